// The row update of the fused optimizers, shared by the CPU and CUDA handlers of
// jaxrec_tbe_fused_update. It is the C++ twin of jaxrec/optim/_rowwise.py
// (update_rows), which documents every formula; keep the two in step. Gradient
// clipping is not here: as in FBGEMM it clamps grad_output before the backward
// (jaxrec.optim._rowwise.clip_output_gradient, applied by the wrapper).
//
// A `Row` holds the elements of one embedding row that the caller owns, as float32:
// w[i], g[i] (the row's summed gradient), s1[i], s2[i] (per-element state), for
// i < Row::Size(). Elements past the row's dim hold 0 and are never stored. Row sums
// go through row.Reduce(partial): the CPU owns the whole row (identity), a CUDA group of
// lanes owns 4 columns per lane and chunk (a shuffle reduction), so this code is written
// once; row.All(ok) is the same for a flag.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/ffi_util.h"

namespace jaxrec {

// jaxrec.optim's configs, in FBGEMM's order (jaxrec/optim/fused_update.py writes the attribute).
enum class OptimizerKind : int32_t {
  kSgd = 0,
  kAdagrad = 1,
  kRowWiseAdagrad = 2,
  kAdam = 3,
  kPartialRowWiseAdam = 4,
  kLamb = 5,
  kPartialRowWiseLamb = 6,
  kLarsSgd = 7,
};

enum class WeightDecayMode : int32_t { kNone = 0, kL2 = 1, kDecoupled = 2 };

// The float32[9] hyperparameter operand: OptimizerHyperparams' fields in order.
struct Hyperparams {
  float learning_rate, eps, beta1, beta2, weight_decay, momentum, eta, max_gradient, max_norm;

  JAXREC_HOST_DEVICE static Hyperparams Load(const float* h) {
    return {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8]};
  }
};

// Number of state buffers of each optimizer, and whether each is one value per row.
JAXREC_HOST_DEVICE constexpr int NumStates(OptimizerKind k) {
  return k == OptimizerKind::kSgd ? 0
         : (k == OptimizerKind::kAdagrad || k == OptimizerKind::kRowWiseAdagrad ||
            k == OptimizerKind::kLarsSgd)
             ? 1
             : 2;
}
JAXREC_HOST_DEVICE constexpr bool State1PerRow(OptimizerKind k) {
  return k == OptimizerKind::kRowWiseAdagrad;
}
JAXREC_HOST_DEVICE constexpr bool State2PerRow(OptimizerKind k) {
  return k == OptimizerKind::kPartialRowWiseAdam || k == OptimizerKind::kPartialRowWiseLamb;
}

// Calls fn(std::integral_constant<OptimizerKind, kind>{}) for the `optimizer` attribute
// (the handlers validate it first: common/tbe_validate.h).
template <typename Fn>
ffi::Error DispatchOptimizer(int32_t optimizer, Fn&& fn) {
  using K = OptimizerKind;
  switch (static_cast<K>(optimizer)) {
    case K::kSgd:
      return fn(std::integral_constant<K, K::kSgd>{});
    case K::kAdagrad:
      return fn(std::integral_constant<K, K::kAdagrad>{});
    case K::kRowWiseAdagrad:
      return fn(std::integral_constant<K, K::kRowWiseAdagrad>{});
    case K::kAdam:
      return fn(std::integral_constant<K, K::kAdam>{});
    case K::kPartialRowWiseAdam:
      return fn(std::integral_constant<K, K::kPartialRowWiseAdam>{});
    case K::kLamb:
      return fn(std::integral_constant<K, K::kLamb>{});
    case K::kPartialRowWiseLamb:
      return fn(std::integral_constant<K, K::kPartialRowWiseLamb>{});
    case K::kLarsSgd:
      return fn(std::integral_constant<K, K::kLarsSgd>{});
  }
  return ffi::Error::InvalidArgument("optimizer must be in [0, 7], got " + std::to_string(optimizer));
}

