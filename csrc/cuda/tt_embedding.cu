// CUDA handlers of the tensor-train (TT) embedding bags, FBTT-Embedding's math
// (see jaxrec/ops/tt_embedding.py for the op and tt_reference.py for the oracle).
//
// Core t is float32[r[t], p[t], q[t], r[t+1]] (r[0] = r[T] = 1). Id i selects the slice
// G_t = core_t[:, i_t] of each core, i_t its digits in the mixed base p (i_0 most
// significant), and its row is the chain L_T with L_1 = G_0 and
// L_{t+1} = L_t @ G_t, L_t viewed as Q_<t x r[t] (Q_<t = q[0] * ... * q[t-1]).
//
// Forward, two kernels: one warp per position contracts its chain in shared memory
// and writes the row to the `rows` scratch; then one warp per bag sums its rows in
// position order (deterministic, no atomics).
//
// Backward, one warp per position: with g = grad_out[bag], the left partials L_t, the
// right partials R_t (r[t+1] x Q_>t, R_{T-1} = [[1]], R_t = G_{t+1} "@" R_{t+1}) and
// X_t = L_t^T @ g, core t gets dG_t[a, j, b] += w/len * sum_n X_t[a, j, n] R_t[b, n].
// These are float32 atomicAdds into the gradient buffers (as in FBTT's kernels): the
// summation order, hence the last bits of the core gradients, may vary between runs.
// The per-sample-weight gradient <g, row> / len is <X_{T-1}, G_{T-1}> / len, which the
// chain already has. A position whose weight is exactly 0 costs no chain in the
// forward and only the left chain in the backward (for its weight's
// gradient); padding positions (>= offsets[num_bags]) are never read. Bad input reads
// nothing outside the cores or the indices: the positions and bags are clamped into
// [0, N] (ClampBag), and an id outside [0, num_embeddings) is skipped like a weight of
// 0, except that it gets no per-sample-weight gradient either (it stays 0).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "cuda/tbe_util.cuh"
#include "cuda/tt_util.cuh"

