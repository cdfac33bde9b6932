// The fused update's kernels (see tbe_fused_update.cu for the algorithm) and the
// definitions of LaunchFused and LaunchWindowHeads, included by the units that instantiate
// them: LaunchFused for their optimizers (JAXREC_INSTANTIATE_FUSED_UPDATE), LaunchWindowHeads
// in tbe_fused_update_rowwise.cu alone.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "common/fused_optimizer.h"
#include "cuda/tbe_fused_update.cuh"

namespace jaxrec {
namespace fused_update {

// A row as a group of kLanes lanes of a warp holds it (32: the whole warp; 8: four rows
// per warp): element i of the group's lane `lane` is column 4 * kLanes * (i / 4) + 4 * lane
// + i % 4. Every lane of the warp runs Reduce and All together (they shuffle over the
// whole warp; a group's lanes are an aligned block of it, so the sums stay in the group).
template <int kLanes, int kChunks>
struct GroupRow {
  static_assert(kLanes == 8 || kLanes == 16 || kLanes == 32,
                "a group is an aligned power-of-2 block of lanes");
  float w[4 * kChunks], g[4 * kChunks], s1[4 * kChunks], s2[4 * kChunks];
  int64_t dim;
  int lane;             // within the group
  int group;            // within the warp
  unsigned group_mask;  // the group's lanes

