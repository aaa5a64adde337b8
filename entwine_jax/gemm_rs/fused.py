# gemm_rs's fused path: whether the kernels can run a call (a predicate that only answers), its
# preparation once per call site at trace time (the C++ plan and the communicator, acquired with the
# room the plan needs), and the call itself inside shard_map: pad as the plan says, one ffi_call, unpad.
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _extension, _ffi, callsite, comm
from entwine_jax.comm import Unavailable
from entwine_jax.fp8 import BLOCK, blocks
from entwine_jax.gemm_rs import plan as _plan
from entwine_jax.gemm_rs.config import GemmRsConfig
from entwine_jax.gemm_rs.plan import GemmRsPlan


# The padding of a gemm_rs call is its plan: GemmRsPlan carries the unpadded call (m, k, n, mp,
# n_part) and the padded partition (mp_pad, k_pad, n_pad) the C++ plan chose.
Padding = GemmRsPlan


def padding(m: int, k: int, n: int, world: int, block_n: int, scatter_cols: bool = False) -> Padding:
    """The kernels' padding of x [m, k] @ w [k, n] scattered over `world` ranks (rows, or columns)
    with `block_n`-wide blocks, the only config field it depends on: the plan pads each partition
    to whole blocks and K to the TMA alignment (zeros add nothing to the sum). ValueError when the
    scattered dim does not divide by the world, or the kernels cannot run the call."""
    if scatter_cols and n % world:
        raise ValueError(f"gemm_rs: N={n} is not divisible by the axis size {world}")
    if not scatter_cols and m % world:
        raise ValueError(f"gemm_rs: M={m} is not divisible by the axis size {world}")
    try:
        return _plan.gemm_rs_plan(m, n, k, world, GemmRsConfig(block_n=block_n), scatter_cols)
    except _plan.PlanError as e:
        raise ValueError(f"gemm_rs: the kernels cannot run x [{m}, {k}] @ w [{k}, {n}] over {world} ranks: "
                         f"{e.rule}") from None


def pad_operands(x, w, p: Padding, xp=jnp):
    """Rows: x [M, K] -> [W * mp_pad, k_pad] (each partition padded on its own), w -> [k_pad, n_pad].
    Columns: x -> [mp_pad, k_pad], w [K, N] -> [k_pad, W * n_pad] (each partition padded on its own)."""
    if p.scatter_cols:
        if (p.mp, p.k) != (p.mp_pad, p.k_pad):
            x = xp.pad(x, ((0, p.mp_pad - p.mp), (0, p.k_pad - p.k)))
        if (p.k, p.n_part) != (p.k_pad, p.n_pad):
            w = w.reshape(p.k, p.world, p.n_part)
            w = xp.pad(w, ((0, p.k_pad - p.k), (0, 0), (0, p.n_pad - p.n_part)))
            w = w.reshape(p.k_pad, p.world * p.n_pad)
        return x, w
    if (p.mp, p.k) != (p.mp_pad, p.k_pad):
        x = x.reshape(p.world, p.mp, p.k)
        x = xp.pad(x, ((0, 0), (0, p.mp_pad - p.mp), (0, p.k_pad - p.k)))
        x = x.reshape(p.world * p.mp_pad, p.k_pad)
    if (p.k, p.n) != (p.k_pad, p.n_pad):
        w = xp.pad(w, ((0, p.k_pad - p.k), (0, p.n_pad - p.n)))
    return x, w


def unpad(y, p: Padding):
    """The kernel's [mp_pad, n_pad] partition of this rank -> [mp, n_part]."""
    return y[: p.mp, : p.n_part] if (p.mp, p.n_part) != (p.mp_pad, p.n_pad) else y


