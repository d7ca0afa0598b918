// Fused multi-tensor Adam/AdamW for CUDA, torch-free (CUDA runtime headers only).
//
// One persistent kernel per batch of up to kMaxTensors tensors walks 16K-element
// chunks with 4-wide vector accesses; a one-block kernel then bumps the
// per-tensor step counters. Both read the found-inf flag on the device, so a
// skipped step (fp16 overflow) costs no host synchronisation. Bias correction
// is computed from the device step count in double precision.
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "fused_adam.h"
#include "lz_cuda.cuh"
#include "lz_multi_tensor.cuh"

namespace {

using lz::kThreads;
using lz::NoOut;
using Batch = lz::TensorBatch<5>;
enum Array { kParam = 0, kGrad = 1, kExpAvg = 2, kExpAvgSq = 3, kOut = 4 };

struct AdamConsts {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float l2;     // Adam mode: weight decay added to the gradient; AdamW mode: 0
  float decay;  // AdamW mode: 1 - lr * weight_decay; Adam mode: 1
  double lr, beta1_d, beta2_d;
};

struct StepCoeffs {
  float step_size, bc2_sqrt;
};

__device__ __forceinline__ StepCoeffs step_coeffs(const AdamConsts& k, float step_before) {
  const double s = (double)step_before + 1.0;
  StepCoeffs c;
  c.step_size = (float)(k.lr / (1.0 - pow(k.beta1_d, s)));
  c.bc2_sqrt = (float)sqrt(1.0 - pow(k.beta2_d, s));
  return c;
}

// The same sequence of fp32 operations as the CPU op (csrc/cpu_adam).
__device__ __forceinline__ void adam_update(float& p, float g, float& m, float& v, const AdamConsts& k,
                                            const StepCoeffs& s, float inv_scale) {
  g *= inv_scale;
  if (k.l2 != 0.0f) g = fmaf(k.l2, p, g);
  m = fmaf(k.beta1, m, k.one_minus_beta1 * g);
  v = fmaf(k.beta2, v, k.one_minus_beta2 * g * g);
  const float denom = sqrtf(v) / s.bc2_sqrt + k.eps;
  p = fmaf(-s.step_size, m / denom, p * k.decay);
}

template <typename P, typename G, typename O>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(const Batch b, const AdamConsts k, const float* grad_scale, const float* found_inf) {
  if (lz::skip_step(found_inf)) return;
  const float inv_scale = grad_scale != nullptr ? 1.0f / *grad_scale : 1.0f;
  const int32_t total = b.chunk_start[b.count];
  for (int32_t c = blockIdx.x; c < total; c += gridDim.x) {
    const lz::ChunkRef<5> ref(b, c);
    const StepCoeffs s = step_coeffs(k, *b.step[ref.t]);
    P* p = static_cast<P*>(b.ptr[kParam][ref.t]) + ref.base;
    const G* g = static_cast<const G*>(b.ptr[kGrad][ref.t]) + ref.base;
    P* m = static_cast<P*>(b.ptr[kExpAvg][ref.t]) + ref.base;
    P* v = static_cast<P*>(b.ptr[kExpAvgSq][ref.t]) + ref.base;
    O* out = static_cast<O*>(b.ptr[kOut][ref.t]) + ref.base;
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
        for (int e = 0; e < 4; ++e) adam_update(rp[e], rg[e], rm[e], rv[e], k, s, inv_scale);
        lz::store4(p + i, rp);
        lz::store4(m + i, rm);
        lz::store4(v + i, rv);
        if constexpr (!std::is_same<O, NoOut>::value) lz::store4(out + i, rp);
      }
    }
    for (int64_t i = vec_end + threadIdx.x; i < ref.len; i += blockDim.x) {
      float rp = lz::to_float(p[i]), rm = lz::to_float(m[i]), rv = lz::to_float(v[i]);
      adam_update(rp, lz::to_float(g[i]), rm, rv, k, s, inv_scale);
      p[i] = lz::from_float<P>(rp);
      m[i] = lz::from_float<P>(rm);
      v[i] = lz::from_float<P>(rv);
      if constexpr (!std::is_same<O, NoOut>::value) out[i] = lz::from_float<O>(rp);
    }
  }
}

