// The interpreter: each block copies its region of the device plan into shared memory and runs
// its ops in order (design §5). Data ops are done by all threads of the block; channel and
// semaphore ops map thread i to the op's i-th id.
#pragma once
#include "primitives.cuh"

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
// result. Vector width V bytes (16, 4 or the element size).
template <int DT, int OP, int V>
__device__ __forceinline__ void plain_unit(u8* const* p, int ns, int nd, u64 o) {
  if (V == 16) {
    uint4 acc = *(const uint4*)(p[0] + o);
    for (int k = 1; k < ns; ++k) {
      uint4 b = *(const uint4*)(p[k] + o);
      acc.x = red_word<DT, OP>(acc.x, b.x);
      acc.y = red_word<DT, OP>(acc.y, b.y);
      acc.z = red_word<DT, OP>(acc.z, b.z);
      acc.w = red_word<DT, OP>(acc.w, b.w);
    }
    for (int k = 0; k < nd; ++k) *(uint4*)(p[ns + k] + o) = acc;
  } else if (V == 4) {
    u32 acc = *(const u32*)(p[0] + o);
    for (int k = 1; k < ns; ++k) acc = red_word<DT, OP>(acc, *(const u32*)(p[k] + o));
    for (int k = 0; k < nd; ++k) *(u32*)(p[ns + k] + o) = acc;
  } else {  // V == 2: one 16-bit element
    u16 acc = *(const u16*)(p[0] + o);
    for (int k = 1; k < ns; ++k) acc = red_half<DT, OP>(acc, *(const u16*)(p[k] + o));
    for (int k = 0; k < nd; ++k) *(u16*)(p[ns + k] + o) = acc;
  }
}

template <int DT, int OP>
__device__ void plain_range(u8* const* p, int ns, int nd, u64 len) {
  constexpr u32 ES = ElemSize<DT>::value;
  const u32 tid = threadIdx.x, nt = blockDim.x;
  int n = ns + nd;
  u32 m16 = 0, mis16 = 0, mis4 = 0;
  u64 a0 = (u64)p[0];
  for (int k = 1; k < n; ++k) {
    u64 ak = (u64)p[k];
    mis16 |= (u32)((ak ^ a0) & 15u);
    mis4 |= (u32)((ak ^ a0) & 3u);
  }
  m16 = (u32)a0 & 15u;
  if (mis16 == 0) {
    u64 head = (16u - m16) & 15u;
    if (head > len) head = len;
    // head and tail elements
    u64 body = (len - head) & ~15ull;
    u64 tail0 = head + body;
    if (ES == 2) {
      for (u64 o = tid * 2ull; o < head; o += nt * 2ull) plain_unit<DT, OP, 2>(p, ns, nd, o);
      for (u64 o = tail0 + tid * 2ull; o < len; o += nt * 2ull) plain_unit<DT, OP, 2>(p, ns, nd, o);
    } else {
      for (u64 o = tid * 4ull; o < head; o += nt * 4ull) plain_unit<DT, OP, 4>(p, ns, nd, o);
      for (u64 o = tail0 + tid * 4ull; o < len; o += nt * 4ull) plain_unit<DT, OP, 4>(p, ns, nd, o);
    }
    for (u64 o = head + tid * 16ull; o < tail0; o += nt * 16ull) plain_unit<DT, OP, 16>(p, ns, nd, o);
  } else if (mis4 == 0) {
    u64 head = (4u - ((u32)a0 & 3u)) & 3u;
    if (head > len) head = len;
    u64 body = (len - head) & ~3ull;
    u64 tail0 = head + body;
    if (ES == 2) {
      for (u64 o = tid * 2ull; o < head; o += nt * 2ull) plain_unit<DT, OP, 2>(p, ns, nd, o);
      for (u64 o = tail0 + tid * 2ull; o < len; o += nt * 2ull) plain_unit<DT, OP, 2>(p, ns, nd, o);
    }
    for (u64 o = head + tid * 4ull; o < tail0; o += nt * 4ull) plain_unit<DT, OP, 4>(p, ns, nd, o);
  } else {
    // only 16-bit types can be misaligned mod 4 (offsets are multiples of the element size)
    for (u64 o = tid * 2ull; o < len; o += nt * 2ull) plain_unit<DT, OP, 2>(p, ns, nd, o);
  }
}

