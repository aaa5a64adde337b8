"""The fused path of both ops: availability, communicators and the calls of the FFI targets.

Per call site, at trace time, an op (ops.py, ag_gemm_op.py):

1. asks ``unavailable_reason(...)`` / ``ag_unavailable_reason(...)``: a predicate that only
   answers (it never creates or grows a communicator);
2. when that is None, ``prepare_gemm_rs(...)`` / ``prepare_ag_gemm(...)``, once: the kernels' plan
   of the call (C++, through ``entwine_jax._plan``) and ``acquire_comm(...)``, the one place that
   creates, grows and connects communicators (one per mesh axis, shared by both ops). The result
   (``GemmRsCall`` / ``AgGemmCall``: plan, comm id, config) is static and goes into the op's plan;
3. inside ``shard_map``, ``call_gemm_rs(x, w, call)`` / ``call_ag_gemm(...)``: pad as the plan
   says, one ``ffi_call``, unpad. No lookup, no communicator work.

``gemm_rs_local`` / ``ag_gemm_local`` do 2 and 3 in one, for callers outside the ops (tests).

Mesh discovery: inside ``jit`` jax exposes only the abstract mesh, so the device assignment comes
from the enclosing ``jax.set_mesh(mesh)`` or, failing that, from ``entwine_jax.setup(mesh, axis)``.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _distributed, _plan
from ._plan import GemmRsPlan

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_DEFAULT_HEAP_MAX_BYTES = 4 << 30
# Heaps grow in steps of this many bytes per slot (and flag words per source) so that a sequence of
# growing shapes reallocates (and synchronises every rank) a few times, not once per shape.
_SLOT_GRANULE = 2 << 20
_TILES_GRANULE = 64
# Cross-process setup (IPC handle exchange, barriers): generous, compilation may run meanwhile.
_KV_TIMEOUT_MS = 300_000


class Unavailable(Exception):
    """The fused path cannot run this call; the message is the reason shown to the user."""


# --- gemm_rs padding, from the plan (tested on CPU) ------------------------------------------------

# The padding of a gemm_rs call is its plan: GemmRsPlan carries the unpadded call (m, k, n, mp,
# n_part) and the padded partition (mp_pad, k_pad, n_pad) the C++ plan chose.
Padding = GemmRsPlan


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padding(m: int, k: int, n: int, world: int, block_n: int, scatter_cols: bool = False) -> Padding:
    """The kernels' padding of x [m, k] @ w [k, n] scattered over `world` ranks (rows, or columns)
    with `block_n`-wide blocks, the only config field it depends on: the plan pads each partition
    to whole blocks and K to the TMA alignment (zeros add nothing to the sum). ValueError when the
    scattered dim does not divide by the world, or the kernels cannot run the call."""
    from entwine_jax.config import GemmRsConfig

    if scatter_cols and n % world:
        raise ValueError(f"gemm_rs: N={n} is not divisible by the axis size {world}")
    if not scatter_cols and m % world:
        raise ValueError(f"gemm_rs: M={m} is not divisible by the axis size {world}")
    try:
        return _plan.gemm_rs_plan(m, n, k, world, GemmRsConfig(block_n=block_n), scatter_cols)
    except _plan.PlanError as e:
        raise ValueError(f"gemm_rs: the kernels cannot run x [{m}, {k}] @ w [{k}, {n}] over {world} ranks: "
                         f"{e.rule}") from None


def pad_operands(x, w, p: Padding, xp=jnp):
    """Rows: x [M, K] -> [W * mp_pad, k_pad] (each partition padded on its own), w -> [k_pad, n_pad].
    Columns: x -> [mp_pad, k_pad], w [K, N] -> [k_pad, W * n_pad] (each partition padded on its own)."""
    if p.scatter_cols:
        if (p.mp, p.k) != (p.mp_pad, p.k_pad):
            x = xp.pad(x, ((0, p.mp_pad - p.mp), (0, p.k_pad - p.k)))
        if (p.k, p.n_part) != (p.k_pad, p.n_pad):
            w = w.reshape(p.k, p.world, p.n_part)
            w = xp.pad(w, ((0, p.k_pad - p.k), (0, 0), (0, p.n_pad - p.n_part)))
            w = w.reshape(p.k_pad, p.world * p.n_pad)
        return x, w
    if (p.mp, p.k) != (p.mp_pad, p.k_pad):
        x = x.reshape(p.world, p.mp, p.k)
        x = xp.pad(x, ((0, 0), (0, p.mp_pad - p.mp), (0, p.k_pad - p.k)))
        x = x.reshape(p.world * p.mp_pad, p.k_pad)
    if (p.k, p.n) != (p.k_pad, p.n_pad):
        w = xp.pad(w, ((0, p.k_pad - p.k), (0, p.n_pad - p.n)))
    return x, w


def unpad(y, p: Padding):
    """The kernel's [mp_pad, n_pad] partition of this rank -> [mp, n_part]."""
    return y[: p.mp, : p.n_part] if (p.mp, p.n_part) != (p.mp_pad, p.n_pad) else y


