# FP8 calls of both ops: y = (x * x_scale) @ (w * w_scale) on float8_e4m3fn operands with per-tensor fp32
# scales, accumulated in fp32, written in bf16 or fp16. The checks of an FP8 call, the quantisation helpers,
# and the custom VJPs that keep the pairing in FP8: each op's backward is the other op on the cotangent
# quantised to float8_e5m2 with its own scale (the hybrid recipe; the kernels run it fused, e5m2 x
# e4m3), or in bf16/fp16 when the caller asks. docs/design.md, "FP8".
"""FP8 calls of ``entwine_jax.gemm_rs`` and ``entwine_jax.ag_gemm``.

An FP8 call passes ``x_scale`` and ``w_scale`` (float32 scalars, shape ``()`` or ``(1,)``) and computes
``(x * x_scale) @ (w * w_scale)`` with fp32 accumulation, the reduce-scatter of gemm_rs summed in fp32,
the result in ``out_dtype`` (bfloat16 or float16). The operands are either

* float8_e4m3fn arrays, already quantised (``x = quantize(x_hp, x_scale)``): constants to
  differentiation (their cotangent is zero, as for quantised values in Flax's FP8 recipe); or
* bfloat16 / float16 / float32 arrays, which the op quantises to e4m3 with the given scales
  (``clip(v / scale, -448, 448)``); their gradients pass straight through the quantisation (the
  derivative of the quantise-dequantise pair taken as the identity, as Flax does) and come back in
  the operands' dtypes.

Scales are dequantisation factors (Flax's convention): ``current_scale(v)`` gives ``amax(|v|) / 448``.
A scale in the reciprocal convention (``448 / amax``) loses the operand (its quantised values all below
1): caught at trace time where values are concrete, and in traced programs under
``ENTWINE_CHECK_FP8_SCALES=1`` (``check_scales``: a ``jax.debug.callback`` raising when the program runs).
Inside ``shard_map`` each rank may hold its own ``x_scale`` (current scaling of its shard): gemm_rs
scales each rank's partial product by that rank's scales before the sum; ag_gemm scales each gathered
block (rows, or a K slice in the contraction layout) by its source's scale, which travels with the
shard. An ``x_scale`` that shard_map's types show to be the same on every rank (not varying over the
axis while x is) is a shared scale (delayed scaling): the kernels use their own and nothing travels.

Backward: the cotangent dy is quantised to ``grad_dtype`` float8_e5m2 (default) with ``grad_scale``
(default: each rank's current scale of its own dy), then dx is the other op in FP8 (gemm_rs's dx an
ag_gemm of e5m2 dy and the e4m3 weight, ag_gemm's dx a gemm_rs) and dw a dot of the gathered FP8
operand. Where the forward runs on the fused kernels, so does this backward: the FP8 kernels take an
e5m2 x with an e4m3 weight (e5m2 x e4m3). ``grad_dtype`` bfloat16 or float16 runs the backward in
that dtype on the dequantised FP8 operands (the bf16/fp16 kernels where the forward is fused).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import callsite
from entwine_jax._dot import dot_by_source, matmul_weight_grad
from entwine_jax.ag_gemm import op as ag_op
from entwine_jax.ag_gemm.config import AgGemmConfig
from entwine_jax.gemm_rs import op as rs_op
from entwine_jax.gemm_rs.config import GemmRsConfig

__all__ = ["E4M3", "E5M2", "quantize", "dequantize", "current_scale"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)  # activations and weights
E5M2 = jnp.dtype(jnp.float8_e5m2)  # gradients: more range, less precision
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HIGH_DTYPES = OUT_DTYPES + (jnp.dtype(jnp.float32),)


def quantize(v, scale, dtype=E4M3):
    """v / scale rounded to the FP8 `dtype`, clipped to its largest finite value (fp32 arithmetic);
    `v` already in `dtype` is returned as it is."""
    dtype = jnp.dtype(dtype)
    if v.dtype == dtype:
        return v
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(v.astype(jnp.float32) / jnp.reshape(scale, ()).astype(jnp.float32), -largest,
                    largest).astype(dtype)


def dequantize(v8, scale, dtype):
    """v8 * scale in `dtype`. The barrier keeps the FP8 rounding: where v8 = quantize(v) in the same
    program, XLA's GPU simplifier (allowed excess precision) would otherwise fold the f32 -> FP8 -> f32
    converts away and compute with v itself, off the recipe by FP8's rounding (2.6% on one H200)."""
    v8 = jax.lax.optimization_barrier(v8)
    return (v8.astype(jnp.float32) * jnp.reshape(scale, ()).astype(jnp.float32)).astype(dtype)


