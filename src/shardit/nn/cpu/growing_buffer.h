#pragma once
// Per-thread scratch of the AMX kernels (nn/cpu/amx_gemm.cpp, nn/cpu/bf16_attention.cpp).
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace shardit::nn::cpu {

/// A 64-byte aligned buffer that keeps its largest size: one per thread and use, so a step's
/// calls reuse the same pages instead of mapping a fresh block (and faulting it in) each call.
class GrowingBuffer {
 public:
  /// At least `bytes`; `what` names the buffer in the error when memory runs out.
  void* get(size_t bytes, const char* what) {
    if (bytes > capacity_) {
      storage_.reset(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
      if (storage_ == nullptr) capacity_ = 0;
      TORCH_CHECK(storage_ != nullptr, what, ": could not allocate ", bytes, " bytes of scratch");
      capacity_ = bytes;
    }
    return storage_.get();
  }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> storage_;
  size_t capacity_ = 0;
};

}  // namespace shardit::nn::cpu
