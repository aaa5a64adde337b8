# The FP8 calls (per-tensor scales) of moe_dispatch_gemm and moe_gemm_combine: the rows travel in
# FP8 (half the bytes of bf16), each source's x_scale beside them; the expert GEMMs multiply the FP8
# values exactly (e4m3 and e5m2 are subsets of bf16) with fp32 accumulation and apply the scales to
# the fp32 sums, as one alpha per 128-row tile would (docs/design.md, "Mixture of experts", "FP8,
# per tensor"); on CUDA the FP8 dispatch and combine kernels do that (dispatch_pool, combine_pool)
# where the plan has them. The custom VJPs keep the pairing: each op's backward is the other on the cotangent
# quantised to e5m2 (or in bf16/fp16 when the caller asks).
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from entwine_jax import callsite, comm, fp8, opspec
from entwine_jax._dot import FP8_EXACT
from entwine_jax.moe import fused, op, reference
from entwine_jax.moe.config import MoeConfig
from entwine_jax.moe.reference import COMBINE, DISPATCH, F32

# The smallest segment moe_transfer moves is 16 bytes: a scale travels as 4 float32 copies.
_SCALE_WORDS = 4


def check(name: str, x, w, x_scale, w_scale, out_dtype, grad_dtype, grad_scale) -> tuple:
    """(x_scale, w_scale, grad_scale, Fp8Call) of an FP8 call of op `name` (fp8.check's rules), per
    tensor only: a scale of any other shape is a ValueError that says so."""
    for arg, s in (("x_scale", x_scale), ("w_scale", w_scale), ("grad_scale", grad_scale)):
        if s is not None and hasattr(s, "shape") and not fp8.is_scalar(s):
            raise ValueError(f"{name}: {arg} must be a float32 scalar (shape () or (1,)): the MoE ops take "
                             f"per-tensor scales only (no block scaling yet), got shape {tuple(s.shape)}")
    return fp8.check(name, x, (w,), x_scale, w_scale, out_dtype, grad_dtype, grad_scale)


def _bf16(v8):
    """FP8 values in bf16, exactly (the barrier keeps XLA from folding a quantise-convert pair away,
    fp8.dequantize's reason)."""
    return jax.lax.optimization_barrier(v8).astype(jnp.bfloat16)


def source_scales(x_scale, plan: op.Plan, shared: bool, name: str):
    """[W] fp32: the x_scale of every source rank, as this rank's experts see them (a shared scale
    is everyone's; else each rank's travels beside its rows: moe_transfer on CUDA)."""
    world = plan.axis_size
    if shared or world == 1:
        return jnp.broadcast_to(x_scale.astype(F32), (world,))
    send = jnp.broadcast_to(x_scale.astype(F32), (plan.num_experts, _SCALE_WORDS))
    # Typed as varying over the axis: a scale the types cannot tell apart moves as each rank's own.
    send = callsite.make_varying(send, comm.axis_tuple(plan.axis_name))
    got = op.to_experts(send, plan, name)  # [E_local, W * 4], every local expert the same
    return got[0].reshape(world, _SCALE_WORDS)[:, 0]


def _scaled_expert_dot(a8, row_scales, w8, w_scale):
    """fp32 [E_local, R, N] = (a8 [E_local, R, K] @ w8 [E_local, K, N]) * row_scales[R] * w_scale:
    the FP8 operands multiplied exactly, the scales applied to the fp32 sums."""
    acc = reference.expert_dot(_bf16(a8), _bf16(w8), precision=FP8_EXACT)
    return acc * row_scales[None, :, None] * w_scale


