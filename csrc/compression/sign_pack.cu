// Sign packing on CUDA, torch-free (CUDA runtime headers only).
//
// Pack: each thread turns 8 consecutive elements (one or two 16-byte loads)
// into one byte, so a warp writes 32 consecutive bytes; a block covers a tile
// of 8192 elements that never straddles a chunk and reduces the tile's sum of
// |x| or x^2. A chunk of one tile gets its scale right away; larger chunks get
// it from a second, tiny kernel that adds the tile sums in order
// (deterministic). Unpack: one byte and one scale make 8 outputs per thread.
#include <cuda_runtime.h>
#include <stdint.h>

#include "lz_cuda.cuh"
#include "sign_pack.h"

namespace {

using lz::kThreads;
constexpr int kOctetsPerThread = 4;
constexpr int64_t kTileOctets = (int64_t)kThreads * kOctetsPerThread;

// 8 consecutive elements: two 16-byte loads for fp32, one for 16-bit types.
template <typename T>
__device__ __forceinline__ void load8(const T* x, float v[8]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(x)[0];
    const float4 b = reinterpret_cast<const float4*>(x)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(x);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = lz::to_float(e[k]);
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* x, const float v[8]) {
  if constexpr (sizeof(T) == 4) {
    reinterpret_cast<float4*>(x)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(x)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = lz::from_float<T>(v[k]);
    *reinterpret_cast<uint4*>(x) = raw;
  }
}

__device__ __forceinline__ float finish_scale(double sum, int64_t len, int mode) {
  const double mean = sum / (double)len;
  return (float)(mode == LZ_SCALE_MEAN_ABS ? mean : sqrt(mean));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    pack_kernel(const T* x, int64_t n, int64_t chunk, int mode, bool aligned, int64_t tiles_per_chunk,
                int64_t tiles, uint8_t* packed, float* scales, float* partials) {
  __shared__ float shared[32];
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t c = tile / tiles_per_chunk;
    const int64_t len = (n - c * chunk) < chunk ? (n - c * chunk) : chunk;
    const int64_t octets = (len + 7) / 8;
    const int64_t begin = (tile % tiles_per_chunk) * kTileOctets;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kOctetsPerThread; ++j) {
      const int64_t o = begin + j * kThreads + threadIdx.x;
      if (o >= octets) break;
      const int64_t e0 = c * chunk + 8 * o;
      const int64_t count = (n - e0) < 8 ? (n - e0) : 8;
      float v[8];
      if (count == 8 && aligned) {
        load8(x + e0, v);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = k < count ? lz::to_float(x[e0 + k]) : 0.0f;
      }
      unsigned byte = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        byte |= (unsigned)(k < count && v[k] >= 0.0f) << k;
        acc += mode == LZ_SCALE_MEAN_ABS ? fabsf(v[k]) : v[k] * v[k];
      }
      packed[e0 / 8] = (uint8_t)byte;
    }
    acc = lz::block_sum(acc, shared);
    if (threadIdx.x == 0) {
      if (tiles_per_chunk == 1) scales[c] = finish_scale(acc, len, mode);
      else partials[tile] = acc;
    }
  }
}

__global__ void scale_kernel(int64_t n, int64_t chunk, int mode, int64_t tiles_per_chunk, int64_t chunks,
                             const float* partials, float* scales) {
  __shared__ float shared[32];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    double sum = 0.0;
    for (int64_t t = threadIdx.x; t < tiles_per_chunk; t += blockDim.x) sum += partials[c * tiles_per_chunk + t];
    const float total = lz::block_sum((float)sum, shared);
    const int64_t len = (n - c * chunk) < chunk ? (n - c * chunk) : chunk;
    if (threadIdx.x == 0) scales[c] = finish_scale(total, len, mode);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk, bool aligned, T* out) {
  const int64_t octets = (n + 7) / 8;
  for (int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; o < octets; o += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e0 = 8 * o;
    const float s = scales[e0 / chunk];
    const unsigned byte = packed[o];
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = ((byte >> k) & 1u) ? s : -s;
    const int64_t count = (n - e0) < 8 ? (n - e0) : 8;
    if (count == 8 && aligned) {
      store8(out + e0, v);
    } else {
      for (int k = 0; k < count; ++k) out[e0 + k] = lz::from_float<T>(v[k]);
    }
  }
}

