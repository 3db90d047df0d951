// Paged K/V cache write: store_kv_ (reference: dflash_ops/ops/kv.py, store_kv_ref).
//
//   k, v          [T, L, Hkv, D]                     any strides, unit stride in D
//   k_caches[l]   [num_blocks, block_size, Hkv, D]   one tensor per layer, each with its own
//   v_caches[l]   strides (unit stride in D): vLLM's [num_blocks, 2, block_size, Hkv, D] views,
//                 or kv[..., :D].permute(0, 2, 1, 3) of a [num_blocks, Hkv, block_size, 2D] tensor
//   slot_mapping  [T] int64: token t goes to block slot / block_size, row slot % block_size;
//                 a slot < 0 or >= num_blocks * block_size is skipped (read on the device)
//
// A pure copy, so the kernel moves bytes, whatever the dtype: VB-byte vectors (16 when every
// base pointer and stride allows, else 8, 4, 2), NVR = D * elem_size / VB of them a row.
// One launch for every layer: blockIdx.y = 2 * layer + (0 for K, 1 for V) picks the source and
// the destination cache, whose base pointer and strides travel in the kernel parameters (a
// by-value struct: MAXL = 8 layers in ~0.6 KB, or 64 in ~4.2 KB, which needs CUDA 12.1+'s large
// kernel parameters). blockIdx.x covers the plane's T * Hkv * NVR vectors, U = 4 a thread
// (loads first, then the stores: 64 bytes in flight a thread); vector j of a plane is token
// j / (Hkv * NVR) (multiply-shift division), head and column by shift and mask. Offsets are
// 64-bit bytes (a cache may pass 2^31 elements).
#include "dflash_ops.h"

#include "checks.h"
#include "register.h"
#include "common.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

