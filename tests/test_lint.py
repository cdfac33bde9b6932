"""The repository's lint: ruff over the Python (config in pyproject.toml) and
clang-format over csrc/ and benchmarks/ (.clang-format). Both come with ``pip install '.[test]'``; fix
with ``ruff check --fix .`` and ``clang-format -i <file>``."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPP_SUFFIXES = {".cc", ".cu", ".h", ".cuh"}


def tool(name: str) -> str:
    """The tool installed beside this Python (the test extra), else on the PATH."""
    path = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert path, f"{name} is not installed: pip install '.[test]' brings it"
    return path


def test_python_passes_ruff():
    result = subprocess.run([tool("ruff"), "check", "--no-cache", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpp_and_cuda_are_clang_formatted():
    files = sorted(str(p) for d in ("csrc", "benchmarks") for p in (ROOT / d).rglob("*")
                   if p.suffix in CPP_SUFFIXES)
    assert len(files) > 10, files
    result = subprocess.run([tool("clang-format"), "--dry-run", "--Werror", *files], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
