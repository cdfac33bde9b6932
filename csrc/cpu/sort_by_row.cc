// CPU handler of jaxrec_sort_by_row: a batch's positions sorted by the table row each
// reads, what the fused update walks (tbe_fused_update.cc: runs of one row). The
// wrapper and the jnp reference (the same sort by XLA, which the GPU runs) are
// jaxrec.ops.row_sort.
//
// Operands: indices I[N], offsets I[T*B+1] (non-decreasing, inside [0, N]: the callers
// correct them first; checked), feature_rows I[T] (rows of each feature's table),
// feature_first_rows I[T] (the first row of that table among all tables' rows; every
// key fits I, checked). Results: sorted_keys, sorted_positions, sorted_bags, each I[N].
//
// Position p inside bag k (feature f = k / B) whose id is a row of f's table has key
// feature_first_rows[f] + id; every other position has the dtype's max (sorted last).
// Its bag is k, -1 before the first bag and T*B after the last. The sort is stable
// (positions ascending within a key): a least-significant-digit radix sort of the keys'
// ranks (the max ranks as the total row count), only over the bits that count, at most
// kMaxDigitBits a pass; a pass in which every rank has the same digit is skipped. Each
// pass splits the positions into chunks that count their digits in parallel and then
// scatter their entries in order, so the result does not depend on the thread count.
// XLA's own CPU sort is a comparison sort on one thread; it took 40-70% of the update.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cpu/tbe_cpu_util.h"

