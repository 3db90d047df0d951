// The building blocks of the block-attention kernels (attention_kernels.cuh): the launch
// parameters, PTX wrappers (cp.async, ldmatrix, mma.sync), the shared-memory tile geometry, a
// request's rows and visible keys, the tile loads, and the rows no request owns. Header only,
// included (through attention_kernels.cuh) by attention.cu alone.
#pragma once

#include "common.cuh"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace dflash_ops {
namespace attention {

using namespace detail;  // common.cuh

constexpr int kThreads = 128;  // 4 warps a CTA (both attention kernels)
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kCombineRows = 8;  // combine_kernel: one warp per row, 8 rows a CTA

struct AttnParams {
  const void* q;  // [Tq, Hq, D], element strides q_st_t, q_st_h; 16-byte aligned rows
  int64_t q_st_t, q_st_h;
  const void* k;  // caches, element strides of [num_blocks, block_size, Hkv]
  const void* v;
  int64_t k_st_b, k_st_r, k_st_h;
  int64_t v_st_b, v_st_r, v_st_h;
  const int32_t* bt;  // block_table [B, M]
  int64_t bt_st_b, bt_st_m;
  const int32_t* seq_lens;
  int64_t sl_st;
  const int32_t* qsl;  // query_start_loc [B + 1]
  int64_t qsl_st;
  const float* sinks;  // [Hq] or null
  int64_t sk_st;
  void* out;  // [Tq, Hq, D], element strides o_st_t, o_st_h; 16-byte aligned rows
  int64_t o_st_t, o_st_h;
  float* part;  // splits > 1: [splits][rows][D] partial O (normalised)
  float* lse;   // splits > 1: [splits][rows] log2-sum-exp (scaled scores)
  int64_t num_blocks;
  int64_t max_keys;  // M * block_size
  int64_t window;    // <= 0: none; else clamped to <= 2^33 (wider is the same as none)
  int tq, hq, hkv, g, batch, splits;
  int64_t split_keys;  // > 0: split s is keys [s * split_keys, (s + 1) * split_keys), absolute
  int rows;  // Tq * Hq < 2^31
  FastDiv div_bs;  // block_size < 2^31
  float scale2;    // scale * log2(e)
  bool causal;
  bool kv_vec;  // caches on 16-byte boundaries: cp.async; else element loads
};

template <class E> struct IsBF16 : std::false_type {};
template <> struct IsBF16<BF16> : std::true_type {};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronous; ok == false writes 16 zero bytes and reads nothing
// (src must still be a valid address).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool ok) {
  const int n = ok ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_1() {  // all but the newest group complete
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}
template <int N>  // all but the newest N groups complete
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col), fp32 accumulation.
template <bool BF>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (BF) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to bf16 / fp16 (round to nearest even), lo in the low half.
template <bool BF>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (BF) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Physical 16-byte chunk of logical chunk c in row `row` of a tile with DC chunks a row: every
// 8 consecutive rows (an ldmatrix 8x8 read: one chunk of each) hit 8 distinct bank groups.
template <int DC>
__device__ __forceinline__ int swizzle(int row, int c) {
  if constexpr (DC >= 8) {
    return c ^ (row & 7);
  } else {
    return c ^ ((row / (8 / DC)) & (DC - 1));
  }
}

// ldmatrix addressing without a register per (k-step, n-tile): the swizzle of a row depends on
// row % 8 only, and for DC >= 8 logical chunk 8a + b (b < 8) lands at 8a + (b ^ (row % 8)). A
// lane's rows differ by multiples of 8 (immediates), so its chunks 2kk + hi need 4 offsets.
template <int DC>
struct LaneChunks {
  uint32_t off[4];  // bytes of logical chunk 2j + hi, j < min(4, DC / 2)
  __device__ __forceinline__ LaneChunks(int row, int hi) {
#pragma unroll
    for (int j = 0; j < 4; ++j) off[j] = 2 * j + hi < DC ? swizzle<DC>(row, 2 * j + hi) * 16 : 0;
  }
  __device__ __forceinline__ uint32_t chunk(int kk) const {  // logical chunk 2kk + hi
    if constexpr (DC >= 8) {
      return (kk >> 2) * 128 + off[kk & 3];
    } else {
      return off[kk];
    }
  }
};