// Optimizers whose state has the same layout may share a kernel (CPU and CUDA), which
// switches on the optimizer, once per row, for the row math alone (UpdateRowIn): LARS-SGD
// runs in Adagrad's kernel, at Adagrad's speed (benchmarks/fused_update_builds_ab.py).
// That cuts the kernels' instantiations (most of the build time); the loads and stores
// of a row are those of its layout either way. Not Adam's family: LAMB in Adam's kernel
// made Adam 12% slower on the GPU (H200), so each keeps its own. KernelOf(k) is the kernel that
// updates optimizer k (the one place that says which share); KernelPartner(k), derived from
// it, the other optimizer that kernel k runs (k itself when it runs one).
JAXREC_HOST_DEVICE constexpr OptimizerKind KernelOf(OptimizerKind k) {
  return k == OptimizerKind::kLarsSgd ? OptimizerKind::kAdagrad : k;
}
constexpr int kNumOptimizers = static_cast<int>(OptimizerKind::kLarsSgd) + 1;
JAXREC_HOST_DEVICE constexpr OptimizerKind KernelPartner(OptimizerKind k) {
  for (int j = 0; j < kNumOptimizers; ++j) {
    const OptimizerKind other = static_cast<OptimizerKind>(j);
    if (other != k && KernelOf(other) == k) return other;
  }
  return k;
}
JAXREC_HOST_DEVICE constexpr bool SameStateLayout(OptimizerKind a, OptimizerKind b) {
  return NumStates(a) == NumStates(b) && State1PerRow(a) == State1PerRow(b) &&
         State2PerRow(a) == State2PerRow(b);
}
// A shared kernel loads and stores one state layout for both of its optimizers, and runs at
// most two (UpdateRowIn switches between a kernel's own optimizer and its partner).
JAXREC_HOST_DEVICE constexpr bool KernelsShareSoundly() {
  for (int j = 0; j < kNumOptimizers; ++j) {
    const OptimizerKind k = static_cast<OptimizerKind>(j);
    const OptimizerKind kernel = KernelOf(k);
    if (!SameStateLayout(k, kernel) || KernelOf(kernel) != kernel) return false;
    if (k != kernel && KernelPartner(kernel) != k) return false;  // a third optimizer in one kernel
  }
  return true;
}
static_assert(KernelsShareSoundly(), "each kernel runs optimizers of one state layout, at most two");
static_assert(KernelPartner(OptimizerKind::kAdagrad) == OptimizerKind::kLarsSgd &&
                  KernelPartner(OptimizerKind::kAdam) == OptimizerKind::kAdam,
              "LARS-SGD runs in Adagrad's kernel; Adam's family keeps its own (comment above)");

struct RowUpdateArgs {
  Hyperparams h;
  float step;  // t: the step after the increment (1 on the first update)
  float dim;   // D of the row's table
  WeightDecayMode weight_decay_mode;
};

// a / b where b > 0, else 0 (jaxrec.optim._rowwise._safe_div).
JAXREC_HOST_DEVICE float SafeDiv(float a, float b) { return b > 0.f ? a / b : 0.f; }

