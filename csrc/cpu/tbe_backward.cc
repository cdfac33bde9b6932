// CPU handler of the TBE backward (jaxrec_tbe_backward): the dense gradient of the
// flat weight buffer and the gradient of the per-sample weights.
//
// Operands: grad_output (F32/F16/BF16, shape of the forward output), weights, indices,
// offsets, per_sample_weights ([N] or [0]), layout. Results: grad_weights (F32, one
// element per weight; zeros for rows no id touches), grad_per_sample_weights (F32, [N]
// or [0]; zeros on padding). Attribute: pooling.
//
//   SUM/MEAN: grad_W[row(p)] += s * w_p * g[b, cols(f)];  grad_w[p] = s * <g[b, cols(f)], W[row(p)]>
//             with s = 1/L for MEAN (L = bag length), else 1; w_p = 1 when not weighted.
//   NONE:     grad_W[row(p)] += g[p, :].
//
// An id outside [0, rows) of its feature's table falls in no row range: its gradient is
// dropped and its grad_w is 0 (the forward skipped it).
//
// Deterministic without atomics: the work items are (table, row range) pairs; an item
// scans the ids of the features on its table in a fixed order (feature, bag, position)
// and applies only those that fall in its rows, so each gradient row is summed in the
// same order whatever thread runs it, and each position's grad_w is written once.
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cpu/tbe_cpu_util.h"

