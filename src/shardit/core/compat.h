#pragma once
// The one place where LibTorch version differences are spelled out. Code elsewhere tests these
// macros instead of TORCH_VERSION_* directly.
#include <torch/version.h>

/// at::scaled_dot_product_attention exists from LibTorch 2.0 on.
#if TORCH_VERSION_MAJOR >= 2
#define SHARDIT_HAS_SDPA 1
#else
#define SHARDIT_HAS_SDPA 0
#endif

/// c10d split ProcessGroup (front) from Backend (Gloo, NCCL) in LibTorch 2.0.
#if TORCH_VERSION_MAJOR >= 2
#define SHARDIT_C10D_HAS_BACKEND 1
#else
#define SHARDIT_C10D_HAS_BACKEND 0
#endif

/// Float8 scalar types (Float8_e4m3fn, Float8_e5m2) exist from LibTorch 2.1 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define SHARDIT_HAS_FLOAT8 1
#else
#define SHARDIT_HAS_FLOAT8 0
#endif
