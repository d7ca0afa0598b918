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
  if (params.empty()) return;
  lz::AdamLists l = lz::adam_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs, out16, steps);
  const int device = lz::common_cuda_device(l.all, "fused_adam");
  const c10::Device dev = params[0].device();
  lz_adam_tensors tensors{l.p.data(), l.g.data(), l.m.data(), l.v.data(), out16.has_value() ? l.o.data() : nullptr,
                          l.s.data(), l.numel.data(), (int64_t)params.size()};
  lz_adam_hparams hp{lr, beta1, beta2, eps, weight_decay, adamw_mode ? 1 : 0};
  const int err = lz_fused_adam(&tensors, l.param_dtype, l.grad_dtype, l.out_dtype, &hp,
                                lz::optional_scalar(grad_scale, dev, "grad_scale"),
                                lz::optional_scalar(found_inf, dev, "found_inf"), device, lz::as_stream(stream));
  lz::check_launch(err, "fused_adam", lz_fused_adam_error_string(err));
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
