# The pairing of every op with its backward, in bf16/fp16 and in FP8: one custom VJP each, driven by
# the ops' contracts (entwine_jax.opspec). An op's dx is its backward op (spec.backward) on (dy, w.T)
# in the same layout; whichever of the two gathers (spec.gathers) hands its gathered operand to dw,
# the forward's gathered x kept as the residual or the backward's gathered dy. An op that gathers
# may take a group of weights (w a tuple, one output each): its dx is the backward op on the
# cotangents and weights joined side by side. docs/design.md, "The pairing" and "FP8".
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import callsite, fp8, registry
from entwine_jax._dot import dot_by_source, matmul_weight_grad


def call(name: str, x, w, *, axis_name, dimension, config, return_gathered: bool = False):
    """The op `name` (bf16/fp16/fp32 operands), differentiable, inside jax.shard_map: plan the call,
    type its operands, and run it under the op's name scope. w: one weight, or for an op that
    gathers a tuple of weights (a group: a tuple of outputs)."""
    op = registry.OPS[name]
    if op.routed:  # its operands are not (x, w): its own package pairs it (opspec.OpSpec)
        raise ValueError(f"pairing.call: {name} is a routed op; call it through its public function")
    plan = op.plan(x, w, axis_name=axis_name, dimension=dimension, config=config, return_gathered=return_gathered)
    names = callsite.varying_over(x, w, axis_name=plan.axis_name)
    # The scope names every operation of the call (forward and backward) in the program's metadata,
    # which is how a collective census tells the op's collectives from XLA's own.
    with jax.named_scope(op.scope):
        return _paired(callsite.make_varying(x, names), _varying(w, names), name, plan)


def _varying(w, names):
    return jax.tree.map(lambda v: callsite.make_varying(v, names), w)


def _joined(dy, w):
    """A group's cotangents and weights side by side ([..., sum of N_i], [K, sum of N_i]) and their
    widths; one weight's as they are (widths None). The price: a copy of each per backward call."""
    if not isinstance(w, tuple):
        return dy, w, None
    return jnp.concatenate(dy, axis=-1), jnp.concatenate(w, axis=1), [v.shape[1] for v in w]


def _split(dw, widths):
    """dw of the joined weights as the group's (widths: _joined's); None (FP8 weights, constants to
    differentiation) is None for each weight of a group."""
    if widths is None:
        return dw
    if dw is None:
        return (None,) * len(widths)
    return tuple(jnp.split(dw, np.cumsum(widths)[:-1].tolist(), axis=1))


def _zero_grads(op, plan, x, w, x_dtype, w_dtype):
    """(dx, dw) of a call whose output is empty (N = 0, or an empty dim of x): zeros. The backward op
    would contract or scatter the empty dim, which the ops refuse (XLA cannot lower it), and an FP8
    cotangent has no current scale. x: the residual operand (gathered where the forward gathers: dx
    has this rank's shard of its gathered dim); w: the weight, a group's joined."""
    shape = list(x.shape)
    if op.gathers:
        shape[plan.dimension] //= plan.axis_size
    names = callsite.varying_over(x, w, axis_name=plan.axis_name)
    return (callsite.make_varying(jnp.zeros(shape, x_dtype), names),
            callsite.make_varying(jnp.zeros(w.shape, w_dtype), names))


def call_fp8(name: str, x, w, x_scale, w_scale, grad_scale, fp8_call: fp8.Fp8Call, *, axis_name, dimension, config,
             return_gathered: bool = False, shared_scale: bool = False):
    """The op `name`'s FP8 call (its arguments checked by entwine_jax.fp8.check), differentiable;
    shared_scale: x_scale is the same on every rank (fp8.shared_over)."""
    op = registry.OPS[name]
    x8_aval = jax.ShapeDtypeStruct(tuple(x.shape), fp8.E4M3)
    w8_aval = jax.tree.map(lambda v: jax.ShapeDtypeStruct(tuple(v.shape), fp8.E4M3), w)
    plan = op.plan(x8_aval, w8_aval, axis_name=axis_name, dimension=dimension, config=config,
                   return_gathered=return_gathered, out_dtype=fp8_call.out_dtype, shared_scale=shared_scale,
                   block_scaled=fp8_call.block)
    names = callsite.varying_over(x, w, axis_name=plan.axis_name)
    with jax.named_scope(op.scope):  # as in call()
        return _paired_fp8(callsite.make_varying(x, names), _varying(w, names), x_scale, w_scale,
                           grad_scale, name, plan, fp8_call)


def _backward_config(plan, back, dy, w_t):
    """The backward op's config: XLA after an XLA forward; a forward the user forced onto the kernels
    keeps its backward there (the small-call rule of path "auto" must not move it to XLA), with the
    config the backward would choose itself; else the backward's own choice (None)."""
    if plan.config.path == "xla":
        return back.config_type(path="xla")
    if plan.config.path == "fused":
        config, _ = back.default_config(dy, w_t, plan.axis_size, plan.dimension)
        return dataclasses.replace(config, path="fused")
    return None