// Tile geometry of the tensor-core kernel (bf16 / fp16): Q, STAGES (K, V) tiles in flight (the
// loads run one tile ahead of the math), and a flag byte a key of every stage.
template <int D>
struct MmaTile {
  static constexpr int STAGES = 2;
  static constexpr int BM = 64;                // rows: 4 warps x 16
  static constexpr int BN = D > 128 ? 32 : 64;  // keys a stage
  static constexpr int DC = D / 8;             // 16-byte chunks a row
  static constexpr int ROW = D * 2;            // bytes a row
  static constexpr int Q_BYTES = BM * ROW;
  static constexpr int KV_BYTES = BN * ROW;
  static constexpr int SMEM = Q_BYTES + 2 * STAGES * KV_BYTES + STAGES * BN;
  static __device__ __forceinline__ int offset(int row, int c) {
    return row * ROW + swizzle<DC>(row, c) * 16;
  }
};

// Tile geometry of the fp32 kernel: rows padded by 16 bytes (conflict-free float4 reads of
// 8 different rows).
template <int D>
struct F32Tile {
  static constexpr int BM = 32;  // rows: 4 warps x RW
  static constexpr int RW = 8;
  static constexpr int BN = 32;  // keys a stage: one a lane
  static constexpr int LD = D + 4;  // floats a shared-memory row
  static constexpr int DC = D / 4;
  static constexpr int ROW = LD * 4;
  static constexpr int Q_BYTES = BM * ROW;
  static constexpr int KV_BYTES = BN * ROW;
  static constexpr int P_LD = BN + 1;
  static constexpr int P_BYTES = 4 * RW * P_LD * 4;  // per warp: P [RW][BN + 1]
  static constexpr int A_BYTES = 4 * 2 * RW * 4;     // per warp: alpha (then l) and m
  static constexpr int SMEM = Q_BYTES + 4 * KV_BYTES + P_BYTES + A_BYTES + 2 * BN;
  // P V: lane (rg, cl) owns rows rg + LR * i (i < PR) and columns cl + CL * k (k < PC).
  static constexpr int CL = D < 32 ? D : 32;
  static constexpr int LR = 32 / CL;
  static constexpr int PR = RW / LR;
  static constexpr int PC = D / CL;
  static __device__ __forceinline__ int offset(int row, int c) { return row * ROW + c * 16; }
};

// What a CTA needs of its request. Its rows [0, nrows) are the request's tokens with a row of q
// in [0, Tq) (query_start_loc may hold anything), times G heads: row i is q's token t0 + i / G
// at position pos0 + i / G, where the request's token k sits at seq_len - q_len + k.
struct ReqInfo {
  int64_t pos0;
  int t0, seq, nrows;
};

__device__ __forceinline__ ReqInfo request_info(const AttnParams& p, int b) {
  const int64_t q0 = __ldg(p.qsl + b * p.qsl_st);
  const int64_t q1 = __ldg(p.qsl + (b + 1) * p.qsl_st);
  const int64_t qlen = q1 > q0 ? q1 - q0 : 0;
  int64_t seq = __ldg(p.seq_lens + b * p.sl_st);
  seq = seq < 0 ? 0 : (seq > p.max_keys ? p.max_keys : seq);  // < 2^31
  const int64_t tb = q0 < 0 ? -q0 : 0;  // first and last + 1 request tokens in [0, Tq)
  const int64_t te = min(qlen, static_cast<int64_t>(p.tq) - q0);
  ReqInfo r;
  r.pos0 = seq - qlen + tb;
  r.t0 = static_cast<int>(q0 + tb);
  r.seq = static_cast<int>(seq);
  r.nrows = te > tb ? static_cast<int>((te - tb) * p.g) : 0;
  return r;
}

