// CUDA handlers of the dynamic vocabulary's hash table (jaxrec.ops.hash_table; shared
// pieces in common/hash_table.h). The bounds (T x 3 int32) are in device memory, read by
// each thread.
//
// find: a tile of 8 lanes per id reads its bucket's digests (16 bytes a lane where the
//   bucket size allows) and compares keys only where a digest matches.
// find_or_insert: one handler for the whole call. (The XLA composition that the CPU
//   handler is part of took about 20 thunks on the GPU, whose launches, not their work,
//   bound the call.)
//   1. Sort the batch by (range, hash), an entry that is no id (not valid, or of no range)
//      past every range: CUB's radix sort of 32-bit keys (the range, the hash's high bits),
//      then the rare groups of equal keys and unequal hashes ordered by hash (SortGroups).
//      Equal hashes are equal ids (the hash is a bijection), so each distinct id is one
//      run, and each bucket's runs are consecutive, in hash order.
//   2. Compact the runs (a scan of the run heads): id, range, bucket, first and last entry.
//   3. A thread per run looks its id up; a found id refreshes its slot's score and seen, a
//      new one joins the list of new runs.
//   4. A tile of 8 lanes per bucket with new runs (from that list) marks the slots
//      its found runs hold, then gives its new runs, in order, the candidates of smallest
//      rank (common/hash_table.h: CandidateRank), each chosen by a min-reduction over the
//      bucket's slots, and writes them after all are chosen (ranks read the old state).
//   5. Each entry gets its run's slot; each run its fresh slot; each range its counts.
// Deterministic: the same slots as the CPU handler and the jnp reference.
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "common/ffi_util.h"
#include "common/hash_table.h"
#include "cuda/scratch.cuh"

