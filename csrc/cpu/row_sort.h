// A batch's positions sorted by the table row each reads, on the CPU: what the fused update
// walks (tbe_fused_update.cc: runs of one row) and the handler of jaxrec_sort_by_row
// returns (sort_by_row.cc; the dense backward's sort). The jnp reference is
// jaxrec.ops.row_sort.sort_by_row_reference.
//
// Position p inside bag k (feature f = k / B) whose id is a row of f's table has key
// first_rows[f] + id; every other position has the dtype's max (sorted last). Its bag is
// k, -1 before the first bag and T*B after the last. The sort is stable (positions
// ascending within a key): a least-significant-digit radix sort of the keys' ranks (the
// max ranks as the total row count), only over the bits that count, at most
// kMaxDigitBits a pass; a pass in which every rank has the same digit is skipped. Each
// pass splits the positions into chunks that count their digits in parallel and then
// scatter their entries in order, so the result does not depend on the thread count.
// XLA's own CPU sort is a comparison sort on one thread; it took 40-70% of the update.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cpu/tbe_cpu_util.h"

namespace jaxrec {
namespace cpu {
namespace row_sort {

constexpr int kMaxDigitBits = 11;       // 2048 buckets: a chunk's counts stay in L1
constexpr int64_t kMinChunk = 1 << 16;  // positions per chunk of a pass
constexpr int64_t kBagsPerItem = 4096;  // bags per item of the key pass

}  // namespace row_sort

// Sorts indices[n] by row key into keys_out, positions_out and bags_out (each I[n]);
// feature_rows and first_rows describe the T features' tables (R: I or int64_t). The
// offsets, T*B+1 of them, must be checked already (CheckOffsets, cpu/tbe_cpu_util.h).
// Checks that every key fits I below its max; sets *total_rows_out (when given) to the row count of all
// tables (the largest first_rows[f] + feature_rows[f]).
template <typename I, typename R>
ffi::Error SortByRow(ffi::ThreadPool& pool, std::string_view op, const I* indices, int64_t n,
                     const I* offsets, int64_t num_bags, const R* feature_rows, const R* first_rows,
                     int64_t num_features, I* keys_out, I* positions_out, I* bags_out,
                     int64_t* total_rows_out = nullptr) {
  using U = std::make_unsigned_t<I>;
  constexpr I kSentinel = std::numeric_limits<I>::max();

  // Every key below the sentinel.
  uint64_t total_rows = 0;  // the sentinel's rank
  for (int64_t f = 0; f < num_features; ++f) {
    const int64_t rows = feature_rows[f], base = first_rows[f];
    if (rows < 0 || base < 0 || rows > int64_t{kSentinel} - base) {
      return Invalid(op, "feature " + std::to_string(f) + ": rows [" + std::to_string(base) + ", " +
                             std::to_string(base) + " + " + std::to_string(rows) + ") must lie in [0, " +
                             std::to_string(int64_t{kSentinel}) + ") (int64 ids take more rows)");
    }
    total_rows = std::max<uint64_t>(total_rows, base + rows);
  }
  if (total_rows_out != nullptr) *total_rows_out = static_cast<int64_t>(total_rows);
  if (n == 0) return ffi::Error::Success();

  // Rank and bag of every position, one pass over the bags; positions outside them rank last.
  std::vector<U> ranks(n), ranks_tmp(n);
  std::vector<I> order(n), order_tmp(n), bags(n);
  const int64_t first = offsets[0], last = offsets[num_bags];
  for (int64_t p = 0; p < first; ++p) ranks[p] = total_rows, bags[p] = -1;
  for (int64_t p = last; p < n; ++p) ranks[p] = total_rows, bags[p] = static_cast<I>(num_bags);
  const int64_t batch_size = num_bags / num_features;
  ParallelFor(pool, (num_bags + row_sort::kBagsPerItem - 1) / row_sort::kBagsPerItem, [&](int64_t item) {
    const int64_t end = std::min(num_bags, (item + 1) * row_sort::kBagsPerItem);
    for (int64_t k = item * row_sort::kBagsPerItem; k < end; ++k) {
      const int64_t f = k / batch_size, rows = feature_rows[f], base = first_rows[f];
      for (int64_t p = offsets[k]; p < offsets[k + 1]; ++p) {
        ranks[p] =
            RowInRange(indices[p], rows) ? static_cast<U>(base + indices[p]) : static_cast<U>(total_rows);
        bags[p] = static_cast<I>(k);
      }
    }
  });
  for (int64_t p = 0; p < n; ++p) order[p] = static_cast<I>(p);

  // The radix passes over the bits of total_rows.
  const int bits = BitWidth(total_rows);
  const int passes = (bits + row_sort::kMaxDigitBits - 1) / row_sort::kMaxDigitBits;
  const int digit_bits = passes > 0 ? (bits + passes - 1) / passes : 0;
  const int64_t buckets = int64_t{1} << digit_bits;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max(row_sort::kMinChunk, (n + threads - 1) / threads);
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  std::vector<int64_t> counts(num_chunks * buckets);
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * digit_bits;
    const U mask = static_cast<U>(buckets - 1);
    std::fill(counts.begin(), counts.end(), 0);
    ParallelFor(pool, num_chunks, [&](int64_t c) {
      int64_t* count = counts.data() + c * buckets;
      for (int64_t i = c * chunk, end = std::min(n, (c + 1) * chunk); i < end; ++i)
        ++count[(ranks[i] >> shift) & mask];
    });
    // Chunk c's first slot for digit d: every entry of a smaller digit, then chunks before c.
    int64_t next = 0;
    bool one_digit = false;
    for (int64_t d = 0; d < buckets; ++d) {
      int64_t in_digit = 0;
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t count = counts[c * buckets + d];
        counts[c * buckets + d] = next + in_digit;
        in_digit += count;
      }
      one_digit |= in_digit == n;
      next += in_digit;
    }
    if (one_digit) continue;  // the pass would move nothing
    ParallelFor(pool, num_chunks, [&](int64_t c) {
      int64_t* slot = counts.data() + c * buckets;
      for (int64_t i = c * chunk, end = std::min(n, (c + 1) * chunk); i < end; ++i) {
        const int64_t to = slot[(ranks[i] >> shift) & mask]++;
        ranks_tmp[to] = ranks[i];
        order_tmp[to] = order[i];
      }
    });
    ranks.swap(ranks_tmp);
    order.swap(order_tmp);
  }

  ParallelFor(pool, num_chunks, [&](int64_t c) {
    for (int64_t i = c * chunk, end = std::min(n, (c + 1) * chunk); i < end; ++i) {
      keys_out[i] = ranks[i] == total_rows ? kSentinel : static_cast<I>(ranks[i]);
      positions_out[i] = order[i];
      bags_out[i] = bags[order[i]];
    }
  });
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jaxrec
