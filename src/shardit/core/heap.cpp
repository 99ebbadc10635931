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
  // 32 MiB is the largest threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

}  // namespace shardit