namespace jaxrec {
namespace {

using namespace hash_table;  // NOLINT(build/namespaces): this file's own vocabulary

namespace cg = cooperative_groups;

constexpr int kThreads = 256;  // a thread per entry / run; a tile per id (FindKernel)
constexpr int kTile = 8;       // lanes per id (FindKernel), per bucket (PlaceNewRuns)
constexpr int kTileThreads = 128;
constexpr int kTilesPerBlock = kTileThreads / kTile;
constexpr int kSortGroupsBlocks = 256;  // SortGroups' blocks, each taking every 256th group
constexpr int kCounters = 3;            // the handler's: groups, runs, new runs

// Bit k set where digest k of the 16 at `digests` (16-byte aligned) equals `digest`.
__device__ __forceinline__ uint32_t MatchMask16(const uint8_t* digests, uint8_t digest) {
  const uint4 chunk = *reinterpret_cast<const uint4*>(digests);
  const uint32_t pattern = 0x01010101u * digest;
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  uint32_t mask = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t m = __vcmpeq4(words[w], pattern);  // 0xff in each equal byte
    mask |= ((m & 1u) | ((m >> 7) & 2u) | ((m >> 14) & 4u) | ((m >> 21) & 8u)) << (4 * w);
  }
  return mask;
}

// The position of `id` among the 16 slots from `base` (16-aligned) of a bucket, or -1.
template <typename I>
__device__ __forceinline__ int FindIn16(const I* keys, const uint8_t* digests, int base, uint8_t digest,
                                        I id) {
  for (uint32_t match = MatchMask16(digests + base, digest); match != 0; match &= match - 1) {
    const int p = base + __ffs(match) - 1;
    if (keys[p] == id) return p;
  }
  return -1;
}

// The position of `id` in its bucket or -1; 16 digests a load when `size` is a multiple of 16.
template <typename I>
__device__ __forceinline__ int FindFast(const I* keys, const uint8_t* digests, int size, uint8_t digest,
                                        I id) {
  if (size % 16 != 0) return FindInBucket(keys, digests, size, digest, id);
  for (int base = 0; base < size; base += 16) {
    const int p = FindIn16(keys, digests, base, digest, id);
    if (p >= 0) return p;
  }
  return -1;
}

// A tile of kTile lanes per id: lane l reads digests 16l ... 16l + 15 of the bucket (then
// 16l + 128 ..., in buckets of more than 128), so that the tile reads a bucket of 128 in
// one 128-byte load and compares the keys of its digest matches at once. (A thread per
// id, reading the bucket 16 digests at a time, took 134 us against 113 for 1M held ids
// in random order at load 0.76 on the H100, 96 against 91 for absent ones; alike at load
// 0.5: benchmarks/hash_table_profile.py.)
template <typename I>
__global__ void FindKernel(const I* __restrict__ keys, const uint8_t* __restrict__ digests, Ranges ranges,
                           int size, const I* __restrict__ ids, const int32_t* __restrict__ table_of,
                           int64_t n, int32_t* __restrict__ slots) {
  const auto tile = cg::tiled_partition<kTile>(cg::this_thread_block());
  const int lane = static_cast<int>(tile.thread_rank());
  const int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / kTile;
  if (i >= n) return;  // the whole tile
  const I id = ids[i];
  const auto h = Hash(id);
  const int64_t bucket = ranges.Of(h, table_of[i]);
  if (bucket < 0) {
    if (lane == 0) slots[i] = -1;
    return;
  }
  const int64_t first = bucket * size;
  const uint8_t digest = DigestOf(h);
  int found = size;  // this lane's smallest position holding the id
  if (size % 16 == 0) {
    for (int base = 16 * lane; base < size && found == size; base += 16 * kTile) {
      const int p = FindIn16(keys + first, digests + first, base, digest, id);
      if (p >= 0) found = p;
    }
  } else {
    for (int p = lane; p < size; p += kTile) {
      if (digests[first + p] == digest && keys[first + p] == id) {
        found = p;
        break;
      }
    }
  }
  found = cg::reduce(tile, found, cg::less<int>());
  if (lane == 0) slots[i] = found < size ? static_cast<int32_t>(first + found) : -1;
}

// The batch's runs (distinct ids, in (range, hash) order): [0, *count) of them.
template <typename I>
struct Runs {
  const int32_t* count;
  I* ids;
  int32_t* tables;
  int32_t* buckets;  // -1: of no range
  int32_t* first;    // the run's entries are the sorted positions [first, stop)
  int32_t* stop;
  int32_t* slots;
  int32_t* status;
  int32_t* new_runs;  // the runs LookupRuns did not find, [0, *num_new) of them, in no order
  int32_t* num_new;
};

struct Table {
  Ranges ranges;
  int size;
  uint8_t* digests;
  int32_t* scores;
  int32_t* seen;
};

// The batch is sorted by (range, hash) with one radix sort of 32-bit keys: the range (an
// entry that is no id ranks num_ranges, past every range) in the high `range_bits` bits,
// the hash's high bits below. A 64-bit hash sort (eight passes) and a stable sort by range
// took about 190 us for 1M ids on the H100; these keys take four passes. Entries whose
// keys are equal but whose hashes differ stay in batch order, so SortGroups then orders
// each such group by (hash, position), as the full sort would: for 1M random ids about 2^7
// groups of two, for ids crafted to share their high hash bits possibly one large one.

// Each entry's sort key, and its hash (0 where it is no id: such entries need no order);
// zeroes the claims of FindUnorderedGroups and the handler's counters (memsets of their own
// cost a launch each).
template <typename I, typename H>
__global__ void PrepareSort(const I* __restrict__ ids, const bool* __restrict__ valid,
                            const int32_t* __restrict__ table_of, int64_t n, int32_t num_ranges,
                            int range_bits, H* __restrict__ hashes, uint32_t* __restrict__ keys,
                            int32_t* __restrict__ order, int32_t* __restrict__ claims,
                            int32_t* __restrict__ counters) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < kCounters) counters[i] = 0;
  if (i >= n) return;
  claims[i] = 0;
  const int32_t t = table_of[i];
  const bool is_id = valid[i] && t >= 0 && t < num_ranges;
  const H h = is_id ? Hash(ids[i]) : H{0};
  hashes[i] = h;
  const auto high = static_cast<uint32_t>(h >> (8 * sizeof(H) - 32));
  keys[i] = (static_cast<uint32_t>(is_id ? t : num_ranges) << (32 - range_bits)) | (high >> range_bits);
  order[i] = static_cast<int32_t>(i);
}

