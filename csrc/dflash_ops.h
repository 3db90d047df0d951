// dflash_ops: the CUDA kernels of torch.ops.dflash, callable from C++.
//
// The op schemas are defined in Python (dflash_ops/ops/*.py); each csrc/<family>.cu registers
// its functions as the CUDA kernels of those ops (TORCH_LIBRARY_IMPL(dflash, CUDA, m)). C++
// users linking the CMake library `dflash_ops` can call them directly. Every function checks
// its arguments (TORCH_CHECK_VALUE, which Python sees as ValueError) before any kernel runs,
// launches on the current CUDA stream, never synchronises, and is safe inside CUDA-graph
// capture.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace dflash_ops {

// rms_norm(Tensor x, Tensor weight, float eps) -> Tensor
//   x: [..., D] bf16/fp16/fp32, any strides with unit stride in the last dim
//   weight: [D], or [G, D] with x of rank >= 3 [T, *inner, D] (row r of a token's R =
//   prod(inner) rows uses weight[r / (R / G)]); dtype of x
//   returns a new contiguous tensor of x's shape: T(float(T(x * rstd)) * float(w)), HF order
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()
//   in place: residual = T(residual + x); x = rms_norm(residual, weight, eps)
//   residual: x's shape and dtype, its own strides (unit stride in the last dim)
void fused_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps);

// silu_mul(Tensor x) -> Tensor
//   x: [..., 2*I] bf16/fp16/fp32, unit stride in the last dim, leading dims that merge into one
//   strided dim of rows (a row stride >= 2*I: a slice of a wider GEMM output); I >= 1
//   returns a new contiguous [..., I] tensor of x's dtype, bit for bit F.silu(gate) * up with
//   gate = x[..., :I], up = x[..., I:]: T(float(T(silu(float(g)))) * float(u)), expf precise
at::Tensor silu_mul(const at::Tensor& x);

// rope_(Tensor(a!) x, Tensor positions, Tensor cos_sin_cache, bool is_neox) -> ()
//   x: [T, Hx, D] bf16/fp16/fp32, any strides with unit stride in D, D in {16, 32, 64, 128, 256}
//   positions: [T] int64; cos_sin_cache: [P, R] fp32, rows [cos(R/2), sin(R/2)], R even, R <= D
//   in place: the first R dims of every head rotated, NeoX (i, i + R/2) or GPT-J (2i, 2i + 1)
//   pairs, fp32 math; a position outside [0, P) leaves its token unchanged
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
           bool is_neox);

// qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, Tensor positions,
//               Tensor cos_sin_cache, float eps, bool is_neox) -> ()
//   q: [T, Hq, D], k: [T, Hkv, D] (e.g. slices of a fused QKV output), weights [D], dtype of q
//   in place, one launch: per-head RMSNorm (HF rounding) then rope_'s rotation; a position
//   outside [0, P) leaves its token normalised but unrotated
void qk_norm_rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& q_weight,
                   const at::Tensor& k_weight, const at::Tensor& positions,
                   const at::Tensor& cos_sin_cache, double eps, bool is_neox);

// knorm_rope_(Tensor(a!) k, Tensor k_weight, Tensor positions, Tensor cos_sin_cache, float eps,
//             bool is_neox) -> ()
//   k: [T, L, Hkv, D] any strides with unit stride in D (e.g. kv[:, :, 0] of a [T, L, 2, Hkv, D]
//   GEMM output); k_weight: [L, D]; layer l's heads normalised with k_weight[l], then rotated;
//   all layers in one launch
void knorm_rope_(at::Tensor& k, const at::Tensor& k_weight, const at::Tensor& positions,
                 const at::Tensor& cos_sin_cache, double eps, bool is_neox);

// qk_norm_rope_store_(Tensor(a!) q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight,
//                     Tensor positions, Tensor cos_sin_cache, float eps, bool is_neox,
//                     Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping) -> ()
//   q: [T, Hq, D], k, v: [T, Hkv, D] (e.g. slices of a fused QKV output); weights [D] or both
//   None (rope_ instead of the norms); caches [num_blocks, block_size, Hkv, D] any strides;
//   one launch: q as qk_norm_rope_ in place; k's rows normed and rotated into k_cache and v's
//   rows copied into v_cache at slot_mapping[t] (skipped outside [0, num_blocks * block_size));
//   k and v are not written
void qk_norm_rope_store_(at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& q_weight,
                         const std::optional<at::Tensor>& k_weight, const at::Tensor& positions,
                         const at::Tensor& cos_sin_cache, double eps, bool is_neox,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping);

