// Scalar tier of the CPU Adam step: runs anywhere, and is the tail of no one
// (vector tiers handle their own tails), so it is also the portable reference.
#ifndef LZ_ADAM_SCALAR_H_
#define LZ_ADAM_SCALAR_H_

#include <math.h>
#include <stdint.h>

#include "adam_coeffs.h"
#include "lz_common.h"
#include "lz_half_cpu.h"

namespace lz {

template <int G>
inline float load_grad_scalar(const void* g, int64_t i) {
  if (G == LZ_FLOAT32) return static_cast<const float*>(g)[i];
  if (G == LZ_BFLOAT16) return lz_bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return lz_f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

// O is LZ_BFLOAT16, LZ_FLOAT16, or -1 for "no 16-bit copy".
template <int O>
inline void store_out_scalar(void* out, int64_t i, float x) {
  if (O == LZ_BFLOAT16) static_cast<uint16_t*>(out)[i] = lz_f32_to_bf16(x);
  if (O == LZ_FLOAT16) static_cast<uint16_t*>(out)[i] = lz_f32_to_f16(x);
}

template <int G, int O>
void adam_range_scalar(float* p, const void* g, float* m, float* v, void* out, int64_t begin,
                       int64_t end, const AdamCoeffs& c) {
  for (int64_t i = begin; i < end; ++i) {
    float grad = load_grad_scalar<G>(g, i) * c.inv_grad_scale;
    float param = p[i] * c.decay;
    if (c.weight_decay != 0.0f) grad = grad + c.weight_decay * p[i];  // Adam's L2 only
    const float mi = c.beta1 * m[i] + c.one_minus_beta1 * grad;
    const float vi = c.beta2 * v[i] + c.one_minus_beta2 * grad * grad;
    const float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
    param = param - c.step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
    store_out_scalar<O>(out, i, param);
  }
}

}  // namespace lz

#endif  // LZ_ADAM_SCALAR_H_
