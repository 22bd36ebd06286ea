"""The cases that run on the emulated AVX2-only CPU (``test_emulated_cpu.py``), as a pytest plugin.

Each case is a test function and the parameter values it runs with, matched against the
parameters pytest collected (``item.callspec.params``), never against the spelling of a test id:
a new pytest may order or join ids differently and the run stays the same. A case that matches
no collected test, or more than one (a test renamed, a parameter gone or widened), stops the run
with an error instead of shrinking it.

Loaded with ``-p tests.kernels.emulated_cases``, the plugin keeps only these cases, each on the
``avx2`` kernel target, and deselects the rest of the files it is given (``FILES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from gguf.constants import GGMLQuantizationType as QT

TARGET = "avx2"


@dataclass(frozen=True)
class Case:
    """One test (``file::function``, the file relative to the repository root) and the values of
    the parameters that pick one of its cases; ``kernel_target`` is always ``TARGET``."""

    test: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def file(self) -> str:
        return self.test.split("::")[0]

    def matches(self, item: pytest.Item) -> bool:
        file, function = self.test.split("::")
        if not str(item.path).endswith(file) or getattr(item, "originalname", None) != function:
            return False
        given = item.callspec.params if hasattr(item, "callspec") else {}
        wanted = {"kernel_target": TARGET, **self.params}
        return all(name in given and given[name] == value for name, value in wanted.items())


ATTENTION = "tests/kernels/test_attention_fast.py::"
FUSED = "tests/kernels/test_fused_ops.py::"
QUANTIZED = "tests/kernels/test_quantized.py::"
FAMILIES = "tests/models/test_families.py::"
F32, BF16 = torch.float32, torch.bfloat16
DEFAULT_HEADS = (9, 3)  # the default model's query and KV heads

# One or a few cases of each kernel of the avx2 target, small shapes: decode and prefill
# attention, float32, bf16 and GGUF matmul stripes, int8 dot products, the layer halves in one
# call, the elementwise ops; then the engine's greedy tokens against transformers' float32 ones
# on tiny random models of two families, Phi-3 (its layers in one C call) and Qwen3 (op by op).
CASES = (
    *(
        Case(
            ATTENTION + "test_kernel_matches_torch_decode",
            {"heads": DEFAULT_HEADS, "head_dim": 64, "dtype": dtype},
        )
        for dtype in (F32, BF16)
    ),
    Case(
        ATTENTION + "test_threads_sharing_a_sequence_change_no_bit",
        {"query_lens": [1], "seq_lens": [333], "heads": DEFAULT_HEADS, "dtype": F32},
    ),
    Case(
        ATTENTION + "test_prefill_kernel_matches_float32_attention",
        {"bf16_prefill_unit": "float32 vectors", "heads": DEFAULT_HEADS, "block_size": 16},
    ),
    *(
        Case(
            FUSED + "test_float32_stripes_are_within_float32_rounding_and_batch_invariant",
            {"shape": (64, 96), "rows": rows},
        )
        for rows in (1, 7, 300)
    ),
    Case(
        FUSED + "test_bf16_stripes_are_float32_sums_rounded_once_and_batch_invariant",
        {"shape": (960, 576), "rows": 7},
    ),
    *(
        Case(
            FUSED + "test_layer_halves_in_one_call_are_the_ops_one_by_one",
            {"first": False, "rows": 5, "dtype": dtype},
        )
        for dtype in (F32, BF16)
    ),
    Case(FUSED + "test_rms_norm", {"num_tokens": 64, "dtype": F32}),
    Case(FUSED + "test_silu_mul", {"num_tokens": 64, "dtype": F32}),
    Case(FUSED + "test_split_rope_is_exact", {"heads": (9, 3, 64), "num_tokens": 64, "dtype": F32}),
    Case(QUANTIZED + "test_quantized_matmul_matches_the_dequantized_weights", {"qtype": QT.Q4_1}),
    Case(QUANTIZED + "test_quantized_matmul_matches_the_dequantized_weights", {"qtype": QT.Q6_K}),
    Case(QUANTIZED + "test_int8_activations_are_the_rounded_rows_product", {"qtype": QT.Q4_1}),
    Case(FAMILIES + "test_greedy_equals_transformers_on_every_kernel_target", {"family": "phi3"}),
    Case(FAMILIES + "test_greedy_equals_transformers_on_every_kernel_target", {"family": "qwen3"}),
)
FILES = tuple(dict.fromkeys(case.file for case in CASES))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = [(case, [item for item in items if case.matches(item)]) for case in CASES]
    wrong = [
        f"{case.test} {case.params} ({len(found)} found)"
        for case, found in chosen
        if len(found) != 1
    ]
    if wrong:
        raise pytest.UsageError(
            "emulated cases that do not name exactly one collected test: " + "; ".join(wrong)
        )
    keep = {id(found[0]) for _, found in chosen}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in keep])
    items[:] = [item for item in items if id(item) in keep]
