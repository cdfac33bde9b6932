// A batch's positions sorted by the table row each reads, on the GPU, inside the handler
// that walks them (the fused update): the same keys, order and bags as the CPU's
// (cpu/row_sort.h) and the jnp reference (jaxrec.ops.row_sort.sort_by_row_reference).
//
// Position p inside bag k (feature f = k / B) whose id is a row of f's table has key
// first_rows[f] + id; every other position, and a key not below total_rows, has the
// dtype's max. Its bag is k, -1 before the first bag and T*B after the last.
//
// One kernel writes each position's key, bag and position; CUB's radix sort (stable)
// orders the (key, position) pairs over the low bit_width(total_rows) bits only, the bits
// a row key has: the sentinel's low bits are all ones, so it still sorts after every key
// below total_rows; a second kernel gathers the bags in sorted order. Sorted here rather
// than by XLA before the handler, the sort takes no more passes than the row count needs,
// and splits none of the command buffers (CUDA graphs) XLA launches the step's kernels as:
// XLA does not record its sort in them, and the handler already stands between two.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "cuda/scratch.cuh"
#include "cuda/tbe_backward_common.cuh"

namespace jaxrec {
namespace row_sort {

constexpr int kThreads = 256;

// Key, bag and position of every position p < args.num_indices.
template <typename I>
__global__ void __launch_bounds__(kThreads)
    RowKeys(const I* __restrict__ indices, const I* __restrict__ offsets, BackwardArgs args,
            int64_t total_rows, I* __restrict__ keys, I* __restrict__ positions, I* __restrict__ bags) {
  const int64_t p = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (p >= args.num_indices) return;
  const int64_t num_bags = args.num_features * args.batch_size;
  I key = std::numeric_limits<I>::max();
  int64_t bag;
  if (p < offsets[0]) {
    bag = -1;
  } else if (p >= offsets[num_bags]) {
    bag = num_bags;
  } else {
    bag = BagOf(offsets, num_bags, static_cast<I>(p));
    const int64_t f = bag / args.batch_size;
    const I id = indices[p];
    if (RowInRange(id, args.rows[f])) {
      const int64_t row = args.first_rows[f] + static_cast<int64_t>(id);
      if (row < total_rows) key = static_cast<I>(row);
    }
  }
  keys[p] = key;
  positions[p] = static_cast<I>(p);
  bags[p] = static_cast<I>(bag);
}

template <typename I>
__global__ void __launch_bounds__(kThreads)
    GatherBags(const I* __restrict__ bags, const I* __restrict__ sorted_positions, int64_t n,
               I* __restrict__ sorted_bags) {
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i < n) sorted_bags[i] = bags[sorted_positions[i]];
}

// The sort's arrays, carved out of `base` (null: to count their bytes).
template <typename I>
struct Work {
  Work(char* base, int64_t n, size_t cub_bytes) {
    Carve c(base);
    keys_in = c.Take<I>(n);
    positions_in = c.Take<I>(n);
    bags_in = c.Take<I>(n);
    keys = c.Take<I>(n);
    positions = c.Take<I>(n);
    bags = c.Take<I>(n);
    cub_storage = c.Take<char>(static_cast<int64_t>(cub_bytes));
    bytes = c.used();
  }
  I *keys_in, *positions_in, *bags_in, *keys, *positions, *bags;
  char* cub_storage;
  size_t bytes;
};

}  // namespace row_sort

// The sorted keys, positions and bags, each I[N], in the handler's scratch memory.
template <typename I>
struct SortedRows {
  const I* keys = nullptr;
  const I* positions = nullptr;
  const I* bags = nullptr;
};

// Sorts the batch's positions by row key on `stream` (see above). The offsets must already
// be corrected (non-decreasing, inside [0, N]: the wrappers clamp them); total_rows is the
// tables' row count (the validation checked it fits I).
template <typename I>
ffi::Error SortByRow(cudaStream_t stream, ffi::ScratchAllocator& scratch, std::string_view op,
                     const BackwardArgs& args, const I* indices, const I* offsets, int64_t total_rows,
                     SortedRows<I>* out) {
  using U = std::make_unsigned_t<I>;  // the keys are >= 0: the same order, no sign bit to flip
  const int64_t n = args.num_indices;
  const int bits = BitWidth(static_cast<uint64_t>(total_rows)) + (total_rows == 0);
  size_t cub_bytes = 0;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<const U*>(nullptr),
                                                    static_cast<U*>(nullptr), static_cast<const I*>(nullptr),
                                                    static_cast<I*>(nullptr), n, 0, bits, stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": sort: " + cudaGetErrorString(err));
  std::optional<row_sort::Work<I>> work;
  if (ffi::Error e = AllocateWork(scratch, op, &work, n, cub_bytes); e.failure()) return e;
  const row_sort::Work<I>& w = *work;
  const unsigned blocks = static_cast<unsigned>((n + row_sort::kThreads - 1) / row_sort::kThreads);
  row_sort::RowKeys<I><<<blocks, row_sort::kThreads, 0, stream>>>(indices, offsets, args, total_rows,
                                                                  w.keys_in, w.positions_in, w.bags_in);
  size_t storage = cub_bytes;
  err = cub::DeviceRadixSort::SortPairs(w.cub_storage, storage, reinterpret_cast<const U*>(w.keys_in),
                                        reinterpret_cast<U*>(w.keys), w.positions_in, w.positions, n, 0, bits,
                                        stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": sort: " + cudaGetErrorString(err));
  row_sort::GatherBags<I><<<blocks, row_sort::kThreads, 0, stream>>>(w.bags_in, w.positions, n, w.bags);
  err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": sort: " + cudaGetErrorString(err));
  *out = {w.keys, w.positions, w.bags};
  return ffi::Error::Success();
}

}  // namespace jaxrec
