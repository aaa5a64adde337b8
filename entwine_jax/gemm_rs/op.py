# gemm_rs at a call site: argument checks, config choice (override, tuned table, heuristic; a config
# the kernels cannot run is a ValueError here), the plan of the call (fused kernels prepared once, or
# the reason the XLA reference runs), the report, and the forward computation; SPEC declares them
# (the op contract, entwine_jax.opspec). Its backward (dx: an ag_gemm in the same layout) is declared
# there and run by entwine_jax.pairing.
import dataclasses
import functools
import math
from typing import Any, ClassVar, Optional

import jax

from entwine_jax import callsite, fp8, opspec
from entwine_jax.gemm_rs import fused, table
from entwine_jax.gemm_rs import plan as kernel_plan
from entwine_jax.gemm_rs.config import GemmRsConfig, get_default_config
from entwine_jax.gemm_rs.reference import gemm_rs_reference, gemm_rs_reference_bwd, gemm_rs_reference_fp8

OP = "gemm_rs"
printed: set = set()  # call sites printed under ENTWINE_PRINT_CONFIG=1


def _moved(target: str, ins: list, outs: list, attrs: str) -> tuple:
    """(W, what one rank sends W - 1 times) of a custom call: its output block (padded), whose peers'
    partials it reduces. Rows: x [W * M', K] -> y [M', N]; columns: w [K, W * N'] -> y [M, N']
    (fused.call); the FP8 target takes the weight transposed, [N, K]."""
    (_, x), (_, w), (_, y) = ins[0][0], ins[1][0], outs[0]
    w = w[::-1] if target.endswith("_fp8") else w
    columns = opspec.attribute_is(attrs, "scatter_dimension", "1")
    return (w[1] // y[1] if columns else x[0] // y[0]), outs[:1]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one call; hashable, so it can be a custom_vjp nondiff argument."""
    axis_name: Any
    axis_size: int
    dimension: int  # the scatter dimension, normalised: 0 <= dimension < x.ndim
    config: GemmRsConfig
    reason: Optional[str]  # None: the fused path (on CUDA); else why the XLA reference runs
    fused_call: Any = None  # with reason None: fused.GemmRsCall (the kernels' plan and the comm id)
    out_dtype: Optional[str] = None  # an FP8 call (entwine_jax.fp8): the output dtype's name
    block_scaled: bool = False  # an FP8 call with block scales (1x128 of x, 128x128 of w)
    # A reduce-scatter returns no gathered operand; each rank's partial carries its own FP8 scales.
    return_gathered: ClassVar[bool] = False


def _check_args(x, w, axis_name, scatter_dimension, fp8: bool) -> tuple[int, int]:
    """Raise ValueError for anything gemm_rs cannot compute; returns (axis_size, scatter dim)."""
    callsite.check_operands(OP, x, w, "[K_local, N]", fp8)
    if x.ndim < 2:
        raise ValueError(f"gemm_rs: x must have rank >= 2 ([..., K_local]), got rank {x.ndim} (shape {tuple(x.shape)})")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"gemm_rs: x.shape[-1] (K_local) must equal w.shape[0], got {x.shape[-1]} and "
                         f"{w.shape[0]} (x shape {tuple(x.shape)}, w shape {tuple(w.shape)})")
    # Empty contractions and empty scattered dims make XLA fail after lowering (as plain
    # psum_scatter does); say so here instead.
    if x.shape[-1] == 0:
        raise ValueError(f"gemm_rs: x.shape[-1] (K_local) must be > 0, got shape {tuple(x.shape)}")
    size = callsite.axis_size(OP, axis_name)
    out_shape = tuple(x.shape[:-1]) + (w.shape[1],)
    sd = callsite.dimension(OP, "scatter_dimension", scatter_dimension, out_shape, "an output")
    if out_shape[sd] == 0:
        raise ValueError(f"gemm_rs: output dim {sd} (the scattered dim) must be > 0, got output shape {out_shape}")
    if out_shape[sd] % size != 0:
        raise ValueError(f"gemm_rs: output dim {sd} (size {out_shape[sd]}) must be divisible by the size of axis "
                         f"{axis_name!r} ({size}); output shape {out_shape}")
    return size, sd


def kernel_scatter_dim(x, sd: int) -> int:
    """The fused kernels scatter rows (0) or columns (1) of the [rows, N] view of the product: a
    scatter over N is a column scatter; any other output dim is a row scatter (a middle dim after
    _rows_by_partition)."""
    return 1 if sd == x.ndim - 1 else 0


