// CUDA versions of the multi-tensor pack / unpack / checksum ops (contracts in flatten.h).
//
// Compiled by the host compiler, like every torch-facing file: argument checks (plan_pack /
// plan_unpack), the task-table upload and error reporting happen here, and only plain launchers
// (multi_tensor_copy.cu, no torch headers, no exceptions) run device code.
#if defined(RLPERF_WITH_CUDA)

#include <cstring>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "flatten.h"

namespace rlperf {
namespace {

void run_plan_cuda(const CopyPlan& plan, const at::Tensor& bucket, int64_t chunk_bytes) {
  if (plan.num_chunks == 0) return;
  TORCH_CHECK(plan.num_chunks <= 0x7fffffffLL, "multi-tensor copy: ", plan.num_chunks,
              " chunks exceed one grid; pass a larger chunk_bytes");
  const c10::cuda::CUDAGuard guard(bucket.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(bucket.device().index());
  const int64_t ntasks = static_cast<int64_t>(plan.tasks.size());
  at::Tensor device_table;  // alive until the launch is queued; see below
  const CopyTask* device_tasks = nullptr;
  if (ntasks > kInlineTasks) {
    // Pinned staging buffer from PyTorch's caching host allocator: the async copy records an
    // event on it, so the buffer is not reused before the copy has read it. The device table is
    // freed when this function returns; the caching allocator hands its block only to later work
    // on this stream, which runs after the kernel.
    const int64_t words = ntasks * static_cast<int64_t>(sizeof(CopyTask) / sizeof(int64_t));
    at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr(), plan.tasks.data(), plan.tasks.size() * sizeof(CopyTask));
    device_table = host.to(bucket.device(), at::kLong, /*non_blocking=*/true);
    device_tasks = reinterpret_cast<const CopyTask*>(device_table.data_ptr());
  }
  C10_CUDA_CHECK(launch_multi_tensor_copy(plan.tasks.data(), device_tasks, ntasks, plan.num_chunks, chunk_bytes, stream));
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

int64_t bucket_checksum_cuda(const at::Tensor& bucket) {
  check_bucket("bucket_checksum", bucket);
  const c10::cuda::CUDAGuard guard(bucket.device());
  const int64_t nbytes = bucket.numel();
  const int64_t full_words = nbytes / 8;
  uint64_t sum = 0;
  if (full_words > 0) {
    at::Tensor out = at::zeros({1}, bucket.options().dtype(at::kLong));
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, bucket.device().index()));
    C10_CUDA_CHECK(launch_checksum_words(static_cast<const uint8_t*>(bucket.data_ptr()), full_words,
                                         reinterpret_cast<unsigned long long*>(out.data_ptr()), sms,
                                         c10::cuda::getCurrentCUDAStream(bucket.device().index())));
    const int64_t s = out.item<int64_t>();  // synchronizes with the stream
    std::memcpy(&sum, &s, 8);
  }
  if (nbytes % 8 != 0) {
    // The zero-padded last word: at most 7 bytes, read on the host.
    uint8_t tail[8] = {0};
    const at::Tensor t = bucket.narrow(0, 8 * full_words, nbytes % 8).cpu();
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

#endif  // RLPERF_WITH_CUDA
