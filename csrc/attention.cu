// Paged block attention: block_attention and block_attention_out_ (reference:
// dflash_ops/ops/attention.py, block_attention_ref; the Triton version of the same algorithm:
// dflash_ops/triton/attention.py).
//
//   q            [Tq, Hq, D]                        any strides, unit stride in D
//   k_cache,     [num_blocks, block_size, Hkv, D]   any strides, unit stride in D; q's dtype
//   v_cache
//   block_table  [B, M] int32 (any strides): key j of request b is row j % block_size of block
//                block_table[b, j / block_size]; an id outside [0, num_blocks) hides its keys
//   seq_lens     [B] int32, clamped to [0, M * block_size] on the device
//   query_start_loc [B + 1] int32: request b owns the rows q[qsl[b]:qsl[b+1]], the last
//                q_len of its seq_len positions; rows outside [qsl[0], qsl[B]) get zeros
//   sinks        [Hq] fp32 (optional): a logit per head in the softmax denominator only
//   out          [Tq, Hq, D], q's dtype
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
// Q tile and S (K, V) stages in shared memory (S = 2, or 3 for D <= 128 with
// DFLASH_OPS_ATTN_STAGES=3: loads run S - 1 tiles ahead of the math), filled by 16-byte cp.async
// (zero-fill for hidden keys and rows past the tile); rows are XOR-swizzled by 16-byte chunk so
// that ldmatrix is free of bank conflicts for every D. S = Q K^T and O += P V by
// mma.sync.m16n8k16 (fp32 accumulation; ldmatrix for Q and K, ldmatrix.trans for V); P is
// rounded to q's dtype for the P V product (as the Triton kernel). Each warp holds its 16 rows'
// O (D / 2 floats a thread) and S tile (BN / 2 floats a thread); warps whose rows all lie past
// the request skip the math. Shared memory: D = 64: 40 KB, 128: 80 KB, 256: 96 KB. Loads: one
// key (or Q) row per group of 128 / rows threads (one block-table read a thread, 16-byte chunks
// at immediate offsets). Registers (ptxas, sm_90a): D = 64: 164, 128: 205, 256: 249, no spills;
// 2 CTAs an SM for D = 128 / 256 (shared memory and registers), 3 for D = 64.
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
//
// Device values are never read on the host. Offsets into the caches and into q / out are
// 64-bit; token and key indices are 32-bit (Tq * Hq < 2^31, seq_len < 2^31). A q or out that is
// not on 16-byte boundaries goes through a contiguous copy; caches that are not use 2- / 4-byte
// loads instead of cp.async (same kernel, a uniform branch).
#include "dflash_ops.h"

#include <cstdio>
#include <cstdlib>

#include "common.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>

namespace dflash_ops {
namespace {

using namespace detail;  // common.cuh

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

constexpr int kThreads = 128;  // 4 warps a CTA (both attention kernels)
constexpr int kMaxSplits = 32;
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
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
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

// Tile geometry of the tensor-core kernel (bf16 / fp16); S: (K, V) stages in flight.
template <int D, int S = 2>
struct MmaTile {
  static constexpr int STAGES = S;
  static constexpr int BM = 64;                // rows: 4 warps x 16
  static constexpr int BN = D > 128 ? 32 : 64;  // keys a stage
  static constexpr int DC = D / 8;             // 16-byte chunks a row
  static constexpr int ROW = D * 2;            // bytes a row
  static constexpr int Q_BYTES = BM * ROW;
  static constexpr int KV_BYTES = BN * ROW;
  static constexpr int SMEM = Q_BYTES + 2 * S * KV_BYTES + S * BN;  // Q, S x (K, V), key flags
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

// The tile [i0, i1)'s share of keys for split blockIdx.y: [start, end), BN-aligned from lo;
// returns the number of BN-key steps (start and end are meaningful only when it is > 0).
__device__ __forceinline__ int tile_keys(const AttnParams& p, const ReqInfo& rq, int i0, int i1,
                                         int bn, int& start, int& end) {
  int64_t lo, hi, lo_last, hi_last;
  visible_keys(p, rq.seq, rq.pos0 + i0 / p.g, lo, hi);
  visible_keys(p, rq.seq, rq.pos0 + (i1 - 1) / p.g, lo_last, hi_last);
  // lo and hi rise with the position: the first row has the lowest lo, the last the highest hi
  const int64_t span = max(hi_last - lo, int64_t{0});
  const int64_t per = (span + p.splits - 1) / p.splits;
  const int64_t chunk = (per + bn - 1) / bn * bn;
  const int64_t s0 = lo + static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t e0 = min(hi_last, s0 + chunk);
  if (s0 >= e0) return 0;
  start = static_cast<int>(s0);  // 0 <= start < end <= seq_len < 2^31
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
  const int i = i0 + r;
  const bool ok = i < rq.nrows;
  int64_t off = 0, flat;
  if (ok) row_place(p, rq, kvh, i, p.q_st_t, p.q_st_h, off, flat);
  const Bits* const src = static_cast<const Bits*>(p.q) + off;
#pragma unroll
  for (int it = 0; it < CPT; ++it) {
    const int c = tp + TPR * it;
    cp_async_16(smem_addr(dst + T::offset(r, c)), src + c * EPC, ok);
  }
}

// Keys [n0, n0 + BN) into a stage: K and V rows gathered through the block table; a key past
// `end` or in a block outside [0, num_blocks) is zero-filled and flagged 0 in ok_dst. One key
// row per group of TPR = 128 / BN threads (one block-table read a thread).
template <class E, class T>
__device__ __forceinline__ void load_kv_tile(const AttnParams& p, const int32_t* bt_row, int kvh,
                                             int n0, int end, char* k_dst, char* v_dst,
                                             uint8_t* ok_dst) {
  using Bits = typename E::Bits;
  constexpr int EPC = 16 / static_cast<int>(sizeof(Bits));
  constexpr int TPR = kThreads / T::BN, CPT = T::DC / TPR;
  static_assert(kThreads % T::BN == 0 && T::DC % TPR == 0, "K/V tile: uneven thread split");
  const int r = threadIdx.x / TPR, tp = threadIdx.x % TPR;
  const int64_t j = static_cast<int64_t>(n0) + r;
  bool ok = false;
  int64_t ko = 0, vo = 0;
  if (j < end) {  // end <= seq_len <= M * block_size: j / block_size < M
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

// ---------------------------------------------------------------------------------------------
// bf16 / fp16: tensor cores.
//
// Warp w owns tile rows [16w, 16w + 16); a thread (g = lane / 4, tig = lane % 4) holds rows g
// and g + 8 of them: S columns 8n + 2tig + {0, 1} of each 8-key n-tile, O columns of each
// 8-wide d-tile likewise (the mma.m16n8k16 accumulator layout).
template <class E, int D, int S>
__global__ void __launch_bounds__(kThreads, 2)
    attn_mma_kernel(const __grid_constant__ AttnParams p) {
  using T = MmaTile<D, S>;
  using Bits = typename E::Bits;
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
    int start = 0, end = 0;
    const int nkt = tile_keys(p, rq, i0, i1, BN, start, end);
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
          load_kv_tile<E, T>(p, bt_row, kvh, start + ps * BN, end, kv_s + 2 * ps * T::KV_BYTES,
                             kv_s + (2 * ps + 1) * T::KV_BYTES, ok_s + ps * BN);
        }
        cp_async_commit();
      }
      for (int kt = 0; kt < nkt; ++kt) {
        const int st = kt % S;
        if (kt + S - 1 < nkt) {  // into the stage computed last iteration (freed by its sync)
          const int ns = (kt + S - 1) % S;
          load_kv_tile<E, T>(p, bt_row, kvh, start + (kt + S - 1) * BN, end,
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
          // mask (hidden keys, keys past the split, causal / window per row), scale, row max
          const int n0 = start + kt * BN;  // < end
          const int lo0 = rk0.lo - n0, hi0 = rk0.hi - n0, lo1 = rk1.lo - n0, hi1 = rk1.hi - n0;
          const uint8_t* const okt = ok_s + st * BN;
          float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            const int c = n * 8 + 2 * tig;
            const uint32_t okp = *reinterpret_cast<const uint16_t*>(okt + c);
            const bool oka = (okp & 0xffu) != 0, okb = (okp >> 8) != 0;
            s[n][0] = (oka && c >= lo0 && c < hi0) ? s[n][0] * p.scale2 : -INFINITY;
            s[n][1] = (okb && c + 1 >= lo0 && c + 1 < hi0) ? s[n][1] * p.scale2 : -INFINITY;
            s[n][2] = (oka && c >= lo1 && c < hi1) ? s[n][2] * p.scale2 : -INFINITY;
            s[n][3] = (okb && c + 1 >= lo1 && c + 1 < hi1) ? s[n][3] * p.scale2 : -INFINITY;
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
          }
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
          // online softmax: m -> max(m, tile max); rescale l and O by 2^(m_old - m_new)
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
          l0 = l0 * al0 + ps0;  // this thread's columns only; summed over the quad at the end
          l1 = l1 * al1 + ps1;
#pragma unroll
          for (int n = 0; n < DT; ++n) {
            o[n][0] *= al0;
            o[n][1] *= al0;
            o[n][2] *= al1;
            o[n][3] *= al1;
          }
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

    // epilogue: rows g (r = 0) and g + 8 (r = 1) of the warp
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
        if (nkt > 0) {
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
}

// ---------------------------------------------------------------------------------------------
// fp32: CUDA cores. Warp w owns tile rows [8w, 8w + 8). Scores: lane = key, all 8 rows (Q reads
// are broadcasts); softmax statistics are warp-wide per row. P V: P and the rescale factors
// through shared memory, lane (rg, cl) accumulates rows rg + LR * i, columns cl + CL * k.
template <int D>
__global__ void __launch_bounds__(kThreads, 1)
    attn_f32_kernel(const __grid_constant__ AttnParams p) {
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
    int start = 0, end = 0;
    const int nkt = tile_keys(p, rq, i0, i1, BN, start, end);
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
      load_kv_tile<F32, T>(p, bt_row, kvh, start, end, kv_c, kv_c + T::KV_BYTES, ok_s);
      cp_async_commit();
      for (int kt = 0; kt < nkt; ++kt) {
        const int st = kt & 1;
        if (kt + 1 < nkt) {
          const int ns = st ^ 1;
          load_kv_tile<F32, T>(p, bt_row, kvh, start + (kt + 1) * BN, end,
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
  using Bits = typename E::Bits;
  constexpr int NV = (D + 127) / 128;
  const int lane = threadIdx.x & 31;
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

// ---------------------------------------------------------------------------------------------
// Host side: argument checks in the words of dflash_ops/ops/attention.py (_check_attn) and
// _checks.py, then the launch.

void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK_VALUE(t.scalar_type() == want, "dflash.", op, ": ", name, " must be ",
                    dtype_name(want), ", got ", dtype_name(t.scalar_type()));
}

void check_last_dim(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(last_dim_ok(t), "dflash.", op, ": ", name,
                    " must have unit stride in its last dimension, got strides ",
                    py_tuple(t.strides()));
}

// attention.py _check_attn, in its order; then the C++ limits.
void check_attn(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& block_table,
                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                const std::optional<at::Tensor>& sinks, const at::Tensor* out) {
  // q: [Tq, Hq, D] bf16/fp16/fp32 on CUDA, unit stride in D, D a supported head_dim
  check_rank(op, "q", q, 3);
  TORCH_CHECK_VALUE(is_float(q.scalar_type()), "dflash.", op,
                    ": q must be bfloat16/float16/float32, got ", dtype_name(q.scalar_type()));
  check_last_dim(op, "q", q);
  TORCH_CHECK_VALUE(q.is_cuda(), "dflash.", op, ": q must be a CUDA tensor, got device ",
                    q.device());
  const int64_t hq = q.size(1), d = q.size(2);
  TORCH_CHECK_VALUE(d == 16 || d == 32 || d == 64 || d == 128 || d == 256, "dflash.", op,
                    ": q head_dim must be one of [16, 32, 64, 128, 256], got ", d);
  const at::Device device = q.device();
  // k_cache, v_cache: [num_blocks, block_size, Hkv, D], q's dtype and device, unit stride in D
  for (const bool is_v : {false, true}) {
    const char* name = is_v ? "v_cache" : "k_cache";
    const at::Tensor& c = is_v ? v_cache : k_cache;
    check_rank(op, name, c, 4);
    check_device(op, name, c, device);
    check_last_dim(op, name, c);
    check_same_dtype(op, name, c, "q", q);
    TORCH_CHECK_VALUE(c.size(3) == d, "dflash.", op, ": ", name,
                      " must be [num_blocks, block_size, Hkv, D=", d, "], got ",
                      py_list(c.sizes()));
  }
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "dflash.", op,
                    ": v_cache must have the shape of k_cache ", py_list(k_cache.sizes()),
                    ", got ", py_list(v_cache.sizes()));
  const int64_t hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(hkv != 0 && hq % hkv == 0, "dflash.", op, ": q's ", hq,
                    " heads must be a multiple of the caches' Hkv = ", hkv);
  // block_table [B, M], seq_lens [B], query_start_loc [B + 1]: int32 on q's device
  check_rank(op, "block_table", block_table, 2);
  check_dtype(op, "block_table", block_table, at::kInt);
  check_device(op, "block_table", block_table, device);
  const int64_t batch = block_table.size(0);
  check_dtype(op, "seq_lens", seq_lens, at::kInt);
  check_device(op, "seq_lens", seq_lens, device);
  check_shape(op, "seq_lens", seq_lens, {batch});
  check_dtype(op, "query_start_loc", query_start_loc, at::kInt);
  check_device(op, "query_start_loc", query_start_loc, device);
  check_shape(op, "query_start_loc", query_start_loc, {batch + 1});
  TORCH_CHECK_VALUE(scale > 0, "dflash.", op, ": scale must be > 0, got ", py_float(scale));
  if (sinks.has_value()) {
    check_dtype(op, "sinks", *sinks, at::kFloat);
    check_device(op, "sinks", *sinks, device);
    check_shape(op, "sinks", *sinks, {hq});
  }
  if (out != nullptr) {
    check_device(op, "out", *out, device);
    check_shape(op, "out", *out, q.sizes());
    check_last_dim(op, "out", *out);
    check_same_dtype(op, "out", *out, "q", q);
  }
  // C++ limits: 32-bit row and key indices, one CTA row of the grid per (request, KV head)
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(q.size(0) * hq < kMax32, "dflash.", op,
                    ": q has too many rows for one launch (Tq * Hq = ", q.size(0) * hq,
                    "); split the call over tokens");
  TORCH_CHECK_VALUE(batch * hkv < kMax32, "dflash.", op,
                    ": block_table has too many requests for one launch (B * Hkv = ",
                    batch * hkv, "); split the call over requests");
  TORCH_CHECK_VALUE(k_cache.size(1) < kMax32, "dflash.", op,
                    ": k_cache block_size must be < 2^31, got ", k_cache.size(1));
}

int sm_count(int device) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// Keys a split at least: 128 (two 64-key tiles at D <= 128), or DFLASH_OPS_ATTN_SPLIT_KEYS
// (64..4096; unparsable: 128). Below
// ~8k keys with few (request, KV head) pairs a CTA is latency-bound, so more splits of fewer
// tiles run faster. Measured (H200, B 1, 16 queries, Hq 32 / Hkv 8, D 128, 1024 keys): 256
// keys 14.7 us, 128 keys 11.6 us, 64 keys 12.2 us; 8192 keys: 27.7-27.9 us for all three.
int64_t min_split_keys() {
  static const int64_t keys = [] {
    const char* v = std::getenv("DFLASH_OPS_ATTN_SPLIT_KEYS");
    char* end = nullptr;
    const int64_t parsed = v != nullptr ? std::strtoll(v, &end, 10) : 0;
    const int64_t n = v != nullptr && end != v && *end == '\0' ? parsed : 128;
    return std::min<int64_t>(4096, std::max<int64_t>(64, n));
  }();
  return keys;
}

// Splits of each tile's key range, from shapes only: B * Hkv * splits fills the GPU about
// twice, at least min_split_keys() keys (of max_blocks * block_size) a split, and the fp32
// partial buffer of splits x Tq x Hq x (D + 1) stays within 256 MiB.
int choose_splits(int64_t bh, int64_t max_keys, int64_t rows, int64_t d, int sms) {
  constexpr int64_t kPartialBytes = int64_t{256} << 20;
  const int64_t per = min_split_keys();
  int64_t s = kMaxSplits;
  s = std::min(s, (2 * static_cast<int64_t>(sms) + bh - 1) / std::max<int64_t>(bh, 1));
  s = std::min(s, (max_keys + per - 1) / per);
  s = std::min(s, kPartialBytes / std::max<int64_t>(rows * (d + 1) * 4, 1));
  return static_cast<int>(std::max<int64_t>(s, 1));
}


// Base on 16 bytes and the strides of the listed dims (those of size > 1) in whole 16 bytes.
bool rows_aligned(const at::Tensor& t, std::initializer_list<int> dims) {
  const int64_t epv = 16 / t.element_size();
  if (!aligned16(t.data_ptr())) return false;
  for (const int dim : dims) {
    if (t.size(dim) > 1 && t.stride(dim) % epv != 0) return false;
  }
  return true;
}

// (K, V) stages of the tensor-core kernel: 2 (measured, the default) or 3 for D <= 128 (2 CTAs
// an SM still fit at D = 128: 112 KB each), set by DFLASH_OPS_ATTN_STAGES=3 until measured.
int attn_stages() {
  static const int stages = [] {
    const char* v = std::getenv("DFLASH_OPS_ATTN_STAGES");
    return v != nullptr && std::string(v) == "3" ? 3 : 2;
  }();
  return stages;
}

// Shared-memory carveout hint (percent, cudaFuncAttributePreferredSharedMemoryCarveout) for the
// tensor-core kernel: DFLASH_OPS_ATTN_CARVEOUT=0..100; unset (the default): no hint, the
// driver's choice. An experiment knob (benchmarks/attn_probe.py): whether the 3-stage kernel
// (112 KB a CTA) keeps 2 CTAs an SM.
int attn_carveout() {
  static const int carveout = [] {
    const char* v = std::getenv("DFLASH_OPS_ATTN_CARVEOUT");
    if (v == nullptr || *v == 0) return -1;
    char* end = nullptr;
    const long c = std::strtol(v, &end, 10);
    if (*end != 0 || c < 0) return -1;  // not a number: no hint
    return c > 100 ? 100 : static_cast<int>(c);
  }();
  return carveout;
}

template <class E, int D, int S>
void launch_mma(const AttnParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int smem = MmaTile<D, S>::SMEM;
  if (smem > 48 * 1024) {  // per launch: attributes are per device
    C10_CUDA_CHECK(cudaFuncSetAttribute(attn_mma_kernel<E, D, S>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  if (attn_carveout() >= 0) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(attn_mma_kernel<E, D, S>,
                                        cudaFuncAttributePreferredSharedMemoryCarveout,
                                        attn_carveout()));
  }
  static const bool reported = [] {  // DFLASH_OPS_ATTN_DEBUG=1: once per instantiation
    const char* dbg = std::getenv("DFLASH_OPS_ATTN_DEBUG");
    if (dbg == nullptr || *dbg != '1') return false;
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, attn_mma_kernel<E, D, S>, kThreads, smem));
    cudaFuncAttributes fa{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, attn_mma_kernel<E, D, S>));
    std::fprintf(stderr,
                 "[dflash attention] attn_mma_kernel<D %d, stages %d>: %d B shared, %d "
                 "registers, carveout %d, occupancy %d CTAs an SM\n",
                 D, S, smem, fa.numRegs, attn_carveout(), blocks);
    return true;
  }();
  (void)reported;
  attn_mma_kernel<E, D, S><<<grid, kThreads, smem, stream>>>(p);
}

template <class E, int D>
void launch(const AttnParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.hkv),
                  static_cast<unsigned>(p.splits));
  if constexpr (std::is_same_v<E, F32>) {
    constexpr int smem = F32Tile<D>::SMEM;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(attn_f32_kernel<D>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    attn_f32_kernel<D><<<grid, kThreads, smem, stream>>>(p);
  } else {
    bool launched = false;
    if constexpr (D <= 128) {
      if (attn_stages() == 3) {
        launch_mma<E, D, 3>(p, grid, stream);
        launched = true;
      }
    }
    if (!launched) launch_mma<E, D, 2>(p, grid, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.splits > 1) {
    const unsigned blocks = static_cast<unsigned>((p.rows + kCombineRows - 1) / kCombineRows);
    combine_kernel<E, D><<<blocks, 32 * kCombineRows, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <class E>
void launch_dtype(const AttnParams& p, int64_t d, cudaStream_t stream) {
  switch (d) {
    case 16: launch<E, 16>(p, stream); break;
    case 32: launch<E, 32>(p, stream); break;
    case 64: launch<E, 64>(p, stream); break;
    case 128: launch<E, 128>(p, stream); break;
    default: launch<E, 256>(p, stream); break;
  }
}

// Arguments checked; writes out (q's shape and dtype, unit stride in D).
void run(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_table, const at::Tensor& seq_lens,
         const at::Tensor& query_start_loc, double scale, bool causal, int64_t window,
         const std::optional<at::Tensor>& sinks, at::Tensor& out) {
  const int64_t tq = q_in.size(0), hq = q_in.size(1), d = q_in.size(2);
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  const int64_t batch = block_table.size(0), mb = block_table.size(1);
  if (out.numel() == 0) return;  // Tq = 0 or Hq = 0
  const c10::cuda::CUDAGuard guard(q_in.device());
  if (batch == 0 || mb == 0 || nb == 0 || bs == 0) {  // no key anywhere
    out.zero_();
    return;
  }
  // q and out rows on 16-byte boundaries (cp.async, vector stores), else contiguous copies
  const at::Tensor q = rows_aligned(q_in, {0, 1}) ? q_in : at::empty(q_in.sizes(), q_in.options()).copy_(q_in);
  const bool out_direct = rows_aligned(out, {0, 1});
  at::Tensor o = out_direct ? out : at::empty(q_in.sizes(), q_in.options());

  const int64_t rows = tq * hq;
  const int splits =
      choose_splits(batch * hkv, mb * bs, rows, d, sm_count(static_cast<int>(q.get_device())));
  at::Tensor part, lse;
  if (splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    part = at::empty({splits, rows, d}, f32);
    lse = at::empty({splits, rows}, f32);
  }

  AttnParams p{};
  p.q = q.data_ptr();
  p.q_st_t = q.stride(0);
  p.q_st_h = q.stride(1);
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.k_st_b = k_cache.stride(0);
  p.k_st_r = k_cache.stride(1);
  p.k_st_h = k_cache.stride(2);
  p.v_st_b = v_cache.stride(0);
  p.v_st_r = v_cache.stride(1);
  p.v_st_h = v_cache.stride(2);
  p.bt = block_table.data_ptr<int32_t>();
  p.bt_st_b = block_table.stride(0);
  p.bt_st_m = block_table.stride(1);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.sl_st = seq_lens.stride(0);
  p.qsl = query_start_loc.data_ptr<int32_t>();
  p.qsl_st = query_start_loc.stride(0);
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  p.sk_st = sinks.has_value() ? sinks->stride(0) : 0;
  p.out = o.data_ptr();
  p.o_st_t = o.stride(0);
  p.o_st_h = o.stride(1);
  p.part = splits > 1 ? part.data_ptr<float>() : nullptr;
  p.lse = splits > 1 ? lse.data_ptr<float>() : nullptr;
  p.num_blocks = nb;
  p.max_keys = mb * bs;
  p.window = window <= 0 ? 0 : std::min<int64_t>(window, int64_t{1} << 33);
  p.tq = static_cast<int>(tq);
  p.hq = static_cast<int>(hq);
  p.hkv = static_cast<int>(hkv);
  p.g = static_cast<int>(hq / hkv);
  p.batch = static_cast<int>(batch);
  p.splits = splits;
  p.rows = static_cast<int>(rows);
  p.div_bs = make_fast_div(bs);
  p.scale2 = static_cast<float>(scale * 1.4426950408889634);
  p.causal = causal;
  p.kv_vec = rows_aligned(k_cache, {0, 1, 2}) && rows_aligned(v_cache, {0, 1, 2});

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  switch (q.scalar_type()) {
    case at::kBFloat16: launch_dtype<BF16>(p, d, stream); break;
    case at::kHalf: launch_dtype<F16>(p, d, stream); break;
    default: launch_dtype<F32>(p, d, stream); break;
  }
  if (!out_direct) out.copy_(o);
}

}  // namespace

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, bool causal, int64_t window,
                           const std::optional<at::Tensor>& sinks) {
  check_attn("block_attention", q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
             scale, sinks, nullptr);
  at::Tensor out = at::empty(q.sizes(), q.options());
  run(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, window, sinks,
      out);
  return out;
}

void block_attention_out_(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_table,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          double scale, bool causal, int64_t window,
                          const std::optional<at::Tensor>& sinks, at::Tensor& out) {
  check_attn("block_attention_out_", q, k_cache, v_cache, block_table, seq_lens,
             query_start_loc, scale, sinks, &out);
  run(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, window, sinks,
      out);
}

}  // namespace dflash_ops
