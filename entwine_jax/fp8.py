# FP8's helpers, for the FP8 calls of every op: y = (x * x_scale) @ (w * w_scale) on float8_e4m3fn operands
# with per-tensor fp32 scales, or block scales (1x128 tiles of x, 128x128 blocks of w), accumulated in fp32,
# written in bf16 or fp16. The checks of an FP8 call, the quantisation helpers (per tensor and per block)
# and the cotangent's quantisation; the custom VJP that keeps the pairing in FP8
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
So is a scale that is not finite and > 0 (zero zeroes the output, NaN or infinity make it NaN).
Inside ``shard_map`` each rank may hold its own ``x_scale`` (current scaling of its shard): gemm_rs
scales each rank's partial product by that rank's scales before the sum; ag_gemm scales each gathered
block (rows, or a K slice in the contraction layout) by its source's scale, which travels with the
shard. An ``x_scale`` that shard_map's types show to be the same on every rank (not varying over the
axis while x is) is a shared scale (delayed scaling): the kernels use their own and nothing travels.

Block scaling (DeepSeek-V3's recipe, TransformerEngine's FP8 block scaling): x carries one scale per
1x128 tile (per row, per 128-wide block of the contracted dim K), ``x_scale [..., rows, ceil(K/128)]`` in
x's own layout, and w [K, N] one per 128x128 block, ``w_scale [ceil(K/128), ceil(N/128)]``;
``y = sum over k-blocks kb of (x_q[:, kb] @ w_q[kb, :]) * x_scale[m, kb] * w_scale[kb, nb]`` in fp32.
The mode is w_scale's: a scalar is per tensor, a rank-2 array (or, for a group of weights, a tuple with
one per weight) is per block, and x_scale must then be x's block scale: a mixture is a ValueError, so
block scales never run per tensor. Tails (K, N or rows not multiples of 128) are partial blocks.
``quantize_1x128`` and ``quantize_128x128`` quantise with the current block scales (``scales_1x128``,
``scales_128x128``); ``quantize`` and ``dequantize`` take either kind of scale.

