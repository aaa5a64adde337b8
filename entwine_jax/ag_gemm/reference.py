# ag_gemm's XLA reference, used on every backend where the fused kernels cannot run: all_gather, then
# a dot accumulated in fp32 and rounded once to the input dtype; and the FP8 reference. A group of
# weights (w a tuple) is one gather and a dot per weight.
import jax
import jax.numpy as jnp

from entwine_jax import fp8, opspec
from entwine_jax._dot import FP8_EXACT, dot_by_source, dot_f32, dot_last_first, dot_type


def ag_gemm_reference(x, w, *, axis_name, gather_dimension: int):
    """(all_gather(x) @ w with fp32 accumulation in x.dtype, the gathered x). gather_dimension must
    be normalised; gathering the last dim gathers the contraction dim (w holds all of K)."""
    with opspec.moves("ag_gemm", x.dtype):  # the census' label (entwine_jax.opspec)
        g = jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    return jax.tree.map(lambda w: dot_last_first(g, w, dot_type(x.dtype)).astype(x.dtype), w), g


def ag_gemm_reference_fp8(x, w, x_scale, w_scale, *, axis_name, gather_dimension: int, out_dtype, shared_scale: bool,
                          block: bool = False):
    """(all_gather(x) @ w of FP8 operands in out_dtype, the gathered FP8 x, the W sources' x_scale).
    Each source's block of the gathered x (rows, or a K slice in the contraction layout) is scaled by
    that source's x_scale, gathered with it; shared_scale: every rank's x_scale is equal, nothing to
    gather. The dot accumulates in fp32. block: block scales (1x128 tiles of x, gathered with x over
    its gathered dim; 128x128 blocks of w), the dot one of the dequantised operands in fp32."""
    # The weight quantised in the same program: the barrier keeps its FP8 rounding (as in gemm_rs's).
    w = jax.lax.optimization_barrier(w)
    # One byte per element of the FP8 x, as the kernels move it (a CPU compile may widen it to f16).
    with opspec.moves("ag_gemm", x.dtype):
        g = jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    world = jax.lax.axis_size(axis_name)
    if block:
        # Each tile's scale travels with its tile.
        with opspec.moves("ag_gemm", jnp.float32):
            scales = jax.lax.all_gather(x_scale, axis_name, axis=gather_dimension, tiled=True)
        y = dot_f32(fp8.dequantize_by_source(g, scales, gather_dimension, jnp.float32, world),
                    fp8.dequantize(w, w_scale))
        return y.astype(out_dtype), g, scales
    if shared_scale:
        scales = jnp.broadcast_to(x_scale, (world,))
        y = jax.tree.map(lambda w: dot_last_first(g, w, precision=FP8_EXACT) * x_scale, w)
    else:
        # The kernels send each shard's scale with it.
        with opspec.moves("ag_gemm", jnp.float32):
            scales = jax.lax.all_gather(jnp.reshape(x_scale, (1,)), axis_name, tiled=True)
        y = jax.tree.map(lambda w: dot_by_source(g, w, (((g.ndim - 1,), (0,)), ((), ())), gather_dimension, scales), w)
    return jax.tree.map(lambda y: (y * w_scale).astype(out_dtype), y), g, scales
