// Quantized (inference) lookup: what the CPU and CUDA handlers of jaxrec_quantized_lookup
// share with jaxrec/ops/quantized_lookup.py, which writes it.
//
// Operands: indices[N], offsets[F*B+1] (S32 or S64, FBGEMM's feature-major bags, as the
// TBE's: common/tbe.h), per_sample_weights (F32 [N] or [0]), then one operand per table.
// A table's rows are, by its precision (attribute `bits`, one per table):
//   32: float32 [rows, dim]                 16: float16 [rows, dim]
//    8: uint8 [rows, 4 + dim]               4: uint8 [rows, 4 + dim / 2]
// int8 / int4 rows are FBGEMM's inference layout: a float16 scale and a float16 bias,
// then the codes (int4: the even column in the low nibble); value = scale * code + bias.
// Every row is a whole number of 32-bit words (int8: dim % 4 == 0, int4: dim % 8 == 0,
// float16: dim % 2 == 0), so that a lane of the CUDA kernel reads one word per row.
// Feature f reads table `feature_tables[f]`; several features may share one.
//
// Result: [B, sum of the features' dims] (SUM, MEAN), or [N, dim] (NONE; one dim for
// all features, zero rows on padding). Each bag's range is clamped into [0, N]
// (ClampBag); an id outside [0, rows) of its table reads row 0 (FBGEMM's correction,
// as the collections' WARNING mode), so bad input reads nothing outside the operands.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"

