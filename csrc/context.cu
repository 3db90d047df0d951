// The context K/V path: kv_proj and context_kv_ (references: dflash_ops/ops/context.py).
//
//   kv_proj      x[T, H] @ w_kv[N, H]^T (+ bias[N]) -> [T, N], through ATen (cuBLAS), or at
//                1-32 rows on sm_90 the skinny kernel (the fused path's GEMM alone, any N)
//   context_kv_  (hidden RMSNorm of x) -> kv = kv_proj(x, w_kv, bias) [T, N = L*2*Hkv*D] ->
//                one epilogue launch over kv viewed as [T, L, 2, Hkv, D]: every layer's K row
//                normalised with k_weight[l] and rotated, written with its V row into layer l's
//                paged caches at slot_mapping[t]; at 1 <= T <= 32 on sm_90 (D 128, bf16, or
//                fp16 without hidden_rms) one kernel instead: the GEMM split over the CTAs of
//                a cluster, reduced in distributed shared memory, and the same epilogue (the
//                fused path, below the epilogue kernel)
//
//   k_caches[l], v_caches[l]  [num_blocks, block_size, Hkv, D], one tensor per layer, each with
//                its own strides (unit stride in D); token t goes to block slot / block_size,
//                row slot % block_size; a slot < 0 or >= num_blocks * block_size is skipped
//                (read on the device). Offsets into a cache are 64-bit bytes.
//
// Epilogue kernel. blockIdx.y = layer (block-uniform: the layer's cache views and k_weight row
// come from the kernel parameters, a by-value struct of MAXL = 8 or 64 layers as in kv.cu);
// blockIdx.x covers that layer's T * Hkv head rows, one group of tpr lanes per (token, head),
// 256 / tpr rows a block; row -> (token, head) by multiply-shift division. The group holds the
// K row and the V row of its head: the K row's units are rope_common.cuh's (the head-row code
// of knorm_rope_: RMSNorm with HF rounding, then NeoX or GPT-J rotation of the first R dims in
// fp32, one rounding; a position outside [0, P) leaves it normalised but unrotated); the V row
// is moved with the same unit offsets (the units partition a row), unchanged.
//   vector path: 16-byte vectors, one unit (two vectors) of K and one of V a lane: D = 128 bf16
//   is 8 lanes a head, 64 bytes in flight a lane. scalar path (V = 1, four units a lane): a
//   cache or k_weight not on 16-byte boundaries, a strided k_weight, or NeoX with R/2 or (D-R)/2
//   not a multiple of the vector.
// Every load of a row (K, V, position, slot) is issued before anything waits on one; a row
// whose slot is skipped is still normalised (the norm's shuffles span the warp) but not stored.
#include "dflash_ops.h"

#include "checks.h"
#include "register.h"
#include "common.cuh"
#include "rope_common.cuh"

#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>

namespace dflash_ops {
namespace {

using namespace detail;  // common.cuh, rope_common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

template <int MAXL>
struct ContextParams {
  CacheView dst[MAXL][2];  // [layer][K, V]
  RotaryRow rope;          // cos/sin table and row geometry
  const void* kv;          // kv[T, N], element strides: s_tok, s_layer (2 Hkv D), s_head (D);
  int64_t s_tok, s_layer, s_head;
  int64_t s_v;             // V row = K row + s_v (Hkv D)
  const void* w;           // k_weight[L, D], element strides w_row, w_col
  int64_t w_row, w_col;
  const int64_t* pos;      // positions[T], element stride pos_stride
  int64_t pos_stride;
  const int64_t* slots;    // slot_mapping[T], element stride slot_stride
  int64_t slot_stride;
  int64_t n_slots;         // num_blocks * block_size
  int64_t block_size;      // (the 64-bit path: n_slots >= 2^31)
  FastDiv div_bs;          // block_size (n_slots < 2^31)
  FastDiv div_hkv;         // Hkv
  uint32_t rows;           // T * Hkv < 2^31: head rows a layer
  bool slots32;            // n_slots < 2^31
  // hidden_rms (the XRMS kernels): every kv row of token t becomes T(kv * rstd_t + bias), rstd_t
  // = 1 / sqrt(mean(x_t^2) + eps) (the hidden RMSNorm whose weight the caller folded into w_kv)
  const void* x;           // x[T, H], row stride x_st, unit column stride
  int64_t x_st;
  int h;
  float inv_h;             // 1 / H (0 when H = 0)
  bool x_vec;              // x's rows in 16-byte vectors
  const void* bias;        // bias[N], unit stride, or null (added after the scaling)
  bool xrms;               // the XRMS kernel (x may be null: H = 0)
};

constexpr int kBlock = 256;
// hidden_rms: at most this many tokens take the fused path (each layer's CTAs compute their
// tokens' rstd from x); above it, a norm pass of ones (x read once, not once a layer).
constexpr int64_t kRmsFusedTokens = 256;

// The block's tokens' sums of squares (hidden_rms), in parts: wpt = kWarps / ntok warps a token
// when the block holds fewer tokens than warps (a decode call's 1-8 tokens: at the drafter's
// H 4096 one token's row is then 2-8 vectors a lane, one round trip, where a warp a token took
// a chain of four), one warp a token otherwise. part[j * wpt + q] = warp q's share of token
// t0 + j; returns wpt. A lane loads up to kXLoads 16-byte vectors before it sums them.
constexpr int kWarps = kBlock / 32;
constexpr int kXLoads = 4;
template <class E, class Params>
__device__ __forceinline__ int token_ss_parts(const Params& p, uint32_t t0, int ntok,
                                              float* part) {
  using Bits = typename E::Bits;
  constexpr int XV = 16 / static_cast<int>(sizeof(Bits));
  const int warp = static_cast<int>(threadIdx.x >> 5), wl = static_cast<int>(threadIdx.x & 31);
  const int wpt = ntok >= kWarps ? 1 : kWarps / ntok;
  for (int w = warp; w < ntok * wpt; w += kWarps) {
    const int j = w / wpt, q = w - j * wpt;
    const Bits* const xr = static_cast<const Bits*>(p.x) + int64_t(t0 + j) * p.x_st;
    float ss = 0.f;
    if (p.x_vec) {  // kXLoads vectors a lane in flight, the row's vectors dealt over wpt warps
      const int step = wpt * 32 * XV;
      for (int c0 = (q * 32 + wl) * XV; c0 < p.h; c0 += kXLoads * step) {
        Pack<Bits, XV> v[kXLoads];
#pragma unroll
        for (int i = 0; i < kXLoads; ++i) {
          const int c = c0 + i * step;
          if (c < p.h) v[i] = load_vec<Bits, XV>(xr + c);
        }
#pragma unroll
        for (int i = 0; i < kXLoads; ++i) {
          if (c0 + i * step >= p.h) break;
#pragma unroll
          for (int e = 0; e < XV; ++e) {
            const float f = E::to_float(v[i].e[e]);
            ss = fmaf(f, f, ss);
          }
        }
      }
    } else {
      for (int c = q * 32 + wl; c < p.h; c += wpt * 32) {
        const float f = E::to_float(xr[c]);
        ss = fmaf(f, f, ss);
      }
    }
    ss = warp_sum(ss);
    if (wl == 0) part[w] = ss;
  }
  return wpt;
}

// Every 128-byte line of the block's ntok x rows asked into L2, a thread a line: x went to DRAM
// while the GEMM streamed the weight through L2 (84 MB for the Qwen3-8B drafter), and a warp's
// row takes two rounds of kXLoads vectors at 2-4 tokens a block (eight loads a lane spill), so
// the second round's lines are on their way during the first.
template <class E, class Params>
__device__ __forceinline__ void prefetch_x_l2(const Params& p, uint32_t t0, int ntok) {
  // a row that starts inside a line touches one line more than H / kLine: the last address
  // asked is the row's last element
  constexpr int kLine = 128 / static_cast<int>(sizeof(typename E::Bits));  // elements a line
  if (p.h == 0) return;
  const int lines = (p.h + kLine - 1) / kLine + 1;
  for (int i = static_cast<int>(threadIdx.x); i < ntok * lines; i += kBlock) {
    const int j = i / lines;
    const typename E::Bits* const xr =
        static_cast<const typename E::Bits*>(p.x) + int64_t(t0 + j) * p.x_st;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(xr + min((i - j * lines) * kLine, p.h - 1)));
  }
}

// An L1 prefetch of the line at ptr (no register, nothing waits on it): the epilogue's weight,
// bias and cos/sin reads, issued before the x reduction so that they travel beside it rather
// than after the block barrier, one round trip each.
__device__ __forceinline__ void prefetch_l1(const void* ptr) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
}