int64_t tiles_per_chunk(int64_t chunk) { return (chunk / 8 + kTileOctets - 1) / kTileOctets; }

int grid_for(int device, int64_t work, int per_sm) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 80;
  const int64_t cap = (int64_t)sms * per_sm;
  return (int)(work < cap ? (work > 0 ? work : 1) : cap);
}

template <typename T>
cudaError_t pack_typed(const void* x, int64_t n, int64_t chunk, int mode, uint8_t* packed, float* scales,
                       float* workspace, int device, cudaStream_t stream) {
  const int64_t chunks = (n + chunk - 1) / chunk, tpc = tiles_per_chunk(chunk), tiles = chunks * tpc;
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;  // 8 elements = 16 or 32 bytes
  pack_kernel<T><<<grid_for(device, tiles, 2048 / kThreads), kThreads, 0, stream>>>(
      static_cast<const T*>(x), n, chunk, mode, aligned, tpc, tiles, packed, scales, workspace);
  if (tpc > 1) scale_kernel<<<grid_for(device, chunks, 8), kThreads, 0, stream>>>(n, chunk, mode, tpc, chunks, workspace, scales);
  return cudaGetLastError();
}

template <typename T>
cudaError_t unpack_typed(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk, void* out, int device,
                         cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t blocks = ((n + 7) / 8 + kThreads - 1) / kThreads;
  unpack_kernel<T><<<grid_for(device, blocks, 2048 / kThreads), kThreads, 0, stream>>>(
      packed, scales, n, chunk, aligned, static_cast<T*>(out));
  return cudaGetLastError();
}

bool valid(int64_t n, int64_t chunk, int dtype) {
  return n >= 0 && chunk > 0 && chunk % 8 == 0 && dtype >= LZ_FLOAT32 && dtype <= LZ_FLOAT16;
}

}  // namespace

extern "C" int64_t lz_sign_pack_workspace_floats(int64_t n, int64_t chunk) {
  if (chunk <= 0) return 0;
  const int64_t tpc = tiles_per_chunk(chunk);
  return tpc > 1 ? ((n + chunk - 1) / chunk) * tpc : 0;
}

extern "C" int lz_sign_pack_cuda(const void* x, int dtype, int64_t n, int64_t chunk, int scale_mode, uint8_t* packed,
                                 float* scales, float* workspace, int64_t workspace_floats, int device, void* stream) {
  if (!valid(n, chunk, dtype) || (scale_mode != LZ_SCALE_RMS && scale_mode != LZ_SCALE_MEAN_ABS)) {
    return cudaErrorInvalidValue;
  }
  if (workspace_floats < lz_sign_pack_workspace_floats(n, chunk)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  lz::DeviceGuard guard(device);
  if (guard.status != cudaSuccess) return guard.status;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == LZ_FLOAT32) return pack_typed<float>(x, n, chunk, scale_mode, packed, scales, workspace, device, s);
  if (dtype == LZ_BFLOAT16) return pack_typed<__nv_bfloat16>(x, n, chunk, scale_mode, packed, scales, workspace, device, s);
  return pack_typed<__half>(x, n, chunk, scale_mode, packed, scales, workspace, device, s);
}

extern "C" int lz_sign_unpack_cuda(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk, void* out,
                                   int dtype, int device, void* stream) {
  if (!valid(n, chunk, dtype)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  lz::DeviceGuard guard(device);
  if (guard.status != cudaSuccess) return guard.status;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == LZ_FLOAT32) return unpack_typed<float>(packed, scales, n, chunk, out, device, s);
  if (dtype == LZ_BFLOAT16) return unpack_typed<__nv_bfloat16>(packed, scales, n, chunk, out, device, s);
  return unpack_typed<__half>(packed, scales, n, chunk, out, device, s);
}

extern "C" const char* lz_sign_pack_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
