// RMSNorm: rms_norm and fused_add_rms_norm_ (HF Qwen3RMSNorm rounding order).
//
//   rstd = rsqrt(mean(float(x)^2) + eps)
//   y    = T(float(T(float(x) * rstd)) * float(w))          T() rounds to x's dtype
//   fused: residual = T(float(residual) + float(x)); x = y(residual)
//
// x is [..., D] with any strides (unit stride in the last dim). The host merges mergeable
// leading dims and hands the kernel at most 3 (sizes + 64-bit strides); a logical row r (row
// major over all leading dims) is unravelled on the device. Three kernels:
//   rows:   D <= 128 vectors. TPR (a power of two <= 32) lanes per row, NV vectors per lane,
//           256-thread blocks (256 / TPR rows each), shuffle reduction inside the lane group.
//           D = 128 bf16: 8 lanes x 2 x 16-byte vectors, 32 rows per block.
//   block:  D up to 4096 vectors (bf16 D <= 32768 with 16-byte vectors). One row per block of
//           up to 512 threads, NV <= 8 vectors per thread, shuffle + shared-memory reduction.
//   generic: anything else (D beyond the register paths, >= 2^31 rows): one row per block at a
//           time, scalar, 64-bit index math, two passes over the row (the second from L2).
// Rows live in registers between the reduction and the write. Vectors are 16 bytes when D,
// every base pointer and every stride allow it, else single elements.
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

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>

namespace dflash_ops {
namespace {

using namespace detail;  // common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

struct NormParams {
  const void* x;    // rows of x, at xs offsets
  void* y;          // rms_norm: out, contiguous [rows, D]; fused: x itself (xs offsets)
  void* res;        // fused: residual, at rs offsets
  const void* w;    // [G, D], row stride w_stride (0 for a 1-D weight)
  int64_t xs[3];    // leading strides of x in elements, outermost first (sizes n0, n1, n2)
  int64_t rs[3];    // same for residual
  int64_t n1, n2;   // the two inner leading sizes (n0 = rows / (n1 * n2))
  int64_t rows;     // product of the leading sizes
  int64_t R;        // rows per token (weight groups repeat every R rows); 1 for a 1-D weight
  int64_t RG;       // rows per weight group, R / G
  int64_t w_stride;
  int64_t d;        // row length D
  FastDiv div_n1, div_n2, div_R, div_RG;  // valid when rows < 2^31 (rows / block kernels)
  float inv_d;      // 1 / D (mean = sum * inv_d)
  float eps;
};

// Element offsets of row `row` (< 2^31) in x, residual and y, and of its weight row.
template <bool ADD>
__host__ __device__ __forceinline__ void row_offsets32(const NormParams& p, uint32_t row,
                                                       int64_t& xoff, int64_t& roff,
                                                       int64_t& yoff, int64_t& woff) {
  const uint32_t q = p.div_n2.div(row);
  const uint32_t i2 = row - q * p.div_n2.d;
  const uint32_t i0 = p.div_n1.div(q);
  const uint32_t i1 = q - i0 * p.div_n1.d;
  xoff = int64_t(i0) * p.xs[0] + int64_t(i1) * p.xs[1] + int64_t(i2) * p.xs[2];
  if (ADD) {
    roff = int64_t(i0) * p.rs[0] + int64_t(i1) * p.rs[1] + int64_t(i2) * p.rs[2];
    yoff = xoff;
  } else {
    roff = 0;
    yoff = int64_t(row) * p.d;
  }
  const uint32_t tok = p.div_R.div(row);
  const uint32_t g = p.div_RG.div(row - tok * p.div_R.d);
  woff = int64_t(g) * p.w_stride;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the result. smem: 32 floats;
// a caller that reuses smem must __syncthreads() before the next call.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? smem[lane] : 0.f;
  return warp_sum(v);
}

// Loads the row's x (and residual) slots of this thread: vector c = j * stride + first, j < NV.
// With ADD, v becomes the rounded sum residual + x, written back to residual. Returns the
// partial sum of squares. Slots past the row end (or of an invalid row) hold zeros. PRE_W also
// loads the weight slots now (their latency hides under x's); else store_row loads them.
template <class E, int VEC, int NV, bool ADD, bool PRE_W>
__device__ __forceinline__ float load_row(const NormParams& p, bool valid, int64_t xoff,
                                          int64_t roff, int64_t woff, int first, int stride,
                                          Pack<typename E::Bits, VEC> (&v)[NV],
                                          Pack<typename E::Bits, VEC> (&w)[NV]) {
  using Bits = typename E::Bits;
  using P = Pack<Bits, VEC>;
  const int nvec = static_cast<int>(p.d / VEC);
  const Bits* xp = static_cast<const Bits*>(p.x) + xoff;
  const Bits* wp = static_cast<const Bits*>(p.w) + woff;
  Bits* rp = static_cast<Bits*>(p.res) + roff;
  P r[NV];
  // All loads first: the residual stores below could alias them as far as the compiler knows.
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = j * stride + first;
    if (valid && c < nvec) {
      v[j] = load_pack<P>(xp + int64_t(c) * VEC);
      if (ADD) r[j] = load_pack<P>(rp + int64_t(c) * VEC);
      if (PRE_W) w[j] = load_pack_ro<P>(wp + int64_t(c) * VEC);
    } else {
      v[j] = zero_pack<P>();
      if (ADD) r[j] = zero_pack<P>();
      if (PRE_W) w[j] = zero_pack<P>();
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (ADD) {
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        v[j].e[k] = E::from_float(E::to_float(r[j].e[k]) + E::to_float(v[j].e[k]));
      const int c = j * stride + first;
      if (valid && c < nvec) store_pack(rp + int64_t(c) * VEC, v[j]);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float f = E::to_float(v[j].e[k]);
      ss = fmaf(f, f, ss);
    }
  }
  return ss;
}

template <class E, int VEC, int NV, bool PRE_W>
__device__ __forceinline__ void store_row(const NormParams& p, bool valid, int64_t yoff,
                                          int64_t woff, int first, int stride, float rstd,
                                          const Pack<typename E::Bits, VEC> (&v)[NV],
                                          const Pack<typename E::Bits, VEC> (&w)[NV]) {
  using Bits = typename E::Bits;
  using P = Pack<Bits, VEC>;
  const int nvec = static_cast<int>(p.d / VEC);
  Bits* yp = static_cast<Bits*>(p.y) + yoff;
  const Bits* wp = static_cast<const Bits*>(p.w) + woff;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = j * stride + first;
    if (valid && c < nvec) {
      const P wj = PRE_W ? w[j] : load_pack_ro<P>(wp + int64_t(c) * VEC);
      P o;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float n = E::to_float(E::from_float(E::to_float(v[j].e[k]) * rstd));
        o.e[k] = E::from_float(n * E::to_float(wj.e[k]));
      }
      store_pack(yp + int64_t(c) * VEC, o);
    }
  }
}

