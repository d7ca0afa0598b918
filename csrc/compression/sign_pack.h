// C API of sign packing with per-chunk scales, the compressor of 1-bit Adam/LAMB.
//
// Layout (CPU and CUDA identical): `packed` is a flat bit array of ceil(n/8)
// bytes, bit k of byte j is the sign of element 8j+k (1 for x >= 0, including
// -0.0; 0 for x < 0 and NaN); pad bits of the last byte are 0. Elements are cut
// into chunks of `chunk` (a positive multiple of 8, so chunks start on byte
// boundaries and can be sent separately); scales[c] is the RMS (LZ_SCALE_RMS)
// or mean |x| (LZ_SCALE_MEAN_ABS) of chunk c. Unpacking writes scale * (+-1).
// Functions return 0 on success, nonzero (a cudaError_t for CUDA) on error.
#ifndef LZ_SIGN_PACK_H_
#define LZ_SIGN_PACK_H_

#include <stdint.h>

#include "lz_common.h"

#ifdef __cplusplus
extern "C" {
#endif

int lz_sign_pack_cpu(const void* x, int dtype, int64_t n, int64_t chunk, int scale_mode, uint8_t* packed,
                     float* scales, int num_threads);
int lz_sign_unpack_cpu(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk, void* out, int dtype,
                       int num_threads);

// Device workspace (floats) lz_sign_pack_cuda needs.
int64_t lz_sign_pack_workspace_floats(int64_t n, int64_t chunk);
int lz_sign_pack_cuda(const void* x, int dtype, int64_t n, int64_t chunk, int scale_mode, uint8_t* packed,
                      float* scales, float* workspace, int64_t workspace_floats, int device, void* stream);
int lz_sign_unpack_cuda(const uint8_t* packed, const float* scales, int64_t n, int64_t chunk, void* out, int dtype,
                        int device, void* stream);
const char* lz_sign_pack_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif  // LZ_SIGN_PACK_H_