__global__ void bump_steps(const Batch b, const float* found_inf) {
  if (lz::skip_step(found_inf)) return;
  for (int t = threadIdx.x; t < b.count; t += blockDim.x) *b.step[t] += 1.0f;
}

template <typename P, typename G, typename O>
cudaError_t run(const lz_adam_tensors* t, const AdamConsts& k, const float* grad_scale, const float* found_inf,
                int device, cudaStream_t stream) {
  const bool has_out = !std::is_same<O, NoOut>::value;
  const void* const* arrays[5] = {
      reinterpret_cast<const void* const*>(t->params), t->grads,
      reinterpret_cast<const void* const*>(t->exp_avg), reinterpret_cast<const void* const*>(t->exp_avg_sq),
      has_out ? reinterpret_cast<const void* const*>(t->out16) : nullptr};
  const int sizes[5] = {sizeof(P), sizeof(G), sizeof(P), sizeof(P), has_out ? 2 : 1};
  return lz::for_each_batch<5>(arrays, sizes, t->steps, t->numel, t->count, INT64_MAX,
                               [&](const Batch& b, int32_t chunks) {
                                 if (chunks > 0) {
                                   const int blocks = lz::persistent_blocks(adam_kernel<P, G, O>, device, chunks);
                                   adam_kernel<P, G, O><<<blocks, kThreads, 0, stream>>>(b, k, grad_scale, found_inf);
                                 }
                                 bump_steps<<<1, 64, 0, stream>>>(b, found_inf);
                                 return cudaGetLastError();
                               });
}

template <typename G>
cudaError_t run_fp32_params(int out_dtype, const lz_adam_tensors* t, const AdamConsts& k, const float* gs,
                            const float* fi, int device, cudaStream_t s) {
  if (out_dtype < 0) return run<float, G, NoOut>(t, k, gs, fi, device, s);
  if (out_dtype == LZ_BFLOAT16) return run<float, G, __nv_bfloat16>(t, k, gs, fi, device, s);
  if (out_dtype == LZ_FLOAT16) return run<float, G, __half>(t, k, gs, fi, device, s);
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" int lz_fused_adam(const lz_adam_tensors* tensors, int param_dtype, int grad_dtype, int out_dtype,
                             const lz_adam_hparams* hp, const float* grad_scale, const float* found_inf,
                             int device, void* stream) {
  if (tensors->count == 0) return cudaSuccess;
  if (out_dtype >= 0 && tensors->out16 == nullptr) return cudaErrorInvalidValue;
  lz::DeviceGuard guard(device);
  if (guard.status != cudaSuccess) return guard.status;
  AdamConsts k;
  k.beta1 = (float)hp->beta1;
  k.one_minus_beta1 = (float)(1.0 - hp->beta1);
  k.beta2 = (float)hp->beta2;
  k.one_minus_beta2 = (float)(1.0 - hp->beta2);
  k.eps = (float)hp->eps;
  k.l2 = hp->adamw_mode ? 0.0f : (float)hp->weight_decay;
  k.decay = hp->adamw_mode ? (float)(1.0 - hp->lr * hp->weight_decay) : 1.0f;
  k.lr = hp->lr;
  k.beta1_d = hp->beta1;
  k.beta2_d = hp->beta2;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (param_dtype == LZ_FLOAT32) {
    if (grad_dtype == LZ_FLOAT32) return run_fp32_params<float>(out_dtype, tensors, k, grad_scale, found_inf, device, s);
    if (grad_dtype == LZ_BFLOAT16)
      return run_fp32_params<__nv_bfloat16>(out_dtype, tensors, k, grad_scale, found_inf, device, s);
    if (grad_dtype == LZ_FLOAT16) return run_fp32_params<__half>(out_dtype, tensors, k, grad_scale, found_inf, device, s);
  } else if (out_dtype < 0 && grad_dtype == param_dtype) {
    if (param_dtype == LZ_BFLOAT16)
      return run<__nv_bfloat16, __nv_bfloat16, NoOut>(tensors, k, grad_scale, found_inf, device, s);
    if (param_dtype == LZ_FLOAT16) return run<__half, __half, NoOut>(tensors, k, grad_scale, found_inf, device, s);
  }
  return cudaErrorInvalidValue;
}

extern "C" const char* lz_fused_adam_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
