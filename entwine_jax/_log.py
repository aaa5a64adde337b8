# The package logger ("entwine_jax"), a once-per-key helper (the ops run at trace time, so the same
# call site is traced many times and must not repeat its messages), the level of a fallback message,
# and whether this machine has CUDA GPUs (without initialising a JAX backend).
import glob
import logging
import os
import sys
import threading
from typing import Optional

logger = logging.getLogger("entwine_jax")

_lock = threading.Lock()
_seen: set = set()


def log_once(key, level: int, msg: str, *args) -> bool:
    """Log `msg` at `level` the first time `key` is seen; returns True when it logged."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.log(level, msg, *args)
    return True


def report_call_site(op: str, key, site: str, config, reason: Optional[str], source: str, printed: set,
                     note: str = "") -> None:
    """What a fused op says about one call site at trace time: the reason it takes the XLA path,
    once, at fallback_level(config.path); and under ENTWINE_PRINT_CONFIG=1, once per `printed` set,
    the path, the config, where it came from and why (`note`: a remark on the fused path)."""
    if reason is not None:
        log_once((op, key), fallback_level(config.path), "%s %s: XLA reference path: %s", op, site, reason)
    if os.environ.get("ENTWINE_PRINT_CONFIG", "0") not in ("", "0") and key not in printed:
        printed.add(key)
        path = "xla" if reason is not None else "fused"
        why = f" reason: {reason}" if reason is not None else note
        print(f"entwine_jax.{op} {site}: path={path} {config} source={source}{why}", file=sys.stderr, flush=True)


def reset_key(key) -> None:
    """Forget one key: its message is logged again the next time."""
    with _lock:
        _seen.discard(key)


def reset_once() -> None:
    """Forget every key (tests use this to observe first-call messages again)."""
    with _lock:
        _seen.clear()


# --- Where the fallback reason goes ---------------------------------------------------------------


def default_platform() -> str:
    """"cuda", "cpu", "gpu" (ROCm), ...: the platform of jax's default backend (initialises it)."""
    import jax
    try:
        name = jax.default_backend()
        if name != "gpu":
            return name
        # "gpu" is CUDA or ROCm; only CUDA runs the fused kernels.
        try:
            return "cuda" if jax.devices("cuda") else "gpu"
        except RuntimeError:
            return "gpu"
    except Exception:  # a broken backend must not take the report (and gemm_rs) down
        return "unknown"


def fallback_level(path: str, backend: Optional[str] = None) -> int:
    """The level of a call site's "XLA reference path: <reason>" message, for config.path `path`.

    "xla": DEBUG (the user asked for it); "fused": WARNING (asked for the kernels, did not get them);
    "auto": WARNING on CUDA GPUs, where the fused kernels were expected to run, else INFO (on CPU the
    XLA path is the only one, and saying so once per call site is news, not a problem).
    backend: "cuda", "cpu", ...; default: jax's default backend (already initialised at trace time).
    """
    if path == "xla":
        return logging.DEBUG
    if path == "fused":
        return logging.WARNING
    if backend is None:
        backend = default_platform()
    return logging.WARNING if backend == "cuda" else logging.INFO


# --- GPUs on this machine -----------------------------------------------------------------------


def cuda_gpus_present() -> bool:
    """Whether this process can see NVIDIA GPUs, without initialising a JAX backend (cheap enough
    for import time): a /dev/nvidia<N> device file, unless CUDA_VISIBLE_DEVICES hides every GPU or
    JAX_PLATFORMS leaves CUDA out."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").lower().split(",") if p.strip()]
    if platforms and not {"cuda", "gpu"} & set(platforms):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


# What to do when the compiled extension is missing on a machine with CUDA GPUs.
EXTENSION_FIX = ("Install entwine_jax where nvcc (CUDA >= 12.3) is on PATH so that its CUDA extension builds "
                 "(pip install -v . shows the build's progress).")
