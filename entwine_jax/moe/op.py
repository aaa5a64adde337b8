# moe_dispatch_gemm and moe_gemm_combine at a call site: argument checks (ValueErrors naming the
# argument, the expected and the actual value), the static capacity, the plan (every call takes the
# XLA reference until the kernels exist, said once per call site), and the custom VJP that pairs each
# op with the other (docs/design.md, "Mixture of experts (planned)", "The pairing"). Their SPECs declare
# them to shared code as routed ops (entwine_jax.opspec).
import dataclasses
import functools
import math
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp

from entwine_jax import callsite, opspec
from entwine_jax.moe import reference
from entwine_jax.moe.config import MoeConfig
from entwine_jax.moe.reference import COMBINE, DISPATCH, TILE, MoeHandle, round_up

printed: set = set()  # call sites printed under ENTWINE_PRINT_CONFIG=1
NOT_BUILT = "MoE kernels not built yet (docs/design.md, \"Mixture of experts (planned)\"): the XLA reference runs"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one call; hashable, so it can be a custom_vjp nondiff argument."""
    axis_name: Any
    axis_size: int
    config: MoeConfig
    reason: Optional[str]  # why the XLA reference runs (always, until the kernels exist)
    e_local: int
    cap: int
    dimension: ClassVar[int] = 0
    return_gathered: ClassVar[bool] = False


def capacity_rows(world: int, tokens: int, k: int, e_local: int, capacity: Optional[float]) -> int:
    """The pool's static rows (docs/design.md, "Capacity, dropless and overflow"): dropless, the worst
    case W*T*min(k, E_local) plus each expert's padding; with a factor f, f*T*k plus the padding."""
    if capacity is None:
        return round_up(world * tokens * min(k, e_local) + (TILE - 1) * e_local, TILE)
    return round_up(math.ceil(capacity * tokens * k) + (TILE - 1) * e_local, TILE)


def _check_array(op: str, name: str, v, shape_words: str, ndim: int) -> None:
    if not (hasattr(v, "shape") and hasattr(v, "dtype")):
        raise ValueError(f"{op}: {name} must be an array, got {type(v).__name__}")
    if v.ndim != ndim:
        raise ValueError(f"{op}: {name} must have rank {ndim} ({shape_words}), got rank {v.ndim} "
                         f"(shape {tuple(v.shape)})")


def _check_float(op: str, name: str, v, like=None) -> None:
    if jnp.dtype(v.dtype) not in callsite.DTYPES:
        raise ValueError(f"{op}: {name}.dtype must be bfloat16 or float16 (or float32 on the XLA path), "
                         f"got {v.dtype}")
    if like is not None and v.dtype != like[1].dtype:
        raise ValueError(f"{op}: {name}.dtype must equal {like[0]}.dtype ({like[1].dtype}), got {v.dtype}")


def _config(op: str, config: Optional[MoeConfig]) -> tuple[MoeConfig, str]:
    """(the call's config, where it came from)."""
    if config is not None and not isinstance(config, MoeConfig):
        raise ValueError(f"{op}: config must be a MoeConfig or None, got {type(config).__name__}")
    return (config, "the call") if config is not None else default_config(None, None, 0, 0)


def why_not_fused(x, w, *, axis_name, axis_size: int, dimension: int, config: MoeConfig, out_dtype=None,
                  shared_scale: bool = False) -> Optional[str]:
    """Why a call takes the XLA path: the user asked, or (every other call) no kernels yet."""
    return "config.path='xla'" if config.path == "xla" else NOT_BUILT


def default_config(x, w, size: int, dimension: int) -> tuple[MoeConfig, str]:
    """(config, source) of a call without one: dropless, path auto."""
    return MoeConfig(), "default"


