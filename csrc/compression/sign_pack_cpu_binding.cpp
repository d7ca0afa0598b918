// Python binding of CPU sign packing: checks tensors, passes pointers.
#include "lz_binding.h"
#include "sign_pack.h"

namespace {

void check_buffers(const at::Tensor& packed, const at::Tensor& scales, int64_t n, int64_t chunk, const char* who) {
  TORCH_CHECK(chunk > 0 && chunk % 8 == 0, who, ": chunk must be a positive multiple of 8, got ", chunk);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() >= (n + 7) / 8, who,
              ": packed must be a contiguous uint8 tensor of ceil(n/8) bytes");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() >= (n + chunk - 1) / chunk,
              who, ": scales must be a contiguous float32 tensor of ceil(n/chunk) elements");
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu(), who, ": tensors must be on the CPU");
}

void pack(const at::Tensor& x, int64_t chunk, int64_t scale_mode, const at::Tensor& packed, const at::Tensor& scales,
          int64_t num_threads) {
  TORCH_CHECK(x.device().is_cpu(), "sign_pack: x must be on the CPU");
  lz::check_dense(x, "sign_pack x");
  check_buffers(packed, scales, x.numel(), chunk, "sign_pack");
  const int err = lz_sign_pack_cpu(x.data_ptr(), lz::dtype_code(x, "sign_pack x"), x.numel(), chunk, (int)scale_mode,
                                   packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), (int)num_threads);
  TORCH_CHECK(err == 0, "sign_pack: invalid arguments");
}

void unpack(const at::Tensor& packed, const at::Tensor& scales, int64_t chunk, const at::Tensor& out,
            int64_t num_threads) {
  TORCH_CHECK(out.device().is_cpu(), "sign_unpack: out must be on the CPU");
  lz::check_dense(out, "sign_unpack out");
  check_buffers(packed, scales, out.numel(), chunk, "sign_unpack");
  const int err = lz_sign_unpack_cpu(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.numel(), chunk,
                                     out.data_ptr(), lz::dtype_code(out, "sign_unpack out"), (int)num_threads);
  TORCH_CHECK(err == 0, "sign_unpack: invalid arguments");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_zero sign packing with per-chunk scales (CPU)";
  m.def("pack", &pack, "Pack signs of x into packed, chunk scales into scales", pybind11::arg("x"),
        pybind11::arg("chunk"), pybind11::arg("scale_mode"), pybind11::arg("packed"), pybind11::arg("scales"),
        pybind11::arg("num_threads") = 0);
  m.def("unpack", &unpack, "Write scale * (+-1) for every element of out", pybind11::arg("packed"),
        pybind11::arg("scales"), pybind11::arg("chunk"), pybind11::arg("out"), pybind11::arg("num_threads") = 0);
}
