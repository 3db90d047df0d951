// Rotary embedding: rope_, qk_norm_rope_, knorm_rope_, qk_norm_rope_store_ (references:
// dflash_ops/ops/rope.py).
//
//   rope_          x[T, Hx, D]                        rotated in place
//   qk_norm_rope_  q[T, Hq, D], k[T, Hkv, D]          per-head RMSNorm, then rotation; one launch
//   knorm_rope_    k[T, L, Hkv, D], k_weight[L, D]    layer l's K-norm, then rotation; one launch
//   qk_norm_rope_store_  q as qk_norm_rope_ (or rope_ without weights); k's row normed and
//                  rotated into k_cache at slot_mapping[t], v's row copied into v_cache there
//                  (a k row's lanes carry its v row too); k and v are not written
//
// Numerics (HF rounding: T(T(x * rstd) * w), then the rotation in fp32 rounded once) and the
// row layout (units of 2V elements, both elements of every rotation pair in one lane) are those
// of rope_common.cuh, whose head-row code this file shares with context.cu's epilogue. rope_
// has y = x and moves only the units with something to rotate.
//
// Lanes. One group of tpr lanes per head row (x, q, k: any strides, unit stride in D):
//   vector path: 16-byte vectors; two units a lane for bf16/fp16 (D = 128: 4 lanes x 4 x 16
//   bytes), one for fp32.
//   scalar path: V = 1, four units a lane, for what the vector path cannot take (a view not on
//   16-byte boundaries, NeoX with R/2 or (D-R)/2 not a multiple of the vector, a strided weight).
// One head row a group (the most rows in flight; 256-thread blocks, 256 / tpr rows each): the
// group reads its token's cos/sin once, from L1/L2 (the block's rows share a token or two).
// The rows of a token are q's heads then k's for qk_norm_rope_, all L * Hkv heads for
// knorm_rope_ (weight row = layer); row -> (token, head) by multiply-shift division.
#include "dflash_ops.h"

#include "checks.h"
#include "register.h"
#include "common.cuh"
#include "rope_common.cuh"

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

using namespace detail;  // common.cuh, rope_common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

// One tensor's heads, viewed as [T, n_outer, n_inner, D] (element strides; 0 for size-1 dims).
// Head h of a token is (o, i) = (h / n_inner, h % n_inner); its weight row is w + o * w_row.
struct HeadSet {
  void* x;
  const void* w;       // norm ops: weight rows (unused by rope_)
  int64_t s_tok, s_outer, s_inner;
  int64_t w_row;       // knorm_rope_: k_weight's layer stride; 0: one weight for every head
  int64_t w_col;       // weight element stride (1 on the vector path)
  FastDiv div_inner;   // n_inner
};

// qk_norm_rope_store_: where set[1]'s (k's) rows go. Token t's head i: its slot s =
// slots[t] (skipped unless 0 <= s < n_slots) gives the cache row (s / block_size) * s_block +
// (s % block_size) * s_row + i * s_head of k_cache (the rotated k row) and of v_cache (v's row,
// read at v + t * v_tok + i * v_inner).
struct StoreDst {
  void* kc;
  void* vc;
  const void* v;
  int64_t kc_block, kc_row, kc_head, vc_block, vc_row, vc_head;
  int64_t v_tok, v_inner;
  const int64_t* slots;
  int64_t slot_stride, n_slots, block_size;
};

struct RopeParams {
  HeadSet set[2];      // qk_norm_rope_: q (heads [0, heads0)), k; otherwise set[0] alone
  StoreDst dst;        // qk_norm_rope_store_ (the STORE kernels) only
  RotaryRow rope;      // cos/sin table and row geometry (rope_common.cuh)
  const int64_t* pos;  // positions[T], element stride pos_stride
  int64_t pos_stride;
  uint32_t rows;       // T * heads < 2^31
  uint32_t heads0;     // heads of set[0] per token
  FastDiv div_heads;   // heads per token, both sets
};

constexpr int kBlock = 256;

