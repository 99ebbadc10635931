#pragma once
// The polynomials behind the fused kernels' and the bf16 kernels' 2^t (avx512_math.h and the AVX2
// build in fused_kernels.h), in one place so that every instruction set computes the same values:
// 2^f = 1 + f q(f) on |f| <= 1/2 (exactly 1 at f = 0), q(f) = (2^f - 1) / f, coefficients highest
// power first.

namespace shardit::nn::cpu {

/// Degree 6 (relative error 2e-9, under the float's own rounding): the softmax weights.
constexpr float kExp2Degree6[6] = {1.5353361959569156e-4f, 1.3398875016719103e-3f, 9.61843691766262e-3f,
                                   5.5503323674201965e-2f, 2.4022647738456726e-1f, 6.931471824645996e-1f};

/// Degree 4 (relative error 3e-6, far under a bf16 result's rounding, 4e-3): the GELU's 1 / (1 + 2^t).
constexpr float kExp2Degree4[4] = {9.582852944731712e-3f, 5.5906426161527634e-2f, 2.4024099111557007e-1f,
                                   6.931241750717163e-1f};

}  // namespace shardit::nn::cpu
