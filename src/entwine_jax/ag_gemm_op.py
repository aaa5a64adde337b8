# ag_gemm: argument checks, config choice, dispatch between the fused kernels (entwine_jax.fused: its
# plan and communicator are prepared once per call site, into the op's static plan) and the XLA
# reference, and the custom VJP, whose dx is a gemm_rs in the same layout (the pairing of
# docs/design.md, "ag_gemm").
import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from entwine_jax import _log
from entwine_jax.config import AgGemmConfig, GemmRsConfig, _sm_count, ag_heuristic_config
from entwine_jax.ops import _DTYPES, _axis_names, _fused_module, _make_varying, _varying_axes, gemm_rs
from entwine_jax.reference import ag_gemm_reference, matmul_weight_grad

_printed: set = set()


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one call; hashable (a custom_vjp nondiff argument)."""
    axis_name: Any
    axis_size: int
    gather_dimension: int  # normalised, 0 <= gather_dimension < x.ndim
    config: AgGemmConfig
    return_gathered: bool
    reason: Optional[str]  # None: the fused path (on CUDA); else why the XLA reference runs
    fused_call: Any = None  # with reason None: fused.AgGemmCall (padding, grid, comm id)


def _check_args(x, w, axis_name, gather_dimension) -> tuple[int, int]:
    """Raise ValueError for anything ag_gemm cannot compute; returns (axis_size, gather dim)."""
    for name, v in (("x", x), ("w", w)):
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise ValueError(f"ag_gemm: {name} must be an array, got {type(v).__name__}")
    if x.ndim < 1:
        raise ValueError(f"ag_gemm: x must have rank >= 1, got shape {tuple(x.shape)}")
    if w.ndim != 2:
        raise ValueError(f"ag_gemm: w must have rank 2 ([K, N]), got rank {w.ndim} (shape {tuple(w.shape)})")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"ag_gemm: x.dtype must be bfloat16 or float16 (or float32 on the XLA path), got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"ag_gemm: w.dtype must equal x.dtype ({x.dtype}), got {w.dtype}")
    try:
        axis_size = jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"ag_gemm: axis_name {axis_name!r} is not bound; call ag_gemm inside jax.shard_map "
                         f"over a mesh with that axis ({e})") from None
    nd, gd = x.ndim, gather_dimension
    if isinstance(gd, bool) or not isinstance(gd, int) or not -nd <= gd < nd:
        raise ValueError(f"ag_gemm: gather_dimension must be an int in [{-nd}, {nd}) for x of rank {nd} "
                         f"(shape {tuple(x.shape)}), got {gd!r}")
    gd = int(gd) % nd
    if gd == nd - 1:
        # Contraction layout: each rank holds K / W of the contraction dim, w holds all of K.
        if x.shape[-1] * axis_size != w.shape[0]:
            raise ValueError(f"ag_gemm: gathering the last dim (the contraction dim) needs w.shape[0] == "
                             f"x.shape[-1] * axis size ({x.shape[-1]} * {axis_size} = {x.shape[-1] * axis_size}), "
                             f"got w shape {tuple(w.shape)}")
    elif x.ndim < 2:
        raise ValueError(f"ag_gemm: x must have rank >= 2 to gather a dim other than the contraction dim, "
                         f"got shape {tuple(x.shape)}")
    elif x.shape[-1] != w.shape[0]:
        raise ValueError(f"ag_gemm: x.shape[-1] (K) must equal w.shape[0], got {x.shape[-1]} and {w.shape[0]} "
                         f"(x shape {tuple(x.shape)}, w shape {tuple(w.shape)})")
    if x.shape[-1] == 0 or x.shape[gd] == 0:
        raise ValueError(f"ag_gemm: x must not be empty in its contraction or gathered dim, got shape {tuple(x.shape)}")
    return axis_size, gd


def _fused_unavailable(x, w, plan_axis, axis_size, gd, config) -> Optional[str]:
    """None when the fused kernels can run this call, else the reason they cannot (only answers)."""
    if config.path == "xla":
        return "config.path='xla'"
    if axis_size == 1 and config.path == "auto":
        return "axis size 1: nothing to gather, XLA's GEMM alone is faster (path='fused' runs the kernels anyway)"
    if x.dtype == jnp.float32:
        return "float32 inputs (the fused kernels take bfloat16/float16)"
    fused, err = _fused_module()
    if fused is None:
        return f"entwine_jax.fused not importable: {err}"
    gather_k = gd == x.ndim - 1
    x2d = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    try:
        return fused.ag_unavailable_reason(x2d, jax.ShapeDtypeStruct(tuple(w.shape), w.dtype), axis_name=plan_axis,
                                           axis_size=axis_size, gather_k=gather_k, config=config)
    except Exception as e:  # a bug there must not take the reference path down with it
        return f"entwine_jax.fused.ag_unavailable_reason raised {type(e).__name__}: {e}"


def _prepare_fused(x, w, axis_name, axis_size, gd, config) -> tuple[Any, Optional[str]]:
    """(fused.AgGemmCall, None) when the fused kernels run this call: its plan and communicator,
    prepared once here (trace time); else (None, the reason the XLA reference runs)."""
    reason = _fused_unavailable(x, w, axis_name, axis_size, gd, config)
    if reason is not None:
        return None, reason
    fused, _ = _fused_module()
    x2d = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    try:
        return fused.prepare_ag_gemm(x2d, jax.ShapeDtypeStruct(tuple(w.shape), w.dtype), axis_name=axis_name,
                                     axis_size=axis_size, gather_k=gd == x.ndim - 1, config=config), None
    except fused.Unavailable as e:  # e.g. the communicator could not be set up: a visible fallback
        return None, str(e)
    except Exception as e:  # a bug there must not take the reference path down with it
        return None, f"entwine_jax.fused.prepare_ag_gemm raised {type(e).__name__}: {e}"


def _report(x, w, plan: _Plan, source: str) -> None:
    key = (tuple(x.shape), tuple(w.shape), str(x.dtype), plan.axis_name, plan.gather_dimension)
    site = (f"x={x.dtype}{list(x.shape)} w={w.dtype}{list(w.shape)} axis={plan.axis_name!r} (size "
            f"{plan.axis_size}) gather_dimension={plan.gather_dimension}")
    _log.report_call_site("ag_gemm", key, site, plan.config, plan.reason, source, _printed)


def _reference(x, w, plan: _Plan):
    return ag_gemm_reference(x, w, axis_name=plan.axis_name, gather_dimension=plan.gather_dimension)


def _fused_forward(x, w, *, plan: _Plan):
    """The kernels see this rank's shard as [rows, cols]. Rows layout: the gathered dim's W slices
    come back stacked in rank order, [W * rows, N]; for a gathered dim with dims in front of it
    (x [B, S/W, K], gather dim 1) the result is permuted into place (one copy of y)."""
    fused, _ = _fused_module()
    world, gd, lead = plan.axis_size, plan.gather_dimension, tuple(x.shape[:-1])
    gather_k = gd == x.ndim - 1
    n = w.shape[1]
    y2d, g = fused.call_ag_gemm(x.reshape(-1, x.shape[-1]), w, plan.fused_call, return_gathered=True)
    names = sorted(_varying_axes(x) | _varying_axes(w), key=str)
    y2d, g = _make_varying(y2d, names), _make_varying(g, names)
    if gather_k:
        # g [W, rows, cols] -> [rows, W * cols]: the contraction dim in rank order.
        g = jnp.swapaxes(g, 0, 1).reshape(lead + (world * x.shape[-1],))
        return y2d.reshape(lead + (n,)), g
    before, d, after = lead[:gd], lead[gd], lead[gd + 1:]
    p = math.prod(before)
    # [W, P, D, R, ·] (source-major) -> [P, W, D, R, ·] -> [..., W * D, ...]
    y = y2d.reshape((world, p, d) + after + (n,))
    g = g.reshape((world, p, d) + after + (x.shape[-1],))
    if p != 1:
        y, g = jnp.swapaxes(y, 0, 1), jnp.swapaxes(g, 0, 1)
    shape = before + (world * d,) + after
    return y.reshape(shape + (n,)), g.reshape(shape + (x.shape[-1],))


def _forward(x, w, plan: _Plan):
    if plan.reason is not None:
        return _reference(x, w, plan)
    return jax.lax.platform_dependent(x, w, cuda=functools.partial(_fused_forward, plan=plan),
                                      default=functools.partial(_reference, plan=plan))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ag_gemm(x, w, plan):
    y, g = _forward(x, w, plan)
    return (y, g) if plan.return_gathered else y


def _ag_gemm_fwd(x, w, plan):
    y, g = _forward(x, w, plan)
    return ((y, g) if plan.return_gathered else y), (g, w)


def _ag_gemm_bwd(plan, res, cotangents):
    g, w = res
    # Only a call that returns the gathered operand has its cotangent (JAX passes zeros when that
    # output is unused: one reduce-scatter of zeros, so return it only where it is needed).
    dy, dg = cotangents if plan.return_gathered else (cotangents, None)
    # dx is a reduce-scatter of dy @ w.T over the gathered dim: one gemm_rs on dy and w.T (rows
    # layout: scatter the gathered dim; contraction layout: scatter the last dim, K).
    rs_config = GemmRsConfig(path="xla") if plan.config.path == "xla" else None
    dx = gemm_rs(dy, w.T, axis_name=plan.axis_name, scatter_dimension=plan.gather_dimension, config=rs_config)
    # A cotangent of the returned gathered operand reduce-scatters onto x too.
    if dg is not None:
        dx = dx + jax.lax.psum_scatter(dg, plan.axis_name, scatter_dimension=plan.gather_dimension,
                                       tiled=True).astype(dx.dtype)
    dw = matmul_weight_grad(g, dy, w.dtype)
    return dx, dw


_ag_gemm.defvjp(_ag_gemm_fwd, _ag_gemm_bwd)


def ag_gemm(x, w, *, axis_name, gather_dimension: int = 0, config: Optional[AgGemmConfig] = None,
            return_gathered: bool = False):
    """Fused AllGather + GEMM, called inside jax.shard_map.

    Computes jnp.matmul(jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True), w) with
    fp32 accumulation and the result in x.dtype; with return_gathered=True also returns the
    gathered x.

    Rows layout (gather_dimension a leading or middle dim: sequence parallelism): x [..., M/W, ..., K],
    w [K, N_local] -> [..., M, ..., N_local]. Contraction layout (gather_dimension = -1: activations
    sharded over the hidden dim): x [..., K/W], w [K, N_local] -> [..., N_local].
    config: an AgGemmConfig; default: ag_heuristic_config().
    """
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    axis_size, gd = _check_args(x, w, axis_name, gather_dimension)
    if config is not None and not isinstance(config, AgGemmConfig):
        raise ValueError(f"ag_gemm: config must be an AgGemmConfig or None, got {type(config).__name__}")
    if not isinstance(return_gathered, bool):
        raise ValueError(f"ag_gemm: return_gathered must be a bool, got {return_gathered!r}")
    if config is not None and config.gemm_sms >= _sm_count() and config.path != "xla":
        raise ValueError(f"ag_gemm: config.gemm_sms must leave an SM free for the chunk releases: at most "
                         f"{_sm_count() - 1} on this GPU, got {config.gemm_sms}")
    source = "override"
    if config is None:
        config, source = ag_heuristic_config(math.prod(x.shape[:-1]), w.shape[1], x.shape[-1], axis_size,
                                             x.dtype), "heuristic"
    fused_call, reason = _prepare_fused(x, w, axis_name, axis_size, gd, config)
    plan = _Plan(axis_name=axis_name, axis_size=axis_size, gather_dimension=gd, config=config,
                 return_gathered=return_gathered, reason=reason, fused_call=fused_call)
    _report(x, w, plan, source)
    names = sorted(_varying_axes(x) | _varying_axes(w) | set(_axis_names(axis_name)), key=str)
    with jax.named_scope("entwine_ag_gemm"):  # see gemm_rs: the census finds the op's collectives by it
        return _ag_gemm(_make_varying(x, names), _make_varying(w, names), plan)
