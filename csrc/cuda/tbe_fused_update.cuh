// What the CUDA handler of jaxrec_tbe_fused_update (tbe_fused_update.cu) hands the
// fused update's kernels (tbe_fused_update_kernels.cuh). The kernels are compiled in two
// units by optimizer family (tbe_fused_update_rowwise.cu, tbe_fused_update_adam.cu): their
// optimizer x weight dtype x index dtype x row width instantiations are most of the CUDA
// build, and two units build in parallel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_util.h"
#include "common/fused_optimizer.h"
#include "cuda/tbe_backward_common.cuh"
#include "cuda/tbe_util.cuh"

namespace jaxrec {
namespace fused_update {

constexpr int kMaxChunks = 8;     // dims up to 8 * 128 = 1024 columns
constexpr int64_t kWindow = 256;  // sorted entries one warp sums before partial rows take over

// A state buffer of runtime dtype (float32, bfloat16 or float16); the branch is uniform.
struct StateBuffer {
  void* data;
  ffi::DataType dtype;

  template <typename T>
  __device__ __forceinline__ T* As() const {
    return static_cast<T*>(data);
  }

  __device__ __forceinline__ float4 Load4(int64_t i, int count) const {
    switch (dtype) {
      case ffi::DataType::BF16:
        return LoadAny4(As<__nv_bfloat16>() + i, count);
      case ffi::DataType::F16:
        return LoadAny4(As<__half>() + i, count);
      default:
        return LoadAny4(As<float>() + i, count);
    }
  }
  __device__ __forceinline__ void Store4(int64_t i, float4 v, int count) const {
    switch (dtype) {
      case ffi::DataType::BF16:
        StoreAny4(As<__nv_bfloat16>() + i, v, count);
        break;
      case ffi::DataType::F16:
        StoreAny4(As<__half>() + i, v, count);
        break;
      default:
        StoreAny4(As<float>() + i, v, count);
    }
  }
  __device__ __forceinline__ float Load(int64_t i) const {
    switch (dtype) {
      case ffi::DataType::BF16:
        return ToFloat(As<__nv_bfloat16>()[i]);
      case ffi::DataType::F16:
        return ToFloat(As<__half>()[i]);
      default:
        return As<float>()[i];
    }
  }
  __device__ __forceinline__ void Store(int64_t i, float v) const {
    switch (dtype) {
      case ffi::DataType::BF16:
        As<__nv_bfloat16>()[i] = FromFloat<__nv_bfloat16>(v);
        break;
      case ffi::DataType::F16:
        As<__half>()[i] = FromFloat<__half>(v);
        break;
      default:
        As<float>()[i] = v;
    }
  }
};

struct FusedArgs {
  BackwardArgs grad;
  OptimizerKind kind;    // the optimizer; its kernel is KernelOf(kind)
  const float* hparams;  // float32[9], device
  const int32_t* step;   // updates so far, device
  StateBuffer state1, state2;
  WeightDecayMode weight_decay_mode;
  bool stochastic_rounding;
  uint32_t seed;
  float* partials;          // [ceil(N / kWindow), max_dim]: each window's head sum (step 1)
  int64_t partial_width;    // max_dim
  int32_t* nonfinite_rows;  // rows kept because their update would not stay finite
  FiniteLimits limits;
};

struct Launch {
  cudaStream_t stream;
  unsigned window_blocks;  // of WindowHeads (LaunchWindowHeads)
  const float* grad;
  void* weights;
  const void* offsets;
  const void* sorted_keys;
  const void* sorted_positions;
  const void* sorted_bags;
};

// Launches kernel kKind of the fused update (tbe_fused_update_kernels.cuh), for optimizer
// a.kind (KernelOf(a.kind) == kKind), on weights W and ids I, for rows of up to max_dim
// (<= 128 * kMaxChunks) columns. Instantiated by the two kernel units.
template <OptimizerKind kKind, typename W, typename I>
void LaunchFused(const Launch& l, int max_dim, const FusedArgs& a);

// Launches step 1's kernel of window heads (tbe_fused_update_kernels.cuh) when a.partials is
// set; before LaunchFused, on the same stream. It depends on neither the optimizer nor the
// weights: instantiated once, by tbe_fused_update_rowwise.cu.
template <typename I>
void LaunchWindowHeads(const Launch& l, int max_dim, const FusedArgs& a);

}  // namespace fused_update
}  // namespace jaxrec
