#include "shardit/core/heap.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace shardit {

void keep_freed_memory_for_reuse() {
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const bool user_set = (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) ||
                        std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
                        std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr;
  if (user_set) return;
  // Blocks up to 1 GiB from the heap; a glibc that refuses a threshold that high (older ones cap
  // it at 32 MiB on 64-bit, DEFAULT_MMAP_THRESHOLD_MAX) gets its largest.
  constexpr int kLargestKept = 1 << 30;
  if (mallopt(M_MMAP_THRESHOLD, kLargestKept) == 0) mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, kLargestKept);
#endif
}

void share_one_heap_arena() {
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if ((tunables != nullptr && std::strstr(tunables, "glibc.malloc.arena_max") != nullptr) ||
      std::getenv("MALLOC_ARENA_MAX") != nullptr) {
    return;
  }
  mallopt(M_ARENA_MAX, 1);
#endif
}

void release_freed_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace shardit
