// Zero-copy (UVA) gather of per-head KV blocks from pinned host memory into the GPU cache.
//
// For each i with src[i] >= 0: host[src[i], :, heads[i], :] -> dev[dst[i], :, heads[i], :], for K and V,
// in ONE launch (grid = n copies x 2 tensors). The GPU reads the pinned host pages
// directly over PCIe (no staging buffer, no per-block cudaMemcpy).
//
// Built by oasiskv_runtime/ops/uva_gather.py with plain nvcc into a shared library and
// called through ctypes (no torch headers: compiles in seconds). The host pointers are
// translated with cudaHostGetDevicePointer (identity under UVA, but the call also
// verifies that the memory really is pinned and mapped).
//
// Strides are in BYTES. The copy unit (16, 8, 4 or 2 bytes) is the largest that divides
// the row length, every stride and every base address.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

template <typename T, int UNROLL>
__global__ void uva_gather_kernel(const char* __restrict__ hk, const char* __restrict__ hv,
                                  char* __restrict__ dk, char* __restrict__ dv,
                                  const int64_t* __restrict__ src, const int64_t* __restrict__ dst,
                                  const int64_t* __restrict__ heads,
                                  int64_t hs_b, int64_t hs_t, int64_t hs_h,
                                  int64_t ds_b, int64_t ds_t, int64_t ds_h,
                                  int block_size, int row_units) {
  const int64_t i = blockIdx.x;
  if (src[i] < 0) return;  // an unused entry of a fixed-size plan
  const char* h = blockIdx.y ? hv : hk;
  char* d = blockIdx.y ? dv : dk;
  const int64_t head = heads[i];
  const char* sp = h + src[i] * hs_b + head * hs_h;
  char* dp = d + dst[i] * ds_b + head * ds_h;
  const int total = block_size * row_units;
  for (int base = threadIdx.x; base < total; base += blockDim.x * UNROLL) {
    T buf[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // all loads first: UNROLL PCIe reads in flight
      int e = base + u * blockDim.x;
      if (e < total) {
        int r = e / row_units, c = e - r * row_units;
        buf[u] = reinterpret_cast<const T*>(sp + r * hs_t)[c];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      int e = base + u * blockDim.x;
      if (e < total) {
        int r = e / row_units, c = e - r * row_units;
        reinterpret_cast<T*>(dp + r * ds_t)[c] = buf[u];
      }
    }
  }
}

template <typename T>
cudaError_t launch(const char* hk, const char* hv, char* dk, char* dv, const int64_t* src,
                   const int64_t* dst, const int64_t* heads, int64_t n, const int64_t* hs,
                   const int64_t* ds, int block_size, int row_bytes, cudaStream_t stream) {
  const int row_units = row_bytes / (int)sizeof(T);
  const int total = block_size * row_units;
  int threads = total >= 256 ? 256 : (total >= 128 ? 128 : 64);
  dim3 grid((unsigned)n, 2);
  uva_gather_kernel<T, 4><<<grid, threads, 0, stream>>>(hk, hv, dk, dv, src, dst, heads, hs[0],
                                                        hs[1], hs[2], ds[0], ds[1], ds[2],
                                                        block_size, row_units);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

// Returns a cudaError_t (0 = success). host_is_device != 0: hk/hv are device pointers
// already (a CUDA source, for tests); otherwise they must be pinned host memory.
int oasis_uva_gather(uint64_t hk_, uint64_t hv_, uint64_t dk_, uint64_t dv_, uint64_t src_,
                     uint64_t dst_, uint64_t heads_, int64_t n, int64_t hs_b, int64_t hs_t,
                     int64_t hs_h, int64_t ds_b, int64_t ds_t, int64_t ds_h, int block_size,
                     int row_bytes, int host_is_device, uint64_t stream_) {
  if (n <= 0) return 0;
  void* hk = reinterpret_cast<void*>(hk_);
  void* hv = reinterpret_cast<void*>(hv_);
  if (!host_is_device) {
    void* p = nullptr;
    cudaError_t e = cudaHostGetDevicePointer(&p, hk, 0);
    if (e != cudaSuccess) return (int)e;
    hk = p;
    e = cudaHostGetDevicePointer(&p, hv, 0);
    if (e != cudaSuccess) return (int)e;
    hv = p;
  }
  const int64_t hs[3] = {hs_b, hs_t, hs_h};
  const int64_t ds[3] = {ds_b, ds_t, ds_h};
  uint64_t all = (uint64_t)hk | (uint64_t)hv | dk_ | dv_ | (uint64_t)row_bytes;
  for (int k = 0; k < 3; ++k) all |= (uint64_t)hs[k] | (uint64_t)ds[k];
  const char* chk = static_cast<const char*>(hk);
  const char* chv = static_cast<const char*>(hv);
  char* cdk = reinterpret_cast<char*>(dk_);
  char* cdv = reinterpret_cast<char*>(dv_);
  const int64_t* src = reinterpret_cast<const int64_t*>(src_);
  const int64_t* dst = reinterpret_cast<const int64_t*>(dst_);
  const int64_t* heads = reinterpret_cast<const int64_t*>(heads_);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_);
  cudaError_t e;
  if ((all & 15) == 0)
    e = launch<uint4>(chk, chv, cdk, cdv, src, dst, heads, n, hs, ds, block_size, row_bytes, stream);
  else if ((all & 7) == 0)
    e = launch<uint2>(chk, chv, cdk, cdv, src, dst, heads, n, hs, ds, block_size, row_bytes, stream);
  else if ((all & 3) == 0)
    e = launch<uint32_t>(chk, chv, cdk, cdv, src, dst, heads, n, hs, ds, block_size, row_bytes, stream);
  else if ((all & 1) == 0)
    e = launch<uint16_t>(chk, chv, cdk, cdv, src, dst, heads, n, hs, ds, block_size, row_bytes, stream);
  else
    e = launch<uint8_t>(chk, chv, cdk, cdv, src, dst, heads, n, hs, ds, block_size, row_bytes, stream);
  return (int)e;
}

}  // extern "C"
