// The head-row code of the norm + rotary kernels, shared by rope.cu (rope_, qk_norm_rope_,
// knorm_rope_) and context.cu (context_kv_'s epilogue). Header only.
//
// Numerics, as the references round (T() rounds to the row's dtype):
//   n = T(float(x) * rstd), rstd = rsqrt(mean(float(x)^2) + eps);   y = T(float(n) * float(w))
//   NeoX pairs (y[i], y[i + R/2]), GPT-J pairs (y[2i], y[2i + 1]), i < R/2, c/s = cos/sin row i:
//   (y1 c - y2 s, y2 c + y1 s) in fp32, each product and sum rounded on its own (no FMA
//   contraction: PyTorch computes them as separate ops), rounded once to the dtype.
//   A position outside [0, P) leaves the row unrotated (normalised when the kernel norms).
//
// Layout. A group of tpr lanes holds one head row of D elements, cut into units of 2V elements
// (V = one vector) that hold V rotation pairs at angle indices [uV, uV + V), loaded as two
// vectors a, b:
//   NeoX,  uV <  R/2:  a = x[uV ..],     b = x[R/2 + uV ..]
//                      (matching chunks of the halves)
//   NeoX,  uV >= R/2:  a = x[R + q ..],  b = x[R + (D-R)/2 + q ..], q = uV - R/2
//                      (tail, unrotated)
//   GPT-J:             a = x[2uV ..],    b = x[2uV + V ..]  (pairs adjacent in a vector)
// so both elements of every pair live in one lane: the only shuffles are the norm's sum. Lane
// `lane` of the group holds units j * tpr + lane, j < NU. The units of a row partition it, so
// the same offsets also move a row that is only copied (context_kv_'s V).
// V = 16 bytes of elements on the vector path (NeoX then needs R/2 and (D-R)/2 multiples of V),
// V = 1 on the scalar path (any R, any alignment, any weight stride).
#pragma once

#include "common.cuh"

#include <cstdint>

namespace dflash_ops {
namespace detail {

// ---------------------------------------------------------------------------------------------
// Device side: no framework types.

// The rotary table and the row geometry of one launch.
struct RotaryRow {
  const float* cs;     // cos_sin_cache[P, R], element strides cs_row, cs_col
  int64_t cs_row, cs_col;
  int64_t n_pos;       // P
  int half;            // R / 2
  int rot_dim;         // R
  int tail_half;       // (D - R) / 2
  int units;           // units per row, D / (2 V)
  float inv_d;         // 1 / D
  float eps;
  bool cs_vec4;        // cos/sin rows readable as float4 (unit column stride, 16-byte aligned)
};

// A unit's 2V elements: vector a, then vector b.
template <class Bits, int V>
struct Unit {
  Pack<Bits, V> a, b;
  __device__ __forceinline__ Bits& operator[](int i) { return i < V ? a.e[i] : b.e[i - V]; }
  __device__ __forceinline__ const Bits& operator[](int i) const {
    return i < V ? a.e[i] : b.e[i - V];
  }
};

template <class Bits, int V>
__device__ __forceinline__ Pack<Bits, V> load_vec(const Bits* p) {
  Pack<Bits, V> v;
  v.raw = *reinterpret_cast<const typename Pack<Bits, V>::Raw*>(p);
  return v;
}

// Weights: read-only for the kernel. The scalar path takes any element stride (the caller
// scales the offset); the vector path has unit stride.
template <class Bits, int V>
__device__ __forceinline__ Pack<Bits, V> load_weight(const Bits* p) {
  Pack<Bits, V> v;
  v.raw = __ldg(reinterpret_cast<const typename Pack<Bits, V>::Raw*>(p));
  return v;
}

// This lane's units: element offsets of a and b in the row, first angle index, and whether
// the lane owns the unit (act: a valid row, u < units, and, for a rotation-only kernel
// (whole_row false), a unit with something to rotate).
template <int V, int NU, bool NEOX>
struct LaneUnits {
  int off_a[NU], off_b[NU], ang0[NU];
  bool act[NU];

