// Sign packing on the CPU (OpenMP over fixed tiles; deterministic scales).
//
// Tiles of 8192 elements never straddle a chunk; each tile's sum goes to its own
// slot and the slots of a chunk are added in order, so the scales do not
// depend on the thread count.
#include <math.h>
#include <stdint.h>

#include <vector>

#include "lz_half_cpu.h"
#include "sign_pack.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kTileOctets = 1024;

template <int D>
inline float load(const void* x, int64_t i) {
  if (D == LZ_FLOAT32) return static_cast<const float*>(x)[i];
  if (D == LZ_BFLOAT16) return lz_bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
  return lz_f16_to_f32(static_cast<const uint16_t*>(x)[i]);
}

template <int D>
inline void store(void* x, int64_t i, float v) {
  if (D == LZ_FLOAT32) static_cast<float*>(x)[i] = v;
  if (D == LZ_BFLOAT16) static_cast<uint16_t*>(x)[i] = lz_f32_to_bf16(v);
  if (D == LZ_FLOAT16) static_cast<uint16_t*>(x)[i] = lz_f32_to_f16(v);
}

int threads_for(int num_threads) {
#ifdef _OPENMP
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
  return 1;
#endif
}

template <int D>
void pack(const void* x, int64_t n, int64_t chunk, int mode, uint8_t* packed, float* scales, int threads) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t tiles_per_chunk = (chunk / 8 + kTileOctets - 1) / kTileOctets;
  const int64_t tiles = chunks * tiles_per_chunk;
  std::vector<double> partial(tiles, 0.0);
#pragma omp parallel for schedule(static) num_threads(threads) if (n > (1 << 16))
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t c = tile / tiles_per_chunk;
    const int64_t len = (n - c * chunk) < chunk ? (n - c * chunk) : chunk;
    const int64_t octets = (len + 7) / 8;
    const int64_t begin = (tile % tiles_per_chunk) * kTileOctets;
    const int64_t end = begin + kTileOctets < octets ? begin + kTileOctets : octets;
    double acc = 0.0;
    for (int64_t o = begin; o < end; ++o) {
      const int64_t e0 = c * chunk + 8 * o;
      const int64_t count = (n - e0) < 8 ? (n - e0) : 8;
      unsigned byte = 0;
      float sum = 0.0f;
      for (int64_t k = 0; k < count; ++k) {
        const float v = load<D>(x, e0 + k);
        byte |= (unsigned)(v >= 0.0f) << k;
        sum += mode == LZ_SCALE_MEAN_ABS ? fabsf(v) : v * v;
      }
      packed[e0 / 8] = (uint8_t)byte;
      acc += sum;
    }
    partial[tile] = acc;
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t len = (n - c * chunk) < chunk ? (n - c * chunk) : chunk;
    double total = 0.0;
    for (int64_t t = 0; t < tiles_per_chunk; ++t) total += partial[c * tiles_per_chunk + t];
    const double mean = total / (double)len;
    scales[c] = (float)(mode == LZ_SCALE_MEAN_ABS ? mean : sqrt(mean));
  }
}

template <int D>
void unpack(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk, void* out, int threads) {
  const int64_t octets = (n + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads) if (n > (1 << 16))
  for (int64_t o = 0; o < octets; ++o) {
    const int64_t e0 = 8 * o;
    const float s = scales[e0 / chunk];
    const unsigned byte = packed[o];
    const int64_t count = (n - e0) < 8 ? (n - e0) : 8;
    for (int64_t k = 0; k < count; ++k) store<D>(out, e0 + k, ((byte >> k) & 1u) ? s : -s);
  }
}

bool valid(int64_t n, int64_t chunk, int dtype) {
  return n >= 0 && chunk > 0 && chunk % 8 == 0 && dtype >= LZ_FLOAT32 && dtype <= LZ_FLOAT16;
}

}  // namespace

extern "C" int lz_sign_pack_cpu(const void* x, int dtype, int64_t n, int64_t chunk, int scale_mode, uint8_t* packed,
                                float* scales, int num_threads) {
  if (!valid(n, chunk, dtype) || (scale_mode != LZ_SCALE_RMS && scale_mode != LZ_SCALE_MEAN_ABS)) return 1;
  if (n == 0) return 0;
  const int threads = threads_for(num_threads);
  if (dtype == LZ_FLOAT32) pack<LZ_FLOAT32>(x, n, chunk, scale_mode, packed, scales, threads);
  if (dtype == LZ_BFLOAT16) pack<LZ_BFLOAT16>(x, n, chunk, scale_mode, packed, scales, threads);
  if (dtype == LZ_FLOAT16) pack<LZ_FLOAT16>(x, n, chunk, scale_mode, packed, scales, threads);
  return 0;
}

extern "C" int lz_sign_unpack_cpu(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk, void* out,
                                  int dtype, int num_threads) {
  if (!valid(n, chunk, dtype)) return 1;
  if (n == 0) return 0;
  const int threads = threads_for(num_threads);
  if (dtype == LZ_FLOAT32) unpack<LZ_FLOAT32>(packed, scales, n, chunk, out, threads);
  if (dtype == LZ_BFLOAT16) unpack<LZ_BFLOAT16>(packed, scales, n, chunk, out, threads);
  if (dtype == LZ_FLOAT16) unpack<LZ_FLOAT16>(packed, scales, n, chunk, out, threads);
  return 0;
}
