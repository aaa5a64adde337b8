# ag_gemm's printable config (the kernels' fields mirror the config struct of ffi/ag_gemm, plus the
# Python-only `path` and `push`), its heuristic, and how a call resolves its push.
import dataclasses

import jax.numpy as jnp
import numpy as np

from entwine_jax import _extension
from entwine_jax._config import BLOCK_N, FIELD_MAX, PATHS, check_int, check_int_choice, check_shape_args
from entwine_jax.tuning import crossover

PUSHES = ("auto", "sm", "ce")


@dataclasses.dataclass(frozen=True)
class AgGemmConfig:
    """Configuration of one ag_gemm call (mirrors entwine::AgGemmConfig in ffi/ag_gemm/ag_gemm.h).

    block_n:     GEMM block 128 x block_n x 64; 128 or 256 (FP8 operands: 128 always).
    gemm_sms:    the GEMM's persistent grid; 0: every SM the push leaves (all but push_sms with the
                 SM push, all but one with the copy engines, whose one-warp chunk releases need an SM
                 while the GEMM's CTAs wait for chunks).
    raster_rows: blocks of a chunk run in groups of this many 128-row tile rows (L2 reuse).
    max_chunks:  each rank's shard travels in at most this many chunks of whole tile rows, each
                 released by its own flag (more chunks: the GEMM starts on a peer's rows sooner).
    push:        how the shard reaches the peers: "sm" (one copy kernel of push_sms CTAs, which
                 releases each chunk itself: one launch per call), "ce" (the copy engines: no SMs, a
                 copy and a release kernel per chunk and peer to enqueue) or "auto" (the SM push for
                 shards up to tuning.crossover's sm_push_max_shard_bytes, when gemm_sms leaves room).
    push_sms:    CTAs of the SM push; 0: tuning.crossover's push_sms.
    path:        "auto" / "fused" / "xla", as for GemmRsConfig.
    """

    block_n: int = 256
    gemm_sms: int = 0
    raster_rows: int = 8
    max_chunks: int = 8
    push: str = "auto"
    push_sms: int = 0
    path: str = "auto"

    def __post_init__(self):
        check_int_choice("block_n", self.block_n, BLOCK_N, "AgGemmConfig")
        check_int("gemm_sms", self.gemm_sms, 0, "AgGemmConfig", FIELD_MAX)
        check_int("raster_rows", self.raster_rows, 1, "AgGemmConfig", FIELD_MAX)
        check_int("max_chunks", self.max_chunks, 1, "AgGemmConfig")
        if self.max_chunks > 64:
            raise ValueError(f"AgGemmConfig: max_chunks must be <= 64, got {self.max_chunks!r}")
        if self.push not in PUSHES:
            raise ValueError(f"AgGemmConfig: push must be one of {PUSHES}, got {self.push!r}")
        check_int("push_sms", self.push_sms, 0, "AgGemmConfig")
        if self.push_sms > 64:
            raise ValueError(f"AgGemmConfig: push_sms must be <= 64, got {self.push_sms!r}")
        if self.path not in PATHS:
            raise ValueError(f"AgGemmConfig: path must be one of {PATHS}, got {self.path!r}")

    def kernel_attributes(self, gemm_sms: int, push_sms: int) -> dict:
        """The fields the kernels read, as the one `config` attribute of the FFI call (decoded by name
        into the op's config struct in the extension): every field but `path` and `push`, with the
        grids resolved (push_sms 0: the copy engines push)."""
        fields = {f.name: np.int64(getattr(self, f.name)) for f in dataclasses.fields(self)
                  if f.name not in ("path", "push")}
        return {**fields, "gemm_sms": np.int64(gemm_sms), "push_sms": np.int64(push_sms)}

    def __str__(self) -> str:
        return (f"AgGemmConfig(block_n={self.block_n}, gemm_sms={self.gemm_sms}, raster_rows={self.raster_rows}, "
                f"max_chunks={self.max_chunks}, push={self.push}, push_sms={self.push_sms}, path={self.path})")


def ag_heuristic_config(rows: int, n: int, cols: int, world: int, dtype, path: str = "auto") -> AgGemmConfig:
    """Config for an ag_gemm call whose shard is [rows, cols] per rank and w has N = n columns.
    ValueError for sizes or world below 1, a dtype no call has, or an unknown path."""
    check_shape_args("ag_heuristic_config", {"rows": rows, "n": n, "cols": cols}, world, dtype)
    if path not in PATHS:
        raise ValueError(f"ag_heuristic_config: path must be one of {PATHS}, got {path!r}")
    # No rule depends on world yet.
    # As for gemm_rs's producer: 128x256 blocks where N allows them without padding; 128 for FP8
    # operands, the only width the FP8 kernels' plan takes.
    block_n = 256 if n % 256 == 0 and jnp.dtype(dtype).itemsize > 1 else 128
    # A persistent grid on every SM the push leaves (gemm_sms=0), whose epilogue overlaps the next
    # block's mainloop; the push by shard size (push="auto"); up to the default 8 chunks, none below
    # tuning.crossover's min_chunk_bytes.
    chunks = rows * cols * jnp.dtype(dtype).itemsize // crossover.COSTS.min_chunk_bytes
    max_chunks = max(1, min(AgGemmConfig.max_chunks, chunks))
    return AgGemmConfig(block_n=block_n, gemm_sms=0, raster_rows=8, max_chunks=max_chunks, push="auto", path=path)


def push_budget(config: AgGemmConfig) -> int:
    """CTAs of the SM push: config.push_sms, or tuning.crossover's default."""
    return config.push_sms or crossover.COSTS.push_sms


def push_of(config: AgGemmConfig, shard_bytes: int) -> str:
    """How a call pushes its shard of `shard_bytes` (unpadded): config.push, or with "auto" the SM
    push up to tuning.crossover's shard size, if a user's gemm_sms leaves it room."""
    if config.push != "auto":
        return config.push
    push = crossover.push_engine(shard_bytes)
    if push == "sm" and config.gemm_sms and config.gemm_sms + push_budget(config) > _extension.sm_count():
        return "ce"
    return push
