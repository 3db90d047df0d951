// dflash_spec::greedy_commit_: greedy acceptance + commit of a verified block, one warp per
// request (the CUDA twin of dflash_ops/triton/accept.py; contract and reference:
// dflash_ops/speculator/accept.py greedy_commit_ref).
//
// Lane j of request r's warp holds post[r, j] and the draft block[r, j + 1]. match = the first
// j < B - 1 where they differ (ballot), the new tokens are post[r, 0..match], cut after the first
// stop token (ballot over the stop list) and at max_new - n_out[row]: kept of them go to
// out_tokens[row, n_out + j]; then n_out / start / last of row, ctx_pos[r, :], kept[r], done[r].
// B <= 32 (one lane a block position). Rows are distinct, so warps never share state.
//
// dflash_spec::sample_commit_: speculative rejection sampling + the same commit, one CTA (256
// threads) per request (the twin of triton/accept.py sample_commit; contract: accept.py
// sample_commit_ref). Warp 0 finds the first rejected draft (lane j: u_j * q_j(d_j) <
// p_j(d_j)); the CTA then makes two passes over the V probabilities of the row drawn from
// (max(p - q, 0) at the rejection, p where that has no mass or after B-1 acceptances): its mass
// and last nonzero token, then the inverse CDF at u_res * mass (a block scan, 1024 entries a
// step: the first entry with weight whose running sum exceeds it); warp 0 commits [accepted
// drafts, the drawn token].
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

// The commit of request r by one warp: lane j holds the new token tok (j <= match). Rows are
// distinct, so warps never share state.
__device__ void commit_warp(const CommitParams& p, int r, int lane, int match, int64_t tok) {
  const int b = p.b;
  const bool in_b = lane < b;
  const int64_t row = p.rows[r];
  bool stop = false;
  for (int s = 0; s < p.n_stop; ++s) stop |= tok == p.stops[s];
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
  if (lane < kept && col < p.out_width) p.out[row * p.out_stride + col] = tok;
  const int src = kept > 1 ? static_cast<int>(kept - 1) : 0;
  const int64_t last = __shfl_sync(0xffffffffu, tok, src);
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

__global__ void __launch_bounds__(kWarps * 32) greedy_commit_kernel(const CommitParams p) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (r >= p.r) return;  // whole warps exit together
  const int b = p.b;
  const int64_t post = lane < b ? p.post[static_cast<int64_t>(r) * b + lane] : 0;
  const int64_t draft = lane < b - 1 ? p.block[static_cast<int64_t>(r) * b + lane + 1] : 0;
  const unsigned differ = __ballot_sync(0xffffffffu, lane < b - 1 && draft != post);
  const int match = differ ? __ffs(differ) - 1 : b - 1;
  commit_warp(p, r, lane, match, post);
}

constexpr int kSampleThreads = 256;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kPerThread = 4;  // consecutive entries a thread in the inverse-CDF pass

struct SampleParams {
  CommitParams c;  // c.post unused
  const float* p;  // [R, B, V], strides sp_r, sp_j, 1
  const float* q;  // [R, B-1, V], strides sq_r, sq_j, 1
  const float* u;      // [R, B-1]
  const float* u_res;  // [R]
  int64_t sp_r, sp_j, sq_r, sq_j, v;
};

__device__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ int64_t warp_max(int64_t x) {
  for (int o = 16; o > 0; o >>= 1) {
    const int64_t y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y > x ? y : x;
  }
  return x;
}

