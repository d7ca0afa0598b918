// Python binding of CUDA sign packing: checks tensors, passes pointers.
//
// Compiled by torch's JIT without CUDA; the kernels come from sign_pack.cu
// compiled by nvcc (see [Note: torch-free CUDA kernels] in ops/builder.py).
#include "lz_cuda_binding.h"
#include "sign_pack.h"

namespace {

void check_buffers(const at::Tensor& packed, const at::Tensor& scales, int64_t n, int64_t chunk, const char* who) {
  TORCH_CHECK(chunk > 0 && chunk % 8 == 0, who, ": chunk must be a positive multiple of 8, got ", chunk);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() >= (n + 7) / 8, who,
              ": packed must be a contiguous uint8 tensor of ceil(n/8) bytes");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() >= (n + chunk - 1) / chunk,
              who, ": scales must be a contiguous float32 tensor of ceil(n/chunk) elements");
}

int64_t workspace_floats(int64_t n, int64_t chunk) { return lz_sign_pack_workspace_floats(n, chunk); }

void pack(const at::Tensor& x, int64_t chunk, int64_t scale_mode, const at::Tensor& packed, const at::Tensor& scales,
          const at::Tensor& workspace, int64_t stream) {
  lz::check_dense(x, "sign_pack x");
  check_buffers(packed, scales, x.numel(), chunk, "sign_pack");
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous(), "sign_pack: bad workspace");
  const int device = lz::common_cuda_device({&x, &packed, &scales, &workspace}, "sign_pack");
  const int err = lz_sign_pack_cuda(x.data_ptr(), lz::dtype_code(x, "sign_pack x"), x.numel(), chunk, (int)scale_mode,
                                    packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), workspace.data_ptr<float>(),
                                    workspace.numel(), device, lz::as_stream(stream));
  TORCH_CHECK(err == 0, "sign_pack: ", lz_sign_pack_error_string(err));
}

void unpack(const at::Tensor& packed, const at::Tensor& scales, int64_t chunk, const at::Tensor& out, int64_t stream) {
  lz::check_dense(out, "sign_unpack out");
  check_buffers(packed, scales, out.numel(), chunk, "sign_unpack");
  const int device = lz::common_cuda_device({&packed, &scales, &out}, "sign_unpack");
  const int err = lz_sign_unpack_cuda(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.numel(), chunk,
                                      out.data_ptr(), lz::dtype_code(out, "sign_unpack out"), device,
                                      lz::as_stream(stream));
  TORCH_CHECK(err == 0, "sign_unpack: ", lz_sign_pack_error_string(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_zero sign packing with per-chunk scales (CUDA)";
  m.def("workspace_floats", &workspace_floats, "float32 workspace elements pack needs");
  m.def("pack", &pack, "Pack signs of x into packed, chunk scales into scales", pybind11::arg("x"),
        pybind11::arg("chunk"), pybind11::arg("scale_mode"), pybind11::arg("packed"), pybind11::arg("scales"),
        pybind11::arg("workspace"), pybind11::arg("stream"));
  m.def("unpack", &unpack, "Write scale * (+-1) for every element of out", pybind11::arg("packed"),
        pybind11::arg("scales"), pybind11::arg("chunk"), pybind11::arg("out"), pybind11::arg("stream"));
}