// The first position in [lo, hi) whose key is not below `key` (upper: above it).
template <bool kUpper>
__device__ int64_t KeyBound(const uint32_t* __restrict__ keys, int64_t lo, int64_t hi, uint32_t key) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (kUpper ? keys[mid] <= key : keys[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Each sorted entry's range and hash; an entry whose hash is below that of the entry before
// with an equal key lists their group [lo, hi) of equal keys for SortGroups (the first such
// entry of a group to claim it, in `claimed`, zeroed).
template <typename H>
__global__ void FindUnorderedGroups(const uint32_t* __restrict__ sorted_keys,
                                    const int32_t* __restrict__ order, const H* __restrict__ hashes,
                                    int64_t n, int range_bits, int32_t* __restrict__ tables,
                                    H* __restrict__ sorted_hashes, int32_t* __restrict__ claimed,
                                    int2* __restrict__ groups, int32_t* __restrict__ num_groups) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const uint32_t key = sorted_keys[i];
  tables[i] = static_cast<int32_t>(key >> (32 - range_bits));
  const H h = hashes[order[i]];
  sorted_hashes[i] = h;
  if (i == 0 || sorted_keys[i - 1] != key || !(h < hashes[order[i - 1]])) return;
  const int64_t lo = KeyBound<false>(sorted_keys, 0, i, key);
  if (atomicCAS(&claimed[lo], 0, 1) != 0) return;
  const int64_t hi = KeyBound<true>(sorted_keys, i + 1, n, key);
  groups[atomicAdd(num_groups, 1)] = make_int2(static_cast<int>(lo), static_cast<int>(hi));
}

// A block per listed group sorts it by (hash, position): a bitonic network of compare-
// exchanges that all put the smaller pair first, over the group padded to a power of two
// with pairs above any (never stored: a compare-exchange with one leaves it in place).
template <typename H>
__global__ void SortGroups(const int2* __restrict__ groups, const int32_t* __restrict__ num_groups,
                           H* __restrict__ sorted_hashes, int32_t* __restrict__ order) {
  for (int32_t g = blockIdx.x; g < *num_groups; g += gridDim.x) {
    const int64_t lo = groups[g].x, size = groups[g].y - lo;
    H* h = sorted_hashes + lo;
    int32_t* o = order + lo;
    int64_t padded = 1;
    while (padded < size) padded *= 2;
    for (int64_t k = 2; k <= padded; k *= 2) {
      for (int64_t j = k / 2; j > 0; j /= 2) {
        for (int64_t t = threadIdx.x; t < padded / 2; t += blockDim.x) {
          const int64_t a = t / j * 2 * j + t % j;             // below b, in the lower half of its k-block
          const int64_t b = j == k / 2 ? a ^ (k - 1) : a + j;  // its mirror in the upper half, then a + j
          if (b < size && (h[b] < h[a] || (h[b] == h[a] && o[b] < o[a]))) {
            const H hb = h[b];
            const int32_t ob = o[b];
            h[b] = h[a];
            o[b] = o[a];
            h[a] = hb;
            o[a] = ob;
          }
        }
        __syncthreads();
      }
    }
  }
}

// heads[i] = 1 where a run starts at sorted position i (entries that are no id start none).
// Equal hashes are equal ids: the sorted hashes are read in order, not the ids by `order`.
template <typename H>
__global__ void MarkHeads(const int32_t* __restrict__ tables, const H* __restrict__ sorted_hashes, int64_t n,
                          int32_t num_ranges, int32_t* __restrict__ heads) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const int32_t t = tables[i];
  heads[i] = t < num_ranges && (i == 0 || t != tables[i - 1] || sorted_hashes[i] != sorted_hashes[i - 1]);
}

// Entry i is of run run_of[i] - 1 (run_of: the inclusive scan of the heads).
template <typename I>
__global__ void CompactRuns(const I* __restrict__ ids, const int32_t* __restrict__ tables,
                            const int32_t* __restrict__ order, const int32_t* __restrict__ heads,
                            const int32_t* __restrict__ run_of, int64_t n, Ranges ranges, Runs<I> runs,
                            int32_t* __restrict__ count) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n || tables[i] >= ranges.count) return;
  const int32_t r = run_of[i] - 1;
  if (heads[i]) {
    const I id = ids[order[i]];
    runs.ids[r] = id;
    runs.tables[r] = tables[i];
    runs.buckets[r] = static_cast<int32_t>(ranges.Of(Hash(id), tables[i]));
    runs.first[r] = static_cast<int32_t>(i);
  }
  const bool ids_end = i + 1 == n || tables[i + 1] >= ranges.count;
  if (ids_end || heads[i + 1]) runs.stop[r] = static_cast<int32_t>(i + 1);
  if (ids_end) *count = r + 1;
}

