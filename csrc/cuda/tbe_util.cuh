// Device helpers of the TBE kernels: 4-element loads/stores of f32/f16/bf16 as
// float4, and the per-feature warp schedule written by jaxrec/ops/tbe.py.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace jaxrec {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Programmatic dependent launch (compute capability 9.0 and later; elsewhere these do
// nothing and LaunchDependent launches as usual). The primary kernel lets a dependent one
// start early; the dependent waits for the primary to complete, its writes visible.
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void WaitForPrimaryGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// `kernel` on one block of `threads`, after the work before it on `stream`, allowed to
// start before that work ends where its code has the wait (its first act must be
// WaitForPrimaryGrid): code for compute capability 9.0 or later. Code for an older one
// (e.g. PTX of 8.0 compiled for a newer device) has no wait and launches as usual. The
// check is made once per kernel signature (the first kernel launched with it): kernels
// of one signature must come from one unit, built for the same architectures.
template <typename... Params, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Params...), cudaStream_t stream, int threads, Args... args) {
  static const bool has_wait = [kernel] {
    cudaFuncAttributes attributes = {};
    return cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess && attributes.ptxVersion >= 90;
  }();
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1);
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (has_wait) {
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Four consecutive elements; `p` must be aligned to 4 elements.
__device__ __forceinline__ float4 Load4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 Load4(const __half* p) {
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ float4 Load4(const __nv_bfloat16* p) {
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// Up to four elements [0, count) without alignment; the rest read as 0.
template <typename T>
__device__ __forceinline__ float4 LoadPartial4(const T* p, int count) {
  float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < count) v[j] = ToFloat(p[j]);
  }
  return make_float4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void Store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void Store4(__half* p, float4 v) {
  __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
  uint2 raw = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  *reinterpret_cast<uint2*>(p) = raw;
}
__device__ __forceinline__ void Store4(__nv_bfloat16* p, float4 v) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 raw = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  *reinterpret_cast<uint2*>(p) = raw;
}

template <typename T>
__device__ __forceinline__ void StorePartial4(T* p, float4 v, int count) {
  const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < count) p[j] = FromFloat<T>(f[j]);
  }
}

// Four elements [0, count) through one vector access when `p` allows it.
template <typename T>
__device__ __forceinline__ float4 LoadAny4(const T* p, int count) {
  const bool aligned = reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0;
  return count == 4 && aligned ? Load4(p) : LoadPartial4(p, count);
}

template <typename T>
__device__ __forceinline__ void StoreAny4(T* p, float4 v, int count) {
  const bool aligned = reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0;
  if (count == 4 && aligned) {
    Store4(p, v);
  } else {
    StorePartial4(p, v, count);
  }
}

// How many of the 4 columns from `column` on are inside a row of `dim` columns.
__device__ __forceinline__ int ColumnsLeft(int64_t dim, int64_t column) {
  return dim - column < 4 ? static_cast<int>(dim - column) : 4;
}

__device__ __forceinline__ void Fma4(float4& acc, float w, float4 v) {
  acc.x = fmaf(w, v.x, acc.x);
  acc.y = fmaf(w, v.y, acc.y);
  acc.z = fmaf(w, v.z, acc.z);
  acc.w = fmaf(w, v.w, acc.w);
}

__device__ __forceinline__ float4 Scale4(float4 v, float s) {
  return make_float4(v.x * s, v.y * s, v.z * s, v.w * s);
}

// The warp schedule (int32[2T+1]): feature f owns warps [start[f], start[f+1]); its
// bags go to groups of 2^shift[f] lanes, 32 >> shift[f] bags per warp, each lane
// holding 4 columns of a chunk (so small dims do not leave lanes idle).
struct WarpSchedule {
  const int32_t* start;  // [T + 1]
  const int32_t* shift;  // [T]
  int32_t num_features;

  __device__ __forceinline__ int32_t FeatureOfWarp(int32_t warp) const {
    int32_t lo = 0, hi = num_features;  // start[lo] <= warp < start[hi]
    while (hi - lo > 1) {
      const int32_t mid = (lo + hi) / 2;
      if (__ldg(start + mid) <= warp)
        lo = mid;
      else
        hi = mid;
    }
    return lo;
  }
};

constexpr int kWarpSize = 32;

// The last row of a table of `rows` >= 1 rows as an id of type I (the largest I when the
// table has more rows than I can name).
template <typename I>
__device__ __forceinline__ I LastRow(int64_t rows) {
  constexpr int64_t kMax = sizeof(I) == 4 ? int64_t{INT32_MAX} : INT64_MAX;
  return static_cast<I>(rows - 1 > kMax ? kMax : rows - 1);
}

// Whether `id` is a row of a table whose last row is `last` (LastRow; the table has rows):
// RowInRange's test in I's own width, one unsigned compare, for the hot loops.
template <typename I>
__device__ __forceinline__ bool IdInTable(I id, I last) {
  using U = std::make_unsigned_t<I>;
  return static_cast<U>(id) <= static_cast<U>(last);
}

}  // namespace jaxrec