namespace jaxrec {

// Features per launch: their descriptions travel as the CUDA kernel's parameters
// (jaxrec/ops/quantized_lookup.py splits larger collections into several calls).
constexpr int kMaxQuantizedFeatures = 64;

struct QuantizedFeature {
  const uint8_t* table;
  int64_t rows;
  int64_t output_offset;  // pooled: first output column
  int32_t row_bytes;
  int32_t dim;
  int32_t bits;   // 32, 16, 8 or 4
  int32_t shift;  // CUDA: 2^shift lanes per bag (4-byte words of a row per lane pass)
};

// Columns of one 32-bit word of a row's codes, and 32-bit words of a row's header.
constexpr JAXREC_HOST_DEVICE int ColumnsPerWord(int bits) { return 32 / bits; }
constexpr JAXREC_HOST_DEVICE int HeaderWords(int bits) { return bits <= 8 ? 1 : 0; }

struct QuantizedProblem {
  QuantizedFeature features[kMaxQuantizedFeatures];
  int32_t num_features;
  int64_t batch_size;
  int64_t num_indices;
  int64_t total_dim;  // pooled: output row width; NONE: dim
  PoolingMode pooling;
  bool weighted;
};

// Checks the operands and attributes (the Python wrapper validated them first: this is
// the last line) and fills `problem`.
inline ffi::Error ValidateQuantized(std::string_view op, const ffi::AnyBuffer& indices,
                                    const ffi::AnyBuffer& offsets, const ffi::AnyBuffer& per_sample_weights,
                                    const ffi::RemainingArgs& tables, const ffi::AnyBuffer& out,
                                    int32_t pooling, ffi::Span<const int64_t> feature_tables,
                                    ffi::Span<const int64_t> bits, QuantizedProblem* problem) {
  const size_t num_tables = tables.size();
  if (pooling < 0 || pooling > 2) return Invalid(op, "pooling must be 0 (SUM), 1 (MEAN) or 2 (NONE)");
  if (!IsIndexType(indices.element_type()) || offsets.element_type() != indices.element_type()) {
    return Invalid(op, "indices and offsets must both be int32 or both int64");
  }
  if (indices.dimensions().size() != 1 || offsets.dimensions().size() != 1) {
    return Invalid(op, "indices and offsets must be 1-D");
  }
  const int64_t num_features = static_cast<int64_t>(feature_tables.size());
  if (num_features < 1 || num_features > kMaxQuantizedFeatures) {
    return Invalid(op, "between 1 and " + std::to_string(kMaxQuantizedFeatures) + " features per call");
  }
  if (bits.size() != num_tables) return Invalid(op, "one precision (bits) per table operand");
  const int64_t n = indices.dimensions()[0];
  const int64_t num_offsets = offsets.dimensions()[0];
  if (num_offsets < 1 || (num_offsets - 1) % num_features != 0) {
    return Invalid(op, "offsets must hold F * B + 1 entries for F = " + std::to_string(num_features));
  }
  if (indices.element_type() == ffi::DataType::S32 && n >= (int64_t{1} << 31)) {
    return Invalid(op, "int32 indices hold fewer than 2^31 ids");
  }
  const bool weighted = per_sample_weights.element_count() > 0;
  if (per_sample_weights.element_type() != ffi::DataType::F32 ||
      (weighted && static_cast<int64_t>(per_sample_weights.element_count()) != n)) {
    return Invalid(op, "per_sample_weights must be float32 [N] or [0]");
  }
  if (!IsFloatType(out.element_type())) return Invalid(op, "the output must be float32, float16 or bfloat16");
  problem->num_features = static_cast<int32_t>(num_features);
  problem->batch_size = (num_offsets - 1) / num_features;
  problem->num_indices = n;
  problem->pooling = static_cast<PoolingMode>(pooling);
  problem->weighted = weighted;
  int64_t column = 0;
  for (int64_t f = 0; f < num_features; ++f) {
    const int64_t t = feature_tables[f];
    if (t < 0 || t >= static_cast<int64_t>(num_tables))
      return Invalid(op, "feature_tables names no table operand");
    const auto found = tables.get<ffi::AnyBuffer>(t);
    if (found.has_error()) return Invalid(op, "table operand " + std::to_string(t) + " is no buffer");
    const ffi::AnyBuffer table = found.value();
    const int64_t b = bits[t];
    const ffi::DataType expected = b == 32   ? ffi::DataType::F32
                                   : b == 16 ? ffi::DataType::F16
                                             : ffi::DataType::U8;
    if ((b != 32 && b != 16 && b != 8 && b != 4) || table.element_type() != expected ||
        table.dimensions().size() != 2) {
      return Invalid(op, "table " + std::to_string(t) +
                             " must be float32 (bits 32), float16 (16) or uint8 (8, 4) "
                             "[rows, row width], got " +
                             DtypeName(table.element_type()) + " for bits " + std::to_string(b));
    }
    const int64_t rows = table.dimensions()[0], width = table.dimensions()[1];
    const int64_t row_bytes = b >= 16 ? width * (b / 8) : width;
    const int64_t dim = b >= 16 ? width : (width - 4) * 8 / b;
    if (dim < 1 || row_bytes % 4 != 0 || row_bytes >= (int64_t{1} << 31) || (b < 16 && width <= 4)) {
      return Invalid(
          op, "table " + std::to_string(t) + "'s rows must be whole 32-bit words with at least one column");
    }
    QuantizedFeature& feature = problem->features[f];
    feature.table = static_cast<const uint8_t*>(table.untyped_data());
    feature.rows = rows;
    feature.output_offset = column;
    feature.row_bytes = static_cast<int32_t>(row_bytes);
    feature.dim = static_cast<int32_t>(dim);
    feature.bits = static_cast<int32_t>(b);
    feature.shift = 0;
    column += dim;
  }
  const auto& dims = out.dimensions();
  if (problem->pooling == PoolingMode::kNone) {
    for (int64_t f = 1; f < num_features; ++f) {
      if (problem->features[f].dim != problem->features[0].dim)
        return Invalid(op, "NONE pooling needs one dim");
    }
    problem->total_dim = problem->features[0].dim;
    if (dims.size() != 2 || dims[0] != n || dims[1] != problem->total_dim) {
      return Invalid(op, "the output must be [N, dim] for NONE pooling");
    }
  } else {
    problem->total_dim = column;
    if (dims.size() != 2 || dims[0] != problem->batch_size || dims[1] != column) {
      return Invalid(op, "the output must be [B, sum of the features' dims]");
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxrec
