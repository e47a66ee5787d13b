// Device-plan layout shared by the interpreter kernel and mscclang.runtime.device_plan.
//
// The host (Python) packs one blob per (plan, rank, sizes): a PlanHeader, tables, and one region
// per thread block holding its ops. Every op's operands are already resolved to
// (buffer slot, byte offset, length) pieces, so the kernel only walks byte ranges. All offsets and
// sizes are 64-bit. The Python side describes the same structs field by field and generates
// `static_assert(offsetof(...) == N)` lines (mscclang.runtime.device_plan.layout_asserts), which
// CI compiles with NVRTC so the two layouts cannot drift.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define MSCCLANG_PLAN_MAGIC 0x4C43534Du   // "MSCL"
#define MSCCLANG_PLAN_VERSION 2u
#define MSCCLANG_MAX_FLAGS 1024           // flag slots per scratch (>= blocks of any plan)
#define MSCCLANG_MAX_BARRIERS 64          // barrier ids per rank
#define MSCCLANG_MAX_OPERANDS 16          // sources + destinations of one op
#define MSCCLANG_MAX_IDS 32               // channels / semaphores of one op

// Op kinds of the device plan (the Python packer maps plan op names onto these).
enum DevOpKind : u32 {
  DOP_NOP = 0,        // __syncthreads
  DOP_BARRIER = 1,    // barrier among listed blocks: aux0 = barrier id, aux1 = count
  DOP_SIGNAL = 2,     // thread i signals memory channel ids[i] (flags bit0: relaxed)
  DOP_WAIT = 3,       // thread i waits on memory channel ids[i] (flags bit0: relaxed)
  DOP_DATA = 4,       // generic data op: sources (plain or packets) reduced into destinations
  DOP_SEM_ACQUIRE = 5,
  DOP_SEM_RELEASE = 6,
  DOP_PIPELINE = 7,   // aux0 = number of inner ops that follow, aux1 = iterations, total = unit
  DOP_PORT_TRIGGER = 8,  // port put/signal: ids[0] = channel entry; flags PORT_SIGNAL/PORT_FLUSH;
                         // trigger aux0 + it * (total & 0xffffffff), slot aux1 + it * (total >> 32)
  DOP_PORT_FLUSH = 9,    // wait until the proxy finished trigger aux0 + it * total (0: nothing posted)
  DOP_PORT_FINAL = 10,   // at block exit: set channel ids[0]'s trigger to aux0 (releases the proxy)
  DOP_SWITCH_REDUCE = 11,   // glre/glres: multimem load-reduce (compiled only)
  DOP_SWITCH_STORE = 12,    // gstore: multimem store (compiled only)
  DOP_RADD = 13,     // residual add: a data op with sources (src, residual), destination residual
  DOP_RMSNORM = 14,  // row-wise RMSNorm: pieces {length, valid, residual offset, output offset}
};

// operand descriptor (u16): low byte = slot, high byte = mode bits
#define OPND_SLOT_INPUT 0
#define OPND_SLOT_OUTPUT 1
#define OPND_SLOT_SCRATCH 2
#define OPND_SLOT_REMOTE0 3       // slot 3 + k = remote buffer k of the rank
#define OPND_SLOT_RESIDUAL 255   // the call's residual (epilogue kernels only; never remote)
#define OPND_MODE_PACKET 1        // operand holds LL packets (address = base + 2 * offset)

#define BUF_KIND_INPUT 0
#define BUF_KIND_OUTPUT 1
#define BUF_KIND_SCRATCH 2

// what a bounded spin waited for (ErrorRecord.what)
#define WHAT_SIGNAL 1
#define WHAT_PACKET 2
#define WHAT_BARRIER 3
#define WHAT_SEMAPHORE 4
#define WHAT_PEER_ABORT 5
#define WHAT_PORT_FLUSH 6
#define WHAT_COUNTS 7     // the count matrix failed a check (ErrorRecord: op_index = CHECK_*, see CountCheck)

// DevOp.flags bits
#define FLAG_RELAXED 1u
#define FLAG_READS_PACKETS 2u
#define FLAG_SEGMENTS 4u  // a data op over segments: pieces {count entry i*n+j, 0, operand words...}

// Data-dependent counts (plans with segmented buffers). The header's `counts` is the call's int32
// matrix [n][2n+2]: row i = rank i's contribution (columns 0..n-1 counts[i][j], n its input rows,
// n+1 its output rows, n+2+j the rows it expects from rank j, -1: not stated). A segment data op's
// piece length is counts[i][j] * row_bytes; its operand word w gives the operand's byte offset:
// (w & 0xffffffff) == SEG_SLOT: a scratch slot, offset (w >> 32) * capacity * row_bytes;
// otherwise a packed buffer, offset row_bytes * (sum of counts of the (w >> 32) entries at u32
// index (w & 0xffffffff) of the segment table: the segments before it in the owner's buffer).
#define SEG_SLOT 0xffffffffu
#define CHECK_NONNEG 0    // entries [first, first + count) of the segment table: each >= 0
#define CHECK_EXPECT 1    // rank i = rank, j = first: counts[i][n+2+j] < 0 or == counts[j][i]
#define CHECK_INPUT 2     // sum of the entries <= counts[rank][n]
#define CHECK_OUTPUT 3    // sum of the entries <= counts[rank][n+1]
#define CHECK_SCRATCH 4   // each entry <= capacity

