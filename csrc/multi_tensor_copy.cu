// CUDA kernels of the multi-tensor copy and the bucket checksum (contracts in flatten.h).
//
// Copy kernel: one thread block per fixed-size chunk of a flat task table, so a 1 GB tensor and a
// 256-byte norm weight share one launch and the big one spreads over every SM. A block finds its
// task by binary search over the tasks' first_chunk (the same index for all threads, so the loads
// are broadcasts), then copies its chunk with 16-byte vectors (uint4) when source and destination
// are both 16-byte aligned (the planner aligns bucket offsets to 16; tensors from the caching
// allocator are aligned), narrower vectors for a lesser common alignment, bytes for the remainder.
//
// Only CUDA headers here (see multi_tensor_copy.h): launchers return cudaError_t, never throw.
#include "multi_tensor_copy.h"

#include <cuda_runtime.h>

#include <cstring>

namespace rlperf {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kUnroll = 4;  // independent vector loads in flight per thread before its stores

struct InlineTable {
  CopyTask tasks[kInlineTasks];
  int64_t ntasks;
  __device__ __forceinline__ const CopyTask& operator[](int64_t i) const { return tasks[i]; }
};

struct GlobalTable {
  const CopyTask* tasks;
  int64_t ntasks;
  __device__ __forceinline__ const CopyTask& operator[](int64_t i) const { return tasks[i]; }
};

// Copies (or zero-fills, src == nullptr) n bytes with vectors of type V; the caller guarantees
// src and dst are aligned to sizeof(V).
template <typename V>
__device__ __forceinline__ void copy_chunk(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t n) {
  const int64_t nvec = n / static_cast<int64_t>(sizeof(V));
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  int64_t i = threadIdx.x;
  if (src != nullptr) {
    for (; i + (kUnroll - 1) * kCopyThreads < nvec; i += kUnroll * kCopyThreads) {
      V r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = s[i + u * kCopyThreads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + u * kCopyThreads] = r[u];
    }
    for (; i < nvec; i += kCopyThreads) d[i] = s[i];
    for (int64_t b = nvec * static_cast<int64_t>(sizeof(V)) + threadIdx.x; b < n; b += kCopyThreads) dst[b] = src[b];
  } else {
    const V zero = V();  // value-initialized: all bytes 0 (uint4, uint2, uint32_t, uint8_t)
    for (; i < nvec; i += kCopyThreads) d[i] = zero;
    for (int64_t b = nvec * static_cast<int64_t>(sizeof(V)) + threadIdx.x; b < n; b += kCopyThreads) dst[b] = 0;
  }
}

template <typename Table>
__global__ void __launch_bounds__(kCopyThreads)
    multi_tensor_copy_kernel(const __grid_constant__ Table table, int64_t chunk_bytes) {
  const int64_t chunk = blockIdx.x;
  // Last task whose first_chunk <= chunk; tasks are in first_chunk order and none is empty.
  int64_t lo = 0, hi = table.ntasks - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const CopyTask& task = table[lo];
  const int64_t start = (chunk - task.first_chunk) * chunk_bytes;
  const int64_t n = task.nbytes - start < chunk_bytes ? task.nbytes - start : chunk_bytes;
  const uint8_t* src = task.src == nullptr ? nullptr : task.src + start;
  uint8_t* dst = task.dst + start;
  const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  if (align % 16 == 0) {
    copy_chunk<uint4>(src, dst, n);
  } else if (align % 8 == 0) {
    copy_chunk<uint2>(src, dst, n);
  } else if (align % 4 == 0) {
    copy_chunk<uint32_t>(src, dst, n);
  } else {
    copy_chunk<uint8_t>(src, dst, n);
  }
}

constexpr int kSumThreads = 256;
constexpr int kSumUnroll = 4;  // 16-byte loads in flight per thread

// Per-thread sums of checksum_term, then per warp, then one 64-bit atomicAdd per warp: integer
// addition mod 2^64 is exact and order-free, so the order of the atomics does not change the bits.
template <bool kAligned16>
__global__ void __launch_bounds__(kSumThreads)
    checksum_kernel(const uint8_t* __restrict__ data, int64_t full_words, unsigned long long* out) {
  uint64_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (kAligned16) {
    const ulonglong2* pairs = reinterpret_cast<const ulonglong2*>(data);
    const int64_t npairs = full_words / 2;
    int64_t p = tid;
    for (; p + (kSumUnroll - 1) * stride < npairs; p += kSumUnroll * stride) {
      ulonglong2 v[kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) v[u] = pairs[p + u * stride];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const int64_t q = p + u * stride;
        acc += checksum_term(v[u].x, 2 * q) + checksum_term(v[u].y, 2 * q + 1);
      }
    }
    for (; p < npairs; p += stride) {
      const ulonglong2 v = pairs[p];
      acc += checksum_term(v.x, 2 * p) + checksum_term(v.y, 2 * p + 1);
    }
    if (tid == 0 && full_words % 2 == 1) {
      const int64_t i = full_words - 1;
      acc += checksum_term(reinterpret_cast<const unsigned long long*>(data)[i], i);
    }
  } else {
    for (int64_t i = tid; i < full_words; i += stride) {
      uint64_t w = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) w |= static_cast<uint64_t>(data[8 * i + b]) << (8 * b);
      acc += checksum_term(w, i);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
}

}  // namespace

cudaError_t launch_multi_tensor_copy(const CopyTask* host_tasks, const CopyTask* device_tasks, int64_t ntasks,
                                     int64_t num_chunks, int64_t chunk_bytes, cudaStream_t stream) {
  if (num_chunks == 0 || ntasks == 0) return cudaSuccess;
  if (num_chunks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(num_chunks));
  if (ntasks <= kInlineTasks) {
    if (host_tasks == nullptr) return cudaErrorInvalidValue;
    InlineTable table;
    std::memcpy(table.tasks, host_tasks, static_cast<size_t>(ntasks) * sizeof(CopyTask));
    table.ntasks = ntasks;
    multi_tensor_copy_kernel<InlineTable><<<grid, kCopyThreads, 0, stream>>>(table, chunk_bytes);
  } else {
    if (device_tasks == nullptr) return cudaErrorInvalidValue;
    const GlobalTable table{device_tasks, ntasks};
    multi_tensor_copy_kernel<GlobalTable><<<grid, kCopyThreads, 0, stream>>>(table, chunk_bytes);
  }
  return cudaGetLastError();
}

cudaError_t launch_checksum_words(const uint8_t* data, int64_t full_words, unsigned long long* out, int num_sms,
                                  cudaStream_t stream) {
  if (full_words == 0) return cudaSuccess;
  const int64_t per_block = static_cast<int64_t>(kSumThreads) * 2 * kSumUnroll;  // words per block-iteration
  int64_t blocks = (full_words + per_block - 1) / per_block;
  const int64_t max_blocks = 8LL * (num_sms > 0 ? num_sms : 1);  // 2048 threads per SM
  if (blocks > max_blocks) blocks = max_blocks;
  if (reinterpret_cast<uintptr_t>(data) % 16 == 0) {
    checksum_kernel<true><<<static_cast<unsigned>(blocks), kSumThreads, 0, stream>>>(data, full_words, out);
  } else {
    checksum_kernel<false><<<static_cast<unsigned>(blocks), kSumThreads, 0, stream>>>(data, full_words, out);
  }
  return cudaGetLastError();
}

}  // namespace rlperf
