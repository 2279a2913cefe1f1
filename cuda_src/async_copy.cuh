// Copies from global to shared memory that do not hold registers while in flight (cp.async, sm_80+): a thread issues
// 16-byte copies, closes them into a group, and later waits until at most N of its groups are still in flight. A
// thread that reads back only the slots it copied itself needs no barrier: its wait is all the ordering they need.
// Before sm_80 the copy is a plain load and store, done when issued.
#pragma once

namespace tiered_ops {

__device__ __forceinline__ void async_copy16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

__device__ __forceinline__ void async_copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void async_copy_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace tiered_ops
