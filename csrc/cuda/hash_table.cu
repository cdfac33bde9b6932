// CUDA handlers of the dynamic vocabulary's hash table (jaxrec.ops.hash_table; operands
// as in cpu/hash_table.cc, shared pieces in common/hash_table.h). The bounds (T x 3
// int32) are in device memory, read by each thread.
//
// find: a thread per id reads its bucket's digests (16-byte loads where the bucket size
//   allows) and compares keys only where a digest matches.
// find_or_insert, on runs sorted by (range, hash) (so each bucket's runs are consecutive):
//   1. a thread per run looks its id up; a found id refreshes its slot's score and seen.
//   2. a tile of 8 lanes per bucket (started at the bucket's first run) marks the slots
//      its found runs hold, then gives its new runs, in order, the candidates of smallest
//      rank (common/hash_table.h: CandidateRank), each chosen by a min-reduction over the
//      bucket's slots, and writes them after all are chosen (ranks read the old state).
// Deterministic: the same slots as the CPU handler and the jnp reference.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_util.h"
#include "common/hash_table.h"

namespace jaxrec {
namespace {

using namespace hash_table;  // NOLINT(build/namespaces): this file's own vocabulary

namespace cg = cooperative_groups;

constexpr int kThreads = 256;  // a thread per id / run
constexpr int kTile = 8;       // lanes per bucket (PlaceNewRuns)
constexpr int kPlaceThreads = 128;
constexpr int kTilesPerBlock = kPlaceThreads / kTile;

// The position of `id` in its bucket or -1; 16 digests a load when `size` is a multiple of 16.
template <typename I>
__device__ __forceinline__ int FindFast(const I* keys, const uint8_t* digests, int size, uint8_t digest,
                                        I id) {
  if (size % 16 != 0) return FindInBucket(keys, digests, size, digest, id);
  const uint32_t pattern = 0x01010101u * digest;
  for (int base = 0; base < size; base += 16) {
    const uint4 chunk = *reinterpret_cast<const uint4*>(digests + base);
    const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t match = __vcmpeq4(words[w], pattern);  // 0xff in each equal byte
      while (match != 0) {
        const int byte = (__ffs(match) - 1) / 8;
        const int p = base + 4 * w + byte;
        if (keys[p] == id) return p;
        match &= ~(0xffu << (8 * byte));
      }
    }
  }
  return -1;
}

template <typename I>
__global__ void FindKernel(const I* __restrict__ keys, const uint8_t* __restrict__ digests, Ranges ranges,
                           int size, const I* __restrict__ ids, const int32_t* __restrict__ table_of,
                           int64_t n, int32_t* __restrict__ slots) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const I id = ids[i];
  const auto h = Hash(id);
  const int64_t bucket = ranges.Of(h, table_of[i]);
  if (bucket < 0) {
    slots[i] = -1;
    return;
  }
  const int64_t first = bucket * size;
  const int p = FindFast(keys + first, digests + first, size, DigestOf(h), id);
  slots[i] = p < 0 ? -1 : static_cast<int32_t>(first + p);
}

struct Table {
  Ranges ranges;
  int size;
  uint8_t* digests;
  int32_t* scores;
  int32_t* seen;
};

template <typename I>
__global__ void LookupRuns(Table t, const I* __restrict__ keys, const I* __restrict__ run_ids,
                           const int32_t* __restrict__ run_tables, const int32_t* __restrict__ counts,
                           int64_t n, const int32_t* __restrict__ step, int32_t policy,
                           int32_t* __restrict__ run_slots, int32_t* __restrict__ status) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (r >= n) return;
  run_slots[r] = -1;
  if (counts[r] <= 0) {
    status[r] = kNotAnId;
    return;
  }
  const I id = run_ids[r];
  const auto h = Hash(id);
  const int64_t bucket = t.ranges.Of(h, run_tables[r]);
  if (bucket < 0) {
    status[r] = kNotAnId;
    return;
  }
  const int64_t first = bucket * t.size;
  const int p = FindFast(keys + first, t.digests + first, t.size, DigestOf(h), id);
  if (p < 0) {
    status[r] = kFailed;  // until placed
    return;
  }
  status[r] = kFound;
  run_slots[r] = static_cast<int32_t>(first + p);
  t.scores[first + p] = NewScore(policy, t.scores[first + p], true, counts[r], *step);
  t.seen[first + p] = *step;
}

template <typename Tile>
__device__ __forceinline__ uint64_t TileMin(const Tile& tile, uint64_t x) {
#pragma unroll
  for (int s = Tile::num_threads() / 2; s > 0; s /= 2) {
    const uint64_t other = tile.shfl_xor(x, s);
    x = other < x ? other : x;
  }
  return x;
}