// This thread's index in a list that the coalesced threads of its warp append to at once
// (one atomic a warp: a million on one counter serialise).
__device__ __forceinline__ int32_t AppendIndex(int32_t* count) {
  const auto group = cg::coalesced_threads();
  int32_t base = 0;
  if (group.thread_rank() == 0) base = atomicAdd(count, static_cast<int32_t>(group.size()));
  return group.shfl(base, 0) + static_cast<int32_t>(group.thread_rank());
}

// A thread per run (a tile of 8 lanes per run, each reading 16 of the bucket's digests,
// took 198 us against 185 for 1M ids already in the table, at load 0.75 on the H100). The
// runs it does not find join the list of new runs that PlaceNewRuns works through.
template <typename I>
__global__ void LookupRuns(Table t, const I* __restrict__ keys, Runs<I> runs, int64_t n,
                           const int32_t* __restrict__ step, int32_t policy) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (r >= n) return;
  const int32_t bucket = r < *runs.count ? runs.buckets[r] : -1;
  if (bucket < 0) {
    runs.slots[r] = -1;
    runs.status[r] = kNotAnId;
    return;
  }
  const I id = runs.ids[r];
  const int64_t first = int64_t{bucket} * t.size;
  const int p = FindFast(keys + first, t.digests + first, t.size, DigestOf(Hash(id)), id);
  if (p < 0) {
    runs.slots[r] = -1;
    runs.status[r] = kFailed;  // until placed
    runs.new_runs[AppendIndex(runs.num_new)] = static_cast<int32_t>(r);
    return;
  }
  runs.slots[r] = static_cast<int32_t>(first + p);
  runs.status[r] = kFound;
  const int32_t old_score =
      policy == kLfu ? t.scores[first + p] : 0;  // LRU's reads none: one scattered read fewer
  t.scores[first + p] = NewScore(policy, old_score, true, runs.stop[r] - runs.first[r], *step);
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