def _rows_of_sources(scales, rows: int):
    """[W] per-source scales -> one per pool row [W * C] (source-major)."""
    return jnp.repeat(scales, rows // scales.shape[0])


def _dequantized(v8, row_scales):
    """[E_local, R, K] FP8 -> fp32 times each row's scale."""
    return _bf16(v8).astype(F32) * row_scales[None, :, None]


def dispatch_pool(x_send8, scales, w_t8, w_scale, plan: op.Plan, out_dtype, name: str, received=None, sent=None):
    """(y [E_local, W*C, N] in out_dtype, pool [E_local, W*C, K] in x_send8's dtype) of x_send8 [E, C, K]
    (e4m3, or e5m2 for a gradient) with every source's scale `scales` [W], times w_t8 [E_local, N, K]
    (e4m3) and w_scale: the FP8 dispatch kernel where the plan has one, on CUDA (op.dispatch_pool's
    `received` and `sent`); else the moves (op.to_experts) and XLA's GEMM."""
    def apart(x_send8, scales, w_t8, w_scale, move):
        pool8 = move(x_send8)
        rows = _rows_of_sources(scales, pool8.shape[1])
        return _scaled_expert_dot(pool8, rows, jnp.swapaxes(w_t8, 1, 2), w_scale).astype(out_dtype), pool8

    if plan.gemm_call is None:
        return apart(x_send8, scales, w_t8, w_scale, lambda v: op.to_experts(v, plan, name))
    names = callsite.varying_over(x_send8, scales, w_t8, w_scale, axis_name=plan.axis_name)

    def kernel(x_send8, scales, w_t8, w_scale, rows, sent):
        return callsite.typed_like(names, *fused.call_fp8(x_send8, w_t8, scales, w_scale, rows, sent,
                                                          plan.gemm_call, out_dtype))

    xla_move = functools.partial(reference.to_experts, axis_name=plan.axis_name, world=plan.axis_size, op=name)
    return callsite.dispatch(None, lambda *a: apart(*a[:-2], xla_move), kernel, x_send8, scales, w_t8, w_scale,
                             op.kernel_rows(received, plan), op.kernel_sent(sent, plan))


def combine_pool(h8, h_scale, w_t8, w_scale, plan: op.Plan, out_dtype, name: str, received=None):
    """o_recv [E, C, H] in out_dtype at the sources of h8 [E_local, W*C, F] (e4m3, or e5m2 for a
    gradient) with this rank's scale h_scale, times w_t8 [E_local, H, F] (e4m3) and w_scale: the FP8
    combine kernel where the plan has one, on CUDA (the blocks past `received`, the handle's counts,
    neither computed nor sent); else XLA's GEMM, then the rows sent home (op.to_sources)."""
    def apart(h8, h_scale, w_t8, w_scale, move):
        rows = jnp.broadcast_to(h_scale.astype(F32), (h8.shape[1],))
        return move(_scaled_expert_dot(h8, rows, jnp.swapaxes(w_t8, 1, 2), w_scale).astype(out_dtype))

    if plan.combine_call is None:
        return apart(h8, h_scale, w_t8, w_scale, lambda v: op.to_sources(v, plan, name))
    names = callsite.varying_over(h8, h_scale, w_t8, w_scale, axis_name=plan.axis_name)

    def kernel(h8, h_scale, w_t8, w_scale, rows):
        return callsite.typed_like(names, fused.call_combine_fp8(h8, w_t8, h_scale, w_scale, rows, plan.combine_call,
                                                                 plan.axis_size, out_dtype))

    xla_move = functools.partial(reference.to_sources, axis_name=plan.axis_name, world=plan.axis_size, op=name)
    return callsite.dispatch(None, lambda *a: apart(*a[:-1], xla_move), kernel, h8, h_scale, w_t8, w_scale,
                             op.kernel_rows(received, plan))


def _cotangent(dy, gs, call: fp8.Fp8Call):
    """(dy in the backward's dtype, its scale): e5m2 with gs or this rank's current scale, or dy as
    it is (scale 1) when the caller asked for a bf16/fp16 backward."""
    if call.fp8_grads:
        return fp8.quantized_cotangent(dy, gs)
    return dy.astype(call.grad_dtype), jnp.float32(1.0)


def _no_scale_grads(*scales) -> tuple:
    """The scales' cotangents: zero (a scale is a constant of the recipe, as in Flax's FP8)."""
    return tuple(None if s is None else jnp.zeros_like(s) for s in scales)


# --- moe_dispatch_gemm ------------------------------------------------------------------------------


def _dispatch_forward(x, w1, xs, ws, handle, plan, call, shared):
    x8, w8 = fp8.quantize(x, xs), fp8.quantize(w1, ws)
    src = source_scales(xs, plan, shared, DISPATCH)
    # The e4m3 rows move; the kernel reads w K-major (w_t, a transposed copy per call).
    y, pool8 = dispatch_pool(op.send_rows(x8, handle, plan), src, jnp.swapaxes(w8, 1, 2), ws, plan, call.out_dtype,
                             DISPATCH, handle.received, handle.sent)
    return y, (pool8, _rows_of_sources(src, pool8.shape[1]), w8, ws)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _dispatch(x, w1, xs, ws, gs, handle, plan, call, shared):
    return _dispatch_forward(x, w1, xs, ws, handle, plan, call, shared)[0]


def _dispatch_fwd(x, w1, xs, ws, gs, handle, plan, call, shared):
    y, (pool8, rows, w8, ws_) = _dispatch_forward(x, w1, xs, ws, handle, plan, call, shared)
    return y, (pool8, rows, w8, ws_, xs, gs, handle)


def _dispatch_bwd(plan, call, shared, res, dy):
    pool8, rows, w8, ws, xs, gs, handle = res
    # dy on the rows no slot took is the caller's activation's (inf or NaN where its slope at y's
    # zeros is): zero there before it enters dy's current scale or dw1 (op._dispatch_bwd's reason).
    taken = op.taken_rows(pool8, handle.received, plan.axis_size)
    if call.fp8_grads and gs is None:
        gs = fp8.current_scale(jnp.where(taken, dy, jnp.zeros((), dy.dtype)), fp8.E5M2)
    # Told by values, a taken row of zeros (a token of zeros, or one under e4m3's smallest value) looks
    # untaken: on_taken_rows keeps its dy, quantised with the taken rows' scale, since dx reads it.
    g8, g_scale = _cotangent(op.on_taken_rows(dy, taken, handle.received), gs, call)
    # dx: a combine of dy with w1^T on the expert side (the FP8 product, scaled), rows home in the
    # backward's dtype, summed with unit weights (copying x[t] to k rows sums their gradients).
    # The FP8 combine (kernel) of e5m2 rows times w1^T (w1 [E_local, H, N] is that GEMM's w_t); a
    # bf16/fp16 backward has no kernel of its own here (the plan's combine call is the FP8 one).
    kernel_plan = plan if call.fp8_grads else dataclasses.replace(plan, combine_call=None)
    o_recv = combine_pool(g8, g_scale, w8, ws, kernel_plan, call.backward_dtype, COMBINE, handle.received)
    dx = reference.from_segments(o_recv, jnp.ones(handle.expert.shape, F32), handle)
    # dw1[e] = pool[e]^T dy[e] from the dequantised operands (rows no slot took are zero): the
    # weight-gradient kernel over the rows received (operands in the output dtype), or XLA's in fp32.
    dw1 = op.weight_grad(_dequantized(pool8, rows), _bf16(g8).astype(F32) * g_scale, plan, handle.received, F32)
    return (fp8.cotangent(dx, call.x_dtype), fp8.cotangent(dw1, call.w_dtype)) + _no_scale_grads(xs, ws, gs) + (None,)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def dispatch(x, topk_idx, w1, *, axis_name, config: Optional[MoeConfig], x_scale, w_scale, out_dtype, grad_dtype,
             grad_scale):
    """moe_dispatch_gemm's FP8 call: (y [E_local, W*C, N] in out_dtype, handle)."""
    xs, ws, gs, call = check(DISPATCH, x, w1, x_scale, w_scale, out_dtype, grad_dtype, grad_scale)
    fp8.check_scales(DISPATCH, (("x", x, xs), ("w1", w1, ws)))
    plan = op.plan_dispatch(opspec.RoutedInput(x, topk_idx), w1, axis_name=axis_name, config=config,
                            out_dtype=call.out_dtype)
    shared = fp8.shared_over(xs, x, plan.axis_name)
    names = callsite.varying_over(x, topk_idx, w1, axis_name=plan.axis_name)
    x, topk_idx, w1 = (callsite.make_varying(v, names) for v in (x, topk_idx, w1))
    with jax.named_scope(op.DISPATCH_SPEC.scope):
        handle = op.layout(topk_idx, plan)
        return _dispatch(x, w1, xs, ws, gs, handle, plan, call, shared), handle


# --- moe_gemm_combine -------------------------------------------------------------------------------


def _combine_forward(h, w2, weights, hs, ws, handle, plan, call):
    h8, w8 = fp8.quantize(h, hs), fp8.quantize(w2, ws)
    rows = jnp.broadcast_to(hs.astype(F32), (h8.shape[1],))
    # The rows travel in out_dtype; the kernel reads w2 K-major (w2_t, a transposed copy per call).
    o_recv = combine_pool(h8, hs, jnp.swapaxes(w8, 1, 2), ws, plan, call.out_dtype, COMBINE, handle.received)
    out = reference.from_segments(o_recv, weights, handle).astype(call.out_dtype)
    return out, (h8, rows, w8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _combine(h, w2, weights, hs, ws, gs, handle, plan, call):
    return _combine_forward(h, w2, weights, hs, ws, handle, plan, call)[0]


def _combine_fwd(h, w2, weights, hs, ws, gs, handle, plan, call):
    out, (h8, rows, w8) = _combine_forward(h, w2, weights, hs, ws, handle, plan, call)
    return out, (h8, rows, w8, weights, hs, ws, gs, handle)


def _combine_bwd(plan, call, res, dout):
    h8, rows, w8, weights, hs, ws, gs, handle = res
    # dout quantised where the tokens are (each rank its own scale), its rows dispatched in the
    # handle's layout (FP8 rows move, their scale beside them), times w2^T on the expert side.
    d8, d_scale = _cotangent(dout, gs, call)
    shared = fp8.shared_over(d_scale, dout, plan.axis_name)  # e.g. 1 for a bf16 backward
    d_src = source_scales(d_scale, plan, shared, DISPATCH)
    d_rows = _rows_of_sources(d_src, plan.axis_size * plan.capacity)
    send = op.send_rows(d8, handle, plan)
    if call.fp8_grads:
        # The FP8 dispatch (kernel) of e5m2 rows times w2^T: w2 [E_local, F, H] is that GEMM's w_t.
        g, pool8 = dispatch_pool(send, d_src, w8, ws, plan, call.out_dtype, DISPATCH, handle.received, handle.sent)
        g = g.astype(F32)
    else:
        pool8 = op.to_experts(send, plan, DISPATCH)
        g = _scaled_expert_dot(pool8, d_rows, jnp.swapaxes(w8, 1, 2), ws)
    # The router weights travel beside the rows (a dispatch's transfer): [E, C] -> [E_local, W*C, 1].
    w_send = reference.to_segments(weights.astype(F32), handle, num_experts=plan.num_experts, capacity=plan.capacity)
    w_pool = op.to_experts(w_send, plan, DISPATCH)[..., None]
    h32 = _dequantized(h8, rows)
    dh = w_pool * g
    # h's rows no slot took never enter the forward, nor dw2 (op._combine_bwd's reason).
    h_used = op.on_taken_rows(h32, w_pool != 0, handle.received)
    dw2 = op.weight_grad(h_used, w_pool * _dequantized(pool8, d_rows), plan, handle.received, F32)
    # The router weights' gradient <dout[t], o row> = <g, h> per row, sent home (the combine's transfer).
    dw_recv = op.to_sources(jnp.sum(g * h32, axis=-1), plan, COMBINE)  # [E, C]
    sent = handle.expert >= 0
    dweights = jnp.where(sent, dw_recv[jnp.maximum(handle.expert, 0), jnp.maximum(handle.place, 0)], 0.0)
    return ((fp8.cotangent(dh, call.x_dtype), fp8.cotangent(dw2, call.w_dtype), dweights.astype(weights.dtype))
            + _no_scale_grads(hs, ws, gs) + (None,))


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(h, w2, topk_weights, handle, *, axis_name, config: Optional[MoeConfig], x_scale, w_scale, out_dtype,
            grad_dtype, grad_scale):
    """moe_gemm_combine's FP8 call (x_scale scales h): out [T, H] in out_dtype."""
    hs, ws, gs, call = check(COMBINE, h, w2, x_scale, w_scale, out_dtype, grad_dtype, grad_scale)
    fp8.check_scales(COMBINE, (("h", h, hs), ("w2", w2, ws)))
    plan = op.plan_combine(opspec.RoutedInput(h, weights=topk_weights, handle=handle), w2, axis_name=axis_name,
                           config=config, out_dtype=call.out_dtype)
    names = callsite.varying_over(h, w2, topk_weights, axis_name=plan.axis_name)
    h, w2, topk_weights = (callsite.make_varying(v, names) for v in (h, w2, topk_weights))
    handle = jax.tree.map(lambda v: callsite.make_varying(v, names), handle)
    with jax.named_scope(op.COMBINE_SPEC.scope):
        return _combine(h, w2, topk_weights, hs, ws, gs, handle, plan, call)
