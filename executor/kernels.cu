// The interpreter kernel, specialised per dtype, packet type (LL8/LL16), reduce op and block-size
// bound. Kernel names: mscclang_<dtype>_<ll8|ll16>_<sum|min|max>[_t512], all with the same
// parameters (fp8 dtypes carry their accumulation dtype, f8e4m3_a32 / f8e4m3_a16 ..., and have
// the sum only: MSCCLANG_KERNELS_SUM_DT):
//   (const u8* plan, u8* input, u8* output, u64 input_delta, u64 output_delta, u64 timeout_ns)
// input_delta/output_delta: offsets of the user buffers inside their (symmetric) allocations, added
// to peers' allocation bases for zero-copy references.
// Variants: the plain name is bounded at 1024 threads (64 registers per thread); `_t512` at 512
// threads (128 registers), used for plans of at most 512 threads per block. MSCCLANG_UNROLL is the
// number of 16-byte vectors (or packets) each thread keeps in flight.
#include "interpreter.cuh"

#ifndef MSCCLANG_UNROLL
#define MSCCLANG_UNROLL 4
#endif
// packets per thread per round: fewer under the 1024-thread bound's 64 registers
#ifndef MSCCLANG_UNROLL_PKT_1024
#define MSCCLANG_UNROLL_PKT_1024 2
#endif
#ifndef MSCCLANG_UNROLL_PKT
#define MSCCLANG_UNROLL_PKT 4
#endif

#define MSCCLANG_KERNEL(NAME, DT, PKT, OP, NT)                                                     \
  extern "C" __global__ void __launch_bounds__(NT, 1)                                              \
      NAME(const u8* __restrict__ plan, u8* input, u8* output, u64 input_delta, u64 output_delta,  \
           u64 timeout_ns) {                                                                       \
    interpret<DT, OP, PKT, MSCCLANG_UNROLL, (NT > 512 ? MSCCLANG_UNROLL_PKT_1024 : MSCCLANG_UNROLL_PKT)>( \
        plan, input, output, input_delta, output_delta, timeout_ns);                               \
  }

// The traced variants (mscclang.runtime.trace): the same interpreter with per-op timestamps
// written to `trace` (see trace_mark in interpreter.cuh); names end in _trace. Built only when
// MSCCLANG_TRACED is defined, as their own module: the untraced modules do not change.
#define MSCCLANG_TRACE_KERNEL(NAME, DT, PKT, OP, NT)                                               \
  extern "C" __global__ void __launch_bounds__(NT, 1)                                              \
      NAME##_trace(const u8* __restrict__ plan, u8* input, u8* output, u64 input_delta,           \
                   u64 output_delta, u64 timeout_ns, u64* trace) {                                 \
    interpret<DT, OP, PKT, MSCCLANG_UNROLL, (NT > 512 ? MSCCLANG_UNROLL_PKT_1024 : MSCCLANG_UNROLL_PKT), 1>( \
        plan, input, output, input_delta, output_delta, timeout_ns, trace);                        \
  }

// The epilogue variants (plans with radd / rmsnorm, issue 22): the same interpreter with EPI = 1,
// sum only, one more parameter: the call's EpiArgs (epilogue.cuh), by value. Names end in _epi.
// Kernels of plans without epilogue ops are the same with or without them.
#define MSCCLANG_EPI_KERNEL(NAME, DT, PKT, NT)                                                     \
  extern "C" __global__ void __launch_bounds__(NT, 1)                                              \
      NAME##_epi(const u8* __restrict__ plan, u8* input, u8* output, u64 input_delta,             \
                 u64 output_delta, u64 timeout_ns, const __grid_constant__ EpiArgs epi) {          \
    interpret<DT, ROP_SUM, PKT, MSCCLANG_UNROLL, (NT > 512 ? MSCCLANG_UNROLL_PKT_1024 : MSCCLANG_UNROLL_PKT), 0, 1>( \
        plan, input, output, input_delta, output_delta, timeout_ns, nullptr, &epi);               \
  }
#define MSCCLANG_EPI_KERNELS_DT(DTNAME, DT)                                \
  MSCCLANG_EPI_KERNEL(mscclang_##DTNAME##_ll16_sum, DT, 16, 1024)         \
  MSCCLANG_EPI_KERNEL(mscclang_##DTNAME##_ll8_sum, DT, 8, 1024)           \
  MSCCLANG_EPI_KERNEL(mscclang_##DTNAME##_ll16_sum_t512, DT, 16, 512)     \
  MSCCLANG_EPI_KERNEL(mscclang_##DTNAME##_ll8_sum_t512, DT, 8, 512)

#ifdef MSCCLANG_TRACED
#undef MSCCLANG_KERNEL
#define MSCCLANG_KERNEL MSCCLANG_TRACE_KERNEL
#endif

#define MSCCLANG_KERNELS_NT(DTNAME, DT, SUFFIX, NT)                                  \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll16_sum##SUFFIX, DT, 16, ROP_SUM, NT)         \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll16_min##SUFFIX, DT, 16, ROP_MIN, NT)         \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll16_max##SUFFIX, DT, 16, ROP_MAX, NT)         \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll8_sum##SUFFIX, DT, 8, ROP_SUM, NT)           \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll8_min##SUFFIX, DT, 8, ROP_MIN, NT)           \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll8_max##SUFFIX, DT, 8, ROP_MAX, NT)

#define MSCCLANG_KERNELS_DT(DTNAME, DT)          \
  MSCCLANG_KERNELS_NT(DTNAME, DT, , 1024)        \
  MSCCLANG_KERNELS_NT(DTNAME, DT, _t512, 512)

#define MSCCLANG_KERNELS_SUM_NT(DTNAME, DT, SUFFIX, NT)                         \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll16_sum##SUFFIX, DT, 16, ROP_SUM, NT)         \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll8_sum##SUFFIX, DT, 8, ROP_SUM, NT)

#define MSCCLANG_KERNELS_SUM_DT(DTNAME, DT)      \
  MSCCLANG_KERNELS_SUM_NT(DTNAME, DT, , 1024)    \
  MSCCLANG_KERNELS_SUM_NT(DTNAME, DT, _t512, 512)

#ifndef MSCCLANG_ONLY_DTYPE
MSCCLANG_KERNELS_DT(f16, DT_F16)
MSCCLANG_KERNELS_DT(bf16, DT_BF16)
MSCCLANG_KERNELS_DT(f32, DT_F32)
MSCCLANG_KERNELS_DT(i32, DT_I32)
#ifndef MSCCLANG_TRACED
MSCCLANG_EPI_KERNELS_DT(f16, DT_F16)
MSCCLANG_EPI_KERNELS_DT(bf16, DT_BF16)
MSCCLANG_EPI_KERNELS_DT(f32, DT_F32)
#endif
#endif
