// Element-wise building blocks of the low-precision host Adam states: the counter-based
// hash behind stochastic rounding, bf16 rounding (nearest and stochastic), and the two
// 8-bit float-like codes of the int8 states.
//
// Every function is branch-free integer/fp32 arithmetic that the compiler vectorises, and
// every one is mirrored op for op by lightning_zero/optim/reference_lowp.py, which is why
// the compiled op and the reference agree bit for bit (see [Note: bitwise reference] there).
// Rules that keep it so: one IEEE operation per C expression step (the op is compiled with
// -ffp-contract=off, so no FMA is formed), no reciprocal tricks, no fast-math.
#ifndef LZ_LOWP_CODES_H_
#define LZ_LOWP_CODES_H_

#include <stdint.h>
#include <string.h>

namespace lz {
namespace lowp {

inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// cond ? a : b as bit masks: GCC turns some `?:` into branches, which stops vectorisation.
inline uint32_t sel(bool cond, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - (uint32_t)cond;
  return (a & m) | (b & ~m);
}

// lowbias32 (C. Wellons' 32-bit integer hash): full avalanche with two multiplies.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

constexpr uint32_t kGolden = 0x9E3779B9u;  // odd: hi * kGolden is a bijection of the high word
constexpr uint32_t kStreamV = 0x6A09E667u;

// Per-call key from (seed, step): computed once, outside the element loop.
inline uint32_t sr_key(uint32_t seed, int64_t step) {
  return mix32(seed ^ mix32((uint32_t)step ^ kGolden));
}

// The 32 random bits of element `idx` (global index): bits 0-15 round the master, bits
// 16-31 round exp_avg; next_bits() of it rounds exp_avg_sq.
inline uint32_t sr_bits(uint32_t key, int64_t idx) {
  const uint32_t lo = (uint32_t)(uint64_t)idx, hi = (uint32_t)((uint64_t)idx >> 32);
  return mix32(lo ^ (key ^ hi * kGolden));
}

// The same bits for a run of indices sharing their high word: hi_key = key ^ hi * kGolden once,
// then only 32-bit work per element (loops split their chunks at multiples of 2^32).
inline uint32_t hi_key(uint32_t key, int64_t idx) { return key ^ (uint32_t)((uint64_t)idx >> 32) * kGolden; }
inline uint32_t sr_bits_lo(uint32_t hkey, uint32_t lo) { return mix32(lo ^ hkey); }

inline uint32_t next_bits(uint32_t h) { return mix32(h ^ kStreamV); }

inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

// Round to nearest even, NaN -> canonical quiet NaN (torch's .to(torch.bfloat16)).
inline uint16_t f32_to_bf16_rn(float x) {
  const uint32_t u = f2u(x);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)sel((u & 0x7FFFFFFFu) > 0x7F800000u, 0x7FC0u, r);
}

// Stochastic rounding: add 16 uniform random bits below bf16's last mantissa bit and
// truncate. On the sign-magnitude encoding this rounds |x| up with probability equal to
// the discarded fraction, for either sign, so E[result] = x (a carry into the exponent is
// the right answer too; only values within one bf16 ulp of FLT_MAX can round to inf).
inline uint16_t f32_to_bf16_sr(float x, uint32_t r16) {
  const uint32_t u = f2u(x);
  const uint32_t r = (u + (r16 & 0xFFFFu)) >> 16;
  return (uint16_t)sel((u & 0x7FFFFFFFu) > 0x7F800000u, 0x7FC0u, r);
}

// ---------------------------------------------------------------------------------- 8-bit codes
// [Note: int8 state codes] (the reasoning is in lightning_zero/optim/reference_lowp.py)
// exp_avg:       sign + E4M3 of m / absmax(block); normal values 2^(e-15) * (1 + f/8), e in 1..15,
//                subnormals f * 2^-17. Codes 0..120 are reachable (|y| <= 1), 0x80|c is -value(c).
// sqrt(exp_avg_sq): unsigned E4M4 of sqrt(v) / max(block); 2^(e-15) * (1 + f/16), subnormals
//                f * 2^-18; codes 0..240 reachable.
// Both round to nearest even, computed on the fp32 bit pattern.

constexpr uint32_t kMinNormal = 0x38800000u;  // 2^-14: below it the codes are subnormal
constexpr float kMagic = 8388608.0f;           // 2^23: (z + 2^23) - 2^23 rounds z >= 0 to an integer, RNE

inline uint8_t encode_m(float y) {
  const uint32_t u = f2u(y);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (112u << 3);
  const float z = u2f(sel(a < kMinNormal, a, 0u)) * 131072.0f;  // |y| * 2^17 (subnormal range), exact
  const uint32_t sub = (uint32_t)((z + kMagic) - kMagic);
  uint32_t c = sel(a >= kMinNormal, normal, sub);
  c = sel(c > 0x7Fu, 0x7Fu, c);
  return (uint8_t)(sign | c);
}

inline float decode_m(uint8_t code) {
  const uint32_t c = code & 0x7Fu;
  const uint32_t normal = (c + (112u << 3)) << 20;
  const uint32_t sub = f2u((float)(int32_t)(c & 7u) * 7.62939453125e-06f);  // f * 2^-17, exact
  return u2f(sel(c >= 8u, normal, sub) | ((uint32_t)(code & 0x80u) << 24));
}

inline uint8_t encode_w(float y) {  // y >= 0
  const uint32_t a = f2u(y) & 0x7FFFFFFFu;
  const uint32_t normal = ((a + 0x3FFFFu + ((a >> 19) & 1u)) >> 19) - (112u << 4);
  const float z = u2f(sel(a < kMinNormal, a, 0u)) * 262144.0f;  // y * 2^18 (subnormal range), exact
  const uint32_t sub = (uint32_t)((z + kMagic) - kMagic);
  uint32_t c = sel(a >= kMinNormal, normal, sub);
  c = sel(c > 0xFFu, 0xFFu, c);
  return (uint8_t)c;
}

inline float decode_w(uint8_t code) {
  const uint32_t c = code;
  const uint32_t normal = (c + (112u << 4)) << 19;
  const uint32_t sub = f2u((float)(int32_t)(c & 15u) * 3.814697265625e-06f);  // f * 2^-18, exact
  return u2f(sel(c >= 16u, normal, sub));
}

}  // namespace lowp
}  // namespace lz

#endif  // LZ_LOWP_CODES_H_
