// CUDA implementation of the multi-tensor pack / unpack / checksum ops (contracts in flatten.h).
//
// Copy kernel: one thread block per fixed-size chunk of a flat task table, so a 1 GB tensor and a
// 256-byte norm weight share one launch and the big one spreads over every SM. A block finds its
// task by binary search over the tasks' first_chunk (uniform across the block, so the loads are
// broadcasts), then copies its chunk with 16-byte vectors (uint4) when source and destination are
// both 16-byte aligned (the planner aligns bucket offsets to 16; tensors from the caching allocator
// are aligned), narrower vectors for lesser common alignment, and bytes for the remainder.
//
// Task table: up to kInlineTasks tasks travel in the kernel's parameter space (__grid_constant__,
// no host-to-device copy that would sit between two bucket launches on the stream); larger tables
// go through a pinned host buffer and an async copy to a device tensor.
#include "flatten.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace rlperf {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kUnroll = 4;          // independent vector loads in flight per thread before its stores
constexpr int kInlineTasks = 96;    // 96 * 32 B = 3 KiB, under the classic 4 KiB kernel-parameter limit

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

void run_plan_cuda(const CopyPlan& plan, const at::Tensor& bucket, int64_t chunk_bytes) {
  if (plan.num_chunks == 0) return;
  TORCH_CHECK(plan.num_chunks <= static_cast<int64_t>(INT32_MAX), "multi-tensor copy: ", plan.num_chunks,
              " chunks exceed one grid; use a larger chunk_bytes");
  const c10::cuda::CUDAGuard guard(bucket.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(plan.num_chunks));
  const int64_t ntasks = static_cast<int64_t>(plan.tasks.size());
  if (ntasks <= kInlineTasks) {
    InlineTable table;
    std::memcpy(table.tasks, plan.tasks.data(), plan.tasks.size() * sizeof(CopyTask));
    table.ntasks = ntasks;
    multi_tensor_copy_kernel<InlineTable><<<grid, kCopyThreads, 0, stream>>>(table, chunk_bytes);
  } else {
    // Pinned staging buffer from PyTorch's caching host allocator: the async copy below records
    // an event on it, so the buffer is not reused before the copy has read it.
    const int64_t words = ntasks * static_cast<int64_t>(sizeof(CopyTask) / sizeof(int64_t));
    at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr(), plan.tasks.data(), plan.tasks.size() * sizeof(CopyTask));
    at::Tensor device_table = host.to(bucket.device(), at::kLong, /*non_blocking=*/true);
    GlobalTable table{reinterpret_cast<const CopyTask*>(device_table.data_ptr()), ntasks};
    multi_tensor_copy_kernel<GlobalTable><<<grid, kCopyThreads, 0, stream>>>(table, chunk_bytes);
    // device_table is freed when this function returns; the caching allocator only hands its
    // block to later work on this same stream, which runs after the kernel.
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void multi_tensor_pack_cuda(at::TensorList srcs, const at::Tensor& bucket, at::IntArrayRef offsets,
                            int64_t chunk_bytes) {
  chunk_bytes = resolve_chunk_bytes(chunk_bytes, kCudaChunkBytes);
  run_plan_cuda(plan_pack(srcs, bucket, offsets, chunk_bytes), bucket, chunk_bytes);
}

void multi_tensor_unpack_cuda(const at::Tensor& bucket, at::TensorList dsts, at::IntArrayRef offsets,
                              int64_t chunk_bytes) {
  chunk_bytes = resolve_chunk_bytes(chunk_bytes, kCudaChunkBytes);
  run_plan_cuda(plan_unpack(bucket, dsts, offsets, chunk_bytes), bucket, chunk_bytes);
}

constexpr int kSumThreads = 256;

// Sum over full words of checksum_term (mod 2^64), accumulated per thread, then per warp, then one
// 64-bit atomicAdd per warp: integer addition is exact, so the order of atomics does not matter.
template <bool kAligned16>
__global__ void __launch_bounds__(kSumThreads)
    checksum_kernel(const uint8_t* __restrict__ data, int64_t full_words, unsigned long long* out) {
  uint64_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (kAligned16) {
    const ulonglong2* pairs = reinterpret_cast<const ulonglong2*>(data);
    const int64_t npairs = full_words / 2;
    for (int64_t p = tid; p < npairs; p += stride) {
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

int64_t bucket_checksum_cuda(const at::Tensor& bucket) {
  TORCH_CHECK(bucket.scalar_type() == at::kByte && bucket.dim() == 1 && bucket.is_contiguous(),
              "bucket_checksum: bucket must be a contiguous 1-D uint8 tensor");
  const c10::cuda::CUDAGuard guard(bucket.device());
  const int64_t nbytes = bucket.numel();
  const int64_t full_words = nbytes / 8;
  uint64_t sum = 0;
  if (full_words > 0) {
    at::Tensor out = at::zeros({1}, bucket.options().dtype(at::kLong));
    const uint8_t* data = static_cast<const uint8_t*>(bucket.data_ptr());
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, bucket.device().index()));
    const int64_t wanted = (full_words / 2 + kSumThreads - 1) / kSumThreads;
    const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(wanted, 8LL * sms)));
    auto* out_ptr = reinterpret_cast<unsigned long long*>(out.data_ptr());
    if (reinterpret_cast<uintptr_t>(data) % 16 == 0) {
      checksum_kernel<true><<<blocks, kSumThreads, 0, stream>>>(data, full_words, out_ptr);
    } else {
      checksum_kernel<false><<<blocks, kSumThreads, 0, stream>>>(data, full_words, out_ptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t s = out.item<int64_t>();
    std::memcpy(&sum, &s, 8);
  }
  if (nbytes % 8 != 0) {
    // The zero-padded last word: at most 7 bytes, read on the host.
    uint8_t tail[8] = {0};
    at::Tensor t = bucket.narrow(0, 8 * full_words, nbytes % 8).cpu();
    std::memcpy(tail, t.data_ptr(), static_cast<size_t>(nbytes % 8));
    uint64_t w;
    std::memcpy(&w, tail, 8);
    sum += checksum_term(w, static_cast<uint64_t>(full_words));
  }
  const uint64_t h = checksum_finish(sum, static_cast<uint64_t>(nbytes));
  int64_t result;
  std::memcpy(&result, &h, 8);
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(rlperf, CUDA, m) {
  m.impl("multi_tensor_pack", &multi_tensor_pack_cuda);
  m.impl("multi_tensor_unpack", &multi_tensor_unpack_cuda);
  m.impl("bucket_checksum", &bucket_checksum_cuda);
}

}  // namespace rlperf