constexpr int kRowsBlock = 256;

// rows kernel: a group of tpr = 2^tpr_log2 lanes per row, 256 / tpr rows per block, rows < 2^31.
template <class E, int VEC, int NV, bool ADD>
__global__ void __launch_bounds__(kRowsBlock)
rms_norm_rows_kernel(const NormParams p, const int tpr_log2) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using P = Pack<typename E::Bits, VEC>;
  const int tpr = 1 << tpr_log2;
  const int lane = threadIdx.x & (tpr - 1);
  const uint32_t row = blockIdx.x * (kRowsBlock >> tpr_log2) + (threadIdx.x >> tpr_log2);
  // Lanes of a row past the end stay to the shuffles (full mask) but touch no memory.
  const bool valid = int64_t(row) < p.rows;
  int64_t xoff = 0, roff = 0, yoff = 0, woff = 0;
  if (valid) row_offsets32<ADD>(p, row, xoff, roff, yoff, woff);
  P v[NV], w[NV];
  float ss = load_row<E, VEC, NV, ADD, true>(p, valid, xoff, roff, woff, lane, tpr, v, w);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1)
    if (o < tpr) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // xor < tpr stays in the group
  const float rstd = rsqrtf(ss * p.inv_d + p.eps);
  store_row<E, VEC, NV, true>(p, valid, yoff, woff, lane, tpr, rstd, v, w);
}

constexpr int kMaxBlock = 512;  // 128 registers a thread

// block kernel: one row per block (blockDim.x a multiple of 32, <= 512), NV vectors a thread.
template <class E, int VEC, int NV, bool ADD>
__global__ void __launch_bounds__(kMaxBlock) rms_norm_block_kernel(const NormParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using P = Pack<typename E::Bits, VEC>;
  __shared__ float smem[32];
  const uint32_t row = blockIdx.x;
  int64_t xoff, roff, yoff, woff;
  row_offsets32<ADD>(p, row, xoff, roff, yoff, woff);
  // NV = 8 (x, residual and weight would not all fit in 128 registers): weight after the sum.
  constexpr bool kPreW = NV <= 4;
  P v[NV], w[NV];
  float ss = load_row<E, VEC, NV, ADD, kPreW>(p, true, xoff, roff, woff, threadIdx.x, blockDim.x,
                                              v, w);
  ss = block_sum(ss, smem);
  const float rstd = rsqrtf(ss * p.inv_d + p.eps);
  store_row<E, VEC, NV, kPreW>(p, true, yoff, woff, threadIdx.x, blockDim.x, rstd, v, w);
}