// ---------------------------------------------------------------------------------------------
// packet path: at least one operand holds packets. Thread handles whole packets (P payload bytes).
template <int DT, int OP, int PKT>
__device__ bool packet_range(const Ctx& c, u8* const* p, const u16* opnd, int ns, int nd, u64 len, u64 valid) {
  typedef Packet<PKT> Pk;
  constexpr u32 P = Pk::kPayload;
  constexpr u32 W = Pk::kWords;
  constexpr u32 ES = ElemSize<DT>::value;
  const u32 tid = threadIdx.x, nt = blockDim.x;
  u64 nunits = (len + P - 1) / P;
  for (u64 u = tid; u < nunits; u += nt) {
    u64 o = u * P;
    u32 nb = (u32)((len - o) < P ? (len - o) : P);
    u32 vb = valid > o ? (u32)((valid - o) < nb ? (valid - o) : nb) : 0u;
    u32 acc[W];
    for (int k = 0; k < ns; ++k) {
      u32 w[W];
      if (opnd[k] >> 8 & OPND_MODE_PACKET) {
        const u8* a = p[k] + 2ull * o;
        Spin s;
        while (!Pk::load(a, w, c.flag)) {
          if (s.tick(c, WHAT_PACKET, -1, c.flag, 0)) return false;
        }
      } else {
        const u8* a = p[k] + o;
        if (vb == P && (((u64)a) & 3u) == 0) {
#pragma unroll
          for (u32 i = 0; i < W; ++i) w[i] = ((const u32*)a)[i];
        } else {
#pragma unroll
          for (u32 i = 0; i < W; ++i) w[i] = 0;
          if (ES == 2) {
            for (u32 b = 0; b < vb; b += 2) {
              u32 e = *(const u16*)(a + b);
              w[b / 4] |= e << ((b & 2u) * 8u);
            }
          } else {
            for (u32 b = 0; b < vb; b += 4) w[b / 4] = *(const u32*)(a + b);
          }
        }
      }
      if (k == 0) {
#pragma unroll
        for (u32 i = 0; i < W; ++i) acc[i] = w[i];
      } else {
#pragma unroll
        for (u32 i = 0; i < W; ++i) acc[i] = red_word<DT, OP>(acc[i], w[i]);
      }
    }
    for (int k = ns; k < ns + nd; ++k) {
      if (opnd[k] >> 8 & OPND_MODE_PACKET) {
        Pk::store(p[k] + 2ull * o, acc, c.flag);
      } else {
        // plain destinations get only the valid bytes (packet slots are written whole)
        u8* a = p[k] + o;
        if (vb == P && (((u64)a) & 3u) == 0) {
#pragma unroll
          for (u32 i = 0; i < W; ++i) ((u32*)a)[i] = acc[i];
        } else if (ES == 2) {
          for (u32 b = 0; b < vb; b += 2) *(u16*)(a + b) = (u16)(acc[b / 4] >> ((b & 2u) * 8u));
        } else {
          for (u32 b = 0; b < vb; b += 4) *(u32*)(a + b) = acc[b / 4];
        }
      }
    }
  }
  return true;
}

