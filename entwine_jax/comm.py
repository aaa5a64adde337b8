"""The communicators of the fused ops: one per mesh axis (group of W devices), shared by every op.

Knows no op. An op asks, at trace time, ``unavailable(...)`` (a predicate that only answers) and then
``acquire_comm(mesh, axis, flags_per_source, regions)`` once per call site: the one place that
creates, grows and connects communicators, with room for what the call needs (``Capacity``: flag
words per source rank, and bytes of each heap region the call uses, named as its op registered it
in C++). The communicator's id goes into the call's static plan; the FFI
handlers find it by that id. ``deferred_growth()`` collects the needs of many call sites instead, so
that ``entwine_jax.reserve`` grows each communicator once. Diagnostics (``check_errors``,
``device_epochs``, ``handler_cost``, ``last_call_ms``, ``heap_usage``) read the communicators without
changing them.

Setup is transactional and agreed across processes: a creation or growth that fails on any process
of the communicator (a peer that never comes within ENTWINE_SETUP_TIMEOUT_MS, a CUDA error) is undone
on every one of them (_agree), the communicator stays as it was, and a later call site tries again.
Only the job's own processes (same uid, the exchange's token) are sent the heap's file descriptors
(heap_exchange.py).

Mesh discovery: inside ``jit`` jax exposes only the abstract mesh, so the device assignment comes
from the enclosing ``jax.set_mesh(mesh)`` or, failing that, from ``entwine_jax.setup(mesh, axis)``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import os
import socket
import sys
import threading
import time
import zlib
from typing import Any, Mapping, Optional

import jax
import numpy as np

from entwine_jax import _distributed, _extension, heap_exchange

_DEFAULT_HEAP_MAX_BYTES = 4 << 30
# Heaps grow in steps of this many bytes per region (and flag words per source) so that a sequence of
# growing shapes reallocates (and synchronises every rank) a few times, not once per shape.
_REGION_GRANULE = 2 << 20
_FLAGS_GRANULE = 64
# Cross-process setup (the exchange of heap chunks): generous, since a peer may still be compiling.
_DEFAULT_SETUP_TIMEOUT_MS = 300_000


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


def setup_timeout_ms() -> int:
    """ENTWINE_SETUP_TIMEOUT_MS: how long a creation or growth waits for the other processes of a
    communicator before it is undone (default 300000)."""
    value = os.environ.get("ENTWINE_SETUP_TIMEOUT_MS", "")
    try:
        ms = int(value) if value else _DEFAULT_SETUP_TIMEOUT_MS
    except ValueError:
        ms = 0
    if ms <= 0:
        raise ValueError(f"ENTWINE_SETUP_TIMEOUT_MS must be a positive integer (milliseconds), got {value!r}")
    return ms


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


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Room in a communicator's heap: flag words per source rank, and bytes of each payload region,
    named as the ops register them in C++ (comm::RegionSpec, e.g. "gemm_rs.partial"); a region not
    named has none. Canonical (regions by name, none of 0 bytes), so equal rooms compare equal."""

    flags_per_source: int = 0
    regions: tuple[tuple[str, int], ...] = ()  # (name, bytes)

    @staticmethod
    def of(flags_per_source: int, regions: Mapping[str, int]) -> Capacity:
        return Capacity(int(flags_per_source), tuple(sorted((str(n), int(b)) for n, b in regions.items() if b)))

    def bytes(self, region: str) -> int:
        return dict(self.regions).get(region, 0)

    def covers(self, other: Capacity) -> bool:
        return other.flags_per_source <= self.flags_per_source and all(b <= self.bytes(n) for n, b in other.regions)

    def union(self, other: Capacity) -> Capacity:
        names = {n for n, _ in self.regions + other.regions}
        return Capacity.of(max(self.flags_per_source, other.flags_per_source),
                           {n: max(self.bytes(n), other.bytes(n)) for n in names})

    def rounded(self) -> Capacity:
        """Rounded up to the granules: the steps a heap grows in."""
        return Capacity.of(_round_up(self.flags_per_source, _FLAGS_GRANULE),
                           {n: _round_up(b, _REGION_GRANULE) for n, b in self.regions})

    def args(self) -> tuple[int, dict[str, int]]:
        """(flags_per_source, {region: bytes}): how the extension's comm_create, comm_grow,
        comm_shrink and heap_bytes take a capacity."""
        return self.flags_per_source, dict(self.regions)

    def __str__(self) -> str:
        return ",".join([f"flags={self.flags_per_source}"] + [f"{n}={b}" for n, b in self.regions])


