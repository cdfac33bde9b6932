// Table-batched embedding (TBE): the layout shared by the CPU and CUDA handlers
// and by jaxrec/ops/tbe.py, which writes it.
//
// All tables live in one flat weight buffer; feature f (of T) looks up the table
// that starts at element `table_offset(f)`, with `dim(f)` columns and `rows(f)`
// rows, whose row 0 is row `first_row(f)` of all tables' rows stacked in order (the base
// of the row keys the sorted backward and the fused update walk); several features may
// share one table. The pooled output is [B, total_D]
// with feature f in columns [output_offset(f), output_offset(f + 1)).
//
// The layout travels as one int32 operand holding int64 values (JAX has no int64
// arrays unless x64 is enabled; offsets into the flat buffer can pass 2^31):
//   [table_offset[0..T), dim[0..T), rows[0..T), first_row[0..T), output_offset[0..T]]
// Bags are FBGEMM's: offsets[T*B+1], feature-major, over indices[N] (static
// capacity; slots past offsets[T*B] are padding and never read).
//
// Bad input never reads or writes outside a feature's own table: every kernel skips
// an id outside [0, rows(f)) (RowInRange: it contributes nothing, and no row or
// optimizer state is touched for it; the CUDA forward's checked modes read row 0 for
// it, FBGEMM's correction), and never reads indices outside [0, N). The wrappers clamp
// the offsets into [0, N], non-decreasing, before every kernel but the CUDA forward,
// which clamps each bag itself (docs/bounds_check.md, "Where the check runs" and "What
// NONE does with a bad id").
#pragma once

#include <cstdint>

#include "common/ffi_util.h"

namespace jaxrec {

// FBGEMM's PoolingMode values.
enum class PoolingMode : int32_t { kSum = 0, kMean = 1, kNone = 2 };

struct TbeLayout {
  const int64_t* table_offsets;   // [T]
  const int64_t* dims;            // [T]
  const int64_t* rows;            // [T]
  const int64_t* first_rows;      // [T]
  const int64_t* output_offsets;  // [T + 1]
  int64_t num_features;           // T

  // `packed` is the int32 operand (host memory on the CPU, device memory on the GPU).
  static TbeLayout FromPacked(const int32_t* packed, int64_t packed_count) {
    const int64_t* values = reinterpret_cast<const int64_t*>(packed);
    const int64_t t = (packed_count / 2 - 1) / 5;
    return {values, values + t, values + 2 * t, values + 3 * t, values + 4 * t, t};
  }
};

// Whether `id` is a row of a table of `rows` rows (rows >= 0), compared in 64 bits so
// int64 ids of 2^31 and more are never truncated; one unsigned compare, as a negative
// id wraps to a huge value.
template <typename I>
JAXREC_HOST_DEVICE bool RowInRange(I id, int64_t rows) {
  return static_cast<uint64_t>(static_cast<int64_t>(id)) < static_cast<uint64_t>(rows);
}

// [start, end) of a bag with offsets `begin`, `end` clamped into [0, n], end >= start:
// the CUDA forward's own correction, a last line of defence elsewhere. In the offsets' own
// type, so that the CUDA forward clamps an int32 bag with int32 compares.
template <typename T>
JAXREC_HOST_DEVICE void ClampBag(T begin, T end, T n, T* start_out, T* end_out) {
  const T start = begin < 0 ? 0 : (begin > n ? n : begin);
  const T stop = end < start ? start : (end > n ? n : end);
  *start_out = start;
  *end_out = stop;
}

// Bits of x (0 for 0): the sorts of row keys order only the bits of the row count.
inline int BitWidth(uint64_t x) { return x == 0 ? 0 : 64 - __builtin_clzll(x); }

// Number of int32 entries of a packed layout for T features.
constexpr int64_t PackedLayoutSize(int64_t num_features) { return 2 * (5 * num_features + 1); }

}  // namespace jaxrec