namespace jaxrec {
namespace {

constexpr int kMaxWarpsPerBlock = 4;  // chain kernels: fewer if shared memory is short
constexpr int kPoolWarpsPerBlock = 8;
// The forward waits on L2 more than it computes: at 72 registers 28 warps share an SM
// (fewer registers spill; measured on an H100).
constexpr int kRowsMinBlocks = 7;
constexpr int64_t kMaxBlocks = 1 << 20;    // the chain kernels stride over the rest
constexpr int64_t kMaxStagedSlice = 1024;  // floats: smaller slices are staged (LeftChain)

struct TtArgs {
  TtShape shape;
  const float* cores[kMaxTtCores];
  float* grad_cores[kMaxTtCores];   // backward only
  const float* per_sample_weights;  // nullptr when unweighted
  int64_t num_positions;            // N
  int64_t num_bags;
  int64_t num_embeddings;  // rows of the table: ids outside [0, it) are skipped
  bool mean;
};

// Element offset of each slice core_t[:, i_t] of `id`.
__device__ __forceinline__ void SliceOffsets(const TtShape& s, int64_t id, int64_t* slice) {
  for (int t = s.num_cores - 1; t >= 0; --t) {
    int64_t digit;
    if (id <= INT32_MAX) {  // 32-bit division is several times cheaper than 64-bit
      const uint32_t u = static_cast<uint32_t>(id), base = static_cast<uint32_t>(s.p[t]);
      digit = u % base;
      id = u / base;
    } else {
      digit = id % s.p[t];
      id /= s.p[t];
    }
    slice[t] = digit * s.q[t] * s.r[t + 1];
  }
}

// The bag k of position p: offsets[k] <= p < offsets[k + 1] (the last such k when
// bags are empty), for p in [offsets[0], offsets[num_bags]).
template <typename I>
__device__ __forceinline__ int64_t BagOfPosition(const I* offsets, int64_t num_bags, int64_t p) {
  int64_t lo = 0, hi = num_bags;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= p)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// L_1 .. L_last into the warp's buffers `ws`; with last == T the row L_T goes to `row`.
// L_{t+1}[(m, j), b] = sum_a L_t[m, a] G_t[a, j, b] is one product per j, so that
// L_{t+1} keeps its padded leading dimension. A small slice is staged first: one round
// trip to L2, where the narrow tiles of its product would each wait on their own.
__device__ void LeftChain(const TtArgs& args, const int64_t* slice, float* ws, int last, float* row) {
  const TtShape& s = args.shape;
  CopyAsync(s.q[0], s.r[1], args.cores[0] + slice[0], s.r[1], ws + s.left[1], s.left_ld[1]);
  CopyWait();
  for (int t = 1; t < last; ++t) {
    const int rn = s.r[t + 1], width = s.q[t] * rn;
    const GemmDims d{s.q[t], s.q_left[t], rn, s.r[t]};
    const Strided a{ws + s.left[t], 0, s.left_ld[t], 1};
    const StridedOut c = t + 1 == s.num_cores
                             ? StridedOut{row, 1, s.q[t], 1}
                             : StridedOut{ws + s.left[t + 1], s.left_ld[t + 1], s.q[t] * s.left_ld[t + 1], 1};
    const float* g = args.cores[t] + slice[t];
    if (s.stage_left[t]) {
      CopyAsync(s.r[t], width, g, s.slice_row[t], ws + s.scratch, width);
      CopyWait();
      WarpGemm<false, false, false, false>(d, a, Strided{ws + s.scratch, rn, width, 1}, c);
    } else {
      WarpGemm<false, true, false, false>(d, a, Strided{g, rn, s.slice_row[t], 1}, c);
    }
    __syncwarp();
  }
}

// X_t = L_t^T @ g, g viewed as Q_<t x (q[t] Q_>t): r[t] x (q[t] Q_>t) into x.
__device__ void LeftTimesGrad(const TtShape& s, const float* ws, int t, float* x) {
  const int width = s.dim / s.q_left[t];
  WarpGemm<false, false, false, false>({1, s.r[t], width, s.q_left[t]},
                                       Strided{ws + s.left[t], 0, 1, s.left_ld[t]},
                                       Strided{ws + s.grad, 0, width, 1}, StridedOut{x, 0, width, 1});
  __syncwarp();
}

// R_t[a, (j, n)] = sum_b G_{t+1}[a, j, b] R_{t+1}[b, n], for t <= T-3: one product
// per a. The sum runs over the slice's contiguous index b, so each lane reads whole
// rows (a, j) of G straight from L2, 16 bytes at a time.
__device__ void RightStep(const TtArgs& args, const int64_t* slice, float* ws, int t) {
  const TtShape& s = args.shape;
  const int u = t + 1, rv = s.r[u + 1];
  WarpGemm<true, false, false, false>({s.r[u], s.q[u], s.q_right[u], rv},
                                      Strided{args.cores[u] + slice[u], s.slice_row[u], rv, 1},
                                      Strided{ws + s.right[u], 0, s.right_ld[u], 1},
                                      StridedOut{ws + s.right[t], s.right_ld[t], s.q_right[u], 1});
  __syncwarp();
}

template <typename I>
__global__ void __launch_bounds__((kMaxWarpsPerBlock * kWarpSize), kRowsMinBlocks)
    TtRowsKernel(const __grid_constant__ TtArgs args, const I* __restrict__ indices,
                 const I* __restrict__ offsets, float* __restrict__ rows) {
  extern __shared__ float smem[];
  const int warps = blockDim.x / kWarpSize;
  float* ws = smem + (threadIdx.x / kWarpSize) * args.shape.forward_floats;
  int64_t begin, end;
  ClampBag<int64_t>(offsets[0], offsets[args.num_bags], args.num_positions, &begin, &end);
  for (int64_t p = begin + int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; p < end;
       p += int64_t{gridDim.x} * warps) {
    if (args.per_sample_weights != nullptr && args.per_sample_weights[p] == 0.f) continue;
    if (!RowInRange(indices[p], args.num_embeddings)) continue;  // no row: the pool skips it
    int64_t slice[kMaxTtCores];
    SliceOffsets(args.shape, static_cast<int64_t>(indices[p]), slice);
    LeftChain(args, slice, ws, args.shape.num_cores, rows + p * args.shape.dim);
  }
}

// out[k] = sum of w_p * rows[p] over the bag in position order (/ len for MEAN);
// positions of weight 0 and ids outside the table have no row and are skipped.
template <typename I>
__global__ void __launch_bounds__((kPoolWarpsPerBlock * kWarpSize))
    TtPoolKernel(const float* __restrict__ rows, const I* __restrict__ indices, const I* __restrict__ offsets,
                 const float* __restrict__ psw, float* __restrict__ out, int64_t num_bags,
                 int64_t num_positions, int64_t num_embeddings, int dim, bool mean) {
  const int64_t bag = int64_t{blockIdx.x} * kPoolWarpsPerBlock + threadIdx.x / kWarpSize;
  if (bag >= num_bags) return;
  const int lane = threadIdx.x % kWarpSize;
  int64_t start, end;
  ClampBag<int64_t>(offsets[bag], offsets[bag + 1], num_positions, &start, &end);
  const float scale = mean && end > start ? 1.f / static_cast<float>(end - start) : 1.f;
  constexpr int kUnroll = 4;
  for (int c = 4 * lane; c < dim; c += 4 * kWarpSize) {
    const int count = ColumnsLeft(dim, c);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t p0 = start; p0 < end; p0 += kUnroll) {
      float w[kUnroll];
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // rows of weight 0 were never written
        w[u] = p0 + u >= end || !RowInRange(indices[p0 + u], num_embeddings) ? 0.f
               : psw != nullptr                                              ? psw[p0 + u]
                                                                             : 1.f;
        v[u] = w[u] != 0.f ? LoadAny4(rows + (p0 + u) * dim + c, count) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) Fma4(acc, w[u], v[u]);
    }
    StoreAny4(out + bag * dim + c, Scale4(acc, scale), count);
  }
}