namespace jaxrec {
namespace cpu {
namespace {

constexpr int64_t kPrefetchDistance = 8;
constexpr int64_t kZeroChunk = int64_t{1} << 20;  // elements of grad_weights zeroed per item

template <typename I>
struct BackwardArgs {
  const void* grad_output;
  const void* weights;
  const I* indices;
  const I* offsets;
  const float* per_sample_weights;  // nullptr when not weighted
  TbeLayout layout;
  int64_t batch_size;
  int64_t total_dim;
  PoolingMode pooling;
  float* grad_weights;
  float* grad_per_sample_weights;  // nullptr when not weighted
};

// A work item: rows [row_begin, row_end) of one table, and the features that read it.
struct RowRange {
  int64_t row_begin;
  int64_t row_end;
  const int64_t* features;  // ascending
  int64_t num_features;
};

// Pointer to g[b, cols(f)] (pooled) or g[p, :] (sequence) as float32: the buffer itself
// for F32, else converted into `scratch`.
template <typename G>
JAXREC_ALWAYS_INLINE const float* GradRow(const G* g, int64_t dim, float* scratch) {
  if constexpr (std::is_same_v<G, float>) {
    return g;
  } else {
    for (int64_t d = 0; d < dim; ++d) scratch[d] = ToFloat(g[d]);
    return scratch;
  }
}

template <typename G, typename W, typename I>
JAXREC_ALWAYS_INLINE void BackwardItem(const BackwardArgs<I>& a, const RowRange& r, float* scratch) {
  const I* __restrict indices = a.indices;
  const float* __restrict psw = a.per_sample_weights;
  const G* grad_output = static_cast<const G*>(a.grad_output);
  const int64_t B = a.batch_size;
  const int64_t lo = r.row_begin, hi = r.row_end;
  const auto mine = [&](int64_t p) {  // in 64 bits: an int64 id is never truncated
    const int64_t row = indices[p];
    return row >= lo && row < hi;  // [lo, hi) lies inside the table: bad ids fall outside
  };
  for (int64_t i = 0; i < r.num_features; ++i) {
    const int64_t f = r.features[i];
    const int64_t dim = a.layout.dims[f];
    const int64_t table_offset = a.layout.table_offsets[f];
    float* __restrict grad_table = a.grad_weights + table_offset;
    const W* __restrict table = static_cast<const W*>(a.weights) + table_offset;
    const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(float));
    const int64_t feature_end = a.offsets[(f + 1) * B];
    for (int64_t b = 0; b < B; ++b) {
      const int64_t k = f * B + b;
      const int64_t start = a.offsets[k], end = a.offsets[k + 1];
      const float scale =
          a.pooling == PoolingMode::kMean && end > start ? 1.0f / static_cast<float>(end - start) : 1.0f;
      const float* g = nullptr;  // converted lazily: most bags of a row range touch none of its rows
      for (int64_t p = start; p < end; ++p) {
        const int64_t ahead = p + kPrefetchDistance;
        if (ahead < feature_end && mine(ahead)) {
          const int64_t row = indices[ahead];
          PrefetchBytes(grad_table + row * dim, row_bytes);
          if (psw != nullptr) PrefetchBytes(table + row * dim, dim * static_cast<int64_t>(sizeof(W)));
        }
        if (!mine(p)) continue;
        const int64_t row = indices[p];
        if (a.pooling == PoolingMode::kNone) {
          g = GradRow(grad_output + p * dim, dim, scratch);
        } else if (g == nullptr) {
          g = GradRow(grad_output + b * a.total_dim + a.layout.output_offsets[f], dim, scratch);
        }
        float* __restrict out = grad_table + row * dim;
        const float coeff = psw != nullptr ? scale * psw[p] : scale;
        for (int64_t d = 0; d < dim; ++d) out[d] += coeff * g[d];
        if (psw != nullptr) {
          const W* __restrict w = table + row * dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < dim; ++d) dot += g[d] * ToFloat(w[d]);
          a.grad_per_sample_weights[p] = scale * dot;
        }
      }
    }
  }
}

template <typename G, typename W, typename I>
void BackwardItemBaseline(const BackwardArgs<I>& a, const RowRange& r, float* scratch) {
  BackwardItem<G, W, I>(a, r, scratch);
}
#if JAXREC_HAS_ISA_CLONES
template <typename G, typename W, typename I>
JAXREC_TARGET_AVX2 void BackwardItemAvx2(const BackwardArgs<I>& a, const RowRange& r, float* scratch) {
  BackwardItem<G, W, I>(a, r, scratch);
}
template <typename G, typename W, typename I>
JAXREC_TARGET_AVX512 void BackwardItemAvx512(const BackwardArgs<I>& a, const RowRange& r, float* scratch) {
  BackwardItem<G, W, I>(a, r, scratch);
}
#endif

template <typename G, typename W, typename I>
auto SelectBackwardItem() {
#if JAXREC_HAS_ISA_CLONES
  switch (CpuIsa()) {
    case Isa::kAvx512:
      return &BackwardItemAvx512<G, W, I>;
    case Isa::kAvx2:
      return &BackwardItemAvx2<G, W, I>;
    case Isa::kBaseline:
      break;
  }
#endif
  return &BackwardItemBaseline<G, W, I>;
}

// A dense gradient is as large as the tables, and XLA hands it over freshly mapped:
// touching it page by page costs more than the whole scatter (one page fault per
// 4 KiB). Where transparent huge pages are in `madvise` mode, ask for 2 MiB pages
// for the whole-page part of the buffer; only advice, harmless if it was touched.
inline void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 4 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

template <typename G, typename W, typename I>
void Backward(ffi::ThreadPool& pool, const BackwardArgs<I>& a, int64_t num_weights, int64_t num_indices,
              int64_t max_dim) {
  // Zero the outputs: grad_weights in parallel chunks (it is as large as the tables).
  AdviseHugePages(a.grad_weights, num_weights * sizeof(float));
  ParallelFor(pool, (num_weights + kZeroChunk - 1) / kZeroChunk, [&](int64_t chunk) {
    const int64_t begin = chunk * kZeroChunk;
    std::memset(a.grad_weights + begin, 0, std::min(kZeroChunk, num_weights - begin) * sizeof(float));
  });
  if (a.grad_per_sample_weights != nullptr) {
    std::memset(a.grad_per_sample_weights, 0, num_indices * sizeof(float));
  }

  // Features grouped by table (first feature's order), each table cut into row ranges.
  const TbeLayout& l = a.layout;
  std::vector<int64_t> by_table(l.num_features);
  for (int64_t f = 0; f < l.num_features; ++f) by_table[f] = f;
  std::stable_sort(by_table.begin(), by_table.end(),
                   [&](int64_t x, int64_t y) { return l.table_offsets[x] < l.table_offsets[y]; });
  std::vector<std::pair<int64_t, int64_t>> tables;  // [first, last) in by_table
  for (int64_t i = 0; i < l.num_features; ++i) {
    if (i == 0 || l.table_offsets[by_table[i]] != l.table_offsets[by_table[i - 1]]) {
      tables.emplace_back(i, i);
    }
    tables.back().second = i + 1;
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t ranges_per_table =
      threads == 1 ? 1 : (4 * threads + static_cast<int64_t>(tables.size()) - 1) / tables.size();
  std::vector<RowRange> items;
  for (const auto& [first, last] : tables) {
    const int64_t rows = l.rows[by_table[first]];
    const int64_t step = std::max<int64_t>(1, (rows + ranges_per_table - 1) / ranges_per_table);
    for (int64_t lo = 0; lo < rows; lo += step) {
      items.push_back({lo, std::min(rows, lo + step), by_table.data() + first, last - first});
    }
  }
  const auto item_fn = SelectBackwardItem<G, W, I>();
  ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t item) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < max_dim) scratch.resize(max_dim);
    item_fn(a, items[item], scratch.data());
  });
}

