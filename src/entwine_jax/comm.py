"""The communicators of the fused ops: one per mesh axis (group of W devices), shared by every op.

Knows no op. An op asks, at trace time, ``unavailable(...)`` (a predicate that only answers) and then
``acquire_comm(mesh, axis, need)`` once per call site: the one place that creates, grows and
connects communicators, with room for what the call needs (``Capacity``: partial-slot bytes, flag
words per source, inbox bytes). The communicator's id goes into the call's static plan; the FFI
handlers find it by that id. Diagnostics (``check_errors``, ``device_epochs``, ``handler_cost``,
``last_call_ms``) read the communicators without changing them.

Mesh discovery: inside ``jit`` jax exposes only the abstract mesh, so the device assignment comes
from the enclosing ``jax.set_mesh(mesh)`` or, failing that, from ``entwine_jax.setup(mesh, axis)``.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import os
import threading
import zlib
from typing import Any, Optional

import jax
import numpy as np

from entwine_jax import _distributed, _extension

_DEFAULT_HEAP_MAX_BYTES = 4 << 30
# Heaps grow in steps of this many bytes per slot (and flag words per source) so that a sequence of
# growing shapes reallocates (and synchronises every rank) a few times, not once per shape.
_SLOT_GRANULE = 2 << 20
_TILES_GRANULE = 64
# Cross-process setup (IPC handle exchange, barriers): generous, compilation may run meanwhile.
_KV_TIMEOUT_MS = 300_000


class Unavailable(Exception):
    """The fused path cannot run this call; the message is the reason shown to the user."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def heap_max_bytes() -> int:
    """ENTWINE_HEAP_MAX_BYTES: per-device heap cap; above it the XLA path is used (default 4 GiB)."""
    value = os.environ.get("ENTWINE_HEAP_MAX_BYTES", "")
    try:
        return int(value) if value else _DEFAULT_HEAP_MAX_BYTES
    except ValueError:
        raise ValueError(f"ENTWINE_HEAP_MAX_BYTES must be an integer byte count, got {value!r}")


def axis_tuple(axis_name) -> tuple[str, ...]:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def device_groups(mesh, axis_name) -> np.ndarray:
    """[groups, W] array of devices: each row shares all other mesh coordinates; column = rank."""
    axes = axis_tuple(axis_name)
    names = tuple(mesh.axis_names)
    missing = [a for a in axes if a not in names]
    if missing:
        raise ValueError(f"axis {missing[0]!r} is not in the mesh axes {names}")
    along = [names.index(a) for a in axes]
    others = [i for i in range(len(names)) if i not in along]
    devices = np.transpose(np.asarray(mesh.devices), others + along)
    world = int(np.prod([devices.shape[len(others) + i] for i in range(len(along))]))
    return devices.reshape(-1, world)


def comm_id(groups: np.ndarray, axis_name) -> int:
    """Stable int64 id of a mesh axis' groups, the same in every process (no Python hash())."""
    ids = np.vectorize(lambda d: int(d.id), otypes=[np.int64])(groups)
    key = f"{axis_tuple(axis_name)}|{ids.shape}|{ids.ravel().tolist()}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)


# --- Mesh discovery -------------- ---------------------------------------------------------------

_lock = threading.RLock()
_setup_meshes: dict[tuple, Any] = {}

def setup(mesh, axis_name) -> None:
    """Tells the fused path which devices a mesh axis runs on.

    Needed only when ``gemm_rs`` is traced outside ``jax.set_mesh(mesh)`` (inside ``jit`` jax
    exposes only the abstract mesh). Meshes are matched by axis names and sizes; a later setup of
    a mesh with the same names and sizes replaces the earlier one.
    """
    device_groups(mesh, axis_name)  # validates the axis
    _setup_meshes[(tuple(mesh.axis_names), tuple(mesh.devices.shape))] = mesh


def find_mesh(axis_name):
    """The concrete mesh holding axis_name for the current trace, or None."""
    axes = axis_tuple(axis_name)
    abstract = jax.sharding.get_abstract_mesh()
    signature = None
    if not abstract.empty:
        signature = (tuple(abstract.axis_names), tuple(abstract.axis_sizes))
    candidates = []
    mesh = _distributed.concrete_mesh()
    if mesh is not None:
        candidates.append(mesh)
    candidates += list(_setup_meshes.values())[::-1]  # latest setup first
    for mesh in candidates:
        names = tuple(mesh.axis_names)
        if not all(a in names for a in axes):
            continue
        if signature is None or signature == (names, tuple(mesh.devices.shape)):
            return mesh
    return None