// A tile of kTile lanes per bucket: a batch of new ids mostly puts one or two in a
// bucket, so a whole warp per bucket left most lanes idle and took 4x the waves.
template <typename I>
__global__ void __launch_bounds__(kPlaceThreads)
    PlaceNewRuns(Table t, I* __restrict__ keys, const I* __restrict__ run_ids,
                 const int32_t* __restrict__ run_tables, const int32_t* __restrict__ counts, int64_t n,
                 const int32_t* __restrict__ step, int32_t policy, int32_t* __restrict__ run_slots,
                 int32_t* __restrict__ status) {
  __shared__ uint32_t hit_words[kTilesPerBlock][2][kMaxBucketSize / 32];  // hit, empty
  const auto tile = cg::tiled_partition<kTile>(cg::this_thread_block());
  const int lane = static_cast<int>(tile.thread_rank());
  const int which = threadIdx.x / kTile;
  const int64_t begin = blockIdx.x * int64_t{kTilesPerBlock} + which;
  if (begin >= n) return;
  const int64_t bucket = t.ranges.Of(Hash(run_ids[begin]), run_tables[begin]);
  if (bucket < 0) return;  // runs of no range (the wrapper's padding): no ids
  if (begin > 0 && t.ranges.Of(Hash(run_ids[begin - 1]), run_tables[begin - 1]) == bucket)
    return;  // not its first run

  // The bucket's runs [begin, end), and whether any is new.
  int64_t end = begin;
  bool any_new = false;
  for (;; end += kTile) {
    const int64_t r = end + lane;
    const bool in = r < n && t.ranges.Of(Hash(run_ids[r]), run_tables[r]) == bucket;
    any_new |= in && status[r] == kFailed;
    const unsigned inside = tile.ballot(in);
    if (inside != (1u << kTile) - 1) {
      end += __ffs(~inside) - 1;
      break;
    }
  }
  if (!tile.any(any_new)) return;

  const int size = t.size;
  const int64_t first = bucket * size;
  uint32_t* hit = hit_words[which][0];
  uint32_t* empty = hit_words[which][1];
  for (int w = lane; w < kMaxBucketSize / 32; w += kTile) hit[w] = empty[w] = 0;
  tile.sync();
  for (int64_t r = begin + lane; r < end; r += kTile) {
    if (status[r] == kFound) {
      const int p = static_cast<int>(run_slots[r] - first);
      atomicOr(&hit[p / 32], 1u << (p % 32));
    }
  }
  int empties = 0;
  for (int p = lane; p < size; p += kTile) {
    if (t.digests[first + p] == 0) {
      atomicOr(&empty[p / 32], 1u << (p % 32));
      ++empties;
    }
  }
  for (int s = kTile / 2; s > 0; s /= 2) empties += tile.shfl_xor(empties, s);
  tile.sync();

  // Choose: the k-th new run takes the candidate of k-th smallest rank. The empty slots
  // rank first, by position: taken from the bitmask without reading a score; only new
  // runs beyond them rank the evictable slots (CandidateRank) by a min-reduction.
  uint64_t last = 0;
  bool first_pick = true;
  int taken = 0, word = 0;
  uint32_t bits = empty[0];
  for (int64_t r = begin; r < end; ++r) {
    if (status[r] != kFailed || counts[r] <= 0) continue;
    uint64_t best;
    if (taken < empties) {  // the next empty slot by position (every lane finds the same)
      while (bits == 0) bits = empty[++word];
      best = static_cast<uint64_t>(32 * word + __ffs(bits) - 1);
      bits &= bits - 1;
      ++taken;
    } else {
      best = kNotCandidate;
      for (int p = lane; p < size; p += kTile) {
        const bool is_hit = (hit[p / 32] >> (p % 32)) & 1u;
        const uint64_t rank =
            CandidateRank(t.digests[first + p] == 0, is_hit, t.scores[first + p], p, policy);
        if ((first_pick || rank > last) && rank < best) best = rank;
      }
      best = TileMin(tile, best);
      if (best == kNotCandidate) break;  // the bucket is out of candidates: the rest fail
    }
    last = best;
    first_pick = false;
    if (lane == 0) {
      const int p = static_cast<int>(best & 0xFFFFFF);
      run_slots[r] = static_cast<int32_t>(first + p);
      status[r] = t.digests[first + p] == 0 ? kInserted : kInsertedEvicting;
    }
  }
  tile.sync();

  // Write the placed runs.
  for (int64_t r = begin + lane; r < end; r += kTile) {
    if (status[r] != kInserted && status[r] != kInsertedEvicting) continue;
    const int64_t slot = run_slots[r];
    keys[slot] = run_ids[r];
    t.digests[slot] = DigestOf(Hash(run_ids[r]));
    t.scores[slot] = NewScore(policy, 0, false, counts[r], *step);
    t.seen[slot] = *step;
  }
}

ffi::Error CudaError(cudaError_t err, const char* op) {
  return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err));
}

