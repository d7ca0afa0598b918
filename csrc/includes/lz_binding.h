// Helpers shared by the thin torch bindings (tensor -> pointer, dtype codes).
//
// Why these headers only: <torch/extension.h> pulls in all of ATen's operator
// declarations (40 s per file on a 2-core CI machine); the bindings need the
// Tensor class, TORCH_CHECK and pybind11's tensor caster, nothing more. No
// c10/cuda header is included anywhere: the CPU torch wheel does not ship them.
#ifndef LZ_BINDING_H_
#define LZ_BINDING_H_

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "lz_common.h"

namespace lz {

inline int dtype_code(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return LZ_FLOAT32;
    case at::kBFloat16: return LZ_BFLOAT16;
    case at::kHalf: return LZ_FLOAT16;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", t.scalar_type(), " (float32/bfloat16/float16 only)");
  }
  return -1;
}

inline void check_dense(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

inline void check_same_numel(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.numel() == b.numel(), what, ": numel ", b.numel(), " != ", a.numel());
}

}  // namespace lz

#endif  // LZ_BINDING_H_
