// Helpers for bindings of the torch-free CUDA kernels (no CUDA header needed:
// streams arrive from Python as integers, see torch.cuda.Stream.cuda_stream).
#ifndef LZ_CUDA_BINDING_H_
#define LZ_CUDA_BINDING_H_

#include <optional>
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

}  // namespace lz

#endif  // LZ_CUDA_BINDING_H_
