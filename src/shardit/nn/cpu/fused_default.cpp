// fused_kernels.h built for any CPU (at::vec's portable loops); always built.
#include "shardit/nn/cpu/fused_table.h"

#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#define SHARDIT_CAPABILITY_NAME "default"
#include "shardit/nn/cpu/fused_kernels.h"

namespace shardit::nn::cpu {
FusedKernelTable fused_kernels_default() { return make_table(); }
}  // namespace shardit::nn::cpu
