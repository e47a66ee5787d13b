// The interpreter: each block copies its region of the device plan into shared memory and runs
// its ops in order (design §5). Data ops are done by all threads of the block; channel and
// semaphore ops map thread i to the op's i-th id.
//
// Performance notes (notes/perf.md):
// * prologue: the block table sits right after the header (fixed offset), so the block's entry and
//   the header load in parallel; thread 0 fills the block's Ctx in shared memory while the others
//   copy the region; one barrier.
// * data ops need no barrier of their own: every thread resolves the operand bases itself (the
//   address tables are prefetched into L1 by the prologue). Hazards between ops are the plan's
//   business (`nop`), as in the simulator.
// * data loops move 16-byte vectors, U independent vectors (or packets) in flight per thread.
#pragma once
#include "epilogue.cuh"

__device__ __forceinline__ const u16* op_operands(const DevOp* op) {
  return (const u16*)((const u8*)op + sizeof(DevOp));
}
__device__ __forceinline__ u32 pad8(u32 n) { return (n + 7u) & ~7u; }
__device__ __forceinline__ const u16* op_ids(const DevOp* op) {
  return (const u16*)((const u8*)op + sizeof(DevOp) + pad8(2u * (op->n_src + op->n_dst)));
}
__device__ __forceinline__ const u64* op_pieces(const DevOp* op) {
  return (const u64*)((const u8*)op + sizeof(DevOp) + pad8(2u * (op->n_src + op->n_dst)) + pad8(2u * op->n_ids));
}

__device__ __forceinline__ u8* operand_base(const Ctx& c, u16 d) {
  u32 slot = d & 0xffu;
  if (slot == OPND_SLOT_INPUT) return c.in;
  if (slot == OPND_SLOT_OUTPUT) return c.out;
  if (slot == OPND_SLOT_SCRATCH) return c.scratch + c.half;
  const RemoteBuf& r = c.remote[slot - OPND_SLOT_REMOTE0];
  u8* b = (u8*)r.base;
  if (r.kind == BUF_KIND_INPUT) return b + c.in_delta;
  if (r.kind == BUF_KIND_OUTPUT) return b + c.out_delta;
  return b + c.half;
}

// ---------------------------------------------------------------------------------------------
// plain path: no packet operands. Sources are reduced in listed order; every destination gets the
// result.
template <int DT, int OP>
__device__ __forceinline__ uint4 red16(uint4 a, uint4 b) {
  a.x = red_word<DT, OP>(a.x, b.x);
  a.y = red_word<DT, OP>(a.y, b.y);
  a.z = red_word<DT, OP>(a.z, b.z);
  a.w = red_word<DT, OP>(a.w, b.w);
  return a;
}

// the reduction of a 16-byte vector over two or more sources (Red, word by word)
template <int DT, int OP> struct Red16 {
  typedef Red<DT, OP> R;
  typename R::A w[4];
  __device__ __forceinline__ void first(uint4 a, uint4 b) {
    w[0] = R::first(a.x, b.x);
    w[1] = R::first(a.y, b.y);
    w[2] = R::first(a.z, b.z);
    w[3] = R::first(a.w, b.w);
  }
  __device__ __forceinline__ void add(uint4 b) {
    R::add(w[0], b.x);
    R::add(w[1], b.y);
    R::add(w[2], b.z);
    R::add(w[3], b.w);
  }
  __device__ __forceinline__ uint4 out() const { return make_uint4(R::out(w[0]), R::out(w[1]), R::out(w[2]), R::out(w[3])); }
};

// the sources' word at offset o reduced in order (one source: its word as it is)
template <int DT, int OP>
__device__ __forceinline__ u32 reduce_word_at(u8* const* p, int ns, u64 o) {
  typedef Red<DT, OP> R;
  const u32 w0 = *(const u32*)(p[0] + o);
  if (ns < 2) return w0;
  typename R::A a = R::first(w0, *(const u32*)(p[1] + o));
  for (int k = 2; k < ns; ++k) R::add(a, *(const u32*)(p[k] + o));
  return R::out(a);
}

// one unit of V bytes (V = 4, 2 or 1) at offset o
template <int DT, int OP, int V>
__device__ __forceinline__ void plain_unit(u8* const* p, int ns, int nd, u64 o) {
  if (V == 4) {
    const u32 acc = reduce_word_at<DT, OP>(p, ns, o);
    for (int k = 0; k < nd; ++k) *(u32*)(p[ns + k] + o) = acc;
  } else if (V == 1) {  // one fp8 element, reduced in lane 0 of a word
    typedef Red<DT, OP> R;
    u32 acc = *(const u8*)(p[0] + o);
    if (ns > 1) {
      typename R::A a = R::first(acc, *(const u8*)(p[1] + o));
      for (int k = 2; k < ns; ++k) R::add(a, *(const u8*)(p[k] + o));
      acc = R::out(a);
    }
    for (int k = 0; k < nd; ++k) *(p[ns + k] + o) = (u8)acc;
  } else {  // V == 2: one 16-bit element
    u16 acc = *(const u16*)(p[0] + o);
    for (int k = 1; k < ns; ++k) acc = red_half<DT, OP>(acc, *(const u16*)(p[k] + o));
    for (int k = 0; k < nd; ++k) *(u16*)(p[ns + k] + o) = acc;
  }
}