@dataclasses.dataclass
class _Comm:
    id: int
    local: list  # (device, rank, its group's row of devices) for the devices of this process
    processes: list  # process indices of the mesh
    heap_max: int  # the heap cap when it was created: its reserved addresses, fixed
    capacity: Capacity = Capacity()
    generation: int = 0  # successful growths: names the exchange of the next one

    @property
    def partners(self) -> list[int]:
        """The other processes driving a rank of one of this process's groups: the ones whose heap
        chunks this process maps, and which map this process's."""
        me = jax.process_index()
        return sorted({int(peer.process_index) for _, _, row in self.local for peer in row} - {me})


_comms: dict[int, _Comm] = {}
# Communicators whose failed setup could not be undone (the undo itself failed): no later call site
# may compile against them. id -> the reason.
_failed: dict[int, str] = {}
_atexit_registered = False
# While deferred_growth() runs on a thread: the needs of the call sites traced meanwhile.
_deferred = threading.local()


def _key(comm: _Comm, capacity: Capacity, what: str) -> str:
    """A key of the exchange that takes `comm` from its generation to `capacity`: processes meet only
    on the same growth, so a process that traced a call site alone never pairs with a different one."""
    return f"entwine/{comm.id & 0xFFFFFFFFFFFFFFFF:016x}/{comm.generation}/{capacity}/{what}"


def _capacity_for(comm: Optional[_Comm], need: Capacity) -> Optional[Capacity]:
    """The capacity a communicator must grow to for a call needing `need`, rounded up to the
    granules; None when it has room already."""
    if comm is not None and comm.capacity.covers(need):
        return None
    old = comm.capacity if comm is not None else Capacity()
    return old.union(need).rounded()


def _heap_cap_reason(ext, comm: Optional[_Comm], world: int, need: Capacity) -> Optional[str]:
    """Why a call's heap cannot be had (ENTWINE_HEAP_MAX_BYTES, and for an existing communicator also
    the cap it was created with, which sized its reserved addresses), or None."""
    new = _capacity_for(comm, need)
    if new is None:
        return None
    need_bytes = int(ext.heap_bytes(world, *new.args()))
    cap = min(heap_max_bytes(), comm.heap_max) if comm is not None else heap_max_bytes()
    if need_bytes > cap:
        return f"symmetric heap of {need_bytes} bytes per device would exceed ENTWINE_HEAP_MAX_BYTES={cap}"
    return None


def _exchange(ext, comm: _Comm, capacity: Capacity, attempt: int) -> None:
    """Makes `capacity` usable by calls on every local rank: the other processes' chunks mapped here
    (their heaps have grown as ours), then the peer tables filled. Raises on a peer that never
    comes within ENTWINE_SETUP_TIMEOUT_MS."""
    deadline = time.monotonic() + setup_timeout_ms() / 1000
    if comm.partners:
        try:
            heap_exchange.share_chunks(ext, comm, lambda p: _key(comm, capacity, f"{attempt}/socket/{p}"), deadline)
        except (TimeoutError, socket.timeout) as e:
            raise TimeoutError(
                f"processes {comm.partners} did not join the growth of the heap to {capacity} within "
                f"ENTWINE_SETUP_TIMEOUT_MS={setup_timeout_ms()} ({e}); every process must trace the same fused call "
                f"sites in the same order (a trace on one process alone, e.g. jax.eval_shape or .lower(), cannot "
                f"grow the heap)") from None
    me = jax.process_index()
    for device, _, row in comm.local:
        peers = [int(p.local_hardware_id) if p.process_index == me else -1 for p in row]
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
    # Ranks driven by one process use each other's heaps directly: they must be able to map them.
    for row in groups:
        mine = [int(d.local_hardware_id) for d in row if d.process_index == me]
        for a in mine:
            for b in mine:
                if a != b and not ext.can_access_peer(a, b):
                    raise Unavailable(f"devices not peer-accessible (local GPUs {a} and {b})")


