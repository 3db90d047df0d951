// DFlash 2's grouped dynamic causal convolution: grouped_dyn_conv, and conv_add_rms_norm_ (the
// convolution after a sublayer, the residual add and the next RMSNorm in one kernel)
// (dflash_ops/ops/conv.py).
//
//   y[t, c] = sum over o < K with t % B >= o of (base[o, c] + dynamic[t, o, c / G]) * x[t - o, c]
//
// fp32 math in the reference's order (w = base + dyn, then acc + w * x, each rounded to fp32),
// one rounding to x's dtype at the end. x is [T, H] with unit stride in H and any row stride;
// dynamic [T, K, H / G] with unit stride in its last dim (a strided half of DFlash 2's
// [T, 2, K, G] projection is taken as it is); base [K, H] with unit stride in H; y a new
// contiguous [T, H].
// One kernel, a streaming one: a thread owns VEC channels (16 bytes when the strides and
// pointers allow) of ROWS consecutive rows and walks them in order, so the rows t - o it reads
// for the later taps are the ones it read just before (L1 hits: x comes from DRAM once). When
// the VEC channels share one group (G % VEC == 0) a tap's dynamic weight is one load.
// ROWS is 8 from kWalkFrom rows on and 1 below: the walk's rows are a chain of dependent load
// round trips (each row's loads wait for the previous row's), which at the drafter's T <= 512
// left the grid too small to hide them (9.6 us at T 64 on the H200 against Triton's 3.5; at
// T >= 4096 the walk ran at 65-74% of copy and beat Triton).
// Grid (row chunks, channel chunks of 128 threads): from the shapes only, graph-capturable.
#include "dflash_ops.h"

#include "checks.h"
#include "register.h"
#include "common.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace dflash_ops {
namespace {

using namespace detail;  // common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

struct ConvParams {
  const void* x;      // row t at x + t * sx
  const void* dyn;    // dynamic[t, o, g] at dyn + t * sd_t + o * sd_k + g
  const void* base;   // base[o, c] at base + o * sb + c
  void* y;            // [T, H] contiguous
  int64_t rows, h, sx, sd_t, sd_k, sb;
  int k, block, group;
};

constexpr int kThreads = 128;
constexpr int kWalkRows = 8;     // rows a thread walks from kWalkFrom rows on (else 1)
constexpr int64_t kWalkFrom = 2048;

template <class E, int VEC, bool ONE_GROUP, int ROWS>
__global__ void __launch_bounds__(kThreads) grouped_dyn_conv_kernel(const ConvParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using Bits = typename E::Bits;
  using P = Pack<Bits, VEC>;
  const int64_t c = (int64_t(blockIdx.y) * kThreads + threadIdx.x) * VEC;
  if (c >= p.h) return;
  const int64_t t0 = int64_t(blockIdx.x) * ROWS;
  const Bits* xb = static_cast<const Bits*>(p.x);
  const Bits* db = static_cast<const Bits*>(p.dyn);
  const Bits* bb = static_cast<const Bits*>(p.base);
  Bits* yb = static_cast<Bits*>(p.y);
  const int g0 = static_cast<int>(c) / p.group;  // H < 2^31 (checked)
  for (int r = 0; r < ROWS; ++r) {
    const int64_t t = t0 + r;
    if (t >= p.rows) break;
    const int pos = static_cast<int>(t) % p.block;  // T < 2^31 (checked)
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    const int taps = pos + 1 < p.k ? pos + 1 : p.k;  // no tap before the block's first row
    for (int o = 0; o < taps; ++o) {
      const P xv = load_pack_ro<P>(xb + (t - o) * p.sx + c);
      const P bv = load_pack_ro<P>(bb + o * p.sb + c);
      const Bits* drow = db + t * p.sd_t + o * p.sd_k;
      if (ONE_GROUP) {
        const float d = E::to_float(__ldg(drow + g0));
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float w = __fadd_rn(E::to_float(bv.e[v]), d);
          acc[v] = __fadd_rn(acc[v], __fmul_rn(w, E::to_float(xv.e[v])));
        }
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float d = E::to_float(__ldg(drow + (static_cast<int>(c) + v) / p.group));
          const float w = __fadd_rn(E::to_float(bv.e[v]), d);
          acc[v] = __fadd_rn(acc[v], __fmul_rn(w, E::to_float(xv.e[v])));
        }
      }
    }
    P out;
#pragma unroll
    for (int v = 0; v < VEC; ++v) out.e[v] = E::from_float(acc[v]);
    store_pack(yb + t * p.h + c, out);
  }
}

