# The MoE ops' fused paths (the dispatch and combine kernels, their FP8 twins, moe_transfer):
# whether the kernels can run a call (a predicate that only answers), its preparation once per call
# site at trace time (the C++ plan and the communicator, acquired with the room the plan needs), and
# the call itself inside shard_map. The kernels replace exactly the reference's functions:
# dispatch_pool (x_send [E, C, H] and w1 [E_local, H, N] -> y [E_local, W * C, N] and the receive
# pool [E_local, W * C, H]), combine_pool (h, w2 -> o_recv [E, C, H]) and the moves.
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _extension, _ffi, callsite, comm, fp8
from entwine_jax._extension import NoExtension, PlanError
from entwine_jax.comm import Unavailable

# The pool's region, as ffi/moe/handler.cc registers it.
INBOX_REGION = "moe.inbox"


def target(fp8: bool = False) -> str:
    """The XLA FFI target name of moe_dispatch_gemm, or of its FP8 twin (spelled once, in the extension)."""
    ext = _extension.ext()
    return ext.MOE_DISPATCH_GEMM_FP8_TARGET if fp8 else ext.MOE_DISPATCH_GEMM_TARGET


def kernels_reason(fp8: bool = False) -> Optional[str]:
    """Why the extension has no moe_dispatch_gemm kernels (not built, or a build without them; fp8: the
    FP8 ones), or None."""
    ext, reason = _extension.module()
    if ext is None:
        return reason
    if not hasattr(ext, "MOE_DISPATCH_GEMM_TARGET") or not hasattr(ext, "moe_plan"):
        return "the CUDA extension was built without the MoE kernels"
    if fp8 and getattr(ext, "MOE_DISPATCH_GEMM_FP8_TARGET", None) not in _extension.fp8_targets():
        return "the CUDA extension was built without the MoE FP8 kernels"
    return None


@dataclasses.dataclass(frozen=True)
class MoePlan:
    """The kernels' plan of one call (the C++ MoePlan)."""

    e_local: int
    num_blocks: int  # GEMM blocks
    grid: int  # GEMM CTAs
    inbox_bytes: int  # the receive pool in the heap
    flags_per_source: int  # one flag per (source, local expert)
    push_grid: int  # CTAs of the SM push (0: the copy engines push)
    sms_needed: int  # SMs the GEMM and the push (or the segment releases) hold at once


@functools.lru_cache(maxsize=1024)
def _asked(world, experts, capacity, k, n, x_dtype, block_n, gemm_sms, raster_rows, push_sms) -> dict:
    return dict(_extension.ext().moe_plan(world, experts, capacity, k, n, x_dtype, block_n, gemm_sms, raster_rows,
                                          push_sms))


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def launch_sms(config) -> tuple[int, int]:
    """(gemm_sms, push_sms): the GEMM grid (config's, or every SM the push leaves) and the SM push's
    CTAs (0: the copy engines push, and the segment releases need one SM)."""
    push_sms = int(config.push_sms)
    return int(config.gemm_sms) or _extension.sm_count() - max(push_sms, 1), push_sms


def block_n(config, n: int, dtype) -> int:
    """The GEMM block's width: config's, or 256 where N allows it (fewer, wider blocks), else 128; FP8
    blocks are 128 wide whatever the config asks (a config asking for 256 is told once)."""
    if is_fp8(dtype):
        return fp8.narrow_blocks("moe", config, "override").block_n if config.block_n else fp8.GEMM_BLOCK_N
    if config.block_n:
        return int(config.block_n)
    return 128 if n % 256 else 256


def moe_plan(world: int, experts: int, capacity: int, k: int, n: int, dtype, config) -> MoePlan:
    """The kernels' plan for x_send of `dtype`; PlanError with the C++ rule when they cannot run the call."""
    if (reason := kernels_reason(is_fp8(dtype))) is not None:
        raise NoExtension(reason)
    gemm_sms, push_sms = launch_sms(config)
    d = _asked(int(world), int(experts), int(capacity), int(k), int(n), jnp.dtype(dtype).name,
               block_n(config, n, dtype), gemm_sms, int(config.raster_rows), push_sms)
    if d["error"] is not None:
        raise PlanError(d["error"], False)
    return MoePlan(**{f.name: int(d[f.name]) for f in dataclasses.fields(MoePlan)})


