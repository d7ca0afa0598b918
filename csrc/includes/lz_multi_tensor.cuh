// Host-side batching of many tensors into kernel-argument structs.
//
// Why by value: a batch travels as a kernel argument (< 4 KiB), so a step over
// hundreds of tensors needs no host->device copy of pointer tables and no
// synchronisation, only a few launches.
#ifndef LZ_MULTI_TENSOR_CUH_
#define LZ_MULTI_TENSOR_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "lz_cuda.cuh"

namespace lz {

// A arrays per tensor (e.g. param, grad, exp_avg, exp_avg_sq, copy-out).
template <int A>
struct TensorBatch {
  void* ptr[A][kMaxTensors];
  float* step[kMaxTensors];
  int64_t n[kMaxTensors];
  int32_t chunk_start[kMaxTensors + 1];
  uint64_t vec_ok;  // bit t: every array of tensor t is aligned for 4-wide access
  int32_t count;
};
static_assert(kMaxTensors <= 64, "vec_ok is a 64-bit mask");

// Cut `count` tensors into batches and call launch(batch, chunks) for each.
// arrays[a] is a host array of device pointers (or NULL: array absent);
// elem_size[a] its element size. A batch closes at kMaxTensors tensors or
// when adding a tensor would pass max_elems (if it already holds one).
template <int A, typename Launch>
cudaError_t for_each_batch(const void* const* const* arrays, const int* elem_size, float* const* steps,
                           const int64_t* numel, int64_t count, int64_t max_elems, Launch launch) {
  TensorBatch<A> b;
  b.count = 0;
  b.vec_ok = 0;
  int32_t chunks = 0;
  int64_t elems = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (b.count > 0 && elems + numel[i] > max_elems) {
      b.chunk_start[b.count] = chunks;
      const cudaError_t err = launch(b, chunks);
      if (err != cudaSuccess) return err;
      b.count = 0, b.vec_ok = 0, chunks = 0, elems = 0;
    }
    const int t = b.count;
    bool ok = true;
    for (int a = 0; a < A; ++a) {
      void* p = arrays[a] != nullptr ? const_cast<void*>(arrays[a][i]) : nullptr;
      b.ptr[a][t] = p;
      if (p != nullptr && reinterpret_cast<uintptr_t>(p) % (4 * elem_size[a]) != 0) ok = false;
    }
    b.step[t] = steps[i];
    b.n[t] = numel[i];
    b.chunk_start[t] = chunks;
    chunks += (int32_t)((numel[i] + kChunk - 1) / kChunk);
    elems += numel[i];
    if (ok) b.vec_ok |= (1ull << t);
    b.count = t + 1;
    if (b.count == kMaxTensors || i == count - 1) {
      b.chunk_start[b.count] = chunks;
      const cudaError_t err = launch(b, chunks);
      if (err != cudaSuccess) return err;
      b.count = 0, b.vec_ok = 0, chunks = 0, elems = 0;
    }
  }
  return cudaSuccess;
}

// Chunk c of a batch: which tensor, where it starts, how long it is.
template <int A>
struct ChunkRef {
  int t;
  int64_t base;
  int64_t len;
  __device__ __forceinline__ ChunkRef(const TensorBatch<A>& b, int32_t c) {
    t = find_tensor(b.chunk_start, b.count, c);
    base = (int64_t)(c - b.chunk_start[t]) * kChunk;
    const int64_t rest = b.n[t] - base;
    len = rest < kChunk ? rest : kChunk;
  }
};

}  // namespace lz

#endif  // LZ_MULTI_TENSOR_CUH_