// Updates row.w (and row.s1/s2, or the per-row s1_row/s2_row) in place, as update_rows.
template <OptimizerKind kKind, typename Row>
JAXREC_HOST_DEVICE void UpdateRow(Row& row, const RowUpdateArgs& a, float& s1_row, float& s2_row) {
  const Hyperparams& h = a.h;
  const int n = row.Size();

  if constexpr (kKind == OptimizerKind::kSgd) {
    for (int i = 0; i < n; ++i) row.w[i] -= h.learning_rate * row.g[i];
  } else if constexpr (kKind == OptimizerKind::kAdagrad) {
    for (int i = 0; i < n; ++i) {
      row.s1[i] += row.g[i] * row.g[i];
      row.w[i] -= h.learning_rate * row.g[i] / (sqrtf(row.s1[i]) + h.eps);
    }
  } else if constexpr (kKind == OptimizerKind::kRowWiseAdagrad) {
    const bool l2 = a.weight_decay_mode == WeightDecayMode::kL2;
    float sum = 0.f;
    for (int i = 0; i < n; ++i) {
      const float gw = l2 ? row.g[i] + h.weight_decay * row.w[i] : row.g[i];
      sum += gw * gw;
    }
    s1_row += row.Reduce(sum) / a.dim;
    const float mult = h.learning_rate / (sqrtf(s1_row) + h.eps);
    const float corr = l2 ? 1.f - mult * h.weight_decay
                       : a.weight_decay_mode == WeightDecayMode::kDecoupled
                           ? 1.f - h.learning_rate * h.weight_decay
                           : 1.f;
    for (int i = 0; i < n; ++i) row.w[i] = corr * row.w[i] - mult * row.g[i];
  } else if constexpr (kKind == OptimizerKind::kLarsSgd) {
    float ww = 0.f, gg = 0.f;
    for (int i = 0; i < n; ++i) {
      ww += row.w[i] * row.w[i];
      gg += row.g[i] * row.g[i];
    }
    const float w_norm = sqrtf(row.Reduce(ww)), g_norm = sqrtf(row.Reduce(gg));
    const float lr_local = SafeDiv(h.learning_rate * h.eta * w_norm, g_norm + h.weight_decay * w_norm);
    for (int i = 0; i < n; ++i) {
      row.s1[i] = h.momentum * row.s1[i] + lr_local * (row.g[i] + h.weight_decay * row.w[i]);
      row.w[i] -= row.s1[i];
    }
  } else {  // the Adam family: moments, then Adam's step or LAMB's trust-ratio step
    constexpr bool kRowV = State2PerRow(kKind);
    constexpr bool kLamb = kKind == OptimizerKind::kLamb || kKind == OptimizerKind::kPartialRowWiseLamb;
    const float c1 = 1.f - powf(h.beta1, a.step), c2 = 1.f - powf(h.beta2, a.step);
    float v_row = 0.f;
    if constexpr (kRowV) {
      float gg = 0.f;
      for (int i = 0; i < n; ++i) gg += row.g[i] * row.g[i];
      s2_row = h.beta2 * s2_row + (1.f - h.beta2) * (row.Reduce(gg) / a.dim);
      v_row = s2_row;
    }
    float ww = 0.f, rr = 0.f;
    for (int i = 0; i < n; ++i) {
      row.s1[i] = h.beta1 * row.s1[i] + (1.f - h.beta1) * row.g[i];
      float v = v_row;
      if constexpr (!kRowV) {
        row.s2[i] = h.beta2 * row.s2[i] + (1.f - h.beta2) * row.g[i] * row.g[i];
        v = row.s2[i];
      }
      const float direction = (row.s1[i] / c1) / (sqrtf(v / c2) + h.eps);
      // Adam: w -= lr * r; LAMB keeps r in g to scale it by the trust ratio below.
      const float r = row.valid(i) ? direction + h.weight_decay * row.w[i] : 0.f;
      if constexpr (kLamb) {
        ww += row.w[i] * row.w[i];
        rr += r * r;
        row.g[i] = r;
      } else {
        row.w[i] -= h.learning_rate * r;
      }
    }
    if constexpr (kLamb) {
      const float w_norm = sqrtf(row.Reduce(ww)), r_norm = sqrtf(row.Reduce(rr));
      const float ratio = w_norm > 0.f && r_norm > 0.f ? w_norm / r_norm : 1.f;
      for (int i = 0; i < n; ++i) row.w[i] -= h.learning_rate * ratio * row.g[i];
    }
  }

  if (h.max_norm > 0.f) {
    float ww = 0.f;
    for (int i = 0; i < n; ++i) ww += row.valid(i) ? row.w[i] * row.w[i] : 0.f;
    const float norm = sqrtf(row.Reduce(ww));
    if (norm > h.max_norm) {
      const float scale = h.max_norm / norm;
      for (int i = 0; i < n; ++i) row.w[i] *= scale;
    }
  }
}