def _heap_need(plan: MoePlan) -> tuple[int, dict[str, int]]:
    return plan.flags_per_source, {INBOX_REGION: plan.inbox_bytes}


def _platform(axis_name, axis_size, config) -> tuple[Optional[str], Any, Any]:
    """(reason, mesh, ext) of both targets' first checks: the path, the build, the axis, the platform."""
    if config.path == "xla":
        return "config.path='xla'", None, None
    if reason := kernels_reason() or comm.world_reason(axis_size):
        return reason, None, None
    return comm.platform_reason(axis_name)


def _answer(key: tuple, axis_name, compute) -> Optional[str]:
    """A predicate's answer for the call `key` describes on `axis_name`'s mesh: compute() once per
    key and mesh (comm.cached_reason), or why the call cannot be inspected."""
    try:
        mesh = comm.find_mesh(axis_name)
        key = key + (comm.axis_tuple(axis_name), mesh)
    except Exception as e:
        return f"cannot inspect the call ({type(e).__name__}: {e})"
    return comm.cached_reason(key, mesh, compute)


def _unavailable(x_send, w1, axis_name, axis_size, config, out_dtype) -> Optional[str]:
    reason, mesh, ext = _platform(axis_name, axis_size, config)
    if reason := reason or callsite.kernel_dtype_reason(x_send.dtype, w1.dtype, out_dtype):
        return reason
    (experts, capacity, k), n = x_send.shape, w1.shape[2]
    try:
        plan = moe_plan(axis_size, experts, capacity, k, n, x_send.dtype, config)
    except NoExtension as e:
        return str(e)
    except PlanError as e:
        return f"the kernels cannot run this call: {e.rule}"
    if plan.sms_needed > _extension.sm_count():
        return (f"the GEMM's {plan.grid} CTAs and the push's {plan.push_grid} (or one SM for the segment releases) "
                f"need {plan.sms_needed} SMs at once, the GPU has {_extension.sm_count()}")
    if reason := comm.mesh_reason(ext, mesh, axis_name, axis_size):
        return reason
    return comm.heap_reason(ext, mesh, axis_name, axis_size, *_heap_need(plan))


def unavailable_reason(x_send, w1, *, axis_name, axis_size: int, config, out_dtype=None) -> Optional[str]:
    """None when the kernels can run dispatch_pool on x_send [E, C, H] and w1 [E_local, H, N]
    (abstract values; out_dtype given: an FP8 call writing it), else a short reason. Only answers
    (prepare acquires)."""
    key = ("moe", tuple(x_send.shape), str(x_send.dtype), tuple(w1.shape), str(w1.dtype), str(out_dtype), axis_size,
           repr(config))
    return _answer(key, axis_name, lambda: _unavailable(x_send, w1, axis_name, axis_size, config, out_dtype))


@dataclasses.dataclass(frozen=True)
class MoeCall:
    """Everything static about one fused call; hashable (it lives in the op's static plan)."""

    comm_id: int
    attributes: tuple  # the kernel config's fields, (name, value) pairs
    target: str
    dtype: Any = None  # the weight-gradient kernel's operand dtype (its caller casts to it)


def prepare(x_send, w1, *, axis_name, axis_size: int, config) -> MoeCall:
    """The plan of one call and its communicator, acquired now: once per call site at trace time,
    after unavailable_reason said None. Raises Unavailable with the reason when the fused path cannot
    run it after all."""
    mesh = comm.mesh_for(axis_name)
    (experts, capacity, k), n = x_send.shape, w1.shape[2]
    try:
        plan = moe_plan(axis_size, experts, capacity, k, n, x_send.dtype, config)
    except NoExtension as e:
        raise Unavailable(str(e)) from None
    except PlanError as e:
        raise Unavailable(f"the kernels cannot run this call: {e.rule}") from None
    cid = comm.acquire_comm(mesh, axis_name, *_heap_need(plan))
    gemm_sms, push_sms = launch_sms(config)
    attributes = (("block_n", block_n(config, n, x_send.dtype)), ("gemm_sms", gemm_sms),
                  ("raster_rows", int(config.raster_rows)), ("push_sms", push_sms))
    return MoeCall(comm_id=cid, attributes=attributes, target=target(is_fp8(x_send.dtype)))


