// Per-step Adam coefficients, derived once in double and shared by all tiers.
#ifndef LZ_ADAM_COEFFS_H_
#define LZ_ADAM_COEFFS_H_

#include <math.h>
#include <stdint.h>

#include "lz_common.h"

namespace lz {

// Everything the inner loop needs, precomputed so every tier runs the same
// sequence of fp32 operations (which keeps tiers interchangeable in tests).
struct AdamCoeffs {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float weight_decay;  // L2 term (Adam mode only; 0 in AdamW mode)
  float decay;         // param multiplier (AdamW mode: 1 - lr*wd; Adam mode: 1)
  float step_size;     // lr / (1 - beta1^step)
  float bc2_sqrt;      // sqrt(1 - beta2^step)
  float inv_grad_scale;
};

inline AdamCoeffs make_adam_coeffs(const lz_adam_hparams& hp, int64_t step, float grad_scale) {
  AdamCoeffs c;
  const double s = (double)step;
  c.beta1 = (float)hp.beta1;
  c.one_minus_beta1 = (float)(1.0 - hp.beta1);
  c.beta2 = (float)hp.beta2;
  c.one_minus_beta2 = (float)(1.0 - hp.beta2);
  c.eps = (float)hp.eps;
  c.weight_decay = hp.adamw_mode ? 0.0f : (float)hp.weight_decay;
  c.decay = hp.adamw_mode ? (float)(1.0 - hp.lr * hp.weight_decay) : 1.0f;
  c.step_size = (float)(hp.lr / (1.0 - pow(hp.beta1, s)));
  c.bc2_sqrt = (float)sqrt(1.0 - pow(hp.beta2, s));
  c.inv_grad_scale = (float)(1.0 / (double)grad_scale);
  return c;
}

}  // namespace lz

#endif  // LZ_ADAM_COEFFS_H_