// cur <- T(cur * r + bias) on the lane's units (bias at the row's offsets, unit stride; null:
// none): the GEMM's rows divided by rms(x_t) before the bias (hidden_rms).
template <class E, int V, int NU, bool NEOX>
__device__ __forceinline__ void scale_units(const LaneUnits<V, NU, NEOX>& lu, float r,
                                            const typename E::Bits* bias,
                                            Unit<typename E::Bits, V> (&cur)[NU]) {
  using Bits = typename E::Bits;
#pragma unroll
  for (int j = 0; j < NU; ++j) {
    if (!lu.act[j]) continue;
    Unit<Bits, V> b;
    if (bias != nullptr) {
      b.a = load_weight<Bits, V>(bias + lu.off_a[j]);
      b.b = load_weight<Bits, V>(bias + lu.off_b[j]);
    }
#pragma unroll
    for (int k = 0; k < 2 * V; ++k) {
      float f = E::to_float(cur[j][k]) * r;
      if (bias != nullptr) f += E::to_float(b[k]);
      cur[j][k] = E::from_float(f);
    }
  }
}

// The K row (normalised; rotated here) and the V row of head h of a token at slot `slot` (in
// range) written into layer `layer`'s caches: the lane's units.
template <class E, int V, int NU, bool NEOX, int MAXL>
__device__ __forceinline__ void store_head_row(const ContextParams<MAXL>& p, int layer,
                                               uint32_t h, int64_t slot, int64_t pos,
                                               const LaneUnits<V, NU, NEOX>& lu,
                                               const Unit<typename E::Bits, V> (&k)[NU],
                                               const Unit<typename E::Bits, V> (&v)[NU]) {
  using Bits = typename E::Bits;
  int64_t block, brow;
  if (p.slots32) {
    const uint32_t b = p.div_bs.div(static_cast<uint32_t>(slot));
    block = b;
    brow = static_cast<uint32_t>(slot) - b * p.div_bs.d;
  } else {
    block = slot / p.block_size;
    brow = slot - block * p.block_size;
  }
  const CacheView kc = p.dst[layer][0], vc = p.dst[layer][1];  // block-uniform index
  Bits* const k_dst = reinterpret_cast<Bits*>(kc.base + block * kc.s_block + brow * kc.s_row +
                                              int64_t(h) * kc.s_head);
  Bits* const v_dst = reinterpret_cast<Bits*>(vc.base + block * vc.s_block + brow * vc.s_row +
                                              int64_t(h) * vc.s_head);
  store_units(v_dst, lu, v);
  const bool rot = pos >= 0 && pos < p.rope.n_pos;
  rotate_store_units<E>(p.rope, lu, pos, rot, k, k_dst);
}

