// CPU handlers of the dynamic vocabulary's hash table (jaxrec.ops.hash_table; the shared
// pieces and the layout: common/hash_table.h).
//
// jaxrec_hash_find: keys I[nb, S], digests u8[nb, S], ids I[N], table_of s32[N] (each
//   id's bucket range), bounds s32[T, 3] (common/hash_table.h: Ranges) -> slots s32[N]
//   (-1: absent).
// jaxrec_hash_insert: keys, digests, scores s32, seen s32 (each aliased with its result),
//   run_ids I[N] (the batch's distinct ids in hash order; an entry of count 0 is not an
//   id), run_tables s32[N] (their ranges), counts s32[N], step s32[], bounds -> the four
//   table results, run_slots s32[N], status s32[N] (hash_table::Status). Attribute policy
//   (hash_table::Policy).
// The runs of one bucket are consecutive; each bucket is placed by one item of the thread
// pool (its lookups, then its new ids in order), so the result does not depend on the
// thread count.
#include "common/hash_table.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/ffi_util.h"
#include "cpu/tbe_cpu_util.h"

namespace jaxrec {
namespace cpu {
namespace {

using namespace hash_table;  // NOLINT(build/namespaces): this file's own vocabulary

constexpr int64_t kIdsPerItem = 1 << 14;

template <typename I>
void Find(ffi::ThreadPool& pool, const I* keys, const uint8_t* digests, Ranges ranges, int size, const I* ids,
          const int32_t* table_of, int64_t n, int32_t* slots) {
  ParallelFor(pool, (n + kIdsPerItem - 1) / kIdsPerItem, [&](int64_t item) {
    for (int64_t i = item * kIdsPerItem, end = std::min(n, (item + 1) * kIdsPerItem); i < end; ++i) {
      const auto h = Hash(ids[i]);
      const int64_t bucket = ranges.Of(h, table_of[i]);
      if (bucket < 0) {
        slots[i] = -1;
        continue;
      }
      const int64_t first = bucket * size;
      const int p = FindInBucket(keys + first, digests + first, size, DigestOf(h), ids[i]);
      slots[i] = p < 0 ? -1 : static_cast<int32_t>(first + p);
    }
  });
}

struct Table {
  Ranges ranges;
  int size;
  uint8_t* digests;
  int32_t* scores;
  int32_t* seen;
};

// Places runs [begin, end), the runs of bucket `bucket`.
template <typename I>
void PlaceBucket(const Table& t, I* keys, int64_t bucket, const I* run_ids, const int32_t* counts,
                 int64_t begin, int64_t end, int32_t step, int32_t policy, int32_t keep_seen,
                 int32_t* run_slots, int32_t* status) {
  const int64_t first = bucket * t.size;
  I* k = keys + first;
  uint8_t* d = t.digests + first;
  int32_t* score = t.scores + first;
  std::vector<bool> hit(t.size, false);
  std::vector<int64_t> fresh;  // the new runs, in order
  for (int64_t r = begin; r < end; ++r) {
    run_slots[r] = -1;
    if (counts[r] <= 0) {
      status[r] = kNotAnId;
      continue;
    }
    const int p = FindInBucket(k, d, t.size, DigestOf(Hash(run_ids[r])), run_ids[r]);
    if (p < 0) {
      status[r] = kFailed;  // until placed
      fresh.push_back(r);
      continue;
    }
    status[r] = kFound;
    run_slots[r] = static_cast<int32_t>(first + p);
    hit[p] = true;
    score[p] = NewScore(policy, score[p], true, counts[r], step);
    t.seen[first + p] = step;
  }
  if (fresh.empty()) return;
  std::vector<std::pair<uint64_t, int>> candidates;
  for (int p = 0; p < t.size; ++p) {
    // in use: hit by this batch, or (keep_seen) seen at this step by an earlier call
    const bool in_use = hit[p] || (keep_seen && t.seen[first + p] == step);
    const uint64_t rank = CandidateRank(d[p] == 0, in_use, score[p], p, policy);
    if (rank != kNotCandidate) candidates.emplace_back(rank, p);
  }
  const size_t placed = std::min(fresh.size(), candidates.size());
  std::partial_sort(candidates.begin(), candidates.begin() + placed, candidates.end());
  for (size_t j = 0; j < placed; ++j) {
    const int64_t r = fresh[j];
    const int p = candidates[j].second;
    status[r] = d[p] == 0 ? kInserted : kInsertedEvicting;
    run_slots[r] = static_cast<int32_t>(first + p);
    k[p] = run_ids[r];
    d[p] = DigestOf(Hash(run_ids[r]));
    score[p] = NewScore(policy, 0, false, counts[r], step);
    t.seen[first + p] = step;
  }
}

template <typename I>
void Insert(ffi::ThreadPool& pool, const Table& t, I* keys, const I* run_ids, const int32_t* run_tables,
            const int32_t* counts, int64_t n, int32_t step, int32_t policy, int32_t keep_seen,
            int32_t* run_slots, int32_t* status) {
  auto bucket = [&](int64_t r) { return t.ranges.Of(Hash(run_ids[r]), run_tables[r]); };
  // An item places the buckets whose first run lies in its share of the runs.
  ParallelFor(pool, (n + kIdsPerItem - 1) / kIdsPerItem, [&](int64_t item) {
    const int64_t stop = std::min(n, (item + 1) * kIdsPerItem);
    int64_t r = item * kIdsPerItem;
    while (r > 0 && r < stop && bucket(r - 1) == bucket(r)) ++r;  // that bucket is the previous item's
    while (r < stop) {
      const int64_t b = bucket(r);
      int64_t end = r + 1;
      while (end < n && bucket(end) == b) ++end;
      if (b >= 0) {
        PlaceBucket(t, keys, b, run_ids, counts, r, end, step, policy, keep_seen, run_slots, status);
      } else {  // runs of no range: no ids
        for (int64_t q = r; q < end; ++q) run_slots[q] = -1, status[q] = kNotAnId;
      }
      r = end;
    }
  });
}

void CopyUnlessAliased(const ffi::AnyBuffer& from, ffi::AnyBuffer& to) {
  if (from.untyped_data() != to.untyped_data() && from.size_bytes() > 0) {
    std::memcpy(to.untyped_data(), from.untyped_data(), from.size_bytes());
  }
}

ffi::Error HashFindCpu(ffi::ThreadPool pool, ffi::AnyBuffer keys, ffi::AnyBuffer digests, ffi::AnyBuffer ids,
                       ffi::AnyBuffer table_of, ffi::AnyBuffer bounds,
                       ffi::Result<ffi::Buffer<ffi::S32>> slots) {
  if (ffi::Error e = CheckTable("jaxrec_hash_find", keys, digests, nullptr, nullptr, ids, table_of, bounds);
      e.failure()) {
    return e;
  }
  const Ranges ranges{bounds.typed_data<int32_t>(), static_cast<int32_t>(bounds.dimensions()[0])};
  const auto dims = keys.dimensions();
  return DispatchIndexType(keys.element_type(), "keys", [&](auto zero) {
    using I = decltype(zero);
    Find<I>(pool, keys.typed_data<I>(), digests.typed_data<uint8_t>(), ranges, static_cast<int>(dims[1]),
            ids.typed_data<I>(), table_of.typed_data<int32_t>(), ids.element_count(), slots->typed_data());
    return ffi::Error::Success();
  });
}

ffi::Error HashInsertCpu(ffi::ThreadPool pool, ffi::AnyBuffer keys_in, ffi::AnyBuffer digests_in,
                         ffi::AnyBuffer scores_in, ffi::AnyBuffer seen_in, ffi::AnyBuffer run_ids,
                         ffi::AnyBuffer run_tables, ffi::AnyBuffer counts, ffi::AnyBuffer step,
                         ffi::AnyBuffer bounds, ffi::Result<ffi::AnyBuffer> keys,
                         ffi::Result<ffi::AnyBuffer> digests, ffi::Result<ffi::AnyBuffer> scores,
                         ffi::Result<ffi::AnyBuffer> seen, ffi::Result<ffi::Buffer<ffi::S32>> run_slots,
                         ffi::Result<ffi::Buffer<ffi::S32>> status, int32_t policy, int32_t keep_seen) {
  constexpr std::string_view kOp = "jaxrec_hash_insert";
  if (ffi::Error e = CheckTable(kOp, keys_in, digests_in, &scores_in, &seen_in, run_ids, run_tables, bounds);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckInsert(kOp, run_ids, counts, ffi::DataType::S32, "counts", step, policy);
      e.failure())
    return e;
  CopyUnlessAliased(keys_in, *keys);
  CopyUnlessAliased(digests_in, *digests);
  CopyUnlessAliased(scores_in, *scores);
  CopyUnlessAliased(seen_in, *seen);
  const auto dims = keys_in.dimensions();
  const Ranges ranges{bounds.typed_data<int32_t>(), static_cast<int32_t>(bounds.dimensions()[0])};
  const Table t{ranges, static_cast<int>(dims[1]), digests->typed_data<uint8_t>(),
                scores->typed_data<int32_t>(), seen->typed_data<int32_t>()};
  return DispatchIndexType(keys_in.element_type(), "keys", [&](auto zero) {
    using I = decltype(zero);
    Insert<I>(pool, t, keys->typed_data<I>(), run_ids.typed_data<I>(), run_tables.typed_data<int32_t>(),
              counts.typed_data<int32_t>(), run_ids.element_count(), step.typed_data<int32_t>()[0], policy,
              keep_seen, run_slots->typed_data(), status->typed_data());
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace cpu
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecHashFindCpu, jaxrec::cpu::HashFindCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // keys
                                  .Arg<xla::ffi::AnyBuffer>()              // digests
                                  .Arg<xla::ffi::AnyBuffer>()              // ids
                                  .Arg<xla::ffi::AnyBuffer>()              // table_of
                                  .Arg<xla::ffi::AnyBuffer>()              // bounds
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // slots
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecHashInsertCpu, jaxrec::cpu::HashInsertCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
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
                                  .Attr<int32_t>("policy")
                                  .Attr<int32_t>("keep_seen"));