struct PlanHeader {
  u32 magic;
  u32 version;
  u32 n_blocks;
  u32 rank;
  u64 sync_base;        // this rank's sync area (device pointer)
  u64 scratch_base;     // this rank's scratch (device pointer)
  u64 scratch_half;     // bytes of one half with double scratch, else 0
  u64 flags;            // u32[MSCCLANG_MAX_FLAGS] in device memory
  u64 abort_word;       // u32 polled by every block of this rank
  u64 error_record;     // ErrorRecord in host-mapped memory
  u64 semaphores;       // i64[n_semaphores] in device memory
  u64 barriers;         // u64[MSCCLANG_MAX_BARRIERS] monotonic arrival counters
  u32 n_peers;          // entries of the peer-abort table
  u32 n_remote;         // entries of the remote-buffer table
  u32 n_channels;       // entries of the channel table
  u32 n_semaphores;
  u64 peer_abort_table; // blob offset of u64[n_peers]: peers' abort words (IPC mapped)
  u64 remote_table;     // blob offset of RemoteBuf[n_remote]
  u64 channel_table;    // blob offset of ChannelDev[n_channels]
  u64 block_table;      // blob offset of BlockEntry[n_blocks]
  // data-dependent counts (all zero when the plan has no segments)
  u64 counts;           // i32[n_ranks][2 n_ranks + 2] count matrix (device pointer, fixed per communicator)
  u64 row_bytes;        // bytes of one row
  u64 capacity;         // rows of one scratch slot
  u64 seg_table;        // blob offset of the u32 segment table (count entries i*n+j)
  u64 check_table;      // blob offset of CountCheck[n_checks]
  u32 n_ranks;
  u32 n_checks;         // count checks every block runs before any data moves (0: none)
};

// One constraint on the count matrix (CHECK_*), the same table on every rank.
struct CountCheck {
  u32 kind;
  u32 rank;    // the rank whose buffer (or expectation) it bounds
  u32 first;   // u32 index into the segment table (CHECK_EXPECT: the sender j)
  u32 count;   // entries
};

struct RemoteBuf {
  u64 base;   // peer's allocation base, mapped here through IPC
  u32 kind;   // BUF_KIND_*
  u32 pad;
};

struct ChannelDev {
  u64 inbound;          // u64 counter the peer signals (local device memory)
  u64 remote_inbound;   // the peer's counter for the paired channel (IPC mapped)
  u64 expected;         // u64 expected count for waits (local device memory)
};

struct BlockEntry {
  u32 offset;   // blob offset of the block's region
  u32 bytes;    // size of the region (copied into shared memory)
};

struct BlockHeader {
  u32 n_ops;
  u32 bytes;
  u32 n_finals;   // DOP_PORT_FINAL records at the end of the region (port channels the block owns)
  u32 pad;
};

// One op record, followed by: u16 operand descriptors [n_src + n_dst] padded to 8 bytes,
// u16 ids [n_ids] padded to 8 bytes, then n_pieces pieces of (2 + n_src + n_dst) u64 words:
// {length, valid, offset[operand]...}. Bytes of a piece past `valid` read as zero from plain
// sources (packet writes cover whole scratch slots).
struct DevOp {
  u8 kind;
  u8 n_src;
  u8 n_dst;
  u8 n_ids;
  u16 n_pieces;
  u16 flags;        // bit0: relaxed signal/wait
  u32 bytes;        // size of this record (inner ops of a pipeline follow it, not counted)
  u32 index;        // op index in the plan's thread block (for error records)
  u32 tbg_member;
  u32 tbg_size;
  u64 total;        // data ops: bytes of the op's stream; pipeline: unit size
  u32 aux0;
  u32 aux1;
  u64 tbg_unit;     // thread-block-group split unit, max(alignment, 8)
};

// Written by the first block that gives up; read by the host.
struct ErrorRecord {
  u32 state;        // 0 none, 1 being written, 2 complete
  i32 rank;
  i32 block;
  i32 op_index;
  i32 what;
  i32 channel;
  u64 expected;
  u64 seen;
  u64 elapsed_ns;
  u32 host_ack;     // set by the host once the abort is on its way to the caller (hold_for_host)
  u32 pad;
};
