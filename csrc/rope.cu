// Rotary embedding: rope_, qk_norm_rope_, knorm_rope_ (references: dflash_ops/ops/rope.py).
//
//   rope_          x[T, Hx, D]                        rotated in place
//   qk_norm_rope_  q[T, Hq, D], k[T, Hkv, D]          per-head RMSNorm, then rotation; one launch
//   knorm_rope_    k[T, L, Hkv, D], k_weight[L, D]    layer l's K-norm, then rotation; one launch
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

struct RopeParams {
  HeadSet set[2];      // qk_norm_rope_: q (heads [0, heads0)), k; otherwise set[0] alone
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
template <class E, int V, int NU, bool NEOX, bool NORM>
__global__ void __launch_bounds__(kBlock, (NU == 1 && V > 1) ? 5 : 1)
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

  // rope_ leaves the unrotated tail alone (NeoX tail units; GPT-J units past R/2).
  const LaneUnits<V, NU, NEOX> lu(p.rope, lane, tpr, valid, /*whole_row=*/NORM);

  // The row first (the long wait), then the position and the weights.
  Unit<Bits, V> cur[NU];
  load_units(x, lu, cur);
  int64_t pos = -1;
  if (valid) pos = __ldg(p.pos + int64_t(t) * p.pos_stride);
  const bool rot = pos >= 0 && pos < p.rope.n_pos;
  if (!NORM && !rot) return;  // rope_: the token stays as it is

  if (NORM) {  // cur <- y = T(T(x * rstd) * w)
    norm_units<E>(p.rope, lu, w, w_col, tpr, cur);
    if (!valid) return;  // (after the last shuffle)
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

template <class E, int V, int NU>
void launch_rope(const RopeParams& p, bool neox, bool norm, int tpr_log2, unsigned blocks,
                 cudaStream_t stream) {
  const dim3 grid(blocks), block(kBlock);
  if (neox) {
    norm ? launch_kernel(rope_kernel<E, V, NU, true, true>, grid, block, 0, stream, p, tpr_log2)
         : launch_kernel(rope_kernel<E, V, NU, true, false>, grid, block, 0, stream, p, tpr_log2);
  } else {
    norm ? launch_kernel(rope_kernel<E, V, NU, false, true>, grid, block, 0, stream, p, tpr_log2)
         : launch_kernel(rope_kernel<E, V, NU, false, false>, grid, block, 0, stream, p, tpr_log2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// nu: units a lane (vector path 1 or 2, scalar path 4).
template <class E>
void launch_dtype(const RopeParams& p, bool vec, int nu, bool neox, bool norm, int tpr_log2,
                  unsigned blocks, cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(typename E::Bits));
  if (!vec) {
    launch_rope<E, 1, 4>(p, neox, norm, tpr_log2, blocks, stream);
  } else if constexpr (kVec == 4) {  // fp32: one unit a lane (the host asks for no more)
    launch_rope<E, kVec, 1>(p, neox, norm, tpr_log2, blocks, stream);
  } else if (nu == 1) {
    launch_rope<E, kVec, 1>(p, neox, norm, tpr_log2, blocks, stream);
  } else {
    launch_rope<E, kVec, 2>(p, neox, norm, tpr_log2, blocks, stream);
  }
}

// Units a lane on the 16-bit vector path: 64 bytes of a row in flight a lane (D = 128 bf16: 4
// lanes a row). fp32 takes one unit a lane.
constexpr int kVectorLaneUnits = 2;

// Builds the parameters and launches; the arguments are checked. sets[1].x may be null; a set
// may have no heads. what: the tensors' names, for the one error left (too many rows).
void run(const char* op, const char* what, const SetArg (&sets)[2], const at::Tensor& positions,
         const at::Tensor& cos_sin_cache, double eps, bool is_neox, bool norm) {
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
  switch (x0.scalar_type()) {
    case at::kBFloat16:
      launch_dtype<BF16>(p, vec, nu, is_neox, norm, tpr_log2, blocks, stream);
      break;
    case at::kHalf:
      launch_dtype<F16>(p, vec, nu, is_neox, norm, tpr_log2, blocks, stream);
      break;
    default:
      launch_dtype<F32>(p, vec, nu, is_neox, norm, tpr_log2, blocks, stream);
      break;
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

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("rope_", TORCH_FN(dflash_ops::rope_));
  m.impl("qk_norm_rope_", TORCH_FN(dflash_ops::qk_norm_rope_));
  m.impl("knorm_rope_", TORCH_FN(dflash_ops::knorm_rope_));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
