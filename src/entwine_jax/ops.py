# gemm_rs: argument checks, config choice (a config the kernels cannot run is a ValueError here),
# dispatch between the fused kernels (entwine_jax.fused: its plan and communicator are prepared once
# per call site, into the op's static plan) and the XLA reference, the per-call-site report, and the
# custom VJP, whose dx is an ag_gemm in the same layout (docs/design.md, "ag_gemm").
import dataclasses
import functools
import logging
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _log, _plan, tuning
from entwine_jax.config import AgGemmConfig, GemmRsConfig, get_default_config
from entwine_jax.reference import gemm_rs_reference, gemm_rs_reference_bwd, matmul_weight_grad

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_printed: set = set()


def extension_status() -> tuple[bool, str]:
    """(built, reason): whether the compiled extension entwine_jax._entwine can be imported."""
    try:
        from entwine_jax import _entwine
    except ImportError as e:
        reason = f"entwine_jax._entwine not importable ({e}): pure-Python install, gemm_rs uses the XLA reference path"
        _log.log_once("extension_status", logging.WARNING if _log.cuda_gpus_present() else logging.INFO, "%s", reason)
        return False, reason
    return True, f"entwine_jax._entwine built: {getattr(_entwine, '__file__', '?')}"


@functools.cache
def _fused_module() -> tuple[Any, Optional[str]]:
    """(module, None) when entwine_jax.fused imports, else (None, the error)."""
    extension_status()  # says once, at INFO, when this is a pure-Python install
    try:
        from entwine_jax import fused
    except Exception as e:  # any failure there must leave the reference path working
        return None, f"{type(e).__name__}: {e}"
    return fused, None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one call; hashable, so it can be a custom_vjp nondiff argument."""
    axis_name: Any
    axis_size: int
    scatter_dimension: int  # normalised, 0 <= scatter_dimension < x.ndim
    config: GemmRsConfig
    reason: Optional[str]  # None: the fused path (on CUDA); else why the XLA reference runs
    fused_call: Any = None  # with reason None: fused.GemmRsCall (the kernels' plan and the comm id)


def _check_args(x, w, axis_name, scatter_dimension) -> tuple[int, int]:
    """Raise ValueError for anything gemm_rs cannot compute; returns (axis_size, scatter dim)."""
    for name, v in (("x", x), ("w", w)):
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise ValueError(f"gemm_rs: {name} must be an array, got {type(v).__name__}")
    if x.ndim < 2:
        raise ValueError(f"gemm_rs: x must have rank >= 2 ([..., K_local]), got rank {x.ndim} (shape {tuple(x.shape)})")
    if w.ndim != 2:
        raise ValueError(f"gemm_rs: w must have rank 2 ([K_local, N]), got rank {w.ndim} (shape {tuple(w.shape)})")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"gemm_rs: x.dtype must be bfloat16 or float16 (or float32 on the XLA path), got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"gemm_rs: w.dtype must equal x.dtype ({x.dtype}), got {w.dtype}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"gemm_rs: x.shape[-1] (K_local) must equal w.shape[0], got {x.shape[-1]} and "
                         f"{w.shape[0]} (x shape {tuple(x.shape)}, w shape {tuple(w.shape)})")
    # Empty contractions and empty scattered dims make XLA fail after lowering (as plain
    # psum_scatter does); say so here instead.
    if x.shape[-1] == 0:
        raise ValueError(f"gemm_rs: x.shape[-1] (K_local) must be > 0, got shape {tuple(x.shape)}")
    # jax raises NameError for an axis name that no enclosing shard_map binds.
    try:
        axis_size = jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"gemm_rs: axis_name {axis_name!r} is not bound; call gemm_rs inside jax.shard_map "
                         f"over a mesh with that axis ({e})") from None
    out_shape = tuple(x.shape[:-1]) + (w.shape[1],)
    nd = len(out_shape)
    sd = scatter_dimension
    if isinstance(sd, bool) or not isinstance(sd, (int, np.integer)) or not -nd <= sd < nd:
        raise ValueError(f"gemm_rs: scatter_dimension must be an int in [{-nd}, {nd}) for an output of rank {nd} "
                         f"(shape {out_shape}), got {sd!r}")
    sd = int(sd) % nd
    if out_shape[sd] == 0:
        raise ValueError(f"gemm_rs: output dim {sd} (the scattered dim) must be > 0, got output shape {out_shape}")
    if out_shape[sd] % axis_size != 0:
        raise ValueError(f"gemm_rs: output dim {sd} (size {out_shape[sd]}) must be divisible by the size of axis "
                         f"{axis_name!r} ({axis_size}); output shape {out_shape}")
    return axis_size, sd


def _kernel_scatter_dim(x, sd: int) -> int:
    """The fused kernels scatter rows (0) or columns (1) of the [rows, N] view of the product: a
    scatter over N is a column scatter; any other output dim is a row scatter (a middle dim after
    _rows_by_partition)."""
    return 1 if sd == x.ndim - 1 else 0


def _check_config(config: GemmRsConfig) -> None:
    """ValueError, at trace time, for a config the kernels cannot run whatever the shape (their own
    rules, from the C++ plan; none without the extension, where no config reaches the kernels)."""
    if config.path == "xla":
        return
    rule = _plan.gemm_rs_config_rule(config)
    if rule is not None:
        raise ValueError(f"gemm_rs: config {config} cannot run on the fused kernels: {rule}")


def _fused_unavailable(x, w, axis_name, axis_size, sd, config) -> Optional[str]:
    """None when the fused kernels can run this call, else the reason they cannot. Only answers:
    _prepare_fused makes the communicator."""
    if config.path == "xla":
        return "config.path='xla'"
    if axis_size == 1 and config.path == "auto":
        # Nothing to reduce or scatter: the fused op would only add a copy of the whole product
        # (measured 0.43-0.73x of XLA's GEMM on one H200; docs/performance.md, "What was tried").
        return "axis size 1: nothing to reduce or scatter, XLA's GEMM alone is faster (path='fused' runs the kernels anyway)"
    if x.dtype == jnp.float32:
        return "float32 inputs (the fused kernels take bfloat16/float16)"
    fused, err = _fused_module()
    if fused is None:
        return f"entwine_jax.fused not importable: {err}"
    x2d = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    w_aval = jax.ShapeDtypeStruct(tuple(w.shape), w.dtype)
    try:
        return fused.unavailable_reason(x2d, w_aval, axis_name=axis_name, axis_size=axis_size,
                                        scatter_dimension=_kernel_scatter_dim(x, sd), config=config)
    except Exception as e:  # a bug there must not take the reference path down with it
        return f"entwine_jax.fused.unavailable_reason raised {type(e).__name__}: {e}"


def _prepare_fused(x, w, axis_name, axis_size, sd, config) -> tuple[Any, Optional[str]]:
    """(fused.GemmRsCall, None) when the fused kernels run this call: its plan and communicator,
    prepared once here (trace time); else (None, the reason the XLA reference runs)."""
    reason = _fused_unavailable(x, w, axis_name, axis_size, sd, config)
    if reason is not None:
        return None, reason
    fused, _ = _fused_module()
    x2d = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    try:
        return fused.prepare_gemm_rs(x2d, jax.ShapeDtypeStruct(tuple(w.shape), w.dtype), axis_name=axis_name,
                                     axis_size=axis_size, scatter_dimension=_kernel_scatter_dim(x, sd),
                                     config=config), None
    except fused.Unavailable as e:  # e.g. the communicator could not be set up: a visible fallback
        return None, str(e)
    except Exception as e:  # a bug there must not take the reference path down with it
        return None, f"entwine_jax.fused.prepare_gemm_rs raised {type(e).__name__}: {e}"


def _report(x, w, plan: _Plan, source: str = "") -> None:
    """Log the XLA-path reason once per call site; print the choice (and where the config came
    from: tuning.SOURCE_*) under ENTWINE_PRINT_CONFIG=1."""
    key = (tuple(x.shape), tuple(w.shape), str(x.dtype), plan.axis_name, plan.scatter_dimension)
    site = (f"x={x.dtype}{list(x.shape)} w={w.dtype}{list(w.shape)} axis={plan.axis_name!r} (size "
            f"{plan.axis_size}) scatter_dimension={plan.scatter_dimension}")
    middle = 0 < plan.scatter_dimension < x.ndim - 1
    note = " (a middle dim: x's rows are permuted first, one copy of x)" if middle else ""
    _log.report_call_site("gemm_rs", key, site, plan.config, plan.reason, source, _printed, note)


def _rows_by_partition(x, sd: int, world: int):
    """x [..., K] -> the [rows, K] view in which the W slices of output dim `sd` are W contiguous
    blocks of rows, each in the row-major order of its slice: [P, D, R, K] (dims before sd, dim sd,
    dims after it) -> [W, P, D/W, R, K]. For sd = 0 that is the plain reshape; for a middle dim it
    costs one copy of x (a transpose XLA runs before the custom call)."""
    lead = x.shape[:-1]
    p, d, r = math.prod(lead[:sd]), lead[sd], math.prod(lead[sd + 1:])
    if p == 1:
        return x.reshape(-1, x.shape[-1])
    blocks = x.reshape(p, world, d // world, r, x.shape[-1])
    return jnp.swapaxes(blocks, 0, 1).reshape(-1, x.shape[-1])


def _fused_forward(x, w, *, plan: _Plan):
    # A scatter over N is a scatter over the columns of the [rows, K] view of x; a scatter over any
    # other output dim is a scatter over its rows, once _rows_by_partition has made every rank's
    # slice a contiguous block of rows (for the leading dim it already is, since B % W == 0).
    fused, _ = _fused_module()
    sd, world, lead = plan.scatter_dimension, plan.axis_size, tuple(x.shape[:-1])
    columns = _kernel_scatter_dim(x, sd)
    x2d = x.reshape(-1, x.shape[-1]) if columns else _rows_by_partition(x, sd, world)
    y = fused.call_gemm_rs(x2d, w, plan.fused_call)
    # platform_dependent needs both branches typed alike: the reference's output varies over every
    # axis x and w vary over (an FFI call's output may not carry that type).
    y = _make_varying(y, sorted(_varying_axes(x) | _varying_axes(w), key=str))
    if columns:
        return y.reshape(lead + (w.shape[1] // world,))
    return y.reshape(lead[:sd] + (lead[sd] // world,) + lead[sd + 1:] + (w.shape[1],))


def _forward(x, w, plan: _Plan):
    reference = functools.partial(gemm_rs_reference, axis_name=plan.axis_name,
                                  scatter_dimension=plan.scatter_dimension)
    if plan.reason is not None:
        return reference(x, w)
    # The same jitted code must still lower for CPU (or any non-CUDA device) of a mixed program.
    return jax.lax.platform_dependent(x, w, cuda=functools.partial(_fused_forward, plan=plan), default=reference)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gemm_rs(x, w, plan):
    return _forward(x, w, plan)


def _gemm_rs_fwd(x, w, plan):
    return _forward(x, w, plan), (x, w)


def _gemm_rs_bwd(plan, res, dy):
    x, w = res
    if plan.config.path == "xla":
        return gemm_rs_reference_bwd(x, w, dy, axis_name=plan.axis_name, scatter_dimension=plan.scatter_dimension)
    # The backward of a reduce-scatter is an all-gather: dx = all_gather(dy) @ w.T is one ag_gemm in
    # the same layout (gathering the scattered dim), and its gathered dy serves dw = x.T @ g.
    from entwine_jax.ag_gemm_op import ag_gemm  # ag_gemm_op imports this module
    dx, g = ag_gemm(dy, w.T, axis_name=plan.axis_name, gather_dimension=plan.scatter_dimension,
                    config=AgGemmConfig(path="fused") if plan.config.path == "fused" else None,
                    return_gathered=True)
    return dx, matmul_weight_grad(x, g, w.dtype)


_gemm_rs.defvjp(_gemm_rs_fwd, _gemm_rs_bwd)


def _axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _varying_axes(v) -> frozenset:
    aval = jax.typeof(v)
    # jax 0.11 keeps the varying axes in aval.manual_axis_type.varying (earlier: aval.vma).
    varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", frozenset())
    return frozenset(varying)


def _make_varying(v, names):
    # The bwd rule's dx, dw vary over every axis x, w or the all-gather vary over. Under
    # shard_map's type checks an input that does not vary over one of them must be cast first;
    # AD then turns that cast into the psum its cotangent needs (e.g. w replicated over a data
    # axis gets dw summed over it). Without type checks nothing varies and the cast is a no-op.
    missing = [n for n in names if n not in _varying_axes(v)]
    for name in missing:
        v = jax.lax.pcast(v, name, to="varying")
    return v


def gemm_rs(x, w, *, axis_name, scatter_dimension: int = 0, config: Optional[GemmRsConfig] = None):
    """Fused GEMM + ReduceScatter, called inside jax.shard_map.

    Computes jax.lax.psum_scatter(x @ w, axis_name, scatter_dimension=scatter_dimension, tiled=True)
    with fp32 accumulation and the result in x.dtype.

    x: [..., K_local] (contraction dim sharded over axis_name); w: [K_local, N].
    scatter_dimension indexes the output [..., N]; negative values count from the end.
    config: a GemmRsConfig; default: set_default_config(), else the tuned table (user cache, then
    shipped; entwine_jax.tuning), else heuristic_config().
    """
    # A list of axis names would not be hashable in the plan; psum_scatter takes a tuple too.
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    axis_size, sd = _check_args(x, w, axis_name, scatter_dimension)
    if config is not None and not isinstance(config, GemmRsConfig):
        raise ValueError(f"gemm_rs: config must be a GemmRsConfig or None, got {type(config).__name__}")
    source = tuning.SOURCE_OVERRIDE
    if config is None:
        config = get_default_config()
    if config is None:
        # Keyed by the rows of x as this rank sees them (before the scatter), N, K_local, W, dtype.
        config, source = tuning.select_config(math.prod(x.shape[:-1]), w.shape[1], x.shape[-1], axis_size, x.dtype,
                                              rows=_kernel_scatter_dim(x, sd) == 0)
    _check_config(config)
    fused_call, reason = _prepare_fused(x, w, axis_name, axis_size, sd, config)
    plan = _Plan(axis_name=axis_name, axis_size=axis_size, scatter_dimension=sd, config=config, reason=reason,
                 fused_call=fused_call)
    _report(x, w, plan, source)
    names = sorted(_varying_axes(x) | _varying_axes(w) | set(_axis_names(axis_name)), key=str)
    x = _make_varying(x, names)
    w = _make_varying(w, names)
    # The scope names every operation of the call (forward and backward) in the program's metadata,
    # which is how a collective census tells the op's collectives from XLA's own.
    with jax.named_scope("entwine_gemm_rs"):
        return _gemm_rs(x, w, plan)
