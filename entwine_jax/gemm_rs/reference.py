# gemm_rs's XLA reference, used on every backend where the fused kernels cannot run: an fp32 dot
# followed by an fp32 psum_scatter, cast back to the input dtype (the kernels accumulate in fp32 too),
# and the matching backward (all_gather, two dots accumulated in fp32); and the FP8 reference.
import jax

from entwine_jax import fp8, opspec
from entwine_jax._dot import FP8_EXACT, dot_f32, dot_last_first, dot_type


def gemm_rs_reference(x, w, *, axis_name, scatter_dimension: int = 0):
    """psum_scatter(x @ w, tiled=True) with fp32 accumulation; output in x.dtype.

    scatter_dimension must already be normalised (0 <= scatter_dimension < x.ndim).
    """
    if jax.lax.axis_size(axis_name) == 1:
        # Nothing to reduce or scatter: XLA's GEMM alone, rounded once to x.dtype.
        return dot_last_first(x, w, dot_type(x.dtype)).astype(x.dtype)
    y = dot_last_first(x, w)
    # The kernels send each partial in x.dtype (the census counts that, not this fp32 sum's bytes).
    with opspec.moves("gemm_rs", x.dtype):
        y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=scatter_dimension, tiled=True)
    return y.astype(x.dtype)


def gemm_rs_reference_bwd(x, w, dy, *, axis_name, dimension: int = 0):
    """Cotangents (dx, dw) of gemm_rs scattering `dimension`: the backward of a reduce-scatter is an
    all-gather."""
    # Gather in the cotangent's own dtype (half the bytes of fp32 for bf16/fp16).
    # Where the forward is fused this gather is an ag_gemm's (entwine_jax.pairing): labelled so.
    with opspec.moves("ag_gemm", dy.dtype):
        g = jax.lax.all_gather(dy, axis_name, axis=dimension, tiled=True)
    # dx = g @ w.T: contract N.
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())),
                             preferred_element_type=dot_type(x.dtype))
    # dw = x.T @ g, contracting over every batch dim of x.
    batch = tuple(range(x.ndim - 1))
    dw = jax.lax.dot_general(x, g, ((batch, batch), ((), ())), preferred_element_type=dot_type(w.dtype))
    return dx.astype(x.dtype), dw.astype(w.dtype)


def gemm_rs_reference_fp8(x, w, x_scale, w_scale, *, axis_name, scatter_dimension: int, out_dtype,
                          block: bool = False):
    """psum_scatter((x * x_scale) @ (w * w_scale), tiled=True) of FP8 operands: the dot of the FP8
    values accumulated in fp32, scaled by this rank's x_scale * w_scale (each rank's partial carries
    its own scales), summed over the ranks in fp32; output in out_dtype. block: the scales are this
    rank's block scales (1x128 tiles of x, 128x128 blocks of w), the dot one of the dequantised
    operands in fp32."""
    if block:
        y = dot_f32(fp8.dequantize(x, x_scale), fp8.dequantize(w, w_scale))
    else:
        # Operands quantised in the same program: the barrier keeps XLA from folding the FP8 rounding
        # away where it upcasts them for the dot (fp8.dequantize says why, and has its own).
        x, w = jax.lax.optimization_barrier((x, w))
        y = dot_last_first(x, w, precision=FP8_EXACT) * (x_scale * w_scale)
    if jax.lax.axis_size(axis_name) > 1:
        # The kernels send each partial in out_dtype (the census counts that, not this fp32 sum's bytes).
        with opspec.moves("gemm_rs", out_dtype):
            y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=scatter_dimension, tiled=True)
    return y.astype(out_dtype)