def current_scale(v, dtype=E4M3):
    """The scale that maps amax(|v|) onto the largest finite value of the FP8 `dtype` (float32, shape
    ()); 1 where v is all zeros (any scale represents it) or not finite (no scale does)."""
    amax = jnp.max(jnp.abs(v)).astype(jnp.float32)
    scale = amax / float(jnp.finfo(dtype).max)
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, jnp.float32(1.0))


@dataclasses.dataclass(frozen=True)
class Fp8Call:
    """The static part of an FP8 call (hashable, a custom_vjp nondiff argument)."""
    out_dtype: str
    grad_dtype: str  # float8_e5m2, or the bf16/fp16 dtype the backward runs in
    x_dtype: str  # the operands as passed: their cotangents' dtypes (FP8 operands get none)
    w_dtype: str

    @property
    def fp8_grads(self) -> bool:
        return jnp.dtype(self.grad_dtype) == E5M2


def requested(x, w, *fp8_arguments) -> bool:
    """Whether a call is an FP8 call: an FP8 operand (w: one weight or a group) or any FP8 argument given."""
    operands = (x, *w) if isinstance(w, (tuple, list)) else (x, w)
    return (any(getattr(v, "dtype", None) in (E4M3, E5M2) for v in operands)
            or any(a is not None for a in fp8_arguments))


def _scale(op: str, name: str, s):
    """s as a float32 scalar of shape (); ValueError unless it is one (shape () or (1,))."""
    if not (hasattr(s, "shape") and hasattr(s, "dtype")):
        raise ValueError(f"{op}: {name} must be a float32 scalar array (shape () or (1,)), got {type(s).__name__}")
    if jnp.dtype(s.dtype) != jnp.float32 or tuple(s.shape) not in ((), (1,)):
        raise ValueError(f"{op}: {name} must be a float32 scalar array (shape () or (1,)), got "
                         f"{jnp.dtype(s.dtype).name}{list(s.shape)}")
    return jnp.reshape(s, ())


def _operand_dtype(op: str, name: str, v) -> jnp.dtype:
    if not (hasattr(v, "shape") and hasattr(v, "dtype")):
        raise ValueError(f"{op}: {name} must be an array, got {type(v).__name__}")
    dtype = jnp.dtype(v.dtype)
    if dtype == E5M2:
        raise ValueError(f"{op}: {name} is float8_e5m2, the FP8 forward takes float8_e4m3fn (e5m2 is the format of "
                         f"the gradients, which the backward quantises itself)")
    if dtype != E4M3 and dtype not in HIGH_DTYPES:
        raise ValueError(f"{op}: {name}.dtype must be float8_e4m3fn (quantised) or bfloat16, float16 or float32 (the "
                         f"op quantises it with its scale) in an FP8 call, got {dtype}")
    return dtype


