"""The exchange of heap chunks between the processes of a communicator (comm.py's growth step):
CUDA's POSIX file descriptors of each rank's chunks cross over Unix sockets (SCM_RIGHTS) whose names
the job's key-value store publishes, and only the job's own processes are served: the same uid
(SO_PEERCRED) presenting the exchange's fresh token (docs/design.md, "Who may join")."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import time
from typing import Callable, Optional

import jax

from entwine_jax import _distributed

# A partner slower than this to join a growth is reported (in the log) while the wait goes on.
_SLOW_PEER_MS = 10_000
# File descriptors per socket message (the kernel takes at most 253).
_FDS_PER_MESSAGE = 64
# A partner says who it is as soon as it connects; a connection silent for this long is not a partner,
# and it would hold up the partners queued behind it.
_HELLO_TIMEOUT_S = 5.0


def _abstract_name(name: str) -> str:
    return "\0" + name  # Linux's abstract socket namespace: no file, gone with the socket


def _send_chunks(conn: socket.socket, table: list) -> None:
    """Sends [(device id, [(offset, bytes, fd)])] over a SOCK_SEQPACKET connection: messages of at
    most _FDS_PER_MESSAGE descriptors (SCM_RIGHTS), each with a JSON header, then an empty end."""
    for device_id, chunks in table:
        for i in range(0, max(len(chunks), 1), _FDS_PER_MESSAGE):
            part = chunks[i:i + _FDS_PER_MESSAGE]
            header = json.dumps({"device": device_id, "chunks": [[o, b] for o, b, _ in part]}).encode()
            socket.send_fds(conn, [header], [fd for _, _, fd in part])
    conn.sendall(b"{}")


def _receive_chunks(conn: socket.socket, deadline: float) -> dict[int, list]:
    """{device id: [(offset, bytes, fd)]} as _send_chunks sent it; the caller closes the fds."""
    received: dict[int, list] = {}
    try:
        while True:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            data, fds, flags, _ = socket.recv_fds(conn, 1 << 16, _FDS_PER_MESSAGE)
            chunks_fds = list(fds)
            try:
                if not data:
                    raise RuntimeError("a peer closed the exchange of heap chunks early")
                header = json.loads(data)
                if flags & socket.MSG_CTRUNC or len(header.get("chunks", [])) != len(chunks_fds):
                    raise RuntimeError("a peer's message of heap chunks arrived truncated")
            except BaseException:
                for fd in chunks_fds:
                    os.close(fd)
                raise
            if not header:
                return received
            received.setdefault(int(header["device"]), []).extend(
                (int(o), int(b), fd) for (o, b), fd in zip(header["chunks"], chunks_fds))
    except BaseException:
        _close_received(received)
        raise


def _close_received(received: dict) -> None:
    for chunks in received.values():
        for _, _, fd in chunks:
            os.close(fd)


def _peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel saw it connect."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _admit(conn: socket.socket, token: str, partners: list, served: set, deadline: float) -> Optional[int]:
    """The partner process at the other end of a connection to this process's exchange socket, or
    None after refusing it: only a process of this user (SO_PEERCRED) that presents this exchange's
    token, which only the job's key-value store holds, is sent file descriptors of the heap
    (docs/design.md, "Who may join"). A refusal is logged, and the exchange goes on waiting."""
    pid, uid = _peer_credentials(conn)
    reason = None
    if uid != os.getuid():
        reason = f"it runs as uid {uid}, not {os.getuid()}"
    else:
        try:
            conn.settimeout(max(min(deadline - time.monotonic(), _HELLO_TIMEOUT_S), 0.001))
            hello = json.loads(conn.recv(4096) or b"null")
            process, given = int(hello["process"]), str(hello["token"])
        except (OSError, ValueError, TypeError, KeyError):
            hello = None
            reason = "it did not say which process of the job it is"
        if hello is not None:
            if not hmac.compare_digest(given.encode(), token.encode()):
                reason = "it did not present the exchange's token"
            elif process not in partners or process in served:
                reason = f"process {process} is not a partner still to be served ({partners}, served {sorted(served)})"
    if reason is None:
        return process
    logging.getLogger("entwine_jax").warning(
        "entwine_jax: refused a connection to the heap exchange from pid %d: %s", pid, reason)
    return None


def _connect_to_peer(name_key: str, me: int, deadline: float) -> socket.socket:
    """A connection, introduced as process `me`, to the socket a peer process published under
    name_key. A name can be stale (an earlier attempt of the peer that gave up): it is read again
    until the peer's live socket answers or the deadline passes."""
    said = False
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            raise TimeoutError(f"no live socket under {name_key} before the deadline")
        try:
            # First a short wait, so that a long one is said while it lasts (a lone trace waits).
            record = json.loads(_distributed.kv_get(name_key, left_ms if said else min(left_ms, _SLOW_PEER_MS)))
        except TimeoutError:
            if said or left_ms <= _SLOW_PEER_MS:
                raise
            said = True
            logging.getLogger("entwine_jax").warning(
                "entwine_jax: waiting up to %.0f s more for another process to join the growth of a fused op's heap "
                "(%s); every process must trace the same fused call sites", left_ms / 1000 - _SLOW_PEER_MS / 1000,
                name_key)
            continue
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.connect(_abstract_name(record["name"]))
        except (ConnectionRefusedError, FileNotFoundError):
            conn.close()
            time.sleep(0.05)
            continue
        except BaseException:
            conn.close()
            raise
        try:
            # A stale name taken over by another user's process: not the partner.
            _, uid = _peer_credentials(conn)
            if uid != os.getuid():
                raise PermissionError(f"the socket published under {name_key} belongs to uid {uid}, not {os.getuid()}")
            conn.send(json.dumps({"process": me, "token": record["token"]}).encode())
            return conn
        except BaseException:
            conn.close()
            raise