def mesh_for(axis_name):
    """The concrete mesh of the current trace; Unavailable (how to provide one) when there is none."""
    mesh = find_mesh(axis_name)
    if mesh is None:
        raise Unavailable(f"no concrete mesh for axis {axis_name!r}: call entwine_jax.setup(mesh, "
                          f"{axis_name!r}) first, or trace under jax.set_mesh(mesh)")
    return mesh


# --- Communicators: one lifecycle, acquire_comm ---------------------------------------------------


@dataclasses.dataclass
class _Comm:
    id: int
    local: list  # (device, rank, its group's row of devices) for the devices of this process
    processes: list  # process indices of the mesh
    slot_bytes: int = 0
    max_tiles: int = 0
    inbox_bytes: int = 0
    generation: int = 0  # bumped per growth: keys of the key-value store are written once

    @property
    def multiprocess(self) -> bool:
        return len(self.processes) > 1


_comms: dict[int, _Comm] = {}
# Communicators whose creation or growth failed part way (a peer never published its heap, cudaMalloc
# failed): their entry is not connected, so no call may be compiled against them. id -> the reason.
_failed: dict[int, str] = {}
_atexit_registered = False


def _key(comm: _Comm, what: str) -> str:
    return f"entwine/{comm.id & 0xFFFFFFFFFFFFFFFF:016x}/{comm.generation}/{what}"


def _capacity_for(comm: Optional[_Comm], slot_bytes: int, max_tiles: int,
                  inbox_bytes: int) -> Optional[tuple[int, int, int]]:
    """The (partial slot bytes, flags per source, inbox bytes) a communicator must grow to for a
    call needing that much, rounded up to the granules; None when it has room already."""
    old = (comm.slot_bytes, comm.max_tiles, comm.inbox_bytes) if comm else (0, 0, 0)
    if comm is not None and slot_bytes <= old[0] and max_tiles <= old[1] and inbox_bytes <= old[2]:
        return None
    return (_round_up(max(old[0], slot_bytes), _SLOT_GRANULE), _round_up(max(old[1], max_tiles), _TILES_GRANULE),
            _round_up(max(old[2], inbox_bytes), _SLOT_GRANULE))


def _heap_cap_reason(ext, comm: Optional[_Comm], world: int, slot_bytes: int, max_tiles: int,
                     inbox_bytes: int) -> Optional[str]:
    """Why a call's heap cannot be had (ENTWINE_HEAP_MAX_BYTES), or None."""
    new = _capacity_for(comm, slot_bytes, max_tiles, inbox_bytes)
    if new is None:
        return None
    need = int(ext.heap_bytes(world, *new))
    if need > heap_max_bytes():
        return f"symmetric heap of {need} bytes per device would exceed ENTWINE_HEAP_MAX_BYTES={heap_max_bytes()}"
    return None


def _connect(ext, comm: _Comm) -> None:
    """Fills every local peer table: local ordinals for ranks of this process, IPC handles else."""
    me = jax.process_index()
    if comm.multiprocess:
        for device, _, _ in comm.local:
            handle = ext.heap_ipc_handle(comm.id, device.local_hardware_id)
            _distributed.kv_set(_key(comm, f"heap/{device.id}"), handle)
    for device, _, row in comm.local:
        peers = []
        for peer in row:
            if peer.process_index == me:
                peers.append(int(peer.local_hardware_id))
            else:
                peers.append(_distributed.kv_get(_key(comm, f"heap/{peer.id}"), _KV_TIMEOUT_MS))
        ext.comm_connect(comm.id, device.local_hardware_id, peers)