def heap_max_bytes() -> int:
    """ENTWINE_HEAP_MAX_BYTES: per-device heap cap; above it the XLA path is used (default 4 GiB)."""
    value = os.environ.get("ENTWINE_HEAP_MAX_BYTES", "")
    try:
        return int(value) if value else _DEFAULT_HEAP_MAX_BYTES
    except ValueError:
        raise ValueError(f"ENTWINE_HEAP_MAX_BYTES must be an integer byte count, got {value!r}")


def _axes(axis_name) -> tuple[str, ...]:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def device_groups(mesh, axis_name) -> np.ndarray:
    """[groups, W] array of devices: each row shares all other mesh coordinates; column = rank."""
    axes = _axes(axis_name)
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
    key = f"{_axes(axis_name)}|{ids.shape}|{ids.ravel().tolist()}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)


def config_attributes(config) -> dict:
    """The kernels' GemmRsConfig as named FFI attributes (decoded by name in gemm_rs/handler.cc)."""
    return dict(block_n=np.int64(config.block_n), producer_sms=np.int64(config.producer_sms),
                consumer_grid=np.int64(config.consumer_grid), consumer_block=np.int64(config.consumer_block),
                raster_rows=np.int64(config.raster_rows), split_tail=bool(config.split_tail))


# --- Extension and mesh discovery ---------------------------------------------------------------

_lock = threading.RLock()
_registered = False
_register_reason: Optional[str] = None
_setup_meshes: dict[tuple, Any] = {}


def _extension():
    """(module, None) or (None, reason). Imports the extension and registers its FFI targets once."""
    global _registered, _register_reason
    ext, reason = _plan.extension()
    if ext is None:
        return None, reason
    with _lock:
        if not _registered:
            _registered = True
            try:
                for name, capsule in ext.registrations().items():
                    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            except Exception as e:  # a registration the backend refuses
                _register_reason = f"extension entwine_jax._entwine unavailable ({type(e).__name__}: {e})"
    return (None, _register_reason) if _register_reason else (ext, None)


def setup(mesh, axis_name) -> None:
    """Tells the fused path which devices a mesh axis runs on.

    Needed only when ``gemm_rs`` is traced outside ``jax.set_mesh(mesh)`` (inside ``jit`` jax
    exposes only the abstract mesh). Meshes are matched by axis names and sizes; a later setup of
    a mesh with the same names and sizes replaces the earlier one.
    """
    device_groups(mesh, axis_name)  # validates the axis
    _setup_meshes[(tuple(mesh.axis_names), tuple(mesh.devices.shape))] = mesh


def _find_mesh(axis_name):
    """The concrete mesh holding axis_name for the current trace, or None."""
    axes = _axes(axis_name)
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


def _mesh_for(axis_name):
    """The concrete mesh of the current trace; Unavailable (how to provide one) when there is none."""
    mesh = _find_mesh(axis_name)
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
    ext, reason = _extension()
    if reason:
        raise Unavailable(reason)
    groups = device_groups(mesh, axis_name)
    world = groups.shape[1]
    cid = comm_id(groups, axis_name)
    with _lock:
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
            raise Unavailable(f"communicator setup failed ({type(e).__name__}: {e})") from e
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
    ext, _ = _extension()
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
    ext, _ = _extension()
    if ext is None:
        return
    with _lock:
        for comm in _comms.values():
            message = ext.error_message(comm.id)
            if message:
                raise RuntimeError(message)