// Places the bucket of run `new_run`, unless an earlier run of the bucket is new too (that
// run's tile places it). A run's status is new (not kFound) from LookupRuns on, whether or
// not its tile has placed it yet.
template <typename I, typename Tile>
__device__ void PlaceBucket(const Tile& tile, const Table& t, I* __restrict__ keys, const Runs<I>& runs,
                            int32_t n, int32_t new_run, uint32_t* hit, uint32_t* empty, const int32_t* step,
                            int32_t policy, int32_t keep_seen) {
  const int lane = static_cast<int>(tile.thread_rank());
  const int32_t bucket = runs.buckets[new_run];
  int32_t begin = new_run;  // the bucket's runs are consecutive: [begin, end)
  while (begin > 0 && runs.buckets[begin - 1] == bucket) --begin;
  bool earlier_new = false;
  for (int32_t q = begin + lane; q < new_run; q += kTile) earlier_new |= runs.status[q] != kFound;
  if (tile.any(earlier_new)) return;
  int32_t end = new_run + 1;
  for (;; end += kTile) {
    const int32_t q = end + lane;
    const unsigned inside = tile.ballot(q < n && runs.buckets[q] == bucket);
    if (inside != (1u << kTile) - 1) {
      end += __ffs(~inside) - 1;
      break;
    }
  }

  const int size = t.size;
  const int32_t first = bucket * size;  // slots are int32
  for (int w = lane; w < (size + 31) / 32; w += kTile) hit[w] = empty[w] = 0;
  tile.sync();
  for (int32_t r = begin + lane; r < end; r += kTile) {
    if (runs.status[r] == kFound) {
      const int p = runs.slots[r] - first;
      atomicOr(&hit[p / 32], 1u << (p % 32));
    }
  }
  int empties = 0;
  if (size % 16 == 0) {  // 16 digests a load: half a mask word
    for (int base = 16 * lane; base < size; base += 16 * kTile) {
      const uint32_t m = MatchMask16(t.digests + first + base, 0);
      if (m != 0) atomicOr(&empty[base / 32], m << (base % 32));
      empties += __popc(m);
    }
  } else {
    for (int p = lane; p < size; p += kTile) {
      if (t.digests[first + p] == 0) {
        atomicOr(&empty[p / 32], 1u << (p % 32));
        ++empties;
      }
    }
  }
  empties = cg::reduce(tile, empties, cg::plus<int>());
  tile.sync();

  // Choose: the k-th new run takes the candidate of k-th smallest rank. The empty slots
  // rank first, by position: taken from the bitmask without reading a score; only new
  // runs beyond them rank the evictable slots (CandidateRank) by a min-reduction.
  uint64_t last = 0;
  bool first_pick = true;
  int taken = 0, word = 0;
  uint32_t bits = empty[0];
  for (int32_t r = begin; r < end; ++r) {
    if (runs.status[r] != kFailed) continue;
    uint64_t best;
    if (taken < empties) {  // the next empty slot by position (every lane finds the same)
      while (bits == 0) bits = empty[++word];
      best = static_cast<uint64_t>(32 * word + __ffs(bits) - 1);
      bits &= bits - 1;
      ++taken;
    } else {
      best = kNotCandidate;
      for (int p = lane; p < size; p += kTile) {
        // in use: hit by this batch, or (keep_seen) seen at this step by an earlier call
        const bool is_hit = ((hit[p / 32] >> (p % 32)) & 1u) || (keep_seen && t.seen[first + p] == *step);
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
      runs.slots[r] = first + p;
      runs.status[r] = t.digests[first + p] == 0 ? kInserted : kInsertedEvicting;
    }
  }
  tile.sync();

  // Write the placed runs.
  for (int32_t r = begin + lane; r < end; r += kTile) {
    const int32_t status = runs.status[r];
    if (status != kInserted && status != kInsertedEvicting) continue;
    const int32_t slot = runs.slots[r];
    keys[slot] = runs.ids[r];
    t.digests[slot] = DigestOf(Hash(runs.ids[r]));
    t.scores[slot] = NewScore(policy, 0, false, runs.stop[r] - runs.first[r], *step);
    t.seen[slot] = *step;
  }
}

// A tile of kTile lanes per bucket with new runs: a batch of new ids mostly puts one or two
// in a bucket, so a whole warp per bucket left most lanes idle and took 4x the waves. The
// tiles (as many as the GPU holds at once) work through the list of new runs; the tile of
// a bucket's first new run places the bucket. (A tile launched per run, for every bucket
// of the batch, placed 1M ids of which 40% were new about as slowly as 1M new ones, 289
// and 285 us on the H100: the blocks whose tiles had nothing to place waited for those
// that had.)
template <typename I>
__global__ void __launch_bounds__(kTileThreads)
    PlaceNewRuns(Table t, I* __restrict__ keys, Runs<I> runs, const int32_t* __restrict__ step,
                 int32_t policy, int32_t keep_seen) {
  __shared__ uint32_t hit_words[kTilesPerBlock][2][kMaxBucketSize / 32];  // hit, empty
  const auto tile = cg::tiled_partition<kTile>(cg::this_thread_block());
  const int lane = static_cast<int>(tile.thread_rank());
  const int which = threadIdx.x / kTile;
  const int32_t n = *runs.count, num_new = *runs.num_new;
  for (int32_t k = blockIdx.x * kTilesPerBlock + which; k < num_new; k += gridDim.x * kTilesPerBlock) {
    tile.sync();  // the tile's last bucket is done with its shared words
    PlaceBucket(tile, t, keys, runs, n, runs.new_runs[k], hit_words[which][0], hit_words[which][1], step,
                policy, keep_seen);
  }
}

// Each entry's slot: its run's, or -1 for an entry that is no id.
__global__ void ScatterSlots(const int32_t* __restrict__ tables, const int32_t* __restrict__ order,
                             const int32_t* __restrict__ run_of, const int32_t* __restrict__ run_slots,
                             int64_t n, int32_t num_ranges, int32_t* __restrict__ slots) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) slots[order[i]] = tables[i] < num_ranges ? run_slots[run_of[i] - 1] : -1;
}