# --- bf16 / fp16 (and fp32 on the XLA path) -------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _paired(x, w, name, plan):
    # Without differentiation only what the caller asked for is computed: a forward-only call never
    # writes the gathered operand.
    return registry.OPS[name].forward(x, w, plan, gathered=plan.return_gathered)


def _paired_fwd(x, w, name, plan):
    op = registry.OPS[name]
    if not op.gathers:
        return op.forward(x, w, plan), (x, w)
    y, g = op.forward(x, w, plan, gathered=True)
    return ((y, g) if plan.return_gathered else y), (g, w)


def _paired_bwd(name, plan, res, cotangents):
    op = registry.OPS[name]
    back = registry.backward_of(op)
    x, w = res  # x: the forward's operand, or its gathered operand where the forward gathers
    # Only a call that returns the gathered operand has its cotangent (JAX passes zeros when that
    # output is unused: one reduce-scatter of zeros, so return it only where it is needed).
    dys, dg = cotangents if plan.return_gathered else (cotangents, None)
    dy, w, widths = _joined(dys, w)
    if dy.size == 0:
        dx, dw = _zero_grads(op, plan, x, w, x.dtype, w.dtype)
        if dg is not None:  # the returned gathered operand's cotangent still reaches x
            dx = dx + jax.lax.psum_scatter(dg, plan.axis_name, scatter_dimension=plan.dimension,
                                           tiled=True).astype(dx.dtype)
        return dx, _split(dw, widths)
    if plan.config.path == "xla" and op.reference_backward is not None:
        dx, dw = op.reference_backward(x, w, dy, axis_name=plan.axis_name, dimension=plan.dimension)
        return dx, _split(dw, widths)
    config = _backward_config(plan, back, dy, w.T)
    if back.gathers:
        # The backward of a reduce-scatter is an all-gather: dx = all_gather(dy) @ w.T, whose gathered
        # dy serves dw = x.T @ g.
        dx, g = call(back.name, dy, w.T, axis_name=plan.axis_name, dimension=plan.dimension, config=config,
                     return_gathered=True)
        return dx, matmul_weight_grad(x, g, w.dtype)
    # The backward of an all-gather is a reduce-scatter of dy @ w.T over the gathered dim; the
    # gathered x serves dw.
    dx = call(back.name, dy, w.T, axis_name=plan.axis_name, dimension=plan.dimension, config=config)
    # A cotangent of the returned gathered operand reduce-scatters onto x too.
    if dg is not None:
        dx = dx + jax.lax.psum_scatter(dg, plan.axis_name, scatter_dimension=plan.dimension,
                                       tiled=True).astype(dx.dtype)
    # A group's dw_i from its own cotangent: one GEMM each, where a joined dw would be split (a copy).
    return dx, jax.tree.map(lambda d: matmul_weight_grad(x, d, w.dtype), dys)


_paired.defvjp(_paired_fwd, _paired_bwd)


# --- FP8 ------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _paired_fp8(x, w, x_scale, w_scale, grad_scale, name, plan, fp8_call):
    out = registry.OPS[name].forward_fp8(fp8.quantize(x, x_scale), _quantized(w, w_scale), x_scale, w_scale, plan,
                                         gathered=plan.return_gathered)
    return out[:2] if plan.return_gathered else out


def _paired_fp8_fwd(x, w, x_scale, w_scale, grad_scale, name, plan, fp8_call):
    op = registry.OPS[name]
    x8, w8 = fp8.quantize(x, x_scale), _quantized(w, w_scale)
    # The FP8 operands are the residuals (one byte per element of x kept for dw): x8 and its scale,
    # or where the forward gathers, the gathered x8 and its sources' scales.
    if not op.gathers:
        return op.forward_fp8(x8, w8, x_scale, w_scale, plan), (x8, x_scale, w8, w_scale, grad_scale)
    y, g8, g_scales = op.forward_fp8(x8, w8, x_scale, w_scale, plan, gathered=True)
    return ((y, g8) if plan.return_gathered else y), (g8, g_scales, w8, w_scale, grad_scale)


