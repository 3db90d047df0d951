// Argument checks of the C++ launchers, in the words of dflash_ops/ops/_checks.py: each raises
// ValueError (TORCH_CHECK_VALUE) as "dflash.<op>: <arg> must ..., got ...", before any kernel runs.
// The launchers check what the kernels rely on: dtype, rank, device, and the sizes and strides
// they index with, of every tensor whose data pointer they take. Host only.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>

namespace dflash_ops {
namespace detail {

// ---------------------------------------------------------------------------------------------
// Python's words for values.

// Python's name of a dtype (torch.int64 -> "int64"); c10's for those not listed.
inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

// Python's repr of a tuple / list of ints: (5, 64), (5,), [5, 64].
inline std::string py_tuple(c10::IntArrayRef v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << (v.size() == 1 ? ",)" : ")");
  return s.str();
}
inline std::string py_list(c10::IntArrayRef v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}

// Python's repr of a float, near enough: the shortest round-tripping %g, and "-1.0" not "-1".
inline std::string py_float(double v) {
  std::string s;
  for (int prec = 1; prec <= 17; ++prec) {
    std::ostringstream o;
    o.precision(prec);
    o << v;
    s = o.str();
    if (std::strtod(s.c_str(), nullptr) == v) break;
  }
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

// An argument's name in a message: "k", or element i of a list argument, "k_caches[i]".
// Formatted only when a check fails.
struct Arg {
  const char* name;
  int64_t index = -1;
  Arg(const char* n, int64_t i = -1) : name(n), index(i) {}  // NOLINT: implicit from a name
};
inline std::ostream& operator<<(std::ostream& os, const Arg& a) {
  os << a.name;
  if (a.index >= 0) os << "[" << a.index << "]";
  return os;
}

inline bool is_float(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

// Unit stride in the last dim, as the Python checks: no element past the first is strided.
inline bool last_dim_ok(const at::Tensor& t) {
  return t.numel() == 0 || t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1;
}

// ---------------------------------------------------------------------------------------------
// One property of one tensor.

// The op's first tensor: the device every other tensor must be on.
inline void check_cuda(const char* op, const Arg& name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cuda(), "dflash.", op, ": ", name, " must be a CUDA tensor, got device ",
                    t.device());
}

inline void check_device(const char* op, const Arg& name, const at::Tensor& t,
                         const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, "dflash.", op, ": ", name, " must be on ", device,
                    ", got ", t.device());
}

inline void check_rank(const char* op, const Arg& name, const at::Tensor& t, int64_t rank) {
  TORCH_CHECK_VALUE(t.dim() == rank, "dflash.", op, ": ", name, " must have rank ", rank,
                    ", got rank ", t.dim(), " (shape ", py_tuple(t.sizes()), ")");
}

inline void check_dtype(const char* op, const Arg& name, const at::Tensor& t,
                        at::ScalarType want) {
  TORCH_CHECK_VALUE(t.scalar_type() == want, "dflash.", op, ": ", name, " must be ",
                    dtype_name(want), ", got ", dtype_name(t.scalar_type()));
}

// bf16 / fp16 / fp32: the element types the kernels are built for.
inline void check_float(const char* op, const Arg& name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(is_float(t.scalar_type()), "dflash.", op, ": ", name,
                    " must be bfloat16/float16/float32, got ", dtype_name(t.scalar_type()));
}

inline void check_same_dtype(const char* op, const Arg& name, const at::Tensor& t,
                             const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), "dflash.", op, ": ", name,
                    " must have the dtype of ", ref_name, " (", dtype_name(ref.scalar_type()),
                    "), got ", dtype_name(t.scalar_type()));
}

inline void check_shape(const char* op, const Arg& name, const at::Tensor& t,
                        c10::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.sizes() == shape, "dflash.", op, ": ", name, " must have shape ",
                    py_list(shape), ", got ", py_list(t.sizes()));
}

inline void check_last_dim(const char* op, const Arg& name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(last_dim_ok(t), "dflash.", op, ": ", name,
                    " must have unit stride in its last dimension, got strides ",
                    py_tuple(t.strides()));
}

// The head sizes the kernels are instantiated for.
inline void check_head_dim(const char* op, const Arg& name, int64_t d) {
  TORCH_CHECK_VALUE(d == 16 || d == 32 || d == 64 || d == 128 || d == 256, "dflash.", op, ": ",
                    name, " head_dim must be one of [16, 32, 64, 128, 256], got ", d);
}

// _checks.no_overlap: t (written) and other share no bytes (same device).
inline std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t last = 0, neg = 0;
  for (int64_t i = 0; i < t.dim(); ++i) {
    const int64_t st = t.stride(i), ext = (t.size(i) - 1) * (st < 0 ? -st : st);
    last += ext;
    if (st < 0) neg += ext;
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr()) - neg * t.element_size();
  return {start, start + (last + 1) * t.element_size()};
}

