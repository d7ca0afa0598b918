// Portable scalar conversions between fp32 and the two 16-bit float formats.
//
// Why our own: the scalar tier must run on any CPU (no F16C, no AVX512-BF16),
// and the vector tiers reuse these for nothing but reference behaviour, so the
// rounding here is the contract: round-to-nearest-even, NaN stays NaN, exactly
// what torch's `.to(torch.bfloat16)` / `.to(torch.float16)` produce.
#ifndef LZ_HALF_CPU_H_
#define LZ_HALF_CPU_H_

#include <stdint.h>
#include <string.h>

static inline uint32_t lz_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

static inline float lz_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

static inline float lz_bf16_to_f32(uint16_t h) { return lz_bits_f32((uint32_t)h << 16); }

static inline uint16_t lz_f32_to_bf16(float f) {
  uint32_t u = lz_f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN -> canonical quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);                     // round to nearest, ties to even
  return (uint16_t)(u >> 16);
}

static inline float lz_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return lz_bits_f32(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {                                                          // zero / subnormal
    const float mag = (float)mant * 5.9604644775390625e-8f;                // mant * 2^-24, exact
    return lz_bits_f32(sign | lz_f32_bits(mag));
  }
  return lz_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t lz_f32_to_f16(float f) {
  uint32_t u = lz_f32_bits(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  u &= 0x7FFFFFFFu;
  if (u >= 0x7F800000u) return sign | (u > 0x7F800000u ? 0x7E00 : 0x7C00);  // NaN / inf
  if (u >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to inf
  if (u < 0x38800000u) {
    // Result is a half subnormal (or zero): adding 0.5f aligns the half's unit
    // (2^-24) with the float's last mantissa bit, so the FPU rounds for us.
    const float shifted = lz_bits_f32(u) + 0.5f;
    return sign | (uint16_t)(lz_f32_bits(shifted) - 0x3F000000u);
  }
  const uint32_t mant_odd = (u >> 13) & 1u;
  u += 0xC8000FFFu + mant_odd;  // re-bias exponent (127 -> 15) and round to nearest even
  return sign | (uint16_t)(u >> 13);
}

#endif  // LZ_HALF_CPU_H_