def check(op: str, x, weights: tuple, x_scale, w_scale, out_dtype, grad_dtype, grad_scale):
    """ValueError for an FP8 call that cannot run; returns (x_scale, w_scale, grad_scale) as float32
    scalars (grad_scale None: current scaling) and the call's Fp8Call."""
    if x_scale is None or w_scale is None:
        raise ValueError(f"{op}: an FP8 call (float8 operands, or out_dtype / grad_dtype / grad_scale given) needs "
                         f"both x_scale and w_scale, got x_scale={'None' if x_scale is None else 'an array'} and "
                         f"w_scale={'None' if w_scale is None else 'an array'}")
    x_dtype = _operand_dtype(op, "x", x)
    w_dtypes = {_operand_dtype(op, f"w[{i}]" if len(weights) > 1 else "w", w) for i, w in enumerate(weights)}
    if len(w_dtypes) > 1:
        raise ValueError(f"{op}: the weights of a group must share one dtype, got {sorted(d.name for d in w_dtypes)}")
    w_dtype = w_dtypes.pop()
    if (x_dtype == E4M3) != (w_dtype == E4M3):
        raise ValueError(f"{op}: mixed FP8 and high-precision operands (x {x_dtype}, w {w_dtype}): pass both "
                         f"quantised (float8_e4m3fn) or both in high precision (the op quantises them)")
    if isinstance(w_scale, (tuple, list)):
        raise ValueError(f"{op}: w_scale must be one float32 scalar; a group of weights shares one scale (quantise "
                         f"them together: current_scale of all of them)")
    xs, ws = _scale(op, "x_scale", x_scale), _scale(op, "w_scale", w_scale)
    if out_dtype is None:
        out_dtype = x_dtype if x_dtype in OUT_DTYPES else jnp.dtype(jnp.bfloat16)
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be bfloat16 or float16, got {jnp.dtype(out_dtype).name}")
    grad_dtype = E5M2 if grad_dtype is None else jnp.dtype(grad_dtype)
    if grad_dtype not in (E5M2,) + OUT_DTYPES:
        raise ValueError(f"{op}: grad_dtype must be float8_e5m2 (the hybrid recipe), bfloat16 or float16, got "
                         f"{grad_dtype.name}")
    gs = None
    if grad_scale is not None:
        if grad_dtype != E5M2:
            raise ValueError(f"{op}: grad_scale scales float8_e5m2 gradients; grad_dtype is {grad_dtype.name}")
        gs = _scale(op, "grad_scale", grad_scale)
    call = Fp8Call(out_dtype=jnp.dtype(out_dtype).name, grad_dtype=grad_dtype.name, x_dtype=x_dtype.name,
                   w_dtype=w_dtype.name)
    return xs, ws, gs, call


def _scale_problem(op: str, name: str, largest) -> Optional[str]:
    """The message for an operand whose quantised values all lie below 1, less than 1/448 of e4m3's
    range (most of them subnormal or zero: the output is lost, nearly zero for small operands), or
    None. largest: max |v / scale| of the operand. A scale in the reciprocal convention gives
    amax^2 / 448 there, below 1 for any amax under 21; a right one gives 448 (or a little less
    with a delayed scale)."""
    if not largest < 1.0:
        return None
    return (f"{op}: {name} quantises to FP8 values that all lie below 1 (largest |{name} / scale| is "
            f"{float(largest):.3g}; amax / scale = 448 is expected), most of them subnormal or zero: the output "
            f"is lost. "
            f"Scales here are dequantisation factors, amax / 448 (fp8.current_scale); a scale in the reciprocal "
            f"convention, 448 / amax, as some libraries pass it, does this: pass 1 / scale")


def check_scales(op: str, operands: tuple) -> None:
    """Catch FP8 scales that zero the output (module docstring: scales are amax / 448). operands:
    ((name, high-precision operand, its scale), ...); operands already in FP8 carry no evidence and
    are skipped. Concrete values are checked now (ValueError); traced ones only under
    ENTWINE_CHECK_FP8_SCALES=1, by a jax.debug.callback that raises when the program runs (one more
    max-reduction per operand, so off by default)."""
    debug = os.environ.get("ENTWINE_CHECK_FP8_SCALES", "") not in ("", "0")
    for name, v, scale in operands:
        if jnp.dtype(v.dtype) == E4M3:
            continue
        concrete = not isinstance(v, jax.core.Tracer) and not isinstance(scale, jax.core.Tracer)
        if not (concrete or debug):
            continue
        largest = jnp.max(jnp.abs(v.astype(jnp.float32))) / jnp.reshape(scale, ()).astype(jnp.float32)
        # An all-zero operand quantises to zeros with any scale: nothing to report.
        largest = jnp.where(jnp.max(jnp.abs(v)) > 0, largest, jnp.float32(jnp.inf))
        if concrete:
            if problem := _scale_problem(op, name, float(largest)):
                raise ValueError(problem)
            continue

        def raise_if_zeroed(value, name=name):
            if problem := _scale_problem(op, name, float(value)):
                raise ValueError(problem)

        jax.debug.callback(raise_if_zeroed, largest)