template <typename I>
__global__ void __launch_bounds__((kMaxWarpsPerBlock * kWarpSize))
    TtBackwardKernel(const __grid_constant__ TtArgs args, const float* __restrict__ grad_out,
                     const I* __restrict__ indices, const I* __restrict__ offsets,
                     float* __restrict__ grad_psw) {
  extern __shared__ float smem[];
  const TtShape& s = args.shape;
  const int last = s.num_cores - 1, lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  float* ws = smem + (threadIdx.x / kWarpSize) * s.backward_floats;
  float* grad = ws + s.grad;
  float* x = ws + s.scratch;
  int64_t begin, end;
  ClampBag<int64_t>(offsets[0], offsets[args.num_bags], args.num_positions, &begin, &end);
  for (int64_t p = begin + int64_t{blockIdx.x} * warps + threadIdx.x / kWarpSize; p < end;
       p += int64_t{gridDim.x} * warps) {
    if (!RowInRange(indices[p], args.num_embeddings)) continue;  // dropped: all its gradients 0
    const float w = args.per_sample_weights != nullptr ? args.per_sample_weights[p] : 1.f;
    const int64_t bag = BagOfPosition(offsets, args.num_bags, p);
    const float inv_len = args.mean ? 1.f / static_cast<float>(offsets[bag + 1] - offsets[bag]) : 1.f;
    const bool core_grads = w != 0.f;
    const float scale = w * inv_len;
    int64_t slice[kMaxTtCores];
    SliceOffsets(s, static_cast<int64_t>(indices[p]), slice);
    // The bag's gradient, and R_{T-2}: G_{T-1} itself, viewed r[T-1] x q[T-1]. The
    // first CopyWait() of LeftChain completes these copies too.
    const int ld = s.right_ld[last - 1];
    const float* g_last = ws + s.right[last - 1];
    CopyAsync(1, s.dim, grad_out + bag * s.dim, s.dim, grad, s.dim);
    CopyAsync(s.r[last], s.q[last], args.cores[last] + slice[last], s.slice_row[last], ws + s.right[last - 1],
              ld);
    LeftChain(args, slice, ws, last, nullptr);
    LeftTimesGrad(s, ws, last, x);

    // Last core (r[T] = 1, R_{T-1} = [[1]]): dG_{T-1} = X_{T-1}, and the weight's gradient.
    float* dg_last = args.grad_cores[last] + slice[last];
    float dot = 0.f;
    for (int e = lane; e < s.r[last] * s.q[last]; e += kWarpSize) {
      const int a = e / s.q[last], j = e - a * s.q[last];
      if (grad_psw != nullptr) dot = fmaf(x[e], g_last[a * ld + j], dot);
      if (core_grads) atomicAdd(dg_last + a * s.slice_row[last] + j, scale * x[e]);
    }
    if (grad_psw != nullptr) {
      dot = WarpSum(dot);
      if (lane == 0) grad_psw[p] = dot * inv_len;
    }
    if (!core_grads) {
      __syncwarp();
      continue;
    }
    // From here on g is scaled by w / len, and so are the X_t made from it.
    for (int c = lane; c < s.dim; c += kWarpSize) grad[c] *= scale;
    __syncwarp();

    for (int t = last - 1; t >= 0; --t) {
      if (t < last - 1) RightStep(args, slice, ws, t);
      const float* xt = grad;  // X_0 = g
      if (t > 0) {
        LeftTimesGrad(s, ws, t, x);
        xt = x;
      }
      const int qr = s.q_right[t];
      // dG_t[a, j, b] += sum_n X_t[a, j, n] R_t[b, n], one product per a.
      WarpGemm<false, false, true, true>(
          {s.r[t], s.q[t], s.r[t + 1], qr}, Strided{xt, s.q[t] * qr, qr, 1},
          Strided{ws + s.right[t], 0, 1, s.right_ld[t]},
          StridedOut{args.grad_cores[t] + slice[t], s.slice_row[t], s.r[t + 1], 1});
      __syncwarp();
    }
  }
}

