// CUDA handler of the quantized (inference) lookup (common/quantized_lookup.h for the
// operands): int8 / int4 / float16 / float32 tables, one launch for every feature.
//
// A bag goes to a group of 2^shift lanes, each lane reading WordsPerLane 32-bit words of
// every row of the bag per pass (4 words: 16 int8 columns; int4 2 words, 16 columns),
// lane l words l, l + G, ...
// so that each load instruction of the group reads consecutive words: a dim-128 int8 row
// (33 words: the float16 scale and bias, then 32 of codes) goes to 8 lanes, four bags to
// a warp. Each lane also loads the row's header word (the same address for the group),
// keeps kRowsInFlight rows in flight and sums in float32, in index order: no atomics, the
// same bits every run. The per-row bias is summed once per row, apart from the codes:
//   sum_p w_p (scale_p * code_pj + bias_p) = sum_p (w_p scale_p) code_pj + sum_p w_p bias_p
// Why 4 words a lane: with one word a lane (32 lanes per dim-128 int8 row) the kernel was
// bound by issue, not memory (Nsight Compute on an H100: 0.68 instructions issued per
// scheduler cycle, DRAM 63% busy): each row's address, bounds check and scale were paid
// for every 4 columns.
// The features' descriptions (table pointers, sizes, precisions, warp schedule) are the
// kernel's parameters, so a launch reads no layout from memory.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "common/quantized_lookup.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"
#include "cuda/tbe_util.cuh"

namespace jaxrec {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * kWarpSize;
// Words a lane reads of each row (int8: 4 words, 16 columns; int4: 2 words, 16 columns;
// fp16: 8 columns; fp32: 4) and rows in flight per lane. Measured on an H100
// (benchmarks/serving_lookup_gpu.py): 8 rows in flight took 114 registers a thread and ran
// no faster; capping registers at 64 spilled and ran slower; a group sharing each row's
// id, header and weight by shuffles (one load of them per row and group, not per lane)
// ran int8 at 0.42 ms against 0.23; 8 columns a lane (int8 2 words, int4 1) ran int8 at
// 0.226 ms (within run-to-run noise) and int4 at 0.184 against 0.170.
constexpr int WordsPerLane(int bits) { return bits == 4 ? 2 : 4; }
constexpr int kRowsInFlight = 4;

struct LookupParams {
  QuantizedProblem problem;
  int32_t warp_start[kMaxQuantizedFeatures + 1];  // feature f owns warps [start[f], start[f+1])
  const float* per_sample_weights;                // nullptr when unweighted
};

// The float of an 8-bit code (< 2^8) by its bits: 2^23 + code is exact, minus 2^23.
__device__ __forceinline__ float CodeToFloat(uint32_t code) {
  return __uint_as_float(0x4b000000u | code) - 8388608.f;
}

// Column j of a row's word, as a float: the code for int8 / int4, the value otherwise.
template <int kBits>
__device__ __forceinline__ float Column(uint32_t word, int j) {
  if constexpr (kBits == 32) {
    return __uint_as_float(word);
  } else if constexpr (kBits == 16) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(word >> (16 * j))));
  } else if constexpr (kBits == 8) {
    return __uint_as_float(__byte_perm(word, 0x4b000000u, 0x7540 | j)) - 8388608.f;  // byte j | 2^23
  } else {
    return CodeToFloat((word >> (4 * j)) & 0xfu);
  }
}

// (scale, bias) of an int8 / int4 row from its header word.
__device__ __forceinline__ float2 ScaleBias(uint32_t header) {
  return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(header & 0xffffu))),
                     __half2float(__ushort_as_half(static_cast<unsigned short>(header >> 16))));
}

// The factor of a row's codes (values for float rows) in a bag, `w` times its scale; its
// bias, times `w`, goes into `bias_sum`.
template <int kBits>
__device__ __forceinline__ float RowScale(uint32_t header, float w, float& bias_sum) {
  if constexpr (kBits <= 8) {
    const float2 sb = ScaleBias(header);
    bias_sum = fmaf(w, sb.y, bias_sum);
    return w * sb.x;
  }
  return w;
}

template <int kBits, typename I>
__device__ __forceinline__ const uint32_t* RowWords(const QuantizedFeature& f, I id, I last_row) {
  const bool ok = IdInTable(id, last_row);
  return reinterpret_cast<const uint32_t*>(f.table + static_cast<int64_t>(ok ? id : I{0}) * f.row_bytes);
}

