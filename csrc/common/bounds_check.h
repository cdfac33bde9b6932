// bounds_check_indices: the definition shared by the CPU and CUDA handlers.
//
// Input in FBGEMM's layout: `offsets` has T*B+1 entries (feature-major bags),
// `indices` has a static capacity N; bag k = t*B + b covers indices[offsets[k],
// offsets[k+1]) and looks up a table of rows_per_table[t] rows. Slots past the
// last offset are padding: never checked, never changed.
//
// A bag is bad when !(0 <= start <= end <= N), where `start` is its corrected
// start (the original one for bag 0) and `end` its original end, which is what
// FBGEMM's sequential CPU loop sees. Correction (WARNING, IGNORE) clamps every
// offset into [0, N] and makes the offsets non-decreasing:
//   corrected[i] = max(clamp(offsets[0], 0, N), ..., clamp(offsets[i], 0, N)),
// the closed form of FBGEMM's bag-by-bag adjustment, which makes it a parallel
// scan. A bad id (< 0 or >= rows) inside a corrected bag becomes row 0.
// The Python reference (jaxrec/ops/bounds_check.py) mirrors this file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"

namespace jaxrec {

// FBGEMM's BoundsCheckMode values.
enum class BoundsCheckMode : int32_t { kFatal = 0, kWarning = 1, kIgnore = 2, kNone = 3 };

template <typename T>
JAXREC_HOST_DEVICE T ClampOffset(T offset, T num_indices) {
  return offset < 0 ? T{0} : (offset > num_indices ? num_indices : offset);
}

template <typename T>
JAXREC_HOST_DEVICE bool IsBadBag(T start, T end, T num_indices) {
  return start < 0 || start > end || end > num_indices;
}

template <typename T>
JAXREC_HOST_DEVICE bool IsBadIndex(T index, T num_rows) {
  return index < 0 || index >= num_rows;
}

// Checks what the handlers cannot trust blindly (the Python wrapper checked it
// first): the mode, one index dtype for all operands, T*B+1 offsets, < 2^31 ids.
ffi::Error ValidateBoundsCheck(int32_t mode, const ffi::AnyBuffer& rows_per_table,
                               const ffi::AnyBuffer& indices, const ffi::AnyBuffer& offsets);

// FATAL-mode messages. `labels` holds one line per feature ("feature 'f' of
// table 't'"), written by the Python wrapper; a missing line reads "feature t".
std::string BadOffsetsMessage(std::string_view labels, int64_t batch_size, int64_t bag, int64_t start,
                              int64_t end, int64_t num_indices);
std::string BadIndexMessage(std::string_view labels, int64_t batch_size, int64_t bag, int64_t position,
                            int64_t index, int64_t num_rows);

}  // namespace jaxrec
