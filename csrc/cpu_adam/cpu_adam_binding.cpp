// Python binding of the CPU Adam step: validates tensors, passes raw pointers.
#include <optional>

#include "cpu_adam.h"
#include "lz_binding.h"

namespace {

// Returns the SIMD tier that ran (0 scalar, 1 AVX2, 2 AVX-512).
int64_t adam_step(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, double lr,
                  double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
                  int64_t step, double grad_scale, int64_t simd_tier, int64_t num_threads) {
  for (const at::Tensor* t : {&params, &grads, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu(), "cpu_adam: all tensors must be on the CPU");
    lz::check_dense(*t, "cpu_adam tensor");
    lz::check_same_numel(params, *t, "cpu_adam");
  }
  TORCH_CHECK(params.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
                  exp_avg_sq.scalar_type() == at::kFloat,
              "cpu_adam: params and optimizer states must be float32");
  const int grad_dtype = lz::dtype_code(grads, "cpu_adam grads");
  void* out_ptr = nullptr;
  int out_dtype = LZ_FLOAT32;
  if (out16.has_value()) {
    const at::Tensor& o = *out16;
    TORCH_CHECK(o.device().is_cpu(), "cpu_adam: out16 must be on the CPU");
    lz::check_dense(o, "cpu_adam out16");
    lz::check_same_numel(params, o, "cpu_adam out16");
    out_dtype = lz::dtype_code(o, "cpu_adam out16");
    TORCH_CHECK(out_dtype != LZ_FLOAT32, "cpu_adam: out16 must be bfloat16 or float16");
    out_ptr = o.data_ptr();
  }
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1");
  lz_adam_hparams hp{lr, beta1, beta2, eps, weight_decay, adamw_mode ? 1 : 0};
  const int tier = lz_cpu_adam_step(params.data_ptr<float>(), grads.data_ptr(), grad_dtype,
                                    exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), out_ptr,
                                    out_dtype, params.numel(), &hp, step, (float)grad_scale,
                                    (int)simd_tier, (int)num_threads);
  TORCH_CHECK(tier >= 0, "cpu_adam: SIMD tier ", simd_tier, " is not supported by this CPU");
  return tier;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_zero CPU Adam/AdamW (OpenMP + AVX-512/AVX2/scalar)";
  m.def("adam_step", &adam_step, "One fused Adam/AdamW step in place; returns the SIMD tier used",
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avg"),
        pybind11::arg("exp_avg_sq"), pybind11::arg("out16"), pybind11::arg("lr"),
        pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"),
        pybind11::arg("weight_decay"), pybind11::arg("adamw_mode"), pybind11::arg("step"),
        pybind11::arg("grad_scale") = 1.0, pybind11::arg("simd_tier") = -1,
        pybind11::arg("num_threads") = 0,
        // the step touches only raw buffers: let other Python threads (offload's delayed update) run
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("best_simd", []() { return lz_cpu_best_simd(); }, "Best SIMD tier of this CPU");
}
