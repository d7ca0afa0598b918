// AVX2 tier of the CPU Adam step (8 fp32 lanes; the tail goes through a small
// stack buffer because AVX2 has no masked 16-bit loads).
#ifndef LZ_ADAM_AVX2_H_
#define LZ_ADAM_AVX2_H_

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "adam_coeffs.h"
#include "lz_common.h"

#define LZ_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace lz {
namespace avx2 {

template <int G>
LZ_TARGET_AVX2 inline __m256 load_grad(const void* g, int64_t i) {
  if constexpr (G == LZ_FLOAT32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == LZ_BFLOAT16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Round-to-nearest-even fp32 -> bf16 with canonical NaN (matches torch).
LZ_TARGET_AVX2 inline __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Values are < 2^16, so the signed->unsigned saturating pack is exact.
  const __m256i packed = _mm256_packus_epi32(r, r);  // [r0-3 r0-3 | r4-7 r4-7]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <int O>
LZ_TARGET_AVX2 inline void store_out(void* out, int64_t i, __m256 x) {
  __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (O == LZ_BFLOAT16) _mm_storeu_si128(dst, to_bf16(x));
  if constexpr (O == LZ_FLOAT16) _mm_storeu_si128(dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

template <int G, int O>
LZ_TARGET_AVX2 inline void adam_block8(float* p, const void* g, float* m, float* v, void* out,
                                       int64_t i, const AdamCoeffs& c) {
  const __m256 p0 = _mm256_loadu_ps(p + i);
  __m256 grad = _mm256_mul_ps(load_grad<G>(g, i), _mm256_set1_ps(c.inv_grad_scale));
  if (c.weight_decay != 0.0f) grad = _mm256_fmadd_ps(_mm256_set1_ps(c.weight_decay), p0, grad);  // Adam's L2 only
  __m256 mi = _mm256_loadu_ps(m + i);
  __m256 vi = _mm256_loadu_ps(v + i);
  mi = _mm256_fmadd_ps(_mm256_set1_ps(c.beta1), mi, _mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta1), grad));
  vi = _mm256_fmadd_ps(_mm256_set1_ps(c.beta2), vi,
                       _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta2), grad), grad));
  const __m256 denom =
      _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(c.bc2_sqrt)), _mm256_set1_ps(c.eps));
  const __m256 param = _mm256_fnmadd_ps(_mm256_set1_ps(c.step_size), _mm256_div_ps(mi, denom),
                                        _mm256_mul_ps(p0, _mm256_set1_ps(c.decay)));
  _mm256_storeu_ps(m + i, mi);
  _mm256_storeu_ps(v + i, vi);
  _mm256_storeu_ps(p + i, param);
  store_out<O>(out, i, param);
}

template <int G, int O>
LZ_TARGET_AVX2 void adam_range(float* p, const void* g, float* m, float* v, void* out,
                               int64_t begin, int64_t end, const AdamCoeffs& c) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) adam_block8<G, O>(p, g, m, v, out, i, c);
  if (i == end) return;
  // Tail: run the same vector code on zero-padded copies, write back the valid part.
  const int64_t rem = end - i;
  const size_t gsize = (G == LZ_FLOAT32) ? 4 : 2;
  float tp[8] = {0}, tm[8] = {0}, tv[8] = {0}, tg[8] = {0};
  uint16_t to[8] = {0};
  memcpy(tp, p + i, rem * 4);
  memcpy(tm, m + i, rem * 4);
  memcpy(tv, v + i, rem * 4);
  memcpy(tg, static_cast<const char*>(g) + i * gsize, rem * gsize);
  adam_block8<G, O>(tp, tg, tm, tv, to, 0, c);
  memcpy(p + i, tp, rem * 4);
  memcpy(m + i, tm, rem * 4);
  memcpy(v + i, tv, rem * 4);
  if (O >= 0) memcpy(static_cast<uint16_t*>(out) + i, to, rem * 2);
}

}  // namespace avx2
}  // namespace lz

#endif  // x86
#endif  // LZ_ADAM_AVX2_H_
