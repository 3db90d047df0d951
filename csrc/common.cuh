// Helpers shared by the kernels of csrc/ (norm.cu, rope.cu, kv.cu): element types, vector packs,
// multiply-shift division, and the host-side naming / stride helpers of the argument checks.
// Header only; the build compiles csrc/*.cu and csrc/*.cpp, never this file on its own.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <sstream>
#include <string>

namespace dflash_ops {
namespace detail {

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

// Element types are moved as raw bits and converted explicitly (torch builds with
// __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__).
struct BF16 {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_float(Bits b) {
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
  }
  static __device__ __forceinline__ Bits from_float(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};
struct F16 {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_float(Bits b) {
    return __half2float(__ushort_as_half(b));
  }
  static __device__ __forceinline__ Bits from_float(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
};
struct F32 {
  using Bits = uint32_t;
  static __device__ __forceinline__ float to_float(Bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ Bits from_float(float f) { return __float_as_uint(f); }
};

template <int BYTES> struct RawOf;
template <> struct RawOf<16> { using type = uint4; };
template <> struct RawOf<8> { using type = uint2; };
template <> struct RawOf<4> { using type = uint32_t; };
template <> struct RawOf<2> { using type = uint16_t; };

// N elements moved as one load/store of N * sizeof(Bits) bytes.
template <class Bits, int N>
union Pack {
  using Raw = typename RawOf<static_cast<int>(sizeof(Bits)) * N>::type;
  Raw raw;
  Bits e[N];
};

template <class P>
__device__ __forceinline__ P load_pack(const void* p) {
  P v;
  v.raw = *reinterpret_cast<const typename P::Raw*>(p);
  return v;
}
template <class P>
__device__ __forceinline__ P load_pack_ro(const void* p) {  // read-only for the whole kernel
  P v;
  v.raw = __ldg(reinterpret_cast<const typename P::Raw*>(p));
  return v;
}
template <class P>
__device__ __forceinline__ void store_pack(void* p, const P& v) {
  *reinterpret_cast<typename P::Raw*>(p) = v.raw;
}
template <class P>
__device__ __forceinline__ P zero_pack() {
  P v;
  v.raw = typename P::Raw{};
  return v;
}

// n / d for n < 2^31, 1 <= d < 2^31 by a multiply and a shift (Granlund-Montgomery round-up
// method: s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1, n / d = (mulhi(m, n) + n) >> s;
// mulhi(m, n) < n, so the sum fits in 32 bits for n < 2^31).
struct FastDiv {
  uint32_t d = 1, m = 1, s = 0;
  __host__ __device__ __forceinline__ uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    return (__umulhi(n, m) + n) >> s;
#else
    return (static_cast<uint32_t>((uint64_t{n} * m) >> 32) + n) >> s;
#endif
  }
};

inline FastDiv make_fast_div(int64_t d) {
  FastDiv f;
  f.d = static_cast<uint32_t>(d);
  f.s = 0;
  while ((uint64_t{1} << f.s) < f.d) ++f.s;
  f.m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.s) - f.d)) / f.d + 1);
  return f;
}

// ---------------------------------------------------------------------------------------------
// Host side: the words of dflash_ops/ops/_checks.py.

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

// norm.cu's messages: Python's name for the floating dtypes only, c10's for the rest
// (torch.int64 -> "Long", not "int64"). Kept apart from dtype_name so those messages stay as
// they are.
inline const char* float_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
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

inline bool is_float(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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

inline void check_rank(const char* op, const std::string& name, const at::Tensor& t,
                       int64_t rank) {
  TORCH_CHECK_VALUE(t.dim() == rank, "dflash.", op, ": ", name, " must have rank ", rank,
                    ", got rank ", t.dim(), " (shape ", py_tuple(t.sizes()), ")");
}

inline void check_device(const char* op, const std::string& name, const at::Tensor& t,
                         const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, "dflash.", op, ": ", name, " must be on ", device,
                    ", got ", t.device());
}

inline void check_shape(const char* op, const std::string& name, const at::Tensor& t,
                        c10::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.sizes() == shape, "dflash.", op, ": ", name, " must have shape ",
                    py_list(shape), ", got ", py_list(t.sizes()));
}

inline void check_same_dtype(const char* op, const std::string& name, const at::Tensor& t,
                             const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), "dflash.", op, ": ", name,
                    " must have the dtype of ", ref_name, " (", dtype_name(ref.scalar_type()),
                    "), got ", dtype_name(t.scalar_type()));
}

inline bool last_dim_ok(const at::Tensor& t) {  // as the Python checks: unit stride unless D <= 1
  return t.numel() == 0 || t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1;
}

}  // namespace detail
}  // namespace dflash_ops
