// Building blocks of the plan-specialised kernels (design §5). mscclang.runtime.specialize
// generates one kernel per (plan, rank, sizes, dtype, packet type, reduce op): each block's ops as
// straight-line code calling the templates below with every length, unit count, loop bound and
// operand offset a compile-time constant. The protocol is the interpreter's: flags in device
// memory advanced by the kernel, double scratch picked by flag parity, bounded spins, error record
// and abort words (primitives.cuh). Both kernels can serve the same context, launch by launch.
//
// Preconditions the generator and the runtime guarantee:
// * every buffer base (input, output, scratch half, peers' bases + deltas) is 16-byte aligned;
// * the operand pointers p[k] already hold base + offset (x2 for packet operands);
// * packet operands are aligned to the packet size (the runtime checks packet_align);
// * sp_packets: every unit whole and valid (P payload bytes) and plain operands aligned to the
//   payload's vector (8 bytes for LL16, 4 for LL8); other units go through sp_packets_generic.
//
// GATE (first data op of a block only): the kernel loaded the abort word together with the flag;
// the op issues its loads, then gives up before its first store when a peer or an earlier launch
// aborted, so checking the abort word costs no extra latency before data moves.
#pragma once
#include "interpreter.cuh"

// plain units of V bytes: 16 (uint4), 4 (one word of whole elements), 2 (one 16-bit element) or
// 1 (one fp8 element)
template <int V> struct SpUnit;
template <> struct SpUnit<16> { typedef uint4 T; };
template <> struct SpUnit<4> { typedef u32 T; };
template <> struct SpUnit<2> { typedef u16 T; };
template <> struct SpUnit<1> { typedef u8 T; };

// x[0..NS) reduced in order (the interpreter's Red: fp8 accumulates wide and rounds once)
template <int DT, int OP, int NS> __device__ __forceinline__ uint4 sp_red(const uint4* x) {
  if constexpr (NS == 1) {
    return x[0];
  } else {
    Red16<DT, OP> a;
    a.first(x[0], x[1]);
#pragma unroll
    for (int k = 2; k < NS; ++k) a.add(x[k]);
    return a.out();
  }
}
template <int DT, int OP, int NS> __device__ __forceinline__ u32 sp_red(const u32* x) {
  if constexpr (NS == 1) {
    return x[0];
  } else {
    typedef Red<DT, OP> R;
    typename R::A a = R::first(x[0], x[1]);
#pragma unroll
    for (int k = 2; k < NS; ++k) R::add(a, x[k]);
    return R::out(a);
  }
}
template <int DT, int OP, int NS> __device__ __forceinline__ u16 sp_red(const u16* x) {
  u16 a = x[0];
#pragma unroll
  for (int k = 1; k < NS; ++k) a = red_half<DT, OP>(a, x[k]);
  return a;
}
template <int DT, int OP, int NS> __device__ __forceinline__ u8 sp_red(const u8* x) {
  u32 w[NS];
#pragma unroll
  for (int k = 0; k < NS; ++k) w[k] = x[k];
  return (u8)sp_red<DT, OP, NS>((const u32*)w);
}

// Loads a plain unit. GATE: through volatile asm, so the compiler cannot sink the load below the
// abort check that follows it (the load must be in flight while the abort word arrives).
template <bool GATE, class T> __device__ __forceinline__ T sp_ld(const T* a);
template <> __device__ __forceinline__ uint4 sp_ld<false, uint4>(const uint4* a) { return *a; }
template <> __device__ __forceinline__ u32 sp_ld<false, u32>(const u32* a) { return *a; }
template <> __device__ __forceinline__ u16 sp_ld<false, u16>(const u16* a) { return *a; }
template <> __device__ __forceinline__ uint2 sp_ld<false, uint2>(const uint2* a) { return *a; }
template <> __device__ __forceinline__ u8 sp_ld<false, u8>(const u8* a) { return *a; }
template <> __device__ __forceinline__ u8 sp_ld<true, u8>(const u8* a) {
  u16 v;
  asm volatile("ld.global.u8 %0, [%1];" : "=h"(v) : "l"(a));
  return (u8)v;
}
template <> __device__ __forceinline__ uint4 sp_ld<true, uint4>(const uint4* a) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  return v;
}
template <> __device__ __forceinline__ uint2 sp_ld<true, uint2>(const uint2* a) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(a));
  return v;
}
template <> __device__ __forceinline__ u32 sp_ld<true, u32>(const u32* a) {
  u32 v;
  asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(a));
  return v;
}
template <> __device__ __forceinline__ u16 sp_ld<true, u16>(const u16* a) {
  u16 v;
  asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(a));
  return v;
}

