# ag_gemm's fused path: whether the kernels can run a call (a predicate that only answers), its
# preparation once per call site at trace time (the C++ plan, the padding and the communicator,
# acquired with the room the plan needs), and the call itself inside shard_map.
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _extension, _ffi, callsite, comm
from entwine_jax.ag_gemm import plan as _plan
from entwine_jax.ag_gemm.config import push_budget, push_of
from entwine_jax.comm import Unavailable
from entwine_jax.fp8 import blocks


@dataclasses.dataclass(frozen=True)
class AgPadding:
    """Kernel shape of one ag_gemm call, as ag_plan pads it: every rank's shard [rows, cols] padded
    to [rows_pad, cols_pad], N to n_pad. gather_k: the shards are slices of the contraction dim, w
    is [world * cols, n]."""

    world: int
    rows: int
    cols: int
    n: int
    rows_pad: int
    cols_pad: int
    n_pad: int
    gather_k: bool


def ag_padding(plan: _plan.AgPlan, rows: int, cols: int, n: int, world: int, gather_k: bool) -> AgPadding:
    """The padding of `plan` for a shard [rows, cols] and N = n."""
    return AgPadding(world, rows, cols, n, plan.rows_pad, plan.cols_pad, plan.n_pad, gather_k)


def pad_operands(x, w, p: AgPadding, xp=jnp):
    """x [rows, cols] -> [rows_pad, cols_pad]; w [cols, n] -> [cols_pad, n_pad], or with gather_k
    w [world * cols, n] -> [world * cols_pad, n_pad] (each rank's slice padded on its own)."""
    if (p.rows, p.cols) != (p.rows_pad, p.cols_pad):
        x = xp.pad(x, ((0, p.rows_pad - p.rows), (0, p.cols_pad - p.cols)))
    if (p.cols, p.n) != (p.cols_pad, p.n_pad):
        if p.gather_k:
            w = w.reshape(p.world, p.cols, p.n)
            w = xp.pad(w, ((0, 0), (0, p.cols_pad - p.cols), (0, p.n_pad - p.n)))
            w = w.reshape(p.world * p.cols_pad, p.n_pad)
        else:
            w = xp.pad(w, ((0, p.cols_pad - p.cols), (0, p.n_pad - p.n)))
    return x, w


def unpad(y, gathered, p: AgPadding):
    """The kernel's y ([world * rows_pad, n_pad], or [rows_pad, n_pad] with gather_k) and gathered
    operand ([world, rows_pad, cols_pad]) -> y [world * rows, n] (or [rows, n]), gathered [world, rows, cols]."""
    if p.gather_k:
        y = y[: p.rows, : p.n]
    elif (p.rows, p.n) != (p.rows_pad, p.n_pad):
        y = y.reshape(p.world, p.rows_pad, p.n_pad)[:, : p.rows, : p.n].reshape(p.world * p.rows, p.n)
    if gathered is not None and (p.rows, p.cols) != (p.rows_pad, p.cols_pad):
        gathered = gathered[:, : p.rows, : p.cols]
    return y, gathered


def launch_sms(config, shard_bytes: int) -> tuple[int, int]:
    """(gemm_sms, push_sms) the kernels run for a shard of `shard_bytes`: the GEMM grid (config's,
    or every SM the push leaves) and the SM push's CTAs (0: the copy engines push, and leave the
    chunk releases one SM)."""
    push_sms = push_budget(config) if push_of(config, shard_bytes) == "sm" else 0
    return config.gemm_sms or _extension.sm_count() - max(push_sms, 1), push_sms


def _ag_plan(rows: int, cols: int, n: int, world: int, gather_k: bool, config, x_dtype, fp8: bool = False,
             shared_scale: bool = False, block_scaled: bool = False) -> _plan.AgPlan:
    x_dtype = jnp.dtype(x_dtype)
    return _plan.ag_plan(rows, cols, n, world, gather_k, config, *launch_sms(config, rows * cols * x_dtype.itemsize),
                         fp8=fp8, shared_scale=shared_scale, x_dtype=x_dtype.name, block_scaled=block_scaled)