// One lane group of tpr = 2^tpr_log2 lanes per head row, NU units a lane, V elements a vector;
// see the file comment. rows < 2^31. Registers (sm_90a, no spills): one unit a lane fits 48
// (5 blocks an SM, 40 KB of rows in flight); two units a lane take up to 79 for bf16 (3 blocks,
// 48 KB), and capping them at 64 spills.
// STORE (qk_norm_rope_store_): set[1]'s rows go to the caches (StoreDst) with their v rows;
// the v row's registers spill under the 48 cap, so these kernels have none.
template <class E, int V, int NU, bool NEOX, bool NORM, bool STORE>
__global__ void __launch_bounds__(kBlock, (NU == 1 && V > 1 && !STORE) ? 5 : 1)
    rope_kernel(const RopeParams p, const int tpr_log2) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using Bits = typename E::Bits;
  const int tpr = 1 << tpr_log2;
  const int lane = threadIdx.x & (tpr - 1);
  const uint32_t row = blockIdx.x * (kBlock >> tpr_log2) + (threadIdx.x >> tpr_log2);
  // Lanes of a row past the end stay for the norm's full-warp shuffles but touch no memory.
  bool valid = row < p.rows;
  if (!NORM && !valid) return;

  // row -> token t, head h -> set, (o, i)
  uint32_t t = 0, h = 0;
  if (valid) {
    t = p.div_heads.div(row);
    h = row - t * p.div_heads.d;
  }
  const bool second = h >= p.heads0;
  if (second) h -= p.heads0;
  const FastDiv div_inner = second ? p.set[1].div_inner : p.set[0].div_inner;
  const uint32_t o = div_inner.div(h), i = h - o * div_inner.d;
  Bits* const x = static_cast<Bits*>(second ? p.set[1].x : p.set[0].x) +
                  (int64_t(t) * (second ? p.set[1].s_tok : p.set[0].s_tok) +
                   int64_t(o) * (second ? p.set[1].s_outer : p.set[0].s_outer) +
                   int64_t(i) * (second ? p.set[1].s_inner : p.set[0].s_inner));
  const Bits* const w = static_cast<const Bits*>(second ? p.set[1].w : p.set[0].w) +
                        int64_t(o) * (second ? p.set[1].w_row : p.set[0].w_row);
  const int64_t w_col = V == 1 ? (second ? p.set[1].w_col : p.set[0].w_col) : 1;

  // rope_ leaves the unrotated tail alone (NeoX tail units; GPT-J units past R/2); a row
  // stored into a cache moves whole.
  const bool to_cache = STORE && second;
  const LaneUnits<V, NU, NEOX> lu(p.rope, lane, tpr, valid, /*whole_row=*/NORM || to_cache);

  // The row first (the long wait; with it a cache row's v row), then the position, the slot
  // and the weights.
  Unit<Bits, V> cur[NU];
  load_units(x, lu, cur);
  Unit<Bits, V> vrow[STORE ? NU : 1];
  int64_t slot = -1;
  if constexpr (STORE) {
    const Bits* const vsrc = static_cast<const Bits*>(p.dst.v) +
                             (int64_t(t) * p.dst.v_tok + int64_t(i) * p.dst.v_inner);
    const LaneUnits<V, NU, NEOX> lv(p.rope, lane, tpr, valid && to_cache, true);
    load_units(vsrc, lv, vrow);
    if (valid && to_cache) slot = __ldg(p.dst.slots + int64_t(t) * p.dst.slot_stride);
  }
  int64_t pos = -1;
  if (valid) pos = __ldg(p.pos + int64_t(t) * p.pos_stride);
  const bool rot = pos >= 0 && pos < p.rope.n_pos;
  if (!NORM && !rot && !to_cache) return;  // rope_: the token stays as it is

  if (NORM) {  // cur <- y = T(T(x * rstd) * w)
    norm_units<E>(p.rope, lu, w, w_col, tpr, cur);
    if (!valid) return;  // (after the last shuffle)
  }
  if constexpr (STORE) {
    if (to_cache) {
      if (slot < 0 || slot >= p.dst.n_slots) return;  // padding, or past the cache
      const int64_t block = slot / p.dst.block_size, brow = slot - block * p.dst.block_size;
      const StoreDst& s = p.dst;
      Bits* const vdst = static_cast<Bits*>(s.vc) +
                         (block * s.vc_block + brow * s.vc_row + int64_t(i) * s.vc_head);
      store_units(vdst, lu, vrow);
      Bits* const kdst = static_cast<Bits*>(s.kc) +
                         (block * s.kc_block + brow * s.kc_row + int64_t(i) * s.kc_head);
      rotate_store_units<E>(p.rope, lu, pos, rot, cur, kdst);
      return;
    }
  }
  rotate_store_units<E>(p.rope, lu, pos, rot, cur, x);
}

