// Multi-tensor copy between many tensors and one uint8 bucket (rlperf.sync.buckets).
//
// Ops (registered in module.cpp under torch.ops.rlperf):
//   multi_tensor_pack(Tensor[] srcs, Tensor(a!) bucket, int[] offsets, int chunk_bytes=0) -> ()
//       bucket[offsets[i] : offsets[i] + nbytes(srcs[i])] = bytes of srcs[i], for every i, and
//       every byte of the bucket that no source covers is set to 0 (so a bucket's bytes, and its
//       checksum, never depend on uninitialized memory in alignment gaps).
//   multi_tensor_unpack(Tensor bucket, Tensor(a!)[] dsts, int[] offsets, int chunk_bytes=0) -> ()
//       bytes of dsts[i] = bucket[offsets[i] : offsets[i] + nbytes(dsts[i])], for every i.
//   bucket_checksum(Tensor bucket) -> int
//       a 64-bit hash of the bucket's bytes (formula below), returned as a signed int64 whose bits
//       are the unsigned hash.
//
// Both copies are "one launch": the work is cut into fixed-size chunks of a flat task table, and
// every chunk is independent (CUDA: one thread block per chunk; CPU: at::parallel_for over chunks).
// chunk_bytes = 0 picks the default of the device (below); other values are for tuning sweeps.
// Sources and destinations must be contiguous and on the bucket's device; the Python layer
// makes non-contiguous sources contiguous and rejects non-contiguous destinations.
//
// Checksum (identical on CPU, CUDA and the pure-torch fallback in rlperf/sync/buckets.py):
//   read the n bytes as little-endian uint64 words w_0 .. w_{m-1}, m = ceil(n / 8), the last word
//   zero-padded; S = sum_i mix64(w_i + (i + 1) * GOLDEN) mod 2^64; checksum = mix64(S + n) mod 2^64,
//   where mix64 is the splitmix64 finalizer. Integer addition mod 2^64 is associative and
//   commutative, so any parallel order gives the same bits; mix64 is a bijection, so changing any
//   single word changes S.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#if defined(__CUDACC__)
#define RLPERF_HD __host__ __device__ __forceinline__
#else
#define RLPERF_HD inline
#endif

namespace rlperf {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

RLPERF_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

RLPERF_HD uint64_t checksum_term(uint64_t word, uint64_t index) { return mix64(word + (index + 1) * kGolden); }

inline uint64_t checksum_finish(uint64_t word_sum, uint64_t nbytes) { return mix64(word_sum + nbytes); }

// One contiguous byte range to copy; src == nullptr means "fill with zeros" (gaps in a bucket).
// first_chunk is the prefix sum of the chunk counts of the tasks before this one, so a chunk's
// task is found by binary search. 32 bytes, so the table packs into int64 words for the GPU.
struct CopyTask {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
  int64_t first_chunk;
};
static_assert(sizeof(CopyTask) == 32, "CopyTask is shipped to the GPU as 4 int64 words");

// The checked, flattened work of one pack or unpack call: tasks (zero-byte ranges dropped) and
// the total number of chunks of chunk_bytes each.
struct CopyPlan {
  std::vector<CopyTask> tasks;
  int64_t num_chunks = 0;
};

// Validates arguments (device, dtype, contiguity, bounds, overlaps) with errors that name the
// offending list index, and builds the plan. Defined in flatten.cpp, shared by CPU and CUDA.
CopyPlan plan_pack(at::TensorList srcs, const at::Tensor& bucket, at::IntArrayRef offsets, int64_t chunk_bytes);
CopyPlan plan_unpack(const at::Tensor& bucket, at::TensorList dsts, at::IntArrayRef offsets, int64_t chunk_bytes);

// Chunk sizes: a GPU block copies 64 KiB (enough 16-byte vectors per thread to keep loads in
// flight, small enough that one 512 MiB bucket is 8192 blocks, ~16 waves on 132 SMs); a CPU
// thread copies 1 MiB at a time (memcpy is at full speed by then, and tasks still balance).
constexpr int64_t kCudaChunkBytes = 64 * 1024;
constexpr int64_t kCpuChunkBytes = 1024 * 1024;

// Resolves chunk_bytes = 0 to the device default and rejects negative values.
int64_t resolve_chunk_bytes(int64_t chunk_bytes, int64_t default_bytes);

}  // namespace rlperf
