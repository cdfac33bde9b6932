// Table-batched embedding (TBE): the layout shared by the CPU and CUDA handlers
// and by jaxrec/ops/tbe.py, which writes it.
//
// All tables live in one flat weight buffer; feature f (of T) looks up the table
// that starts at element `table_offset(f)`, with `dim(f)` columns and `rows(f)`
// rows; several features may share one table. The pooled output is [B, total_D]
// with feature f in columns [output_offset(f), output_offset(f + 1)).
//
// The layout travels as one int32 operand holding int64 values (JAX has no int64
// arrays unless x64 is enabled; offsets into the flat buffer can pass 2^31):
//   [table_offset[0..T), dim[0..T), rows[0..T), output_offset[0..T]]
// Bags are FBGEMM's: offsets[T*B+1], feature-major, over indices[N] (static
// capacity; slots past offsets[T*B] are padding and never read). Ids are assumed
// in range: the Python wrapper runs bounds_check_indices first.
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
  const int64_t* output_offsets;  // [T + 1]
  int64_t num_features;           // T

  // `packed` is the int32 operand (host memory on the CPU, device memory on the GPU).
  static TbeLayout FromPacked(const int32_t* packed, int64_t packed_count) {
    const int64_t* values = reinterpret_cast<const int64_t*>(packed);
    const int64_t t = (packed_count / 2 - 1) / 4;
    return {values, values + t, values + 2 * t, values + 3 * t, t};
  }
};

// Number of int32 entries of a packed layout for T features.
constexpr int64_t PackedLayoutSize(int64_t num_features) { return 2 * (4 * num_features + 1); }

}  // namespace jaxrec
