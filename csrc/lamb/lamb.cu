// Fused multi-tensor LAMB for CUDA, torch-free (CUDA runtime headers only).
//
// Three launches per batch: (1) update the moments and accumulate, per chunk,
// ||param||^2 and ||update||^2; (2) one block per tensor sums its chunks into a
// trust ratio and bumps the step; (3) recompute the update from the new moments
// and apply it scaled by the ratio. Recomputing beats storing the update: both
// cost 40 bytes per parameter in fp32, and recomputing needs no scratch the size
// of the model. Batches are capped at kBatchElems so that, for tensors of up to
// a few million elements, pass (3) reads what pass (1) left in L2. Every pass
// checks the device found-inf flag, so a skipped step needs no host sync.
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "lamb.h"
#include "lz_cuda.cuh"
#include "lz_multi_tensor.cuh"

namespace {

using lz::kThreads;
using lz::NoOut;
using Batch = lz::TensorBatch<5>;
enum Array { kParam = 0, kGrad = 1, kExpAvg = 2, kExpAvgSq = 3, kOut = 4 };
constexpr int64_t kBatchElems = int64_t(1) << 21;

struct LambConsts {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, lr, max_coeff, min_coeff;
  double beta1_d, beta2_d;
  int bias_correction;
};

struct Bias {
  float bc1, bc2_sqrt;
};

__device__ __forceinline__ Bias bias_for(const LambConsts& k, float step) {
  Bias b{1.0f, 1.0f};
  if (k.bias_correction) {
    b.bc1 = (float)(1.0 - pow(k.beta1_d, (double)step));
    b.bc2_sqrt = (float)sqrt(1.0 - pow(k.beta2_d, (double)step));
  }
  return b;
}

__device__ __forceinline__ float lamb_update(float p, float m, float v, const LambConsts& k, const Bias& b) {
  return (m / b.bc1) / (sqrtf(v) / b.bc2_sqrt + k.eps) + k.weight_decay * p;
}

template <typename P, typename G>
__global__ void __launch_bounds__(kThreads) lamb_moments(const Batch b, const LambConsts k, const float* grad_scale,
                                                          const float* found_inf, float* partials) {
  if (lz::skip_step(found_inf)) return;
  __shared__ float shared[32];
  const float inv_scale = grad_scale != nullptr ? 1.0f / *grad_scale : 1.0f;
  const int32_t total = b.chunk_start[b.count];
  for (int32_t c = blockIdx.x; c < total; c += gridDim.x) {
    const lz::ChunkRef<5> ref(b, c);
    const Bias bias = bias_for(k, *b.step[ref.t] + 1.0f);
    const P* p = static_cast<const P*>(b.ptr[kParam][ref.t]) + ref.base;
    const G* g = static_cast<const G*>(b.ptr[kGrad][ref.t]) + ref.base;
    P* m = static_cast<P*>(b.ptr[kExpAvg][ref.t]) + ref.base;
    P* v = static_cast<P*>(b.ptr[kExpAvgSq][ref.t]) + ref.base;
    float w_sq = 0.0f, u_sq = 0.0f;
    int64_t vec_end = 0;
    if ((b.vec_ok >> ref.t) & 1ull) {
      vec_end = ref.len & ~int64_t(3);
      for (int64_t i = 4 * (int64_t)threadIdx.x; i < vec_end; i += 4 * (int64_t)blockDim.x) {
        float rp[4], rg[4], rm[4], rv[4];
        lz::load4(p + i, rp);
        lz::load4(g + i, rg);
        lz::load4(m + i, rm);
        lz::load4(v + i, rv);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float grad = rg[e] * inv_scale;
          // Round to the state dtype first, so the norms see what lamb_apply will read.
          rm[e] = lz::round_trip<P>(fmaf(k.beta1, rm[e], k.one_minus_beta1 * grad));
          rv[e] = lz::round_trip<P>(fmaf(k.beta2, rv[e], k.one_minus_beta2 * grad * grad));
          const float u = lamb_update(rp[e], rm[e], rv[e], k, bias);
          w_sq = fmaf(rp[e], rp[e], w_sq);
          u_sq = fmaf(u, u, u_sq);
        }
        lz::store4(m + i, rm);
        lz::store4(v + i, rv);
      }
    }
    for (int64_t i = vec_end + threadIdx.x; i < ref.len; i += blockDim.x) {
      const float pi = lz::to_float(p[i]), grad = lz::to_float(g[i]) * inv_scale;
      const float mi = lz::round_trip<P>(fmaf(k.beta1, lz::to_float(m[i]), k.one_minus_beta1 * grad));
      const float vi = lz::round_trip<P>(fmaf(k.beta2, lz::to_float(v[i]), k.one_minus_beta2 * grad * grad));
      m[i] = lz::from_float<P>(mi);
      v[i] = lz::from_float<P>(vi);
      const float u = lamb_update(pi, mi, vi, k, bias);
      w_sq = fmaf(pi, pi, w_sq);
      u_sq = fmaf(u, u, u_sq);
    }
    w_sq = lz::block_sum(w_sq, shared);
    u_sq = lz::block_sum(u_sq, shared);
    if (threadIdx.x == 0) {
      partials[2 * c] = w_sq;
      partials[2 * c + 1] = u_sq;
    }
  }
}