// One round of a plain range: units u0 + j NT (j < U) that are below N.
template <int DT, int OP, int NS, int ND, int NT, int U, int V, u32 N, bool GATE>
__device__ __forceinline__ bool sp_plain_round(u8* const* p, u32 stop, u32 u0) {
  typedef SpUnit<V> SU;
  typedef typename SU::T T;
  T v[NS][U];
#pragma unroll
  for (int k = 0; k < NS; ++k)
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const u32 u = u0 + (u32)j * NT;
      if (j == 0 || u < N) v[k][j] = sp_ld<GATE>((const T*)p[k] + u);
    }
  if (GATE && stop) return false;
#pragma unroll
  for (int j = 0; j < U; ++j) {
    T x[NS];
#pragma unroll
    for (int k = 0; k < NS; ++k) x[k] = v[k][j];
    v[0][j] = sp_red<DT, OP, NS>(x);
  }
#pragma unroll
  for (int k = 0; k < ND; ++k)
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const u32 u = u0 + (u32)j * NT;
      if (j == 0 || u < N) ((T*)p[NS + k])[u] = v[0][j];
    }
  return true;
}

// Plain range of N units of V bytes: sources p[0..NS) reduced in order into every destination
// p[NS..NS+ND). U units per thread in flight (unit u and u + NT, u + 2 NT, ...); no loop when one
// round covers the range.
template <int DT, int OP, int NS, int ND, int NT, int U, int V, u32 N, bool GATE>
__device__ __forceinline__ bool sp_plain(u8* const* p, u32 stop) {
  const u32 tid = threadIdx.x;
  if constexpr (N <= (u32)U * NT) {
    if (tid < N) return sp_plain_round<DT, OP, NS, ND, NT, U, V, N, GATE>(p, stop, tid);
    return true;
  } else {
#pragma unroll 1
    for (u32 u0 = tid; u0 < N; u0 += (u32)U * NT)
      if (!sp_plain_round<DT, OP, NS, ND, NT, U, V, N, GATE>(p, stop, u0)) return false;
    return true;
  }
}

// payload words of a plain operand at unit u (aligned, whole unit)
template <int PKT, bool GATE>
__device__ __forceinline__ void sp_plain_load(const u8* a, u32 u, u32* w) {
  if (PKT == 16) {
    const uint2 x = sp_ld<GATE>((const uint2*)a + u);
    w[0] = x.x;
    w[PKT == 16 ? 1 : 0] = x.y;
  } else {
    w[0] = sp_ld<GATE>((const u32*)a + u);
  }
}
template <int PKT>
__device__ __forceinline__ void sp_plain_store(u8* a, u32 u, const u32* w) {
  if (PKT == 16)
    ((uint2*)a)[u] = make_uint2(w[0], w[PKT == 16 ? 1 : 0]);
  else
    ((u32*)a)[u] = w[0];
}

// One round of a packet range of N whole, valid units (P payload bytes each): units u0 + j NT
// (j < U); units past N are clamped to N - 1 (loaded, never stored). Operand k holds packets when
// bit k of PMASK is set. Every load of the round (U units x NS sources) is issued before the first
// flag check.
template <int DT, int OP, int PKT, int NT, int U, int NS, int ND, u32 PMASK, u32 N, bool GATE, class C>
__device__ __forceinline__ bool sp_packets_round(const C& c, int opi, u8* const* p, u32 flag, u32 stop, u32 u0) {
  typedef Packet<PKT> Pk;
  constexpr u32 P = Pk::kPayload;
  constexpr u32 W = Pk::kWords;
  u32 w[NS][U][W];
  bool ok[NS][U];
  u32 uc[U];
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const u32 u = u0 + (u32)j * NT;
    uc[j] = (j == 0 || u < N) ? u : N - 1;
  }
#pragma unroll
  for (int k = 0; k < NS; ++k)
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (PMASK >> k & 1u) {
        ok[k][j] = Pk::load(p[k] + 2ull * P * uc[j], w[k][j], flag);
      } else {
        ok[k][j] = true;
        sp_plain_load<PKT, GATE>(p[k], uc[j], w[k][j]);
      }
    }
  if (GATE && stop) return false;
#pragma unroll
  for (int k = 0; k < NS; ++k) {
    if (PMASK >> k & 1u) {
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (!ok[k][j] && (j == 0 || u0 + (u32)j * NT < N)) {
          Spin s(opi);
          while (!Pk::load(p[k] + 2ull * P * uc[j], w[k][j], flag)) {
            if (s.tick(c, WHAT_PACKET, -1, flag, 0)) return false;
          }
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < U; ++j)
#pragma unroll
    for (u32 i = 0; i < W; ++i) {
      u32 x[NS];
#pragma unroll
      for (int k = 0; k < NS; ++k) x[k] = w[k][j][i];
      w[0][j][i] = sp_red<DT, OP, NS>(x);
    }
#pragma unroll
  for (int k = 0; k < ND; ++k)
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (j == 0 || u0 + (u32)j * NT < N) {
        if (PMASK >> (NS + k) & 1u)
          Pk::store(p[NS + k] + 2ull * P * uc[j], w[0][j], flag);
        else
          sp_plain_store<PKT>(p[NS + k], uc[j], w[0][j]);
      }
    }
  return true;
}