// ---------------------------------------------------------------------------------------------
// Host side: argument checks (checks.h; the order of dflash_ops/ops/rope.py), then the launch.

// x[T, ..., D] of the given rank: float, unit stride in D, D a supported head_dim. device: the
// one x must be on; nullptr: x is the op's first tensor and must be a CUDA tensor.
void check_heads(const char* op, const char* name, const at::Tensor& x, int64_t rank,
                 const at::Device* device) {
  check_rank(op, name, x, rank);
  check_float(op, name, x);
  if (device == nullptr) {
    check_cuda(op, name, x);
  } else {
    check_device(op, name, x, *device);
  }
  check_last_dim(op, name, x);
  check_head_dim(op, name, x.size(-1));
}

// positions [T] int64, cos_sin_cache [P, R] fp32.
void check_positions(const char* op, const at::Tensor& positions,
                     const at::Tensor& cos_sin_cache, int64_t t, int64_t d,
                     const at::Device& device) {
  check_index_vector(op, "positions", positions, t, device);
  check_cos_sin_cache(op, cos_sin_cache, d, device);
}

// A norm weight: the given shape, on device, of ref's dtype.
void check_weight(const char* op, const char* name, const at::Tensor& w, c10::IntArrayRef shape,
                  const at::Device& device, const char* ref_name, const at::Tensor& ref) {
  check_device(op, name, w, device);
  check_shape(op, name, w, shape);
  check_same_dtype(op, name, w, ref_name, ref);
}

// One head set's description for the launcher.
struct SetArg {
  const at::Tensor* x = nullptr;  // [T, Hx, D] or, with outer, [T, L, Hkv, D]
  const at::Tensor* w = nullptr;  // [D] or [L, D] (norm ops)
  bool outer = false;
};

