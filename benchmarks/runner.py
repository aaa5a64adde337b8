# What the ag_gemm and MLP benchmarks (bench_ag_gemm.py, bench_mlp.py) share: the two process models (one
# process driving every local GPU; W processes, one rank each, possibly sharing one GPU), inputs
# made from seeds on every process, results checked per shard against a local reference, programs
# timed in interleaved rounds with the max over processes, and the --processes launcher.
"""The process models of ``python benchmarks/bench.py --op {ag_gemm,mlp}``.

One process (the default): it drives min(--world, local devices) devices, as the gemm_rs bench does.

W processes (``--processes W [--gpus G]``): the launcher starts W copies of the same command on
localhost (``jax.distributed``, rank r on local GPU r mod G, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``),
rank 0 prints the table. Where several processes share one GPU, NCCL cannot run (it refuses two
ranks on one device), so every program with an XLA collective is skipped there and only the fused
op, XLA's GEMMs and the bound are timed (``--fused-only`` asks for the same anywhere). Nothing in
this module runs a device collective of its own: inputs come from seeds on every process, results
are checked shard by shard against a reference computed on the process's own device, and the
timings meet in the jax.distributed key-value store.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import entwine_jax
from entwine_jax import _distributed, _log
from entwine_jax.tuning.timing import max_over_processes, rel_err, time_interleaved

AXIS = "tp"
# How long a process waits for another at a key-value exchange (they may still be compiling).
KV_TIMEOUT_MS = 1_800_000
# Per-compile DebugOptions overrides: they reach the GPU SPMD partitioner without XLA_FLAGS, so the
# windowed column needs no second process (which would have to share GPU memory with this one).
# Each row records whether the loop was really built; if not, starting the whole bench with these
# flags in XLA_FLAGS is harmless to the other columns (shard_map bodies are never windowed).
WINDOWED_OPTIONS = {"xla_gpu_multi_streamed_windowed_einsum": True,
                    "xla_gpu_threshold_for_windowed_einsum_mib": 0}


# --- Launcher (--processes W) ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(argv: list, processes: int, timeout_s: float, program=None) -> int:
    """Runs `python benchmarks/bench.py ARGV --rank r --port P` for r < processes and waits
    (program: the command before ARGV, a list; tests pass their own).

    Rank 0 writes to this process's stdout and stderr (the table, the progress); the other ranks'
    output goes to stderr, each line prefixed with its rank. After timeout_s every rank still
    running is killed (its whole process group, nothing else). Returns 0 iff every rank returned 0,
    else the first non-zero status (1 after a timeout)."""
    port = _free_port()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    procs, pumps = [], []

    def pump(rank, stream):
        for line in stream:
            print(f"[rank {rank}] {line}", end="", file=sys.stderr, flush=True)

    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(processes):
        cmd = [*(program or [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")]), *argv, "--rank", str(rank),
               "--port", str(port)]
        piped = subprocess.PIPE if rank else None
        # Own session: a timeout kills the rank's process group and nothing else.
        proc = subprocess.Popen(cmd, env=env, stdout=piped, stderr=subprocess.STDOUT if rank else None, text=True,
                                start_new_session=True)
        procs.append(proc)
        if rank:
            pumps.append(threading.Thread(target=pump, args=(rank, proc.stdout), daemon=True))
            pumps[-1].start()
    start, timed_out = time.monotonic(), False
    for proc in procs:
        try:
            proc.wait(timeout=max(timeout_s - (time.monotonic() - start), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
    for t in pumps:
        t.join(timeout=5)
    codes = [proc.returncode for proc in procs]
    if timed_out:
        print(f"benchmarks/bench.py: killed the ranks still running after --timeout {timeout_s:g} s "
              f"(exit codes {codes})", file=sys.stderr)
        return 1
    return next((c for c in codes if c), 0)


def init_rank(rank: int, port: int, processes: int, gpus: int) -> None:
    """jax.distributed on localhost, before anything touches a backend: rank `rank` of `processes`,
    on local GPU rank mod gpus (on a machine without CUDA GPUs, the host's devices)."""
    kwargs = {"local_device_ids": [rank % gpus]} if _log.cuda_gpus_present() else {}
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=processes, process_id=rank,
                               **kwargs)