__global__ void __launch_bounds__(kSampleThreads) sample_commit_kernel(const SampleParams sp) {
  const CommitParams& p = sp.c;
  const int r = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = p.b;
  __shared__ int s_match;
  __shared__ float s_f[2][kSampleWarps];
  __shared__ int64_t s_i[3][kSampleWarps];
  const int64_t draft = warp == 0 && lane < b - 1
                            ? p.block[static_cast<int64_t>(r) * b + lane + 1] : 0;
  if (warp == 0) {
    bool ok = false;
    if (lane < b - 1) {
      const float pd = sp.p[r * sp.sp_r + lane * sp.sp_j + draft];
      const float qd = sp.q[r * sp.sq_r + lane * sp.sq_j + draft];
      ok = sp.u[static_cast<int64_t>(r) * (b - 1) + lane] * qd < pd;
    }
    const unsigned rejected = __ballot_sync(0xffffffffu, lane < b - 1 && !ok);
    if (lane == 0) s_match = rejected ? __ffs(rejected) - 1 : b - 1;
  }
  __syncthreads();
  const int match = s_match;
  const bool q_on = match < b - 1;
  const float* prow = sp.p + r * sp.sp_r + match * sp.sp_j;
  const float* qrow = sp.q + r * sp.sq_r + (q_on ? match : 0) * sp.sq_j;
  const int64_t v = sp.v;

  // pass 1: mass of max(p - q, 0), of p, and the last token with weight in each
  float mass = 0.f, pmass = 0.f;
  int64_t last_r = 0, last_p = 0;
  for (int64_t k = tid; k < v; k += kSampleThreads) {
    const float pv = prow[k];
    const float rv = fmaxf(pv - (q_on ? qrow[k] : 0.f), 0.f);
    mass += rv;
    pmass += pv;
    if (rv > 0.f) last_r = k;
    if (pv > 0.f) last_p = k;
  }
  mass = warp_sum(mass);
  pmass = warp_sum(pmass);
  last_r = warp_max(last_r);
  last_p = warp_max(last_p);
  if (lane == 0) {
    s_f[0][warp] = mass;
    s_f[1][warp] = pmass;
    s_i[0][warp] = last_r;
    s_i[1][warp] = last_p;
  }
  __syncthreads();
  mass = pmass = 0.f;
  last_r = last_p = 0;
  for (int w = 0; w < kSampleWarps; ++w) {
    mass += s_f[0][w];
    pmass += s_f[1][w];
    last_r = s_i[0][w] > last_r ? s_i[0][w] : last_r;
    last_p = s_i[1][w] > last_p ? s_i[1][w] : last_p;
  }
  const bool use_r = mass > 0.f;
  const float target = sp.u_res[r] * (use_r ? mass : pmass);
  const bool sub_q = use_r && q_on;
  __syncthreads();  // s_f is reused below

  // pass 2 (the inverse CDF): the first entry with weight whose running sum exceeds target.
  // Asking for weight keeps zero-weight tokens out where the parallel fp32 running sum dips.
  float run = 0.f;
  int64_t first = v;
  for (int64_t base = 0; base < v; base += kSampleThreads * kPerThread) {
    const int64_t k0 = base + static_cast<int64_t>(tid) * kPerThread;
    float incl[kPerThread];
    bool has[kPerThread];
    float local = 0.f;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t k = k0 + i;
      float dv = 0.f;
      if (k < v) {
        const float pv = prow[k];
        dv = use_r ? fmaxf(pv - (sub_q ? qrow[k] : 0.f), 0.f) : pv;
      }
      local += dv;
      incl[i] = local;
      has[i] = dv > 0.f;
    }
    float scan = local;  // the warp's inclusive scan of the threads' sums
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, scan, o);
      if (lane >= o) scan += y;
    }
    if (lane == 31) s_f[0][warp] = scan;
    __syncthreads();
    float before = 0.f, chunk = 0.f;
    for (int w = 0; w < kSampleWarps; ++w) {
      before += w < warp ? s_f[0][w] : 0.f;
      chunk += s_f[0][w];
    }
    const float offset = run + before + (scan - local);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (has[i] && offset + incl[i] > target && k0 + i < first) first = k0 + i;
    }
    run += chunk;
    __syncthreads();  // s_f is rewritten next step
  }
  for (int o = 16; o > 0; o >>= 1) {
    const int64_t y = __shfl_xor_sync(0xffffffffu, first, o);
    first = y < first ? y : first;
  }
  if (lane == 0) s_i[2][warp] = first;
  __syncthreads();
  if (warp != 0) return;
  for (int w = 0; w < kSampleWarps; ++w) first = s_i[2][w] < first ? s_i[2][w] : first;
  const int64_t token = first < v ? first : (use_r ? last_r : last_p);
  commit_warp(p, r, lane, match, lane == match ? token : draft);
}

void check_long(const std::string& name, const at::Tensor& t, int64_t rank,
                const at::Device& dev, const char* op = kOp) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, "dflash_spec.", op, ": ", name,
                    " must be int64, got ", t.scalar_type());
  detail::check_device(op, name, t, dev);
  detail::check_rank(op, name, t, rank);
  TORCH_CHECK_VALUE(t.is_contiguous(), "dflash_spec.", op, ": ", name, " must be contiguous");
}

// The state arguments both ops share: checked, and their pointers into a CommitParams.
CommitParams check_state(const char* op, const at::Tensor& block, const at::Tensor& rows,
                         at::Tensor& n_out, at::Tensor& start, at::Tensor& last,
                         at::Tensor& out_tokens, const at::Tensor& stop_ids, int64_t max_new,
                         at::Tensor& kept, at::Tensor& done, at::Tensor& ctx_pos) {
  const at::Device dev = block.device();
  const int64_t r = block.size(0), b = block.size(1);
  check_long("rows", rows, 1, dev, op);
  TORCH_CHECK_VALUE(rows.size(0) == r, "dflash_spec.", op, ": rows must have ", r,
                    " entries (block.shape[0]), got ", rows.size(0));
  check_long("n_out", n_out, 1, dev, op);
  const int64_t n = n_out.size(0);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"start", &start},
                                {"last", &last}}) {
    check_long(name, *t, 1, dev, op);
    TORCH_CHECK_VALUE(t->size(0) == n, "dflash_spec.", op, ": ", name, " must have ", n,
                      " entries (n_out's), got ", t->size(0));
  }
  check_long("out_tokens", out_tokens, 2, dev, op);
  TORCH_CHECK_VALUE(out_tokens.size(0) == n, "dflash_spec.", op, ": out_tokens must have ", n,
                    " rows (n_out's), got ", out_tokens.size(0));
  check_long("stop_ids", stop_ids, 1, dev, op);
  check_long("kept", kept, 1, dev, op);
  TORCH_CHECK_VALUE(kept.size(0) == r, "dflash_spec.", op, ": kept must have ", r,
                    " entries, got ", kept.size(0));
  TORCH_CHECK_VALUE(done.scalar_type() == at::kBool && done.dim() == 1 && done.size(0) == r &&
                        done.is_contiguous() && done.device() == dev,
                    "dflash_spec.", op, ": done must be a contiguous bool [", r, "] on ", dev);
  check_long("ctx_pos", ctx_pos, 2, dev, op);
  detail::check_shape(op, "ctx_pos", ctx_pos, block.sizes());
  TORCH_CHECK_VALUE(r < (int64_t{1} << 30), "dflash_spec.", op, ": too many requests: ", r);
  CommitParams p{};
  p.block = block.data_ptr<int64_t>();
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
  return p;
}