def _unavailable(x_local_aval, w_aval, axis_name, axis_size, gather_k, config, out_dtype, shared_scale, block_scaled):
    if config.path == "xla":
        return "config.path is 'xla'"
    if reason := callsite.kernel_dtype_reason(x_local_aval.dtype, w_aval.dtype, out_dtype):
        return reason
    if block_scaled and (reason := _plan.fp8_block_reason()):
        return reason
    if reason := comm.world_reason(axis_size):
        return reason
    (rows, cols), (_, n) = x_local_aval.shape, w_aval.shape
    if rows == 0 or cols == 0 or n == 0:
        return f"empty operands x {x_local_aval.shape}, w {w_aval.shape}"
    reason, mesh, ext = comm.platform_reason(axis_name)
    if reason:
        return reason
    if out_dtype is not None and (reason := _plan.fp8_reason()):
        return reason
    try:
        plan = _ag_plan(rows, cols, n, axis_size, gather_k, config, x_local_aval.dtype, fp8=out_dtype is not None,
                        shared_scale=shared_scale, block_scaled=block_scaled)
    except _plan.PlanError as e:
        return f"the kernels cannot run this call: {e.rule}"
    if plan.sms_needed > _extension.sm_count():
        return (f"the GEMM's {plan.grid} CTAs and the push's {plan.push_grid} (or one SM for the chunk releases) "
                f"need {plan.sms_needed} SMs at once, the GPU has {_extension.sm_count()}")
    if reason := comm.mesh_reason(ext, mesh, axis_name, axis_size):
        return reason
    return comm.heap_reason(ext, mesh, axis_name, axis_size, *_heap_need(plan))


def _heap_need(plan) -> tuple[int, dict[str, int]]:
    """What a call needs of the communicator's heap: a flag per chunk of a shard, and the W gathered
    shards in the region that ffi/ag_gemm/handler.cc registers (the inbox)."""
    return plan.chunks, {"ag_gemm.inbox": plan.inbox_bytes}


def unavailable_reason(x_local_aval, w_aval, *, axis_name, axis_size, gather_k, config,
                       out_dtype=None, shared_scale: bool = False, block_scaled: bool = False) -> Optional[str]:
    """None when the ag_gemm kernels can run this call (x [rows, cols], w [cols or W * cols, n]),
    else a short reason (out_dtype given: the FP8 kernels on an e4m3 or e5m2 x and an e4m3 w, writing
    out_dtype, with one x scale on every rank if shared_scale; block_scaled: with block scales). Only
    answers (prepare acquires)."""
    try:
        mesh = comm.find_mesh(axis_name)
        key = ("ag", tuple(x_local_aval.shape), str(x_local_aval.dtype), tuple(w_aval.shape),
               str(w_aval.dtype), comm.axis_tuple(axis_name), axis_size, gather_k, repr(config), mesh, str(out_dtype), shared_scale,
               bool(block_scaled))
    except Exception as e:
        return f"cannot inspect the call ({type(e).__name__}: {e})"
    return comm.cached_reason(key, mesh, lambda: _unavailable(x_local_aval, w_aval, axis_name, axis_size, gather_k,
                                                               config, out_dtype, shared_scale, block_scaled))


@dataclasses.dataclass(frozen=True)
class AgGemmCall:
    """Everything static about one fused ag_gemm call: padding, the GEMM grid, the communicator
    and the config. Hashable: it lives in the op's static plan."""

    padding: AgPadding
    gemm_sms: int
    push_sms: int  # 0: the copy engines push
    comm_id: int
    config: Any  # AgGemmConfig
    target: str
    out_dtype: Optional[str] = None  # an FP8 call: the output dtype's name; None: bf16/fp16 in, same out
    block_scaled: bool = False  # an FP8 call with block scales (the plan was made for them)


