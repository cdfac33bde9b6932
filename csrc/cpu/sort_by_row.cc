// CPU handler of jaxrec_sort_by_row: a batch's positions sorted by the table row each
// reads (cpu/row_sort.h), what the dense sorted backward walks. The wrapper and the jnp
// reference (the same sort by XLA, which the GPU runs) are jaxrec.ops.row_sort; the fused
// update sorts inside its own handler.
//
// Operands: indices I[N], offsets I[T*B+1] (non-decreasing, inside [0, N]: the callers
// correct them first; checked), feature_rows I[T] (rows of each feature's table),
// feature_first_rows I[T] (the first row of that table among all tables' rows; every
// key fits I, checked). Results: sorted_keys, sorted_positions, sorted_bags, each I[N].
#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "common/tbe_validate.h"
#include "cpu/row_sort.h"

namespace jaxrec {
namespace cpu {
namespace {

constexpr std::string_view kOp = "jaxrec_sort_by_row";

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
    const int64_t num_bags = static_cast<int64_t>(offsets.element_count()) - 1;
    if (num_bags % num_features != 0) {
      return Invalid(kOp, "offsets has " + std::to_string(num_bags + 1) +
                              " entries, which is not T * B + 1 for T = " + std::to_string(num_features));
    }
    if (ffi::Error e = CheckOffsets(kOp, offsets.typed_data<I>(), num_bags + 1, n); e.failure()) return e;
    return SortByRow<I, I>(pool, kOp, indices.typed_data<I>(), n, offsets.typed_data<I>(), num_bags,
                           feature_rows.typed_data<I>(), feature_first_rows.typed_data<I>(), num_features,
                           sorted_keys->typed_data<I>(), sorted_positions->typed_data<I>(),
                           sorted_bags->typed_data<I>());
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
