"""Multi-process GPU tests of the fused ops (gemm_rs and ag_gemm): W processes (jax.distributed on
localhost), one rank each, sharing one GPU (CUDA IPC between processes of one device) or one GPU
each.

    python tests/gpu_ranks.py --world 2 --suite quick            # 2 ranks on GPU 0
    python tests/gpu_ranks.py --world 4 --suite all              # all but hostcost and smallshapes
    python tests/gpu_ranks.py --world 2 --gpus 2 --suite quick   # one process per GPU
    python tests/gpu_ranks.py --world 4 --mps --suite quick      # 4 ranks at once on GPU 0 (CUDA MPS)

Without --mps, processes sharing a GPU take turns on it in time slices, which hides every problem of
kernels that need SMs at the same time. --mps starts a private MPS server (its own pipe and log
folders), runs the suites' ranks as its clients, so their kernels share the SMs at once as kernels of
other streams do on a real node, and stops it at the end; --mps-percent N also caps each client at N %
of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE).

Suites:
  quick    suite-like and tail shapes, bf16 and fp16, growing (the heap regrows across processes),
           then x [B, S, K] scattered over S, jax.vmap(gemm_rs) (w batched or shared), gemm_rs
           inside lax.scan; results checked against a float64 host reference, repeated calls
           bitwise identical.
  stress   1000 back-to-back calls: two shapes, three input sets, two call sites, other XLA work
           in between, every result checked.
  missing  the last rank skips one call; the others must report the deadline error (with
           ENTWINE_TIMEOUT_MS=2000) through entwine_jax.comm.check_errors(), never hang.
  ag       ag_gemm in both layouts (gathering rows, also a middle dim, and gathering the contraction
           dim), bf16 and fp16, tails, the gathered operand returned, repeated calls bitwise equal,
           every shape and layout pushed by the SM copy kernel and by the copy engines;
           then a sequence-parallel MLP (ag_gemm -> silu -> gemm_rs) forward and backward with both
           directions fused, gradients against a float64 host reference.
  mixed    1000 back-to-back calls alternating gemm_rs and ag_gemm (both layouts, both pushes) on
           one communicator, every result checked.
  agmissing  as `missing`, for ag_gemm (the SM push): the ranks waiting for the absent rank's
           chunks or announcement report it.
  cmdbuf   XLA command buffers (CUDA graphs) on for fusions, custom calls, loops and conditionals,
           graphs of any size: gemm_rs (two call sites), ag_gemm (both layouts, both pushes), three
           independent fused calls in one program and a lax.scan of both
           ops, 20 runs each on operands generated in the program from fresh seeds, every
           result checked; the device epoch must advance once per call while the handlers execute
           fewer times (the rest are replays), except in the loop, which XLA keeps out of its graphs.
  cmdbufmissing  as `missing`, under command buffers: the replayed call of the ranks whose peer
           never came traps at the deadline, XLA raises, check_errors() names the absent rank.
  skipcall the last rank skips the first of two different calls (it runs the second while its peers
           run the first): every rank must fail within seconds (a mismatch naming both calls, or the
           abort of a peer that saw it), every output since is NaN, the next call is refused.
  disagree as skipcall, for one shape whose config differs on the last rank (a plan disagreement).
  heapgrow eight gemm_rs call sites of growing size (M = 2048*i*W, N = 8192, K = 256, bf16, i = 1..8),
           each traced and run once, every result checked; then the first site again, after the last
           growth; then rank 0 alone traces a ninth, larger site (jax.eval_shape) and must give up
           within ENTWINE_SETUP_TIMEOUT_MS with its heap unchanged, after which all ranks run that site.
           The device memory the processes gained beyond XLA's own pool must stay within 1.5x the last
           heap per process (retired heaps would add up to about 5x). Then entwine_jax.reserve sizes two
           larger sites at once, and running them must grow nothing. Runs twice: plainly, and with
           XLA command buffers for fusions and custom calls (the first site's graph, recorded before
           every growth, is replayed after them).
  fp8kernels  the FP8 FFI targets called directly (no Python op): entwine_gemm_rs_fp8 (rows and
           columns, bf16 and fp16 out) and entwine_ag_gemm_fp8 (rows layout with per-shard scales,
           the gathered shards and scales returned; contraction layout with a shared scale; each by
           both pushes) on e4m3 operands with a scale per rank, against float64 of the dequantised
           operands.
  fp8      the FP8 calls (float8_e4m3fn operands, fp32 scales, bf16/fp16 out) on the FP8 kernels:
           gemm_rs both layouts with each rank's own scales, tails; ag_gemm both layouts with
           per-shard and shared x_scale, the gathered FP8 operand returned; repeated calls bitwise
           equal; an FP8 then an fp16 ag_gemm in one program; the grouped FP8 ag_gemm (q/k/v widths)
           with its fp16 backward; then an FP8 sequence-parallel MLP (FP8
           forward; backward in e5m2 on the e5m2 x e4m3 kernels, and in fp16 on the fp16 kernels)
           with gradients; all against float64 of the dequantised operands. Fails where the
           extension has no FP8 kernels (the XLA path cannot run several ranks on one GPU).
  fp8half  the FP8 calls' fp16 backward piece by piece: the fp16 ops alone at the FP8 MLP's
           backward shapes (both configs, both pushes), each FP8 op's fp16 backward alone against
           the recipe (FP8-rounded operands) and against the unrounded operands, the FP8 MLP.
  hostcost the handlers' host time per execution (validation, plan, TMA descriptors, launches) for
           gemm_rs and ag_gemm (both layouts), over 200 calls each, one at a time, also by phase; then the host
           time per step of a lax.scan over an 8-layer MLP block (ag_gemm -> silu -> gemm_rs);
           reports them and checks the results.
  forward  forward progress: gemm_rs and ag_gemm with explicit configs a user writes (the dataclass
           defaults, the largest grids, both pushes), every result checked; then, on rank 0's GPU, a
           kernel of another stream that holds SMs until released (tests' SmHold): with
           ENTWINE_SM_RESERVE set to its SMs, fused calls run beside it and finish before it is
           released; holding every SM, a call finishes once it is released (after 2 s).
  smallshapes  the fused ops against XLA's path on Llama-8B and -70B projections (q/k/v and
           gate/up: ag_gemm; o and down: gemm_rs) at 16..2048 tokens per rank: XLA's GEMM alone
           plus the transfer at the link rate of tuning/crossover.py (no NCCL between processes of
           one GPU); prints a table, the fixed costs fitted to it, and where the rule of
           tuning/crossover.py disagrees with the measurement. Meaningful with one GPU per rank only:
           processes sharing a GPU take turns on it in time slices, and a fused call waits for its
           peer's turn (2.3 ms per gemm_rs, 4.6 ms per ag_gemm on one H200, whatever the shape).

NCCL refuses two ranks on one GPU, so each rank computes its reference on the host from the shared
seeds. Every rank prints `ENTWINE_RANK <r> PASS|FAIL <detail>`; the launcher kills every rank of a
suite after --timeout seconds and prints a one-line summary last. Exit status 0 iff all ranks passed.
"""

from __future__ import annotations

import argparse
import contextlib
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

MISSING_TIMEOUT_MS = 2000
# Command buffers for fusions and custom calls, however small the graph.
CMDBUF_XLA_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL "
                    "--xla_gpu_graph_min_graph_size=1")
# heapgrow_cmdbuf: graphs of fusions and the fused custom calls.
HEAPGROW_XLA_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
LONE_TRACE_TIMEOUT_MS = 3000
# forward: SMs that a kernel of another stream holds on rank 0's GPU while fused calls run beside it.
FORWARD_HELD_SMS = 40


def fp8_rounded(v, dtype=None):
    """float64 of v quantised to FP8 (default float8_e4m3fn) with its current scale and dequantised,
    as the ops do: scale = amax / the type's largest value, rounded to f32."""
    import ml_dtypes
    import numpy as np

    dtype = dtype or ml_dtypes.float8_e4m3fn
    v = np.asarray(v, np.float64)
    top = float(ml_dtypes.finfo(dtype).max)
    s = np.float32(np.abs(v).max() / top)
    return np.clip(v / s, -top, top).astype(dtype).astype(np.float64) * s


def rel_error(a, b) -> float:
    """|a - b| / |b| in float64 (Frobenius norms)."""
    import numpy as np

    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# --- Launcher -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    # `all` runs the suites as separate launches: the short deadline of `missing` is read once per
    # process, and would turn the compile-time skew between ranks of the other suites into errors.
    suites = (["quick", "ag", "stress", "mixed", "missing", "agmissing", "cmdbuf", "cmdbufmissing", "skipcall",
               "disagree", "heapgrow", "fp8kernels"]
              if args.suite == "all"
              else args.suite.split(","))
    # heapgrow runs with and without command buffers: XLA reads its flags once per process.
    suites = [s for suite in suites for s in (["heapgrow", "heapgrow_cmdbuf"] if suite == "heapgrow" else [suite])]
    with mps_server(args) as mps_env:
        lines = [launch_suite(args, suite, mps_env) for suite in suites]
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


def launch_suite(args, suite, mps_env=None) -> str:
    """Runs one suite on W fresh processes; returns 'PASS (...)' or 'FAIL (...)'."""
    port = _free_port()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **(mps_env or {}))
    if suite in ("missing", "agmissing", "cmdbufmissing"):
        env["ENTWINE_TIMEOUT_MS"] = str(MISSING_TIMEOUT_MS)
    if suite in ("skipcall", "disagree"):  # a mismatch fails at once; the deadline covers a first compile
        env["ENTWINE_TIMEOUT_MS"] = str(10 * MISSING_TIMEOUT_MS)
    env.pop("XLA_FLAGS", None)  # fake host devices of the pytest process would confuse the mesh
    if suite.startswith("cmdbuf"):
        env["XLA_FLAGS"] = CMDBUF_XLA_FLAGS
    if suite == "heapgrow_cmdbuf":
        env["XLA_FLAGS"] = HEAPGROW_XLA_FLAGS
    if suite == "forward":  # read once per process: the SMs that rank 0's held kernel takes
        env["ENTWINE_SM_RESERVE"] = str(FORWARD_HELD_SMS)
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
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--port", str(port),
               "--world", str(args.world), "--gpus", str(args.gpus), "--suite", suite]
        # Own session: a timeout kills the rank's whole process group, and nothing else.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        procs.append(proc)
        pumps.append(threading.Thread(target=pump, args=(rank, proc), daemon=True))
        pumps[-1].start()
    timed_out = False
    for proc in procs:
        left = args.timeout - (time.monotonic() - start)
        try:
            proc.wait(timeout=max(left, 0.1))
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
    passed = [r for r in range(args.world) if results.get(r) == "PASS" and procs[r].returncode == 0]
    ok = len(passed) == args.world and not timed_out
    codes = ",".join(str(p.returncode) for p in procs)
    return (f"{'PASS' if ok else 'FAIL'} ({len(passed)}/{args.world} ranks passed, exit codes {codes}"
            f"{', killed after the timeout' if timed_out else ''}, {time.monotonic() - start:.1f} s)")


# --- One rank -------------------------------------------------------------------------------------------


