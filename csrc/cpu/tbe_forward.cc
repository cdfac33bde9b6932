// CPU handler of the TBE forward (jaxrec_tbe_forward): pooled (SUM, MEAN) or
// sequence (NONE) embedding lookups of every feature in one call. See common/tbe.h
// for the layout and the bags.
//
// Operands: weights (F32/F16/BF16, flat), indices[N], offsets[T*B+1] (S32/S64),
// per_sample_weights (F32, [N] or [0]), layout (packed). Result: [B, total_D]
// (SUM, MEAN) or [N, D] (NONE), F32/F16/BF16. Attribute: pooling.
//
// Parallel over chunks of bags (XLA's intra-op pool; each chunk writes its own output
// rows, so the result does not depend on the schedule). Per bag the rows are summed in
// float32 into a small accumulator in L1, with the rows of the next ids prefetched:
// a pooled lookup is bound by the latency of random row reads, not by arithmetic.
// An id outside [0, rows) of its feature's table is skipped (RowInRange, one compare):
// it adds nothing to its bag (MEAN still divides by the bag's length) and gives a
// zero row for pooling NONE.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cpu/tbe_cpu_util.h"

namespace jaxrec {
namespace cpu {
namespace {

// Ids whose rows are prefetched ahead of the one being summed.
constexpr int64_t kPrefetchDistance = 8;
// Bags per work item: enough work to amortise the claim, many items to balance threads.
constexpr int64_t kBagsPerItem = 32;

template <typename I>
struct ForwardArgs {
  const void* weights;
  const I* indices;
  const I* offsets;
  const float* per_sample_weights;  // nullptr when not weighted
  TbeLayout layout;
  int64_t batch_size;
  int64_t total_dim;
  PoolingMode pooling;
  void* out;
};

// Bags [bag_begin, bag_end) of the pooled (SUM, MEAN) forward.
template <typename W, typename O, typename I>
JAXREC_ALWAYS_INLINE void PooledBags(const ForwardArgs<I>& a, int64_t bag_begin, int64_t bag_end,
                                     float* __restrict acc) {
  const W* weights = static_cast<const W*>(a.weights);
  O* out = static_cast<O*>(a.out);
  const I* __restrict indices = a.indices;
  const float* __restrict psw = a.per_sample_weights;
  const int64_t B = a.batch_size;
  for (int64_t k = bag_begin; k < bag_end; ++k) {
    const int64_t f = k / B;
    const int64_t b = k - f * B;
    const int64_t dim = a.layout.dims[f];
    const int64_t rows = a.layout.rows[f];
    const W* __restrict table = weights + a.layout.table_offsets[f];
    const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(W));
    const int64_t start = a.offsets[k], end = a.offsets[k + 1];
    // Prefetch within this feature's ids (the next bags of the same table too).
    const int64_t prefetch_end = a.offsets[(f + 1) * B];
    const auto prefetch = [&](int64_t p) {
      if (RowInRange(indices[p], rows))
        PrefetchBytes(table + static_cast<int64_t>(indices[p]) * dim, row_bytes);
    };
    if (k == bag_begin || b == 0) {
      for (int64_t p = start; p < std::min(start + kPrefetchDistance, prefetch_end); ++p) prefetch(p);
    }
    for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
    for (int64_t p = start; p < end; ++p) {
      if (p + kPrefetchDistance < prefetch_end) prefetch(p + kPrefetchDistance);
      if (!RowInRange(indices[p], rows)) continue;
      const W* __restrict row = table + static_cast<int64_t>(indices[p]) * dim;
      if (psw != nullptr) {
        const float w = psw[p];
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * ToFloat(row[d]);
      } else {
        for (int64_t d = 0; d < dim; ++d) acc[d] += ToFloat(row[d]);
      }
    }
    O* __restrict o = out + b * a.total_dim + a.layout.output_offsets[f];
    if (a.pooling == PoolingMode::kMean && end > start) {
      const float scale = 1.0f / static_cast<float>(end - start);
      for (int64_t d = 0; d < dim; ++d) o[d] = FromFloat<O>(acc[d] * scale);
    } else {
      for (int64_t d = 0; d < dim; ++d) o[d] = FromFloat<O>(acc[d]);
    }
  }
}

// Bags [bag_begin, bag_end) of the sequence (NONE) forward: output row p = row of indices[p].
template <typename W, typename O, typename I>
JAXREC_ALWAYS_INLINE void SequenceBags(const ForwardArgs<I>& a, int64_t bag_begin, int64_t bag_end) {
  const W* weights = static_cast<const W*>(a.weights);
  O* out = static_cast<O*>(a.out);
  const I* __restrict indices = a.indices;
  const int64_t B = a.batch_size;
  const int64_t dim = a.layout.dims[0];
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(W));
  for (int64_t k = bag_begin; k < bag_end; ++k) {
    const int64_t f = k / B;
    const int64_t rows = a.layout.rows[f];
    const W* __restrict table = weights + a.layout.table_offsets[f];
    const int64_t prefetch_end = a.offsets[(f + 1) * B];
    for (int64_t p = a.offsets[k]; p < a.offsets[k + 1]; ++p) {
      const int64_t ahead = p + kPrefetchDistance;
      if (ahead < prefetch_end && RowInRange(indices[ahead], rows)) {
        PrefetchBytes(table + static_cast<int64_t>(indices[ahead]) * dim, row_bytes);
      }
      O* __restrict o = out + p * dim;
      if (!RowInRange(indices[p], rows)) {  // a dropped id: a zero row
        for (int64_t d = 0; d < dim; ++d) o[d] = FromFloat<O>(0.0f);
        continue;
      }
      const W* __restrict row = table + static_cast<int64_t>(indices[p]) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = FromFloat<O>(ToFloat(row[d]));
    }
  }
}

template <typename W, typename O, typename I>
JAXREC_ALWAYS_INLINE void ForwardItem(const ForwardArgs<I>& a, int64_t item, float* acc) {
  const int64_t num_bags = a.layout.num_features * a.batch_size;
  const int64_t begin = item * kBagsPerItem, end = std::min(num_bags, begin + kBagsPerItem);
  if (a.pooling == PoolingMode::kNone) {
    SequenceBags<W, O, I>(a, begin, end);
  } else {
    PooledBags<W, O, I>(a, begin, end, acc);
  }
}

// One copy of the work item per instruction set; the best one is chosen at run time.
template <typename W, typename O, typename I>
void ForwardItemBaseline(const ForwardArgs<I>& a, int64_t item, float* acc) {
  ForwardItem<W, O, I>(a, item, acc);
}
#if JAXREC_HAS_ISA_CLONES
template <typename W, typename O, typename I>
JAXREC_TARGET_AVX2 void ForwardItemAvx2(const ForwardArgs<I>& a, int64_t item, float* acc) {
  ForwardItem<W, O, I>(a, item, acc);
}
template <typename W, typename O, typename I>
JAXREC_TARGET_AVX512 void ForwardItemAvx512(const ForwardArgs<I>& a, int64_t item, float* acc) {
  ForwardItem<W, O, I>(a, item, acc);
}
#endif

template <typename W, typename O, typename I>
auto SelectForwardItem() {
#if JAXREC_HAS_ISA_CLONES
  switch (CpuIsa()) {
    case Isa::kAvx512:
      return &ForwardItemAvx512<W, O, I>;
    case Isa::kAvx2:
      return &ForwardItemAvx2<W, O, I>;
    case Isa::kBaseline:
      break;
  }
#endif
  return &ForwardItemBaseline<W, O, I>;
}

template <typename W, typename O, typename I>
void Forward(ffi::ThreadPool& pool, const ForwardArgs<I>& a, int64_t num_indices, int64_t max_dim) {
  const int64_t num_bags = a.layout.num_features * a.batch_size;
  if (a.pooling == PoolingMode::kNone) {
    // Padding positions (outside [offsets[0], offsets[T*B])) get zero rows.
    const int64_t dim = a.layout.dims[0];
    O* out = static_cast<O*>(a.out);
    const int64_t first = a.offsets[0], last = a.offsets[num_bags];
    std::memset(out, 0, first * dim * sizeof(O));
    std::memset(out + last * dim, 0, (num_indices - last) * dim * sizeof(O));
  }
  const auto item_fn = SelectForwardItem<W, O, I>();
  const int64_t num_items = (num_bags + kBagsPerItem - 1) / kBagsPerItem;
  ParallelFor(pool, num_items, [&](int64_t item) {
    thread_local std::vector<float> acc;
    if (static_cast<int64_t>(acc.size()) < max_dim) acc.resize(max_dim);
    item_fn(a, item, acc.data());
  });
}

constexpr std::string_view kOp = "jaxrec_tbe_forward";

ffi::Error TbeForwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer weights, ffi::AnyBuffer indices,
                         ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                         ffi::Result<ffi::AnyBuffer> output, int32_t pooling) {
  TbeProblem problem;
  if (ffi::Error error = ValidateForward(kOp, weights, indices, offsets, per_sample_weights, layout, *output,
                                         pooling, &problem);
      error.failure()) {
    return error;
  }
  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    if (ffi::Error error = ValidateContents<I>(kOp, weights, offsets, &problem); error.failure()) {
      return error;
    }
    if (ffi::Error error = CheckShape(kOp, "output", output->dimensions(), problem.out_dims);
        error.failure()) {
      return error;
    }
    const ForwardArgs<I> args{
        weights.untyped_data(),  indices.typed_data<I>(),
        offsets.typed_data<I>(), problem.weighted ? per_sample_weights.typed_data<float>() : nullptr,
        problem.layout,          problem.batch_size,
        problem.total_dim,       problem.pooling,
        output->untyped_data()};
    return DispatchFloatType<Half, BFloat16>(weights.element_type(), "weights", [&](auto weight_zero) {
      using W = decltype(weight_zero);
      return DispatchFloatType<Half, BFloat16>(output->element_type(), "output", [&](auto out_zero) {
        using O = decltype(out_zero);
        Forward<W, O, I>(pool, args, problem.num_indices, problem.max_dim);
        return ffi::Error::Success();
      });
    });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecTbeForwardCpu, jaxrec::cpu::TbeForwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // weights
                                  .Arg<xla::ffi::AnyBuffer>()  // indices
                                  .Arg<xla::ffi::AnyBuffer>()  // offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // per_sample_weights
                                  .Arg<xla::ffi::AnyBuffer>()  // layout
                                  .Ret<xla::ffi::AnyBuffer>()  // output
                                  .Attr<int32_t>("pooling"));
