// The fused epilogue ops (issue 22): `radd` (residual add) and the row-wise `rmsnorm` with an
// optional FP8 output. The numerics are the simulator's (mscclang/sim/epilogue.py, written in
// docs/semantics.md) bit for bit: every fp32 operation is one IEEE operation rounded to nearest
// even (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn; never a fused multiply-add), and the sum of
// squares follows the fixed order: per group of 8 elements a sequential sum of rounded squares,
// then a pairwise tree over the groups padded with zeros to a power of two. A block reduces one
// row at a time: the groups' partials go to shared memory, then the tree runs stride by stride with
// a barrier between strides, which gives the same order for any thread count.
//
// Only the interpreter's epilogue kernels (EPI = 1, kernels.cu) compile any of this.
#pragma once
#include "primitives.cuh"

#define EPI_W_F32 0        // weight dtype: float32
#define EPI_W_ACT 1        // weight dtype: the activation dtype
#define EPI_Q_NONE 0       // output in the activation dtype
#define EPI_Q_E4M3 1       // output float8_e4m3fn
#define EPI_Q_E5M2 2       // output float8_e5m2
#define EPI_MAX_HIDDEN 65536
#define EPI_MAX_GROUPS (EPI_MAX_HIDDEN / 8)

// The execution parameters of a call (kernel parameter, by value; mscclang.runtime.epilogue packs
// it with the same field order, checked by the generated static_asserts).
struct EpiArgs {
  u64 residual;      // device address of this rank's residual (activation dtype)
  u64 weight;        // device address of the weight row (H elements of the weight dtype)
  u32 hidden;        // H: elements per row, a multiple of 8, 8 <= H <= EPI_MAX_HIDDEN
  u32 wdt;           // EPI_W_*
  u32 quant;         // EPI_Q_*
  float eps;
  float scale;       // FP8 scale s > 0 (quant only): output = Q(y / s) as y * (1 / s)
  u32 pad;
};

// element conversions of the activation dtype (DT_F16, DT_BF16, DT_F32)
template <int DT> __device__ __forceinline__ float epi_ld(const u8* p) {
  if (DT == DT_F32) return *(const float*)p;
  if (DT == DT_F16) return h2f(*(const u16*)p);
  return b2f(*(const u16*)p);
}
template <int DT> __device__ __forceinline__ void epi_st(u8* p, float v) {
  if (DT == DT_F32) *(float*)p = v;
  else if (DT == DT_F16) *(u16*)p = f2h(v);
  else *(u16*)p = f2b(v);
}
// round to the activation dtype and back (y_i is rounded to A before it is quantised)
template <int DT> __device__ __forceinline__ float epi_round(float v) {
  if (DT == DT_F32) return v;
  if (DT == DT_F16) return h2f(f2h(v));
  return b2f(f2b(v));
}

// FP8 of one fp32 value, round to nearest even, saturating to the largest finite value (the
// spec's clamp), NaN stays NaN: cvt.rn.satfinite (sm_89 and later; the host refuses quantised
// calls below, so older architectures never run it).
template <int Q> __device__ __forceinline__ u8 epi_fp8(float v) {
#if __CUDA_ARCH__ >= 890
  u16 r;
  if (Q == EPI_Q_E4M3)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
  else
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
  return (u8)(r & 0xffu);
#else
  __trap();
  return 0;
#endif
}