// One group of tpr = 2^tpr_log2 lanes per (token, head) of layer blockIdx.y, NU units a lane,
// V elements a vector. Registers: see the report of PTXAS_VERBOSE=1 .ci/nvcc_check.sh; the
// vector path is held to 48 (5 blocks an SM, 80 KB of K and V in flight), no spills; with
// hidden_rms (XRMS: the x reduction and the bias) to 64 (4 blocks).
template <class E, int V, int NU, bool NEOX, bool XRMS, int MAXL>
__global__ void __launch_bounds__(kBlock, V > 1 ? (XRMS ? 4 : 5) : 1)
    context_kv_kernel(const __grid_constant__ ContextParams<MAXL> p, const int tpr_log2) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using Bits = typename E::Bits;
  const int layer = blockIdx.y;
  const int tpr = 1 << tpr_log2;
  const int lane = threadIdx.x & (tpr - 1);
  const uint32_t row = blockIdx.x * (kBlock >> tpr_log2) + (threadIdx.x >> tpr_log2);
  // Lanes of a row past the end stay for the norm's full-warp shuffles but touch no memory.
  const bool valid = row < p.rows;
  uint32_t t = 0, h = 0;
  if (valid) {
    t = p.div_hkv.div(row);
    h = row - t * p.div_hkv.d;
  }
  const Bits* const k_src = static_cast<const Bits*>(p.kv) +
                            (int64_t(t) * p.s_tok + int64_t(layer) * p.s_layer +
                             int64_t(h) * p.s_head);
  const Bits* const v_src = k_src + p.s_v;
  const Bits* const w = static_cast<const Bits*>(p.w) + int64_t(layer) * p.w_row;
  const int64_t w_col = V == 1 ? p.w_col : 1;

  const LaneUnits<V, NU, NEOX> lu(p.rope, lane, tpr, valid, /*whole_row=*/true);
  Unit<Bits, V> k[NU], v[NU];
  load_units(k_src, lu, k);
  load_units(v_src, lu, v);
  int64_t pos = -1, slot = -1;
  if (valid) {
    pos = __ldg(p.pos + int64_t(t) * p.pos_stride);
    slot = __ldg(p.slots + int64_t(t) * p.slot_stride);
  }

  if constexpr (XRMS) {  // kv <- T(kv / rms(x_t) + bias): the block's tokens' rstd first
    // (a block holds at most kBlock rows, so as many tokens, and kWarps parts when fewer)
    __shared__ float part_s[kBlock];
    const Bits* const bias = static_cast<const Bits*>(p.bias);
    const int64_t b_off = int64_t(layer) * p.s_layer + int64_t(h) * p.s_head;
    if constexpr (V > 1) {  // what the epilogue reads after the barrier, on its way now
#pragma unroll
      for (int j = 0; j < NU; ++j) {
        if (!lu.act[j]) continue;
        prefetch_l1(w + lu.off_a[j]);
        prefetch_l1(w + lu.off_b[j]);
        if (bias != nullptr) {
          prefetch_l1(bias + b_off + lu.off_a[j]);
          prefetch_l1(bias + b_off + lu.off_b[j]);
          prefetch_l1(bias + b_off + p.s_v + lu.off_a[j]);
          prefetch_l1(bias + b_off + p.s_v + lu.off_b[j]);
        }
      }
    }
    const uint32_t row0 = blockIdx.x * (kBlock >> tpr_log2);
    const uint32_t row_last = min(row0 + (kBlock >> tpr_log2), p.rows) - 1;
    const uint32_t t0 = p.div_hkv.div(row0);
    const int ntok = static_cast<int>(p.div_hkv.div(row_last) - t0) + 1;
    if (ntok > 1) prefetch_x_l2<E>(p, t0, ntok);  // one token's row is one round already
    const int wpt = token_ss_parts<E>(p, t0, ntok, part_s);
    if constexpr (V > 1) {  // pos has long arrived: the row's cos/sin lines
      if (p.rope.cs_vec4 && pos >= 0 && pos < p.rope.n_pos) {
        const float* const cs = p.rope.cs + pos * p.rope.cs_row;
#pragma unroll
        for (int j = 0; j < NU; ++j) {
          if (!lu.act[j] || lu.ang0[j] >= p.rope.half) continue;
          prefetch_l1(cs + lu.ang0[j]);
          prefetch_l1(cs + p.rope.half + lu.ang0[j]);
        }
      }
    }
    __syncthreads();
    float r = 0.f;
    if (valid) {
      float ss = 0.f;
      for (int q = 0; q < wpt; ++q) ss += part_s[(t - t0) * wpt + q];
      r = rsqrtf(ss * p.inv_h + p.rope.eps);
    }
    scale_units<E>(lu, r, bias == nullptr ? nullptr : bias + b_off, k);
    scale_units<E>(lu, r, bias == nullptr ? nullptr : bias + b_off + p.s_v, v);
  }
  norm_units<E>(p.rope, lu, w, w_col, tpr, k);  // k <- T(T(k * rstd) * w); every lane
  if (!valid || slot < 0 || slot >= p.n_slots) return;  // padding, or past the cache
  store_head_row<E>(p, layer, h, slot, pos, lu, k, v);
}

// ---------------------------------------------------------------------------------------------
// The cluster GEMM of kv_proj's skinny path (sm_90, 1 <= T <= kSkinnyMaxTokens): a cluster of
// CTAs cuts H; a lane loads its A rows (the weight) straight from global memory, 16 contiguous
// elements a row a step (two 16-byte loads; no shared-memory staging), and runs mma.sync
// m16n8k16 with the tokens as B's 8-wide columns; the partial tiles meet through distributed
// shared memory, ranks in order (deterministic). (A fused context_kv_ kernel on this loop, GEMM
// and epilogue in one launch, lost to cuBLAS + the epilogue kernel on the H100 at 1-32 tokens
// and was deleted: NOTES, session 28.)
constexpr int kSkinnyMaxTokens = 32;  // with DFLASH_OPS_SKINNY_PLAN forcing a plan
constexpr int kSplits = 8;  // CTAs a cluster (portable cluster size)
constexpr int kSkinnyRows = 8;  // kv_proj's skinny path by default (see kv_proj)
constexpr int kChunk = 64;  // H elements a main-loop step

// A 16-byte weight load that skips L1 (each weight byte is read once).
__device__ __forceinline__ uint4 ld_stream16(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

template <bool BF>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1,
                                             uint32_t a2, uint32_t a3, uint2 b) {
  if constexpr (BF) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  __syncwarp();  // the .aligned barrier wants converged warps; the code before it branches
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// addr (this CTA's shared memory) in CTA `rank` of the cluster
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float4 ld_cluster4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
// The float4 at addr (this CTA's shared memory) summed over CTAs 0 .. ranks - 1 of the
// cluster, in rank order (the same sum on every call: deterministic).
__device__ __forceinline__ float4 cluster_sum4(uint32_t addr, int ranks) {
  float4 s = ld_cluster4(cluster_map(addr, 0));
  for (int q = 1; q < ranks; ++q) {
    const float4 o = ld_cluster4(cluster_map(addr, static_cast<uint32_t>(q)));
    s.x += o.x;
    s.y += o.y;
    s.z += o.z;
    s.w += o.w;
  }
  return s;
}
#endif

// One 64-element step's A fragments of a warp's MT m16 tiles: the lane's rows g and g + 8 of
// each tile at its 16 elements of step c (w: the lane's first row at its elements; a row at or
// past rows_left, counted from the warp's first row, reads as zero).
template <class E, int MT>
__device__ __forceinline__ void load_a_step(uint4 (&a)[MT][2][2], const typename E::Bits* w,
                                            int64_t w_st, int rows_left, int c) {
  using Bits = typename E::Bits;
  const int gq = static_cast<int>(threadIdx.x & 31) >> 2;
  const int64_t k0 = int64_t(c) * kChunk;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = mt * 16 + hr * 8;
      const Bits* const src = w + int64_t(r) * w_st + k0;
      if (r + gq < rows_left) {
        a[mt][hr][0] = ld_stream16(src);
        a[mt][hr][1] = ld_stream16(src + 8);
      } else {
        a[mt][hr][0] = a[mt][hr][1] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

// acc += step c's A fragments times the tokens' x (xb: x at the lane's 16 elements; tokens >= t
// read as zero).
template <class E, int MT, int NT>
__device__ __forceinline__ void mma_step(const uint4 (&a)[MT][2][2], const typename E::Bits* xb,
                                         int64_t x_st, int t, int c, float (&acc)[MT][NT][4]) {
  constexpr bool kBF = std::is_same<E, BF16>::value;
  const int gq = static_cast<int>(threadIdx.x & 31) >> 2;
  const int64_t k0 = int64_t(c) * kChunk;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint2 b[NT];  // token nt * 8 + g, elements 4j .. 4j + 3 of the lane's 16
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = nt * 8 + gq;
      b[nt] = n < t ? __ldg(reinterpret_cast<const uint2*>(xb + n * x_st + k0 + 4 * j))
                    : make_uint2(0u, 0u);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4& lo = a[mt][0][j >> 1];
      const uint4& hi = a[mt][1][j >> 1];
      const bool odd = j & 1;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mma_m16n8k16<kBF>(acc[mt][nt], odd ? lo.z : lo.x, odd ? hi.z : hi.x, odd ? lo.w : lo.y,
                          odd ? hi.w : hi.y, b[nt]);
      }
    }
  }
}

