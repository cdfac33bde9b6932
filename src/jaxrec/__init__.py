"""jaxrec: FBGEMM_GPU and TorchRec for JAX.

Layers: ``jaxrec.sparse`` (jagged types) <- ``jaxrec.ops`` (functional ops over XLA
FFI kernels) <- ``jaxrec.optim`` (optimizer configs, state, math) <- ``jaxrec.fused``
(tables with the optimizer in the backward, their train step) <- ``jaxrec.nn`` (Flax NNX
modules) <- ``jaxrec.models``; ``jaxrec.parallel`` (sharding) on top; ``jaxrec.data``,
``jaxrec.metrics``, ``jaxrec.checkpoint`` and ``jaxrec.train`` beside them.
"""

from importlib.metadata import PackageNotFoundError, version

from jaxrec._ffi import build_info
from jaxrec._step_guard import NonFiniteError

try:
    __version__ = version("jaxrec")
except PackageNotFoundError:  # a source checkout that is not installed
    __version__ = "0.0.0+source"

__all__ = ["NonFiniteError", "build_info", "__version__"]