Backward: the cotangent dy is quantised to ``grad_dtype`` float8_e5m2 (default) with ``grad_scale``
(default: each rank's current scale of its own dy), then dx is the other op in FP8 (gemm_rs's dx an
ag_gemm of e5m2 dy and the e4m3 weight, ag_gemm's dx a gemm_rs) and dw a dot of the gathered FP8
operand. Where the forward runs on the fused kernels, so does this backward: the FP8 kernels take an
e5m2 x with an e4m3 weight (e5m2 x e4m3). ``grad_dtype`` bfloat16 or float16 runs the backward in
that dtype on the dequantised FP8 operands (the bf16/fp16 kernels where the forward is fused). Block
scaling quantises dy to e5m2 with its own current 1x128 scales along its last dimension (the dx GEMM's
contracted one; ``grad_scale`` is per tensor and refused there), reuses w with its block scales transposed,
and computes dw by XLA on the dequantised operands (its contraction runs over the rows, along which both
operands' scales vary).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _log, callsite, comm

__all__ = ["E4M3", "E5M2", "BLOCK", "quantize", "dequantize", "current_scale", "scales_1x128", "scales_128x128",
           "quantize_1x128", "quantize_128x128"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)  # activations and weights
E5M2 = jnp.dtype(jnp.float8_e5m2)  # gradients: more range, less precision
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HIGH_DTYPES = OUT_DTYPES + (jnp.dtype(jnp.float32),)
BLOCK = 128  # the edge of a scaling block: 1x128 tiles of x, 128x128 blocks of w
# The FP8 kernels' GEMM block width: the promoted fp32 sum of a wider block does not fit the math
# warps' registers (docs/design.md, "FP8 operands").
GEMM_BLOCK_N = 128


def narrow_blocks(op: str, config, source: str):
    """An FP8 call's config: GEMM_BLOCK_N-wide blocks whatever config.block_n says, so a config written
    for 16-bit operands (AgGemmConfig's default is 256) still runs the kernels. A config the user
    passed (source "override") is told so once."""
    if config.block_n == GEMM_BLOCK_N:
        return config
    if source == "override":
        _log.log_once((op, "fp8 block_n", config), logging.INFO, "%s: FP8 operands run %d-wide blocks, not "
                      "config.block_n = %d", op, GEMM_BLOCK_N, config.block_n)
    return dataclasses.replace(config, block_n=GEMM_BLOCK_N)


def blocks(n: int) -> int:
    """How many BLOCK-wide blocks cover n elements (the last one partial where n % BLOCK)."""
    return -(-int(n) // BLOCK)


def is_scalar(scale) -> bool:
    """Whether `scale` has the shape of a per-tensor scale, () or (1,)."""
    return tuple(getattr(scale, "shape", ())) in ((), (1,))


def expand_scale(scale, shape):
    """`scale` broadcast onto an operand of `shape`: a per-tensor scale (shape () or (1,)) as a scalar; a
    block scale (the operand's rank; each dim the operand's, or its count of BLOCK-wide blocks) repeated
    over the elements of its blocks. Sizes tell the two dims apart: they differ for any dim of 2 or more
    elements, and a dim of one element is the same either way (as a rank-1 operand's one block is its
    per-tensor scale)."""
    scale = jnp.asarray(scale, jnp.float32)
    if is_scalar(scale):
        return jnp.reshape(scale, ())
    for d, n in enumerate(shape):
        if scale.shape[d] != n:
            scale = jax.lax.slice_in_dim(jnp.repeat(scale, BLOCK, axis=d), 0, n, axis=d)
    return scale


def quantize(v, scale, dtype=E4M3):
    """v / scale rounded to the FP8 `dtype`, clipped to its largest finite value (fp32 arithmetic);
    `scale` per tensor or per block (expand_scale); `v` already in `dtype` is returned as it is."""
    dtype = jnp.dtype(dtype)
    if v.dtype == dtype:
        return v
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(v.astype(jnp.float32) / expand_scale(scale, v.shape), -largest, largest).astype(dtype)


def dequantize(v8, scale, dtype=jnp.float32):
    """v8 * scale in `dtype`, `scale` per tensor or per block (expand_scale). The barrier keeps the FP8
    rounding: where v8 = quantize(v) in the same program, XLA's GPU simplifier (allowed excess
    precision) would otherwise fold the f32 -> FP8 -> f32 converts away and compute with v itself, off
    the recipe by FP8's rounding (2.6% on one H200)."""
    v8 = jax.lax.optimization_barrier(v8)
    return (v8.astype(jnp.float32) * expand_scale(scale, v8.shape)).astype(dtype)


def _scale_of_amax(amax, dtype):
    """amax / the largest finite value of `dtype`; 1 where amax is 0 (any scale represents zeros) or not
    finite (no scale does). Written as a product with the float32 reciprocal: XLA turns a division by a
    constant into that product when it compiles, while an eager division rounds once; the product makes
    the scale the same bits in both, so a reference computed outside jit quantises as the op does."""
    reciprocal = np.float32(1.0 / float(jnp.finfo(dtype).max))
    return jnp.where((amax > 0) & jnp.isfinite(amax), amax * reciprocal, jnp.float32(1.0))


def current_scale(v, dtype=E4M3):
    """The scale that maps amax(|v|) onto the largest finite value of the FP8 `dtype` (float32, shape
    ()); 1 where v is all zeros or empty (any scale represents it) or not finite (no scale does)."""
    return _scale_of_amax(jnp.max(jnp.abs(v), initial=0).astype(jnp.float32), dtype)


def _block_scales(v, dims: tuple, dtype):
    """The current scale of every block of v: BLOCK elements along each dim of `dims`, one along the
    others (a partial block at a tail, its missing elements counted as zeros)."""
    a = jnp.abs(v).astype(jnp.float32)
    a = jnp.pad(a, [(0, blocks(n) * BLOCK - n if d in dims else 0) for d, n in enumerate(v.shape)])
    split = []
    for d, n in enumerate(a.shape):
        split += [n // BLOCK, BLOCK] if d in dims else [n]
    inner = tuple(i + 1 + k for k, i in enumerate(sorted(dims)))  # the BLOCK axes after the split
    return _scale_of_amax(jnp.max(a.reshape(split), axis=inner), dtype)


def scales_1x128(x, dtype=E4M3):
    """x's current scales per 1x128 tile: float32 ``x.shape[:-1] + (ceil(K/128),)``, each block's amax
    over the largest finite value of the FP8 `dtype` (1 for an all-zero block); K = x.shape[-1]."""
    return _block_scales(x, (x.ndim - 1,), dtype)


def scales_128x128(w, dtype=E4M3):
    """w [K, N]'s current scales per 128x128 block: float32 ``[ceil(K/128), ceil(N/128)]``, as
    scales_1x128."""
    if w.ndim != 2:
        raise ValueError(f"scales_128x128: w must have rank 2 ([K, N]), got shape {tuple(w.shape)}")
    return _block_scales(w, (0, 1), dtype)


def quantize_1x128(x, dtype=E4M3):
    """(x quantised to the FP8 `dtype` per 1x128 tile of its last dim, its scales_1x128): the x and
    x_scale of a block-scaled call; dequantize(q, scale) gives x back within FP8's rounding."""
    scale = scales_1x128(x, dtype)
    return quantize(x, scale, dtype), scale


def quantize_128x128(w, dtype=E4M3):
    """(w [K, N] quantised to the FP8 `dtype` per 128x128 block, its scales_128x128): the w and w_scale
    of a block-scaled call."""
    scale = scales_128x128(w, dtype)
    return quantize(w, scale, dtype), scale


def current_scale_over(v, axis_name, dtype=E4M3):
    """The largest of every rank's current_scale(v) over axis_name: one scale, the same on every rank
    (a scalar all-reduce). The layers and the backward take it for a gather over the contracted
    dimension: there the kernels take per-shard scales too, but on a per-slice loop measured 6-8%
    slower than the shared scale's (docs/design.md, "FP8 operands"). A constant to differentiation,
    as the ops treat every scale (pmax has no derivative rule)."""
    return jax.lax.pmax(jax.lax.stop_gradient(current_scale(v, dtype)), axis_name)


@dataclasses.dataclass(frozen=True)
class Fp8Call:
    """The static part of an FP8 call (hashable, a custom_vjp nondiff argument)."""
    out_dtype: str
    grad_dtype: str  # float8_e5m2, or the bf16/fp16 dtype the backward runs in
    x_dtype: str  # the operands as passed: their cotangents' dtypes (FP8 operands get none)
    w_dtype: str
    block: bool = False  # block scales (1x128 of x, 128x128 of w) instead of per-tensor ones

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
        raise ValueError(f"{op}: {name} must be a float32 scalar array (shape () or (1,); block scales: a w_scale "
                         f"of rank 2), got {jnp.dtype(s.dtype).name}{list(s.shape)}")
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


def block_scaled(w_scale) -> bool:
    """Whether w_scale asks for block scaling: a rank-2 block scale, or a group's tuple of them."""
    return isinstance(w_scale, (tuple, list)) or getattr(w_scale, "ndim", 0) == 2


def check(op: str, x, weights: tuple, x_scale, w_scale, out_dtype, grad_dtype, grad_scale, grouped: bool = False):
    """ValueError for an FP8 call that cannot run; returns (x_scale, w_scale, grad_scale) (float32
    scalars, or block scales with w_scale a tuple for a group; grad_scale None: current scaling) and
    the call's Fp8Call. grouped: `weights` is a group (a tuple the caller passed, even of one)."""
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
    block = block_scaled(w_scale)
    if block:
        xs, ws = _block_scales_checked(op, x, weights, x_scale, w_scale, grouped)
    else:
        ws = _scale(op, "w_scale", w_scale)
        if hasattr(x_scale, "shape") and not is_scalar(x_scale) and x.ndim:
            raise ValueError(f"{op}: x_scale {_described(x_scale)} is not a scalar but w_scale {_described(w_scale)} "
                             f"is per tensor: pass both scales per tensor (float32 scalars) or both per block "
                             f"(x_scale {_shape_text(x.shape[:-1] + (blocks(x.shape[-1]),))} for 1x128 tiles, "
                             f"w_scale [ceil(K/128), ceil(N/128)] for 128x128 blocks)")
        xs = _scale(op, "x_scale", x_scale)
    if out_dtype is None:
        out_dtype = x_dtype if x_dtype in OUT_DTYPES else jnp.dtype(jnp.bfloat16)
    if not _is_dtype_of(out_dtype, OUT_DTYPES):
        raise ValueError(f"{op}: out_dtype must be bfloat16 or float16, got {_dtype_text(out_dtype)}")
    if grad_dtype is None:
        grad_dtype = E5M2
    if not _is_dtype_of(grad_dtype, (E5M2,) + OUT_DTYPES):
        raise ValueError(f"{op}: grad_dtype must be float8_e5m2 (the hybrid recipe), bfloat16 or float16, got "
                         f"{_dtype_text(grad_dtype)}")
    grad_dtype = jnp.dtype(grad_dtype)
    gs = None
    if grad_scale is not None:
        if block:
            raise ValueError(f"{op}: grad_scale is a per-tensor scale; a block-scaled call quantises its gradients "
                             f"with their own current 1x128 scales: leave grad_scale None")
        if grad_dtype != E5M2:
            raise ValueError(f"{op}: grad_scale scales float8_e5m2 gradients; grad_dtype is {grad_dtype.name}")
        gs = _scale(op, "grad_scale", grad_scale)
    # The scales as passed (what the checks above made of them is traced under jit): concrete ones
    # are checked now, traced ones by check_scales under ENTWINE_CHECK_FP8_SCALES=1.
    for name, scale in [("x_scale", x_scale), ("grad_scale", grad_scale)] + (
            [(f"w_scale[{i}]", s) for i, s in enumerate(w_scale)] if isinstance(w_scale, (tuple, list))
            else [("w_scale", w_scale)]):
        if scale is not None and not isinstance(scale, jax.core.Tracer):
            if problem := _scale_values_problem(op, name, scale):
                raise ValueError(problem)
    call = Fp8Call(out_dtype=jnp.dtype(out_dtype).name, grad_dtype=grad_dtype.name, x_dtype=x_dtype.name,
                   w_dtype=w_dtype.name, block=block)
    return xs, ws, gs, call


def _is_dtype_of(dtype, dtypes: tuple) -> bool:
    """Whether the dtype argument `dtype` names one of `dtypes` (False where it names no dtype, e.g. a
    misspelt string, which jnp.dtype would answer with a TypeError)."""
    try:
        return jnp.dtype(dtype) in dtypes
    except TypeError:
        return False


def _dtype_text(dtype) -> str:
    """A dtype argument as an error message shows it: its name, or what was passed."""
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        return repr(dtype)


def _scale_values_problem(op: str, name: str, scale) -> Optional[str]:
    """The message for a scale with an entry that is not finite and > 0, or None. Scales are
    dequantisation factors (amax / 448): zero quantises its operand to the largest FP8 value and then
    zeroes the product, NaN or infinity make the output NaN, and current_scale gives neither (1 for
    an all-zero operand)."""
    values = np.asarray(scale, np.float32)
    bad = ~(np.isfinite(values) & (values > 0))
    if not bad.any():
        return None
    where = np.argwhere(bad)[0]
    at = f" at index {tuple(int(i) for i in where)}" if values.ndim else ""
    return (f"{op}: {name} must be finite and > 0 (a dequantisation factor, amax / 448: fp8.current_scale), got "
            f"{float(values[tuple(where)])}{at}")


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def _described(s) -> str:
    """An argument as an error message shows it: dtype[shape], or its type."""
    if hasattr(s, "shape") and hasattr(s, "dtype"):
        return f"{jnp.dtype(s.dtype).name}{_shape_text(s.shape)}"
    return type(s).__name__


def _block_scale(op: str, name: str, s, shape: tuple, what: str):
    """s, a float32 array of `shape` (the block scale of `what`); ValueError naming both otherwise."""
    if not (hasattr(s, "shape") and hasattr(s, "dtype")) or jnp.dtype(s.dtype) != jnp.float32 \
            or tuple(s.shape) != tuple(shape):
        kind = "a per-tensor scalar: mixing block and per-tensor scales" if is_scalar(s) and hasattr(s, "dtype") \
            else _described(s)
        raise ValueError(f"{op}: {name} must be float32{_shape_text(shape)} ({what}) in a block-scaled call, got "
                         f"{kind}" + (f" ({_described(s)})" if kind != _described(s) else ""))
    return s


def _block_scales_checked(op: str, x, weights: tuple, x_scale, w_scale, grouped: bool) -> tuple:
    """(x_scale, w_scale) of a block-scaled call, checked against the operands' block shapes: x_scale
    x.shape[:-1] + (ceil(K/128),), w_scale [ceil(K/128), ceil(N/128)] or, for a group, a tuple of
    one per weight."""
    for i, w in enumerate(weights):
        if w.ndim != 2:
            raise ValueError(f"{op}: w{f'[{i}]' if len(weights) > 1 else ''} must have rank 2 ([K, N]), got shape "
                             f"{tuple(w.shape)}")
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have rank >= 1 ([..., K]), got a scalar")
    if not grouped and isinstance(w_scale, (tuple, list)):
        raise ValueError(f"{op}: w_scale is a tuple of {len(w_scale)}, which gives a group of weights their block "
                         f"scales; one weight takes its w_scale array itself")
    if grouped and not (isinstance(w_scale, (tuple, list)) and len(w_scale) == len(weights)):
        raise ValueError(f"{op}: a block-scaled group of {len(weights)} weights takes a tuple of {len(weights)} "
                         f"w_scale arrays (one [ceil(K/128), ceil(N_i/128)] per weight), got "
                         f"{len(w_scale) if isinstance(w_scale, (tuple, list)) else 'one array'}")
    scales = tuple(w_scale) if grouped else (w_scale,)
    if grouped and all(hasattr(s, "dtype") and is_scalar(s) for s in scales):
        raise ValueError(f"{op}: a tuple w_scale gives each weight of a group its 128x128 block scales; per-tensor "
                         f"scaling takes one float32 scalar shared by the group (the largest of the weights' "
                         f"current_scale), got {len(scales)} scalars")
    ws = tuple(_block_scale(op, f"w_scale[{i}]" if grouped else "w_scale", s,
                            (blocks(w.shape[0]), blocks(w.shape[1])),
                            f"128x128 blocks of w{f'[{i}]' if grouped else ''} {_shape_text(w.shape)}")
               for i, (w, s) in enumerate(zip(weights, scales)))
    xs = _block_scale(op, "x_scale", x_scale, tuple(x.shape[:-1]) + (blocks(x.shape[-1]),),
                      f"1x128 tiles of x {_shape_text(x.shape)}")
    return xs, (ws if grouped else ws[0])


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
        if debug and isinstance(scale, jax.core.Tracer):
            # The scale's own values, finite and > 0 (check() takes the concrete ones), named as the
            # argument: the weight's (w, w1, w[i]; a group's per-tensor scale is the one w_scale, its
            # block scales w_scale[i]) or else x's (x, or the MoE combine's h).
            index = name[name.index("["):] if "[" in name and not is_scalar(scale) else ""
            scale_name = "w_scale" + index if name.startswith("w") else "x_scale"

            def raise_if_not_positive(value, scale_name=scale_name):
                if problem := _scale_values_problem(op, scale_name, value):
                    raise ValueError(problem)

            jax.debug.callback(raise_if_not_positive, scale)
        # An empty operand has no values to lose (and no largest one).
        if jnp.dtype(v.dtype) == E4M3 or v.size == 0:
            continue
        concrete = not isinstance(v, jax.core.Tracer) and not isinstance(scale, jax.core.Tracer)
        if not (concrete or debug):
            continue
        largest = jnp.max(jnp.abs(v.astype(jnp.float32)) / expand_scale(scale, v.shape))
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
    return all(a in varying_x and a not in varying_s for a in comm.axis_tuple(axis_name))


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


def dequantize_by_source(g8, scales, dim: int, dtype, world: int):
    """The operand gathered over `dim` from `world` ranks, in `dtype`: with per-tensor scales (f32
    [world]) each source's block of `dim` times its scale; with block scales (gathered with it over
    `dim`) each source's tiles times theirs, which over the contracted (last) dim are tiles of each
    source's own K slice."""
    g8 = jax.lax.optimization_barrier(g8)  # as in dequantize
    if tuple(scales.shape) == (world,):
        shape = [1] * g8.ndim
        shape[dim] = g8.shape[dim]
        per = jnp.repeat(scales, g8.shape[dim] // world).reshape(shape)
    elif dim == g8.ndim - 1:
        lead = tuple(g8.shape[:-1])
        # The tiles per source by count, not -1: an operand without rows has no scales to infer it from.
        per = expand_scale(scales.reshape(lead + (world, scales.shape[-1] // world)),
                           lead + (world, g8.shape[-1] // world))
        per = per.reshape(g8.shape)
    else:
        per = expand_scale(scales, g8.shape)
    return (g8.astype(jnp.float32) * per).astype(dtype)
