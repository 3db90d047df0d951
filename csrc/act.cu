// SwiGLU: silu_mul, PyTorch's rounding order (bit for bit F.silu(gate) * up).
//
//   s = T(g / (1 + expf(-g)))      g = float(x[r, c]), as ATen's CUDA silu kernel computes it
//   y = T(float(s) * float(u))     u = float(x[r, I + c]); T() rounds to x's dtype
//
// x is [..., 2*I] with unit stride in the last dim and leading dims that merge into one strided
// dim of rows (row r at r * row_stride elements); y is a new contiguous [..., I].
// One kernel: a block of 256 threads covers 256 / TPR rows x TPR vectors of columns, TPR (a
// power of two <= 256) lanes per row; grid = (row blocks, column chunks of TPR vectors). A
// thread loads one gate vector and the up vector I columns further, writes one output vector.
// Vectors are 16 bytes when I, the row stride and x's base pointer allow, else single elements.
// expf and the division are the precise ones (no fast math): they must match ATen's kernel.
#include "dflash_ops.h"

#include "checks.h"
#include "register.h"
#include "common.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

namespace dflash_ops {
namespace {

using namespace detail;  // common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

struct SiluMulParams {
  const void* x;       // row r at x + r * row_stride: gate [0, I), up [I, 2I)
  void* y;             // [rows, I] contiguous
  int64_t rows;
  int64_t row_stride;  // elements
  int64_t inner;       // I
};

constexpr int kBlock = 256;

template <class E>
__device__ __forceinline__ typename E::Bits silu_mul_one(typename E::Bits g, typename E::Bits u) {
  const float gf = E::to_float(g);
  const float s = E::to_float(E::from_float(gf / (1.0f + expf(-gf))));
  return E::from_float(s * E::to_float(u));
}

// VEC elements a thread; 2^tpr_log2 threads per row.
template <class E, int VEC>
__global__ void __launch_bounds__(kBlock) silu_mul_kernel(const SiluMulParams p,
                                                          const int tpr_log2) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using Bits = typename E::Bits;
  using P = Pack<Bits, VEC>;
  const int64_t row =
      int64_t(blockIdx.x) * (kBlock >> tpr_log2) + (threadIdx.x >> tpr_log2);
  const int lane = static_cast<int>(threadIdx.x) & ((1 << tpr_log2) - 1);
  const int64_t col = ((int64_t(blockIdx.y) << tpr_log2) + lane) * VEC;
  if (row >= p.rows || col >= p.inner) return;
  const Bits* xp = static_cast<const Bits*>(p.x) + row * p.row_stride + col;
  const P g = load_pack_ro<P>(xp);
  const P u = load_pack_ro<P>(xp + p.inner);
  P o;
#pragma unroll
  for (int k = 0; k < VEC; ++k) o.e[k] = silu_mul_one<E>(g.e[k], u.e[k]);
  store_pack(static_cast<Bits*>(p.y) + row * p.inner + col, o);
}

// ---------------------------------------------------------------------------------------------
// Host side.

// (rows, row stride) of x seen as [rows, 2*I]: the leading dims after dropping size-1 dims must
// merge into one (dflash_ops/ops/act.py rows_of, same message).
void rows_of(const char* op, const at::Tensor& x, int64_t& rows, int64_t& row_stride) {
  const int64_t d = x.size(-1);
  int64_t n = 0, st = 0;
  int dims = 0;
  for (int64_t i = 0; i < x.dim() - 1; ++i) {
    const int64_t s = x.size(i);
    if (s == 0) {
      rows = 0;
      row_stride = d;
      return;
    }
    if (s == 1) continue;
    if (dims > 0 && st == x.stride(i) * s) {
      n *= s;
      st = x.stride(i);
    } else {
      ++dims;
      n = s;
      st = x.stride(i);
    }
  }
  TORCH_CHECK_VALUE(dims <= 1, "dflash.", op, ": x must be viewable as [rows, ", d,
                    "] with one row stride (leading dims that merge), got shape ",
                    py_list(x.sizes()), " with strides ", py_list(x.strides()), "; pass ",
                    "x.contiguous()");
  rows = dims ? n : 1;
  row_stride = dims ? st : d;
}

template <class E, int VEC>
void launch(const SiluMulParams& p, cudaStream_t stream) {
  const int64_t nvec = p.inner / VEC;
  int tpr_log2 = 0;
  while (tpr_log2 < 8 && (int64_t{1} << tpr_log2) < nvec) ++tpr_log2;
  const int64_t rows_per_block = kBlock >> tpr_log2;
  const int64_t row_blocks = (p.rows + rows_per_block - 1) / rows_per_block;
  const int64_t col_chunks = (nvec + (int64_t{1} << tpr_log2) - 1) >> tpr_log2;
  TORCH_CHECK_VALUE(col_chunks <= 65535 && row_blocks <= std::numeric_limits<int32_t>::max(),
                    "dflash.silu_mul: x of ", p.rows, " rows of ", 2 * p.inner,
                    " is too large for one launch");
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(col_chunks));
  launch_kernel(silu_mul_kernel<E, VEC>, grid, kBlock, 0, stream, p, tpr_log2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class E>
void run(const SiluMulParams& p, int elem_size, cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(typename E::Bits));
  // 16-byte vectors: every row start, the up half and the output rows on 16-byte boundaries
  // (y is a fresh allocation, so aligned).
  const bool vec16 = (p.inner * elem_size) % 16 == 0 && p.row_stride % kVec == 0 &&
                     aligned16(p.x) && aligned16(p.y);
  if (vec16) {
    launch<E, kVec>(p, stream);
  } else {
    launch<E, 1>(p, stream);
  }
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& x) {
  constexpr const char* op = "silu_mul";
  // x: [..., 2*I] bf16/fp16/fp32 on CUDA, unit stride in the last dim (checks.h; the order of
  // dflash_ops/ops/act.py)
  check_cuda(op, "x", x);
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1, "dflash.", op, ": x must have rank >= 1, got a 0-d tensor");
  check_last_dim(op, "x", x);
  const int64_t d = x.size(-1);
  TORCH_CHECK_VALUE(d % 2 == 0 && d > 0, "dflash.", op,
                    ": x must have an even last dim 2*I with I >= 1 (gate then up), got ", d,
                    " (shape ", py_list(x.sizes()), ")");
  int64_t rows = 0, row_stride = 0;
  rows_of(op, x, rows, row_stride);

  c10::SmallVector<int64_t, 8> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d / 2;
  at::Tensor out = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (rows == 0) return out;

  SiluMulParams p{};
  p.x = x.data_ptr();
  p.y = out.data_ptr();
  p.rows = rows;
  p.row_stride = row_stride;
  p.inner = d / 2;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  const int es = static_cast<int>(x.element_size());
  switch (x.scalar_type()) {
    case at::kBFloat16: run<BF16>(p, es, stream); break;
    case at::kHalf: run<F16>(p, es, stream); break;
    default: run<F32>(p, es, stream); break;
  }
  return out;
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("silu_mul", TORCH_FN(dflash_ops::silu_mul));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
