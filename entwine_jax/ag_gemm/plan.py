# ag_gemm's plan of one call, asked of the C++ extension instead of restated here (the padding of a
# shard, its chunks, the GEMM's blocks and grid, the inbox bytes), and its FFI target name. Without
# the extension (a pure-Python install) there is no plan, and no fused path to plan.
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from entwine_jax import _extension
from entwine_jax._extension import NoExtension, PlanError  # noqa: F401  (the errors a plan raises)


def target() -> str:
    """The XLA FFI target name of ag_gemm (spelled once, in the extension)."""
    return _extension.ext().AG_GEMM_TARGET


def fp8_target() -> str:
    """The XLA FFI target name of FP8 ag_gemm (spelled once, in the extension)."""
    return _extension.ext().AG_GEMM_FP8_TARGET


def max_weights() -> int:
    """The most weights of a group the kernels read in place (AgGemmArgs, spelled in the extension)."""
    return int(_extension.ext().AG_GEMM_MAX_WEIGHTS)


def fp8_reason() -> Optional[str]:
    """Why the extension cannot run FP8 ag_gemm (no FP8 target, no FP8 plan), or None."""
    return _extension.fp8_reason("AG_GEMM_FP8_TARGET", "ag_gemm_fp8_plan")


def fp8_block_reason() -> Optional[str]:
    """Why the extension cannot run block-scaled FP8 ag_gemm (no FP8 kernels, or FP8 kernels that take
    per-tensor scales only), or None."""
    return _extension.fp8_block_reason("ag_gemm", "ag_gemm_fp8_plan")


@dataclasses.dataclass(frozen=True)
class AgPlan:
    """ag_gemm's plan of one call (the C++ AgPlan) of an unpadded shard [rows, cols] and N = n."""

    rows_pad: int  # the shard padded to whole 128-row tiles
    cols_pad: int  # and to 16-byte rows
    n_pad: int  # N padded to whole blocks
    chunks: int  # chunks per shard, one flag each (divides the tile rows, <= config.max_chunks)
    chunk_tiles: int  # tile rows per chunk
    num_blocks: int  # GEMM blocks of the call
    grid: int  # GEMM CTAs
    k_tiles: int
    inbox_bytes: int  # the W gathered shards
    push_grid: int  # CTAs of the SM push (0: the copy engines push)
    sms_needed: int  # SMs the GEMM and the push (or the chunk releases) hold at once


@functools.lru_cache(maxsize=4096)
def _asked(fp8, x_dtype, shared_scale, block_scaled, rows, cols, n, world, gather_k, block_n, gemm_sms, raster_rows,
           max_chunks, push_sms) -> dict:
    args = (rows, cols, n, world, gather_k, block_n, gemm_sms, raster_rows, max_chunks, push_sms)
    if fp8:
        # The FP8 plan: the bf16 plan's arguments, x's FP8 dtype and whether every shard has the same
        # scale (the per-tensor contraction layout needs it); block_scaled only where asked (a build
        # without block-scaled kernels has no such keyword).
        return dict(_extension.ext().ag_gemm_fp8_plan(*args, shared_scale=shared_scale, x_dtype=x_dtype,
                                                      **({"block_scaled": True} if block_scaled else {})))
    return dict(_extension.ext().ag_plan(*args))


def ag_plan(rows: int, cols: int, n: int, world: int, gather_k: bool, config, gemm_sms: int,
            push_sms: int = 0, fp8: bool = False, shared_scale: bool = False,
            x_dtype: str = "float8_e4m3fn", block_scaled: bool = False) -> AgPlan:
    """ag_gemm's plan of one rank's shard [rows, cols] and N = n over `world` ranks (gather_k: the
    shards are slices of the contraction dim) with `config` (an AgGemmConfig); gemm_sms and push_sms:
    the GEMM grid and the SM push's CTAs the call runs (config's resolved; push_sms 0: the copy
    engines); fp8: the FP8 kernels' plan, shared_scale: one x scale on every rank, x_dtype: the
    shard's FP8 dtype (float8_e4m3fn or float8_e5m2; w is e4m3), block_scaled: with block scales.
    Raises PlanError with the C++ rule when the kernels cannot run it, NoExtension without the
    extension (or its FP8 plan, or one that takes block scales)."""
    if fp8 and (reason := fp8_reason()) is not None:
        raise NoExtension(reason)
    if block_scaled and (reason := fp8_block_reason()) is not None:
        raise NoExtension(reason)
    d = _asked(bool(fp8), str(x_dtype) if fp8 else None, bool(shared_scale), bool(fp8 and block_scaled), int(rows),
               int(cols), int(n), int(world), bool(gather_k), int(config.block_n), int(gemm_sms),
               int(config.raster_rows), int(config.max_chunks), int(push_sms))
    if d["error"] is not None:
        raise PlanError(d["error"], False)
    return AgPlan(**{f.name: int(d[f.name]) for f in dataclasses.fields(AgPlan)})