def share_chunks(ext, comm, socket_key: Callable[[int], str], deadline: float) -> None:
    """Maps into this process the heap chunks of every rank of the other processes of `comm`'s groups
    (comm.py's _Comm: its id, generation, local ranks and partners), and hands them ours: CUDA's POSIX
    file descriptors, which are per process, cross over a Unix socket (SCM_RIGHTS) whose name process
    p publishes in the key-value store under socket_key(p). The order cannot deadlock: every
    process listens before it publishes, connects to all its partners (the kernel queues a connection
    until it is accepted), serves every partner that connects, and only then reads what it was sent.
    The socket only lives during this exchange, and serves only the partners (_admit): the token it
    publishes beside its name is fresh each exchange."""
    me = jax.process_index()
    partners = comm.partners
    name = f"entwine-{comm.id & 0xFFFFFFFFFFFFFFFF:016x}-{comm.generation}-{me}-{os.getpid()}-{time.monotonic_ns()}"
    my_key = socket_key(me)
    token = secrets.token_hex(32)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    clients: dict[int, socket.socket] = {}
    exported: list = []
    received: dict[int, list] = {}
    try:
        server.bind(_abstract_name(name))
        server.listen(len(partners) + 4)  # room beside the partners for connections it refuses
        for device, _, _ in comm.local:
            exported.append((int(device.id), [tuple(c) for c in ext.comm_export(comm.id, device.local_hardware_id)]))
        _distributed.kv_set(my_key, json.dumps({"name": name, "token": token}).encode(), overwrite=True)
        for p in partners:
            clients[p] = _connect_to_peer(socket_key(p), me, deadline)
        served: set[int] = set()
        while len(served) < len(partners):
            server.settimeout(max(deadline - time.monotonic(), 0.001))
            conn, _ = server.accept()
            with conn:
                process = _admit(conn, token, partners, served, deadline)
                if process is None:
                    continue
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                _send_chunks(conn, exported)
                served.add(process)
        for p, conn in clients.items():
            for device_id, chunks in _receive_chunks(conn, deadline).items():
                received.setdefault(device_id, []).extend(chunks)
        for device, _, row in comm.local:
            for rank, peer in enumerate(row):
                if peer.process_index != me:
                    chunks = received.get(int(peer.id))
                    if not chunks:
                        raise RuntimeError(f"process {peer.process_index} sent no heap chunks of device {peer.id}")
                    ext.comm_import(comm.id, device.local_hardware_id, rank, [(o, b, fd) for o, b, fd in chunks])
    except BaseException:
        with contextlib.suppress(Exception):
            _distributed.kv_delete(my_key)  # a peer reading it meanwhile finds it stale and reads again
        raise
    finally:
        server.close()
        for conn in clients.values():
            conn.close()
        for _, chunks in exported:
            for _, _, fd in chunks:
                os.close(fd)
        _close_received(received)