def prepare(x_local_aval, w_aval, *, axis_name, axis_size, gather_k, config, out_dtype=None,
            shared_scale: bool = False, block_scaled: bool = False) -> AgGemmCall:
    """The plan of ag_gemm on this rank's shard x [rows, cols] and w, and its communicator, acquired
    now (acquire_comm): once per call site at trace time, after unavailable_reason said None
    (out_dtype: an FP8 call, as there). Raises Unavailable with the reason when the fused path
    cannot run it after all."""
    if block_scaled and (reason := _plan.fp8_block_reason()):
        raise Unavailable(reason)  # block scales never reach the per-tensor kernels
    mesh = comm.mesh_for(axis_name)
    (rows, cols), n = x_local_aval.shape, w_aval.shape[1]
    fp8 = out_dtype is not None
    gemm_sms, push_sms = launch_sms(config, rows * cols * jnp.dtype(x_local_aval.dtype).itemsize)
    try:
        plan = _plan.ag_plan(rows, cols, n, axis_size, gather_k, config, gemm_sms, push_sms, fp8=fp8,
                             shared_scale=shared_scale, x_dtype=jnp.dtype(x_local_aval.dtype).name,
                             block_scaled=block_scaled)
    except _plan.NoExtension as e:
        raise Unavailable(str(e)) from None
    except _plan.PlanError as e:
        raise Unavailable(f"the kernels cannot run this call: {e.rule}") from None
    p = ag_padding(plan, rows, cols, n, axis_size, gather_k)
    cid = comm.acquire_comm(mesh, axis_name, *_heap_need(plan))
    return AgGemmCall(padding=p, gemm_sms=gemm_sms, push_sms=push_sms, comm_id=cid, config=config,
                      target=_plan.fp8_target() if fp8 else _plan.target(),
                      out_dtype=jnp.dtype(out_dtype).name if fp8 else None, block_scaled=bool(fp8 and block_scaled))


def _group_operands(x2d, w, p: AgPadding) -> tuple:
    """(x padded, the weights padded, the padding of each weight's output): w one weight, or a group
    whose widths are multiples of the block (fused.call), each weight padded in K alone."""
    if not isinstance(w, tuple):
        x_pad, w_pad = pad_operands(x2d, w, p)
        return x_pad, (w_pad,), (p,)
    pads = tuple(dataclasses.replace(p, n=w_i.shape[1], n_pad=w_i.shape[1]) for w_i in w)
    x_pad = pad_operands(x2d, w[0], pads[0])[0]
    return x_pad, tuple(pad_operands(x2d, w_i, p_i)[1] for w_i, p_i in zip(w, pads)), pads


def _outputs(results: list, pads: tuple, fixed: int, return_gathered: bool):
    """(y, gathered or None) unpadded from the FFI results: the first weight's y, `fixed` results
    after it (the gathered operand first), then the group's further outputs; y alone, or a tuple of a
    group's."""
    y, gathered = unpad(results[0], results[1] if return_gathered else None, pads[0])
    ys = (y,) + tuple(unpad(y_i, None, p_i)[0] for y_i, p_i in zip(results[1 + fixed:], pads[1:]))
    return (ys if len(pads) > 1 else y), gathered


def _shapes(weights) -> list:
    """The weight operands' shapes as a call's signature names them: one weight's, or a group's list."""
    return list(weights[0].shape) if len(weights) == 1 else [list(v.shape) for v in weights]


def call(x2d, w, site: AgGemmCall, return_gathered: bool):
    """One rank's fused AllGather + GEMM inside shard_map, as prepared: (y, gathered or None). w one
    weight, or a group of weights [K, N_i] (a tuple; each N_i a multiple of config.block_n, the
    plan's N their sum), each read where it lies and each with its own output: then y is a tuple.
    The FFI call takes the weights after w and returns their outputs after the gathered operand."""
    p = site.padding
    x_pad, weights, pads = _group_operands(x2d, w, p)
    y_rows = p.rows_pad if p.gather_k else p.world * p.rows_pad
    gathered_shape = (p.world, p.rows_pad, p.cols_pad) if return_gathered else (0,)
    attributes = site.config.kernel_attributes(site.gemm_sms, site.push_sms)
    layout = "contraction" if p.gather_k else "rows"
    signature = comm.call_signature(f"ag_gemm {x2d.dtype} x {list(x_pad.shape)} w {_shapes(weights)} "
                                    f"gathering {layout}, gathered {list(gathered_shape)}, config "
                                    f"{comm.attributes_text(attributes)}, from {comm.call_site()}")
    ys = [jax.ShapeDtypeStruct((y_rows, p_i.n_pad), x2d.dtype) for p_i in pads]
    results = _ffi.fused_call(
        site.target, [ys[0], jax.ShapeDtypeStruct(gathered_shape, x2d.dtype)] + ys[1:],
        x_pad, *weights, comm_id=np.int64(site.comm_id), gather_k=bool(p.gather_k), signature=np.int64(signature),
        config=attributes)
    return _outputs(results, pads, 1, return_gathered)