template <class E, int V, int NU, bool STORE>
void launch_rope(const RopeParams& p, bool neox, bool norm, int tpr_log2, unsigned blocks,
                 cudaStream_t stream) {
  const dim3 grid(blocks), block(kBlock);
  if (neox) {
    norm ? launch_kernel(rope_kernel<E, V, NU, true, true, STORE>, grid, block, 0, stream, p,
                         tpr_log2)
         : launch_kernel(rope_kernel<E, V, NU, true, false, STORE>, grid, block, 0, stream, p,
                         tpr_log2);
  } else {
    norm ? launch_kernel(rope_kernel<E, V, NU, false, true, STORE>, grid, block, 0, stream, p,
                         tpr_log2)
         : launch_kernel(rope_kernel<E, V, NU, false, false, STORE>, grid, block, 0, stream, p,
                         tpr_log2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// nu: units a lane (vector path 1 or 2, scalar path 4).
template <class E, bool STORE>
void launch_dtype(const RopeParams& p, bool vec, int nu, bool neox, bool norm, int tpr_log2,
                  unsigned blocks, cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(typename E::Bits));
  if (!vec) {
    launch_rope<E, 1, 4, STORE>(p, neox, norm, tpr_log2, blocks, stream);
  } else if constexpr (kVec == 4) {  // fp32: one unit a lane (the host asks for no more)
    launch_rope<E, kVec, 1, STORE>(p, neox, norm, tpr_log2, blocks, stream);
  } else if (nu == 1) {
    launch_rope<E, kVec, 1, STORE>(p, neox, norm, tpr_log2, blocks, stream);
  } else {
    launch_rope<E, kVec, 2, STORE>(p, neox, norm, tpr_log2, blocks, stream);
  }
}

template <bool STORE>
void launch_any(at::ScalarType dtype, const RopeParams& p, bool vec, int nu, bool neox, bool norm,
                int tpr_log2, unsigned blocks, cudaStream_t stream) {
  switch (dtype) {
    case at::kBFloat16:
      launch_dtype<BF16, STORE>(p, vec, nu, neox, norm, tpr_log2, blocks, stream);
      break;
    case at::kHalf:
      launch_dtype<F16, STORE>(p, vec, nu, neox, norm, tpr_log2, blocks, stream);
      break;
    default:
      launch_dtype<F32, STORE>(p, vec, nu, neox, norm, tpr_log2, blocks, stream);
      break;
  }
}

// Units a lane on the 16-bit vector path: 64 bytes of a row in flight a lane (D = 128 bf16: 4
// lanes a row). fp32 takes one unit a lane.
constexpr int kVectorLaneUnits = 2;

// qk_norm_rope_store_'s v and caches (the arguments of run's store mode).
struct StoreArg {
  const at::Tensor* v;
  const at::Tensor* k_cache;
  const at::Tensor* v_cache;
  const at::Tensor* slot_mapping;
};

// Builds the parameters and launches; the arguments are checked. sets[1].x may be null; a set
// may have no heads. what: the tensors' names, for the one error left (too many rows). store:
// qk_norm_rope_store_ (set[1] is k; its rows go to the caches).
void run(const char* op, const char* what, const SetArg (&sets)[2], const at::Tensor& positions,
         const at::Tensor& cos_sin_cache, double eps, bool is_neox, bool norm,
         const StoreArg* store = nullptr) {
  const at::Tensor& x0 = *sets[0].x;
  const int64_t t = x0.size(0), d = x0.size(-1);
  const int64_t es = x0.element_size();
  const int64_t vmax = 16 / es;

  RopeParams p{};
  p.rope = make_rotary_row(cos_sin_cache, d, eps);
  p.pos = positions.data_ptr<int64_t>();
  p.pos_stride = positions.stride(0);

  // The vector path needs every row and weight row on 16-byte boundaries and, for NeoX, both
  // the halves and the tail halves in whole vectors.
  bool vec = !is_neox || (p.rope.half % vmax == 0 && p.rope.tail_half % vmax == 0);
  int64_t heads = 0;  // per token, both sets
  for (int s = 0; s < 2; ++s) {
    HeadSet& h = p.set[s];
    h.div_inner = make_fast_div(1);
    if (sets[s].x == nullptr) continue;
    const at::Tensor& x = *sets[s].x;
    const int64_t n_outer = sets[s].outer ? x.size(1) : 1;
    const int64_t n_inner = x.size(sets[s].outer ? 2 : 1);
    h.x = x.data_ptr();
    h.s_tok = t > 1 ? x.stride(0) : 0;
    h.s_outer = sets[s].outer && n_outer > 1 ? x.stride(1) : 0;
    h.s_inner = n_inner > 1 ? x.stride(sets[s].outer ? 2 : 1) : 0;
    h.div_inner = make_fast_div(std::max<int64_t>(n_inner, 1));
    vec = vec && aligned16(h.x) && h.s_tok % vmax == 0 && h.s_outer % vmax == 0 &&
          h.s_inner % vmax == 0;
    if (norm) {
      const at::Tensor& w = *sets[s].w;
      h.w = w.data_ptr();
      h.w_row = w.dim() == 2 && w.size(0) > 1 ? w.stride(0) : 0;
      h.w_col = w.stride(-1);
      vec = vec && aligned16(h.w) && h.w_row % vmax == 0 && h.w_col == 1;
    }
    if (s == 0) p.heads0 = static_cast<uint32_t>(n_outer * n_inner);
    heads += n_outer * n_inner;
  }
  if (store != nullptr) {  // the caches' rows: vector path where v and both caches allow it
    StoreDst& s = p.dst;
    const at::Tensor &v = *store->v, &kc = *store->k_cache, &vc = *store->v_cache;
    s.kc = kc.data_ptr();
    s.vc = vc.data_ptr();
    s.v = v.data_ptr();
    s.kc_block = kc.stride(0), s.kc_row = kc.stride(1), s.kc_head = kc.stride(2);
    s.vc_block = vc.stride(0), s.vc_row = vc.stride(1), s.vc_head = vc.stride(2);
    s.v_tok = v.stride(0), s.v_inner = v.stride(1);
    s.slots = store->slot_mapping->data_ptr<int64_t>();
    s.slot_stride = store->slot_mapping->stride(0);
    s.block_size = kc.size(1);
    s.n_slots = kc.size(0) * kc.size(1);
    for (const int64_t st : {s.kc_block, s.kc_row, s.kc_head, s.vc_block, s.vc_row, s.vc_head,
                             s.v_tok, s.v_inner})
      vec = vec && st % vmax == 0;
    vec = vec && aligned16(s.kc) && aligned16(s.vc) && aligned16(s.v);
  }
  const int64_t rows = t * heads;
  if (rows == 0) return;
  TORCH_CHECK_VALUE(rows < std::numeric_limits<int32_t>::max(), "dflash.", op, ": ", what,
                    " hold too many head rows (", rows, ") for one launch; split the call over "
                    "tokens");
  p.rows = static_cast<uint32_t>(rows);
  p.div_heads = make_fast_div(heads);

  // Lanes per row: the units of a row (D / (2V) <= 32 with vectors, <= 128 scalar) over
  // lanes with nu units each, at most 32 lanes.
  const int v = vec ? static_cast<int>(vmax) : 1;
  p.rope.units = static_cast<int>(d / (2 * v));
  const int nu = !vec ? 4 : es == 4 ? 1 : std::min(kVectorLaneUnits, p.rope.units);
  int tpr_log2 = 0;
  while ((1 << tpr_log2) * nu < p.rope.units && tpr_log2 < 5) ++tpr_log2;
  const int64_t rows_per_block = kBlock >> tpr_log2;
  const unsigned blocks = static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block);
  const int dev = x0.get_device();

  const c10::cuda::CUDAGuard guard(x0.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  if (store != nullptr) {
    launch_any<true>(x0.scalar_type(), p, vec, nu, is_neox, norm, tpr_log2, blocks, stream);
  } else {
    launch_any<false>(x0.scalar_type(), p, vec, nu, is_neox, norm, tpr_log2, blocks, stream);
  }
}

}  // namespace

void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
           bool is_neox) {
  constexpr const char* op = "rope_";
  // x: [T, Hx, D]; positions: [T] int64; cos_sin_cache: [P, R] fp32
  check_heads(op, "x", x, 3, nullptr);
  check_positions(op, positions, cos_sin_cache, x.size(0), x.size(-1), x.device());
  if (x.numel() == 0) return;
  const SetArg sets[2] = {{&x, nullptr, false}, {}};
  run(op, "x", sets, positions, cos_sin_cache, 0.0, is_neox, /*norm=*/false);
}