template <typename O, int kColumns>
__device__ __forceinline__ void StoreColumns(O* p, const float (&v)[kColumns], bool vector) {
  if constexpr (kColumns % 4 == 0) {
    if (vector) {
#pragma unroll
      for (int j = 0; j < kColumns; j += 4) Store4(p + j, make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]));
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < kColumns; ++j) p[j] = FromFloat<O>(v[j]);
}

// The bag [start, end) of feature `f` for the lane at word `word0` of each pass.
template <int kBits, typename O, typename I, bool kSequence>
__device__ __forceinline__ void LookupBag(const QuantizedFeature& f, const I* __restrict__ indices,
                                          const float* __restrict__ psw, I start, I end, int64_t b,
                                          int group_lane, O* __restrict__ out,
                                          const QuantizedProblem& problem) {
  constexpr int kColumns = ColumnsPerWord(kBits);
  constexpr int kHeader = HeaderWords(kBits);
  const int words = f.dim / kColumns;
  const int group = 1 << f.shift;
  const I last = f.rows > 0 ? end : start;  // a table without rows has no row 0: nothing is read
  const I last_row = f.rows > 0 ? LastRow<I>(f.rows) : I{0};
  if constexpr (kSequence) {
    const bool vector = f.dim % 4 == 0;
    for (I p = start; p < last; ++p) {
      const uint32_t* row = RowWords<kBits>(f, indices[p], last_row);
      float2 sb = make_float2(1.f, 0.f);
      if constexpr (kHeader) sb = ScaleBias(__ldg(row));
      for (int word = group_lane; word < words; word += group) {
        const uint32_t bits = __ldg(row + kHeader + word);
        float v[kColumns];
#pragma unroll
        for (int j = 0; j < kColumns; ++j)
          v[j] = kHeader ? fmaf(sb.x, Column<kBits>(bits, j), sb.y) : Column<kBits>(bits, j);
        StoreColumns<O, kColumns>(out + static_cast<int64_t>(p) * f.dim + word * kColumns, v, vector);
      }
    }
  } else {
    O* out_row = out + b * problem.total_dim + f.output_offset;
    const bool vector = problem.total_dim % 4 == 0 && f.output_offset % 4 == 0;
    const float mean =
        problem.pooling == PoolingMode::kMean && end > start ? 1.f / static_cast<float>(end - start) : 1.f;
    constexpr int kWords = WordsPerLane(kBits);
    // A pass covers kWords * group words; lane l holds words base + l + k * group,
    // so that each load instruction of the group reads consecutive words.
    for (int base = 0; base < words; base += kWords * group) {
      float acc[kWords][kColumns] = {};
      float bias_sum = 0.f;
      // Batches of kRowsInFlight rows, the last one predicated: a bag's rows are read in
      // ceil(L / kRowsInFlight) round trips (an unpredicated tail would add one per row).
      for (I p = start; p < last; p += kRowsInFlight) {
        uint32_t header[kRowsInFlight], bits[kRowsInFlight][kWords];
        float w[kRowsInFlight];
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          const bool in_bag = p + u < last;
          const uint32_t* row = RowWords<kBits>(f, in_bag ? indices[p + u] : I{0}, last_row) + kHeader;
          header[u] = kHeader && in_bag ? __ldg(row - kHeader) : 0u;
#pragma unroll
          for (int k = 0; k < kWords; ++k) {
            const int word = base + group_lane + k * group;
            bits[u][k] = in_bag && word < words ? __ldg(row + word) : 0u;
          }
          w[u] = in_bag ? (psw ? psw[p + u] : 1.f) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          const float scale = RowScale<kBits>(header[u], w[u], bias_sum);
#pragma unroll
          for (int k = 0; k < kWords; ++k) {
#pragma unroll
            for (int j = 0; j < kColumns; ++j)
              acc[k][j] = fmaf(scale, Column<kBits>(bits[u][k], j), acc[k][j]);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kWords; ++k) {
        const int word = base + group_lane + k * group;
        if (word >= words) break;
#pragma unroll
        for (int j = 0; j < kColumns; ++j) acc[k][j] = (acc[k][j] + bias_sum) * mean;
        StoreColumns<O, kColumns>(out_row + word * kColumns, acc[k], vector);
      }
    }
  }
}

template <typename O, typename I, bool kSequence>
__global__ void __launch_bounds__(kThreads)
    QuantizedLookupKernel(const I* __restrict__ indices, const I* __restrict__ offsets, O* __restrict__ out,
                          const __grid_constant__ LookupParams params) {
  const QuantizedProblem& problem = params.problem;
  const int32_t warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (warp >= params.warp_start[problem.num_features]) return;
  int32_t lo = 0, hi = problem.num_features;  // warp_start[lo] <= warp < warp_start[hi]
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    (params.warp_start[mid] <= warp ? lo : hi) = mid;
  }
  const QuantizedFeature& f = problem.features[lo];
  const int lane = threadIdx.x % kWarpSize;
  const int64_t b = int64_t{warp - params.warp_start[lo]} * (kWarpSize >> f.shift) + (lane >> f.shift);
  if (b >= problem.batch_size) return;
  const int group_lane = lane & ((1 << f.shift) - 1);
  const int64_t bag = lo * problem.batch_size + b;
  I start, end;
  ClampBag<I>(offsets[bag], offsets[bag + 1], static_cast<I>(problem.num_indices), &start, &end);
  const float* psw = params.per_sample_weights;
  switch (f.bits) {  // one feature per warp: the branch is uniform
    case 8:
      return LookupBag<8, O, I, kSequence>(f, indices, psw, start, end, b, group_lane, out, problem);
    case 4:
      return LookupBag<4, O, I, kSequence>(f, indices, psw, start, end, b, group_lane, out, problem);
    case 16:
      return LookupBag<16, O, I, kSequence>(f, indices, psw, start, end, b, group_lane, out, problem);
    default:
      return LookupBag<32, O, I, kSequence>(f, indices, psw, start, end, b, group_lane, out, problem);
  }
}