def _unavailable(x_local_aval, w_aval, axis_name, axis_size, scatter_dimension, config, out_dtype, block_scaled):
    if getattr(config, "path", None) == "xla":
        return "config.path is 'xla'"
    if reason := callsite.kernel_dtype_reason(x_local_aval.dtype, w_aval.dtype, out_dtype):
        return reason
    if block_scaled and (reason := _plan.fp8_block_reason()):
        return reason
    if scatter_dimension not in (0, 1):
        return f"fused kernels scatter over rows (0) or columns (1) of the 2-D product, got {scatter_dimension}"
    if reason := comm.world_reason(axis_size):
        return reason
    if len(x_local_aval.shape) != 2 or len(w_aval.shape) != 2:
        return f"fused path takes 2-D x and w, got {x_local_aval.shape} and {w_aval.shape}"
    (m, k), (_, n) = x_local_aval.shape, w_aval.shape
    if m == 0 or n == 0 or k == 0:
        return f"empty operands x {x_local_aval.shape}, w {w_aval.shape}"
    if (n if scatter_dimension == 1 else m) % axis_size:
        return f"scattered size not divisible by the axis size {axis_size}"
    if block_scaled and scatter_dimension == 1 and (n // axis_size) % BLOCK:
        # Each rank's slice of N is padded on its own: w's 128-column scale blocks must not straddle them.
        return (f"block-scaled FP8 scattering columns needs N / W % 128 == 0 (w's 128x128 scale blocks within "
                f"each rank's output slice), got N = {n} over {axis_size} ranks")
    plan = None
    if _extension.module()[0] is not None:
        if out_dtype is not None and (reason := _plan.fp8_reason()):
            return reason
        try:
            plan = _plan.gemm_rs_plan(m, n, k, axis_size, config, scatter_dimension == 1, fp8=out_dtype is not None,
                                      x_dtype=jnp.dtype(x_local_aval.dtype).name, block_scaled=block_scaled)
        except _plan.PlanError as e:
            return f"the kernels cannot run x {x_local_aval.shape} @ w {w_aval.shape} over {axis_size} ranks: {e.rule}"
    # Without the extension there is no plan, and this is where the reason says so.
    reason, mesh, ext = comm.platform_reason(axis_name)
    if reason:
        return reason
    if reason := comm.mesh_reason(ext, mesh, axis_name, axis_size):
        return reason
    return comm.heap_reason(ext, mesh, axis_name, axis_size, *_heap_need(plan))


def _heap_need(plan) -> tuple[int, dict[str, int]]:
    """What a call needs of the communicator's heap: a flag per tile of a partition, and its partial
    output in the region that ffi/gemm_rs/handler.cc registers (double-buffered)."""
    return plan.tiles_per_partition, {"gemm_rs.partial": plan.slot_bytes}


def unavailable_reason(x_local_aval, w_aval, *, axis_name, axis_size, scatter_dimension,
                       config, out_dtype=None, block_scaled: bool = False) -> Optional[str]:
    """None when the fused kernels can run gemm_rs on x [M, K] (this rank's 2-D view), w [K, N],
    else a short reason (out_dtype given: the FP8 kernels on an e4m3 or e5m2 x and an e4m3 w, writing
    out_dtype; block_scaled: with block scales).
    Only answers: no communicator is created or grown here (prepare does that). Never raises for
    ordinary inputs; cached per call shape."""
    try:
        mesh = comm.find_mesh(axis_name)
        key = (tuple(x_local_aval.shape), str(x_local_aval.dtype), tuple(w_aval.shape),
               str(w_aval.dtype), comm.axis_tuple(axis_name), axis_size, scatter_dimension,
               repr(config), mesh, str(out_dtype), bool(block_scaled))
    except Exception as e:
        return f"cannot inspect the call ({type(e).__name__}: {e})"
    return comm.cached_reason(key, mesh, lambda: _unavailable(x_local_aval, w_aval, axis_name, axis_size,
                                                              scatter_dimension, config, out_dtype, block_scaled))


@dataclasses.dataclass(frozen=True)
class GemmRsCall:
    """Everything static about one fused gemm_rs call: the kernels' plan (the padding), the
    communicator and the config. Hashable: it lives in the op's static plan."""

    plan: GemmRsPlan
    comm_id: int
    config: Any  # GemmRsConfig
    target: str
    out_dtype: Optional[str] = None  # an FP8 call: the output dtype's name; None: bf16/fp16 in, same out
    block_scaled: bool = False  # an FP8 call with block scales (the plan was made for them)

    @property
    def scatter_dimension(self) -> int:
        return int(self.plan.scatter_cols)


def prepare(x_local_aval, w_aval, *, axis_name, axis_size, scatter_dimension, config, out_dtype=None,
            block_scaled: bool = False) -> GemmRsCall:
    """The plan of gemm_rs on x [M, K] (this rank's 2-D view), w [K, N], and its communicator,
    acquired now (acquire_comm): call once per call site at trace time, after unavailable_reason
    said None (out_dtype: an FP8 call, as there). Raises Unavailable with the reason when the fused
    path cannot run it after all."""
    if block_scaled and (reason := _plan.fp8_block_reason()):
        raise Unavailable(reason)  # block scales never reach the per-tensor kernels
    mesh = comm.mesh_for(axis_name)
    (m, k), (_, n) = x_local_aval.shape, w_aval.shape
    fp8 = out_dtype is not None
    try:
        plan = _plan.gemm_rs_plan(m, n, k, axis_size, config, scatter_dimension == 1, fp8=fp8,
                                  x_dtype=jnp.dtype(x_local_aval.dtype).name, block_scaled=block_scaled)
    except (_plan.PlanError, _plan.NoExtension) as e:
        raise Unavailable(f"the kernels cannot run this call: {e}") from None
    cid = comm.acquire_comm(mesh, axis_name, *_heap_need(plan))
    return GemmRsCall(plan=plan, comm_id=cid, config=config, target=_plan.fp8_target() if fp8 else _plan.target(),
                      out_dtype=jnp.dtype(out_dtype).name if fp8 else None, block_scaled=bool(fp8 and block_scaled))


def call(x2d, w, site: GemmRsCall) -> jax.Array:
    """One rank's fused GEMM + ReduceScatter inside shard_map, as prepared: [M, K] @ [K, N] ->
    [M / W, N] (rows) or [M, N / W] (columns). Pads as the plan says, calls, unpads."""
    p = site.plan
    x_pad, w_pad = pad_operands(x2d, w, p)
    layout = "columns" if site.scatter_dimension else "rows"
    signature = comm.call_signature(f"gemm_rs {x2d.dtype} x {list(x_pad.shape)} w {list(w_pad.shape)} scattering "
                                    f"{layout}, config {comm.attributes_text(site.config.kernel_attributes())}, from {comm.call_site()}")
    y, = _ffi.fused_call(site.target, [jax.ShapeDtypeStruct((p.mp_pad, p.n_pad), x2d.dtype)], x_pad, w_pad,
                             comm_id=np.int64(site.comm_id), scatter_dimension=np.int64(site.scatter_dimension),
                             signature=np.int64(signature), config=site.config.kernel_attributes())
    return unpad(y, p)


def pad_block_scales(x_scale, w_scale, p: GemmRsPlan) -> list:
    """Block scales in the kernels' layout for the padded operands (pad_operands): x_scale [M, K/128]
    (x2d's rows) -> [K/128, rows of x_pad], M-major; w_scale [K/128, ceil(N/128)] -> [n of w_t / 128,
    K/128], w_t's 128x128 blocks. Padded rows and columns are zeros; their scales are 1. The plan had
    K % 128 == 0 (no K padding) and, scattering columns, N / W % 128 == 0 (unavailable_reason)."""
    kb = x_scale.shape[1]
    if p.scatter_cols:
        x_scale = jnp.pad(x_scale, ((0, p.mp_pad - p.mp), (0, 0)), constant_values=1)
        per, padded = p.n_part // BLOCK, blocks(p.n_pad)
        w_scale = jnp.pad(w_scale.reshape(kb, p.world, per), ((0, 0), (0, 0), (0, padded - per)), constant_values=1)
    else:
        x_scale = jnp.pad(x_scale.reshape(p.world, p.mp, kb), ((0, 0), (0, p.mp_pad - p.mp), (0, 0)),
                          constant_values=1)
        w_scale = jnp.pad(w_scale, ((0, 0), (0, blocks(p.n_pad) - w_scale.shape[1])), constant_values=1)
    return [x_scale.reshape(-1, kb).astype(jnp.float32).T, w_scale.reshape(kb, -1).astype(jnp.float32).T]


def call_fp8(x2d, w, x_scale, w_scale, site: GemmRsCall) -> jax.Array:
    """call() of the FP8 kernels: x [M, K] in e4m3 or e5m2 and w [K, N] in e4m3, y = (x * x_scale) @
    (w * w_scale) reduce-scattered, in site.out_dtype; block scales (site.block_scaled): x_scale
    [M, K/128] for x2d's rows, w_scale [K/128, ceil(N/128)]. The kernels take the weight transposed
    ([N, K], K-major, as Hopper's FP8 wgmma reads both operands); XLA fuses the transpose with the
    padding (one pass over w's bytes, or none where the quantisation that made w writes it)."""
    p = site.plan
    x_pad, w_pad = pad_operands(x2d, w, p)
    if site.block_scaled:
        scales = pad_block_scales(x_scale, w_scale, p)
    else:
        scales = [jnp.reshape(s.astype(jnp.float32), (1,)) for s in (x_scale, w_scale)]
    w_t = w_pad.T
    layout = "columns" if site.scatter_dimension else "rows"
    signature = comm.call_signature(f"gemm_rs {x2d.dtype} x {list(x_pad.shape)} w_t {list(w_t.shape)} scattering "
                                    f"{layout}, out {site.out_dtype}{', block-scaled' if site.block_scaled else ''}, "
                                    f"config "
                                    f"{comm.attributes_text(site.config.kernel_attributes())}, from {comm.call_site()}")
    y, = _ffi.fused_call(site.target, [jax.ShapeDtypeStruct((p.mp_pad, p.n_pad), site.out_dtype)], x_pad,
                             w_t, *scales, comm_id=np.int64(site.comm_id),
                             scatter_dimension=np.int64(site.scatter_dimension), signature=np.int64(signature),
                             config=site.config.kernel_attributes())
    return unpad(y, p)


def call_local(x2d, w, *, axis_name, axis_size, config, scatter_dimension=0) -> jax.Array:
    """prepare and call in one, inside shard_map (for callers outside the op, e.g. tests):
    [M, K] @ [K, N] -> [M / W, N] (scatter_dimension 0) or [M, N / W] (scatter_dimension 1)."""
    try:
        site = prepare(jax.ShapeDtypeStruct(x2d.shape, x2d.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype),
                       axis_name=axis_name, axis_size=axis_size, scatter_dimension=scatter_dimension, config=config)
    except Unavailable as e:
        raise RuntimeError(f"entwine gemm_rs: {e}") from None
    return call(x2d, w, site)