void check_block(const char* op, const at::Tensor& block, int64_t min_b) {
  const at::Device dev = block.device();
  TORCH_CHECK_VALUE(dev.is_cuda(), "dflash_spec.", op, ": block must be a CUDA tensor, got ",
                    dev);
  check_long("block", block, 2, dev, op);
  TORCH_CHECK_VALUE(block.size(1) >= min_b && block.size(1) <= 32, "dflash_spec.", op,
                    ": block size (block.shape[1]) must be in [", min_b, ", 32], got ",
                    block.size(1));
}

void check_probs(const char* op, const std::string& name, const at::Tensor& t,
                 c10::IntArrayRef shape, const at::Device& dev) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, "dflash_spec.", op, ": ", name,
                    " must be float32, got ", t.scalar_type());
  detail::check_device(op, name, t, dev);
  detail::check_shape(op, name, t, shape);
  TORCH_CHECK_VALUE(t.numel() == 0 || t.stride(-1) == 1, "dflash_spec.", op, ": ", name,
                    " must have unit stride in its last dim, got strides ",
                    detail::py_list(t.strides()));
}

}  // namespace

void greedy_commit_(const at::Tensor& block, const at::Tensor& post, const at::Tensor& rows,
                    at::Tensor& n_out, at::Tensor& start, at::Tensor& last,
                    at::Tensor& out_tokens, const at::Tensor& stop_ids, int64_t max_new,
                    at::Tensor& kept, at::Tensor& done, at::Tensor& ctx_pos) {
  check_block(kOp, block, 1);
  const at::Device dev = block.device();
  check_long("post", post, 2, dev);
  detail::check_shape(kOp, "post", post, block.sizes());
  CommitParams p = check_state(kOp, block, rows, n_out, start, last, out_tokens, stop_ids,
                               max_new, kept, done, ctx_pos);
  const int64_t r = block.size(0);
  if (r == 0) return;
  p.post = post.data_ptr<int64_t>();
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const unsigned grid = static_cast<unsigned>((r + kWarps - 1) / kWarps);
  greedy_commit_kernel<<<grid, kWarps * 32, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void sample_commit_(const at::Tensor& block, const at::Tensor& p, const at::Tensor& q,
                    const at::Tensor& u, const at::Tensor& u_res, const at::Tensor& rows,
                    at::Tensor& n_out, at::Tensor& start, at::Tensor& last,
                    at::Tensor& out_tokens, const at::Tensor& stop_ids, int64_t max_new,
                    at::Tensor& kept, at::Tensor& done, at::Tensor& ctx_pos) {
  constexpr const char* op = "sample_commit_";
  check_block(op, block, 2);
  const at::Device dev = block.device();
  const int64_t r = block.size(0), b = block.size(1);
  TORCH_CHECK_VALUE(p.dim() == 3, "dflash_spec.", op, ": p must be [R, B, V], got ",
                    detail::py_list(p.sizes()));
  const int64_t v = p.size(2);
  TORCH_CHECK_VALUE(v >= 1 && v < (int64_t{1} << 31), "dflash_spec.", op,
                    ": vocabulary (p.shape[2]) must be in [1, 2^31), got ", v);
  check_probs(op, "p", p, {r, b, v}, dev);
  check_probs(op, "q", q, {r, b - 1, v}, dev);
  check_probs(op, "u", u, {r, b - 1}, dev);
  check_probs(op, "u_res", u_res, {r}, dev);
  TORCH_CHECK_VALUE(u.is_contiguous() && u_res.is_contiguous(), "dflash_spec.", op,
                    ": u and u_res must be contiguous");
  SampleParams sp{};
  sp.c = check_state(op, block, rows, n_out, start, last, out_tokens, stop_ids, max_new, kept,
                     done, ctx_pos);
  if (r == 0) return;
  sp.p = p.data_ptr<float>();
  sp.q = q.data_ptr<float>();
  sp.u = u.data_ptr<float>();
  sp.u_res = u_res.data_ptr<float>();
  sp.sp_r = p.stride(0);
  sp.sp_j = p.stride(1);
  sp.sq_r = q.stride(0);
  sp.sq_j = q.stride(1);
  sp.v = v;
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  sample_commit_kernel<<<static_cast<unsigned>(r), kSampleThreads, 0, stream>>>(sp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash_ops
