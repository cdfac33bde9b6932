"""jaxrec: FBGEMM_GPU and TorchRec for JAX.

Layers: ``jaxrec.sparse`` (jagged types) <- ``jaxrec.ops`` (functional ops over XLA
FFI kernels) <- ``jaxrec.optim`` (fused optimizers) <- ``jaxrec.nn`` (Flax NNX modules)
<- ``jaxrec.models``; ``jaxrec.parallel`` (sharding) on top; ``jaxrec.data``,
``jaxrec.metrics``, ``jaxrec.checkpoint`` and ``jaxrec.train`` beside them.
"""

from importlib.metadata import PackageNotFoundError, version

from jaxrec._ffi import build_info

try:
    __version__ = version("jaxrec")
except PackageNotFoundError:  # a source checkout that is not installed
    __version__ = "0.0.0+source"

__all__ = ["build_info", "__version__"]