// conv_add_rms_norm_: one block a row; each thread owns VEC channels at a time (stride the
// block), convolves them as above (rounded to the dtype), adds them into the residual row
// (rounded, stored) and sums their squares; a block reduction gives rstd; then the thread's
// own residual channels again (its own stores: no barrier needed for them) for the output,
// RMSNorm's numerics (fp32 rstd, cast, times the weight, rounded).
struct ConvNormParams {
  ConvParams c;       // x, dyn, base, y = out, rows, h, strides, k, block, group
  void* res;          // residual row t at res + t * sr; the output row t at c.y + t * so
  const void* w;      // [H]
  int64_t sr, so;
  float eps, inv_h;
  int trigger;        // the grid is one wave: let the next grid launch right after the wait
};

constexpr int kNormThreads = 256;

__device__ __forceinline__ float block_sum(float v, float* smem) {  // blockDim.x % 32 == 0
  v = warp_sum(v);  // common.cuh: the same butterfly (16, 8, 4, 2, 1)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < warps; ++i) s += smem[i];
  return s;
}

// Row t's channels [c, c + VEC): their convolution over the row's `taps` taps (rounded to the
// dtype) added into r, the residual pack (rounded); returns the new residual's sum of squares.
template <class E, int VEC, bool ONE_GROUP, class P>
__device__ __forceinline__ float conv_add_pack(const ConvParams& p, int64_t t, int taps,
                                               int64_t c, P& r) {
  using Bits = typename E::Bits;
  const Bits* xb = static_cast<const Bits*>(p.x);
  const Bits* bb = static_cast<const Bits*>(p.base);
  const Bits* db = static_cast<const Bits*>(p.dyn) + t * p.sd_t;
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
  for (int o = 0; o < taps; ++o) {
    const P xv = load_pack_ro<P>(xb + (t - o) * p.sx + c);
    const P bv = load_pack_ro<P>(bb + o * p.sb + c);
    const Bits* drow = db + o * p.sd_k;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int g = ONE_GROUP ? static_cast<int>(c) / p.group
                              : (static_cast<int>(c) + v) / p.group;
      const float w = __fadd_rn(E::to_float(bv.e[v]), E::to_float(__ldg(drow + g)));
      acc[v] = __fadd_rn(acc[v], __fmul_rn(w, E::to_float(xv.e[v])));
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const float conv = E::to_float(E::from_float(acc[v]));  // c rounded to the dtype
    r.e[v] = E::from_float(__fadd_rn(E::to_float(r.e[v]), conv));
    const float rf = E::to_float(r.e[v]);
    ss = __fmaf_rn(rf, rf, ss);
  }
  return ss;
}

// RMSNorm's output numerics: (residual * rstd) rounded, times the weight, rounded.
template <class E, int VEC>
__device__ __forceinline__ Pack<typename E::Bits, VEC> norm_pack(
    const Pack<typename E::Bits, VEC>& r, const Pack<typename E::Bits, VEC>& w, float rstd) {
  Pack<typename E::Bits, VEC> out;
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const float n = E::to_float(E::from_float(__fmul_rn(E::to_float(r.e[v]), rstd)));
    out.e[v] = E::from_float(__fmul_rn(n, E::to_float(w.e[v])));
  }
  return out;
}

template <class E, int VEC, bool ONE_GROUP>
__global__ void __launch_bounds__(kNormThreads) conv_add_rms_norm_kernel(const ConvNormParams q) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  if (q.trigger) pdl_trigger();  // one wave: the next grid (the kernel projection's split-K
  // GEMM, which prefetches its weight before its own wait) launches while this one runs
  using Bits = typename E::Bits;
  using P = Pack<Bits, VEC>;
  __shared__ float smem[kNormThreads / 32];
  const ConvParams& p = q.c;
  const int64_t t = blockIdx.x;
  const int pos = static_cast<int>(t % p.block);
  const int taps = pos + 1 < p.k ? pos + 1 : p.k;
  Bits* rb = static_cast<Bits*>(q.res) + t * q.sr;
  float ss = 0.0f;
  for (int64_t c = int64_t(threadIdx.x) * VEC; c < p.h; c += int64_t(kNormThreads) * VEC) {
    P r = load_pack<P>(rb + c);
    ss += conv_add_pack<E, VEC, ONE_GROUP>(p, t, taps, c, r);
    store_pack(rb + c, r);
  }
  const float rstd = rsqrtf(block_sum(ss, smem) * q.inv_h + q.eps);
  const Bits* wb = static_cast<const Bits*>(q.w);
  Bits* ob = static_cast<Bits*>(p.y) + t * q.so;
  for (int64_t c = int64_t(threadIdx.x) * VEC; c < p.h; c += int64_t(kNormThreads) * VEC) {
    store_pack(ob + c, norm_pack<E, VEC>(load_pack<P>(rb + c), load_pack_ro<P>(wb + c), rstd));
  }
}

