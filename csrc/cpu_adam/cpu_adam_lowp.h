// C API of the low-precision host Adam/AdamW steps (torch-free; the binding passes pointers).
//
// Two layouts beside cpu_adam.h's fp32 one (the reasoning is in
// lightning_zero/optim/host_states.py, [Note: host state precisions]):
//   bf16:  master, exp_avg, exp_avg_sq in bf16 (6 B/param); every write stochastically
//          rounded with bits from a hash of (seed, step, offset + i), so any split of a
//          buffer into calls or threads gives the same bits. With `comp` non-null the master
//          is instead Kahan-compensated (bf16 master + bf16 compensation, rounded to nearest);
//          the moments stay stochastically rounded.
//   int8:  fp32 master; exp_avg as sign+E4M3 codes and sqrt(exp_avg_sq) as E4M4 codes, one
//          fp32 scale per block of `block` elements each (see lowp_codes.h).
// Both compute in fp32 in the order of cpu_adam's scalar tier (except sqrt(v) * (1 / sqrt(1 - beta2^t))
// where cpu_adam divides by sqrt(1 - beta2^t): one division per element fewer), read grads as grad_dtype divided
// by grad_scale, and write the updated master into out16 (bf16/fp16) in the same pass when
// out16 is non-null. Each returns the SIMD tier used, or -1 on an invalid argument (nothing is
// written then).
#ifndef LZ_CPU_ADAM_LOWP_H_
#define LZ_CPU_ADAM_LOWP_H_

#include <stdint.h>

#include "lz_common.h"

#ifdef __cplusplus
extern "C" {
#endif

// Best SIMD tier this CPU supports (0 scalar, 1 AVX2, 2 AVX-512), as in cpu_adam.h.
int lz_lowp_best_simd(void);

int lz_cpu_adam_bf16_step(uint16_t* params, uint16_t* comp, const void* grads, int grad_dtype,
                          uint16_t* exp_avg, uint16_t* exp_avg_sq, void* out16, int out_dtype,
                          int64_t n, const lz_adam_hparams* hp, int64_t step, float grad_scale,
                          uint32_t seed, int64_t offset, int simd_tier, int num_threads);

// n elements in ceil(n / block) blocks; scales hold one float per block.
int lz_cpu_adam_int8_step(float* params, const void* grads, int grad_dtype, uint8_t* exp_avg_codes,
                          float* exp_avg_scales, uint8_t* exp_avg_sq_codes, float* exp_avg_sq_scales,
                          void* out16, int out_dtype, int64_t n, int64_t block,
                          const lz_adam_hparams* hp, int64_t step, float grad_scale, int simd_tier,
                          int num_threads);

#ifdef __cplusplus
}
#endif

#endif  // LZ_CPU_ADAM_LOWP_H_