// --- host ---------------------------------------------------------------------------

ffi::Error Invalid(std::string_view op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

ffi::Error CudaError(std::string_view op, cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string(op) + ": " + what + ": " + cudaGetErrorString(err));
}

// The shape from the attributes, and each warp's shared-memory layout (see TtShape).
ffi::Error MakeShape(std::string_view op, ffi::Span<const int64_t> p, ffi::Span<const int64_t> q,
                     ffi::Span<const int64_t> ranks, TtShape* s) {
  const int64_t num_cores = static_cast<int64_t>(p.size());
  if (num_cores < 2 || num_cores > kMaxTtCores) {
    return Invalid(op, "p_shapes must have 2 to 4 entries (one per core), got " + std::to_string(num_cores));
  }
  if (static_cast<int64_t>(q.size()) != num_cores || static_cast<int64_t>(ranks.size()) != num_cores + 1) {
    return Invalid(op, "q_shapes must have T = " + std::to_string(num_cores) +
                           " entries and ranks T + 1, got " + std::to_string(q.size()) + " and " +
                           std::to_string(ranks.size()));
  }
  if (ranks[0] != 1 || ranks[num_cores] != 1) {
    return Invalid(op, "ranks must start and end with 1, got " + std::to_string(ranks[0]) + " and " +
                           std::to_string(ranks[num_cores]));
  }
  constexpr int64_t kMaxFactor = int64_t{1} << 30;
  for (int64_t t = 0; t < num_cores; ++t) {
    if (p[t] < 1 || q[t] < 1 || ranks[t] < 1 || p[t] > kMaxFactor || q[t] > kMaxFactor ||
        ranks[t] > kMaxFactor) {
      return Invalid(op, "p_shapes, q_shapes and ranks must be positive (and below 2^30); core " +
                             std::to_string(t) + " has p=" + std::to_string(p[t]) +
                             ", q=" + std::to_string(q[t]) + ", r=" + std::to_string(ranks[t]));
    }
  }
  int64_t dim = 1;
  for (int64_t t = 0; t < num_cores; ++t) {
    // Offsets inside a core are int32 on the device. Each product stays below 2^61.
    int64_t size = ranks[t] * p[t];
    if (size <= INT32_MAX) size *= q[t];
    if (size <= INT32_MAX) size *= ranks[t + 1];
    if (size > INT32_MAX) {
      return Invalid(op, "core " + std::to_string(t) +
                             " has 2^31 elements or more, beyond the CUDA "
                             "kernel's int32 offsets; use smaller p, q or ranks, or backend=\"reference\"");
    }
    dim *= q[t];
    if (dim > kMaxFactor)
      return Invalid(op, "the product of q_shapes (the embedding dim) must be below 2^30");
  }
  *s = TtShape{};
  s->num_cores = static_cast<int>(num_cores);
  s->dim = static_cast<int>(dim);
  for (int t = 0; t <= num_cores; ++t) s->r[t] = static_cast<int>(ranks[t]);
  int64_t q_left = 1;
  for (int t = 0; t < num_cores; ++t) {
    s->p[t] = static_cast<int>(p[t]);
    s->q[t] = static_cast<int>(q[t]);
    s->q_left[t] = static_cast<int>(q_left);
    s->q_right[t] = static_cast<int>(dim / q_left / q[t]);
    s->slice_row[t] = static_cast<int>(p[t] * q[t] * ranks[t + 1]);
    q_left *= q[t];
  }
  // Layout: [L_1 .. L_{T-1}][scratch][R_0 .. R_{T-2}][grad]; sizes in int64 until the
  // total is known to be small. The forward needs the first two (scratch: staged slices).
  auto odd = [](int64_t n) { return n | 1; };
  int64_t cursor = 0;
  for (int t = 1; t < num_cores; ++t) {
    s->left[t] = static_cast<int>(cursor);
    s->left_ld[t] = static_cast<int>(odd(ranks[t]));
    cursor += s->q_left[t] * odd(ranks[t]);
  }
  int64_t forward_scratch = 0, scratch = 0;
  for (int t = 1; t < num_cores; ++t) {
    const int64_t slice_size = ranks[t] * q[t] * ranks[t + 1];
    s->stage_left[t] = slice_size <= kMaxStagedSlice;
    if (s->stage_left[t]) forward_scratch = std::max(forward_scratch, slice_size);
    scratch = std::max(scratch, ranks[t] * (dim / s->q_left[t]));  // X_t
  }
  scratch = std::max(scratch, forward_scratch);
  s->scratch = static_cast<int>(cursor);
  const int64_t forward_floats = cursor + forward_scratch;
  cursor += scratch;
  for (int t = 0; t + 1 < num_cores; ++t) {
    s->right[t] = static_cast<int>(cursor);
    s->right_ld[t] = static_cast<int>(odd(s->q_right[t]));
    cursor += ranks[t + 1] * odd(s->q_right[t]);
  }
  s->grad = static_cast<int>(cursor);
  cursor += dim;
  constexpr int64_t kMaxFloats = int64_t{1} << 24;  // far above any GPU's shared memory
  if (cursor > kMaxFloats) {
    return Invalid(op, "ranks and q_shapes are too large for the CUDA kernel (" + std::to_string(cursor) +
                           " floats of shared memory per id); use backend=\"reference\"");
  }
  s->forward_floats = static_cast<int>(forward_floats);
  s->backward_floats = static_cast<int>(cursor);
  return ffi::Error::Success();
}