constexpr int kMaxSharedRanges = 1024;  // per-range counts summed in shared memory up to this many

// fresh[r]: run r's slot if it was placed, else the capacity; counts[3, T]: placed,
// evicted and failed runs of each range, summed per block first (a million atomics on a
// few counters serialise).
template <typename I>
__global__ void FinishRuns(Runs<I> runs, int64_t n, int32_t num_ranges, int32_t capacity,
                           int32_t* __restrict__ fresh, int32_t* __restrict__ counts) {
  __shared__ int32_t block_counts[3 * kMaxSharedRanges];
  const bool in_shared = num_ranges <= kMaxSharedRanges;
  if (in_shared) {
    for (int k = threadIdx.x; k < 3 * num_ranges; k += blockDim.x) block_counts[k] = 0;
    __syncthreads();
  }
  const int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (r < n) {
    const bool is_run = r < *runs.count;
    const int32_t status = is_run ? runs.status[r] : kNotAnId;
    const bool placed = status == kInserted || status == kInsertedEvicting;
    fresh[r] = placed ? runs.slots[r] : capacity;
    int32_t* target = in_shared ? block_counts : counts;
    const int32_t t = is_run ? runs.tables[r] : 0;
    if (placed) atomicAdd(&target[t], 1);
    if (status == kInsertedEvicting) atomicAdd(&target[num_ranges + t], 1);
    if (status == kFailed) atomicAdd(&target[2 * num_ranges + t], 1);
  }
  if (in_shared) {
    __syncthreads();
    for (int k = threadIdx.x; k < 3 * num_ranges; k += blockDim.x) {
      if (block_counts[k] != 0) atomicAdd(&counts[k], block_counts[k]);
    }
  }
}

ffi::Error CudaError(cudaError_t err, const char* op) {
  return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err));
}

unsigned Blocks(int64_t items, int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

// The blocks of `kernel` that the current GPU holds at once (no limit where CUDA cannot say).
template <typename Kernel>
unsigned ResidentBlocks(Kernel kernel, int threads) {
  static const int per_sm = [&] {  // a property of the kernel and the architecture
    int blocks = 0;
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0);
    return err == cudaSuccess ? blocks : 0;
  }();
  int device = 0, sms = 0;
  if (per_sm < 1 || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return std::numeric_limits<unsigned>::max();
  }
  return static_cast<unsigned>(sms * per_sm);
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
    FindKernel<I><<<Blocks(n, kThreads / kTile), kThreads, 0, stream>>>(
        keys.typed_data<I>(), digests.typed_data<uint8_t>(),
        Ranges{bounds.typed_data<int32_t>(), static_cast<int32_t>(bounds.dimensions()[0])},
        static_cast<int>(dims[1]), ids.typed_data<I>(), table_of.typed_data<int32_t>(), n,
        slots->typed_data());
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, kOp);
  });
}

// The handler's arrays, carved out of `base` (null: to count their bytes).
template <typename I, typename H>
struct Work {
  Work(char* base, int64_t n, size_t cub_bytes) {
    Carve c(base);
    hashes = c.Take<H>(n);
    sorted_hashes = c.Take<H>(n);
    sort_keys = c.Take<uint32_t>(n);
    sorted_keys = c.Take<uint32_t>(n);
    iota = c.Take<int32_t>(n);
    order = c.Take<int32_t>(n);
    tables = c.Take<int32_t>(n);
    heads = c.Take<int32_t>(n);
    run_of = c.Take<int32_t>(n);
    groups = c.Take<int2>(n / 2 + 1);
    counters = c.Take<int32_t>(kCounters);  // PrepareSort zeroes them
    num_groups = counters;
    count = counters + 1;
    runs = Runs<I>{count,
                   c.Take<I>(n),
                   c.Take<int32_t>(n),
                   c.Take<int32_t>(n),
                   c.Take<int32_t>(n),
                   c.Take<int32_t>(n),
                   c.Take<int32_t>(n),
                   c.Take<int32_t>(n),
                   c.Take<int32_t>(n),
                   counters + 2};  // num_new
    cub_storage = c.Take<char>(static_cast<int64_t>(cub_bytes));
    bytes = c.used();
  }
  H *hashes, *sorted_hashes;
  uint32_t *sort_keys, *sorted_keys;
  int32_t *iota, *order, *tables, *heads, *run_of, *counters, *num_groups, *count;
  int2* groups;
  Runs<I> runs;
  char* cub_storage;
  size_t bytes;
};