// Keys [lo, hi) within [0, seq] that a query at position pos sees.
__device__ __forceinline__ void visible_keys(const AttnParams& p, int64_t seq, int64_t pos,
                                             int64_t& lo, int64_t& hi) {
  lo = 0;
  hi = seq;
  if (p.causal) hi = min(hi, pos + 1);
  if (p.window > 0) {
    lo = max(lo, pos - p.window + 1);
    if (!p.causal) hi = min(hi, pos + p.window);
  }
  lo = min(lo, seq);
  hi = max(hi, lo);
}

struct RowKeys {  // a row's visible keys [lo, hi); lo == hi == 0 for a row past the request
  int lo, hi;
};

__device__ __forceinline__ RowKeys row_keys(const AttnParams& p, const ReqInfo& rq, int i) {
  RowKeys r{0, 0};
  if (i < rq.nrows) {
    int64_t lo, hi;
    visible_keys(p, rq.seq, rq.pos0 + i / p.g, lo, hi);
    r.lo = static_cast<int>(lo);
    r.hi = static_cast<int>(hi);
  }
  return r;
}

// Element offset of row i's (token, head) in a [Tq, Hq, D] tensor of strides st_t, st_h, and
// its index t * Hq + h.
__device__ __forceinline__ void row_place(const AttnParams& p, const ReqInfo& rq, int kvh, int i,
                                          int64_t st_t, int64_t st_h, int64_t& off,
                                          int64_t& flat) {
  const int tk = i / p.g;
  const int64_t t = rq.t0 + tk;
  const int h = kvh * p.g + (i - tk * p.g);
  off = t * st_t + static_cast<int64_t>(h) * st_h;
  flat = t * p.hq + h;
}

// Row i's (token, head) in q; q itself for a row past the request (ok false: never read).
template <class Bits>
__device__ __forceinline__ const Bits* q_row(const AttnParams& p, const ReqInfo& rq, int kvh,
                                             int i, bool ok) {
  int64_t off = 0, flat;
  if (ok) row_place(p, rq, kvh, i, p.q_st_t, p.q_st_h, off, flat);
  return static_cast<const Bits*>(p.q) + off;
}

// The tile [i0, i1)'s share of keys for split blockIdx.y: [start, end), BN-aligned from lo, or
// from lo rounded down to a multiple of bn when `align` (with split_keys: the split's absolute
// keys, BN-aligned from 0): the first tile may then start below lo, and keys below ``begin``
// are zero-filled like those past end, so a stale NaN there cannot reach a sum;
// returns the number of BN-key steps (start and end are meaningful only when it is > 0).
__device__ __forceinline__ int tile_keys(const AttnParams& p, const ReqInfo& rq, int i0, int i1,
                                         int bn, int& start, int& end, int& begin,
                                         bool align = false) {
  int64_t lo, hi, lo_last, hi_last;
  visible_keys(p, rq.seq, rq.pos0 + i0 / p.g, lo, hi);
  visible_keys(p, rq.seq, rq.pos0 + (i1 - 1) / p.g, lo_last, hi_last);
  // lo and hi rise with the position: the first row has the lowest lo, the last the highest hi
  int64_t s0, e0;
  if (p.split_keys > 0) {  // absolute splits, tiles at absolute multiples of bn: batch-invariant
    const int64_t a = static_cast<int64_t>(blockIdx.y) * p.split_keys;
    s0 = max(a, lo / bn * bn);  // lo >= 0; a tile before a row's first key is masked for it
    e0 = min(hi_last, a + p.split_keys);
  } else {
    const int64_t from = align ? lo / bn * bn : lo;
    const int64_t span = max(hi_last - from, int64_t{0});
    const int64_t per = (span + p.splits - 1) / p.splits;
    const int64_t chunk = (per + bn - 1) / bn * bn;
    s0 = from + static_cast<int64_t>(blockIdx.y) * chunk;
    e0 = min(hi_last, s0 + chunk);
  }
  if (s0 >= e0) return 0;
  start = static_cast<int>(s0);  // 0 <= start < end <= seq_len < 2^31
  begin = static_cast<int>(lo);  // keys below lo: no row of the tile sees them (zero-filled)
  end = static_cast<int>(e0);
  return static_cast<int>((e0 - s0 + bn - 1) / bn);
}

