// The last-line validation of the TBE handlers, shared by the CPU and the CUDA ones:
// every handler of jaxrec_tbe_forward, jaxrec_tbe_backward (CUDA:
// jaxrec_tbe_backward_sorted) and jaxrec_tbe_fused_update calls its Validate* first,
// so both platforms accept and reject the same operands and attributes with the same
// message, "<target>: <what is wrong>". The Python wrappers validate first; these
// checks stop a direct call.
//
// Checked here is everything a handler knows without reading an operand's memory: the
// attributes, and the dtypes, ranks and sizes of the operands and results (the layout's
// T comes from its size). The values of the layout (each table inside the weights,
// output columns, no overlap, its rows below total_rows) and of the offsets
// (non-decreasing, inside [0, N]) lie in device memory on the GPU, where
// reading them would stall the stream: only the CPU handlers check them, after this
// (cpu/tbe_cpu_util.h). On the GPU the wrappers build those operands, and the kernels
// never read or write outside a feature's table whatever they hold (common/tbe.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "common/tbe.h"

namespace jaxrec {

// What the validation learns about the batch.
struct TbeBatch {
  TbeLayout layout;  // points into the layout operand (host memory on the CPU, device memory on the GPU)
  PoolingMode pooling;
  int64_t batch_size;   // B
  int64_t num_indices;  // N
  bool weighted;        // per_sample_weights has N > 0 elements (else 0)
};

// InvalidArgument("<op>: <message>").
ffi::Error Invalid(std::string_view op, const std::string& message);

// "[2, 3]".
std::string ShapeString(ffi::AnyBuffer::Dimensions dims);

ffi::Error ValidateForward(std::string_view op, ffi::AnyBuffer weights, ffi::AnyBuffer indices,
                           ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                           ffi::AnyBuffer output, int32_t pooling, TbeBatch* batch);

ffi::Error ValidateBackward(std::string_view op, ffi::AnyBuffer grad_output, ffi::AnyBuffer weights,
                            ffi::AnyBuffer indices, ffi::AnyBuffer offsets, ffi::AnyBuffer per_sample_weights,
                            ffi::AnyBuffer layout, ffi::AnyBuffer grad_weights,
                            ffi::AnyBuffer grad_per_sample_weights, int32_t pooling, TbeBatch* batch);

// The positions sorted by row key (the CUDA backward takes them).
ffi::Error ValidateSorted(std::string_view op, ffi::AnyBuffer indices, ffi::AnyBuffer sorted_keys,
                          ffi::AnyBuffer sorted_positions, ffi::AnyBuffer sorted_bags);

// Also the optimizer's kind, weight-decay mode and state buffers, and total_rows (the
// tables' row count, which the handlers sort the row keys below; the CPU handler checks
// it against the layout): per-element state has one element per weight, per-row state at
// least total_rows.
ffi::Error ValidateFusedUpdate(std::string_view op, ffi::AnyBuffer grad_output, ffi::AnyBuffer weights,
                               ffi::AnyBuffer indices, ffi::AnyBuffer offsets,
                               ffi::AnyBuffer per_sample_weights, ffi::AnyBuffer layout,
                               ffi::AnyBuffer state1, ffi::AnyBuffer state2, ffi::AnyBuffer hparams,
                               ffi::AnyBuffer step, ffi::AnyBuffer weights_out, ffi::AnyBuffer state1_out,
                               ffi::AnyBuffer state2_out, ffi::AnyBuffer grad_per_sample_weights,
                               ffi::AnyBuffer nonfinite_rows, int32_t optimizer, int32_t pooling,
                               int32_t weight_decay_mode, int32_t max_dim, int64_t total_rows,
                               TbeBatch* batch);

// The per-row state message.
std::string PerRowStateMessage(int which, int64_t count, int64_t total_rows);

}  // namespace jaxrec
