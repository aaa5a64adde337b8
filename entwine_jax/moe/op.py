# moe_dispatch_gemm and moe_gemm_combine at a call site: argument checks (ValueErrors naming the
# argument, the expected and the actual value), the static capacity, the plan (the kernels or the
# XLA reference, said once per call site), the moves and GEMMs that the kernels replace (dispatch_pool,
# combine_pool, to_experts, to_sources), and the custom VJP that pairs each op with the other
# (docs/design.md, "Mixture of experts", "The pairing"). Their SPECs declare them to shared code as
# routed ops (entwine_jax.opspec).
import dataclasses
import functools
import math
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp

from entwine_jax import _log, callsite, comm, fp8, opspec
from entwine_jax.moe import fused, reference
from entwine_jax.moe.config import MoeConfig
from entwine_jax.moe.reference import COMBINE, DISPATCH, F32, TILE, MoeHandle, round_up

printed: set = set()  # call sites printed under ENTWINE_PRINT_CONFIG=1


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one call; hashable, so it can be a custom_vjp nondiff argument."""
    axis_name: Any
    axis_size: int
    config: MoeConfig
    reason: Optional[str]  # why the XLA reference runs the op's moves (None: the kernels, on CUDA)
    e_local: int
    capacity: int  # C, the rows of one (source, expert) segment
    # The dispatch kernel's fused.MoeCall (moves and GEMM in one), for a dispatch's forward or a
    # combine's backward (its cotangent dispatched, times w2^T), or None.
    gemm_call: Any = None
    # The combine kernel's, for a combine's forward or a dispatch's backward (dy times w1^T sent
    # home), or None.
    combine_call: Any = None
    # The weight-gradient GEMM's fused.MoeCall over the rows received (a dispatch's dw1, a combine's
    # dw2), or None: XLA's GEMM over the whole layout.
    wgrad_call: Any = None
    dimension: ClassVar[int] = 0
    return_gathered: ClassVar[bool] = False

    @property
    def num_experts(self) -> int:
        return self.axis_size * self.e_local


def capacity_rows(tokens: int, k: int, num_experts: int, capacity: Optional[float]) -> int:
    """C, the static rows of one (source, expert) segment (docs/design.md, "Capacity, dropless and
    overflow"), a multiple of 128: dropless, round_up(T, 128) (every token once; a token naming one
    expert twice needs two rows and can overflow); with a factor f, f times the balanced share
    T*k/E, at least 128 and at most round_up(T*k, 128)."""
    if capacity is None:
        return round_up(tokens, TILE)
    # A source has T*k slots in all: more rows than that per expert never fill, and a large factor
    # (capacity=1e30) would otherwise ask for a buffer no one can allocate.
    share = min(float(capacity) * tokens * k / num_experts, tokens * k)
    return max(TILE, round_up(math.ceil(share), TILE))


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


def _early_reason(config: MoeConfig, axis_name, size: int, dtype) -> Optional[str]:
    """Why no move of this call can take the kernels, whatever its shape."""
    if config.path == "xla":
        return "config.path='xla'"
    if reason := callsite.platform_reason(axis_name):
        return reason
    if size == 1 and config.path == "auto":
        return "axis size 1: nothing to move (path='fused' runs the kernels anyway)"
    if jnp.dtype(dtype) == jnp.float32:
        return "float32 inputs (the fused kernels take bfloat16/float16)"
    return None


def why_not_fused(x, w, *, axis_name, axis_size: int, dimension: int, config: MoeConfig, out_dtype=None,
                  shared_scale: bool = False) -> Optional[str]:
    """Why a call's moves take the XLA path (the user asked, not on CUDA, the kernels cannot move its
    rows), or None. x: a RoutedInput (a dispatch's tokens and ids, or a combine's h and handle)."""
    if reason := _early_reason(config, axis_name, axis_size, x.x.dtype):
        return reason
    if x.topk_idx is not None:  # a dispatch: its tokens' segments [E, C, H]
        t, k = x.topk_idx.shape
        capacity = capacity_rows(t, k, axis_size * w.shape[0], config.capacity)
        send = jax.ShapeDtypeStruct((axis_size * w.shape[0], capacity, x.x.shape[1]), x.x.dtype)
    else:  # a combine: its output rows [E, C, H], sent home
        e_local, rows, _ = x.x.shape
        send = jax.ShapeDtypeStruct((axis_size * e_local, rows // axis_size, w.shape[2]), x.x.dtype)
    return fused.transfer_unavailable_reason(send, axis_name=axis_name, axis_size=axis_size, config=config)


def prepare_gemm(plan: Plan, h: int, n: int, dtype, out_dtype=None) -> tuple[Any, Optional[str]]:
    """(the fused.MoeCall of the dispatch kernel on x_send [E, C, h] of `dtype` and w [E_local, h, n],
    None), or (None, why that GEMM is XLA's). out_dtype given: the FP8 kernel (x_send e4m3 or e5m2, w
    e4m3), writing out_dtype."""
    x_send = jax.ShapeDtypeStruct((plan.num_experts, plan.capacity, h), dtype)
    w_aval = jax.ShapeDtypeStruct((plan.e_local, h, n), dtype if out_dtype is None else fp8.E4M3)
    kw = dict(axis_name=plan.axis_name, axis_size=plan.axis_size, config=plan.config)
    why = lambda: plan.reason or fused.unavailable_reason(x_send, w_aval, out_dtype=out_dtype, **kw)  # noqa: E731
    return callsite.prepare(DISPATCH, why, lambda: fused.prepare(x_send, w_aval, **kw))


def prepare_combine(plan: Plan, f: int, h: int, dtype, out_dtype=None) -> tuple[Any, Optional[str]]:
    """(the fused.MoeCall of the combine kernel on rows [E_local, W*C, f] of `dtype` and w [E_local, f,
    h], None), or (None, why that GEMM is XLA's and its rows move apart). out_dtype given: the FP8
    kernel (rows e4m3 or e5m2, w e4m3), writing out_dtype."""
    rows = jax.ShapeDtypeStruct((plan.e_local, plan.axis_size * plan.capacity, f), dtype)
    w_aval = jax.ShapeDtypeStruct((plan.e_local, f, h), dtype if out_dtype is None else fp8.E4M3)
    kw = dict(axis_name=plan.axis_name, axis_size=plan.axis_size, config=plan.config)
    why = lambda: plan.reason or fused.combine_unavailable_reason(rows, w_aval, out_dtype=out_dtype, **kw)  # noqa: E731
    return callsite.prepare(COMBINE, why, lambda: fused.prepare_combine(rows, w_aval, **kw))


def prepare_wgrad(plan: Plan, op: str, m: int, n: int, dtype) -> tuple[Any, Optional[str]]:
    """(the fused.MoeCall of the weight-gradient GEMM dw [E_local, m, n] over the plan's segments in
    `dtype`, None), or (None, why XLA's GEMM over the whole layout runs it: said once where the op's
    other kernels run). It runs where a kernel of the op runs (the handle's counts exist then), on
    that kernel's communicator."""
    site = plan.gemm_call or plan.combine_call
    if site is None:
        return None, "no kernel of the op runs (no counts of the rows received)"
    call, reason = fused.prepare_wgrad(site.comm_id, world=plan.axis_size, e_local=plan.e_local,
                                       capacity=plan.capacity, m=m, n=n, dtype=dtype, config=plan.config)
    if reason is not None:
        _log.log_once((op, "wgrad", m, n, str(dtype), plan.capacity), _log.fallback_level(plan.config.path),
                      "%s: its weight gradient [E_local, %d, %d] is XLA's GEMM over every row of the layout: %s",
                      op, m, n, reason)
    return call, reason


def default_config(x, w, size: int, dimension: int) -> tuple[MoeConfig, str]:
    """(config, source) of a call without one: dropless, path auto."""
    return MoeConfig(), "default"


# The SM push moves each segment's rows sent (whole 128-row blocks of them), the copy engines all C
# rows (their sizes are the host's). Measured on one H100 with a quarter and an eighth of every
# segment's rows sent (docs/performance.md, "Only the rows sent"): the SM push 1.08-1.24x faster
# where segments are short next to their GEMM; where they are long 0.96x with a quarter (its 8 SMs
# are the GEMM's loss) and equal with an eighth, as the bytes saved grow.
DEFAULT_PUSH_SMS = 8
SM_PUSH_MAX_FILL = 1 / 8


def default_push(config: MoeConfig, source: str, tokens: int, k: int, experts: int, capacity: int) -> MoeConfig:
    """A default config's push: the SM push where the rows routed fill at most SM_PUSH_MAX_FILL of the
    static layout's E x C rows (T k / (E C): DeepSeek-V3's dropless 8 of 256 experts fill 1/32,
    Mixtral's 2 of 8 1/4), else the copy engines. A config the caller gave is kept."""
    if source != "default" or config.push_sms != 0 or tokens * k > SM_PUSH_MAX_FILL * experts * capacity:
        return config
    return dataclasses.replace(config, push_sms=DEFAULT_PUSH_SMS)


def plan_dispatch(x, w1, *, axis_name, dimension=0, config: Optional[MoeConfig] = None,
                  return_gathered: bool = False, out_dtype=None, shared_scale: bool = False) -> Plan:
    """Check a moe_dispatch_gemm call (x: an opspec.RoutedInput of x [T, H] and topk_idx [T, k]; w1
    [E_local, H, N]), fix its capacity, report its path once. out_dtype given: an FP8 call (its
    operands' dtypes checked by entwine_jax.fp8.check), whose e4m3 rows move and whose GEMM is the FP8
    kernel's where the kernels run. return_gathered must be False (not built); shared_scale changes
    nothing."""
    xs, topk_idx = x.x, x.topk_idx
    if return_gathered:
        raise ValueError(f"{DISPATCH}: return_gathered is not supported")
    _check_array(DISPATCH, "x", xs, "[T, H]", 2)
    _check_array(DISPATCH, "topk_idx", topk_idx, "[T, k]", 2)
    _check_array(DISPATCH, "w1", w1, "[E_local, H, N]", 3)
    if out_dtype is None:
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
    capacity = capacity_rows(t, k, size * e_local, config.capacity)
    config = default_push(config, source, t, k, size * e_local, capacity)
    moved = x if out_dtype is None else opspec.RoutedInput(jax.ShapeDtypeStruct(xs.shape, fp8.E4M3), topk_idx)
    reason = why_not_fused(moved, w1, axis_name=axis_name, axis_size=size, dimension=0, config=config)
    plan = Plan(axis_name=axis_name, axis_size=size, config=config, reason=reason, e_local=e_local,
                capacity=capacity)
    gemm_call, gemm_reason = prepare_gemm(plan, h, n, xs.dtype if out_dtype is None else fp8.E4M3, out_dtype)
    # The backward's dx: dy [E_local, W*C, N] times w1^T, sent home (the combine kernel; an FP8 call's
    # with dy in e5m2, which entwine_jax.moe.fp8_op uses when its gradients are FP8).
    backward = (xs.dtype, None) if out_dtype is None else (fp8.E5M2, out_dtype)
    combine_call = prepare_combine(plan, n, h, *backward)[0]
    plan = dataclasses.replace(plan, gemm_call=gemm_call, combine_call=combine_call)
    # dw1 [E_local, H, N] over the rows received (an FP8 call's operands dequantised to out_dtype).
    plan = dataclasses.replace(plan, wgrad_call=prepare_wgrad(plan, DISPATCH, h, n,
                                                                  xs.dtype if out_dtype is None else out_dtype)[0])
    site = (f"x={xs.dtype}{list(xs.shape)} topk_idx{list(topk_idx.shape)} w1={w1.dtype}{list(w1.shape)} "
            f"axis={axis_name!r} (size {size}) C={capacity}" + ("" if out_dtype is None else f" FP8 -> {out_dtype}"))
    key = (tuple(xs.shape), tuple(topk_idx.shape), tuple(w1.shape), str(xs.dtype), axis_name, capacity, str(out_dtype))
    # The moves' path is the call's; a GEMM that XLA runs beside fused moves is said as a note.
    note = f" (its GEMM by XLA: {gemm_reason})" if reason is None and gemm_reason is not None else ""
    callsite.report(DISPATCH, key, site, config, reason, source, printed, note)
    return plan


def plan_combine(x, w2, *, axis_name, dimension=0, config: Optional[MoeConfig] = None,
                 return_gathered: bool = False, out_dtype=None, shared_scale: bool = False) -> Plan:
    """Check a moe_gemm_combine call (x: an opspec.RoutedInput of h [E_local, W*C, F], topk_weights
    [T, k] and the dispatch's handle; w2 [E_local, F, H]) against the handle; report its path once.
    E_local and C come from h's shape, which is the dispatch's y's. out_dtype given: an FP8 call
    (entwine_jax.fp8.check checked the dtypes), whose rows travel in out_dtype."""
    h, weights, handle = x.x, x.weights, x.handle
    if return_gathered:
        raise ValueError(f"{COMBINE}: return_gathered is not supported")
    if not isinstance(handle, MoeHandle):
        raise ValueError(f"{COMBINE}: handle must be the MoeHandle moe_dispatch_gemm returned, got "
                         f"{type(handle).__name__}")
    _check_array(COMBINE, "h", h, "[E_local, W*C, F]", 3)
    _check_array(COMBINE, "w2", w2, "[E_local, F, H]", 3)
    _check_array(COMBINE, "topk_weights", weights, "[T, k]", 2)
    if out_dtype is None:
        _check_float(COMBINE, "h", h)
        _check_float(COMBINE, "w2", w2, ("h", h))
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"{COMBINE}: topk_weights.dtype must be a float type, got {weights.dtype}")
    config, source = _config(COMBINE, config)
    axis_name = callsite.hashable_axis(axis_name)
    size = callsite.axis_size(COMBINE, axis_name)
    (e_local, rows, f), (t, k) = h.shape, handle.expert.shape
    if rows % (size * TILE) or min(e_local, f) == 0:
        raise ValueError(f"{COMBINE}: h must have shape [E_local, W*C, F] with W = {size} (axis {axis_name!r}) and "
                         f"C a multiple of 128 (the dispatch's y), got {tuple(h.shape)}")
    if tuple(w2.shape[:2]) != (e_local, f):
        raise ValueError(f"{COMBINE}: w2 must have shape [E_local = {e_local}, F = {f}, H], got {tuple(w2.shape)}")
    if tuple(weights.shape) != (t, k):
        raise ValueError(f"{COMBINE}: topk_weights must have shape [T, k] = {(t, k)} (the dispatch's topk_idx), "
                         f"got {tuple(weights.shape)}")
    # Where a kernel ran, the handle's counts carry the dispatch's experts per rank (E_local and C are
    # otherwise h's word alone: the handle's other arrays are [T, k]).
    if handle.received is not None and tuple(handle.received.shape) != (e_local, size):
        raise ValueError(f"{COMBINE}: h must be in the layout of the handle's dispatch: h has E_local = {e_local} "
                         f"(shape {tuple(h.shape)}), the handle's received counts are "
                         f"{tuple(handle.received.shape)} = [E_local, W]")
    config = default_push(config, source, t, k, size * e_local, rows // size)
    moved = x if out_dtype is None else x._replace(x=jax.ShapeDtypeStruct(h.shape, out_dtype))
    reason = why_not_fused(moved, w2, axis_name=axis_name, axis_size=size, dimension=0, config=config)
    plan = Plan(axis_name=axis_name, axis_size=size, config=config, reason=reason, e_local=e_local,
                capacity=rows // size)
    # The backward dispatches dout [T, H] and multiplies by w2^T [E_local, H, F]: the dispatch kernel
    # (an FP8 call's, dout in e5m2; entwine_jax.moe.fp8_op uses it when its gradients are FP8).
    backward = (h.dtype, None) if out_dtype is None else (fp8.E5M2, out_dtype)
    plan = dataclasses.replace(plan, gemm_call=prepare_gemm(plan, w2.shape[2], f, *backward)[0])
    forward = (h.dtype, None) if out_dtype is None else (fp8.E4M3, out_dtype)
    combine_call, combine_reason = prepare_combine(plan, f, w2.shape[2], *forward)
    plan = dataclasses.replace(plan, combine_call=combine_call)
    # dw2 [E_local, F, H] over the rows received (an FP8 call's operands dequantised to out_dtype).
    wgrad_dtype = h.dtype if out_dtype is None else out_dtype
    plan = dataclasses.replace(plan, wgrad_call=prepare_wgrad(plan, COMBINE, f, w2.shape[2], wgrad_dtype)[0])
    site = (f"h={h.dtype}{list(h.shape)} w2={w2.dtype}{list(w2.shape)} T={t} k={k} axis={axis_name!r} (size {size})"
            + ("" if out_dtype is None else f" FP8 -> {out_dtype}"))
    key = (tuple(h.shape), tuple(w2.shape), (t, k), str(h.dtype), axis_name, str(out_dtype))
    # Where the combine kernel cannot run, its GEMM runs on XLA before the rows are sent home (no
    # overlap): said with the path.
    note = ""
    if reason is None and plan.combine_call is None:
        note = " (its GEMM by XLA, then the rows sent home" + (f": {combine_reason})" if combine_reason else ")")
    callsite.report(COMBINE, key, site, config, reason, source, printed, note)
    return plan


# --- Where the kernels plug in ---------------------------------------------------------------------
# Each op's transfer and GEMM is one function of the plan with the kernel's exact boundary; the rest
# of both ops (layout, send buffer, weighted sum) is XLA on the token side and stays.


def _transfer_call(send, plan: Plan, op: str):
    """The fused.MoeCall of moe_transfer for send (an array [E, C, ...]), or None where the XLA
    reference moves it (the plan's reason, or the kernels cannot move these rows)."""
    if plan.reason is not None:
        return None
    kw = dict(axis_name=plan.axis_name, axis_size=plan.axis_size)
    call, reason = callsite.prepare(op, lambda: fused.transfer_unavailable_reason(send, config=plan.config, **kw),
                                    lambda: fused.prepare_transfer(send, **kw))
    if reason is not None:  # the call's other moves may be fused: this one is said once
        _log.log_once((op, "move", tuple(send.shape), str(send.dtype)), _log.fallback_level(plan.config.path),
                      "%s: rows %s %s move by XLA's all_to_all: %s", op, send.dtype, list(send.shape), reason)
    return call


def to_experts(send, plan: Plan, op: str):
    """send [E, C, ...] -> pool [E_local, W*C, ...] (reference.to_experts): moe_transfer where it can
    move the rows, on CUDA; the XLA reference elsewhere. Counted as `op`'s."""
    reference_move = functools.partial(reference.to_experts, axis_name=plan.axis_name, world=plan.axis_size, op=op)
    call = _transfer_call(send, plan, op)
    if call is None:
        return reference_move(send)
    names = callsite.varying_over(send, axis_name=plan.axis_name)

    def kernel(v):
        with opspec.moves(op, v.dtype):  # the census counts the call as `op`'s
            return callsite.typed_like(names, fused.transfer(v, call, plan.axis_size))

    return callsite.dispatch(None, reference_move, kernel, send)


def to_sources(pool, plan: Plan, op: str):
    """pool [E_local, W*C, ...] -> [E, C, ...] at the sources (reference.to_sources): the rows laid out
    as a send buffer, one to_experts, and the received [E_local, W, C, ...] read back expert-major."""
    e_local, wc = pool.shape[:2]
    rest, world = pool.shape[2:], plan.axis_size
    c = wc // world
    send = jnp.swapaxes(pool.reshape((e_local, world, c) + rest), 0, 1).reshape((world * e_local, c) + rest)
    got = to_experts(send, plan, op)  # [E_local, W expert rank, C, ...]: rank r's expert l at (l, r)
    return jnp.swapaxes(got.reshape((e_local, world, c) + rest), 0, 1).reshape((world * e_local, c) + rest)


# The rows each source sends each expert travel as one 16-byte segment per expert (moe_transfer's
# smallest, as the FP8 scales do).
_ROW_WORDS = 4


def received_rows(counts, plan: Plan):
    """[E_local, W] int32: the rows source s sends this rank's expert l, at [l, s] (MoeHandle.received),
    of every rank's counts [E] (reference.sent_rows): moved to their experts' ranks before the
    dispatch's kernel, which skips the blocks past them, as the combine's does."""
    if plan.axis_size == 1:
        return counts[:, None]
    send = jnp.broadcast_to(counts[:, None], (plan.num_experts, _ROW_WORDS))
    # Typed as varying over the axis: every rank's own counts.
    send = callsite.make_varying(send, comm.axis_tuple(plan.axis_name))
    got = to_experts(send, plan, DISPATCH)  # [E_local, W * _ROW_WORDS]
    return got.reshape(plan.e_local, plan.axis_size, _ROW_WORDS)[..., 0]


def kernel_rows(received, plan: Plan):
    """What a kernel reads as MoeGemmArgs::received: the handle's counts, or every segment full."""
    if received is not None:
        return received
    return jnp.full((plan.e_local, plan.axis_size), plan.capacity, jnp.int32)


def kernel_sent(sent, plan: Plan):
    """What the dispatch kernel's SM push reads as MoePushArgs::sent: the handle's counts, or every
    segment full."""
    if sent is not None:
        return sent
    return jnp.full((plan.num_experts,), plan.capacity, jnp.int32)


def taken_rows(pool, received, world: int):
    """[E_local, W*C, 1] bool: the pool's rows that some slot took. With the handle's counts (a kernel
    ran) the first received[l, q] rows of each segment (an iota, fused into the user of the mask);
    else the rows not all zero (a taken row of zeros counts as untaken, which adds nothing to a
    weight gradient either way)."""
    if received is None:
        return jnp.any(pool != 0, axis=-1, keepdims=True)
    rows = pool.shape[1]
    segment = rows // world
    i = jnp.arange(rows, dtype=jnp.int32)
    return (i % segment < received[:, i // segment])[..., None]


def on_taken_rows(v, taken, received):
    """v on the rows some slot took, zero on the others, whose values are the caller's function of
    zero rows (inf or NaN where its slope at zero is). With the handle's counts (`received`) `taken`
    is exact. Without them it is a mask of values (rows not all zero, or with a router weight), which
    also drops a taken row that happens to be zero: there v's finite values are kept as well, so that
    dx and a second derivative see that row (a finite value on a row no slot took meets a zero row or
    weight and adds nothing)."""
    if received is None:
        taken = taken | jnp.isfinite(v)
    return jnp.where(taken, v, jnp.zeros((), v.dtype))


def dispatch_pool(x_send, w1, plan: Plan, received=None, sent=None):
    """(y [E_local, W*C, N] in x_send.dtype, pool [E_local, W*C, H]) of x_send [E, C, H] and w1: the
    dispatch kernel (the moves, of the rows `sent` only with the SM push, and the GEMM, which starts on
    each source's rows as they arrive, and skips the blocks past `received`; both the handle's counts)
    where the plan has one, on CUDA; else the moves (to_experts) and XLA's GEMM. The pool's rows past
    `received` rounded up to whole 128-row blocks are zeros."""
    def apart(x_send, w1):
        pool = to_experts(x_send, plan, DISPATCH)
        return reference.expert_dot(pool, w1).astype(x_send.dtype), pool

    if plan.gemm_call is None:
        return apart(x_send, w1)
    names = callsite.varying_over(x_send, w1, axis_name=plan.axis_name)

    def kernel(x_send, w1, rows, sent):
        return callsite.typed_like(names, *fused.call(x_send, w1, rows, sent, plan.gemm_call, return_pool=True))

    reference_pool = functools.partial(reference.dispatch_pool, axis_name=plan.axis_name, world=plan.axis_size)
    return callsite.dispatch(None, lambda x_send, w1, *_: reference_pool(x_send, w1), kernel, x_send, w1,
                             kernel_rows(received, plan), kernel_sent(sent, plan))


def combine_pool(h, w2, plan: Plan, received=None):
    """o_recv [E, C, H] in h.dtype of h [E_local, W*C, F] and w2: the combine kernel (each finished
    block sent home as it is done; the blocks past `received`, the handle's counts, neither computed
    nor sent: those rows of o_recv hold anything) where the plan has one, on CUDA; else XLA's GEMM on
    the expert side, then the rows sent home (to_sources: moe_transfer on CUDA)."""
    def apart(h, w2):
        return to_sources(reference.expert_dot(h, w2).astype(h.dtype), plan, COMBINE)

    if plan.combine_call is None:
        return apart(h, w2)
    names = callsite.varying_over(h, w2, axis_name=plan.axis_name)

    def kernel(h, w2, rows):
        return callsite.typed_like(names, fused.call_combine(h, w2, rows, plan.combine_call, plan.axis_size))

    reference_pool = functools.partial(reference.combine_pool, axis_name=plan.axis_name, world=plan.axis_size)
    return callsite.dispatch(None, lambda h, w2, _: reference_pool(h, w2), kernel, h, w2, kernel_rows(received, plan))


def weight_grad(a, dy, plan: Plan, received, out_dtype):
    """dw [E_local, M, N] in out_dtype, per expert a[e]^T dy[e] (a [E_local, W*C, M], dy [E_local, W*C,
    N], both zero on the rows no slot took): the weight-gradient kernel over each segment's rows
    received, the handle's counts (its operands in its 16-bit dtype), where the plan has one, on
    CUDA; else XLA's GEMM over every row of the layout, in fp32."""
    def apart(a, dy, *_):
        return reference.expert_weight_grad(a, dy).astype(out_dtype)

    call = plan.wgrad_call
    if call is None or received is None:
        return apart(a, dy)
    names = callsite.varying_over(a, dy, axis_name=plan.axis_name)

    def kernel(a, dy, rows):
        dw = fused.weight_grad(a.astype(call.dtype), dy.astype(call.dtype), rows, call, plan.axis_size)
        return callsite.typed_like(names, dw.astype(out_dtype))

    return callsite.dispatch(None, apart, kernel, a, dy, received)


def layout(topk_idx, plan: Plan) -> MoeHandle:
    """This rank's routing; with the counts the kernels skip by where the plan has a kernel."""
    handle = reference.layout(topk_idx, num_experts=plan.num_experts, capacity=plan.capacity)
    if plan.gemm_call is None and plan.combine_call is None:
        return handle
    counts = reference.sent_rows(handle, num_experts=plan.num_experts)
    return handle._replace(received=received_rows(counts, plan), sent=counts)


def send_rows(rows, handle: MoeHandle, plan: Plan):
    """rows [T, ...] -> the send buffer [E, C, ...] (each token's row at each of its sent slots)."""
    t, k = handle.expert.shape
    slot_rows = jnp.broadcast_to(rows[:, None], (t, k) + rows.shape[1:])
    return reference.to_segments(slot_rows, handle, num_experts=plan.num_experts, capacity=plan.capacity)


def forward_dispatch(x, w1, plan: Plan, gathered: bool = False):
    """(y, handle) of a planned dispatch (x: a RoutedInput); no differentiation rule (dispatch() has it)."""
    handle = layout(x.topk_idx, plan)
    return dispatch_pool(send_rows(x.x, handle, plan), w1, plan, handle.received, handle.sent)[0], handle


def forward_combine(x, w2, plan: Plan, gathered: bool = False):
    """out of a planned combine (x: a RoutedInput with h, the weights and the handle)."""
    o_recv = combine_pool(x.x, w2, plan, x.handle.received)
    return reference.from_segments(o_recv, x.weights, x.handle).astype(x.x.dtype)


# --- The pairing: each op's backward is the other (docs/design.md, "The pairing") ------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, w1, handle, plan):
    return dispatch_pool(send_rows(x, handle, plan), w1, plan, handle.received, handle.sent)[0]


def _dispatch_fwd(x, w1, handle, plan):
    y, pool = dispatch_pool(send_rows(x, handle, plan), w1, plan, handle.received, handle.sent)
    return y, (pool, w1, handle)


def _dispatch_bwd(plan, res, dy):
    pool, w1, handle = res
    # dx: a combine of dy with w1^T and unit weights (copying x[t] to k rows sums their gradients);
    # dy has y's dtype, x's. Rows no slot sent (those the kernel computes at all) come back too and
    # are never read.
    o_recv = combine_pool(dy, jnp.swapaxes(w1, 1, 2), plan, handle.received)
    dx = reference.from_segments(o_recv, jnp.ones(handle.expert.shape, F32), handle).astype(dy.dtype)
    # dw1[e] = pool[e]^T dy[e]: the pool's unused rows are zero and add nothing, but only where dy is
    # finite there: the caller's activation can make it inf or NaN on rows no slot took (sqrt or log
    # of y's zeros), rows no dense program has. dy is taken as zero there.
    dy_used = on_taken_rows(dy, taken_rows(pool, handle.received, plan.axis_size), handle.received)
    dw1 = weight_grad(pool, dy_used, plan, handle.received, w1.dtype)
    return dx, dw1, None  # the handle is integers: no cotangent


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(h, w2, weights, handle, plan):
    return forward_combine(opspec.RoutedInput(h, weights=weights, handle=handle), w2, plan)


def _combine_fwd(h, w2, weights, handle, plan):
    return _combine.fun(h, w2, weights, handle, plan), (h, w2, weights, handle)


def _combine_bwd(plan, res, dout):
    h, w2, weights, handle = res
    # dout's rows dispatched in the handle's layout, times w2^T: g = dout row @ w2^T on the expert side.
    g, dy_pool = dispatch_pool(send_rows(dout, handle, plan), jnp.swapaxes(w2, 1, 2), plan, handle.received,
                               handle.sent)
    # The router weights travel beside them (a dispatch's transfer): [E, C] -> [E_local, W*C, 1].
    w_send = reference.to_segments(weights.astype(F32), handle, num_experts=plan.num_experts, capacity=plan.capacity)
    w_pool = to_experts(w_send, plan, DISPATCH)[..., None]
    g = g.astype(F32)
    dh = (w_pool * g).astype(h.dtype)
    # h's rows no slot took are the caller's (an activation of y's zero rows, even inf or NaN): the
    # forward never reads them, and neither does dw2 (their router weight is zero; 0 * NaN is not).
    h_used = on_taken_rows(h.astype(F32), w_pool != 0, handle.received)
    dw2 = weight_grad(h_used, w_pool * dy_pool.astype(F32), plan, handle.received, w2.dtype)
    # The router weights' gradient <dout[t], o row> = <g, h> per row, sent home (the combine's transfer).
    dw_recv = to_sources(jnp.sum(g * h.astype(F32), axis=-1), plan, COMBINE)  # [E, C]
    sent = handle.expert >= 0
    dweights = jnp.where(sent, dw_recv[jnp.maximum(handle.expert, 0), jnp.maximum(handle.place, 0)], 0.0)
    return dh, dw2, dweights.astype(weights.dtype), None


_combine.defvjp(_combine_fwd, _combine_bwd)


def dispatch(x, topk_idx, w1, *, axis_name, config: Optional[MoeConfig]):
    """moe_dispatch_gemm, differentiable in x and w1, inside jax.shard_map: (y [E_local, W*C, N], handle)."""
    plan = plan_dispatch(opspec.RoutedInput(x, topk_idx), w1, axis_name=axis_name, config=config)
    names = callsite.varying_over(x, topk_idx, w1, axis_name=plan.axis_name)
    x, topk_idx, w1 = (callsite.make_varying(v, names) for v in (x, topk_idx, w1))
    # The scope names every operation of the call, forward and backward (the census's owner).
    with jax.named_scope(DISPATCH_SPEC.scope):
        handle = layout(topk_idx, plan)
        return _dispatch(x, w1, handle, plan), handle


def combine(h, w2, topk_weights, handle, *, axis_name, config: Optional[MoeConfig]):
    """moe_gemm_combine, differentiable in h, w2 and topk_weights, inside jax.shard_map: out [T, H]."""
    plan = plan_combine(opspec.RoutedInput(h, weights=topk_weights, handle=handle), w2, axis_name=axis_name,
                        config=config)
    names = callsite.varying_over(h, w2, topk_weights, axis_name=plan.axis_name)
    h, w2, topk_weights = (callsite.make_varying(v, names) for v in (h, w2, topk_weights))
    handle = jax.tree.map(lambda v: callsite.make_varying(v, names), handle)
    with jax.named_scope(COMBINE_SPEC.scope):
        return _combine(h, w2, topk_weights, handle, plan)


def _moved(target: str, ins: list, outs: list, attrs: str) -> tuple:
    """(W, what one rank sends W - 1 times) of a custom call: one destination's share of the send
    buffer [E, C, ...] (the first operand); W from the output [E_local, W*C, ...]. The combine kernel
    (h [E_local, W*C, F] -> o_recv [E, C, H]) sends each source its E_local segments [C, H], in o_recv's
    dtype (an FP8 call's rows travel in its 16-bit output type)."""
    (dtype, first), (out_dtype, out) = ins[0][0], outs[0]
    if target.startswith("entwine_moe_gemm_combine"):
        return out[0] // first[0], [(out_dtype, (first[0],) + tuple(out[1:]))]
    world = out[1] // first[1]
    return world, [(dtype, (first[0] // world,) + tuple(first[1:]))]


# The op contracts (entwine_jax.opspec), listed in entwine_jax/registry.py: routed ops (no FP8 or
# fixed cost yet); each one's backward is the other. moe_transfer is the combine's target; where the
# dispatch's moves call it, its moves() scope counts them as the dispatch's.
DISPATCH_SPEC = opspec.OpSpec(name=DISPATCH, kind="all-to-all",
                              targets=("entwine_moe_dispatch_gemm", "entwine_moe_dispatch_gemm_fp8"), moved=_moved,
                              backward=COMBINE, gathers=False, reference_backward=None, config_type=MoeConfig, plan=plan_dispatch,
                              forward=forward_dispatch, forward_fp8=None, why_not_fused=why_not_fused,
                              default_config=default_config, fixed_us=None, routed=True)
COMBINE_SPEC = opspec.OpSpec(name=COMBINE, kind="all-to-all",
                             targets=("entwine_moe_gemm_combine", "entwine_moe_gemm_combine_fp8", "entwine_moe_transfer"),
                             moved=_moved,
                             backward=DISPATCH, gathers=False, reference_backward=None, config_type=MoeConfig, plan=plan_combine,
                             forward=forward_combine, forward_fp8=None, why_not_fused=why_not_fused,
                             default_config=default_config, fixed_us=None, routed=True)