void qk_norm_rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& q_weight,
                   const at::Tensor& k_weight, const at::Tensor& positions,
                   const at::Tensor& cos_sin_cache, double eps, bool is_neox) {
  constexpr const char* op = "qk_norm_rope_";
  // q: [T, Hq, D]; k: [T, Hkv, D]; q_weight, k_weight: [D]
  check_heads(op, "q", q, 3, nullptr);
  const at::Device device = q.device();
  check_heads(op, "k", k, 3, &device);
  check_same_dtype(op, "k", k, "q", q);
  const int64_t d = q.size(-1);
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(2) == d, "dflash.", op,
                    ": k must be [T=", q.size(0), ", Hkv, D=", d, "] like q, got ",
                    py_list(k.sizes()));
  check_weight(op, "q_weight", q_weight, {d}, device, "q", q);
  check_weight(op, "k_weight", k_weight, {d}, device, "q", q);
  check_eps(op, eps);
  check_positions(op, positions, cos_sin_cache, q.size(0), d, device);
  if (q.numel() == 0 && k.numel() == 0) return;
  const SetArg sets[2] = {{&q, &q_weight, false}, {&k, &k_weight, false}};
  run(op, "q and k", sets, positions, cos_sin_cache, eps, is_neox, /*norm=*/true);
}

