// Python binding of the low-precision host Adam steps: validates tensors, passes raw pointers.
#include <optional>

#include "cpu_adam_lowp.h"
#include "lz_binding.h"

namespace {

void check_cpu(const at::Tensor& t, const at::Tensor& like, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam_lowp: ", what, " must be on the CPU");
  lz::check_dense(t, what);
  lz::check_same_numel(like, t, what);
  TORCH_CHECK(t.scalar_type() == dtype, "cpu_adam_lowp: ", what, " must be ", dtype, ", got ",
              t.scalar_type());
}

struct Out16 {
  void* ptr = nullptr;
  int dtype = LZ_FLOAT32;
};

Out16 out16_of(const std::optional<at::Tensor>& out16, const at::Tensor& like) {
  Out16 o;
  if (!out16.has_value()) return o;
  const at::Tensor& t = *out16;
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam_lowp: out16 must be on the CPU");
  lz::check_dense(t, "cpu_adam_lowp out16");
  lz::check_same_numel(like, t, "cpu_adam_lowp out16");
  o.dtype = lz::dtype_code(t, "cpu_adam_lowp out16");
  TORCH_CHECK(o.dtype != LZ_FLOAT32, "cpu_adam_lowp: out16 must be bfloat16 or float16");
  o.ptr = t.data_ptr();
  return o;
}

uint16_t* u16(const at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

// Returns the SIMD tier that ran (0 scalar, 1 AVX2, 2 AVX-512).
int64_t adam_step_bf16(const at::Tensor& params, const std::optional<at::Tensor>& comp,
                       const at::Tensor& grads, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                       const std::optional<at::Tensor>& out16, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool adamw_mode, int64_t step, double grad_scale,
                       int64_t seed, int64_t offset, int64_t simd_tier, int64_t num_threads) {
  check_cpu(params, params, at::kBFloat16, "params");
  check_cpu(exp_avg, params, at::kBFloat16, "exp_avg");
  check_cpu(exp_avg_sq, params, at::kBFloat16, "exp_avg_sq");
  if (comp.has_value()) check_cpu(*comp, params, at::kBFloat16, "comp");
  TORCH_CHECK(grads.device().is_cpu(), "cpu_adam_lowp: grads must be on the CPU");
  lz::check_dense(grads, "cpu_adam_lowp grads");
  lz::check_same_numel(params, grads, "cpu_adam_lowp grads");
  const int grad_dtype = lz::dtype_code(grads, "cpu_adam_lowp grads");
  const Out16 o = out16_of(out16, params);
  TORCH_CHECK(step >= 1, "cpu_adam_lowp: step must be >= 1");
  TORCH_CHECK(offset >= 0, "cpu_adam_lowp: offset must be >= 0");
  lz_adam_hparams hp{lr, beta1, beta2, eps, weight_decay, adamw_mode ? 1 : 0};
  const int tier = lz_cpu_adam_bf16_step(
      u16(params), comp.has_value() ? u16(*comp) : nullptr, grads.data_ptr(), grad_dtype, u16(exp_avg),
      u16(exp_avg_sq), o.ptr, o.dtype, params.numel(), &hp, step, (float)grad_scale,
      (uint32_t)(seed & 0xFFFFFFFF), offset, (int)simd_tier, (int)num_threads);
  TORCH_CHECK(tier >= 0, "cpu_adam_lowp: SIMD tier ", simd_tier, " is not supported by this CPU");
  return tier;
}

int64_t adam_step_int8(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg_codes,
                       const at::Tensor& exp_avg_scales, const at::Tensor& exp_avg_sq_codes,
                       const at::Tensor& exp_avg_sq_scales, const std::optional<at::Tensor>& out16,
                       double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool adamw_mode, int64_t step, double grad_scale, int64_t block, int64_t simd_tier,
                       int64_t num_threads) {
  check_cpu(params, params, at::kFloat, "params");
  check_cpu(exp_avg_codes, params, at::kByte, "exp_avg codes");
  check_cpu(exp_avg_sq_codes, params, at::kByte, "exp_avg_sq codes");
  TORCH_CHECK(block >= 1 && block <= 1024, "cpu_adam_lowp: block must be in [1, 1024]");
  const int64_t blocks = (params.numel() + block - 1) / block;
  for (const at::Tensor* s : {&exp_avg_scales, &exp_avg_sq_scales}) {
    TORCH_CHECK(s->device().is_cpu() && s->is_contiguous() && s->scalar_type() == at::kFloat,
                "cpu_adam_lowp: scales must be contiguous float32 CPU tensors");
    TORCH_CHECK(s->numel() == blocks, "cpu_adam_lowp: ", blocks, " scales expected, got ", s->numel());
  }
  TORCH_CHECK(grads.device().is_cpu(), "cpu_adam_lowp: grads must be on the CPU");
  lz::check_dense(grads, "cpu_adam_lowp grads");
  lz::check_same_numel(params, grads, "cpu_adam_lowp grads");
  const int grad_dtype = lz::dtype_code(grads, "cpu_adam_lowp grads");
  const Out16 o = out16_of(out16, params);
  TORCH_CHECK(step >= 1, "cpu_adam_lowp: step must be >= 1");
  lz_adam_hparams hp{lr, beta1, beta2, eps, weight_decay, adamw_mode ? 1 : 0};
  const int tier = lz_cpu_adam_int8_step(
      params.data_ptr<float>(), grads.data_ptr(), grad_dtype, exp_avg_codes.data_ptr<uint8_t>(),
      exp_avg_scales.data_ptr<float>(), exp_avg_sq_codes.data_ptr<uint8_t>(), exp_avg_sq_scales.data_ptr<float>(),
      o.ptr, o.dtype, params.numel(), block, &hp, step, (float)grad_scale, (int)simd_tier, (int)num_threads);
  TORCH_CHECK(tier >= 0, "cpu_adam_lowp: SIMD tier ", simd_tier, " is not supported by this CPU");
  return tier;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "lightning_zero low-precision host Adam/AdamW (bf16 SR, bf16 Kahan, int8 blockwise)";
  m.def("adam_step_bf16", &adam_step_bf16,
        "bf16 master/moments step in place (comp given: Kahan master); returns the SIMD tier used",
        py::arg("params"), py::arg("comp"), py::arg("grads"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("out16"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("step"), py::arg("grad_scale") = 1.0,
        py::arg("seed") = 0, py::arg("offset") = 0, py::arg("simd_tier") = -1, py::arg("num_threads") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("adam_step_int8", &adam_step_int8,
        "fp32 master, 8-bit blockwise moments step in place; returns the SIMD tier used", py::arg("params"),
        py::arg("grads"), py::arg("exp_avg_codes"), py::arg("exp_avg_scales"), py::arg("exp_avg_sq_codes"),
        py::arg("exp_avg_sq_scales"), py::arg("out16"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("step"),
        py::arg("grad_scale") = 1.0, py::arg("block") = 256, py::arg("simd_tier") = -1,
        py::arg("num_threads") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("best_simd", []() { return lz_lowp_best_simd(); }, "Best SIMD tier of this CPU");
}
