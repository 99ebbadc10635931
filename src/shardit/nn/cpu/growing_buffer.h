#pragma once
// Per-thread scratch of the AMX and AVX512-BF16 kernels (nn/cpu/amx_gemm.cpp, nn/cpu/bf16_attention.cpp).
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace shardit::nn::cpu {

/// A 64-byte aligned buffer that keeps its size between calls: one per thread and use, so a
/// step's calls reuse the same pages instead of mapping a fresh block (and faulting it in) each
/// call. It keeps at most kMaxKeptBytes: a larger request gets a block of its own, which the next
/// request within the bound gives back, so one outsized call does not hold its memory for the
/// life of the thread (the FLUX-width kernels ask for a few MiB).
class GrowingBuffer {
 public:
  static constexpr size_t kMaxKeptBytes = size_t{64} << 20;

  /// At least `bytes`, valid until the next get(); `what` names the buffer in the error when
  /// memory runs out.
  void* get(size_t bytes, const char* what) {
    const bool trim = capacity_ > kMaxKeptBytes && bytes <= kMaxKeptBytes;
    if (bytes > capacity_ || trim) {
      storage_.reset();
      capacity_ = 0;
      const size_t rounded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;  // aligned_alloc takes multiples of 64
      storage_.reset(static_cast<char*>(std::aligned_alloc(64, rounded)));
      TORCH_CHECK(storage_ != nullptr, what, ": could not allocate ", bytes, " bytes of scratch");
      capacity_ = bytes;
    }
    return storage_.get();
  }

  size_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> storage_;
  size_t capacity_ = 0;
};

}  // namespace shardit::nn::cpu
