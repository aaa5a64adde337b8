# ag_gemm at a call site: argument checks, config choice (override or heuristic), the plan of the call
# (fused kernels prepared once, or the reason the XLA reference runs), the report, and the forward
# computation; SPEC declares them (the op contract, entwine_jax.opspec). Its backward (dx: a gemm_rs
# in the same layout) is declared there and run by entwine_jax.pairing.
import dataclasses
import functools
import logging
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _extension, _log, callsite, fp8, opspec
from entwine_jax.ag_gemm import fused
from entwine_jax.ag_gemm import plan as _plan
from entwine_jax.ag_gemm.config import AgGemmConfig, ag_heuristic_config, push_budget, push_of
from entwine_jax.ag_gemm.reference import ag_gemm_reference, ag_gemm_reference_fp8

OP = "ag_gemm"
printed: set = set()  # call sites printed under ENTWINE_PRINT_CONFIG=1


def _moved(target: str, ins: list, outs: list, attrs: str) -> tuple:
    """(W, what one rank sends W - 1 times) of a custom call: its shard of x (padded), and in an FP8
    call without a shared scale the shard's x_scale, which travels with it. gather_k: w [W * cols, N]
    -> y [rows, N]; rows: y [W * rows, N] (fused.call); the FP8 target takes w transposed, [N, K]."""
    (_, x), (_, w), (_, y) = ins[0][0], ins[1][0], outs[0]
    w = w[::-1] if target.endswith("_fp8") else w
    gather_k = opspec.attribute_is(attrs, "gather_k", "true")
    world = w[0] // x[1] if gather_k else y[0] // x[0]
    shared = opspec.attribute_is(attrs, "shared_scale", "true")
    sent = ins[0][:1] + (ins[2][:1] if target.endswith("_fp8") and not shared and len(ins) > 2 else [])
    return world, sent


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one call; hashable (a custom_vjp nondiff argument)."""
    axis_name: Any
    axis_size: int
    dimension: int  # the gather dimension, normalised: 0 <= dimension < x.ndim
    config: AgGemmConfig
    return_gathered: bool
    reason: Optional[str]  # None: the fused path (on CUDA); else why the XLA reference runs
    fused_call: Any = None  # with reason None: fused.AgGemmCall (padding, grid, comm id)
    out_dtype: Optional[str] = None  # an FP8 call (entwine_jax.fp8): the output dtype's name
    shared_scale: bool = False  # an FP8 call: every rank's x_scale is the same
    block_scaled: bool = False  # an FP8 call with block scales (1x128 of x, 128x128 of w)
    # A group of weights (w a tuple): None: one weight. joined: why the fused call concatenates the
    # group's weights (and splits its output) instead of reading each where it lies; None: it does not.
    widths: Optional[tuple] = None
    joined: Optional[str] = None


def _check_args(x, w, axis_name, gather_dimension, fp8: bool) -> tuple[int, int]:
    """Raise ValueError for anything ag_gemm cannot compute; returns (axis_size, gather dim)."""
    callsite.check_operands(OP, x, w, "[K, N]", fp8)
    if x.ndim < 1:
        raise ValueError(f"ag_gemm: x must have rank >= 1, got shape {tuple(x.shape)}")
    size = callsite.axis_size(OP, axis_name)
    gd = callsite.dimension(OP, "gather_dimension", gather_dimension, tuple(x.shape), "x")
    if gd == x.ndim - 1:
        # Contraction layout: each rank holds K / W of the contraction dim, w holds all of K.
        if x.shape[-1] * size != w.shape[0]:
            raise ValueError(f"ag_gemm: gathering the last dim (the contraction dim) needs w.shape[0] == "
                             f"x.shape[-1] * axis size ({x.shape[-1]} * {size} = {x.shape[-1] * size}), "
                             f"got w shape {tuple(w.shape)}")
    elif x.ndim < 2:
        raise ValueError(f"ag_gemm: x must have rank >= 2 to gather a dim other than the contraction dim, "
                         f"got shape {tuple(x.shape)}")
    elif x.shape[-1] != w.shape[0]:
        raise ValueError(f"ag_gemm: x.shape[-1] (K) must equal w.shape[0], got {x.shape[-1]} and {w.shape[0]} "
                         f"(x shape {tuple(x.shape)}, w shape {tuple(w.shape)})")
    if x.shape[-1] == 0 or x.shape[gd] == 0:
        raise ValueError(f"ag_gemm: x must not be empty in its contraction or gathered dim, got shape {tuple(x.shape)}")
    return size, gd


def check_group(x, weights: tuple, fp8: bool = False) -> None:
    """ValueError unless `weights` is a non-empty group of [K, N_i] arrays that one GEMM can serve
    (x's dtype, or with fp8 one dtype of their own; one K)."""
    if not weights:
        raise ValueError("ag_gemm: w is an empty group; pass one weight or a tuple of weights [K, N_i]")
    for i, w in enumerate(weights):
        if not (hasattr(w, "shape") and hasattr(w, "dtype")):
            raise ValueError(f"ag_gemm: w[{i}] must be an array, got {type(w).__name__}")
        if w.ndim != 2:
            raise ValueError(f"ag_gemm: w[{i}] must have rank 2 ([K, N_{i}]), got shape {tuple(w.shape)}")
        if w.shape[0] != weights[0].shape[0] or w.dtype != weights[0].dtype:
            raise ValueError(f"ag_gemm: the weights of a group must share K and dtype: w[0] is "
                             f"{weights[0].dtype}{list(weights[0].shape)}, w[{i}] is {w.dtype}{list(w.shape)}")
        if not fp8 and hasattr(x, "dtype") and w.dtype != x.dtype:
            raise ValueError(f"ag_gemm: w[{i}].dtype must equal x.dtype ({x.dtype}), got {w.dtype}")
        if w.shape[1] == 0:
            raise ValueError(f"ag_gemm: w[{i}] has no columns (shape {tuple(w.shape)})")


def _joined_aval(weights: tuple):
    """The [K, sum of N_i] operand a group of weights stands for."""
    return jax.ShapeDtypeStruct((weights[0].shape[0], sum(w.shape[1] for w in weights)), weights[0].dtype)


def _group_reason(widths, config: AgGemmConfig) -> Optional[str]:
    """Why the kernels cannot read a group of weights of these widths where they lie (the call then
    concatenates them, one copy of the weights per call), or None. Each weight is read through its own
    descriptors into whole blocks of its own: a width must be a multiple of the block."""
    if len(widths) > _plan.max_weights():
        return f"{len(widths)} weights, the kernels read at most {_plan.max_weights()} in place"
    for i, n in enumerate(widths):
        if n % config.block_n:
            return f"w[{i}] has {n} columns, not a multiple of config.block_n ({config.block_n})"
    return None


def _group_config(widths, config: AgGemmConfig, source: str) -> AgGemmConfig:
    """A group's config: 128-wide blocks where config.block_n's would straddle two weights (a 256-wide
    block needs every width a multiple of 256) but 128-wide ones would not, whatever the config's
    source: reading the weights in place saves a copy of them per call, and a block cannot belong to
    two weights. A config the user passed is told so once."""
    if config.block_n == 128 or any(n % 128 for n in widths) or not any(n % config.block_n for n in widths):
        return config
    if source == "override":
        _log.log_once((OP, "group block_n", tuple(widths), config), logging.INFO,
                      "%s: a group of widths %s runs 128-wide blocks, not config.block_n = %d (its blocks would "
                      "straddle two weights; the weights are read in place)", OP, list(widths), config.block_n)
    return dataclasses.replace(config, block_n=128)


def _check_config(config: AgGemmConfig) -> None:
    """ValueError for a GEMM grid that leaves no SM for the chunk releases (or, with push="sm", not
    the SM push's CTAs) on this GPU."""
    if config.path == "xla":
        return
    sms = _extension.sm_count()
    where = "this GPU" if _extension.gpu_sm_count() else "a 132-SM Hopper GPU (no GPU seen here)"
    if config.push == "sm" and config.gemm_sms + push_budget(config) > sms:
        raise ValueError(f"ag_gemm: config.gemm_sms must leave the SM push its {push_budget(config)} SMs: at "
                         f"most {sms - push_budget(config)} on {where}, got {config.gemm_sms}")
    if config.gemm_sms >= sms:
        raise ValueError(f"ag_gemm: config.gemm_sms must leave an SM free for the chunk releases: at most "
                         f"{sms - 1} on {where}, got {config.gemm_sms}")


def fixed_us(push: str) -> float:
    """The fused call's fixed device cost beyond XLA's, in microseconds, by push (the small-call
    rule, tuning/crossover.py). Copy engines ("ce"): 8 chunk pushes and releases took 65 us to
    enqueue whatever their size below ~30 MB (one H200, docs/performance.md, "ag_gemm"). SM push:
    one launch beside the GEMM, estimated like gemm_rs's consumer launch."""
    return 20.0 if push == "sm" else 70.0


def _cost(x, w, size: int) -> tuple[float, float]:
    """(flops of this rank's GEMM on the gathered operand, bytes the gather brings in: the W - 1
    peers' shards). Either layout: the gathered operand holds W shards, the GEMM covers all of them."""
    shard = math.prod(x.shape)
    return 2.0 * size * shard * w.shape[1], (size - 1) * shard * jnp.dtype(x.dtype).itemsize


def _fused_arguments(x, w, axis_name, size, gd, config, out_dtype, shared_scale, block_scaled) -> tuple:
    x2d = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    w_aval = jax.ShapeDtypeStruct(tuple(w.shape), w.dtype)
    kwargs = dict(axis_name=axis_name, axis_size=size, gather_k=gd == len(x.shape) - 1, config=config)
    if out_dtype is not None:  # an FP8 call
        kwargs.update(out_dtype=out_dtype, shared_scale=shared_scale, block_scaled=block_scaled)
    return x2d, w_aval, kwargs


def why_not_fused(x, w, *, axis_name, axis_size: int, dimension: int, config: AgGemmConfig,
                  out_dtype=None, shared_scale: bool = False, block_scaled: bool = False) -> Optional[str]:
    """Why a call on operands shaped like x and w (dimension: the gather dimension, normalised;
    out_dtype: an FP8 call's output dtype, shared_scale: its x_scale the same on every rank,
    block_scaled: with block scales) takes the XLA path on this mesh, or None; asks only, no
    communicator is made (for programs that report on calls)."""
    push = push_of(config, math.prod(x.shape) * jnp.dtype(x.dtype).itemsize)
    reason = callsite.early_reason(config, axis_size, x.dtype, "gather", *_cost(x, w, axis_size), fixed_us(push),
                                   axis_name=axis_name)
    if reason is not None:
        return reason
    x2d, w_aval, kwargs = _fused_arguments(x, w, axis_name, axis_size, dimension, config, out_dtype, shared_scale,
                                           block_scaled)
    return fused.unavailable_reason(x2d, w_aval, **kwargs)


def _prepare(x, w, axis_name, size, gd, config, out_dtype, shared_scale, block_scaled) -> tuple[Any, Optional[str]]:
    """(fused.AgGemmCall, None) when the fused kernels run this call, else (None, the reason)."""
    # why_not_fused only answers; prepare makes the communicator once it said None.
    x2d, w_aval, kwargs = _fused_arguments(x, w, axis_name, size, gd, config, out_dtype, shared_scale, block_scaled)
    return callsite.prepare(OP, lambda: why_not_fused(x, w, axis_name=axis_name, axis_size=size, dimension=gd,
                                                      config=config, out_dtype=out_dtype, shared_scale=shared_scale,
                                                      block_scaled=block_scaled),
                            lambda: fused.prepare(x2d, w_aval, **kwargs))


def default_config(x, w, size: int, dimension: int) -> tuple[AgGemmConfig, str]:
    """(config, source) of a call without an override: the heuristic, whatever the gather dimension."""
    return ag_heuristic_config(math.prod(x.shape[:-1]), w.shape[1], x.shape[-1], size, x.dtype), "heuristic"


def plan(x, w, *, axis_name, dimension, config: Optional[AgGemmConfig], return_gathered: bool = False,
         out_dtype=None, shared_scale: bool = False, block_scaled: bool = False) -> Plan:
    """Check a call, choose its config and its path, and report the choice once per call site.
    dimension: the gather dimension; out_dtype: an FP8 call (operands checked by entwine_jax.fp8)
    writing this dtype; shared_scale: its x_scale is the same on every rank; block_scaled: with block
    scales (which travel with their tiles: never shared)."""
    axis_name = callsite.hashable_axis(axis_name)
    out_dtype = None if out_dtype is None else jnp.dtype(out_dtype).name
    # A group of weights plans as the one operand their columns side by side make.
    widths = tuple(int(w_i.shape[1]) for w_i in w) if isinstance(w, tuple) else None
    w = _joined_aval(w) if widths else w
    size, gd = _check_args(x, w, axis_name, dimension, out_dtype is not None)
    if config is not None and not isinstance(config, AgGemmConfig):
        raise ValueError(f"ag_gemm: config must be an AgGemmConfig or None, got {type(config).__name__}")
    if not isinstance(return_gathered, bool):
        raise ValueError(f"ag_gemm: return_gathered must be a bool, got {return_gathered!r}")
    source = "override"
    if config is None:
        config, source = default_config(x, w, size, gd)
    if widths:
        config = _group_config(widths, config, source)
    _check_config(config)
    if out_dtype is not None:
        config = fp8.narrow_blocks(OP, config, source)
    block_scaled = bool(block_scaled) and out_dtype is not None
    shared_scale = bool(shared_scale) and not block_scaled
    fused_call, reason = _prepare(x, w, axis_name, size, gd, config, out_dtype, shared_scale, block_scaled)
    joined = _group_reason(widths, config) if widths and reason is None else None
    p = Plan(axis_name=axis_name, axis_size=size, dimension=gd, config=config,
             return_gathered=return_gathered, reason=reason, fused_call=fused_call, out_dtype=out_dtype,
             shared_scale=shared_scale, block_scaled=block_scaled, widths=widths, joined=joined)
    key = (tuple(x.shape), tuple(w.shape), str(x.dtype), axis_name, gd, out_dtype, shared_scale, block_scaled,
           widths)
    site = (f"x={x.dtype}{list(x.shape)} w={w.dtype}{list(w.shape)}"
            + (f" (a group of widths {list(widths)})" if widths else "")
            + f" axis={axis_name!r} (size {size}) gather_dimension={gd}"
            + (f" out_dtype={out_dtype} shared_scale={shared_scale}" if out_dtype else "")
            + (" block-scaled" if block_scaled else ""))
    callsite.report(OP, key, site, config, reason, source, printed)
    if joined is not None:
        # Fused, at the price of one copy of the weights (and of the outputs) per call: worth saying.
        _log.log_once((OP, "joined", key), _log.fallback_level(config.path),
                      "%s %s: the weights are concatenated per call: %s", OP, site, joined)
    return p


def _reference(x, w, plan: Plan, gathered: bool):
    y, g = ag_gemm_reference(x, w, axis_name=plan.axis_name, gather_dimension=plan.dimension)
    return (y, g) if gathered else y


def _fused_forward(x, w, *scales, plan: Plan, gathered: bool):
    """The kernels see this rank's shard as [rows, cols]. Rows layout: the gathered dim's W slices
    come back stacked in rank order, [W * rows, N]; for a gathered dim with dims in front of it
    (x [B, S/W, K], gather dim 1) the result is permuted into place (one copy of y). scales: an FP8
    call's (x_scale, w_scale); with `gathered` it also returns the W sources' x_scale (block scales:
    their tiles' scales, placed as the gathered x is). A group of weights (w a tuple) gives a tuple
    of outputs: each weight read where it lies and its output written by the kernels, or where
    plan.joined says why not, the weights concatenated and the one output split."""
    x2d = x.reshape(-1, x.shape[-1])
    names = callsite.varying_over(x, w, *scales)
    operand = jnp.concatenate(w, axis=1) if plan.joined is not None else w
    if not scales:
        y2d, g = fused.call(x2d, operand, plan.fused_call, return_gathered=gathered)
        return _placed(x, _as_group(y2d, plan), g, plan, gathered, names)
    x_scale, w_scale = scales
    if plan.block_scaled:  # x's tile scales [..., cols/128] follow its rows
        x_scale = x_scale.reshape(-1, x_scale.shape[-1])
    y2d, g, source_scales = fused.call_fp8(x2d, operand, x_scale, w_scale, plan.fused_call, gathered,
                                           plan.shared_scale)
    out = _placed(x, _as_group(y2d, plan), g, plan, gathered, names)
    if not gathered:
        return out
    if plan.block_scaled:  # [W, cols/128, rows] -> the gathered x's layout, its last dim in tiles
        source_scales = _in_x_layout(jnp.swapaxes(source_scales, 1, 2), tuple(x.shape[:-1]),
                                     x_scale.shape[-1], plan)
    return (*out, callsite.typed_like(names, source_scales))


def _as_group(y2d, plan: Plan):
    """The kernels' output(s) as the call's: y alone, or a group's tuple (a joined call's y split)."""
    if plan.joined is not None:
        return tuple(jnp.split(y2d, np.cumsum(plan.widths)[:-1].tolist(), axis=1))
    return y2d


def _in_x_layout(v, lead: tuple, last: int, plan: Plan):
    """A source-major result of the kernels, [W, rows, last] or [W * rows, last] (rows: this rank's
    shard's leading dims, `lead`), in x's layout with the gathered dim whole: in the rows layout
    lead's gathered dim W times longer ([W, P, D, R, ·] (dims before it, it, after it) -> [P, W, D,
    R, ·]), in the contraction layout the last dim (the sources' K slices in rank order)."""
    world, gd = plan.axis_size, plan.dimension
    if gd == len(lead):
        return jnp.swapaxes(v.reshape(world, -1, last), 0, 1).reshape(lead + (world * last,))
    before, d, after = lead[:gd], lead[gd], lead[gd + 1:]
    p = math.prod(before)
    v = v.reshape((world, p, d) + after + (last,))
    if p != 1:
        v = jnp.swapaxes(v, 0, 1)
    return v.reshape(before + (world * d,) + after + (last,))


def _placed(x, y2d, g, plan: Plan, gathered: bool, names):
    """The kernels' y [W * rows, N] (or [rows, N]; a group: a tuple of them) and gathered [W, rows,
    cols] in x's layout."""
    lead = tuple(x.shape[:-1])
    gather_k = plan.dimension == x.ndim - 1
    # The kernels write no gathered operand at all unless asked: a forward-only call moves only y.
    y = jax.tree.map(lambda v: v.reshape(lead + (v.shape[1],)) if gather_k else _in_x_layout(v, lead, v.shape[1], plan),
                     callsite.typed_like(names, y2d))
    if not gathered:
        return y
    return y, _in_x_layout(callsite.typed_like(names, g), lead, x.shape[-1], plan)


def forward(x, w, plan: Plan, gathered: bool = False):
    """all_gather(x) @ w, and with `gathered` the gathered x too: the fused kernels where the plan
    says so (on CUDA), else the reference."""
    return callsite.dispatch(plan.reason, functools.partial(_reference, plan=plan, gathered=gathered),
                             functools.partial(_fused_forward, plan=plan, gathered=gathered), x, w)


def _reference_fp8(x, w, x_scale, w_scale, plan: Plan, gathered: bool):
    y, g, scales = ag_gemm_reference_fp8(x, w, x_scale, w_scale, axis_name=plan.axis_name,
                                         gather_dimension=plan.dimension, out_dtype=plan.out_dtype,
                                         shared_scale=plan.shared_scale, block=plan.block_scaled)
    # Typed as the fused branch types its results (a shared scale's broadcast varies over nothing).
    names = callsite.varying_over(x, w, x_scale, w_scale)
    return callsite.typed_like(names, y, g, scales) if gathered else callsite.typed_like(names, y)


def forward_fp8(x, w, x_scale, w_scale, plan: Plan, gathered: bool = False):
    """all_gather(x * x_scale) @ (w * w_scale) of FP8 operands in plan.out_dtype, and with `gathered`
    the gathered FP8 x and the W sources' x_scale (block scales: x's tiles' scales, gathered with x
    over its gathered dim): the FP8 kernels where the plan says so (on CUDA), else the reference."""
    return callsite.dispatch(plan.reason, functools.partial(_reference_fp8, plan=plan, gathered=gathered),
                             functools.partial(_fused_forward, plan=plan, gathered=gathered), x, w, x_scale, w_scale)


# The op contract (entwine_jax.opspec), listed in entwine_jax/registry.py.
SPEC = opspec.OpSpec(name=OP, kind="all-gather", targets=("entwine_ag_gemm", "entwine_ag_gemm_fp8"), moved=_moved,
                     backward="gemm_rs", gathers=True, reference_backward=None, config_type=AgGemmConfig, plan=plan,
                     forward=forward, forward_fp8=forward_fp8, why_not_fused=why_not_fused,
                     default_config=default_config, fixed_us=fixed_us)
