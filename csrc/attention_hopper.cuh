// The Hopper (sm_90a) block-attention kernel of attention.cu: attn_wgmma_kernel, bf16 / fp16,
// D = 64 or 128, caches whose block_size is a power of two >= 8 and whose rows the bulk tensor
// copy engine can address (16-byte strides). Same contract, grid, splits, masks, epilogue and
// combine as attn_mma_kernel (attention_kernels.cuh); what differs is how a tile arrives and is
// multiplied:
//
// - Warp-specialised: warps 0-3 (one warpgroup) compute, warp 4 loads. The loader walks the
//   same (row tile, key tile) sequence as the consumers; for each 64-key tile it reads the
//   block-table entries of the tile's pages (a lane a page), issues one TMA box a page, K and V,
//   64 head dims at a time (`cp.async.bulk.tensor`, 128-byte swizzle) into a STAGES-deep ring,
//   and posts a 64-bit mask of the keys that are loaded and in [begin, end) with the stage's
//   `full` mbarrier (arrive + expected bytes). Pages wholly outside [begin, end) or with a block
//   id outside [0, num_blocks) are not loaded.
// - The consumers wait on `full`, zero the V rows of masked keys when a tile has any (stale or
//   unloaded rows: 0 * NaN must not reach a sum), then S = Q K^T by wgmma m64n64k16 (Q and K
//   from shared memory, K-major), the online softmax in registers (the accumulator layout is
//   mma.sync's: the softmax and epilogue are attention_common.cuh's), O += P V by wgmma
//   m64nDk16 with P from registers and V from shared memory (MN-major), and each warp arrives
//   on the stage's `empty` mbarrier once its wgmma has retired.
// - Tiles start at multiples of 64 keys (tile_keys with align), so a tile covers whole pages
//   (block_size <= 64) or lies in one (block_size > 64).
// Shared memory (D = 128): Q 16 KB + 3 stages x 32 KB = 112 KB: two CTAs an SM. D = 64: 4
// stages, 72 KB.
#pragma once

#include "attention_common.cuh"
#include "common.cuh"

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DFLASH_OPS_WGMMA 1
#else
#define DFLASH_OPS_WGMMA 0
#endif

