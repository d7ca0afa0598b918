// Plain-C definitions shared by every lightning_zero kernel, CPU and CUDA.
//
// Why plain C: the CUDA kernels are compiled torch-free (the CPU torch wheel
// has no generated c10/cuda headers), so the contract between a binding and a
// kernel is raw pointers, element counts and these small structs.
#ifndef LZ_COMMON_H_
#define LZ_COMMON_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element types a kernel can read or write. The binding maps torch dtypes to
// these codes; 0 also means "no buffer" where a buffer is optional.
enum lz_dtype {
  LZ_FLOAT32 = 0,
  LZ_BFLOAT16 = 1,
  LZ_FLOAT16 = 2,
};

// Hyper-parameters of one Adam/AdamW step over one parameter group.
// Bias corrections are computed by the caller (CPU) or from the device-side
// step counter (CUDA), so the struct carries only what the user configured.
// Doubles on purpose: 1 - beta2 computed from a float beta2 = 0.999f is off by
// 1.3e-5 relative, which shows after a few steps against a float64 reference.
typedef struct lz_adam_hparams {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int adamw_mode;  // 1: decoupled weight decay (AdamW); 0: L2 added to the gradient (Adam)
} lz_adam_hparams;

// Hyper-parameters of one LAMB step over one parameter group.
typedef struct lz_lamb_hparams {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;  // added to the Adam update before the trust ratio, as in the LAMB paper
  double max_coeff;     // trust ratio is clamped to [min_coeff, max_coeff]
  double min_coeff;
  int bias_correction;
} lz_lamb_hparams;

// How a sign-compression chunk's scale is computed.
enum lz_sign_scale {
  LZ_SCALE_RMS = 0,       // ||x||_2 / sqrt(n): what DeepSpeed's 1-bit Adam uses
  LZ_SCALE_MEAN_ABS = 1,  // ||x||_1 / n: the least-squares optimal scale for sign(x)
};

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // LZ_COMMON_H_
