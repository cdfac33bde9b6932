"""jaxrec.checkpoint: save / restore on orbax, bit-exact.

* Round trips of each kind of state (arrays of every dtype, nnx.State with and without
  nnx.Rngs keys, optax states, FusedEmbeddingTables) compare the bits, so a cast, a
  lost NaN payload or a -0.0 would fail. Every value is random and nonzero, so a restore
  that returned the init (zeros) would fail too.
* Metadata, keep=N, steps, every error path, resharding 8 -> 4 devices / replicated, and
  a resumed training run that ends bit-identical to the uninterrupted one.
* Integrity: bytes flipped in the files orbax writes, truncated or deleted files, edited
  JSON are each found and named, and the newest intact checkpoint is restored instead;
  stray folders are ignored; NaN/Inf arrays are refused; the directory lock.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec import checkpoint as ckpt
from jaxrec.fused import FusedEmbeddingTables
from jaxrec.ops import TableLayout
from jaxrec.optim import RowWiseAdagrad


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def randomize(tree, seed=0):
    """The same pytree with random nonzero values in every leaf (keys: random key data)."""
    rng = np.random.default_rng(seed)

    def leaf(x):
        if _is_key(x):
            data = jax.random.key_data(x)
            bits = rng.integers(1, 2**32, data.shape, dtype=np.uint32)
            new = jax.random.wrap_key_data(jnp.asarray(bits), impl=jax.random.key_impl(x))
        elif jnp.issubdtype(x.dtype, jnp.floating):
            new = np.asarray(rng.uniform(0.5, 2.0, x.shape) * rng.choice([-1, 1], x.shape),
                             dtype=x.dtype)
        elif x.dtype == jnp.bool_:
            new = np.ones(x.shape, bool)
        else:
            info = np.iinfo(x.dtype)
            new = rng.integers(1, info.max, x.shape, dtype=x.dtype, endpoint=True)
        return jax.device_put(new, x.sharding)

    return jax.tree.map(leaf, tree)


def assert_bits_equal(actual, expected):
    """Same structure (static fields included), dtypes, shapes and bits."""
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(actual)
    flat_e, tree_e = jax.tree_util.tree_flatten_with_path(expected)
    assert tree_a == tree_e
    for (path, a), (_, e) in zip(flat_a, flat_e):
        where = jax.tree_util.keystr(path)
        assert isinstance(a, jax.Array), where
        assert (a.dtype, a.shape) == (e.dtype, e.shape), where
        if _is_key(e):
            assert jax.random.key_impl(a) == jax.random.key_impl(e), where
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        a, e = np.asarray(a), np.asarray(e)
        bits = np.dtype(f"uint{8 * e.dtype.itemsize}")
        assert np.array_equal(a.view(bits), e.view(bits)), where


def round_trip(tmp_path, state, target=None, **save):
    ckpt.save_checkpoint(tmp_path, 1, state, **save)
    target = jax.eval_shape(lambda: state) if target is None else target
    restored, metadata = ckpt.restore_checkpoint(tmp_path, target)
    assert metadata == {}
    assert_bits_equal(restored, state)
    return restored


# --- round trips of each kind of state -----------------------------------------------

def test_every_dtype_round_trips_bit_exact(tmp_path):
    state = randomize({name: jnp.zeros((3, 5), name) for name in
                       ["float32", "bfloat16", "float16", "int32", "uint32", "int8", "uint8",
                        "int16", "bool"]})
    # Special values whose bits a cast or a float round trip would change.
    specials = {"float32": 0x7FC12345, "bfloat16": 0x7FC5, "float16": 0x7E15}  # NaN payloads
    for name, payload in specials.items():
        bits = np.dtype(f"uint{8 * jnp.dtype(name).itemsize}")
        values = np.asarray(state[name]).copy()
        values.view(bits)[0, :3] = [payload, 0x8000 << (values.itemsize * 8 - 16), 1]  # NaN,-0,tiny
        state[name] = jnp.asarray(values)
    state["scalar"] = jnp.float32(2.5)
    restored = round_trip(tmp_path, state, allow_nonfinite=True)
    assert np.isnan(np.asarray(restored["float32"])[0, 0])


def test_64_bit_types_round_trip_bit_exact(tmp_path, x64):
    state = randomize({"i64": jnp.zeros((4,), jnp.int64), "u64": jnp.zeros((4,), jnp.uint64),
                       "f64": jnp.zeros((2, 2), jnp.float64)})
    state["i64"] = state["i64"].at[0].set(2**62 + 12345)
    round_trip(tmp_path, state)


def test_nnx_state_round_trips(tmp_path):
    state = randomize(nnx.state(nnx.Linear(3, 4, rngs=nnx.Rngs(0))))
    restored = round_trip(tmp_path, state)
    assert isinstance(restored, nnx.State)
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(7))
    nnx.update(model, restored)
    np.testing.assert_array_equal(model.kernel[...], state["kernel"][...])


class _Dropout(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.rngs = nnx.Rngs(1, dropout=2)


def test_nnx_state_with_rngs_keys_round_trips(tmp_path):
    state = randomize(nnx.state(_Dropout()), seed=1)
    keys = [x for x in jax.tree.leaves(state) if _is_key(x)]
    assert len(keys) == 2  # typed key<fry> arrays: saved as key_data, re-wrapped
    restored = round_trip(tmp_path, state, target=jax.eval_shape(lambda: nnx.state(_Dropout())))
    again = [x for x in jax.tree.leaves(restored) if _is_key(x)]
    np.testing.assert_array_equal(jax.random.uniform(again[0], (3,)),
                                  jax.random.uniform(keys[0], (3,)))


def test_optax_state_round_trips(tmp_path):
    params = {"w": jnp.zeros((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = randomize((params, opt.init(params)), seed=2)
    restored = round_trip(tmp_path, state)
    assert isinstance(restored[1][1][0], optax.ScaleByAdamState)
    assert restored[1][1][0].count.dtype == jnp.int32


def test_fused_embedding_tables_round_trip(tmp_path):
    tables = FusedEmbeddingTables.create(TableLayout.from_embedding_specs([(50, 8), (30, 4)]),
                                         RowWiseAdagrad(learning_rate=0.1), key=jax.random.key(0))
    state = randomize(tables, seed=3)
    restored = round_trip(tmp_path, state)
    assert isinstance(restored, FusedEmbeddingTables)
    assert (restored.layout, restored.config) == (tables.layout, tables.config)


# --- metadata, steps, keep -----------------------------------------------------------

def test_metadata_round_trips_and_relative_paths_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metadata = {"step": 1000, "data_position": 128_000, "lr": 0.125, "done": False,
                "config": {"tables": [[50, 8], [30, 4]], "name": "dlrm é", "seed": None}}
    path = ckpt.save_checkpoint("run", 1000, {"x": jnp.ones((2,))}, metadata=metadata)
    assert path == tmp_path / "run" / "1000" and path.is_dir()
    _, restored = ckpt.restore_checkpoint("run", {"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
    assert restored == json.loads(json.dumps(metadata))


def test_steps_latest_and_restore_a_given_step(tmp_path):
    assert ckpt.all_steps(tmp_path / "none") == [] and ckpt.latest_step(tmp_path) is None
    states = {s: randomize({"x": jnp.zeros((3,))}, seed=s) for s in (5, 10, 20)}
    for s, state in states.items():
        ckpt.save_checkpoint(tmp_path, s, state, metadata={"step": s})
    assert ckpt.all_steps(tmp_path) == [5, 10, 20] and ckpt.latest_step(tmp_path) == 20
    target = {"x": jax.ShapeDtypeStruct((3,), jnp.float32)}
    newest, meta = ckpt.restore_checkpoint(tmp_path, target)
    assert meta == {"step": 20}
    assert_bits_equal(newest, states[20])
    older, meta = ckpt.restore_checkpoint(tmp_path, target, step=10)
    assert meta == {"step": 10}
    assert_bits_equal(older, states[10])


def test_keep_deletes_the_oldest(tmp_path):
    for s in range(1, 6):
        ckpt.save_checkpoint(tmp_path, s, {"x": jnp.full((2,), s, jnp.int32)}, keep=2)
    assert ckpt.all_steps(tmp_path) == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["4", "5"]
    state, _ = ckpt.restore_checkpoint(tmp_path, {"x": jnp.zeros((2,), jnp.int32)}, step=4)
    np.testing.assert_array_equal(state["x"], [4, 4])


def test_keep_spares_keep_steps(tmp_path):
    for s in range(1, 6):
        ckpt.save_checkpoint(tmp_path, s, {"x": jnp.full((2,), s, jnp.int32)}, keep=2, keep_steps=(2,))
    assert ckpt.all_steps(tmp_path) == [2, 4, 5]
    state, _ = ckpt.restore_checkpoint(tmp_path, {"x": jnp.zeros((2,), jnp.int32)}, step=2)
    np.testing.assert_array_equal(state["x"], [2, 2])


# --- errors ------------------------------------------------------------------------------

def test_errors_of_the_directory_and_the_step(tmp_path):
    target = {"x": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in directory=.*check the path"):
        ckpt.restore_checkpoint(tmp_path, target)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in directory=.*missing"):
        ckpt.restore_checkpoint(tmp_path / "missing", target)
    ckpt.save_checkpoint(tmp_path, 3, {"x": jnp.ones((2,))})
    ckpt.save_checkpoint(tmp_path, 7, {"x": jnp.ones((2,))})
    with pytest.raises(FileNotFoundError, match=r"no checkpoint step=5 .* are \[3, 7\]"):
        ckpt.restore_checkpoint(tmp_path, target, step=5)
    with pytest.raises(ValueError, match=r"step must be an int >= 0, got step=-1"):
        ckpt.restore_checkpoint(tmp_path, target, step=-1)
    with pytest.raises(ValueError, match=r"step must be an int >= 0, got step=-2"):
        ckpt.save_checkpoint(tmp_path, -2, {"x": jnp.ones((2,))})
    with pytest.raises(ValueError, match=r"step=7 already exists .*larger step"):
        ckpt.save_checkpoint(tmp_path, 7, {"x": jnp.ones((2,))})
    with pytest.raises(ValueError, match=r"step=4 is older than the latest, 7, .*\[3, 7\].*roll"):
        ckpt.save_checkpoint(tmp_path, 4, {"x": jnp.ones((2,))})
    with pytest.raises(ValueError, match=r"keep must be a positive int .* keep=0"):
        ckpt.save_checkpoint(tmp_path, 8, {"x": jnp.ones((2,))}, keep=0)
    with pytest.raises(TypeError, match=r"metadata must be JSON-serialisable"):
        ckpt.save_checkpoint(tmp_path, 8, {"x": jnp.ones((2,))}, metadata={"a": jnp.ones(2)})
    assert ckpt.all_steps(tmp_path) == [3, 7]


def test_non_array_leaves_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"leaf \['lr'\] is a float .*Python ints/floats are not "
                                         r"supported.*jnp.asarray"):
        ckpt.save_checkpoint(tmp_path, 0, {"w": jnp.ones(2), "lr": 0.1})
    with pytest.raises(ValueError, match=r"leaf \[1\] is a int"):
        ckpt.save_checkpoint(tmp_path, 0, (jnp.ones(2), 3))
    assert ckpt.all_steps(tmp_path) == []
    ckpt.save_checkpoint(tmp_path, 0, {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"target leaf \['w'\] is a str.*jax.eval_shape"):
        ckpt.restore_checkpoint(tmp_path, {"w": "x"})


def test_a_target_that_does_not_match_names_each_difference(tmp_path):
    ckpt.save_checkpoint(tmp_path, 0, {"a": jnp.ones((2, 3)), "b": jnp.ones(4, jnp.bfloat16),
                                       "c": jnp.ones(1)})
    target = {"a": jax.ShapeDtypeStruct((3, 2), jnp.float32),
              "b": jax.ShapeDtypeStruct((4,), jnp.float32),
              "d": jax.ShapeDtypeStruct((5,), jnp.int32)}
    with pytest.raises(ValueError) as info:
        ckpt.restore_checkpoint(tmp_path, target)
    message = str(info.value)
    for line in [r"['a']: saved float32[2, 3], target expects float32[3, 2]",
                 r"['b']: saved bfloat16[4], target expects float32[4]",
                 r"['d']: missing in the checkpoint, target expects int32[5]",
                 r"['c']: saved float32[1], not in the target",
                 "Restore into the structure that was saved"]:
        assert line in message


# --- shardings ---------------------------------------------------------------------------

def test_restore_reshards_8_devices_to_4_and_to_replicated(tmp_path):
    cpus = jax.devices("cpu")  # conftest gives 8, also where the default backend is a GPU
    mesh8 = jax.make_mesh((8,), ("x",), devices=cpus[:8])
    mesh4 = jax.make_mesh((4,), ("y",), devices=cpus[4:8])
    shapes = {"rows": ((16, 8), jnp.float32, P("x")), "cols": ((4, 24), jnp.bfloat16, P(None, "x")),
              "ids": ((32,), jnp.uint32, P("x")), "keys": ((8,), jax.random.key(0).dtype, P("x"))}

    def leaf(shape, dtype, spec, mesh):
        spec = P(*["y" if s == "x" else s for s in spec]) if mesh is mesh4 else spec
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    def zeros(s):
        if _is_key(s):
            return jax.device_put(jax.random.split(jax.random.key(0), s.shape), s.sharding)
        return jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding)

    state = randomize({k: zeros(leaf(*v, mesh8)) for k, v in shapes.items()}, seed=4)
    assert len(state["rows"].sharding.device_set) == 8
    ckpt.save_checkpoint(tmp_path, 0, state)
    for target in [{k: leaf(*v, mesh4) for k, v in shapes.items()},
                   {k: jax.ShapeDtypeStruct(v[0], v[1], sharding=NamedSharding(mesh4, P()))
                    for k, v in shapes.items()}]:
        restored, _ = ckpt.restore_checkpoint(tmp_path, target)
        assert_bits_equal(restored, state)
        for k in shapes:
            assert restored[k].sharding.is_equivalent_to(target[k].sharding, len(shapes[k][0])), k
    # A leaf without a sharding goes to the default device.
    abstract = jax.eval_shape(lambda: state)
    plain = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), abstract)
    restored, _ = ckpt.restore_checkpoint(tmp_path, plain)
    assert_bits_equal(restored, state)
    assert restored["keys"].sharding.device_set == {jax.devices()[0]}
    # jax.eval_shape of sharded arrays gives abstract meshes: jax.set_mesh gives the devices.
    with pytest.raises(ValueError, match=r"leaf \['cols'\] has a sharding over an abstract mesh "
                                         r"\({'x': 8}.*with jax.set_mesh\(mesh\)"):
        ckpt.restore_checkpoint(tmp_path, abstract)
    with jax.set_mesh(mesh8):
        restored, _ = ckpt.restore_checkpoint(tmp_path, abstract)
    assert_bits_equal(restored, state)
    for k in shapes:
        assert restored[k].sharding.is_equivalent_to(state[k].sharding, len(shapes[k][0])), k


# --- resuming a training run -----------------------------------------------------------

def test_resumed_training_ends_bit_identical(tmp_path):
    rng = np.random.default_rng(5)
    xs = jnp.asarray(rng.standard_normal((6, 16, 5)), jnp.float32)
    ys = jnp.asarray(rng.standard_normal((6, 16, 3)), jnp.float32)
    opt = optax.adam(optax.exponential_decay(0.05, 1, 0.8))  # the count matters

    def init():
        params = {"w": jax.random.normal(jax.random.key(0), (5, 3)), "b": jnp.full((3,), 0.1)}
        return params, opt.init(params)

    @jax.jit
    def train_step(state, x, y):
        params, opt_state = state
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(params)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int count and floats
            updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def train(state, start, stop):
        for i in range(start, stop):
            state = train_step(state, xs[i], ys[i])
        return state

    uninterrupted = train(init(), 0, 6)
    first = train(init(), 0, 3)
    ckpt.save_checkpoint(tmp_path, 3, first, metadata={"step": 3, "data_position": 3})
    del first
    state, meta = ckpt.restore_checkpoint(tmp_path, jax.eval_shape(init))
    resumed = train(state, meta["data_position"], 6)
    assert meta["step"] == 3
    assert_bits_equal(resumed, uninterrupted)
    assert not np.array_equal(uninterrupted[0]["w"], init()[0]["w"])


# --- integrity: checksums, fallback, stray folders, non-finite arrays, the lock --------------

TARGET = {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32),
          "i": jax.ShapeDtypeStruct((50,), jnp.int32)}


def save_two(tmp_path):
    """Checkpoints 1 and 2 of random states; returns the states."""
    states = {s: randomize(jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), TARGET), seed=s)
              for s in (1, 2)}
    for s, state in states.items():
        ckpt.save_checkpoint(tmp_path, s, state, metadata={"step": s})
    return states


def data_file(tmp_path, step):
    """The largest array data file orbax wrote for ``step`` (the one holding ``w``)."""
    files = (tmp_path / str(step) / "state" / "ocdbt.process_0" / "d").iterdir()
    return max(files, key=lambda p: p.stat().st_size)


def flip(path, count, seed=0):
    data = bytearray(path.read_bytes())
    for k in np.random.default_rng(seed).choice(len(data) // 2, count, replace=False):
        data[len(data) // 4 + k] ^= 0x5A  # inside the payload, clear of the header
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_json(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


DAMAGE = {  # what is done to checkpoint 2, and what the error names
    "one flipped byte": (lambda d: flip(data_file(d, 2), 1), r"leaf \['w'\] .*does not match"),
    # 64 flips may also hit a block header of the compressed data: then TensorStore cannot
    # read it at all (which the file's bytes decide, and they vary from run to run).
    "64 flipped bytes": (lambda d: flip(data_file(d, 2), 64),
                         r"leaf \['w'\] .*does not match|cannot read the arrays in .*2/state"),
    "truncated data file": (lambda d: truncate(data_file(d, 2)), r"arrays in .*2/state"),
    "truncated manifest": (lambda d: truncate(d / "2" / "manifest" / "metadata"),
                           r"cannot read .*2/manifest"),
    "deleted manifest": (lambda d: (d / "2" / "manifest" / "metadata").unlink(),
                         r"2/manifest"),
    "edited manifest shape": (lambda d: edit_json(d / "2" / "manifest" / "metadata", "[64, 16]",
                                                  "[16, 64]"), r"2/manifest does not match"),
    "edited metadata": (lambda d: edit_json(d / "2" / "metadata" / "metadata", "2", "3"),
                        r"2/metadata does not match its checksum"),
    "deleted state": (lambda d: __import__("shutil").rmtree(d / "2" / "state"),
                      r"arrays in .*2/state"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_corrupt_checkpoint_is_named_and_the_newest_intact_one_restored(tmp_path, damage):
    states = save_two(tmp_path)
    harm, names = DAMAGE[damage]
    harm(tmp_path)
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"checkpoint step=2 in .* is corrupt"
                                                          ) as info:
        ckpt.restore_checkpoint(tmp_path, TARGET, step=2)
    assert re.search(names, str(info.value)), str(info.value)
    assert "Traceback" not in str(info.value) and "TensorStore({" not in str(info.value)
    with pytest.warns(UserWarning, match=r"using checkpoint step=1 .*newest intact one; "
                                         r"skipped .*\n  checkpoint step=2 .* is corrupt"):
        state, meta = ckpt.restore_checkpoint(tmp_path, TARGET)
    assert_bits_equal(state, states[1])
    assert meta == {"step": 1} and meta.step == 1 and list(meta.corrupt) == [2]


def test_when_every_checkpoint_is_corrupt_the_error_lists_them(tmp_path):
    save_two(tmp_path)
    for step in (1, 2):
        flip(data_file(tmp_path, step), 1)
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"every checkpoint in .* is corrupt:"
                                                          r"\n  .*step=2.*\n  .*step=1"):
        ckpt.restore_checkpoint(tmp_path, TARGET)


def test_an_intact_restore_says_its_step_and_verify_false_skips_the_checksums(tmp_path):
    states = save_two(tmp_path)
    _, meta = ckpt.restore_checkpoint(tmp_path, TARGET)
    assert meta.step == 2 and meta.corrupt == {}
    _, meta = ckpt.restore_checkpoint(tmp_path, TARGET, step=1)
    assert meta.step == 1
    flip(data_file(tmp_path, 2), 1)
    state, _ = ckpt.restore_checkpoint(tmp_path, TARGET, step=2, verify=False)
    assert not np.array_equal(np.asarray(state["w"]), np.asarray(states[2]["w"]))  # undetected


def test_folders_that_are_not_complete_checkpoints_are_ignored(tmp_path):
    states = save_two(tmp_path)
    (tmp_path / "999").mkdir()  # a stray empty folder
    (tmp_path / "500").mkdir()
    (tmp_path / "500" / "state").mkdir()  # an unfinished copy
    (tmp_path / "notes").mkdir()
    assert ckpt.all_steps(tmp_path) == [1, 2] and ckpt.latest_step(tmp_path) == 2
    state, meta = ckpt.restore_checkpoint(tmp_path, TARGET)
    assert meta.step == 2
    assert_bits_equal(state, states[2])
    ckpt.save_checkpoint(tmp_path, 3, states[1], keep=2)
    assert ckpt.all_steps(tmp_path) == [2, 3] and (tmp_path / "999").is_dir()
    with pytest.raises(ValueError, match=r"999 exists but is not a complete checkpoint.*delete"):
        ckpt.save_checkpoint(tmp_path, 999, states[1])
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in directory"):
        ckpt.restore_checkpoint(tmp_path / "999", TARGET)


def test_non_finite_arrays_are_refused_unless_allowed(tmp_path):
    rng = np.random.default_rng(6)
    state = {"dense": {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)},
             "tables": jnp.asarray(rng.standard_normal((8, 2)), jnp.bfloat16),
             "count": jnp.asarray(rng.integers(1, 9, 3), jnp.int32)}
    bad = {**state, "dense": {"w": state["dense"]["w"].at[1, 2].set(jnp.nan)},
           "tables": state["tables"].at[0, 0].set(jnp.inf)}
    with pytest.raises(ValueError, match=r"NaN or Inf: \['dense'\]\['w'\] \(1 of 12 values "
                                         r"NaN/Inf\), \['tables'\] \(1 of 16.*allow_nonfinite"):
        ckpt.save_checkpoint(tmp_path, 1, bad)
    assert ckpt.all_steps(tmp_path) == []
    ckpt.save_checkpoint(tmp_path, 1, state)
    ckpt.save_checkpoint(tmp_path, 2, bad, allow_nonfinite=True)
    restored, _ = ckpt.restore_checkpoint(tmp_path, jax.eval_shape(lambda: bad))
    assert_bits_equal(restored, bad)


def test_the_lock_refuses_a_second_holder_names_it_and_is_released(tmp_path):
    directory = tmp_path / "run"
    with ckpt.CheckpointLock(directory):
        assert directory.is_dir()
        with pytest.raises(ckpt.CheckpointLockedError, match=rf"{directory} is in use by another "
                                                            rf"run \(holder: pid {os.getpid()} on"):
            ckpt.CheckpointLock(directory).acquire()
        ckpt.save_checkpoint(directory, 1, {"x": jnp.ones(2)})  # the lock file is not a step
        assert ckpt.all_steps(directory) == [1]
    with ckpt.CheckpointLock(directory):  # released on exit
        pass


def test_the_lock_of_another_process_is_refused_and_dies_with_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
         str(tmp_path / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ckpt.CheckpointLockedError, match=rf"{tmp_path} is in use"):
            ckpt.CheckpointLock(tmp_path).acquire()
    finally:
        holder.kill()  # a crash: the lock goes with the process
        holder.wait()
    ckpt.CheckpointLock(tmp_path).acquire().release()


# --- arrays that span several processes: a digest computed where the shards live -----------

def test_the_global_digest_ignores_the_sharding_and_sees_any_changed_word():
    rng = np.random.default_rng(3)
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    for x in (rng.standard_normal((64, 5)).astype(np.float32), rng.integers(1, 99, 24, dtype=np.int8),
              rng.standard_normal(16).astype(jnp.bfloat16), rng.random(8) > 0.5,
              rng.integers(1, 2**40, (8, 3), dtype=np.int64)):  # 8 bytes: NumPy only (no x64)
        digest = ckpt._global_digest(x)
        if x.dtype != np.int64:
            assert ckpt._global_digest(jax.device_put(x, NamedSharding(mesh, P("data")))) == digest
            assert ckpt._global_digest(jax.device_put(x, NamedSharding(mesh, P()))) == digest
        for k in rng.choice(x.size, 4, replace=False):  # one element changed, anywhere
            y = x.copy().reshape(-1)
            y[k] = ~y[k] if y.dtype == bool else y[k] + 1
            assert ckpt._global_digest(y.reshape(x.shape)) != digest


def test_a_corrupt_array_saved_by_several_processes_is_found_by_its_digest(tmp_path, monkeypatch):
    # Every array taken as spanning processes (one process cannot make one): saved with a
    # digest in place of the SHA-256, and checked by it on restore.
    monkeypatch.setattr(ckpt, "_spans_processes", lambda array: True)
    states = save_two(tmp_path)
    manifest = json.loads((tmp_path / "2" / "manifest" / "metadata").read_text())
    assert all("digest" in e and "sha256" not in e for e in manifest["leaves"].values())
    assert_bits_equal(ckpt.restore_checkpoint(tmp_path, TARGET, step=2)[0], states[2])
    flip(data_file(tmp_path, 2), 1)
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"leaf \['w'\] .*does not match"):
        ckpt.restore_checkpoint(tmp_path, TARGET, step=2)
    bad = {"w": states[1]["w"].at[3, 4].set(jnp.nan), "i": states[1]["i"]}  # counted there too
    with pytest.raises(ckpt.NonFiniteStateError, match=r"\['w'\] \(1 of 1024 values NaN/Inf\)"):
        ckpt.save_checkpoint(tmp_path, 3, bad)