// The same with the row in registers: blockDim.x threads (a multiple of 32, at most 1024) own
// NV vectors each (vector i of a thread: threadIdx.x + i * blockDim.x), so the residual row is
// loaded once and the output needs no second pass over memory (the weight's loads issue before
// the reduction). One load round trip, one block reduction, one store: at the drafter's T 8-64
// rows the loop kernel above waits on a chain of them (three 2048-channel passes, then the
// residual again).
template <class E, int VEC, bool ONE_GROUP, int NV>
__global__ void __launch_bounds__(1024) conv_add_rms_norm_reg_kernel(const ConvNormParams q) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  if (q.trigger) pdl_trigger();  // one wave: the next grid (the kernel projection's split-K
  // GEMM, which prefetches its weight before its own wait) launches while this one runs
  using Bits = typename E::Bits;
  using P = Pack<Bits, VEC>;
  __shared__ float smem[32];
  const ConvParams& p = q.c;
  const int64_t t = blockIdx.x;
  const int pos = static_cast<int>(t % p.block);
  const int taps = pos + 1 < p.k ? pos + 1 : p.k;
  const Bits* wb = static_cast<const Bits*>(q.w);
  Bits* rb = static_cast<Bits*>(q.res) + t * q.sr;
  P r[NV], wv[NV];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = (int64_t(threadIdx.x) + int64_t(i) * blockDim.x) * VEC;
    if (c >= p.h) continue;
    r[i] = load_pack<P>(rb + c);
    wv[i] = load_pack_ro<P>(wb + c);
    ss += conv_add_pack<E, VEC, ONE_GROUP>(p, t, taps, c, r[i]);
    store_pack(rb + c, r[i]);
  }
  const float rstd = rsqrtf(block_sum(ss, smem) * q.inv_h + q.eps);
  Bits* ob = static_cast<Bits*>(p.y) + t * q.so;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = (int64_t(threadIdx.x) + int64_t(i) * blockDim.x) * VEC;
    if (c < p.h) store_pack(ob + c, norm_pack<E, VEC>(r[i], wv[i], rstd));
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

