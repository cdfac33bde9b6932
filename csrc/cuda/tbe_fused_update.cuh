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

constexpr int kMaxChunks = 8;  // dims up to 8 * 128 = 1024 columns

// Whether kernel kKind gives rows of up to 128 columns to groups of 8 lanes (four rows per
// warp) rather than a warp each. Measured on an H100 at T=32, E=1e6, D=128, B=4096, L=20
// (benchmarks/results/fused_update_row_groups_h100_2026-11-26.json): SGD 1.50 vs 1.61 ms,
// rowwise Adagrad 1.74 vs 2.07 (its per-row state is one more dependent load, which the
// four rows of a warp overlap); but Adagrad 3.41 vs 2.51 and Adam 5.29 vs 3.79: rows with
// per-element state need twice the registers in a group, and the fewer warps lose more
// than the groups gain.
constexpr bool RowGroups(OptimizerKind kind) {
  return (NumStates(kind) < 1 || State1PerRow(kind)) && (NumStates(kind) < 2 || State2PerRow(kind));
}

// The lanes that hold a row in the kernel of `kind` when the widest row has max_dim columns.
constexpr int RowLanes(OptimizerKind kind, int max_dim) {
  return RowGroups(kind) && max_dim <= 128 ? 8 : kWarpSize;
}

// log2 of the sorted entries a run's own group sums before partial rows (each window's
// head, summed by a warp) take over: 256 for a warp, 64 for a group of 8 lanes, whose
// lanes each load 4x the columns of an entry. With 256 for the groups too, a Zipf head
// id's run was walked by 8 lanes where a warp had walked it before: the row-wise DLRM
// step's update took 642 us instead of 220 on an H200 (docs/fused.md).
constexpr int WindowShift(int lanes) { return lanes == kWarpSize ? 8 : 6; }

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
  int window_shift;         // WindowShift of the kernel's lanes
  float* partials;          // [ceil(N / window), max_dim]: each window's head sum (step 1)
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