// The split-K main loop of the cluster GEMM (skinny_kernel): acc (zeroed
// here) = this warp's MT m16 tiles of weight rows times the tokens' x rows over the 64-element
// steps [c_lo, c_hi). w: the lane's first row (the warp's row g) at its 16 elements (+ 16 c);
// a row at or past rows_left (counted from the warp's first row) reads as zero. xb: x at the
// lane's 16 elements (+ 16 c); tokens >= t read as zero.
// A sum over k doesn't care which k a fragment slot holds: slot (2c, 2c + 1, 2c + 8, 2c + 9) of
// mma j holds elements 16c + 4j + 0..3. U: steps whose loads are issued before the first of
// their mma's (U = 2: two round trips' bytes in flight a warp, 16 MT more registers).
template <class E, int MT, int NT, int U = 1>
__device__ __forceinline__ void split_k_steps(const typename E::Bits* w, int64_t w_st,
                                              int rows_left, const typename E::Bits* xb,
                                              int64_t x_st, int t, int c_lo, int c_hi,
                                              float (&acc)[MT][NT][4]) {
  static_assert(U == 1 || U == 2, "one or two steps in flight");
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
  }
  int c = c_lo;
  if constexpr (U == 2) {
    for (; c + 1 < c_hi; c += 2) {
      uint4 a0[MT][2][2], a1[MT][2][2];  // [m tile][row g, g + 8][elements 0-7, 8-15]
      load_a_step<E, MT>(a0, w, w_st, rows_left, c);
      load_a_step<E, MT>(a1, w, w_st, rows_left, c + 1);
      mma_step<E, MT, NT>(a0, xb, x_st, t, c, acc);
      mma_step<E, MT, NT>(a1, xb, x_st, t, c + 1, acc);
    }
  }
  for (; c < c_hi; ++c) {
    uint4 a[MT][2][2];
    load_a_step<E, MT>(a, w, w_st, rows_left, c);
    mma_step<E, MT, NT>(a, xb, x_st, t, c, acc);
  }
}

// The warp's C fragments (row g / g + 8 of each m tile, columns 2c, 2c + 1 of each column
// tile) into part_s[token][row0 + row], PR floats a token.
template <int MT, int NT, int PR>
__device__ __forceinline__ void store_partial(float* part_s, int row0,
                                              const float (&acc)[MT][NT][4]) {
  const int lane = static_cast<int>(threadIdx.x & 31), gq = lane >> 2, cq = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int r = row0 + mt * 16 + gq, n = nt * 8 + 2 * cq;
      part_s[n * PR + r] = acc[mt][nt][0];
      part_s[(n + 1) * PR + r] = acc[mt][nt][1];
      part_s[n * PR + r + 8] = acc[mt][nt][2];
      part_s[(n + 1) * PR + r + 8] = acc[mt][nt][3];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// kv_proj's skinny path (sm_90, 1 <= T <= kSkinnyMaxTokens, bf16 / fp16, H a multiple of 64): the
// fused kernel's GEMM without its epilogue, for any N. A CTA holds 128 MT / KG rows of w (8
// warps of MT m16 tiles; KG warps a row group split the CTA's part of H), a cluster of `splits`
// CTAs (1-8) cuts H (the plan: skinny_plan, or DFLASH_OPS_SKINNY_PLAN); after a
// cluster barrier rank r sums its slice of the [T][rows] tile over the cluster (ranks in
// order), adds the bias in fp32 and rounds once into out (F.linear's single rounding), and a
// second barrier keeps every CTA's shared memory alive until the last read.
struct SkinnyGemm {
  const void* w;     // [N, H], unit column stride, row stride w_st (% 8 == 0)
  int64_t w_st;
  const void* x;     // [T, H], unit column stride, row stride x_st (% 8 == 0 when T > 1)
  int64_t x_st;
  const void* bias;  // [N] with unit stride, or null
  void* out;         // [T, N] contiguous
  int64_t n;
  int t;
  int chunks;        // H / kChunk
  int splits;        // CTAs a cluster
};

// CTAs an SM each skinny_kernel instance is compiled for: U = 1 holds NT 1 to 80 registers (3 an
// SM), else 2 an SM (<= 128). U = 2 (16 MT more registers): 2 an SM at NT 1 and at MT 1 with
// NT 2 (88-114 registers), else 1: held to 128, ptxas moved the second step's loads after the
// first step's mma's (a review of the SASS); with the room (150-158 registers) they come first,
// except at MT 2 / NT 4 (186 registers), where 5 of the 16 still issue after the first mma.
constexpr int skinny_min_blocks(int mt, int nt, int u) {
  return u == 1 ? (nt == 1 ? 3 : 2) : (nt == 1 || (mt == 1 && nt == 2) ? 2 : 1);
}

// KG: warps a row group (8 / KG row groups of 16 MT rows: ROWS rows a CTA) that split the CTA's
// steps among themselves, their partial tiles summed in shared memory (in warp order) before
// the cluster's sum; U: steps in flight a warp (split_k_steps).
template <class E, int MT, int NT, int KG, int U>
__global__ void __launch_bounds__(kBlock, skinny_min_blocks(MT, NT, U))
    skinny_kernel(const __grid_constant__ SkinnyGemm g) {
  pdl_wait();  // x comes from the grid before
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Bits = typename E::Bits;
  static_assert(kWarps % KG == 0, "whole row groups");
  constexpr int RG = kWarps / KG, ROWS = RG * 16 * MT, NTOK = 8 * NT, PR = ROWS + 4;
  constexpr int kRowVecs = ROWS / 4;
  __shared__ __align__(16) float part_s[KG * NTOK * PR];

  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int gq = lane >> 2, cq = lane & 3;
  // (KG 1 spelled out: ptxas cannot prove warp < 8 and kept kg live, costing the default plan
  // 6-12 registers and the order of its loads)
  const int rg = KG == 1 ? warp : warp % RG, kg = KG == 1 ? 0 : warp / RG;
  const int rank = g.splits > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int64_t n0 = int64_t(blockIdx.x / g.splits) * ROWS;
  const int row0 = rg * 16 * MT;
  const int64_t left = g.n - n0 - row0;  // the warp's rows inside w (may be <= 0)
  const int rows_left = static_cast<int>(left < 0 ? 0 : (left > 16 * MT ? 16 * MT : left));
  const Bits* const w = static_cast<const Bits*>(g.w) + (n0 + row0 + gq) * g.w_st + cq * 16;
  const Bits* const xb = static_cast<const Bits*>(g.x) + cq * 16;
  const int c_lo = rank * g.chunks / g.splits, c_hi = (rank + 1) * g.chunks / g.splits;
  const int k_lo = KG == 1 ? c_lo : c_lo + kg * (c_hi - c_lo) / KG;
  const int k_hi = KG == 1 ? c_hi : c_lo + (kg + 1) * (c_hi - c_lo) / KG;

  float acc[MT][NT][4];
  split_k_steps<E, MT, NT, U>(w, g.w_st, rows_left, xb, g.x_st, g.t, k_lo, k_hi, acc);
  store_partial<MT, NT, PR>(part_s + kg * NTOK * PR, row0, acc);
  const int nvec = g.t * kRowVecs;
  if constexpr (KG > 1) {  // the row groups' K parts into part 0, in warp order
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < nvec; i += kBlock) {
      const int tok = i / kRowVecs, col = (i - tok * kRowVecs) * 4;
      float4* const d = reinterpret_cast<float4*>(part_s + tok * PR + col);
      float4 s = *d;
#pragma unroll
      for (int q = 1; q < KG; ++q) {
        const float4 o = *reinterpret_cast<const float4*>(part_s + q * NTOK * PR + tok * PR + col);
        s.x += o.x;
        s.y += o.y;
        s.z += o.z;
        s.w += o.w;
      }
      *d = s;
    }
  }
  if (g.splits > 1) {
    cluster_sync();  // 1: every CTA's partial tile is in its shared memory
  } else {
    __syncthreads();
  }
  const int per = (nvec + g.splits - 1) / g.splits;
  const int v_lo = rank * per, v_hi = min(nvec, v_lo + per);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(part_s));
  const Bits* const bias = static_cast<const Bits*>(g.bias);
  Bits* const out = static_cast<Bits*>(g.out);
  for (int i = v_lo + static_cast<int>(threadIdx.x); i < v_hi; i += kBlock) {
    const int tok = i / kRowVecs, col = (i - tok * kRowVecs) * 4;
    const float4 s =
        g.splits > 1 ? cluster_sum4(base + 4u * static_cast<uint32_t>(tok * PR + col), g.splits)
                     : *reinterpret_cast<const float4*>(part_s + tok * PR + col);
    const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t n = n0 + col + e;
      if (n >= g.n) break;
      const float b = bias != nullptr ? E::to_float(bias[n]) : 0.f;
      out[int64_t(tok) * g.n + n] = E::from_float(v[e] + b);
    }
  }
  if (g.splits > 1) cluster_sync();  // 2: the others' shared memory is no longer read
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side: argument checks (checks.h; the order of dflash_ops/ops/context.py), then the
// launch.

