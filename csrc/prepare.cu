// dflash_spec::prepare_step_: a speculator step's static inputs in one launch (the CUDA twin of
// dflash_ops/triton/accept.py prepare_step; contract and reference:
// dflash_ops/speculator/prepare.py prepare_step_ / prepare_step_ref).
//
// CTA i (32 threads, lane j loops over the B block positions) writes block row i (i < P):
// [last[rows[i]], drafts[i, :] or fill_id...], requests_out[i] = rows[i], start_out[i] =
// start[rows[i]] for i < R, the padding row (fill_id..., scratch, 0) for R <= i < P; and the
// context entries e in [i * B, i * B + B) (e < C): (ctx_rows[i], ctx_pos[i, e - i * B]) for
// i < Rc, (scratch, -1) past them. Grid: max(P, C / B) CTAs. Shapes alone decide the launch.
#include "dflash_ops.h"

#include "common.cuh"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

namespace dflash_ops {
namespace {

constexpr const char* kPrepOp = "prepare_step_";

struct PrepareParams {
  const int64_t* rows;
  const int64_t* last;
  const int64_t* start;
  const int64_t* drafts;  // nullptr: fill_id
  const int64_t* ctx_rows;
  const int64_t* ctx_pos;
  int64_t* block;
  int64_t* requests;
  int64_t* start_out;
  int64_t* ctx_req;
  int64_t* ctx_pos_out;
  int64_t fill_id, scratch;
  int r, p, rc, b;
  int64_t c;
};

__global__ void prepare_step_kernel(const PrepareParams p) {
  const int i = blockIdx.x;
  const int b = p.b;
  if (i < p.p) {
    const bool real = i < p.r;
    const int64_t row = real ? p.rows[i] : p.scratch;
    for (int j = threadIdx.x; j < b; j += blockDim.x) {
      int64_t tok = p.fill_id;
      if (real && j == 0) tok = p.last[row];
      else if (real && p.drafts != nullptr) tok = p.drafts[static_cast<int64_t>(i) * (b - 1) + j - 1];
      p.block[static_cast<int64_t>(i) * b + j] = tok;
    }
    if (threadIdx.x == 0) {
      p.requests[i] = row;
      p.start_out[i] = real ? p.start[row] : 0;
    }
  }
  const bool ctx_real = i < p.rc;
  const int64_t req = ctx_real ? p.ctx_rows[i] : p.scratch;
  for (int j = threadIdx.x; j < b; j += blockDim.x) {
    const int64_t e = static_cast<int64_t>(i) * b + j;
    if (e >= p.c) break;
    p.ctx_req[e] = req;
    p.ctx_pos_out[e] = ctx_real ? p.ctx_pos[e] : -1;
  }
}

void check_int64(const std::string& name, const at::Tensor& t, c10::IntArrayRef shape,
                 const at::Device& dev) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, "dflash_spec.", kPrepOp, ": ", name,
                    " must be int64, got ", t.scalar_type());
  detail::check_device(kPrepOp, name, t, dev);
  detail::check_shape(kPrepOp, name, t, shape);
  TORCH_CHECK_VALUE(t.is_contiguous(), "dflash_spec.", kPrepOp, ": ", name,
                    " must be contiguous");
}

}  // namespace

void prepare_step_(const at::Tensor& rows, const at::Tensor& last, const at::Tensor& start,
                   const at::Tensor& drafts, const at::Tensor& ctx_rows,
                   const at::Tensor& ctx_pos, int64_t fill_id, int64_t scratch,
                   at::Tensor& block_out, at::Tensor& requests_out, at::Tensor& start_out,
                   at::Tensor& ctx_req_out, at::Tensor& ctx_pos_out) {
  const at::Device dev = rows.device();
  TORCH_CHECK_VALUE(dev.is_cuda(), "dflash_spec.", kPrepOp, ": rows must be a CUDA tensor, got ",
                    dev);
  detail::check_rank(kPrepOp, "rows", rows, 1);
  const int64_t r = rows.size(0);
  check_int64("rows", rows, {r}, dev);
  detail::check_rank(kPrepOp, "last", last, 1);
  const int64_t n = last.size(0);
  check_int64("last", last, {n}, dev);
  check_int64("start", start, {n}, dev);
  detail::check_rank(kPrepOp, "block_out", block_out, 2);
  const int64_t p = block_out.size(0), b = block_out.size(1);
  TORCH_CHECK_VALUE(p >= r && b >= 1, "dflash_spec.", kPrepOp,
                    ": block_out must be [P, B] with P >= ", r, " (rows' length) and B >= 1, got ",
                    detail::py_list(block_out.sizes()));
  check_int64("block_out", block_out, {p, b}, dev);
  check_int64("requests_out", requests_out, {p}, dev);
  check_int64("start_out", start_out, {p}, dev);
  // drafts: [R, B-1], or a 2-D tensor with no rows for none (the block gets fill_id)
  const bool has_drafts = !(drafts.dim() == 2 && drafts.size(0) == 0);
  if (has_drafts) check_int64("drafts", drafts, {r, b - 1}, dev);
  detail::check_rank(kPrepOp, "ctx_rows", ctx_rows, 1);
  const int64_t rc = ctx_rows.size(0);
  check_int64("ctx_rows", ctx_rows, {rc}, dev);
  check_int64("ctx_pos", ctx_pos, {rc, b}, dev);
  detail::check_rank(kPrepOp, "ctx_req_out", ctx_req_out, 1);
  const int64_t c = ctx_req_out.size(0);
  TORCH_CHECK_VALUE(c >= rc * b && c % b == 0, "dflash_spec.", kPrepOp,
                    ": ctx_req_out must have a multiple of B = ", b, " entries, at least ", rc * b,
                    " (ctx_rows x B), got ", c);
  check_int64("ctx_req_out", ctx_req_out, {c}, dev);
  check_int64("ctx_pos_out", ctx_pos_out, {c}, dev);
  TORCH_CHECK_VALUE(p < (int64_t{1} << 30) && c / b < (int64_t{1} << 30) && b <= 4096,
                    "dflash_spec.", kPrepOp, ": too many rows (", p, ", ", c / b,
                    ") or block size too large (", b, ")");
  const int64_t grid = std::max(p, c / b);
  if (grid == 0) return;
  PrepareParams pp{};
  pp.rows = rows.data_ptr<int64_t>();
  pp.last = last.data_ptr<int64_t>();
  pp.start = start.data_ptr<int64_t>();
  pp.drafts = has_drafts ? drafts.data_ptr<int64_t>() : nullptr;
  pp.ctx_rows = ctx_rows.data_ptr<int64_t>();
  pp.ctx_pos = ctx_pos.data_ptr<int64_t>();
  pp.block = block_out.data_ptr<int64_t>();
  pp.requests = requests_out.data_ptr<int64_t>();
  pp.start_out = start_out.data_ptr<int64_t>();
  pp.ctx_req = ctx_req_out.data_ptr<int64_t>();
  pp.ctx_pos_out = ctx_pos_out.data_ptr<int64_t>();
  pp.fill_id = fill_id;
  pp.scratch = scratch;
  pp.r = static_cast<int>(r);
  pp.p = static_cast<int>(p);
  pp.rc = static_cast<int>(rc);
  pp.b = static_cast<int>(b);
  pp.c = c;
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  prepare_step_kernel<<<static_cast<unsigned>(grid), 32, 0, stream>>>(pp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash_ops
