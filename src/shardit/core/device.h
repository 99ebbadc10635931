#pragma once
// Waiting for a device: kernels on a CUDA device run after the call that queued them returns, so
// whoever reads a clock around device work (the bench) waits for the device first.
#include <c10/core/Device.h>

namespace shardit {

/// Returns once every kernel queued on `device` has finished; at once on the CPU, whose work is
/// done when the call that did it returns.
void synchronize(const c10::Device& device);

}  // namespace shardit
