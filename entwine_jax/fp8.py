# FP8's helpers, for the FP8 calls of every op: y = (x * x_scale) @ (w * w_scale) on float8_e4m3fn operands
# with per-tensor fp32 scales, accumulated in fp32, written in bf16 or fp16. The checks of an FP8 call, the
# quantisation helpers and the cotangent's quantisation; the custom VJP that keeps the pairing in FP8
# (each op's backward is its backward op on the cotangent quantised to float8_e5m2 with its own scale:
# the hybrid recipe, e5m2 x e4m3 on the kernels; or in bf16/fp16 when the caller asks) is
# entwine_jax.pairing's. docs/design.md, "FP8".
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
import os
from typing import Optional

import jax
import jax.numpy as jnp

from entwine_jax import callsite

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


def current_scale_over(v, axis_name, dtype=E4M3):
    """The largest of every rank's current_scale(v) over axis_name: one scale, the same on every rank
    (a scalar all-reduce). A gather over the contracted dimension needs it: its sources' scales
    cannot be applied after the dot, and the kernels take one x scale there (docs/design.md, "FP8").
    A constant to differentiation, as the ops treat every scale (pmax has no derivative rule)."""
    return jax.lax.pmax(jax.lax.stop_gradient(current_scale(v, dtype)), axis_name)


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

    @property
    def backward_dtype(self) -> jnp.dtype:
        """The dtype the backward op writes dx in: the operand's when the kernels can write it."""
        return jnp.dtype(self.x_dtype) if jnp.dtype(self.x_dtype) in OUT_DTYPES else jnp.dtype(self.out_dtype)


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


def cotangent(v, dtype: str):
    """A gradient for an operand passed as `dtype`: FP8 operands are constants (zero cotangent)."""
    return None if jnp.dtype(dtype) == E4M3 else v.astype(dtype)


def quantized_cotangent(dy, grad_scale, shared_axis=None):
    """(dy in e5m2, its scale): grad_scale; else the current scale of dy, this rank's own or, with
    shared_axis, the largest over that axis (current_scale_over)."""
    if grad_scale is not None:
        gs = grad_scale
    elif shared_axis is not None:
        gs = current_scale_over(dy, shared_axis, E5M2)
    else:
        gs = current_scale(dy, E5M2)
    return quantize(dy, gs, E5M2), gs


def dequantize_by_source(g8, scales, dim: int, dtype):
    """The gathered FP8 operand in `dtype`, each source's block of `dim` times its scale."""
    shape = [1] * g8.ndim
    shape[dim] = g8.shape[dim]
    per = jnp.repeat(scales, g8.shape[dim] // scales.shape[0]).reshape(shape)
    return (jax.lax.optimization_barrier(g8).astype(jnp.float32) * per).astype(dtype)  # as in dequantize
