// DFlash 2's candidate selector walk: select_candidates (dflash_ops/ops/select.py).
//
//   score[r, j, i] = unary[r, j, i]
//                  + sum_d pred[prev, d] * hidden[r, j, d] * succ[cand[r, j, i], d]
//   greedy: pick = the first maximum (the first NaN if any);
//   sampled: q = softmax(score / T), pick = the first running sum of q past u[r, j] * sum(q);
//   prev = cand[r, j, pick] (prev starts at anchor[r])
//
// One block of 8 warps per request. Candidate i belongs to warp i / CPW; every lane holds the
// same DPL dims (lane + 32 * n) of every row, so a candidate's dot product is a warp reduction.
// The walk's only dependence is prev: the rows a step reads (succ rows of its candidates, their
// pred rows, hidden, unary) do not depend on it, so step j + 1's are loaded into registers while
// step j computes, and the next predecessor's pred row is the one the picking warp already
// holds (it loaded the pred rows of its own candidates), passed on through shared memory. A step
// is then two warp reductions and three barriers, no global round trip. fp32 math; ids outside
// [0, V) read as zero rows. Grid (R,): graph-capturable.
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

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace dflash_ops {
namespace {

using namespace detail;  // common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxRank = 512;

enum DType : int { kDtBF16 = 0, kDtF16 = 1, kDtF32 = 2 };

struct SelectParams {
  const void* unary;    // [R, J, K], dtype unary_dt
  const int64_t* cand;  // [R, J, K]
  const void* hidden;   // [R, J, rank], dtype hidden_dt
  const int64_t* anchor;
  const void* pred;     // [V, rank], the kernel's element type
  const void* succ;
  const float* u;       // [R, J] or null (greedy)
  int64_t* path;        // [R, J]
  float* q;             // [R, J, K]
  int64_t v;
  int j, k, rank;
  int unary_dt, hidden_dt;
  float inv_t;  // sampled: score * (1 / temperature), as ATen's CUDA division by a scalar
};

__device__ __forceinline__ float load_any(const void* p, int64_t i, int dt) {
  if (dt == kDtBF16) return BF16::to_float(__ldg(static_cast<const uint16_t*>(p) + i));
  if (dt == kDtF16) return F16::to_float(__ldg(static_cast<const uint16_t*>(p) + i));
  return __ldg(static_cast<const float*>(p) + i);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// One step's inputs as this lane holds them.
template <int DPL, int CPW>
struct StepRegs {
  float succ[CPW][DPL];
  float pred[CPW][DPL];
  float hid[DPL];
  float un[CPW];
  int64_t cand[CPW];
};

// The first kCandSmem candidate ids of the request (its first kCandSmem / k steps), loaded into
// shared memory by the whole block before the walk: a step's codebook-row loads then need no
// id round trip first (a warp issues in order, so waiting for the ids at the top of step j
// held up step j's compute by one memory latency).
constexpr int kCandSmem = 1024;

template <class E, int DPL, int CPW>
__device__ __forceinline__ void load_step(const SelectParams& p, int64_t r, int j, int warp,
                                          int lane, StepRegs<DPL, CPW>& s,
                                          const int64_t* s_cand) {
  using Bits = typename E::Bits;
  const Bits* pred = static_cast<const Bits*>(p.pred);
  const Bits* succ = static_cast<const Bits*>(p.succ);
  const int64_t row = r * p.j + j;
#pragma unroll
  for (int n = 0; n < DPL; ++n) {
    const int d = lane + 32 * n;
    s.hid[n] = d < p.rank ? load_any(p.hidden, row * p.rank + d, p.hidden_dt) : 0.0f;
  }
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    const int i = warp * CPW + c;
    const bool in = i < p.k;
    const int64_t at = int64_t(j) * p.k + i;  // within the request
    const int64_t id = !in ? -1 : at < kCandSmem ? s_cand[at] : __ldg(p.cand + row * p.k + i);
    const bool ok = id >= 0 && id < p.v;
    s.cand[c] = id;
    s.un[c] = in ? load_any(p.unary, row * p.k + i, p.unary_dt) : 0.0f;
#pragma unroll
    for (int n = 0; n < DPL; ++n) {
      const int d = lane + 32 * n;
      const bool okd = ok && d < p.rank;
      s.succ[c][n] = okd ? E::to_float(__ldg(succ + id * p.rank + d)) : 0.0f;
      s.pred[c][n] = okd ? E::to_float(__ldg(pred + id * p.rank + d)) : 0.0f;
    }
  }
}

template <class E, int DPL, int CPW>
__global__ void __launch_bounds__(kThreads, 1) select_kernel(const SelectParams p) {
  pdl_wait();  // launched as a programmatic dependent (common.cuh): the prior grid first
  using Bits = typename E::Bits;
  __shared__ float s_score[kWarps * CPW];
  __shared__ float s_pv[kMaxRank];
  __shared__ int s_pick;
  __shared__ int64_t s_cand[kCandSmem];
  const int64_t r = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool sample = p.u != nullptr;

  float pv[DPL];  // pred[prev], this lane's dims
  {
    const int64_t a = __ldg(p.anchor + r);
    const bool ok = a >= 0 && a < p.v;
    const Bits* pred = static_cast<const Bits*>(p.pred);
#pragma unroll
    for (int n = 0; n < DPL; ++n) {
      const int d = lane + 32 * n;
      pv[n] = ok && d < p.rank ? E::to_float(__ldg(pred + a * p.rank + d)) : 0.0f;
    }
  }
  StepRegs<DPL, CPW> cur, nxt;
  {
    const int64_t n = int64_t(p.j) * p.k < kCandSmem ? int64_t(p.j) * p.k : kCandSmem;
    const int64_t* cand = p.cand + r * p.j * p.k;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) s_cand[i] = __ldg(cand + i);
    __syncthreads();
  }
  load_step<E, DPL, CPW>(p, r, 0, warp, lane, cur, s_cand);
  for (int j = 0; j < p.j; ++j) {
    if (j + 1 < p.j) load_step<E, DPL, CPW>(p, r, j + 1, warp, lane, nxt, s_cand);
    float qv[DPL];
#pragma unroll
    for (int n = 0; n < DPL; ++n) qv[n] = __fmul_rn(pv[n], cur.hid[n]);
#pragma unroll
    for (int c = 0; c < CPW; ++c) {
      float acc = 0.0f;
#pragma unroll
      for (int n = 0; n < DPL; ++n) acc = fmaf(qv[n], cur.succ[c][n], acc);
      acc = warp_sum(acc);
      const int i = warp * CPW + c;
      if (lane == 0) s_score[i] = i < p.k ? cur.un[c] + acc : -INFINITY;
    }
    __syncthreads();
    if (warp == 0) {  // k <= 32: one candidate a lane
      const bool in = lane < p.k;
      const float score = in ? s_score[lane] : -INFINITY;
      const int64_t row = r * p.j + j;
      int pick;
      float q;
      if (sample) {
        const float s = score * p.inv_t;
        const float m = warp_max(s);
        const float e = in ? expf(s - m) : 0.0f;
        q = e / warp_sum(e);
        float cdf = q;  // inclusive scan
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const float t = __shfl_up_sync(0xffffffffu, cdf, o);
          if (lane >= o) cdf += t;
        }
        const float total = __shfl_sync(0xffffffffu, cdf, 31);
        const unsigned over = __ballot_sync(0xffffffffu, in && cdf > __ldg(p.u + row) * total);
        pick = over ? __ffs(over) - 1 : p.k - 1;
      } else {
        // the first NaN if the row has one (torch.argmax's rule), else the first maximum
        const unsigned nan = __ballot_sync(0xffffffffu, in && isnan(score));
        const float best = warp_max(score);  // fmaxf: NaN-free unless every lane is NaN
        const unsigned hit = nan ? nan : __ballot_sync(0xffffffffu, in && score == best);
        pick = hit ? __ffs(hit) - 1 : 0;
        q = lane == pick ? 1.0f : 0.0f;
      }
      if (in) p.q[row * p.k + lane] = q;
      if (lane == 0) s_pick = pick;
    }
    __syncthreads();
    const int pick = s_pick;
    if (warp == pick / CPW) {
      const int c = pick % CPW;
#pragma unroll
      for (int cc = 0; cc < CPW; ++cc) {
        if (cc != c) continue;
#pragma unroll
        for (int n = 0; n < DPL; ++n) {
          const int d = lane + 32 * n;
          if (d < kMaxRank) s_pv[d] = cur.pred[cc][n];
        }
        if (lane == 0) p.path[r * p.j + j] = cur.cand[cc];
      }
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < DPL; ++n) pv[n] = s_pv[lane + 32 * n];
    if (j + 1 < p.j) cur = nxt;
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

int dt_code(at::ScalarType t) {
  return t == at::kBFloat16 ? kDtBF16 : t == at::kHalf ? kDtF16 : kDtF32;
}

template <class E, int DPL, int CPW>
void launch(const SelectParams& p, int64_t r, cudaStream_t stream) {
  launch_kernel(select_kernel<E, DPL, CPW>, static_cast<unsigned>(r), kThreads, 0, stream, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// (dims a lane, candidates a warp) with DPL * CPW <= 16: the two steps' rows in registers
// without spilling (select_fits).
int dims_per_lane(int64_t rank) { return rank <= 64 ? 2 : rank <= 128 ? 4 : rank <= 256 ? 8 : 16; }
int cands_per_warp(int64_t k) { return k <= kWarps ? 1 : k <= 2 * kWarps ? 2 : 4; }
bool select_fits(int64_t k, int64_t rank) {
  return k <= 4 * kWarps && rank <= kMaxRank && dims_per_lane(rank) * cands_per_warp(k) <= 16;
}

template <class E, int CPW>
void by_rank(const SelectParams& p, int64_t r, cudaStream_t stream) {
  switch (dims_per_lane(p.rank)) {
    case 2: launch<E, 2, CPW>(p, r, stream); break;
    case 4: launch<E, 4, CPW>(p, r, stream); break;
    case 8:
      if constexpr (CPW <= 2) {
        launch<E, 8, CPW>(p, r, stream);
      } else {
        TORCH_CHECK(false, "dflash.select_candidates: internal: no kernel for rank ", p.rank,
                    ", k ", p.k, " (select_fits and by_rank disagree)");
      }
      break;
    default:
      if constexpr (CPW == 1) {
        launch<E, 16, CPW>(p, r, stream);
      } else {
        TORCH_CHECK(false, "dflash.select_candidates: internal: no kernel for rank ", p.rank,
                    ", k ", p.k, " (select_fits and by_rank disagree)");
      }
      break;
  }
}

template <class E>
void run(const SelectParams& p, int64_t r, cudaStream_t stream) {
  switch (cands_per_warp(p.k)) {
    case 1: by_rank<E, 1>(p, r, stream); break;
    case 2: by_rank<E, 2>(p, r, stream); break;
    default: by_rank<E, 4>(p, r, stream); break;
  }
}

void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "dflash.", op, ": ", name, " must be contiguous, got shape ",
                    py_list(t.sizes()), " strides ", py_list(t.strides()));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> select_candidates(
    const at::Tensor& unary, const at::Tensor& cand, const at::Tensor& hidden,
    const at::Tensor& anchor, const at::Tensor& pred, const at::Tensor& succ,
    double temperature, const std::optional<at::Tensor>& u) {
  constexpr const char* op = "select_candidates";
  // the order and messages of dflash_ops/ops/select.py _check
  check_cuda(op, "unary", unary);
  check_rank(op, "unary", unary, 3);
  check_float(op, "unary", unary);
  check_contiguous(op, "unary", unary);
  const int64_t r = unary.size(0), j = unary.size(1), k = unary.size(2);
  TORCH_CHECK_VALUE(k >= 1 || r * j == 0, "dflash.", op,
                    ": unary must have k >= 1 candidates a row (its last dim), got shape ",
                    py_list(unary.sizes()));
  check_dtype(op, "cand", cand, at::kLong);
  check_device(op, "cand", cand, unary.device());
  check_shape(op, "cand", cand, {r, j, k});
  check_contiguous(op, "cand", cand);
  check_dtype(op, "anchor", anchor, at::kLong);
  check_device(op, "anchor", anchor, unary.device());
  check_shape(op, "anchor", anchor, {r});
  check_contiguous(op, "anchor", anchor);
  check_rank(op, "pred", pred, 2);
  check_float(op, "pred", pred);
  check_device(op, "pred", pred, unary.device());
  check_contiguous(op, "pred", pred);
  const int64_t v = pred.size(0), rank = pred.size(1);
  check_device(op, "succ", succ, unary.device());
  check_shape(op, "succ", succ, {v, rank});
  check_contiguous(op, "succ", succ);
  check_same_dtype(op, "succ", succ, "pred", pred);
  check_float(op, "hidden", hidden);
  check_device(op, "hidden", hidden, unary.device());
  check_shape(op, "hidden", hidden, {r, j, rank});
  check_contiguous(op, "hidden", hidden);
  TORCH_CHECK_VALUE(temperature >= 0, "dflash.", op, ": temperature must be >= 0, got ",
                    py_float(temperature));
  const bool sample = temperature > 0;
  if (sample) {
    TORCH_CHECK_VALUE(u.has_value(), "dflash.", op,
                      ": u (uniforms [R, J]) is required when temperature > 0");
    check_dtype(op, "u", *u, at::kFloat);
    check_device(op, "u", *u, unary.device());
    check_shape(op, "u", *u, {r, j});
    check_contiguous(op, "u", *u);
  }
  TORCH_CHECK_VALUE(j <= std::numeric_limits<int32_t>::max() &&
                        r <= std::numeric_limits<int32_t>::max(),
                    "dflash.", op, ": R = ", r, " or J = ", j, " is too large");

  at::Tensor path = at::empty({r, j}, cand.options());
  at::Tensor q = at::empty({r, j, k}, unary.options().dtype(at::kFloat));
  if (r == 0 || j == 0) return {path, q};
  TORCH_CHECK_VALUE(select_fits(k, rank), "dflash.", op,
                    ": the CUDA kernel takes k <= 8 with rank <= 512, k <= 16 with rank <= 256, "
                    "or k <= 32 with rank <= 128; got k = ", k, ", rank = ", rank,
                    " (unary's last dim, pred's); use the triton backend");
  SelectParams p{};
  p.unary = unary.data_ptr();
  p.cand = cand.data_ptr<int64_t>();
  p.hidden = hidden.data_ptr();
  p.anchor = anchor.data_ptr<int64_t>();
  p.pred = pred.data_ptr();
  p.succ = succ.data_ptr();
  p.u = sample ? u->data_ptr<float>() : nullptr;
  p.path = path.data_ptr<int64_t>();
  p.q = q.data_ptr<float>();
  p.v = v;
  p.j = static_cast<int>(j);
  p.k = static_cast<int>(k);
  p.rank = static_cast<int>(rank);
  p.unary_dt = dt_code(unary.scalar_type());
  p.hidden_dt = dt_code(hidden.scalar_type());
  p.inv_t = sample ? 1.0f / static_cast<float>(temperature) : 1.0f;
  const c10::cuda::CUDAGuard guard(unary.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(unary.get_device()).stream();
  switch (pred.scalar_type()) {
    case at::kBFloat16: run<BF16>(p, r, stream); break;
    case at::kHalf: run<F16>(p, r, stream); break;
    default: run<F32>(p, r, stream); break;
  }
  return {path, q};
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("select_candidates", TORCH_FN(dflash_ops::select_candidates));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