template <class E, int VEC, bool ONE_GROUP, int ROWS>
void launch_rows(const ConvParams& p, cudaStream_t stream) {
  const int64_t nvec = p.h / VEC;
  const int64_t chunks = (nvec + kThreads - 1) / kThreads;
  const int64_t row_chunks = (p.rows + ROWS - 1) / ROWS;
  TORCH_CHECK_VALUE(chunks <= 65535 && row_chunks <= std::numeric_limits<int32_t>::max(),
                    "dflash.grouped_dyn_conv: x of ", p.rows, " rows of ", p.h,
                    " is too large for one launch");
  const dim3 grid(static_cast<unsigned>(row_chunks), static_cast<unsigned>(chunks));
  launch_kernel(grouped_dyn_conv_kernel<E, VEC, ONE_GROUP, ROWS>, grid, kThreads, 0, stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class E, int VEC, bool ONE_GROUP>
void launch(const ConvParams& p, cudaStream_t stream) {
  if (p.rows >= kWalkFrom) {
    launch_rows<E, VEC, ONE_GROUP, kWalkRows>(p, stream);
  } else {
    launch_rows<E, VEC, ONE_GROUP, 1>(p, stream);
  }
}

template <class E>
void run(const ConvParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(typename E::Bits));
  // 16-byte vectors: H, the row strides of x and base on vector boundaries, the pointers on
  // 16-byte boundaries (y is a fresh allocation)
  const bool vec = p.h % kVec == 0 && p.sx % kVec == 0 && p.sb % kVec == 0 &&
                   aligned16(p.x) && aligned16(p.base) && aligned16(p.y);
  if (vec && p.group % kVec == 0) {
    launch<E, kVec, true>(p, stream);
  } else if (vec) {
    launch<E, kVec, false>(p, stream);
  } else {
    launch<E, 1, true>(p, stream);
  }
}

template <class E, int VEC, int NV>
void launch_reg(bool one_group, dim3 grid, unsigned threads, cudaStream_t stream,
                const ConvNormParams& q) {
  if (one_group) launch_kernel(conv_add_rms_norm_reg_kernel<E, VEC, true, NV>, grid, threads, 0,
                               stream, q);
  else launch_kernel(conv_add_rms_norm_reg_kernel<E, VEC, false, NV>, grid, threads, 0, stream, q);
}

template <class E>
void run_norm(const ConvNormParams& q, cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(typename E::Bits));
  const ConvParams& p = q.c;
  const bool vec = p.h % kVec == 0 && p.sx % kVec == 0 && p.sb % kVec == 0 &&
                   q.sr % kVec == 0 && q.so % kVec == 0 && aligned16(p.x) && aligned16(p.base) &&
                   aligned16(p.y) &&
                   aligned16(q.res) && aligned16(q.w);
  const dim3 grid(static_cast<unsigned>(p.rows));
  // the row in registers where it fits (<= 2 vectors a thread of 1024: 4 spilled under the
  // 64-register cap of 1024-thread blocks), else the loop kernel
  const int64_t vectors = vec ? (p.h + kVec - 1) / kVec : p.h;
  const int64_t threads = std::min<int64_t>(1024, (vectors + 31) / 32 * 32);
  const int64_t nv = (vectors + threads - 1) / threads;
  if (vec && nv <= 2) {
    const unsigned th = static_cast<unsigned>(threads);
    if (nv == 1) launch_reg<E, kVec, 1>(p.group % kVec == 0, grid, th, stream, q);
    else launch_reg<E, kVec, 2>(p.group % kVec == 0, grid, th, stream, q);
  } else if (vec && p.group % kVec == 0) {
    launch_kernel(conv_add_rms_norm_kernel<E, kVec, true>, grid, kNormThreads, 0, stream, q);
  } else if (vec) {
    launch_kernel(conv_add_rms_norm_kernel<E, kVec, false>, grid, kNormThreads, 0, stream, q);
  } else {
    launch_kernel(conv_add_rms_norm_kernel<E, 1, true>, grid, kNormThreads, 0, stream, q);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// the order and messages of dflash_ops/ops/conv.py _check
void check_conv(const char* op, const at::Tensor& x, const at::Tensor& dynamic,
                const at::Tensor& base, int64_t group_size, int64_t block_size) {
  check_cuda(op, "x", x);
  check_rank(op, "x", x, 2);
  check_float(op, "x", x);
  check_last_dim(op, "x", x);
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK_VALUE(group_size >= 1 && h % group_size == 0, "dflash.", op,
                    ": group_size must be a positive divisor of H = ", h, ", got ", group_size);
  TORCH_CHECK_VALUE(block_size >= 1, "dflash.", op, ": block_size must be >= 1, got ",
                    block_size);
  TORCH_CHECK_VALUE(t % block_size == 0, "dflash.", op, ": x's ", t,
                    " rows must be whole blocks of block_size = ", block_size);
  check_rank(op, "base", base, 2);
  check_device(op, "base", base, x.device());
  check_last_dim(op, "base", base);
  check_same_dtype(op, "base", base, "x", x);
  const int64_t k = base.size(0);
  TORCH_CHECK_VALUE(k >= 1 && base.size(1) == h, "dflash.", op, ": base must be [K >= 1, H = ",
                    h, "], got ", py_list(base.sizes()));
  const int64_t groups = h / group_size;
  check_rank(op, "dynamic", dynamic, 3);
  check_device(op, "dynamic", dynamic, x.device());
  check_shape(op, "dynamic", dynamic, {t, k, groups});
  check_last_dim(op, "dynamic", dynamic);
  check_same_dtype(op, "dynamic", dynamic, "x", x);
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(k <= kMax32 && block_size <= kMax32 && t <= kMax32 && h <= kMax32, "dflash.",
                    op, ": x [", t, ", ", h, "], K = ", k, " or block_size = ", block_size,
                    " is too large (each at most 2^31 - 1)");
}

ConvParams conv_params(const at::Tensor& x, const at::Tensor& dynamic, const at::Tensor& base,
                       int64_t group_size, int64_t block_size, at::Tensor& y) {
  ConvParams p{};
  p.x = x.data_ptr();
  p.dyn = dynamic.data_ptr();
  p.base = base.data_ptr();
  p.y = y.data_ptr();
  p.sx = x.stride(0);
  p.sd_t = dynamic.stride(0);
  p.sd_k = dynamic.stride(1);
  p.sb = base.stride(0);
  p.rows = x.size(0);
  p.h = x.size(1);
  p.k = static_cast<int>(base.size(0));
  p.block = static_cast<int>(block_size);
  p.group = static_cast<int>(group_size);
  return p;
}

}  // namespace

at::Tensor grouped_dyn_conv(const at::Tensor& x, const at::Tensor& dynamic,
                            const at::Tensor& base, int64_t group_size, int64_t block_size) {
  check_conv("grouped_dyn_conv", x, dynamic, base, group_size, block_size);
  const int64_t t = x.size(0), h = x.size(1);
  at::Tensor y = at::empty({t, h}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (t == 0 || h == 0) return y;
  const ConvParams p = conv_params(x, dynamic, base, group_size, block_size, y);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  switch (x.scalar_type()) {
    case at::kBFloat16: run<BF16>(p, stream); break;
    case at::kHalf: run<F16>(p, stream); break;
    default: run<F32>(p, stream); break;
  }
  return y;
}

void conv_add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& dynamic,
                        const at::Tensor& base, int64_t group_size, int64_t block_size,
                        const at::Tensor& weight, double eps, at::Tensor& out) {
  constexpr const char* op = "conv_add_rms_norm_";
  // the order and messages of dflash_ops/ops/conv.py _check_norm
  check_conv(op, x, dynamic, base, group_size, block_size);
  const int64_t t = x.size(0), h = x.size(1);
  check_rank(op, "residual", residual, 2);
  check_device(op, "residual", residual, x.device());
  check_last_dim(op, "residual", residual);
  check_same_dtype(op, "residual", residual, "x", x);
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "dflash.", op,
                    ": residual must have the shape of x ", py_list(x.sizes()), ", got ",
                    py_list(residual.sizes()));
  check_rank(op, "weight", weight, 1);
  check_device(op, "weight", weight, x.device());
  check_last_dim(op, "weight", weight);
  check_same_dtype(op, "weight", weight, "x", x);
  TORCH_CHECK_VALUE(weight.size(0) == h, "dflash.", op, ": weight must be [H = ", h, "], got ",
                    py_list(weight.sizes()));
  check_eps(op, eps);
  check_rank(op, "out", out, 2);
  check_device(op, "out", out, x.device());
  check_last_dim(op, "out", out);
  check_same_dtype(op, "out", out, "x", x);
  TORCH_CHECK_VALUE(out.sizes() == x.sizes(), "dflash.", op, ": out must have the shape of x ",
                    py_list(x.sizes()), ", got ", py_list(out.sizes()));
  check_no_overlap(op, "residual", residual, "x", x);
  check_no_overlap(op, "out", out, "x", x);
  check_no_overlap(op, "out", out, "residual", residual);
  if (t == 0 || h == 0) return;
  ConvNormParams q{};
  q.c = conv_params(x, dynamic, base, group_size, block_size, out);
  q.res = residual.data_ptr();
  q.w = weight.data_ptr();
  q.sr = residual.stride(0);
  q.so = out.stride(0);
  q.eps = static_cast<float>(eps);
  q.inv_h = 1.0f / static_cast<float>(h);
  const c10::cuda::CUDAGuard guard(x.device());
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()));
  q.trigger = t <= sms;  // a CTA a row
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  switch (x.scalar_type()) {
    case at::kBFloat16: run_norm<BF16>(q, stream); break;
    case at::kHalf: run_norm<F16>(q, stream); break;
    default: run_norm<F32>(q, stream); break;
  }
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("grouped_dyn_conv", TORCH_FN(dflash_ops::grouped_dyn_conv));
  m.impl("conv_add_rms_norm_", TORCH_FN(dflash_ops::conv_add_rms_norm_));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
