# The FP8 state of entwine_jax.layers: current scaling (per tensor, or per block: 1x128 tiles of x,
# 128x128 blocks of the kernel), and delayed scaling with Flax's state (flax.linen.fp8_ops): the scales
# and amax histories, their update through the gradient, and the FP8 keyword arguments of an op call.
# The layers (entwine_jax.layers) and MaxText's switch use it.
import functools
from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops as flax_fp8

from entwine_jax import callsite, comm
from entwine_jax import fp8 as fp8_ops


# The delayed-scaling state of one layer, named and shaped as Flax's Fp8DotGeneral keeps it (scales
# (1,), amax histories (amax_history_length,), float32) in the collection OVERWRITE_WITH_GRADIENT:
# the training step replaces each of them by its "gradient", which is its next value.
FP8_META_NAMES = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history", "input_scale",
                  "kernel_scale", "output_grad_scale")
OVERWRITE_WITH_GRADIENT = flax_fp8.OVERWRITE_WITH_GRADIENT
# The fp8 modes of a layer: none, current per-tensor scaling, current block scaling, delayed scaling.
FP8_MODES = (None, "current", "block", "delayed")


def fp8_meta(amax_history_length: int = 1024) -> dict:
    """A fresh delayed-scaling state (Flax's initial values: scales 1, histories 0)."""
    history = jnp.zeros((amax_history_length,), jnp.float32)
    scale = jnp.ones((1,), jnp.float32)
    return {name: history if name.endswith("history") else scale for name in FP8_META_NAMES}


class Fp8Meta(nnx.Variable):
    """An NNX variable of the delayed-scaling state (FP8_META_NAMES). Differentiate with respect to it
    too (``nnx.DiffState(0, (nnx.Param, Fp8Meta))``) and overwrite it with its gradient
    (overwrite_with_gradient), as Flax's OVERWRITE_WITH_GRADIENT collection is."""