namespace dflash_ops {
namespace attention {

constexpr int kWgThreads = 160;  // a consumer warpgroup + a loader warp
// CTAs an SM (D 64 and 128: registers and shared memory allow two; the split count's one wave)
constexpr int kWgCtasPerSm = 2;
// The launch bound of attn_wgmma_kernel: the host reads it back (cudaFuncGetAttributes) to learn
// whether this binary holds the sm_90a body (a build without sm_90a gets a stub of one warp).
#if DFLASH_OPS_WGMMA || !defined(__CUDA_ARCH__)
constexpr int kWgBound = kWgThreads;
#else
constexpr int kWgBound = 32;
#endif

template <int D>
struct WgTile {
  static constexpr int BM = 64, BN = 64;
  static constexpr int STAGES = D > 64 ? 3 : 4;
  static constexpr int SPAN = 64 * 128;  // bytes of 64 rows x 128 bytes (64 head dims)
  static constexpr int HALVES = D / 64;  // 128-byte spans a row
  static constexpr int Q_BYTES = HALVES * SPAN;
  static constexpr int KV_BYTES = HALVES * SPAN;  // K or V of a stage
  static constexpr int STAGE_BYTES = 2 * KV_BYTES;
  static constexpr int BAR_OFF = Q_BYTES + STAGES * STAGE_BYTES;  // full[S], empty[S], mask[S]
  static constexpr int SMEM = BAR_OFF + STAGES * 24;
};

// The tensor maps of the two caches (host: make_kv_map in attention.cu): dims innermost first
// (D, Hkv, block_size, num_blocks), or (D, block_size, Hkv, num_blocks) when head_outer, a box
// of (64 dims, one head, min(block_size, 64) rows, one block).
struct WgMaps {
  CUtensorMap k, v;
  int head_outer;
};

#if DFLASH_OPS_WGMMA
// The accumulator list of an m64n64 / m64n128 fp32 tile, then the rest of the operands.
#define DFLASH_WG_ACC64                                                                  \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "             \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define DFLASH_WG_ACC128                                                                 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "             \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "   \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "   \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define DFLASH_WG_D8(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define DFLASH_WG_OUT64                                                                  \
  DFLASH_WG_D8(0), DFLASH_WG_D8(1), DFLASH_WG_D8(2), DFLASH_WG_D8(3), DFLASH_WG_D8(4),  \
      DFLASH_WG_D8(5), DFLASH_WG_D8(6), DFLASH_WG_D8(7)
#define DFLASH_WG_OUT128                                                                 \
  DFLASH_WG_OUT64, DFLASH_WG_D8(8), DFLASH_WG_D8(9), DFLASH_WG_D8(10), DFLASH_WG_D8(11), \
      DFLASH_WG_D8(12), DFLASH_WG_D8(13), DFLASH_WG_D8(14), DFLASH_WG_D8(15)
// "{ set p from the operand after the inputs; wgmma.<shape>.f32.<ty>.<ty> {acc}, ARGS, p, ... }"
#define DFLASH_WG_ASM(SHAPE, TY, ACC, ARGS, P, TAIL)                                     \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                                         \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " {" ACC ARGS ", p, " TAIL ";\n}\n"

// d (m64 x n64, fp32) (+)= A (smem, K-major) * B (smem, K-major); d is overwritten when !acc.
template <bool BF>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[8][4], uint64_t da, uint64_t db,
                                             bool acc) {
  if constexpr (BF) {
    asm volatile(DFLASH_WG_ASM("m64n64k16", "bf16", DFLASH_WG_ACC64, "%32, %33", "%34",
                               "1, 1, 0, 0")
                 : DFLASH_WG_OUT64
                 : "l"(da), "l"(db), "r"(static_cast<int>(acc)));
  } else {
    asm volatile(DFLASH_WG_ASM("m64n64k16", "f16", DFLASH_WG_ACC64, "%32, %33", "%34",
                               "1, 1, 0, 0")
                 : DFLASH_WG_OUT64
                 : "l"(da), "l"(db), "r"(static_cast<int>(acc)));
  }
}

// d (m64 x nN, fp32) += A (registers: each warp's m16n8k16 A fragment, as mma.sync's) * B
// (smem, MN-major: imm-trans-b 1).
template <bool BF>
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (BF) {
    asm volatile(DFLASH_WG_ASM("m64n64k16", "bf16", DFLASH_WG_ACC64, "{%32, %33, %34, %35}, %36",
                               "%37", "1, 1, 1")
                 : DFLASH_WG_OUT64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  } else {
    asm volatile(DFLASH_WG_ASM("m64n64k16", "f16", DFLASH_WG_ACC64, "{%32, %33, %34, %35}, %36",
                               "%37", "1, 1, 1")
                 : DFLASH_WG_OUT64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  }
}
template <bool BF>
__device__ __forceinline__ void wgmma_rs(float (&d)[16][4], const uint32_t (&a)[4],
                                         uint64_t db) {
  if constexpr (BF) {
    asm volatile(DFLASH_WG_ASM("m64n128k16", "bf16", DFLASH_WG_ACC128,
                               "{%64, %65, %66, %67}, %68", "%69", "1, 1, 1")
                 : DFLASH_WG_OUT128
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  } else {
    asm volatile(DFLASH_WG_ASM("m64n128k16", "f16", DFLASH_WG_ACC128,
                               "{%64, %65, %66, %67}, %68", "%69", "1, 1, 1")
                 : DFLASH_WG_OUT128
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  }
}
#undef DFLASH_WG_ASM
#undef DFLASH_WG_OUT128
#undef DFLASH_WG_OUT64
#undef DFLASH_WG_D8
#undef DFLASH_WG_ACC128
#undef DFLASH_WG_ACC64

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// A shared-memory matrix descriptor, 128-byte swizzle: start, leading and stride byte offsets.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Spins in PTX (a C++ loop around try_wait would make the path look divergent to ptxas, which
// then serialises the wgmma that follow).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred q;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 q, [%0], %1;\n"
      "@!q bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Ordinary shared-memory stores made visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void consumers_sync() {  // the 128 consumer threads (warps 0-3)
  asm volatile("bar.sync 1, 128;\n" ::: "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Q rows [i0, i0 + 64) of the request into the 128-byte-swizzled tile (zeros past the
// request): spans of 64 dims, 16-byte chunk c of row r at r * 128 + ((c ^ r % 8) * 16).
template <class E, int D>
__device__ __forceinline__ void store_q_tile(const AttnParams& p, const ReqInfo& rq, int kvh,
                                             int i0, char* q_s) {
  using Bits = typename E::Bits;
  using P = Pack<Bits, 8>;
  constexpr int CPT = D / 16;  // chunks a thread: 2 threads a row, D / 8 chunks a row
  const int r = threadIdx.x >> 1, c0 = (threadIdx.x & 1) * CPT;
  const bool ok = i0 + r < rq.nrows;
  const Bits* const src = q_row<Bits>(p, rq, kvh, i0 + r, ok);
#pragma unroll
  for (int j = 0; j < CPT; ++j) {
    const int c = c0 + j;
    const P v = ok ? load_pack_ro<P>(src + c * 8) : zero_pack<P>();
    store_pack(q_s + (c >> 3) * WgTile<D>::SPAN + r * 128 + (((c & 7) ^ (r & 7)) << 4), v);
  }
}

// The loader warp: every (row tile, key tile) of the CTA in the consumers' order.
template <class E, int D>
__device__ __forceinline__ void wg_loader(const AttnParams& p, const WgMaps& maps,
                                          const ReqInfo& rq, const int32_t* bt_row, int kvh,
                                          uint32_t kv_u, uint32_t full_u, uint32_t empty_u,
                                          uint64_t* mask_s) {
  using T = WgTile<D>;
  constexpr int S = T::STAGES;
  const int lane = threadIdx.x & 31;
  const int bs = static_cast<int>(p.div_bs.d);
  const int rows = bs < 64 ? bs : 64;  // rows a box
  const int boxes = 64 / rows;         // pages a tile (<= 8)
  const uint32_t box_bytes = static_cast<uint32_t>(rows) * 128;
  int it = 0;
  for (int i0 = 0; i0 < rq.nrows; i0 += T::BM) {
    const int i1 = min(i0 + T::BM, rq.nrows);
    int start = 0, end = 0, begin = 0;
    const int nkt = tile_keys(p, rq, i0, i1, T::BN, start, end, begin, true);
    for (int kt = 0; kt < nkt; ++kt, ++it) {
      const int st = it % S;
      if (it >= S) mbar_wait(empty_u + 8 * st, ((it / S) - 1) & 1);
      const int n0 = start + kt * T::BN;
      int blk = 0, row0 = 0;
      bool load = false;
      if (lane < boxes) {
        const int k0 = n0 + lane * rows;  // the box's first key
        if (k0 < end && k0 > begin - rows) {  // k0 < end <= M * block_size: its page < M
          const uint32_t bi = p.div_bs.div(static_cast<uint32_t>(k0));
          row0 = k0 - static_cast<int>(bi) * bs;
          const int64_t b64 = __ldg(bt_row + static_cast<int64_t>(bi) * p.bt_st_m);
          load = b64 >= 0 && b64 < p.num_blocks;
          blk = static_cast<int>(b64);
        }
      }
      const uint32_t loaded = __ballot_sync(0xffffffffu, load);
      // keys lane and lane + 32 of the tile: loaded and in [begin, end)
      const int ka = n0 + lane, kb = n0 + lane + 32;
      const bool oka = ((loaded >> (lane / rows)) & 1u) && ka >= begin && ka < end;
      const bool okb = ((loaded >> ((lane + 32) / rows)) & 1u) && kb >= begin && kb < end;
      const uint32_t ma = __ballot_sync(0xffffffffu, oka), mb = __ballot_sync(0xffffffffu, okb);
      if (lane == 0) {
        mask_s[st] = static_cast<uint64_t>(ma) | (static_cast<uint64_t>(mb) << 32);
        mbar_arrive_tx(full_u + 8 * st, __popc(loaded) * box_bytes * 2 * T::HALVES);  // releases
      }
      __syncwarp();
      if (load) {
        const uint32_t k_dst = kv_u + st * T::STAGE_BYTES + lane * box_bytes;
        const int c1 = maps.head_outer ? row0 : kvh, c2 = maps.head_outer ? kvh : row0;
#pragma unroll
        for (int h = 0; h < T::HALVES; ++h) {
          tma_load_4d(k_dst + h * T::SPAN, &maps.k, full_u + 8 * st, h * 64, c1, c2, blk);
          tma_load_4d(k_dst + T::KV_BYTES + h * T::SPAN, &maps.v, full_u + 8 * st, h * 64, c1,
                      c2, blk);
        }
      }
    }
  }
}
#endif  // DFLASH_OPS_WGMMA

// One CTA per (request, KV head, split), as attn_mma_kernel; 160 threads.
template <class E, int D>
__global__ void __launch_bounds__(kWgBound, kWgCtasPerSm)
    attn_wgmma_kernel(const __grid_constant__ AttnParams p, const __grid_constant__ WgMaps maps) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
#if DFLASH_OPS_WGMMA
  using T = WgTile<D>;
  constexpr int S = T::STAGES, NT = T::BN / 8, DT = D / 8;
  constexpr bool kBF = IsBF16<E>::value;
  extern __shared__ __align__(1024) char wg_smem[];  // 1024-byte aligned: the swizzle atoms
  char* const smem = wg_smem;
  const uint32_t base = smem_addr(smem);
  const uint32_t kv_u = base + T::Q_BYTES;
  const uint32_t full_u = base + T::BAR_OFF, empty_u = full_u + 8 * S;
  uint64_t* const mask_s = reinterpret_cast<uint64_t*>(smem + T::BAR_OFF + 16 * S);
  const int lane = threadIdx.x & 31;
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0);  // uniform
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full_u + 8 * s, 1);
      mbar_init(empty_u + 8 * s, 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    fence_async_smem();
  }
  __syncthreads();
  const int b = blockIdx.x / p.hkv, kvh = blockIdx.x - b * p.hkv;
  if (blockIdx.y == 0) zero_unowned<E, D>(p, b, kvh);
  const ReqInfo rq = request_info(p, b);
  const int32_t* const bt_row = p.bt + b * p.bt_st_b;
  if (warp == 4) {
    wg_loader<E, D>(p, maps, rq, bt_row, kvh, kv_u, full_u, empty_u, mask_s);
    return;
  }

  // Loop bounds and branches around the wgmma made visibly warp-uniform (a value from lane 0):
  // ptxas serialises every wgmma it cannot prove the whole warp reaches.
  const int g = lane >> 2, tig = lane & 3;
  const int nrows = __shfl_sync(0xffffffffu, rq.nrows, 0);
  int it = 0;
  for (int i0 = 0; i0 < nrows; i0 += T::BM) {
    const int i1 = min(i0 + T::BM, nrows);
    int start = 0, end = 0, begin = 0;
    const int nkt =
        __shfl_sync(0xffffffffu, tile_keys(p, rq, i0, i1, T::BN, start, end, begin, true), 0);
    const int wrow = i0 + warp * 16;
    const RowKeys rk0 = row_keys(p, rq, wrow + g), rk1 = row_keys(p, rq, wrow + g + 8);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float o[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    if (nkt > 0) {  // CTA-uniform
      consumers_sync();  // the last row tile's wgmma reads of Q are over
      store_q_tile<E, D>(p, rq, kvh, i0, smem);
      fence_async_smem();
      consumers_sync();
      for (int kt = 0; kt < nkt; ++kt, ++it) {
        const int st = it % S;
        mbar_wait(full_u + 8 * st, (it / S) & 1);
        const uint32_t k_u = kv_u + st * T::STAGE_BYTES, v_u = k_u + T::KV_BYTES;
        // The stage's key mask, read by lane 0 alone and broadcast: lane 0 is the thread whose
        // empty-barrier arrive releases the stage back to the loader (which rewrites the mask),
        // so every read of it is ordered before that arrive in its own thread (racecheck
        // reported WAR hazards here when all 32 lanes read it, ordered only by __syncwarp).
        uint64_t okm = 0;
        if (lane == 0) okm = *reinterpret_cast<volatile uint64_t*>(mask_s + st);
        okm = __shfl_sync(0xffffffffu, okm, 0);
        if (okm != ~uint64_t{0}) {  // zero masked keys' V rows (okm is warp-uniform)
          char* const v_s = smem + T::Q_BYTES + st * T::STAGE_BYTES + T::KV_BYTES;
          for (int idx = threadIdx.x; idx < 64 * 8 * T::HALVES; idx += 128) {
            const int r = idx & 63, c = idx >> 6;  // row, 16-byte chunk (all spans)
            if (!((okm >> r) & 1u)) {
              store_pack(v_s + (c >> 3) * T::SPAN + r * 128 + ((c & 7) << 4),
                         zero_pack<Pack<uint32_t, 4>>());
            }
          }
          fence_async_smem();
          consumers_sync();
        }
        // S = Q K^T: k-step kk reads 16 dims, 32 bytes into span kk / 4 of each row
        float s[NT][4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t off = (kk >> 2) * T::SPAN + (kk & 3) * 32;
          wgmma_ss_n64<kBF>(s, sw128_desc(base + off, 16, 1024), sw128_desc(k_u + off, 16, 1024),
                            kk > 0);
        }
        wg_commit();
        wg_wait_all();
        const int n0 = start + kt * T::BN;
        online_softmax(s, o, [&](int c) { return static_cast<uint32_t>(okm >> c) & 3u; }, tig,
                       rk0.lo - n0, rk0.hi - n0, rk1.lo - n0, rk1.hi - n0, p.scale2, m0, m1, l0,
                       l1);
        // O += P V (P rounded to q's dtype, packed before the fence): k-step kk is keys
        // [16 kk, 16 kk + 16), 2 KB on
        uint32_t a[T::BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < T::BN / 16; ++kk) {
          a[kk][0] = pack2<kBF>(s[2 * kk][0], s[2 * kk][1]);
          a[kk][1] = pack2<kBF>(s[2 * kk][2], s[2 * kk][3]);
          a[kk][2] = pack2<kBF>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
          a[kk][3] = pack2<kBF>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < T::BN / 16; ++kk) {
          wgmma_rs<kBF>(o, a[kk], sw128_desc(v_u + kk * 2048, T::SPAN, 1024));
        }
        wg_commit();
        wg_wait_all();
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_u + 8 * st);  // this warp's reads of the stage are over
      }
    }
    pdl_trigger();  // the last row tile's keys are done: the next grid may start launching
    write_rows<E, D>(p, rq, kvh, wrow, i1, g, tig, nkt > 0, o, m0, m1, l0, l1);
  }
#else
  __trap();  // not built for sm_90a: the host never launches this stub
#endif
}

}  // namespace attention
}  // namespace dflash_ops
