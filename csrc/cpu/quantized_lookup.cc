// CPU handler of the quantized (inference) lookup (common/quantized_lookup.h for the
// operands): int8 / int4 / float16 / float32 tables, every feature in one call.
//
// Parallel over chunks of bags (XLA's intra-op pool; each chunk writes its own output
// rows). Per bag the rows are dequantized as they are read and summed in float32, in
// index order, the next rows prefetched; per row the bias is added once per column as
// value = scale * code + bias, as the jnp reference computes it.
#include "common/quantized_lookup.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "cpu/tbe_cpu_util.h"

namespace jaxrec {
namespace cpu {
namespace {

constexpr int64_t kPrefetchDistance = 8;
constexpr int64_t kBagsPerItem = 32;

// Row `id` of `f` dequantized into v[0, dim).
JAXREC_ALWAYS_INLINE void DequantizeRow(const QuantizedFeature& f, int64_t id, float* __restrict v) {
  const uint8_t* row = f.table + id * f.row_bytes;
  switch (f.bits) {
    case 32:
      std::memcpy(v, row, sizeof(float) * f.dim);
      return;
    case 16:
      for (int32_t j = 0; j < f.dim; ++j) {
        uint16_t half;
        std::memcpy(&half, row + 2 * j, sizeof(half));
        v[j] = ToFloat(Half{half});
      }
      return;
    default:
      break;
  }
  uint16_t head[2];
  std::memcpy(head, row, sizeof(head));
  const float scale = ToFloat(Half{head[0]}), bias = ToFloat(Half{head[1]});
  const uint8_t* codes = row + 4;
  if (f.bits == 8) {
    for (int32_t j = 0; j < f.dim; ++j) v[j] = scale * static_cast<float>(codes[j]) + bias;
  } else {
    for (int32_t j = 0; j < f.dim; ++j) {
      v[j] = scale * static_cast<float>((codes[j / 2] >> (4 * (j % 2))) & 0xf) + bias;
    }
  }
}

template <typename O, typename I>
void LookupBags(const QuantizedProblem& problem, const I* __restrict indices, const I* __restrict offsets,
                const float* __restrict psw, O* __restrict out, int64_t bag_begin, int64_t bag_end,
                float* __restrict acc, float* __restrict row) {
  const int64_t batch = problem.batch_size;
  const I n = static_cast<I>(problem.num_indices);
  for (int64_t k = bag_begin; k < bag_end; ++k) {
    const QuantizedFeature& f = problem.features[k / batch];
    const int64_t b = k % batch;
    I start, end;
    ClampBag<I>(offsets[k], offsets[k + 1], n, &start, &end);
    if (f.rows == 0) end = start;  // no row 0 to read for a bad id: the bag reads nothing
    auto row_of = [&](I p) { return RowInRange(indices[p], f.rows) ? static_cast<int64_t>(indices[p]) : 0; };
    if (problem.pooling == PoolingMode::kNone) {
      for (I p = start; p < end; ++p) {
        DequantizeRow(f, row_of(p), row);
        O* out_row = out + static_cast<int64_t>(p) * f.dim;
        for (int32_t j = 0; j < f.dim; ++j) out_row[j] = FromFloat<O>(row[j]);
      }
      continue;
    }
    std::fill(acc, acc + f.dim, 0.f);
    for (I p = start; p < end; ++p) {
      if (p + kPrefetchDistance < end)
        PrefetchBytes(f.table + row_of(p + kPrefetchDistance) * f.row_bytes, f.row_bytes);
      DequantizeRow(f, row_of(p), row);
      const float w = psw ? psw[p] : 1.f;
      for (int32_t j = 0; j < f.dim; ++j) acc[j] += w * row[j];
    }
    const float mean =
        problem.pooling == PoolingMode::kMean && end > start ? 1.f / static_cast<float>(end - start) : 1.f;
    O* out_row = out + b * problem.total_dim + f.output_offset;
    for (int32_t j = 0; j < f.dim; ++j) out_row[j] = FromFloat<O>(acc[j] * mean);
  }
}

constexpr std::string_view kOp = "jaxrec_quantized_lookup";

ffi::Error QuantizedLookupCpu(ffi::ThreadPool pool, ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                              ffi::AnyBuffer per_sample_weights, ffi::RemainingArgs tables,
                              ffi::Result<ffi::AnyBuffer> out, int32_t pooling,
                              ffi::Span<const int64_t> feature_tables, ffi::Span<const int64_t> bits) {
  QuantizedProblem problem;
  if (ffi::Error invalid = ValidateQuantized(kOp, indices, offsets, per_sample_weights, tables, *out, pooling,
                                             feature_tables, bits, &problem);
      invalid.failure()) {
    return invalid;
  }
  if (problem.pooling == PoolingMode::kNone) std::memset(out->untyped_data(), 0, out->size_bytes());
  int32_t max_dim = 0;
  for (int32_t f = 0; f < problem.num_features; ++f) max_dim = std::max(max_dim, problem.features[f].dim);
  const int64_t num_bags = problem.num_features * problem.batch_size;
  const float* psw = problem.weighted ? per_sample_weights.typed_data<float>() : nullptr;
  ffi::AnyBuffer* out_buffer = &(*out);
  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    return DispatchFloatType<Half, BFloat16>(out_buffer->element_type(), "output", [&](auto out_zero) {
      using O = decltype(out_zero);
      O* o = reinterpret_cast<O*>(out_buffer->untyped_data());
      ParallelFor(pool, (num_bags + kBagsPerItem - 1) / kBagsPerItem, [&](int64_t item) {
        thread_local std::vector<float> scratch;
        if (static_cast<int64_t>(scratch.size()) < 2 * max_dim) scratch.resize(2 * max_dim);
        const int64_t begin = item * kBagsPerItem;
        LookupBags<O, I>(problem, indices.typed_data<I>(), offsets.typed_data<I>(), psw, o, begin,
                         std::min(begin + kBagsPerItem, num_bags), scratch.data(), scratch.data() + max_dim);
      });
      return ffi::Error::Success();
    });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecQuantizedLookupCpu, jaxrec::cpu::QuantizedLookupCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // indices
                                  .Arg<xla::ffi::AnyBuffer>()  // offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // per_sample_weights
                                  .RemainingArgs()             // tables
                                  .Ret<xla::ffi::AnyBuffer>()  // output
                                  .Attr<int32_t>("pooling")
                                  .Attr<xla::ffi::Span<const int64_t>>("feature_tables")
                                  .Attr<xla::ffi::Span<const int64_t>>("bits"));