  __device__ explicit GroupRow(unsigned thread)
      : lane(static_cast<int>(thread % kLanes)),
        group(static_cast<int>(thread % kWarpSize / kLanes)),
        group_mask(kLanes == kWarpSize ? 0xffffffffu : ((1u << kLanes) - 1) << (group * kLanes)) {}
  __device__ static constexpr int Size() { return 4 * kChunks; }
  __device__ static constexpr int Width() { return 4 * kLanes; }  // columns of one chunk
  __device__ __forceinline__ int64_t Column(int i) const { return Width() * (i / 4) + 4 * lane + i % 4; }
  __device__ __forceinline__ bool valid(int i) const { return Column(i) < dim; }
  __device__ __forceinline__ float Reduce(float x) const {
#pragma unroll
    for (int s = kLanes / 2; s > 0; s /= 2) x += __shfl_xor_sync(0xffffffff, x, s);
    return x;  // every lane of the group holds the same sum (each butterfly step adds a pair both ways)
  }
  __device__ __forceinline__ bool All(bool ok) const {
    return (__ballot_sync(0xffffffff, ok) & group_mask) == group_mask;
  }
};

__device__ __forceinline__ int WarpMax(int x) {
#pragma unroll
  for (int s = kWarpSize / 2; s > 0; s /= 2) x = max(x, __shfl_xor_sync(0xffffffff, x, s));
  return x;
}

__device__ __forceinline__ void Put4(float* dst, float4 v) {
  dst[0] = v.x;
  dst[1] = v.y;
  dst[2] = v.z;
  dst[3] = v.w;
}
__device__ __forceinline__ float4 Get4(const float* src) {
  return make_float4(src[0], src[1], src[2], src[3]);
}

template <typename W>
__device__ __forceinline__ float4 RoundStochastic4(float4 v, const FusedArgs& a, uint32_t step, int64_t key,
                                                   int64_t column) {
  constexpr int kDrop = sizeof(W) == 2 ? (std::is_same_v<W, __nv_bfloat16> ? 16 : 13) : 0;
  if constexpr (kDrop == 0) {
    return v;
  } else {
    return make_float4(StochasticRound(v.x, RoundingBits(a.seed, step, key, column), kDrop),
                       StochasticRound(v.y, RoundingBits(a.seed, step, key, column + 1), kDrop),
                       StochasticRound(v.z, RoundingBits(a.seed, step, key, column + 2), kDrop),
                       StochasticRound(v.w, RoundingBits(a.seed, step, key, column + 3), kDrop));
  }
}

// Adds to row.g the gradient rows of the sorted entries from `begin` on, up to `end` or
// the first entry of another key, in sorted order; a group that is not `active` adds
// none (every lane of the warp calls this: the groups shuffle together). The lanes of a
// group read its entries kLanes at a time (key, position, bag -> scale and gradient row)
// and the group then walks them in order; the gradient loads of successive entries, and
// of the groups' rows, do not depend on each other, so many are in flight at once.
template <int kLanes, int kChunks, typename I>
__device__ __forceinline__ void SumEntries(GroupRow<kLanes, kChunks>& row, const float* __restrict__ grad,
                                           const I* __restrict__ offsets, const I* __restrict__ sorted_keys,
                                           const I* __restrict__ sorted_positions,
                                           const I* __restrict__ sorted_bags, const BackwardArgs& ga,
                                           int64_t begin, int64_t end, I key, bool active) {
#pragma unroll
  for (int e = 0; e < row.Size(); ++e) row.g[e] = 0.f;
  bool more = active;  // the group's entries may go on past those read so far
  for (int64_t base = begin;; base += kLanes) {
    const int64_t j = base + row.lane;
    const bool mine = more && j < end && sorted_keys[j] == key;  // a prefix of the group's lanes
    unsigned long long g_address = 0;
    float scale = 0.f;
    if (mine) {
      const I p = sorted_positions[j];
      const int64_t bag = sorted_bags[j];
      if (RunEntryOk(ga, p, bag)) {  // else address 0: the entry is skipped below
        scale = PositionScale(ga, offsets, bag, p);
        g_address = reinterpret_cast<unsigned long long>(GradRow(ga, grad, bag, bag / ga.batch_size, p));
      }
    }
    const int n = __popc(__ballot_sync(0xffffffff, mine) & row.group_mask);
    const int rounds = kLanes == kWarpSize ? n : WarpMax(n);
#pragma unroll 8
    for (int t = 0; t < rounds; ++t) {
      const float* g = reinterpret_cast<const float*>(__shfl_sync(0xffffffff, g_address, t, kLanes));
      const float entry_scale = __shfl_sync(0xffffffff, scale, t, kLanes);
      if ((kLanes < kWarpSize && t >= n) || g == nullptr) continue;  // the same for the whole group
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int64_t c = row.Column(4 * k);
        if (c < row.dim) {
          float4 acc = Get4(row.g + 4 * k);
          Fma4(acc, entry_scale, LoadAny4(g + c, ColumnsLeft(row.dim, c)));
          Put4(row.g + 4 * k, acc);
        }
      }
    }
    if constexpr (kLanes == kWarpSize) {  // a warp per row: its own count decides, no vote
      if (n < kWarpSize) break;
    } else {
      more = more && n == kLanes;
      if (!__any_sync(0xffffffff, more)) break;
    }
  }
}

// Step 1's partial rows: warp w sums the head of window w, the entries from w * window
// on whose key is that of the entry before (a run that began in an earlier window).
template <int kChunks, typename I>
__global__ void __launch_bounds__((kWarpsPerBlock * kWarpSize))
    WindowHeads(const float* __restrict__ grad, const I* __restrict__ offsets,
                const I* __restrict__ sorted_keys, const I* __restrict__ sorted_positions,
                const I* __restrict__ sorted_bags, FusedArgs a) {
  const BackwardArgs& ga = a.grad;
  const int64_t w = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int64_t begin = w << a.window_shift;
  if (begin == 0 || begin >= ga.num_indices) return;
  const I key = sorted_keys[begin];
  if (key == std::numeric_limits<I>::max() || sorted_keys[begin - 1] != key) return;
  if (!RunEntryOk(ga, sorted_positions[begin], sorted_bags[begin])) return;  // its run is skipped too
  GroupRow<kWarpSize, kChunks> row(threadIdx.x);
  row.dim = ga.dims[sorted_bags[begin] / ga.batch_size];
  SumEntries(row, grad, offsets, sorted_keys, sorted_positions, sorted_bags, ga, begin,
             std::min(begin + (int64_t{1} << a.window_shift), ga.num_indices), key, true);
  float* partial = a.partials + w * a.partial_width;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t c = row.Column(4 * k);
    if (c < row.dim) StoreAny4(partial + c, Get4(row.g + 4 * k), ColumnsLeft(row.dim, c));
  }
}

// Which run heads a launch of the update takes: every one, or (rows in groups of lanes)
// the short runs' heads, the groups' kernel, and the long runs', a warp's (LaunchFused).
enum class Runs { kAll, kShort, kLong };

// A run of at least this many sorted entries is long. A group of 8 lanes loads 4x the
// columns of an entry a lane that a warp does, and a hot id's run (Zipf ids) of hundreds
// of entries took a group 1.9x a warp's time (docs/fused.md, "Groups and Zipf ids").
constexpr int kLongRun = 5;

template <typename I>
__device__ __forceinline__ bool LongRunAt(const I* __restrict__ sorted_keys, int64_t i, int64_t n, I key) {
  return i + kLongRun - 1 < n && sorted_keys[i + kLongRun - 1] == key;
}

