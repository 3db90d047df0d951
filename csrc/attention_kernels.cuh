// The block-attention kernels of attention.cu: attn_mma_kernel (bf16 / fp16, tensor cores),
// attn_f32_kernel (fp32) and combine_kernel (the merge of the key splits). Header only, included
// by attention.cu alone; their building blocks are in attention_common.cuh.
//
// One CTA (128 threads) per (request b, KV head, split s): grid (B * Hkv, SPLITS). The CTA's
// rows are the request's (token, head) pairs of its KV head, flattened token-major (row i is
// token i / G, query head kvh * G + i % G, G = Hq / Hkv), walked in tiles of BM rows, so each
// request's K/V is read once per KV head and split for every BM rows. A tile's visible key
// range [lo, hi) follows from its first and last token: [0, seq_len), cut to <= the last
// position when causal, to the window around the first (and, non-causal, last) position; the
// split s takes the s-th of SPLITS BN-aligned equal pieces of it. Every row also carries its
// own [lo, hi) (causal / window), applied as a mask; a key whose block id is outside
// [0, num_blocks) is zero-filled in shared memory and masked (so neither its K nor its V, which
// may hold anything, reaches the sums). Online softmax in fp32, log2 domain (scale * log2 e).
//
// bf16 / fp16 (attn_mma_kernel): BM = 64 rows (4 warps x 16), BN = 64 keys (32 for D = 256).
// Q tile and two (K, V) stages in shared memory (the loads run one tile ahead of the math),
// filled by 16-byte cp.async (zero-fill for hidden keys and rows past the tile); rows are
// XOR-swizzled by 16-byte chunk so that ldmatrix is free of bank conflicts for every D.
// S = Q K^T and O += P V by mma.sync.m16n8k16 (fp32 accumulation; ldmatrix for Q and K,
// ldmatrix.trans for V); P is rounded to q's dtype for the P V product (as the Triton kernel).
// Each warp holds its 16 rows' O (D / 2 floats a thread) and S tile (BN / 2 floats a thread);
// warps whose rows all lie past the request skip the math. Shared memory: D = 64: 40 KB, 128:
// 80 KB, 256: 96 KB. Loads: one key (or Q) row per group of 128 / rows threads (one block-table
// read a thread, 16-byte chunks at immediate offsets). Registers (ptxas, sm_90a): D = 64: 164,
// 128: 205, 256: 249, no spills; 2 CTAs an SM for D = 128 / 256 (shared memory and registers),
// 3 for D = 64.
// fp32 (attn_f32_kernel, no tensor cores, fp32 FMA throughout): BM = 32 rows (8 a warp),
// BN = 32 keys, rows padded by 16 bytes; a lane scores one key against its warp's 8 rows, then
// P goes through shared memory for P V, where a lane owns D / 32 columns of the 8 rows
// (D = 16: 16 columns of 4 rows). Shared memory up to 167 KB (D = 256); 254 registers; 1 CTA.
//
// SPLITS comes from the SM count, B * Hkv, M * block_size and (a cap on the fp32 partial
// buffer) Tq * Hq * D, never from seq_lens, so a launch replays in a CUDA graph for any lengths.
// SPLITS == 1: the CTA normalises, applies the sinks (o *= 1 / (1 + exp(sink - lse)) for rows
// that see at least one key) and writes out. Else it writes its normalised partial O (fp32) and
// its log2-sum-exp per row (-inf for a row that saw nothing; empty splits skip the O write), and
// combine_kernel (a warp per output row) merges them: lse = log2sum_s exp2(lse_s),
// o = sum_s exp2(lse_s - lse) o_s, then the sinks. Rows no request owns (before qsl[0], from
// qsl[B] on) are zeroed by the split-0 CTAs of the first and the last request (with splits,
// their lse is set to -inf instead and the combine writes the zeros).
#pragma once

