#pragma once
// The one place where LibTorch version differences are spelled out. Code elsewhere tests these
// macros instead of TORCH_VERSION_* directly.
#include <torch/version.h>

#include <cstddef>
#include <cstdint>

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

/// c10::Allocator::allocate is a const member before LibTorch 2.3 and a non-const one from 2.3 on,
/// which also adds the pure virtual copy_data: an allocator of ours declares
/// `allocate(size_t n) SHARDIT_ALLOCATE_CONST override`, and copy_data where
/// SHARDIT_ALLOCATOR_HAS_COPY_DATA.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define SHARDIT_ALLOCATE_CONST
#define SHARDIT_ALLOCATOR_HAS_COPY_DATA 1
#else
#define SHARDIT_ALLOCATE_CONST const
#define SHARDIT_ALLOCATOR_HAS_COPY_DATA 0
#endif

namespace shardit::compat {

/// The type of the running totals (total_allocated, total_reserved) that
/// c10::MemoryReportingInfoBase::reportMemoryUsage receives: int64_t in LibTorch 1.x, size_t in
/// 2.x.
#if TORCH_VERSION_MAJOR >= 2
using MemoryReportTotal = std::size_t;
#else
using MemoryReportTotal = int64_t;
#endif

}  // namespace shardit::compat