// store_kv_(Tensor k, Tensor v, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches,
//           Tensor slot_mapping) -> ()
//   k, v: [T, L, Hkv, D] any strides with unit stride in D; k_caches, v_caches: L tensors
//   [num_blocks, block_size, Hkv, D] each, any strides with unit stride in D, dtype of k;
//   slot_mapping: [T] int64. Writes token t of layer l to block slot / block_size, row
//   slot % block_size of layer l's caches; a slot < 0 or >= num_blocks * block_size is skipped.
//   One launch for all layers; L <= 64.
void store_kv_(const at::Tensor& k, const at::Tensor& v, at::TensorList k_caches,
               at::TensorList v_caches, const at::Tensor& slot_mapping);

// kv_proj(Tensor x, Tensor w_kv, Tensor? bias=None) -> Tensor
//   x: [T, H] bf16/fp16/fp32; w_kv: [N, H] (layer-major L*2*Hkv*D rows for the context path);
//   bias: [N]; all of x's dtype, any strides. Returns x @ w_kv^T (+ bias) as a new contiguous
//   [T, N] tensor in x's dtype, through cuBLAS (at::mm / at::addmm: fp32 accumulation, one
//   rounding), or at 1-32 rows on sm_90 (bf16 / fp16, H a multiple of 64, aligned rows) our
//   skinny kernel (split-K over a thread-block cluster; fp32 accumulation, one rounding).
//   T, N or H may be 0 (H = 0: the bias broadcast, or zeros).
at::Tensor kv_proj(const at::Tensor& x, const at::Tensor& w_kv,
                   const std::optional<at::Tensor>& bias);

// context_kv_(Tensor x, Tensor w_kv, Tensor? bias, Tensor k_weight, Tensor positions,
//             Tensor cos_sin_cache, Tensor slot_mapping, Tensor(a!)[] k_caches,
//             Tensor(b!)[] v_caches, float eps, bool is_neox,
//             Tensor? hidden_norm_weight=None, bool hidden_rms=False) -> ()
//   The whole context K/V path of L layers: x = rms_norm(x, hidden_norm_weight, eps) when given
//   ([H]); kv = kv_proj(x, w_kv, bias) viewed as [T, L, 2, Hkv, D] (hidden_rms: the norm's
//   weight folded into w_kv by the caller, kv = (x @ w_kv^T) / rms(x_t) + bias; bf16 / fp32 at
//   T <= 256: the epilogue does the scaling and the bias, one launch after the GEMM); then one
//   launch writes, for every token and layer, K = rope(rms_norm(kv[t, l, 0], k_weight[l], eps))
//   (knorm_rope_'s numerics) and V = kv[t, l, 1] to block slot / block_size, row
//   slot % block_size of k_caches[l] / v_caches[l]; a slot < 0 or >= num_blocks * block_size
//   is skipped, a position outside [0, P) leaves K normalised but unrotated.
//   x: [T, H] bf16/fp16/fp32; w_kv: [L*2*Hkv*D, H]; k_weight: [L, D]; positions, slot_mapping:
//   [T] int64; cos_sin_cache: [P, R] fp32, R even, R <= D; k_caches, v_caches: L tensors
//   [num_blocks, block_size, Hkv, D] each, any strides with unit stride in D, x's dtype;
//   D in {16, 32, 64, 128, 256}; L <= 64. Allocates the GEMM output (and the normed x) from the
//   caching allocator.
void context_kv_(const at::Tensor& x, const at::Tensor& w_kv,
                 const std::optional<at::Tensor>& bias, const at::Tensor& k_weight,
                 const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                 const at::Tensor& slot_mapping, at::TensorList k_caches,
                 at::TensorList v_caches, double eps, bool is_neox,
                 const std::optional<at::Tensor>& hidden_norm_weight, bool hidden_rms);

// block_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens,
//                 Tensor query_start_loc, float scale, bool causal=False, int window=-1,
//                 Tensor? sinks=None, int split_keys=0) -> Tensor
//   Attention of each request's block of query tokens over its paged K/V.
//   q: [Tq, Hq, D] bf16/fp16/fp32, any strides with unit stride in D, D in {16, 32, 64, 128,
//   256}; k_cache, v_cache: [num_blocks, block_size, Hkv, D] of q's dtype, any strides with unit
//   stride in D, Hq a multiple of Hkv (query head h reads KV head h / (Hq / Hkv));
//   block_table: [B, M] int32; seq_lens: [B] int32; query_start_loc: [B + 1] int32; sinks: [Hq]
//   fp32 (a per-head logit in the softmax denominator only); scale > 0.
//   Request b owns the rows q[query_start_loc[b]:query_start_loc[b+1]], the last q_len of its
//   seq_lens[b] positions; key j lives in block block_table[b, j / block_size], row
//   j % block_size. causal: a query sees keys <= its position; window > 0: keys with
//   pos - j < window (causal) or |pos - j| < window; window <= 0: no window.
//   Device values are bounds-checked on the device: a block id outside [0, num_blocks) hides its
//   keys, seq_lens is clamped to [0, M * block_size], a query that sees no key gets zeros, and
//   rows outside [query_start_loc[0], query_start_loc[B]) are zeros.
//   Returns a new contiguous [Tq, Hq, D] tensor in q's dtype. fp32 softmax statistics and
//   accumulation; bf16/fp16 run on tensor cores with the probabilities rounded to q's dtype for
//   the P V product. The key range may be split over CTAs (the split count depends on shapes
//   only, so a CUDA graph replays for any lengths); the fp32 partial results and their merge
//   then take a [splits, Tq * Hq, D + 1] fp32 buffer from the caching allocator. split_keys > 0
//   (a multiple of 64): split s is the absolute keys [s * split_keys, (s + 1) * split_keys),
//   ceil(M * block_size / split_keys) splits (at most 32), tiles at absolute key multiples,
//   merged in split order: a row's result does not depend on the rest of the call.
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, bool causal, int64_t window,
                           const std::optional<at::Tensor>& sinks, int64_t split_keys);

