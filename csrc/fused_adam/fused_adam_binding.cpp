// Python binding of the fused CUDA Adam step: checks tensors, passes pointers.
//
// Compiled by torch's JIT without CUDA; the kernels come from fused_adam.cu
// compiled by nvcc (see [Note: torch-free CUDA kernels] in ops/builder.py).
#include <optional>
#include <vector>

#include "fused_adam.h"
#include "lz_cuda_binding.h"

namespace {

using TensorList = std::vector<at::Tensor>;

void adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const std::optional<TensorList>& out16, const TensorList& steps,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
               int64_t stream) {
  const size_t n = params.size();
  if (n == 0) return;
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "fused_adam: tensor lists differ in length");
  TORCH_CHECK(!out16.has_value() || out16->size() == n, "fused_adam: out16 list differs in length");
  std::vector<const at::Tensor*> all;
  std::vector<void*> p(n), m(n), v(n), o(out16.has_value() ? n : 0);
  std::vector<const void*> g(n);
  std::vector<float*> s(n);
  std::vector<int64_t> numel(n);
  const int param_dtype = lz::dtype_code(params[0], "fused_adam params");
  const int grad_dtype = lz::dtype_code(grads[0], "fused_adam grads");
  const int out_dtype = out16.has_value() ? lz::dtype_code((*out16)[0], "fused_adam out16") : -1;
  for (size_t i = 0; i < n; ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      lz::check_dense(*t, "fused_adam tensor");
      lz::check_same_numel(params[i], *t, "fused_adam");
      all.push_back(t);
    }
    TORCH_CHECK(lz::dtype_code(params[i], "params") == param_dtype && lz::dtype_code(exp_avgs[i], "exp_avg") == param_dtype &&
                    lz::dtype_code(exp_avg_sqs[i], "exp_avg_sq") == param_dtype,
                "fused_adam: params and states must share one dtype");
    TORCH_CHECK(lz::dtype_code(grads[i], "grads") == grad_dtype, "fused_adam: grads must share one dtype");
    TORCH_CHECK(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1, "fused_adam: steps must be float32 scalars");
    all.push_back(&steps[i]);
    p[i] = params[i].data_ptr();
    g[i] = grads[i].data_ptr();
    m[i] = exp_avgs[i].data_ptr();
    v[i] = exp_avg_sqs[i].data_ptr();
    s[i] = steps[i].data_ptr<float>();
    numel[i] = params[i].numel();
    if (out16.has_value()) {
      const at::Tensor& out = (*out16)[i];
      lz::check_dense(out, "fused_adam out16");
      lz::check_same_numel(params[i], out, "fused_adam out16");
      TORCH_CHECK(lz::dtype_code(out, "out16") == out_dtype && out_dtype != LZ_FLOAT32,
                  "fused_adam: out16 must all be bfloat16 or all float16");
      all.push_back(&out);
      o[i] = out.data_ptr();
    }
  }
  const int device = lz::common_cuda_device(all, "fused_adam");
  const c10::Device dev = params[0].device();
  lz_adam_tensors tensors{p.data(), g.data(), m.data(), v.data(), out16.has_value() ? o.data() : nullptr,
                          s.data(), numel.data(), (int64_t)n};
  lz_adam_hparams hp{lr, beta1, beta2, eps, weight_decay, adamw_mode ? 1 : 0};
  const int err = lz_fused_adam(&tensors, param_dtype, grad_dtype, out_dtype, &hp,
                                lz::optional_scalar(grad_scale, dev, "grad_scale"),
                                lz::optional_scalar(found_inf, dev, "found_inf"), device, lz::as_stream(stream));
  TORCH_CHECK(err == 0, "fused_adam: ", lz_fused_adam_error_string(err),
              err == 1 ? " (unsupported dtype combination: fp32 params take fp32/bf16/fp16 grads; "
                         "bf16/fp16 params take grads of their own dtype and no out16)"
                       : "");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_zero fused multi-tensor Adam/AdamW (CUDA)";
  m.def("adam_step", &adam_step, "Adam/AdamW step over lists of same-device CUDA tensors, no host sync",
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avgs"), pybind11::arg("exp_avg_sqs"),
        pybind11::arg("out16"), pybind11::arg("steps"), pybind11::arg("lr"), pybind11::arg("beta1"),
        pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"), pybind11::arg("adamw_mode"),
        pybind11::arg("grad_scale"), pybind11::arg("found_inf"), pybind11::arg("stream"));
}