constexpr int kGenericBlock = 256;

// generic kernel: any D, any row count; rows strided over the grid, 64-bit index math.
template <class E, bool ADD>
__global__ void __launch_bounds__(kGenericBlock) rms_norm_generic_kernel(const NormParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using Bits = typename E::Bits;
  __shared__ float smem[32];
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t q = row / p.n2, i2 = row - q * p.n2;
    const int64_t i0 = q / p.n1, i1 = q - i0 * p.n1;
    const Bits* xp = static_cast<const Bits*>(p.x) + (i0 * p.xs[0] + i1 * p.xs[1] + i2 * p.xs[2]);
    Bits* rp = static_cast<Bits*>(p.res) + (ADD ? i0 * p.rs[0] + i1 * p.rs[1] + i2 * p.rs[2] : 0);
    Bits* yp = static_cast<Bits*>(p.y) +
               (ADD ? i0 * p.xs[0] + i1 * p.xs[1] + i2 * p.xs[2] : row * p.d);
    const Bits* wp = static_cast<const Bits*>(p.w) + ((row % p.R) / p.RG) * p.w_stride;
    float ss = 0.f;
    for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x) {
      float f;
      if (ADD) {
        const Bits s = E::from_float(E::to_float(rp[c]) + E::to_float(xp[c]));
        rp[c] = s;
        f = E::to_float(s);
      } else {
        f = E::to_float(xp[c]);
      }
      ss = fmaf(f, f, ss);
    }
    ss = block_sum(ss, smem);
    const float rstd = rsqrtf(ss * p.inv_d + p.eps);
    // Same element-to-thread map as above: with ADD each thread reads back its own writes.
    for (int64_t c = threadIdx.x; c < p.d; c += blockDim.x) {
      const float f = E::to_float(ADD ? rp[c] : xp[c]);
      const float n = E::to_float(E::from_float(f * rstd));
      yp[c] = E::from_float(n * E::to_float(__ldg(wp + c)));
    }
    __syncthreads();  // smem is reused by the next row
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Argument checks (checks.h; the order of dflash_ops/ops/norm.py).
void check_common(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps) {
  // x: [..., D] bf16/fp16/fp32 on CUDA, unit stride in D
  check_cuda(op, "x", x);
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1, "dflash.", op, ": x must have rank >= 1, got a 0-d tensor");
  check_last_dim(op, "x", x);
  // weight: [D] or [G, D] of x's dtype, unit stride in D
  TORCH_CHECK_VALUE(weight.dim() == 1 || weight.dim() == 2, "dflash.", op,
                    ": weight must have rank 1 or 2, got rank ", weight.dim(), " (shape ",
                    py_tuple(weight.sizes()), ")");
  check_device(op, "weight", weight, x.device());
  check_same_dtype(op, "weight", weight, "x", x);
  check_last_dim(op, "weight", weight);
  const int64_t d = x.size(-1);
  TORCH_CHECK_VALUE(weight.size(-1) == d, "dflash.", op, ": weight must have ", d,
                    " columns (the last dim of x), got shape ", py_list(weight.sizes()));
  if (weight.dim() == 2) {
    TORCH_CHECK_VALUE(x.dim() >= 3, "dflash.", op,
                      ": a 2-D weight [G, D] needs x of rank >= 3 ([T, *inner, D]), got rank ",
                      x.dim());
    int64_t inner = 1;
    for (int64_t i = 1; i < x.dim() - 1; ++i) inner *= x.size(i);
    const int64_t g = weight.size(0);
    TORCH_CHECK_VALUE(g > 0 && inner % g == 0, "dflash.", op, ": weight has G = ", g,
                      " groups, which must divide the ", inner, " rows per token of x (shape ",
                      py_list(x.sizes()), ")");
  }
  check_eps(op, eps);
}

// The leading dims of x (and residual) after dropping size-1 dims and merging neighbours that
// are contiguous with each other in every tensor; padded in front to 3 (size 1, stride 0).
struct Leading {
  int64_t size[3];
  int64_t xs[3];
  int64_t rs[3];
};

