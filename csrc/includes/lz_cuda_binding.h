// Helpers for bindings of the torch-free CUDA kernels (no CUDA header needed:
// streams arrive from Python as integers, see torch.cuda.Stream.cuda_stream).
#ifndef LZ_CUDA_BINDING_H_
#define LZ_CUDA_BINDING_H_

#include <optional>
#include <string>
#include <vector>

#include "lz_binding.h"

namespace lz {

// All tensors on one CUDA device; returns its index.
inline int common_cuda_device(const std::vector<const at::Tensor*>& tensors, const char* who) {
  TORCH_CHECK(!tensors.empty(), who, ": no tensors");
  const c10::Device device = tensors.front()->device();
  TORCH_CHECK(device.is_cuda(), who, ": tensors must be on a CUDA device, got ", device);
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device() == device, who, ": all tensors must be on ", device, ", got ", t->device());
  }
  return device.index();
}

// Device pointer of an optional scalar float32 flag/scale, or nullptr.
inline const float* optional_scalar(const std::optional<at::Tensor>& t, const c10::Device& device, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1, what, " must be a float32 tensor of one element");
  TORCH_CHECK(t->device() == device, what, " must be on ", device);
  return t->data_ptr<float>();
}

inline void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

// The tensor lists of an Adam-family step (fused Adam, fused LAMB), checked and turned into the raw
// pointer arrays the torch-free kernels take. `all` collects every tensor for common_cuda_device.
struct AdamLists {
  std::vector<const at::Tensor*> all;
  std::vector<void*> p, m, v, o;
  std::vector<const void*> g;
  std::vector<float*> s;
  std::vector<int64_t> numel;
  int param_dtype = -1, grad_dtype = -1, out_dtype = -1;
};

inline AdamLists adam_lists(const char* who, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                            const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                            const std::optional<std::vector<at::Tensor>>& out16, const std::vector<at::Tensor>& steps) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              who, ": tensor lists differ in length");
  TORCH_CHECK(!out16.has_value() || out16->size() == n, who, ": out16 list differs in length");
  AdamLists l;
  l.p.resize(n), l.m.resize(n), l.v.resize(n), l.o.resize(out16.has_value() ? n : 0);
  l.g.resize(n), l.s.resize(n), l.numel.resize(n);
  if (n == 0) return l;
  const std::string name(who);
  l.param_dtype = dtype_code(params[0], (name + " params").c_str());
  l.grad_dtype = dtype_code(grads[0], (name + " grads").c_str());
  l.out_dtype = out16.has_value() ? dtype_code((*out16)[0], (name + " out16").c_str()) : -1;
  for (size_t i = 0; i < n; ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      check_dense(*t, (name + " tensor").c_str());
      check_same_numel(params[i], *t, who);
      l.all.push_back(t);
    }
    TORCH_CHECK(dtype_code(params[i], "params") == l.param_dtype && dtype_code(exp_avgs[i], "exp_avg") == l.param_dtype &&
                    dtype_code(exp_avg_sqs[i], "exp_avg_sq") == l.param_dtype,
                who, ": params and states must share one dtype");
    TORCH_CHECK(dtype_code(grads[i], "grads") == l.grad_dtype, who, ": grads must share one dtype");
    TORCH_CHECK(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1, who, ": steps must be float32 scalars");
    l.all.push_back(&steps[i]);
    l.p[i] = params[i].data_ptr();
    l.g[i] = grads[i].data_ptr();
    l.m[i] = exp_avgs[i].data_ptr();
    l.v[i] = exp_avg_sqs[i].data_ptr();
    l.s[i] = steps[i].data_ptr<float>();
    l.numel[i] = params[i].numel();
    if (out16.has_value()) {
      const at::Tensor& out = (*out16)[i];
      check_dense(out, (name + " out16").c_str());
      check_same_numel(params[i], out, who);
      TORCH_CHECK(dtype_code(out, "out16") == l.out_dtype && l.out_dtype != LZ_FLOAT32, who,
                  ": out16 must all be bfloat16 or all float16");
      l.all.push_back(&out);
      l.o[i] = out.data_ptr();
    }
  }
  return l;
}

// The message of a failed kernel launch (1: a dtype combination the kernels do not instantiate).
inline void check_launch(int err, const char* who, const char* what) {
  TORCH_CHECK(err == 0, who, ": ", what,
              err == 1 ? " (unsupported dtype combination: fp32 params take fp32/bf16/fp16 grads; "
                         "bf16/fp16 params take grads of their own dtype and no out16)"
                       : "");
}

}  // namespace lz

#endif  // LZ_CUDA_BINDING_H_
