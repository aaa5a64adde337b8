# The printable configs of the fused ops: GemmRsConfig (mirrors entwine::GemmRsConfig in
# ffi/gemm_rs/gemm_rs.h, plus the Python-only `path`), its global default and shape heuristic, and
# AgGemmConfig (ffi/ag_gemm/ag_gemm.h) with its heuristic. The kernels' shape rules (blocks, grids)
# come from their C++ plan (entwine_jax._plan), never restated here.
import contextlib
import dataclasses
from typing import Iterator, Optional

import numpy as np

_PATHS = ("auto", "fused", "xla")
# The values a config can hold, checked at construction with messages that name them; the kernels'
# own rules (e.g. consumer_grid <= 64) are checked against the C++ plan when gemm_rs is traced.
_BLOCK_N = (128, 256)
_CONSUMER_BLOCK = (128, 256, 512)


def _check_int(name: str, value, lo: int, where: str = "GemmRsConfig") -> None:
    # bool is an int subclass; True as a grid size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{where}: {name} must be an int >= {lo}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GemmRsConfig:
    """Configuration of one gemm_rs call.

    block_n:        producer GEMM block 128 x block_n x 64; 128 or 256.
    producer_sms:   0: one CTA per GEMM block (shared SM pool); > 0: persistent grid of that size.
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
        if self.block_n not in _BLOCK_N or isinstance(self.block_n, bool):
            raise ValueError(f"GemmRsConfig: block_n must be one of {_BLOCK_N}, got {self.block_n!r}")
        _check_int("producer_sms", self.producer_sms, 0)
        _check_int("consumer_grid", self.consumer_grid, 1)
        if self.consumer_block not in _CONSUMER_BLOCK or isinstance(self.consumer_block, bool):
            raise ValueError(
                f"GemmRsConfig: consumer_block must be one of {_CONSUMER_BLOCK}, got {self.consumer_block!r}")
        _check_int("raster_rows", self.raster_rows, 1)
        # 0 and 1 too: bench --configs and JSON tables spell it as an int.
        if self.split_tail not in (True, False) or not isinstance(self.split_tail, (bool, np.bool_, int, np.integer)):
            raise ValueError(f"GemmRsConfig: split_tail must be a bool, got {self.split_tail!r}")
        object.__setattr__(self, "split_tail", bool(self.split_tail))
        if self.path not in _PATHS:
            raise ValueError(f"GemmRsConfig: path must be one of {_PATHS}, got {self.path!r}")

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
    return max(1, (sm_count or _sm_count()) - consumer_grid)


def heuristic_config(m: int, n: int, k: int, world: int, dtype, *, scatter_cols: bool = False) -> GemmRsConfig:
    """Config for a call with x [m, k] (per rank), w [k, n] over `world` ranks (scattered over
    rows, or over N with scatter_cols).

    Every rule says why; the tuned table (per GPU and shape) overrides these. Measurements:
    docs/performance.md.
    """
    del dtype  # no rule depends on it yet
    # 128x256 blocks measured 5-15% faster than 128x128 for the producer alone on H200;
    # 128 only where N is not a multiple of 256, so no padding is needed.
    block_n = 256 if n % 256 == 0 else 128
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
    from entwine_jax import _plan

    try:
        return _plan.gemm_rs_plan(m, n, k, world, GemmRsConfig(block_n=block_n), scatter_cols).blocks_per_partition
    except (_plan.NoExtension, _plan.PlanError):
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


def _sm_count() -> int:
    """SMs of the first GPU (jax reports them as core_count); 132 (H100/H200 SXM) elsewhere."""
    try:
        import jax
        for d in jax.devices():
            count = getattr(d, "core_count", None)
            if d.platform == "gpu" and count:
                return int(count)
    except Exception:  # no GPU backend: the heuristic is only printed, never run
        pass
    return 132


@dataclasses.dataclass(frozen=True)
class AgGemmConfig:
    """Configuration of one ag_gemm call (mirrors entwine::AgGemmConfig in ffi/ag_gemm/ag_gemm.h).

    block_n:     GEMM block 128 x block_n x 64; 128 or 256.
    gemm_sms:    the GEMM's persistent grid; 0: every SM but one. It must leave at least one SM
                 free: the one-warp kernels that release each pushed chunk need it while the GEMM's
                 CTAs wait for chunks.
    raster_rows: blocks of a chunk run in groups of this many 128-row tile rows (L2 reuse).
    max_chunks:  each rank's shard travels in at most this many chunks of whole tile rows, each
                 released by its own flag (more chunks: the GEMM starts on a peer's rows sooner).
    path:        "auto" / "fused" / "xla", as for GemmRsConfig.
    """

    block_n: int = 256
    gemm_sms: int = 0
    raster_rows: int = 8
    max_chunks: int = 8
    path: str = "auto"

    def __post_init__(self):
        if self.block_n not in _BLOCK_N or isinstance(self.block_n, bool):
            raise ValueError(f"AgGemmConfig: block_n must be one of {_BLOCK_N}, got {self.block_n!r}")
        _check_int("gemm_sms", self.gemm_sms, 0, "AgGemmConfig")
        _check_int("raster_rows", self.raster_rows, 1, "AgGemmConfig")
        _check_int("max_chunks", self.max_chunks, 1, "AgGemmConfig")
        if self.max_chunks > 64:
            raise ValueError(f"AgGemmConfig: max_chunks must be <= 64, got {self.max_chunks!r}")
        if self.path not in _PATHS:
            raise ValueError(f"AgGemmConfig: path must be one of {_PATHS}, got {self.path!r}")

    def __str__(self) -> str:
        return (f"AgGemmConfig(block_n={self.block_n}, gemm_sms={self.gemm_sms}, raster_rows={self.raster_rows}, "
                f"max_chunks={self.max_chunks}, path={self.path})")


def ag_heuristic_config(rows: int, n: int, cols: int, world: int, dtype, path: str = "auto") -> AgGemmConfig:
    """Config for an ag_gemm call whose shard is [rows, cols] per rank and w has N = n columns."""
    del rows, cols, world, dtype  # no rule depends on them yet
    # As for gemm_rs's producer: 128x256 blocks where N allows them without padding.
    block_n = 256 if n % 256 == 0 else 128
    # The copy engines move the shards, so the GEMM may hold every SM but the one the chunk releases
    # need (gemm_sms=0): a persistent grid, whose epilogue overlaps the next block's mainloop.
    return AgGemmConfig(block_n=block_n, gemm_sms=0, raster_rows=8, max_chunks=8, path=path)
