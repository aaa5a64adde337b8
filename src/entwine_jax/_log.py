# The package logger ("entwine_jax"), a once-per-key helper (gemm_rs runs at trace time, so the
# same call site is traced many times and must not repeat its messages), the level of a fallback
# message, and the check for a source checkout imported in place of the installed package.
import glob
import importlib.util
import logging
import os
import pathlib
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


# --- Imported from a source checkout --------------------------------------------------------------


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


def _extension_importable() -> bool:
    """Whether entwine_jax._entwine can be found (not loaded): beside the package, or through an
    editable install's import hook."""
    try:
        return importlib.util.find_spec("entwine_jax._entwine") is not None
    except (ImportError, ValueError):
        return False


def source_tree_warning(package_dir=None, *, extension: Optional[bool] = None,
                        gpus: Optional[bool] = None) -> Optional[str]:
    """The warning for an entwine_jax imported from a source checkout (pyproject.toml and ffi/ beside
    the package) without its compiled extension on a machine with CUDA GPUs; None otherwise.

    That happens when a command runs from the repository root: Python puts the current directory
    first on sys.path, so ./entwine_jax shadows the installed package and its extension. Every
    gemm_rs call then takes the XLA path, and bench/tune would time XLA.
    package_dir, extension, gpus: default to this package's directory, _extension_importable() and
    cuda_gpus_present() (tests pass them).
    """
    package = pathlib.Path(package_dir if package_dir is not None else __file__).resolve()
    package = package if package.is_dir() else package.parent
    root = package.parent
    if not ((root / "pyproject.toml").is_file() and (root / "ffi").is_dir()):
        return None
    if extension is None:
        extension = _extension_importable()
    if extension:
        return None
    if gpus is None:
        gpus = cuda_gpus_present()
    if not gpus:
        return None
    return (f"entwine_jax was imported from the source tree ({package / '__init__.py'}), which has no compiled "
            f"extension, on a machine with CUDA GPUs: every gemm_rs call takes the XLA reference path, and "
            f"`python -m entwine_jax bench` / `tune` would time XLA, not the fused kernels. Python imports "
            f"./entwine_jax before the installed package when run from the repository root ({root}). Fix: run from "
            f"another directory (e.g. cd /tmp), or install in development mode from the repository root "
            f"(pip install -e ., which builds the extension with nvcc).")


def extension_fix() -> str:
    """What to do when the compiled extension is missing on a machine with CUDA GPUs: the source-tree
    fix when that is the cause, else how to build it."""
    return source_tree_warning(gpus=True) or (
        "Install entwine_jax where nvcc (CUDA >= 12.3) is on PATH so that its CUDA extension builds "
        "(pip install -v . shows the build's progress).")


def warn_if_source_tree() -> Optional[str]:
    """Log source_tree_warning() once, at WARNING, if there is one; returns it (None: nothing to say)."""
    message = source_tree_warning()
    if message is not None:
        log_once("source-tree", logging.WARNING, "%s", message)
    return message