def _check_config(config: GemmRsConfig) -> None:
    """ValueError, at trace time, for a config the kernels cannot run whatever the shape (their own
    rules, from the C++ plan; none without the extension, where no config reaches the kernels)."""
    if config.path == "xla":
        return
    rule = kernel_plan.config_rule(config)
    if rule is not None:
        raise ValueError(f"gemm_rs: config {config} cannot run on the fused kernels: {rule}")


def fixed_us() -> float:
    """The fused call's fixed device cost beyond XLA's, in microseconds (the small-call rule,
    tuning/crossover.py): the consumer's launch beside the GEMM and the flag round trips; not
    measured apart yet, set from the handler's launches."""
    return 15.0


def _cost(x, w, size: int, out_dtype) -> tuple[float, float]:
    """(flops of this rank's GEMM, bytes its reduce-scatter brings in: the W - 1 peers' partials of
    this rank's slice of the [M, N] product, in the output dtype)."""
    m, (k, n) = math.prod(x.shape[:-1]), w.shape
    return 2.0 * m * n * k, (size - 1) / size * m * n * jax.numpy.dtype(out_dtype).itemsize


def _fused_arguments(x, w, axis_name, size, sd, config, out_dtype, block_scaled) -> tuple:
    x2d = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    w_aval = jax.ShapeDtypeStruct(tuple(w.shape), w.dtype)
    kwargs = dict(axis_name=axis_name, axis_size=size, scatter_dimension=kernel_scatter_dim(x, sd), config=config)
    if out_dtype is not None:  # an FP8 call
        kwargs.update(out_dtype=out_dtype, block_scaled=block_scaled)
    return x2d, w_aval, kwargs


def why_not_fused(x, w, *, axis_name, axis_size: int, dimension: int, config: GemmRsConfig, out_dtype=None,
                  shared_scale: bool = False, block_scaled: bool = False) -> Optional[str]:
    """Why a call on operands shaped like x and w (dimension: the scatter dimension, normalised;
    out_dtype: an FP8 call's output dtype, block_scaled: with block scales; shared_scale changes
    nothing here) takes the XLA path on this mesh, or None; asks only, no communicator is made (for
    programs that report on calls, e.g. the benchmarks)."""
    reason = callsite.early_reason(config, axis_size, x.dtype, "reduce or scatter",
                                   *_cost(x, w, axis_size, out_dtype or x.dtype), fixed_us(), axis_name=axis_name)
    if reason is not None:
        return reason
    x2d, w_aval, kwargs = _fused_arguments(x, w, axis_name, axis_size, dimension, config, out_dtype, block_scaled)
    return fused.unavailable_reason(x2d, w_aval, **kwargs)


def _prepare(x, w, axis_name, size, sd, config, out_dtype, block_scaled) -> tuple[Any, Optional[str]]:
    """(fused.GemmRsCall, None) when the fused kernels run this call, else (None, the reason)."""
    # why_not_fused only answers; prepare makes the communicator once it said None.
    x2d, w_aval, kwargs = _fused_arguments(x, w, axis_name, size, sd, config, out_dtype, block_scaled)
    return callsite.prepare(OP, lambda: why_not_fused(x, w, axis_name=axis_name, axis_size=size, dimension=sd,
                                                      config=config, out_dtype=out_dtype, block_scaled=block_scaled),
                            lambda: fused.prepare(x2d, w_aval, **kwargs))


def default_config(x, w, size: int, dimension: int) -> tuple[GemmRsConfig, str]:
    """(config, source) of a call without an override: set_default_config(), else the tuned table,
    else the heuristic. dimension: the normalised scatter dimension."""
    config = get_default_config()
    if config is not None:
        return config, table.SOURCE_OVERRIDE
    # Keyed by the rows of x as this rank sees them (before the scatter), N, K_local, W, dtype.
    return table.select_config(math.prod(x.shape[:-1]), w.shape[1], x.shape[-1], size, x.dtype,
                               rows=kernel_scatter_dim(x, dimension) == 0)


