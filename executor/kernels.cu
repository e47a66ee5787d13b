// The interpreter kernel, specialised per dtype, packet type (LL8/LL16) and reduce op.
// Kernel names: mscclang_<dtype>_<ll8|ll16>_<sum|min|max>, all with the same parameters:
//   (const u8* plan, u8* input, u8* output, u64 input_delta, u64 output_delta, u64 timeout_ns)
// input_delta/output_delta: offsets of the user buffers inside their (symmetric) allocations, added
// to peers' allocation bases for zero-copy references.
#include "interpreter.cuh"

#define MSCCLANG_KERNEL(NAME, DT, PKT, OP)                                                         \
  extern "C" __global__ void __launch_bounds__(1024, 1)                                            \
      NAME(const u8* __restrict__ plan, u8* input, u8* output, u64 input_delta, u64 output_delta,  \
           u64 timeout_ns) {                                                                       \
    interpret<DT, OP, PKT>(plan, input, output, input_delta, output_delta, timeout_ns);            \
  }

#define MSCCLANG_KERNELS_DT(DTNAME, DT)                                \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll16_sum, DT, 16, ROP_SUM)       \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll16_min, DT, 16, ROP_MIN)       \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll16_max, DT, 16, ROP_MAX)       \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll8_sum, DT, 8, ROP_SUM)         \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll8_min, DT, 8, ROP_MIN)         \
  MSCCLANG_KERNEL(mscclang_##DTNAME##_ll8_max, DT, 8, ROP_MAX)

#ifndef MSCCLANG_ONLY_DTYPE
MSCCLANG_KERNELS_DT(f16, DT_F16)
MSCCLANG_KERNELS_DT(bf16, DT_BF16)
MSCCLANG_KERNELS_DT(f32, DT_F32)
MSCCLANG_KERNELS_DT(i32, DT_I32)
#endif