def _counts(name: str, words: str, counts, shape: tuple):
    """A kernel's row-count operand `name`, int32 of `shape` (`words` names its dims)."""
    if tuple(counts.shape) != shape or counts.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32 {words} = {list(shape)}, got {counts.dtype}{list(counts.shape)}")
    return counts


def _received(received, e_local: int, world: int):
    """The kernels' received operand, int32 [E_local, W] (MoeGemmArgs::received)."""
    return _counts("received", "[E_local, W]", received, (e_local, world))


def _sent(sent, experts: int):
    """The dispatch kernel's sent operand, int32 [E] (MoePushArgs::sent)."""
    return _counts("sent", "[E]", sent, (experts,))


def call(x_send, w1, received, sent, site: MoeCall, return_pool: bool):
    """One rank's fused dispatch and expert GEMM inside shard_map: (y [E_local, W * C, N], the pool
    [E_local, W * C, H] or None). received [E_local, W]: the rows each source sent each expert (the
    blocks past them are zeros in y, never computed); sent [E]: the rows this rank sends each expert
    (the SM push moves only those, in whole 128-row blocks)."""
    experts, capacity, k = x_send.shape
    e_local, n = w1.shape[0], w1.shape[2]
    world = experts // e_local
    pool_shape = (e_local, world * capacity, k) if return_pool else (0,)
    attributes = {name: np.int64(v) for name, v in site.attributes}
    signature = comm.call_signature(f"moe_dispatch_gemm {x_send.dtype} x_send {list(x_send.shape)} w "
                                    f"{list(w1.shape)}, pool {list(pool_shape)}, config "
                                    f"{comm.attributes_text(attributes)}, from {comm.call_site()}")
    y, pool = _ffi.fused_call(site.target, [jax.ShapeDtypeStruct((e_local, world * capacity, n), x_send.dtype),
                                            jax.ShapeDtypeStruct(pool_shape, x_send.dtype)],
                              x_send, w1, _received(received, e_local, world), _sent(sent, experts),
                              comm_id=np.int64(site.comm_id),
                              signature=np.int64(signature), config=attributes)
    return y, (pool if return_pool else None)


def call_fp8(x_send, w_t, x_scales, w_scale, received, sent, site: MoeCall, out_dtype):
    """One rank's FP8 dispatch and expert GEMM inside shard_map: x_send [E, C, K] e4m3 or e5m2, w_t
    [E_local, N, K] e4m3, x_scales [W] (every source's), w_scale, received and sent (as call's) -> (y [E_local,
    W * C, N] in out_dtype, the pool [E_local, W * C, K] in x_send's dtype)."""
    experts, capacity, k = x_send.shape
    e_local, n = w_t.shape[0], w_t.shape[1]
    world = experts // e_local
    attributes = {name: np.int64(v) for name, v in site.attributes}
    signature = comm.call_signature(f"moe_dispatch_gemm fp8 {x_send.dtype} x_send {list(x_send.shape)} w_t "
                                    f"{list(w_t.shape)} -> {jnp.dtype(out_dtype).name}, config "
                                    f"{comm.attributes_text(attributes)}, from {comm.call_site()}")
    y, pool = _ffi.fused_call(site.target, [jax.ShapeDtypeStruct((e_local, world * capacity, n), out_dtype),
                                            jax.ShapeDtypeStruct((e_local, world * capacity, k), x_send.dtype)],
                              x_send, w_t, x_scales.astype(jnp.float32), jnp.reshape(w_scale, ()).astype(jnp.float32),
                              _received(received, e_local, world), _sent(sent, experts), comm_id=np.int64(site.comm_id),
                              signature=np.int64(signature), config=attributes)
    return y, pool


# -- moe_gemm_combine's GEMM and the return of its rows, one kernel (each block sent as it is done) --


def combine_target(fp8: bool = False) -> str:
    """The XLA FFI target name of the combine kernel, or of its FP8 twin (spelled once, in the extension)."""
    ext = _extension.ext()
    return ext.MOE_GEMM_COMBINE_FP8_TARGET if fp8 else ext.MOE_GEMM_COMBINE_TARGET