@contextlib.contextmanager
def deferred_growth():
    """Within it, acquire_comm on this thread only records what each call site needs, per
    communicator, and changes nothing; yields {comm id: (mesh, axis_name, Capacity)}, the largest need
    of each. entwine_jax.reserve grows each to it afterwards."""
    if getattr(_deferred, "needs", None) is not None:
        raise RuntimeError("deferred_growth() does not nest")
    _deferred.needs = {}
    try:
        yield _deferred.needs
    finally:
        _deferred.needs = None


def acquire_comm(mesh, axis_name, flags_per_source: int, regions: Mapping[str, int]) -> int:
    """The communicator of `axis_name` of `mesh` (shared by every op), with room for flags_per_source
    flag words per source rank and `regions` ({region name: bytes}: the heap regions the call's op
    registered, e.g. {"gemm_rs.partial": slot bytes}); returns its id, which the call passes to its
    FFI handler.

    The one place that changes communicators: it creates one (heaps, streams, peer tables), or grows
    it (docs/design.md, "The communicator and symmetric heap"), or finds it big enough and does
    nothing. Called once per call site, at trace time, before any call that needs the room can run;
    every process of the mesh must make the same calls in the same order. Raises Unavailable with the
    reason when the fused path cannot have it (heap cap, devices, a CUDA failure or a peer that never
    came); the communicator is then exactly as before and a later call may try again.
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
        need = Capacity.of(flags_per_source, regions)
        new = _capacity_for(comm, need)
        if new is None:
            return cid
        cap_reason = _heap_cap_reason(ext, comm, world, need)
        if cap_reason:
            raise Unavailable(cap_reason)
        needs = getattr(_deferred, "needs", None)
        if needs is not None:
            _, _, have = needs.get(cid, (mesh, axis_name, Capacity()))
            needs[cid] = (mesh, axis_name, have.union(need))
            return cid
        try:
            if comm is None:
                _create(ext, groups, cid, new)
            else:
                _grow(ext, comm, new)
        except Unavailable:
            raise
        except Exception as e:  # CUDA failures, a peer that never came
            reason = f"communicator setup failed ({type(e).__name__}: {e})"
            if cid in _failed:
                raise Unavailable(_failed[cid]) from e
            raise Unavailable(f"{reason}; the communicator of axis {axis_name!r} is unchanged") from e
        return cid


def reserve(fn, *args, **kwargs) -> dict:
    """Sizes the heap of every communicator that fn's fused calls use, once, for all its call sites:
    traces fn(*args, **kwargs) abstractly (jax.eval_shape; arrays or jax.ShapeDtypeStructs), with each
    call site's growth deferred, then grows each communicator to the largest need of its sites. A
    program traced afterwards finds room and grows nothing. Call it on every process, with the same
    arguments, where fn's mesh is known (under jax.set_mesh, or after entwine_jax.setup).

    Returns {axis name: bytes of device memory one rank's heap maps}. Raises RuntimeError when a
    communicator cannot be grown (above ENTWINE_HEAP_MAX_BYTES, a peer that never came); call sites
    whose own need is above the cap take the XLA path and are not counted."""
    with deferred_growth() as needs:
        jax.eval_shape(fn, *args, **kwargs)
    ext, _ = _extension.registered()
    sized = {}
    for cid, (mesh, axis_name, need) in needs.items():
        try:
            acquire_comm(mesh, axis_name, need.flags_per_source, dict(need.regions))
        except Unavailable as e:
            raise RuntimeError(f"entwine_jax.reserve: the heap of axis {axis_name!r} cannot hold every call site "
                               f"of {getattr(fn, '__name__', fn)!r} at once: {e}") from None
        with _lock:
            comm = _comms[cid]
            sized[axis_name] = int(ext.heap_bytes(len(comm.local[0][2]), *comm.capacity.args()))
    return sized


def _create(ext, groups: np.ndarray, cid: int, capacity: Capacity) -> None:
    _check_devices(ext, groups)
    me = jax.process_index()
    local = [(d, r, row) for row in groups for r, d in enumerate(row) if d.process_index == me]
    processes = sorted({int(d.process_index) for d in groups.ravel()})
    comm = _Comm(cid, local, processes, heap_max_bytes())
    attempt = _attempt(comm, capacity)
    try:
        ext.comm_create(cid, groups.shape[1], [(int(d.local_hardware_id), r) for d, r, _ in local],
                        *capacity.args(), comm.heap_max)
    except BaseException as e:
        _agree(comm, capacity, attempt, e)  # raises: the partners hear of it now, not at their deadline
        raise
    _register_atexit()
    _setup_step(comm, capacity, attempt, lambda: _exchange(ext, comm, capacity, attempt), lambda: ext.comm_destroy(cid))
    comm.capacity = capacity
    comm.generation += 1
    _comms[cid] = comm


def _grow(ext, comm: _Comm, capacity: Capacity) -> None:
    # Calls compiled earlier may run meanwhile: growing only maps memory behind what they use, and
    # they keep the old capacity until the exchange made the new one usable on every rank here.
    attempt = _attempt(comm, capacity)

    def grow_and_exchange():
        ext.comm_grow(comm.id, *capacity.args())
        _exchange(ext, comm, capacity, attempt)

    _setup_step(comm, capacity, attempt, grow_and_exchange, lambda: ext.comm_shrink(comm.id, *comm.capacity.args()))
    comm.capacity = capacity
    comm.generation += 1


class SetupUndone(RuntimeError):
    """A creation or growth that every process of the communicator undid: the message names the
    process that failed (or never reported) and why."""


def _setup_step(comm: _Comm, capacity: Capacity, attempt: int, step, undo) -> None:
    """Runs a setup step, then commits it only where every process of the communicator did its part
    (_agree); else undoes it here, as every process does, and raises SetupUndone with the reason."""
    try:
        step()
        failure = None
    except BaseException as e:
        failure = e
    try:
        _agree(comm, capacity, attempt, failure)
    except BaseException as e:
        _undo(comm.id, undo, e)
        if failure is not None and e is not failure:
            raise e from failure
        raise


_DECIDED = b"commit"


def _attempt(comm: _Comm, capacity: Capacity) -> int:
    """The number of this process's attempt at the setup taking `comm` to `capacity`: the first one
    not decided yet. Processes that try while an attempt is open join it; after a lone attempt that
    was undone (a trace on one process), the next attempt of all of them has a fresh number."""
    if len(comm.processes) < 2:
        return 0
    attempt = 0
    while _distributed.kv_try_get(_key(comm, capacity, f"{attempt}/decision")) is not None:
        attempt += 1
    return attempt


def _agree(comm: _Comm, capacity: Capacity, attempt: int, failure: Optional[BaseException]) -> None:
    """Setup agreed across processes (docs/design.md, "Setup agreed across processes"): returns when
    every process of the communicator did its part of this attempt, else raises SetupUndone, the same
    on every process, naming the first process that failed or never reported. Each process posts its
    vote; the first to know the outcome (all voted ok, or one failed, or one did not vote within
    ENTWINE_SETUP_TIMEOUT_MS) writes the decision once (the key-value store keeps the first write);
    every process then reads that one decision, so no process commits what another undoes."""
    if len(comm.processes) < 2:
        if failure is not None:
            raise failure
        return
    me = jax.process_index()
    vote = "ok" if failure is None else f"{type(failure).__name__}: {failure}"
    _distributed.kv_set(_key(comm, capacity, f"{attempt}/vote/{me}"), vote.encode(), overwrite=True)
    verdict = None if failure is None else f"process {me} failed its part ({vote})"
    deadline = time.monotonic() + setup_timeout_ms() / 1000
    for p in comm.processes:
        if verdict is not None:
            break
        if p == me:
            continue
        try:
            theirs = _distributed.kv_get(_key(comm, capacity, f"{attempt}/vote/{p}"),
                                         max(int((deadline - time.monotonic()) * 1000), 1)).decode()
        except TimeoutError:
            verdict = f"process {p} did not report its part within ENTWINE_SETUP_TIMEOUT_MS={setup_timeout_ms()}"
            break
        if theirs != "ok":
            verdict = f"process {p} failed its part ({theirs})"
    decision_key = _key(comm, capacity, f"{attempt}/decision")
    _distributed.kv_set_once(decision_key, _DECIDED if verdict is None else verdict.encode())
    decision = _distributed.kv_get(decision_key, 60_000)
    if decision != _DECIDED:
        raise SetupUndone(f"every process undid the setup: {decision.decode()}")


def _undo(cid: int, undo, cause: BaseException) -> None:
    """Runs the undo of a failed setup step; if that fails too, no call site may use the
    communicator any more (_failed)."""
    try:
        undo()
    except Exception as e:
        _failed[cid] = (f"communicator setup failed ({type(cause).__name__}: {cause}) and could not be undone "
                        f"({type(e).__name__}: {e}); this process no longer uses it")


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


_NOT_USER_CODE = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, np))


def call_site() -> str:
    """`file:line (function)` of the innermost frame of the user's code (not jax's, NumPy's, this
    package's or the standard library's) tracing the current call: it names the call in its
    signature, so that two calls of the same shape from different lines differ."""
    own = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the package (entwine_jax/), not what holds it
    stdlib = os.path.dirname(os.__file__) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((own, stdlib) + _NOT_USER_CODE) and "/flax/" not in path and "<" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "unknown site"


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
    window) and to the join of the first side stream (a reduce-scatter's consumer, forked there
    under profiling). Needs ENTWINE_PROFILE=1 before the first call (the
    extension then records timing events per call); block on the call's result first."""
    ext, cid = _queried_comm("last_call_ms", mesh, axis_name)
    return [tuple(t) for t in ext.last_call_ms(cid)]


