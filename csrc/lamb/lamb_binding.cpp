// Python binding of the fused CUDA LAMB step: checks tensors, passes pointers.
//
// Compiled by torch's JIT without CUDA; the kernels come from lamb.cu compiled
// by nvcc (see [Note: torch-free CUDA kernels] in ops/builder.py).
#include <optional>
#include <vector>

#include "lamb.h"
#include "lz_cuda_binding.h"

namespace {

using TensorList = std::vector<at::Tensor>;

int64_t workspace_floats(const std::vector<int64_t>& numel) {
  return lz_fused_lamb_workspace_floats(numel.data(), (int64_t)numel.size());
}

void lamb_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const std::optional<TensorList>& out16, const TensorList& steps,
               const at::Tensor& workspace, const std::optional<at::Tensor>& trust_ratios, double lr, double beta1,
               double beta2, double eps, double weight_decay, double max_coeff, double min_coeff,
               bool bias_correction, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, int64_t stream) {
  const size_t n = params.size();
  if (n == 0) return;
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "fused_lamb: tensor lists differ in length");
  TORCH_CHECK(!out16.has_value() || out16->size() == n, "fused_lamb: out16 list differs in length");
  std::vector<const at::Tensor*> all{&workspace};
  std::vector<void*> p(n), m(n), v(n), o(out16.has_value() ? n : 0);
  std::vector<const void*> g(n);
  std::vector<float*> s(n);
  std::vector<int64_t> numel(n);
  const int param_dtype = lz::dtype_code(params[0], "fused_lamb params");
  const int grad_dtype = lz::dtype_code(grads[0], "fused_lamb grads");
  const int out_dtype = out16.has_value() ? lz::dtype_code((*out16)[0], "fused_lamb out16") : -1;
  for (size_t i = 0; i < n; ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      lz::check_dense(*t, "fused_lamb tensor");
      lz::check_same_numel(params[i], *t, "fused_lamb");
      all.push_back(t);
    }
    TORCH_CHECK(lz::dtype_code(params[i], "params") == param_dtype && lz::dtype_code(exp_avgs[i], "exp_avg") == param_dtype &&
                    lz::dtype_code(exp_avg_sqs[i], "exp_avg_sq") == param_dtype,
                "fused_lamb: params and states must share one dtype");
    TORCH_CHECK(lz::dtype_code(grads[i], "grads") == grad_dtype, "fused_lamb: grads must share one dtype");
    TORCH_CHECK(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1, "fused_lamb: steps must be float32 scalars");
    all.push_back(&steps[i]);
    p[i] = params[i].data_ptr();
    g[i] = grads[i].data_ptr();
    m[i] = exp_avgs[i].data_ptr();
    v[i] = exp_avg_sqs[i].data_ptr();
    s[i] = steps[i].data_ptr<float>();
    numel[i] = params[i].numel();
    if (out16.has_value()) {
      const at::Tensor& out = (*out16)[i];
      lz::check_dense(out, "fused_lamb out16");
      lz::check_same_numel(params[i], out, "fused_lamb out16");
      TORCH_CHECK(lz::dtype_code(out, "out16") == out_dtype && out_dtype != LZ_FLOAT32,
                  "fused_lamb: out16 must all be bfloat16 or all float16");
      all.push_back(&out);
      o[i] = out.data_ptr();
    }
  }
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous(), "fused_lamb: bad workspace");
  TORCH_CHECK(workspace.numel() >= workspace_floats(numel), "fused_lamb: workspace too small");
  float* ratios_ptr = nullptr;
  if (trust_ratios.has_value()) {
    TORCH_CHECK(trust_ratios->scalar_type() == at::kFloat && trust_ratios->is_contiguous() &&
                    trust_ratios->numel() == (int64_t)n,
                "fused_lamb: trust_ratios must be a contiguous float32 tensor with one entry per param");
    all.push_back(&*trust_ratios);
    ratios_ptr = trust_ratios->data_ptr<float>();
  }
  const int device = lz::common_cuda_device(all, "fused_lamb");
  const c10::Device dev = params[0].device();
  lz_lamb_tensors tensors{p.data(), g.data(), m.data(), v.data(), out16.has_value() ? o.data() : nullptr,
                          s.data(), numel.data(), (int64_t)n};
  lz_lamb_hparams hp{lr, beta1, beta2, eps, weight_decay, max_coeff, min_coeff, bias_correction ? 1 : 0};
  const int err = lz_fused_lamb(&tensors, param_dtype, grad_dtype, out_dtype, &hp,
                                lz::optional_scalar(grad_scale, dev, "grad_scale"),
                                lz::optional_scalar(found_inf, dev, "found_inf"), workspace.data_ptr<float>(),
                                workspace.numel(), ratios_ptr, device, lz::as_stream(stream));
  TORCH_CHECK(err == 0, "fused_lamb: ", lz_fused_lamb_error_string(err),
              err == 1 ? " (unsupported dtype combination: fp32 params take fp32/bf16/fp16 grads; "
                         "bf16/fp16 params take grads of their own dtype and no out16)"
                       : "");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_zero fused multi-tensor LAMB (CUDA)";
  m.def("workspace_floats", &workspace_floats, "float32 workspace elements lamb_step needs for these sizes");
  m.def("lamb_step", &lamb_step, "LAMB step over lists of same-device CUDA tensors, no host sync",
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avgs"), pybind11::arg("exp_avg_sqs"),
        pybind11::arg("out16"), pybind11::arg("steps"), pybind11::arg("workspace"), pybind11::arg("trust_ratios"),
        pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"),
        pybind11::arg("weight_decay"), pybind11::arg("max_coeff"), pybind11::arg("min_coeff"),
        pybind11::arg("bias_correction"), pybind11::arg("grad_scale"), pybind11::arg("found_inf"),
        pybind11::arg("stream"));
}