def pad_block_scales(x_scale, w_scale, p: AgPadding) -> list:
    """Block scales in the kernels' layout for the padded operands (pad_operands): the shard's x_scale
    [rows, cols/128] -> [cols/128, rows_pad], M-major; w_scale [K/128, ceil(N/128)] -> [n_pad/128, K/128],
    w_t's 128x128 blocks. Padded rows and columns are zeros; their scales are 1. The plan had
    cols % 128 == 0 (no K padding)."""
    x_scale = jnp.pad(x_scale, ((0, p.rows_pad - p.rows), (0, 0)), constant_values=1)
    w_scale = jnp.pad(w_scale, ((0, 0), (0, blocks(p.n_pad) - w_scale.shape[1])), constant_values=1)
    return [x_scale.astype(jnp.float32).T, w_scale.astype(jnp.float32).T]


def call_fp8(x2d, w, x_scale, w_scale, site: AgGemmCall, return_gathered: bool, shared_scale: bool):
    """call() of the FP8 kernels: shard x [rows, cols] in e4m3 or e5m2 (scaled by this rank's x_scale)
    and w in e4m3 (or a group of them, sharing w_scale), y in site.out_dtype; returns (y, gathered
    [W, rows, cols] in x's dtype or None, the W sources' x_scale: f32 [W], or with block scales
    (site.block_scaled, one weight: x_scale [rows, cols/128], w_scale [K/128, ceil(N/128)])
    [W, cols/128, rows] or, without return_gathered, empty).
    Each shard's scale travels with it inside the kernels (no collective of its own); shared_scale
    says every rank's x_scale is equal, so the kernels may use their own. Each weight goes in
    transposed ([N_i, K], K-major, as for gemm_rs's FP8 call): XLA fuses the transpose with the
    quantisation that makes the weight (one pass over its bytes). A group's further w_t follow the
    scales, their outputs the gathered scales."""
    p = site.padding
    x_pad, weights, pads = _group_operands(x2d, w, p)
    y_rows = p.rows_pad if p.gather_k else p.world * p.rows_pad
    gathered_shape = (p.world, p.rows_pad, p.cols_pad) if return_gathered else (0,)
    if site.block_scaled:
        scales = pad_block_scales(x_scale, w_scale, p)
        scales_shape = (p.world, x_scale.shape[1], p.rows_pad) if return_gathered else (0,)
    else:
        scales = [jnp.reshape(s.astype(jnp.float32), (1,)) for s in (x_scale, w_scale)]
        scales_shape = (p.world,)
    w_ts = [v.T for v in weights]
    attributes = site.config.kernel_attributes(site.gemm_sms, site.push_sms)
    layout = "contraction" if p.gather_k else "rows"
    signature = comm.call_signature(f"ag_gemm {x2d.dtype} x {list(x_pad.shape)} w_t {_shapes(w_ts)} "
                                    f"gathering {layout}, gathered {list(gathered_shape)}, out {site.out_dtype}, "
                                    f"shared scale {bool(shared_scale)}{', block-scaled' if site.block_scaled else ''}, "
                                    f"config {comm.attributes_text(attributes)}, from {comm.call_site()}")
    ys = [jax.ShapeDtypeStruct((y_rows, p_i.n_pad), site.out_dtype) for p_i in pads]
    results = _ffi.fused_call(
        site.target, [ys[0], jax.ShapeDtypeStruct(gathered_shape, x2d.dtype),
                      jax.ShapeDtypeStruct(scales_shape, jnp.float32)] + ys[1:],
        x_pad, w_ts[0], *scales, *w_ts[1:], comm_id=np.int64(site.comm_id), gather_k=bool(p.gather_k),
        shared_scale=bool(shared_scale), signature=np.int64(signature), config=attributes)
    y, gathered = _outputs(results, pads, 2, return_gathered)
    gathered_scales = results[2]
    if site.block_scaled and return_gathered:
        gathered_scales = gathered_scales[:, :, : p.rows]
    return y, gathered, gathered_scales