// One 16-byte chunk into shared memory: cp.async (zero-fill when !ok), or element loads when
// the caches are not on 16-byte boundaries.
template <class Bits>
__device__ __forceinline__ void copy_chunk(char* dst, const Bits* src, bool ok, bool vec) {
  if (vec) {
    cp_async_16(smem_addr(dst), src, ok);
  } else {
    constexpr int N = 16 / static_cast<int>(sizeof(Bits));
    Pack<Bits, N> v = zero_pack<Pack<Bits, N>>();
    if (ok) {
#pragma unroll
      for (int e = 0; e < N; ++e) v.e[e] = src[e];
    }
    store_pack(dst, v);
  }
}

// Q rows [i0, i0 + BM) of the request into the tile (zeros past the request). One row per
// group of TPR = 128 / BM threads; a thread copies chunks tp + TPR * it of its row.
template <class E, class T>
__device__ __forceinline__ void load_q_tile(const AttnParams& p, const ReqInfo& rq, int kvh,
                                            int i0, char* dst) {
  using Bits = typename E::Bits;
  constexpr int EPC = 16 / static_cast<int>(sizeof(Bits));
  constexpr int TPR = kThreads / T::BM, CPT = T::DC / TPR;
  static_assert(kThreads % T::BM == 0 && T::DC % TPR == 0, "Q tile: uneven thread split");
  const int r = threadIdx.x / TPR, tp = threadIdx.x % TPR;
  const bool ok = i0 + r < rq.nrows;
  const Bits* const src = q_row<Bits>(p, rq, kvh, i0 + r, ok);
#pragma unroll
  for (int it = 0; it < CPT; ++it) {
    const int c = tp + TPR * it;
    cp_async_16(smem_addr(dst + T::offset(r, c)), src + c * EPC, ok);
  }
}

// Keys [n0, n0 + BN) into a stage: K and V rows gathered through the block table; a key below
// `begin`, past `end` or in a block outside [0, num_blocks) is zero-filled and flagged 0 in
// ok_dst. One key
// row per group of TPR = 128 / BN threads (one block-table read a thread).
template <class E, class T>
__device__ __forceinline__ void load_kv_tile(const AttnParams& p, const int32_t* bt_row, int kvh,
                                             int n0, int begin, int end, char* k_dst,
                                             char* v_dst, uint8_t* ok_dst) {
  using Bits = typename E::Bits;
  constexpr int EPC = 16 / static_cast<int>(sizeof(Bits));
  constexpr int TPR = kThreads / T::BN, CPT = T::DC / TPR;
  static_assert(kThreads % T::BN == 0 && T::DC % TPR == 0, "K/V tile: uneven thread split");
  const int r = threadIdx.x / TPR, tp = threadIdx.x % TPR;
  const int64_t j = static_cast<int64_t>(n0) + r;
  bool ok = false;
  int64_t ko = 0, vo = 0;
  if (j >= begin && j < end) {  // end <= seq_len <= M * block_size: j / block_size < M
    const uint32_t jj = static_cast<uint32_t>(j);
    const uint32_t bi = p.div_bs.div(jj);
    const int64_t br = jj - bi * p.div_bs.d;
    const int64_t blk = __ldg(bt_row + static_cast<int64_t>(bi) * p.bt_st_m);
    if (blk >= 0 && blk < p.num_blocks) {
      ok = true;
      ko = blk * p.k_st_b + br * p.k_st_r + kvh * p.k_st_h;
      vo = blk * p.v_st_b + br * p.v_st_r + kvh * p.v_st_h;
    }
  }
  if (tp == 0) ok_dst[r] = ok;
  const Bits* const ks = static_cast<const Bits*>(p.k) + ko;  // the cache's first row if !ok
  const Bits* const vs = static_cast<const Bits*>(p.v) + vo;
#pragma unroll
  for (int it = 0; it < CPT; ++it) {
    const int c = tp + TPR * it;
    const int so = T::offset(r, c);
    copy_chunk(k_dst + so, ks + c * EPC, ok, p.kv_vec);
    copy_chunk(v_dst + so, vs + c * EPC, ok, p.kv_vec);
  }
}