// Packet range of N whole, valid units, U per thread per round; no loop when one round covers it.
template <int DT, int OP, int PKT, int NT, int U, int NS, int ND, u32 PMASK, u32 N, bool GATE, class C>
__device__ __forceinline__ bool sp_packets(const C& c, int opi, u8* const* p, u32 flag, u32 stop) {
  const u32 tid = threadIdx.x;
  if constexpr (N <= (u32)U * NT) {
    if (tid < N) return sp_packets_round<DT, OP, PKT, NT, U, NS, ND, PMASK, N, GATE>(c, opi, p, flag, stop, tid);
    return true;
  } else {
#pragma unroll 1
    for (u32 u0 = tid; u0 < N; u0 += (u32)U * NT)
      if (!sp_packets_round<DT, OP, PKT, NT, U, NS, ND, PMASK, N, GATE>(c, opi, p, flag, stop, u0)) return false;
    return true;
  }
}

// Packet range, any units: units [U0, U1) of a range of LEN bytes whose first VALID bytes come
// from the plain sources (the rest reads as zero; plain destinations get only valid bytes). Plain
// operands may have any alignment. Used for clipped chunks' last units and misaligned operands.
template <int DT, int OP, int PKT, int NT, int NS, int ND, u32 PMASK, u64 U0, u64 U1, u64 LEN, u64 VALID,
          bool GATE, class C>
__device__ __forceinline__ bool sp_packets_generic(const C& c, int opi, u8* const* p, u32 flag, u32 stop) {
  typedef Packet<PKT> Pk;
  constexpr u32 P = Pk::kPayload;
  constexpr u32 W = Pk::kWords;
#pragma unroll 1
  for (u64 u = U0 + threadIdx.x; u < U1; u += NT) {
    const u64 o = u * P;
    const u32 nb = (u32)((LEN - o) < P ? (LEN - o) : P);
    const u32 vb = VALID > o ? (u32)((VALID - o) < nb ? (VALID - o) : nb) : 0u;
    u32 w[NS][W];
    bool ok[NS];
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      if (PMASK >> k & 1u) {
        ok[k] = Pk::load(p[k] + 2ull * o, w[k], flag);
      } else {
        ok[k] = true;
        plain_payload<DT, PKT>(p[k] + o, vb, w[k]);
      }
    }
    if (GATE && stop) return false;
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      if ((PMASK >> k & 1u) && !ok[k]) {
        Spin s(opi);
        while (!Pk::load(p[k] + 2ull * o, w[k], flag)) {
          if (s.tick(c, WHAT_PACKET, -1, flag, 0)) return false;
        }
      }
    }
#pragma unroll
    for (u32 i = 0; i < W; ++i) {
      u32 x[NS];
#pragma unroll
      for (int k = 0; k < NS; ++k) x[k] = w[k][i];
      w[0][i] = sp_red<DT, OP, NS>(x);
    }
#pragma unroll
    for (int k = 0; k < ND; ++k) {
      if (PMASK >> (NS + k) & 1u)
        Pk::store(p[NS + k] + 2ull * o, w[0], flag);
      else
        plain_store_payload<DT, PKT>(p[NS + k] + o, vb, w[0]);
    }
  }
  return true;
}

// Flag epilogue: this block's flag advances (block 0 also the slots from NB to MSCCLANG_MAX_FLAGS,
// with 16-byte stores where aligned). No barrier: the next launch reads the flags.
template <int NT, u32 NB>
__device__ __forceinline__ void sp_advance_flags(u32* flags, u32 flag) {
  u32 next = flag + 1u;
  if (next == 0u) next = 1u;
  const u32 tid = threadIdx.x;
  if (tid == 0) flags[blockIdx.x] = next;
  if (blockIdx.x == 0) {
    constexpr u32 A = (NB + 3u) & ~3u;  // first 4-aligned slot at or after NB
    for (u32 s = NB + tid; s < A && s < MSCCLANG_MAX_FLAGS; s += NT) flags[s] = next;
    const uint4 v = make_uint4(next, next, next, next);
    for (u32 s = A / 4u + tid; s < MSCCLANG_MAX_FLAGS / 4u; s += NT) ((uint4*)flags)[s] = v;
  }
}