def plan_dispatch(x, w1, *, axis_name, dimension=0, config: Optional[MoeConfig] = None,
                  return_gathered: bool = False, out_dtype=None, shared_scale: bool = False) -> Plan:
    """Check a moe_dispatch_gemm call (x: an opspec.RoutedInput of x [T, H] and topk_idx [T, k]; w1
    [E_local, H, N]), fix its capacity, report its path once. return_gathered and out_dtype (FP8) must
    be the defaults (neither is built); shared_scale changes nothing."""
    xs, topk_idx = x.x, x.topk_idx
    if return_gathered or out_dtype is not None:
        raise ValueError(f"{DISPATCH}: return_gathered and out_dtype (FP8) are not supported yet")
    _check_array(DISPATCH, "x", xs, "[T, H]", 2)
    _check_array(DISPATCH, "topk_idx", topk_idx, "[T, k]", 2)
    _check_array(DISPATCH, "w1", w1, "[E_local, H, N]", 3)
    _check_float(DISPATCH, "x", xs)
    _check_float(DISPATCH, "w1", w1, ("x", xs))
    if topk_idx.dtype != jnp.int32:
        raise ValueError(f"{DISPATCH}: topk_idx.dtype must be int32 (global expert ids, -1: none), got "
                         f"{topk_idx.dtype}")
    (t, h), (t2, k), (e_local, h2, n) = xs.shape, topk_idx.shape, w1.shape
    if t2 != t:
        raise ValueError(f"{DISPATCH}: topk_idx.shape[0] must equal x.shape[0] (T = {t}), got shape "
                         f"{tuple(topk_idx.shape)}")
    if h2 != h:
        raise ValueError(f"{DISPATCH}: w1.shape[1] must equal x.shape[1] (H = {h}), got w1 shape {tuple(w1.shape)}")
    if min(t, h, k, e_local, n) == 0:
        raise ValueError(f"{DISPATCH}: every dim must be > 0, got x {tuple(xs.shape)}, topk_idx "
                         f"{tuple(topk_idx.shape)}, w1 {tuple(w1.shape)}")
    config, source = _config(DISPATCH, config)
    axis_name = callsite.hashable_axis(axis_name)
    size = callsite.axis_size(DISPATCH, axis_name)
    cap = capacity_rows(size, t, k, e_local, config.capacity)
    if cap < TILE * e_local:
        raise ValueError(f"{DISPATCH}: capacity {config.capacity} gives {cap} pool rows, fewer than 128 * E_local "
                         f"= {TILE * e_local} (one tile per local expert); use a larger factor")
    reason = why_not_fused(x, w1, axis_name=axis_name, axis_size=size, dimension=0, config=config)
    site = (f"x={xs.dtype}{list(xs.shape)} topk_idx{list(topk_idx.shape)} w1={w1.dtype}{list(w1.shape)} "
            f"axis={axis_name!r} (size {size}) cap={cap}")
    key = (tuple(xs.shape), tuple(topk_idx.shape), tuple(w1.shape), str(xs.dtype), axis_name, cap)
    callsite.report(DISPATCH, key, site, config, reason, source, printed)
    return Plan(axis_name=axis_name, axis_size=size, config=config, reason=reason, e_local=e_local, cap=cap)


def plan_combine(x, w2, *, axis_name, dimension=0, config: Optional[MoeConfig] = None,
                 return_gathered: bool = False, out_dtype=None, shared_scale: bool = False) -> Plan:
    """Check a moe_gemm_combine call (x: an opspec.RoutedInput of h [cap, F], topk_weights [T, k] and
    the dispatch's handle; w2 [E_local, F, H]) against the handle's layout; report its path once."""
    h, weights, handle = x.x, x.weights, x.handle
    if return_gathered or out_dtype is not None:
        raise ValueError(f"{COMBINE}: return_gathered and out_dtype (FP8) are not supported yet")
    if not isinstance(handle, MoeHandle):
        raise ValueError(f"{COMBINE}: handle must be the MoeHandle moe_dispatch_gemm returned, got "
                         f"{type(handle).__name__}")
    _check_array(COMBINE, "h", h, "[cap, F]", 2)
    _check_array(COMBINE, "w2", w2, "[E_local, F, H]", 3)
    _check_array(COMBINE, "topk_weights", weights, "[T, k]", 2)
    _check_float(COMBINE, "h", h)
    _check_float(COMBINE, "w2", w2, ("h", h))
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"{COMBINE}: topk_weights.dtype must be a float type, got {weights.dtype}")
    cap, (t, k), e_local = handle.src.shape[0], handle.pos.shape, handle.group_sizes.shape[0]
    if h.shape[0] != cap:
        raise ValueError(f"{COMBINE}: h.shape[0] must equal the dispatch's pool rows (cap = {cap}), got h shape "
                         f"{tuple(h.shape)}")
    if w2.shape[0] != e_local or w2.shape[1] != h.shape[1]:
        raise ValueError(f"{COMBINE}: w2 must have shape [E_local = {e_local}, F = {h.shape[1]}, H], got "
                         f"{tuple(w2.shape)}")
    if tuple(weights.shape) != (t, k):
        raise ValueError(f"{COMBINE}: topk_weights must have shape [T, k] = {(t, k)} (the dispatch's topk_idx), "
                         f"got {tuple(weights.shape)}")
    config, source = _config(COMBINE, config)
    axis_name = callsite.hashable_axis(axis_name)
    size = callsite.axis_size(COMBINE, axis_name)
    if handle.counts.shape != (size, size * e_local):
        raise ValueError(f"{COMBINE}: handle.counts must have shape [W, E] = {(size, size * e_local)} on axis "
                         f"{axis_name!r}, got {tuple(handle.counts.shape)} (a handle of another axis?)")
    reason = why_not_fused(x, w2, axis_name=axis_name, axis_size=size, dimension=0, config=config)
    site = f"h={h.dtype}{list(h.shape)} w2={w2.dtype}{list(w2.shape)} T={t} k={k} axis={axis_name!r} (size {size})"
    key = (tuple(h.shape), tuple(w2.shape), (t, k), str(h.dtype), axis_name)
    callsite.report(COMBINE, key, site, config, reason, source, printed)
    return Plan(axis_name=axis_name, axis_size=size, config=config, reason=reason, e_local=e_local, cap=cap)


def _where(plan: Plan) -> dict:
    return dict(axis_name=plan.axis_name, world=plan.axis_size, e_local=plan.e_local)


