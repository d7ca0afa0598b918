// AVX-512 tier of the CPU Adam step (16 fp32 lanes, masked tail).
//
// Compiled with a function-level target attribute rather than -march flags so
// one binary carries every tier and picks at run time: a JIT cache shared by
// machines of different CPU generations can then never SIGILL.
#ifndef LZ_ADAM_AVX512_H_
#define LZ_ADAM_AVX512_H_

#if defined(__x86_64__) || defined(_M_X64)
#define LZ_HAVE_X86 1
#include <immintrin.h>
#include <stdint.h>

#include "adam_coeffs.h"
#include "lz_common.h"

#define LZ_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

namespace lz {
namespace avx512 {

template <int G>
LZ_TARGET_AVX512 inline __m512 load_grad(const void* g, int64_t i, __mmask16 k) {
  if constexpr (G == LZ_FLOAT32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(g) + i);
    if constexpr (G == LZ_BFLOAT16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Round-to-nearest-even fp32 -> bf16 with canonical NaN (matches torch).
LZ_TARGET_AVX512 inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

template <int O>
LZ_TARGET_AVX512 inline void store_out(void* out, int64_t i, __m512 x, __mmask16 k) {
  if constexpr (O == LZ_BFLOAT16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k, to_bf16(x));
  } else if constexpr (O == LZ_FLOAT16) {
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k, h);
  }
}

template <int G, int O>
LZ_TARGET_AVX512 void adam_range(float* p, const void* g, float* m, float* v, void* out,
                                 int64_t begin, int64_t end, const AdamCoeffs& c) {
  const __m512 beta1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(c.eps), wd = _mm512_set1_ps(c.weight_decay);
  const __m512 decay = _mm512_set1_ps(c.decay), step_size = _mm512_set1_ps(c.step_size);
  const __m512 bc2 = _mm512_set1_ps(c.bc2_sqrt), inv_scale = _mm512_set1_ps(c.inv_grad_scale);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 k = (end - i >= 16) ? (__mmask16)0xFFFF : (__mmask16)((1u << (end - i)) - 1u);
    const __m512 p0 = _mm512_maskz_loadu_ps(k, p + i);
    __m512 grad = _mm512_mul_ps(load_grad<G>(g, i, k), inv_scale);
    if (c.weight_decay != 0.0f) grad = _mm512_fmadd_ps(wd, p0, grad);  // Adam's L2 only
    __m512 mi = _mm512_maskz_loadu_ps(k, m + i);
    __m512 vi = _mm512_maskz_loadu_ps(k, v + i);
    mi = _mm512_fmadd_ps(beta1, mi, _mm512_mul_ps(omb1, grad));
    vi = _mm512_fmadd_ps(beta2, vi, _mm512_mul_ps(_mm512_mul_ps(omb2, grad), grad));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
    const __m512 param = _mm512_fnmadd_ps(step_size, _mm512_div_ps(mi, denom), _mm512_mul_ps(p0, decay));
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    _mm512_mask_storeu_ps(p + i, k, param);
    store_out<O>(out, i, param, k);
  }
}

}  // namespace avx512
}  // namespace lz

#endif  // x86
#endif  // LZ_ADAM_AVX512_H_