// One block per tensor: norms -> clamped trust ratio; then count the step.
__global__ void __launch_bounds__(kThreads) lamb_ratios(const Batch b, const LambConsts k, const float* found_inf,
                                                         const float* partials, float* ratios, float* ratios_out) {
  if (lz::skip_step(found_inf)) return;
  __shared__ float shared[32];
  const int t = blockIdx.x;
  double w_sq = 0.0, u_sq = 0.0;
  for (int32_t c = b.chunk_start[t] + threadIdx.x; c < b.chunk_start[t + 1]; c += blockDim.x) {
    w_sq += partials[2 * c];
    u_sq += partials[2 * c + 1];
  }
  const float w = sqrtf(lz::block_sum((float)w_sq, shared));
  const float u = sqrtf(lz::block_sum((float)u_sq, shared));
  if (threadIdx.x == 0) {
    float ratio = (w > 0.0f && u > 0.0f) ? w / u : 1.0f;
    ratio = fminf(fmaxf(ratio, k.min_coeff), k.max_coeff);
    ratios[t] = ratio;
    if (ratios_out != nullptr) ratios_out[t] = ratio;
    *b.step[t] += 1.0f;
  }
}

template <typename P, typename O>
__global__ void __launch_bounds__(kThreads)
    lamb_apply(const Batch b, const LambConsts k, const float* found_inf, const float* ratios) {
  if (lz::skip_step(found_inf)) return;
  const int32_t total = b.chunk_start[b.count];
  for (int32_t c = blockIdx.x; c < total; c += gridDim.x) {
    const lz::ChunkRef<5> ref(b, c);
    const Bias bias = bias_for(k, *b.step[ref.t]);  // already counted by lamb_ratios
    const float scale = k.lr * ratios[ref.t];
    P* p = static_cast<P*>(b.ptr[kParam][ref.t]) + ref.base;
    const P* m = static_cast<const P*>(b.ptr[kExpAvg][ref.t]) + ref.base;
    const P* v = static_cast<const P*>(b.ptr[kExpAvgSq][ref.t]) + ref.base;
    O* out = static_cast<O*>(b.ptr[kOut][ref.t]) + ref.base;
    int64_t vec_end = 0;
    if ((b.vec_ok >> ref.t) & 1ull) {
      vec_end = ref.len & ~int64_t(3);
      for (int64_t i = 4 * (int64_t)threadIdx.x; i < vec_end; i += 4 * (int64_t)blockDim.x) {
        float rp[4], rm[4], rv[4];
        lz::load4(p + i, rp);
        lz::load4(m + i, rm);
        lz::load4(v + i, rv);
#pragma unroll
        for (int e = 0; e < 4; ++e) rp[e] = fmaf(-scale, lamb_update(rp[e], rm[e], rv[e], k, bias), rp[e]);
        lz::store4(p + i, rp);
        if constexpr (!std::is_same<O, NoOut>::value) lz::store4(out + i, rp);
      }
    }
    for (int64_t i = vec_end + threadIdx.x; i < ref.len; i += blockDim.x) {
      const float pi = lz::to_float(p[i]);
      const float np = fmaf(-scale, lamb_update(pi, lz::to_float(m[i]), lz::to_float(v[i]), k, bias), pi);
      p[i] = lz::from_float<P>(np);
      if constexpr (!std::is_same<O, NoOut>::value) out[i] = lz::from_float<O>(np);
    }
  }
}

struct Launch {
  const LambConsts& k;
  const float* grad_scale;
  const float* found_inf;
  float* workspace;
  float* ratios_out;
  int device;
  cudaStream_t stream;
};