void knorm_rope_(at::Tensor& k, const at::Tensor& k_weight, const at::Tensor& positions,
                 const at::Tensor& cos_sin_cache, double eps, bool is_neox) {
  constexpr const char* op = "knorm_rope_";
  // k: [T, L, Hkv, D] (e.g. kv[:, :, 0] of a [T, L, 2, Hkv, D] GEMM output); k_weight: [L, D]
  check_heads(op, "k", k, 4, nullptr);
  const at::Device device = k.device();
  const int64_t d = k.size(3);
  check_weight(op, "k_weight", k_weight, {k.size(1), d}, device, "k", k);
  check_eps(op, eps);
  check_positions(op, positions, cos_sin_cache, k.size(0), d, device);
  if (k.numel() == 0) return;
  const SetArg sets[2] = {{&k, &k_weight, true}, {}};
  run(op, "k", sets, positions, cos_sin_cache, eps, is_neox, /*norm=*/true);
}

void qk_norm_rope_store_(at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& q_weight,
                         const std::optional<at::Tensor>& k_weight, const at::Tensor& positions,
                         const at::Tensor& cos_sin_cache, double eps, bool is_neox,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  constexpr const char* op = "qk_norm_rope_store_";
  // q: [T, Hq, D]; k, v: [T, Hkv, D]; q_weight, k_weight: [D] or both None; caches
  // [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int64 (the order of ops/rope.py)
  check_heads(op, "q", q, 3, nullptr);
  const at::Device device = q.device();
  check_heads(op, "k", k, 3, &device);
  check_same_dtype(op, "k", k, "q", q);
  const int64_t t = q.size(0), d = q.size(-1);
  TORCH_CHECK_VALUE(k.size(0) == t && k.size(2) == d, "dflash.", op, ": k must be [T=", t,
                    ", Hkv, D=", d, "] like q, got ", py_list(k.sizes()));
  check_device(op, "v", v, device);
  check_shape(op, "v", v, k.sizes());
  check_last_dim(op, "v", v);
  check_same_dtype(op, "v", v, "q", q);
  TORCH_CHECK_VALUE(q_weight.has_value() == k_weight.has_value(), "dflash.", op,
                    ": q_weight and k_weight must both be given (QK-norm) or both be None "
                    "(RoPE alone), got q_weight ", q_weight ? "a tensor" : "None",
                    " and k_weight ", k_weight ? "a tensor" : "None");
  const bool norm = q_weight.has_value();
  if (norm) {
    check_weight(op, "q_weight", *q_weight, {d}, device, "q", q);
    check_weight(op, "k_weight", *k_weight, {d}, device, "q", q);
  }
  check_eps(op, eps);
  check_positions(op, positions, cos_sin_cache, t, d, device);
  const int64_t hkv = k.size(1);
  for (const auto& [name, c] : {std::pair<const char*, const at::Tensor*>{"k_cache", &k_cache},
                                {"v_cache", &v_cache}}) {
    check_cache(op, name, *c, q);
    TORCH_CHECK_VALUE(c->size(2) == hkv && c->size(3) == d, "dflash.", op, ": ", name,
                      " must be [num_blocks, block_size, ", hkv, ", ", d,
                      "] (Hkv, D of k), got ", py_list(c->sizes()));
  }
  TORCH_CHECK_VALUE(k_cache.sizes().slice(0, 2) == v_cache.sizes().slice(0, 2), "dflash.", op,
                    ": v_cache must have the [num_blocks, block_size] of k_cache ",
                    py_list(k_cache.sizes().slice(0, 2)), ", got ",
                    py_list(v_cache.sizes().slice(0, 2)));
  check_index_vector(op, "slot_mapping", slot_mapping, t, device);
  if (t == 0) return;
  const SetArg sets[2] = {{&q, norm ? &*q_weight : nullptr, false},
                          {&k, norm ? &*k_weight : nullptr, false}};
  const StoreArg store{&v, &k_cache, &v_cache, &slot_mapping};
  run(op, "q and k", sets, positions, cos_sin_cache, eps, is_neox, norm, &store);
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("rope_", TORCH_FN(dflash_ops::rope_));
  m.impl("qk_norm_rope_", TORCH_FN(dflash_ops::qk_norm_rope_));
  m.impl("knorm_rope_", TORCH_FN(dflash_ops::knorm_rope_));
  m.impl("qk_norm_rope_store_", TORCH_FN(dflash_ops::qk_norm_rope_store_));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