constexpr int kMaxLayers = 64;

// x [T, H] float on CUDA; w_kv [N, H], bias [N], both of x's dtype.
void check_proj(const char* op, const at::Tensor& x, const at::Tensor& w_kv,
                const std::optional<at::Tensor>& bias) {
  check_rank(op, "x", x, 2);
  check_float(op, "x", x);
  check_cuda(op, "x", x);
  const at::Device device = x.device();
  check_rank(op, "w_kv", w_kv, 2);
  check_device(op, "w_kv", w_kv, device);
  check_same_dtype(op, "w_kv", w_kv, "x", x);
  TORCH_CHECK_VALUE(w_kv.size(1) == x.size(1), "dflash.", op, ": w_kv must be [N, H=", x.size(1),
                    "] (H = x's columns), got ", py_list(w_kv.sizes()));
  if (bias.has_value()) {
    check_device(op, "bias", *bias, device);
    check_shape(op, "bias", *bias, {w_kv.size(0)});
    check_same_dtype(op, "bias", *bias, "x", x);
  }
}

void check_context(const at::Tensor& x, const at::Tensor& w_kv,
                   const std::optional<at::Tensor>& bias, const at::Tensor& k_weight,
                   const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                   const at::Tensor& slot_mapping, at::TensorList k_caches,
                   at::TensorList v_caches, double eps,
                   const std::optional<at::Tensor>& hidden_norm_weight, bool hidden_rms) {
  constexpr const char* op = "context_kv_";
  check_proj(op, x, w_kv, bias);
  const at::Device device = x.device();
  TORCH_CHECK_VALUE(!k_caches.empty(), "dflash.", op,
                    ": k_caches must be a non-empty list of per-layer caches");
  // k_caches[0] sets L, Hkv and D
  check_cache(op, Arg("k_caches", 0), k_caches[0], x);
  const int64_t n_layers = static_cast<int64_t>(k_caches.size());
  const int64_t hkv = k_caches[0].size(2), d = k_caches[0].size(3);
  check_head_dim(op, Arg("k_caches", 0), d);
  check_caches(op, "k_caches", k_caches, n_layers, hkv, d, x);
  check_caches(op, "v_caches", v_caches, n_layers, hkv, d, x);
  const int64_t n = n_layers * 2 * hkv * d;
  TORCH_CHECK_VALUE(w_kv.size(0) == n, "dflash.", op, ": w_kv must have L*2*Hkv*D = ", n_layers,
                    "*2*", hkv, "*", d, " = ", n, " rows (from the caches), got ", w_kv.size(0));
  // k_weight: [L, D]
  check_device(op, "k_weight", k_weight, device);
  check_shape(op, "k_weight", k_weight, {n_layers, d});
  check_same_dtype(op, "k_weight", k_weight, "x", x);
  const int64_t t = x.size(0);
  check_index_vector(op, "positions", positions, t, device);
  check_cos_sin_cache(op, cos_sin_cache, d, device);
  check_index_vector(op, "slot_mapping", slot_mapping, t, device);
  check_cache_blocks(op, k_caches, v_caches);
  if (hidden_norm_weight.has_value()) {
    check_device(op, "hidden_norm_weight", *hidden_norm_weight, device);
    check_shape(op, "hidden_norm_weight", *hidden_norm_weight, {x.size(1)});
    check_same_dtype(op, "hidden_norm_weight", *hidden_norm_weight, "x", x);
    TORCH_CHECK_VALUE(!hidden_rms, "dflash.", op, ": hidden_rms must be False when "
                      "hidden_norm_weight is given (hidden_rms is the norm with its weight folded "
                      "into w_kv), got True");
  }
  check_eps(op, eps);
  check_max_layers(op, "k_caches", n_layers, kMaxLayers);
}