unsigned Blocks(int64_t items, int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

ffi::Error HashFindCuda(cudaStream_t stream, ffi::AnyBuffer keys, ffi::AnyBuffer digests, ffi::AnyBuffer ids,
                        ffi::AnyBuffer table_of, ffi::AnyBuffer bounds,
                        ffi::Result<ffi::Buffer<ffi::S32>> slots) {
  constexpr const char* kOp = "jaxrec_hash_find";
  if (ffi::Error e = CheckTable(kOp, keys, digests, nullptr, nullptr, ids, table_of, bounds); e.failure())
    return e;
  const int64_t n = ids.element_count();
  if (n == 0) return ffi::Error::Success();
  const auto dims = keys.dimensions();
  return DispatchIndexType(keys.element_type(), "keys", [&](auto zero) {
    using I = decltype(zero);
    FindKernel<I><<<Blocks(n, kThreads), kThreads, 0, stream>>>(
        keys.typed_data<I>(), digests.typed_data<uint8_t>(),
        Ranges{bounds.typed_data<int32_t>(), static_cast<int32_t>(bounds.dimensions()[0])},
        static_cast<int>(dims[1]), ids.typed_data<I>(), table_of.typed_data<int32_t>(), n,
        slots->typed_data());
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, kOp);
  });
}

ffi::Error HashInsertCuda(cudaStream_t stream, ffi::AnyBuffer keys_in, ffi::AnyBuffer digests_in,
                          ffi::AnyBuffer scores_in, ffi::AnyBuffer seen_in, ffi::AnyBuffer run_ids,
                          ffi::AnyBuffer run_tables, ffi::AnyBuffer counts, ffi::AnyBuffer step,
                          ffi::AnyBuffer bounds, ffi::Result<ffi::AnyBuffer> keys,
                          ffi::Result<ffi::AnyBuffer> digests, ffi::Result<ffi::AnyBuffer> scores,
                          ffi::Result<ffi::AnyBuffer> seen, ffi::Result<ffi::Buffer<ffi::S32>> run_slots,
                          ffi::Result<ffi::Buffer<ffi::S32>> status, int32_t policy) {
  constexpr const char* kOp = "jaxrec_hash_insert";
  if (ffi::Error e = CheckTable(kOp, keys_in, digests_in, &scores_in, &seen_in, run_ids, run_tables, bounds);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckInsert(kOp, run_ids, counts, step, policy); e.failure()) return e;
  const std::pair<const ffi::AnyBuffer*, ffi::AnyBuffer*> state[] = {
      {&keys_in, &*keys}, {&digests_in, &*digests}, {&scores_in, &*scores}, {&seen_in, &*seen}};
  for (const auto& [from, to] : state) {  // XLA aliases them; copy where it did not
    if (from->untyped_data() == to->untyped_data() || from->size_bytes() == 0) continue;
    const cudaError_t err = cudaMemcpyAsync(to->untyped_data(), from->untyped_data(), from->size_bytes(),
                                            cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return CudaError(err, kOp);
  }
  const int64_t n = run_ids.element_count();
  if (n == 0) return ffi::Error::Success();
  const auto dims = keys_in.dimensions();
  const Ranges ranges{bounds.typed_data<int32_t>(), static_cast<int32_t>(bounds.dimensions()[0])};
  const Table t{ranges, static_cast<int>(dims[1]), digests->typed_data<uint8_t>(),
                scores->typed_data<int32_t>(), seen->typed_data<int32_t>()};
  return DispatchIndexType(keys_in.element_type(), "keys", [&](auto zero) {
    using I = decltype(zero);
    const int32_t* step_ptr = step.typed_data<int32_t>();
    const int32_t* tables = run_tables.typed_data<int32_t>();
    LookupRuns<I><<<Blocks(n, kThreads), kThreads, 0, stream>>>(
        t, keys->typed_data<I>(), run_ids.typed_data<I>(), tables, counts.typed_data<int32_t>(), n, step_ptr,
        policy, run_slots->typed_data(), status->typed_data());
    PlaceNewRuns<I><<<Blocks(n, kTilesPerBlock), kPlaceThreads, 0, stream>>>(
        t, keys->typed_data<I>(), run_ids.typed_data<I>(), tables, counts.typed_data<int32_t>(), n, step_ptr,
        policy, run_slots->typed_data(), status->typed_data());
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, kOp);
  });
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecHashFindCuda, jaxrec::HashFindCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // keys
                                  .Arg<xla::ffi::AnyBuffer>()              // digests
                                  .Arg<xla::ffi::AnyBuffer>()              // ids
                                  .Arg<xla::ffi::AnyBuffer>()              // table_of
                                  .Arg<xla::ffi::AnyBuffer>()              // bounds
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // slots
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecHashInsertCuda, jaxrec::HashInsertCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // keys
                                  .Arg<xla::ffi::AnyBuffer>()              // digests
                                  .Arg<xla::ffi::AnyBuffer>()              // scores
                                  .Arg<xla::ffi::AnyBuffer>()              // seen
                                  .Arg<xla::ffi::AnyBuffer>()              // run_ids
                                  .Arg<xla::ffi::AnyBuffer>()              // run_tables
                                  .Arg<xla::ffi::AnyBuffer>()              // counts
                                  .Arg<xla::ffi::AnyBuffer>()              // step
                                  .Arg<xla::ffi::AnyBuffer>()              // bounds
                                  .Ret<xla::ffi::AnyBuffer>()              // keys (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()              // digests (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()              // scores (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()              // seen (aliased)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // run_slots
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // status
                                  .Attr<int32_t>("policy"));