// block_attention_out_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table,
//                      Tensor seq_lens, Tensor query_start_loc, float scale, bool causal=False,
//                      int window=-1, Tensor? sinks=None, int split_keys=0, *,
//                      Tensor(a!) out) -> ()
//   block_attention written into out: [Tq, Hq, D] of q's dtype, any strides with unit stride
//   in D (rows not on 16-byte boundaries go through a contiguous copy).
void block_attention_out_(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_table,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          double scale, bool causal, int64_t window,
                          const std::optional<at::Tensor>& sinks, int64_t split_keys,
                          at::Tensor& out);

// grouped_dyn_conv(Tensor x, Tensor dynamic, Tensor base, int group_size, int block_size)
//   -> Tensor
//   x: [T, H] bf16/fp16/fp32, unit stride in H, T whole blocks of block_size rows; dynamic
//   [T, K, H / group_size] (unit stride in its last dim), base [K, H] (unit stride in H), both
//   of x's dtype. Returns a new contiguous [T, H]: y[t, c] = sum over o < K with
//   t % block_size >= o of (base[o, c] + dynamic[t, o, c / group_size]) * x[t - o, c], fp32
//   math, one rounding. DFlash 2's convolution along each block's rows.
at::Tensor grouped_dyn_conv(const at::Tensor& x, const at::Tensor& dynamic,
                            const at::Tensor& base, int64_t group_size, int64_t block_size);

// conv_add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor dynamic, Tensor base, int group_size,
//                    int block_size, Tensor weight, float eps, *, Tensor(b!) out) -> ()
//   grouped_dyn_conv(x, dynamic, base, ...) rounded to x's dtype, added into residual [T, H]
//   (x's dtype, unit stride in H) in place; out [T, H] (unit stride in H, overlapping neither x
//   nor residual) = RMSNorm(residual) * weight (weight [H]), fused_add_rms_norm_'s numerics.
void conv_add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& dynamic,
                        const at::Tensor& base, int64_t group_size, int64_t block_size,
                        const at::Tensor& weight, double eps, at::Tensor& out);

// select_candidates(Tensor unary, Tensor cand, Tensor hidden, Tensor anchor, Tensor pred,
//                   Tensor succ, float temperature, Tensor? u=None) -> (Tensor, Tensor)
//   DFlash 2's selector walk (dflash_ops/ops/select.py): unary [R, J, k] float, cand [R, J, k]
//   int64, hidden [R, J, rank] float, anchor [R] int64, pred / succ [V, rank] one float dtype,
//   u [R, J] fp32 when temperature > 0; all contiguous. Returns path [R, J] int64 and q
//   [R, J, k] fp32. The kernel takes k <= 8 with rank <= 512, k <= 16 with rank <= 256, or
//   k <= 32 with rank <= 128 (else a ValueError naming the shapes).
std::tuple<at::Tensor, at::Tensor> select_candidates(
    const at::Tensor& unary, const at::Tensor& cand, const at::Tensor& hidden,
    const at::Tensor& anchor, const at::Tensor& pred, const at::Tensor& succ,
    double temperature, const std::optional<at::Tensor>& u);

// row_topk(Tensor z, int k) -> (Tensor, Tensor)
//   z [M, V] bf16/fp16/fp32 with unit stride in V, 1 <= k <= min(V, 64): values [M, k] (z's
//   dtype and bits) and indices [M, k] int64 of each row's k largest entries, descending, equal
//   values by ascending index, NaN above +inf (dflash_ops/ops/select.py row_topk_ref).
std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& z, int64_t k);

// row_argmax(Tensor z) -> Tensor
//   [M] int64: the first index of the maximum of each row of z [M, V] (V <= 2^24), NaN above
//   +inf (torch.argmax's answer; dflash_ops/ops/select.py row_argmax_ref).
at::Tensor row_argmax(const at::Tensor& z);

}  // namespace dflash_ops
