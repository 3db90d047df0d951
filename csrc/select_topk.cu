// row_topk and row_argmax (dflash_ops/ops/select.py; the select family's second file, beside
// select.cu). row_topk: the k largest entries of each row of z [M, V], descending, equal values
// by ascending index, NaN above +inf (the reference's stable sort). row_argmax: at the end.
//
// The Triton kernel's algorithm (dflash_ops/triton/select.py), four launches, chunks of kChunk
// entries, one block of kThreads a chunk or a row:
//   1. chunk_max: each chunk's max (NaN as +inf);
//   2. threshold: per row the k-th largest chunk max T (-inf with fewer than k chunks): k chunks
//      hold an entry >= T each, so each of the row's k best is >= T, and a chunk whose max is
//      below T holds none of them;
//   3. chunk_topk: a chunk whose max reaches T takes its entries >= T, best first, up to k;
//      the others write empty slots without loading their chunk;
//   4. merge: per row the k best of the chunks' candidates, values copied from z (z's bits).
// An entry is one int64 (pack): the key's float bits made order-preserving as an int32 in the
// high word (-0.0 as +0.0, NaN above +inf), 2^31 - 1 - index in the low word, so the op's
// order is the integers' order and entries are distinct. A round is then one block max over
// the entries below the previous pick: nothing to mark or remove. Grids depend on shapes
// only (graph-capturable); buffers come from the caching allocator.
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
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace dflash_ops {
namespace {

using namespace detail;  // common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 2048;
constexpr int kPer = kChunk / kThreads;  // entries a thread holds in chunk_topk
constexpr int64_t kMaxK = 64;            // TOPK_MAX of dflash_ops/ops/select.py
constexpr long long kEmpty = std::numeric_limits<long long>::min();
constexpr long long kTop = std::numeric_limits<long long>::max();

__device__ __forceinline__ long long pack(float key, long long idx) {
  if (key == 0.0f) key = 0.0f;  // -0.0 ties with +0.0
  const int bits = __float_as_int(key);
  int ordered = bits ^ ((bits >> 31) & 0x7fffffff);
  if (key != key) ordered = 0x7fffffff;  // NaN above +inf (0x7f800000)
  const unsigned long long hi = static_cast<unsigned long long>(static_cast<uint32_t>(ordered));
  return static_cast<long long>((hi << 32) | static_cast<unsigned long long>(0x7fffffffLL - idx));
}

__device__ __forceinline__ float unpack_key(long long p) {
  const int hi = static_cast<int>(p >> 32);
  return __int_as_float(hi ^ ((hi >> 31) & 0x7fffffff));
}

__device__ __forceinline__ long long unpack_idx(long long p) {
  return 0x7fffffffLL - (p & 0xffffffffLL);
}

// The warp's max of v (every lane gets it).
__device__ __forceinline__ long long warp_max(long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// The block's max of v (every thread gets it); s holds kWarps values.
__device__ __forceinline__ long long block_max(long long v, long long* s) {
  v = warp_max(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) s[warp] = v;
  __syncthreads();
  long long r = s[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = s[w] > r ? s[w] : r;
  __syncthreads();  // s is free again
  return r;
}

__device__ __forceinline__ float block_fmax(float v, float* s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) s[warp] = v;
  __syncthreads();
  float r = s[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, s[w]);
  __syncthreads();
  return r;
}

struct TopkParams {
  const void* z;       // [M, V], row stride `stride`, unit stride in V
  int64_t stride, m, v;
  int nch, k;
  float* cmax;         // [M, nch]
  float* thr;          // [M]
  long long* cand;     // [M, nch, k] packed entries
  void* vals;          // [M, k], z's dtype
  int64_t* idx;        // [M, k]
};

template <class E>
__global__ void __launch_bounds__(kThreads) chunk_max_kernel(const TopkParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  __shared__ float s[kWarps];
  using Bits = typename E::Bits;
  const int64_t m = blockIdx.x / p.nch, c = blockIdx.x % p.nch;
  const Bits* row = static_cast<const Bits*>(p.z) + m * p.stride;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t col = c * kChunk + i * kThreads + threadIdx.x;
    if (col < p.v) {
      float x = E::to_float(row[col]);
      mx = fmaxf(mx, x != x ? INFINITY : x);
    }
  }
  mx = block_fmax(mx, s);
  if (threadIdx.x == 0) p.cmax[m * p.nch + c] = mx;
}

__global__ void __launch_bounds__(kThreads) threshold_kernel(const TopkParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  __shared__ long long s[kWarps];
  const int64_t m = blockIdx.x;
  const float* cm = p.cmax + m * p.nch;
  long long prev = kTop, best = kEmpty;
  for (int t = 0; t < p.k; ++t) {
    long long local = kEmpty;
    for (int j = threadIdx.x; j < p.nch; j += kThreads) {
      const long long e = pack(cm[j], j);
      if (e < prev && e > local) local = e;
    }
    best = block_max(local, s);
    prev = best;
    if (best == kEmpty) break;  // fewer than k chunks (block-uniform)
  }
  if (threadIdx.x == 0) p.thr[m] = best == kEmpty ? -INFINITY : unpack_key(best);
}

template <class E>
__global__ void __launch_bounds__(kThreads) chunk_topk_kernel(const TopkParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  __shared__ long long s[kWarps];
  using Bits = typename E::Bits;
  const int64_t m = blockIdx.x / p.nch, c = blockIdx.x % p.nch;
  long long* out = p.cand + (m * p.nch + c) * p.k;
  const float thr = p.thr[m];
  if (!(p.cmax[m * p.nch + c] >= thr)) {  // none of the row's k best here (block-uniform)
    for (int t = threadIdx.x; t < p.k; t += kThreads) out[t] = kEmpty;
    return;
  }
  const long long floor = pack(thr, 0x7fffffffLL);  // the lowest entry of key thr
  const Bits* row = static_cast<const Bits*>(p.z) + m * p.stride;
  long long e[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t col = c * kChunk + i * kThreads + threadIdx.x;
    e[i] = col < p.v ? pack(E::to_float(row[col]), col) : kEmpty;
    if (e[i] < floor) e[i] = kEmpty;
  }
  long long prev = kTop;
  for (int t = 0; t < p.k; ++t) {
    long long local = kEmpty;
#pragma unroll
    for (int i = 0; i < kPer; ++i) local = e[i] < prev && e[i] > local ? e[i] : local;
    const long long best = block_max(local, s);
    if (best == kEmpty) {  // the chunk has no more entries >= thr (block-uniform)
      for (int q = t + threadIdx.x; q < p.k; q += kThreads) out[q] = kEmpty;
      break;
    }
    if (threadIdx.x == 0) out[t] = best;
    prev = best;
  }
}

template <class E>
__global__ void __launch_bounds__(kThreads) merge_kernel(const TopkParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  __shared__ long long s[kWarps];
  using Bits = typename E::Bits;
  const int64_t m = blockIdx.x;
  const int64_t n = static_cast<int64_t>(p.nch) * p.k;
  const long long* cand = p.cand + m * n;
  const Bits* row = static_cast<const Bits*>(p.z) + m * p.stride;
  long long prev = kTop;
  for (int t = 0; t < p.k; ++t) {
    long long local = kEmpty;
    for (int64_t q = threadIdx.x; q < n; q += kThreads) {
      const long long x = cand[q];
      if (x < prev && x > local) local = x;
    }
    const long long best = block_max(local, s);
    prev = best;
    if (threadIdx.x == 0) {  // k <= V: a row always has k entries (empty only on a bug)
      const int64_t i = best == kEmpty ? -1 : unpack_idx(best);
      p.idx[m * p.k + t] = i;
      static_cast<Bits*>(p.vals)[m * p.k + t] =
          i >= 0 ? row[i] : E::from_float(-INFINITY);
    }
  }
}

template <class E>
void run(const TopkParams& p, cudaStream_t stream) {
  const unsigned chunks = static_cast<unsigned>(p.m * p.nch), rows = static_cast<unsigned>(p.m);
  launch_kernel(chunk_max_kernel<E>, chunks, kThreads, 0, stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_kernel(threshold_kernel, rows, kThreads, 0, stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_kernel(chunk_topk_kernel<E>, chunks, kThreads, 0, stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_kernel(merge_kernel<E>, rows, kThreads, 0, stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}


// ---------------------------------------------------------------------------------------------
// row_argmax: z [M, V] in chunks of kArgChunk entries, a block per (row, chunk) takes its best
// entry packed (so the first index wins ties, NaN above +inf), then a warp per row takes the
// best of its chunks' and unpacks the index. A row of one chunk is done by the first kernel.
constexpr int kArgChunk = 4096;  // ARGMAX_CHUNK of dflash_ops/triton/select.py
constexpr int kArgPer = kArgChunk / kThreads;
constexpr int64_t kArgMaxV = int64_t{1} << 24;  // ARGMAX_MAX_V of dflash_ops/ops/select.py

struct ArgmaxParams {
  const void* z;     // [M, V], row stride `stride`, unit stride in V
  int64_t stride, v;
  int nch;
  long long* part;   // [M, nch] packed entries (nch > 1)
  int64_t* idx;      // [M]
};

template <class E>
__global__ void __launch_bounds__(kThreads) argmax_chunk_kernel(const ArgmaxParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  __shared__ long long s[kWarps];
  using Bits = typename E::Bits;
  const int64_t m = blockIdx.x / p.nch, c = blockIdx.x % p.nch;
  const Bits* row = static_cast<const Bits*>(p.z) + m * p.stride;
  Bits raw[kArgPer] = {};
#pragma unroll
  for (int i = 0; i < kArgPer; ++i) {  // every load issued before the first compare
    const int64_t col = c * kArgChunk + i * kThreads + threadIdx.x;
    if (col < p.v) raw[i] = row[col];
  }
  long long best = kEmpty;
#pragma unroll
  for (int i = 0; i < kArgPer; ++i) {
    const int64_t col = c * kArgChunk + i * kThreads + threadIdx.x;
    if (col < p.v) {
      const long long e = pack(E::to_float(raw[i]), col);
      best = e > best ? e : best;
    }
  }
  best = block_max(best, s);
  if (threadIdx.x == 0) {
    if (p.nch == 1) p.idx[m] = unpack_idx(best);
    else p.part[m * p.nch + c] = best;
  }
}

__global__ void __launch_bounds__(32) argmax_merge_kernel(const ArgmaxParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  const int64_t m = blockIdx.x;
  const long long* part = p.part + m * p.nch;
  long long best = kEmpty;
  for (int j = threadIdx.x; j < p.nch; j += 32) best = part[j] > best ? part[j] : best;
  best = warp_max(best);
  if (threadIdx.x == 0) p.idx[m] = unpack_idx(best);
}

template <class E>
void run_argmax(const ArgmaxParams& p, int64_t m, cudaStream_t stream) {
  launch_kernel(argmax_chunk_kernel<E>, static_cast<unsigned>(m * p.nch), kThreads, 0, stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.nch > 1) {
    launch_kernel(argmax_merge_kernel, static_cast<unsigned>(m), 32, 0, stream, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& z, int64_t k) {
  constexpr const char* op = "row_topk";
  // the order and messages of dflash_ops/ops/select.py _check_topk
  check_cuda(op, "z", z);
  check_rank(op, "z", z, 2);
  check_float(op, "z", z);
  check_last_dim(op, "z", z);
  const int64_t m = z.size(0), v = z.size(1);
  const int64_t kmax = std::min(v, kMaxK);
  TORCH_CHECK_VALUE(k >= 1 && k <= kmax, "dflash.", op, ": k must be an int in [1, min(V, ",
                    kMaxK, ")] = [1, ", kmax, "] (V = z's last dim, ", v, "), got ", k);
  at::Tensor vals = at::empty({m, k}, z.options());
  at::Tensor idx = at::empty({m, k}, z.options().dtype(at::kLong));
  if (m == 0) return {vals, idx};
  const int64_t nch = (v + kChunk - 1) / kChunk;
  TORCH_CHECK_VALUE(m * nch <= std::numeric_limits<int32_t>::max(), "dflash.", op,
                    ": M x ceil(V / ", kChunk, ") = ", m * nch,
                    " chunks is more than one launch takes; use the triton backend");
  const c10::cuda::CUDAGuard guard(z.device());
  at::Tensor cmax = at::empty({m, nch}, z.options().dtype(at::kFloat));
  at::Tensor thr = at::empty({m}, z.options().dtype(at::kFloat));
  at::Tensor cand = at::empty({m, nch, k}, z.options().dtype(at::kLong));
  TopkParams p{};
  p.z = z.data_ptr();
  p.stride = z.stride(0);
  p.m = m;
  p.v = v;
  p.nch = static_cast<int>(nch);
  p.k = static_cast<int>(k);
  p.cmax = cmax.data_ptr<float>();
  p.thr = thr.data_ptr<float>();
  p.cand = reinterpret_cast<long long*>(cand.data_ptr<int64_t>());
  p.vals = vals.data_ptr();
  p.idx = idx.data_ptr<int64_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(z.get_device()).stream();
  switch (z.scalar_type()) {
    case at::kBFloat16: run<BF16>(p, stream); break;
    case at::kHalf: run<F16>(p, stream); break;
    default: run<F32>(p, stream); break;
  }
  return {vals, idx};
}


at::Tensor row_argmax(const at::Tensor& z) {
  constexpr const char* op = "row_argmax";
  // the order and messages of dflash_ops/ops/select.py _check_argmax
  check_cuda(op, "z", z);
  check_rank(op, "z", z, 2);
  check_float(op, "z", z);
  check_last_dim(op, "z", z);
  const int64_t m = z.size(0), v = z.size(1);
  TORCH_CHECK_VALUE(v >= 1 && v <= kArgMaxV, "dflash.", op, ": z must have 1 to ", kArgMaxV,
                    " entries a row (its last dim), got shape [", m, ", ", v, "]");
  at::Tensor idx = at::empty({m}, z.options().dtype(at::kLong));
  if (m == 0) return idx;
  const int64_t nch = (v + kArgChunk - 1) / kArgChunk;
  TORCH_CHECK_VALUE(m * nch <= std::numeric_limits<int32_t>::max(), "dflash.", op,
                    ": M x ceil(V / ", kArgChunk, ") = ", m * nch,
                    " chunks is more than one launch takes; use the triton backend");
  const c10::cuda::CUDAGuard guard(z.device());
  at::Tensor part;
  if (nch > 1) part = at::empty({m, nch}, z.options().dtype(at::kLong));
  ArgmaxParams p{};
  p.z = z.data_ptr();
  p.stride = z.stride(0);
  p.v = v;
  p.nch = static_cast<int>(nch);
  p.part = nch > 1 ? reinterpret_cast<long long*>(part.data_ptr<int64_t>()) : nullptr;
  p.idx = idx.data_ptr<int64_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(z.get_device()).stream();
  switch (z.scalar_type()) {
    case at::kBFloat16: run_argmax<BF16>(p, m, stream); break;
    case at::kHalf: run_argmax<F16>(p, m, stream); break;
    default: run_argmax<F32>(p, m, stream); break;
  }
  return idx;
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("row_topk", TORCH_FN(dflash_ops::row_topk));
  m.impl("row_argmax", TORCH_FN(dflash_ops::row_argmax));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