Leading merge_leading(const char* op, const at::Tensor& x, const at::Tensor* res) {
  c10::SmallVector<int64_t, 8> size, xs, rs;
  for (int64_t i = 0; i < x.dim() - 1; ++i) {
    const int64_t n = x.size(i);
    if (n == 1) continue;
    const int64_t sx = x.stride(i), sr = res ? res->stride(i) : 0;
    if (!size.empty() && xs.back() == n * sx && (!res || rs.back() == n * sr)) {
      size.back() *= n;
      xs.back() = sx;
      rs.back() = sr;
    } else {
      size.push_back(n);
      xs.push_back(sx);
      rs.push_back(sr);
    }
  }
  if (size.size() > 3) {
    std::ostringstream what;
    what << "dflash." << op << ": the leading dims of x" << (res ? " and residual" : "")
         << " merge into " << size.size() << " strided dims (x shape " << x.sizes()
         << ", strides " << x.strides();
    if (res) what << ", residual strides " << res->strides();
    what << "); at most 3 are supported (pass a contiguous copy)";
    TORCH_CHECK_VALUE(false, what.str());
  }
  Leading l;
  const int pad = 3 - static_cast<int>(size.size());
  for (int i = 0; i < 3; ++i) {
    l.size[i] = i < pad ? 1 : size[i - pad];
    l.xs[i] = i < pad ? 0 : xs[i - pad];
    l.rs[i] = i < pad ? 0 : rs[i - pad];
  }
  return l;
}

bool aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Which kernel and shape serve rows of nvec vectors.
enum class Path { kRows, kBlock, kGeneric };
struct LaunchShape {
  Path path;
  int tpr_log2;     // rows: lanes per row = 2^tpr_log2
  int nv;           // rows / block: vectors per thread (1, 2, 4; block also 8)
  int threads;      // threads per block
  int64_t blocks;
};

LaunchShape choose_shape(int64_t rows, int64_t nvec) {
  constexpr int64_t kInt32Rows = std::numeric_limits<int32_t>::max();
  LaunchShape s{Path::kGeneric, 0, 1, kGenericBlock, std::min<int64_t>(rows, int64_t{1} << 20)};
  if (rows >= kInt32Rows) return s;
  if (nvec <= 32 * 4) {
    // TPR = the power of two >= nvec / kRowsLaneVecs (capped at 32); then NV in {1, 2, 4} covers
    // the row. D = 128 bf16: 8 lanes x 2 vectors (40 registers, 6 blocks an SM, 32 bytes a lane
    // in flight). On the H200 at T >= 4096, 1 vector a lane (16 lanes, 28 registers) measured
    // ~3% slower and 4 vectors a lane the same as 2.
    constexpr int64_t kRowsLaneVecs = 2;
    s.path = Path::kRows;
    while (s.tpr_log2 < 5 && (int64_t{1} << s.tpr_log2) * kRowsLaneVecs < nvec) ++s.tpr_log2;
    const int64_t tpr = int64_t{1} << s.tpr_log2;
    const int64_t nv = (nvec + tpr - 1) / tpr;
    s.nv = nv <= 1 ? 1 : nv <= 2 ? 2 : 4;
    s.threads = kRowsBlock;
    const int64_t rows_per_block = kRowsBlock / tpr;
    s.blocks = (rows + rows_per_block - 1) / rows_per_block;
  } else if (nvec <= kMaxBlock * 8) {
    // NV: the fewest vectors per thread that keep the block at <= 256 threads (up to 8).
    s.path = Path::kBlock;
    while (s.nv < 8 && (nvec + s.nv - 1) / s.nv > 256) s.nv *= 2;
    s.threads = static_cast<int>(((nvec + s.nv - 1) / s.nv + 31) / 32 * 32);
    s.blocks = rows;
  }
  return s;
}

