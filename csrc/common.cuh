// Helpers shared by the kernels of csrc/: element types, vector packs, multiply-shift division,
// the paged-cache view. The argument checks are in checks.h. Header only; the build compiles
// csrc/*.cu and csrc/*.cpp, never this file on its own.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <utility>

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

// The sum over the warp (a butterfly: every lane gets it, in the same order on every lane).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
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

// Programmatic dependent launch (PDL): a kernel started by launch_kernel() below on sm_90+ may
// begin while the grid before it in the stream drains; every kernel calls this first, so it
// waits for that grid (complete, its writes visible) before any global load or store. A no-op
// when the kernel was not launched as a dependent, and before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the grid after this one (a programmatic dependent) begin launching once every CTA of
// this grid has called it or exited: its CTAs run their prologue and wait in pdl_wait(), which
// still waits for this whole grid to complete and its writes to be visible. Repeated calls do
// nothing; a no-op without PDL and before sm_90.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// One layer's paged K or V cache (kv.cu, context.cu): base pointer and byte strides of
// [num_blocks, block_size, Hkv].
struct CacheView {
  char* base;
  int64_t s_block, s_row, s_head;
};

// ---------------------------------------------------------------------------------------------
// Host side.

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

static __global__ void pdl_probe_kernel() { pdl_wait(); }

// Whether the kernels of this binary run code compiled for sm_90+ on the current device (a
// build whose device code is older PTX, JIT-compiled for the GPU, has kernels compiled for
// that older architecture: no griddepcontrol, no clusters). Asked once a device of
// pdl_probe_kernel (static: one a translation unit, all built with the same architectures); a
// failed query is asked again.
inline bool sm90_code() {
  static std::array<std::atomic<int>, 64> known{};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  int v = known[dev].load();
  if (v == 0) {
    cudaFuncAttributes a{};
    int major = 0;
    if (cudaFuncGetAttributes(&a, pdl_probe_kernel) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      return false;  // no answer (the error is left for the caller's checks): ask again later
    }
    v = (major >= 9 && a.ptxVersion >= 90) ? 1 : 2;
    known[dev].store(v);
  }
  return v == 1;
}

// Whether launch_kernel() makes programmatic dependents on the current device: sm90_code()
// (so pdl_wait() holds the wait), unless DFLASH_OPS_PDL=0 (read once a process; the Triton
// kernels read it at each launch: set it before the first call).
inline bool pdl_enabled() {
  static const bool env_on = [] {
    const char* v = std::getenv("DFLASH_OPS_PDL");
    return !(v != nullptr && v[0] == '0' && v[1] == '\0');
  }();
  return env_on && sm90_code();
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the grid
// before it where pdl_enabled() (the kernel must call pdl_wait() first). Launch errors are
// left for C10_CUDA_KERNEL_LAUNCH_CHECK, as with <<<>>>.
template <class... KArgs, class... Args>
inline void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  if (!pdl_enabled()) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace detail
}  // namespace dflash_ops