def _check_devices(ext, groups: np.ndarray) -> None:
    """Raises Unavailable when this process's devices of the mesh cannot run the kernels (asks only)."""
    me = jax.process_index()
    local = [d for d in groups.ravel() if d.process_index == me]
    if not local:
        raise Unavailable("this process drives no device of the mesh")
    for d in local:
        if d.platform != "gpu":
            raise Unavailable(f"not running on CUDA GPUs (device {d.id} is {d.platform!r})")
        cc = str(getattr(d, "compute_capability", ""))
        if cc != "9.0":
            raise Unavailable(f"needs a Hopper GPU (compute capability 9.0), device {d.id} has {cc!r}")
    # Ranks driven by one process use raw peer pointers: they must be able to map each other.
    for row in groups:
        mine = [int(d.local_hardware_id) for d in row if d.process_index == me]
        for a in mine:
            for b in mine:
                if a != b and not ext.can_access_peer(a, b):
                    raise Unavailable(f"devices not peer-accessible (local GPUs {a} and {b})")


def acquire_comm(mesh, axis_name, slot_bytes: int, max_tiles: int, inbox_bytes: int = 0) -> int:
    """The communicator of `axis_name` of `mesh` (shared by gemm_rs and ag_gemm), with room for one
    partial slot of slot_bytes (gemm_rs), max_tiles flag words per source rank, and an inbox of
    inbox_bytes (ag_gemm); returns its id, which the call passes to its FFI handler.

    The one place that changes communicators: it creates one (heaps, streams, peer tables), or grows
    it (the sequence of docs/design.md, "The communicator and symmetric heap"), or finds it big
    enough and does nothing. Called once per call site, at trace time, before any call that needs
    the room can run. Raises Unavailable with the reason when the fused path cannot have it (heap
    cap, devices, a CUDA or key-value store failure during setup).
    """
    ext, reason = _extension.registered()
    if reason:
        raise Unavailable(reason)
    groups = device_groups(mesh, axis_name)
    world = groups.shape[1]
    cid = comm_id(groups, axis_name)
    with _lock:
        if cid in _failed:
            raise Unavailable(_failed[cid])
        comm = _comms.get(cid)
        new = _capacity_for(comm, slot_bytes, max_tiles, inbox_bytes)
        if new is None:
            return cid
        cap_reason = _heap_cap_reason(ext, comm, world, slot_bytes, max_tiles, inbox_bytes)
        if cap_reason:
            raise Unavailable(cap_reason)
        try:
            if comm is None:
                _check_devices(ext, groups)
                me = jax.process_index()
                local = [(d, r, row) for row in groups for r, d in enumerate(row) if d.process_index == me]
                processes = sorted({int(d.process_index) for d in groups.ravel()})
                comm = _Comm(cid, local, processes)
                ext.comm_create(cid, world, [(int(d.local_hardware_id), r) for d, r, _ in local], *new)
                _register_atexit()
                _comms[cid] = comm
                comm.slot_bytes, comm.max_tiles, comm.inbox_bytes = new
                _connect(ext, comm)
            else:
                _grow(ext, comm, new)
        except Unavailable:
            raise
        except Exception as e:  # CUDA or key-value store failures during setup
            reason = f"communicator setup failed ({type(e).__name__}: {e})"
            if cid in _comms:
                # Created or grown but not connected: no later call site may compile against it.
                _failed[cid] = f"{reason}; this process no longer uses the communicator of axis {axis_name!r}"
            raise Unavailable(reason) from e
        return cid


def _grow(ext, comm: _Comm, new: tuple[int, int, int]) -> None:
    # Dispatch is asynchronous: a program launched earlier may not have reached the handler yet and
    # would run on a freed heap. Wait for everything live, then for our side streams.
    jax.block_until_ready(jax.live_arrays())
    ext.comm_synchronize(comm.id)
    me = jax.process_index()
    if comm.multiprocess:
        # No peer may still run a call on our heap, and (CUDA) no peer may still have it open
        # through IPC when we free it.
        _distributed.barrier(_key(comm, "idle"), comm.processes, me, _KV_TIMEOUT_MS)
    ext.comm_disconnect(comm.id)
    if comm.multiprocess:
        _distributed.barrier(_key(comm, "closed"), comm.processes, me, _KV_TIMEOUT_MS)
    ext.comm_grow(comm.id, *new)
    comm.slot_bytes, comm.max_tiles, comm.inbox_bytes = new
    comm.generation += 1
    _connect(ext, comm)


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        _atexit_registered = True
        # atexit hooks run before the interpreter tears down the jax.distributed client, so the
        # key-value store is still up for the barrier in shutdown().
        atexit.register(shutdown)


