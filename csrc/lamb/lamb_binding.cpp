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
  lz::AdamLists l = lz::adam_lists("fused_lamb", params, grads, exp_avgs, exp_avg_sqs, out16, steps);
  l.all.push_back(&workspace);
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous(), "fused_lamb: bad workspace");
  TORCH_CHECK(workspace.numel() >= workspace_floats(l.numel), "fused_lamb: workspace too small");
  float* ratios_ptr = nullptr;
  if (trust_ratios.has_value()) {
    TORCH_CHECK(trust_ratios->scalar_type() == at::kFloat && trust_ratios->is_contiguous() &&
                    trust_ratios->numel() == (int64_t)n,
                "fused_lamb: trust_ratios must be a contiguous float32 tensor with one entry per param");
    l.all.push_back(&*trust_ratios);
    ratios_ptr = trust_ratios->data_ptr<float>();
  }
  const int device = lz::common_cuda_device(l.all, "fused_lamb");
  const c10::Device dev = params[0].device();
  lz_lamb_tensors tensors{l.p.data(), l.g.data(), l.m.data(), l.v.data(), out16.has_value() ? l.o.data() : nullptr,
                          l.s.data(), l.numel.data(), (int64_t)n};
  lz_lamb_hparams hp{lr, beta1, beta2, eps, weight_decay, max_coeff, min_coeff, bias_correction ? 1 : 0};
  const int err = lz_fused_lamb(&tensors, l.param_dtype, l.grad_dtype, l.out_dtype, &hp,
                                lz::optional_scalar(grad_scale, dev, "grad_scale"),
                                lz::optional_scalar(found_inf, dev, "found_inf"), workspace.data_ptr<float>(),
                                workspace.numel(), ratios_ptr, device, lz::as_stream(stream));
  lz::check_launch(err, "fused_lamb", lz_fused_lamb_error_string(err));
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
