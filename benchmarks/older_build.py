"""An older build of jaxrec, importable in the same process as this one.

A process's host time per step falls into modes about 1.5x apart that last its whole life
(docs/parallel.md, "Host time of a step"): two builds, each in its own process, compare
poorly. ``import_older(checkout, into)`` copies an older checkout's package and benchmarks
under ``into`` with every name that would collide renamed, so both builds run side by side:

* the package ``jaxrec`` becomes ``jaxrec_base``, and with it every name that starts with
  ``jaxrec``: its XLA FFI targets (``jaxrec_tbe_forward`` -> ``jaxrec_base_tbe_forward``:
  XLA keeps one handler per name) and its libraries (``libjaxrec_base_cuda.so``, loaded by
  path, so each build's handlers resolve in their own library);
* each benchmark module ``m`` becomes ``base_m``.

The checkout must be built: its ``src/jaxrec/_lib`` holds its libraries, as an install does.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys

PACKAGE = "jaxrec_base"


def _rename(text: str, modules: list[str]) -> str:
    text = re.sub(r"\bjaxrec", PACKAGE, text)
    for m in modules:
        text = re.sub(rf"^(\s*)(from|import) {m}\b", rf"\1\2 base_{m}", text, flags=re.M)
    return text


def _copy_renamed(source: str, target: str, modules: list[str]) -> None:
    with open(source) as f:
        text = f.read()
    with open(target, "w") as f:
        f.write(_rename(text, modules))


def import_older(checkout: str, into: str, module: str = "profile_sharded_step"):
    """Copies ``checkout``'s ``src/jaxrec`` and ``benchmarks/*.py`` under ``into`` renamed
    (above) and returns its benchmark ``module``, imported."""
    package = os.path.join(into, PACKAGE)
    shutil.copytree(os.path.join(checkout, "src", "jaxrec"), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for root, _, files in os.walk(package):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py"):
                _copy_renamed(path, path, [])
            elif name.startswith("libjaxrec_"):
                os.rename(path, os.path.join(root, "lib" + _rename(name[3:], [])))
    bench = os.path.join(checkout, "benchmarks")
    modules = [n[:-3] for n in os.listdir(bench) if n.endswith(".py")]
    for m in modules:
        _copy_renamed(os.path.join(bench, m + ".py"), os.path.join(into, f"base_{m}.py"), modules)
    sys.path.insert(0, into)
    return importlib.import_module(f"base_{module}")