// Updates the row of the run headed by sorted entry i, if i heads a run of the class kRuns
// (kLong: the caller found it so). Every lane of the warp calls this (the groups shuffle
// together); a group whose entry heads no such run idles along (no lane leaves before the
// last shuffle). Several rows per warp (RowGroups): each row's loads wait on the loads
// before them, and a warp of four groups keeps four such chains in flight. `a` comes by
// value, as the kernels take it: a reference to the kernel's parameter cost SGD's kernels
// 12 more registers (76 against 64), one block an SM less.
template <OptimizerKind kKind, Runs kRuns, int kLanes, int kChunks, typename W, typename I>
__device__ __forceinline__ void UpdateRun(GroupRow<kLanes, kChunks>& row, const int64_t i,
                                          const float* __restrict__ grad, W* __restrict__ weights,
                                          const I* __restrict__ offsets, const I* __restrict__ sorted_keys,
                                          const I* __restrict__ sorted_positions,
                                          const I* __restrict__ sorted_bags, const FusedArgs a) {
  const BackwardArgs& ga = a.grad;
  bool active = i < ga.num_indices;
  const I key = active ? sorted_keys[i] : I{0};
  active = active && key != std::numeric_limits<I>::max() && !(i > 0 && sorted_keys[i - 1] == key);
  if constexpr (kRuns == Runs::kShort) active = active && !LongRunAt(sorted_keys, i, ga.num_indices, key);
  const int64_t bag = active ? static_cast<int64_t>(sorted_bags[i]) : 0;
  active = active && RunEntryOk(ga, sorted_positions[i], bag);
  // The row comes from the key, as FBGEMM's backward does (key - the table's first row),
  // not from indices[position]: one dependent load less before the row's loads. Inside
  // the feature's table whatever the key (RowInRange); the wrapper's keys are the ids'.
  const int64_t f0 = active ? bag / ga.batch_size : 0;
  const int64_t id = static_cast<int64_t>(key) - (active ? ga.first_rows[f0] : 0);
  active = active && RowInRange(id, ga.rows[f0]);
  if (!__any_sync(0xffffffff, active)) return;  // the whole warp

  int64_t row_start = 0;
  row.dim = 0;  // an idle group: no column is valid, nothing is loaded or stored
  if (active) {
    row.dim = ga.dims[f0];
    row_start = ga.table_offsets[f0] + id * row.dim;
  }

  // Weights and optimizer state in. Adam's and LAMB's kernels (two states a column)
  // issue these loads before the gradient sum, where they overlap its loads; the others
  // load them after it, where fewer registers stay live through the sum. Loading first,
  // measured on an H100 at issue 20's shape: Adam 0.95x the time, rowwise Adagrad 1.00x,
  // Adagrad 1.05x, SGD 1.07x (docs/fused.md).
  constexpr bool kLoadRowFirst = NumStates(kKind) == 2 && !State1PerRow(kKind) && !State2PerRow(kKind);
  constexpr bool kS1Row = State1PerRow(kKind), kS2Row = State2PerRow(kKind);
  constexpr int kStates = NumStates(kKind);
  float s1_row = 0.f, s2_row = 0.f;
  const auto LoadRow = [&] {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t c = row.Column(4 * k);
      const bool in = c < row.dim;
      const int count = in ? ColumnsLeft(row.dim, c) : 0;
      Put4(row.w + 4 * k, in ? LoadAny4(weights + row_start + c, count) : make_float4(0.f, 0.f, 0.f, 0.f));
      if constexpr (kStates >= 1 && !kS1Row) {
        Put4(row.s1 + 4 * k, in ? a.state1.Load4(row_start + c, count) : make_float4(0.f, 0.f, 0.f, 0.f));
      }
      if constexpr (kStates >= 2 && !kS2Row) {
        Put4(row.s2 + 4 * k, in ? a.state2.Load4(row_start + c, count) : make_float4(0.f, 0.f, 0.f, 0.f));
      }
    }
    if constexpr (kS1Row) s1_row = active ? a.state1.Load(key) : 0.f;
    if constexpr (kS2Row) s2_row = active ? a.state2.Load(key) : 0.f;
  };
  if constexpr (kLoadRowFirst) LoadRow();

  // 1. The row's summed gradient, in sorted order: the run's entries in its first window,
  // then the head sums of the windows it continues into.
  const int shift = a.window_shift;
  const int64_t window_end = std::min(((i >> shift) + 1) << shift, ga.num_indices);
  SumEntries(row, grad, offsets, sorted_keys, sorted_positions, sorted_bags, ga, i, window_end, key, active);
  for (int64_t w = (i >> shift) + 1;
       active && (w << shift) < ga.num_indices && sorted_keys[w << shift] == key; ++w) {
    const float* partial = a.partials + w * a.partial_width;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t c = row.Column(4 * k);
      if (c < row.dim) {
        float4 acc = Get4(row.g + 4 * k);
        Fma4(acc, 1.f, LoadAny4(partial + c, ColumnsLeft(row.dim, c)));
        Put4(row.g + 4 * k, acc);
      }
    }
  }

  // 2. Weights and state in (unless loaded before step 1), the optimizer, 3. out.
  if constexpr (!kLoadRowFirst) LoadRow();
  RowUpdateArgs ua;
  ua.h = Hyperparams::Load(a.hparams);
  const int32_t new_step = *a.step + 1;
  ua.step = static_cast<float>(new_step);
  ua.dim = static_cast<float>(active ? row.dim : 1);  // an idle group's row sums stay finite
  ua.weight_decay_mode = a.weight_decay_mode;
  UpdateRowIn<kKind>(a.kind, row, ua, s1_row, s2_row);

  // Stochastic rounding first, so that the check sees the values that would be stored;
  // the row keeps its old values if one would not be finite.
  if (a.stochastic_rounding) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t c = row.Column(4 * k);
      Put4(row.w + 4 * k,
           RoundStochastic4<W>(Get4(row.w + 4 * k), a, static_cast<uint32_t>(new_step), key, c));
    }
  }
  const bool finite = RowStaysFinite<kKind>(row, s1_row, s2_row, a.limits);  // the last shuffle
  if (!active) return;
  if (!finite) {
    if (row.lane == 0) atomicAdd(a.nonfinite_rows, 1);
    return;
  }