using F32Buffer = ffi::Buffer<ffi::F32>;

// Used cores must hold r[t] p[t] q[t] r[t+1] floats; `what` names them ("core", "grad_core").
ffi::Error CheckCores(std::string_view op, const TtShape& s, const F32Buffer* const* cores,
                      std::string_view what) {
  for (int t = 0; t < s.num_cores; ++t) {
    const int64_t want = int64_t{s.r[t]} * s.slice_row[t];
    if (static_cast<int64_t>(cores[t]->element_count()) != want) {
      return Invalid(op, std::string(what) + std::to_string(t) +
                             " must have r*p*q*r' = " + std::to_string(want) + " elements, got " +
                             std::to_string(cores[t]->element_count()));
    }
  }
  return ffi::Error::Success();
}

// indices [N], offsets [num_bags + 1] of the same dtype, per_sample_weights [N] or [0].
ffi::Error CheckBags(std::string_view op, const ffi::AnyBuffer& indices, const ffi::AnyBuffer& offsets,
                     const F32Buffer& psw, int32_t pooling) {
  if (indices.dimensions().size() != 1 || offsets.dimensions().size() != 1 || offsets.element_count() < 1) {
    return Invalid(op, "indices must be [N] and offsets [num_bags + 1]");
  }
  if (offsets.element_type() != indices.element_type()) {
    return Invalid(op, "offsets must have the dtype of indices");
  }
  if (psw.element_count() != 0 && psw.element_count() != indices.element_count()) {
    return Invalid(op, "per_sample_weights must be [N] like indices, or [0] when unweighted; got " +
                           std::to_string(psw.element_count()) +
                           " for N = " + std::to_string(indices.element_count()));
  }
  if (pooling != static_cast<int32_t>(PoolingMode::kSum) &&
      pooling != static_cast<int32_t>(PoolingMode::kMean)) {
    return Invalid(op, "pooling must be SUM (0) or MEAN (1), got " + std::to_string(pooling));
  }
  return ffi::Error::Success();
}