// x @ w_kv^T (+ bias) through cuBLAS: [T, N] contiguous in x's dtype, fp32 accumulation, one
// rounding (the bias joins the fp32 sum). T, N or H may be 0 (H = 0: bias or zeros).
at::Tensor project(const at::Tensor& x, const at::Tensor& w_kv,
                   const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? at::addmm(*bias, x, w_kv.t()) : at::mm(x, w_kv.t());
}

template <class E, int V, int NU, bool XRMS, int MAXL>
void launch(const ContextParams<MAXL>& p, bool neox, int tpr_log2, dim3 grid,
            cudaStream_t stream) {
  if (neox) {
    launch_kernel(context_kv_kernel<E, V, NU, true, XRMS, MAXL>, grid, kBlock, 0, stream, p,
                  tpr_log2);
  } else {
    launch_kernel(context_kv_kernel<E, V, NU, false, XRMS, MAXL>, grid, kBlock, 0, stream, p,
                  tpr_log2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class E, bool XRMS, int MAXL>
void launch_path(const ContextParams<MAXL>& p, bool vec, bool neox, int tpr_log2, dim3 grid,
                 cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(typename E::Bits));
  if (vec) {
    launch<E, kVec, 1, XRMS>(p, neox, tpr_log2, grid, stream);
  } else {
    launch<E, 1, 4, XRMS>(p, neox, tpr_log2, grid, stream);
  }
}

template <class E, int MAXL>
void launch_dtype(const ContextParams<MAXL>& p, bool vec, bool neox, int tpr_log2, dim3 grid,
                  cudaStream_t stream) {
  if (p.xrms) {
    launch_path<E, true>(p, vec, neox, tpr_log2, grid, stream);
  } else {
    launch_path<E, false>(p, vec, neox, tpr_log2, grid, stream);
  }
}

// The parameters of a call but kv's (p.kv, p.s_tok: the caller's). Returns whether the vector
// path's conditions hold for everything but kv: for NeoX the halves and tail halves in whole
// vectors, k_weight with unit column stride and 16-byte rows, the caches' row starts and
// hidden_rms's bias on 16-byte boundaries. Sets p.rows; p.rope.units (which depends on the
// path) is the caller's.
// x_rms (hidden_rms, a defined tensor): x [T, H] with unit column stride, and bias_rms (or
// undefined) [N] with unit stride, applied by the kernel after the 1 / rms(x_t) scaling.
template <int MAXL>
bool fill_params(ContextParams<MAXL>& p, int64_t t, const at::Tensor& k_weight,
                 const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                 const at::Tensor& slot_mapping, at::TensorList k_caches,
                 at::TensorList v_caches, double eps, bool is_neox, const at::Tensor& x_rms,
                 const at::Tensor& bias_rms) {
  const int64_t n_layers = static_cast<int64_t>(k_caches.size());
  const int64_t hkv = k_caches[0].size(2), d = k_caches[0].size(3);
  const int64_t es = k_caches[0].element_size();
  const int64_t vmax = 16 / es;
  const int64_t n_slots = k_caches[0].size(0) * k_caches[0].size(1);

  p.rope = make_rotary_row(cos_sin_cache, d, eps);
  p.s_layer = 2 * hkv * d;
  p.s_v = hkv * d;
  p.s_head = d;
  p.w = k_weight.data_ptr();
  p.w_row = n_layers > 1 ? k_weight.stride(0) : 0;
  p.w_col = k_weight.stride(1);
  p.pos = positions.data_ptr<int64_t>();
  p.pos_stride = positions.stride(0);
  p.slots = slot_mapping.data_ptr<int64_t>();
  p.slot_stride = slot_mapping.stride(0);
  p.n_slots = n_slots;
  p.block_size = k_caches[0].size(1);
  p.slots32 = n_slots < std::numeric_limits<int32_t>::max();
  if (p.slots32) p.div_bs = make_fast_div(p.block_size);
  p.div_hkv = make_fast_div(hkv);
  if (x_rms.defined()) {
    const int64_t xv = 16 / x_rms.element_size();
    p.xrms = true;
    p.x = x_rms.data_ptr();
    p.x_st = x_rms.stride(0);
    p.h = static_cast<int>(x_rms.size(1));
    p.inv_h = p.h > 0 ? 1.f / static_cast<float>(p.h) : 0.f;
    p.x_vec = aligned16(p.x) && (t <= 1 || p.x_st % xv == 0) && p.h % xv == 0;
  }
  if (bias_rms.defined()) p.bias = bias_rms.data_ptr();

  bool vec = !is_neox || (p.rope.half % vmax == 0 && p.rope.tail_half % vmax == 0);
  vec = vec && aligned16(p.w) && p.w_row % vmax == 0 && p.w_col == 1;
  vec = vec && (p.bias == nullptr || aligned16(p.bias));
  // Cache byte strides; those of size-1 dims never multiply a non-zero index: 0.
  auto bstride = [es](const at::Tensor& c, int dim) -> int64_t {
    return c.size(dim) > 1 ? c.stride(dim) * es : 0;
  };
  for (int64_t l = 0; l < n_layers; ++l) {
    for (int s = 0; s < 2; ++s) {
      const at::Tensor& c = s ? v_caches[l] : k_caches[l];
      CacheView& cv = p.dst[l][s];
      cv.base = static_cast<char*>(c.data_ptr());
      cv.s_block = bstride(c, 0);
      cv.s_row = bstride(c, 1);
      cv.s_head = bstride(c, 2);
      vec = vec && aligned16(cv.base) && cv.s_block % 16 == 0 && cv.s_row % 16 == 0 &&
            cv.s_head % 16 == 0;
    }
  }
  const int64_t rows = t * hkv;
  TORCH_CHECK_VALUE(rows < std::numeric_limits<int32_t>::max(), "dflash.context_kv_: x has too "
                    "many tokens for one launch (T * Hkv = ", rows, " head rows a layer); split "
                    "the call over tokens");
  p.rows = static_cast<uint32_t>(rows);
  return vec;
}

// The epilogue over kv [T, N] (contiguous rows): builds the parameters and launches.
template <int MAXL>
void run_epilogue(const at::Tensor& kv, const at::Tensor& k_weight, const at::Tensor& positions,
                  const at::Tensor& cos_sin_cache, const at::Tensor& slot_mapping,
                  at::TensorList k_caches, at::TensorList v_caches, double eps, bool is_neox,
                  const at::Tensor& x_rms = at::Tensor(),
                  const at::Tensor& bias_rms = at::Tensor()) {
  const int64_t t = kv.size(0), n_layers = static_cast<int64_t>(k_caches.size());
  const int64_t d = k_caches[0].size(3);
  const int64_t vmax = 16 / kv.element_size();

  ContextParams<MAXL> p{};
  bool vec = fill_params(p, t, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                         v_caches, eps, is_neox, x_rms, bias_rms);
  p.kv = kv.data_ptr();
  p.s_tok = t > 1 ? kv.stride(0) : 0;
  vec = vec && aligned16(p.kv) && p.s_tok % vmax == 0;  // s_layer, s_head: multiples of D

  // Lanes per row: the units of a row (D / (2V): <= 32 with vectors, <= 128 scalar) over lanes
  // of nu units each, at most 32 lanes.
  const int v = vec ? static_cast<int>(vmax) : 1;
  p.rope.units = static_cast<int>(d / (2 * v));
  const int nu = vec ? 1 : 4;
  int tpr_log2 = 0;
  while ((1 << tpr_log2) * nu < p.rope.units && tpr_log2 < 5) ++tpr_log2;
  const int64_t rows_per_block = kBlock >> tpr_log2;
  const dim3 grid(static_cast<unsigned>((p.rows + rows_per_block - 1) / rows_per_block),
                  static_cast<unsigned>(n_layers));

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(kv.get_device()).stream();
  switch (kv.scalar_type()) {
    case at::kBFloat16:
      launch_dtype<BF16>(p, vec, is_neox, tpr_log2, grid, stream);
      break;
    case at::kHalf:
      launch_dtype<F16>(p, vec, is_neox, tpr_log2, grid, stream);
      break;
    default:
      launch_dtype<F32>(p, vec, is_neox, tpr_log2, grid, stream);
      break;
  }
}

// The split-K GEMM kernels' operands (skinny_kernel, context_fused_kernel's GEMM): x [T, H] @
// w [N, H]^T (+ bias) with 1 <= T <= kSkinnyMaxTokens, bf16 / fp16, H a multiple of 64, rows of x
// and w on 16-byte boundaries with unit column stride, a bias with unit stride; sm_90 code.
bool split_k_operands(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias) {
  const int64_t t = x.size(0), h = x.size(1);
  if (t < 1 || t > kSkinnyMaxTokens || h <= 0 || h % kChunk != 0 || w.size(0) < 1) return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf) return false;
  if (x.stride(1) != 1 || !aligned16(x.data_ptr()) || (t > 1 && x.stride(0) % 8 != 0)) return false;
  if (w.stride(1) != 1 || !aligned16(w.data_ptr()) || w.stride(0) % 8 != 0) return false;
  if (bias.has_value() && bias->stride(0) != 1) return false;
  return sm90_code();
}

// Launches kernel(args...) on `grid` CTAs of kBlock threads on `stream`, in clusters of
// `cluster` CTAs along x (1: no cluster) and, where pdl_enabled(), as a programmatic
// dependent. Returns false, launching nothing, where the device cannot hold one such cluster
// (a partitioned GPU: MIG, green contexts; a failed query counts as that), asked once a
// (kernel, device, cluster size).
template <class... KArgs, class... Args>
bool launch_cluster(void (*kernel)(KArgs...), int cluster, int64_t grid, cudaStream_t stream,
                    Args&&... args) {
  cudaLaunchAttribute attr[2];
  int na = 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kBlock);
  cfg.stream = stream;
  cfg.attrs = attr;
  if (cluster > 1) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[na].val.clusterDim.y = 1;
    attr[na].val.clusterDim.z = 1;
    cfg.numAttrs = ++na;
    static std::mutex mu;
    static std::map<std::tuple<const void*, int, int>, bool> fits;
    int dev = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), dev, cluster);
    std::lock_guard<std::mutex> lock(mu);
    auto it = fits.find(key);
    if (it == fits.end()) {
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, reinterpret_cast<const void*>(kernel),
                                         &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        clusters = 0;
      }
      it = fits.emplace(key, clusters > 0).first;
    }
    if (!it->second) return false;
  }
  if (pdl_enabled()) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs = ++na;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
  return true;
}

