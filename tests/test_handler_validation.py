"""The CPU and CUDA handlers of the TBE ops accept and reject the same operands.

Every handler of jaxrec_tbe_forward, jaxrec_tbe_backward (on CUDA jaxrec_tbe_backward_sorted,
which also takes the sorted positions) and jaxrec_tbe_fused_update (which sorts them itself)
first runs the validation
shared by both libraries (csrc/common/tbe_validate.h). These tests call the FFI targets
directly, past the Python wrappers' own checks, with one operand, result or attribute made
bad, and read the handler's message; on a GPU the CUDA handler must give the CPU's message
word for word (after the target's name). A valid call passes on each platform: the control.

The batch: T = 2 features on two tables (4 rows of dim 4, 5 rows of dim 3), B = 2.

    #               0        1     <-- batch
    # "f0" (t0)    [1, 0]   [2]
    # "f1" (t1)    [3]      [4]
    # indices = [1, 0, 2, 3, 4]; offsets = [0, 2, 3, 4, 5]
"""

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrec import _ffi

ROWS, DIMS = (4, 5), (4, 3)
TABLE_OFFSETS = (0, 16)
OUTPUT_OFFSETS = (0, 4, 7)
FIRST_ROWS = (0, 4)  # each table's row 0 among both tables' rows
NUM_WEIGHTS, TOTAL_DIM, B, N = 31, 7, 2, 5
INDICES = np.array([1, 0, 2, 3, 4], np.int32)
OFFSETS = np.array([0, 2, 3, 4, 5], np.int32)
BAGS = np.array([0, 0, 1, 2, 3], np.int32)  # the bag of each position
SUM, NONE = 0, 2
ADAGRAD, ROWWISE_ADAGRAD, ADAM = 1, 2, 3