// the 8 elements of one group (16-byte loads where the group is aligned)
template <int DT> __device__ __forceinline__ void epi_ld8(const u8* q, float* x) {
  constexpr u32 ES = ElemSize<DT>::value;
  if ((((u64)q) & 15u) == 0) {
    const uint4 a = *(const uint4*)q;
    if (ES == 2) {
      const u32 wd[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (u32 i = 0; i < 4u; ++i) {
        x[2 * i] = DT == DT_F16 ? h2f((u16)(wd[i] & 0xffffu)) : b2f((u16)(wd[i] & 0xffffu));
        x[2 * i + 1] = DT == DT_F16 ? h2f((u16)(wd[i] >> 16)) : b2f((u16)(wd[i] >> 16));
      }
    } else {
      const uint4 b = *(const uint4*)(q + 16);
      const u32 wd[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (u32 i = 0; i < 8u; ++i) x[i] = __uint_as_float(wd[i]);
    }
    return;
  }
#pragma unroll
  for (u32 i = 0; i < 8u; ++i) x[i] = epi_ld<DT>(q + i * ES);
}

// r[o] = round_A(f32(src[o]) + f32(r[o])) over [0, len) bytes: the interpreter runs radd as a
// data op with sources (src, r) and destination r (red_word's sum is this very rounding).

// sum of squares of one row (H elements at v) in the spec's order; every thread returns it.
// `part`: shared memory of at least P floats, P = the smallest power of two >= H / 8.
template <int DT>
__device__ float epi_sum_squares(const u8* v, u32 H, float* part) {
  constexpr u32 ES = ElemSize<DT>::value;
  const u32 tid = threadIdx.x, nt = blockDim.x;
  const u32 G = H / 8u;
  u32 P = 1u;
  while (P < G) P <<= 1;
  for (u32 g = tid; g < P; g += nt) {
    float p = 0.0f;
    if (g < G) {
      float x[8];
      epi_ld8<DT>(v + (u64)g * 8u * ES, x);
#pragma unroll
      for (u32 i = 0; i < 8u; ++i) p = __fadd_rn(p, __fmul_rn(x[i], x[i]));
    }
    part[g] = p;
  }
  __syncthreads();
  u32 s = P >> 1;
  for (; s >= 32u; s >>= 1) {
    for (u32 j = tid; j < s; j += nt) part[j] = __fadd_rn(part[j], part[j + s]);
    __syncthreads();
  }
  // the strides below 32 (the same adds in the same order) within the first warp
  if (tid < 32u) {
    const u32 lanes = nt >= 32u ? 0xffffffffu : ((1u << nt) - 1u);
    for (; s >= 1u; s >>= 1) {
      for (u32 j = tid; j < s; j += nt) part[j] = __fadd_rn(part[j], part[j + s]);
      __syncwarp(lanes);
    }
  }
  __syncthreads();
  const float total = part[0];
  __syncthreads();   // every thread has read the total: the next row may overwrite the partials
  return total;
}

// inv = 1 / sqrt(total / H + eps), each step one correctly rounded operation
__device__ __forceinline__ float epi_inv_rms(float total, u32 H, float eps) {
  const float mean = __fdiv_rn(total, (float)H);
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}

// one row: residual row `v` (activation dtype) -> output row `o` (activation dtype, or FP8 Q)
template <int DT, int W, int Q>
__device__ void epi_norm_row(const u8* v, u8* o, const u8* w, u32 H, float eps, float sinv, float* part) {
  constexpr u32 ES = ElemSize<DT>::value;
  const float inv = epi_inv_rms(epi_sum_squares<DT>(v, H, part), H, eps);
  for (u32 i = threadIdx.x; i < H; i += blockDim.x) {
    const float x = epi_ld<DT>(v + (u64)i * ES);
    const float wi = W == EPI_W_F32 ? ((const float*)w)[i] : epi_ld<DT>(w + (u64)i * ES);
    const float y = __fmul_rn(__fmul_rn(x, inv), wi);
    if (Q == EPI_Q_NONE)
      epi_st<DT>(o + (u64)i * ES, y);
    else
      o[i] = epi_fp8<Q>(__fmul_rn(epi_round<DT>(y), sinv));
  }
}

// The rows of one rmsnorm record: pieces of (length, valid, residual offset, output offset), the
// offsets and lengths in the activation dtype's bytes and on whole rows (checked by the host at
// the call). Row k of the residual goes to row k of the output, whose rows are H elements of the
// output dtype (FP8: one byte each).
template <int DT, int W, int Q>
__device__ void epi_norm_rows(const u8* res, u8* out, const EpiArgs& e, const u64* pc, u32 n_pieces,
                              float* part) {
  constexpr u32 ES = ElemSize<DT>::value;
  const u32 H = e.hidden;
  const u64 row = (u64)H * ES;
  const u64 orow = Q == EPI_Q_NONE ? row : (u64)H;
  const float sinv = Q == EPI_Q_NONE ? 1.0f : __fdiv_rn(1.0f, e.scale);
  const u8* w = (const u8*)e.weight;
  for (u32 i = 0; i < n_pieces; ++i, pc += 4) {
    const u64 rows = pc[0] / row;
    for (u64 k = 0; k < rows; ++k)
      epi_norm_row<DT, W, Q>(res + pc[2] + k * row, out + (pc[3] / row + k) * orow, w, H, e.eps, sinv, part);
  }
}

template <int DT>
__device__ void epi_rmsnorm(const u8* res, u8* out, const EpiArgs& e, const u64* pc, u32 n_pieces) {
  __shared__ float part[EPI_MAX_GROUPS];   // one array per kernel, whichever instantiation runs
  if (e.wdt == EPI_W_F32) {
    if (e.quant == EPI_Q_NONE) epi_norm_rows<DT, EPI_W_F32, EPI_Q_NONE>(res, out, e, pc, n_pieces, part);
    else if (e.quant == EPI_Q_E4M3) epi_norm_rows<DT, EPI_W_F32, EPI_Q_E4M3>(res, out, e, pc, n_pieces, part);
    else epi_norm_rows<DT, EPI_W_F32, EPI_Q_E5M2>(res, out, e, pc, n_pieces, part);
  } else {
    if (e.quant == EPI_Q_NONE) epi_norm_rows<DT, EPI_W_ACT, EPI_Q_NONE>(res, out, e, pc, n_pieces, part);
    else if (e.quant == EPI_Q_E4M3) epi_norm_rows<DT, EPI_W_ACT, EPI_Q_E4M3>(res, out, e, pc, n_pieces, part);
    else epi_norm_rows<DT, EPI_W_ACT, EPI_Q_E5M2>(res, out, e, pc, n_pieces, part);
  }
}
