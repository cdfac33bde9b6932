// Helpers of the CPU TBE handlers (tbe_forward.cc, tbe_backward.cc, tbe_fused_update.cc):
// 16-bit float types and conversions, a deterministic parallel-for over XLA's intra-op
// thread pool, runtime ISA dispatch, and the checks of the operands' values that only
// the CPU makes (the shared ones are common/tbe_validate.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/ffi_util.h"
#include "common/tbe.h"
#include "common/tbe_validate.h"

#define JAXREC_ALWAYS_INLINE inline __attribute__((always_inline))

namespace jaxrec {
namespace cpu {

// --- 16-bit floats ----------------------------------------------------------------
// Storage types with the bits of an IEEE half / a bfloat16; arithmetic is float32.
// The dtype dispatch is DispatchFloatType<Half, BFloat16> (common/ffi_util.h).
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

template <typename To, typename From>
JAXREC_ALWAYS_INLINE To BitCast(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// Branch-light conversions (F. Giesen's half<->float); no float denormal is an
// operand, so they are exact whatever the FTZ/DAZ flags of the calling thread.
JAXREC_ALWAYS_INLINE float ToFloat(float x) { return x; }
JAXREC_ALWAYS_INLINE float ToFloat(BFloat16 x) { return BitCast<float>(uint32_t{x.bits} << 16); }
JAXREC_ALWAYS_INLINE float ToFloat(Half x) {
  const uint32_t shifted = (uint32_t{x.bits} & 0x7fffu) << 13;
  const uint32_t exponent = shifted & 0x0f800000u;
  uint32_t bits = shifted + ((127u - 15u) << 23);
  if (exponent == 0x0f800000u) {  // inf, nan
    bits += (128u - 16u) << 23;
  } else if (exponent == 0) {  // zero, subnormal: renormalise with one float subtraction
    bits = BitCast<uint32_t>(BitCast<float>(bits + (1u << 23)) - BitCast<float>(113u << 23));
  }
  return BitCast<float>(bits | ((uint32_t{x.bits} & 0x8000u) << 16));
}

// float -> T with round-to-nearest-even.
template <typename T>
T FromFloat(float x);
template <>
JAXREC_ALWAYS_INLINE float FromFloat<float>(float x) {
  return x;
}
template <>
JAXREC_ALWAYS_INLINE BFloat16 FromFloat<BFloat16>(float x) {
  uint32_t bits = BitCast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((bits >> 16) | 0x40u)};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return {static_cast<uint16_t>(bits >> 16)};
}
template <>
JAXREC_ALWAYS_INLINE Half FromFloat<Half>(float x) {
  uint32_t bits = BitCast<uint32_t>(x);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint32_t out;
  if (bits >= ((127u + 16u) << 23)) {  // overflow -> inf; nan stays nan
    out = bits > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (bits < (113u << 23)) {  // half subnormal or zero: let the FPU round
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    out = BitCast<uint32_t>(BitCast<float>(bits) + BitCast<float>(magic)) - magic;
  } else {
    const uint32_t odd = (bits >> 13) & 1u;
    bits += ((15u - 127u) << 23) + 0xfffu + odd;
    out = bits >> 13;
  }
  return {static_cast<uint16_t>(out | (sign >> 16))};
}

// --- ISA dispatch -------------------------------------------------------------------
// The library is built for baseline x86-64; the hot loops are compiled three times
// (baseline, AVX2+FMA, AVX-512) and the best one the CPU supports is picked at run time.
enum class Isa { kBaseline, kAvx2, kAvx512 };

#if defined(__x86_64__) && defined(__GNUC__)
#define JAXREC_HAS_ISA_CLONES 1
#define JAXREC_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define JAXREC_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi2")))
inline Isa DetectIsa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
  return Isa::kBaseline;
}
#else
#define JAXREC_HAS_ISA_CLONES 0
inline Isa DetectIsa() { return Isa::kBaseline; }
#endif

inline Isa CpuIsa() {
  static const Isa isa = DetectIsa();
  return isa;
}

// Prefetches the `bytes` bytes at `p` (one embedding row) into the cache.
JAXREC_ALWAYS_INLINE void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// --- parallel for -------------------------------------------------------------------
// Runs fn(item) for item in [0, num_items) on the calling thread and up to
// num_threads - 1 tasks of XLA's intra-op pool; items are claimed through an atomic
// counter. The caller runs every item nobody else claimed and waits only for items
// that a running task holds, so it never waits on a task that has not started (no
// deadlock if the pool is busy or the caller is a pool thread). Tasks that start late
// find no items left and touch only the shared counters, which they keep alive.
// Each item must write its own outputs, so the result never depends on the schedule.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t num_items, const Fn& fn) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, num_items - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < num_items; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t count = 0;
    const Fn* fn = nullptr;
    std::mutex mutex;
    std::condition_variable all_done;
  };
  auto state = std::make_shared<State>();
  state->count = num_items;
  state->fn = &fn;
  auto work = [](State& s) {
    int64_t finished = 0;
    for (int64_t i; (i = s.next.fetch_add(1, std::memory_order_relaxed)) < s.count; ++finished) {
      (*s.fn)(i);
    }
    if (finished > 0 && s.done.fetch_add(finished, std::memory_order_acq_rel) + finished == s.count) {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.all_done.notify_all();
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state, work] { work(*state); });
  work(*state);
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_done.wait(lock, [&] { return state->done.load(std::memory_order_acquire) == num_items; });
}