// The skinny kernel's launch for N rows, H / 64 = steps (kv_proj's 1-8 rows): 32-row CTAs (MT 1,
// KG 4) with two steps in flight (U 2), splits doubling while the grid is under one CTA an SM
// (Qwen3-8B: o_proj and down 128 x 2, qkv 192 x 1, gate_up 768 x 1; DFlash 2's proj2 40 x 4): the
// best plan of the H100 sweep at 1 and 8 rows on every shape, or within 2% of it (NOTES, session
// 28). DFLASH_OPS_SKINNY_PLAN replaces it (and takes 9-32 rows) for the sweep's other plans.
struct SkinnyPlan {
  int mt, kg, u, splits;
  int64_t tiles;
};
SkinnyPlan skinny_plan(int64_t n, int64_t steps, int sms) {
  const int64_t tiles = (n + 31) / 32;
  int splits = 1;
  while (splits < kSplits && tiles * splits < sms && steps >= 8 * splits) splits *= 2;
  return SkinnyPlan{1, 4, 2, splits, tiles};
}

// DFLASH_OPS_SKINNY_PLAN="MT,KG,SPLITS,U" (read at each call; unset or empty: skinny_plan) forces
// the plan, for the benchmarks that time the plans of a shape in one process.
SkinnyPlan forced_skinny_plan(int64_t n, const SkinnyPlan& dflt) {
  const char* env = std::getenv("DFLASH_OPS_SKINNY_PLAN");
  if (env == nullptr || env[0] == '\0') return dflt;
  int mt = 0, kg = 0, splits = 0, u = 0;
  char tail = 0;
  const int got = std::sscanf(env, "%d,%d,%d,%d%c", &mt, &kg, &splits, &u, &tail);
  TORCH_CHECK_VALUE(got == 4 && (mt == 1 || mt == 2) && (kg == 1 || (kg == 4 && mt == 1)) &&
                        (splits == 1 || splits == 2 || splits == 4 || splits == 8) &&
                        (u == 1 || u == 2),
                    "DFLASH_OPS_SKINNY_PLAN: expected 'MT,KG,SPLITS,U' with MT 1 or 2, KG 1 "
                    "or 4 (4 with MT 1 only), SPLITS 1, 2, 4 or 8, U 1 or 2, got '", env, "'");
  const int64_t rows = 128 * mt / kg;
  return SkinnyPlan{mt, kg, u, splits, (n + rows - 1) / rows};
}