template <typename P, typename G, typename O>
cudaError_t run(const lz_lamb_tensors* t, const Launch& l) {
  const bool has_out = !std::is_same<O, NoOut>::value;
  const void* const* arrays[5] = {
      reinterpret_cast<const void* const*>(t->params), t->grads,
      reinterpret_cast<const void* const*>(t->exp_avg), reinterpret_cast<const void* const*>(t->exp_avg_sq),
      has_out ? reinterpret_cast<const void* const*>(t->out16) : nullptr};
  const int sizes[5] = {sizeof(P), sizeof(G), sizeof(P), sizeof(P), has_out ? 2 : 1};
  int64_t first = 0;  // index of the batch's first tensor, for ratios_out
  return lz::for_each_batch<5>(
      arrays, sizes, t->steps, t->numel, t->count, kBatchElems, [&](const Batch& b, int32_t chunks) {
        float* ratios = l.workspace;  // kMaxTensors floats, then 2 per chunk
        float* partials = l.workspace + lz::kMaxTensors;
        float* out = l.ratios_out != nullptr ? l.ratios_out + first : nullptr;
        first += b.count;
        if (chunks > 0) {
          const int blocks = lz::persistent_blocks(lamb_moments<P, G>, l.device, chunks);
          lamb_moments<P, G><<<blocks, kThreads, 0, l.stream>>>(b, l.k, l.grad_scale, l.found_inf, partials);
        }
        lamb_ratios<<<b.count, kThreads, 0, l.stream>>>(b, l.k, l.found_inf, partials, ratios, out);
        if (chunks > 0) {
          const int blocks = lz::persistent_blocks(lamb_apply<P, O>, l.device, chunks);
          lamb_apply<P, O><<<blocks, kThreads, 0, l.stream>>>(b, l.k, l.found_inf, ratios);
        }
        return cudaGetLastError();
      });
}

template <typename G>
cudaError_t run_fp32_params(int out_dtype, const lz_lamb_tensors* t, const Launch& l) {
  if (out_dtype < 0) return run<float, G, NoOut>(t, l);
  if (out_dtype == LZ_BFLOAT16) return run<float, G, __nv_bfloat16>(t, l);
  if (out_dtype == LZ_FLOAT16) return run<float, G, __half>(t, l);
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" int64_t lz_fused_lamb_workspace_floats(const int64_t* numel, int64_t count) {
  int64_t chunks = 0;
  for (int64_t i = 0; i < count; ++i) chunks += (numel[i] + lz::kChunk - 1) / lz::kChunk;
  return lz::kMaxTensors + 2 * chunks;
}

extern "C" int lz_fused_lamb(const lz_lamb_tensors* tensors, int param_dtype, int grad_dtype, int out_dtype,
                             const lz_lamb_hparams* hp, const float* grad_scale, const float* found_inf,
                             float* workspace, int64_t workspace_floats, float* trust_ratios, int device,
                             void* stream) {
  if (tensors->count == 0) return cudaSuccess;
  if (out_dtype >= 0 && tensors->out16 == nullptr) return cudaErrorInvalidValue;
  if (workspace_floats < lz_fused_lamb_workspace_floats(tensors->numel, tensors->count)) return cudaErrorInvalidValue;
  lz::DeviceGuard guard(device);
  if (guard.status != cudaSuccess) return guard.status;
  LambConsts k;
  k.beta1 = (float)hp->beta1;
  k.one_minus_beta1 = (float)(1.0 - hp->beta1);
  k.beta2 = (float)hp->beta2;
  k.one_minus_beta2 = (float)(1.0 - hp->beta2);
  k.eps = (float)hp->eps;
  k.weight_decay = (float)hp->weight_decay;
  k.lr = (float)hp->lr;
  k.max_coeff = (float)hp->max_coeff;
  k.min_coeff = (float)hp->min_coeff;
  k.beta1_d = hp->beta1;
  k.beta2_d = hp->beta2;
  k.bias_correction = hp->bias_correction;
  const Launch l{k, grad_scale, found_inf, workspace, trust_ratios, device, static_cast<cudaStream_t>(stream)};
  if (param_dtype == LZ_FLOAT32) {
    if (grad_dtype == LZ_FLOAT32) return run_fp32_params<float>(out_dtype, tensors, l);
    if (grad_dtype == LZ_BFLOAT16) return run_fp32_params<__nv_bfloat16>(out_dtype, tensors, l);
    if (grad_dtype == LZ_FLOAT16) return run_fp32_params<__half>(out_dtype, tensors, l);
  } else if (out_dtype < 0 && grad_dtype == param_dtype) {
    if (param_dtype == LZ_BFLOAT16) return run<__nv_bfloat16, __nv_bfloat16, NoOut>(tensors, l);
    if (param_dtype == LZ_FLOAT16) return run<__half, __half, NoOut>(tensors, l);
  }
  return cudaErrorInvalidValue;
}

extern "C" const char* lz_fused_lamb_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