// --- what only the CPU validates -------------------------------------------------------
// The shared validation (common/tbe_validate.h) checked the operands' dtypes and sizes;
// on the CPU the layout and the offsets are in host memory, so their values are checked too.
struct TbeProblem : TbeBatch {
  int64_t total_dim;  // output_offsets[T]
  int64_t max_dim;
  std::vector<int64_t> out_dims;  // shape of the forward output
};

// Offsets: every bag inside [0, N] and non-decreasing (a bad offset would read out of bounds).
template <typename I>
ffi::Error CheckOffsets(std::string_view op, const I* offsets, int64_t num_offsets, int64_t n) {
  if (offsets[0] < 0 || offsets[num_offsets - 1] > n) {
    return Invalid(op,
                   "offsets must lie in [0, N = " + std::to_string(n) + "]; run bounds_check_indices first");
  }
  for (int64_t k = 0; k + 1 < num_offsets; ++k) {
    if (offsets[k + 1] < offsets[k]) {
      return Invalid(op, "offsets must be non-decreasing; offsets[" + std::to_string(k + 1) + "] < offsets[" +
                             std::to_string(k) + "]; run bounds_check_indices first");
    }
  }
  return ffi::Error::Success();
}

// Checks what the kernels must not trust in the values of the layout (each feature's
// table inside `weights`, output columns, distinct tables not overlapping) and of the
// offsets (non-decreasing, inside [0, N]; the wrappers clamp them first, so this only
// stops a direct call). `problem` holds the shared validation's TbeBatch. Ids are not
// checked here: the kernels skip each id outside its feature's table (RowInRange).
template <typename I>
ffi::Error ValidateContents(std::string_view op, ffi::AnyBuffer weights, ffi::AnyBuffer offsets,
                            TbeProblem* problem) {
  const TbeLayout& l = problem->layout;
  const int64_t t = l.num_features;
  const int64_t n = problem->num_indices;

  // Layout: tables inside weights, columns of the pooled output, no overlapping tables.
  const int64_t num_weights = weights.element_count();
  if (l.output_offsets[0] != 0) return Invalid(op, "layout output_offsets[0] must be 0");
  int64_t max_dim = 0;
  for (int64_t f = 0; f < t; ++f) {
    const int64_t off = l.table_offsets[f], dim = l.dims[f], rows = l.rows[f];
    if (dim <= 0 || rows < 0 || off < 0 || (rows > 0 && (num_weights - off) / rows < dim)) {
      return Invalid(op, "layout feature " + std::to_string(f) + ": table at element " + std::to_string(off) +
                             " with " + std::to_string(rows) + " rows of dim " + std::to_string(dim) +
                             " does not fit in weights of " + std::to_string(num_weights) + " elements");
    }
    if (l.output_offsets[f + 1] - l.output_offsets[f] != dim) {
      return Invalid(op, "layout feature " + std::to_string(f) + ": output columns [" +
                             std::to_string(l.output_offsets[f]) + ", " +
                             std::to_string(l.output_offsets[f + 1]) + ") do not match its dim " +
                             std::to_string(dim));
    }
    max_dim = std::max(max_dim, dim);
  }
  std::vector<int64_t> order(t);
  for (int64_t f = 0; f < t; ++f) order[f] = f;
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return l.table_offsets[a] < l.table_offsets[b]; });
  for (int64_t i = 1; i < t; ++i) {
    const int64_t a = order[i - 1], b = order[i];
    if (l.table_offsets[a] == l.table_offsets[b]) {
      if (l.dims[a] != l.dims[b] || l.rows[a] != l.rows[b]) {
        return Invalid(op, "layout features " + std::to_string(a) + " and " + std::to_string(b) +
                               " share a table offset but not its rows and dim");
      }
    } else if (l.table_offsets[a] + l.rows[a] * l.dims[a] > l.table_offsets[b]) {
      return Invalid(op, "layout tables of features " + std::to_string(a) + " and " + std::to_string(b) +
                             " overlap in weights");
    }
  }
  problem->max_dim = max_dim;
  problem->total_dim = l.output_offsets[t];

  if (problem->pooling == PoolingMode::kNone) {
    for (int64_t f = 1; f < t; ++f) {
      if (l.dims[f] != l.dims[0]) return Invalid(op, "pooling NONE needs one dim for all features");
    }
    problem->out_dims = {n, l.dims[0]};
  } else {
    problem->out_dims = {problem->batch_size, problem->total_dim};
  }

  return CheckOffsets(op, offsets.typed_data<I>(), offsets.element_count(), n);
}

// The columns of the output (or its gradient), which the shared validation cannot see.
inline ffi::Error CheckShape(std::string_view op, std::string_view name, ffi::AnyBuffer::Dimensions dims,
                             const std::vector<int64_t>& expected) {
  if (dims.size() == expected.size() && std::equal(expected.begin(), expected.end(), dims.begin())) {
    return ffi::Error::Success();
  }
  std::string want = "[";
  for (size_t i = 0; i < expected.size(); ++i) want += (i ? ", " : "") + std::to_string(expected[i]);
  return Invalid(op, std::string(name) + " has shape " + ShapeString(dims) + "; expected " + want + "]");
}

}  // namespace cpu
}  // namespace jaxrec