def _queried_comm(what: str, mesh, axis_name):
    """(extension, communicator id) of the mesh axis for a diagnostic query named `what`; raises
    RuntimeError when there is no extension or no fused call has made the communicator yet."""
    ext, reason = _extension()
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


def _platform_reason(axis_name) -> tuple[Optional[str], Any, Any]:
    """(reason, mesh, ext): None, the concrete mesh (or None) and the extension when the call runs
    on CUDA GPUs with the extension built; else why not."""
    mesh = _find_mesh(axis_name)
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if platform != "gpu":
        return f"not running on CUDA GPUs (platform {platform!r})", mesh, None
    ext, reason = _extension()
    return reason, mesh, ext


def _mesh_reason(ext, mesh, axis_name, axis_size) -> Optional[str]:
    """Why the mesh cannot run the kernels (none, another axis size, devices), asked only."""
    if mesh is None:
        return (f"no concrete mesh for axis {axis_name!r}: call entwine_jax.setup(mesh, "
                f"{axis_name!r}) first, or trace under jax.set_mesh(mesh)")
    groups = device_groups(mesh, axis_name)
    if groups.shape[1] != axis_size:
        return f"axis {axis_name!r} has {groups.shape[1]} devices, not {axis_size}"
    if comm_id(groups, axis_name) not in _comms:  # a communicator's devices were checked when it was made
        try:
            _check_devices(ext, groups)
        except Unavailable as e:
            return str(e)
    return None


def _heap_reason(ext, mesh, axis_name, world: int, slot_bytes: int, max_tiles: int,
                 inbox_bytes: int = 0) -> Optional[str]:
    groups = device_groups(mesh, axis_name)
    with _lock:
        return _heap_cap_reason(ext, _comms.get(comm_id(groups, axis_name)), world, slot_bytes, max_tiles,
                                inbox_bytes)


def _cached_reason(key, mesh, compute) -> Optional[str]:
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


def _world_reason(axis_size) -> Optional[str]:
    ext, _ = _plan.extension()
    if ext is not None and not 1 <= axis_size <= _plan.max_world():
        return f"axis size {axis_size} outside [1, {_plan.max_world()}]"
    return None


def _reason(x_local_aval, w_aval, axis_name, axis_size, scatter_dimension, config):
    if getattr(config, "path", None) == "xla":
        return "config.path is 'xla'"
    dtype = jnp.dtype(x_local_aval.dtype)
    if dtype not in _DTYPES or jnp.dtype(w_aval.dtype) != dtype:
        return f"fused kernels take bf16 or fp16 operands of one dtype, got {dtype} and {w_aval.dtype}"
    if scatter_dimension not in (0, 1):
        return f"fused kernels scatter over rows (0) or columns (1) of the 2-D product, got {scatter_dimension}"
    if reason := _world_reason(axis_size):
        return reason
    if len(x_local_aval.shape) != 2 or len(w_aval.shape) != 2:
        return f"fused path takes 2-D x and w, got {x_local_aval.shape} and {w_aval.shape}"
    (m, k), (_, n) = x_local_aval.shape, w_aval.shape
    if m == 0 or n == 0 or k == 0:
        return f"empty operands x {x_local_aval.shape}, w {w_aval.shape}"
    if (n if scatter_dimension == 1 else m) % axis_size:
        return f"scattered size not divisible by the axis size {axis_size}"
    plan = None
    if _plan.extension()[0] is not None:
        try:
            plan = _plan.gemm_rs_plan(m, n, k, axis_size, config, scatter_dimension == 1)
        except _plan.PlanError as e:
            return f"the kernels cannot run x {x_local_aval.shape} @ w {w_aval.shape} over {axis_size} ranks: {e.rule}"
    # Without the extension there is no plan, and this is where the reason says so.
    reason, mesh, ext = _platform_reason(axis_name)
    if reason:
        return reason
    if reason := _mesh_reason(ext, mesh, axis_name, axis_size):
        return reason
    return _heap_reason(ext, mesh, axis_name, axis_size, plan.slot_bytes, plan.tiles_per_partition)