# --- One process's view of the mesh ----------------------------------------------------------------


def mesh_devices(world: int) -> list:
    """The devices of the benchmark's mesh axis in rank order: one process, the first `world` local
    devices; several processes, the first device of each process (rank r = process r)."""
    if jax.process_count() == 1:
        return jax.local_devices()[: max(1, world)]
    return [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
            for p in range(jax.process_count())]


def shares_a_gpu(devices: list) -> bool:
    """Whether two processes of the mesh drive the same physical GPU (same host, same
    CUDA_VISIBLE_DEVICES, same CUDA ordinal). A collective: every process must call it."""
    if jax.process_count() == 1 or devices[0].platform != "gpu":
        return False
    me = jax.process_index()
    mine = next(d for d in devices if d.process_index == me)
    ident = f"{socket.gethostname()}|{os.environ.get('CUDA_VISIBLE_DEVICES', '')}|{mine.local_hardware_id}"
    _distributed.kv_set(f"entwine_bench/gpu/{me}", ident.encode())
    idents = [_distributed.kv_get(f"entwine_bench/gpu/{p}", KV_TIMEOUT_MS) for p in range(jax.process_count())]
    return len(set(idents)) < len(idents)


class Runner:
    """The mesh, how inputs reach it, how programs are compiled, checked and timed; the same code
    in both process models."""

    def __init__(self, world: int, dtype, iters: int, warmup: int, batch: int, fused_only: bool):
        self.devices = mesh_devices(world)
        self.world = len(self.devices)
        self.dtype = jnp.dtype(dtype)
        self.iters, self.warmup, self.batch = iters, warmup, batch
        self.mesh = jax.make_mesh((self.world,), (AXIS,), (jax.sharding.AxisType.Explicit,), devices=self.devices)
        self.me = jax.process_index()
        self.rank0 = self.me == 0
        self.local = [d for d in self.devices if d.process_index == self.me]
        # Where this process makes full inputs and references: its first device of the mesh.
        self.home = self.local[0]
        self._barriers = 0
        self.shared_gpu = shares_a_gpu(self.devices)
        self.fused_only = fused_only or self.shared_gpu
        try:
            entwine_jax.setup(self.mesh, AXIS)  # the fused path finds its devices under jit
        except Exception as e:  # no fused module: the ops say why they use XLA
            if self.rank0:
                print(f"entwine_jax.setup failed ({type(e).__name__}: {e})", file=sys.stderr)

    @property
    def on_gpu(self) -> bool:
        return self.home.platform == "gpu"

    def sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # -- inputs --

    def normal(self, seed: int, shapes: list, scales: list) -> list:
        """Full (unsharded) arrays of normal values times `scales`, in the bench dtype, on this
        process's home device; the same values on every process (a seed, no communication)."""
        keys = jax.random.split(jax.random.key(seed), len(shapes))

        def make(keys):
            return [(jax.random.normal(k, s, jnp.float32) * c).astype(self.dtype)
                    for k, s, c in zip(keys, shapes, scales)]

        return jax.jit(make, out_shardings=jax.sharding.SingleDeviceSharding(self.home))(keys)

    def place(self, full, spec):
        """The global array of `full` (on the home device) sharded by `spec` over the mesh."""
        if jax.process_count() == 1:
            return jax.device_put(full, self.sharding(spec))
        # device_put to devices of other processes would first compare the values across processes
        # (a device collective); each process places its own shards instead.
        return jax.make_array_from_callback(full.shape, self.sharding(spec), lambda index: full[index])

    def tile(self, block, spec):
        """A global array whose every device block is a copy of `block` (dim 0 repeated W times,
        sharded over it): per-device inputs of a program that must not communicate."""
        shape = (self.world * block.shape[0],) + tuple(block.shape[1:])
        sharding = self.sharding(spec)
        devices = sharding.addressable_devices_indices_map(shape)
        return jax.make_array_from_single_device_arrays(shape, sharding, [jax.device_put(block, d) for d in devices])

    # -- programs --

    def shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def compile(self, fn, *args, options=None):
        """(lowered, compiled) of jit(fn) on args under the mesh; options: per-compile XLA
        DebugOptions (the windowed-einsum flags)."""
        with jax.set_mesh(self.mesh):
            lowered = jax.jit(fn).lower(*args)
            return lowered, lowered.compile(compiler_options=options)

    def warm_up(self, seconds: float = 1.0) -> None:
        """Back-to-back GEMMs on every local device first, so that no shape's columns pay for an
        idle GPU's low clock (see bench.Bench.warm_up). GPUs only; no collective."""
        if not self.on_gpu:
            return
        steps = []
        for d in self.local:
            a = jax.device_put(jnp.ones((8192, 8192), self.dtype), d)
            steps.append((jax.jit(lambda a: jnp.dot(a, a)), a))
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            jax.block_until_ready([f(a) for f, a in steps for _ in range(10)])

    # -- checks and timings --

    def shard_error(self, outs, refs) -> float:
        """max over the outputs and this process's shards of rel_err(shard, the same block of the
        full reference on the home device)."""
        errs = [rel_err(jax.device_put(s.data, self.home), ref[s.index])
                for out, ref in zip(outs, refs) for s in out.addressable_shards]
        return max(float(e) for e in errs)

    def max_over_processes(self, values: list) -> list:
        return max_over_processes(values, KV_TIMEOUT_MS)

    def barrier(self) -> None:
        """All processes meet here (a no-op in one process); each call is a new key-value barrier."""
        if jax.process_count() > 1:
            self._barriers += 1
            _distributed.barrier(f"entwine_bench/barrier/{self._barriers}", range(jax.process_count()), self.me,
                                 KV_TIMEOUT_MS)

    def time(self, programs: dict, progress) -> dict:
        """{name: (compiled, args)} -> {name: ms}: median per call, interleaved rounds, max over
        processes (every process passes the same names in the same order). With several processes
        every timed batch starts at a barrier: a process that ran ahead would otherwise time its
        fused calls waiting for a peer still busy with the previous program."""
        times = time_interleaved(programs, self.iters, self.warmup, self.batch, on_round=progress.step,
                                 before_batch=self.barrier if jax.process_count() > 1 else None)
        names = list(programs)
        return dict(zip(names, self.max_over_processes([times[n] for n in names])))


