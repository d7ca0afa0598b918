// C API of the fused CUDA LAMB step (torch-free; the binding passes pointers).
#ifndef LZ_LAMB_H_
#define LZ_LAMB_H_

#include <stdint.h>

#include "lz_common.h"

#ifdef __cplusplus
extern "C" {
#endif

// Same layout as lz_adam_tensors (see csrc/fused_adam/fused_adam.h).
typedef struct lz_lamb_tensors {
  void* const* params;
  const void* const* grads;
  void* const* exp_avg;
  void* const* exp_avg_sq;
  void* const* out16;
  float* const* steps;
  const int64_t* numel;
  int64_t count;
} lz_lamb_tensors;

// Floats of device workspace lz_fused_lamb needs for these tensor sizes.
int64_t lz_fused_lamb_workspace_floats(const int64_t* numel, int64_t count);

// One LAMB step over every tensor with per-tensor trust ratios, no host sync.
// Dtype rules, grad_scale and found_inf as lz_fused_adam. If trust_ratios is
// non-null it receives each tensor's ratio (count floats, device). Returns a
// cudaError_t value (0 = success).
int lz_fused_lamb(const lz_lamb_tensors* tensors, int param_dtype, int grad_dtype, int out_dtype,
                  const lz_lamb_hparams* hp, const float* grad_scale, const float* found_inf, float* workspace,
                  int64_t workspace_floats, float* trust_ratios, int device, void* stream);

const char* lz_fused_lamb_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif  // LZ_LAMB_H_