#include "attention_common.cuh"
#include "common.cuh"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace dflash_ops {
namespace attention {

using namespace detail;  // common.cuh

// ---------------------------------------------------------------------------------------------
// bf16 / fp16: tensor cores.
//
// Warp w owns tile rows [16w, 16w + 16); a thread (g = lane / 4, tig = lane % 4) holds rows g
// and g + 8 of them: S columns 8n + 2tig + {0, 1} of each 8-key n-tile, O columns of each
// 8-wide d-tile likewise (the mma.m16n8k16 accumulator layout).
template <class E, int D>
__global__ void __launch_bounds__(kThreads, 2)
    attn_mma_kernel(const __grid_constant__ AttnParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using T = MmaTile<D>;
  constexpr int S = T::STAGES;
  constexpr bool kBF = IsBF16<E>::value;
  constexpr int BN = T::BN, NT = BN / 8, DT = D / 8;
  extern __shared__ __align__(128) char smem[];
  char* const q_s = smem;
  char* const kv_s = smem + T::Q_BYTES;  // stage s: K at 2s, V at 2s + 1 (x KV_BYTES)
  uint8_t* const ok_s = reinterpret_cast<uint8_t*>(smem + T::Q_BYTES + 2 * S * T::KV_BYTES);
  const uint32_t q_u = smem_addr(q_s), kv_u = smem_addr(kv_s);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  // per-lane ldmatrix addresses: Q (A operand), K (B), V (B, transposed); stage base added later
  const int q_row = warp * 16 + (lane & 15);
  const int k_row = (lane & 7) + ((lane >> 4) << 3);
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3);
  const uint32_t q_lane = q_u + q_row * T::ROW, k_lane = k_row * T::ROW, v_lane = v_row * T::ROW;
  const LaneChunks<T::DC> q_ch(q_row, lane >> 4), k_ch(k_row, (lane >> 3) & 1),
      v_ch(v_row, lane >> 4);
  const int b = blockIdx.x / p.hkv, kvh = blockIdx.x - b * p.hkv;
  if (blockIdx.y == 0) zero_unowned<E, D>(p, b, kvh);
  const ReqInfo rq = request_info(p, b);
  const int32_t* const bt_row = p.bt + b * p.bt_st_b;

  for (int i0 = 0; i0 < rq.nrows; i0 += T::BM) {
    const int i1 = min(i0 + T::BM, rq.nrows);
    int start = 0, end = 0, begin = 0;
    const int nkt = tile_keys(p, rq, i0, i1, BN, start, end, begin);
    const int wrow = i0 + warp * 16;
    const bool active = wrow < i1;  // warp-uniform
    const RowKeys rk0 = row_keys(p, rq, wrow + g), rk1 = row_keys(p, rq, wrow + g + 8);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float o[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    if (nkt > 0) {  // CTA-uniform
      // groups: Q + tile 0, then one a tile (empty past the last), S - 1 tiles ahead
      load_q_tile<E, T>(p, rq, kvh, i0, q_s);
#pragma unroll
      for (int ps = 0; ps < S - 1; ++ps) {
        if (ps < nkt) {
          load_kv_tile<E, T>(p, bt_row, kvh, start + ps * BN, begin, end,
                             kv_s + 2 * ps * T::KV_BYTES,
                             kv_s + (2 * ps + 1) * T::KV_BYTES, ok_s + ps * BN);
        }
        cp_async_commit();
      }
      for (int kt = 0; kt < nkt; ++kt) {
        const int st = kt % S;
        if (kt + S - 1 < nkt) {  // into the stage computed last iteration (freed by its sync)
          const int ns = (kt + S - 1) % S;
          load_kv_tile<E, T>(p, bt_row, kvh, start + (kt + S - 1) * BN, begin, end,
                             kv_s + 2 * ns * T::KV_BYTES, kv_s + (2 * ns + 1) * T::KV_BYTES,
                             ok_s + ns * BN);
        }
        cp_async_commit();
        cp_async_wait<S - 1>();  // tile kt (and Q) landed
        __syncthreads();
        if (active) {
          const uint32_t k_u = kv_u + 2 * st * T::KV_BYTES, v_u = k_u + T::KV_BYTES;
          // S = Q K^T
          float s[NT][4];
#pragma unroll
          for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[4];
            ldsm_x4(a, q_lane + q_ch.chunk(kk));
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
              uint32_t kb[4];
              ldsm_x4(kb, k_u + k_lane + np * 16 * T::ROW + k_ch.chunk(kk));
              mma_16816<kBF>(s[2 * np], a, kb[0], kb[1]);
              mma_16816<kBF>(s[2 * np + 1], a, kb[2], kb[3]);
            }
          }
          // mask (hidden keys, keys past the split, causal / window per row), online softmax
          const int n0 = start + kt * BN;  // < end
          const uint8_t* const okt = ok_s + st * BN;
          online_softmax(
              s, o,
              [&](int c) {
                const uint32_t okp = *reinterpret_cast<const uint16_t*>(okt + c);
                return ((okp & 0xffu) != 0 ? 1u : 0u) | ((okp >> 8) != 0 ? 2u : 0u);
              },
              tig, rk0.lo - n0, rk0.hi - n0, rk1.lo - n0, rk1.hi - n0, p.scale2, m0, m1, l0, l1);
          // O += P V (P rounded to q's dtype)
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t a[4];
            a[0] = pack2<kBF>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<kBF>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<kBF>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<kBF>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
              uint32_t vb[4];
              ldsm_x4_t(vb, v_u + v_lane + kk * 16 * T::ROW + v_ch.chunk(dp));
              mma_16816<kBF>(o[2 * dp], a, vb[0], vb[1]);
              mma_16816<kBF>(o[2 * dp + 1], a, vb[2], vb[3]);
            }
          }
        }
        __syncthreads();  // the stage is free for the load S iterations on
      }
    }

    pdl_trigger();  // the last row tile's keys are done: the next grid may start launching
    write_rows<E, D>(p, rq, kvh, wrow, i1, g, tig, nkt > 0, o, m0, m1, l0, l1);
  }
}