def shared_over(scale, x, axis_name) -> bool:
    """Whether shard_map's types show `scale` to be the same on every rank of axis_name: it does not
    vary over the axis while x does. Without type checks (check_vma=False) nothing varies, nothing is
    known, and the scale counts as each rank's own."""
    varying_x, varying_s = callsite.varying_axes(x), callsite.varying_axes(scale)
    return all(a in varying_x and a not in varying_s for a in callsite.axis_names(axis_name))


def _cotangent(v, dtype: str):
    """A gradient for an operand passed as `dtype`: FP8 operands are constants (zero cotangent)."""
    return None if jnp.dtype(dtype) == E4M3 else v.astype(dtype)


def _backward_dtype(call: Fp8Call) -> jnp.dtype:
    """The dtype the backward op writes dx in: the operand's when the kernels can write it."""
    return jnp.dtype(call.x_dtype) if jnp.dtype(call.x_dtype) in OUT_DTYPES else jnp.dtype(call.out_dtype)


def _quantized_cotangent(dy, grad_scale):
    """(dy in e5m2, its scale): grad_scale, or this rank's current scale of its own dy."""
    gs = current_scale(dy, E5M2) if grad_scale is None else grad_scale
    return quantize(dy, gs, E5M2), gs


def _lead_dims(v) -> tuple:
    return tuple(range(v.ndim - 1))


# --- gemm_rs --------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gemm_rs_fp8(x, w, x_scale, w_scale, grad_scale, plan, call):
    return rs_op.forward_fp8(quantize(x, x_scale), quantize(w, w_scale), x_scale, w_scale, plan)


def _gemm_rs_fp8_fwd(x, w, x_scale, w_scale, grad_scale, plan, call):
    x8, w8 = quantize(x, x_scale), quantize(w, w_scale)
    # The FP8 operands are the residuals: one byte per element of x kept for dw.
    return rs_op.forward_fp8(x8, w8, x_scale, w_scale, plan), (x8, w8, x_scale, w_scale, grad_scale)


def _gemm_rs_fp8_bwd(plan, call, res, dy):
    x8, w8, xs, ws, grad_scale = res
    sd = plan.scatter_dimension
    if not call.fp8_grads:
        # The backward in bf16/fp16 on the dequantised weight: the bf16 ag_gemm, whose gathered dy serves dw.
        dtype = jnp.dtype(call.grad_dtype)
        dy, w_t = dy.astype(dtype), dequantize(w8, ws, dtype).T
        config = _ag_backward_config(plan.config, dy, w_t, plan.axis_size)
        ag_plan = ag_op.plan(dy, w_t, axis_name=plan.axis_name, gather_dimension=sd, config=config, return_gathered=True)
        dx, g = ag_op.forward(dy, w_t, ag_plan, gathered=True)
        dw = matmul_weight_grad(dequantize(x8, xs, dtype), g, dtype)
    else:
        # dx = all_gather(dy) @ w.T: an FP8 ag_gemm of e5m2 dy (each rank's block scaled by its own grad
        # scale) and the e4m3 weight; its gathered dy serves dw = x.T @ g.
        d8, gs = _quantized_cotangent(dy, grad_scale)
        # The config of the e5m2 operand: the FP8 kernels' blocks are 128 wide only.
        config = _ag_backward_config(plan.config, d8, w8.T, plan.axis_size)
        ag_plan = ag_op.plan(d8, w8.T, axis_name=plan.axis_name, gather_dimension=sd, config=config,
                             return_gathered=True, out_dtype=_backward_dtype(call),
                             shared_scale=shared_over(gs, d8, plan.axis_name))
        dx, g8, g_scales = ag_op.forward_fp8(d8, w8.T, gs, ws, ag_plan, gathered=True)
        # dw.T = g.T @ x: g's gathered dim carries the sources' scales (contracted in the rows layout).
        lead = _lead_dims(x8)
        dw = dot_by_source(g8, x8, ((lead, lead), ((), ())), sd, g_scales).T * xs
    return _cotangent(dx, call.x_dtype), _cotangent(dw, call.w_dtype), None, None, None


