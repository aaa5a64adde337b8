# gemm_rs's printable config (the kernels' fields mirror the config struct of ffi/gemm_rs, plus the
# Python-only `path`), its global default and its shape heuristic. The kernels' shape rules (blocks,
# grids) come from their C++ plan (plan.py), never restated here.
import contextlib
import dataclasses
from typing import Iterator, Optional

import jax.numpy as jnp
import numpy as np

from entwine_jax import _extension
from entwine_jax._config import (BLOCK_N, FIELD_MAX, PATHS, check_int, check_int_choice, check_shape_args,
                                 ffi_attribute)
from entwine_jax.gemm_rs import plan

_CONSUMER_BLOCK = (128, 256, 512)
# The consumer kernel serves at most this many CTAs; the C++ plan refuses more too, but a config
# made where the extension is absent must say so as well.
_CONSUMER_GRID_MAX = 64


@dataclasses.dataclass(frozen=True)
class GemmRsConfig:
    """Configuration of one gemm_rs call.

    block_n:        producer GEMM block 128 x block_n x 64; 128 or 256 (FP8 operands: 128 always).
    producer_sms:   the persistent GEMM grid; 0: the SMs the consumer and ENTWINE_SM_RESERVE leave
                    (resolved by the handler on the GPU). Any value is safe: the GEMM never waits.
    consumer_grid:  the communication budget x: CTAs of the reduction kernel.
    consumer_block: threads per consumer CTA; 128, 256 or 512.
    raster_rows:    the producer visits each partition in groups of this many 128-row tile rows,
                    column by column inside a group (L2 reuse); the consumer follows that order.
    split_tail:     a persistent producer splits its partial last wave in K over the whole grid
                    (when that leaves enough work per CTA); False: whole blocks to the end.
    path:           "auto": fused when it can run and the axis size is > 1, else the XLA
                    reference (logged once);
                    "fused": fused when it can run (also on an axis of size 1), else the
                    reference with a warning;
                    "xla": always the XLA reference (psum_scatter of an fp32 dot).
    """

    block_n: int = 128
    producer_sms: int = 0
    consumer_grid: int = 16
    consumer_block: int = 512
    raster_rows: int = 8
    split_tail: bool = False
    path: str = "auto"

    def __post_init__(self):
        check_int_choice("block_n", self.block_n, BLOCK_N, "GemmRsConfig")
        check_int("producer_sms", self.producer_sms, 0, "GemmRsConfig", FIELD_MAX)
        check_int("consumer_grid", self.consumer_grid, 1, "GemmRsConfig")
        if self.consumer_grid > _CONSUMER_GRID_MAX:
            raise ValueError(f"GemmRsConfig: consumer_grid must be <= {_CONSUMER_GRID_MAX} (the consumer kernel's "
                             f"limit), got {self.consumer_grid!r}")
        check_int_choice("consumer_block", self.consumer_block, _CONSUMER_BLOCK, "GemmRsConfig")
        check_int("raster_rows", self.raster_rows, 1, "GemmRsConfig", FIELD_MAX)
        # 0 and 1 too: bench --configs and JSON tables spell it as an int.
        if self.split_tail not in (True, False) or not isinstance(self.split_tail, (bool, np.bool_, int, np.integer)):
            raise ValueError(f"GemmRsConfig: split_tail must be a bool, got {self.split_tail!r}")
        object.__setattr__(self, "split_tail", bool(self.split_tail))
        if self.path not in PATHS:
            raise ValueError(f"GemmRsConfig: path must be one of {PATHS}, got {self.path!r}")

    def kernel_attributes(self) -> dict:
        """The fields the kernels read, as the one `config` attribute of the FFI call (decoded by name
        into the op's config struct in the extension): every field but `path`."""
        return {f.name: ffi_attribute(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "path"}

    def __str__(self) -> str:
        return (f"GemmRsConfig(block_n={self.block_n}, producer_sms={self.producer_sms}, "
                f"consumer_grid={self.consumer_grid}, consumer_block={self.consumer_block}, "
                f"raster_rows={self.raster_rows}, split_tail={self.split_tail}, path={self.path})")


_default: Optional[GemmRsConfig] = None


def set_default_config(config: Optional[GemmRsConfig]) -> Optional[GemmRsConfig]:
    """Use `config` for every gemm_rs call without an explicit config (None: the heuristic).

    Read at trace time: functions already jitted keep the config they were traced with.
    Returns the previous default.
    """
    global _default
    if config is not None and not isinstance(config, GemmRsConfig):
        raise ValueError(f"set_default_config: config must be a GemmRsConfig or None, got {type(config).__name__}")
    previous, _default = _default, config
    return previous


def get_default_config() -> Optional[GemmRsConfig]:
    return _default


@contextlib.contextmanager
def using_config(config: Optional[GemmRsConfig]) -> Iterator[None]:
    """Context manager form of set_default_config."""
    previous = set_default_config(config)
    try:
        yield
    finally:
        set_default_config(previous)


def producer_sms_beside(consumer_grid: int, sm_count: Optional[int] = None) -> int:
    """The persistent producer grid beside a consumer of `consumer_grid` CTAs: the SMs it leaves.
    The one place this split of the GPU is stated (heuristic_config, with_overrides, tune())."""
    # More producer CTAs than SMs left over would only start once others finish all their work.
    return max(1, (sm_count or _extension.sm_count()) - consumer_grid)


def heuristic_config(m: int, n: int, k: int, world: int, dtype, *, scatter_cols: bool = False) -> GemmRsConfig:
    """Config for a call with x [m, k] (per rank), w [k, n] over `world` ranks (scattered over
    rows, or over N with scatter_cols).

    Every rule says why; the tuned table (per GPU and shape) overrides these. Measurements:
    docs/performance.md. ValueError for sizes or world below 1, or a dtype no call has.
    """
    check_shape_args("heuristic_config", {"m": m, "n": n, "k": k}, world, dtype)
    # 128x256 blocks measured 5-15% faster than 128x128 for the producer alone on H200;
    # 128 only where N is not a multiple of 256, so no padding is needed. FP8 operands: 128, the only
    # width the FP8 kernels' plan takes (the promoted fp32 accumulator of a wider block does not fit).
    block_n = 256 if n % 256 == 0 and jnp.dtype(dtype).itemsize > 1 else 128
    # The budget follows the communication share: each rank moves (M/W) x N x W elements whatever
    # K is, while the GEMM grows with K. Best of x in {4, 8, ..., 32} end to end on 2xH200 (W=2):
    # x = 24 at K = 1024 (10-20% faster than 16 there), 12 at K = 2048, 8 at K = 3584, 4 at
    # K = 6656 (below K = 1024 not measured: 24 kept).
    budget = 24 if k <= 1024 else 12 if k <= 2048 else 8 if k <= 4096 else 4
    # More CTAs than blocks of the local partition (the kernels' plan of this call) would only
    # idle. Without the extension there is no plan, and no kernel to run the config: no cap.
    blocks = _partition_blocks(m, n, k, world, block_n, scatter_cols)
    consumer_grid = min(budget, blocks) if blocks else budget
    # A persistent producer on the SMs the consumer leaves free measured 1.2-1.4x faster than one
    # CTA per block on H200 (its epilogue overlaps the next block's mainloop).
    producer_sms = producer_sms_beside(consumer_grid)
    # 512 threads keep enough 16-byte loads in flight per SM to cover NVLink latency.
    consumer_block = 512
    # Groups of 8 tile rows keep the blocks in flight on a few rows of x and columns of w: measured
    # up to 12% faster than row-major on N = 16384.
    raster_rows = 8
    # The split tail makes the producer alone 2-3% faster where the last wave is nearly empty,
    # but end to end it was 0-4% slower on the suite shapes it applies to: the last full wave's
    # tiles are then released at the very end with the rest, so the reduction left after the GEMM
    # grows. tune() tries it.
    split_tail = False
    return GemmRsConfig(block_n=block_n, producer_sms=producer_sms, consumer_grid=consumer_grid,
                        consumer_block=consumer_block, raster_rows=raster_rows, split_tail=split_tail)


def _partition_blocks(m: int, n: int, k: int, world: int, block_n: int, scatter_cols: bool) -> Optional[int]:
    """Producer blocks of one (padded) partition, from the kernels' plan; None without a plan."""
    try:
        return plan.gemm_rs_plan(m, n, k, world, GemmRsConfig(block_n=block_n), scatter_cols).blocks_per_partition
    except (plan.NoExtension, plan.PlanError):
        return None


def with_overrides(base: GemmRsConfig, fields: dict) -> GemmRsConfig:
    """`base` with `fields` replaced. A consumer_grid given without producer_sms moves the persistent
    producer onto the SMs the budget leaves (producer_sms_beside), as heuristic_config does: a
    budget alone must not make the two grids outgrow the GPU. Raises TypeError for an unknown
    field, ValueError for a bad value."""
    fields = dict(fields)
    if "consumer_grid" in fields and "producer_sms" not in fields:
        fields["producer_sms"] = producer_sms_beside(int(fields["consumer_grid"]))
    return dataclasses.replace(base, **fields)
