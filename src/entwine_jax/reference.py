# The XLA reference of gemm_rs, used on every backend where the fused kernels cannot run: an fp32
# dot followed by an fp32 psum_scatter, cast back to the input dtype (the kernels accumulate in
# fp32 too), and the matching backward (all_gather, two dots accumulated in fp32).
import jax
import jax.numpy as jnp


def _dot_type(dtype):
    """Output type of a GEMM whose result is only rounded to `dtype`. XLA's bf16 GEMM accumulates in
    fp32; writing bf16 at once was bitwise equal to fp32-then-cast on an H200, and faster
    (docs/performance.md, "What was tried"). Anything else keeps an explicit fp32 output."""
    return jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32


def _dot_last_first(x, w, out_type=jnp.float32):
    # x [..., K] . w [K, N] -> [..., N].
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=out_type)


def gemm_rs_reference(x, w, *, axis_name, scatter_dimension: int = 0):
    """psum_scatter(x @ w, tiled=True) with fp32 accumulation; output in x.dtype.

    scatter_dimension must already be normalised (0 <= scatter_dimension < x.ndim).
    """
    if jax.lax.axis_size(axis_name) == 1:
        # Nothing to reduce or scatter: XLA's GEMM alone, rounded once to x.dtype.
        return _dot_last_first(x, w, _dot_type(x.dtype)).astype(x.dtype)
    y = _dot_last_first(x, w)
    y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=scatter_dimension, tiled=True)
    return y.astype(x.dtype)


def gemm_rs_reference_bwd(x, w, dy, *, axis_name, scatter_dimension: int = 0):
    """Cotangents (dx, dw) of gemm_rs: the backward of a reduce-scatter is an all-gather."""
    # Gather in the cotangent's own dtype (half the bytes of fp32 for bf16/fp16).
    g = jax.lax.all_gather(dy, axis_name, axis=scatter_dimension, tiled=True)
    # dx = g @ w.T: contract N.
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())),
                             preferred_element_type=_dot_type(x.dtype))
    # dw = x.T @ g, contracting over every batch dim of x.
    batch = tuple(range(x.ndim - 1))
    dw = jax.lax.dot_general(x, g, ((batch, batch), ((), ())), preferred_element_type=_dot_type(w.dtype))
    return dx.astype(x.dtype), dw.astype(w.dtype)


def ag_gemm_reference(x, w, *, axis_name, gather_dimension: int):
    """(all_gather(x) @ w with fp32 accumulation in x.dtype, the gathered x). gather_dimension must
    be normalised; gathering the last dim gathers the contraction dim (w holds all of K)."""
    g = jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    return _dot_last_first(g, w, _dot_type(x.dtype)).astype(x.dtype), g


def matmul_weight_grad(x, dy, dtype):
    """dw = x.T @ dy, contracting every dim of x and dy but the last (fp32 accumulation)."""
    batch = tuple(range(x.ndim - 1))
    return jax.lax.dot_general(x, dy, ((batch, batch), ((), ())), preferred_element_type=_dot_type(dtype)).astype(dtype)
