// C API of the fused CUDA Adam/AdamW step (torch-free; the binding passes pointers).
#ifndef LZ_FUSED_ADAM_H_
#define LZ_FUSED_ADAM_H_

#include <stdint.h>

#include "lz_common.h"

#ifdef __cplusplus
extern "C" {
#endif

// Host arrays of `count` device pointers, one entry per tensor. exp_avg and
// exp_avg_sq have the params' dtype; out16 may be NULL (no 16-bit copies).
// steps[i] points at that tensor's float32 step counter on the device.
typedef struct lz_adam_tensors {
  void* const* params;
  const void* const* grads;
  void* const* exp_avg;
  void* const* exp_avg_sq;
  void* const* out16;
  float* const* steps;
  const int64_t* numel;
  int64_t count;
} lz_adam_tensors;

// One Adam/AdamW step over every tensor, on `stream` of `device`, with no host
// synchronisation. Supported dtypes: fp32 params with fp32/bf16/fp16 grads and
// an optional bf16/fp16 copy-out (out_dtype, -1 for none); bf16 or fp16
// params with grads of the same dtype (math in fp32). grad_scale (nullable,
// device) divides the grads; if *found_inf (nullable, device) is nonzero the
// whole step, step counters included, is a no-op. Steps are incremented on
// the device. Returns a cudaError_t value (0 = success).
int lz_fused_adam(const lz_adam_tensors* tensors, int param_dtype, int grad_dtype, int out_dtype,
                  const lz_adam_hparams* hp, const float* grad_scale, const float* found_inf,
                  int device, void* stream);

const char* lz_fused_adam_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif  // LZ_FUSED_ADAM_H_