template <typename I>
ffi::Error FindOrInsert(cudaStream_t stream, ffi::ScratchAllocator& scratch, const Table& t, I* keys,
                        const I* ids, const bool* valid, const int32_t* table_of, int64_t n, int64_t capacity,
                        const int32_t* step, int32_t policy, int32_t keep_seen, int32_t* slots,
                        int32_t* fresh, int32_t* counts) {
  constexpr const char* kOp = "jaxrec_hash_find_or_insert";
  using H = decltype(Hash(I{}));
  const int32_t num_ranges = t.ranges.count;
  const int items = static_cast<int>(n);
  int range_bits = 1;  // ranks 0 ... num_ranges (no id)
  while ((int64_t{1} << range_bits) <= num_ranges) ++range_bits;

  size_t cub_bytes = 0;
  for (int k = 0; k < 2; ++k) {
    size_t bytes = 0;
    cudaError_t err =
        k == 0
            ? cub::DeviceRadixSort::SortPairs(
                  nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
                  static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), items, 0, 32, stream)
            : cub::DeviceScan::InclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                            static_cast<int32_t*>(nullptr), items, stream);
    if (err != cudaSuccess) return CudaError(err, kOp);
    cub_bytes = std::max(cub_bytes, bytes);
  }
  std::optional<Work<I, H>> work;
  if (ffi::Error e = AllocateWork(scratch, kOp, &work, n, cub_bytes); e.failure()) return e;
  const Work<I, H>& w = *work;

  const unsigned blocks = Blocks(n, kThreads);
  PrepareSort<I, H><<<blocks, kThreads, 0, stream>>>(ids, valid, table_of, n, num_ranges, range_bits,
                                                     w.hashes, w.sort_keys, w.iota, w.heads, w.counters);
  size_t bytes = cub_bytes;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(w.cub_storage, bytes, w.sort_keys, w.sorted_keys, w.iota,
                                                    w.order, items, 0, 32, stream);
  if (err != cudaSuccess) return CudaError(err, kOp);
  FindUnorderedGroups<H><<<blocks, kThreads, 0, stream>>>(w.sorted_keys, w.order, w.hashes, n, range_bits,
                                                          w.tables, w.sorted_hashes, w.heads, w.groups,
                                                          w.num_groups);
  SortGroups<H><<<kSortGroupsBlocks, kThreads, 0, stream>>>(w.groups, w.num_groups, w.sorted_hashes, w.order);
  MarkHeads<H><<<blocks, kThreads, 0, stream>>>(w.tables, w.sorted_hashes, n, num_ranges, w.heads);
  bytes = cub_bytes;
  err = cub::DeviceScan::InclusiveSum(w.cub_storage, bytes, w.heads, w.run_of, items, stream);
  if (err != cudaSuccess) return CudaError(err, kOp);
  CompactRuns<I><<<blocks, kThreads, 0, stream>>>(ids, w.tables, w.order, w.heads, w.run_of, n, t.ranges,
                                                  w.runs, w.count);
  LookupRuns<I><<<blocks, kThreads, 0, stream>>>(t, keys, w.runs, n, step, policy);
  const unsigned place_blocks =
      std::min(Blocks(n, kTilesPerBlock), ResidentBlocks(PlaceNewRuns<I>, kTileThreads));
  PlaceNewRuns<I><<<place_blocks, kTileThreads, 0, stream>>>(t, keys, w.runs, step, policy, keep_seen);
  ScatterSlots<<<blocks, kThreads, 0, stream>>>(w.tables, w.order, w.run_of, w.runs.slots, n, num_ranges,
                                                slots);
  FinishRuns<I>
      <<<blocks, kThreads, 0, stream>>>(w.runs, n, num_ranges, static_cast<int32_t>(capacity), fresh, counts);
  err = cudaGetLastError();
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, kOp);
}

