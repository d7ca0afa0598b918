// Low-precision host Adam/AdamW steps (bf16 stochastic rounding, bf16 Kahan, int8 blockwise):
// OpenMP over contiguous slices, one auto-vectorised SIMD tier per call.
//
// Torch-free like cpu_adam.cpp. Must be compiled with -ffp-contract=off (the builder adds
// it): a fused multiply-add rounds once where the pure-torch reference rounds twice, and the
// two are tested bit for bit.
#include "cpu_adam_lowp.h"

#include <math.h>
#include <stdint.h>

#include "adam_coeffs.h"
#include "lowp_codes.h"
#include "lz_half_cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#define LZ_LOWP_X86 1
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// Elements per inner chunk (stack buffers of this many floats); also the largest int8 block.
constexpr int64_t kChunk = 1024;
// Below this many elements the fork/join costs more than it saves.
constexpr int64_t kMinParallel = 1 << 15;
// bf16 slice boundaries: multiples of 64 elements (128 B of each 16-bit buffer).
constexpr int64_t kSliceAlign = 64;

struct LowpArgs {
  lz::AdamCoeffs c;
  const void* grads;
  int grad_dtype;
  void* out16;
  int out_dtype;
  int64_t n;
  // bf16 layouts
  uint16_t* p16;
  uint16_t* comp;
  uint16_t* m16;
  uint16_t* v16;
  uint32_t key;
  int64_t offset;
  float lr_wd;    // lr * weight_decay in AdamW mode (Kahan's delta), 0 in Adam mode
  float inv_bc2;  // 1 / sqrt(1 - beta2^step): sqrt(v) * inv_bc2 spares a division (DeepSpeed's CPU Adam does the same)
  // int8 layout
  float* p32;
  uint8_t* mq;
  float* ms;
  uint8_t* vq;
  float* vs;
  int64_t block;
};

}  // namespace

#define LZ_LOWP_NS lz_lowp_scalar
#define LZ_LOWP_TARGET
#include "lowp_kernels.inc"
#undef LZ_LOWP_NS
#undef LZ_LOWP_TARGET

#ifdef LZ_LOWP_X86
#define LZ_LOWP_F16C 1
#define LZ_LOWP_NS lz_lowp_avx2
#define LZ_LOWP_TARGET __attribute__((target("avx2,fma,f16c")))
#include "lowp_kernels.inc"
#undef LZ_LOWP_NS
#undef LZ_LOWP_TARGET
#define LZ_LOWP_NS lz_lowp_avx512
#define LZ_LOWP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#include "lowp_kernels.inc"
#undef LZ_LOWP_NS
#undef LZ_LOWP_TARGET
#undef LZ_LOWP_F16C
#endif

namespace {

using RangeFn = void (*)(const LowpArgs&, int64_t, int64_t);

bool cpu_supports(int tier) {
#ifdef LZ_LOWP_X86
  __builtin_cpu_init();
  if (tier == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (tier == 1)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#endif
  return tier == 0;
}

int best_tier() {
  if (cpu_supports(2)) return 2;
  if (cpu_supports(1)) return 1;
  return 0;
}

RangeFn pick(bool int8, int tier) {
#ifdef LZ_LOWP_X86
  if (tier == 2) return int8 ? &lz_lowp_avx512::int8_range : &lz_lowp_avx512::bf16_range;
  if (tier == 1) return int8 ? &lz_lowp_avx2::int8_range : &lz_lowp_avx2::bf16_range;
#endif
  (void)tier;
  return int8 ? &lz_lowp_scalar::int8_range : &lz_lowp_scalar::bf16_range;
}

// Checks shared by both entry points; fills the common fields. Returns the tier or -1.
int prepare(LowpArgs& a, const void* grads, int grad_dtype, void* out16, int out_dtype, int64_t n,
            const lz_adam_hparams* hp, int64_t step, float grad_scale, int simd_tier) {
  const int tier = simd_tier < 0 ? best_tier() : simd_tier;
  if (!cpu_supports(tier)) return -1;
  if (grad_dtype != LZ_FLOAT32 && grad_dtype != LZ_BFLOAT16 && grad_dtype != LZ_FLOAT16) return -1;
  if (out16 != nullptr && out_dtype != LZ_BFLOAT16 && out_dtype != LZ_FLOAT16) return -1;
  if (step < 1 || n < 0) return -1;
  a.c = lz::make_adam_coeffs(*hp, step, grad_scale);
  a.grads = grads;
  a.grad_dtype = grad_dtype;
  a.out16 = out16;
  a.out_dtype = out_dtype;
  a.n = n;
  a.lr_wd = hp->adamw_mode ? (float)(hp->lr * hp->weight_decay) : 0.0f;
  a.inv_bc2 = (float)(1.0 / sqrt(1.0 - pow(hp->beta2, (double)step)));
  return tier;
}

// Runs fn over [0, units) split into aligned per-thread slices (units: elements or blocks).
void run_parallel(RangeFn fn, const LowpArgs& a, int64_t units, int64_t align, int64_t elems_per_unit,
                  int num_threads) {
#ifdef _OPENMP
  int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (units * elems_per_unit < kMinParallel) threads = 1;
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      int64_t per = (units + nt - 1) / nt;
      per = (per + align - 1) / align * align;
      const int64_t begin = t * per < units ? t * per : units;
      const int64_t end = begin + per < units ? begin + per : units;
      if (begin < end) fn(a, begin, end);
    }
    return;
  }
#else
  (void)num_threads;
  (void)elems_per_unit;
#endif
  fn(a, 0, units);
}

}  // namespace

extern "C" int lz_lowp_best_simd(void) { return best_tier(); }

extern "C" int lz_cpu_adam_bf16_step(uint16_t* params, uint16_t* comp, const void* grads, int grad_dtype,
                                     uint16_t* exp_avg, uint16_t* exp_avg_sq, void* out16, int out_dtype,
                                     int64_t n, const lz_adam_hparams* hp, int64_t step, float grad_scale,
                                     uint32_t seed, int64_t offset, int simd_tier, int num_threads) {
  LowpArgs a{};
  const int tier = prepare(a, grads, grad_dtype, out16, out_dtype, n, hp, step, grad_scale, simd_tier);
  if (tier < 0 || offset < 0) return -1;
  a.p16 = params;
  a.comp = comp;
  a.m16 = exp_avg;
  a.v16 = exp_avg_sq;
  a.key = lz::lowp::sr_key(seed, step);
  a.offset = offset;
  if (n > 0) run_parallel(pick(false, tier), a, n, kSliceAlign, 1, num_threads);
  return tier;
}

extern "C" int lz_cpu_adam_int8_step(float* params, const void* grads, int grad_dtype, uint8_t* exp_avg_codes,
                                     float* exp_avg_scales, uint8_t* exp_avg_sq_codes, float* exp_avg_sq_scales,
                                     void* out16, int out_dtype, int64_t n, int64_t block,
                                     const lz_adam_hparams* hp, int64_t step, float grad_scale, int simd_tier,
                                     int num_threads) {
  LowpArgs a{};
  const int tier = prepare(a, grads, grad_dtype, out16, out_dtype, n, hp, step, grad_scale, simd_tier);
  if (tier < 0 || block < 1 || block > kChunk) return -1;
  a.p32 = params;
  a.mq = exp_avg_codes;
  a.ms = exp_avg_scales;
  a.vq = exp_avg_sq_codes;
  a.vs = exp_avg_sq_scales;
  a.block = block;
  const int64_t blocks = (n + block - 1) / block;
  if (n > 0) run_parallel(pick(true, tier), a, blocks, 1, block, num_threads);
  return tier;
}
