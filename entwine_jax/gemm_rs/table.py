# The tuned-config table gemm_rs consults at trace time, between a user override and its heuristic:
# the user cache written by tune(), then the shipped tuned_configs.json. Reading and writing only; the
# timing loop that fills it is entwine_jax/tuning/tune.py.
"""Tuned GemmRsConfigs: the lookup ``gemm_rs`` makes at trace time, and the cache ``tune()`` writes.

Selection order of a gemm_rs call (docs/design.md, "The budget and configuration"):

1. ``config=`` or ``set_default_config``          -> source "override"
2. the user cache (``ENTWINE_TUNE_CACHE``, default ``~/.cache/entwine_jax/tuned.json``)
                                                  -> source "tuned (user cache)"
3. the shipped ``entwine_jax/gemm_rs/tuned_configs.json`` -> source "tuned (shipped)"
4. ``heuristic_config``                           -> source "heuristic"

Entries are keyed by (device_kind, world, m, n, k_local, dtype): ``device_kind`` is
``jax.devices()[0].device_kind`` (e.g. "NVIDIA H200"), ``m`` the rows of x as gemm_rs sees them
(``prod(x.shape[:-1])``, before the scatter), ``k_local = x.shape[-1]``, ``n = w.shape[1]``,
``world`` the size of the scatter axis and ``dtype`` the dtype name ("bfloat16", "float16").
Every entry was measured with the scatter over rows (scatter_dimension 0, as tune() times it): a
scatter over N (column partitions) is not looked up and takes heuristic_config until measured.

Device classes: an entry may also carry ``device_class`` (``"hopper-<SMs>sm"``: compute capability
9.0 with that many SMs, e.g. "hopper-132sm" for H100 SXM and H200). A GPU with no entry under its
own ``device_kind`` (in either file) uses an entry of its class: same kernels, same SM split
(``config.producer_sms_beside``), same NVLink generation. Exact matches always win; such a
match is reported as e.g. "tuned (shipped) via hopper-132sm".

Files are JSON: ``{"format": 1, ..., "entries": [{device_kind, device_class?, world, m, n, k_local,
dtype, config: {GemmRsConfig fields}, ms, provenance}, ...]}``. An unreadable file or entry is
skipped with a warning (logged once); it never breaks gemm_rs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import tempfile
import threading
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp

from entwine_jax import _log
from entwine_jax.gemm_rs import plan as kernel_plan
from entwine_jax.gemm_rs.config import GemmRsConfig, heuristic_config

FORMAT = 1
SHIPPED_PATH = pathlib.Path(__file__).with_name("tuned_configs.json")
DEFAULT_CACHE_PATH = pathlib.Path("~/.cache/entwine_jax/tuned.json")

SOURCE_OVERRIDE = "override"
SOURCE_USER = "tuned (user cache)"
SOURCE_SHIPPED = "tuned (shipped)"
SOURCE_HEURISTIC = "heuristic"

DTYPE_NAMES = ("bfloat16", "float16")
_KEY_FIELDS = ("device_kind", "world", "m", "n", "k_local", "dtype")


def cache_path() -> pathlib.Path:
    """The user cache: $ENTWINE_TUNE_CACHE, else ~/.cache/entwine_jax/tuned.json."""
    return pathlib.Path(os.environ.get("ENTWINE_TUNE_CACHE") or DEFAULT_CACHE_PATH).expanduser()


def device_class(device) -> Optional[str]:
    """"hopper-<SMs>sm" for a compute capability 9.0 GPU, else None (no class fallback)."""
    cc = str(getattr(device, "compute_capability", ""))
    cores = getattr(device, "core_count", None)
    if getattr(device, "platform", None) == "gpu" and cc == "9.0" and cores:
        return f"hopper-{int(cores)}sm"
    return None


def current_device() -> tuple[str, Optional[str]]:
    """(device_kind, device_class) of jax.devices()[0], the GPU gemm_rs's lookup is keyed by."""
    device = jax.devices()[0]
    return str(device.device_kind), device_class(device)


# --- Reading tables -------------------------------------------------------------------------------


def _key(entry: dict) -> tuple:
    return tuple(entry[f] for f in _KEY_FIELDS)


def _parse_entry(entry: Any) -> tuple[tuple, Optional[str], GemmRsConfig]:
    """(key, device_class, config) of one entry; ValueError naming what is wrong."""
    if not isinstance(entry, dict):
        raise ValueError(f"entry must be an object, got {type(entry).__name__}")
    missing = [f for f in _KEY_FIELDS + ("config",) if f not in entry]
    if missing:
        raise ValueError(f"entry lacks {missing}")
    if not isinstance(entry["device_kind"], str):
        raise ValueError(f"device_kind must be a string, got {entry['device_kind']!r}")
    for f in ("world", "m", "n", "k_local"):
        if isinstance(entry[f], bool) or not isinstance(entry[f], int) or entry[f] < 1:
            raise ValueError(f"{f} must be an int >= 1, got {entry[f]!r}")
    if entry["dtype"] not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {entry['dtype']!r}")
    cls = entry.get("device_class")
    if cls is not None and not isinstance(cls, str):
        raise ValueError(f"device_class must be a string or absent, got {cls!r}")
    if not isinstance(entry["config"], dict):
        raise ValueError(f"config must be an object of GemmRsConfig fields, got {entry['config']!r}")
    try:
        config = GemmRsConfig(**entry["config"])
    except TypeError as e:  # unknown field names
        raise ValueError(f"config {entry['config']!r}: {e}") from None
    # A config the kernels cannot run is never picked (checked where the extension can tell).
    rule = kernel_plan.config_rule(config)
    if rule is not None:
        raise ValueError(f"config {config} cannot run on the fused kernels: {rule}")
    return _key(entry), cls, config


