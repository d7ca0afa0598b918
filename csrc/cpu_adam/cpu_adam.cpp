// CPU Adam/AdamW step: OpenMP over contiguous slices, one SIMD tier per call.
//
// Torch-free on purpose: the binding hands raw pointers, so this file can be
// compiled and tested alone (tests/ops builds it with plain g++ per tier).
// Memory traffic is the whole cost (28 bytes per parameter with bf16 grads in
// and a bf16 copy out), so the loop is a single pass and threads get large
// contiguous slices aligned to cache lines.
#include "cpu_adam.h"

#include <stdint.h>

// GCC 12 warns about its own intrinsics headers (`__Y = __Y` idiom).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include "adam_avx2.h"
#include "adam_avx512.h"
#include "adam_coeffs.h"
#include "adam_scalar.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int kNoOut = -1;
// Below this many elements the fork/join costs more than it saves.
constexpr int64_t kMinParallel = 1 << 15;
// Slice boundaries are multiples of this, so no two threads share a cache line
// of params/states (64 B = 16 fp32) or of the 16-bit copy (64 B = 32 halves).
constexpr int64_t kSliceAlign = 64;

bool cpu_supports(int tier) {
#if defined(LZ_HAVE_X86)
  __builtin_cpu_init();
  if (tier == LZ_SIMD_AVX512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (tier == LZ_SIMD_AVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#endif
  return tier == LZ_SIMD_SCALAR;
}

using RangeFn = void (*)(float*, const void*, float*, float*, void*, int64_t, int64_t,
                         const lz::AdamCoeffs&);

template <int G, int O>
RangeFn pick_range(int tier) {
#if defined(LZ_HAVE_X86)
  if (tier == LZ_SIMD_AVX512) return &lz::avx512::adam_range<G, O>;
  if (tier == LZ_SIMD_AVX2) return &lz::avx2::adam_range<G, O>;
#endif
  (void)tier;
  return &lz::adam_range_scalar<G, O>;
}

template <int G>
RangeFn pick_out(int out_dtype, int tier) {
  if (out_dtype == LZ_BFLOAT16) return pick_range<G, LZ_BFLOAT16>(tier);
  if (out_dtype == LZ_FLOAT16) return pick_range<G, LZ_FLOAT16>(tier);
  return pick_range<G, kNoOut>(tier);
}

RangeFn pick(int grad_dtype, int out_dtype, int tier) {
  if (grad_dtype == LZ_FLOAT32) return pick_out<LZ_FLOAT32>(out_dtype, tier);
  if (grad_dtype == LZ_BFLOAT16) return pick_out<LZ_BFLOAT16>(out_dtype, tier);
  return pick_out<LZ_FLOAT16>(out_dtype, tier);
}

}  // namespace

extern "C" int lz_cpu_best_simd(void) {
  if (cpu_supports(LZ_SIMD_AVX512)) return LZ_SIMD_AVX512;
  if (cpu_supports(LZ_SIMD_AVX2)) return LZ_SIMD_AVX2;
  return LZ_SIMD_SCALAR;
}

extern "C" int lz_cpu_adam_step(float* params, const void* grads, int grad_dtype, float* exp_avg,
                                float* exp_avg_sq, void* out16, int out_dtype, int64_t n,
                                const lz_adam_hparams* hp, int64_t step, float grad_scale,
                                int simd_tier, int num_threads) {
  const int tier = simd_tier == LZ_SIMD_AUTO ? lz_cpu_best_simd() : simd_tier;
  if (!cpu_supports(tier)) return -1;
  if (grad_dtype != LZ_FLOAT32 && grad_dtype != LZ_BFLOAT16 && grad_dtype != LZ_FLOAT16) return -1;
  if (out16 == nullptr) out_dtype = kNoOut;
  if (out16 != nullptr && out_dtype != LZ_BFLOAT16 && out_dtype != LZ_FLOAT16) return -1;
  if (n <= 0) return tier;

  const lz::AdamCoeffs c = lz::make_adam_coeffs(*hp, step, grad_scale);
  const RangeFn fn = pick(grad_dtype, out_dtype, tier);

#ifdef _OPENMP
  int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (n < kMinParallel) threads = 1;
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      int64_t per = (n + nt - 1) / nt;
      per = (per + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
      const int64_t begin = t * per < n ? t * per : n;
      const int64_t end = begin + per < n ? begin + per : n;
      if (begin < end) fn(params, grads, exp_avg, exp_avg_sq, out16, begin, end, c);
    }
    return tier;
  }
#else
  (void)num_threads;
#endif
  fn(params, grads, exp_avg, exp_avg_sq, out16, 0, n, c);
  return tier;
}
