// Device helpers of the TT embedding kernels (tt_embedding.cu): the shapes of the
// cores with each warp's shared-memory layout, a warp-wide strided GEMM and a warp's
// asynchronous copy of a core slice to shared memory.
//
// One warp contracts the chain of one id. Its matrices are small (a core slice is
// r x q*r', the partials have D*r entries), so a warp multiplies them alone, each
// lane holding a kTile x kTile block of C in registers: per step of k it loads
// 2*kTile values for kTile^2 FMAs. The tile is picked per product (PickTile) so that
// small products still keep all 32 lanes busy. A chain is a string of dependent
// products, so what a warp mostly waits on is L2: the code tries to have many loads
// in flight per round trip (cp.async copies, unrolled loads of global operands).
#pragma once

#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/tbe_util.cuh"

namespace jaxrec {

constexpr int kMaxTtCores = 4;
constexpr int kVectorUnroll = 2;  // steps of 4 k unrolled: kTile * 2 16-byte loads of A in flight

// The TT shape (core t is float32[r[t], p[t], q[t], r[t+1]], row-major) and where each
// warp keeps its partial products in its slice of dynamic shared memory, in floats.
// Leading dimensions are odd so that lanes reading one column of consecutive rows
// hit distinct banks.
struct TtShape {
  int num_cores;  // T
  int dim;        // D = q[0] * ... * q[T-1]
  int p[kMaxTtCores], q[kMaxTtCores], r[kMaxTtCores + 1];
  int q_left[kMaxTtCores];                        // Q_<t = q[0] * ... * q[t-1]
  int q_right[kMaxTtCores];                       // Q_>t = q[t+1] * ... * q[T-1]
  int slice_row[kMaxTtCores];                     // p[t] q[t] r[t+1]: between rows a of a slice
  int left[kMaxTtCores], left_ld[kMaxTtCores];    // L_t (t >= 1): Q_<t x r[t]
  int right[kMaxTtCores], right_ld[kMaxTtCores];  // R_t (t <= T-2): r[t+1] x Q_>t
  bool stage_left[kMaxTtCores];                   // the step L_t -> L_{t+1} first copies G_t to the scratch
  int scratch;                                    // a staged core slice, or X_t
  int grad;                                       // the bag's output gradient (D)
  int forward_floats;   // per warp, forward: L_1 .. L_{T-1} and the scratch for staged slices
  int backward_floats;  // per warp, backward: everything
};

// Element (b, i, j) of a batch of matrices is data[b * batch + i * row + j * col].
// Strides are int: the host checks that every core has fewer than 2^31 elements.
struct Strided {
  const float* data;
  int batch, row, col;
};

struct StridedOut {
  float* data;
  int batch, row, col;
};

struct GemmDims {
  int batch, m, n, k;
};

// C[b] = A[b] @ B[b] by one warp (C[b] += with kAtomic: float32 atomicAdd into global
// memory). A and B are in shared memory, or in global memory (read through __ldg) with
// kGlobalA / kGlobalB. A global A whose rows are contiguous in k and 16-byte aligned is
// read 4 k at a time (each lane reads its own rows, so one float4 beats four floats).
// Lane u of the (batch, row tile, column tile) units owns rows tm + row_tiles * i
// (lanes read consecutive rows of A) and columns tn + col_tiles * j (interleaved: lanes
// read consecutive columns of B) or, with kAdjacentCols, tn * kTile + j (four adjacent
// outputs, one 16-byte atomic on sm_90). Rows and columns past the edge are clamped
// for the loads and skipped for the stores.
template <int kTile, bool kGlobalA, bool kGlobalB, bool kAdjacentCols, bool kAtomic>
__device__ __forceinline__ void GemmTiles(const GemmDims& d, const Strided& a, const Strided& b,
                                          const StridedOut& c) {
  const int lane = threadIdx.x % kWarpSize;
  const int row_tiles = (d.m + kTile - 1) / kTile;
  const int col_tiles = (d.n + kTile - 1) / kTile;
  const int units = d.batch * row_tiles * col_tiles;
  // The lane's unit (bt, tm, tn), and kWarpSize units as a step in (bt, tm, tn).
  int tn = lane % col_tiles, tm = lane / col_tiles % row_tiles, bt = lane / col_tiles / row_tiles;
  const int step_n = kWarpSize % col_tiles, step_m = kWarpSize / col_tiles % row_tiles;
  const int step_b = kWarpSize / col_tiles / row_tiles;
  const bool vector_a = kGlobalA && a.col == 1 && a.batch % 4 == 0 && a.row % 4 == 0 &&
                        reinterpret_cast<uintptr_t>(a.data) % 16 == 0;
  for (int u = lane; u < units; u += kWarpSize) {
    int row[kTile], col[kTile];
    const float* pa[kTile];
    const float* pb[kTile];
#pragma unroll
    for (int i = 0; i < kTile; ++i) {
      row[i] = tm + row_tiles * i;
      pa[i] = a.data + (bt * a.batch + min(row[i], d.m - 1) * a.row);
    }
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      col[j] = kAdjacentCols ? tn * kTile + j : tn + col_tiles * j;
      pb[j] = b.data + (bt * b.batch + min(col[j], d.n - 1) * b.col);
    }
    float acc[kTile][kTile] = {};
    int k = 0;
    if (vector_a) {
      // Each lane waits on its own rows of A: unrolling puts several loads in flight.
#pragma unroll(kVectorUnroll)
      for (; k + 4 <= d.k; k += 4) {
        float4 av4[kTile];
#pragma unroll
        for (int i = 0; i < kTile; ++i) av4[i] = __ldg(reinterpret_cast<const float4*>(pa[i] + k));
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          float bv[kTile];
#pragma unroll
          for (int j = 0; j < kTile; ++j) bv[j] = pb[j][(k + kk) * b.row];
#pragma unroll
          for (int i = 0; i < kTile; ++i) {
            const float av = reinterpret_cast<const float*>(&av4[i])[kk];
#pragma unroll
            for (int j = 0; j < kTile; ++j) acc[i][j] = fmaf(av, bv[j], acc[i][j]);
          }
        }
      }
    }
    // Global B: more steps per unrolled body, so more loads in flight per round trip.
#pragma unroll(kGlobalB ? 8 : 4)
    for (; k < d.k; ++k) {
      float av[kTile], bv[kTile];
#pragma unroll
      for (int i = 0; i < kTile; ++i) av[i] = kGlobalA ? __ldg(pa[i] + k * a.col) : pa[i][k * a.col];
#pragma unroll
      for (int j = 0; j < kTile; ++j) bv[j] = kGlobalB ? __ldg(pb[j] + k * b.row) : pb[j][k * b.row];
#pragma unroll
      for (int i = 0; i < kTile; ++i) {
#pragma unroll
        for (int j = 0; j < kTile; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
    }
    float* pc = c.data + bt * c.batch;
#pragma unroll
    for (int i = 0; i < kTile; ++i) {
      if (row[i] >= d.m) continue;
      float* dst = pc + (row[i] * c.row + col[0] * c.col);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if constexpr (kAtomic && kAdjacentCols && kTile == 4) {
        if (c.col == 1 && col[3] < d.n && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
          atomicAdd(reinterpret_cast<float4*>(dst), make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
          continue;
        }
      }
#endif
#pragma unroll
      for (int j = 0; j < kTile; ++j) {
        if (col[j] >= d.n) continue;
        float* out = pc + (row[i] * c.row + col[j] * c.col);
        if constexpr (kAtomic) {
          atomicAdd(out, acc[i][j]);
        } else {
          *out = acc[i][j];
        }
      }
    }
    tn += step_n;  // step_n < col_tiles and step_m < row_tiles: each carry is at most one
    const int carry_n = tn >= col_tiles;
    tn -= carry_n * col_tiles;
    tm += step_m + carry_n;
    const int carry_m = tm >= row_tiles;
    tm -= carry_m * row_tiles;
    bt += step_b + carry_m;
  }
}

// The tile (4, 2 or 1) with the shortest busiest lane: rounds of units per lane times
// the loads and FMAs of one k step (ties go to the larger tile, fewer loads in all).
__device__ __forceinline__ int PickTile(const GemmDims& d) {
  int best = 4, best_cost = INT_MAX;
#pragma unroll
  for (int tile = 4; tile >= 1; tile /= 2) {
    const int units = d.batch * ((d.m + tile - 1) / tile) * ((d.n + tile - 1) / tile);
    const int cost = (units + kWarpSize - 1) / kWarpSize * (2 * tile + tile * tile);
    if (cost < best_cost) {
      best = tile;
      best_cost = cost;
    }
  }
  return best;
}

// The warp's product; the caller puts a __syncwarp() between it and readers of C.
template <bool kGlobalA, bool kGlobalB, bool kAdjacentCols, bool kAtomic>
__device__ void WarpGemm(const GemmDims& d, const Strided& a, const Strided& b, const StridedOut& c) {
  switch (PickTile(d)) {
    case 4:
      GemmTiles<4, kGlobalA, kGlobalB, kAdjacentCols, kAtomic>(d, a, b, c);
      break;
    case 2:
      GemmTiles<2, kGlobalA, kGlobalB, kAdjacentCols, kAtomic>(d, a, b, c);
      break;
    default:
      GemmTiles<1, kGlobalA, kGlobalB, kAdjacentCols, kAtomic>(d, a, b, c);
  }
}

// Starts copying a rows x cols block from global to shared memory, rows src_row and
// dst_row apart, columns contiguous in both. The copies are asynchronous (cp.async):
// the warp issues all of them before it waits, so a whole core slice costs one round
// trip to L2. A short row shares the warp with other rows (2^shift >= cols lanes each).
// CopyWait() completes them.
__device__ __forceinline__ void CopyAsync(int rows, int cols, const float* src, int src_row, float* dst,
                                          int dst_row) {
  const int lane = threadIdx.x % kWarpSize;
  const int shift = cols >= kWarpSize ? 5 : 32 - __clz(cols - 1);
  const int r0 = lane >> shift, row_step = kWarpSize >> shift;
  for (int c = lane & ((1 << shift) - 1); c < cols; c += 1 << shift) {
    const float* from = src + (r0 * src_row + c);
    float* to = dst + (r0 * dst_row + c);
#pragma unroll 4
    for (int r = r0; r < rows; r += row_step) {
      __pipeline_memcpy_async(to, from, sizeof(float));
      from += row_step * src_row;
      to += row_step * dst_row;
    }
  }
}

// Waits for the lane's copies, then makes every lane's copies visible to the warp.
__device__ __forceinline__ void CopyWait() {
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncwarp();
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int s = kWarpSize / 2; s > 0; s /= 2) x += __shfl_xor_sync(0xffffffff, x, s);
  return x;
}

}  // namespace jaxrec
