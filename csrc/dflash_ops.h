// dflash_ops: the CUDA kernels of torch.ops.dflash, callable from C++.
//
// The op schemas are defined in Python (dflash_ops/ops/*.py); csrc/registration.cpp registers
// these functions as their CUDA kernels. C++ users linking the CMake library `dflash_ops` can
// call them directly. Every function validates its arguments (TORCH_CHECK_VALUE, which Python
// sees as ValueError) before any kernel runs, launches on the current CUDA stream, never
// synchronises, and is safe inside CUDA-graph capture.
#pragma once

#include <ATen/core/Tensor.h>

namespace dflash_ops {

// rms_norm(Tensor x, Tensor weight, float eps) -> Tensor
//   x: [..., D] bf16/fp16/fp32, any strides with unit stride in the last dim
//   weight: [D], or [G, D] with x of rank >= 3 [T, *inner, D] (row r of a token's R =
//   prod(inner) rows uses weight[r / (R / G)]); dtype of x
//   returns a new contiguous tensor of x's shape: T(float(T(x * rstd)) * float(w)), HF order
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()
//   in place: residual = T(residual + x); x = rms_norm(residual, weight, eps)
//   residual: x's shape and dtype, its own strides (unit stride in the last dim)
void fused_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps);

}  // namespace dflash_ops
