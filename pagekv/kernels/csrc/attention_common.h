// Shared by the attention kernels (decode.cpp, prefill.cpp): the vector layer (with bf16.h's
// numbers one at a time) and the head sizes they are built for (with_head_dim).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "vec.h"

// f(std::integral_constant<int, D>{}) for D == head_dim, one of PAGEKV_HEAD_DIMS: each kernel
// is a template on D, and this is where a call picks its instance. 0, or -1 (f not called)
// for another head size.
template <typename F>
static inline int with_head_dim(int head_dim, F&& f) {
    switch (head_dim) {
#define PAGEKV_HEAD_DIM_CASE(D)              \
    case D:                                  \
        f(std::integral_constant<int, D>{}); \
        return 0;
        PAGEKV_HEAD_DIMS(PAGEKV_HEAD_DIM_CASE)
#undef PAGEKV_HEAD_DIM_CASE
        default:
            return -1;
    }
}

static inline bool takes_head_dim(int head_dim) {
    return with_head_dim(head_dim, [](auto) {}) == 0;
}
