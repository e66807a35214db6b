// Argument checks and copy plans shared by both devices, and the CPU implementation of the
// multi-tensor pack / unpack / checksum ops (see flatten.h for their contracts).
#include "flatten.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace rlperf {

int64_t resolve_chunk_bytes(int64_t chunk_bytes, int64_t default_bytes) {
  if (chunk_bytes == 0) return default_bytes;
  // Chunk starts must stay 16-byte aligned relative to their task, so 16-byte vector copies
  // of an aligned task stay aligned in every chunk.
  TORCH_CHECK(chunk_bytes > 0 && chunk_bytes % 16 == 0,
              "chunk_bytes must be 0 (the default) or a positive multiple of 16, got ", chunk_bytes);
  return chunk_bytes;
}

void check_bucket(const char* op, const at::Tensor& bucket) {
  TORCH_CHECK(bucket.layout() == at::kStrided, op, ": bucket must be a strided (dense) tensor");
  TORCH_CHECK(bucket.scalar_type() == at::kByte, op, ": bucket must be uint8, got ", bucket.scalar_type());
  TORCH_CHECK(bucket.dim() == 1, op, ": bucket must be 1-D, got shape ", bucket.sizes());
  TORCH_CHECK(bucket.is_contiguous(), op, ": bucket must be contiguous");
}

namespace {

// The checks every source or destination tensor passes; `what` is "srcs" or "dsts".
int64_t checked_range(const char* op, const char* what, size_t i, const at::Tensor& t, const at::Tensor& bucket,
                      int64_t offset) {
  TORCH_CHECK(t.defined(), op, ": ", what, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", what, "[", i, "] must be a strided (dense) tensor");
  TORCH_CHECK(t.device() == bucket.device(), op, ": ", what, "[", i, "] is on ", t.device(), " but the bucket is on ",
              bucket.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, "[", i, "] (shape ", t.sizes(), ", strides ", t.strides(),
              ") is not contiguous; the byte copy needs contiguous tensors");
  const int64_t nbytes = static_cast<int64_t>(t.nbytes());
  TORCH_CHECK(offset >= 0 && offset <= bucket.numel() && nbytes <= bucket.numel() - offset, op, ": ", what, "[", i,
              "] needs bytes [", offset, ", ", offset + nbytes, ") of a bucket of ", bucket.numel(), " bytes");
  return nbytes;
}

void add_task(CopyPlan& plan, const uint8_t* src, uint8_t* dst, int64_t nbytes, int64_t chunk_bytes) {
  if (nbytes == 0) return;
  plan.tasks.push_back(CopyTask{src, dst, nbytes, plan.num_chunks});
  plan.num_chunks += (nbytes + chunk_bytes - 1) / chunk_bytes;
}

}  // namespace

CopyPlan plan_pack(at::TensorList srcs, const at::Tensor& bucket, at::IntArrayRef offsets, int64_t chunk_bytes) {
  const char* op = "multi_tensor_pack";
  check_bucket(op, bucket);
  TORCH_CHECK(srcs.size() == offsets.size(), op, ": got ", srcs.size(), " srcs but ", offsets.size(), " offsets");
  struct Range {
    int64_t start, nbytes;
    size_t index;
  };
  std::vector<Range> ranges;
  ranges.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const int64_t nbytes = checked_range(op, "srcs", i, srcs[i], bucket, offsets[i]);
    if (nbytes > 0) ranges.push_back({offsets[i], nbytes, i});
  }
  // Sorted by offset, the ranges must not overlap (two sources writing the same bytes would race);
  // the gaps between them, and the tail, become zero-fill tasks so every bucket byte is defined.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.start < b.start; });
  CopyPlan plan;
  plan.tasks.reserve(2 * ranges.size() + 1);
  uint8_t* base = bucket.numel() > 0 ? static_cast<uint8_t*>(bucket.data_ptr()) : nullptr;
  int64_t cursor = 0;
  for (size_t k = 0; k < ranges.size(); ++k) {
    const Range& r = ranges[k];
    TORCH_CHECK(r.start >= cursor, op, ": srcs[", r.index, "] (bytes [", r.start, ", ", r.start + r.nbytes,
                ")) overlaps srcs[", ranges[k - 1].index, "] (bytes [", ranges[k - 1].start, ", ", cursor, "))");
    add_task(plan, nullptr, base + cursor, r.start - cursor, chunk_bytes);
    add_task(plan, static_cast<const uint8_t*>(srcs[r.index].data_ptr()), base + r.start, r.nbytes, chunk_bytes);
    cursor = r.start + r.nbytes;
  }
  if (base != nullptr) add_task(plan, nullptr, base + cursor, bucket.numel() - cursor, chunk_bytes);
  return plan;
}

