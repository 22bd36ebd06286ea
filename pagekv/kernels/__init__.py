"""The C++ kernels of the CPU fast path and their Python wrappers.

    csrc/         the sources: one .cpp per library (its entry points), the headers it is made
                  of, kernels.h declaring every entry point and struct once; csrc/arch/ one
                  header per target with its instruction-set bodies (arch/target.h)
    isa           kernel targets (generic, avx2, avx512, avx512bf16, amx): which runs here
    build         build a library for a target (first use, cached), load it with ctypes
    abi           the structs that cross by address, mirrored from kernels.h as ctypes
    check         compile-check every library for every target (make lint)
    decode        paged decode attention, the KV write, bf16 argmax      (decode.cpp)
    prefill       prefill chunks; in tiles, shared prefixes and drafts   (prefill.cpp)
    fused_ops     the layer ops and the packed-weight matmuls, as LayerOps (fused_ops.cpp)
      row_ops     RMSNorm(+residual), RoPE+split, SiLU x up on rows      (fused_ops.cpp)
      dense       float32/bf16 weights in stripes or tiles, their matmul (fused_ops.cpp)
      quant       GGUF-quantized weights in stripes, their matmul        (quant_matmul.h)
      layer_stack a decode step's layers in one C call                   (layer_stack.h)
    report        the system-info line: CPU features and the kernels in use
    triton_attention, triton_check   the GPU runner's Triton kernels and their compile check

The words stripe, tile, run, unit, half, stack and cascade: docs/glossary.md.

Each wrapper's ``load(target=None)`` returns None (the caller keeps torch ops) where there is no
compiler, the build fails (a warning with the compiler's message), its switch is off, or
``PAGEKV_CPU_ISA=none``. Imports no higher layer than ``pagekv.models.layer_ops``, the protocol
the fused ops implement.
"""