// ---------------------------------------------------------------------------------------------
// fp32: CUDA cores. Warp w owns tile rows [8w, 8w + 8). Scores: lane = key, all 8 rows (Q reads
// are broadcasts); softmax statistics are warp-wide per row. P V: P and the rescale factors
// through shared memory, lane (rg, cl) accumulates rows rg + LR * i, columns cl + CL * k.
template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    attn_f32_kernel(const __grid_constant__ AttnParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using T = F32Tile<D>;
  constexpr int BN = T::BN, RW = T::RW, LD = T::LD;
  constexpr int CL = T::CL, LR = T::LR, PR = T::PR, PC = T::PC;
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  char* const q_c = smem;
  char* const kv_c = smem + T::Q_BYTES;
  float* const p_s = reinterpret_cast<float*>(kv_c + 4 * T::KV_BYTES) + warp * RW * T::P_LD;
  float* const a_s = reinterpret_cast<float*>(kv_c + 4 * T::KV_BYTES + T::P_BYTES) + warp * 2 * RW;
  uint8_t* const ok_s =
      reinterpret_cast<uint8_t*>(kv_c + 4 * T::KV_BYTES + T::P_BYTES + T::A_BYTES);
  const float* const q_s = reinterpret_cast<const float*>(q_c) + warp * RW * LD;
  const int cl = lane % CL, rg = lane / CL;

  const int b = blockIdx.x / p.hkv, kvh = blockIdx.x - b * p.hkv;
  if (blockIdx.y == 0) zero_unowned<F32, D>(p, b, kvh);
  const ReqInfo rq = request_info(p, b);
  const int32_t* const bt_row = p.bt + b * p.bt_st_b;

  for (int i0 = 0; i0 < rq.nrows; i0 += T::BM) {
    const int i1 = min(i0 + T::BM, rq.nrows);
    int start = 0, end = 0, begin = 0;
    const int nkt = tile_keys(p, rq, i0, i1, BN, start, end, begin);
    const int wrow = i0 + warp * RW;
    const bool active = wrow < i1;
    int lo[RW], hi[RW];
    float m[RW], ls[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const RowKeys rk = row_keys(p, rq, wrow + r);
      lo[r] = rk.lo;
      hi[r] = rk.hi;
      m[r] = -INFINITY;
      ls[r] = 0.f;
    }
    float acc[PR][PC];
#pragma unroll
    for (int r = 0; r < PR; ++r) {
#pragma unroll
      for (int k = 0; k < PC; ++k) acc[r][k] = 0.f;
    }

    if (nkt > 0) {
      load_q_tile<F32, T>(p, rq, kvh, i0, q_c);
      load_kv_tile<F32, T>(p, bt_row, kvh, start, begin, end, kv_c, kv_c + T::KV_BYTES, ok_s);
      cp_async_commit();
      for (int kt = 0; kt < nkt; ++kt) {
        const int st = kt & 1;
        if (kt + 1 < nkt) {
          const int ns = st ^ 1;
          load_kv_tile<F32, T>(p, bt_row, kvh, start + (kt + 1) * BN, begin, end,
                               kv_c + 2 * ns * T::KV_BYTES, kv_c + (2 * ns + 1) * T::KV_BYTES,
                               ok_s + ns * BN);
        }
        cp_async_commit();
        cp_async_wait_1();
        __syncthreads();
        if (active) {
          const float* const k_s = reinterpret_cast<const float*>(kv_c + 2 * st * T::KV_BYTES);
          const float* const v_s = k_s + T::KV_BYTES / 4;
          float sc[RW];
#pragma unroll
          for (int r = 0; r < RW; ++r) sc[r] = 0.f;
#pragma unroll 4
          for (int d4 = 0; d4 < D / 4; ++d4) {
            const float4 kv = *reinterpret_cast<const float4*>(k_s + lane * LD + 4 * d4);
#pragma unroll
            for (int r = 0; r < RW; ++r) {
              const float4 qv = *reinterpret_cast<const float4*>(q_s + r * LD + 4 * d4);
              sc[r] = fmaf(qv.x, kv.x, sc[r]);
              sc[r] = fmaf(qv.y, kv.y, sc[r]);
              sc[r] = fmaf(qv.z, kv.z, sc[r]);
              sc[r] = fmaf(qv.w, kv.w, sc[r]);
            }
          }
          const int n0 = start + kt * BN;
          const bool okc = ok_s[st * BN + lane] != 0;
#pragma unroll
          for (int r = 0; r < RW; ++r) {
            const bool vis = okc && lane >= lo[r] - n0 && lane < hi[r] - n0;
            const float x = vis ? sc[r] * p.scale2 : -INFINITY;
            const float mn = fmaxf(m[r], warp_max(x));
            const float ms = mn == -INFINITY ? 0.f : mn;
            const float al = ex2(m[r] - ms);
            m[r] = mn;
            const float pr = ex2(x - ms);
            ls[r] = ls[r] * al + pr;  // this lane's keys; summed over the warp at the end
            p_s[r * T::P_LD + lane] = pr;
            if (lane == 0) a_s[r] = al;
          }
          __syncwarp();
#pragma unroll
          for (int r = 0; r < PR; ++r) {
            const float al = a_s[rg + LR * r];
#pragma unroll
            for (int k = 0; k < PC; ++k) acc[r][k] *= al;
          }
#pragma unroll 4
          for (int c = 0; c < BN; ++c) {
            float vv[PC];
#pragma unroll
            for (int k = 0; k < PC; ++k) vv[k] = v_s[c * LD + cl + CL * k];
#pragma unroll
            for (int r = 0; r < PR; ++r) {
              const float pv = p_s[(rg + LR * r) * T::P_LD + c];
#pragma unroll
              for (int k = 0; k < PC; ++k) acc[r][k] = fmaf(pv, vv[k], acc[r][k]);
            }
          }
        }
        __syncthreads();
      }
    }

    // epilogue: l and m per row through shared memory, then each lane its rows and columns
    float lt[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) lt[r] = warp_sum(ls[r]);
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        a_s[r] = lt[r];
        a_s[RW + r] = m[r];
      }
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < PR; ++r) {
      const int row = rg + LR * r;
      const int i = wrow + row;
      if (i >= i1) continue;
      const float l = a_s[row], mm = a_s[RW + row];
      const bool seen = l > 0.f;
      float f = seen ? 1.f / l : 0.f;
      const float lse2 = seen ? mm + log2f(l) : -INFINITY;
      if (p.splits == 1) {
        int64_t off, flat;
        row_place(p, rq, kvh, i, p.o_st_t, p.o_st_h, off, flat);
        if (p.sinks != nullptr && seen) f *= sink_factor(p, flat % p.hq, lse2);
        float* const dst = static_cast<float*>(p.out) + off + cl;
#pragma unroll
        for (int k = 0; k < PC; ++k) dst[CL * k] = acc[r][k] * f;
      } else {
        int64_t off, flat;
        row_place(p, rq, kvh, i, 0, 0, off, flat);
        const int64_t prow = static_cast<int64_t>(blockIdx.y) * p.rows + flat;
        if (nkt > 0) {
          float* const dst = p.part + prow * D + cl;
#pragma unroll
          for (int k = 0; k < PC; ++k) dst[CL * k] = acc[r][k] * f;
        }
        if (cl == 0) p.lse[prow] = lse2;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Split merge: one warp per output row (t, h) of [0, Tq) x [0, Hq); lane s < splits reads
// lse_s, each lane 4 columns (lane * 4 + 128 k) of every split that saw a key.
template <class E, int D>
__global__ void __launch_bounds__(32 * kCombineRows)
    combine_kernel(const __grid_constant__ AttnParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using Bits = typename E::Bits;
  constexpr int NV = (D + 127) / 128;
  const int lane = threadIdx.x & 31;
  pdl_trigger();  // a small one-wave grid: the next grid's launch overlaps the merge
  const int row = blockIdx.x * kCombineRows + static_cast<int>(threadIdx.x >> 5);
  if (row >= p.rows) return;  // warp-uniform
  const float ls = lane < p.splits ? p.lse[static_cast<int64_t>(lane) * p.rows + row] : -INFINITY;
  const float mx = warp_max(ls);
  const float ms = mx == -INFINITY ? 0.f : mx;
  const float w = ex2(ls - ms);  // 0 for an empty split and for lanes past the splits
  const float den = warp_sum(w);
  float4 acc[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < p.splits; ++s) {
    const float ws = __shfl_sync(0xffffffffu, w, s);
    if (ws > 0.f) {  // warp-uniform; a split with lse = -inf may not have written its O
      const float* const src = p.part + (static_cast<int64_t>(s) * p.rows + row) * D;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int d = lane * 4 + 128 * k;
        if (d < D) {
          const float4 v = *reinterpret_cast<const float4*>(src + d);
          acc[k].x = fmaf(ws, v.x, acc[k].x);
          acc[k].y = fmaf(ws, v.y, acc[k].y);
          acc[k].z = fmaf(ws, v.z, acc[k].z);
          acc[k].w = fmaf(ws, v.w, acc[k].w);
        }
      }
    }
  }
  const int t = row / p.hq, h = row - t * p.hq;
  const bool seen = den > 0.f;
  float f = seen ? 1.f / den : 0.f;
  if (p.sinks != nullptr && seen) f *= sink_factor(p, h, ms + log2f(den));
  Bits* const dst =
      static_cast<Bits*>(p.out) + static_cast<int64_t>(t) * p.o_st_t + h * p.o_st_h;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int d = lane * 4 + 128 * k;
    if (d < D) {
      Pack<Bits, 4> v;
      v.e[0] = E::from_float(acc[k].x * f);
      v.e[1] = E::from_float(acc[k].y * f);
      v.e[2] = E::from_float(acc[k].z * f);
      v.e[3] = E::from_float(acc[k].w * f);
      store_pack(dst + d, v);
    }
  }
}

}  // namespace attention
}  // namespace dflash_ops
