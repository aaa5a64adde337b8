# ag_gemm's XLA reference, used on every backend where the fused kernels cannot run: all_gather, then
# a dot accumulated in fp32 and rounded once to the input dtype.
import jax

from entwine_jax._dot import dot_last_first, dot_type


def ag_gemm_reference(x, w, *, axis_name, gather_dimension: int):
    """(all_gather(x) @ w with fp32 accumulation in x.dtype, the gathered x). gather_dimension must
    be normalised; gathering the last dim gathers the contraction dim (w holds all of K)."""
    g = jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    return dot_last_first(g, w, dot_type(x.dtype)).astype(x.dtype), g