def unavailable_reason(x_local_aval, w_aval, *, axis_name, axis_size, scatter_dimension,
                       config) -> Optional[str]:
    """None when the fused kernels can run gemm_rs on x [M, K] (this rank's 2-D view), w [K, N],
    else a short reason. Only answers: no communicator is created or grown here (prepare_gemm_rs
    does that). Never raises for ordinary inputs; cached per call shape."""
    try:
        mesh = _find_mesh(axis_name)
        key = (tuple(x_local_aval.shape), str(x_local_aval.dtype), tuple(w_aval.shape),
               str(w_aval.dtype), _axes(axis_name), axis_size, scatter_dimension,
               repr(config), mesh)
    except Exception as e:
        return f"cannot inspect the call ({type(e).__name__}: {e})"
    return _cached_reason(key, mesh, lambda: _reason(x_local_aval, w_aval, axis_name, axis_size,
                                                     scatter_dimension, config))


# --- gemm_rs: prepare once per call site, call inside shard_map -----------------------------------


@dataclasses.dataclass(frozen=True)
class GemmRsCall:
    """Everything static about one fused gemm_rs call: the kernels' plan (the padding), the
    communicator and the config. Hashable: it lives in the op's static plan."""

    plan: GemmRsPlan
    comm_id: int
    config: Any  # GemmRsConfig
    target: str

    @property
    def scatter_dimension(self) -> int:
        return int(self.plan.scatter_cols)


def prepare_gemm_rs(x_local_aval, w_aval, *, axis_name, axis_size, scatter_dimension, config) -> GemmRsCall:
    """The plan of gemm_rs on x [M, K] (this rank's 2-D view), w [K, N], and its communicator,
    acquired now (acquire_comm): call once per call site at trace time, after unavailable_reason
    said None. Raises Unavailable with the reason when the fused path cannot run it after all."""
    mesh = _mesh_for(axis_name)
    (m, k), (_, n) = x_local_aval.shape, w_aval.shape
    try:
        plan = _plan.gemm_rs_plan(m, n, k, axis_size, config, scatter_dimension == 1)
    except (_plan.PlanError, _plan.NoExtension) as e:
        raise Unavailable(f"the kernels cannot run this call: {e}") from None
    cid = acquire_comm(mesh, axis_name, plan.slot_bytes, plan.tiles_per_partition)
    return GemmRsCall(plan=plan, comm_id=cid, config=config, target=_plan.gemm_rs_target())


def call_gemm_rs(x2d, w, call: GemmRsCall) -> jax.Array:
    """One rank's fused GEMM + ReduceScatter inside shard_map, as prepared: [M, K] @ [K, N] ->
    [M / W, N] (rows) or [M, N / W] (columns). Pads as the plan says, calls, unpads."""
    p = call.plan
    x_pad, w_pad = pad_operands(x2d, w, p)
    # Under jax.vmap the call runs once per batch element (a loop on the device, like lax.scan):
    # each element is its own reduce-scatter, with its own epoch.
    ffi = jax.ffi.ffi_call(call.target, jax.ShapeDtypeStruct((p.mp_pad, p.n_pad), x2d.dtype), vmap_method="sequential")
    y = ffi(x_pad, w_pad, comm_id=np.int64(call.comm_id), scatter_dimension=np.int64(call.scatter_dimension),
            **config_attributes(call.config))
    return unpad(y, p)


def gemm_rs_local(x2d, w, *, axis_name, axis_size, config, scatter_dimension=0) -> jax.Array:
    """prepare_gemm_rs and call_gemm_rs in one, inside shard_map (for callers outside ops.py):
    [M, K] @ [K, N] -> [M / W, N] (scatter_dimension 0) or [M, N / W] (scatter_dimension 1)."""
    try:
        call = prepare_gemm_rs(jax.ShapeDtypeStruct(x2d.shape, x2d.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype),
                               axis_name=axis_name, axis_size=axis_size, scatter_dimension=scatter_dimension,
                               config=config)
    except Unavailable as e:
        raise RuntimeError(f"entwine gemm_rs: {e}") from None
    return call_gemm_rs(x2d, w, call)


