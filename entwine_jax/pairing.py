# The two ops as users call them, and the custom VJPs that pair them: the backward of gemm_rs is an
# ag_gemm in the same layout (its gathered dy also serves dw), and the backward of ag_gemm is a
# gemm_rs (its gathered x serves dw). docs/design.md, "The pairing".
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import callsite, fp8
from entwine_jax._dot import matmul_weight_grad
from entwine_jax.ag_gemm import op as ag_op
from entwine_jax.ag_gemm.config import AgGemmConfig
from entwine_jax.gemm_rs import op as rs_op
from entwine_jax.gemm_rs.config import GemmRsConfig
from entwine_jax.gemm_rs.reference import gemm_rs_reference_bwd


# The ops as shared code sees them (entwine_jax.opspec; the census reads them here): one line per op.
SPECS = (rs_op.SPEC, ag_op.SPEC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gemm_rs(x, w, plan):
    return rs_op.forward(x, w, plan)


def _gemm_rs_fwd(x, w, plan):
    return rs_op.forward(x, w, plan), (x, w)


def _gemm_rs_bwd(plan, res, dy):
    x, w = res
    if plan.config.path == "xla":
        return gemm_rs_reference_bwd(x, w, dy, axis_name=plan.axis_name, scatter_dimension=plan.scatter_dimension)
    # The backward of a reduce-scatter is an all-gather: dx = all_gather(dy) @ w.T is one ag_gemm in
    # the same layout (gathering the scattered dim), and its gathered dy serves dw = x.T @ g.
    # A forward the user forced onto the kernels keeps its backward there (the small-call rule of
    # path "auto" must not move it to XLA), with the config the backward would choose itself.
    config = None
    if plan.config.path == "fused":
        config = dataclasses.replace(ag_op.default_config(dy, w.T, plan.axis_size), path="fused")
    dx, g = ag_gemm(dy, w.T, axis_name=plan.axis_name, gather_dimension=plan.scatter_dimension, config=config,
                    return_gathered=True)
    return dx, matmul_weight_grad(x, g, w.dtype)


_gemm_rs.defvjp(_gemm_rs_fwd, _gemm_rs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ag_gemm(x, w, plan):
    # Without differentiation only what the caller asked for is computed: a forward-only call never
    # writes the gathered operand.
    return ag_op.forward(x, w, plan, gathered=plan.return_gathered)


def _ag_gemm_fwd(x, w, plan):
    y, g = ag_op.forward(x, w, plan, gathered=True)
    return ((y, g) if plan.return_gathered else y), (g, w)


def _ag_gemm_bwd(plan, res, cotangents):
    g, w = res
    # Only a call that returns the gathered operand has its cotangent (JAX passes zeros when that
    # output is unused: one reduce-scatter of zeros, so return it only where it is needed).
    dy, dg = cotangents if plan.return_gathered else (cotangents, None)
    # dx is a reduce-scatter of dy @ w.T over the gathered dim: one gemm_rs on dy and w.T (rows
    # layout: scatter the gathered dim; contraction layout: scatter the last dim, K).
    rs_config = GemmRsConfig(path="xla") if plan.config.path == "xla" else None
    if plan.config.path == "fused":  # as in _gemm_rs_bwd: a forced forward keeps its backward fused
        config, _ = rs_op.default_config(dy, w.T, plan.axis_size, plan.gather_dimension)
        rs_config = dataclasses.replace(config, path="fused")
    dx = gemm_rs(dy, w.T, axis_name=plan.axis_name, scatter_dimension=plan.gather_dimension, config=rs_config)
    # A cotangent of the returned gathered operand reduce-scatters onto x too.
    if dg is not None:
        dx = dx + jax.lax.psum_scatter(dg, plan.axis_name, scatter_dimension=plan.gather_dimension,
                                       tiled=True).astype(dx.dtype)
    dw = matmul_weight_grad(g, dy, w.dtype)
    return dx, dw


_ag_gemm.defvjp(_ag_gemm_fwd, _ag_gemm_bwd)


def gemm_rs(x, w, *, axis_name, scatter_dimension: int = 0, config: Optional[GemmRsConfig] = None,
            x_scale=None, w_scale=None, out_dtype=None, grad_dtype=None, grad_scale=None):
    """Fused GEMM + ReduceScatter, called inside jax.shard_map.

    Computes jax.lax.psum_scatter(x @ w, axis_name, scatter_dimension=scatter_dimension, tiled=True)
    with fp32 accumulation and the result in x.dtype.

    x: [..., K_local] (contraction dim sharded over axis_name); w: [K_local, N].
    scatter_dimension indexes the output [..., N]; negative values count from the end.
    config: a GemmRsConfig; default: set_default_config(), else the tuned table (user cache, then
    shipped; entwine_jax.tuning), else heuristic_config().

    FP8 (entwine_jax.fp8): with x_scale and w_scale (float32 scalars) computes
    psum_scatter((x * x_scale) @ (w * w_scale)) on float8_e4m3fn operands (or bf16/fp16/fp32 ones the
    op quantises with those scales) in out_dtype (bfloat16 or float16); the backward quantises the
    cotangent to grad_dtype (float8_e5m2 with grad_scale, default each rank's current scale; or
    bfloat16/float16).
    """
    if fp8.requested(x, w, x_scale, w_scale, out_dtype, grad_dtype, grad_scale):
        return fp8.gemm_rs(x, w, axis_name=axis_name, scatter_dimension=scatter_dimension, config=config,
                           x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype, grad_dtype=grad_dtype,
                           grad_scale=grad_scale)
    plan = rs_op.plan(x, w, axis_name=axis_name, scatter_dimension=scatter_dimension, config=config)
    names = callsite.varying_over(x, w, axis_name=plan.axis_name)
    # The scope names every operation of the call (forward and backward) in the program's metadata,
    # which is how a collective census tells the op's collectives from XLA's own.
    with jax.named_scope("entwine_gemm_rs"):
        return _gemm_rs(callsite.make_varying(x, names), callsite.make_varying(w, names), plan)


def ag_gemm(x, w, *, axis_name, gather_dimension: int = 0, config: Optional[AgGemmConfig] = None,
            return_gathered: bool = False, x_scale=None, w_scale=None, out_dtype=None, grad_dtype=None,
            grad_scale=None):
    """Fused AllGather + GEMM, called inside jax.shard_map.

    Computes jnp.matmul(jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True), w) with
    fp32 accumulation and the result in x.dtype; with return_gathered=True also returns the
    gathered x.

    Rows layout (gather_dimension a leading or middle dim: sequence parallelism): x [..., M/W, ..., K],
    w [K, N_local] -> [..., M, ..., N_local]. Contraction layout (gather_dimension = -1: activations
    sharded over the hidden dim): x [..., K/W], w [K, N_local] -> [..., N_local].

    Grouped: w a tuple (or list) of weights [K, N_i] (e.g. query, key and value, of any widths) ->
    a tuple of outputs [..., N_i], from one gather of x: the weights are one GEMM over their
    concatenated columns, and the backward is one gemm_rs on all the cotangents.
    config: an AgGemmConfig; default: ag_heuristic_config().

    FP8 (entwine_jax.fp8): with x_scale and w_scale (float32 scalars; a group shares one w_scale)
    computes all_gather(x * x_scale) @ (w * w_scale) on float8_e4m3fn operands (or bf16/fp16/fp32
    ones the op quantises) in out_dtype; each rank's x_scale scales its own block of the gathered x.
    return_gathered returns the gathered FP8 x. Backward as for gemm_rs.
    """
    if fp8.requested(x, w, x_scale, w_scale, out_dtype, grad_dtype, grad_scale):
        return fp8.ag_gemm(x, w, axis_name=axis_name, gather_dimension=gather_dimension, config=config,
                           return_gathered=return_gathered, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                           grad_dtype=grad_dtype, grad_scale=grad_scale)
    if isinstance(w, (tuple, list)):
        return _grouped_ag_gemm(x, tuple(w), axis_name=axis_name, gather_dimension=gather_dimension, config=config,
                                return_gathered=return_gathered)
    return _one_ag_gemm(x, w, axis_name=axis_name, gather_dimension=gather_dimension, config=config,
                        return_gathered=return_gathered)


def _one_ag_gemm(x, w, *, axis_name, gather_dimension, config, return_gathered):
    plan = ag_op.plan(x, w, axis_name=axis_name, gather_dimension=gather_dimension, config=config,
                      return_gathered=return_gathered)
    names = callsite.varying_over(x, w, axis_name=plan.axis_name)
    with jax.named_scope("entwine_ag_gemm"):  # see gemm_rs: the census finds the op's collectives by it
        return _ag_gemm(callsite.make_varying(x, names), callsite.make_varying(w, names), plan)


def _grouped_ag_gemm(x, weights: tuple, *, axis_name, gather_dimension, config, return_gathered):
    # One ag_gemm over the weights' concatenated columns, split after. Differentiating through the
    # concatenation and the split gives the pairing for the group: one gemm_rs on the concatenated
    # cotangents (dx of every weight summed inside the GEMM) and each dw a column block of gathered
    # x.T @ dy. The price is one copy of the weights (and of the cotangents in the backward) per call.
    widths = ag_op.check_group(x, weights)
    with jax.named_scope("entwine_ag_gemm"):
        out = _one_ag_gemm(x, jnp.concatenate(weights, axis=1), axis_name=axis_name,
                           gather_dimension=gather_dimension, config=config, return_gathered=return_gathered)
        y, g = out if return_gathered else (out, None)
        ys = tuple(jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1))
    return (ys, g) if return_gathered else ys
