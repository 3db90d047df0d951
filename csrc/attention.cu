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
// The kernels, and how the key range of a request is tiled and split: attention_kernels.cuh
// (mma.sync, any GPU of the build) and attention_hopper.cuh (TMA + wgmma, sm_90a: the default
// where it can take the call; DFLASH_OPS_ATTN_KERNEL=auto|mma|wgmma, see attn_kernel).
// Device values are never read on the host. Offsets into the caches and into q / out are
// 64-bit; token and key indices are 32-bit (Tq * Hq < 2^31, seq_len < 2^31). A q or out that is
// not on 16-byte boundaries goes through a contiguous copy; caches that are not use 2- / 4-byte
// loads instead of cp.async (same kernel, a uniform branch).
#include "dflash_ops.h"

#include "attention_hopper.cuh"
#include "attention_kernels.cuh"
#include "checks.h"
#include "register.h"
#include "common.cuh"

#include <ATen/ops/empty.h>
#include <cmath>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>

namespace dflash_ops {
namespace {

using namespace attention;  // attention_kernels.cuh, attention_common.cuh
using namespace detail;     // common.cuh, checks.h

// ---------------------------------------------------------------------------------------------
// Host side: argument checks (checks.h), then the launch.

// The checks of dflash_ops/ops/attention.py in its order, then the C++ limits.
// split_keys: at most 32 splits (combine_kernel merges one split a lane of one warp)
constexpr int64_t kMaxAbsoluteSplits = 32;

void check_attn(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& block_table,
                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                const std::optional<at::Tensor>& sinks, int64_t split_keys,
                const at::Tensor* out) {
  // q: [Tq, Hq, D] bf16/fp16/fp32 on CUDA, unit stride in D, D a supported head_dim
  check_rank(op, "q", q, 3);
  check_float(op, "q", q);
  check_last_dim(op, "q", q);
  check_cuda(op, "q", q);
  const int64_t hq = q.size(1), d = q.size(2);
  check_head_dim(op, "q", d);
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
  TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale), "dflash.", op,
                    ": scale must be finite and > 0, got ", py_float(scale));
  if (sinks.has_value()) {
    check_dtype(op, "sinks", *sinks, at::kFloat);
    check_device(op, "sinks", *sinks, device);
    check_shape(op, "sinks", *sinks, {hq});
  }
  TORCH_CHECK_VALUE(split_keys >= 0 && split_keys % 64 == 0, "dflash.", op,
                    ": split_keys must be 0 or a positive multiple of 64, got ", split_keys);
  if (split_keys > 0) {
    const int64_t keys = block_table.size(1) * k_cache.size(1);
    const int64_t n = (keys + split_keys - 1) / split_keys;
    TORCH_CHECK_VALUE(n <= kMaxAbsoluteSplits, "dflash.", op, ": split_keys = ", split_keys,
                      " splits max_blocks * block_size = ", keys, " keys ", n,
                      " ways (at most ", kMaxAbsoluteSplits, ")");
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

// Keys a split at least: two 64-key tiles at D <= 128. Below ~8k keys with few (request, KV
// head) pairs a CTA is latency-bound, so more splits of fewer tiles run faster. Measured (H200,
// B 1, 16 queries, Hq 32 / Hkv 8, D 128, 1024 keys): 256 keys a split 14.7 us, 128 keys 11.6
// us, 64 keys 12.2 us; 8192 keys: 27.7-27.9 us for all three.
constexpr int64_t kMinSplitKeys = 128;

// Splits of each tile's key range, from shapes only: at least kMinSplitKeys keys (of
// max_blocks * block_size) a split, the fp32 partial buffer of splits x Tq x Hq x (D + 1)
// within 256 MiB, at most 32, and B * Hkv * splits CTAs:
// - mma.sync kernel: about twice the SMs (rounded up);
// - wgmma kernel (`one_wave`): at most one wave of its resident CTAs (`slots`, rounded down): a
//   second, partial wave runs its few CTAs at their own rate, not the copy rate. Measured (H200,
//   16 queries, Hq 32 / Hkv 8, D 128, graph replay; results/session21-2026-12-04/*splits*.md):
//   8 x 4k 5 splits (the round-up rule, 320 CTAs) 59.4 us, 4 splits 45.4; 32 x 4k 2 splits
//   152.7 us, 1 split 138.7; 1 x 1k, 1 x 32k, 1 x 131k, 64 x 1k best at the counts both rules
//   give.
int choose_splits(int64_t bh, int64_t max_keys, int64_t rows, int64_t d, int64_t slots,
                  bool one_wave) {
  constexpr int64_t kMaxSplits = 32;
  constexpr int64_t kPartialBytes = int64_t{256} << 20;
  const int64_t per = kMinSplitKeys;
  bh = std::max<int64_t>(bh, 1);
  int64_t s = kMaxSplits;
  s = std::min(s, one_wave ? slots / bh : (slots + bh - 1) / bh);
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

// ---------------------------------------------------------------------------------------------
// The Hopper kernel (attention_hopper.cuh): when it runs, and its tensor maps.

// Whether this binary holds attn_wgmma_kernel's sm_90a body for the current device: a build
// without sm_90a (or another GPU) gets the one-warp stub, or no image at all.
bool wgmma_built(int device) {
  static std::array<std::atomic<int>, 64> known{};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= 64) return false;
  int v = known[device].load();
  if (v == 0) {
    cudaFuncAttributes a{};
    const cudaError_t e = cudaFuncGetAttributes(&a, attn_wgmma_kernel<BF16, 128>);
    if (e == cudaSuccess) {
      v = a.maxThreadsPerBlock >= kWgThreads ? 1 : 2;
    } else if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
      (void)cudaGetLastError();  // the answer "no image for this GPU" (our query's own error)
      v = 2;
    } else {
      return false;  // no answer (another error, left for the caller's checks): ask again later
    }
    known[device].store(v);
  }
  return v == 1;
}

// A cache's byte stride of dim `dim`: what TMA needs (multiples of 16 bytes, < 2^40); a dim of
// size 1 is never stepped, so any valid stride does.
int64_t tma_stride(const at::Tensor& c, int dim) {
  return c.size(dim) > 1 ? c.stride(dim) * c.element_size() : 16;
}

bool tma_cache_ok(const at::Tensor& c) {
  if (!aligned16(c.data_ptr()) || c.size(0) > (int64_t{1} << 32)) return false;
  for (int dim = 0; dim < 3; ++dim) {
    const int64_t st = tma_stride(c, dim);
    if (st <= 0 || st % 16 != 0 || st >= (int64_t{1} << 40)) return false;
  }
  return true;
}

// Why the Hopper kernel cannot take a call (nullptr: it can): bf16 / fp16, D 64 / 128,
// power-of-two pages of >= 8 rows, caches TMA can address, an sm_90a build on an sm_90 GPU.
const char* wgmma_refusal(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache) {
  const int64_t d = q.size(2), bs = k_cache.size(1);
  if (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf) return "q not bf16/fp16";
  if (d != 64 && d != 128) return "head_dim not 64 or 128";
  if (bs < 8 || (bs & (bs - 1)) != 0) return "block_size not a power of two >= 8";
  if (!tma_cache_ok(k_cache) || !tma_cache_ok(v_cache)) {
    return "a cache's base or strides not on 16 bytes";
  }
  if (!wgmma_built(static_cast<int>(q.get_device()))) return "no sm_90a build for this GPU";
  return nullptr;
}

// DFLASH_OPS_ATTN_KERNEL: unset or "auto" (the Hopper kernel where it can run, else the
// portable one), "mma" (the portable kernel), "wgmma" (the Hopper kernel, or an error saying
// why not).
enum class AttnKernel { kMma, kWgmma, kWgmmaForced };

AttnKernel attn_kernel(const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache) {
  const char* env = std::getenv("DFLASH_OPS_ATTN_KERNEL");
  const std::string force = env == nullptr ? "auto" : env;
  TORCH_CHECK_VALUE(force == "auto" || force == "mma" || force == "wgmma",
                    "dflash.block_attention: DFLASH_OPS_ATTN_KERNEL must be auto, mma or "
                    "wgmma, got '", force, "'");
  if (force == "mma") return AttnKernel::kMma;
  const char* why = wgmma_refusal(q, k_cache, v_cache);
  TORCH_CHECK_VALUE(why == nullptr || force != "wgmma", "dflash.block_attention: "
                    "DFLASH_OPS_ATTN_KERNEL=wgmma but the Hopper kernel cannot run this call: ",
                    why);
  if (why != nullptr) return AttnKernel::kMma;
  return force == "wgmma" ? AttnKernel::kWgmmaForced : AttnKernel::kWgmma;
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult res{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                    cudaEnableDefault, &res));
    TORCH_CHECK(res == cudaDriverEntryPointSuccess && f != nullptr,
                "dflash.block_attention: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// [num_blocks, block_size, Hkv, D] as a 4-D tensor map, dims innermost first: (D, Hkv,
// block_size, num_blocks), or (D, block_size, Hkv, num_blocks) when head_outer (the head stride
// is the larger, as in vLLM's head-major cache); a box is 64 dims x one head x min(block_size,
// 64) rows of one block, 128-byte swizzled.
// Returns the encoder's result; `map` is valid on CUDA_SUCCESS.
CUresult make_kv_map(const at::Tensor& c, bool head_outer, CUtensorMap& map) {
  const int64_t bs = c.size(1), rows = std::min<int64_t>(bs, 64);
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(c.size(3)), 0, 0,
                        static_cast<cuuint64_t>(c.size(0))};
  cuuint64_t strides[3] = {0, 0, static_cast<cuuint64_t>(tma_stride(c, 0))};
  cuuint32_t box[4] = {64, 1, 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const int inner = head_outer ? 1 : 2, outer = head_outer ? 2 : 1;  // dims of c
  dims[1] = static_cast<cuuint64_t>(c.size(inner));
  dims[2] = static_cast<cuuint64_t>(c.size(outer));
  strides[0] = static_cast<cuuint64_t>(tma_stride(c, inner));
  strides[1] = static_cast<cuuint64_t>(tma_stride(c, outer));
  box[head_outer ? 1 : 2] = static_cast<cuuint32_t>(rows);
  std::memset(&map, 0, sizeof(map));
  return tensor_map_encoder()(
      &map,
      c.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, c.data_ptr(), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

template <class E, int D>
void launch_combine(const AttnParams& p, cudaStream_t stream) {
  if (p.splits > 1) {
    const unsigned blocks = static_cast<unsigned>((p.rows + kCombineRows - 1) / kCombineRows);
    launch_kernel(combine_kernel<E, D>, blocks, 32 * kCombineRows, 0, stream, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <class E, int D>
void launch_wgmma(const AttnParams& p, const WgMaps& maps, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.hkv),
                  static_cast<unsigned>(p.splits));
  constexpr int smem = WgTile<D>::SMEM;
  C10_CUDA_CHECK(cudaFuncSetAttribute(attn_wgmma_kernel<E, D>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  launch_kernel(attn_wgmma_kernel<E, D>, grid, kWgThreads, smem, stream, p, maps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_combine<E, D>(p, stream);
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
    launch_kernel(attn_f32_kernel<D>, grid, kThreads, smem, stream, p);
  } else {
    constexpr int smem = MmaTile<D>::SMEM;
    if (smem > 48 * 1024) {  // per launch: attributes are per device
      C10_CUDA_CHECK(cudaFuncSetAttribute(attn_mma_kernel<E, D>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    launch_kernel(attn_mma_kernel<E, D>, grid, kThreads, smem, stream, p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_combine<E, D>(p, stream);
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
         const std::optional<at::Tensor>& sinks, int64_t split_keys, at::Tensor& out) {
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
  const at::Tensor q =
      rows_aligned(q_in, {0, 1}) ? q_in : at::empty(q_in.sizes(), q_in.options()).copy_(q_in);
  const bool out_direct = rows_aligned(out, {0, 1});
  at::Tensor o = out_direct ? out : at::empty(q_in.sizes(), q_in.options());

  const int64_t rows = tq * hq;
  const AttnKernel kernel = attn_kernel(q, k_cache, v_cache);
  const bool wgmma = kernel != AttnKernel::kMma;
  const int64_t sms = sm_count(static_cast<int>(q.get_device()));
  // split_keys: one split per split_keys absolute keys of the table's width (checked <= 32);
  // the partial buffer then has no cap: the caller chose it
  const int splits =
      split_keys > 0
          ? static_cast<int>((mb * bs + split_keys - 1) / split_keys)
          : choose_splits(batch * hkv, mb * bs, rows, d, (wgmma ? kWgCtasPerSm : 2) * sms,
                          wgmma);
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
  p.split_keys = split_keys;
  p.rows = static_cast<int>(rows);
  p.div_bs = make_fast_div(bs);
  p.scale2 = static_cast<float>(scale * 1.4426950408889634);
  p.causal = causal;
  p.kv_vec = rows_aligned(k_cache, {0, 1, 2}) && rows_aligned(v_cache, {0, 1, 2});

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  if (wgmma) {
    const bool head_outer = k_cache.stride(2) > k_cache.stride(1);
    WgMaps maps{};
    maps.head_outer = head_outer ? 1 : 0;
    CUresult r = make_kv_map(k_cache, head_outer, maps.k);
    if (r == CUDA_SUCCESS) r = make_kv_map(v_cache, head_outer, maps.v);
    if (r == CUDA_SUCCESS) {
      const bool bf = q.scalar_type() == at::kBFloat16;
      if (d == 64) {
        bf ? launch_wgmma<BF16, 64>(p, maps, stream) : launch_wgmma<F16, 64>(p, maps, stream);
      } else {
        bf ? launch_wgmma<BF16, 128>(p, maps, stream) : launch_wgmma<F16, 128>(p, maps, stream);
      }
      if (!out_direct) out.copy_(o);
      return;
    }
    // the driver refused a tensor map our checks let through: the portable kernel (auto)
    TORCH_CHECK_VALUE(kernel != AttnKernel::kWgmmaForced, "dflash.block_attention: "
                      "DFLASH_OPS_ATTN_KERNEL=wgmma "
                      "but cuTensorMapEncodeTiled refused the caches (error ", static_cast<int>(r),
                      "): k_cache shape ", py_list(k_cache.sizes()), " strides ",
                      py_list(k_cache.strides()), ", v_cache strides ", py_list(v_cache.strides()));
  }
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
                           const std::optional<at::Tensor>& sinks, int64_t split_keys) {
  check_attn("block_attention", q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
             scale, sinks, split_keys, nullptr);
  at::Tensor out = at::empty(q.sizes(), q.options());
  run(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, window, sinks,
      split_keys, out);
  return out;
}

void block_attention_out_(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_table,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          double scale, bool causal, int64_t window,
                          const std::optional<at::Tensor>& sinks, int64_t split_keys,
                          at::Tensor& out) {
  check_attn("block_attention_out_", q, k_cache, v_cache, block_table, seq_lens,
             query_start_loc, scale, sinks, split_keys, &out);
  run(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, causal, window, sinks,
      split_keys, out);
}

}  // namespace dflash_ops

static void register_kernels(torch::Library& m) {
  m.impl("block_attention", TORCH_FN(dflash_ops::block_attention));
  m.impl("block_attention_out_", TORCH_FN(dflash_ops::block_attention_out_));
}
DFLASH_OPS_REGISTER_CUDA(register_kernels)