ffi::Error HashFindOrInsertCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer keys_in,
                                ffi::AnyBuffer digests_in, ffi::AnyBuffer scores_in, ffi::AnyBuffer seen_in,
                                ffi::AnyBuffer ids, ffi::AnyBuffer valid, ffi::AnyBuffer table_of,
                                ffi::AnyBuffer step, ffi::AnyBuffer bounds, ffi::Result<ffi::AnyBuffer> keys,
                                ffi::Result<ffi::AnyBuffer> digests, ffi::Result<ffi::AnyBuffer> scores,
                                ffi::Result<ffi::AnyBuffer> seen, ffi::Result<ffi::Buffer<ffi::S32>> slots,
                                ffi::Result<ffi::Buffer<ffi::S32>> fresh,
                                ffi::Result<ffi::Buffer<ffi::S32>> counts, int32_t policy,
                                int32_t keep_seen) {
  constexpr const char* kOp = "jaxrec_hash_find_or_insert";
  if (ffi::Error e = CheckTable(kOp, keys_in, digests_in, &scores_in, &seen_in, ids, table_of, bounds);
      e.failure())
    return e;
  if (ffi::Error e = CheckInsert(kOp, ids, valid, ffi::DataType::PRED, "valid", step, policy); e.failure())
    return e;
  const int64_t n = ids.element_count();
  const int32_t num_ranges = static_cast<int32_t>(bounds.dimensions()[0]);
  if (n >= (int64_t{1} << 31)) return Invalid(kOp, "ids must be fewer than 2**31, got " + std::to_string(n));
  if (counts->element_count() != 3 * int64_t{num_ranges})
    return Invalid(kOp, "counts must be int32[3, " + std::to_string(num_ranges) + "]");
  const std::pair<const ffi::AnyBuffer*, ffi::AnyBuffer*> state[] = {
      {&keys_in, &*keys}, {&digests_in, &*digests}, {&scores_in, &*scores}, {&seen_in, &*seen}};
  for (const auto& [from, to] : state) {  // XLA aliases them; copy where it did not
    if (from->untyped_data() == to->untyped_data() || from->size_bytes() == 0) continue;
    const cudaError_t err = cudaMemcpyAsync(to->untyped_data(), from->untyped_data(), from->size_bytes(),
                                            cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return CudaError(err, kOp);
  }
  cudaError_t err = cudaMemsetAsync(counts->typed_data(), 0, counts->size_bytes(), stream);
  if (err != cudaSuccess) return CudaError(err, kOp);
  if (n == 0) return ffi::Error::Success();
  const auto dims = keys_in.dimensions();
  const Table t{Ranges{bounds.typed_data<int32_t>(), num_ranges}, static_cast<int>(dims[1]),
                digests->typed_data<uint8_t>(), scores->typed_data<int32_t>(), seen->typed_data<int32_t>()};
  return DispatchIndexType(keys_in.element_type(), "keys", [&](auto zero) {
    using I = decltype(zero);
    return FindOrInsert<I>(stream, scratch, t, keys->typed_data<I>(), ids.typed_data<I>(),
                           valid.typed_data<bool>(), table_of.typed_data<int32_t>(), n, dims[0] * dims[1],
                           step.typed_data<int32_t>(), policy, keep_seen, slots->typed_data(),
                           fresh->typed_data(), counts->typed_data());
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecHashFindOrInsertCuda, jaxrec::HashFindOrInsertCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()              // keys
                                  .Arg<xla::ffi::AnyBuffer>()              // digests
                                  .Arg<xla::ffi::AnyBuffer>()              // scores
                                  .Arg<xla::ffi::AnyBuffer>()              // seen
                                  .Arg<xla::ffi::AnyBuffer>()              // ids
                                  .Arg<xla::ffi::AnyBuffer>()              // valid
                                  .Arg<xla::ffi::AnyBuffer>()              // table_of
                                  .Arg<xla::ffi::AnyBuffer>()              // step
                                  .Arg<xla::ffi::AnyBuffer>()              // bounds
                                  .Ret<xla::ffi::AnyBuffer>()              // keys (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()              // digests (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()              // scores (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()              // seen (aliased)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // slots
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // fresh
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [3, T]
                                  .Attr<int32_t>("policy")
                                  .Attr<int32_t>("keep_seen"));