CopyPlan plan_unpack(const at::Tensor& bucket, at::TensorList dsts, at::IntArrayRef offsets, int64_t chunk_bytes) {
  const char* op = "multi_tensor_unpack";
  check_bucket(op, bucket);
  TORCH_CHECK(dsts.size() == offsets.size(), op, ": got ", dsts.size(), " dsts but ", offsets.size(), " offsets");
  CopyPlan plan;
  plan.tasks.reserve(dsts.size());
  const uint8_t* base = bucket.numel() > 0 ? static_cast<const uint8_t*>(bucket.data_ptr()) : nullptr;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const int64_t nbytes = checked_range(op, "dsts", i, dsts[i], bucket, offsets[i]);
    if (nbytes > 0) add_task(plan, base + offsets[i], static_cast<uint8_t*>(dsts[i].data_ptr()), nbytes, chunk_bytes);
  }
  return plan;
}

namespace {

// One parallel loop over all chunks of all tasks: a thread finds the task of its first chunk by
// binary search on first_chunk, then walks forward.
void run_plan_cpu(const CopyPlan& plan, int64_t chunk_bytes) {
  const std::vector<CopyTask>& tasks = plan.tasks;
  int64_t total_bytes = 0;
  for (const CopyTask& t : tasks) total_bytes += t.nbytes;
  // Below a few MiB one thread's memcpy finishes before a parallel region would pay for itself
  // (waking a worker can cost milliseconds on a loaded machine), so small copies stay serial.
  constexpr int64_t kParallelMinBytes = 4 * 1024 * 1024;
  const int64_t grain = total_bytes >= kParallelMinBytes ? 1 : std::max<int64_t>(plan.num_chunks, 1);
  at::parallel_for(0, plan.num_chunks, grain, [&](int64_t begin, int64_t end) {
    auto it = std::upper_bound(tasks.begin(), tasks.end(), begin,
                               [](int64_t chunk, const CopyTask& t) { return chunk < t.first_chunk; });
    size_t t = static_cast<size_t>(it - tasks.begin()) - 1;
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      while (t + 1 < tasks.size() && tasks[t + 1].first_chunk <= chunk) ++t;
      const CopyTask& task = tasks[t];
      const int64_t start = (chunk - task.first_chunk) * chunk_bytes;
      const int64_t n = std::min(chunk_bytes, task.nbytes - start);
      if (task.src == nullptr) {
        std::memset(task.dst + start, 0, static_cast<size_t>(n));
      } else {
        std::memcpy(task.dst + start, task.src + start, static_cast<size_t>(n));
      }
    }
  });
}

void multi_tensor_pack_cpu(at::TensorList srcs, const at::Tensor& bucket, at::IntArrayRef offsets,
                           int64_t chunk_bytes) {
  chunk_bytes = resolve_chunk_bytes(chunk_bytes, kCpuChunkBytes);
  run_plan_cpu(plan_pack(srcs, bucket, offsets, chunk_bytes), chunk_bytes);
}

void multi_tensor_unpack_cpu(const at::Tensor& bucket, at::TensorList dsts, at::IntArrayRef offsets,
                             int64_t chunk_bytes) {
  chunk_bytes = resolve_chunk_bytes(chunk_bytes, kCpuChunkBytes);
  run_plan_cpu(plan_unpack(bucket, dsts, offsets, chunk_bytes), chunk_bytes);
}

int64_t bucket_checksum_cpu(const at::Tensor& bucket) {
  check_bucket("bucket_checksum", bucket);
  const int64_t nbytes = bucket.numel();
  const uint8_t* data = nbytes > 0 ? static_cast<const uint8_t*>(bucket.data_ptr()) : nullptr;
  const int64_t full_words = nbytes / 8;
  constexpr int64_t kWordsPerBlock = 1 << 17;  // 1 MiB of words per parallel task
  const int64_t nblocks = (full_words + kWordsPerBlock - 1) / kWordsPerBlock;
  std::vector<uint64_t> partial(static_cast<size_t>(nblocks), 0);
  at::parallel_for(0, nblocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint64_t acc = 0;
      const int64_t stop = std::min(full_words, (b + 1) * kWordsPerBlock);
      for (int64_t i = b * kWordsPerBlock; i < stop; ++i) {
        uint64_t w;
        std::memcpy(&w, data + 8 * i, 8);  // little-endian host (x86-64, aarch64); memcpy: any alignment
        acc += checksum_term(w, static_cast<uint64_t>(i));
      }
      partial[static_cast<size_t>(b)] = acc;
    }
  });
  uint64_t sum = std::accumulate(partial.begin(), partial.end(), uint64_t{0});
  if (nbytes % 8 != 0) {
    uint64_t w = 0;
    std::memcpy(&w, data + 8 * full_words, static_cast<size_t>(nbytes % 8));
    sum += checksum_term(w, static_cast<uint64_t>(full_words));
  }
  const uint64_t h = checksum_finish(sum, static_cast<uint64_t>(nbytes));
  int64_t out;
  std::memcpy(&out, &h, 8);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rlperf, CPU, m) {
  m.impl("multi_tensor_pack", &multi_tensor_pack_cpu);
  m.impl("multi_tensor_unpack", &multi_tensor_unpack_cpu);
  m.impl("bucket_checksum", &bucket_checksum_cpu);
}

}  // namespace rlperf
