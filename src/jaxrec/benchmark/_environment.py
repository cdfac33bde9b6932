"""What a benchmark ran on: the device, the versions of JAX and jaxrec, the optional peers.

Every result file starts with :func:`environment`:

    {"benchmark": "tbe_cpu", "date": "2026-11-21", "device": "AMD EPYC",
     "jax": "0.10.2", "jaxlib": "0.10.2", "jaxrec": "0.1.0", "jaxrec_build": {...},
     "torch": null, "fbgemm_gpu": null,
     "skipped": {"fbgemm": "fbgemm_gpu does not import (...); ..."}}

PyTorch and FBGEMM are optional peers: :func:`optional_import` returns the module or
the note that goes under "skipped".
"""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jaxlib

import jaxrec


def share_gpu_with_torch() -> None:
    """Keeps JAX from taking most of the GPU up front, so that PyTorch fits beside it.

    Takes effect only before JAX starts its GPU backend (the first ``jax.devices()``).
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def optional_import(name: str) -> tuple[ModuleType | None, str | None]:
    """(module, None), or (None, why it was skipped) when `name` does not import."""
    try:
        return importlib.import_module(name), None
    # A peer built for another torch or CUDA fails with OSError or RuntimeError, not
    # only ImportError; any failure skips the peer and the rest of the run goes on.
    except Exception as error:  # noqa: BLE001
        return None, f"{name} does not import ({type(error).__name__}: {error}); its peer was skipped"


def environment(benchmark: str, device: str, peers: dict[str, ModuleType | None],
                skipped: dict[str, str]) -> dict[str, Any]:
    """The header of a result file: benchmark, date, device, versions and skipped peers.

    peers: {module name: module, or None when it did not import}; skipped: {peer: note}.
    """
    return {
        "benchmark": benchmark,
        "date": datetime.date.today().isoformat(),
        "device": device,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jaxrec": jaxrec.__version__,
        "jaxrec_build": jaxrec.build_info(),
        **{name: getattr(module, "__version__", None) for name, module in peers.items()},
        "skipped": skipped,
    }


def nvidia_driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi, None where there is no nvidia-smi."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name from lscpu ("?" where lscpu is missing or does not say)."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    except FileNotFoundError:
        return platform.processor() or "?"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "?")


def machine_info() -> dict[str, Any]:
    """The host of a CPU benchmark: model, cores, OS, versions, load, transparent huge pages.

    Called at the end of a run (the load average is the one the run saw).
    """
    info = {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "jax": jax.__version__,
            "load_average_at_end": os.getloadavg()}
    try:  # the dense backward gains most where transparent huge pages are on or `madvise`
        info["transparent_hugepage"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    info["jaxlib"] = jaxlib.__version__
    fbgemm_gpu, _ = optional_import("fbgemm_gpu")
    torch, _ = optional_import("torch")
    if fbgemm_gpu is not None and torch is not None:
        info.update(torch=torch.__version__, fbgemm_gpu=fbgemm_gpu.__version__,
                    torch_threads=torch.get_num_threads())
    return info