def ms_or_none(value):
    """NaN (a column skipped on some process) -> None (JSON null, '-' in the table)."""
    return None if value is None or np.isnan(value) else float(value)


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(value, width: int, digits: int = 3) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def path_note(row, skipped_needs: str) -> str:
    """A row's path, with the reason where XLA's ran (a fallback must never read as entwine speed);
    skipped_needs: what a row skipped for ranks sharing a GPU needed ("its collectives need")."""
    if row["check"] == "SKIP":
        return f"path=xla, not run: {skipped_needs} NCCL, which cannot run ranks sharing a GPU ({row['reason']})"
    return "path=fused" if row["path"] == "fused" else f"path=xla ({row['reason']})"


def print_geomeans(rows, geomean, keys, noun: str) -> None:
    """The table's last line: the geomean of each column of `keys` over the checked rows, and a warning
    when any of them ran the XLA fallback."""
    ok = [r for r in rows if r["check"] == "OK"]
    fallback = sum(r["path"] != "fused" for r in ok)
    means = {key: geomean([r[key] for r in ok if r[key] is not None]) for key in keys}
    print(f"geomean over {len(ok)} checked {noun}: " + "  ".join(f"{k} {fmt(v, 0)}" for k, v in means.items())
          + (f"  WARNING: {fallback} of them ran the XLA fallback, not entwine" if fallback else ""))


class QuietProgress:
    """The progress of ranks other than 0: nothing printed."""

    def phase(self, what):
        pass

    def step(self, _round=None):
        pass

    def close(self):
        pass
