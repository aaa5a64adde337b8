"""The only place entwine_jax touches ``jax._src``: the concrete mesh set by ``jax.set_mesh`` and
the ``jax.distributed`` key-value store (the names of the sockets that share heap memory, barriers).

Why private: inside ``jit`` the public ``jax.sharding.get_mesh()`` refuses to answer (it raises
"can only be used outside of jax.jit") and ``get_abstract_mesh()`` has no devices; and jax has no
public API for the distributed client's key-value store. Both are read here, behind small
functions that degrade to "not available" if jax moves them.
"""

from __future__ import annotations

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