def _combine_plan(world: int, h, w2, config) -> dict:
    """The combine kernel's plan of h [E_local, W*C, F] (16-bit, or FP8) and w2 [E_local, F, H]
    (abstract values); PlanError with the C++ rule when it cannot run them."""
    if (reason := kernels_reason()) is not None:
        raise NoExtension(reason)
    ext = _extension.ext()
    if not hasattr(ext, "moe_combine_plan"):
        raise NoExtension("the CUDA extension was built without the MoE combine kernel")
    if is_fp8(h.dtype) and getattr(ext, "MOE_GEMM_COMBINE_FP8_TARGET", None) not in _extension.fp8_targets():
        raise NoExtension("the CUDA extension was built without the MoE FP8 combine kernel")
    (e_local, rows, f), n = h.shape, w2.shape[2]
    gemm_sms, _ = launch_sms(config)
    d = dict(ext.moe_combine_plan(int(world), int(e_local * world), int(rows // world), int(f), int(n),
                                  jnp.dtype(h.dtype).name, block_n(config, n, h.dtype), gemm_sms,
                                  int(config.raster_rows)))
    if d["error"] is not None:
        raise PlanError(d["error"], False)
    return d


def _combine_unavailable(h, w2, axis_name, axis_size, config, out_dtype) -> Optional[str]:
    reason, mesh, ext = _platform(axis_name, axis_size, config)
    if reason := reason or callsite.kernel_dtype_reason(h.dtype, w2.dtype, out_dtype):
        return reason
    try:
        d = _combine_plan(axis_size, h, w2, config)
    except NoExtension as e:
        return str(e)
    except PlanError as e:
        return f"the kernels cannot run this combine: {e.rule}"
    if d["sms_needed"] > _extension.sm_count():
        return f"the combine's {d['grid']} CTAs need {d['sms_needed']} SMs at once, the GPU has {_extension.sm_count()}"
    if reason := comm.mesh_reason(ext, mesh, axis_name, axis_size):
        return reason
    return comm.heap_reason(ext, mesh, axis_name, axis_size, d["flags_per_source"], {INBOX_REGION: d["inbox_bytes"]})


def combine_unavailable_reason(h, w2, *, axis_name, axis_size: int, config, out_dtype=None) -> Optional[str]:
    """None when the combine kernel can run combine_pool on h [E_local, W*C, F] and w2 [E_local, F, H]
    (abstract values; out_dtype given: an FP8 call, h e4m3 or e5m2 and w2 e4m3, writing out_dtype),
    else a short reason. Only answers."""
    key = ("moe combine", tuple(h.shape), str(h.dtype), tuple(w2.shape), str(w2.dtype), str(out_dtype), axis_size,
           repr(config))
    return _answer(key, axis_name, lambda: _combine_unavailable(h, w2, axis_name, axis_size, config, out_dtype))


def prepare_combine(h, w2, *, axis_name, axis_size: int, config) -> MoeCall:
    """The combine kernel's communicator, acquired now (after combine_unavailable_reason said None)."""
    mesh = comm.mesh_for(axis_name)
    try:
        d = _combine_plan(axis_size, h, w2, config)
    except NoExtension as e:
        raise Unavailable(str(e)) from None
    except PlanError as e:
        raise Unavailable(f"the kernels cannot run this combine: {e.rule}") from None
    cid = comm.acquire_comm(mesh, axis_name, d["flags_per_source"], {INBOX_REGION: d["inbox_bytes"]})
    gemm_sms, _ = launch_sms(config)
    attributes = (("block_n", block_n(config, w2.shape[2], h.dtype)), ("gemm_sms", gemm_sms),
                  ("raster_rows", int(config.raster_rows)), ("push_sms", 0))
    return MoeCall(comm_id=cid, attributes=attributes, target=combine_target(is_fp8(h.dtype)))


def call_combine(h, w2, received, site: MoeCall, world: int):
    """One rank's combine kernel inside shard_map: h [E_local, W*C, F] times w2 [E_local, F, H] ->
    o_recv [E, C, H] at the sources (reference.combine_pool's result). received [E_local, W]: the rows
    of each segment its source reads back (the blocks past them are neither computed nor sent, so
    those rows of o_recv hold anything)."""
    e_local, rows, _ = h.shape
    out = jax.ShapeDtypeStruct((e_local * world, rows // world, w2.shape[2]), h.dtype)
    attributes = {name: np.int64(v) for name, v in site.attributes}
    signature = comm.call_signature(f"moe_gemm_combine {h.dtype} h {list(h.shape)} w2 {list(w2.shape)}, config "
                                    f"{comm.attributes_text(attributes)}, from {comm.call_site()}")
    (o_recv,) = _ffi.fused_call(site.target, [out], h, w2, _received(received, e_local, world),
                                comm_id=np.int64(site.comm_id), signature=np.int64(signature), config=attributes)
    return o_recv


def call_combine_fp8(h, w2_t, x_scale, w_scale, received, site: MoeCall, world: int, out_dtype):
    """One rank's FP8 combine kernel inside shard_map: h [E_local, W*C, F] e4m3 or e5m2 with its scale,
    w2_t [E_local, H, F] e4m3 with w_scale, received (as call_combine's) -> o_recv [E, C, H] in
    out_dtype at the sources."""
    e_local, rows, _ = h.shape
    out = jax.ShapeDtypeStruct((e_local * world, rows // world, w2_t.shape[1]), out_dtype)
    attributes = {name: np.int64(v) for name, v in site.attributes}
    signature = comm.call_signature(f"moe_gemm_combine fp8 {h.dtype} h {list(h.shape)} w2_t {list(w2_t.shape)} -> "
                                    f"{jnp.dtype(out_dtype).name}, config {comm.attributes_text(attributes)}, from "
                                    f"{comm.call_site()}")
    (o_recv,) = _ffi.fused_call(site.target, [out], h, w2_t, jnp.reshape(x_scale, ()).astype(jnp.float32),
                                jnp.reshape(w_scale, ()).astype(jnp.float32), _received(received, e_local, world),
                                comm_id=np.int64(site.comm_id), signature=np.int64(signature), config=attributes)
    return o_recv


# -- moe_transfer: the same moves without the GEMM (the combine's return, the backward's moves) --


def transfer_target() -> str:
    """The XLA FFI target name of moe_transfer (spelled once, in the extension)."""
    return _extension.ext().MOE_TRANSFER_TARGET


def _transfer_plan(world: int, send) -> dict:
    """moe_transfer's plan of send [E, C, ...] (an abstract value); PlanError with the C++ rule."""
    if (reason := kernels_reason()) is not None:
        raise NoExtension(reason)
    experts, capacity = send.shape[:2]
    row_bytes = int(np.prod(send.shape[2:], dtype=np.int64)) * jnp.dtype(send.dtype).itemsize
    d = dict(_extension.ext().moe_transfer_plan(int(world), int(experts), int(capacity), row_bytes, 0))
    if d["error"] is not None:
        raise PlanError(d["error"], False)
    return d


def _transfer_unavailable(send, axis_name, axis_size, config) -> Optional[str]:
    reason, mesh, ext = _platform(axis_name, axis_size, config)
    if reason:
        return reason
    try:
        d = _transfer_plan(axis_size, send)
    except PlanError as e:
        return f"the kernels cannot move this: {e.rule}"
    if reason := comm.mesh_reason(ext, mesh, axis_name, axis_size):
        return reason
    return comm.heap_reason(ext, mesh, axis_name, axis_size, d["flags_per_source"], {INBOX_REGION: d["inbox_bytes"]})


def transfer_unavailable_reason(send, *, axis_name, axis_size: int, config) -> Optional[str]:
    """None when moe_transfer can move send [E, C, ...] (an abstract value, any dtype), else why not."""
    key = ("moe transfer", tuple(send.shape), str(send.dtype), axis_size, config.path)
    return _answer(key, axis_name, lambda: _transfer_unavailable(send, axis_name, axis_size, config))


def prepare_transfer(send, *, axis_name, axis_size: int) -> MoeCall:
    """moe_transfer's communicator for send [E, C, ...], acquired now (after transfer_unavailable_reason
    said None)."""
    mesh = comm.mesh_for(axis_name)
    try:
        d = _transfer_plan(axis_size, send)
    except NoExtension as e:
        raise Unavailable(str(e)) from None
    except PlanError as e:
        raise Unavailable(f"the kernels cannot move this: {e.rule}") from None
    cid = comm.acquire_comm(mesh, axis_name, d["flags_per_source"], {INBOX_REGION: d["inbox_bytes"]})
    # The copy engines move the rows: no SM is taken from the GEMMs around the move.
    return MoeCall(comm_id=cid, attributes=(("push_sms", 0),), target=transfer_target())


def transfer(send, site: MoeCall, world: int):
    """One rank's moe_transfer inside shard_map over an axis of `world` ranks: send [E, C, ...] (rows
    for every expert, expert d * E_local + e on rank d) -> recv [E_local, W * C, ...] (every source's
    rows of this rank's expert e, source-major)."""
    experts, capacity = send.shape[:2]
    recv = jax.ShapeDtypeStruct((experts // world, world * capacity) + tuple(send.shape[2:]), send.dtype)
    signature = comm.call_signature(f"moe_transfer {send.dtype} send {list(send.shape)}, from {comm.call_site()}")
    (out,) = _ffi.fused_call(site.target, [recv], send, comm_id=np.int64(site.comm_id), signature=np.int64(signature),
                             push_sms=np.int64(dict(site.attributes)["push_sms"]))
    return out


# -- The experts' weight gradients over the rows received (a local GEMM with a ragged K) --


def wgrad_target() -> str:
    """The XLA FFI target name of moe_weight_grad (spelled once, in the extension)."""
    return _extension.ext().MOE_WEIGHT_GRAD_TARGET


def _wgrad_plan(world: int, e_local: int, capacity: int, m: int, n: int, dtype, config) -> dict:
    """The weight-gradient GEMM's plan (the C++ MoeWgradPlan); PlanError with its rule."""
    if (reason := kernels_reason()) is not None:
        raise NoExtension(reason)
    ext = _extension.ext()
    if not hasattr(ext, "moe_wgrad_plan"):
        raise NoExtension("the CUDA extension was built without the MoE weight-gradient kernel")
    # Nothing waits: every SM is the GEMM's.
    d = dict(ext.moe_wgrad_plan(int(world), int(e_local), int(capacity), int(m), int(n), jnp.dtype(dtype).name,
                                block_n(config, n, dtype), _extension.sm_count(), int(config.raster_rows)))
    if d["error"] is not None:
        raise PlanError(d["error"], False)
    return d


def prepare_wgrad(comm_id: int, *, world: int, e_local: int, capacity: int, m: int, n: int, dtype,
                  config) -> tuple[Optional[MoeCall], Optional[str]]:
    """(the MoeCall of the weight-gradient GEMM dw [E_local, m, n] over segments of `capacity` rows of
    `dtype` on the communicator comm_id (its device's kernels were prepared with it), None), or (None,
    why XLA's GEMM over the whole layout runs it)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None, f"{jnp.dtype(dtype).name} operands (the kernel takes bfloat16/float16)"
    try:
        _wgrad_plan(world, e_local, capacity, m, n, dtype, config)
    except NoExtension as e:
        return None, str(e)
    except PlanError as e:
        return None, f"the kernel cannot run it: {e.rule}"
    attributes = (("block_n", block_n(config, n, dtype)), ("gemm_sms", _extension.sm_count()),
                  ("raster_rows", int(config.raster_rows)), ("push_sms", 0))
    return MoeCall(comm_id=int(comm_id), attributes=attributes, target=wgrad_target(), dtype=jnp.dtype(dtype)), None


def weight_grad(a, dy, received, site: MoeCall, world: int):
    """One rank's weight gradients dw [E_local, M, N] = a[e]^T dy[e] over each segment's received rows
    (the rows past them, inside a segment's last k-tile, must be zero in a or dy): a [E_local, W*C, M]
    and dy [E_local, W*C, N] in one 16-bit dtype, received int32 [E_local, W]."""
    e_local, _, m = a.shape
    out = jax.ShapeDtypeStruct((e_local, m, dy.shape[2]), a.dtype)
    attributes = {name: np.int64(v) for name, v in site.attributes}
    (dw,) = _ffi.fused_call(site.target, [out], jnp.swapaxes(a, 1, 2), dy, _received(received, e_local, world),
                            comm_id=np.int64(site.comm_id), config=attributes)
    return dw