inline void check_no_overlap(const char* op, const char* name, const at::Tensor& t,
                             const char* other_name, const at::Tensor& other) {
  if (t.device() != other.device()) return;
  const auto a = byte_span(t), b = byte_span(other);
  TORCH_CHECK_VALUE(!(a.first < b.second && b.first < a.second), "dflash.", op, ": ", name,
                    " must not overlap ", other_name, " (a kernel writes ", name,
                    " while it reads ", other_name, ")");
}

inline void check_eps(const char* op, double eps) {
  TORCH_CHECK_VALUE(eps >= 0.0, "dflash.", op, ": eps must be >= 0, got ", py_float(eps));
}

// ---------------------------------------------------------------------------------------------
// The arguments several ops share.

// _checks.index_vector: [n] int64 (positions, slot_mapping: one entry per token).
inline void check_index_vector(const char* op, const Arg& name, const at::Tensor& t, int64_t n,
                               const at::Device& device) {
  check_rank(op, name, t, 1);
  check_dtype(op, name, t, at::kLong);
  check_device(op, name, t, device);
  TORCH_CHECK_VALUE(t.size(0) == n, "dflash.", op, ": ", name, " must have ", n,
                    " entries (one per token), got ", t.size(0));
}

// _checks.cos_sin_cache: [P, R] fp32 with R even, 0 < R <= head_dim d (the kernels read
// R / 2 cos and R / 2 sin values of a row and rotate the first R dims). P = 0 is left to the
// kernels: every position is then outside [0, P), so no row of the table is read.
inline void check_cos_sin_cache(const char* op, const at::Tensor& cache, int64_t d,
                                const at::Device& device) {
  check_rank(op, "cos_sin_cache", cache, 2);
  check_dtype(op, "cos_sin_cache", cache, at::kFloat);
  check_device(op, "cos_sin_cache", cache, device);
  const int64_t r = cache.size(1);
  TORCH_CHECK_VALUE(r % 2 == 0 && r > 0 && r <= d, "dflash.", op,
                    ": cos_sin_cache must have an even number of columns R with 0 < R <= "
                    "head_dim (", d, "), got R = ", r);
}

// One paged cache [num_blocks, block_size, Hkv, D]: rank 4, the dtype and device of ref (the
// tensor whose rows it receives), unit stride in D.
inline void check_cache(const char* op, const Arg& name, const at::Tensor& c,
                        const at::Tensor& ref) {
  check_rank(op, name, c, 4);
  check_dtype(op, name, c, ref.scalar_type());
  check_device(op, name, c, ref.device());
  check_last_dim(op, name, c);
}

// _checks.caches: n_layers caches [num_blocks, block_size, hkv, d] of one shape, each checked
// as check_cache (any strides, unit stride in D).
inline void check_caches(const char* op, const char* name, at::TensorList caches,
                         int64_t n_layers, int64_t hkv, int64_t d, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(caches.size()) == n_layers, "dflash.", op, ": ", name,
                    " must hold one cache per layer (", n_layers, "), got ", caches.size());
  for (size_t i = 0; i < caches.size(); ++i) {
    const at::Tensor& c = caches[i];
    const Arg ci(name, static_cast<int64_t>(i));
    check_cache(op, ci, c, ref);
    TORCH_CHECK_VALUE(c.size(2) == hkv && c.size(3) == d, "dflash.", op, ": ", ci,
                      " must have shape [num_blocks, block_size, ", hkv, ", ", d,
                      "] (Hkv, D), got ", py_list(c.sizes()));
    TORCH_CHECK_VALUE(i == 0 || c.sizes() == caches[0].sizes(), "dflash.", op, ": ", ci,
                      " has shape ", py_list(c.sizes()), " but ", name, "[0] has ",
                      py_list(caches[0].sizes()));
  }
}

// K and V caches of one [num_blocks, block_size]: a slot indexes both.
inline void check_cache_blocks(const char* op, at::TensorList k_caches, at::TensorList v_caches) {
  TORCH_CHECK_VALUE(k_caches[0].sizes().slice(0, 2) == v_caches[0].sizes().slice(0, 2),
                    "dflash.", op, ": v_caches must have the [num_blocks, block_size] of "
                    "k_caches ", py_list(k_caches[0].sizes().slice(0, 2)), ", got ",
                    py_list(v_caches[0].sizes().slice(0, 2)));
}

// The layers one launch takes (their cache views travel in the kernel parameters).
inline void check_max_layers(const char* op, const char* name, int64_t n_layers, int64_t max) {
  TORCH_CHECK_VALUE(n_layers <= max, "dflash.", op, ": ", name, " has L = ", n_layers,
                    " layers; one call writes at most ", max, " (split the call over layers)");
}

}  // namespace detail
}  // namespace dflash_ops