  __device__ __forceinline__ LaneUnits(const RotaryRow& g, int lane, int tpr, bool valid,
                                       bool whole_row) {
#pragma unroll
    for (int j = 0; j < NU; ++j) {
      const int u = j * tpr + lane;
      ang0[j] = u * V;
      act[j] = valid && u < g.units && (whole_row || ang0[j] < g.half);
      if (NEOX) {
        off_a[j] = ang0[j] < g.half ? ang0[j] : g.rot_dim + (ang0[j] - g.half);
        off_b[j] = off_a[j] + (ang0[j] < g.half ? g.half : g.tail_half);
      } else {
        off_a[j] = 2 * ang0[j];
        off_b[j] = 2 * ang0[j] + V;
      }
    }
  }
};

// cur <- the lane's units of the row at x (zeros where the lane owns none).
template <class Bits, int V, int NU, bool NEOX>
__device__ __forceinline__ void load_units(const Bits* x, const LaneUnits<V, NU, NEOX>& lu,
                                           Unit<Bits, V> (&cur)[NU]) {
#pragma unroll
  for (int j = 0; j < NU; ++j) {
    if (lu.act[j]) {
      cur[j].a = load_vec<Bits, V>(x + lu.off_a[j]);
      cur[j].b = load_vec<Bits, V>(x + lu.off_b[j]);
    } else {
      cur[j].a.raw = typename Pack<Bits, V>::Raw{};
      cur[j].b.raw = typename Pack<Bits, V>::Raw{};
    }
  }
}

// The lane's units written unchanged to the row at y.
template <class Bits, int V, int NU, bool NEOX>
__device__ __forceinline__ void store_units(Bits* y, const LaneUnits<V, NU, NEOX>& lu,
                                            const Unit<Bits, V> (&cur)[NU]) {
#pragma unroll
  for (int j = 0; j < NU; ++j) {
    if (!lu.act[j]) continue;
    *reinterpret_cast<typename Pack<Bits, V>::Raw*>(y + lu.off_a[j]) = cur[j].a.raw;
    *reinterpret_cast<typename Pack<Bits, V>::Raw*>(y + lu.off_b[j]) = cur[j].b.raw;
  }
}

// RMSNorm of the group's row, in place: cur <- T(T(x * rstd) * w), w at element stride w_col
// (1 on the vector path). Full-warp shuffles: every lane of the warp calls this, with the
// same tpr (units a lane does not own hold zeros and add nothing).
template <class E, int V, int NU, bool NEOX>
__device__ __forceinline__ void norm_units(const RotaryRow& g, const LaneUnits<V, NU, NEOX>& lu,
                                           const typename E::Bits* w, int64_t w_col, int tpr,
                                           Unit<typename E::Bits, V> (&cur)[NU]) {
  using Bits = typename E::Bits;
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < NU; ++j) {
#pragma unroll
    for (int k = 0; k < 2 * V; ++k) {
      const float f = E::to_float(cur[j][k]);
      ss = fmaf(f, f, ss);
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1)
    if (m < tpr) ss += __shfl_xor_sync(0xffffffffu, ss, m);  // xor < tpr stays in the group
  const float rstd = rsqrtf(ss * g.inv_d + g.eps);
  // The weights (L1-resident) only now: fewer registers live across the sum.
#pragma unroll
  for (int j = 0; j < NU; ++j) {
    if (!lu.act[j]) continue;
    Unit<Bits, V> wt;
    wt.a = load_weight<Bits, V>(w + lu.off_a[j] * w_col);
    wt.b = load_weight<Bits, V>(w + lu.off_b[j] * w_col);
#pragma unroll
    for (int k = 0; k < 2 * V; ++k) {
      const float n = E::to_float(E::from_float(E::to_float(cur[j][k]) * rstd));
      cur[j][k] = E::from_float(n * E::to_float(wt[k]));
    }
  }
}

// The lane's units rotated at position pos (rot: pos in [0, P); else written unrotated) and
// stored to the row at y. cos/sin are read only now (fewer registers live at once); angles
// >= R/2 are never rotated, so never read.
template <class E, int V, int NU, bool NEOX>
__device__ __forceinline__ void rotate_store_units(const RotaryRow& g,
                                                   const LaneUnits<V, NU, NEOX>& lu, int64_t pos,
                                                   bool rot,
                                                   const Unit<typename E::Bits, V> (&cur)[NU],
                                                   typename E::Bits* y) {
  using Bits = typename E::Bits;
  using P = Pack<Bits, V>;
  const float* cs = g.cs + (rot ? pos : 0) * g.cs_row;
#pragma unroll
  for (int j = 0; j < NU; ++j) {
    if (!lu.act[j]) continue;
    const int ang0 = lu.ang0[j];
    float cv[V], sv[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      cv[k] = 1.f;
      sv[k] = 0.f;
    }
    if (rot) {
      bool done = false;
      if constexpr (V % 4 == 0) {
        if (g.cs_vec4) {
#pragma unroll
          for (int q = 0; q < V; q += 4) {
            if (ang0 + q < g.half) {  // R/2 % 4 == 0 here: 4 angles all in or all out
              const float4 c4 = __ldg(reinterpret_cast<const float4*>(cs + ang0 + q));
              const float4 s4 = __ldg(reinterpret_cast<const float4*>(cs + g.half + ang0 + q));
              cv[q] = c4.x, cv[q + 1] = c4.y, cv[q + 2] = c4.z, cv[q + 3] = c4.w;
              sv[q] = s4.x, sv[q + 1] = s4.y, sv[q + 2] = s4.z, sv[q + 3] = s4.w;
            }
          }
          done = true;
        }
      }
      if (!done) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (ang0 + k < g.half) {
            cv[k] = __ldg(cs + int64_t(ang0 + k) * g.cs_col);
            sv[k] = __ldg(cs + int64_t(g.half + ang0 + k) * g.cs_col);
          }
        }
      }
    }
    Unit<Bits, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {  // pair k: elements i1, i2 of the unit, angle ang0 + k
      const int i1 = NEOX ? k : 2 * k, i2 = NEOX ? V + k : 2 * k + 1;
      if (rot && ang0 + k < g.half) {
        const float f1 = E::to_float(cur[j][i1]), f2 = E::to_float(cur[j][i2]);
        out[i1] = E::from_float(__fsub_rn(__fmul_rn(f1, cv[k]), __fmul_rn(f2, sv[k])));
        out[i2] = E::from_float(__fadd_rn(__fmul_rn(f2, cv[k]), __fmul_rn(f1, sv[k])));
      } else {
        out[i1] = cur[j][i1];
        out[i2] = cur[j][i2];
      }
    }
    *reinterpret_cast<typename P::Raw*>(y + lu.off_a[j]) = out.a.raw;
    *reinterpret_cast<typename P::Raw*>(y + lu.off_b[j]) = out.b.raw;
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The table and geometry for head_dim d; units is left for the caller (it depends on the
// vector width). cos_sin_cache: [P, R] fp32, checked (R even, 0 < R <= d; P may be 0).
inline RotaryRow make_rotary_row(const at::Tensor& cos_sin_cache, int64_t d, double eps) {
  RotaryRow g{};
  const int64_t r = cos_sin_cache.size(1);
  g.half = static_cast<int>(r / 2);
  g.rot_dim = static_cast<int>(r);
  g.tail_half = static_cast<int>((d - r) / 2);
  g.inv_d = static_cast<float>(1.0 / static_cast<double>(d));
  g.eps = static_cast<float>(eps);
  g.cs = cos_sin_cache.data_ptr<float>();
  g.n_pos = cos_sin_cache.size(0);
  g.cs_row = g.n_pos > 1 ? cos_sin_cache.stride(0) : 0;
  g.cs_col = cos_sin_cache.stride(1);
  g.cs_vec4 = g.cs_col == 1 && reinterpret_cast<uintptr_t>(g.cs) % 16 == 0 && g.cs_row % 4 == 0 &&
              g.half % 4 == 0;
  return g;
}

}  // namespace detail
}  // namespace dflash_ops
