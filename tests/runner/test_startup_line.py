"""The start-up line names the attention path that runs for the loaded model, not the default
model's: tiny Llamas of head_dim 64 and 128 (the kernels' sizes) and 96 (none of theirs), each
prefilled once, with the prefill kernel and the SDPA fallback watched."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagekv import SamplingParams
from pagekv.models import load_model
from tests.engine.test_engine_golden import make_llm
from tests.models.test_families import _reference_model, _save, count_attention_paths

pytest.importorskip("transformers")


@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_the_line_names_the_prefill_path_that_runs(
    head_dim: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads = 2 if head_dim == 96 else 256 // head_dim
    reference = _reference_model(
        "LlamaConfig",
        hidden_size=256,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
    )
    loaded = load_model(str(_save(reference, tmp_path)))
    assert loaded.config.head_dim == head_dim
    llm = make_llm(loaded, block_size=16, num_kv_blocks=64)
    line = llm.engine.system_line
    assert f"float32, head_dim {head_dim}:" in line, line

    calls = count_attention_paths(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], params, use_tqdm=False)

    prefills = {path.removeprefix("prefill "): n for path, n in calls.items() if "prefill" in path}
    assert len(prefills) == 1, calls  # one path took every prefill of the step
    (ran,) = prefills
    assert f"prefill attention {ran}," in line, (calls, line)
    if (
        getattr(llm.engine.runner.backend, "prefill_kernel", None) is not None
    ):  # the kernels' sizes, and one not theirs
        assert ran == ("SDPA" if head_dim == 96 else "C++")
