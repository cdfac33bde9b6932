"""Loads jaxrec's XLA FFI libraries, registers their handlers and picks one per platform.

The build installs ``_lib/libjaxrec_cpu.so`` (always), ``_lib/libjaxrec_cuda.so``
(when CUDA was found) and ``_lib/build_info.json``. Each op has one target name,
registered for the ``cpu`` platform with the CPU handler and for ``CUDA`` with the
CUDA handler (``TARGETS``); :func:`dispatch` lowers the kernel of the platform being
compiled for, or the op's pure-``jnp`` reference on a platform that has no handler.
It traces the kernels of every platform jaxrec has handlers for and the reference only
where a backend of this process has none, or, inside :func:`lowering_platforms`, the
branches of the platforms named there (``jax.export`` for platforms beyond those).

Libraries load lazily, on the first op that needs them, so ``import jaxrec``
works even when a library is missing or was built for another jaxlib.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.extend
import jaxlib

_LIB_DIR = Path(__file__).parent / "_lib"

# Target name -> handler symbol, per platform library.
TARGETS = {
    "cpu": {
        "jaxrec_bounds_check_indices": "JaxrecBoundsCheckIndicesCpu",
        "jaxrec_tbe_forward": "JaxrecTbeForwardCpu",
        "jaxrec_tbe_backward": "JaxrecTbeBackwardCpu",
        "jaxrec_tbe_fused_update": "JaxrecTbeFusedUpdateCpu",
        "jaxrec_sort_by_row": "JaxrecSortByRowCpu",
        "jaxrec_quantized_lookup": "JaxrecQuantizedLookupCpu",
        "jaxrec_hash_find": "JaxrecHashFindCpu",
        "jaxrec_hash_insert": "JaxrecHashInsertCpu",
        "jaxrec_copy_rows": "JaxrecCopyRowsCpu",
        "jaxrec_copy_rows_async": "JaxrecCopyRowsCpu",  # the CPU copies in place
        "jaxrec_wait_copies": "JaxrecWaitCopiesCpu",
    },
    "cuda": {
        "jaxrec_bounds_check_indices": "JaxrecBoundsCheckIndicesCuda",
        "jaxrec_tbe_forward": "JaxrecTbeForwardCuda",
        "jaxrec_tbe_backward_sorted": "JaxrecTbeBackwardSortedCuda",
        "jaxrec_tbe_fused_update": "JaxrecTbeFusedUpdateCuda",
        "jaxrec_tt_forward": "JaxrecTtForwardCuda",
        "jaxrec_tt_backward": "JaxrecTtBackwardCuda",
        "jaxrec_quantized_lookup": "JaxrecQuantizedLookupCuda",
        "jaxrec_hash_find": "JaxrecHashFindCuda",
        "jaxrec_hash_find_or_insert": "JaxrecHashFindOrInsertCuda",
        "jaxrec_copy_rows": "JaxrecCopyRowsCuda",
        "jaxrec_copy_rows_async": "JaxrecCopyRowsAsyncCuda",
        "jaxrec_wait_copies": "JaxrecWaitCopiesCuda",
    },
}

_LIBRARIES = {"cpu": "jaxrec_cpu", "cuda": "jaxrec_cuda"}
_XLA_PLATFORM_NAMES = {"cpu": "cpu", "cuda": "CUDA"}

_REBUILD_HINT = (
    "Rebuild jaxrec against the jaxlib you run: `pip install --no-build-isolation "
    "--force-reinstall --no-deps .` from the jaxrec source tree, or upgrade jax and jaxlib "
    "(`pip install -U jax jaxlib`)."
)


@functools.cache
def build_info() -> dict[str, Any]:
    """What the installed jaxrec was built with, and what runs it now.

    Keys: ``cpu`` / ``cuda`` (whether each handler library was built),
    ``jaxlib_headers_version`` and ``ffi_api_version`` (of the XLA FFI headers
    used at build time), ``cuda_version``, ``cuda_architectures``,
    ``runtime_jaxlib_version`` and ``runtime_ffi_api_version``.
    """
    path = _LIB_DIR / "build_info.json"
    if path.exists():
        info = json.loads(path.read_text())
        info["ffi_api_version"] = tuple(info["ffi_api_version"])
    else:  # A source checkout on sys.path instead of an installed package.
        info = {"cpu": False, "cuda": False, "jaxlib_headers_version": None,
                "ffi_api_version": None, "cuda_version": "", "cuda_architectures": ""}
    info["cpu"] = info["cpu"] and _library_path("jaxrec_cpu").exists()
    info["cuda"] = info["cuda"] and _library_path("jaxrec_cuda").exists()
    info["runtime_jaxlib_version"] = jaxlib.__version__
    info["runtime_ffi_api_version"] = _runtime_ffi_api_version()
    return info


def _library_path(name: str) -> Path:
    return _LIB_DIR / f"lib{name}.so"


def _runtime_ffi_api_version() -> tuple[int, int] | None:
    """(major, minor) of the FFI API of the running jaxlib, read from its own headers."""
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = header.read_text()
    except OSError:
        return None
    found = [re.search(rf"^#define XLA_FFI_API_{part} (\d+)", text, re.M) for part in ("MAJOR", "MINOR")]
    if not all(found):
        return None
    return int(found[0].group(1)), int(found[1].group(1))


def check_ffi_compatibility(built: tuple[int, int] | None, runtime: tuple[int, int] | None) -> None:
    """Raises if handlers built with FFI API `built` cannot run on a jaxlib with API `runtime`.

    XLA accepts handlers built against headers of the same major and an older or
    equal minor version, and refuses newer ones at registration.
    """
    if built is None or runtime is None:
        return
    if built[0] != runtime[0] or built[1] > runtime[1]:
        info = build_info()
        raise RuntimeError(
            f"jaxrec was built against the XLA FFI headers of jaxlib "
            f"{info['jaxlib_headers_version']} (FFI API {built[0]}.{built[1]}), which the running "
            f"jaxlib {info['runtime_jaxlib_version']} (FFI API {runtime[0]}.{runtime[1]}) refuses. "
            + _REBUILD_HINT
        )


@functools.cache
def _load(platform: str) -> bool:
    """Loads the library of `platform` and registers its handlers; False if it was not built."""
    info = build_info()
    if not info[platform]:
        return False
    check_ffi_compatibility(info["ffi_api_version"], info["runtime_ffi_api_version"])
    library = ctypes.CDLL(str(_library_path(_LIBRARIES[platform])))
    for target, symbol in TARGETS[platform].items():
        try:
            handler = jax.ffi.pycapsule(getattr(library, symbol))
        except AttributeError:
            raise RuntimeError(f"jaxrec's {platform} library lacks the handler {symbol} of {target}: "
                               "it was built from older sources. " + _REBUILD_HINT) from None
        try:
            jax.ffi.register_ffi_target(target, handler, platform=_XLA_PLATFORM_NAMES[platform])
        except Exception as error:  # XLA's own message names the API versions.
            raise RuntimeError(
                f"Registering jaxrec's {platform} handler {target} failed: {error}. " + _REBUILD_HINT
            ) from error
    return True


def custom_call_targets() -> list[str]:
    """Every target name of jaxrec's handlers (what ``jax.export`` must be told to allow)."""
    return sorted({t for targets in TARGETS.values() for t in targets})