def overwrite_with_gradient(state, grads):
    """Replaces every Fp8Meta value of the NNX `state` by its gradient in `grads` (same structure)."""
    return jax.tree.map(lambda v, g: g if isinstance(v, Fp8Meta) else v, state, grads,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


def check_fp8(where: str, fp8) -> None:
    """ValueError unless `fp8` is None, "current", "block" or a delayed-scaling state (fp8_meta())."""
    if fp8 is None or fp8 in ("current", "block"):
        return
    if not isinstance(fp8, Mapping) or set(fp8) != set(FP8_META_NAMES):
        raise ValueError(f"{where}: fp8 must be None, 'current', 'block' or a delayed-scaling state with the keys "
                         f"{FP8_META_NAMES} (layers.fp8_meta()), got {fp8!r}")
    for name in FP8_META_NAMES:
        v = fp8[name]
        if not (hasattr(v, "dtype") and jnp.dtype(v.dtype) == jnp.float32 and v.ndim == 1):
            raise ValueError(f"{where}: fp8[{name!r}] must be a 1-D float32 array, got "
                             f"{getattr(v, 'dtype', type(v).__name__)}{list(getattr(v, 'shape', ()))}")


def _global_amax(v, axis_name):
    # The largest |v| over every rank's shard, over axis_name and every other axis v varies over (a
    # data-parallel axis): the delayed-scaling state stays the same on every device, so its
    # "gradient" is not summed over the axes it is replicated on.
    axes = tuple(sorted(set(comm.axis_tuple(axis_name)) | callsite.varying_axes(v), key=str))
    return jax.lax.pmax(jnp.max(jnp.abs(v)).astype(jnp.float32), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _delayed_scale(dtype, axis_name, v, scale, history):
    """This step's scale of v (from the amax history, Flax's rule); its "gradient" with respect to
    scale and history is their next value (the history rolled, v's global amax in front)."""
    return _next_meta(dtype, axis_name, v, scale, history)[0]


def _next_meta(dtype, axis_name, v, scale, history):
    return flax_fp8.update_fp8_meta(_global_amax(v, axis_name), dtype, scale, history)


def _delayed_scale_fwd(dtype, axis_name, v, scale, history):
    new_scale, new_history = _next_meta(dtype, axis_name, v, scale, history)
    return new_scale, (new_scale, new_history)


def _delayed_scale_bwd(dtype, axis_name, res, _):
    new_scale, new_history = res
    return None, new_scale, new_history


_delayed_scale.defvjp(_delayed_scale_fwd, _delayed_scale_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _output_grad_meta(axis_name, y, scale, history):
    """y, unchanged; the "gradient" of the output-gradient scale and history is their next value,
    from the global amax of y's cotangent (the scale the backward used came from the history alone)."""
    return y


def _output_grad_meta_fwd(axis_name, y, scale, history):
    return y, (scale, history)


def _output_grad_meta_bwd(axis_name, res, dy):
    scale, history = res
    new_scale, new_history = flax_fp8.update_fp8_meta(_global_amax(dy, axis_name), fp8_ops.E5M2, scale, history)
    return dy, new_scale, new_history


_output_grad_meta.defvjp(_output_grad_meta_fwd, _output_grad_meta_bwd)


def _history_scale(scale, history, dtype):
    """The scale update_fp8_meta gives from the history alone (what the backward quantises dy with)."""
    largest = jnp.finfo(dtype).max.astype(jnp.float32)
    return jnp.reshape(flax_fp8.compute_scale(jnp.max(history), scale, largest), ())


def fp8_call_arguments(where: str, fp8, x, kernel, axis_name, dtype, contracted_gather: bool = False):
    """(the FP8 keyword arguments of an op call on x and kernel inside shard_map, a function applied to
    its output; `where` names the caller in errors) for `fp8`:
    None (a bf16/fp16 call), "current" (each rank's current scales of its own x and kernel shard, e5m2
    gradients at their current scale; contracted_gather, an ag_gemm over x's last dimension: x's
    scale the largest over the axis, for the kernels' faster shared-scale loop), "block" (each rank's current block
    scales of its x (1x128) and kernel (128x128) shards, this step's, no history; the gradients per
    1x128 tile) or a delayed-scaling state (scales from the amax histories, the same on every rank,
    updated through the gradient as Flax does). kernel: one [K, N] array, or with "current" and "block"
    a tuple of them (a group: one shared scale, or one block scale each)."""
    if fp8 is None:
        return {}, lambda y: y
    out_dtype = dtype if dtype in fp8_ops.OUT_DTYPES else jnp.dtype(jnp.bfloat16)
    if fp8 == "block":
        w_scale = (tuple(fp8_ops.scales_128x128(k) for k in kernel) if isinstance(kernel, tuple)
                   else fp8_ops.scales_128x128(kernel))
        return dict(x_scale=fp8_ops.scales_1x128(x), w_scale=w_scale, out_dtype=out_dtype), lambda y: y.astype(dtype)
    group = kernel if isinstance(kernel, tuple) else None
    if fp8 == "current":
        x_scale = fp8_ops.current_scale_over(x, axis_name) if contracted_gather else fp8_ops.current_scale(x)
        # A group's kernels share one scale: the largest of theirs.
        w_scale = (jnp.max(jnp.stack([fp8_ops.current_scale(k) for k in group])) if group
                   else fp8_ops.current_scale(kernel))
        return dict(x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype), lambda y: y.astype(dtype)
    meta = {name: jnp.asarray(v) for name, v in fp8.items()}
    e4m3 = fp8_ops.E4M3
    kwargs = dict(x_scale=_delayed_scale(e4m3, axis_name, x, meta["input_scale"], meta["input_amax_history"]),
                  w_scale=_delayed_scale(e4m3, axis_name, kernel, meta["kernel_scale"], meta["kernel_amax_history"]),
                  grad_scale=jax.lax.stop_gradient(_history_scale(meta["output_grad_scale"],
                                                                  meta["output_grad_amax_history"], fp8_ops.E5M2)),
                  out_dtype=out_dtype)
    return kwargs, lambda y: _output_grad_meta(axis_name, y, meta["output_grad_scale"],
                                               meta["output_grad_amax_history"]).astype(dtype)