def _paired_fp8_bwd(name, plan, fp8_call, res, cotangents):
    back = registry.backward_of(registry.OPS[name])
    x8, x_scales, w8, ws, grad_scale = res
    # The returned gathered operand is FP8, a constant to differentiation: its cotangent is dropped.
    dy = cotangents[0] if plan.return_gathered else cotangents
    dy, w8, widths = _joined(dy, w8)
    dim = plan.dimension
    lead = tuple(range(x8.ndim - 1))
    if dy.size == 0:
        dx, dw = _zero_grads(registry.OPS[name], plan, x8, w8, jnp.float32, jnp.float32)
    elif not fp8_call.fp8_grads:
        # The backward in bf16/fp16 on the dequantised weight and operand: the backward op in that dtype.
        dtype = jnp.dtype(fp8_call.grad_dtype)
        dy, w_t = dy.astype(dtype), fp8.dequantize(w8, ws, dtype).T
        config = _backward_config(plan, back, dy, w_t)
        back_plan = back.plan(dy, w_t, axis_name=plan.axis_name, dimension=dim, config=config,
                              return_gathered=back.gathers)
        if back.gathers:
            dx, g = back.forward(dy, w_t, back_plan, gathered=True)
            dw = matmul_weight_grad(fp8.dequantize(x8, x_scales, dtype), g, dtype)
        else:
            dx = back.forward(dy, w_t, back_plan)
            dw = matmul_weight_grad(fp8.dequantize_by_source(x8, x_scales, dim, dtype, plan.axis_size), dy, dtype)
    elif fp8_call.block:
        dx, dw = _block_scaled_bwd(back, plan, fp8_call, x8, x_scales, w8, ws, dy)
    else:
        # dx: the backward op in FP8 on e5m2 dy (each rank's block or partial scaled by its own grad
        # scale) and the e4m3 weight.
        # A backward that gathers over the contracted dimension (a forward scatter over the last one)
        # takes one dy scale on every rank by default (the current scale over the axis): the kernels'
        # shared-scale loop, faster than their per-slice one.
        contracted = back.gathers and dim == dy.ndim - 1
        d8, gs = fp8.quantized_cotangent(dy, grad_scale, plan.axis_name if contracted else None)
        # The config of the e5m2 operand: the FP8 kernels' blocks are 128 wide only.
        config = _backward_config(plan, back, d8, w8.T)
        back_plan = back.plan(d8, w8.T, axis_name=plan.axis_name, dimension=dim, config=config,
                              return_gathered=back.gathers, out_dtype=fp8_call.backward_dtype,
                              shared_scale=fp8.shared_over(gs, d8, plan.axis_name))
        if back.gathers:
            dx, g8, g_scales = back.forward_fp8(d8, w8.T, gs, ws, back_plan, gathered=True)
            # dw.T = g.T @ x: g's gathered dim carries the sources' scales (contracted in the rows layout).
            dw = dot_by_source(g8, x8, ((lead, lead), ((), ())), dim, g_scales).T * x_scales
        else:
            dx = back.forward_fp8(d8, w8.T, gs, ws, back_plan)
            # dw = gathered x.T @ dy from the gathered FP8 operand.
            dw = dot_by_source(x8, d8, ((lead, lead), ((), ())), dim, x_scales) * gs
    return fp8.cotangent(dx, fp8_call.x_dtype), _split(fp8.cotangent(dw, fp8_call.w_dtype), widths), None, None, None


def _block_scaled_bwd(back, plan, fp8_call, x8, x_scales, w8, ws, dy):
    """(dx, dw) of a block-scaled call: dx the backward op on dy quantised to e5m2 per 1x128 tile of its
    last dim (the dx GEMM's contracted one; each rank's own scales, which travel with its tiles) and
    w8.T with its 128x128 scales transposed; dw by XLA on the dequantised operands in fp32 (its
    contraction runs over the rows, along which both operands' scales vary, so no FP8 dot can take
    them out of its sum)."""
    dim, world = plan.dimension, plan.axis_size
    lead = tuple(range(x8.ndim - 1))
    d8, gs = fp8.quantize_1x128(dy, fp8.E5M2)
    config = _backward_config(plan, back, d8, w8.T)
    back_plan = back.plan(d8, w8.T, axis_name=plan.axis_name, dimension=dim, config=config,
                          return_gathered=back.gathers, out_dtype=fp8_call.backward_dtype, block_scaled=True)
    if back.gathers:
        dx, g8, g_scales = back.forward_fp8(d8, w8.T, gs, ws.T, back_plan, gathered=True)
        x, g = fp8.dequantize(x8, x_scales), fp8.dequantize_by_source(g8, g_scales, dim, jnp.float32, world)
    else:
        dx = back.forward_fp8(d8, w8.T, gs, ws.T, back_plan)
        x, g = fp8.dequantize_by_source(x8, x_scales, dim, jnp.float32, world), fp8.dequantize(d8, gs)
    dw = jax.lax.dot_general(x, g, ((lead, lead), ((), ())), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    return dx, dw


_paired_fp8.defvjp(_paired_fp8_fwd, _paired_fp8_bwd)


def _quantized(w, w_scale):
    """w (one weight or a group, sharing w_scale) in e4m3."""
    return jax.tree.map(lambda v: fp8.quantize(v, w_scale), w)