def shutdown() -> None:
    """Frees every communicator. Runs at exit; in multi-process runs it first waits (bounded) for
    the other processes, whose producers may still write flags into this process's heaps."""
    ext, _ = _extension.registered()
    with _lock:
        if ext is None or not _comms:
            return
        processes = sorted({p for c in _comms.values() for p in c.processes})
        try:
            for c in _comms.values():
                ext.comm_synchronize(c.id)
            if len(processes) > 1 and _distributed.client() is not None:
                _distributed.barrier("entwine/shutdown", processes, jax.process_index(), 60_000)
        except Exception:  # a crashed peer must not keep this process from exiting
            pass
        ext.shutdown()
        _comms.clear()


def check_errors() -> None:
    """Raises RuntimeError if a consumer recorded a device error (a peer that never arrived).

    Reads host-mapped memory without synchronising: block on the results first
    (``jax.block_until_ready``) to see the errors of the calls made so far. Inside an XLA command
    buffer the waiting kernel traps instead of returning, so XLA raises a launch failure first; this
    still works afterwards (it makes no CUDA call) and says which peer never arrived.
    """
    ext, _ = _extension.registered()
    if ext is None:
        return
    with _lock:
        for comm in _comms.values():
            message = ext.error_message(comm.id)
            if message:
                raise RuntimeError(message)


_SIGNATURE_BITS = 24  # the low bits of every flag word (CallEpoch::signature, comm/protocol.h)


@functools.cache
def call_signature(description: str) -> int:
    """The signature of a fused call described by `description` (op, padded shapes, dtype, layout,
    config: the same words on every rank for the same call), named in this process's error messages.
    The kernels stamp it next to the epoch in every flag, so a rank waiting for one call that sees
    another from a peer fails naming both (docs/design.md, "Per-call identity")."""
    signature = zlib.crc32(description.encode()) & ((1 << _SIGNATURE_BITS) - 1)
    ext, _ = _extension.registered()
    if ext is not None and hasattr(ext, "name_call"):
        ext.name_call(signature, description)
    return signature


def attributes_text(attributes: dict) -> str:
    """A config's kernel attributes as `name=value` words, for call descriptions."""
    return " ".join(f"{name}={int(value)}" for name, value in attributes.items())


def _queried_comm(what: str, mesh, axis_name):
    """(extension, communicator id) of the mesh axis for a diagnostic query named `what`; raises
    RuntimeError when there is no extension or no fused call has made the communicator yet."""
    ext, reason = _extension.registered()
    if reason:
        raise RuntimeError(f"entwine {what}: {reason}")
    cid = comm_id(device_groups(mesh, axis_name), axis_name)
    with _lock:
        if cid not in _comms:
            raise RuntimeError(f"entwine {what}: no fused call has run on axis {axis_name!r} of this mesh")
    return ext, cid


def last_call_ms(mesh, axis_name) -> list[tuple[int, float, float]]:
    """[(local device, producer_ms, consumer_ms)] of the last completed fused call on the mesh
    axis: milliseconds from the fork of XLA's stream to the end of the producer GEMM (the GEMM
    window) and to the end of the consumer. Needs ENTWINE_PROFILE=1 before the first call (the
    extension then records timing events per call); block on the call's result first."""
    ext, cid = _queried_comm("last_call_ms", mesh, axis_name)
    return [tuple(t) for t in ext.last_call_ms(cid)]


def device_epochs(mesh, axis_name) -> list[tuple[int, int]]:
    """[(local device, epoch word)] of the mesh axis's communicator: 1 + the number of fused calls
    that ran on the device, whether their handler executed or a CUDA graph replayed them.
    Synchronous (a device-to-host copy): for tests and diagnostics."""
    ext, cid = _queried_comm("device_epochs", mesh, axis_name)
    return [tuple(t) for t in ext.device_epochs(cid)]


def handler_cost(mesh, axis_name) -> list[tuple[int, int, float]]:
    """[(local device, handler executions, mean host microseconds per execution)] of the fused
    calls on the mesh axis: the handlers' own wall time on the host (validation, plan, TMA
    descriptors, launches). Under XLA command buffers a replayed call runs no handler, so
    executions can be fewer than calls."""
    ext, cid = _queried_comm("handler_cost", mesh, axis_name)
    return [tuple(t) for t in ext.handler_cost(cid)]