template <class E, int VEC, bool ADD>
void launch_vec(const NormParams& p, cudaStream_t stream) {
  const LaunchShape s = choose_shape(p.rows, p.d / VEC);
  const dim3 grid(static_cast<unsigned>(s.blocks)), block(static_cast<unsigned>(s.threads));
  if (s.path == Path::kRows) {
    switch (s.nv) {
      case 1: launch_kernel(rms_norm_rows_kernel<E, VEC, 1, ADD>, grid, block, 0, stream, p,
                            s.tpr_log2); break;
      case 2: launch_kernel(rms_norm_rows_kernel<E, VEC, 2, ADD>, grid, block, 0, stream, p,
                            s.tpr_log2); break;
      default: launch_kernel(rms_norm_rows_kernel<E, VEC, 4, ADD>, grid, block, 0, stream, p,
                             s.tpr_log2); break;
    }
  } else if (s.path == Path::kBlock) {
    switch (s.nv) {
      case 1: launch_kernel(rms_norm_block_kernel<E, VEC, 1, ADD>, grid, block, 0, stream,
                            p); break;
      case 2: launch_kernel(rms_norm_block_kernel<E, VEC, 2, ADD>, grid, block, 0, stream,
                            p); break;
      case 4: launch_kernel(rms_norm_block_kernel<E, VEC, 4, ADD>, grid, block, 0, stream,
                            p); break;
      default: launch_kernel(rms_norm_block_kernel<E, VEC, 8, ADD>, grid, block, 0, stream,
                             p); break;
    }
  } else {
    launch_kernel(rms_norm_generic_kernel<E, ADD>, grid, block, 0, stream, p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernel arguments of a call (x, weight, strides, groups); sets vec16 when 16-byte vectors
// are possible: D, every row start and the weight rows on 16-byte boundaries.
// out: rms_norm's contiguous output, or nullptr; res: fused's residual, or nullptr.
NormParams make_params(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps,
                       const at::Tensor* out, const at::Tensor* res, bool& vec16) {
  const Leading l = merge_leading(op, x, res);
  const int64_t d = x.size(-1);
  NormParams p{};
  p.x = x.data_ptr();
  p.y = res ? x.data_ptr() : out->data_ptr();
  p.res = res ? res->data_ptr() : nullptr;
  p.w = weight.data_ptr();
  for (int i = 0; i < 3; ++i) {
    p.xs[i] = l.xs[i];
    p.rs[i] = l.rs[i];
  }
  p.n1 = l.size[1];
  p.n2 = l.size[2];
  p.rows = x.numel() / d;
  p.d = d;
  p.inv_d = static_cast<float>(1.0 / static_cast<double>(d));
  p.eps = static_cast<float>(eps);
  const int64_t g = weight.dim() == 2 ? weight.size(0) : 1;
  if (g > 1) {
    p.R = p.rows / x.size(0);  // rows per token (numel > 0, so x.size(0) > 0)
    p.RG = p.R / g;
    p.w_stride = weight.stride(0);
  } else {
    p.R = 1;
    p.RG = 1;
    p.w_stride = 0;
  }
  if (p.rows < std::numeric_limits<int32_t>::max()) {
    p.div_n1 = make_fast_div(p.n1);
    p.div_n2 = make_fast_div(p.n2);
    p.div_R = make_fast_div(p.R);
    p.div_RG = make_fast_div(p.RG);
  }
  const int vec = 16 / static_cast<int>(x.element_size());
  vec16 = d % vec == 0 && aligned(p.x, 16) && aligned(p.y, 16) && aligned(p.w, 16) &&
          p.w_stride % vec == 0 && (!res || aligned(p.res, 16));
  for (int i = 0; i < 3; ++i) vec16 = vec16 && l.xs[i] % vec == 0 && l.rs[i] % vec == 0;
  return p;
}

template <bool ADD>
void run(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps,
         const at::Tensor* out, const at::Tensor* res) {
  bool vec16 = false;
  const NormParams p = make_params(op, x, weight, eps, out, res, vec16);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  constexpr int kVec16 = 8, kVec32 = 4;  // elements in 16 bytes
  switch (x.scalar_type()) {
    case at::kBFloat16:
      vec16 ? launch_vec<BF16, kVec16, ADD>(p, stream) : launch_vec<BF16, 1, ADD>(p, stream);
      break;
    case at::kHalf:
      vec16 ? launch_vec<F16, kVec16, ADD>(p, stream) : launch_vec<F16, 1, ADD>(p, stream);
      break;
    default:
      vec16 ? launch_vec<F32, kVec32, ADD>(p, stream) : launch_vec<F32, 1, ADD>(p, stream);
      break;
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm";
  check_common(op, x, weight, eps);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  run<false>(op, x, weight, eps, &out, nullptr);
  return out;
}

void fused_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps) {
  constexpr const char* op = "fused_add_rms_norm_";
  check_common(op, x, weight, eps);
  // residual: x's shape, device and dtype, its own strides (unit stride in D)
  check_device(op, "residual", residual, x.device());
  check_same_dtype(op, "residual", residual, "x", x);
  check_shape(op, "residual", residual, x.sizes());
  check_last_dim(op, "residual", residual);
  if (x.numel() == 0) return;
  run<true>(op, x, weight, eps, nullptr, &residual);
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("rms_norm", TORCH_FN(dflash_ops::rms_norm));
  m.impl("fused_add_rms_norm_", TORCH_FN(dflash_ops::fused_add_rms_norm_));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
