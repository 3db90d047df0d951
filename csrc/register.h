// Registering a family's C++ kernels with the dispatcher. Schemas live in Python
// (dflash_ops/ops/<family>.py); each csrc/<family>.cu ends with
//   static void register_kernels(torch::Library& m) {
//     m.impl("<op>", TORCH_FN(dflash_ops::<op>)); ... }
//   DFLASH_OPS_REGISTER_CUDA(register_kernels)
// which registers every kernel twice: as the CUDA kernel of torch.ops.dflash.<op> (the dispatcher
// calls it with no Python in between where the C++ kernel is the op's choice), and as the CUDA
// kernel of torch.ops.dflash_cuda.<op>, the same function under its own name, which the Python
// router calls where the choice depends on the call (an eager call vs one captured into a CUDA
// graph; dflash_ops/dispatch.py).
#pragma once

#include <torch/library.h>

#define DFLASH_OPS_REGISTER_CUDA(fn)                 \
  TORCH_LIBRARY_IMPL(dflash, CUDA, m) { fn(m); }     \
  TORCH_LIBRARY_IMPL(dflash_cuda, CUDA, m) { fn(m); }
