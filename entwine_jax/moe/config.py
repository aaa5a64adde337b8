# The MoE ops' printable config: the static capacity factor, the path, and the dispatch kernel's
# knobs (its GEMM block and grid, the SM push).
import dataclasses
import math
from typing import Optional

import numpy as np

from entwine_jax._config import FIELD_MAX, PATHS


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Configuration of one moe_dispatch_gemm call (moe_gemm_combine takes the dispatch's layout).

    capacity: C, the static rows per (source rank, expert), a multiple of 128. None: dropless,
              C = round_up(T, 128), one row per token (a token naming one expert twice takes two,
              so rows past C can still drop); a factor f > 0: C = max(128, round_up(ceil(f*T*k/E),
              128)), f times the balanced share, and at most round_up(T*k, 128) (a source never
              sends one expert more than its T*k slots: a larger C would never fill). A slot past C
              is dropped (docs/design.md, "Capacity, dropless and overflow").
    path:     "auto" / "fused" / "xla", as for GemmRsConfig (an axis of size 1 or float32 operands
              take the XLA path under "auto"; the reason is logged once per call site).
    block_n:  the dispatch GEMM's block width, 128 or 256; 0: 256 where N allows it, else 128 (FP8: 128 always).
    gemm_sms: the dispatch GEMM's persistent grid; 0: every SM the push leaves.
    raster_rows: an expert's GEMM blocks (its local segment alone, its peers' segments stacked) run
                 in groups of this many tile rows (L2 reuse of w).
    push_sms: 0: the copy engines move the tokens (no SM), every segment's C rows (their sizes are
              the host's); n > 0: an SM push of n CTAs ahead of the dispatch GEMM, which moves only
              the rows sent, in whole 128-row blocks (the moves without a GEMM always take the copy
              engines). A call without a config takes the SM push (8 CTAs) where the rows routed fill
              at most an eighth of the E x C rows (moe.op.default_push), else the copy engines.
    """

    capacity: Optional[float] = None
    path: str = "auto"
    block_n: int = 0
    gemm_sms: int = 0
    raster_rows: int = 8
    push_sms: int = 0

    def __post_init__(self):
        c = self.capacity
        # NumPy scalars count as numbers (np.float32(1.25) as 1.25); inf is no factor (C = inf * T*k/E
        # rows cannot be allocated), nor is nan.
        number = isinstance(c, (int, float, np.integer, np.floating)) and not isinstance(c, (bool, np.bool_))
        if c is not None and not (number and 0 < c < math.inf):
            raise ValueError(f"MoeConfig: capacity must be None (dropless) or a finite number > 0, got {c!r}")
        if self.path not in PATHS:
            raise ValueError(f"MoeConfig: path must be one of {PATHS}, got {self.path!r}")
        for name, allowed in (("block_n", "0, 128 or 256"), ("gemm_sms", ">= 0"), ("raster_rows", ">= 1"),
                              ("push_sms", "in [0, 64]")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"MoeConfig: {name} must be an int ({allowed}), got {v!r}")
        if self.block_n not in (0, 128, 256):
            raise ValueError(f"MoeConfig: block_n must be 0, 128 or 256, got {self.block_n}")
        if not (0 <= self.gemm_sms <= FIELD_MAX and 1 <= self.raster_rows <= FIELD_MAX and 0 <= self.push_sms <= 64):
            raise ValueError(f"MoeConfig: gemm_sms must be in [0, {FIELD_MAX}], raster_rows in [1, {FIELD_MAX}] and "
                             f"push_sms in [0, 64], got {self.gemm_sms}, {self.raster_rows}, {self.push_sms}")

    def __str__(self) -> str:
        return (f"MoeConfig(capacity={self.capacity}, path={self.path}, block_n={self.block_n}, "
                f"gemm_sms={self.gemm_sms}, raster_rows={self.raster_rows}, push_sms={self.push_sms})")
