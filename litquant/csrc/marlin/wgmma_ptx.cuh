// PTX wrappers of Hopper's warpgroup MMA (wgmma, sm_90a): the shared-memory matrix descriptors, the
// fence / commit / wait of the asynchronous groups, and the instruction m64nNk16 (fp32 accumulators) with its A
// operand from registers (wgmma_rs: wgmma.cu, whose A is the dequantized weight) or from shared memory (wgmma_ss:
// benchmarks/wgmma_rate.cu). Facts from the PTX ISA (wgmma.mma_async, its fragments and descriptors).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace litquant_marlin {

// Shared-memory matrix descriptor of a K-major operand with 128-byte swizzle: start address,
// leading byte offset (unused with this swizzle: 1), stride byte offset 1024 (between 8-row atoms),
// swizzle mode 1 in bits 62-63 (all addresses in units of 16 bytes).
// Its high word is the same for every stage: only the low word (start address and leading byte offset) is
// computed, in 32 bits, and the constant high word is joined to it at the instruction.
__device__ __forceinline__ uint32_t swizzled_descriptor_low(uint32_t address) {
  return ((address & 0x3ffffu) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t swizzled_descriptor(uint32_t low) {
  return ((uint64_t)((1024 >> 4) | (1u << 30)) << 32) | low;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// The registers of this warpgroup's threads set to kRegisters (a multiple of 8 in 24..256): the producer warpgroup
// of a warp-specialized block gives registers back to a pool, which its consumers then take from.
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
// A block barrier among `threads` threads (whole warps) only, by id (0 is __syncthreads').
__device__ __forceinline__ void sync_threads(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Orders this thread's generic-proxy accesses of shared memory (ld.shared, st.shared) before later async-proxy
// ones (bulk copies, wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The asm operands: the N / 2 accumulators of a thread come first (%0 ..), then A (4 registers, or a
// descriptor), B's descriptor and the scale-d flag, whose operand numbers therefore depend on N.
#define LQ_D4(d, o) "+f"(d[(o)]), "+f"(d[(o) + 1]), "+f"(d[(o) + 2]), "+f"(d[(o) + 3])
#define LQ_D16(d, o) LQ_D4(d, o), LQ_D4(d, (o) + 4), LQ_D4(d, (o) + 8), LQ_D4(d, (o) + 12)
#define LQ_D32(d, o) LQ_D16(d, o), LQ_D16(d, (o) + 16)
#define LQ_D64(d, o) LQ_D32(d, o), LQ_D32(d, (o) + 32)
#define LQ_D_8(d) LQ_D4(d, 0)
#define LQ_D_16(d) LQ_D4(d, 0), LQ_D4(d, 4)
#define LQ_D_32(d) LQ_D16(d, 0)
#define LQ_D_64(d) LQ_D32(d, 0)
#define LQ_D_128(d) LQ_D64(d, 0)
#define LQ_D_160(d) LQ_D64(d, 0), LQ_D16(d, 64)
#define LQ_D_192(d) LQ_D64(d, 0), LQ_D32(d, 64)
#define LQ_D_256(d) LQ_D64(d, 0), LQ_D64(d, 64)
#define LQ_A4(a) "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])
#define LQ_ACC_8 "{%0, %1, %2, %3}"
#define LQ_ACC_16 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define LQ_ACC_32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define LQ_ACC_64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define LQ_ACC_128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63}"
#define LQ_ACC_160 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
  "%78, %79}"
#define LQ_ACC_192 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
  "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define LQ_ACC_256 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
  "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
  "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, " \
  "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define LQ_RS_TAIL_8 ", {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n"
#define LQ_RS_PRED_8 "9"
#define LQ_SS_TAIL_8 ", %4, %5, p, 1, 1, 0, 0;\n"
#define LQ_SS_PRED_8 "6"
#define LQ_RS_TAIL_16 ", {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n"
#define LQ_RS_PRED_16 "13"
#define LQ_SS_TAIL_16 ", %8, %9, p, 1, 1, 0, 0;\n"
#define LQ_SS_PRED_16 "10"
#define LQ_RS_TAIL_32 ", {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n"
#define LQ_RS_PRED_32 "21"
#define LQ_SS_TAIL_32 ", %16, %17, p, 1, 1, 0, 0;\n"
#define LQ_SS_PRED_32 "18"
#define LQ_RS_TAIL_64 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
#define LQ_RS_PRED_64 "37"
#define LQ_SS_TAIL_64 ", %32, %33, p, 1, 1, 0, 0;\n"
#define LQ_SS_PRED_64 "34"
#define LQ_RS_TAIL_128 ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
#define LQ_RS_PRED_128 "69"
#define LQ_SS_TAIL_128 ", %64, %65, p, 1, 1, 0, 0;\n"
#define LQ_SS_PRED_128 "66"
#define LQ_RS_TAIL_160 ", {%80, %81, %82, %83}, %84, p, 1, 1, 0;\n"
#define LQ_RS_PRED_160 "85"
#define LQ_SS_TAIL_160 ", %80, %81, p, 1, 1, 0, 0;\n"
#define LQ_SS_PRED_160 "82"
#define LQ_RS_TAIL_192 ", {%96, %97, %98, %99}, %100, p, 1, 1, 0;\n"
#define LQ_RS_PRED_192 "101"
#define LQ_SS_TAIL_192 ", %96, %97, p, 1, 1, 0, 0;\n"
#define LQ_SS_PRED_192 "98"
#define LQ_RS_TAIL_256 ", {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n"
#define LQ_RS_PRED_256 "133"
#define LQ_SS_TAIL_256 ", %128, %129, p, 1, 1, 0, 0;\n"
#define LQ_SS_PRED_256 "130"
// scale-d is the predicate p (accumulate into d, or overwrite it). FORM is RS or SS.
#define LQ_WGMMA(FORM, N, TYPE)                                                                                      \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" LQ_##FORM##_PRED_##N ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N \
  "k16.f32." TYPE "." TYPE " " LQ_ACC_##N LQ_##FORM##_TAIL_##N "}\n"
#define LQ_WGMMA_CALL(FORM, N, ...)                                                                                  \
  if constexpr (std::is_same<T, __nv_bfloat16>::value)                                                               \
    asm volatile(LQ_WGMMA(FORM, N, "bf16") : LQ_D_##N(d) : __VA_ARGS__, "l"(desc), "r"(accumulate));                 \
  else                                                                                                               \
    asm volatile(LQ_WGMMA(FORM, N, "f16") : LQ_D_##N(d) : __VA_ARGS__, "l"(desc), "r"(accumulate))
// The instruction for the N of the caller (a template parameter); the arguments are A's asm operands.
#define LQ_WGMMA_ANY_N(FORM, ...)                                                                                    \
  static_assert(N == 8 || N == 16 || N == 32 || N == 64 || N == 128 || N == 160 || N == 192 || N == 256,             \
                "wgmma: 8, 16, 32, 64, 128, 160, 192 or 256 columns");                                               \
  if constexpr (N == 8) { LQ_WGMMA_CALL(FORM, 8, __VA_ARGS__); }                                                     \
  else if constexpr (N == 16) { LQ_WGMMA_CALL(FORM, 16, __VA_ARGS__); }                                              \
  else if constexpr (N == 32) { LQ_WGMMA_CALL(FORM, 32, __VA_ARGS__); }                                              \
  else if constexpr (N == 64) { LQ_WGMMA_CALL(FORM, 64, __VA_ARGS__); }                                              \
  else if constexpr (N == 128) { LQ_WGMMA_CALL(FORM, 128, __VA_ARGS__); }                                            \
  else if constexpr (N == 160) { LQ_WGMMA_CALL(FORM, 160, __VA_ARGS__); }                                            \
  else if constexpr (N == 192) { LQ_WGMMA_CALL(FORM, 192, __VA_ARGS__); }                                            \
  else { LQ_WGMMA_CALL(FORM, 256, __VA_ARGS__); }

// d[64 x N] = A[64 x 16] (this thread's fragment `a`, registers) * B[16 x N] (shared memory, `desc`),
// plus d if `accumulate`; d is this thread's N / 2 accumulators. (Starting with accumulate = 0 rather
// than zeroing d keeps ordinary instructions from writing the accumulators, which makes ptxas
// serialize the wgmmas.)
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  LQ_WGMMA_ANY_N(RS, LQ_A4(a))
#endif
}

// The same with A read from shared memory too (`a_desc`, K-major like B).
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a_desc, uint64_t desc, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  LQ_WGMMA_ANY_N(SS, "l"(a_desc))
#endif
}

}  // namespace litquant_marlin