// stream range of a data op for this block: pipeline iteration slice, then thread-block-group split
__device__ __forceinline__ void op_range(const DevOp* op, long long iter, u64 unit, u64& A, u64& B) {
  u64 total = op->total;
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

// shared per-op operand bases, double-buffered by data-op parity (one barrier per data op)
struct OpScratch {
  u8* base[2][MSCCLANG_MAX_OPERANDS];
};

template <int DT, int OP, int PKT>
__device__ bool run_data(const Ctx& c, const DevOp* op, long long iter, u64 unit, OpScratch* sh, u32& parity) {
  const u16* opnd = op_operands(op);
  int ns = op->n_src, nd = op->n_dst, n = ns + nd;
  u8** base = sh->base[parity & 1u];
  parity++;
  if ((int)threadIdx.x < n) base[threadIdx.x] = operand_base(c, opnd[threadIdx.x]);
  bool any_packet = false;
  for (int k = 0; k < n; ++k) any_packet |= (opnd[k] >> 8 & OPND_MODE_PACKET) != 0;
  __syncthreads();
  u64 A, B;
  op_range(op, iter, unit, A, B);
  if (A >= B) return true;
  const u64* pc = op_pieces(op);
  u32 stride = 2u + (u32)n;
  u64 pos = 0;
  u8* p[MSCCLANG_MAX_OPERANDS];
  for (u32 i = 0; i < op->n_pieces; ++i, pc += stride) {
    u64 plen = pc[0], pvalid = pc[1];
    u64 lo = A > pos ? A : pos;
    u64 hi = B < pos + plen ? B : pos + plen;
    if (lo < hi) {
      u64 d = lo - pos;
      u64 len = hi - lo;
      u64 valid = pvalid > d ? pvalid - d : 0ull;
      if (any_packet) {
#pragma unroll 1
        for (int k = 0; k < n; ++k) {
          bool pk = (opnd[k] >> 8 & OPND_MODE_PACKET) != 0;
          u64 off = pc[2 + k] + d;
          p[k] = base[k] + (pk ? 2ull * off : off);
        }
        if (!packet_range<DT, OP, PKT>(c, p, opnd, ns, nd, len, valid)) return false;
      } else {
#pragma unroll 1
        for (int k = 0; k < n; ++k) p[k] = base[k] + pc[2 + k] + d;
        plain_range<DT, OP>(p, ns, nd, len);
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

// Runs one op; returns false when the block must stop (abort).
template <int DT, int OP, int PKT>
__device__ bool run_op(Ctx& c, const DevOp* op, long long iter, u64 unit, OpScratch* sh, u32& parity) {
  const u32 tid = threadIdx.x;
  c.op_index = (i32)op->index;
  switch (op->kind) {
    case DOP_NOP:
      __syncthreads();
      return true;
    case DOP_BARRIER: {
      bool ok = true;
      __syncthreads();
      if (tid == 0) ok = block_group_barrier(c, op->aux0, op->aux1);
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
      if (tid < op->n_ids) ok = channel_wait(c, c.chan[ids[tid]], ids[tid], (op->flags & 1u) != 0);
      return !__syncthreads_or(!ok);
    }
    case DOP_DATA: {
      bool ok = run_data<DT, OP, PKT>(c, op, iter, unit, sh, parity);
      if (op->flags & 2u) return !__syncthreads_or(!ok);  // op reads packets: may have aborted
      return true;
    }
    case DOP_SEM_ACQUIRE: {
      const u16* ids = op_ids(op);
      bool ok = true;
      if (tid < op->n_ids) ok = semaphore_acquire(c, ids[tid]);
      return !__syncthreads_or(!ok);
    }
    case DOP_SEM_RELEASE: {
      const u16* ids = op_ids(op);
      if (tid < op->n_ids) semaphore_release(c, ids[tid]);
      return true;
    }
    case DOP_PORT_PUT:
    case DOP_PORT_SIGNAL:
    case DOP_PORT_FLUSH: {
      bool ok = true;
      if (tid == 0) ok = port_fifo_push(c, (const PortFifo*)op->total, (u64)op->aux0, (u64)op->aux1);
      return !__syncthreads_or(!ok);
    }
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

template <int DT, int OP, int PKT>
__device__ __forceinline__ void interpret(const u8* __restrict__ blob, u8* in, u8* out, u64 in_delta,
                                          u64 out_delta, u64 timeout_ns) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 s_flag;
  __shared__ u32 s_stop;
  __shared__ OpScratch s_ops;
  const PlanHeader* H = (const PlanHeader*)blob;
  const BlockEntry be = ((const BlockEntry*)(blob + H->block_table))[blockIdx.x];
  const uint4* src = (const uint4*)(blob + be.offset);
  for (u32 i = threadIdx.x; i < be.bytes / 16u; i += blockDim.x) ((uint4*)smem)[i] = src[i];
  u32* flags = (u32*)H->flags;
  if (threadIdx.x == 0) {
    s_flag = ld_volatile_u32(flags + blockIdx.x);
    s_stop = ld_volatile_u32((const u32*)H->abort_word);
  }
  __syncthreads();
  if (s_stop) {  // a peer or an earlier launch aborted: record it (if nobody did) and exit
    if (threadIdx.x == 0) {
      Ctx c0;
      c0.err = (ErrorRecord*)H->error_record;
      c0.rank = (i32)H->rank;
      c0.op_index = -1;
      record_error(c0, WHAT_PEER_ABORT, -1, 0, 0, 0);
    }
    return;
  }

  Ctx c;
  c.blob = blob;
  c.in = in;
  c.out = out;
  c.scratch = (u8*)H->scratch_base;
  c.in_delta = in_delta;
  c.out_delta = out_delta;
  c.flag = s_flag;
  c.half = (c.flag & 1u) ? 0ull : H->scratch_half;
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
  c.op_index = -1;

  const BlockHeader* bh = (const BlockHeader*)smem;
  const u8* cur = smem + sizeof(BlockHeader);
  u32 parity = 0;
  for (u32 i = 0; i < bh->n_ops; ++i) {
    const DevOp* op = (const DevOp*)cur;
    if (op->kind == DOP_PIPELINE) {
      u32 n_inner = op->aux0, iters = op->aux1;
      u64 unit = op->total;
      const u8* first = cur + op->bytes;
      const u8* after = first;
      for (u32 j = 0; j < n_inner; ++j) after += ((const DevOp*)after)->bytes;
      for (u32 it = 0; it < iters; ++it) {
        const u8* q = first;
        for (u32 j = 0; j < n_inner; ++j) {
          const DevOp* inner = (const DevOp*)q;
          if (!run_op<DT, OP, PKT>(c, inner, (long long)it, unit, &s_ops, parity)) return;
          q += inner->bytes;
        }
      }
      cur = after;
      i += n_inner;
    } else {
      if (!run_op<DT, OP, PKT>(c, op, -1, 0, &s_ops, parity)) return;
      cur += op->bytes;
    }
  }
  // advance this block's flag (block 0 also the slots at and beyond gridDim)
  __syncthreads();
  u32 next = c.flag + 1u;
  if (next == 0u) next = 1u;
  if (threadIdx.x == 0) flags[blockIdx.x] = next;
  if (blockIdx.x == 0)
    for (u32 b = gridDim.x + threadIdx.x; b < MSCCLANG_MAX_FLAGS; b += blockDim.x) flags[b] = next;
}
