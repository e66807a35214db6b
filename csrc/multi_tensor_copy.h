// Plain C++/CUDA declarations shared by the op layer (flatten*.cpp) and the CUDA kernels
// (multi_tensor_copy.cu). No torch headers here: the .cu file compiles against CUDA alone, and no
// C++ exception ever has to cross a frame that nvcc compiled (launchers return cudaError_t; the
// op layer, compiled by the host compiler, turns errors into exceptions).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RLPERF_HD __host__ __device__ __forceinline__
#else
#define RLPERF_HD inline
#endif

namespace rlperf {

// ---- checksum formula (documented in flatten.h and rlperf/sync/buckets.py) ----
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// splitmix64 finalizer: a bijection on 64-bit words.
RLPERF_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

RLPERF_HD uint64_t checksum_term(uint64_t word, uint64_t index) { return mix64(word + (index + 1) * kGolden); }

inline uint64_t checksum_finish(uint64_t word_sum, uint64_t nbytes) { return mix64(word_sum + nbytes); }

// ---- copy tasks ----
// One contiguous byte range to copy; src == nullptr means "fill with zeros" (gaps in a bucket).
// first_chunk is the prefix sum of the chunk counts of the tasks before this one, so a chunk's
// task is found by binary search. 32 bytes, so a table ships to the GPU as int64 words.
struct CopyTask {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
  int64_t first_chunk;
};
static_assert(sizeof(CopyTask) == 32, "CopyTask is shipped to the GPU as 4 int64 words");

// Chunk sizes. GPU: a block of 256 threads copies 16 KiB, i.e. each thread one batch of four
// independent 16-byte loads then four stores. Packing 8.04 GB on an H200 (fraction of one
// device-to-device copy, one run each): 4K 0.75, 8K 0.87, 16K 0.975, 32K 0.95, 64K 0.93,
// 256K 0.90, 1M 0.87. Smaller chunks leave threads with fewer loads in flight than the unroll;
// larger ones make fewer, longer blocks that drain unevenly. CPU: a thread copies 1 MiB at a
// time (memcpy is at full speed by then, and tasks still balance across threads).
constexpr int64_t kCudaChunkBytes = 16 * 1024;
constexpr int64_t kCpuChunkBytes = 1024 * 1024;

// Tables of at most this many tasks travel in the kernel's parameter space (no host-to-device
// copy queued between two bucket launches); larger ones need a device copy of the table.
constexpr int64_t kInlineTasks = 96;  // 96 * 32 B = 3 KiB, under the classic 4 KiB parameter limit

}  // namespace rlperf

#if defined(RLPERF_WITH_CUDA)
#include <cuda_runtime_api.h>

namespace rlperf {

// Copies every chunk of `tasks` in one launch on `stream`. host_tasks: the table in host memory
// (used when ntasks <= kInlineTasks); device_tasks: the same table in device memory (required
// otherwise). Returns the launch error, if any.
cudaError_t launch_multi_tensor_copy(const CopyTask* host_tasks, const CopyTask* device_tasks, int64_t ntasks,
                                     int64_t num_chunks, int64_t chunk_bytes, cudaStream_t stream);

// Adds sum_i checksum_term(w_i, i) over the first full_words little-endian words of data into
// *out (mod 2^64) on `stream`; *out must be zeroed first. data may have any alignment.
cudaError_t launch_checksum_words(const uint8_t* data, int64_t full_words, unsigned long long* out, int num_sms,
                                  cudaStream_t stream);

}  // namespace rlperf
#endif
