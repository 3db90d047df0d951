// dflash_spec::greedy_commit_: greedy acceptance + commit of a verified block, one warp per
// request (the CUDA twin of dflash_ops/triton/accept.py; contract and reference:
// dflash_ops/speculator/accept.py greedy_commit_ref).
//
// Lane j of request r's warp holds post[r, j] and the draft block[r, j + 1]. match = the first
// j < B - 1 where they differ (ballot), the new tokens are post[r, 0..match], cut after the first
// stop token (ballot over the stop list) and at max_new - n_out[row]: kept of them go to
// out_tokens[row, n_out + j]; then n_out / start / last of row, ctx_pos[r, :], kept[r], done[r].
// B <= 32 (one lane a block position). Rows are distinct, so warps never share state.
#include "dflash_ops.h"

#include "common.cuh"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

namespace dflash_ops {
namespace {

constexpr int kWarps = 4;  // requests a CTA
constexpr const char* kOp = "greedy_commit_";

struct CommitParams {
  const int64_t* block;
  const int64_t* post;
  const int64_t* rows;
  int64_t* n_out;
  int64_t* start;
  int64_t* last;
  int64_t* out;
  const int64_t* stops;
  int64_t* ctx_pos;
  int64_t* kept;
  bool* done;
  int64_t out_stride, out_width, max_new;
  int r, b, n_stop;
};

__global__ void __launch_bounds__(kWarps * 32) greedy_commit_kernel(const CommitParams p) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (r >= p.r) return;  // whole warps exit together
  const int b = p.b;
  const bool in_b = lane < b;
  const int64_t row = p.rows[r];
  const int64_t post = in_b ? p.post[static_cast<int64_t>(r) * b + lane] : 0;
  const int64_t draft = lane < b - 1 ? p.block[static_cast<int64_t>(r) * b + lane + 1] : 0;
  const unsigned differ = __ballot_sync(0xffffffffu, lane < b - 1 && draft != post);
  const int match = differ ? __ffs(differ) - 1 : b - 1;
  bool stop = false;
  for (int s = 0; s < p.n_stop; ++s) stop |= post == p.stops[s];
  const unsigned stops = __ballot_sync(0xffffffffu, stop && lane <= match);
  const int first_stop = stops ? __ffs(stops) - 1 : b;
  const int64_t n_out = p.n_out[row];
  const int64_t room = p.max_new - n_out;
  int64_t kept = static_cast<int64_t>(match) + 1;
  kept = kept < room ? kept : room;
  kept = kept < first_stop + 1 ? kept : first_stop + 1;
  kept = kept > 0 ? kept : 0;
  const bool done = kept >= room || first_stop < kept;
  const int64_t col = n_out + lane;
  if (lane < kept && col < p.out_width) p.out[row * p.out_stride + col] = post;
  const int src = kept > 1 ? static_cast<int>(kept - 1) : 0;
  const int64_t last = __shfl_sync(0xffffffffu, post, src);
  const int64_t start = p.start[row];
  if (in_b) p.ctx_pos[static_cast<int64_t>(r) * b + lane] = lane < kept ? start + lane : -1;
  __syncwarp();  // every lane has read n_out / start before lane 0 writes them
  if (lane == 0) {
    p.n_out[row] = n_out + kept;
    p.start[row] = start + kept;
    p.last[row] = last;
    p.kept[r] = kept;
    p.done[r] = done;
  }
}

void check_long(const std::string& name, const at::Tensor& t, int64_t rank,
                const at::Device& dev) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, "dflash_spec.", kOp, ": ", name,
                    " must be int64, got ", t.scalar_type());
  detail::check_device(kOp, name, t, dev);
  detail::check_rank(kOp, name, t, rank);
  TORCH_CHECK_VALUE(t.is_contiguous(), "dflash_spec.", kOp, ": ", name, " must be contiguous");
}

}  // namespace

void greedy_commit_(const at::Tensor& block, const at::Tensor& post, const at::Tensor& rows,
                    at::Tensor& n_out, at::Tensor& start, at::Tensor& last,
                    at::Tensor& out_tokens, const at::Tensor& stop_ids, int64_t max_new,
                    at::Tensor& kept, at::Tensor& done, at::Tensor& ctx_pos) {
  const at::Device dev = block.device();
  TORCH_CHECK_VALUE(dev.is_cuda(), "dflash_spec.", kOp, ": block must be a CUDA tensor, got ",
                    dev);
  check_long("block", block, 2, dev);
  const int64_t r = block.size(0), b = block.size(1);
  TORCH_CHECK_VALUE(b >= 1 && b <= 32, "dflash_spec.", kOp,
                    ": block size (block.shape[1]) must be in [1, 32], got ", b);
  check_long("post", post, 2, dev);
  detail::check_shape(kOp, "post", post, block.sizes());
  check_long("rows", rows, 1, dev);
  TORCH_CHECK_VALUE(rows.size(0) == r, "dflash_spec.", kOp, ": rows must have ", r,
                    " entries (block.shape[0]), got ", rows.size(0));
  check_long("n_out", n_out, 1, dev);
  const int64_t n = n_out.size(0);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"start", &start},
                                {"last", &last}}) {
    check_long(name, *t, 1, dev);
    TORCH_CHECK_VALUE(t->size(0) == n, "dflash_spec.", kOp, ": ", name, " must have ", n,
                      " entries (n_out's), got ", t->size(0));
  }
  check_long("out_tokens", out_tokens, 2, dev);
  TORCH_CHECK_VALUE(out_tokens.size(0) == n, "dflash_spec.", kOp, ": out_tokens must have ", n,
                    " rows (n_out's), got ", out_tokens.size(0));
  check_long("stop_ids", stop_ids, 1, dev);
  check_long("kept", kept, 1, dev);
  TORCH_CHECK_VALUE(kept.size(0) == r, "dflash_spec.", kOp, ": kept must have ", r,
                    " entries, got ", kept.size(0));
  TORCH_CHECK_VALUE(done.scalar_type() == at::kBool && done.dim() == 1 && done.size(0) == r &&
                        done.is_contiguous() && done.device() == dev,
                    "dflash_spec.", kOp, ": done must be a contiguous bool [", r, "] on ", dev);
  check_long("ctx_pos", ctx_pos, 2, dev);
  detail::check_shape(kOp, "ctx_pos", ctx_pos, block.sizes());
  if (r == 0) return;
  TORCH_CHECK_VALUE(r < (int64_t{1} << 30), "dflash_spec.", kOp, ": too many requests: ", r);

  CommitParams p{};
  p.block = block.data_ptr<int64_t>();
  p.post = post.data_ptr<int64_t>();
  p.rows = rows.data_ptr<int64_t>();
  p.n_out = n_out.data_ptr<int64_t>();
  p.start = start.data_ptr<int64_t>();
  p.last = last.data_ptr<int64_t>();
  p.out = out_tokens.data_ptr<int64_t>();
  p.stops = stop_ids.data_ptr<int64_t>();
  p.ctx_pos = ctx_pos.data_ptr<int64_t>();
  p.kept = kept.data_ptr<int64_t>();
  p.done = done.data_ptr<bool>();
  p.out_stride = out_tokens.stride(0);
  p.out_width = out_tokens.size(1);
  p.max_new = max_new;
  p.r = static_cast<int>(r);
  p.b = static_cast<int>(b);
  p.n_stop = static_cast<int>(stop_ids.size(0));
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const unsigned grid = static_cast<unsigned>((r + kWarps - 1) / kWarps);
  greedy_commit_kernel<<<grid, kWarps * 32, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash_ops
