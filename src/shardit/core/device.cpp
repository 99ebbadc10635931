#include "shardit/core/device.h"

#include <c10/util/Exception.h>

#if SHARDIT_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace shardit {

void synchronize(const c10::Device& device) {
  if (device.is_cpu()) return;
#if SHARDIT_WITH_CUDA
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard on_device(device);
    c10::cuda::device_synchronize();
    return;
  }
#endif
  TORCH_CHECK(false, "synchronize: ", device, " is not a device this build runs on (cpu",
#if SHARDIT_WITH_CUDA
              ", cuda",
#endif
              ")");
}

}  // namespace shardit
