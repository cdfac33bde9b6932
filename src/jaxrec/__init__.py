"""jaxrec: FBGEMM_GPU and TorchRec for JAX."""
