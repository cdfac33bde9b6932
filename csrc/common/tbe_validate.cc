#include "common/tbe_validate.h"

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "common/fused_optimizer.h"

namespace jaxrec {
namespace {

std::string FloatTypeMessage(std::string_view name, ffi::DataType dtype) {
  return std::string(name) + " must be float32, float16 or bfloat16, got " + DtypeName(dtype);
}

// The operands every TBE handler takes: weights, indices, offsets, per_sample_weights,
// layout, and the pooling attribute.
ffi::Error ValidateLookup(std::string_view op, ffi::AnyBuffer weights, ffi::AnyBuffer indices,
                          ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                          int32_t pooling, TbeBatch* batch) {
  if (pooling < 0 || pooling > 2) {
    return Invalid(op, "pooling must be 0 (SUM), 1 (MEAN) or 2 (NONE), got " + std::to_string(pooling));
  }
  if (!IsFloatType(weights.element_type())) {
    return Invalid(op, FloatTypeMessage("weights", weights.element_type()));
  }
  if (weights.dimensions().size() != 1) {
    return Invalid(op, "weights must be 1-D (the flat buffer of all tables), got shape " +
                           ShapeString(weights.dimensions()));
  }
  if (!IsIndexType(indices.element_type())) {
    return Invalid(op, "indices must be int32 or int64, got " + DtypeName(indices.element_type()));
  }
  if (offsets.element_type() != indices.element_type()) {
    return Invalid(op, "offsets must have the dtype of indices (" + DtypeName(indices.element_type()) +
                           "), got " + DtypeName(offsets.element_type()));
  }
  if (indices.dimensions().size() != 1 || offsets.dimensions().size() != 1) {
    return Invalid(op, "indices and offsets must be 1-D, got shapes " + ShapeString(indices.dimensions()) +
                           " and " + ShapeString(offsets.dimensions()));
  }
  if (layout.element_type() != ffi::DataType::S32) {
    return Invalid(op, "layout must be int32 (packed int64), got " + DtypeName(layout.element_type()));
  }
  const int64_t packed = layout.element_count();
  if (packed < PackedLayoutSize(1) || packed % 2 != 0 || (packed / 2 - 1) % 5 != 0) {
    return Invalid(op, "layout has " + std::to_string(packed) +
                           " int32 entries; expected 2 * (5 * T + 1) for T >= 1 features");
  }
  if (reinterpret_cast<uintptr_t>(layout.untyped_data()) % alignof(int64_t) != 0) {
    return Invalid(op, "layout buffer is not 8-byte aligned");
  }
  batch->layout = TbeLayout::FromPacked(layout.typed_data<int32_t>(), packed);
  const int64_t t = batch->layout.num_features;
  const int64_t n = indices.element_count();
  const int64_t num_offsets = offsets.element_count();
  if (num_offsets < 1 || (num_offsets - 1) % t != 0) {
    return Invalid(op, "offsets has " + std::to_string(num_offsets) +
                           " entries; expected T * B + 1 with T = " + std::to_string(t) + " features");
  }
  batch->pooling = static_cast<PoolingMode>(pooling);
  batch->batch_size = (num_offsets - 1) / t;
  batch->num_indices = n;

  if (per_sample_weights.element_type() != ffi::DataType::F32) {
    return Invalid(op,
                   "per_sample_weights must be float32, got " + DtypeName(per_sample_weights.element_type()));
  }
  const int64_t num_psw = per_sample_weights.element_count();
  if (num_psw != n && num_psw != 0) {
    return Invalid(op, "per_sample_weights has " + std::to_string(num_psw) +
                           " elements; expected N = " + std::to_string(n) + " (weighted) or 0");
  }
  if (num_psw > 0 && batch->pooling == PoolingMode::kNone) {
    return Invalid(op, "per_sample_weights must be empty for pooling NONE");
  }
  batch->weighted = num_psw > 0;
  return ffi::Error::Success();
}

// `name` (the output or its gradient) is 2-D with a row per bag of a feature (SUM,
// MEAN) or per index position (NONE). Its columns are the layout's: the CPU checks them.
ffi::Error ValidateRows(std::string_view op, std::string_view name, ffi::AnyBuffer buffer,
                        const TbeBatch& batch) {
  const bool sequence = batch.pooling == PoolingMode::kNone;
  const int64_t rows = sequence ? batch.num_indices : batch.batch_size;
  const auto dims = buffer.dimensions();
  if (dims.size() == 2 && dims[0] == rows) return ffi::Error::Success();
  return Invalid(op, std::string(name) + " has shape " + ShapeString(dims) + "; expected " +
                         (sequence ? "[N = " : "[B = ") + std::to_string(rows) +
                         (sequence ? ", dim]" : ", total_dim]"));
}

ffi::Error ValidateGradPerSampleWeights(std::string_view op, ffi::AnyBuffer per_sample_weights,
                                        ffi::AnyBuffer grad_per_sample_weights) {
  if (grad_per_sample_weights.element_type() != ffi::DataType::F32 ||
      grad_per_sample_weights.element_count() != per_sample_weights.element_count()) {
    return Invalid(op, "grad_per_sample_weights must be float32 like per_sample_weights (" +
                           std::to_string(per_sample_weights.element_count()) + " elements)");
  }
  return ffi::Error::Success();
}

// State operand `which` (1 or 2) and its result; `used` and `per_row` come from the optimizer.
ffi::Error ValidateState(std::string_view op, int which, ffi::AnyBuffer state, ffi::AnyBuffer result,
                         bool used, bool per_row, int64_t num_weights, int64_t total_rows) {
  const std::string name = "state" + std::to_string(which);
  if (result.element_type() != state.element_type() || result.element_count() != state.element_count()) {
    return Invalid(op, name + " result must have the dtype and size of the " + name + " operand");
  }
  if (!used) return ffi::Error::Success();
  if (!IsFloatType(state.element_type())) return Invalid(op, FloatTypeMessage(name, state.element_type()));
  const int64_t count = state.element_count();
  if (per_row) {  // one per table row: the kernels index it by row key, which is < total_rows
    if (count < total_rows) return Invalid(op, PerRowStateMessage(which, count, total_rows));
  } else if (count != num_weights) {
    return Invalid(op, name + " has " + std::to_string(count) +
                           " elements; this optimizer needs one per weight (" + std::to_string(num_weights) +
                           "); build it with jaxrec.optim.init_state");
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Invalid(std::string_view op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string PerRowStateMessage(int which, int64_t count, int64_t total_rows) {
  return "state" + std::to_string(which) + " has " + std::to_string(count) +
         " elements; this optimizer needs one per table row (" + std::to_string(total_rows) +
         ", the sum of the tables' rows); build it with jaxrec.optim.init_state";
}

ffi::Error ValidateForward(std::string_view op, ffi::AnyBuffer weights, ffi::AnyBuffer indices,
                           ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                           ffi::AnyBuffer output, int32_t pooling, TbeBatch* batch) {
  if (ffi::Error error =
          ValidateLookup(op, weights, indices, offsets, per_sample_weights, layout, pooling, batch);
      error.failure()) {
    return error;
  }
  if (!IsFloatType(output.element_type())) {
    return Invalid(op, FloatTypeMessage("output", output.element_type()));
  }
  return ValidateRows(op, "output", output, *batch);
}

ffi::Error ValidateBackward(std::string_view op, ffi::AnyBuffer grad_output, ffi::AnyBuffer weights,
                            ffi::AnyBuffer indices, ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights,
                            ffi::AnyBuffer layout, ffi::AnyBuffer grad_weights,
                            ffi::AnyBuffer grad_per_sample_weights, int32_t pooling, TbeBatch* batch) {
  if (ffi::Error error =
          ValidateLookup(op, weights, indices, offsets, per_sample_weights, layout, pooling, batch);
      error.failure()) {
    return error;
  }
  if (!IsFloatType(grad_output.element_type())) {
    return Invalid(op, FloatTypeMessage("grad_output", grad_output.element_type()));
  }
  if (ffi::Error error = ValidateRows(op, "grad_output", grad_output, *batch); error.failure()) return error;
  if (grad_weights.element_type() != ffi::DataType::F32 ||
      grad_weights.element_count() != weights.element_count()) {
    return Invalid(op, "grad_weights must be float32 with one element per weight (" +
                           std::to_string(weights.element_count()) + ")");
  }
  return ValidateGradPerSampleWeights(op, per_sample_weights, grad_per_sample_weights);
}

ffi::Error ValidateSorted(std::string_view op, ffi::AnyBuffer indices, ffi::AnyBuffer sorted_keys,
                          ffi::AnyBuffer sorted_positions, ffi::AnyBuffer sorted_bags) {
  for (ffi::AnyBuffer sorted : {sorted_keys, sorted_positions, sorted_bags}) {
    if (sorted.element_type() != indices.element_type() ||
        sorted.element_count() != indices.element_count()) {
      return Invalid(
          op, "sorted_keys, sorted_positions and sorted_bags must have the dtype and size of indices (" +
                  DtypeName(indices.element_type()) + ", " + std::to_string(indices.element_count()) + ")");
    }
  }
  return ffi::Error::Success();
}

ffi::Error ValidateFusedUpdate(std::string_view op, ffi::AnyBuffer grad_output, ffi::AnyBuffer weights,
                               ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                               ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                               ffi::AnyBuffer state1, ffi::AnyBuffer state2, ffi::AnyBuffer hparams,
                               ffi::AnyBuffer step, ffi::AnyBuffer weights_out, ffi::AnyBuffer state1_out,
                               ffi::AnyBuffer state2_out, ffi::AnyBuffer grad_per_sample_weights,
                               ffi::AnyBuffer nonfinite_rows, int32_t optimizer, int32_t pooling,
                               int32_t weight_decay_mode, int32_t max_dim, int64_t total_rows,
                               TbeBatch* batch) {
  if (ffi::Error error =
          ValidateLookup(op, weights, indices, offsets, per_sample_weights, layout, pooling, batch);
      error.failure()) {
    return error;
  }
  if (grad_output.element_type() != ffi::DataType::F32) {
    return Invalid(op, "grad_output must be float32, got " + DtypeName(grad_output.element_type()));
  }
  if (ffi::Error error = ValidateRows(op, "grad_output", grad_output, *batch); error.failure()) return error;
  const int64_t max_key = indices.element_type() == ffi::DataType::S32
                              ? int64_t{std::numeric_limits<int32_t>::max()}
                              : std::numeric_limits<int64_t>::max();
  if (total_rows < 0 || total_rows > max_key) {  // every key < total_rows, below the sentinel (max)
    return Invalid(op, "total_rows must be the tables' row count in [0, " + std::to_string(max_key) + "] (" +
                           DtypeName(indices.element_type()) + " row keys), got " +
                           std::to_string(total_rows));
  }
  if (hparams.element_type() != ffi::DataType::F32 || hparams.element_count() != 9) {
    return Invalid(op, "hparams must be float32[9] (OptimizerHyperparams' fields in order)");
  }
  if (step.element_type() != ffi::DataType::S32 || step.element_count() != 1) {
    return Invalid(op, "step must be an int32 scalar");
  }
  if (optimizer < 0 || optimizer > static_cast<int32_t>(OptimizerKind::kLarsSgd)) {
    return Invalid(op, "optimizer must be in [0, 7] (jaxrec.optim's configs in FBGEMM's order), got " +
                           std::to_string(optimizer));
  }
  if (weight_decay_mode < 0 || weight_decay_mode > 2) {
    return Invalid(op, "weight_decay_mode must be 0 (none), 1 (l2) or 2 (decoupled), got " +
                           std::to_string(weight_decay_mode));
  }
  if (max_dim < 1) {
    return Invalid(op, "max_dim must be the layout's largest dim, got " + std::to_string(max_dim));
  }
  if (weights_out.element_type() != weights.element_type() ||
      weights_out.element_count() != weights.element_count()) {
    return Invalid(op, "the weights result must have the dtype and size of weights");
  }
  if (ffi::Error error = ValidateGradPerSampleWeights(op, per_sample_weights, grad_per_sample_weights);
      error.failure()) {
    return error;
  }
  if (nonfinite_rows.element_type() != ffi::DataType::S32 || nonfinite_rows.element_count() != 1) {
    return Invalid(op, "the nonfinite_rows result must be an int32 scalar");
  }
  const auto kind = static_cast<OptimizerKind>(optimizer);
  const int64_t num_weights = weights.element_count();
  if (ffi::Error error = ValidateState(op, 1, state1, state1_out, NumStates(kind) >= 1, State1PerRow(kind),
                                       num_weights, total_rows);
      error.failure()) {
    return error;
  }
  return ValidateState(op, 2, state2, state2_out, NumStates(kind) >= 2, State2PerRow(kind), num_weights,
                       total_rows);
}

}  // namespace jaxrec