_gemm_rs_fp8.defvjp(_gemm_rs_fp8_fwd, _gemm_rs_fp8_bwd)


def _ag_backward_config(config: GemmRsConfig, dy, w_t, size: int) -> Optional[AgGemmConfig]:
    """The backward ag_gemm's config: XLA after an XLA forward; a forward forced onto the kernels keeps
    its backward there (as in the bf16 pairing); else the backward's own choice."""
    if config.path == "xla":
        return AgGemmConfig(path="xla")
    if config.path == "fused":
        return dataclasses.replace(ag_op.default_config(dy, w_t, size), path="fused")
    return None


def gemm_rs(x, w, *, axis_name, scatter_dimension, config, x_scale, w_scale, out_dtype, grad_dtype, grad_scale):
    """entwine_jax.gemm_rs's FP8 call (see the module docstring)."""
    xs, ws, gs, call = check("gemm_rs", x, (w,), x_scale, w_scale, out_dtype, grad_dtype, grad_scale)
    check_scales("gemm_rs", (("x", x, xs), ("w", w, ws)))
    x8_aval = jax.ShapeDtypeStruct(tuple(x.shape), E4M3)
    w8_aval = jax.ShapeDtypeStruct(tuple(w.shape), E4M3)
    plan = rs_op.plan(x8_aval, w8_aval, axis_name=axis_name, scatter_dimension=scatter_dimension, config=config,
                      out_dtype=call.out_dtype)
    names = callsite.varying_over(x, w, axis_name=plan.axis_name)
    with jax.named_scope("entwine_gemm_rs"):  # the census finds the op's collectives by it
        return _gemm_rs_fp8(callsite.make_varying(x, names), callsite.make_varying(w, names), xs, ws, gs, plan, call)


# --- ag_gemm --------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ag_gemm_fp8(x, w, x_scale, w_scale, grad_scale, plan, call):
    out = ag_op.forward_fp8(quantize(x, x_scale), quantize(w, w_scale), x_scale, w_scale, plan,
                            gathered=plan.return_gathered)
    return out[:2] if plan.return_gathered else out


def _ag_gemm_fp8_fwd(x, w, x_scale, w_scale, grad_scale, plan, call):
    w8 = quantize(w, w_scale)
    y, g8, g_scales = ag_op.forward_fp8(quantize(x, x_scale), w8, x_scale, w_scale, plan, gathered=True)
    # The gathered FP8 operand (and its sources' scales) is the residual for dw.
    return ((y, g8) if plan.return_gathered else y), (g8, g_scales, w8, w_scale, grad_scale)