constexpr std::string_view kOp = "jaxrec_quantized_lookup";

ffi::Error QuantizedLookupCuda(cudaStream_t stream, ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                               ffi::AnyBuffer per_sample_weights, ffi::RemainingArgs tables,
                               ffi::Result<ffi::AnyBuffer> out, int32_t pooling,
                               ffi::Span<const int64_t> feature_tables, ffi::Span<const int64_t> bits) {
  LookupParams params;
  if (ffi::Error invalid = ValidateQuantized(kOp, indices, offsets, per_sample_weights, tables, *out, pooling,
                                             feature_tables, bits, &params.problem);
      invalid.failure()) {
    return invalid;
  }
  QuantizedProblem& problem = params.problem;
  // 2^shift lanes per bag: enough for a row's words at WordsPerLane words a lane, up to a warp.
  int64_t warps = 0;
  params.warp_start[0] = 0;
  for (int f = 0; f < problem.num_features; ++f) {
    QuantizedFeature& feature = problem.features[f];
    const int per_lane = WordsPerLane(feature.bits);
    const int lane_words = (feature.dim / ColumnsPerWord(feature.bits) + per_lane - 1) / per_lane;
    int shift = 0;
    while (shift < 5 && (1 << shift) < lane_words) ++shift;
    feature.shift = shift;
    warps += (problem.batch_size + (kWarpSize >> shift) - 1) / (kWarpSize >> shift);
    if (warps >= (int64_t{1} << 31) / kThreads) return Invalid(kOp, "the batch is too large for one launch");
    params.warp_start[f + 1] = static_cast<int32_t>(warps);
  }
  params.per_sample_weights = problem.weighted ? per_sample_weights.typed_data<float>() : nullptr;
  const bool sequence = problem.pooling == PoolingMode::kNone;
  if (sequence) {  // padding positions are zero rows
    cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  }
  const unsigned blocks = static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  ffi::AnyBuffer* out_buffer = &(*out);
  return DispatchIndexType(indices.element_type(), "indices", [&](auto index_zero) {
    using I = decltype(index_zero);
    return DispatchFloatType<__half, __nv_bfloat16>(out_buffer->element_type(), "output", [&](auto out_zero) {
      using O = decltype(out_zero);
      if (blocks > 0) {
        auto kernel = sequence ? QuantizedLookupKernel<O, I, true> : QuantizedLookupKernel<O, I, false>;
        kernel<<<blocks, kThreads, 0, stream>>>(indices.typed_data<I>(), offsets.typed_data<I>(),
                                                reinterpret_cast<O*>(out_buffer->untyped_data()), params);
      }
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess)
        return ffi::Error::Internal(std::string(kOp) + " launch: " + cudaGetErrorString(err));
      return ffi::Error::Success();
    });
  });
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecQuantizedLookupCuda, jaxrec::QuantizedLookupCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // indices
                                  .Arg<xla::ffi::AnyBuffer>()  // offsets
                                  .Arg<xla::ffi::AnyBuffer>()  // per_sample_weights
                                  .RemainingArgs()             // tables
                                  .Ret<xla::ffi::AnyBuffer>()  // output
                                  .Attr<int32_t>("pooling")
                                  .Attr<xla::ffi::Span<const int64_t>>("feature_tables")
                                  .Attr<xla::ffi::Span<const int64_t>>("bits"));
