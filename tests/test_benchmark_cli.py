"""``jaxrec bench --quick --platform cpu``: the run, its JSON and its table.

The benchmark checks, before timing, that jaxrec and each peer compute the same pooled
output (and XLA the same dense gradient); a wrong kernel makes it raise. The JSON
records that check, which these tests read back.
"""

import json

import jax
import pytest

import jaxrec
from jaxrec.benchmark import lookup_bytes, main


@pytest.fixture(scope="module")
def quick_cpu_run(tmp_path_factory):
    if not jaxrec.build_info()["cpu"]:
        pytest.skip("jaxrec was built without its CPU library (see jaxrec.build_info())")
    out = tmp_path_factory.mktemp("bench") / "r.json"
    assert main(["--quick", "--platform", "cpu", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_header_names_device_and_versions(quick_cpu_run):
    result = quick_cpu_run
    assert result["benchmark"] == "tbe_cpu"
    assert isinstance(result["device"], str) and result["device"]
    assert result["jax"] == jax.__version__
    assert result["jaxrec"] == jaxrec.__version__
    assert result["jaxrec_build"]["cpu"] is True
    # Optional peers: a version, or a note saying why they were skipped.
    assert result["fbgemm_gpu"] is not None or "fbgemm" in result["skipped"]
    assert result["machine"]["cores"] >= 1


def test_jaxrec_and_xla_agree_and_are_timed(quick_cpu_run):
    (run,) = quick_cpu_run["runs"]
    T, D, B = (run["config"][k] for k in "TDB")
    check = run["check"]
    # The same pooled output: shape [B, T * D] for both, values within the tolerance.
    assert check["output_shape"]["jaxrec"] == check["output_shape"]["xla"] == [B, T * D]
    # Forward values are ~0.03, so the tolerance is all atol (float32 rounding of the sums).
    assert 0 <= check["max_abs_diff"]["xla_forward"] <= check["atol"]
    assert check["max_abs_diff"]["xla_forward_backward"] >= 0  # within rtol, or the run raised
    for name in ("jaxrec_forward", "xla_forward", "jaxrec_forward_backward", "xla_forward_backward"):
        assert run["times_ms"][f"{name}_ms"] > 0, name
    assert run["ratios"]["xla_forward / jaxrec_forward"] == pytest.approx(
        run["times_ms"]["xla_forward_ms"] / run["times_ms"]["jaxrec_forward_ms"])
    assert run["jaxrec_forward_GB_per_s"] > 0
    if "fbgemm" in check["output_shape"]:
        assert check["output_shape"]["fbgemm"] == [B, T * D]
        assert run["times_ms"]["fbgemm_forward_ms"] > 0


def test_prints_a_table(tmp_path, capsys):
    if not jaxrec.build_info()["cpu"]:
        pytest.skip("jaxrec was built without its CPU library (see jaxrec.build_info())")
    assert main(["--quick", "--platform", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("tbe_cpu on ")
    for name in ("jaxrec_forward", "xla_forward", "jaxrec_forward_backward", "xla_forward_backward"):
        assert f" {name} " in printed
    assert not list(tmp_path.iterdir())  # no --out: no file


def test_lookup_bytes_counts_as_fbgemm():
    # Fixed bags: 4 * B * T * D output + 4 * B * T * D * L rows read.
    assert lookup_bytes(512, [128] * 32, [512 * 20] * 32) == 4 * 512 * 32 * 128 * 21
    # Jagged, mixed dims, 2-byte rows: output once, one row per id looked up.
    assert lookup_bytes(2, [4, 8], [3, 0], weight_bytes=2) == 4 * 2 * 12 + 2 * 3 * 4
    with pytest.raises(ValueError, match="ids_per_feature"):
        lookup_bytes(2, [4, 8], [3])


def test_gpu_platform_without_a_gpu_says_how_to_fix(capsys):
    try:
        has_gpu = bool(jax.devices("cuda")) and jaxrec.build_info()["cuda"]
    except RuntimeError:
        has_gpu = False
    if has_gpu:
        pytest.skip("a CUDA GPU and jaxrec's CUDA library are present")
    with pytest.raises(SystemExit) as exit_info:
        main(["--platform", "gpu"])
    assert exit_info.value.code == 2
    assert "--platform cpu" in capsys.readouterr().err