# --- ag_gemm ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AgPadding:
    """Kernel shape of one ag_gemm call, as ag_plan pads it: every rank's shard [rows, cols] padded
    to [rows_pad, cols_pad], N to n_pad. gather_k: the shards are slices of the contraction dim, w
    is [world * cols, n]."""

    world: int
    rows: int
    cols: int
    n: int
    rows_pad: int
    cols_pad: int
    n_pad: int
    gather_k: bool


def ag_padding(plan: dict, rows: int, cols: int, n: int, world: int, gather_k: bool) -> AgPadding:
    """The padding of ag_plan's answer `plan` for a shard [rows, cols] and N = n."""
    return AgPadding(world, rows, cols, n, plan["rows_pad"], plan["cols_pad"], plan["n_pad"], gather_k)


def ag_pad_operands(x, w, p: AgPadding, xp=jnp):
    """x [rows, cols] -> [rows_pad, cols_pad]; w [cols, n] -> [cols_pad, n_pad], or with gather_k
    w [world * cols, n] -> [world * cols_pad, n_pad] (each rank's slice padded on its own)."""
    if (p.rows, p.cols) != (p.rows_pad, p.cols_pad):
        x = xp.pad(x, ((0, p.rows_pad - p.rows), (0, p.cols_pad - p.cols)))
    if (p.cols, p.n) != (p.cols_pad, p.n_pad):
        if p.gather_k:
            w = w.reshape(p.world, p.cols, p.n)
            w = xp.pad(w, ((0, 0), (0, p.cols_pad - p.cols), (0, p.n_pad - p.n)))
            w = w.reshape(p.world * p.cols_pad, p.n_pad)
        else:
            w = xp.pad(w, ((0, p.cols_pad - p.cols), (0, p.n_pad - p.n)))
    return x, w


def ag_unpad(y, gathered, p: AgPadding):
    """The kernel's y ([world * rows_pad, n_pad], or [rows_pad, n_pad] with gather_k) and gathered
    operand ([world, rows_pad, cols_pad]) -> y [world * rows, n] (or [rows, n]), gathered [world, rows, cols]."""
    if p.gather_k:
        y = y[: p.rows, : p.n]
    elif (p.rows, p.n) != (p.rows_pad, p.n_pad):
        y = y.reshape(p.world, p.rows_pad, p.n_pad)[:, : p.rows, : p.n].reshape(p.world * p.rows, p.n)
    if gathered is not None and (p.rows, p.cols) != (p.rows_pad, p.cols_pad):
        gathered = gathered[:, : p.rows, : p.cols]
    return y, gathered


def ag_gemm_sms(config) -> int:
    """The GEMM grid the kernels run: config.gemm_sms, or every SM of the GPU but one."""
    from entwine_jax.config import _sm_count

    return config.gemm_sms or _sm_count() - 1


def _ag_plan(rows: int, cols: int, n: int, world: int, gather_k: bool, config) -> dict:
    return _plan.ag_plan(rows, cols, n, world, gather_k, config, ag_gemm_sms(config))


def _ag_reason(x_local_aval, w_aval, axis_name, axis_size, gather_k, config):
    if config.path == "xla":
        return "config.path is 'xla'"
    dtype = jnp.dtype(x_local_aval.dtype)
    if dtype not in _DTYPES or jnp.dtype(w_aval.dtype) != dtype:
        return f"fused kernels take bf16 or fp16 operands of one dtype, got {dtype} and {w_aval.dtype}"
    if reason := _world_reason(axis_size):
        return reason
    (rows, cols), (_, n) = x_local_aval.shape, w_aval.shape
    if rows == 0 or cols == 0 or n == 0:
        return f"empty operands x {x_local_aval.shape}, w {w_aval.shape}"
    reason, mesh, ext = _platform_reason(axis_name)
    if reason:
        return reason
    plan = _ag_plan(rows, cols, n, axis_size, gather_k, config)
    if plan["error"] is not None:
        return f"the kernels cannot run this call: {plan['error']}"
    if reason := _mesh_reason(ext, mesh, axis_name, axis_size):
        return reason
    return _heap_reason(ext, mesh, axis_name, axis_size, 0, plan["chunks"], plan["inbox_bytes"])