namespace jaxrec {
namespace cpu {
namespace {

constexpr std::string_view kOp = "jaxrec_sort_by_row";
constexpr int kMaxDigitBits = 11;       // 2048 buckets: a chunk's counts stay in L1
constexpr int64_t kMinChunk = 1 << 16;  // positions per chunk of a pass
constexpr int64_t kBagsPerItem = 4096;  // bags per item of the key pass

int BitWidth(uint64_t x) { return x == 0 ? 0 : 64 - __builtin_clzll(x); }

template <typename I>
ffi::Error SortByRow(ffi::ThreadPool& pool, const I* indices, int64_t n, const I* offsets, int64_t num_bags,
                     const I* feature_rows, const I* first_rows, int64_t num_features, I* keys_out,
                     I* positions_out, I* bags_out) {
  using U = std::make_unsigned_t<I>;
  constexpr I kSentinel = std::numeric_limits<I>::max();

  // The operands' values: bags inside [0, N], non-decreasing; keys below the sentinel.
  if (num_bags % num_features != 0) {
    return Invalid(kOp, "offsets has " + std::to_string(num_bags + 1) +
                            " entries, which is not T * B + 1 for T = " + std::to_string(num_features));
  }
  if (offsets[0] < 0 || offsets[num_bags] > n) {
    return Invalid(kOp,
                   "offsets must lie in [0, N = " + std::to_string(n) + "]; run bounds_check_indices first");
  }
  for (int64_t k = 0; k < num_bags; ++k) {
    if (offsets[k + 1] < offsets[k]) {
      return Invalid(kOp, "offsets must be non-decreasing; offsets[" + std::to_string(k + 1) +
                              "] < offsets[" + std::to_string(k) + "]; run bounds_check_indices first");
    }
  }
  uint64_t total_rows = 0;  // the sentinel's rank
  for (int64_t f = 0; f < num_features; ++f) {
    const int64_t rows = feature_rows[f], base = first_rows[f];
    if (rows < 0 || base < 0 || rows > int64_t{kSentinel} - base) {
      return Invalid(kOp, "feature " + std::to_string(f) + ": rows [" + std::to_string(base) + ", " +
                              std::to_string(base) + " + " + std::to_string(rows) + ") must lie in [0, " +
                              std::to_string(int64_t{kSentinel}) + ") (int64 ids take more rows)");
    }
    total_rows = std::max<uint64_t>(total_rows, base + rows);
  }
  if (n == 0) return ffi::Error::Success();

  // Rank and bag of every position, one pass over the bags; positions outside them rank last.
  std::vector<U> ranks(n), ranks_tmp(n);
  std::vector<I> order(n), order_tmp(n), bags(n);
  const int64_t first = offsets[0], last = offsets[num_bags];
  for (int64_t p = 0; p < first; ++p) ranks[p] = total_rows, bags[p] = -1;
  for (int64_t p = last; p < n; ++p) ranks[p] = total_rows, bags[p] = static_cast<I>(num_bags);
  const int64_t batch_size = num_bags / num_features;
  ParallelFor(pool, (num_bags + kBagsPerItem - 1) / kBagsPerItem, [&](int64_t item) {
    const int64_t end = std::min(num_bags, (item + 1) * kBagsPerItem);
    for (int64_t k = item * kBagsPerItem; k < end; ++k) {
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
  const int passes = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit_bits = passes > 0 ? (bits + passes - 1) / passes : 0;
  const int64_t buckets = int64_t{1} << digit_bits;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max(kMinChunk, (n + threads - 1) / threads);
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

ffi::Error SortByRowCpu(ffi::ThreadPool pool, ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                        ffi::AnyBuffer feature_rows, ffi::AnyBuffer feature_first_rows,
                        ffi::Result<ffi::AnyBuffer> sorted_keys, ffi::Result<ffi::AnyBuffer> sorted_positions,
                        ffi::Result<ffi::AnyBuffer> sorted_bags) {
  const int64_t n = static_cast<int64_t>(indices.element_count());
  const int64_t num_features = static_cast<int64_t>(feature_rows.element_count());
  if (indices.dimensions().size() != 1 || offsets.dimensions().size() != 1 || offsets.element_count() < 1) {
    return Invalid(kOp, "indices and offsets must be 1-D, offsets of T * B + 1 >= 1 entries; got indices " +
                            ShapeString(indices.dimensions()) + ", offsets " +
                            ShapeString(offsets.dimensions()));
  }
  for (const ffi::AnyBuffer* operand : {&offsets, &feature_rows, &feature_first_rows}) {
    if (operand->element_type() != indices.element_type()) {
      return Invalid(kOp, "offsets, feature_rows and feature_first_rows must have the indices' dtype " +
                              DtypeName(indices.element_type()) + ", got " +
                              DtypeName(operand->element_type()));
    }
  }
  if (num_features < 1 || static_cast<int64_t>(feature_first_rows.element_count()) != num_features) {
    return Invalid(kOp, "feature_rows and feature_first_rows must hold T >= 1 values each, got " +
                            std::to_string(num_features) + " and " +
                            std::to_string(feature_first_rows.element_count()));
  }
  for (ffi::AnyBuffer* result : {&*sorted_keys, &*sorted_positions, &*sorted_bags}) {
    if (result->element_type() != indices.element_type() ||
        static_cast<int64_t>(result->element_count()) != n) {
      return Invalid(kOp, "each result must be like indices, " + DtypeName(indices.element_type()) + "[" +
                              std::to_string(n) + "]");
    }
  }
  return DispatchIndexType(indices.element_type(), "indices", [&](auto zero) {
    using I = decltype(zero);
    return SortByRow<I>(pool, indices.typed_data<I>(), n, offsets.typed_data<I>(),
                        static_cast<int64_t>(offsets.element_count()) - 1, feature_rows.typed_data<I>(),
                        feature_first_rows.typed_data<I>(), num_features, sorted_keys->typed_data<I>(),
                        sorted_positions->typed_data<I>(), sorted_bags->typed_data<I>());
  });
}

}  // namespace
}  // namespace cpu
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecSortByRowCpu, jaxrec::cpu::SortByRowCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // indices
                                  .Arg<xla::ffi::AnyBuffer>()  // offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // feature_rows
                                  .Arg<xla::ffi::AnyBuffer>()  // feature_first_rows
                                  .Ret<xla::ffi::AnyBuffer>()  // sorted_keys
                                  .Ret<xla::ffi::AnyBuffer>()  // sorted_positions
                                  .Ret<xla::ffi::AnyBuffer>()  // sorted_bags
);
