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
// every chunk is independent (CUDA: one thread block per chunk, multi_tensor_copy.cu; CPU:
// at::parallel_for over chunks, flatten.cpp). Argument checks and plans live in flatten.cpp and
// run before any device code, for both devices (flatten_cuda.cpp registers the CUDA versions).
// chunk_bytes = 0 picks the device default (kCudaChunkBytes / kCpuChunkBytes in
// multi_tensor_copy.h); other values are for tuning sweeps.
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

#include <vector>

#include <ATen/ATen.h>

#include "multi_tensor_copy.h"

namespace rlperf {

// The checked, flattened work of one pack or unpack call: tasks (zero-byte ranges dropped) and
// the total number of chunks of chunk_bytes each.
struct CopyPlan {
  std::vector<CopyTask> tasks;
  int64_t num_chunks = 0;
};

// Validates arguments (device, dtype, contiguity, bounds, overlaps) with errors that name the
// offending list index, and builds the plan. Shared by CPU and CUDA.
CopyPlan plan_pack(at::TensorList srcs, const at::Tensor& bucket, at::IntArrayRef offsets, int64_t chunk_bytes);
CopyPlan plan_unpack(const at::Tensor& bucket, at::TensorList dsts, at::IntArrayRef offsets, int64_t chunk_bytes);

// Checks a bucket argument: strided, uint8, 1-D, contiguous.
void check_bucket(const char* op, const at::Tensor& bucket);

// Resolves chunk_bytes = 0 to the device default; rejects values that are not positive
// multiples of 16.
int64_t resolve_chunk_bytes(int64_t chunk_bytes, int64_t default_bytes);

}  // namespace rlperf
