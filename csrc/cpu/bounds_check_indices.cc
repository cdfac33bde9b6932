// CPU handler of bounds_check_indices (see common/bounds_check.h for the definition).
//
// Operands: rows_per_table[T], indices[N] (aliased with the indices result, so
// ids are fixed in place), offsets[T*B+1]. Results: indices, corrected offsets,
// report[4] (report[0] = number of corrections in WARNING mode).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/bounds_check.h"
#include "common/ffi_util.h"

namespace jaxrec {
namespace {

template <typename T>
ffi::Error BoundsCheck(const T* rows_per_table, int64_t num_features, T* indices, int64_t num_indices,
                       const T* offsets_in, T* offsets, int64_t num_bags, BoundsCheckMode mode,
                       std::string_view labels, int32_t* report) {
  const int64_t batch_size = num_features > 0 ? num_bags / num_features : 0;
  const T n = static_cast<T>(num_indices);
  int64_t corrections = 0;

  // Offsets: check each bag; WARNING/IGNORE correct them by the running max.
  if (offsets != offsets_in) std::memcpy(offsets, offsets_in, (num_bags + 1) * sizeof(T));
  if (mode != BoundsCheckMode::kFatal) offsets[0] = ClampOffset(offsets_in[0], n);
  for (int64_t k = 0; k < num_bags; ++k) {
    const T start = k == 0 ? offsets_in[0] : offsets[k];
    const T end = offsets_in[k + 1];
    if (IsBadBag(start, end, n)) {
      if (mode == BoundsCheckMode::kFatal) {
        return ffi::Error::InvalidArgument(BadOffsetsMessage(labels, batch_size, k, start, end, num_indices));
      }
      ++corrections;
    }
    if (mode != BoundsCheckMode::kFatal) {
      offsets[k + 1] = std::max(offsets[k], ClampOffset(end, n));
    }
  }

  // Ids inside the (now valid) bags.
  for (int64_t k = 0; k < num_bags; ++k) {
    const T num_rows = rows_per_table[k / batch_size];
    for (T p = offsets[k]; p < offsets[k + 1]; ++p) {
      if (!IsBadIndex(indices[p], num_rows)) continue;
      if (mode == BoundsCheckMode::kFatal) {
        return ffi::Error::InvalidArgument(BadIndexMessage(labels, batch_size, k, p, indices[p], num_rows));
      }
      indices[p] = 0;
      ++corrections;
    }
  }

  report[0] = mode == BoundsCheckMode::kWarning ? static_cast<int32_t>(corrections) : 0;
  report[1] = report[2] = report[3] = 0;
  return ffi::Error::Success();
}

ffi::Error BoundsCheckIndicesCpu(ffi::AnyBuffer rows_per_table, ffi::AnyBuffer indices_in,
                                 ffi::AnyBuffer offsets_in, ffi::Result<ffi::AnyBuffer> indices,
                                 ffi::Result<ffi::AnyBuffer> offsets,
                                 ffi::Result<ffi::Buffer<ffi::S32>> report, int32_t mode,
                                 std::string_view labels) {
  if (ffi::Error error = ValidateBoundsCheck(mode, rows_per_table, indices_in, offsets_in); error.failure()) {
    return error;
  }
  const int64_t num_indices = indices_in.element_count();
  const int64_t num_bags = static_cast<int64_t>(offsets_in.element_count()) - 1;
  const int64_t num_features = rows_per_table.element_count();
  return DispatchIndexType(indices_in.element_type(), "indices", [&](auto zero) {
    using T = decltype(zero);
    if (indices->untyped_data() != indices_in.untyped_data()) {
      std::memcpy(indices->untyped_data(), indices_in.untyped_data(), num_indices * sizeof(T));
    }
    return BoundsCheck<T>(rows_per_table.typed_data<T>(), num_features, indices->typed_data<T>(), num_indices,
                          offsets_in.typed_data<T>(), offsets->typed_data<T>(), num_bags,
                          static_cast<BoundsCheckMode>(mode), labels, report->typed_data());
  });
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecBoundsCheckIndicesCpu, jaxrec::BoundsCheckIndicesCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()              // rows_per_table
                                  .Arg<xla::ffi::AnyBuffer>()              // indices
                                  .Arg<xla::ffi::AnyBuffer>()              // offsets
                                  .Ret<xla::ffi::AnyBuffer>()              // indices (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()              // offsets
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // report
                                  .Attr<int32_t>("mode")
                                  .Attr<std::string_view>("labels"));
