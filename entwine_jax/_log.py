# The package logger ("entwine_jax") and a once-per-key helper: gemm_rs runs at trace time, so
# the same call site is traced many times and must not repeat its messages.
import logging
import threading

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


def reset_once() -> None:
    """Forget every key (tests use this to observe first-call messages again)."""
    with _lock:
        _seen.clear()