rng = np.random.default_rng(0)
WEIGHTS = rng.uniform(-1, 1, NUM_WEIGHTS).astype(np.float32)
PSW = rng.uniform(0.5, 1.5, N).astype(np.float32)
GRAD_OUTPUT = rng.standard_normal((B, TOTAL_DIM)).astype(np.float32)
# lr, eps, beta1, beta2, weight_decay, momentum, eta, max_gradient, max_norm
HPARAMS = np.array([0.1, 1e-8, 0.9, 0.999, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)


def packed_layout() -> np.ndarray:
    """int32 view of [table_offset[T], dim[T], rows[T], first_row[T], output_offset[T+1]]
    (csrc/common/tbe.h)."""
    return np.array([*TABLE_OFFSETS, *DIMS, *ROWS, *FIRST_ROWS, *OUTPUT_OFFSETS], np.int64).view(np.int32)


def sorted_positions() -> dict[str, np.ndarray]:
    """The positions sorted by row key (the table's first row among all tables' rows + id)."""
    first_row = np.array([0, ROWS[0]], np.int32)[BAGS // B]
    keys = first_row + INDICES
    order = np.argsort(keys, kind="stable").astype(np.int32)
    return dict(sorted_keys=keys[order], sorted_positions=order, sorted_bags=BAGS[order])


def warp_schedule() -> np.ndarray:
    """The CUDA forward's int32[2T+1] warp schedule (jaxrec.ops.tbe._warp_schedule)."""
    shifts = np.array([min(5, int(np.ceil(np.log2(max(1, -(-d // 4)))))) for d in DIMS])
    warps = -(-B // (32 >> shifts))
    return np.concatenate([[0], np.cumsum(warps), shifts]).astype(np.int32)


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, np.float32)


@dataclasses.dataclass
class Call:
    """One direct call of an FFI target: operands and results in the handler's order."""

    target: str
    operands: dict[str, np.ndarray]
    results: dict[str, jax.ShapeDtypeStruct]
    attrs: dict[str, np.generic]

    def run(self):
        call = jax.ffi.ffi_call(self.target, tuple(self.results.values()))
        return jax.block_until_ready(jax.jit(lambda *a: call(*a, **self.attrs))(*self.operands.values()))


def forward(platform: str) -> Call:
    operands = dict(weights=WEIGHTS, indices=INDICES, offsets=OFFSETS, per_sample_weights=PSW,
                    layout=packed_layout())
    attrs = dict(pooling=np.int32(SUM))
    results = dict(output=f32(B, TOTAL_DIM))
    if platform == "cuda":  # the CUDA forward also checks bounds as it reads (ops/tbe.py)
        schedule = warp_schedule()
        operands["schedule"] = schedule
        results["report"] = jax.ShapeDtypeStruct((4,), np.int32)
        attrs.update(num_warps=np.int64(schedule[len(DIMS)]), bounds_check_mode=np.int32(3), labels="")
    return Call("jaxrec_tbe_forward", operands, results, attrs)


def backward(platform: str) -> Call:
    operands = dict(grad_output=GRAD_OUTPUT, weights=WEIGHTS, indices=INDICES, offsets=OFFSETS,
                    per_sample_weights=PSW, layout=packed_layout())
    target = "jaxrec_tbe_backward"
    if platform == "cuda":
        target = "jaxrec_tbe_backward_sorted"
        operands.update(sorted_positions())
    results = dict(grad_weights=f32(NUM_WEIGHTS), grad_per_sample_weights=f32(N))
    return Call(target, operands, results, dict(pooling=np.int32(SUM)))


def fused_update(platform: str) -> Call:
    del platform  # the same operands on both (each handler sorts the positions itself)
    operands = dict(grad_output=GRAD_OUTPUT, weights=WEIGHTS, indices=INDICES, offsets=OFFSETS,
                    per_sample_weights=PSW, layout=packed_layout(),
                    state1=np.zeros(NUM_WEIGHTS, np.float32), state2=np.zeros(NUM_WEIGHTS, np.float32),
                    hparams=HPARAMS, step=np.int32(0))
    results = dict(weights=f32(NUM_WEIGHTS), state1=f32(NUM_WEIGHTS), state2=f32(NUM_WEIGHTS),
                   grad_per_sample_weights=f32(N), nonfinite_rows=jax.ShapeDtypeStruct((), np.int32))
    attrs = dict(optimizer=np.int32(ADAM), pooling=np.int32(SUM), weight_decay_mode=np.int32(0),
                 stochastic_rounding=np.int32(0), seed=np.int32(0), max_dim=np.int32(max(DIMS)),
                 total_rows=np.int64(sum(ROWS)))
    return Call("jaxrec_tbe_fused_update", operands, results, attrs)


BUILD = {"forward": forward, "backward": backward, "fused_update": fused_update}


# --- one bad thing per case --------------------------------------------------------------


def operand(name: str, value: Callable[[np.ndarray], np.ndarray]) -> Callable[[Call], None]:
    return lambda c: c.operands.__setitem__(name, value(c.operands[name]))


def result(name: str, shape: tuple[int, ...], dtype=np.float32) -> Callable[[Call], None]:
    return lambda c: c.results.__setitem__(name, jax.ShapeDtypeStruct(shape, dtype))


def attr(name: str, value: int) -> Callable[[Call], None]:
    """Attribute `name` set to `value`, in the attribute's own integer type."""
    return lambda c: c.attrs.__setitem__(name, type(c.attrs[name])(value))


def state(which: int, array: np.ndarray) -> Callable[[Call], None]:
    """State operand `which` and its result both `array`'s shape and dtype."""
    name = f"state{which}"

    def mutate(c: Call):
        c.operands[name] = array
        c.results[name] = jax.ShapeDtypeStruct(array.shape, array.dtype)

    return mutate


def both(*mutations: Callable[[Call], None]) -> Callable[[Call], None]:
    def mutate(c: Call):
        for m in mutations:
            m(c)

    return mutate


ALL = ("forward", "backward", "fused_update")
GRADS = ("backward", "fused_update")
CASES = [  # (ops, id, mutation, the shared validation's message)
    (ALL, "pooling", attr("pooling", 3), "pooling must be 0 (SUM), 1 (MEAN) or 2 (NONE), got 3"),
    (ALL, "weights-dtype", operand("weights", lambda w: w.view(np.int32)),
     "weights must be float32, float16 or bfloat16, got int32"),
    (ALL, "weights-rank", operand("weights", lambda w: w.reshape(-1, 1)),
     "weights must be 1-D (the flat buffer of all tables), got shape [31, 1]"),
    (ALL, "indices-dtype", operand("indices", lambda i: i.astype(np.float32)),
     "indices must be int32 or int64, got float32"),
    (ALL, "offsets-dtype", operand("offsets", lambda o: o.astype(np.int16)),
     "offsets must have the dtype of indices (int32), got int16"),
    (ALL, "indices-rank", operand("indices", lambda i: i.reshape(-1, 1)),
     "indices and offsets must be 1-D, got shapes [5, 1] and [5]"),
    (ALL, "layout-dtype", operand("layout", lambda l: l.view(np.float32)),
     "layout must be int32 (packed int64), got float32"),
    (ALL, "layout-size", operand("layout", lambda l: l[:-2]),
     "layout has 20 int32 entries; expected 2 * (5 * T + 1) for T >= 1 features"),
    (ALL, "offsets-size", operand("offsets", lambda o: o[:-1]),
     "offsets has 4 entries; expected T * B + 1 with T = 2 features"),
    (ALL, "psw-dtype", operand("per_sample_weights", lambda p: p.astype(np.float16)),
     "per_sample_weights must be float32, got float16"),
    (ALL, "psw-size", operand("per_sample_weights", lambda p: p[:3]),
     "per_sample_weights has 3 elements; expected N = 5 (weighted) or 0"),
    (ALL, "psw-none-pooling", attr("pooling", NONE), "per_sample_weights must be empty for pooling NONE"),
    (("forward",), "output-rows", result("output", (B + 1, TOTAL_DIM)),
     "output has shape [3, 7]; expected [B = 2, total_dim]"),
    (("forward",), "output-dtype", result("output", (B, TOTAL_DIM), np.int32),
     "output must be float32, float16 or bfloat16, got int32"),
    (GRADS, "grad-output-rows", operand("grad_output", lambda g: g[:1]),
     "grad_output has shape [1, 7]; expected [B = 2, total_dim]"),
    (("backward",), "grad-output-dtype", operand("grad_output", lambda g: g.view(np.int32)),
     "grad_output must be float32, float16 or bfloat16, got int32"),
    (("fused_update",), "grad-output-f16", operand("grad_output", lambda g: g.astype(np.float16)),
     "grad_output must be float32, got float16"),
    (("backward",), "grad-weights", result("grad_weights", (NUM_WEIGHTS,), np.float16),
     "grad_weights must be float32 with one element per weight (31)"),
    (GRADS, "grad-psw", result("grad_per_sample_weights", (N - 1,)),
     "grad_per_sample_weights must be float32 like per_sample_weights (5 elements)"),
    (("fused_update",), "total-rows-negative", attr("total_rows", -1),
     "total_rows must be the tables' row count in [0, 2147483647] (int32 row keys), got -1"),
    (("fused_update",), "total-rows-past-int32", attr("total_rows", 2**31),
     "total_rows must be the tables' row count in [0, 2147483647] (int32 row keys), got 2147483648"),
    (("fused_update",), "hparams", operand("hparams", lambda h: h[:8]),
     "hparams must be float32[9] (OptimizerHyperparams' fields in order)"),
    (("fused_update",), "step", operand("step", lambda s: np.zeros(2, np.int32)), "step must be an int32 scalar"),
    (("fused_update",), "optimizer-high", attr("optimizer", 8),
     "optimizer must be in [0, 7] (jaxrec.optim's configs in FBGEMM's order), got 8"),
    (("fused_update",), "optimizer-negative", attr("optimizer", -1),
     "optimizer must be in [0, 7] (jaxrec.optim's configs in FBGEMM's order), got -1"),
    (("fused_update",), "weight-decay-mode", attr("weight_decay_mode", 3),
     "weight_decay_mode must be 0 (none), 1 (l2) or 2 (decoupled), got 3"),
    (("fused_update",), "max-dim", attr("max_dim", 0), "max_dim must be the layout's largest dim, got 0"),
    (("fused_update",), "weights-result", result("weights", (NUM_WEIGHTS,), jnp.bfloat16),
     "the weights result must have the dtype and size of weights"),
    (("fused_update",), "nonfinite-rows-result", result("nonfinite_rows", (2,), np.int32),
     "the nonfinite_rows result must be an int32 scalar"),
    (("fused_update",), "state-result", result("state1", (NUM_WEIGHTS - 1,)),
     "state1 result must have the dtype and size of the state1 operand"),
    (("fused_update",), "state-dtype", both(attr("optimizer", ADAGRAD), state(1, np.zeros(NUM_WEIGHTS, np.int32))),
     "state1 must be float32, float16 or bfloat16, got int32"),
    (("fused_update",), "state-too-small", state(1, np.zeros(NUM_WEIGHTS - 1, np.float32)),
     "state1 has 30 elements; this optimizer needs one per weight (31); build it with jaxrec.optim.init_state"),
    (("fused_update",), "state-missing", state(2, np.zeros(0, np.float32)),
     "state2 has 0 elements; this optimizer needs one per weight (31); build it with jaxrec.optim.init_state"),
    (("fused_update",), "row-state-missing",
     both(attr("optimizer", ROWWISE_ADAGRAD), state(1, np.zeros(0, np.float32)), state(2, np.zeros(0, np.float32))),
     "state1 has 0 elements; this optimizer needs one per table row (9, the sum of the tables' rows); build it "
     "with jaxrec.optim.init_state"),
    (("fused_update",), "row-state-short",
     both(attr("optimizer", ROWWISE_ADAGRAD), state(1, np.zeros(sum(ROWS) - 1, np.float32)),
          state(2, np.zeros(0, np.float32))),
     "state1 has 8 elements; this optimizer needs one per table row (9, the sum of the tables' rows); build it "
     "with jaxrec.optim.init_state"),
]


def rejection(platform: str, op: str, mutate: Callable[[Call], None]) -> str:
    """The message (after "<target>: ") with which `op`'s handler on `platform` rejects the call."""
    assert _ffi.has_kernel(platform), f"jaxrec has no {platform} handlers (jaxrec.build_info())"
    call = BUILD[op](platform)
    mutate(call)
    prefix = re.escape(call.target) + ": "
    with jax.default_device(jax.devices(platform)[0]), pytest.raises(Exception, match=prefix) as error:
        call.run()
    message = re.search(prefix + "([^\n]*)", str(error.value)).group(1)
    # The GPU runtime appends the executable's name to a handler's error; it is not the handler's.
    return re.sub(r" \[executable_name='[^']*'\]$", "", message)


@pytest.mark.parametrize("op, mutate, expected", [
    pytest.param(op, mutate, expected, id=f"{op}-{name}") for ops, name, mutate, expected in CASES for op in ops])
def test_handlers_reject_bad_descriptors_alike(platform, op, mutate, expected):
    message = rejection(platform, op, mutate)
    assert expected in message
    if platform != "cpu":  # the same words as the CPU handler's
        assert message == rejection("cpu", op, mutate)


def test_every_op_has_cases():
    assert {op for ops, *_ in CASES for op in ops} == set(BUILD)


# --- the control: the unchanged calls pass ------------------------------------------------


def _table_row(array, table: int, row: int):
    start = TABLE_OFFSETS[table] + row * DIMS[table]
    return array[start:start + DIMS[table]]


def _pooled_forward() -> np.ndarray:
    """float64 reference of the weighted SUM forward of the batch."""
    out = np.zeros((B, TOTAL_DIM))
    for bag in range(len(OFFSETS) - 1):
        f, b = divmod(bag, B)
        for p in range(OFFSETS[bag], OFFSETS[bag + 1]):
            cols = slice(OUTPUT_OFFSETS[f], OUTPUT_OFFSETS[f + 1])
            out[b, cols] += PSW[p] * _table_row(WEIGHTS.astype(np.float64), f, INDICES[p])
    return out


@pytest.mark.parametrize("op", list(BUILD))
def test_valid_call_passes(platform, op):
    assert _ffi.has_kernel(platform), f"jaxrec has no {platform} handlers (jaxrec.build_info())"
    with jax.default_device(jax.devices(platform)[0]):
        results = [np.asarray(r) for r in BUILD[op](platform).run()]
    if op == "forward":
        np.testing.assert_allclose(results[0], _pooled_forward(), rtol=1e-5, atol=1e-6)
    elif op == "backward":
        touched = np.zeros(NUM_WEIGHTS, bool)
        for p, bag in enumerate(BAGS):
            _table_row(touched, bag // B, INDICES[p])[:] = True
        assert np.all(results[0][~touched] == 0) and np.all(results[0][touched] != 0)
    else:  # Adam moved the rows the batch touched, and only those
        new_weights = results[0]
        for table, row in [(0, 3), (1, 0), (1, 1), (1, 2)]:
            assert np.array_equal(_table_row(new_weights, table, row), _table_row(WEIGHTS, table, row))
        for table, row in [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4)]:
            assert not np.array_equal(_table_row(new_weights, table, row), _table_row(WEIGHTS, table, row))


def test_cpu_checks_total_rows_against_the_layout():
    """The layout's rows lie in host memory only on the CPU; the CUDA handler sorts keys
    below total_rows and drops the rest, never indexing a per-row state past it."""
    assert _ffi.has_kernel("cpu"), "jaxrec has no cpu handlers (jaxrec.build_info())"
    message = rejection("cpu", "fused_update", attr("total_rows", sum(ROWS) - 1))
    assert message == "total_rows is 8 but the layout's features read rows up to 9"