template <class E, int MT, int NT, int KG, int U>
bool launch_skinny(const SkinnyGemm& g, int64_t tiles, cudaStream_t stream) {
  return launch_cluster(skinny_kernel<E, MT, NT, KG, U>, g.splits, tiles * g.splits, stream, g);
}

template <class E, int MT, int KG, int U>
bool launch_skinny_t(const SkinnyGemm& g, int64_t tiles, cudaStream_t stream) {
  if (g.t <= 8) return launch_skinny<E, MT, 1, KG, U>(g, tiles, stream);
  if (g.t <= 16) return launch_skinny<E, MT, 2, KG, U>(g, tiles, stream);
  return launch_skinny<E, MT, 4, KG, U>(g, tiles, stream);
}

template <class E>
bool launch_skinny_plan(const SkinnyGemm& g, const SkinnyPlan& plan, cudaStream_t stream) {
  const int64_t tiles = plan.tiles;
  if (plan.mt == 2) {
    return plan.u == 1 ? launch_skinny_t<E, 2, 1, 1>(g, tiles, stream)
                       : launch_skinny_t<E, 2, 1, 2>(g, tiles, stream);
  }
  if (plan.kg == 4) {
    return plan.u == 1 ? launch_skinny_t<E, 1, 4, 1>(g, tiles, stream)
                       : launch_skinny_t<E, 1, 4, 2>(g, tiles, stream);
  }
  return plan.u == 1 ? launch_skinny_t<E, 1, 1, 1>(g, tiles, stream)
                     : launch_skinny_t<E, 1, 1, 2>(g, tiles, stream);
}

// out = x @ w^T (+ bias) by skinny_kernel; false (nothing launched) where the device cannot
// run its cluster.
bool run_skinny(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                at::Tensor& out) {
  const int64_t t = x.size(0), n = w.size(0);
  SkinnyGemm g{};
  g.w = w.data_ptr();
  g.w_st = w.stride(0);
  g.x = x.data_ptr();
  g.x_st = t > 1 ? x.stride(0) : 0;
  g.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  g.out = out.data_ptr();
  g.n = n;
  g.t = static_cast<int>(t);
  g.chunks = static_cast<int>(x.size(1) / kChunk);
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const SkinnyPlan plan = forced_skinny_plan(n, skinny_plan(n, g.chunks, sms));
  g.splits = plan.splits;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  return x.scalar_type() == at::kBFloat16 ? launch_skinny_plan<BF16>(g, plan, stream)
                                          : launch_skinny_plan<F16>(g, plan, stream);
}

}  // namespace

at::Tensor kv_proj(const at::Tensor& x, const at::Tensor& w_kv,
                   const std::optional<at::Tensor>& bias) {
  check_proj("kv_proj", x, w_kv, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  // 1-8 rows on sm_90 (1-32 with DFLASH_OPS_SKINNY_PLAN set): skinny_kernel; above 8 rows it
  // lost to cuBLAS on the H100 at every plan measured at 32 rows (NOTES, session 28)
  const char* plan_env = std::getenv("DFLASH_OPS_SKINNY_PLAN");
  const bool forced = plan_env != nullptr && plan_env[0] != '\0';
  if ((x.size(0) <= kSkinnyRows || forced) && split_k_operands(x, w_kv, bias)) {
    at::Tensor out = at::empty({x.size(0), w_kv.size(0)}, x.options());
    if (run_skinny(x, w_kv, bias, out)) return out;
  }
  return project(x, w_kv, bias);
}

void context_kv_(const at::Tensor& x, const at::Tensor& w_kv,
                 const std::optional<at::Tensor>& bias, const at::Tensor& k_weight,
                 const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                 const at::Tensor& slot_mapping, at::TensorList k_caches,
                 at::TensorList v_caches, double eps, bool is_neox,
                 const std::optional<at::Tensor>& hidden_norm_weight, bool hidden_rms) {
  check_context(x, w_kv, bias, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                v_caches, eps, hidden_norm_weight, hidden_rms);
  const int64_t t = x.size(0), hkv = k_caches[0].size(2);
  const int64_t n_slots = k_caches[0].size(0) * k_caches[0].size(1);
  if (t == 0 || hkv == 0 || n_slots == 0) return;  // nothing to write

  const c10::cuda::CUDAGuard guard(x.device());
  // hidden_rms at up to kRmsFusedTokens tokens: the GEMM without the bias, then the epilogue
  // scales each row by 1 / rms(x_t) and adds the bias (one launch after the GEMM); above, a norm
  // pass with unit weights and the plain path (K / V then round at other points: equal to the
  // reference within its tolerance, not bit for bit across the two paths)
  // (not fp16: the unnormalised GEMM output rounded to fp16 could overflow before the division;
  // bf16 and fp32 have the range)
  const bool fused_rms = hidden_rms && t <= kRmsFusedTokens && x.scalar_type() != at::kHalf;
  at::Tensor h = x, x_rms, bias_rms;
  if (hidden_norm_weight.has_value() || (hidden_rms && !fused_rms)) {
    // rms_norm takes rows and weights with unit stride in the last dim; the op takes any.
    at::Tensor hw;
    if (!hidden_norm_weight.has_value()) {
      hw = at::ones({x.size(1)}, x.options());
    } else {
      hw = last_dim_ok(*hidden_norm_weight) ? *hidden_norm_weight
                                            : hidden_norm_weight->contiguous();
    }
    h = rms_norm(last_dim_ok(x) ? x : x.contiguous(), hw, eps);
  }
  if (fused_rms) {
    x_rms = last_dim_ok(x) ? x : x.contiguous();
    if (bias.has_value()) bias_rms = bias->stride(0) == 1 ? *bias : bias->contiguous();
  }
  at::Tensor kv = project(h, w_kv, fused_rms ? std::nullopt : bias);  // [T, L * 2 * Hkv * D]
  if (kv.stride(1) != 1) kv = kv.contiguous();
  if (k_caches.size() <= 8) {
    run_epilogue<8>(kv, k_weight, positions, cos_sin_cache, slot_mapping, k_caches, v_caches,
                    eps, is_neox, x_rms, bias_rms);
  } else {
    run_epilogue<kMaxLayers>(kv, k_weight, positions, cos_sin_cache, slot_mapping, k_caches,
                             v_caches, eps, is_neox, x_rms, bias_rms);
  }
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("kv_proj", TORCH_FN(dflash_ops::kv_proj));
  m.impl("context_kv_", TORCH_FN(dflash_ops::context_kv_));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