def _ag_gemm_fp8_bwd(plan, call, res, cotangents):
    g8, g_scales, w8, ws, grad_scale = res
    # The returned gathered operand is FP8, a constant to differentiation: its cotangent is dropped.
    dy = cotangents[0] if plan.return_gathered else cotangents
    gd = plan.gather_dimension
    if not call.fp8_grads:
        # The backward in bf16/fp16 on the dequantised weight and gathered operand: the bf16 gemm_rs.
        dtype = jnp.dtype(call.grad_dtype)
        dy, w_t = dy.astype(dtype), dequantize(w8, ws, dtype).T
        config = _rs_backward_config(plan, dy, w_t)
        rs_plan = rs_op.plan(dy, w_t, axis_name=plan.axis_name, scatter_dimension=gd, config=config)
        dx = rs_op.forward(dy, w_t, rs_plan)
        g = _dequantize_by_source(g8, g_scales, gd, dtype)
        dw = matmul_weight_grad(g, dy, dtype)
    else:
        # dx = reduce-scatter of dy @ w.T: an FP8 gemm_rs of e5m2 dy (each rank's partial scaled by its own
        # grad scale) and the e4m3 weight; dw = gathered x.T @ dy from the gathered FP8 operand.
        d8, gs = _quantized_cotangent(dy, grad_scale)
        # The config of the e5m2 operand: the FP8 kernels' blocks are 128 wide only.
        config = _rs_backward_config(plan, d8, w8.T)
        rs_plan = rs_op.plan(d8, w8.T, axis_name=plan.axis_name, scatter_dimension=gd, config=config,
                             out_dtype=_backward_dtype(call))
        dx = rs_op.forward_fp8(d8, w8.T, gs, ws, rs_plan)
        lead = _lead_dims(g8)
        dw = dot_by_source(g8, d8, ((lead, lead), ((), ())), gd, g_scales) * gs
    return _cotangent(dx, call.x_dtype), _cotangent(dw, call.w_dtype), None, None, None


_ag_gemm_fp8.defvjp(_ag_gemm_fp8_fwd, _ag_gemm_fp8_bwd)


def _rs_backward_config(plan, dy, w_t) -> Optional[GemmRsConfig]:
    """The backward gemm_rs's config, by the rule of _ag_backward_config."""
    if plan.config.path == "xla":
        return GemmRsConfig(path="xla")
    if plan.config.path == "fused":
        config, _ = rs_op.default_config(dy, w_t, plan.axis_size, plan.gather_dimension)
        return dataclasses.replace(config, path="fused")
    return None


def _dequantize_by_source(g8, scales, dim: int, dtype):
    """The gathered FP8 operand in `dtype`, each source's block of `dim` times its scale."""
    shape = [1] * g8.ndim
    shape[dim] = g8.shape[dim]
    per = jnp.repeat(scales, g8.shape[dim] // scales.shape[0]).reshape(shape)
    return (jax.lax.optimization_barrier(g8).astype(jnp.float32) * per).astype(dtype)  # as in dequantize


def ag_gemm(x, w, *, axis_name, gather_dimension, config, return_gathered, x_scale, w_scale, out_dtype, grad_dtype,
            grad_scale):
    """entwine_jax.ag_gemm's FP8 call, w one weight or a group (see the module docstring). With
    return_gathered also returns the gathered FP8 x (e4m3, each source's block in its own scale)."""
    grouped = isinstance(w, (tuple, list))
    weights = tuple(w) if grouped else (w,)
    xs, ws, gs, call = check("ag_gemm", x, weights, x_scale, w_scale, out_dtype, grad_dtype, grad_scale)
    widths = ag_op.check_group(x, weights, fp8=True) if grouped else None
    check_scales("ag_gemm", (("x", x, xs),) + tuple((f"w[{i}]" if grouped else "w", w_i, ws)
                                                     for i, w_i in enumerate(weights)))
    # One GEMM over the group's concatenated columns, split after (as for the bf16 group).
    w_all = jnp.concatenate(weights, axis=1) if grouped else w
    x8_aval = jax.ShapeDtypeStruct(tuple(x.shape), E4M3)
    w8_aval = jax.ShapeDtypeStruct(tuple(w_all.shape), E4M3)
    axis_name = callsite.hashable_axis(axis_name)
    plan = ag_op.plan(x8_aval, w8_aval, axis_name=axis_name, gather_dimension=gather_dimension, config=config,
                      return_gathered=return_gathered, out_dtype=call.out_dtype,
                      shared_scale=shared_over(xs, x, axis_name))
    names = callsite.varying_over(x, w_all, axis_name=plan.axis_name)
    with jax.named_scope("entwine_ag_gemm"):  # the census finds the op's collectives by it
        out = _ag_gemm_fp8(callsite.make_varying(x, names), callsite.make_varying(w_all, names), xs, ws, gs, plan,
                           call)
        if not grouped:
            return out
        y, g = out if return_gathered else (out, None)
        ys = tuple(jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1))
    return (ys, g) if return_gathered else ys