#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int64_t c = row.Column(4 * k);
    if (c >= row.dim) continue;
    const int count = ColumnsLeft(row.dim, c);
    StoreAny4(weights + row_start + c, Get4(row.w + 4 * k), count);
    if constexpr (kStates >= 1 && !kS1Row) a.state1.Store4(row_start + c, Get4(row.s1 + 4 * k), count);
    if constexpr (kStates >= 2 && !kS2Row) a.state2.Store4(row_start + c, Get4(row.s2 + 4 * k), count);
  }
  if (row.lane == 0) {
    if constexpr (kS1Row) a.state1.Store(key, s1_row);
    if constexpr (kS2Row) a.state2.Store(key, s2_row);
  }
}

// Sorted entry i goes to group i % (32 / kLanes) of warp i / (32 / kLanes).
template <OptimizerKind kKind, Runs kRuns, int kLanes, int kChunks, typename W, typename I>
__global__ void __launch_bounds__((kWarpsPerBlock * kWarpSize))
    FusedUpdate(const float* __restrict__ grad, W* __restrict__ weights, const I* __restrict__ offsets,
                const I* __restrict__ sorted_keys, const I* __restrict__ sorted_positions,
                const I* __restrict__ sorted_bags, FusedArgs a) {
  constexpr int kGroups = kWarpSize / kLanes;
  GroupRow<kLanes, kChunks> row(threadIdx.x);
  const int64_t i = (int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize) * kGroups + row.group;
  UpdateRun<kKind, kRuns>(row, i, grad, weights, offsets, sorted_keys, sorted_positions, sorted_bags, a);
}

// The long runs: warp w looks at sorted entries 32w to 32w + 31, a lane each, and updates
// the rows of the long runs headed there one after another (at most seven: long runs'
// heads are kLongRun entries apart), all 32 lanes on each.
template <OptimizerKind kKind, int kChunks, typename W, typename I>
__global__ void __launch_bounds__((kWarpsPerBlock * kWarpSize))
    FusedUpdateLongRuns(const float* __restrict__ grad, W* __restrict__ weights,
                        const I* __restrict__ offsets, const I* __restrict__ sorted_keys,
                        const I* __restrict__ sorted_positions, const I* __restrict__ sorted_bags,
                        FusedArgs a) {
  const int64_t n = a.grad.num_indices;
  const int64_t base = (int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize) * kWarpSize;
  const int64_t j = base + threadIdx.x % kWarpSize;
  bool head = false;
  if (j < n) {
    const I key = sorted_keys[j];
    head = key != std::numeric_limits<I>::max() && !(j > 0 && sorted_keys[j - 1] == key) &&
           LongRunAt(sorted_keys, j, n, key);
  }
  GroupRow<kWarpSize, kChunks> row(threadIdx.x);
  for (unsigned heads = __ballot_sync(0xffffffff, head); heads != 0; heads &= heads - 1) {
    UpdateRun<kKind, Runs::kLong>(row, base + __ffs(heads) - 1, grad, weights, offsets, sorted_keys,
                                  sorted_positions, sorted_bags, a);
  }
}