def plan(x, w, *, axis_name, dimension, config: Optional[GemmRsConfig], return_gathered: bool = False,
         out_dtype=None, shared_scale: bool = False, block_scaled: bool = False) -> Plan:
    """Check a call, choose its config and its path, and report the choice once per call site.
    dimension: the scatter dimension; out_dtype: an FP8 call (operands checked by entwine_jax.fp8)
    writing this dtype, block_scaled: with block scales. return_gathered must be False and
    shared_scale changes nothing: a reduce-scatter gathers nothing, and each rank's partial carries
    its own scales."""
    if return_gathered:
        raise ValueError("gemm_rs: return_gathered must be False (a reduce-scatter gathers nothing)")
    axis_name = callsite.hashable_axis(axis_name)
    out_dtype = None if out_dtype is None else jax.numpy.dtype(out_dtype).name
    size, sd = _check_args(x, w, axis_name, dimension, out_dtype is not None)
    if config is not None and not isinstance(config, GemmRsConfig):
        raise ValueError(f"gemm_rs: config must be a GemmRsConfig or None, got {type(config).__name__}")
    source = table.SOURCE_OVERRIDE
    if config is None:
        config, source = default_config(x, w, size, sd)
    _check_config(config)
    if out_dtype is not None:
        config = fp8.narrow_blocks(OP, config, source)
    block_scaled = bool(block_scaled) and out_dtype is not None
    fused_call, reason = _prepare(x, w, axis_name, size, sd, config, out_dtype, block_scaled)
    p = Plan(axis_name=axis_name, axis_size=size, dimension=sd, config=config, reason=reason,
             fused_call=fused_call, out_dtype=out_dtype, block_scaled=block_scaled)
    key = (tuple(x.shape), tuple(w.shape), str(x.dtype), axis_name, sd, out_dtype, block_scaled)
    site = (f"x={x.dtype}{list(x.shape)} w={w.dtype}{list(w.shape)} axis={axis_name!r} (size {size}) "
            f"scatter_dimension={sd}" + (f" out_dtype={out_dtype}" if out_dtype else "")
            + (" block-scaled" if block_scaled else ""))
    middle = 0 < sd < x.ndim - 1
    note = " (a middle dim: x's rows are permuted first, one copy of x)" if middle else ""
    callsite.report(OP, key, site, config, reason, source, printed, note)
    return p


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
    return jax.numpy.swapaxes(blocks, 0, 1).reshape(-1, x.shape[-1])


def _fused_forward(x, w, *scales, plan: Plan):
    # A scatter over N is a scatter over the columns of the [rows, K] view of x; a scatter over any
    # other output dim is a scatter over its rows, once _rows_by_partition has made every rank's
    # slice a contiguous block of rows (for the leading dim it already is, since B % W == 0).
    # scales: an FP8 call's (x_scale, w_scale).
    sd, world, lead = plan.dimension, plan.axis_size, tuple(x.shape[:-1])
    columns = kernel_scatter_dim(x, sd)
    x2d = x.reshape(-1, x.shape[-1]) if columns else _rows_by_partition(x, sd, world)
    if plan.block_scaled:  # x's tile scales [..., K/128] follow its rows
        x_scale, w_scale = scales
        scales = (x_scale.reshape(-1, x_scale.shape[-1]) if columns else _rows_by_partition(x_scale, sd, world),
                  w_scale)
    y = fused.call_fp8(x2d, w, *scales, plan.fused_call) if scales else fused.call(x2d, w, plan.fused_call)
    y = callsite.typed_like(callsite.varying_over(x, w, *scales), y)
    if columns:
        return y.reshape(lead + (w.shape[1] // world,))
    return y.reshape(lead[:sd] + (lead[sd] // world,) + lead[sd + 1:] + (w.shape[1],))


def forward(x, w, plan: Plan, gathered: bool = False):
    """y = psum_scatter(x @ w): the fused kernels where the plan says so (on CUDA), else the reference.
    gathered: False (nothing is gathered; the contract's argument)."""
    reference = functools.partial(gemm_rs_reference, axis_name=plan.axis_name, scatter_dimension=plan.dimension)
    return callsite.dispatch(plan.reason, reference, functools.partial(_fused_forward, plan=plan), x, w)


def forward_fp8(x, w, x_scale, w_scale, plan: Plan, gathered: bool = False):
    """psum_scatter((x * x_scale) @ (w * w_scale)) of FP8 operands in plan.out_dtype, the scales per
    tensor or per block (plan.block_scaled): the FP8 kernels where the plan says so (on CUDA), else
    the reference. gathered: False, as in forward."""
    reference = functools.partial(gemm_rs_reference_fp8, axis_name=plan.axis_name, scatter_dimension=plan.dimension,
                                  out_dtype=plan.out_dtype, block=plan.block_scaled)
    return callsite.dispatch(plan.reason, reference, functools.partial(_fused_forward, plan=plan), x, w, x_scale,
                             w_scale)


# The op contract (entwine_jax.opspec), listed in entwine_jax/registry.py.
SPEC = opspec.OpSpec(name=OP, kind="reduce-scatter", targets=("entwine_gemm_rs", "entwine_gemm_rs_fp8"), moved=_moved,
                     backward="ag_gemm", gathers=False, reference_backward=gemm_rs_reference_bwd,
                     config_type=GemmRsConfig, plan=plan, forward=forward, forward_fp8=forward_fp8,
                     why_not_fused=why_not_fused, default_config=default_config, fixed_us=fixed_us)
