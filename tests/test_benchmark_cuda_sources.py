"""The standalone CUDA programs under benchmarks/ (built by hand on a GPU machine, outside
the library's CMake build) compile wherever nvcc is on the PATH, as the library's own CUDA
sources do in the install."""

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parents[1] / "benchmarks").rglob("*.cu"))


def test_there_are_sources():
    assert {p.name for p in SOURCES} >= {"random_row_reads.cu", "control.cu"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on the PATH")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles(source, tmp_path):
    result = subprocess.run(["nvcc", "-arch=sm_90", "-c", str(source), "-o", str(tmp_path / "out.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