namespace dflash_ops {
namespace {

using namespace detail;  // common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

template <int MAXL>
struct StoreParams {
  CacheView dst[MAXL][2];       // [layer][K, V]
  const char* src[2];           // k, v
  int64_t s_tok[2], s_layer[2], s_head[2];  // byte strides of k, v
  const int64_t* slots;         // slot_mapping, element stride slot_stride
  int64_t slot_stride;
  int64_t n_slots;              // num_blocks * block_size
  int64_t block_size;           // (the 64-bit path: n_slots >= 2^31)
  FastDiv div_bs;               // block_size (n_slots < 2^31)
  FastDiv div_hn;               // Hkv * NVR: vectors per (token, layer, K|V)
  uint32_t n;                   // T * Hkv * NVR < 2^31: vectors per plane
  int nvr_log2;                 // NVR = 2^nvr_log2 vectors a row
  bool slots32;                 // n_slots < 2^31
};

constexpr int kBlock = 256;
constexpr int kUnroll = 4;  // vectors a thread

// 48 registers at most (5 blocks an SM: 1280 threads x 64 bytes = 80 KB in flight), no spills.
template <int VB, int MAXL>
__global__ void __launch_bounds__(kBlock, 5)
    store_kv_kernel(const __grid_constant__ StoreParams<MAXL> p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using Raw = typename RawOf<VB>::type;
  const int kv = blockIdx.y & 1;
  const int layer = blockIdx.y >> 1;
  const char* const src = (kv ? p.src[1] : p.src[0]) + layer * (kv ? p.s_layer[1] : p.s_layer[0]);
  const int64_t s_tok = kv ? p.s_tok[1] : p.s_tok[0];
  const int64_t s_head = kv ? p.s_head[1] : p.s_head[0];
  const CacheView dst = p.dst[layer][kv];  // block-uniform index: constant-bank loads
  const uint32_t col_mask = (1u << p.nvr_log2) - 1;

  // All loads first (sources and slots; nothing waits on a slot before the last load is
  // out), then the stores.
  Raw val[kUnroll];
  int64_t slot[kUnroll];
  uint32_t head[kUnroll], col[kUnroll];
  const uint32_t first = blockIdx.x * (kBlock * kUnroll) + threadIdx.x;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint32_t j = first + u * kBlock;
    slot[u] = -1;
    head[u] = col[u] = 0;
    if (j >= p.n) continue;
    const uint32_t t = p.div_hn.div(j);
    const uint32_t r = j - t * p.div_hn.d;
    head[u] = r >> p.nvr_log2;
    col[u] = r & col_mask;
    val[u] = *reinterpret_cast<const Raw*>(src + int64_t(t) * s_tok + int64_t(head[u]) * s_head +
                                           int64_t(col[u]) * VB);
    slot[u] = __ldg(p.slots + int64_t(t) * p.slot_stride);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (slot[u] < 0 || slot[u] >= p.n_slots) continue;  // padding, or past the cache
    int64_t block, row;
    if (p.slots32) {
      const uint32_t b = p.div_bs.div(static_cast<uint32_t>(slot[u]));
      block = b;
      row = static_cast<uint32_t>(slot[u]) - b * p.div_bs.d;
    } else {
      block = slot[u] / p.block_size;
      row = slot[u] - block * p.block_size;
    }
    *reinterpret_cast<Raw*>(dst.base + block * dst.s_block + row * dst.s_row +
                            int64_t(head[u]) * dst.s_head + int64_t(col[u]) * VB) = val[u];
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: argument checks (checks.h; the order of dflash_ops/ops/kv.py), then the launch.

constexpr const char* kOp = "store_kv_";
constexpr int kMaxLayers = 64;

void check_store(const at::Tensor& k, const at::Tensor& v, at::TensorList k_caches,
                 at::TensorList v_caches, const at::Tensor& slot_mapping) {
  // k: [T, L, Hkv, D] bf16/fp16/fp32 on CUDA, unit stride in D
  check_rank(kOp, "k", k, 4);
  check_float(kOp, "k", k);
  check_cuda(kOp, "k", k);
  check_last_dim(kOp, "k", k);
  const int64_t n_layers = k.size(1), d = k.size(3);
  TORCH_CHECK_VALUE(n_layers > 0, "dflash.", kOp,
                    ": k must hold at least one layer ([T, L, Hkv, D] with L >= 1) and k_caches "
                    "one cache per layer, got k ", py_list(k.sizes()));
  check_head_dim(kOp, "k", d);
  // v: k's shape, device and dtype, its own strides (unit stride in D)
  check_device(kOp, "v", v, k.device());
  check_shape(kOp, "v", v, k.sizes());
  check_last_dim(kOp, "v", v);
  check_same_dtype(kOp, "v", v, "k", k);
  // k_caches, v_caches: L caches [num_blocks, block_size, Hkv, D] of one shape
  check_caches(kOp, "k_caches", k_caches, n_layers, k.size(2), d, k);
  check_caches(kOp, "v_caches", v_caches, n_layers, k.size(2), d, k);
  check_cache_blocks(kOp, k_caches, v_caches);
  // slot_mapping: [T] int64
  check_index_vector(kOp, "slot_mapping", slot_mapping, k.size(0), k.device());
  check_max_layers(kOp, "k", n_layers, kMaxLayers);
}

// The largest power-of-two byte count <= 16 dividing every value (pointers and byte strides).
int vector_bytes(uint64_t bits) {
  int vb = 16;
  while (vb > 1 && bits % vb != 0) vb /= 2;
  return vb;
}

template <int VB, int MAXL>
void launch(const StoreParams<MAXL>& p, dim3 grid, cudaStream_t stream) {
  launch_kernel(store_kv_kernel<VB, MAXL>, grid, kBlock, 0, stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int MAXL>
void run(const at::Tensor& k, const at::Tensor& v, at::TensorList k_caches,
         at::TensorList v_caches, const at::Tensor& slot_mapping) {
  const int64_t t = k.size(0), n_layers = k.size(1), hkv = k.size(2), d = k.size(3);
  const int64_t es = k.element_size();
  const int64_t num_blocks = k_caches[0].size(0), block_size = k_caches[0].size(1);
  const int64_t n_slots = num_blocks * block_size;
  if (t == 0 || hkv == 0 || n_slots == 0) return;  // nothing to write

  StoreParams<MAXL> p{};
  // Strides of size-1 dims never multiply a non-zero index: 0, so that they neither count
  // against the vector width nor hide an overflow.
  auto bstride = [es](const at::Tensor& x, int dim) -> int64_t {
    return x.size(dim) > 1 ? x.stride(dim) * es : 0;
  };
  uint64_t bits = static_cast<uint64_t>(d * es);  // row bytes: a multiple of 32
  const at::Tensor* srcs[2] = {&k, &v};
  for (int s = 0; s < 2; ++s) {
    p.src[s] = static_cast<const char*>(srcs[s]->data_ptr());
    p.s_tok[s] = bstride(*srcs[s], 0);
    p.s_layer[s] = bstride(*srcs[s], 1);
    p.s_head[s] = bstride(*srcs[s], 2);
    bits |= reinterpret_cast<uintptr_t>(p.src[s]) | static_cast<uint64_t>(p.s_tok[s]) |
            static_cast<uint64_t>(p.s_layer[s]) | static_cast<uint64_t>(p.s_head[s]);
  }
  for (int64_t l = 0; l < n_layers; ++l) {
    for (int s = 0; s < 2; ++s) {
      const at::Tensor& c = s ? v_caches[l] : k_caches[l];
      CacheView& cv = p.dst[l][s];
      cv.base = static_cast<char*>(c.data_ptr());
      cv.s_block = bstride(c, 0);
      cv.s_row = bstride(c, 1);
      cv.s_head = bstride(c, 2);
      bits |= reinterpret_cast<uintptr_t>(cv.base) | static_cast<uint64_t>(cv.s_block) |
              static_cast<uint64_t>(cv.s_row) | static_cast<uint64_t>(cv.s_head);
    }
  }
  const int vb = vector_bytes(bits);
  const int64_t nvr = d * es / vb;  // a power of two: D and the element size are
  int nvr_log2 = 0;
  while ((int64_t{1} << nvr_log2) < nvr) ++nvr_log2;
  const int64_t n = t * hkv * nvr;
  TORCH_CHECK_VALUE(n < std::numeric_limits<int32_t>::max(), "dflash.", kOp,
                    ": k has too many rows for one launch (T * Hkv * D = ", t * hkv * d,
                    " elements a layer); split the call over tokens");
  p.n = static_cast<uint32_t>(n);
  p.nvr_log2 = nvr_log2;
  p.div_hn = make_fast_div(hkv * nvr);
  p.slots = slot_mapping.data_ptr<int64_t>();
  p.slot_stride = slot_mapping.stride(0);
  p.n_slots = n_slots;
  p.block_size = block_size;
  p.slots32 = n_slots < std::numeric_limits<int32_t>::max();
  if (p.slots32) p.div_bs = make_fast_div(block_size);

  const dim3 grid(static_cast<unsigned>((n + kBlock * kUnroll - 1) / (kBlock * kUnroll)),
                  static_cast<unsigned>(2 * n_layers));
  const c10::cuda::CUDAGuard guard(k.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(k.get_device()).stream();
  switch (vb) {
    case 16: launch<16>(p, grid, stream); break;
    case 8: launch<8>(p, grid, stream); break;
    case 4: launch<4>(p, grid, stream); break;
    default: launch<2>(p, grid, stream); break;
  }
}

}  // namespace

void store_kv_(const at::Tensor& k, const at::Tensor& v, at::TensorList k_caches,
               at::TensorList v_caches, const at::Tensor& slot_mapping) {
  check_store(k, v, k_caches, v_caches, slot_mapping);
  if (k.size(1) <= 8) {
    run<8>(k, v, k_caches, v_caches, slot_mapping);
  } else {
    run<kMaxLayers>(k, v, k_caches, v_caches, slot_mapping);
  }
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("store_kv_", TORCH_FN(dflash_ops::store_kv_));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
