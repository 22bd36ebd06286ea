"""The C++ kernels of the CPU fast path and their Python wrappers.

    csrc/         the sources: one .cpp per library, kernels.h declaring every entry point once
    isa           kernel targets (generic, avx2, avx512, avx512bf16, amx): which runs here
    build         build a library for a target (first use, cached), load it with ctypes
    decode        paged decode attention, the KV write, bf16 argmax      (decode.cpp)
    prefill       attention in tiles: prefill chunks, shared prefixes    (prefill.cpp)
    fused_ops     the layer ops and the packed-weight matmuls, as LayerOps (fused_ops.cpp)
      dense       float32/bf16 weights in stripes or tiles, their matmul (fused_ops.cpp)
      quant       GGUF-quantized weights in stripes, their matmul        (quant.h)
    report        the system-info line: CPU features and the kernels in use

Each wrapper's ``load(target=None)`` returns None (the caller keeps torch ops) where there is no
compiler, the build fails (a warning with the compiler's message), its switch is off, or
``PAGEKV_CPU_ISA=none``. Imports no higher layer than ``pagekv.models.layer_ops``, the protocol
the fused ops implement.
"""
