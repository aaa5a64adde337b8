"""The exchange of heap chunks between processes (entwine_jax.comm._share_chunks), on CPU: two real
processes joined by jax.distributed, real Unix sockets and file descriptors, and a fake extension
whose chunks are memfd files that name their owner. Covers the creation, a growth, a peer that
comes too late (the attempt is undone, the retry works) and the descriptors left open afterwards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Abstract Unix sockets and memfd files are Linux's, as the exchange is.
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_share_their_chunks_and_retry_after_a_late_peer():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {rank}:\n{out}"
        result = json.loads(out.strip().splitlines()[-1])
        other = 1 - rank
        # The late peer: process 0's first attempt timed out and was undone (the comm destroyed).
        if rank == 0:
            assert "did not join the growth" in result["first_attempt"] and "is unchanged" in result["first_attempt"]
            assert result["calls"][:3] == ["comm_create", "comm_export", "comm_destroy"]
        # Then both created (one chunk each) and grew (two chunks): each imported the other's.
        assert result["imported"] == [[other, f"p{other}-o0"], [other, f"p{other}-o0"], [other, f"p{other}-o2097152"]]
        assert result["calls"][-4:] == ["comm_grow", "comm_export", "comm_import", "comm_connect"]
        assert result["connect"] == [[0, -1], [-1, 0]][rank]
        assert result["open_fds_after"] == result["open_fds_before"]


def test_many_chunks_cross_in_several_messages():
    # More descriptors than one message carries, over two devices, and a device with none.
    from entwine_jax import comm

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    table = []
    for device, count in ((3, 150), (5, 0), (7, 2)):
        chunks = []
        for i in range(count):
            fd = os.memfd_create("chunk")
            os.write(fd, f"d{device}-c{i}".encode())
            chunks.append((i << 21, 2 << 20, fd))
        table.append((device, chunks))
    with a, b:
        comm._send_chunks(a, table)
        received = comm._receive_chunks(b, time.monotonic() + 10)
    try:
        assert sorted(received) == [3, 5, 7] and received[5] == []
        for device, chunks in table:
            got = received[device]
            assert [(o, n) for o, n, _ in got] == [(o, n) for o, n, _ in chunks]
            assert [os.pread(fd, 16, 0).decode() for _, _, fd in got] == [f"d{device}-c{i}" for i in range(len(chunks))]
    finally:
        comm._close_received(received)
        for _, chunks in table:
            for _, _, fd in chunks:
                os.close(fd)


# --- One process --------------------------------------------------------------------------------------


class _ChunkExt:
    """A fake extension whose heap chunks are memfd files holding their owner's name and offset."""

    def __init__(self, me):
        self.me, self.calls, self.imported, self.connected = me, [], [], None
        self.chunks = []

    def _record(self, name):
        self.calls.append(name)

    def comm_create(self, *args):
        self._record("comm_create")
        self.chunks = [0]

    def comm_destroy(self, cid):
        self._record("comm_destroy")

    def comm_grow(self, *args):
        self._record("comm_grow")
        self.chunks.append(2 << 20)

    def comm_shrink(self, *args):
        self._record("comm_shrink")

    def comm_export(self, cid, device):
        self._record("comm_export")
        out = []
        for offset in self.chunks:
            fd = os.memfd_create("chunk")
            os.write(fd, f"p{self.me}-o{offset}".encode())
            out.append((offset, 2 << 20, fd))
        return out

    def comm_import(self, cid, device, rank, chunks):
        self._record("comm_import")
        for offset, _, fd in chunks:
            self.imported.append([rank, os.pread(fd, 64, 0).decode()])

    def comm_connect(self, cid, device, peers):
        self._record("comm_connect")
        self.connected = peers

    def heap_bytes(self, world, slot, tiles, inbox=0):
        return 2 * slot

    def can_access_peer(self, a, b):
        return True


def _process_main(rank: int, port: int) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=rank)
    jax.devices()  # the backend's start waits for every process: before the late process sleeps
    from entwine_jax import _extension, comm

    ext = _ChunkExt(rank)
    _extension.registered = lambda: (ext, None)
    from test_fused_cpu import FakeDevice, FakeMesh  # this file's directory leads sys.path: run as a script

    mesh = FakeMesh([FakeDevice(0, 0, 0), FakeDevice(1, 1, 0)], ("tp",))
    open_before = len(os.listdir("/proc/self/fd"))
    result = {}
    if rank == 0:
        os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = "1000"
        try:
            comm.acquire_comm(mesh, "tp", 1 << 20, 1)
        except comm.Unavailable as e:
            result["first_attempt"] = str(e)
        os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = "60000"
        ext.imported.clear()
    else:
        time.sleep(3)  # arrives after process 0's first attempt gave up
    comm.acquire_comm(mesh, "tp", 1 << 20, 1)
    comm.acquire_comm(mesh, "tp", 3 << 20, 1)  # a growth: a second chunk
    result.update(calls=ext.calls, imported=ext.imported, connect=ext.connected,
                  open_fds_before=open_before, open_fds_after=len(os.listdir("/proc/self/fd")))
    print(json.dumps(result), flush=True)
    # Neither process may leave while the other still reads the key-value store.
    from entwine_jax import _distributed

    _distributed.barrier("test/done", [0, 1], rank, 60_000)
    comm._comms.clear()


if __name__ == "__main__":
    _process_main(int(sys.argv[1]), int(sys.argv[2]))
