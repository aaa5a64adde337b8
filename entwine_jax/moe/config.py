# The MoE ops' printable config: the static capacity factor and the path. No kernel fields yet (no
# kernels are built); the fused schedule's knobs (push_sms, consumer_grid, combine_groups) come with them.
import dataclasses
from typing import Optional

from entwine_jax._config import PATHS


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Configuration of one moe_dispatch_gemm call (moe_gemm_combine takes the dispatch's layout).

    capacity: C, the static rows per (source rank, expert), a multiple of 128. None: dropless,
              C = round_up(T, 128), one row per token (a token naming one expert twice takes two,
              so rows past C can still drop); a factor f > 0: C = max(128, round_up(ceil(f*T*k/E),
              128)), f times the balanced share. A slot past C is dropped (docs/design.md,
              "Capacity, dropless and overflow").
    path:     "auto" / "fused" / "xla", as for GemmRsConfig; the kernels are not built yet, so every
              call runs the XLA reference (logged once per call site).
    """

    capacity: Optional[float] = None
    path: str = "auto"

    def __post_init__(self):
        c = self.capacity
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise ValueError(f"MoeConfig: capacity must be None (dropless) or a number > 0, got {c!r}")
        if self.path not in PATHS:
            raise ValueError(f"MoeConfig: path must be one of {PATHS}, got {self.path!r}")

    def __str__(self) -> str:
        return f"MoeConfig(capacity={self.capacity}, path={self.path})"
