"""The only place entwine_jax touches ``jax._src``: the concrete mesh set by ``jax.set_mesh``, the
``jax.distributed`` key-value store (the names of the sockets that share heap memory, barriers, the
setup's agreement), and the ``compiler_options`` of the ``jax.jit`` being traced.

Why private: inside ``jit`` the public ``jax.sharding.get_mesh()`` refuses to answer (it raises
"can only be used outside of jax.jit") and ``get_abstract_mesh()`` has no devices; and jax has no
public API for the distributed client's key-value store, nor for the options of the jit being traced.
All three are read here, behind small functions that degrade to "not available" if jax moves them.
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np


def concrete_mesh():
    """The mesh of the enclosing ``jax.set_mesh`` (or ``jax.sharding.use_mesh``), or None."""
    try:
        from jax._src import mesh as mesh_lib

        mesh = mesh_lib.get_concrete_mesh()
    except (ImportError, AttributeError):
        return None
    if mesh is None or getattr(mesh, "empty", True):
        return None
    return mesh


def client():
    """The ``jax.distributed`` client, or None in a single-process run."""
    try:
        from jax._src import distributed

        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None


def kv_set(key: str, value: bytes, overwrite: bool = False) -> None:
    """Sets ``key``; a second set of a key raises unless ``overwrite``."""
    if overwrite:
        client().key_value_set_bytes(key, value, allow_overwrite=True)
    else:
        client().key_value_set_bytes(key, value)


def kv_set_once(key: str, value: bytes) -> bool:
    """Sets ``key`` unless some process set it first; True when this call set it. The coordination
    service applies one insert of a key at a time, so of the processes racing here exactly one wins."""
    try:
        client().key_value_set_bytes(key, value)
        return True
    except Exception as e:  # jax raises its runtime error, with the coordination service's status
        if "ALREADY_EXISTS" in str(e):
            return False
        raise


def kv_try_get(key: str) -> Optional[bytes]:
    """The value of ``key``, or None when no process has set it (does not wait)."""
    try:
        return bytes(client().key_value_try_get_bytes(key))
    except Exception as e:
        if "NOT_FOUND" in str(e):
            return None
        raise


def kv_delete(key: str) -> None:
    client().key_value_delete(key)


def kv_get(key: str, timeout_ms: int) -> bytes:
    """Blocks until another process set ``key``; raises TimeoutError after ``timeout_ms``."""
    try:
        return bytes(client().blocking_key_value_get_bytes(key, timeout_ms))
    except Exception as e:  # jax raises its runtime error, with the coordination service's status
        if "DEADLINE_EXCEEDED" in str(e):
            raise TimeoutError(str(e)) from None
        raise


def barrier(name: str, process_ids, my_process: int, timeout_ms: int) -> None:
    """Waits until every process in ``process_ids`` reached ``name`` (each name used once).

    Built on the key-value store rather than ``wait_at_barrier`` so that it can involve only the
    processes of one mesh, not every process of the job.
    """
    kv_set(f"{name}/{my_process}", b"1")
    for p in sorted(set(int(i) for i in np.ravel(process_ids))):
        kv_get(f"{name}/{p}", timeout_ms)


def jit_compiler_options() -> dict:
    """The ``compiler_options`` of the ``jax.jit(f, compiler_options=...)`` calls tracing the current
    call, merged outermost first; {} when there are none or jax keeps them elsewhere.

    jax holds them in its ``PjitInfo`` (``compiler_options_kvs``), a local of its tracing frames,
    and has no API for them; read from the stack here. Options given later, to
    ``.lower(...).compile(compiler_options=...)``, do not exist yet at trace time and are not seen.
    """
    found = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_infer_params":
            kvs = getattr(frame.f_locals.get("ji"), "compiler_options_kvs", None)
            if isinstance(kvs, tuple):
                found.append(dict(kvs))
        frame = frame.f_back
    merged = {}
    for options in reversed(found):
        merged.update(options)
    return merged
