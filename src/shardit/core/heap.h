#pragma once
// The C heap's policy for a process that allocates the same large tensors step after step.

namespace shardit {

/// Keeps freed blocks up to 1 GiB in the process for the next allocation (where glibc accepts a
/// threshold that high; 32 MiB where it does not), where glibc would give blocks above its
/// (adaptive) threshold back to the OS at once and fault them in again, page by page, on the next
/// step: a 2 + 4-block FLUX step in bf16 took 65,000 page faults, paid by whichever kernel touched
/// the memory first (a bf16 RMSNorm call: 7.3 ms, against 1.2 ms without the faults); with 32 MiB,
/// the single blocks' 36 MiB `proj_mlp` outputs still took up to 22,000 a step (each 9,217 faults,
/// 8 ms of a 70 ms product). The heap keeps up to 1 GiB free at its top before trimming. Call
/// once, first thing in main; GLIBC_TUNABLES or MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_
/// set by the user win.
void keep_freed_memory_for_reuse();

/// A long-running server's heap: one arena for every thread (glibc's M_ARENA_MAX 1), so that what
/// a burst of connection threads freed is held in the one heap release_freed_memory() trims, not
/// in per-thread arenas whose tops glibc keeps up to the 1 GiB trim threshold above (16 threads'
/// 10 MB request bodies stayed resident as ~700 MB). Call before the server's threads start;
/// MALLOC_ARENA_MAX or a glibc.malloc.arena_max tunable set by the user wins.
void share_one_heap_arena();

/// Gives the pages of every freed block back to the OS (glibc's malloc_trim(0)): what a request
/// (its body, its decoded images, its answer) left freed stops counting in the process's RSS. The
/// next request faults in what it uses again (a generation step's first touch of its blocks).
void release_freed_memory();

}  // namespace shardit