ffi::Error CheckMatrix(std::string_view op, std::string_view what, const F32Buffer& buffer, int64_t rows,
                       int64_t cols) {
  const auto dims = buffer.dimensions();
  if (dims.size() != 2 || dims[0] != rows || dims[1] != cols) {
    return Invalid(
        op, std::string(what) + " must be [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  }
  return ffi::Error::Success();
}

// Launches a chain kernel (one warp per position, each needing `floats` of shared
// memory) over num_positions positions: as many warps per block as shared memory allows.
template <typename... KernelArgs, typename... Args>
ffi::Error LaunchChain(std::string_view op, void (*kernel)(KernelArgs...), int floats, int64_t num_positions,
                       cudaStream_t stream, Args... args) {
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return CudaError(op, err, "shared memory limit");
  const size_t per_warp = std::max<size_t>(size_t(floats) * sizeof(float), sizeof(float));
  if (per_warp > static_cast<size_t>(optin)) {
    return Invalid(op, "ranks and q_shapes are too large for the CUDA kernel: one id needs " +
                           std::to_string(per_warp) + " bytes of shared memory, the GPU gives a block " +
                           std::to_string(optin) + "; use backend=\"reference\"");
  }
  const int warps = static_cast<int>(std::min<size_t>(kMaxWarpsPerBlock, optin / per_warp));
  const size_t bytes = warps * per_warp;
  if (bytes > 48 * 1024) {
    err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err != cudaSuccess) return CudaError(op, err, "shared memory attribute");
  }
  const auto blocks =
      static_cast<unsigned>(std::min<int64_t>((num_positions + warps - 1) / warps, kMaxBlocks));
  kernel<<<blocks, warps * kWarpSize, bytes, stream>>>(args...);
  if (err = cudaGetLastError(); err != cudaSuccess) return CudaError(op, err, "chain launch");
  return ffi::Error::Success();
}

TtArgs MakeArgs(const TtShape& shape, const F32Buffer* const* cores, const F32Buffer& psw,
                const ffi::AnyBuffer& indices, const ffi::AnyBuffer& offsets, int32_t pooling,
                int64_t num_embeddings) {
  TtArgs args{};
  args.shape = shape;
  for (int t = 0; t < shape.num_cores; ++t) args.cores[t] = cores[t]->typed_data();
  args.per_sample_weights = psw.element_count() > 0 ? psw.typed_data() : nullptr;
  args.num_positions = static_cast<int64_t>(indices.element_count());
  args.num_bags = static_cast<int64_t>(offsets.element_count()) - 1;
  args.mean = pooling == static_cast<int32_t>(PoolingMode::kMean);
  args.num_embeddings = num_embeddings;
  return args;
}

// The kernels skip ids outside [0, num_embeddings); those inside must have digits
// inside the cores: num_embeddings <= p[0] * ... * p[T-1].
ffi::Error CheckNumEmbeddings(std::string_view op, ffi::Span<const int64_t> p, int64_t num_embeddings) {
  int64_t capacity = 1;
  for (const int64_t pt : p) {
    if (capacity >= num_embeddings) break;  // no overflow: stop once it is enough
    capacity *= pt;
  }
  if (num_embeddings < 0 || capacity < num_embeddings) {
    return Invalid(
        op, "num_embeddings " + std::to_string(num_embeddings) + " must be in [0, product of p_shapes]");
  }
  return ffi::Error::Success();
}

constexpr std::string_view kForward = "jaxrec_tt_forward";
constexpr std::string_view kBackward = "jaxrec_tt_backward";

ffi::Error TtForwardCuda(cudaStream_t stream, ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                         F32Buffer per_sample_weights, F32Buffer core0, F32Buffer core1, F32Buffer core2,
                         F32Buffer core3, ffi::Result<F32Buffer> out, ffi::Result<F32Buffer> rows,
                         int32_t pooling, int64_t num_embeddings, ffi::Span<const int64_t> p_shapes,
                         ffi::Span<const int64_t> q_shapes, ffi::Span<const int64_t> ranks) {
  TtShape shape;
  if (ffi::Error e = MakeShape(kForward, p_shapes, q_shapes, ranks, &shape); e.failure()) return e;
  if (ffi::Error e = CheckNumEmbeddings(kForward, p_shapes, num_embeddings); e.failure()) return e;
  const F32Buffer* cores[kMaxTtCores] = {&core0, &core1, &core2, &core3};
  if (ffi::Error e = CheckCores(kForward, shape, cores, "core"); e.failure()) return e;
  if (ffi::Error e = CheckBags(kForward, indices, offsets, per_sample_weights, pooling); e.failure())
    return e;
  const TtArgs args = MakeArgs(shape, cores, per_sample_weights, indices, offsets, pooling, num_embeddings);
  if (ffi::Error e = CheckMatrix(kForward, "out", *out, args.num_bags, shape.dim); e.failure()) return e;
  if (ffi::Error e = CheckMatrix(kForward, "rows", *rows, args.num_positions, shape.dim); e.failure())
    return e;

  return DispatchIndexType(indices.element_type(), "indices", [&](auto zero) {
    using I = decltype(zero);
    if (args.num_positions > 0) {
      if (ffi::Error e =
              LaunchChain(kForward, TtRowsKernel<I>, shape.forward_floats, args.num_positions, stream, args,
                          indices.typed_data<I>(), offsets.typed_data<I>(), rows->typed_data());
          e.failure()) {
        return e;
      }
    }
    if (args.num_bags > 0) {
      const unsigned blocks =
          static_cast<unsigned>((args.num_bags + kPoolWarpsPerBlock - 1) / kPoolWarpsPerBlock);
      TtPoolKernel<I><<<blocks, kPoolWarpsPerBlock * kWarpSize, 0, stream>>>(
          rows->typed_data(), indices.typed_data<I>(), offsets.typed_data<I>(), args.per_sample_weights,
          out->typed_data(), args.num_bags, args.num_positions, args.num_embeddings, shape.dim, args.mean);
      if (cudaError_t err = cudaGetLastError(); err != cudaSuccess)
        return CudaError(kForward, err, "pool launch");
    }
    return ffi::Error::Success();
  });
}

ffi::Error TtBackwardCuda(cudaStream_t stream, F32Buffer grad_out, ffi::AnyBuffer indices,
                          ffi::AnyBuffer offsets, F32Buffer per_sample_weights, F32Buffer core0,
                          F32Buffer core1, F32Buffer core2, F32Buffer core3,
                          ffi::Result<F32Buffer> grad_core0, ffi::Result<F32Buffer> grad_core1,
                          ffi::Result<F32Buffer> grad_core2, ffi::Result<F32Buffer> grad_core3,
                          ffi::Result<F32Buffer> grad_psw, int32_t pooling, int64_t num_embeddings,
                          ffi::Span<const int64_t> p_shapes, ffi::Span<const int64_t> q_shapes,
                          ffi::Span<const int64_t> ranks) {
  TtShape shape;
  if (ffi::Error e = MakeShape(kBackward, p_shapes, q_shapes, ranks, &shape); e.failure()) return e;
  if (ffi::Error e = CheckNumEmbeddings(kBackward, p_shapes, num_embeddings); e.failure()) return e;
  const F32Buffer* cores[kMaxTtCores] = {&core0, &core1, &core2, &core3};
  const F32Buffer* grads[kMaxTtCores] = {&*grad_core0, &*grad_core1, &*grad_core2, &*grad_core3};
  if (ffi::Error e = CheckCores(kBackward, shape, cores, "core"); e.failure()) return e;
  if (ffi::Error e = CheckCores(kBackward, shape, grads, "grad_core"); e.failure()) return e;
  if (ffi::Error e = CheckBags(kBackward, indices, offsets, per_sample_weights, pooling); e.failure())
    return e;
  TtArgs args = MakeArgs(shape, cores, per_sample_weights, indices, offsets, pooling, num_embeddings);
  if (ffi::Error e = CheckMatrix(kBackward, "grad_out", grad_out, args.num_bags, shape.dim); e.failure())
    return e;
  if (grad_psw->element_count() != per_sample_weights.element_count()) {
    return Invalid(kBackward, "grad_psw must have the shape of per_sample_weights");
  }
  // Every gradient is accumulated or written sparsely: zero them all first.
  for (int t = 0; t < kMaxTtCores; ++t) {
    args.grad_cores[t] = grads[t]->typed_data();
    if (grads[t]->element_count() == 0) continue;
    cudaError_t err = cudaMemsetAsync(args.grad_cores[t], 0, grads[t]->size_bytes(), stream);
    if (err != cudaSuccess) return CudaError(kBackward, err, "memset");
  }
  float* gpsw = grad_psw->element_count() > 0 ? grad_psw->typed_data() : nullptr;
  if (gpsw != nullptr) {
    cudaError_t err = cudaMemsetAsync(gpsw, 0, grad_psw->size_bytes(), stream);
    if (err != cudaSuccess) return CudaError(kBackward, err, "memset");
  }
  if (args.num_positions == 0 || args.num_bags == 0) return ffi::Error::Success();

  return DispatchIndexType(indices.element_type(), "indices", [&](auto zero) {
    using I = decltype(zero);
    return LaunchChain(kBackward, TtBackwardKernel<I>, shape.backward_floats, args.num_positions, stream,
                       args, grad_out.typed_data(), indices.typed_data<I>(), offsets.typed_data<I>(), gpsw);
  });
}

}  // namespace
}  // namespace jaxrec

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecTtForwardCuda, jaxrec::TtForwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // indices
                                  .Arg<xla::ffi::AnyBuffer>()              // offsets
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // per_sample_weights
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // core0
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // core1
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // core2
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // core3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // rows (scratch)
                                  .Attr<int32_t>("pooling")
                                  .Attr<int64_t>("num_embeddings")
                                  .Attr<xla::ffi::Span<const int64_t>>("p_shapes")
                                  .Attr<xla::ffi::Span<const int64_t>>("q_shapes")
                                  .Attr<xla::ffi::Span<const int64_t>>("ranks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrecTtBackwardCuda, jaxrec::TtBackwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // grad_out
                                  .Arg<xla::ffi::AnyBuffer>()              // indices
                                  .Arg<xla::ffi::AnyBuffer>()              // offsets
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // per_sample_weights
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // core0
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // core1
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // core2
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // core3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // grad_core0
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // grad_core1
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // grad_core2
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // grad_core3
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // grad_psw
                                  .Attr<int32_t>("pooling")
                                  .Attr<int64_t>("num_embeddings")
                                  .Attr<xla::ffi::Span<const int64_t>>("p_shapes")
                                  .Attr<xla::ffi::Span<const int64_t>>("q_shapes")
                                  .Attr<xla::ffi::Span<const int64_t>>("ranks"));
