"""Compile the Triton kernels for NVIDIA GPUs on a machine without one:

    python -m pagekv.kernels.triton_check

Triton's interpreter (what the tests run without a GPU) executes a kernel's Python, not its
compilation: a global a GPU build cannot read, a dot's operand types, or tiles that overflow
shared memory pass there and fail on the first GPU. This compiles every launch the runner may
choose, for every cache dtype and the GPUs named in ``ARCHS``, to machine code with Triton's
own compiler (no driver needed), and checks each kernel's shared memory against the GPU's.
Exits non-zero on any failure.
"""

from __future__ import annotations

import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels' module is imported

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagekv.kernels import triton_attention as ta

# compute capability -> shared memory a block may take (bytes)
ARCHS = {80: 166_912, 90: 232_448}
POINTERS = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
# Arguments whose type is not the rule's (any other *_ptr: the caches' dtype; the rest: i32).
TYPES = {
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_ptr": "*i32",
    "slot_ptr": "*i64",
    "scale": "fp32",
    "softcap": "fp32",
}


# 8-bit caches: rows (int8, or e4m3 bits in uint8) and float16 scales beside bf16 activations
EIGHT_BIT = {"int8": "*i8", "fp8": "*u8"}


def signature(fn: object, pointer: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """``fn``'s argument types, read off its parameters: a new argument needs no entry here."""
    types = {}
    for param in fn.params:  # type: ignore[attr-defined]
        if param.is_constexpr:
            types[param.name] = "constexpr"
        else:
            default = pointer if param.name.endswith("_ptr") else "i32"
            types[param.name] = {**TYPES, **(overrides or {})}.get(param.name, default)
    return types


def eight_bit_overrides(kind: str) -> dict[str, str]:
    cache = EIGHT_BIT[kind]
    return {"k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": "*fp16",
            "v_scale_ptr": "*fp16"}  # fmt: skip


def attention_cases() -> list[tuple[str, dict[str, object], ta.Launch]]:
    """(cache dtype, constants, launch): every launch ``Launch.for_step`` picks, decode rows
    (16 a program) and prefill tiles (64), Llama's head sizes, scores capped and not."""
    launches = {ta.DEFAULT_LAUNCH: (16, 64), ta.SHORT_DECODE: (16,), ta.LONG_DECODE: (16,)}
    cases = []
    for dtype, head_dim, softcap in itertools.product(POINTERS, (64, 128), (False, True)):
        if softcap and head_dim == 128:
            continue  # the capped scores' code does not depend on the head size
        for launch, block_ms in launches.items():
            for block_m in block_ms:
                constants: dict[str, object] = {
                    "SOFTCAP": softcap,
                    "FLOAT32_DOTS": False,
                    "PRECISION": ta._precision(getattr(torch, dtype)),
                    "EIGHT_BIT": False,
                    "FP8": False,
                    "GROUP": 4,
                    "HEAD_DIM": head_dim,
                    "BLOCK_D": head_dim,
                    "BLOCK_M": block_m,
                    "BLOCK_N": launch.block_n,
                }
                cases.append((dtype, constants, launch))
    return cases


def _compile(fn: object, signature: dict[str, str], constants: dict[str, object], arch: int,
             launch: ta.Launch) -> int:  # fmt: skip
    """The compiled kernel's shared memory in bytes."""
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return int(kernel.metadata.shared)


def main() -> int:
    failed = total = 0
    for arch, limit in ARCHS.items():
        jobs = [
            (
                ta._paged_attention_kernel,
                signature(ta._paged_attention_kernel, POINTERS[d]),
                c,
                launch,
                d,
            )
            for d, c, launch in attention_cases()
        ]
        jobs += [  # 8-bit caches: widened to float32 as they load (full float32 dots)
            (ta._paged_attention_kernel,
             signature(ta._paged_attention_kernel, POINTERS["bfloat16"], eight_bit_overrides(k)),
             {**c, "EIGHT_BIT": True, "FP8": k == "fp8", "PRECISION": "ieee"}, launch, k)
            for k in EIGHT_BIT
            for d, c, launch in attention_cases()
            if d == "bfloat16"
        ]  # fmt: skip
        jobs += [
            (ta._write_kv_kernel, signature(ta._write_kv_kernel, POINTERS[d]),
             {"WIDTH": 192, "BLOCK": 256}, ta.DEFAULT_LAUNCH, d)
            for d in POINTERS
        ]  # fmt: skip
        for fn, types, constants, launch, dtype in jobs:
            total += 1
            what = f"{fn.__name__} [sm_{arch}, {dtype}, {launch}, {constants}]"
            try:
                shared = _compile(fn, types, constants, arch, launch)
            except Exception as error:  # any compiler error is this check's finding
                failed += 1
                print(f"FAIL {what}\n{error}", file=sys.stderr)
                continue
            fits = shared <= limit
            failed += not fits
            print(f"{'ok  ' if fits else 'FAIL'} {what}: {shared} bytes of shared memory")
    print(f"{total - failed}/{total} Triton compile checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