def heap_usage(mesh, axis_name) -> list[tuple[int, int, int, int]]:
    """[(local device, bytes of device memory its heap maps, bytes of the other processes' heaps
    mapped into this process, reserved addresses of its heap)] of the mesh axis's communicator."""
    ext, cid = _queried_comm("heap_usage", mesh, axis_name)
    return [tuple(u) for u in ext.heap_usage(cid)]


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
    return [tuple(t[:3]) for t in ext.handler_cost(cid)]


HOST_PHASES = ("checks", "fork", "launch", "join", "end")


def handler_phases(mesh, axis_name) -> list[tuple[int, int, dict[str, float]]]:
    """[(local device, handler executions, {phase: mean host microseconds per execution})]: where
    handler_cost's time goes. Phases, in a call's order: its checks and plan, the fork of its side
    streams, the launches of its kernels and copies, the join back to XLA's stream, its last kernel."""
    ext, cid = _queried_comm("handler_phases", mesh, axis_name)
    return [(t[0], t[1], dict(zip(HOST_PHASES, t[3]))) for t in ext.handler_cost(cid)]


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


def command_buffer_hazard(xla_flags: Optional[str] = None, compiler_options: Optional[dict] = None) -> Optional[str]:
    """Why XLA's flags (XLA_FLAGS, or `xla_flags`), with `compiler_options` (a jax.jit's, which XLA
    applies over XLA_FLAGS) if given, make the fused path unsafe, or None.

    Every fused call on a communicator shares its device epoch and side streams, so two of them must
    never run at once. XLA's CONCURRENT command-buffer scheduling orders a graph's nodes only by the
    buffers they share: independent fused calls recorded in one graph may then overlap, and their
    kernels trap. Until the calls carry an order of their own, the fused path is refused there (the
    XLA reference runs, with this reason), unless custom calls are kept out of command buffers.

    What is seen (at trace time, where the path is chosen): XLA_FLAGS, and the ``compiler_options`` of
    ``jax.jit(f, compiler_options=...)`` (jit_hazard). Not seen: options given to
    ``jax.jit(f).lower(...).compile(compiler_options=...)``, which come after the trace, and enum values
    given as numbers; there, keep CUSTOM_CALL out of ``xla_gpu_enable_command_buffer`` yourself."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    values = {}
    for item in flags.split():
        name, _, value = item.lstrip("-").partition("=")
        values[name] = value
    values.update({str(k): str(v) for k, v in (compiler_options or {}).items()})
    if values.get("xla_gpu_command_buffer_scheduling_mode", "").upper() != "CONCURRENT":
        return None
    enabled = values.get("xla_gpu_enable_command_buffer")
    # Not given: XLA's default set, which records custom calls.
    if enabled is not None and "CUSTOM_CALL" not in enabled.upper().replace(" ", "").split(","):
        return None
    where = "XLA_FLAGS sets" if not compiler_options else "the compiler_options of jax.jit (over XLA_FLAGS) set"
    return (f"{where} --xla_gpu_command_buffer_scheduling_mode=CONCURRENT with custom calls in command "
            "buffers: XLA may then run two fused calls of one communicator at once, which is not safe; use the "
            "default scheduling mode (LHS), or leave CUSTOM_CALL out of --xla_gpu_enable_command_buffer")


def jit_hazard() -> Optional[str]:
    """command_buffer_hazard() with the compiler_options of the jax.jit being traced, when it has any
    (they differ per jit, so this is asked at every trace, never cached)."""
    options = _distributed.jit_compiler_options()
    return command_buffer_hazard(compiler_options=options) if options else None


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


def heap_reason(ext, mesh, axis_name, world: int, flags_per_source: int, regions: Mapping[str, int]) -> Optional[str]:
    """Why the communicator cannot grow to what the call needs (the heap cap), asked only."""
    groups = device_groups(mesh, axis_name)
    with _lock:
        return _heap_cap_reason(ext, _comms.get(comm_id(groups, axis_name)), world,
                                Capacity.of(flags_per_source, regions))


def cached_reason(key, mesh, compute) -> Optional[str]:
    """compute()'s answer for a call site's `key`, computed once where it is settled; where it is
    None, the compiler options of the jax.jit being traced may still refuse the call (jit_hazard)."""
    with _lock:
        if key in _reason_cache:
            reason = _reason_cache[key]
        else:
            try:
                reason = compute()
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
            # Only settled answers are cached: the mesh or setup() may still come. A settled answer
            # stays true: communicators only grow, and only within the heap cap.
            if reason is None or mesh is not None:
                _reason_cache[key] = reason
    # The enclosing jax.jit's compiler options differ from one trace to the next: asked each time.
    return reason or jit_hazard()


def world_reason(axis_size) -> Optional[str]:
    """Why the kernels cannot serve an axis of this size, or None (None too without the extension)."""
    ext, _ = _extension.module()
    if ext is not None and not 1 <= axis_size <= _extension.max_world():
        return f"axis size {axis_size} outside [1, {_extension.max_world()}]"
    return None