constexpr std::string_view kOp = "jaxrec_tbe_backward";

ffi::Error TbeBackwardCpu(ffi::ThreadPool pool, ffi::AnyBuffer grad_output, ffi::AnyBuffer weights,
                          ffi::AnyBuffer indices, ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights,
                          ffi::AnyBuffer layout, ffi::Result<ffi::AnyBuffer> grad_weights,
                          ffi::Result<ffi::AnyBuffer> grad_per_sample_weights, int32_t pooling) {
  TbeProblem problem;
  if (ffi::Error error = ValidateBackward(kOp, grad_output, weights, indices, offsets, per_sample_weights,
                                          layout, *grad_weights, *grad_per_sample_weights, pooling, &problem);
      error.failure()) {
    return error;
  }
  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    if (ffi::Error error = ValidateContents<I>(kOp, weights, offsets, &problem); error.failure()) {
      return error;
    }
    if (ffi::Error error = CheckShape(kOp, "grad_output", grad_output.dimensions(), problem.out_dims);
        error.failure()) {
      return error;
    }
    const BackwardArgs<I> args{grad_output.untyped_data(),
                               weights.untyped_data(),
                               indices.typed_data<I>(),
                               offsets.typed_data<I>(),
                               problem.weighted ? per_sample_weights.typed_data<float>() : nullptr,
                               problem.layout,
                               problem.batch_size,
                               problem.total_dim,
                               problem.pooling,
                               grad_weights->typed_data<float>(),
                               problem.weighted ? grad_per_sample_weights->typed_data<float>() : nullptr};
    return DispatchFloatType<Half, BFloat16>(grad_output.element_type(), "grad_output", [&](auto grad_zero) {
      using G = decltype(grad_zero);
      return DispatchFloatType<Half, BFloat16>(weights.element_type(), "weights", [&](auto weight_zero) {
        using W = decltype(weight_zero);
        Backward<G, W, I>(pool, args, weights.element_count(), problem.num_indices, problem.max_dim);
        return ffi::Error::Success();
      });
    });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecTbeBackwardCpu, jaxrec::cpu::TbeBackwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // grad_output
                                  .Arg<xla::ffi::AnyBuffer>()  // weights
                                  .Arg<xla::ffi::AnyBuffer>()  // indices
                                  .Arg<xla::ffi::AnyBuffer>()  // offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // per_sample_weights
                                  .Arg<xla::ffi::AnyBuffer>()  // layout
                                  .Ret<xla::ffi::AnyBuffer>()  // grad_weights
                                  .Ret<xla::ffi::AnyBuffer>()  // grad_per_sample_weights
                                  .Attr<int32_t>("pooling"));
