// One-launch copy of many byte ranges (pack many tensors into a buffer, or unpack a buffer into many tensors).
//
// Every block copies one chunk (chunk_bytes, 64 KiB by default) of one task; a block finds its task by binary search
// in the chunk prefix. Inside a chunk the widest word both ends are aligned to is used (16-byte vector loads for the
// usual case of 16-byte aligned offsets), 4x unrolled for memory-level parallelism; head and tail bytes go one by one.
#include <cuda_runtime.h>

#include <cstdint>

#include "elan_cuda.h"

namespace elan {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr std::int64_t kMaxGrid = 1 << 20;

template <typename Word>
__device__ __forceinline__ void copy_words(const unsigned char* src, unsigned char* dst, std::int64_t nbytes) {
  const Word* s = reinterpret_cast<const Word*>(src);
  Word* d = reinterpret_cast<Word*>(dst);
  const std::int64_t words = nbytes / static_cast<std::int64_t>(sizeof(Word));
  const std::int64_t stride = blockDim.x;
  std::int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * stride < words; i += kUnroll * stride) {
    Word r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * stride] = r[u];
  }
  for (; i < words; i += stride) d[i] = s[i];
  for (std::int64_t b = words * static_cast<std::int64_t>(sizeof(Word)) + threadIdx.x; b < nbytes; b += stride) {
    dst[b] = src[b];
  }
}

__device__ void copy_range(const unsigned char* src, unsigned char* dst, std::int64_t nbytes) {
  const std::uintptr_t s = reinterpret_cast<std::uintptr_t>(src);
  const std::uintptr_t d = reinterpret_cast<std::uintptr_t>(dst);
  int width = 16;
  while (width > 1 && ((s ^ d) & static_cast<std::uintptr_t>(width - 1)) != 0) width >>= 1;
  std::int64_t head = static_cast<std::int64_t>((width - (s & static_cast<std::uintptr_t>(width - 1))) &
                                                static_cast<std::uintptr_t>(width - 1));
  if (head > nbytes) head = nbytes;
  for (std::int64_t b = threadIdx.x; b < head; b += blockDim.x) dst[b] = src[b];
  src += head;
  dst += head;
  nbytes -= head;
  switch (width) {
    case 16: copy_words<uint4>(src, dst, nbytes); break;
    case 8: copy_words<uint2>(src, dst, nbytes); break;
    case 4: copy_words<unsigned int>(src, dst, nbytes); break;
    case 2: copy_words<unsigned short>(src, dst, nbytes); break;
    default: copy_words<unsigned char>(src, dst, nbytes); break;
  }
}

__global__ void __launch_bounds__(kThreads) multi_tensor_copy_kernel(const std::int64_t* meta, int ntasks,
                                                                     std::int64_t total_chunks,
                                                                     std::int64_t chunk_bytes) {
  const std::int64_t* srcs = meta;
  const std::int64_t* dsts = meta + ntasks;
  const std::int64_t* sizes = meta + 2 * ntasks;
  const std::int64_t* prefix = meta + 3 * ntasks;
  for (std::int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    int lo = 0;
    int hi = ntasks - 1;
    while (lo < hi) {  // the last task whose first chunk is <= chunk (empty tasks own no chunk)
      const int mid = (lo + hi + 1) / 2;
      if (prefix[mid] <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const std::int64_t begin = (chunk - prefix[lo]) * chunk_bytes;
    std::int64_t n = sizes[lo] - begin;
    if (n > chunk_bytes) n = chunk_bytes;
    const auto* src = reinterpret_cast<const unsigned char*>(srcs[lo]) + begin;
    auto* dst = reinterpret_cast<unsigned char*>(dsts[lo]) + begin;
    copy_range(src, dst, n);
  }
}

}  // namespace

std::int64_t chunk_prefix(const std::int64_t* nbytes, int ntasks, std::int64_t chunk_bytes, std::int64_t* prefix) {
  prefix[0] = 0;
  for (int t = 0; t < ntasks; ++t) prefix[t + 1] = prefix[t] + (nbytes[t] + chunk_bytes - 1) / chunk_bytes;
  return prefix[ntasks];
}

int launch_multi_tensor_copy(const std::int64_t* device_meta, int ntasks, std::int64_t total_chunks,
                             std::int64_t chunk_bytes, int device, std::uintptr_t stream) {
  if (ntasks == 0 || total_chunks == 0) return cudaSuccess;
  int previous = 0;
  cudaError_t error = cudaGetDevice(&previous);
  if (error != cudaSuccess) return error;
  if (previous != device && (error = cudaSetDevice(device)) != cudaSuccess) return error;
  const int grid = static_cast<int>(total_chunks < kMaxGrid ? total_chunks : kMaxGrid);
  multi_tensor_copy_kernel<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(device_meta, ntasks,
                                                                                          total_chunks, chunk_bytes);
  error = cudaGetLastError();
  if (previous != device) cudaSetDevice(previous);
  return error;
}

}  // namespace elan