def has_kernel(platform: str) -> bool:
    """Whether jaxrec has compiled handlers for `platform` ('cpu' or 'cuda')."""
    return platform in _LIBRARIES and _load(platform)


def call_kernel(kernel: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)``, whose FFI targets XLA resolves for the platform being compiled for:
    no ``platform_dependent`` conditional around it (one that takes operands in host memory
    must not sit inside a conditional, which XLA's host offloading cannot follow) and no
    reference. Needs the handlers of that platform."""
    if not any([has_kernel(p) for p in _LIBRARIES]):  # every built library loaded (no short cut)
        raise RuntimeError("this op needs jaxrec's compiled handlers, which are missing "
                           "(jaxrec.build_info()); " + _REBUILD_HINT)
    return kernel(*args)


_LOWERING_PLATFORMS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "jaxrec_lowering_platforms", default=None)


@contextlib.contextmanager
def lowering_platforms(platforms: Sequence[str]):
    """Within: :func:`dispatch` traces the branches of `platforms` ('cpu', 'cuda', 'tpu',
    ...) instead of the default ones (module doc): for ``jax.export`` to a platform that
    has neither a backend in this process nor jaxrec handlers, which then gets the jnp
    reference (``jaxrec.serving.export`` names its platforms this way)."""
    token = _LOWERING_PLATFORMS.set(tuple(platforms))
    try:
        yield
    finally:
        _LOWERING_PLATFORMS.reset(token)


def _traced_platforms() -> tuple[str, ...]:
    # This process's backends and every platform jaxrec has handlers for (a kernel branch
    # is cheap to trace, and jax.export to CUDA from a CPU-only machine keeps working),
    # but the jnp reference only where it can be lowered: tracing it as the default of
    # every op cost a CPU-only machine 6% of the test suite's time (11% of the nn, optim
    # and parallel tests), for a branch no platform here ever lowered.
    explicit = _LOWERING_PLATFORMS.get()
    if explicit is not None:
        return explicit
    present = tuple(jax.extend.backend.backends())
    return present + tuple(p for p in _LIBRARIES if p not in present and has_kernel(p))


def dispatch(kernel: Callable[..., Any] | dict[str, Callable[..., Any]],
             reference: Callable[..., Any], *args: Any, backend: str = "auto") -> Any:
    """Calls `kernel(*args)` on platforms with compiled handlers, else `reference(*args)`.

    `kernel` is one function for every platform, or a dict {"cpu": ..., "cuda": ...}
    where the platforms' handlers take different operands; a platform missing from the
    dict (an op with no kernel there) runs the reference.

    backend: "auto" (kernel where built, reference elsewhere), "kernel" (always the
    handler; lowering fails on a platform without one) or "reference" (always the
    pure-jnp reference).
    The platform is the one the computation is lowered for, so this works under jit;
    the module doc says which branches are traced.
    """
    if backend == "reference":
        return reference(*args)
    if backend not in ("auto", "kernel"):
        raise ValueError(f"backend must be 'auto', 'kernel' or 'reference', got {backend!r}")

    kernels = kernel if isinstance(kernel, dict) else dict.fromkeys(_LIBRARIES, kernel)
    platforms = _traced_platforms()
    if backend == "kernel":
        # Always the handlers, and the reference is not even traced (it may not handle
        # every input the kernels do): lowering for a platform without a handler fails.
        available = {p: kernels[p] for p in platforms if p in kernels and has_kernel(p)}
        if not available:
            raise RuntimeError(f"backend='kernel' but jaxrec has no compiled handlers for {list(platforms)} "
                               "(jaxrec.build_info()); " + _REBUILD_HINT)
        return jax.lax.platform_dependent(*args, **available)
    branches = {p: (kernels[p] if p in kernels and has_kernel(p) else reference)
                for p in platforms if p in _LIBRARIES}
    others = any(p not in _LIBRARIES for p in platforms)  # e.g. 'tpu': the reference
    if not branches:
        return reference(*args)
    return jax.lax.platform_dependent(*args, default=reference if others else None, **branches)