def forward_dispatch(x, w1, plan: Plan, gathered: bool = False):
    """(y, handle) of a planned dispatch (x: a RoutedInput); no differentiation rule (dispatch() has it)."""
    handle = reference.layout(x.topk_idx, cap=plan.cap, **_where(plan))
    return reference.dispatch_reference(x.x, w1, handle, **_where(plan))[0], handle


def forward_combine(x, w2, plan: Plan, gathered: bool = False):
    """out of a planned combine (x: a RoutedInput with h, the weights and the handle)."""
    return reference.combine_reference(x.x, w2, x.weights, x.handle, **_where(plan))


# --- The pairing: each op's backward is the other (docs/design.md, "The pairing") ------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, w1, handle, plan):
    return reference.dispatch_reference(x, w1, handle, **_where(plan))[0]


def _dispatch_fwd(x, w1, handle, plan):
    y, pool = reference.dispatch_reference(x, w1, handle, **_where(plan))
    return y, (pool, w1, handle)


def _dispatch_bwd(plan, res, dy):
    pool, w1, handle = res
    # dy has y's dtype, x's.
    dx, dw1 = reference.dispatch_backward(pool, w1, handle, dy, x_dtype=dy.dtype, **_where(plan))
    return dx, dw1, None  # the handle is integers: no cotangent


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(h, w2, weights, handle, plan):
    return reference.combine_reference(h, w2, weights, handle, **_where(plan))


def _combine_fwd(h, w2, weights, handle, plan):
    return reference.combine_reference(h, w2, weights, handle, **_where(plan)), (h, w2, weights, handle)


def _combine_bwd(plan, res, dout):
    h, w2, weights, handle = res
    dh, dw2, dweights = reference.combine_backward(h, w2, weights, handle, dout, **_where(plan))
    return dh, dw2, dweights, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def dispatch(x, topk_idx, w1, *, axis_name, config: Optional[MoeConfig]):
    """moe_dispatch_gemm, differentiable in x and w1, inside jax.shard_map: (y [cap, N], handle)."""
    plan = plan_dispatch(opspec.RoutedInput(x, topk_idx), w1, axis_name=axis_name, config=config)
    names = callsite.varying_over(x, topk_idx, w1, axis_name=plan.axis_name)
    x, topk_idx, w1 = (callsite.make_varying(v, names) for v in (x, topk_idx, w1))
    # The scope names every operation of the call, forward and backward (the census's owner).
    with jax.named_scope(DISPATCH_SPEC.scope):
        handle = reference.layout(topk_idx, cap=plan.cap, **_where(plan))
        return _dispatch(x, w1, handle, plan), handle


def combine(h, w2, topk_weights, handle, *, axis_name, config: Optional[MoeConfig]):
    """moe_gemm_combine, differentiable in h, w2 and topk_weights, inside jax.shard_map: out [T, H]."""
    plan = plan_combine(opspec.RoutedInput(h, weights=topk_weights, handle=handle), w2, axis_name=axis_name,
                        config=config)
    names = callsite.varying_over(h, w2, topk_weights, axis_name=plan.axis_name)
    h, w2, topk_weights = (callsite.make_varying(v, names) for v in (h, w2, topk_weights))
    handle = MoeHandle(*(callsite.make_varying(v, names) for v in handle))
    with jax.named_scope(COMBINE_SPEC.scope):
        return _combine(h, w2, topk_weights, handle, plan)


def reference_bytes(kind: str, operand_bytes: int, world: int) -> int:
    """What the census counts for a collective of the reference (docs/design.md, "Census"): each slot's
    data crosses once, (W-1)/W of it to another rank; the reference's all-to-all operand is W per-pair
    blocks of T*k rows each, W times that. The counts' all-gather is counted as it is."""
    if kind == "all-to-all":
        return (world - 1) * operand_bytes // (world * world)
    return (world - 1) * operand_bytes if kind == "all-gather" else operand_bytes


# The op contracts (entwine_jax.opspec), listed in entwine_jax/registry.py: routed ops, no kernels yet
# (no targets, moved, forward_fp8 or fixed cost); each one's backward is the other.
DISPATCH_SPEC = opspec.OpSpec(name=DISPATCH, kind="ragged-all-to-all", targets=(), moved=None, backward=COMBINE,
                              gathers=False, reference_backward=None, config_type=MoeConfig, plan=plan_dispatch,
                              forward=forward_dispatch, forward_fp8=None, why_not_fused=why_not_fused,
                              default_config=default_config, fixed_us=None, routed=True,
                              reference_bytes=reference_bytes)
COMBINE_SPEC = opspec.OpSpec(name=COMBINE, kind="ragged-all-to-all", targets=(), moved=None, backward=DISPATCH,
                             gathers=False, reference_backward=None, config_type=MoeConfig, plan=plan_combine,
                             forward=forward_combine, forward_fp8=None, why_not_fused=why_not_fused,
                             default_config=default_config, fixed_us=None, routed=True,
                             reference_bytes=reference_bytes)