// Rows of tokens [t_lo, t_hi) x heads of kvh that no request owns: zeros in out (splits == 1),
// else lse = -inf in every split (the combine writes the zeros).
template <class E, int D>
__device__ void zero_rows(const AttnParams& p, int64_t t_lo, int64_t t_hi, int kvh) {
  if (t_hi <= t_lo) return;
  const int64_t n = (t_hi - t_lo) * p.g;
  if (p.splits == 1) {
    using Bits = typename E::Bits;
    constexpr int EPV = 16 / static_cast<int>(sizeof(Bits));
    constexpr int V = D / EPV;  // 16-byte vectors a row (D * elem >= 32 bytes)
    Bits* const ob = static_cast<Bits*>(p.out);
    for (int64_t idx = threadIdx.x; idx < n * V; idx += blockDim.x) {
      const int64_t row = idx / V;
      const int v = static_cast<int>(idx % V);
      const int64_t tk = row / p.g;
      const int64_t h = kvh * p.g + (row - tk * p.g);
      store_pack(ob + (t_lo + tk) * p.o_st_t + h * p.o_st_h + v * EPV,
                 zero_pack<Pack<Bits, EPV>>());
    }
  } else {
    for (int64_t idx = threadIdx.x; idx < n * p.splits; idx += blockDim.x) {
      const int64_t s = idx / n, row = idx - s * n;
      const int64_t tk = row / p.g;
      const int64_t h = kvh * p.g + (row - tk * p.g);
      p.lse[s * p.rows + (t_lo + tk) * p.hq + h] = -INFINITY;
    }
  }
}

template <class E, int D>
__device__ void zero_unowned(const AttnParams& p, int b, int kvh) {
  if (b == 0) {
    const int64_t q0 = __ldg(p.qsl);
    zero_rows<E, D>(p, 0, min(q0, static_cast<int64_t>(p.tq)), kvh);
  }
  if (b == p.batch - 1) {
    const int64_t qb = __ldg(p.qsl + p.batch * p.qsl_st);
    zero_rows<E, D>(p, max(qb, int64_t{0}), p.tq, kvh);
  }
}

// 1 / (1 + 2^(sink2 - lse2)): the share of the denominator that the keys keep.
__device__ __forceinline__ float sink_factor(const AttnParams& p, int64_t h, float lse2) {
  const float sink2 = __ldg(p.sinks + h * p.sk_st) * kLog2e;
  return 1.f / (1.f + ex2(sink2 - lse2));
}