def ag_unavailable_reason(x_local_aval, w_aval, *, axis_name, axis_size, gather_k, config) -> Optional[str]:
    """None when the ag_gemm kernels can run this call (x [rows, cols], w [cols or W * cols, n]),
    else a short reason. Only answers, like unavailable_reason (prepare_ag_gemm acquires)."""
    try:
        mesh = _find_mesh(axis_name)
        key = ("ag", tuple(x_local_aval.shape), str(x_local_aval.dtype), tuple(w_aval.shape),
               str(w_aval.dtype), _axes(axis_name), axis_size, gather_k, repr(config), mesh)
    except Exception as e:
        return f"cannot inspect the call ({type(e).__name__}: {e})"
    return _cached_reason(key, mesh, lambda: _ag_reason(x_local_aval, w_aval, axis_name, axis_size, gather_k,
                                                        config))


@dataclasses.dataclass(frozen=True)
class AgGemmCall:
    """Everything static about one fused ag_gemm call: padding, the GEMM grid, the communicator
    and the config. Hashable: it lives in the op's static plan."""

    padding: AgPadding
    gemm_sms: int
    comm_id: int
    config: Any  # AgGemmConfig
    target: str


def prepare_ag_gemm(x_local_aval, w_aval, *, axis_name, axis_size, gather_k, config) -> AgGemmCall:
    """The plan of ag_gemm on this rank's shard x [rows, cols] and w, and its communicator, acquired
    now (acquire_comm): once per call site at trace time, after ag_unavailable_reason said None.
    Raises Unavailable with the reason when the fused path cannot run it after all."""
    mesh = _mesh_for(axis_name)
    (rows, cols), n = x_local_aval.shape, w_aval.shape[1]
    try:
        plan = _ag_plan(rows, cols, n, axis_size, gather_k, config)
    except _plan.NoExtension as e:
        raise Unavailable(str(e)) from None
    if plan["error"] is not None:
        raise Unavailable(f"the kernels cannot run this call: {plan['error']}")
    p = ag_padding(plan, rows, cols, n, axis_size, gather_k)
    cid = acquire_comm(mesh, axis_name, 0, plan["chunks"], inbox_bytes=plan["inbox_bytes"])
    return AgGemmCall(padding=p, gemm_sms=ag_gemm_sms(config), comm_id=cid, config=config,
                      target=_plan.ag_gemm_target())


def call_ag_gemm(x2d, w, call: AgGemmCall, return_gathered: bool):
    """One rank's fused AllGather + GEMM inside shard_map, as prepared: (y, gathered or None)."""
    p = call.padding
    x_pad, w_pad = ag_pad_operands(x2d, w, p)
    y_rows = p.rows_pad if p.gather_k else p.world * p.rows_pad
    gathered_shape = (p.world, p.rows_pad, p.cols_pad) if return_gathered else (0,)
    ffi = jax.ffi.ffi_call(call.target, (jax.ShapeDtypeStruct((y_rows, p.n_pad), x2d.dtype),
                                         jax.ShapeDtypeStruct(gathered_shape, x2d.dtype)),
                           vmap_method="sequential")
    c = call.config
    y, gathered = ffi(x_pad, w_pad, comm_id=np.int64(call.comm_id), gather_k=bool(p.gather_k),
                      block_n=np.int64(c.block_n), gemm_sms=np.int64(call.gemm_sms),
                      raster_rows=np.int64(c.raster_rows), max_chunks=np.int64(c.max_chunks))
    return ag_unpad(y, gathered if return_gathered else None, p)


def ag_gemm_local(x2d, w, *, axis_name, axis_size, config, gather_k, return_gathered):
    """prepare_ag_gemm and call_ag_gemm in one, inside shard_map. x2d [rows, cols] (this rank's
    shard). Rows layout: w [cols, n] -> y [W * rows, n] (shards stacked in rank order). gather_k:
    w [W * cols, n] -> y [rows, n]. The gathered operand, when asked for: [W, rows, cols]."""
    try:
        call = prepare_ag_gemm(jax.ShapeDtypeStruct(x2d.shape, x2d.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype),
                               axis_name=axis_name, axis_size=axis_size, gather_k=gather_k, config=config)
    except Unavailable as e:
        raise RuntimeError(f"entwine ag_gemm: {e}") from None
    return call_ag_gemm(x2d, w, call, return_gathered)
