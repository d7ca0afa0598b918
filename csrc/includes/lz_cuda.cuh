// Device helpers shared by the torch-free CUDA kernels: typed 4-wide loads and
// stores, the multi-tensor batch layout, block reductions and a device guard.
//
// Only CUDA runtime headers are included (see [Note: torch-free CUDA kernels]
// in lightning_zero/ops/builder.py). Conversions use explicit intrinsics
// because torch's usual nvcc flags disable the implicit half/bf16 operators.
#ifndef LZ_CUDA_CUH_
#define LZ_CUDA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "lz_common.h"

namespace lz {

// ---------------------------------------------------------------- scalars
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Value as stored in T and read back (identity for float).
template <typename T>
__device__ __forceinline__ float round_trip(float x) { return to_float(from_float<T>(x)); }

// "No buffer" marker type for optional outputs (a 16-bit param copy).
struct NoOut {};

// ----------------------------------------------------------- 4-wide vectors
// 4 elements per thread: one 16-byte access for fp32, one 8-byte access for 16-bit.
template <typename T>
struct Vec4Storage;
template <>
struct Vec4Storage<float> { using type = float4; };
template <>
struct Vec4Storage<__nv_bfloat16> { using type = uint2; };
template <>
struct Vec4Storage<__half> { using type = uint2; };

template <typename T>
__device__ __forceinline__ void load4(const T* ptr, float out[4]) {
  const typename Vec4Storage<T>::type raw = *reinterpret_cast<const typename Vec4Storage<T>::type*>(ptr);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = to_float(elems[k]);
}

template <typename T>
__device__ __forceinline__ void store4(T* ptr, const float in[4]) {
  typename Vec4Storage<T>::type raw;
  T* elems = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) elems[k] = from_float<T>(in[k]);
  *reinterpret_cast<typename Vec4Storage<T>::type*>(ptr) = raw;
}

template <typename T>
__host__ __device__ __forceinline__ bool aligned4(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T))) == 0;
}

// -------------------------------------------------------- multi-tensor batch
// A batch of up to kMaxTensors tensors is passed by value as a kernel argument
// (no host->device copy per step). Each tensor is cut into kChunk-element
// chunks; chunk_start is the prefix sum, and a persistent grid strides over all
// chunks of the batch. kChunk is a multiple of 4, so every chunk of a tensor
// keeps the tensor's 16-byte alignment.
constexpr int kMaxTensors = 36;
constexpr int64_t kChunk = 16384;
constexpr int kThreads = 256;

// Index of the tensor that owns chunk c (chunk_start has n+1 entries).
__device__ __forceinline__ int find_tensor(const int32_t* chunk_start, int n, int32_t c) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (chunk_start[mid] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ bool skip_step(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// ------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sum over the block, result valid in every thread. Deterministic order.
// `shared` holds at least 32 floats; the trailing barrier makes it reusable.
__device__ __forceinline__ float block_sum(float x, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  x = warp_sum(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += shared[w];
  __syncthreads();
  return total;
}

// ------------------------------------------------------------------ host side
// Sets the current device for the duration of a launch. The binding passes the
// tensors' device explicitly: our cudart may not be the instance torch uses, so
// torch's current device cannot be assumed.
struct DeviceGuard {
  int previous = -1;
  cudaError_t status = cudaSuccess;
  explicit DeviceGuard(int device) {
    status = cudaGetDevice(&previous);
    if (status == cudaSuccess && previous != device) status = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int current = -1;
    if (previous >= 0 && cudaGetDevice(&current) == cudaSuccess && current != previous) cudaSetDevice(previous);
  }
};

// Grid size of a persistent kernel: as many blocks as can be resident at once
// (more would only queue behind the grid-stride loop and unbalance the tail).
template <typename Kernel>
inline int persistent_blocks(Kernel kernel, int device, int64_t chunks) {
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 80;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess || per_sm <= 0)
    per_sm = 2;
  const int64_t cap = (int64_t)sms * per_sm;
  return (int)(chunks < cap ? chunks : cap);
}

}  // namespace lz

#endif  // LZ_CUDA_CUH_