// A row of up to 32 columns (one float4 per lane of a group or warp), up to 128 (four
// float4 per lane of a group of 8 lanes; one per lane of a warp), up to 512, up to 1024.
template <OptimizerKind kKind, typename W, typename I>
void LaunchFused(const Launch& l, int max_dim, const FusedArgs& a) {
  const auto launch = [&](auto kernel, int entries_per_warp) {
    const int64_t per_block = int64_t{kWarpsPerBlock} * entries_per_warp;
    const auto blocks = static_cast<unsigned>((a.grad.num_indices + per_block - 1) / per_block);
    kernel<<<blocks, kWarpsPerBlock * kWarpSize, 0, l.stream>>>(
        l.grad, static_cast<W*>(l.weights), static_cast<const I*>(l.offsets),
        static_cast<const I*>(l.sorted_keys), static_cast<const I*>(l.sorted_positions),
        static_cast<const I*>(l.sorted_bags), a);
  };
  constexpr int kSmall = RowLanes(kKind, 128);  // lanes per row of <= 128 columns
  if constexpr (kSmall < kWarpSize) {           // groups: their short runs, then the long ones by warps
    if (max_dim <= 128) {
      if (max_dim <= 4 * kSmall) {
        launch(FusedUpdate<kKind, Runs::kShort, kSmall, 1, W, I>, kWarpSize / kSmall);
      } else {
        launch(FusedUpdate<kKind, Runs::kShort, kSmall, 128 / (4 * kSmall), W, I>, kWarpSize / kSmall);
      }
      launch(FusedUpdateLongRuns<kKind, 1, W, I>, kWarpSize);  // 32 entries a warp
      return;
    }
  } else if (max_dim <= 128) {
    launch(FusedUpdate<kKind, Runs::kAll, kWarpSize, 1, W, I>, 1);
    return;
  }
  if (max_dim <= 512) {
    launch(FusedUpdate<kKind, Runs::kAll, kWarpSize, 4, W, I>, 1);
  } else {
    launch(FusedUpdate<kKind, Runs::kAll, kWarpSize, kMaxChunks, W, I>, 1);
  }
}

template <typename I>
void LaunchWindowHeads(const Launch& l, int max_dim, const FusedArgs& a) {
  if (a.partials == nullptr) return;
  const auto launch = [&](auto heads) {
    heads<<<l.window_blocks, kWarpsPerBlock * kWarpSize, 0, l.stream>>>(
        l.grad, static_cast<const I*>(l.offsets), static_cast<const I*>(l.sorted_keys),
        static_cast<const I*>(l.sorted_positions), static_cast<const I*>(l.sorted_bags), a);
  };
  if (max_dim <= 128) {
    launch(WindowHeads<1, I>);
  } else if (max_dim <= 512) {
    launch(WindowHeads<4, I>);
  } else {
    launch(WindowHeads<kMaxChunks, I>);
  }
}

}  // namespace fused_update
}  // namespace jaxrec

// LaunchFused for the kernel of optimizer `kind` (an OptimizerKind that is its own
// KernelOf) and every weight and index dtype.
#define JAXREC_INSTANTIATE_FUSED_UPDATE(kind)                                                    \
  static_assert(KernelOf(kind) == kind, "instantiate the kernel that KernelOf names");           \
  template void LaunchFused<kind, float, int32_t>(const Launch&, int, const FusedArgs&);         \
  template void LaunchFused<kind, float, int64_t>(const Launch&, int, const FusedArgs&);         \
  template void LaunchFused<kind, __half, int32_t>(const Launch&, int, const FusedArgs&);        \
  template void LaunchFused<kind, __half, int64_t>(const Launch&, int, const FusedArgs&);        \
  template void LaunchFused<kind, __nv_bfloat16, int32_t>(const Launch&, int, const FusedArgs&); \
  template void LaunchFused<kind, __nv_bfloat16, int64_t>(const Launch&, int, const FusedArgs&);