// UpdateRow of optimizer `kind` in kernel kKernel (KernelOf(kind) == kKernel).
template <OptimizerKind kKernel, typename Row>
JAXREC_HOST_DEVICE void UpdateRowIn(OptimizerKind kind, Row& row, const RowUpdateArgs& a, float& s1_row,
                                    float& s2_row) {
  if constexpr (constexpr OptimizerKind kPartner = KernelPartner(kKernel); kPartner != kKernel) {
    if (kind == kPartner) {  // on a GPU uniform: the whole grid runs one optimizer
      UpdateRow<kPartner>(row, a, s1_row, s2_row);
    } else {
      UpdateRow<kKernel>(row, a, s1_row, s2_row);
    }
  } else {
    UpdateRow<kKernel>(row, a, s1_row, s2_row);
  }
}

// --- rows that would not stay finite ----------------------------------------------------
// A row whose new weights or state are not all finite, as they would be stored, is not
// written: it keeps its old values, and the handler counts it (the `nonfinite_rows`
// result; a train step's guard then reports the step as non-finite: jaxrec/_step_guard.py).
// A NaN or Inf gradient and an overflowing update (lr x a finite gradient, or a value past
// float16's range) are caught alike.

// Below this magnitude a float32 rounds (to nearest even) to a finite value of `dtype`:
// float16's max 65504 plus half a unit, bfloat16's likewise (0x7f7f8000), float32's inf.
// NaN compares false. One compare per value, instead of rounding each value to check it.
inline float FiniteLimit(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F16:
      return 65520.f;
    case ffi::DataType::BF16:
      return 3.3961775e38f;
    default:
      return HUGE_VALF;
  }
}

struct FiniteLimits {
  float w, s1, s2;  // FiniteLimit of the weights' and the two states' dtypes
};

// Whether every value of `row` (and the per-row states) that UpdateRow set stays finite
// as stored; for a CUDA group of lanes, across all of them (row.All).
template <OptimizerKind kKind, typename Row>
JAXREC_HOST_DEVICE bool RowStaysFinite(const Row& row, float s1_row, float s2_row,
                                       const FiniteLimits& limit) {
  constexpr int kStates = NumStates(kKind);
  bool ok = fabsf(s1_row) < limit.s1 && fabsf(s2_row) < limit.s2;  // 0 unless a per-row state
  for (int i = 0; i < row.Size(); ++i) {
    if (!row.valid(i)) continue;
    ok &= fabsf(row.w[i]) < limit.w;
    if constexpr (kStates >= 1 && !State1PerRow(kKind)) ok &= fabsf(row.s1[i]) < limit.s1;
    if constexpr (kStates >= 2 && !State2PerRow(kKind)) ok &= fabsf(row.s2[i]) < limit.s2;
  }
  return row.All(ok);
}

// --- stochastic rounding -------------------------------------------------------------
// Deterministic given (seed, step, row key, column); jaxrec/optim/_rounding.py is the
// jnp twin (the same hash in uint32 arithmetic).

JAXREC_HOST_DEVICE uint32_t MixBits(uint32_t x) {  // "lowbias32" integer hash
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

JAXREC_HOST_DEVICE uint32_t RoundingBits(uint32_t seed, uint32_t step, int64_t key, int64_t column) {
  uint32_t x = MixBits(seed ^ MixBits(step));
  x = MixBits(x ^ static_cast<uint32_t>(static_cast<uint64_t>(key)));
  x = MixBits(x ^ static_cast<uint32_t>(static_cast<uint64_t>(key) >> 32));
  return MixBits(x ^ static_cast<uint32_t>(column));
}

// x with its low `drop` mantissa bits rounded stochastically: add random bits below the
// kept ones, truncate. The result is exact in the narrower type (bf16 drops 16 bits,
// f16 13 in its normal range), so a round-to-nearest conversion then keeps it.
JAXREC_HOST_DEVICE float StochasticRound(float x, uint32_t random, int drop) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u) return x;  // inf and NaN stay as they are
  const uint32_t mask = (1u << drop) - 1u;
  bits = (bits + (random & mask)) & ~mask;
  float y;
  memcpy(&y, &bits, sizeof(y));
  return y;
}

}  // namespace jaxrec
