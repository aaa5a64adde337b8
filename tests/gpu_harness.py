"""The launcher and the rank-side base of tests/gpu_ranks.py (its docstring says what the suites do):
W processes started with jax.distributed on localhost, optionally as clients of a private CUDA MPS
server, killed after a timeout, one PASS/FAIL summary line; in each process, the Rank helpers the
suite modules (gpu_*_suites.py) build on. gpu_ranks.SUITES names each suite's class and environment."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# The script every rank process runs (the launcher re-runs it with --rank).
ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_ranks.py")
# The deadline (ENTWINE_TIMEOUT_MS) of the suites in which a rank never arrives.
MISSING_TIMEOUT_MS = 2000


@dataclasses.dataclass(frozen=True)
class Suite:
    """A row of gpu_ranks.SUITES: the Rank subclass whose method of the suite's name every rank runs;
    the environment its processes need (read once per process); whether it checks (`--suite all` and
    the GPU pytest run the checking suites, the others measure); the suite it is a second launch of."""

    ranks: type
    env: dict = dataclasses.field(default_factory=dict)
    checking: bool = True
    part_of: str | None = None


# --- Launcher -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def checking_suites(table) -> list:
    """The suites that `--suite all` runs, in the table's order: every checking suite but the second
    launches (those come with the suite they belong to)."""
    return [name for name, spec in table.items() if spec.checking and spec.part_of is None]


def launch(args, table) -> int:
    # `all` runs the suites as separate launches: the short deadline of `missing` is read once per
    # process, and would turn the compile-time skew between ranks of the other suites into errors.
    suites = checking_suites(table) if args.suite == "all" else args.suite.split(",")
    # A suite's second launches follow it (heapgrow with command buffers: XLA reads its flags once per
    # process).
    suites = [s for suite in suites for s in [suite, *(name for name, spec in table.items() if spec.part_of == suite)]]
    with mps_server(args) as mps_env:
        lines = [launch_suite(args, suite, table[suite], mps_env) for suite in suites]
    ok = all(line.startswith("PASS") for line in lines)
    mode = f"mps{'' if args.mps_percent is None else f' {args.mps_percent}%'}" if args.mps else "time-sliced"
    print(f"gpu_ranks: world={args.world} gpus={args.gpus} {mode}: {'PASS' if ok else 'FAIL'}: " + " | ".join(
        f"{suite} {line}" for suite, line in zip(suites, lines)), flush=True)
    return 0 if ok else 1


@contextlib.contextmanager
def mps_server(args):
    """With --mps: a private CUDA MPS control daemon for the suites' ranks (its own pipe and log
    folders, so it neither joins nor disturbs another one), stopped on the way out; yields the
    clients' environment. Without --mps: nothing, and an empty environment."""
    if not args.mps:
        yield {}
        return
    root = tempfile.mkdtemp(prefix="entwine-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for folder in env.values():
        os.makedirs(folder)
    server_env = dict(os.environ, **env)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=server_env, check=True, timeout=60)
    clients = dict(env)
    if args.mps_percent is not None:
        clients["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.mps_percent)
    try:
        yield clients
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=server_env, text=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


# Seconds the other ranks get to finish after one rank failed, before their stacks are printed and
# they are killed.
STRAGGLE_S = 20


def launch_suite(args, suite, spec, mps_env=None) -> str:
    """Runs one suite on W fresh processes; returns 'PASS (...)' or 'FAIL (...)'."""
    port = _free_port()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **(mps_env or {}))
    env.pop("XLA_FLAGS", None)  # fake host devices of the pytest process would confuse the mesh
    env.update(spec.env)
    procs, results, lock = [], {}, threading.Lock()

    def pump(rank, proc):
        for line in proc.stdout:
            print(f"[{suite} rank {rank}] {line}", end="", flush=True)
            if line.startswith("ENTWINE_RANK "):
                _, r, status, *_ = line.split(maxsplit=3)
                with lock:
                    results[int(r)] = status

    start = time.monotonic()
    pumps = []
    for rank in range(args.world):
        cmd = [sys.executable, ENTRY, "--rank", str(rank), "--port", str(port),
               "--world", str(args.world), "--gpus", str(args.gpus), "--suite", suite]
        # Own session: a timeout kills the rank's whole process group, and nothing else.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        procs.append(proc)
        pumps.append(threading.Thread(target=pump, args=(rank, proc), daemon=True))
        pumps[-1].start()
    # Wait for every rank, until the timeout, or until STRAGGLE_S after a rank failed: its peers may
    # then wait on it in host code with long deadlines (jax.distributed's barriers, the KV store).
    timed_out, failed_at = False, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now - start > args.timeout or (failed_at is not None and now - failed_at > STRAGGLE_S):
            timed_out = True
            break
        time.sleep(0.2)
    if timed_out:
        # Each straggler prints its Python stack first (rank_main registers SIGUSR1): where it hung.
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
    for t in pumps:
        t.join(timeout=5)
    passed = [r for r in range(args.world) if results.get(r) == "PASS" and procs[r].returncode == 0]
    ok = len(passed) == args.world and not timed_out
    codes = ",".join(str(p.returncode) for p in procs)
    killed = ""
    if timed_out:
        killed = (f", stragglers killed {STRAGGLE_S} s after a rank failed" if failed_at is not None
                  else ", killed after the timeout")
    return (f"{'PASS' if ok else 'FAIL'} ({len(passed)}/{args.world} ranks passed, exit codes {codes}{killed}, "
            f"{time.monotonic() - start:.1f} s)")


