// Device primitives of the mscclang executor: memory-ordering helpers, 64-bit monotonic channel
// counters, LL8/LL16 packets, element-wise reduction per dtype, bounded spins with the abort
// protocol, port-channel FIFO push (compiled, not used by the runtime yet) and switch-channel
// multimem access (compiled only).
#pragma once
#include "plan_layout.cuh"

#define DT_F16 0
#define DT_BF16 1
#define DT_F32 2
#define DT_I32 3
// fp8, one code per accumulation dtype (float32 _A32, float16 _A16); sum only
#define DT_F8E4M3_A32 4
#define DT_F8E4M3_A16 5
#define DT_F8E5M2_A32 6
#define DT_F8E5M2_A16 7

#define ROP_SUM 0
#define ROP_MIN 1
#define ROP_MAX 2

struct u32x4 { u32 x, y, z, w; };

// ------------------------------------------------------------------------------------------------
// memory ordering
__device__ __forceinline__ u64 ld_acquire_sys_u64(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_relaxed_sys_u64(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_acquire_gpu_u64(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_add_release_sys(u64* p, u64 v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_add_relaxed_sys(u64* p, u64 v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u32 ld_volatile_u32(const u32* p) {
  u32 v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys_u32(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ------------------------------------------------------------------------------------------------
// LL packets: LL16 = {data0, flag, data1, flag} carries 8 payload bytes, LL8 = {data, flag} 4.
template <int PKT> struct Packet;
template <> struct Packet<16> {
  static constexpr u32 kPayload = 8;
  static constexpr u32 kWords = 2;
  __device__ static __forceinline__ void store(u8* p, const u32* w, u32 flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(flag),
                 "r"(w[1]), "r"(flag)
                 : "memory");
  }
  // true when the packet carries `flag`; payload words in w
  __device__ static __forceinline__ bool load(const u8* p, u32* w, u32 flag) {
    u32 a, b, c, d;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "l"(p)
                 : "memory");
    w[0] = a;
    w[1] = c;
    return b == flag && d == flag;
  }
};
template <> struct Packet<8> {
  static constexpr u32 kPayload = 4;
  static constexpr u32 kWords = 1;
  __device__ static __forceinline__ void store(u8* p, const u32* w, u32 flag) {
    asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(w[0]), "r"(flag) : "memory");
  }
  __device__ static __forceinline__ bool load(const u8* p, u32* w, u32 flag) {
    u32 a, b;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p) : "memory");
    w[0] = a;
    return b == flag;
  }
};

// ------------------------------------------------------------------------------------------------
// element-wise reduction: fp16/bf16 every step in fp32 rounded to nearest even, fp32 in fp32,
// int32 wrapping, min/max exact; fp8 (sum only) accumulated in fp32 or fp16 and rounded once per
// op to fp8, saturating (docs/semantics.md, "FP8 reductions").
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float b2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f2b(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

template <int OP> __device__ __forceinline__ float fop(float a, float b) {
  if (OP == ROP_SUM) return __fadd_rn(a, b);
  if (OP == ROP_MIN) return fminf(a, b);
  return fmaxf(a, b);
}
template <int OP> __device__ __forceinline__ i32 iop(i32 a, i32 b) {
  if (OP == ROP_SUM) return (i32)((u32)a + (u32)b);
  if (OP == ROP_MIN) return a < b ? a : b;
  return a > b ? a : b;
}

// one 16-bit element
template <int DT, int OP> __device__ __forceinline__ u16 red_half(u16 a, u16 b) {
  if (DT == DT_F16) return f2h(fop<OP>(h2f(a), h2f(b)));
  return f2b(fop<OP>(b2f(a), b2f(b)));
}

template <int DT> struct IsF8 { static constexpr bool value = DT >= DT_F8E4M3_A32 && DT <= DT_F8E5M2_A16; };
template <int DT> struct F8Kind {
  static constexpr bool e5m2 = DT == DT_F8E5M2_A32 || DT == DT_F8E5M2_A16;
  static constexpr bool acc16 = DT == DT_F8E4M3_A16 || DT == DT_F8E5M2_A16;
};

// fp8 pairs (element 0 in the low byte) <-> f16x2 / f32 (sm_89+ hardware conversions; fp8 to
// f16 is exact, the way back rounds to nearest even and saturates: satfinite)
template <bool E5> __device__ __forceinline__ u32 f8x2_to_h2(u16 v) {
  u32 r;
  if (E5)
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(v));
  else
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
}
template <bool E5> __device__ __forceinline__ u16 h2_to_f8x2(u32 h) {
  u16 r;
  if (E5)
    asm("cvt.rn.satfinite.e5m2x2.f16x2 %0, %1;" : "=h"(r) : "r"(h));
  else
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(h));
  return r;
}
template <bool E5> __device__ __forceinline__ u16 f2_to_f8x2(float lo, float hi) {
  u16 r;  // the first source operand lands in the high byte
  if (E5)
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ u32 hadd2_rn(u32 a, u32 b) {
  u32 r;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// The reduction of one 32-bit word of whole elements over two or more sources:
// A a = first(src0, src1); add(a, src2) ...; out(a). Non-fp8 types keep the word itself (every
// step rounds to the type); fp8 keeps the 4 elements in the accumulation dtype.
template <int DT, int OP, bool F8 = IsF8<DT>::value, bool H = F8Kind<DT>::acc16> struct Red;
template <int DT, int OP> struct Red<DT, OP, false, false> {
  typedef u32 A;
  __device__ static __forceinline__ u32 step(u32 a, u32 b) {
    if (DT == DT_F32) return __float_as_uint(fop<OP>(__uint_as_float(a), __uint_as_float(b)));
    if (DT == DT_I32) return (u32)iop<OP>((i32)a, (i32)b);
    u16 lo = red_half<DT, OP>((u16)(a & 0xffffu), (u16)(b & 0xffffu));
    u16 hi = red_half<DT, OP>((u16)(a >> 16), (u16)(b >> 16));
    return ((u32)hi << 16) | lo;
  }
  __device__ static __forceinline__ A first(u32 a, u32 b) { return step(a, b); }
  __device__ static __forceinline__ void add(A& a, u32 b) { a = step(a, b); }
  __device__ static __forceinline__ u32 out(A a) { return a; }
};
template <int DT, int OP> struct Red<DT, OP, true, false> {  // fp8, fp32 accumulation
  static_assert(OP == ROP_SUM, "fp8 reduces with sum only");
  static constexpr bool E5 = F8Kind<DT>::e5m2;
  struct A { float f[4]; };
  __device__ static __forceinline__ void widen(u32 w, float* f) {
    const u32 lo = f8x2_to_h2<E5>((u16)(w & 0xffffu)), hi = f8x2_to_h2<E5>((u16)(w >> 16));
    f[0] = h2f((u16)(lo & 0xffffu));
    f[1] = h2f((u16)(lo >> 16));
    f[2] = h2f((u16)(hi & 0xffffu));
    f[3] = h2f((u16)(hi >> 16));
  }
  __device__ static __forceinline__ void add(A& a, u32 b) {
    float f[4];
    widen(b, f);
#pragma unroll
    for (int i = 0; i < 4; ++i) a.f[i] = __fadd_rn(a.f[i], f[i]);
  }
  __device__ static __forceinline__ A first(u32 a, u32 b) {
    A r;
    widen(a, r.f);
    add(r, b);
    return r;
  }
  __device__ static __forceinline__ u32 out(const A& a) {
    return (u32)f2_to_f8x2<E5>(a.f[0], a.f[1]) | ((u32)f2_to_f8x2<E5>(a.f[2], a.f[3]) << 16);
  }
};
template <int DT, int OP> struct Red<DT, OP, true, true> {  // fp8, fp16 accumulation
  static_assert(OP == ROP_SUM, "fp8 reduces with sum only");
  static constexpr bool E5 = F8Kind<DT>::e5m2;
  struct A { u32 h[2]; };
  __device__ static __forceinline__ void add(A& a, u32 b) {
    a.h[0] = hadd2_rn(a.h[0], f8x2_to_h2<E5>((u16)(b & 0xffffu)));
    a.h[1] = hadd2_rn(a.h[1], f8x2_to_h2<E5>((u16)(b >> 16)));
  }
  __device__ static __forceinline__ A first(u32 a, u32 b) {
    A r;
    r.h[0] = f8x2_to_h2<E5>((u16)(a & 0xffffu));
    r.h[1] = f8x2_to_h2<E5>((u16)(a >> 16));
    add(r, b);
    return r;
  }
  __device__ static __forceinline__ u32 out(const A& a) {
    return (u32)h2_to_f8x2<E5>(a.h[0]) | ((u32)h2_to_f8x2<E5>(a.h[1]) << 16);
  }
};

// one 32-bit word holding whole elements, two sources
template <int DT, int OP> __device__ __forceinline__ u32 red_word(u32 a, u32 b) {
  typedef Red<DT, OP> R;
  return R::out(R::first(a, b));
}
template <int DT> struct ElemSize {
  static constexpr u32 value = (DT == DT_F16 || DT == DT_BF16) ? 2 : IsF8<DT>::value ? 1 : 4;
};

// ------------------------------------------------------------------------------------------------
// execution context of one block (lives in shared memory: one copy per block, read by every
// thread, so it costs no registers across the op loop). The helpers below take any context type C
// with the fields they use (err, rank, abort_word, peer_abort[], n_peers, timeout_ns, sems, bars):
// the interpreter passes its Ctx, a plan-specialised kernel its kernel-parameter struct.
struct Ctx {
  const u8* blob;
  u8* in;
  u8* out;
  u8* scratch;
  u64 in_delta;
  u64 out_delta;
  u64 half;
  const RemoteBuf* remote;
  const ChannelDev* chan;
  const u64* peer_abort;
  u32 n_peers;
  u32 flag;
  i64* sems;
  u64* bars;
  u32* abort_word;
  ErrorRecord* err;
  u64 timeout_ns;
  i32 rank;
  // data-dependent counts (plans with segments; see plan_layout.cuh)
  u32 n_ranks;
  u32 n_checks;
  const i32* counts;
  const u32* segs;
  const CountCheck* checks;
  u64 row_bytes;
  u64 capacity;
};

template <class C>
__device__ __noinline__ void record_error(const C& c, int op_index, int what, int channel, u64 expected,
                                          u64 seen, u64 elapsed) {
  ErrorRecord* r = c.err;
  if (atomicCAS(&r->state, 0u, 1u) == 0u) {
    r->rank = c.rank;
    r->block = (i32)blockIdx.x;
    r->op_index = op_index;
    r->what = what;
    r->channel = channel;
    r->expected = expected;
    r->seen = seen;
    r->elapsed_ns = elapsed;
    __threadfence_system();
    atomicExch(&r->state, 2u);
    __threadfence_system();
  }
}

template <class C>
__device__ __noinline__ void raise_abort(const C& c) {
  st_relaxed_sys_u32(c.abort_word, 1u);
  for (u32 p = 0; p < c.n_peers; ++p) st_relaxed_sys_u32((u32*)c.peer_abort[p], 1u);
  __threadfence_system();
}

// After an abort, the launch does not end before the host has seen it: the thread that noticed
// the abort waits until the host sets ErrorRecord.host_ack (it does so once the exception is on
// its way to the code that launched the collective, or the watchdog has acted), bounded by the
// timeout. So no launch that gave up completes, and no later launch (a graph replay) completes
// either, while the launching thread could still read its result without an exception.
template <class C>
__device__ __noinline__ void hold_for_host(const C& c) {
  const volatile u32* ack = &c.err->host_ack;
  if (*ack != 0u) return;
  const u64 t0 = global_timer_ns();
  while (*ack == 0u && global_timer_ns() - t0 < c.timeout_ns) __nanosleep(1000);
}

// A bounded spin: call tick() once per failed poll; it returns true when the caller must give up
// (bound expired here, or another block / rank aborted).
struct Spin {
  u64 t0;
  u32 n;
  i32 op;   // op index, for the error record
  __device__ __forceinline__ explicit Spin(int op_index) : t0(0), n(0), op(op_index) {}
  template <class C>
  __device__ __forceinline__ bool tick(const C& c, int what, int channel, u64 expected, u64 seen) {
    if ((++n & 15u) != 0u) return false;
    if (ld_volatile_u32(c.abort_word) != 0u) {
      record_error(c, op, WHAT_PEER_ABORT, channel, expected, seen, 0);
      hold_for_host(c);
      return true;
    }
    u64 now = global_timer_ns();
    if (t0 == 0) {
      t0 = now;
      return false;
    }
    if (now - t0 > c.timeout_ns) {
      record_error(c, op, what, channel, expected, seen, now - t0);
      raise_abort(c);
      hold_for_host(c);
      return true;
    }
    return false;
  }
};

// ------------------------------------------------------------------------------------------------
// memory channel signal / wait on monotonic 64-bit counters. Return false on abort.
__device__ __forceinline__ void channel_signal(const ChannelDev& ch, bool relaxed) {
  if (relaxed)
    red_add_relaxed_sys((u64*)ch.remote_inbound, 1ull);
  else
    red_add_release_sys((u64*)ch.remote_inbound, 1ull);
}
template <class C>
__device__ __forceinline__ bool channel_wait(const C& c, int opi, const ChannelDev& ch, int id, bool relaxed) {
  u64 expected = atomicAdd((unsigned long long*)ch.expected, 1ull) + 1ull;
  const u64* in = (const u64*)ch.inbound;
  Spin s(opi);
  for (;;) {
    u64 v = relaxed ? ld_relaxed_sys_u64(in) : ld_acquire_sys_u64(in);
    if (v >= expected) return true;
    if (s.tick(c, WHAT_SIGNAL, id, expected, v)) return false;
  }
}

// intra-GPU semaphores (values persist across launches)
template <class C>
__device__ __forceinline__ bool semaphore_acquire(const C& c, int opi, int id) {
  unsigned long long* p = (unsigned long long*)&c.sems[id];
  Spin s(opi);
  for (;;) {
    i64 v = (i64)atomicAdd(p, 0ull);
    if (v > 0 && atomicCAS(p, (unsigned long long)v, (unsigned long long)(v - 1)) == (unsigned long long)v) {
      __threadfence();
      return true;
    }
    if (v <= 0 && s.tick(c, WHAT_SEMAPHORE, id, 1, (u64)v)) return false;
  }
}
template <class C>
__device__ __forceinline__ void semaphore_release(const C& c, int id) {
  __threadfence();
  atomicAdd((unsigned long long*)&c.sems[id], 1ull);
}

// barrier among `count` blocks of this rank on a monotonic arrival counter (thread 0 only)
template <class C>
__device__ __forceinline__ bool block_group_barrier(const C& c, int opi, u32 id, u32 count) {
  __threadfence();
  unsigned long long* p = (unsigned long long*)&c.bars[id];
  u64 arrive = atomicAdd(p, 1ull);
  u64 target = (arrive / count + 1ull) * count;
  Spin s(opi);
  for (;;) {
    u64 v = ld_acquire_gpu_u64((const u64*)p);
    if (v >= target) return true;
    if (s.tick(c, WHAT_BARRIER, (int)id, target, v)) return false;
  }
}

// ------------------------------------------------------------------------------------------------
// port channel device side (mscclang.runtime.proxy is the host side). A port channel's ChannelDev
// entry (after the memory channels) holds: inbound = the u64 counter the peer's proxy writes (its
// monotonic signal count), expected = {u64 expected count, u64 signals sent}, remote_inbound = the
// device plan's port block of the channel: {u32 trigger, u32 done, u64 slot[signals per launch]}.
// The stream front end waits for `trigger >= t` (cuStreamWaitValue32), copies the put's bytes,
// copies slot s (the sent count the block wrote) into the peer's inbound counter for a signal,
// then writes `done = t`. The host zeroes trigger and done before every launch.
#define PORT_SIGNAL 1u
#define PORT_FLUSH 2u
__device__ __forceinline__ void st_release_sys_u32(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_sys_u32(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Post trigger t (thread 0, after the block's earlier writes: the caller syncs first). A signal
// first publishes the channel's next sent count in its slot.
__device__ __forceinline__ void port_trigger(const ChannelDev& ch, u32 t, u32 slot, bool signal) {
  u8* blk = (u8*)ch.remote_inbound;
  if (signal) {
    u64* sent = (u64*)ch.expected + 1;
    const u64 v = *sent + 1ull;
    *sent = v;
    ((volatile u64*)(blk + 8))[slot] = v;
  }
  __threadfence_system();
  st_release_sys_u32((u32*)blk, t);
}
// Wait until the proxy finished trigger t of the channel (bounded).
template <class C>
__device__ __noinline__ bool port_flush_wait(const C& c, int opi, const ChannelDev& ch, int id, u32 t) {
  const u32* done = (const u32*)ch.remote_inbound + 1;
  Spin s(opi);
  for (;;) {
    const u32 v = ld_acquire_sys_u32(done);
    if (v >= t) return true;
    if (s.tick(c, WHAT_PORT_FLUSH, id, t, v)) return false;
  }
}
// Block exit (any path): release every wait the proxy enqueued for this launch on the channel.
__device__ __forceinline__ void port_release(const ChannelDev& ch, u32 final_t) {
  __threadfence_system();
  st_release_sys_u32((u32*)ch.remote_inbound, final_t);
}

// ------------------------------------------------------------------------------------------------
// switch channel (NVLink multicast) access: compiled only; the runtime refuses switch ops unless
// MSCCLANG_ENABLE_NVLS=1 and never creates multicast objects itself.
template <int DT, int OP> __device__ __forceinline__ u32 multimem_ld_reduce_word(const u8* mc) {
  u32 v = 0;
  if (DT == DT_F32) {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.f32 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
  } else if (DT == DT_F16) {
    if (OP == ROP_SUM)
      asm volatile("multimem.ld_reduce.relaxed.sys.global.add.f16x2 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
    else if (OP == ROP_MIN)
      asm volatile("multimem.ld_reduce.relaxed.sys.global.min.f16x2 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
    else
      asm volatile("multimem.ld_reduce.relaxed.sys.global.max.f16x2 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
  } else if (DT == DT_BF16) {
    if (OP == ROP_SUM)
      asm volatile("multimem.ld_reduce.relaxed.sys.global.add.bf16x2 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
    else if (OP == ROP_MIN)
      asm volatile("multimem.ld_reduce.relaxed.sys.global.min.bf16x2 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
    else
      asm volatile("multimem.ld_reduce.relaxed.sys.global.max.bf16x2 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
  } else {
    if (OP == ROP_SUM)
      asm volatile("multimem.ld_reduce.relaxed.sys.global.add.u32 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
    else if (OP == ROP_MIN)
      asm volatile("multimem.ld_reduce.relaxed.sys.global.min.s32 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
    else
      asm volatile("multimem.ld_reduce.relaxed.sys.global.max.s32 %0, [%1];" : "=r"(v) : "l"(mc) : "memory");
  }
  return v;
}
__device__ __forceinline__ void multimem_st_word(u8* mc, u32 v) {
  asm volatile("multimem.st.relaxed.sys.global.b32 [%0], %1;" ::"l"(mc), "r"(v) : "memory");
}
