"""Serving: a trained model's tables quantized to row-wise int8 / int4 (FBGEMM's
inference layout) or fp16, with the same interface.

- ``quantize(model, {"t_big": "int4", "*": "int8"})`` -> ``(served, QuantizationReport)``.
- ``QuantizedEmbeddingBagCollection``: the pooled lookup over quantized rows
  (``jaxrec.ops.quantized_lookup``: CPU and CUDA kernels).
- ``quantize_rows`` / ``dequantize_rows`` / ``quantization_error_bound``: the row format.
- ``export(model, path, ...)`` / ``load(path)``: ``jax.export`` artifacts and weights in a
  folder, loaded in a fresh process as ``predict(dense, kjt)`` (or
  ``predict.predict_arrays(dense, lengths, values)`` from host arrays).
- ``jaxrec export CHECKPOINT OUT``: a ``jaxrec train`` run's model as such a folder.

See docs/serving.md.
"""

from jaxrec.ops.quantized_rows import dequantize_rows, quantization_error_bound, quantize_rows, row_bytes
from jaxrec.serving._collection import (
    PRECISIONS,
    QuantizationReport,
    QuantizedEmbeddingBagCollection,
    quantize,
)
from jaxrec.serving._export import Served, export, load

__all__ = [
    "PRECISIONS",
    "QuantizationReport",
    "QuantizedEmbeddingBagCollection",
    "Served",
    "dequantize_rows",
    "export",
    "load",
    "quantization_error_bound",
    "quantize",
    "quantize_rows",
    "row_bytes",
]