@dataclasses.dataclass
class _Table:
    exact: dict  # key -> config
    by_class: dict  # (device_class,) + key[1:] -> (config, device_kind)


_tables: dict[str, tuple[tuple, _Table]] = {}
_tables_lock = threading.Lock()


def _read_document(path: pathlib.Path) -> dict:
    """The parsed file; ValueError when it is not a table of this format."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), list):
        raise ValueError(f"expected an object with \"format\": {FORMAT} and an \"entries\" list")
    return doc


def _load(path: pathlib.Path) -> Optional[_Table]:
    """The table in `path` (None if absent), re-read only when the file changes."""
    try:
        st = path.stat()
    except OSError:
        return None
    # A new inode (os.replace) or size or mtime: tune() in this process is seen by the next trace.
    signature = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _tables_lock:
        cached = _tables.get(str(path))
        if cached is not None and cached[0] == signature:
            return cached[1]
    table = _Table({}, {})
    try:
        entries = _read_document(path)["entries"]
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        _log.log_once(("tuned-file", str(path), signature), logging.WARNING,
                      "tuned configs %s ignored: %s", path, e)
        entries = []
    for i, entry in enumerate(entries):
        try:
            key, cls, config = _parse_entry(entry)
        except ValueError as e:
            _log.log_once(("tuned-entry", str(path), signature, i), logging.WARNING,
                          "tuned configs %s: entry %d ignored: %s", path, i, e)
            continue
        table.exact[key] = config
        if cls is not None:
            # First entry of a class wins: a file lists one GPU's measurements per class.
            table.by_class.setdefault((cls,) + key[1:], (config, key[0]))
    with _tables_lock:
        _tables[str(path)] = (signature, table)
    return table


def lookup(m: int, n: int, k: int, world: int, dtype, *, device_kind: Optional[str] = None,
           device_cls: Optional[str] = None) -> Optional[tuple[GemmRsConfig, str]]:
    """(config, source) of the tuned entry for this call, or None.

    device_kind/device_cls default to current_device(). Order: user cache then shipped file by
    exact device_kind, then user cache then shipped file by device class.
    """
    if device_kind is None:
        device_kind, device_cls = current_device()
    name = jnp.dtype(dtype).name
    key = (device_kind, int(world), int(m), int(n), int(k), name)
    tables = [(_load(cache_path()), SOURCE_USER), (_load(SHIPPED_PATH), SOURCE_SHIPPED)]
    for table, source in tables:
        if table is not None and key in table.exact:
            return table.exact[key], source
    if device_cls is not None:
        for table, source in tables:
            hit = table.by_class.get((device_cls,) + key[1:]) if table is not None else None
            if hit is not None:
                return hit[0], f"{source} via {device_cls}"
    return None


def select_config(m: int, n: int, k: int, world: int, dtype, *, rows: bool = True) -> tuple[GemmRsConfig, str]:
    """(config, source) for a call without an override: tuned table, else heuristic_config.

    rows: the call scatters rows of the [rows, N] view of the product (any output dim but N; a middle
    dim after a permutation of x's rows): the same kernels as scatter_dimension 0, the only calls tuned.
    """
    try:
        hit = lookup(m, n, k, world, dtype) if rows else None
    except Exception as e:  # a broken table must never take gemm_rs down
        _log.log_once(("tuned-lookup", type(e).__name__, str(e)), logging.WARNING,
                      "tuned config lookup failed (%s: %s); using heuristic_config", type(e).__name__, e)
        hit = None
    if hit is not None:
        return hit
    return heuristic_config(m, n, k, world, dtype, scatter_cols=not rows), SOURCE_HEURISTIC


# --- Writing the user cache -----------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    """Exclusive lock on `path`.lock so that concurrent tune() runs merge instead of losing entries."""
    try:
        import fcntl
    except ImportError:  # not POSIX: atomic replace alone (a concurrent writer's entries may be lost)
        yield
        return
    with open(str(path) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_cache(entries: Iterable[dict], path=None) -> pathlib.Path:
    """Merge `entries` into the cache file (same key: replaced) with an atomic write; returns the path.

    Entries already in the file under other keys are kept as they are. An unreadable file is
    replaced (warning). The new file is written next to the old one and renamed over it, so a
    reader (or a crash) never sees a half-written table.
    """
    path = pathlib.Path(path).expanduser() if path is not None else cache_path()
    new = list(entries)
    for entry in new:
        _parse_entry(entry)  # never write what the lookup would refuse
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path):
        merged: dict = {}
        if path.exists():
            try:
                for entry in _read_document(path)["entries"]:
                    if isinstance(entry, dict) and all(f in entry for f in _KEY_FIELDS):
                        merged[repr(_key(entry))] = entry
            except (OSError, ValueError) as e:
                _log.logger.warning("tuned config cache %s was unreadable (%s); writing a new one", path, e)
        for entry in new:
            merged[repr(_key(entry))] = entry
        doc = {"format": FORMAT,
               "about": "entwine_jax user cache of tuned GemmRsConfigs, written by entwine_jax.tune(); "
                        "see entwine_jax/gemm_rs/table.py for the key and the selection order",
               "entries": sorted(merged.values(), key=lambda e: tuple(str(v) for v in _key(e)))}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path