# --- One rank -------------------------------------------------------------------------------------------


def rank_main(args, table) -> int:
    import faulthandler

    import jax

    faulthandler.register(signal.SIGUSR1, all_threads=True)

    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.world,
                               process_id=args.rank, local_device_ids=[args.rank % args.gpus])
    try:
        detail = getattr(table[args.suite].ranks(args), args.suite)()
        print(f"ENTWINE_RANK {args.rank} PASS {detail}", flush=True)
        return 0
    except Exception as e:
        traceback.print_exc()
        print(f"ENTWINE_RANK {args.rank} FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 1


class Rank:
    """The checks of one rank. Every rank makes the same calls in the same order (the comm needs it),
    except where the `missing` suite says otherwise."""

    def __init__(self, args):
        import jax
        import numpy as np
        from jax.sharding import Mesh

        self.args, self.rank, self.world = args, args.rank, args.world
        self.started = time.monotonic()
        # Rank r is process r: the mesh orders the devices by process.
        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        self.mesh = Mesh(np.array(devices), ("tp",))
        self.device = jax.local_devices()[0]

    def log(self, msg):
        print(f"rank {self.rank} +{time.monotonic() - self.started:.1f}s: {msg}", flush=True)

    # -- inputs and reference, from the shared seeds --

    def host_inputs(self, m, n, k, dtype, seed):
        """Every rank's (x_s [M, K], w_s [K, N]) as float64 of the dtype-rounded values."""
        import numpy as np

        rng = np.random.default_rng(seed)
        xs, ws = [], []
        for _ in range(self.world):
            x = (rng.standard_normal((m, k), np.float32) / np.sqrt(self.world * k)).astype(dtype)
            w = rng.standard_normal((k, n), np.float32).astype(dtype)
            xs.append(x)
            ws.append(w)
        return xs, ws

    def reference(self, xs, ws):
        import numpy as np

        mp = xs[0].shape[0] // self.world
        rows = slice(self.rank * mp, (self.rank + 1) * mp)
        return sum(x[rows].astype(np.float64) @ w.astype(np.float64) for x, w in zip(xs, ws))

    def global_arrays(self, xs, ws):
        """Global x [..., K*W] and w [..., K*W, N] from this rank's shards, split over their K dim."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        def place(a, k_dim):
            shape, spec = list(a.shape), [None] * a.ndim
            shape[k_dim] *= self.world
            spec[k_dim] = "tp"
            return jax.make_array_from_single_device_arrays(
                tuple(shape), NamedSharding(self.mesh, P(*spec)), [jax.device_put(a, self.device)])

        x, w = xs[self.rank], ws[self.rank]
        return place(x, x.ndim - 1), place(w, w.ndim - 2)

    def fused_config(self, m, n, k, dtype):
        """The heuristic's config with path="fused": a call that cannot take it fails loudly (the XLA
        fallback would need NCCL, which cannot run two ranks on one GPU)."""
        import dataclasses

        from entwine_jax import heuristic_config

        return dataclasses.replace(heuristic_config(m, n, k, self.world, dtype), path="fused")

    def local(self, y):
        import numpy as np

        return np.asarray(y.addressable_shards[0].data)

    def census(self, f, *args):
        """The collective census of jit program f compiled on args under the mesh (entwine_jax.census):
        its fused ops' custom calls (custom_call True) and XLA's collectives, with executions per run."""
        import jax

        from entwine_jax import census

        with jax.set_mesh(self.mesh):
            return census.collectives(f.lower(*args), mesh=self.mesh)

    def fused_calls(self, f, *args) -> dict:
        """{op: executions per run} of the fused custom calls of f on args (self.census)."""
        return self.census(f, *args).select(custom_call=True).counts("owner")

    def ag_gemm_weights(self, f, *args) -> list:
        """The weight operands of each fused ag_gemm call of f on args: G for a group read in place,
        1 for one weight or a group joined into one (the FFI call's operands: x, the first weight, the
        FP8 call's two scales, then the group's further weights)."""
        import re

        import jax

        with jax.set_mesh(self.mesh):
            text = f.lower(*args).as_text()
        calls = re.findall(r"custom_call @entwine_ag_gemm(_fp8)?\(([^)]*)\)", text)
        return [len(operands.split(",")) - (3 if fp8 else 1) for fp8, operands in calls]

    # -- the ops --

    def gemm_fn(self, m, n, k, dtype, extra_work=False, config=None):
        """jit(shard_map(entwine_jax.gemm_rs)); refuses to run unless it lowers to the fused call
        (the XLA fallback would need NCCL, which cannot run two ranks on one GPU)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax.gemm_rs import fused as rs_fused

        config = config or self.fused_config(m, n, k, dtype)
        with jax.set_mesh(self.mesh):
            reason = rs_fused.unavailable_reason(
                jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype), axis_name="tp",
                axis_size=self.world, scatter_dimension=0, config=config)
        if reason is not None:
            raise RuntimeError(f"fused path unavailable for M={m} N={n} K={k}: {reason}")

        def body(x, w):
            y = entwine_jax.gemm_rs(x, w, axis_name="tp", config=config)
            if not extra_work:
                return y, jnp.zeros((1, 1), jnp.float32)
            # Local XLA work in the same program, next to the custom call (no collective).
            z = jnp.tanh(jnp.dot(x[:64].astype(jnp.float32), x[:64].astype(jnp.float32).T))
            return y, z.sum(keepdims=True).reshape(1, 1)

        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, "tp"), P("tp", None)),
                                  out_specs=(P("tp", None), P("tp", None)), check_vma=False))

        def call(gx, gw):
            with jax.set_mesh(self.mesh):
                return f(gx, gw)[0]

        call.jitted = f  # for traces that set the mesh themselves (jax.eval_shape)
        return call

    def recorded_error(self, absence) -> str:
        """The message of the error the communicator recorded (entwine_jax.comm.check_errors);
        AssertionError(absence) where none was."""
        from entwine_jax import comm

        try:
            comm.check_errors()
        except RuntimeError as e:
            return str(e)
        raise AssertionError(absence)

    def check(self, y, ref, what, tol=1e-2):
        import numpy as np

        y = y.astype(np.float64)
        err, norm = np.linalg.norm(y - ref), np.linalg.norm(ref)
        if not err <= tol * norm:
            raise AssertionError(f"{what}: rel error {err / norm:.3g} > {tol:g}")
        return err / max(norm, 1e-30)

    def device_epoch(self):
        from entwine_jax import comm

        (_, epoch), = comm.device_epochs(self.mesh, "tp")
        return epoch

    def handler_executions(self):
        from entwine_jax import comm

        (_, executions, _), = comm.handler_cost(self.mesh, "tp")
        return executions

    # -- ag_gemm --

    def ag_inputs(self, rows, cols, n, dtype, seed, gather_k):
        """Every rank's shard x_s [rows, cols] and weight w_s ([cols, n], or [W * cols, n] when the
        contraction dim is gathered), as float64 of the dtype-rounded values."""
        import numpy as np

        rng = np.random.default_rng(seed)
        k = self.world * cols if gather_k else cols
        xs = [(rng.standard_normal((rows, cols), np.float32) / np.sqrt(k)).astype(dtype) for _ in range(self.world)]
        ws = [rng.standard_normal((k, n), np.float32).astype(dtype) for _ in range(self.world)]
        return xs, ws

    def ag_reference(self, xs, ws, gather_k):
        import numpy as np

        g = np.concatenate([x.astype(np.float64) for x in xs], axis=1 if gather_k else 0)
        return g @ ws[self.rank].astype(np.float64), g

    def replicated(self, a):
        """The same value on every rank as one replicated array, from this rank's copy (a device_put
        of a host value to a sharding over every process would check it with a collective: NCCL)."""
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        a = np.asarray(a)
        return jax.make_array_from_single_device_arrays(a.shape, NamedSharding(self.mesh, P()),
                                                        [jax.device_put(a, self.device)])

    def place(self, a, spec_dim, shape):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        spec = [None] * a.ndim
        spec[spec_dim] = "tp"
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(self.mesh, P(*spec)),
                                                        [jax.device_put(a, self.device)])

    def ag_fn(self, rows, cols, n, dtype, gather_k, return_gathered=False, push="auto", config=None):
        """jit(shard_map(entwine_jax.ag_gemm)) on x sharded over its rows or columns and w sharded
        over N, with `config` (default: the heuristic's, the shard pushed as `push` says); refuses to
        run unless the fused path takes it."""
        import dataclasses

        import jax
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax.ag_gemm import fused as ag_fused

        config = config or dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, self.world, dtype),
                                               path="fused", push=push)
        k = self.world * cols if gather_k else cols
        with jax.set_mesh(self.mesh):
            reason = ag_fused.unavailable_reason(
                jax.ShapeDtypeStruct((rows, cols), dtype), jax.ShapeDtypeStruct((k, n), dtype), axis_name="tp",
                axis_size=self.world, gather_k=gather_k, config=config)
        if reason is not None:
            raise RuntimeError(f"fused ag_gemm unavailable for rows={rows} cols={cols} N={n}: {reason}")
        gd = -1 if gather_k else 0
        body = lambda x, w: entwine_jax.ag_gemm(x, w, axis_name="tp", gather_dimension=gd, config=config,
                                                return_gathered=return_gathered)
        x_spec = P(None, "tp") if gather_k else P("tp", None)
        out = (P(None, "tp"), P("tp")) if return_gathered else P(None, "tp")
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(x_spec, P(None, "tp")), out_specs=out,
                                  check_vma=False))

        def call(gx, gw):
            with jax.set_mesh(self.mesh):
                return f(gx, gw)

        return call, f

    def ag_globals(self, xs, ws, gather_k):
        x, w = xs[self.rank], ws[self.rank]
        x_shape = (x.shape[0], self.world * x.shape[1]) if gather_k else (self.world * x.shape[0], x.shape[1])
        return (self.place(x, 1 if gather_k else 0, x_shape),
                self.place(w, 1, (w.shape[0], self.world * w.shape[1])))
