"""The exchange of heap chunks between processes (entwine_jax.heap_exchange), on CPU: two real
processes joined by jax.distributed, real Unix sockets and file descriptors, and a fake extension
whose chunks are memfd files that name their owner. Covers the creation, a growth, a peer that
comes too late (the attempt is undone, the retry works), the descriptors left open afterwards, a
process outside the job that connects (refused; the job's setup goes on), and a partner that fails
in the middle of a growth or never reports (every process undoes it: setup agreed across processes)."""

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
# The one heap region the fake extension's chunks stand for.
REGION = "gemm_rs.partial"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_job(scenario: str, intruder: bool = False) -> list[dict]:
    """Runs `scenario` in two processes of one jax.distributed job (and, with `intruder`, a third
    process outside it); returns each job process's result (its last output line, JSON), then the
    intruder's."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    args = [[scenario, str(rank), str(port)] for rank in (0, 1)] + ([["intruder"]] if intruder else [])
    procs = [subprocess.Popen([sys.executable, __file__, *a], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for a in args]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    results = []
    for who, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {who}:\n{out}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_two_processes_share_their_chunks_and_retry_after_a_late_peer():
    for rank, result in enumerate(_run_job("late_peer")):
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


def test_a_process_outside_the_job_is_refused_and_the_setup_goes_on():
    # A process of the same user but outside the job connects to every exchange socket it sees (they
    # are listed in /proc/net/unix), once saying nothing and once with a guessed token: it gets no
    # file descriptor, and the two processes of the job still create and grow their communicator.
    *job, intruder = _run_job("intruded", intruder=True)
    assert intruder["attacked"] >= 1, intruder
    assert intruder["fds_received"] == 0 and intruder["bytes_received"] == 0, intruder
    for rank, result in enumerate(job):
        other = 1 - rank
        assert result["imported"] == [[other, f"p{other}-o0"], [other, f"p{other}-o0"], [other, f"p{other}-o2097152"]]
        assert result["generation"] == 2
    # Process 0 listened while process 1 was late: the intruder's connections reached it, and were refused.
    assert any("did not present the exchange's token" in r for r in job[0]["refused"]), job[0]["refused"]
    assert any("did not say which process" in r for r in job[0]["refused"]), job[0]["refused"]


def test_a_partner_failing_in_the_exchange_undoes_the_growth_on_every_process():
    # A growth that process 1 fails after both exchanged their chunks (process 0 imported, connected
    # and would have committed alone), then one where process 1 never reports within process 0's
    # ENTWINE_SETUP_TIMEOUT_MS: both times both processes undo it, with one reason naming process 1,
    # and keep the capacity they agreed on; the retry commits on both.
    results = _run_job("partner_fails")
    for rank, result in enumerate(results):
        failed, late = result["failed_growth"], result["late_growth"]
        assert "process 1 failed its part (RuntimeError: injected: cuMemMap of rank 0's chunk" in failed, failed
        assert "is unchanged" in failed
        assert "process 1 did not report its part within ENTWINE_SETUP_TIMEOUT_MS=1500" in late, late
        assert result["capacity_after_undo"] == result["capacity_before"]
        assert result["generation"] == 2 and result["capacity"] != result["capacity_before"]
    # The same capacity and generation everywhere; process 0 shrank back what it had connected.
    assert results[0]["capacity"] == results[1]["capacity"]
    assert results[0]["calls"][-14:] == ["comm_grow", "comm_export", "comm_import", "comm_connect", "comm_shrink"] * 2 + [
        "comm_grow", "comm_export", "comm_import", "comm_connect"]


def test_the_exchange_admits_only_the_jobs_partners(monkeypatch):
    from entwine_jax import heap_exchange

    def admit(hello, partners=(1, 2), served=()):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with a, b:
            if hello is not None:
                b.send(json.dumps(hello).encode())
            return heap_exchange._admit(a, "s3cret", list(partners), set(served), time.monotonic() + 0.2)

    assert admit({"process": 2, "token": "s3cret"}) == 2
    assert admit({"process": 2, "token": "guess"}) is None
    assert admit(None) is None  # silent: refused after the hello timeout, here the deadline
    assert admit({"process": 3, "token": "s3cret"}) is None  # not a partner
    assert admit({"process": 2, "token": "s3cret"}, served=(2,)) is None  # served already
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)  # another user's process
    assert admit({"process": 2, "token": "s3cret"}) is None


def test_many_chunks_cross_in_several_messages():
    # More descriptors than one message carries, over two devices, and a device with none.
    from entwine_jax import heap_exchange

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
        heap_exchange._send_chunks(a, table)
        received = heap_exchange._receive_chunks(b, time.monotonic() + 10)
    try:
        assert sorted(received) == [3, 5, 7] and received[5] == []
        for device, chunks in table:
            got = received[device]
            assert [(o, n) for o, n, _ in got] == [(o, n) for o, n, _ in chunks]
            assert [os.pread(fd, 16, 0).decode() for _, _, fd in got] == [f"d{device}-c{i}" for i in range(len(chunks))]
    finally:
        heap_exchange._close_received(received)
        for _, chunks in table:
            for _, _, fd in chunks:
                os.close(fd)


# --- One process --------------------------------------------------------------------------------------


class _ChunkExt:
    """A fake extension whose heap chunks are memfd files holding their owner's name and offset."""

    def __init__(self, me):
        self.me, self.calls, self.imported, self.connected = me, [], [], None
        self.chunks = []
        self.on_import = []  # what the next comm_import calls do first (a failure injected by a test)

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

    def comm_shrink(self, cid, flags_per_source, regions):
        self._record("comm_shrink")
        self.chunks = [o for o in self.chunks if o < regions[REGION]]

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
        if self.on_import:
            self.on_import.pop(0)()
        for offset, _, fd in chunks:
            self.imported.append([rank, os.pread(fd, 64, 0).decode()])

    def comm_connect(self, cid, device, peers):
        self._record("comm_connect")
        self.connected = peers

    def heap_bytes(self, world, flags_per_source, regions):
        return 2 * regions.get(REGION, 0)

    def can_access_peer(self, a, b):
        return True