// 16-byte vectors over [lo, hi) (offsets 16-aligned in every operand), U vectors in flight per
// thread, coalesced across the block (vector j of a thread at o + j * nt * 16).
template <int DT, int OP, int U>
__device__ __forceinline__ void plain_vec16(u8* const* p, int ns, int nd, u64 lo, u64 hi) {
  const u64 step = (u64)blockDim.x * 16ull;
  u64 o = lo + (u64)threadIdx.x * 16ull;
  if (ns == 1 && nd == 1) {  // copy / put / get
    const u8* s = p[0];
    u8* d = p[1];
    for (; o + (U - 1) * step < hi; o += U * step) {
      uint4 v[U];
#pragma unroll
      for (int j = 0; j < U; ++j) v[j] = *(const uint4*)(s + o + j * step);
#pragma unroll
      for (int j = 0; j < U; ++j) *(uint4*)(d + o + j * step) = v[j];
    }
    for (; o < hi; o += step) *(uint4*)(d + o) = *(const uint4*)(s + o);
    return;
  }
  if (ns == 2) {  // the common reductions: local + one peer
    const u8* s0 = p[0];
    const u8* s1 = p[1];
    for (; o + (U - 1) * step < hi; o += U * step) {
      uint4 a[U], b[U];
#pragma unroll
      for (int j = 0; j < U; ++j) a[j] = *(const uint4*)(s0 + o + j * step);
#pragma unroll
      for (int j = 0; j < U; ++j) b[j] = *(const uint4*)(s1 + o + j * step);
#pragma unroll
      for (int j = 0; j < U; ++j) a[j] = red16<DT, OP>(a[j], b[j]);
      for (int k = 0; k < nd; ++k) {
        u8* d = p[2 + k];
#pragma unroll
        for (int j = 0; j < U; ++j) *(uint4*)(d + o + j * step) = a[j];
      }
    }
    for (; o < hi; o += step) {
      uint4 a = red16<DT, OP>(*(const uint4*)(s0 + o), *(const uint4*)(s1 + o));
      for (int k = 0; k < nd; ++k) *(uint4*)(p[2 + k] + o) = a;
    }
    return;
  }
  for (; o + (U - 1) * step < hi; o += U * step) {
    uint4 a[U];
    const u8* s0 = p[0];
#pragma unroll
    for (int j = 0; j < U; ++j) a[j] = *(const uint4*)(s0 + o + j * step);
    if (ns > 1) {
      Red16<DT, OP> acc[U];
      for (int k = 1; k < ns; ++k) {
        const u8* sk = p[k];
        uint4 b[U];
#pragma unroll
        for (int j = 0; j < U; ++j) b[j] = *(const uint4*)(sk + o + j * step);
        if (k == 1) {
#pragma unroll
          for (int j = 0; j < U; ++j) acc[j].first(a[j], b[j]);
        } else {
#pragma unroll
          for (int j = 0; j < U; ++j) acc[j].add(b[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < U; ++j) a[j] = acc[j].out();
    }
    for (int k = 0; k < nd; ++k) {
      u8* d = p[ns + k];
#pragma unroll
      for (int j = 0; j < U; ++j) *(uint4*)(d + o + j * step) = a[j];
    }
  }
  for (; o < hi; o += step) {
    uint4 a = *(const uint4*)(p[0] + o);
    if (ns > 1) {
      Red16<DT, OP> acc;
      acc.first(a, *(const uint4*)(p[1] + o));
      for (int k = 2; k < ns; ++k) acc.add(*(const uint4*)(p[k] + o));
      a = acc.out();
    }
    for (int k = 0; k < nd; ++k) *(uint4*)(p[ns + k] + o) = a;
  }
}

template <int DT, int OP, int U>
__device__ void plain_range(u8* const* p, int ns, int nd, u64 len) {
  constexpr u32 ES = ElemSize<DT>::value;
  const u32 tid = threadIdx.x, nt = blockDim.x;
  int n = ns + nd;
  u32 mis16 = 0, mis4 = 0;
  u64 a0 = (u64)p[0];
  for (int k = 1; k < n; ++k) {
    u64 ak = (u64)p[k];
    mis16 |= (u32)((ak ^ a0) & 15u);
    mis4 |= (u32)((ak ^ a0) & 3u);
  }
  if (mis16 == 0) {
    u64 head = (16u - ((u32)a0 & 15u)) & 15u;
    if (head > len) head = len;
    u64 body = (len - head) & ~15ull;
    u64 tail0 = head + body;
    if (ES < 4) {  // 16-bit or 8-bit elements: element units in the head and the tail
      for (u64 o = tid * ES; o < head; o += nt * ES) plain_unit<DT, OP, ES>(p, ns, nd, o);
      for (u64 o = tail0 + tid * ES; o < len; o += nt * ES) plain_unit<DT, OP, ES>(p, ns, nd, o);
    } else {
      for (u64 o = tid * 4ull; o < head; o += nt * 4ull) plain_unit<DT, OP, 4>(p, ns, nd, o);
      for (u64 o = tail0 + tid * 4ull; o < len; o += nt * 4ull) plain_unit<DT, OP, 4>(p, ns, nd, o);
    }
    if (body) plain_vec16<DT, OP, U>(p, ns, nd, head, tail0);
  } else if (mis4 == 0) {
    u64 head = (4u - ((u32)a0 & 3u)) & 3u;
    if (head > len) head = len;
    u64 body = (len - head) & ~3ull;
    u64 tail0 = head + body;
    if (ES < 4) {
      for (u64 o = tid * ES; o < head; o += nt * ES) plain_unit<DT, OP, ES>(p, ns, nd, o);
      for (u64 o = tail0 + tid * ES; o < len; o += nt * ES) plain_unit<DT, OP, ES>(p, ns, nd, o);
    }
    for (u64 o = head + tid * 4ull; o < tail0; o += nt * 4ull) plain_unit<DT, OP, 4>(p, ns, nd, o);
  } else {
    // only 16-bit and 8-bit types can be misaligned mod 4 (offsets are multiples of the element
    // size): element units
    for (u64 o = tid * ES; o < len; o += nt * ES) plain_unit<DT, OP, (ES < 4 ? ES : 4)>(p, ns, nd, o);
  }
}

// ---------------------------------------------------------------------------------------------
// packet path: at least one operand holds packets. A thread handles U packets per round (unit u
// and u + nt, u + 2 nt, ...): every load of a round is issued before the first flag check.

// payload words of a plain source for the unit at a (vb valid bytes of P); zero past vb
template <int DT, int PKT>
__device__ __forceinline__ void plain_payload(const u8* a, u32 vb, u32* w) {
  typedef Packet<PKT> Pk;
  constexpr u32 P = Pk::kPayload;
  constexpr u32 W = Pk::kWords;
  constexpr u32 ES = ElemSize<DT>::value;
  if (vb == P && (((u64)a) & 3u) == 0) {
    if (W == 2 && (((u64)a) & 7u) == 0) {
      uint2 v = *(const uint2*)a;
      w[0] = v.x;
      w[W - 1] = v.y;
    } else {
#pragma unroll
      for (u32 i = 0; i < W; ++i) w[i] = ((const u32*)a)[i];
    }
    return;
  }
#pragma unroll
  for (u32 i = 0; i < W; ++i) w[i] = 0;
  if (ES == 1) {
    for (u32 b = 0; b < vb; ++b) w[b / 4] |= (u32)a[b] << ((b & 3u) * 8u);
  } else if (ES == 2) {
    for (u32 b = 0; b < vb; b += 2) {
      u32 e = *(const u16*)(a + b);
      w[b / 4] |= e << ((b & 2u) * 8u);
    }
  } else {
    for (u32 b = 0; b < vb; b += 4) w[b / 4] = *(const u32*)(a + b);
  }
}

template <int DT, int PKT>
__device__ __forceinline__ void plain_store_payload(u8* a, u32 vb, const u32* w) {
  typedef Packet<PKT> Pk;
  constexpr u32 P = Pk::kPayload;
  constexpr u32 W = Pk::kWords;
  constexpr u32 ES = ElemSize<DT>::value;
  if (vb == P && (((u64)a) & 3u) == 0) {
    if (W == 2 && (((u64)a) & 7u) == 0) {
      *(uint2*)a = make_uint2(w[0], w[W - 1]);
    } else {
#pragma unroll
      for (u32 i = 0; i < W; ++i) ((u32*)a)[i] = w[i];
    }
  } else if (ES == 1) {
    for (u32 b = 0; b < vb; ++b) a[b] = (u8)(w[b / 4] >> ((b & 3u) * 8u));
  } else if (ES == 2) {
    for (u32 b = 0; b < vb; b += 2) *(u16*)(a + b) = (u16)(w[b / 4] >> ((b & 2u) * 8u));
  } else {
    for (u32 b = 0; b < vb; b += 4) *(u32*)(a + b) = w[b / 4];
  }
}

template <int DT, int OP, int PKT, int U>
__device__ bool packet_range(const Ctx& c, int opi, u8* const* p, u32 pmask, int ns, int nd, u64 len,
                             u64 valid) {
  typedef Packet<PKT> Pk;
  constexpr u32 P = Pk::kPayload;
  constexpr u32 W = Pk::kWords;
  const u32 tid = threadIdx.x, nt = blockDim.x;
  const u32 flag = c.flag;
  const u64 nunits = (len + P - 1) / P;
  for (u64 u0 = tid; u0 < nunits; u0 += (u64)U * nt) {
    u32 acc[U][W];
    typename Red<DT, OP>::A wide[IsF8<DT>::value ? U : 1][IsF8<DT>::value ? W : 1];  // fp8 only
    u32 nb[U], vb[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      u64 o = (u0 + (u64)j * nt) * P;
      u32 b = o < len ? (u32)((len - o) < P ? (len - o) : P) : 0u;
      nb[j] = b;
      vb[j] = valid > o ? (u32)((valid - o) < b ? (valid - o) : b) : 0u;
    }
    // units of this round past the end are clamped to the last unit (loaded, never used), so
    // every load of the round is issued unconditionally, before any result is looked at
    u64 uc[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      u64 uj = u0 + (u64)j * nt;
      uc[j] = uj < nunits ? uj : nunits - 1;
    }
    const bool full = (u0 + (u64)(U - 1) * nt + 1) * P <= valid;  // every unit whole and valid
    for (int k = 0; k < ns; ++k) {
      u32 w[U][W];
      if (pmask >> k & 1u) {
        const u8* a = p[k];
        bool ok[U];
#pragma unroll
        for (int j = 0; j < U; ++j) ok[j] = Pk::load(a + 2ull * uc[j] * P, w[j], flag);
#pragma unroll
        for (int j = 0; j < U; ++j) {
          if (!ok[j] && nb[j]) {
            Spin s(opi);
            while (!Pk::load(a + 2ull * uc[j] * P, w[j], flag)) {
              if (s.tick(c, WHAT_PACKET, -1, flag, 0)) return false;
            }
          }
        }
      } else {
        const u8* a = p[k];
        if (full && (((u64)a) & (W == 2 ? 7u : 3u)) == 0) {
#pragma unroll
          for (int j = 0; j < U; ++j) {
            if (W == 2) {
              uint2 v = *(const uint2*)(a + uc[j] * P);
              w[j][0] = v.x;
              w[j][W - 1] = v.y;
            } else {
              w[j][0] = *(const u32*)(a + uc[j] * P);
            }
          }
        } else {
#pragma unroll
          for (int j = 0; j < U; ++j) {
            if (nb[j]) plain_payload<DT, PKT>(a + uc[j] * P, vb[j], w[j]);
          }
        }
      }
      if (k == 0) {
#pragma unroll
        for (int j = 0; j < U; ++j)
#pragma unroll
          for (u32 i = 0; i < W; ++i) acc[j][i] = w[j][i];
      } else if constexpr (IsF8<DT>::value) {  // accumulated wide, rounded once after the loop
        if (k == 1) {
#pragma unroll
          for (int j = 0; j < U; ++j)
#pragma unroll
            for (u32 i = 0; i < W; ++i) wide[j][i] = Red<DT, OP>::first(acc[j][i], w[j][i]);
        } else {
#pragma unroll
          for (int j = 0; j < U; ++j)
#pragma unroll
            for (u32 i = 0; i < W; ++i) Red<DT, OP>::add(wide[j][i], w[j][i]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < U; ++j)
#pragma unroll
          for (u32 i = 0; i < W; ++i) acc[j][i] = red_word<DT, OP>(acc[j][i], w[j][i]);
      }
    }
    if constexpr (IsF8<DT>::value) {
      if (ns > 1) {
#pragma unroll
        for (int j = 0; j < U; ++j)
#pragma unroll
          for (u32 i = 0; i < W; ++i) acc[j][i] = Red<DT, OP>::out(wide[j][i]);
      }
    }
    for (int k = ns; k < ns + nd; ++k) {
      if (pmask >> k & 1u) {
        u8* a = p[k] + 2ull * u0 * P;
#pragma unroll
        for (int j = 0; j < U; ++j)
          if (nb[j]) Pk::store(a + 2ull * j * nt * P, acc[j], flag);
      } else {
        // plain destinations get only the valid bytes (packet slots are written whole)
        u8* a = p[k] + u0 * P;
#pragma unroll
        for (int j = 0; j < U; ++j)
          if (nb[j]) plain_store_payload<DT, PKT>(a + (u64)j * nt * P, vb[j], acc[j]);
      }
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// data-dependent counts: a segment op's lengths and offsets come from the count matrix (checked
// at the start of the launch: every count a segment names is >= 0 here)
__device__ __forceinline__ u64 seg_rows(const Ctx& c, u32 e) {
  const u32 n = c.n_ranks;
  const i32 v = c.counts[(u64)(e / n) * (2ull * n + 2ull) + (e % n)];
  return v > 0 ? (u64)v : 0ull;
}
__device__ __forceinline__ u64 seg_offset(const Ctx& c, u64 w) {
  const u32 lo = (u32)w, k = (u32)(w >> 32);
  if (lo == SEG_SLOT) return (u64)k * c.capacity * c.row_bytes;
  u64 rows = 0;
  for (u32 t = 0; t < k; ++t) rows += seg_rows(c, c.segs[lo + t]);
  return rows * c.row_bytes;
}

// one count check (plan_layout.cuh, CHECK_*); on failure, `f` (if given) gets what failed
struct CountFail {
  i32 rank, i, j;
  i64 seen, bound;
};
__device__ __forceinline__ i32 count_at(const Ctx& c, u32 i, u32 j) {
  return c.counts[(u64)i * (2ull * c.n_ranks + 2ull) + j];
}
__device__ bool check_counts_one(const Ctx& c, const CountCheck& k, CountFail* f) {
  const u32 n = c.n_ranks;
  if (k.kind == CHECK_EXPECT) {
    for (u32 j = 0; j < k.count; ++j) {
      const i32 want = count_at(c, k.rank, n + 2u + j), sent = count_at(c, j, k.rank);
      if (want >= 0 && want != sent) {
        if (f) *f = CountFail{(i32)k.rank, (i32)k.rank, (i32)j, sent, want};
        return false;
      }
    }
    return true;
  }
  if (k.kind == CHECK_INPUT || k.kind == CHECK_OUTPUT) {
    i64 sum = 0;
    for (u32 t = 0; t < k.count; ++t) {
      const u32 e = c.segs[k.first + t];
      sum += count_at(c, e / n, e % n);
    }
    const i64 bound = count_at(c, k.rank, k.kind == CHECK_INPUT ? n : n + 1u);
    if (sum > bound) {
      if (f) *f = CountFail{(i32)k.rank, -1, -1, sum, bound};
      return false;
    }
    return true;
  }
  for (u32 t = 0; t < k.count; ++t) {
    const u32 e = c.segs[k.first + t];
    const i32 v = count_at(c, e / n, e % n);
    if ((k.kind == CHECK_NONNEG && v < 0) || (k.kind == CHECK_SCRATCH && (i64)v > (i64)c.capacity)) {
      if (f) *f = CountFail{(i32)k.rank, (i32)(e / n), (i32)(e % n), v, k.kind == CHECK_NONNEG ? 0 : (i64)c.capacity};
      return false;
    }
  }
  return true;
}

// Every block checks the count matrix before any data moves; the same table and matrix on every
// rank give every block of every rank the same verdict. The first failing check (in table order)
// goes into the error record (what = WHAT_COUNTS, op_index = its kind, channel = i << 16 | j or
// -1, expected = its bound, seen = the count or sum) and the launch aborts. All threads call it.
__device__ __noinline__ bool counts_ok(const Ctx& c, u32* bad) {
  for (u32 i = threadIdx.x; i < c.n_checks; i += blockDim.x)
    if (!check_counts_one(c, c.checks[i], nullptr)) atomicMin(bad, i);
  __syncthreads();
  const u32 b = *bad;
  if (b == 0xffffffffu) return true;
  if (threadIdx.x == 0) {
    CountFail f{0, -1, -1, 0, 0};
    check_counts_one(c, c.checks[b], &f);
    ErrorRecord* r = c.err;
    if (atomicCAS(&r->state, 0u, 1u) == 0u) {
      r->rank = f.rank;
      r->block = (i32)blockIdx.x;
      r->op_index = (i32)c.checks[b].kind;
      r->what = WHAT_COUNTS;
      r->channel = f.i < 0 ? -1 : (f.i << 16) | f.j;
      r->expected = (u64)f.bound;
      r->seen = (u64)f.seen;
      r->elapsed_ns = 0;
      __threadfence_system();
      atomicExch(&r->state, 2u);
      __threadfence_system();
    }
    raise_abort(c);
    hold_for_host(c);
  }
  return false;
}

// stream range of a data op for this block (`total`: the op's stream bytes): pipeline iteration
// slice, then thread-block-group split
__device__ __forceinline__ void op_range(const DevOp* op, u64 total, long long iter, u64 unit, u64& A, u64& B) {
  u64 a = 0, b = total;
  if (iter >= 0) {
    a = (u64)iter * unit;
    b = a + unit;
    if (a > total) a = total;
    if (b > total) b = total;
  }
  if (op->tbg_size > 1) {
    u64 L = b - a, U = op->tbg_unit;
    u64 units = (L + U - 1) / U;
    u64 q = units / op->tbg_size, r = units % op->tbg_size, m = op->tbg_member;
    u64 s = m * q + (m < r ? m : r);
    u64 e = s + q + (m < r ? 1ull : 0ull);
    u64 lo = s * U, hi = e * U;
    A = a + (lo < L ? lo : L);
    B = a + (hi < L ? hi : L);
  } else {
    A = a;
    B = b;
  }
}

// EPI: an epilogue kernel, where an operand may be the call's residual (`e`)
template <int DT, int OP, int PKT, int U, int UP, int EPI = 0>
__device__ bool run_data(const Ctx& c, const DevOp* op, int opi, long long iter, u64 unit,
                         const EpiArgs* e = nullptr) {
  const u16* opnd = op_operands(op);
  const int ns = op->n_src, n = ns + op->n_dst;
  const u64* pc = op_pieces(op);
  const u32 stride = 2u + (u32)n;
  // segments (never in pipelines): piece lengths and the op's total from the count matrix
  const bool seg = (op->flags & FLAG_SEGMENTS) != 0u;
  u64 total = op->total;
  if (seg) {
    total = 0;
    for (u32 i = 0; i < op->n_pieces; ++i) total += seg_rows(c, (u32)pc[i * stride]) * c.row_bytes;
  }
  u64 A, B;
  op_range(op, total, iter, unit, A, B);
  if (A >= B) return true;
  u32 pmask = 0;
  for (int k = 0; k < n; ++k) pmask |= (u32)((opnd[k] >> 8) & OPND_MODE_PACKET) << k;
  u64 pos = 0;
  u8* p[MSCCLANG_MAX_OPERANDS];
  for (u32 i = 0; i < op->n_pieces; ++i, pc += stride) {
    const u64 plen = seg ? seg_rows(c, (u32)pc[0]) * c.row_bytes : pc[0];
    u64 lo = A > pos ? A : pos;
    u64 hi = B < pos + plen ? B : pos + plen;
    if (lo < hi) {
      u64 d = lo - pos;
      u64 len = hi - lo;
#pragma unroll 1
      for (int k = 0; k < n; ++k) {
        u64 off = (seg ? seg_offset(c, pc[2 + k]) : pc[2 + k]) + d;
        if (EPI && (opnd[k] & 0xffu) == OPND_SLOT_RESIDUAL)
          p[k] = (u8*)e->residual + off;
        else
          p[k] = operand_base(c, opnd[k]) + ((pmask >> k & 1u) ? 2ull * off : off);
      }
      if (pmask) {
        u64 pvalid = seg ? plen : pc[1];
        u64 valid = pvalid > d ? pvalid - d : 0ull;
        if (!packet_range<DT, OP, PKT, UP>(c, opi, p, pmask, ns, n - ns, len, valid)) return false;
      } else {
        plain_range<DT, OP, U>(p, ns, n - ns, len);
      }
    }
    pos += plen;
    if (pos >= B) break;
  }
  return true;
}

template <int DT, int OP>
__device__ void run_switch(const Ctx& c, const DevOp* op, bool store) {
  // operands: [multicast src, local dst] (glre/glres) or [local src, multicast dst] (gstore)
  const u16* opnd = op_operands(op);
  const u64* pc = op_pieces(op);
  u8* b0 = operand_base(c, opnd[0]);
  u8* b1 = operand_base(c, opnd[1]);
  for (u32 i = 0; i < op->n_pieces; ++i, pc += 4) {
    u64 len = pc[0];
    u8* s = b0 + pc[2];
    u8* d = b1 + pc[3];
    for (u64 o = threadIdx.x * 4ull; o + 4 <= len; o += blockDim.x * 4ull) {
      if (store)
        multimem_st_word(d + o, *(const u32*)(s + o));
      else
        *(u32*)(d + o) = multimem_ld_reduce_word<DT, OP>(s + o);
    }
  }
}

// Runs one op; returns false when the block must stop (abort). `last`: no op of this block
// follows (a failed packet read then needs no block-wide agreement: every thread just ends).
// EPI: an epilogue kernel (its call's parameters in `e`); only those run radd and rmsnorm.
template <int DT, int OP, int PKT, int U, int UP, int EPI = 0>
__device__ bool run_op(const Ctx& c, const DevOp* op, long long iter, u64 unit, bool last,
                       const EpiArgs* e = nullptr) {
  const u32 tid = threadIdx.x;
  const int opi = (int)op->index;
  if constexpr (EPI) {
    if (op->kind == DOP_RADD) return run_data<DT, ROP_SUM, PKT, U, UP, 1>(c, op, opi, iter, unit, e);
    if (op->kind == DOP_RMSNORM) {
      epi_rmsnorm<DT>((const u8*)e->residual, c.out, *e, op_pieces(op), op->n_pieces);
      return true;
    }
  }
  switch (op->kind) {
    case DOP_NOP:
      __syncthreads();
      return true;
    case DOP_BARRIER: {
      bool ok = true;
      __syncthreads();
      if (tid == 0) ok = block_group_barrier(c, opi, op->aux0, op->aux1);
      return !__syncthreads_or(!ok);
    }
    case DOP_SIGNAL: {
      const u16* ids = op_ids(op);
      if (tid < op->n_ids) channel_signal(c.chan[ids[tid]], (op->flags & 1u) != 0);
      return true;
    }
    case DOP_WAIT: {
      const u16* ids = op_ids(op);
      bool ok = true;
      if (tid < op->n_ids) ok = channel_wait(c, opi, c.chan[ids[tid]], ids[tid], (op->flags & 1u) != 0);
      return !__syncthreads_or(!ok);
    }
    case DOP_DATA: {
      bool ok = run_data<DT, OP, PKT, U, UP, EPI>(c, op, opi, iter, unit, e);
      if ((op->flags & 2u) && !last) return !__syncthreads_or(!ok);  // reads packets: may have aborted
      return ok;
    }
    case DOP_SEM_ACQUIRE: {
      const u16* ids = op_ids(op);
      bool ok = true;
      if (tid < op->n_ids) ok = semaphore_acquire(c, opi, ids[tid]);
      return !__syncthreads_or(!ok);
    }
    case DOP_SEM_RELEASE: {
      const u16* ids = op_ids(op);
      if (tid < op->n_ids) semaphore_release(c, ids[tid]);
      return true;
    }
    case DOP_PORT_TRIGGER: {
      // every thread's earlier writes (the data the copy engine reads) before the trigger
      __syncthreads();
      const u16* ids = op_ids(op);
      const u64 step = iter >= 0 ? (u64)iter : 0ull;
      const u32 t = op->aux0 + (u32)(step * (op->total & 0xffffffffull));
      bool ok = true;
      if (tid == 0) {
        const ChannelDev& ch = c.chan[ids[0]];
        port_trigger(ch, t, op->aux1 + (u32)(step * (op->total >> 32)), (op->flags & PORT_SIGNAL) != 0u);
        if (op->flags & PORT_FLUSH) ok = port_flush_wait(c, opi, ch, ids[0], t);
      }
      if (op->flags & PORT_FLUSH) return !__syncthreads_or(!ok);
      return true;
    }
    case DOP_PORT_FLUSH: {
      const u16* ids = op_ids(op);
      const u64 step = iter >= 0 ? (u64)iter : 0ull;
      const u32 t = op->aux0 + (u32)(step * op->total);
      bool ok = true;
      if (tid == 0 && t > 0u) ok = port_flush_wait(c, opi, c.chan[ids[0]], ids[0], t);
      return !__syncthreads_or(!ok);
    }
    case DOP_PORT_FINAL:
      return true;
    case DOP_SWITCH_REDUCE:
      run_switch<DT, OP>(c, op, false);
      return true;
    case DOP_SWITCH_STORE:
      run_switch<DT, OP>(c, op, true);
      return true;
    default:
      return true;
  }
}

// The GPU's global nanosecond timer (the traced kernels only).
__device__ __forceinline__ u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Traced kernels (TR = 1) write, per block and device record i, {start, end} in global-timer ns
// at trace[1 + blockIdx.x * trace[0] + 2 i]; trace[0] is the per-block stride in u64 (2 x the
// most records of a block), set by the host. Every thread meets before each end is taken, so an
// op's end is when its last thread finished. Inner ops of a pipeline: the first iteration's start
// and the last one's end. TR = 0 compiles none of it.
template <int TR>
__device__ __forceinline__ void trace_mark(u64* trace, u32 rec, int which) {
  if constexpr (TR) {
    if (which) __syncthreads();
    if (threadIdx.x == 0) trace[1 + (u64)blockIdx.x * trace[0] + 2ull * rec + (u32)which] = global_ns();
  }
}

// The block's ops in order; false when it must stop (abort).
template <int DT, int OP, int PKT, int U, int UP, int TR = 0, int EPI = 0>
__device__ __forceinline__ bool run_block(const Ctx& c, const u8* smem, u64* trace = nullptr,
                                          const EpiArgs* e = nullptr) {
  const BlockHeader* bh = (const BlockHeader*)smem;
  const u8* cur = smem + sizeof(BlockHeader);
  const u32 n_ops = bh->n_ops;
  for (u32 i = 0; i < n_ops; ++i) {
    const DevOp* op = (const DevOp*)cur;
    if (op->kind == DOP_PIPELINE) {
      u32 n_inner = op->aux0, iters = op->aux1;
      u64 unit = op->total;
      const u8* first = cur + op->bytes;
      const u8* after = first;
      for (u32 j = 0; j < n_inner; ++j) after += ((const DevOp*)after)->bytes;
      trace_mark<TR>(trace, i, 0);
      for (u32 it = 0; it < iters; ++it) {
        const u8* q = first;
        for (u32 j = 0; j < n_inner; ++j) {
          const DevOp* inner = (const DevOp*)q;
          if constexpr (TR) {
            if (it == 0u) trace_mark<TR>(trace, i + 1u + j, 0);
          }
          if (!run_op<DT, OP, PKT, U, UP, EPI>(c, inner, (long long)it, unit, false, e)) return false;
          if constexpr (TR) {
            if (it + 1u == iters) trace_mark<TR>(trace, i + 1u + j, 1);
          }
          q += inner->bytes;
        }
      }
      trace_mark<TR>(trace, i, 1);
      cur = after;
      i += n_inner;
    } else {
      trace_mark<TR>(trace, i, 0);
      if (!run_op<DT, OP, PKT, U, UP, EPI>(c, op, -1, 0, i + 1 == n_ops, e)) return false;
      trace_mark<TR>(trace, i, 1);
      cur += op->bytes;
    }
  }
  return true;
}

// Block exit, on every path: a port channel's trigger gets its final value for the launch, so no
// wait its proxy enqueued can outlive the kernel (the DOP_PORT_FINAL records end the region).
__device__ __forceinline__ void port_finals(const Ctx& c, const u8* smem) {
  const BlockHeader* bh = (const BlockHeader*)smem;
  if (threadIdx.x != 0 || bh->n_finals == 0u) return;
  const u8* cur = smem + sizeof(BlockHeader);
  for (u32 i = 0; i < bh->n_ops; ++i) {
    const DevOp* op = (const DevOp*)cur;
    if (op->kind == DOP_PORT_FINAL) port_release(c.chan[op_ids(op)[0]], op->aux0);
    cur += op->bytes;
  }
}

template <int DT, int OP, int PKT, int U, int UP, int TR = 0, int EPI = 0>
__device__ __forceinline__ void interpret(const u8* __restrict__ blob, u8* in, u8* out, u64 in_delta,
                                          u64 out_delta, u64 timeout_ns, u64* trace = nullptr,
                                          const EpiArgs* e = nullptr) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ Ctx s_c;
  __shared__ u32 s_stop;
  __shared__ u32 s_bad;   // the first count check that failed (~0u: none)
  const PlanHeader* H = (const PlanHeader*)blob;
  // the block table follows the header at a fixed offset: no dependent load on the header
  const BlockEntry be = ((const BlockEntry*)(blob + sizeof(PlanHeader)))[blockIdx.x];
  if (threadIdx.x == 0) {
    Ctx& c = s_c;
    const u32 flag = ld_volatile_u32((const u32*)H->flags + blockIdx.x);
    s_stop = ld_volatile_u32((const u32*)H->abort_word);
    c.blob = blob;
    c.in = in;
    c.out = out;
    c.scratch = (u8*)H->scratch_base;
    c.in_delta = in_delta;
    c.out_delta = out_delta;
    c.flag = flag;
    c.half = (flag & 1u) ? 0ull : H->scratch_half;
    c.remote = (const RemoteBuf*)(blob + H->remote_table);
    c.chan = (const ChannelDev*)(blob + H->channel_table);
    c.peer_abort = (const u64*)(blob + H->peer_abort_table);
    c.n_peers = H->n_peers;
    c.sems = (i64*)H->semaphores;
    c.bars = (u64*)H->barriers;
    c.abort_word = (u32*)H->abort_word;
    c.err = (ErrorRecord*)H->error_record;
    c.timeout_ns = timeout_ns;
    c.rank = (i32)H->rank;
    c.n_ranks = H->n_ranks;
    c.n_checks = H->n_checks;
    c.counts = (const i32*)H->counts;
    c.segs = (const u32*)(blob + H->seg_table);
    c.checks = (const CountCheck*)(blob + H->check_table);
    c.row_bytes = H->row_bytes;
    c.capacity = H->capacity;
    s_bad = 0xffffffffu;
  } else if (threadIdx.x >= 32 && threadIdx.x < 40) {
    // warm L1 with the address tables (peer aborts, remote buffers, channels) that lie between
    // the block table and the first region
    const u32 off = (u32)sizeof(PlanHeader) + 128u * (threadIdx.x - 31u);
    if (off < be.offset) asm volatile("prefetch.global.L1 [%0];" ::"l"(blob + off));
  }
  const uint4* src = (const uint4*)(blob + be.offset);
  for (u32 i = threadIdx.x; i < be.bytes / 16u; i += blockDim.x) ((uint4*)smem)[i] = src[i];
  __syncthreads();
  const Ctx& c = s_c;
  // a plan with segments: the count matrix is checked first (bad counts are reported as such,
  // even after an earlier abort)
  if (c.n_checks != 0u && !counts_ok(c, &s_bad)) {
    port_finals(c, smem);
    return;
  }
  if (s_stop) {  // a peer or an earlier launch aborted: record it (if nobody did) and exit
    if (threadIdx.x == 0) {
      record_error(c, -1, WHAT_PEER_ABORT, -1, 0, 0, 0);
      hold_for_host(c);
    }
    port_finals(c, smem);
    return;
  }

  if (!run_block<DT, OP, PKT, U, UP, TR, EPI>(c, smem, trace, e)) {
    port_finals(c, smem);
    return;
  }
  port_finals(c, smem);
  // advance this block's flag (block 0 also the slots at and beyond gridDim). No barrier: the
  // flag is read again only by the next launch, which starts after this one ends.
  u32 next = c.flag + 1u;
  if (next == 0u) next = 1u;
  u32* flags = (u32*)H->flags;
  if (threadIdx.x == 0) flags[blockIdx.x] = next;
  if (blockIdx.x == 0)
    for (u32 b = gridDim.x + threadIdx.x; b < MSCCLANG_MAX_FLAGS; b += blockDim.x) flags[b] = next;
}
