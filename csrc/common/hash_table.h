// The dynamic vocabulary's hash table (jaxrec.ops.hash_table), shared by its CPU and CUDA
// handlers: the hash, bucket and digest of an id, the lookup of an id in its bucket, the
// rank of a slot as an insertion candidate, and the operands' checks.
//
// Table: keys I[num_buckets, S], digests u8 (0 = empty, else the low byte of the id's
// hash, 0 read as 1), scores and seen s32. bucket = (hi32(h) * num_buckets) >> 32 grows
// with the hash h, so a batch sorted by h comes grouped by bucket.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/ffi_util.h"
#include "common/tbe_validate.h"

namespace jaxrec {
namespace hash_table {

// What find_or_insert did with a distinct id (jaxrec.ops.hash_table_reference's codes).
enum Status : int32_t { kNotAnId = 0, kFound = 1, kInserted = 2, kInsertedEvicting = 3, kFailed = 4 };
enum Policy : int32_t { kLru = 0, kLfu = 1, kNone = 2 };

constexpr int kMaxBucketSize = 1024;  // jaxrec.ops.hash_table.MAX_BUCKET_SIZE

// murmur3's finalizers: bijections of the id's bits.
JAXREC_HOST_DEVICE uint32_t Hash(int32_t id) {
  uint32_t h = static_cast<uint32_t>(id);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}
JAXREC_HOST_DEVICE uint64_t Hash(int64_t id) {
  uint64_t h = static_cast<uint64_t>(id);
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 33);
}

JAXREC_HOST_DEVICE int64_t BucketOf(uint32_t h, int64_t num_buckets) {
  return static_cast<int64_t>((uint64_t{h} * static_cast<uint64_t>(num_buckets)) >> 32);
}
JAXREC_HOST_DEVICE int64_t BucketOf(uint64_t h, int64_t num_buckets) {
  return BucketOf(static_cast<uint32_t>(h >> 32), num_buckets);
}

// The bucket ranges of a table (jaxrec.ops.hash_table.Range), bounds s32[T, 3]: range t
// is buckets [first, first + local) and holds a local-bucket part of a table of total
// buckets; an id of range t has bucket first + BucketOf(h, total) % local (an id routed to
// a part has its bucket in the part's range of the larger table).
// An id of no range (t outside [0, count): the wrapper's padding runs, a bad table_of)
// has no bucket: -1.
struct Ranges {
  const int32_t* bounds;
  int32_t count;
  template <typename H>
  JAXREC_HOST_DEVICE int64_t Of(H h, int32_t t) const {
    if (t < 0 || t >= count) return -1;
    const int32_t first = bounds[3 * t], local = bounds[3 * t + 1], total = bounds[3 * t + 2];
    const int64_t b = BucketOf(h, total);
    return first + (total == local ? b : b % local);
  }
};

template <typename H>
JAXREC_HOST_DEVICE uint8_t DigestOf(H h) {
  const uint8_t d = static_cast<uint8_t>(h & 0xFF);
  return d == 0 ? 1 : d;
}

// The position of `id` in its bucket (`keys` and `digests` at the bucket's first slot),
// or -1: keys are compared only where the digest matches.
template <typename I>
JAXREC_HOST_DEVICE int FindInBucket(const I* keys, const uint8_t* digests, int size, uint8_t digest, I id) {
  for (int p = 0; p < size; ++p) {
    if (digests[p] == digest && keys[p] == id) return p;
  }
  return -1;
}

// A slot's rank as a candidate for a new id of its bucket, smaller first: empty slots by
// position, then evictable ones (held, not used by this batch, an evicting policy) by
// (score, position); kNotCandidate for the others. Built from the bucket's state before
// the batch's insertions.
constexpr uint64_t kNotCandidate = ~uint64_t{0};
JAXREC_HOST_DEVICE uint64_t CandidateRank(bool empty, bool hit, int32_t score, int position, int32_t policy) {
  if (empty) return static_cast<uint64_t>(position);
  if (hit || policy == kNone) return kNotCandidate;
  const uint64_t biased = static_cast<uint32_t>(score) ^ 0x80000000u;  // int32 order as unsigned
  return (uint64_t{1} << 62) | (biased << 24) | static_cast<uint64_t>(position);
}

// A new id's score: its step (LRU, and "none") or its count in the batch (LFU); a held
// id's: the step, or its old count plus the batch's.
JAXREC_HOST_DEVICE int32_t NewScore(int32_t policy, int32_t old_score, bool found, int32_t count,
                                    int32_t step) {
  if (policy != kLfu) return step;
  return (found ? old_score : 0) + count;
}

// Shapes and dtypes of a table's operands (keys, digests, scores, seen), of the ids and
// their ranges (table_of s32 like the ids) and of the bounds (s32[T, 3]; their values are
// the Python wrapper's, checked there).
inline ffi::Error CheckTable(std::string_view op, const ffi::AnyBuffer& keys, const ffi::AnyBuffer& digests,
                             const ffi::AnyBuffer* scores, const ffi::AnyBuffer* seen,
                             const ffi::AnyBuffer& ids, const ffi::AnyBuffer& table_of,
                             const ffi::AnyBuffer& bounds) {
  const auto dims = keys.dimensions();
  if (dims.size() != 2 || dims[0] < 1 || dims[1] < 1 || dims[1] > kMaxBucketSize) {
    return Invalid(op, "keys must be [num_buckets >= 1, bucket_size] with bucket_size in [1, " +
                           std::to_string(kMaxBucketSize) + "], got " + ShapeString(dims));
  }
  if (!IsIndexType(keys.element_type()) || ids.element_type() != keys.element_type()) {
    return Invalid(op, "keys and ids must be both int32 or both int64, got " +
                           DtypeName(keys.element_type()) + " and " + DtypeName(ids.element_type()));
  }
  if (ids.dimensions().size() != 1)
    return Invalid(op, "ids must be 1-D, got " + ShapeString(ids.dimensions()));
  if (table_of.element_type() != ffi::DataType::S32 || table_of.element_count() != ids.element_count()) {
    return Invalid(op, "table_of must be int32 like the ids, [" + std::to_string(ids.element_count()) + "]");
  }
  const auto bdims = bounds.dimensions();
  if (bounds.element_type() != ffi::DataType::S32 || bdims.size() != 2 || bdims[0] < 1 || bdims[1] != 3) {
    return Invalid(op, "bounds must be int32[T >= 1, 3], got " + ShapeString(bdims));
  }
  const auto same_shape = [&](const ffi::AnyBuffer& b) {
    return b.dimensions().size() == 2 && b.dimensions()[0] == dims[0] && b.dimensions()[1] == dims[1];
  };
  if (!same_shape(digests) || digests.element_type() != ffi::DataType::U8) {
    return Invalid(op, "digests must be uint8 of keys' shape " + ShapeString(dims));
  }
  for (const ffi::AnyBuffer* b : {scores, seen}) {
    if (b != nullptr && (!same_shape(*b) || b->element_type() != ffi::DataType::S32)) {
      return Invalid(op, "scores and seen must be int32 of keys' shape " + ShapeString(dims));
    }
  }
  return ffi::Error::Success();
}

// The operands of find_or_insert besides the table and the ids: one per id (the CPU
// handler's counts s32, the CUDA handler's valid pred), a step s32 scalar, the policy.
inline ffi::Error CheckInsert(std::string_view op, const ffi::AnyBuffer& ids, const ffi::AnyBuffer& per_id,
                              ffi::DataType per_id_type, std::string_view per_id_name,
                              const ffi::AnyBuffer& step, int32_t policy) {
  if (per_id.element_type() != per_id_type || per_id.element_count() != ids.element_count()) {
    return Invalid(op, std::string(per_id_name) + " must be " + DtypeName(per_id_type) + " like the ids, [" +
                           std::to_string(ids.element_count()) + "]");
  }
  if (step.element_type() != ffi::DataType::S32 || step.element_count() != 1) {
    return Invalid(op, "step must be an int32 scalar");
  }
  if (policy < kLru || policy > kNone) {
    return Invalid(op, "policy must be 0 (lru), 1 (lfu) or 2 (none), got " + std::to_string(policy));
  }
  return ffi::Error::Success();
}

}  // namespace hash_table
}  // namespace jaxrec