# --- Availability: predicates that only answer --------------------------------------------------

_reason_cache: dict[tuple, Optional[str]] = {}


def platform_reason(axis_name) -> tuple[Optional[str], Any, Any]:
    """(reason, mesh, ext): None, the concrete mesh (or None) and the extension when the call runs
    on CUDA GPUs with the extension built; else why not."""
    mesh = find_mesh(axis_name)
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if platform != "gpu":
        return f"not running on CUDA GPUs (platform {platform!r})", mesh, None
    if reason := command_buffer_hazard():
        return reason, mesh, None
    ext, reason = _extension.registered()
    return reason, mesh, ext


def command_buffer_hazard(xla_flags: Optional[str] = None) -> Optional[str]:
    """Why XLA's flags (XLA_FLAGS, or `xla_flags`) make the fused path unsafe, or None.

    Every fused call on a communicator shares its device epoch and side streams, so two of them must
    never run at once. XLA's CONCURRENT command-buffer scheduling orders a graph's nodes only by the
    buffers they share: independent fused calls recorded in one graph may then overlap, and their
    kernels trap. Until the calls carry an order of their own, the fused path is refused there (the
    XLA reference runs, with this reason), unless custom calls are kept out of command buffers."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    values = {}
    for item in flags.split():
        name, _, value = item.lstrip("-").partition("=")
        values[name] = value
    if values.get("xla_gpu_command_buffer_scheduling_mode", "").upper() != "CONCURRENT":
        return None
    enabled = values.get("xla_gpu_enable_command_buffer")
    # Not given: XLA's default set, which records custom calls.
    if enabled is not None and "CUSTOM_CALL" not in enabled.upper().split(","):
        return None
    return ("XLA_FLAGS sets --xla_gpu_command_buffer_scheduling_mode=CONCURRENT with custom calls in command "
            "buffers: XLA may then run two fused calls of one communicator at once, which is not safe; use the "
            "default scheduling mode (LHS), or leave CUSTOM_CALL out of --xla_gpu_enable_command_buffer")


def mesh_reason(ext, mesh, axis_name, axis_size) -> Optional[str]:
    """Why the mesh cannot run the kernels (none, another axis size, devices), asked only."""
    if mesh is None:
        return (f"no concrete mesh for axis {axis_name!r}: call entwine_jax.setup(mesh, "
                f"{axis_name!r}) first, or trace under jax.set_mesh(mesh)")
    groups = device_groups(mesh, axis_name)
    if groups.shape[1] != axis_size:
        return f"axis {axis_name!r} has {groups.shape[1]} devices, not {axis_size}"
    if (failed := _failed.get(comm_id(groups, axis_name))) is not None:
        return failed
    if comm_id(groups, axis_name) not in _comms:  # a communicator's devices were checked when it was made
        try:
            _check_devices(ext, groups)
        except Unavailable as e:
            return str(e)
    return None


def heap_reason(ext, mesh, axis_name, world: int, slot_bytes: int, max_tiles: int,
                inbox_bytes: int = 0) -> Optional[str]:
    """Why the communicator cannot grow to what the call needs (the heap cap), asked only."""
    groups = device_groups(mesh, axis_name)
    with _lock:
        return _heap_cap_reason(ext, _comms.get(comm_id(groups, axis_name)), world, slot_bytes, max_tiles,
                                inbox_bytes)


def cached_reason(key, mesh, compute) -> Optional[str]:
    """compute()'s answer for a call site's `key`, computed once where it is settled."""
    with _lock:
        if key in _reason_cache:
            return _reason_cache[key]
        try:
            reason = compute()
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        # Only settled answers are cached: the mesh or setup() may still come. A settled answer
        # stays true: communicators only grow, and only within the heap cap.
        if reason is None or mesh is not None:
            _reason_cache[key] = reason
        return reason


def world_reason(axis_size) -> Optional[str]:
    """Why the kernels cannot serve an axis of this size, or None (None too without the extension)."""
    ext, _ = _extension.module()
    if ext is not None and not 1 <= axis_size <= _extension.max_world():
        return f"axis size {axis_size} outside [1, {_extension.max_world()}]"
    return None