// One key tile of a warp's 16 rows in the mma accumulator layout (rows g and g + 8 of the warp,
// columns 8n + 2tig + {0, 1}): masks the scores (ok2(c): bit 0 / 1 for keys c / c + 1 of the
// tile loaded; lo*, hi*: the rows' visible keys relative to the tile), scales them to the log2
// domain, updates the running max m and sum l (this thread's columns; summed over the quad in
// write_rows) and rescales O; s becomes P (unrounded).
template <int NT, int DT, class Ok2>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&o)[DT][4],
                                               const Ok2& ok2, int tig, int lo0, int hi0,
                                               int lo1, int hi1, float scale2, float& m0,
                                               float& m1, float& l0, float& l1) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int c = n * 8 + 2 * tig;
    const uint32_t okp = ok2(c);
    const bool oka = (okp & 1u) != 0, okb = (okp & 2u) != 0;
    s[n][0] = (oka && c >= lo0 && c < hi0) ? s[n][0] * scale2 : -INFINITY;
    s[n][1] = (okb && c + 1 >= lo0 && c + 1 < hi0) ? s[n][1] * scale2 : -INFINITY;
    s[n][2] = (oka && c >= lo1 && c < hi1) ? s[n][2] * scale2 : -INFINITY;
    s[n][3] = (okb && c + 1 >= lo1 && c + 1 < hi1) ? s[n][3] * scale2 : -INFINITY;
    mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
    mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  // m -> max(m, tile max); l and O rescaled by 2^(m_old - m_new)
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  const float ms0 = mn0 == -INFINITY ? 0.f : mn0;
  const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
  const float al0 = ex2(m0 - ms0), al1 = ex2(m1 - ms1);
  m0 = mn0;
  m1 = mn1;
  float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    s[n][0] = ex2(s[n][0] - ms0);
    s[n][1] = ex2(s[n][1] - ms0);
    s[n][2] = ex2(s[n][2] - ms1);
    s[n][3] = ex2(s[n][3] - ms1);
    ps0 += s[n][0] + s[n][1];
    ps1 += s[n][2] + s[n][3];
  }
  l0 = l0 * al0 + ps0;
  l1 = l1 * al1 + ps1;
#pragma unroll
  for (int n = 0; n < DT; ++n) {
    o[n][0] *= al0;
    o[n][1] *= al0;
    o[n][2] *= al1;
    o[n][3] *= al1;
  }
}

// The epilogue of a warp's rows g (r = 0) and g + 8 (r = 1) in the mma accumulator layout:
// splits == 1: O / l (times the sink factor) into out; else the normalised partial O (when the
// CTA saw any key tile) and the log2-sum-exp into the split's slices.
template <class E, int D>
__device__ __forceinline__ void write_rows(const AttnParams& p, const ReqInfo& rq, int kvh,
                                           int wrow, int i1, int g, int tig, bool any,
                                           const float (&o)[D / 8][4], float m0, float m1,
                                           float l0, float l1) {
  using Bits = typename E::Bits;
  constexpr bool kBF = IsBF16<E>::value;
  constexpr int DT = D / 8;
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = wrow + g + 8 * r;
    if (i >= i1) continue;
    const float l = r ? l1 : l0, m = r ? m1 : m0;
    const bool seen = l > 0.f;
    float f = seen ? 1.f / l : 0.f;
    const float lse2 = seen ? m + log2f(l) : -INFINITY;
    if (p.splits == 1) {
      int64_t off, flat;
      row_place(p, rq, kvh, i, p.o_st_t, p.o_st_h, off, flat);
      if (p.sinks != nullptr && seen) f *= sink_factor(p, flat % p.hq, lse2);
      Bits* const dst = static_cast<Bits*>(p.out) + off + 2 * tig;
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        *reinterpret_cast<uint32_t*>(dst + n * 8) =
            pack2<kBF>(o[n][2 * r] * f, o[n][2 * r + 1] * f);
      }
    } else {
      int64_t off, flat;
      row_place(p, rq, kvh, i, 0, 0, off, flat);
      const int64_t prow = static_cast<int64_t>(blockIdx.y) * p.rows + flat;
      if (any) {
        float* const dst = p.part + prow * D + 2 * tig;
#pragma unroll
        for (int n = 0; n < DT; ++n) {
          *reinterpret_cast<float2*>(dst + n * 8) =
              make_float2(o[n][2 * r] * f, o[n][2 * r + 1] * f);
        }
      }
      if (tig == 0) p.lse[prow] = lse2;
    }
  }
}

}  // namespace attention
}  // namespace dflash_ops