def _join(rank: int, port: int):
    """Joins the job as `rank`; returns (comm module, fake extension, 2-rank mesh, fd count now)."""
    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=rank)
    jax.devices()  # the backend's start waits for every process: before the late process sleeps
    from entwine_jax import _extension, comm

    ext = _ChunkExt(rank)
    _extension.registered = lambda: (ext, None)
    from test_fused_cpu import FakeDevice, FakeMesh  # this file's directory leads sys.path: run as a script

    mesh = FakeMesh([FakeDevice(0, 0, 0), FakeDevice(1, 1, 0)], ("tp",))
    return comm, ext, mesh, len(os.listdir("/proc/self/fd"))


def _leave(rank: int, comm, result: dict) -> None:
    print(json.dumps(result), flush=True)
    # Neither process may leave while the other still reads the key-value store.
    from entwine_jax import _distributed

    _distributed.barrier("test/done", [0, 1], rank, 60_000)
    comm._comms.clear()


def _late_peer(rank: int, port: int) -> None:
    comm, ext, mesh, open_before = _join(rank, port)
    result = {}
    if rank == 0:
        os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = "1000"
        try:
            comm.acquire_comm(mesh, "tp", 1, {REGION: 1 << 20})
        except comm.Unavailable as e:
            result["first_attempt"] = str(e)
        os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = "60000"
        ext.imported.clear()
    else:
        time.sleep(3)  # arrives after process 0's first attempt gave up
    comm.acquire_comm(mesh, "tp", 1, {REGION: 1 << 20})
    comm.acquire_comm(mesh, "tp", 1, {REGION: 3 << 20})  # a growth: a second chunk
    result.update(calls=ext.calls, imported=ext.imported, connect=ext.connected,
                  open_fds_before=open_before, open_fds_after=len(os.listdir("/proc/self/fd")))
    _leave(rank, comm, result)


