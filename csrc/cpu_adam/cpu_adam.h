// C API of the CPU Adam/AdamW step (torch-free; the binding passes pointers).
#ifndef LZ_CPU_ADAM_H_
#define LZ_CPU_ADAM_H_

#include <stdint.h>

#include "lz_common.h"

#ifdef __cplusplus
extern "C" {
#endif

// SIMD tiers, best last. LZ_SIMD_AUTO picks the best the running CPU supports.
enum lz_simd_tier { LZ_SIMD_AUTO = -1, LZ_SIMD_SCALAR = 0, LZ_SIMD_AVX2 = 1, LZ_SIMD_AVX512 = 2 };

// Best tier this CPU (and this build) supports.
int lz_cpu_best_simd(void);

// One Adam/AdamW step over n contiguous elements, in place on params (fp32),
// exp_avg and exp_avg_sq (fp32). grads are read as grad_dtype (lz_dtype) and
// divided by grad_scale. If out16 is non-null the updated params are also
// written to it as out_dtype (LZ_BFLOAT16 or LZ_FLOAT16) in the same pass.
// step is the 1-based step count after this update (for bias correction).
// Returns the SIMD tier used, or -1 if the requested tier is unsupported or a
// dtype code is invalid (nothing is written then).
int lz_cpu_adam_step(float* params, const void* grads, int grad_dtype, float* exp_avg,
                     float* exp_avg_sq, void* out16, int out_dtype, int64_t n,
                     const lz_adam_hparams* hp, int64_t step, float grad_scale, int simd_tier,
                     int num_threads);

#ifdef __cplusplus
}
#endif

#endif  // LZ_CPU_ADAM_H_
