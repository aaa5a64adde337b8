# gemm_rs's plan of one call, asked of the C++ extension instead of restated here (the config's rules,
# the padding, tiles, blocks, the producer's grid and split tail, the slot bytes), and its FFI target
# name. Without the extension (a pure-Python install) there is no plan, and no fused path to plan.
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from entwine_jax import _extension
from entwine_jax._extension import NoExtension, PlanError  # noqa: F401  (the errors a plan raises)


def target() -> str:
    """The XLA FFI target name of gemm_rs (spelled once, in the extension)."""
    return _extension.ext().GEMM_RS_TARGET


def fp8_target() -> str:
    """The XLA FFI target name of FP8 gemm_rs (spelled once, in the extension)."""
    return _extension.ext().GEMM_RS_FP8_TARGET


def fp8_reason() -> Optional[str]:
    """Why the extension cannot run FP8 gemm_rs (no FP8 target, no FP8 plan), or None."""
    return _extension.fp8_reason("GEMM_RS_FP8_TARGET", "gemm_rs_fp8_plan")


def fp8_block_reason() -> Optional[str]:
    """Why the extension cannot run block-scaled FP8 gemm_rs (no FP8 kernels, or FP8 kernels that take
    per-tensor scales only), or None."""
    return _extension.fp8_block_reason("gemm_rs", "gemm_rs_fp8_plan")


@dataclasses.dataclass(frozen=True)
class GemmRsPlan:
    """gemm_rs's plan of one call (the C++ GemmRsPlan), with the call it was made for.

    The call: x [m, k], w [k, n] on each of `world` ranks, scattered over rows (partitions of
    mp = m / W rows, n_part = n columns) or columns (scatter_cols: mp = m rows, n_part = n / W).
    The kernels' problem: each partition padded to [mp_pad, n_pad], K to k_pad. Hashable: it is
    part of the op's static plan.
    """

    world: int
    m: int
    k: int
    n: int
    scatter_cols: bool
    mp: int
    mp_pad: int  # rows of a padded partition
    k_pad: int
    n_pad: int  # columns of a padded partition
    tiles_per_partition: int  # reduction tiles of one partition: flag words per source rank
    m_blocks: int  # producer blocks of one partition: m_blocks x n_blocks
    n_blocks: int
    raster_rows: int  # the raster group the kernels run (config.raster_rows, at most m_blocks)
    num_blocks: int  # producer blocks of the call (all W partitions)
    grid: int  # producer CTAs
    k_tiles: int
    split_first_block: int  # blocks from here on are split in K (num_blocks: none)
    split: bool  # the producer splits its tail in K
    slot_bytes: int  # one partial slot: the padded [W * mp_pad, n_pad] (or [mp_pad, W * n_pad]) product

    @property
    def n_part(self) -> int:
        return self.n // self.world if self.scatter_cols else self.n

    @property
    def needed(self) -> bool:
        """Whether the operands need padding at all."""
        return (self.mp, self.k, self.n_part) != (self.mp_pad, self.k_pad, self.n_pad)

    @property
    def blocks_per_partition(self) -> int:
        return self.m_blocks * self.n_blocks


@functools.lru_cache(maxsize=4096)
def _asked(fp8, x_dtype, block_scaled, m, n, k, world, scatter_cols, block_n, producer_sms, consumer_grid,
           consumer_block, raster_rows, split_tail) -> dict:
    args = (m, n, k, world, scatter_cols, block_n, producer_sms, consumer_grid, consumer_block, raster_rows,
            split_tail)
    if fp8:
        # The FP8 plan: the bf16 plan's arguments and x's FP8 dtype; it pads K to 16 one-byte elements.
        # block_scaled only where asked: a build without block-scaled kernels has no such keyword.
        return dict(_extension.ext().gemm_rs_fp8_plan(*args, x_dtype=x_dtype,
                                                      **({"block_scaled": True} if block_scaled else {})))
    return dict(_extension.ext().gemm_rs_plan(*args))


def gemm_rs_plan(m: int, n: int, k: int, world: int, config, scatter_cols: bool = False,
                 fp8: bool = False, x_dtype: str = "float8_e4m3fn", block_scaled: bool = False) -> GemmRsPlan:
    """The plan of gemm_rs for x [m, k], w [k, n] (one rank's operands, unpadded) over `world`
    ranks with `config` (a GemmRsConfig); fp8: the FP8 kernels' plan, x_dtype: x's FP8 dtype
    (float8_e4m3fn or float8_e5m2; w is e4m3), block_scaled: with block scales. Raises PlanError with
    the C++ rule when the kernels cannot run it, NoExtension without the extension (or its FP8 plan,
    or one that takes block scales)."""
    if fp8 and (reason := fp8_reason()) is not None:
        raise NoExtension(reason)
    if block_scaled and (reason := fp8_block_reason()) is not None:
        raise NoExtension(reason)
    d = _asked(bool(fp8), str(x_dtype) if fp8 else None, bool(fp8 and block_scaled), int(m), int(n), int(k),
               int(world), bool(scatter_cols),
               int(config.block_n), int(config.producer_sms), int(config.consumer_grid), int(config.consumer_block),
               int(config.raster_rows), bool(config.split_tail))
    if d["error"] is not None:
        raise PlanError(d["error"], bool(d["config_error"]))
    mp = int(m) if scatter_cols else int(m) // int(world)
    return GemmRsPlan(world=int(world), m=int(m), k=int(k), n=int(n), scatter_cols=bool(scatter_cols), mp=mp,
                      mp_pad=d["part_rows"], k_pad=d["k"], n_pad=d["part_cols"],
                      tiles_per_partition=d["tiles_per_partition"], m_blocks=d["m_blocks"], n_blocks=d["n_blocks"],
                      raster_rows=d["raster_rows"], num_blocks=d["num_blocks"], grid=d["grid"], k_tiles=d["k_tiles"],
                      split_first_block=d["split_first_block"], split=bool(d["split"]), slot_bytes=d["slot_bytes"])


def config_rule(config) -> Optional[str]:
    """The kernels' rule that `config` violates whatever the shape, or None; None too without the
    extension, where no config runs on the kernels."""
    if _extension.module()[0] is None:
        return None
    try:
        gemm_rs_plan(1, 1, 1, 1, config)
    except PlanError as e:
        return e.rule if e.config_error else None
    return None