def _intruded(rank: int, port: int) -> None:
    import logging

    comm, ext, mesh, _ = _join(rank, port)
    from entwine_jax import heap_exchange

    heap_exchange._HELLO_TIMEOUT_S = 1.0  # the silent intruder holds process 0 up this long
    refused = []
    handler = logging.Handler()
    handler.emit = lambda record: refused.append(record.getMessage())
    logging.getLogger("entwine_jax").addHandler(handler)
    os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = "60000"
    if rank == 1:
        time.sleep(4)  # process 0 listens meanwhile, and the intruder finds its socket
    cid = comm.acquire_comm(mesh, "tp", 1, {REGION: 1 << 20})
    comm.acquire_comm(mesh, "tp", 1, {REGION: 3 << 20})
    _leave(rank, comm, dict(imported=ext.imported, generation=comm._comms[cid].generation,
                            refused=[m for m in refused if "refused" in m]))


def _partner_fails(rank: int, port: int) -> None:
    comm, ext, mesh, _ = _join(rank, port)
    os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = "60000"
    cid = comm.acquire_comm(mesh, "tp", 1, {REGION: 1 << 20})
    result = dict(capacity_before=str(comm._comms[cid].capacity))

    def fail():
        raise RuntimeError("injected: cuMemMap of rank 0's chunk failed")

    if rank == 1:
        ext.on_import = [fail]  # after it served process 0 and received its chunks: the middle of the exchange
    try:
        comm.acquire_comm(mesh, "tp", 1, {REGION: 3 << 20})
    except comm.Unavailable as e:
        result["failed_growth"] = str(e)
    result["capacity_after_undo"] = str(comm._comms[cid].capacity)
    if rank == 0:
        os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = "1500"
    else:
        ext.on_import = [lambda: time.sleep(4)]  # its part done only after process 0 stopped waiting
    try:
        comm.acquire_comm(mesh, "tp", 1, {REGION: 3 << 20})
    except comm.Unavailable as e:
        result["late_growth"] = str(e)
    os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = "60000"
    comm.acquire_comm(mesh, "tp", 1, {REGION: 3 << 20})
    result.update(calls=ext.calls, capacity=str(comm._comms[cid].capacity), generation=comm._comms[cid].generation)
    _leave(rank, comm, result)


def _intruder() -> None:
    """A process of this user outside the job: connects to every exchange socket that appears (silent
    once, once with a guessed token) and counts what it is sent."""
    attacked, fds_received, bytes_received, seen = 0, 0, 0, set()
    end = time.monotonic() + 12
    while time.monotonic() < end:
        with open("/proc/net/unix") as f:
            names = {line.split()[-1][1:] for line in f if line.split()[-1].startswith("@entwine-")}
        for name in sorted(names - seen):
            seen.add(name)
            conns = []
            try:
                for hello in (None, {"process": 1, "token": "00" * 32}):
                    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    c.connect("\0" + name)
                    if hello is not None:
                        c.send(json.dumps(hello).encode())
                    conns.append(c)
            except OSError:
                pass
            attacked += bool(conns)
            for c in conns:
                c.settimeout(15)
                try:
                    while True:
                        data, fds, _, _ = socket.recv_fds(c, 1 << 16, 64)
                        fds_received += len(fds)
                        bytes_received += len(data)
                        for fd in fds:
                            os.close(fd)
                        if not data:
                            break
                except OSError:
                    pass
                c.close()
        time.sleep(0.02)
    print(json.dumps(dict(attacked=attacked, fds_received=fds_received, bytes_received=bytes_received)), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "intruder":
        _intruder()
    else:
        {"late_peer": _late_peer, "intruded": _intruded, "partner_fails": _partner_fails}[sys.argv[1]](
            int(sys.argv[2]), int(sys.argv[3]))