def rank_main(args) -> int:
    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.world,
                               process_id=args.rank, local_device_ids=[args.rank % args.gpus])
    try:
        detail = getattr(Rank(args), args.suite)()
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
        # Rank r is process r: the mesh orders the devices by process.
        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        self.mesh = Mesh(np.array(devices), ("tp",))
        self.device = jax.local_devices()[0]

    def log(self, msg):
        print(f"rank {self.rank}: {msg}", flush=True)

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

    # -- the op --

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

    def check(self, y, ref, what):
        import numpy as np

        y = y.astype(np.float64)
        err, norm = np.linalg.norm(y - ref), np.linalg.norm(ref)
        if not err <= 1e-2 * norm:
            raise AssertionError(f"{what}: rel error {err / norm:.3g} > 1e-2")
        return err / max(norm, 1e-30)

    # -- suites --

    def quick(self):
        import jax.numpy as jnp
        import numpy as np

        from entwine_jax import comm

        w_ = self.world
        # Growing sizes: every new shape regrows the heaps of all processes.
        # The two suite-like shapes keep M near 2048 and 4096 rows for any W (M must divide by W).
        shapes = [(w_ * 77, 130, 60), (w_ * 128, 256, 64), (w_ * 200, 1000, 1000), (w_ * 129, 257, 72),
                  (2048 // w_ * w_, 4096, 1024), (4096 // w_ * w_, 8192, 1024)]
        worst = 0.0
        for dtype in (jnp.bfloat16, jnp.float16):
            for i, (m, n, k) in enumerate(shapes):
                xs, ws = self.host_inputs(m, n, k, dtype, seed=100 + i)
                ref = self.reference(xs, ws)
                gx, gw = self.global_arrays(xs, ws)
                f = self.gemm_fn(m, n, k, dtype)
                ys = [self.local(f(gx, gw)) for _ in range(3)]
                comm.check_errors()
                worst = max(worst, self.check(ys[0], ref, f"M={m} N={n} K={k} {dtype.__name__}"))
                for y in ys[1:]:
                    if not np.array_equal(y.view(np.uint16), ys[0].view(np.uint16)):
                        raise AssertionError(f"M={m} N={n} K={k} {dtype.__name__}: repeated calls differ bitwise")
                self.log(f"quick M={m} N={n} K={k} {dtype.__name__}: ok")
        # [B, S, K] scattered over S (sequence parallelism): rows permuted before the fused call.
        for i, (b, s, n, k) in enumerate([(3, w_ * 100, 257, 72), (2, w_ * 1024, 2048, 1024)]):
            worst = max(worst, self.middle_dim(b, s, n, k, jnp.bfloat16, seed=200 + i))
            self.log(f"quick B={b} S={s} N={n} K={k} scattered over S: ok")
        # jax.vmap over a leading batch dim, w batched or shared: one fused call per element.
        for shared_w in (False, True):
            worst = max(worst, self.vmapped(3, w_ * 256, 512, 256, jnp.bfloat16, shared_w, seed=400 + shared_w))
            self.log(f"quick jax.vmap (w {'shared' if shared_w else 'batched'}): ok")
        # MaxText's scan_layers: the custom call inside lax.scan, once per step of a device loop.
        worst = max(worst, self.scan_layers(w_ * 256, 512, 256, layers=3, dtype=jnp.bfloat16, seed=300))
        self.log("quick gemm_rs inside lax.scan (3 steps): ok")
        return f"quick: {2 * len(shapes) + 5} shapes ok, worst rel error {worst:.2e}"

    def vmapped(self, b, m, n, k, dtype, shared_w, seed):
        """jax.vmap(gemm_rs) over b elements inside shard_map (w batched or shared) against the host
        reference of every element; the program must contain the fused call."""
        import jax
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        elems = [self.host_inputs(m, n, k, dtype, seed + 10 * i) for i in range(b)]
        if shared_w:
            elems = [(xs, elems[0][1]) for xs, _ in elems]
        x_ranks = [np.stack([xs[r] for xs, _ in elems]) for r in range(self.world)]
        w_ranks = [elems[0][1][r] if shared_w else np.stack([ws[r] for _, ws in elems]) for r in range(self.world)]
        gx, gw = self.global_arrays(x_ranks, w_ranks)
        config = self.fused_config(m, n, k, dtype)
        op = jax.vmap(lambda x, w: entwine_jax.gemm_rs(x, w, axis_name="tp", config=config),
                      in_axes=(0, None if shared_w else 0))
        w_spec = P("tp", None) if shared_w else P(None, "tp", None)
        f = jax.jit(jax.shard_map(op, mesh=self.mesh, in_specs=(P(None, None, "tp"), w_spec),
                                  out_specs=P(None, "tp", None)))
        if not self.fused_calls(f, gx, gw).get("gemm_rs"):
            raise AssertionError("jax.vmap(gemm_rs) did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            ys = self.local(f(gx, gw))
        comm.check_errors()
        what = f"vmap over {b} (w {'shared' if shared_w else 'batched'})"
        if ys.shape != (b, m // self.world, n):
            raise AssertionError(f"{what}: local result of shape {ys.shape}")
        return max(self.check(ys[i], self.reference(*elems[i]), f"{what}, element {i}") for i in range(b))

    def scan_layers(self, m, n, k, layers, dtype, seed):
        """jax.lax.scan over `layers` weight matrices, gemm_rs in the body, against the host reference."""
        import jax
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        xs, _ = self.host_inputs(m, n, k, dtype, seed)
        w_layers = [self.host_inputs(m, n, k, dtype, seed + 1 + i)[1] for i in range(layers)]
        # w of every rank stacked over the layers: [layers, K, N] per rank.
        gx, gws = self.global_arrays(xs, [np.stack([wl[r] for wl in w_layers]) for r in range(self.world)])
        config = self.fused_config(m, n, k, dtype)

        def body(x, ws):
            return jax.lax.scan(lambda c, w: (c, entwine_jax.gemm_rs(x, w, axis_name="tp", config=config)), None, ws)[1]

        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, "tp"), P(None, "tp", None)),
                                  out_specs=P(None, "tp", None)))
        # The census counts a call in a loop once per trip (XLA's known_trip_count): `layers` fused
        # calls per run, whether XLA keeps the loop or unrolls it; a loop of unknown trip count must hold it.
        calls = self.census(f, gx, gws).select(owner="gemm_rs", custom_call=True)
        if not (calls.count == layers or (calls.unknown and all(c.loops for c in calls))):
            raise AssertionError(f"gemm_rs inside lax.scan did not lower to the fused call in a loop: {calls.count} "
                                 f"fused calls per run, expected {layers}\n{calls.table()}")
        with jax.set_mesh(self.mesh):
            ys = self.local(f(gx, gws))
        comm.check_errors()
        worst = 0.0
        for i, wl in enumerate(w_layers):
            worst = max(worst, self.check(ys[i], self.reference(xs, wl), f"scan step {i}"))
        return worst

    def middle_dim(self, b, s, n, k, dtype, seed):
        """entwine_jax.gemm_rs on x [B, S, K] with scatter_dimension=1 (the fused path must take it)
        against the host reference: rank r holds rows r*S/W .. of dim 1 of sum_ranks(x @ w)."""
        import jax
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        xs, ws = self.host_inputs(b * s, n, k, dtype, seed)
        xs = [x.reshape(b, s, k) for x in xs]
        part = slice(self.rank * s // self.world, (self.rank + 1) * s // self.world)
        ref = sum(x[:, part].astype(np.float64) @ w.astype(np.float64) for x, w in zip(xs, ws))
        gx, gw = self.global_arrays(xs, ws)
        config = self.fused_config(b * s, n, k, dtype)
        body = lambda x, w: entwine_jax.gemm_rs(x, w, axis_name="tp", scatter_dimension=1, config=config)
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, None, "tp"), P("tp", None)),
                                  out_specs=P(None, "tp", None)))
        if not self.fused_calls(f, gx, gw).get("gemm_rs"):
            raise AssertionError(f"B={b} S={s} N={n} K={k}: a scatter over S did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            ys = [self.local(f(gx, gw)) for _ in range(2)]
        comm.check_errors()
        if ys[0].shape != (b, s // self.world, n):
            raise AssertionError(f"scatter over S: local result of shape {ys[0].shape}")
        if not np.array_equal(ys[1].view(np.uint16), ys[0].view(np.uint16)):
            raise AssertionError(f"B={b} S={s} N={n} K={k} scattered over S: repeated calls differ bitwise")
        return self.check(ys[0], ref, f"B={b} S={s} N={n} K={k} scattered over S")

    def stress(self, calls=1000, batch=16):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from entwine_jax import comm

        w_ = self.world
        shapes = [(w_ * 256, 512, 256), (w_ * 300, 640, 200)]
        variants = 3  # consecutive calls of one shape see other data: a stale slot would show
        data = {}
        for s, (m, n, k) in enumerate(shapes):
            sites = [self.gemm_fn(m, n, k, jnp.bfloat16), self.gemm_fn(m, n, k, jnp.bfloat16, extra_work=True)]
            for v in range(variants):
                xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=1000 + 10 * s + v)
                data[s, v] = (self.global_arrays(xs, ws), self.reference(xs, ws), sites)
        side = jax.device_put(np.ones((512, 512), np.float32), self.device)
        side_fn = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
        first, pending, checked = {}, [], 0
        t0 = time.monotonic()
        for i in range(calls):
            s, v, site = i % 2, (i // 2) % variants, (i // (2 * variants)) % 2
            (gx, gw), ref, sites = data[s, v]
            pending.append(((s, v, site, i), sites[site](gx, gw)))
            if i % 3 == 0:
                side = side_fn(side)  # other XLA work between the calls, on the same device
            if len(pending) == batch or i == calls - 1:
                for (s_, v_, site_, i_), y in pending:
                    y = self.local(y)
                    if (s_, v_) not in first:
                        self.check(y, data[s_, v_][1], f"stress call {i_} shape {s_} variant {v_}")
                        first[s_, v_] = y
                    elif not np.array_equal(y.view(np.uint16), first[s_, v_].view(np.uint16)):
                        self.check(y, data[s_, v_][1], f"stress call {i_} (site {site_})")
                        raise AssertionError(f"stress call {i_} shape {s_} variant {v_} site {site_}: "
                                             "differs bitwise from the first call")
                    checked += 1
                pending.clear()
                comm.check_errors()
        jax.block_until_ready(side)
        return f"stress: {checked} calls checked in {time.monotonic() - t0:.1f} s"

    # -- XLA command buffers (CUDA graphs) --

    def gen(self, seed, rank, shape, salt, xp):
        """A rank's operand from (seed, rank, salt) by integer hashing, in jnp (inside the program, on
        the device) or np (the host reference) alike: values k/16 for k in -8..8, exact in bf16."""
        import numpy as np

        size = int(np.prod(shape))
        h = xp.arange(size, dtype=xp.uint32) * xp.uint32(2654435761)
        h = h + (xp.asarray(seed).astype(xp.uint32) * xp.uint32(40503) + xp.asarray(rank).astype(xp.uint32) *
                 xp.uint32(7919) + xp.uint32(salt * 104729))
        h = h ^ (h >> xp.uint32(13))
        h = h * xp.uint32(0x5BD1E995)
        h = h ^ (h >> xp.uint32(15))
        return ((h % xp.uint32(17)).astype(xp.int32) - 8).astype(xp.float32).reshape(shape) / 16

    def cmdbuf_sites(self):
        """Programs f(seed) whose fused calls consume operands generated inside the program from the
        seed: a call of fresh data reuses the command buffer's addresses, so XLA may replay the
        recorded calls. Each: (name, f, fused calls per run, host reference of seed -> [local results],
        whether XLA replays its calls: not the loop's; XLA 0.11.2 ran the handler at every step of it,
        also with a body of nothing but the slicing and the two calls)."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax

        w_, bf = self.world, jnp.bfloat16
        m, n, k = w_ * 256, 512, 256
        rows, cols, n_ag = 256, 192, 512
        rs_config = self.fused_config(m, n, k, bf)
        ag_config = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n_ag, cols, w_, bf), path="fused")
        host = lambda seed, rank, shape, salt: self.gen(seed, rank, shape, salt, np).astype(bf)  # noqa: E731

        def rs_local(seed, step=0):
            xs = [host(seed + step, q, (m, k), 1) for q in range(w_)]
            ws = [host(seed + step, q, (k, n), 2) for q in range(w_)]
            return self.reference(xs, ws)

        def ag_local(seed, gather_k, step=0):
            kk = w_ * cols if gather_k else cols
            xs = [host(seed + step, q, (rows, cols), 3) for q in range(w_)]
            ws = [host(seed + step, q, (kk, n_ag), 4) for q in range(w_)]
            return self.ag_reference(xs, ws, gather_k)[0]

        def program(body, out_specs):
            f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(), out_specs=out_specs, check_vma=False))

            def call(seed):
                with jax.set_mesh(self.mesh):
                    return f(np.int32(seed))
            return call

        def dev(seed, shape, salt):
            return self.gen(seed, jax.lax.axis_index("tp"), shape, salt, jnp).astype(bf)

        def rs(seed, extra_work):
            y = entwine_jax.gemm_rs(dev(seed, (m, k), 1), dev(seed, (k, n), 2), axis_name="tp", config=rs_config)
            if extra_work:  # local XLA work next to the custom call, in the same command buffer
                y = y + jnp.tanh(jnp.zeros((1, n), jnp.float32)).astype(bf)
            return y

        def ag(seed, gather_k):
            # Both pushes replayed: the SM push in the rows layout, the copy engines in the other.
            kk = w_ * cols if gather_k else cols
            return entwine_jax.ag_gemm(dev(seed, (rows, cols), 3), dev(seed, (kk, n_ag), 4), axis_name="tp",
                                       gather_dimension=-1 if gather_k else 0,
                                       config=dataclasses.replace(ag_config, push=("sm", "ce")[gather_k]))

        def independent(seed):
            # Three fused calls that share no data, two of them of one shape: XLA's schedule orders
            # them, the same on every rank (the call site in each signature would expose a swap).
            y1 = rs(seed, False)
            y2 = entwine_jax.gemm_rs(dev(seed, (m, k), 5), dev(seed, (k, n), 6), axis_name="tp", config=rs_config)
            return y1, y2, ag(seed, False)

        def independent_local(seed):
            xs = [host(seed, q, (m, k), 5) for q in range(w_)]
            ws = [host(seed, q, (k, n), 6) for q in range(w_)]
            return [rs_local(seed), self.reference(xs, ws), ag_local(seed, False)]

        layers = 3

        def scanned(seed):
            # Both ops in the body of a device loop (MaxText's scan_layers): with WHILE command buffers
            # the body's graph is replayed once per step, with no host in between. The operands are
            # made before the loop, so that the body holds only the calls and slicing.
            steps = seed + jnp.arange(layers, dtype=jnp.int32)
            stacked = [jax.vmap(lambda t, shape=shape, salt=salt: dev(t, shape, salt))(steps)
                       for shape, salt in (((m, k), 1), ((k, n), 2), ((rows, cols), 3), ((cols, n_ag), 4))]

            def step(carry, ops):
                x1, w1, x2, w2 = ops
                return carry, (entwine_jax.gemm_rs(x1, w1, axis_name="tp", config=rs_config),
                               entwine_jax.ag_gemm(x2, w2, axis_name="tp", gather_dimension=0, config=ag_config))
            return jax.lax.scan(step, None, tuple(stacked))[1]

        return [
            ("gemm_rs", program(lambda s: rs(s, False), P("tp", None)), 1, lambda s: [rs_local(s)], True),
            ("gemm_rs + XLA work", program(lambda s: rs(s, True), P("tp", None)), 1, lambda s: [rs_local(s)], True),
            ("ag_gemm rows", program(lambda s: ag(s, False), P(None, "tp")), 1, lambda s: [ag_local(s, False)],
             True),
            ("ag_gemm contraction", program(lambda s: ag(s, True), P(None, "tp")), 1, lambda s: [ag_local(s, True)],
             True),
            ("three independent calls", program(independent, (P("tp", None), P("tp", None), P(None, "tp"))), 3,
             independent_local, True),
            (f"scan of {layers} steps of both ops", program(scanned, (P(None, "tp", None), P(None, None, "tp"))),
             2 * layers, lambda s: [r for t in range(layers) for r in (rs_local(s, t), ag_local(s, False, t))],
             False),
        ]

    def handler_executions(self):
        from entwine_jax import comm

        (_, executions, _), = comm.handler_cost(self.mesh, "tp")
        return executions

    def device_epoch(self):
        from entwine_jax import comm

        (_, epoch), = comm.device_epochs(self.mesh, "tp")
        return epoch

    def cmdbuf(self, runs=20):
        """Every site run `runs` times with fresh seeds (and again with repeated ones), every result
        checked against the host reference. Then the proof that the calls ran inside command buffers:
        the device epoch advanced once per fused call, while the handlers executed fewer times (the
        rest were replays of recorded graphs)."""
        from entwine_jax import comm

        if CMDBUF_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            raise AssertionError("the cmdbuf suite runs with command buffers enabled (launch it through the launcher)")
        worst, parts, counts = 0.0, [], []
        for name, call, per_run, ref, replays in self.cmdbuf_sites():
            call(0)  # compile and record once
            comm.check_errors()
            epoch0, exec0 = self.device_epoch(), self.handler_executions()
            for i in range(runs):
                seed = 1 + i % (runs // 2 + 1) * 7  # fresh seeds, then some again
                out = call(seed)
                outs = [self.local(o) for o in (out if isinstance(out, tuple) else (out,))]
                if per_run > len(outs):  # scan: stacked over the steps, one stack per op
                    outs = [o[t] for t in range(per_run // len(outs)) for o in outs]
                comm.check_errors()
                for j, (y, r) in enumerate(zip(outs, ref(seed))):
                    worst = max(worst, self.check(y, r, f"cmdbuf {name}, run {i} (seed {seed}), result {j}"))
            epoch1, exec1 = self.device_epoch(), self.handler_executions()
            calls = runs * per_run
            if epoch1 - epoch0 != calls:
                raise AssertionError(f"cmdbuf {name}: the device epoch advanced {epoch1 - epoch0} times for {calls} calls")
            parts.append(f"{name}: {calls} calls, {exec1 - exec0} handler executions")
            counts.append((name, calls, exec1 - exec0, replays))
            self.log(f"cmdbuf {name}: {calls} calls checked, handler executed {exec1 - exec0} times")
        not_replayed = [name for name, calls, executions, replays in counts if replays and executions >= calls]
        if not_replayed:
            raise AssertionError("no call of " + ", ".join(not_replayed) + " was replayed from a command buffer: " +
                                 "; ".join(parts))
        return f"cmdbuf: worst rel error {worst:.2e}; " + "; ".join(parts)

    def cmdbufmissing(self):
        """Under command buffers, after replayed calls, the last rank skips one: the others' replayed
        call must trap at the deadline (no handler runs between replays to report it), XLA must raise,
        and check_errors() must name the absent rank. A replay that kept the epoch of its recording
        would instead pass its waits on the flags of the earlier calls and return without error."""
        import jax

        from entwine_jax import _distributed, comm

        if CMDBUF_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            raise AssertionError("the cmdbufmissing suite runs with command buffers enabled")
        _, call, _, ref, _ = self.cmdbuf_sites()[0]
        for seed in (1, 2, 3):
            self.check(self.local(call(seed)), ref(seed)[0], f"cmdbufmissing warm-up (seed {seed})")
        comm.check_errors()
        absent = self.world - 1
        if self.rank == absent:
            detail = "cmdbufmissing: skipped the call"
        else:
            exec0 = self.handler_executions()
            t0 = time.monotonic()
            try:
                jax.block_until_ready(call(4))
            except Exception as e:  # XlaRuntimeError: the kernel trapped
                xla_error = f"{type(e).__name__}: {str(e)[:160]}"
            else:
                raise AssertionError(f"no error after {time.monotonic() - t0:.1f} s although rank {absent} never called")
            waited = time.monotonic() - t0
            if self.handler_executions() != exec0:
                raise AssertionError("the call without the absent rank was recorded again, not replayed")
            try:
                comm.check_errors()
            except RuntimeError as e:
                message = str(e)
            else:
                raise AssertionError(f"XLA raised ({xla_error}) but no deadline was recorded")
            if f"from rank {absent}" not in message or f"waited {MISSING_TIMEOUT_MS} ms" not in message:
                raise AssertionError(f"deadline error does not name rank {absent} and the timeout: {message}")
            if waited > 10 * MISSING_TIMEOUT_MS / 1000 + 20:
                raise AssertionError(f"the deadline took {waited:.1f} s")
            detail = f"cmdbufmissing: replayed call trapped after {waited:.1f} s ({xla_error[:60]}); {message[:100]}"
        _distributed.barrier("entwine_test/cmdbufmissing_done", range(self.world), self.rank, 120_000)
        return detail

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

    def ag_case(self, rows, cols, n, dtype, gather_k, seed, return_gathered=False, repeats=2, push="auto"):
        import numpy as np

        from entwine_jax import comm

        xs, ws = self.ag_inputs(rows, cols, n, dtype, seed, gather_k)
        ref, g_ref = self.ag_reference(xs, ws, gather_k)
        call, f = self.ag_fn(rows, cols, n, dtype, gather_k, return_gathered, push)
        gx, gw = self.ag_globals(xs, ws, gather_k)
        if not self.fused_calls(f, gx, gw).get("ag_gemm"):
            raise AssertionError("ag_gemm did not lower to the fused call")
        outs = [call(gx, gw) for _ in range(repeats)]
        comm.check_errors()
        what = (f"ag_gemm rows={rows} cols={cols} N={n} {'contraction' if gather_k else 'rows'} {dtype.__name__} "
                f"push={push}")
        ys = [self.local(o[0] if return_gathered else o) for o in outs]
        if ys[0].shape != ref.shape:
            raise AssertionError(f"{what}: local result of shape {ys[0].shape}, expected {ref.shape}")
        err = self.check(ys[0], ref, what)
        for y in ys[1:]:
            if not np.array_equal(y.view(np.uint16), ys[0].view(np.uint16)):
                raise AssertionError(f"{what}: repeated calls differ bitwise")
        if return_gathered:
            g = self.local(outs[0][1])
            if g.shape != g_ref.shape or not np.array_equal(g.astype(np.float64), g_ref):
                raise AssertionError(f"{what}: the gathered operand differs from the shards")
        return err

    # -- FP8 targets, called directly --

    def fp8_operand(self, rng, shape):
        """float8_e4m3fn values of a standard normal array (ml_dtypes, host)."""
        import ml_dtypes
        import numpy as np

        return rng.standard_normal(shape, np.float32).astype(ml_dtypes.float8_e4m3fn)

    def fp8_call(self, target, results, operands, **attributes):
        """jit(shard_map) of one FP8 FFI call: every operand is this rank's block of a global array
        stacked over ranks ([W, ...], one block each); returns this rank's results."""
        import jax
        import numpy as np
        from jax.sharding import PartitionSpec as P

        from entwine_jax import _ffi

        def body(*blocks):
            outs = _ffi.fused_call(target, results, *(b[0] for b in blocks), **attributes)
            return tuple(o[None] for o in outs)

        stacked = [self.place(np.asarray(a)[None], 0, (self.world, *np.shape(a))) for a in operands]
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("tp"),) * len(operands),
                                  out_specs=(P("tp"),) * len(results), check_vma=False))
        with jax.set_mesh(self.mesh):
            return [self.local(o)[0] for o in f(*stacked)]

    def fp8kernels(self):
        """entwine_gemm_rs_fp8 and entwine_ag_gemm_fp8 on e4m3 operands with a scale per rank,
        against float64 of the dequantised operands (every rank builds all ranks' operands from one
        seed): gemm_rs over rows and columns into bf16 and fp16, ag_gemm's rows layout with
        per-shard scales (the gathered shards and scales returned) and its contraction layout with
        a shared scale, each by the copy engines and by the SM push. Repeated calls bitwise equal."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np

        import entwine_jax
        from entwine_jax import _extension, comm
        from entwine_jax.ag_gemm.config import push_budget

        ext = _extension.ext()
        if set(ext.fp8_targets()) != {ext.GEMM_RS_FP8_TARGET, ext.AG_GEMM_FP8_TARGET}:
            raise AssertionError(f"fp8_targets() lists {ext.fp8_targets()}")
        w_, r = self.world, self.rank
        f8 = lambda a: a.astype(np.float64)
        scales = [(np.float32(0.5 + 0.125 * s), np.float32(0.25 * (1 + s % 3))) for s in range(w_)]
        worst, cases = 0.0, 0
        for out_dtype in (jnp.bfloat16, jnp.float16):
            for scatter_cols in (False, True):
                m, n, k = (256, w_ * 256, 1040) if scatter_cols else (w_ * 256, 384, 1040)
                rng = np.random.default_rng(1300 + cases)
                xs = [self.fp8_operand(rng, (m, k)) for _ in range(w_)]
                w_ts = [self.fp8_operand(rng, (n, k)) for _ in range(w_)]
                full = sum(float(scales[s][0] * scales[s][1]) * (f8(xs[s]) @ f8(w_ts[s]).T) for s in range(w_))
                part = full[:, r * n // w_:(r + 1) * n // w_] if scatter_cols else full[r * m // w_:(r + 1) * m // w_]
                config = dataclasses.replace(self.fused_config(m, n, k, out_dtype), block_n=128)
                plan = ext.gemm_rs_fp8_plan(m, n, k, w_, scatter_cols, 128, config.producer_sms, config.consumer_grid,
                                            config.consumer_block, config.raster_rows, config.split_tail)
                if plan["error"] or (plan["m"], plan["n"], plan["k"]) != (m, n, k):
                    raise AssertionError(f"fp8 gemm_rs plan of an aligned call: {plan}")
                cid = comm.acquire_comm(self.mesh, "tp", plan["slot_bytes"], plan["tiles_per_partition"])
                what = f"gemm_rs fp8 -> {jnp.dtype(out_dtype).name} M={m} N={n} K={k} scatter={'cols' if scatter_cols else 'rows'}"
                signature = comm.call_signature(f"fp8kernels {what}")
                outs = [self.fp8_call(ext.GEMM_RS_FP8_TARGET, [jax.ShapeDtypeStruct(part.shape, out_dtype)],
                                      [xs[r], w_ts[r], np.array([scales[r][0]]), np.array([scales[r][1]])],
                                      comm_id=np.int64(cid), scatter_dimension=np.int64(int(scatter_cols)),
                                      signature=np.int64(signature), config=config.kernel_attributes())[0]
                        for _ in range(2)]
                comm.check_errors()
                worst = max(worst, self.check(outs[0], part, what))
                if not np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16)):
                    raise AssertionError(f"{what}: repeated calls differ bitwise")
                cases += 1
                self.log(f"{what}: ok")

        # Both layouts by both pushes: the SM push carries a per-shard scale in its slot too.
        for gather_k, push_sms in ((False, 0), (False, -1), (True, 0), (True, -1)):
            rows, cols, n = 256, 512, 384
            shared = gather_k  # the contraction layout needs one scale for every shard
            rng = np.random.default_rng(1400 + int(gather_k))
            xs = [self.fp8_operand(rng, (rows, cols)) for _ in range(w_)]
            w_t = self.fp8_operand(rng, (n, w_ * cols if gather_k else cols))
            x_scales = [scales[0 if shared else s][0] for s in range(w_)]
            w_scale = scales[r][1]
            deq = [float(x_scales[s]) * f8(xs[s]) for s in range(w_)]
            if gather_k:
                ref = float(w_scale) * (np.concatenate(deq, axis=1) @ f8(w_t).T)
            else:
                ref = float(w_scale) * (np.concatenate(deq, axis=0) @ f8(w_t).T)
            config = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, w_, jnp.bfloat16), block_n=128)
            push_sms = push_budget(config) if push_sms < 0 else 0
            gemm_sms = _extension.sm_count() - max(push_sms, 1)
            plan = ext.ag_gemm_fp8_plan(rows, cols, n, w_, gather_k, 128, gemm_sms, config.raster_rows,
                                        config.max_chunks, push_sms, shared_scale=shared)
            if plan["error"]:
                raise AssertionError(f"fp8 ag plan: {plan['error']}")
            if w_ > 1 and (plan["push_grid"] > 0) != (push_sms > 0):
                raise AssertionError(f"fp8 ag plan: push_grid {plan['push_grid']} with push_sms {push_sms}")
            cid = comm.acquire_comm(self.mesh, "tp", 0, plan["chunks"], inbox_bytes=plan["inbox_bytes"])
            what = (f"ag_gemm fp8 -> bf16 rows={rows} cols={cols} N={n} "
                    f"{'contraction, shared scale' if gather_k else 'rows, per-shard scales'} "
                    f"push={'sm' if push_sms else 'ce'}")
            signature = comm.call_signature(f"fp8kernels {what}")
            results = [jax.ShapeDtypeStruct(ref.shape, jnp.bfloat16),
                       jax.ShapeDtypeStruct((w_, rows, cols), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((w_,), jnp.float32)]
            outs = [self.fp8_call(ext.AG_GEMM_FP8_TARGET, results,
                                  [xs[r], w_t, np.array([x_scales[r]]), np.array([w_scale])],
                                  comm_id=np.int64(cid), gather_k=bool(gather_k), signature=np.int64(signature),
                                  config=config.kernel_attributes(gemm_sms, push_sms), shared_scale=bool(shared))
                    for _ in range(2)]
            comm.check_errors()
            y, gathered, gathered_scales = outs[0]
            worst = max(worst, self.check(y, ref, what))
            if not np.array_equal(y.view(np.uint16), outs[1][0].view(np.uint16)):
                raise AssertionError(f"{what}: repeated calls differ bitwise")
            if not np.array_equal(gathered.view(np.uint8), np.stack(xs).view(np.uint8)):
                raise AssertionError(f"{what}: the gathered shards differ from the ranks' shards")
            if not np.array_equal(gathered_scales, np.array(x_scales, np.float32)):
                raise AssertionError(f"{what}: gathered scales {gathered_scales}, expected {x_scales}")
            cases += 1
            self.log(f"{what}: ok")
        return f"fp8kernels: {cases} cases, worst rel err {worst:.2e}"

    def ag(self):
        import jax.numpy as jnp

        shapes = [(128, 64, 256), (77, 60, 130), (200, 1000, 1000), (1024, 512, 2048), (2048, 1024, 4096)]
        worst, cases = 0.0, 0
        for d, dtype in enumerate((jnp.bfloat16, jnp.float16)):
            for gather_k in (False, True):
                for i, (rows, cols, n) in enumerate(shapes):
                    # Each shape and layout by both pushes: the SM push in one dtype, the copy engines in the other.
                    push = ("sm", "ce")[(i + gather_k + d) % 2]
                    worst = max(worst, self.ag_case(rows, cols, n, dtype, gather_k, seed=700 + i,
                                                    return_gathered=i % 2 == 1, push=push))
                    cases += 1
                    self.log(f"ag rows={rows} cols={cols} N={n} gather_k={gather_k} {dtype.__name__} push={push}: ok")
        worst = max(worst, self.mlp_grads(self.world * 256, 512, 384, jnp.float16, seed=900))
        self.log("ag: sequence-parallel MLP forward + backward, both directions fused: ok")
        worst = max(worst, self.mlp_grads(self.world * 200, 264, 200, jnp.bfloat16, seed=901))
        self.log("ag: sequence-parallel MLP with tails: ok")
        # Grouped: q/k/v-like weights of unequal widths (8 query heads per kv head), and tails.
        groups = [(256, 512, (512, 64, 64), jnp.bfloat16), (77, 60, (130, 17, 17, 40), jnp.float16)]
        for i, (rows, cols, widths, dtype) in enumerate(groups):
            for gather_k in (False, True):
                worst = max(worst, self.grouped_grads(rows, cols, widths, dtype, gather_k, seed=950 + i))
                self.log(f"ag: grouped rows={rows} cols={cols} widths={widths} gather_k={gather_k}: ok")
        return f"ag: {cases} cases + 2 MLP gradients + 4 grouped ok, worst rel error {worst:.2e}"

    def grouped_grads(self, rows, cols, widths, dtype, gather_k, seed):
        """ys = ag_gemm(x, (w_1, ..., w_G)) (one gather, weights of unequal widths), its values and the
        gradients of loss = sum_i sum(y_i c_i) (summed over ranks) against float64: one fused ag_gemm
        forward, one fused gemm_rs backward, no XLA collective."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        rng = np.random.default_rng(seed)
        k = self.world * cols if gather_k else cols
        out_rows = rows if gather_k else self.world * rows
        xs = [(rng.standard_normal((rows, cols), np.float32) / np.sqrt(k)).astype(dtype) for _ in range(self.world)]
        ws = [[rng.standard_normal((k, n), np.float32).astype(dtype) for n in widths] for _ in range(self.world)]
        cs = [[rng.standard_normal((out_rows, n), np.float32).astype(dtype) for n in widths]
              for _ in range(self.world)]
        config = entwine_jax.AgGemmConfig(path="fused")
        gd = -1 if gather_k else 0
        groups = len(widths)

        def values_and_grads(x, *wc):
            w, c = wc[:groups], wc[groups:]

            def loss(x, *w):
                ys = entwine_jax.ag_gemm(x, w, axis_name="tp", gather_dimension=gd, config=config)
                return sum(jnp.sum(y.astype(jnp.float32) * ci.astype(jnp.float32)) for y, ci in zip(ys, c)), ys
            (_, ys), grads = jax.value_and_grad(loss, argnums=tuple(range(groups + 1)), has_aux=True)(x, *w)
            return ys, grads

        x_spec = P(None, "tp") if gather_k else P("tp", None)
        w_spec, c_spec = P(None, "tp"), P(None, "tp")
        f = jax.jit(jax.shard_map(values_and_grads, mesh=self.mesh,
                                  in_specs=(x_spec,) + (w_spec,) * groups + (c_spec,) * groups,
                                  out_specs=((P(None, "tp"),) * groups, (x_spec,) + (w_spec,) * groups)))
        x_global = (rows, self.world * cols) if gather_k else (self.world * rows, cols)
        args = [self.place(xs[self.rank], 1 if gather_k else 0, x_global)]
        args += [self.place(w, 1, (k, self.world * w.shape[1])) for w in ws[self.rank]]
        args += [self.place(c, 1, (out_rows, self.world * c.shape[1])) for c in cs[self.rank]]
        found = self.census(f, *args)
        calls = found.select(custom_call=True).counts("owner")
        if calls != {"ag_gemm": 1, "gemm_rs": 1}:
            raise AssertionError(f"grouped: custom calls {calls}, expected one ag_gemm and one gemm_rs")
        left = found.select(custom_call=False, kind=("all-gather", "reduce-scatter", "all-reduce"))
        if left:
            raise AssertionError(f"grouped: the compiled program still has XLA collectives:\n{left.table()}")
        with jax.set_mesh(self.mesh):
            ys, grads = f(*args)
        comm.check_errors()
        # float64 reference: G = the gathered x; y_i = G @ W_i^r; dG = sum_r sum_i C_i^r W_i^r.T.
        g = np.concatenate([a.astype(np.float64) for a in xs], axis=1 if gather_k else 0)
        what = f"grouped rows={rows} cols={cols} widths={widths} {'contraction' if gather_k else 'rows'} {dtype.__name__}"
        worst = 0.0
        for i in range(groups):
            worst = max(worst, self.check(self.local(ys[i]), g @ ws[self.rank][i].astype(np.float64), f"{what} y{i}"))
            worst = max(worst, self.check(self.local(grads[1 + i]), g.T @ cs[self.rank][i].astype(np.float64),
                                          f"{what} dw{i}"))
        dg = sum(cs[r][i].astype(np.float64) @ ws[r][i].astype(np.float64).T for r in range(self.world)
                 for i in range(groups))
        mine = (slice(None), slice(self.rank * cols, (self.rank + 1) * cols)) if gather_k else \
            (slice(self.rank * rows, (self.rank + 1) * rows), slice(None))
        return max(worst, self.check(self.local(grads[0]), dg[mine], f"{what} dx"))

    def mlp_grads(self, t, d, f_local, dtype, seed):
        """x [T/W, D] -> h = ag_gemm(x, w1 [D, F/W]) -> silu -> gemm_rs(., w2 [F/W, D]) -> [T/W, D];
        loss = sum(y * c) + sum(y^2) / 2. jax.grad inside shard_map (the sum of every rank's loss) against float64.
        The compiled program must hold both fused calls and no all-gather or reduce-scatter."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        rng = np.random.default_rng(seed)
        tl = t // self.world
        xs = [(rng.standard_normal((tl, d), np.float32)).astype(dtype) for _ in range(self.world)]
        w1 = [(rng.standard_normal((d, f_local), np.float32) / np.sqrt(d)).astype(dtype) for _ in range(self.world)]
        w2 = [(rng.standard_normal((f_local, d), np.float32) / np.sqrt(f_local * self.world)).astype(dtype)
              for _ in range(self.world)]
        cs = [rng.standard_normal((tl, d), np.float32).astype(dtype) for _ in range(self.world)]
        up = dataclasses.replace(entwine_jax.ag_heuristic_config(tl, f_local, d, self.world, dtype), path="fused")
        down = dataclasses.replace(entwine_jax.heuristic_config(t, d, f_local, self.world, dtype), path="fused")

        def loss(x, w1_, w2_, c):
            h = entwine_jax.ag_gemm(x, w1_, axis_name="tp", config=up)
            a = jax.nn.silu(h.astype(jnp.float32)).astype(dtype)
            y = entwine_jax.gemm_rs(a, w2_, axis_name="tp", config=down)
            # Squared, so that the forward's y is needed by the backward (a linear loss would let
            # XLA drop the forward gemm_rs).
            return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)) + 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32)))

        grads = jax.grad(loss, argnums=(0, 1, 2))
        f = jax.jit(jax.shard_map(grads, mesh=self.mesh,
                                  in_specs=(P("tp", None), P(None, "tp"), P("tp", None), P("tp", None)),
                                  out_specs=(P("tp", None), P(None, "tp"), P("tp", None))))
        gx = self.place(xs[self.rank], 0, (t, d))
        g1 = self.place(w1[self.rank], 1, (d, self.world * f_local))
        g2 = self.place(w2[self.rank], 0, (self.world * f_local, d))
        gc = self.place(cs[self.rank], 0, (t, d))
        # Forward ag_gemm and gemm_rs; backward gemm_rs' dx an ag_gemm, ag_gemm's dx a gemm_rs: two
        # custom calls of each, and no XLA all-gather, reduce-scatter or all-reduce left.
        found = self.census(f, gx, g1, g2, gc)
        calls = found.select(custom_call=True).counts("owner")
        for op in ("ag_gemm", "gemm_rs"):
            if calls.get(op, 0) != 2:
                raise AssertionError(f"MLP gradients: {calls.get(op, 0)} entwine_{op} custom calls, expected 2")
        left = found.select(custom_call=False, kind=("all-gather", "reduce-scatter", "all-reduce"))
        if left:
            raise AssertionError(f"MLP gradients: the compiled program still has XLA collectives:\n{left.table()}")
        with jax.set_mesh(self.mesh):
            dx, dw1, dw2 = (self.local(o) for o in f(gx, g1, g2, gc))
        comm.check_errors()
        # float64 reference of d(sum over ranks of the loss).
        x = np.concatenate([a.astype(np.float64) for a in xs])
        c = np.concatenate([a.astype(np.float64) for a in cs])
        sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
        y = sum((lambda h: h / (1 + np.exp(-h)))(x @ w1[r].astype(np.float64)) @ w2[r].astype(np.float64)
                for r in range(self.world))
        dy = c + y  # d(sum(y c) + sum(y^2) / 2) / dy
        dx_ref = np.zeros_like(x)
        for r in range(self.world):
            h = x @ w1[r].astype(np.float64)
            da = dy @ w2[r].astype(np.float64).T
            dh = da * (sig(h) * (1 + h * (1 - sig(h))))
            if r == self.rank:
                a = h * sig(h)
                dw1_ref, dw2_ref = x.T @ dh, a.T @ dy
            dx_ref += dh @ w1[r].astype(np.float64).T
        rows = slice(self.rank * tl, (self.rank + 1) * tl)
        what = f"MLP T={t} D={d} F/W={f_local} {dtype.__name__}"
        return max(self.check(dx, dx_ref[rows], what + " dx"), self.check(dw1, dw1_ref, what + " dw1"),
                   self.check(dw2, dw2_ref, what + " dw2"))

    # -- FP8 --

    def fp8_shards(self, shape, seed, scale_spread):
        """Every rank's e4m3 shard of `shape` and float32 scale (ranks' scales scale_spread apart), as
        float64 dequantised values too."""
        import ml_dtypes
        import numpy as np

        rng = np.random.default_rng(seed)
        scales = (rng.uniform(1.0, scale_spread, self.world) / 448).astype(np.float32)
        shards = [np.clip(rng.standard_normal(shape, np.float32) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
                  for _ in range(self.world)]
        return shards, scales, [a.astype(np.float64) * float(s) for a, s in zip(shards, scales)]

    def fp8_ready(self, op, reason):
        if reason is not None:
            raise RuntimeError(f"FP8 {op} cannot take the fused path: {reason}")

    def fp8_gemm_rs_case(self, m, n, k, out_dtype, columns, seed):
        """gemm_rs FP8 on x [M, K] (this rank's K slice) and w [K, N], each rank's own x_scale and w_scale,
        scattered over rows or columns; against sum over ranks of the dequantised products."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm
        from entwine_jax.gemm_rs import fused as rs_fused

        xs, x_scales, xd = self.fp8_shards((m, k), seed, 8.0)
        ws, w_scales, wd = self.fp8_shards((k, n), seed + 1, 8.0)
        sd = 1 if columns else 0
        config = dataclasses.replace(entwine_jax.heuristic_config(m, n, k, self.world, jnp.float8_e4m3fn,
                                                                  scatter_cols=columns), path="fused")
        with jax.set_mesh(self.mesh):
            self.fp8_ready("gemm_rs", rs_fused.unavailable_reason(
                jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
                axis_name="tp", axis_size=self.world, scatter_dimension=sd, config=config, out_dtype=out_dtype))
        body = lambda x, w, a, b: entwine_jax.gemm_rs(x, w, axis_name="tp", scatter_dimension=sd, config=config,
                                                      x_scale=a, w_scale=b, out_dtype=out_dtype)
        out = P(None, "tp") if columns else P("tp", None)
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, "tp"), P("tp", None), P("tp"), P("tp")),
                                  out_specs=out))
        args = (self.place(xs[self.rank], 1, (m, self.world * k)), self.place(ws[self.rank], 0, (self.world * k, n)),
                self.place(x_scales[self.rank:self.rank + 1], 0, (self.world,)),
                self.place(w_scales[self.rank:self.rank + 1], 0, (self.world,)))
        if not self.fused_calls(f, *args).get("gemm_rs"):
            raise AssertionError("FP8 gemm_rs did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            ys = [self.local(f(*args)) for _ in range(2)]
        comm.check_errors()
        full = sum(x @ w for x, w in zip(xd, wd))
        ref = (full[:, self.rank * n // self.world:(self.rank + 1) * n // self.world] if columns
               else full[self.rank * m // self.world:(self.rank + 1) * m // self.world])
        what = f"FP8 gemm_rs M={m} N={n} K={k} {'columns' if columns else 'rows'} -> {jnp.dtype(out_dtype).name}"
        if ys[0].dtype != jnp.dtype(out_dtype) or not np.array_equal(ys[0].view(np.uint16), ys[1].view(np.uint16)):
            raise AssertionError(f"{what}: dtype {ys[0].dtype}, or repeated calls differ bitwise")
        return self.check(ys[0], ref, what)

    def fp8_ag_case(self, rows, cols, n, gather_k, shared, seed):
        """ag_gemm FP8 on this rank's shard [rows, cols] with its own x_scale (or one shared by all), w
        sharded over N; y and the gathered FP8 operand against the dequantised shards."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm
        from entwine_jax.ag_gemm import fused as ag_fused

        xs, x_scales, _ = self.fp8_shards((rows, cols), seed, 8.0)
        if shared:
            x_scales = np.full_like(x_scales, x_scales[0])
        k = self.world * cols if gather_k else cols
        ws, w_scales, _ = self.fp8_shards((k, n), seed + 1, 1.0)  # one w_scale on every rank
        config = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, self.world, jnp.float8_e4m3fn),
                                     path="fused")
        with jax.set_mesh(self.mesh):
            reason = ag_fused.unavailable_reason(
                jax.ShapeDtypeStruct((rows, cols), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
                axis_name="tp", axis_size=self.world, gather_k=gather_k, config=config, out_dtype=jnp.bfloat16,
                shared_scale=shared)
        if reason is not None and reason.startswith("the kernels cannot run this call") and gather_k and not shared:
            # The kernels' own rule (per-source scales of K slices may be left to shared scales only):
            # reported, not failed.
            return None, reason
        self.fp8_ready("ag_gemm", reason)
        gd = -1 if gather_k else 0
        body = lambda x, w, a, b: entwine_jax.ag_gemm(x, w, axis_name="tp", gather_dimension=gd, config=config,
                                                      x_scale=a, w_scale=b, return_gathered=True)
        x_spec = P(None, "tp") if gather_k else P("tp", None)
        # A replicated x_scale (P()) is a shared one: shard_map's types say every rank holds the same.
        s_spec = P() if shared else P("tp")
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(x_spec, P(None, "tp"), s_spec, P()),
                                  out_specs=(P(None, "tp"), P("tp"))))
        x_shape = (rows, self.world * cols) if gather_k else (self.world * rows, cols)
        scale_arg = (self.replicated(x_scales[0]) if shared
                     else self.place(x_scales[self.rank:self.rank + 1], 0, (self.world,)))
        args = (self.place(xs[self.rank], 1 if gather_k else 0, x_shape),
                self.place(ws[self.rank], 1, (k, self.world * n)), scale_arg,
                self.replicated(w_scales[0]))
        if not self.fused_calls(f, *args).get("ag_gemm"):
            raise AssertionError("FP8 ag_gemm did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            outs = [f(*args) for _ in range(2)]
        comm.check_errors()
        axis = 1 if gather_k else 0
        g_ref = np.concatenate([x.astype(np.float64) * float(s) for x, s in zip(xs, x_scales)], axis=axis)
        ref = g_ref @ (ws[self.rank].astype(np.float64) * float(w_scales[0]))
        what = (f"FP8 ag_gemm rows={rows} cols={cols} N={n} {'contraction' if gather_k else 'rows'} "
                f"{'shared' if shared else 'per-shard'} scale")
        ys = [self.local(o[0]) for o in outs]
        if not np.array_equal(ys[0].view(np.uint16), ys[1].view(np.uint16)):
            raise AssertionError(f"{what}: repeated calls differ bitwise")
        g = self.local(outs[0][1])
        if not np.array_equal(g.astype(np.float64), np.concatenate([x.astype(np.float64) for x in xs], axis=axis)):
            raise AssertionError(f"{what}: the gathered FP8 operand differs from the shards")
        return self.check(ys[0], ref, what), None

    def fp8_mlp_grads(self, t, d, f_local, seed, grad_dtype="float16"):
        """x [T/W, D] (fp16) -> ag_gemm FP8 -> silu -> gemm_rs FP8 -> [T/W, D], current scaling of every
        operand; loss = sum(y c). grad_dtype float16: the backward on the fp16 kernels, on the
        dequantised FP8 operands; float8_e5m2 (the hybrid recipe): each backward call's cotangent
        quantised to e5m2 with its rank's current scale, on the e5m2 x e4m3 kernels. Gradients against float64 of the same recipe: the forward on the
        dequantised operands, the backward straight through the quantisation, the cotangents quantised
        where the recipe quantises them. (fp16, not bf16: the recipe rounds to the half dtype five times
        on the way to dx, which in bf16 alone reaches the 1e-2 bound.) The e5m2 bound is 3e-2: a
        cotangent the device rounds to fp16 on the other side of an e5m2 step than float64 does (about
        one element in 2^8) moves that element by a whole step (up to 25%)."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import ml_dtypes
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        rng = np.random.default_rng(seed)
        tl = t // self.world
        half = jnp.float16
        e5m2 = grad_dtype == "float8_e5m2"
        gdt = jnp.float8_e5m2 if e5m2 else half
        xs = [rng.standard_normal((tl, d), np.float32).astype(half) for _ in range(self.world)]
        w1 = [(rng.standard_normal((d, f_local), np.float32) / np.sqrt(d)).astype(half) for _ in range(self.world)]
        w2 = [(rng.standard_normal((f_local, d), np.float32) / np.sqrt(f_local * self.world)).astype(half)
              for _ in range(self.world)]
        cs = [rng.standard_normal((tl, d), np.float32).astype(half) for _ in range(self.world)]
        up = dataclasses.replace(entwine_jax.ag_heuristic_config(tl, f_local, d, self.world, half), block_n=128,
                                 path="fused")
        # FP8 operands take 128-wide blocks only (the plan's rule); the fp16 heuristic may pick 256.
        down = dataclasses.replace(entwine_jax.heuristic_config(t, d, f_local, self.world, half), block_n=128,
                                   path="fused")

        def loss(x, w1_, w2_, c):
            h = entwine_jax.ag_gemm(x, w1_, axis_name="tp", config=up, x_scale=fp8.current_scale(x),
                                    w_scale=fp8.current_scale(w1_), grad_dtype=gdt)
            a = jax.nn.silu(h.astype(jnp.float32)).astype(half)
            y = entwine_jax.gemm_rs(a, w2_, axis_name="tp", config=down, x_scale=fp8.current_scale(a),
                                    w_scale=fp8.current_scale(w2_), grad_dtype=gdt)
            return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)), h

        # h (the FP8 forward's output) comes back too: a wrong gradient then says which call it came from.
        grads = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
        f = jax.jit(jax.shard_map(grads, mesh=self.mesh,
                                  in_specs=(P("tp", None), P(None, "tp"), P("tp", None), P("tp", None)),
                                  out_specs=((P("tp", None), P(None, "tp"), P("tp", None)), P(None, "tp"))))
        args = (self.place(xs[self.rank], 0, (t, d)), self.place(w1[self.rank], 1, (d, self.world * f_local)),
                self.place(w2[self.rank], 0, (self.world * f_local, d)), self.place(cs[self.rank], 0, (t, d)))
        calls = self.fused_calls(f, *args)
        # The loss is linear in y, so its gradient never needs y: the forward gemm_rs is dead code under
        # jax.grad. What runs fused: ag_gemm forward (FP8), gemm_rs's backward ag_gemm and ag_gemm's
        # backward gemm_rs (in either recipe).
        want = (2, 1)
        if (calls.get("ag_gemm", 0), calls.get("gemm_rs", 0)) != want:
            raise AssertionError(f"FP8 MLP gradients ({grad_dtype}): fused calls {calls}, expected {want[0]} "
                                 f"ag_gemm and {want[1]} gemm_rs")
        with jax.set_mesh(self.mesh):
            (dx, dw1, dw2), h_out = jax.tree.map(self.local, f(*args))
        comm.check_errors()

        deq = fp8_rounded

        # float64 of every rank's part (the inputs of all ranks come from the shared seed): each x shard
        # quantised with its own scale; the gradient passes straight through the quantisation; the
        # backward's GEMMs use the dequantised weights; e5m2: each rank's cotangent quantised with its scale.
        sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
        rounded = lambda v: v.astype(half).astype(np.float64)  # noqa: E731  (where the device writes fp16)
        cot = (lambda v: deq(v, ml_dtypes.float8_e5m2)) if e5m2 else (lambda v: v)  # noqa: E731
        x_all = np.concatenate([deq(x) for x in xs])
        c_all = np.concatenate([cot(c.astype(np.float64)) for c in cs])
        dx_ref = np.zeros_like(x_all)
        for r in range(self.world):
            h = rounded(x_all @ deq(w1[r]))
            a = rounded(h * sig(h))
            w2_back = deq(w2[r]) if e5m2 else rounded(deq(w2[r]))  # e5m2: the e4m3 weight as it is
            w1_back = deq(w1[r]) if e5m2 else rounded(deq(w1[r]))
            dh = rounded(c_all @ w2_back.T) * (sig(h) * (1 + h * (1 - sig(h))))
            dh = cot(rounded(dh)) if e5m2 else dh
            dx_ref += dh @ w1_back.T
            if r == self.rank:
                h_ref, dw1_ref, dw2_ref = h, x_all.T @ dh, deq(a).T @ c_all
        rows = slice(self.rank * tl, (self.rank + 1) * tl)
        # Every error at once, from the forward's h to dx: which are wrong locates the fault.
        bound = 3e-2 if e5m2 else 1e-2
        errors = {}
        for name, out, ref in (("h", h_out, h_ref), ("dw2", dw2, dw2_ref), ("dw1", dw1, dw1_ref),
                               ("dx", dx, dx_ref[rows])):
            out = np.asarray(out, np.float64)
            errors[name] = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
        if not all(e <= bound for e in errors.values()):
            raise AssertionError(f"FP8 MLP T={t} D={d} F/W={f_local} grad_dtype={grad_dtype}: rel errors " +
                                 ", ".join(f"{k} {v:.3g}" for k, v in errors.items()) + f" (bound {bound:g})")
        self.log(f"FP8 MLP grad_dtype={grad_dtype}: rel errors " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        return max(errors.values())

    def fp8_grouped_grads(self, rows=256, cols=512, widths=(512, 128, 128), seed=1380):
        """The grouped FP8 ag_gemm (one gather of x for q/k/v-like weights of unequal widths, rows
        layout, each rank's own x scale, one scale for the group's weights) with its fp16 backward:
        ys and the gradients of sum_i sum(y_i c_i) against float64 of the recipe. One fused FP8
        ag_gemm forward, one fused fp16 gemm_rs backward. Returns the worst rel error."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        w_, r, half = self.world, self.rank, jnp.float16
        rng = np.random.default_rng(seed)
        groups = len(widths)
        xs = [rng.standard_normal((rows, cols), np.float32).astype(half) for _ in range(w_)]
        ws = [[(rng.standard_normal((cols, n), np.float32) / np.sqrt(cols)).astype(half) for n in widths]
              for _ in range(w_)]
        cs = [[rng.standard_normal((w_ * rows, n), np.float32).astype(half) for n in widths] for _ in range(w_)]
        config = entwine_jax.AgGemmConfig(block_n=128, path="fused")

        def values_and_grads(x, *wc):
            w, c = wc[:groups], wc[groups:]

            def loss(x, *w):
                ws_scale = fp8.current_scale(jnp.concatenate(w, axis=1))
                ys = entwine_jax.ag_gemm(x, w, axis_name="tp", config=config, x_scale=fp8.current_scale(x),
                                         w_scale=ws_scale, grad_dtype=half)
                return sum(jnp.sum(y.astype(jnp.float32) * ci.astype(jnp.float32)) for y, ci in zip(ys, c)), ys
            (_, ys), grads = jax.value_and_grad(loss, argnums=tuple(range(groups + 1)), has_aux=True)(x, *w)
            return ys, grads

        f = jax.jit(jax.shard_map(values_and_grads, mesh=self.mesh,
                                  in_specs=(P("tp", None),) + (P(None, "tp"),) * (2 * groups),
                                  out_specs=((P(None, "tp"),) * groups, (P("tp", None),) + (P(None, "tp"),) * groups)))
        args = [self.place(xs[r], 0, (w_ * rows, cols))]
        args += [self.place(w, 1, (cols, w_ * w.shape[1])) for w in ws[r]]
        args += [self.place(c, 1, (w_ * rows, w_ * c.shape[1])) for c in cs[r]]
        calls = self.fused_calls(f, *args)
        if (calls.get("ag_gemm", 0), calls.get("gemm_rs", 0)) != (1, 1):
            raise AssertionError(f"grouped FP8: fused calls {calls}, expected one ag_gemm and one gemm_rs")
        with jax.set_mesh(self.mesh):
            ys, grads = f(*args)
        comm.check_errors()

        deq = fp8_rounded

        def deq_group(group):  # one scale for the group's weights
            return np.split(deq(np.concatenate(group, axis=1)), np.cumsum(widths)[:-1], axis=1)

        rounded = lambda v: v.astype(half).astype(np.float64)  # noqa: E731
        g = np.concatenate([deq(x) for x in xs])
        mine = deq_group(ws[r])
        errors = {}
        for i in range(groups):
            errors[f"y{i}"] = rel_error(self.local(ys[i]), g @ mine[i])
            errors[f"dw{i}"] = rel_error(self.local(grads[1 + i]), g.T @ cs[r][i].astype(np.float64))
        dg = sum(cs[q][i].astype(np.float64) @ rounded(deq_group(ws[q])[i]).T for q in range(w_) for i in range(groups))
        errors["dx"] = rel_error(self.local(grads[0]), dg[r * rows:(r + 1) * rows])
        self.log("grouped FP8 ag_gemm, fp16 backward: rel errors " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        if max(errors.values()) > 1e-2:
            raise AssertionError("grouped FP8 ag_gemm: rel errors " + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))
        return max(errors.values())

    def fp8_then_half(self, rows=256, cols=512, n=384, seed=1350):
        """An FP8 ag_gemm (per-shard scales) and then an fp16 ag_gemm returning its gathered operand, in one
        program on one communicator (the FP8 MLP's forward and its gemm_rs's fp16 backward): both
        against float64. Returns the worst relative error."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax

        half = jnp.float16
        xs, x_scales, x_deq = self.fp8_shards((rows, cols), seed, 8.0)
        ws, w_scales, _ = self.fp8_shards((cols, n), seed + 1, 1.0)
        rng = np.random.default_rng(seed + 2)
        hs = [rng.standard_normal((rows, cols), np.float32).astype(half) for _ in range(self.world)]
        vs = [(rng.standard_normal((cols, n), np.float32) / np.sqrt(cols)).astype(half) for _ in range(self.world)]
        c8 = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, self.world, jnp.float8_e4m3fn),
                                 path="fused")
        c16 = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, self.world, half), path="fused")

        def body(x, w, a, b, h, v):
            y8 = entwine_jax.ag_gemm(x, w, axis_name="tp", config=c8, x_scale=a, w_scale=b)
            y16, g16 = entwine_jax.ag_gemm(h, v, axis_name="tp", config=c16, return_gathered=True)
            return y8, y16, g16

        f = jax.jit(jax.shard_map(body, mesh=self.mesh,
                                  in_specs=(P("tp", None), P(None, "tp"), P("tp"), P(), P("tp", None), P(None, "tp")),
                                  out_specs=(P(None, "tp"), P(None, "tp"), P("tp", None))))
        r = self.rank
        args = (self.place(xs[r], 0, (self.world * rows, cols)), self.place(ws[r], 1, (cols, self.world * n)),
                self.place(x_scales[r:r + 1], 0, (self.world,)), self.replicated(w_scales[0]),
                self.place(hs[r], 0, (self.world * rows, cols)), self.place(vs[r], 1, (cols, self.world * n)))
        calls = self.fused_calls(f, *args)
        if calls.get("ag_gemm", 0) != 2:
            raise AssertionError(f"FP8 then fp16 ag_gemm: fused calls {calls}, expected 2 ag_gemm")
        with jax.set_mesh(self.mesh):
            y8, y16, g16 = (self.local(o) for o in f(*args))
        h_all = np.concatenate([h.astype(np.float64) for h in hs])
        errors = {"fp8 y": np.concatenate(x_deq) @ (ws[r].astype(np.float64) * float(w_scales[0])),
                  "fp16 y": h_all @ vs[r].astype(np.float64), "fp16 gathered": h_all}
        outs = {"fp8 y": y8, "fp16 y": y16, "fp16 gathered": g16}
        for name, ref in list(errors.items()):
            out = np.asarray(outs[name], np.float64)
            errors[name] = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        if not all(e <= 1e-2 for e in errors.values()):
            raise AssertionError("FP8 then fp16 ag_gemm on one communicator: rel errors " +
                                 ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))
        return max(errors.values())

    def fp8_half_backward(self, t=512, d=512, f_local=384, seed=1360):
        """Each FP8 op's fp16 backward alone (jax.vjp with a given cotangent), on the kernels: gemm_rs's (an fp16 ag_gemm returning the gathered
        dy, dw from it) and ag_gemm's (an fp16 gemm_rs, dw from the gathered FP8 x); against float64
        of the dequantised operands. Returns {name: rel error}."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        w_, r, half = self.world, self.rank, jnp.float16
        tl = t // w_
        rng = np.random.default_rng(seed)
        a_s = [rng.standard_normal((t, f_local), np.float32).astype(half) for _ in range(w_)]  # gemm_rs x
        w2 = [(rng.standard_normal((f_local, d), np.float32) / np.sqrt(f_local * w_)).astype(half) for _ in range(w_)]
        cs = [rng.standard_normal((tl, d), np.float32).astype(half) for _ in range(w_)]  # gemm_rs dy
        xs = [rng.standard_normal((tl, d), np.float32).astype(half) for _ in range(w_)]  # ag_gemm x
        w1 = [(rng.standard_normal((d, f_local), np.float32) / np.sqrt(d)).astype(half) for _ in range(w_)]
        dhs = [rng.standard_normal((t, f_local), np.float32).astype(half) for _ in range(w_)]  # ag_gemm dy
        up = dataclasses.replace(entwine_jax.ag_heuristic_config(tl, f_local, d, w_, half), block_n=128, path="fused")
        down = dataclasses.replace(entwine_jax.heuristic_config(t, d, f_local, w_, half), block_n=128, path="fused")
        cur = fp8.current_scale

        def rs_bwd(a, w, c):
            _, vjp = jax.vjp(lambda a_, w__: entwine_jax.gemm_rs(a_, w__, axis_name="tp", config=down,
                                                                  x_scale=cur(a_), w_scale=cur(w__), grad_dtype=half),
                             a, w)
            return vjp(c)

        def ag_bwd(x, w, dh):
            _, vjp = jax.vjp(lambda x_, w__: entwine_jax.ag_gemm(x_, w__, axis_name="tp", config=up,
                                                                  x_scale=cur(x_), w_scale=cur(w__), grad_dtype=half),
                             x, w)
            return vjp(dh)

        f_rs = jax.jit(jax.shard_map(rs_bwd, mesh=self.mesh, in_specs=(P(None, "tp"), P("tp", None), P("tp", None)),
                                     out_specs=(P(None, "tp"), P("tp", None))))
        f_ag = jax.jit(jax.shard_map(ag_bwd, mesh=self.mesh, in_specs=(P("tp", None), P(None, "tp"), P(None, "tp")),
                                     out_specs=(P("tp", None), P(None, "tp"))))
        with jax.set_mesh(self.mesh):
            da, dw2 = (self.local(o) for o in f_rs(self.place(a_s[r], 1, (t, w_ * f_local)),
                                                   self.place(w2[r], 0, (w_ * f_local, d)),
                                                   self.place(cs[r], 0, (t, d))))
            dx, dw1 = (self.local(o) for o in f_ag(self.place(xs[r], 0, (t, d)),
                                                   self.place(w1[r], 1, (d, w_ * f_local)),
                                                   self.place(dhs[r], 1, (t, w_ * f_local))))
        comm.check_errors()

        deq = fp8_rounded

        rounded = lambda v: v.astype(half).astype(np.float64)  # noqa: E731
        c_all = np.concatenate([c.astype(np.float64) for c in cs])
        x_all = np.concatenate([deq(x) for x in xs])
        dh_r = dhs[r].astype(np.float64)
        refs = {"gemm_rs bwd da": c_all @ rounded(deq(w2[r])).T,
                "gemm_rs bwd dw": deq(a_s[r]).T @ c_all,
                "ag_gemm bwd dx": sum(dhs[q].astype(np.float64) @ rounded(deq(w1[q])).T for q in range(w_))[
                    r * tl:(r + 1) * tl],
                "ag_gemm bwd dw": x_all.T @ dh_r}
        plain = lambda v: v.astype(np.float64)  # noqa: E731
        x_plain = np.concatenate([plain(x) for x in xs])
        refs.update({"gemm_rs bwd da unrounded": c_all @ plain(w2[r]).T, "gemm_rs bwd dw unrounded": plain(a_s[r]).T @ c_all,
                     "ag_gemm bwd dx unrounded": sum(plain(dhs[q]) @ plain(w1[q]).T for q in range(w_))[
                         r * tl:(r + 1) * tl],
                     "ag_gemm bwd dw unrounded": x_plain.T @ dh_r})
        outs = {"gemm_rs bwd da": da, "gemm_rs bwd dw": dw2, "ag_gemm bwd dx": dx, "ag_gemm bwd dw": dw1}
        return {k: rel_error(outs[k.replace(" unrounded", "")], v) for k, v in refs.items()}

    def fp8half(self):
        """The FP8 calls' fp16 backward piece by piece: the fp16 ops alone at the MLP's backward shapes
        and configs, each FP8 op's fp16 backward alone (against the recipe, which rounds operands to
        FP8, and against the unrounded operands: XLA folding the rounding away shows as 2.6% from the
        recipe and agreement with the unrounded), then the FP8 MLP with it. Reports every error; fails
        where one against the recipe exceeds 1e-2."""
        import dataclasses

        import jax.numpy as jnp

        from entwine_jax.ag_gemm import op as ag_op
        from entwine_jax.gemm_rs import op as rs_op

        w_, half = self.world, jnp.float16
        t, d, f_local = w_ * 256, 512, 384
        tl = t // w_
        errors = {}
        # The configs the backward takes (the e5m2 rule applied to fp16 operands), and 128-wide blocks.
        ag_default = ag_op.default_config(jnp.zeros((tl, d), half), jnp.zeros((d, f_local), half), w_)
        rs_default, _ = rs_op.default_config(jnp.zeros((t, f_local), half), jnp.zeros((f_local, d), half), w_, 0)
        self.log(f"fp8half: backward configs ag {ag_default}, rs {rs_default}")
        for name, cfg in (("default", ag_default), ("block128", dataclasses.replace(ag_default, block_n=128))):
            for push in ("sm", "ce"):
                c = dataclasses.replace(cfg, path="fused", push=push)
                e_y, e_g = self.half_ag_case(tl, d, f_local, c, seed=1370)
                errors[f"fp16 ag_gemm {name} {push} y"] = e_y
                errors[f"fp16 ag_gemm {name} {push} gathered"] = e_g
        for name, cfg in (("default", rs_default), ("block128", dataclasses.replace(rs_default, block_n=128))):
            errors[f"fp16 gemm_rs {name}"] = self.half_rs_case(t, d, f_local, dataclasses.replace(cfg, path="fused"),
                                                               seed=1371)
        errors.update(self.fp8_half_backward(t, d, f_local))
        try:
            errors["mlp worst"] = self.fp8_mlp_grads(t, d, f_local, seed=1300, grad_dtype="float16")
        except AssertionError as e:
            self.log(f"fp8half: MLP: {e}")
            errors["mlp worst"] = float("inf")
        for k, v in errors.items():
            self.log(f"fp8half: {k}: {v:.3e}")
        bad = {k: v for k, v in errors.items() if not v <= 1e-2 and "unrounded" not in k}
        if bad:
            raise AssertionError("fp8half: " + ", ".join(f"{k} {v:.2e}" for k, v in bad.items()))
        return f"fp8half: {len(errors)} checks, worst {max(errors.values()):.2e}"

    def half_ag_case(self, rows, cols, n, config, seed):
        """fp16 ag_gemm rows layout with the gathered operand returned: (rel error of y, of gathered)."""
        import jax.numpy as jnp

        xs, ws = self.ag_inputs(rows, cols, n, jnp.float16, seed, False)
        call, _ = self.ag_fn(rows, cols, n, jnp.float16, False, return_gathered=True, config=config)
        y, g = (self.local(o) for o in call(*self.ag_globals(xs, ws, False)))
        ref, g_ref = self.ag_reference(xs, ws, False)
        return rel_error(y, ref), rel_error(g, g_ref)

    def half_rs_case(self, m, n, k, config, seed):
        """fp16 gemm_rs scattering rows: rel error of this rank's block."""
        import jax.numpy as jnp

        xs, ws = self.host_inputs(m, n, k, jnp.float16, seed)
        y = self.local(self.gemm_fn(m, n, k, jnp.float16, config=config)(*self.global_arrays(xs, ws)))
        ref = self.reference(xs, ws)
        return rel_error(y, ref)

    def fp8(self):
        import jax.numpy as jnp

        from entwine_jax import _extension

        if not _extension.fp8_targets():
            raise RuntimeError("the extension registers no FP8 targets (FP8 kernels not built)")
        w_ = self.world
        worst, cases = 0.0, 0
        for out_dtype in (jnp.bfloat16, jnp.float16):
            for columns in (False, True):
                # N divides by W for the columns layout, M for the rows.
                for i, (m, n, k) in enumerate([(w_ * 128, w_ * 128, 64), (w_ * 77, w_ * 65, 60),
                                               (w_ * 512, w_ * 1024, 1024)]):
                    worst = max(worst, self.fp8_gemm_rs_case(m, n, k, out_dtype, columns, seed=1100 + i))
                    cases += 1
                    self.log(f"fp8 gemm_rs M={m} N={n} K={k} columns={columns} {jnp.dtype(out_dtype).name}: ok")
        skipped = []
        for gather_k in (False, True):
            for shared in (False, True):
                for i, (rows, cols, n) in enumerate([(128, 64, 256), (77, 60, 130), (1024, 512, 2048)]):
                    what = f"fp8 ag_gemm rows={rows} cols={cols} N={n} gather_k={gather_k} shared={shared}"
                    err, rule = self.fp8_ag_case(rows, cols, n, gather_k, shared, seed=1200 + i)
                    if rule is not None:
                        skipped.append(what)
                        self.log(f"{what}: not run, the kernels' plan says: {rule}")
                        continue
                    worst = max(worst, err)
                    cases += 1
                    self.log(f"{what}: ok")
        # Both backward recipes, each on the kernels.
        failures = []
        try:
            worst = max(worst, self.fp8_then_half())
            self.log("fp8: an FP8 ag_gemm, then an fp16 one with its gathered operand: ok")
        except AssertionError as e:
            failures.append(str(e))
        try:
            worst = max(worst, self.fp8_grouped_grads())
        except AssertionError as e:
            failures.append(str(e))
        for grad_dtype in ("float16", "float8_e5m2"):
            try:
                worst = max(worst, self.fp8_mlp_grads(w_ * 256, 512, 384, seed=1300, grad_dtype=grad_dtype))
            except AssertionError as e:
                failures.append(str(e))
        if failures:
            raise AssertionError("; ".join(failures))
        self.log("fp8: MLP FP8 forward, fp16 and e5m2 backward, every call fused: ok")
        return (f"fp8: {cases} cases + MLP gradients ok, worst rel error {worst:.2e}"
                + (f"; {len(skipped)} per-shard contraction cases refused by the kernels' plan" if skipped else ""))

    def mixed(self, calls=1000, batch=16):
        """Back-to-back calls of gemm_rs and ag_gemm (both layouts, both pushes) on one communicator:
        the two ops and the two pushes share its epochs, flags and inbox, so a wrong double-buffer
        argument would show as a wrong result."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from entwine_jax import comm

        w_ = self.world
        m, n, k = w_ * 256, 512, 256
        rs_sites, ag_sites = [], []
        for v in range(2):
            xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=1100 + v)
            rs_sites.append((self.gemm_fn(m, n, k, jnp.bfloat16), self.global_arrays(xs, ws), self.reference(xs, ws)))
            for gather_k in (False, True):
                xs, ws = self.ag_inputs(256, 192, 512, jnp.bfloat16, 1200 + v + 10 * gather_k, gather_k)
                call, _ = self.ag_fn(256, 192, 512, jnp.bfloat16, gather_k, push=("sm", "ce")[v])
                ag_sites.append((call, self.ag_globals(xs, ws, gather_k), self.ag_reference(xs, ws, gather_k)[0]))
        sites = [s for pair in zip(rs_sites + rs_sites, ag_sites) for s in pair]
        first, pending, checked = {}, [], 0
        t0 = time.monotonic()
        for i in range(calls):
            j = i % len(sites)
            call, (gx, gw), _ = sites[j]
            pending.append((j, i, call(gx, gw)))
            if len(pending) == batch or i == calls - 1:
                for j_, i_, y in pending:
                    y = self.local(y)
                    if j_ not in first:
                        self.check(y, sites[j_][2], f"mixed call {i_} (site {j_})")
                        first[j_] = y
                    elif not np.array_equal(y.view(np.uint16), first[j_].view(np.uint16)):
                        self.check(y, sites[j_][2], f"mixed call {i_} (site {j_})")
                        raise AssertionError(f"mixed call {i_} site {j_}: differs bitwise from its first call")
                    checked += 1
                pending.clear()
                comm.check_errors()
        jax.block_until_ready(first[0])
        return f"mixed: {checked} calls of both ops checked in {time.monotonic() - t0:.1f} s"

    # -- heap growth --

    def memory_point(self, label):
        """(device bytes in use, summed over the processes on this GPU; XLA's pool bytes, summed
        likewise), measured while every rank waits between two barriers, so no process is mid-call."""
        import json

        from entwine_jax import _distributed, _extension

        _distributed.barrier(f"entwine_test/mem/{label}/before", range(self.world), self.rank, 300_000)
        free, total = _extension.ext().device_memory(self.device.local_hardware_id)
        stats = self.device.memory_stats() or {}
        pool = int(stats.get("pool_bytes", stats.get("bytes_reserved", stats.get("bytes_in_use", 0))))
        _distributed.kv_set(f"entwine_test/mem/{label}/{self.rank}", json.dumps([total - free, pool]).encode())
        sharing = [r for r in range(self.world) if r % self.args.gpus == self.rank % self.args.gpus]
        points = [json.loads(_distributed.kv_get(f"entwine_test/mem/{label}/{r}", 300_000)) for r in sharing]
        _distributed.barrier(f"entwine_test/mem/{label}/after", range(self.world), self.rank, 300_000)
        # Every process on the GPU saw the same device-wide bytes in use; their pools add up.
        return max(p[0] for p in points), sum(p[1] for p in points), len(sharing)

    def heapgrow(self):
        return self.grow_heap(cmdbuf=False)

    def heapgrow_cmdbuf(self):
        if HEAPGROW_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            raise AssertionError("heapgrow_cmdbuf runs with command buffers enabled (launch it as --suite heapgrow)")
        return self.grow_heap(cmdbuf=True)

    def grow_heap(self, cmdbuf):
        import jax
        import jax.numpy as jnp

        from entwine_jax import _distributed, comm

        dtype, n, k = jnp.bfloat16, 8192, 256
        mib = 1 << 20
        start_used, start_pool, sharing = self.memory_point("start")
        worst, first, lines = 0.0, None, []

        def site(i):
            m = 2048 * i * self.world
            xs, ws = self.host_inputs(m, n, k, dtype, seed=300 + i)
            gx, gw = self.global_arrays(xs, ws)
            return m, self.gemm_fn(m, n, k, dtype), gx, gw, self.reference(xs, ws)

        def record(i):
            used, pool, _ = self.memory_point(f"site{i}")
            (_, own, imported, reserved), = comm.heap_usage(self.mesh, "tp")
            gained = (used - start_used - (pool - start_pool)) / sharing
            lines.append(f"site {i}: heap {own // mib} MiB (imported {imported // mib} MiB, reserved "
                         f"{reserved // mib} MiB), device memory gained per process beyond XLA's pool "
                         f"{gained / mib:.0f} MiB (XLA's pool {pool // mib} MiB over {sharing} processes)")
            self.log(lines[-1])
            return own, gained

        for i in range(1, 9):
            m, f, gx, gw, ref = site(i)
            worst = max(worst, self.check(self.local(f(gx, gw)), ref, f"heapgrow site {i} (M={m})"))
            if i == 1:  # recorded (under command buffers) and replayed before any growth
                worst = max(worst, self.check(self.local(f(gx, gw)), ref, "heapgrow site 1, second call"))
                first = (f, gx, gw, ref)
            else:
                del f, gx, gw
            record(i)
        # The first site, compiled (and recorded) against the smallest heap, after the last growth.
        f, gx, gw, ref = first
        exec0 = self.handler_executions()
        for r in range(3):
            worst = max(worst, self.check(self.local(f(gx, gw)), ref, f"heapgrow site 1 after the growths, run {r}"))
        comm.check_errors()
        handler_runs = self.handler_executions() - exec0
        if cmdbuf and handler_runs >= 3:
            raise AssertionError("the first site was recorded again after the growths, never replayed")

        # A trace on rank 0 alone (jax.eval_shape) of a larger site: it waits for the others at most
        # ENTWINE_SETUP_TIMEOUT_MS, then gives up and leaves the heap as it was; the site takes the
        # XLA path in that trace only. Then every rank runs the site: the growth is tried again.
        (_, own_before, _, _), = comm.heap_usage(self.mesh, "tp")
        m, f, gx, gw, ref = site(9)
        if self.rank == 0:
            os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = str(LONE_TRACE_TIMEOUT_MS)
            lone = self.gemm_fn(m, n, k, dtype)  # its own trace: f's cache must not keep the XLA path
            t0 = time.monotonic()
            with jax.set_mesh(self.mesh):
                jax.eval_shape(lone.jitted, gx, gw)
            waited = time.monotonic() - t0
            del os.environ["ENTWINE_SETUP_TIMEOUT_MS"]
            (_, own_after, _, _), = comm.heap_usage(self.mesh, "tp")
            if own_after != own_before:
                raise AssertionError(f"a lone trace changed the heap: {own_before} -> {own_after} bytes")
            if not LONE_TRACE_TIMEOUT_MS / 1000 <= waited < LONE_TRACE_TIMEOUT_MS / 1000 + 30:
                raise AssertionError(f"a lone trace waited {waited:.1f} s (deadline {LONE_TRACE_TIMEOUT_MS} ms)")
            lines.append(f"lone trace on rank 0: gave up after {waited:.1f} s, heap unchanged")
            self.log(lines[-1])
        _distributed.barrier("entwine_test/heapgrow/lone", range(self.world), self.rank, 300_000)
        worst = max(worst, self.check(self.local(f(gx, gw)), ref, f"heapgrow site 9 (M={m}) after the lone trace"))
        del f, gx, gw
        heap, gained = record(9)
        # What the old heaps cost when they were kept: the sum of every heap; now the last one alone.
        if gained > 1.5 * heap:
            raise AssertionError(f"device memory gained per process {gained / mib:.0f} MiB > 1.5 x the last heap "
                                 f"{heap / mib:.0f} MiB: " + "; ".join(lines))
        # entwine_jax.reserve: two larger sites sized by one growth; running them grows nothing more.
        import entwine_jax

        sites = [site(i) for i in (10, 11)]
        with jax.set_mesh(self.mesh):
            sized = entwine_jax.reserve(lambda: [f.jitted(gx, gw) for _, f, gx, gw, _ in sites])
        (_, reserved_heap, _, _), = comm.heap_usage(self.mesh, "tp")
        for i, (m, f, gx, gw, ref) in zip((10, 11), sites):
            worst = max(worst, self.check(self.local(f(gx, gw)), ref, f"heapgrow site {i} (M={m}) after reserve"))
        (_, own, _, _), = comm.heap_usage(self.mesh, "tp")
        if own != reserved_heap or sized.get("tp") != own:
            raise AssertionError(f"reserve sized {sized} ({reserved_heap} bytes mapped), the sites then had {own} bytes")
        return (f"heapgrow{' (command buffers)' if cmdbuf else ''}: worst rel error {worst:.2e}; first site after "
                f"the growths: {handler_runs} handler runs in 3 calls; last heap {heap // mib} MiB, gained "
                f"{gained / mib:.0f} MiB per process beyond XLA's pool; reserve for two more sites: "
                f"{own // mib} MiB, no growth while they ran")

    def hostcost(self, calls=200):
        """Mean host time of one handler execution, per op, from the extension's own counters."""
        import jax
        import jax.numpy as jnp

        from entwine_jax import _extension, comm

        w_ = self.world
        m, n, k = w_ * 1024, 4096, 1024
        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=1300)
        sites = [("gemm_rs", self.gemm_fn(m, n, k, jnp.bfloat16), self.global_arrays(xs, ws), self.reference(xs, ws))]
        for gather_k in (False, True):
            xs, ws = self.ag_inputs(1024, 1024, 2048, jnp.bfloat16, 1310 + gather_k, gather_k)
            call, _ = self.ag_fn(1024, 1024, 2048, jnp.bfloat16, gather_k)
            sites.append((f"ag_gemm {'contraction' if gather_k else 'rows'}", call,
                          self.ag_globals(xs, ws, gather_k), self.ag_reference(xs, ws, gather_k)[0]))
        parts = []
        # Twice per site: the ranks calling together, then every rank but 0 starting each call 2 ms
        # late, so that rank 0's handler runs while no other process has a kernel on the GPU (as with
        # a GPU per process); ranks sharing a GPU slow each other's launches.
        for lag in (0.0, 0.002):
            for name, call, (gx, gw), ref in sites:
                self.check(self.local(call(gx, gw)), ref, f"hostcost {name} warm-up")
                (_, calls0, mean0), = comm.handler_cost(self.mesh, "tp")
                (_, _, phases0), = comm.handler_phases(self.mesh, "tp")
                # One call at a time, each waited for: with work queued, a launch can block until the
                # GPU frees a slot of its queue, and the handler's time would measure the GPU instead.
                for _ in range(calls):
                    if lag and self.rank != 0:
                        time.sleep(lag)
                    y = jax.block_until_ready(call(gx, gw))
                comm.check_errors()
                self.check(self.local(y), ref, f"hostcost {name}")
                (_, calls1, mean1), = comm.handler_cost(self.mesh, "tp")
                (_, _, phases1), = comm.handler_phases(self.mesh, "tp")
                execs = calls1 - calls0
                per_exec = (calls1 * mean1 - calls0 * mean0) / max(execs, 1)
                by_phase = ", ".join(f"{p} {(calls1 * phases1[p] - calls0 * phases0[p]) / max(execs, 1):.1f}"
                                     for p in comm.HOST_PHASES)
                parts.append(f"{name}{' (ranks > 0 late)' if lag else ''}: {execs} handler executions for "
                             f"{calls} calls, {per_exec:.1f} us each ({by_phase})")
        parts.append(self.scanned_block_cost())
        # gemm_rs's CUDA calls alone (two launches, the second a programmatic dependent) from this
        # process's main thread: their floor here, against the launch phases above (handler on XLA's
        # thread); with the GPU idle, then while an XLA program runs (dispatched, not yet waited for).
        device = jax.local_devices()[0].local_hardware_id
        floor = _extension.ext().call_sequence_us(device, 200)
        a = jnp.ones((8192, 8192), jnp.bfloat16)
        busy = jax.jit(lambda a: jax.lax.fori_loop(0, 200, lambda i, b: (b @ a) * 1e-4, a))
        jax.block_until_ready(busy(a))
        pending = busy(a)
        during = _extension.ext().call_sequence_us(device, 200)
        jax.block_until_ready(pending)
        parts.append(f"gemm_rs's CUDA calls alone from the main thread: {floor:.1f} us (GPU idle), "
                     f"{during:.1f} us (an XLA program running)")
        return "hostcost: " + "; ".join(parts)

    def scanned_block_cost(self, layers=8, runs=50):
        """Host time per step of a lax.scan over `layers` MLP blocks (ag_gemm over rows -> silu ->
        gemm_rs over rows: MaxText's scan_layers, where XLA 0.11.2 runs the handlers at every step),
        every step's result checked against float64 on the host."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        w_, bf = self.world, jnp.bfloat16
        tl, d, fl = 256, 512, 512  # tokens, embed and mlp width per rank
        rng = np.random.default_rng(1400)
        xs = [(rng.standard_normal((tl, d), np.float32) / np.sqrt(d)).astype(bf) for _ in range(w_)]
        w1 = [[rng.standard_normal((d, fl), np.float32).astype(bf) for _ in range(w_)] for _ in range(layers)]
        w2 = [[(rng.standard_normal((fl, d), np.float32) / np.sqrt(w_ * fl)).astype(bf) for _ in range(w_)]
              for _ in range(layers)]
        r = self.rank
        gx = self.place(xs[r], 0, (w_ * tl, d))
        gw1 = self.place(np.stack([w1[i][r] for i in range(layers)]), 2, (layers, d, w_ * fl))
        gw2 = self.place(np.stack([w2[i][r] for i in range(layers)]), 1, (layers, w_ * fl, d))
        ag_config = dataclasses.replace(entwine_jax.ag_heuristic_config(tl, fl, d, w_, bf), path="fused")
        rs_config = self.fused_config(w_ * tl, d, fl, bf)

        def body(x, w1s, w2s):
            def step(carry, ws):
                h = entwine_jax.ag_gemm(x, ws[0], axis_name="tp", gather_dimension=0, config=ag_config)
                return carry, entwine_jax.gemm_rs(jax.nn.silu(h), ws[1], axis_name="tp", config=rs_config)
            return jax.lax.scan(step, None, (w1s, w2s))[1]

        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("tp", None), P(None, None, "tp"),
                                                                  P(None, "tp", None)),
                                  out_specs=P(None, "tp", None), check_vma=False))

        def run():
            with jax.set_mesh(self.mesh):
                return jax.block_until_ready(f(gx, gw1, gw2))

        ys = self.local(run())
        comm.check_errors()
        g = np.concatenate([x.astype(np.float64) for x in xs])
        rows = slice(r * tl, (r + 1) * tl)
        silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
        for i in range(layers):
            ref = sum(silu(g @ w1[i][q].astype(np.float64))[rows] @ w2[i][q].astype(np.float64) for q in range(w_))
            self.check(ys[i], ref, f"scanned block, step {i}")
        (_, calls0, mean0), = comm.handler_cost(self.mesh, "tp")
        t0 = time.perf_counter()
        for _ in range(runs):
            run()
        wall = time.perf_counter() - t0
        comm.check_errors()
        (_, calls1, mean1), = comm.handler_cost(self.mesh, "tp")
        steps = runs * layers
        host_us = (calls1 * mean1 - calls0 * mean0) / steps
        return (f"scanned {layers}-layer MLP block (ag_gemm + gemm_rs per step): {(calls1 - calls0) / steps:.1f} "
                f"handler executions and {host_us:.1f} us of handler time per step, {wall / steps * 1e6:.0f} us "
                f"wall per step")

    # Llama projections per model (hidden, mlp, kv width): q/k/v and gate/up gather the tokens
    # (ag_gemm, rows layout), o and down scatter them (gemm_rs): (name, op, K of the call, N of the call).
    SMALL_MODELS = (("8B", 4096, 14336, 1024), ("70B", 8192, 28672, 1024))
    SMALL_TOKENS = (16, 64, 256, 1024, 2048)

    def small_projections(self, hidden, mlp, kv):
        w_ = self.world
        return (("qkv", "ag_gemm", hidden, (hidden + 2 * kv) // w_), ("o", "gemm_rs", hidden // w_, hidden),
                ("gate/up", "ag_gemm", hidden, 2 * mlp // w_), ("down", "gemm_rs", mlp // w_, hidden))

    def smallshapes(self, iters=40, batch=10):
        """The fused op (path="fused") against XLA's path on every projection and token count: XLA's
        GEMM alone on this rank's operands plus the transfer at tuning.crossover's link rate (XLA's
        collective cannot run between processes of one GPU). Max over ranks of interleaved medians."""
        import itertools

        import jax
        import jax.numpy as jnp
        import numpy as np

        import entwine_jax
        from entwine_jax import _distributed, comm
        from entwine_jax.ag_gemm import config as ag_config
        from entwine_jax.ag_gemm import op as ag_op
        from entwine_jax.gemm_rs import op as rs_op
        from entwine_jax.tuning import crossover, timing

        w_, bf = self.world, jnp.bfloat16
        batches = itertools.count()
        costs = crossover.COSTS
        key = jax.random.key(1500 + self.rank)
        rows, fits = [], {"gemm_rs": [], "ag_gemm": []}
        header = f"{'model':5} {'proj':7} {'tokens':>6} {'M':>6} {'N':>6} {'K':>6} {'fused_us':>9} {'xla_us':>8} " \
                 f"{'gemm_us':>8} {'link_us':>8} {'rule':>5} {'winner':>6}"
        for model, hidden, mlp, kv in self.SMALL_MODELS:
            for proj, op, k, n in self.small_projections(hidden, mlp, kv):
                for t in self.SMALL_TOKENS:
                    m = w_ * t  # the GEMM's rows: the gathered tokens (ag_gemm) or the unscattered ones (gemm_rs)
                    ka, kb = jax.random.split(jax.random.fold_in(key, len(rows)))
                    with jax.default_device(self.device):
                        if op == "gemm_rs":
                            x = (jax.random.normal(ka, (m, k), jnp.float32) / np.sqrt(w_ * k)).astype(bf)
                            gx = self.place(x, 1, (m, w_ * k))
                            a_full = x
                            moved = (w_ - 1) / w_ * m * n * 2
                        else:
                            x = (jax.random.normal(ka, (t, k), jnp.float32) / np.sqrt(k)).astype(bf)
                            gx = self.place(x, 0, (m, k))
                            a_full = jnp.concatenate([x] * w_)  # the gathered operand's shape
                            moved = (w_ - 1) * t * k * 2
                        w = jax.random.normal(kb, (k, n), jnp.float32).astype(bf)
                    if op == "gemm_rs":
                        gw = self.place(w, 0, (w_ * k, n))
                        fused = self.gemm_fn(m, n, k, bf)
                    else:
                        gw = self.place(w, 1, (k, w_ * n))
                        fused, _ = self.ag_fn(t, k, n, bf, False)
                    gemm = jax.jit(lambda a, b: a @ b)
                    # Every process times the same batch of the same program at once (they share the GPU).
                    barrier = lambda: _distributed.barrier(f"entwine_test/small/{next(batches)}", range(w_),  # noqa: E731
                                                           self.rank, 120_000)
                    ms = timing.time_interleaved({"fused": (fused, (gx, gw)), "gemm": (gemm, (a_full, w))},
                                                 iters=iters, warmup=5, batch=batch, before_batch=barrier)
                    comm.check_errors()
                    fused_ms, gemm_ms = timing.max_over_processes([ms["fused"], ms["gemm"]])
                    link_ms = moved / (costs.link_gbps * 1e9) * 1e3
                    xla_ms = gemm_ms + link_ms
                    flops = 2.0 * m * n * k
                    push = ag_config.push_of(entwine_jax.ag_heuristic_config(t, n, k, w_, bf), t * k * 2) \
                        if op == "ag_gemm" else None
                    fixed = rs_op.fixed_us() if op == "gemm_rs" else ag_op.fixed_us(push)
                    rule = "xla" if crossover.fused_cannot_win(fixed, flops, moved) else "fused"
                    winner = "fused" if fused_ms < xla_ms else "xla"
                    # The fixed cost the rule assumes: what the fused op takes beyond the longer of its
                    # GEMM and its transfer (the overlap's bound).
                    fits[op].append((fused_ms - max(gemm_ms, link_ms)) * 1e3)
                    rows.append((model, proj, t, m, n, k, fused_ms * 1e3, xla_ms * 1e3, gemm_ms * 1e3, link_ms * 1e3,
                                 rule, winner))
                    self.log(f"smallshapes {model} {proj} T={t}: fused {fused_ms * 1e3:.1f} us, XLA path "
                             f"{xla_ms * 1e3:.1f} us")
        if self.rank == 0:
            print(header, flush=True)
            for r in rows:
                print(f"{r[0]:5} {r[1]:7} {r[2]:>6} {r[3]:>6} {r[4]:>6} {r[5]:>6} {r[6]:>9.1f} {r[7]:>8.1f} {r[8]:>8.1f} "
                      f"{r[9]:>8.1f} {r[10]:>5} {r[11]:>6}", flush=True)
        fitted = {op: float(np.median(v)) for op, v in fits.items()}
        wrong = [f"{r[0]} {r[1]} T={r[2]}" for r in rows if r[10] != r[11]]
        # Processes sharing one GPU without MPS take turns on it (time slices of milliseconds): a fused
        # call waits for its peer's turn, so its time is the slice, not the op's.
        shared = (" (ranks share a GPU: the fused times are the driver's time slices between processes, not "
                  "the ops' costs; only --gpus W measures the crossover)" if self.args.gpus < self.world else "")
        return (f"smallshapes{shared}: {len(rows)} shapes; fitted fixed_us (median of fused - max(GEMM, link)): "
                f"gemm_rs {fitted['gemm_rs']:.1f}, ag_gemm {fitted['ag_gemm']:.1f} (the ops declare gemm_rs "
                f"{rs_op.fixed_us():.0f}, ag_gemm {ag_op.fixed_us('ce'):.0f} / {ag_op.fixed_us('sm'):.0f} with the copy "
                f"engines / the SM push); the rule disagrees with the measurement on {len(wrong)}: "
                f"{', '.join(wrong) or 'none'}")

    def forward(self):
        """Explicit configs, then fused calls beside a kernel of another stream that holds SMs."""
        import jax.numpy as jnp
        import numpy as np

        from entwine_jax import AgGemmConfig, GemmRsConfig, _extension

        w_ = self.world
        sms = _extension.sm_count()
        done = []
        m, n, k = 2048 * w_, 4096, 256
        # The dataclass defaults (producer_sms = 0) and the largest grids a user may write: the GEMM
        # never waits, so its grid may exceed what fits beside the consumer.
        rs_configs = [GemmRsConfig(path="fused"), GemmRsConfig(producer_sms=sms, consumer_grid=16, path="fused"),
                      GemmRsConfig(producer_sms=sms, consumer_grid=64, block_n=256, path="fused")]
        for i, config in enumerate(rs_configs):
            xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=4100 + i)
            ref = self.reference(xs, ws)
            f = self.gemm_fn(m, n, k, jnp.bfloat16, config=config)
            y = self.local(f(*self.global_arrays(xs, ws)))
            self.check(y, ref, f"gemm_rs {config}")
            self.log(f"forward: gemm_rs {config}: ok")
            done.append("rs")
        # ag_gemm: the dataclass defaults and each push at the largest GEMM grid it allows.
        ag_configs = [AgGemmConfig(path="fused"), AgGemmConfig(gemm_sms=sms - 1, push="ce", path="fused"),
                      AgGemmConfig(gemm_sms=sms - 16, push="sm", push_sms=16, path="fused")]
        for i, config in enumerate(ag_configs):
            for gather_k in (False, True):
                self.ag_config_case(1024, 512, 1024, jnp.bfloat16, gather_k, 4200 + 2 * i + gather_k, config)
                self.log(f"forward: ag_gemm {'contraction' if gather_k else 'rows'} {config}: ok")
                done.append("ag")
        # A kernel of another stream holding FORWARD_HELD_SMS SMs of rank 0's GPU, released only after
        # the calls beside it returned: they must fit (the reserve leaves it its SMs). Everything is
        # compiled and placed first: compiling or allocating may synchronise the whole device, which
        # would wait for the held kernel whatever our kernels do.
        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=4300)
        ref = self.reference(xs, ws)
        gx, gw = self.global_arrays(xs, ws)
        f = self.gemm_fn(m, n, k, jnp.bfloat16, config=GemmRsConfig(path="fused"))
        self.check(self.local(f(gx, gw)), ref, "gemm_rs before holding")
        ag_runs = []
        for gather_k, config in ((False, AgGemmConfig(path="fused")), (True, AgGemmConfig(push="sm", path="fused"))):
            axs, aws = self.ag_inputs(1024, 512, 1024, jnp.bfloat16, 4301 + gather_k, gather_k)
            call, _ = self.ag_fn(1024, 512, 1024, jnp.bfloat16, gather_k, config=config)
            args = self.ag_globals(axs, aws, gather_k)
            aref, _ = self.ag_reference(axs, aws, gather_k)
            self.check(self.local(call(*args)), aref, "ag_gemm before holding")
            ag_runs.append((call, args, aref))
        self.barrier("forward_compiled")
        held = self.hold_sms(FORWARD_HELD_SMS, bound_ms=60000)
        self.log(f"forward: {held.started if held else '-'} held CTAs running")
        t0 = time.monotonic()
        self.check(self.local(f(gx, gw)), ref, "gemm_rs beside")
        for call, args, aref in ag_runs:
            self.check(self.local(call(*args)), aref, "ag_gemm beside")
        beside = time.monotonic() - t0
        self.log(f"forward: gemm_rs and ag_gemm beside the held SMs: ok ({beside:.1f} s)")
        if held is not None:
            if held.started != FORWARD_HELD_SMS:
                raise AssertionError(f"the held kernel has {held.started} of {FORWARD_HELD_SMS} CTAs running")
            if beside > 30:
                raise AssertionError(f"the calls beside the held SMs took {beside:.1f} s: they waited for its bound")
            held.release()
        self.barrier("forward_beside")
        # Every SM held: a call can only finish once the held kernel ends (released after 2 s).
        held = self.hold_sms(sms, bound_ms=60000)
        self.log(f"forward: {held.started if held else '-'} held CTAs running (all SMs)")
        if held is not None:
            threading.Timer(2.0, held.release).start()
        t0 = time.monotonic()
        self.check(self.local(f(gx, gw)), ref, "gemm_rs after release")
        after = time.monotonic() - t0
        return (f"{len(done)} explicit-config calls correct; beside {FORWARD_HELD_SMS} held SMs: 3 calls in "
                f"{beside:.1f} s; all SMs held: finished {after:.1f} s after the call (released at 2 s)")

    def hold_sms(self, ctas, bound_ms):
        """On rank 0: a kernel of another stream holding `ctas` SMs of this GPU (tests' SmHold), once
        they all run; None elsewhere."""
        if self.rank != 0:
            return None
        from entwine_jax import _extension

        held = _extension.ext().SmHold(int(self.device.local_hardware_id), int(ctas), int(bound_ms))
        deadline = time.monotonic() + 30
        while held.started < min(ctas, _extension.sm_count()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return held

    def barrier(self, name):
        from entwine_jax import _distributed

        _distributed.barrier(f"entwine_test/{name}", range(self.world), self.rank, 120_000)

    def ag_config_case(self, rows, cols, n, dtype, gather_k, seed, config):
        """One ag_gemm call with `config` (path="fused") against the host reference."""
        import numpy as np

        xs, ws = self.ag_inputs(rows, cols, n, dtype, seed, gather_k)
        call, _ = self.ag_fn(rows, cols, n, dtype, gather_k, config=config)
        y = self.local(call(*self.ag_globals(xs, ws, gather_k)))
        ref, _ = self.ag_reference(xs, ws, gather_k)
        self.check(y, ref, f"ag_gemm {'contraction' if gather_k else 'rows'} {config}")

    def agmissing(self):
        import jax.numpy as jnp

        from entwine_jax import comm

        xs, ws = self.ag_inputs(128, 64, 256, jnp.bfloat16, 17, False)
        call, _ = self.ag_fn(128, 64, 256, jnp.bfloat16, False)
        gx, gw = self.ag_globals(xs, ws, False)
        self.check(self.local(call(gx, gw)), self.ag_reference(xs, ws, False)[0], "agmissing: warm-up call")
        comm.check_errors()
        absent = self.world - 1
        # Either wait may pass its deadline first: the GEMM's for a chunk of the absent rank, or a
        # transfer stream's for the absent rank's announcement of the call.
        return self.absent_rank("agmissing", lambda: call(gx, gw),
                                (f"of the shard of rank {absent}", f"for rank {absent} to start the call"), None)

    def missing(self):
        import jax.numpy as jnp

        from entwine_jax import comm

        m, n, k = self.world * 128, 128, 64  # one tile per rank: one deadline, not one per tile
        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=7)
        gx, gw = self.global_arrays(xs, ws)
        f = self.gemm_fn(m, n, k, jnp.bfloat16)
        self.check(self.local(f(gx, gw)), self.reference(xs, ws), "missing: warm-up call")
        comm.check_errors()
        absent = self.world - 1
        return self.absent_rank("missing", lambda: f(gx, gw), f"from rank {absent}", "entwine gemm_rs")

    def skipcall(self):
        """The last rank skips one call of a sequence of two different calls (a caught error on one
        rank, say): at the same epoch it runs the second call while its peers run the first. Every
        rank must fail with an error (the ranks that see it: one naming both calls), every output
        since is NaN, nothing hangs, and the next call is refused."""
        import jax.numpy as jnp

        w_ = self.world
        first = (w_ * 128, 256, 128)
        second = (w_ * 256, 384, 64)
        calls = {}
        for name, (m, n, k) in (("first", first), ("second", second)):
            xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=len(calls) + 31)
            calls[name] = (self.gemm_fn(m, n, k, jnp.bfloat16), self.global_arrays(xs, ws), self.reference(xs, ws))
        sequence = ["second", "second"] if self.rank == w_ - 1 else ["first", "second", "second"]
        return self.disagreement("skipcall", calls, sequence)

    def disagree(self):
        """Same shape, different plans: the last rank runs the call with another config (a tuned
        table that differs between ranks, say). Its signature differs: every rank fails, one of them
        naming both calls, instead of adding up partial tiles of different layouts."""
        import dataclasses

        import jax.numpy as jnp

        m, n, k = self.world * 256, 512, 256
        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=41)
        config = self.fused_config(m, n, k, jnp.bfloat16)
        other = dataclasses.replace(config, consumer_grid=config.consumer_grid // 2 if config.consumer_grid > 1 else 2)
        calls = {"agreed": (self.gemm_fn(m, n, k, jnp.bfloat16), self.global_arrays(xs, ws), self.reference(xs, ws)),
                 "own": (self.gemm_fn(m, n, k, jnp.bfloat16, config=other if self.rank == self.world - 1 else None),
                         self.global_arrays(xs, ws), self.reference(xs, ws))}
        return self.disagreement("disagree", calls, ["own", "agreed"], warm=["agreed"])

    def disagreement(self, suite, calls, sequence, warm=None):
        """Warm-up: the calls `warm` (default: all) of `calls` ({name: (f, (gx, gw), reference)}) once on
        every rank, checked.
        Then this rank runs `sequence` (ranks differ): every rank must get an error from check_errors
        (a mismatch naming both calls, or the abort of a peer that saw one) within a few seconds, every
        output of the sequence must be all NaN or its call must raise, and the next call must be refused."""
        import jax
        import numpy as np

        from entwine_jax import _distributed, comm

        for name in warm or sorted(calls):
            f, (gx, gw), ref = calls[name]
            self.check(self.local(f(gx, gw)), ref, f"{suite}: warm-up {name}")
        comm.check_errors()
        _distributed.barrier(f"entwine_test/{suite}_warm", range(self.world), self.rank, 120_000)
        t0 = time.monotonic()
        outputs = []
        for name in sequence:
            f, (gx, gw), _ = calls[name]
            try:
                outputs.append((name, self.local(jax.block_until_ready(f(gx, gw)))))
            except Exception as e:  # the handler refused: the error was already seen on this rank
                outputs.append((name, f"{type(e).__name__}"))
        waited = time.monotonic() - t0
        try:
            comm.check_errors()
        except RuntimeError as e:
            message = str(e)
        else:
            raise AssertionError(f"{suite}: no error after {waited:.1f} s although the ranks ran different calls")
        if "while rank" not in message and "gave up on the communicator" not in message:
            raise AssertionError(f"{suite}: the error is neither a mismatch nor an abort: {message}")
        # A process names the calls it traced; a peer's call it never traced is named by its signature.
        if "while rank" in message and message.count("gemm_rs bfloat16") + message.count("(signature ") != 2:
            raise AssertionError(f"{suite}: the mismatch does not name both calls: {message}")
        for name, y in outputs:
            if isinstance(y, np.ndarray) and not np.isnan(y.astype(np.float32)).all():
                raise AssertionError(f"{suite}: an output of call {name} after the failure is not all NaN")
        if waited > 10 * MISSING_TIMEOUT_MS / 1000 + 20:
            raise AssertionError(f"{suite}: the failure took {waited:.1f} s")
        f, (gx, gw), _ = calls[sequence[-1]]
        self.expect_refused(lambda: f(gx, gw), None, f"{suite}: a call after the failure was not refused")
        _distributed.barrier(f"entwine_test/{suite}_done", range(self.world), self.rank, 120_000)
        return f"{suite}: failed after {waited:.1f} s with: {message[:200]}"

    def expect_refused(self, call, op, failure):
        """call() must raise (an XlaRuntimeError from the handler of a poisoned communicator), with `op`
        in its message unless op is None; else AssertionError(failure)."""
        import jax

        try:
            jax.block_until_ready(call())
        except Exception as e:
            if op is not None and op not in str(e):
                raise
        else:
            raise AssertionError(failure)

    def absent_rank(self, suite, call, names_absent, op):
        """The last rank skips one call; every other rank must get the deadline error (naming the
        absent rank as `names_absent`, or one of its phrases, says, and the timeout) within the deadline and never hang; with
        `op`, its next call must then be refused by the poisoned communicator with an error naming it."""
        import jax

        from entwine_jax import _distributed, comm

        absent = self.world - 1
        if self.rank == absent:
            detail = f"{suite}: skipped the call"
        else:
            t0 = time.monotonic()
            jax.block_until_ready(call())
            waited = time.monotonic() - t0
            try:
                comm.check_errors()
            except RuntimeError as e:
                message = str(e)
            else:
                raise AssertionError(f"no deadline error after {waited:.1f} s although rank {absent} never called")
            names = (names_absent,) if isinstance(names_absent, str) else names_absent
            if not any(n in message for n in names) or f"waited {MISSING_TIMEOUT_MS} ms" not in message:
                raise AssertionError(f"deadline error does not name rank {absent} and the timeout: {message}")
            if waited > 10 * MISSING_TIMEOUT_MS / 1000 + 20:
                raise AssertionError(f"the deadline took {waited:.1f} s")
            # The communicator is poisoned: the next call fails in the handler, before any launch.
            if op is not None:
                self.expect_refused(call, op, "a call after the deadline error did not fail")
            detail = f"{suite}: deadline reported after {waited:.1f} s: {message[:120]}"
        # The absent rank keeps its heap mapped until the others are done with it.
        _distributed.barrier(f"entwine_test/{suite}_done", range(self.world), self.rank, 120_000)
        return detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="number of ranks (processes), 1..8")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs to spread the ranks over (rank r on GPU r %% gpus)")
    parser.add_argument("--suite", default="quick",
                        help="quick, ag, stress, mixed, missing, agmissing, cmdbuf, cmdbufmissing, skipcall, disagree, "
                             "heapgrow, fp8, hostcost, smallshapes, all, or a comma-separated list")
    parser.add_argument("--timeout", type=float, default=900, help="wall-clock limit per suite in seconds; stragglers are killed")
    parser.add_argument("--mps", action="store_true",
                        help="run the ranks as clients of a private CUDA MPS server (concurrent, not time-sliced)")
    parser.add_argument("--mps-percent", type=int, default=None,
                        help="with --mps: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of every rank (1..100)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.world <= 8:
        parser.error(f"--world must be in [1, 8], got {args.world}")
    if args.mps_percent is not None and not (args.mps and 1 <= args.mps_percent <= 100):
        parser.error("--mps-percent needs --mps and a value in [1, 100]")
    return launch(args) if args.rank is None else rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
