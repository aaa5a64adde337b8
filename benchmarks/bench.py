# The benchmark program (docs/performance.md, "Reading the numbers"): per shape, XLA GEMM, XLA reduce-scatter, XLA
# GEMM->RS (the baseline), XLA windowed einsum and entwine gemm_rs, one process driving every local
# device. Prints one comparable line per shape and a geomean; optional JSON and plot. The command line
# of --op ag_gemm (bench_ag) and --op mlp (bench_mlp, the layer-level bar) too, in both process models.
"""The benchmark of the fused ops: per shape, XLA's GEMM, reduce-scatter, GEMM->reduce-scatter (the
baseline) and windowed einsum against entwine's gemm_rs, one process driving every local device; one
line per shape and a geomean. Without CUDA GPUs the timings mean nothing: it then runs one small
smoke shape (unless --shapes is given) with fewer calls. On GPUs it refuses to time the XLA path
when the compiled extension is missing (--allow-xla times it anyway)."""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import entwine_jax
import bench_ag_gemm as bench_ag
import bench_mlp
import runner as bench_run
from entwine_jax import _extension, _log, census
from entwine_jax.gemm_rs import op as gemm_rs_op
# XLA's windowed-einsum flags (per compile): one definition for every op's benchmark.
from runner import WINDOWED_OPTIONS
from entwine_jax.ag_gemm.config import AgGemmConfig
from entwine_jax.gemm_rs.config import GemmRsConfig, with_overrides
# Re-exported: scripts and tests take the protocol's pieces from here too.
from entwine_jax.tuning.timing import DESIGN_SUITE, SHORT_NAMES, TOL, parse_dtype, parse_shapes, rel_err  # noqa: F401
from entwine_jax.tuning.timing import rounds, time_interleaved
from entwine_jax.gemm_rs.table import select_config

AXIS = "tp"
# Budget sweep: same M, N, one communication-bound (small K) and one GEMM-bound (large K) shape.
SWEEP_SHAPES = [(8192, 8192, 1024), (8192, 8192, 3584)]
BUDGETS = (8, 12, 16, 20, 24, 28, 32, 40)
# Without CUDA GPUs: one shape that compiles and runs in about a second on CPU (M adjusted to W).
SMOKE_SHAPE = (256, 256, 64)
# Timed calls and warm-ups per program: on CUDA GPUs, and elsewhere (where timings mean nothing).
GPU_ITERS, GPU_WARMUP = 100, 20
SMOKE_ITERS, SMOKE_WARMUP = 10, 2
OPS = ("gemm_rs", "ag_gemm", "mlp")
DEFAULT_LAYOUTS = {"ag_gemm": ["rows"], "mlp": ["rows", "hidden"]}
LAYOUT_NAMES = {"ag_gemm": {"hidden": "contraction"}, "mlp": {"contraction": "hidden"}}
OPS_HELP = """

--op ag_gemm: ag_gemm against XLA's all-gather alone, GEMM alone, all-gather->GEMM (the baseline)
and windowed einsum. A shape MxNxK is the GEMM [M, K] @ [K, N] that every rank runs after the
gather; rows layout: each rank holds x [M/W, K]; contraction: x [M, K/W]; w [K, N] (its own
columns) in both. Suite: the gate/up projections of the --op mlp shapes (embed 4096 / mlp 14336
and 8192 / 28672, 8192 and 16384 tokens): M = tokens, N = mlp/W, K = embed.

--op mlp: the SwiGLU MLP block y = silu(x @ w_gate) * (x @ w_up) @ w_down, forward + backward
under jit (y and the gradients of sum(y * c) w.r.t. x and the three weights), bf16. Layouts: rows
(sequence parallel: x [T/W, D] per rank) and hidden (x [T, D/W]). Columns: ours (ag_gemm for
gate/up, gemm_rs for down, every collective fused), plain XLA (all_gather + dots, dot +
psum_scatter), XLA with its windowed-einsum flags, and the bound (the same GEMMs on the gathered
shapes with no collective). A shape TxDxF: T tokens per tensor group, embed D, mlp F (F/W per
rank). Suite: embed 4096 / mlp 14336 and 8192 / 28672 at 8192 and 16384 tokens.

W processes: --processes W [--gpus G] starts W ranks on localhost (jax.distributed); where they
share a GPU, NCCL cannot run, so only entwine, XLA's GEMMs and the bound are timed:
    python benchmarks/bench.py --op mlp --processes 2            # 2 ranks on one GPU
    python benchmarks/bench.py --op ag_gemm                      # one process, every local GPU
"""



def _fused_target() -> str:
    """The custom-call name the fused gemm_rs lowers to (defined once, in the extension)."""
    ext, _ = _extension.module()
    return ext.GEMM_RS_TARGET if ext is not None else "(no extension)"

def parse_layouts(text):
    """'rows,hidden' -> ['rows', 'hidden'] (an argparse type; which layouts an op takes is checked later)."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [x for x in items if x not in ("rows", "contraction", "hidden")]
    if not items or bad:
        raise argparse.ArgumentTypeError(
            f"--layout: expected rows, contraction or hidden (comma-separated), got {text!r}")
    return items


def parse_configs(text, config_class=GemmRsConfig):
    """'block_n=256,consumer_grid=16;block_n=128' -> [{'block_n': 256, 'consumer_grid': 16}, ...].

    An empty item stands for the config the op selects itself: ';raster_rows=1' times that config
    and one variant of it. config_class: GemmRsConfig, or AgGemmConfig for --op ag_gemm."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    configs = []
    items = [s.strip() for s in text.split(";")]
    if not any(items):
        raise argparse.ArgumentTypeError("--configs: no config given")
    for item in items:
        kwargs = {}
        for pair in filter(None, (s.strip() for s in item.split(","))):
            key, sep, value = pair.partition("=")
            if not sep or key.strip() not in fields or not (key.strip() == "path" or value.strip().isdigit()):
                raise argparse.ArgumentTypeError(
                    f"--configs: expected key=int (or path=str) with key in {sorted(fields)}, got {pair!r}")
            kwargs[key.strip()] = value.strip() if key.strip() == "path" else int(value)
        try:  # validate now, not after minutes of benchmarking
            config_class(**kwargs)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--configs {item!r}: {e}") from None
        configs.append(kwargs)
    return configs


class Progress:
    """Timed rounds done out of all, on stderr (stdout stays the table): a tqdm bar when tqdm is
    installed, else a line per phase and at most one per 2 s of rounds. Compiles and checks are
    phases, shown as the bar's description, not counted: the count is timed work."""

    def __init__(self, total):
        self.done, self.total, self.what = 0, total, ""
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, file=sys.stderr, leave=False, unit="round")
        except ImportError:
            self._bar, self._printed = None, 0.0

    def _line(self):
        print(f"[{self.done}/{self.total} timed rounds] {self.what}", file=sys.stderr, flush=True)
        self._printed = time.monotonic()

    def phase(self, what):
        self.what = what
        if self._bar is not None:
            self._bar.set_description(what)
        else:
            self._line()

    def step(self, _round=None):
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.done == self.total or time.monotonic() - self._printed >= 2.0:
            self._line()

    def close(self):
        if self._bar is not None:
            self._bar.close()


class Bench:
    def __init__(self, args):
        self.args = args
        self.dtype = jnp.dtype(args.dtype)
        devices = jax.local_devices()[: max(1, args.world)]
        self.world = len(devices)
        # Explicit axes: jnp.dot takes out_sharding, as a user of sharding annotations writes it.
        self.mesh = jax.make_mesh((self.world,), (AXIS,), (jax.sharding.AxisType.Explicit,), devices=devices)
        try:
            entwine_jax.setup(self.mesh, AXIS)  # the fused path finds its devices under jit
        except Exception as e:  # no fused module: gemm_rs will say why it uses XLA
            print(f"entwine_jax.setup failed ({type(e).__name__}: {e})", file=sys.stderr)
        self.x_spec, self.w_spec = P(None, AXIS), P(AXIS, None)

    def warm_up(self, seconds=1.0):
        """Back-to-back GEMMs on every device first: an idle GPU starts at a low clock, which
        otherwise lands on the first shape's columns (their XLA and entwine times ~20% high; see
        docs/performance.md). The columns are timed in interleaved rounds, so what is left of a slow
        start weighs on all of them alike. GPUs only: on CPU the timings mean nothing anyway."""
        if self.mesh.devices.flat[0].platform != "gpu":
            return
        x = jax.device_put(jnp.ones((8192, 8192), self.dtype), NamedSharding(self.mesh, P()))
        step = self.compile(lambda a: jnp.dot(a, a), x)[1]
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            jax.block_until_ready([step(x) for _ in range(10)])

    def compile(self, fn, *args, options=None):
        with jax.set_mesh(self.mesh):
            lowered = jax.jit(fn).lower(*args)
            return lowered, lowered.compile(compiler_options=options)

    def shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def inputs(self, m, n, k, seed):
        """Global x [M, W*K] and w [W*K, N] sharded on K: fresh normal values per shape, never zeros."""
        dtype, world = self.dtype, self.world

        def make(key):
            kx, kw = jax.random.split(jax.random.fold_in(key, jax.lax.axis_index(AXIS)))
            # w scaled so outputs stay O(1): fp16 must not overflow at K_total = 6656 * 8.
            w = jax.random.normal(kw, (k, n), jnp.float32) / math.sqrt(k * world)
            return jax.random.normal(kx, (m, k), jnp.float32).astype(dtype), w.astype(dtype)

        gen = self.shard_map(make, P(), (self.x_spec, self.w_spec))
        with jax.set_mesh(self.mesh):
            return jax.jit(gen)(jax.random.key(seed))

    def timed_interleaved(self, programs, progress):
        a = self.args
        return time_interleaved(programs, a.iters, a.warmup, a.batch, on_round=progress.step)

    def entwine(self, x, w, config):
        """(compiled, path, reason) of gemm_rs with `config`; path is what the program really runs."""
        fn = self.shard_map(lambda x, w: entwine_jax.gemm_rs(x, w, axis_name=AXIS, config=config),
                            (self.x_spec, self.w_spec), P(AXIS))
        lowered, compiled = self.compile(fn, x, w)
        # The FFI target in the lowered program is the proof; the reason is for the user.
        if _fused_target() in lowered.as_text():
            return compiled, "fused", None
        try:
            m, k, n = x.shape[0], x.shape[1] // self.world, w.shape[1]
            with jax.set_mesh(self.mesh):
                reason = gemm_rs_op.why_not_fused(
                    jax.ShapeDtypeStruct((m, k), x.dtype), jax.ShapeDtypeStruct((k, n), w.dtype),
                    axis_name=AXIS, axis_size=self.world, dimension=0, config=config)
        except Exception as e:
            reason = f"the fused path's availability check raised ({type(e).__name__}: {e})"
        return compiled, "xla", reason or f"{_fused_target()} not in the lowered program"

    def config(self, m, n, k, overrides):
        # Fields not given come from what gemm_rs picks for this shape without an override: the
        # tuned table (user cache, then shipped), else heuristic_config.
        return with_overrides(select_config(m, n, k, self.world, self.dtype)[0], overrides)

    def baseline(self, x, w):
        fn = self.shard_map(lambda x, w: jax.lax.psum_scatter(jnp.dot(x, w), AXIS, scatter_dimension=0, tiled=True),
                            (self.x_spec, self.w_spec), P(AXIS))
        return self.compile(fn, x, w)[1]

    def shape_row(self, m, n, k, configs, progress, seed):
        """Compiles XLA's GEMM, RS, GEMM->RS and windowed einsum and gemm_rs for every config, checks
        gemm_rs against GEMM->RS, then times all of them in interleaved rounds."""
        name = f"{m}x{n}x{k}"
        progress.phase(f"{name}: compiling XLA gemm, rs, gemm->rs, windowed einsum")
        x, w = self.inputs(m, n, k, seed)
        gemm = self.compile(self.shard_map(jnp.dot, (self.x_spec, self.w_spec), P(AXIS)), x, w)[1]
        # RS alone scatters the per-device [M, N] GEMM output (non-zero), the bytes gemm_rs moves.
        partial = gemm(x, w)
        rs = self.compile(self.shard_map(lambda y: jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True),
                                         P(AXIS), P(AXIS)), partial)[1]
        base = self.baseline(x, w)
        out = NamedSharding(self.mesh, P(AXIS, None))
        _, windowed = self.compile(lambda x, w: jnp.dot(x, w, out_sharding=out), x, w, options=WINDOWED_OPTIONS)
        # A windowed reduce-scatter einsum is a while loop of collective-permutes; without one XLA
        # kept the plain dot + reduce-scatter (e.g. on CPU, whose partitioner ignores the gpu flags).
        windowed_loop = any(c.loops for c in census.collectives(windowed).select(kind="collective-permute"))
        ref = base(x, w)
        programs = {"gemm": (gemm, (x, w)), "rs": (rs, (partial,)), "base": (base, (x, w)),
                    "windowed": (windowed, (x, w))}
        trials = []
        for i, overrides in enumerate(configs):
            progress.phase(f"{name}: compiling and checking entwine config {i + 1}/{len(configs)}")
            config = self.config(m, n, k, overrides)
            compiled, path, reason = self.entwine(x, w, config)
            err = float(rel_err(compiled(x, w), ref))
            trials.append({"config": str(config), "path": path, "reason": reason, "rel_err": err,
                           "ok": err <= TOL, **(self.profile(compiled, (x, w)) or {})})
            programs[f"entwine {i}"] = (compiled, (x, w))
        progress.phase(f"{name}: timing {len(programs)} programs")
        times = self.timed_interleaved(programs, progress)
        del programs, partial
        gemm_ms, rs_ms, base_ms, windowed_ms = (times[key] for key in ("gemm", "rs", "base", "windowed"))
        for i, trial in enumerate(trials):
            trial["ms"] = times[f"entwine {i}"]
        # Best: right results first, then the fused path (an XLA config must not stand in for
        # entwine's speed when the fused path ran), then time.
        best = min(trials, key=lambda t: (not t["ok"], t["path"] != "fused", t["ms"]))
        ms = best["ms"]
        return {"m": m, "n": n, "k": k, "gemm_ms": gemm_ms, "rs_ms": rs_ms, "xla_gemm_rs_ms": base_ms,
                "windowed_ms": windowed_ms, "windowed_loop": windowed_loop, "entwine_ms": ms,
                "speedup": base_ms / ms, "efficiency": max(gemm_ms, rs_ms) / ms, "vs_windowed": windowed_ms / ms,
                **{key: best[key] for key in ("gemm_window_ms", "tail_ms") if key in best},
                "check": "OK" if best["ok"] else "FAIL", "rel_err": best["rel_err"], "path": best["path"],
                "reason": best["reason"], "config": best["config"], "configs": trials}

    def profile(self, compiled, args, calls=20):
        """Median GEMM window and communication tail of isolated fused calls (ENTWINE_PROFILE=1),
        max over the local ranks: window = fork to producer end, tail = producer end to the end of
        the later of the two kernels; None when profiling is off or the call did not run fused."""
        if os.environ.get("ENTWINE_PROFILE") != "1":
            return None
        from entwine_jax import comm
        windows, ends = [], []
        for _ in range(calls):
            jax.block_until_ready(compiled(*args))
            try:
                timings = comm.last_call_ms(self.mesh, AXIS)
            except RuntimeError:
                return None
            windows.append(max(t[1] for t in timings))
            ends.append(max(max(t[1], t[2]) for t in timings))
        window, end = statistics.median(windows), statistics.median(ends)
        return {"gemm_window_ms": window, "tail_ms": end - window, "isolated_ms": end}

    def sweep_rows(self, m, n, k, progress, seed):
        name = f"{m}x{n}x{k}"
        progress.phase(f"{name}: compiling XLA gemm->rs")
        x, w = self.inputs(m, n, k, seed)
        programs = {"base": (self.baseline(x, w), (x, w))}
        rows = []
        for budget in BUDGETS:
            progress.phase(f"{name}: compiling consumer_grid={budget}")
            config = self.config(m, n, k, {"consumer_grid": budget})
            compiled, path, reason = self.entwine(x, w, config)
            programs[budget] = (compiled, (x, w))
            row = {"m": m, "n": n, "k": k, "consumer_grid": budget, "path": path, "reason": reason,
                   "config": str(config)}
            row.update(self.profile(compiled, (x, w)) or {})
            rows.append(row)
        progress.phase(f"{name}: timing {len(programs)} programs")
        times = self.timed_interleaved(programs, progress)
        for row in rows:
            row.update(ms=times[row["consumer_grid"]], xla_gemm_rs_ms=times["base"])
        return rows


def path_note(row):
    # A fallback must never read as entwine speed: the reason goes on the row itself.
    return "path=fused" if row["path"] == "fused" else f"path=xla ({row['reason']})"


def geomean(values):
    # None (JSON null) when no shape passed its check: there is nothing to average.
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def print_table(rows):
    print(f"{'M':>6} {'N':>6} {'K':>5} | {'gemm_ms':>8} {'rs_ms':>8} {'xla_gemm_rs_ms':>14} {'windowed_ms':>11} "
          f"{'entwine_ms':>10} | {'speedup':>7} {'efficiency':>10} {'vs_windowed':>11} | check   path config")
    for r in rows:
        star = " " if r["windowed_loop"] else "*"
        print(f"{r['m']:>6} {r['n']:>6} {r['k']:>5} | {r['gemm_ms']:8.3f} {r['rs_ms']:8.3f} "
              f"{r['xla_gemm_rs_ms']:14.3f} {r['windowed_ms']:10.3f}{star} {r['entwine_ms']:10.3f} | "
              f"{r['speedup']:7.3f} {r['efficiency']:10.3f} {r['vs_windowed']:11.3f} | "
              f"{r['check']:<4} {path_note(r)} {r['config']}")
    ok = [r for r in rows if r["check"] == "OK"]
    fallback = sum(r["path"] != "fused" for r in ok)
    means = [geomean([r[key] for r in ok]) or float("nan") for key in ("speedup", "efficiency", "vs_windowed")]
    print(f"geomean over {len(ok)} checked shapes: speedup {means[0]:.3f}  efficiency {means[1]:.3f}  "
          f"vs_windowed {means[2]:.3f}"
          + (f"  WARNING: {fallback} of them ran the XLA fallback, not entwine" if fallback else ""))
    if any("tail_ms" in r for r in rows):
        print("isolated calls (ENTWINE_PROFILE): GEMM window / communication tail, ms")
        for r in rows:
            if "tail_ms" in r:
                print(f"{r['m']:>6} {r['n']:>6} {r['k']:>5} | {r['gemm_window_ms']:8.3f} {r['tail_ms']:8.3f}")
    if any(not r["windowed_loop"] for r in rows):
        print("* no windowed-einsum loop in the compiled program: XLA kept dot + reduce-scatter for that column")


def plot(path, rows, sweep):
    import matplotlib  # parse_args made sure it is there
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if sweep:
        # The paper's budget figure, one panel per shape: end-to-end latency, the GEMM window and
        # the communication tail against the consumer grid x.
        shapes = list(dict.fromkeys((r["m"], r["n"], r["k"]) for r in sweep))
        fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            pts = [r for r in sweep if (r["m"], r["n"], r["k"]) == shape]
            xs = [r["consumer_grid"] for r in pts]
            ax.plot(xs, [r["ms"] for r in pts], "o-", label="gemm_rs (back to back)")
            if all("tail_ms" in r for r in pts):
                ax.plot(xs, [r["gemm_window_ms"] for r in pts], "s--", label="GEMM window")
                ax.plot(xs, [r["tail_ms"] for r in pts], "^:", label="communication tail")
            ax.axhline(pts[0]["xla_gemm_rs_ms"], color="k", ls="--", lw=0.8, label="XLA GEMM->RS")
            title = "x".join(map(str, shape)) + ("" if pts[0]["path"] == "fused" else " (XLA fallback)")
            ax.set(title=title, xlabel="consumer grid x (CTAs)", ylabel="ms")
            ax.legend(fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [f"{r['m']}x{r['n']}x{r['k']}" for r in rows]
        ax.bar(labels, [r["speedup"] for r in rows],
               hatch=["" if r["path"] == "fused" else "//" for r in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(ylabel="speedup vs XLA GEMM->RS (hatched: XLA fallback)")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def parse_args(argv, prog="python benchmarks/bench.py"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__ + OPS_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=OPS, default="gemm_rs",
                   help="what to time (default gemm_rs): the fused op gemm_rs or ag_gemm against XLA, or mlp, the "
                        "SwiGLU MLP block forward + backward (see below)")
    p.add_argument("--layout", type=parse_layouts,
                   help="comma-separated; ag_gemm: rows (default) or contraction; mlp: rows and hidden (default both); "
                        "hidden and contraction name the same layout (x split over its last dim)")
    p.add_argument("--suite", choices=("design", "quick"), default="design",
                   help="quick: the first 3 shapes of the op's suite (on CUDA GPUs; elsewhere one smoke shape, see "
                        "--shapes)")
    p.add_argument("--shapes", type=parse_shapes,
                   help="comma-separated shapes; overrides --suite, and runs these shapes even without CUDA GPUs. "
                        "gemm_rs: MxNxK_local (per-device K); ag_gemm: MxNxK, the GEMM [M, K] @ [K, N] every rank "
                        "runs after the gather (N: its own columns of w); mlp: TxDxF (tokens, embed, mlp)")
    p.add_argument("--dtype", type=parse_dtype, default="bfloat16", metavar="{bf16,bfloat16,fp16,float16}")
    p.add_argument("--world", type=int, default=8,
                   help="W = min(world, local devices) (with --processes: W = the number of processes)")
    p.add_argument("--iters", type=int, help=f"timed calls per measurement (at least; default {GPU_ITERS} on CUDA "
                                             f"GPUs, {SMOKE_ITERS} elsewhere)")
    p.add_argument("--warmup", type=int, help=f"default {GPU_WARMUP} on CUDA GPUs, {SMOKE_WARMUP} elsewhere")
    p.add_argument("--batch", type=int, default=10, help="back-to-back dispatches per timed batch")
    p.add_argument("--configs",
                   help="';'-separated GemmRsConfig overrides (e.g. 'block_n=256,consumer_grid=16;block_n=128'); "
                        "unspecified fields come from the config gemm_rs selects (tuned table, else heuristic_config), "
                        "a consumer_grid alone also sets producer_sms = SMs - consumer_grid; the best per shape is "
                        "reported. --op ag_gemm: AgGemmConfig overrides of ag_heuristic_config (e.g. 'max_chunks=4')")
    p.add_argument("--sweep-budget", action="store_true", help="latency vs consumer_grid x in %s" % (BUDGETS,))
    p.add_argument("--profile", action="store_true",
                   help="also time the GEMM window and communication tail of isolated calls (on with --sweep-budget)")
    p.add_argument("--allow-xla", action="store_true",
                   help="on CUDA GPUs without the compiled extension, time the XLA path anyway instead of refusing")
    p.add_argument("--json", help="write machine, versions and rows to this file")
    p.add_argument("--plot", help="write a PNG (speedup per shape, or latency vs x with --sweep-budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=1, metavar="W",
                   help="ag_gemm, mlp: start W processes on localhost (jax.distributed, one rank each, rank r on "
                        "GPU r mod --gpus); rank 0 prints the table")
    p.add_argument("--gpus", type=int, default=1, help="with --processes: GPUs to spread the ranks over (default 1: "
                                                       "all share GPU 0, and the XLA columns are skipped)")
    p.add_argument("--fused-only", action="store_true",
                   help="ag_gemm, mlp: time only what runs without NCCL (entwine, XLA's GEMMs, the bound); implied "
                        "where several processes share one GPU")
    p.add_argument("--timeout", type=float, default=3600,
                   help="with --processes: seconds after which the ranks still running are killed (default 3600)")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("iters", "warmup", "batch"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be >= {0 if name == 'warmup' else 1}, got {value}")
    if args.op == "gemm_rs":
        given = [flag for flag, on in (("--layout", args.layout is not None), ("--processes", args.processes != 1),
                                       ("--fused-only", args.fused_only)) if on]
        if given:
            p.error(f"{', '.join(given)}: --op ag_gemm and --op mlp only (gemm_rs with W processes: "
                    "tests/gpu_ranks.py)")
    else:
        given = [flag for flag, on in (("--sweep-budget", args.sweep_budget), ("--profile", args.profile),
                                       ("--plot", args.plot), ("--configs", args.op == "mlp" and args.configs))
                 if on]
        if given:
            p.error(f"{', '.join(given)}: not with --op {args.op}")
        layouts = args.layout or DEFAULT_LAYOUTS[args.op]
        # One name per layout: the ag_gemm bench calls it contraction, the MLP bench hidden.
        args.layout = list(dict.fromkeys(LAYOUT_NAMES[args.op].get(x, x) for x in layouts))
    if not 1 <= args.processes <= 8 or args.gpus < 1:
        p.error(f"--processes must be in [1, 8] and --gpus >= 1, got {args.processes} and {args.gpus}")
    try:
        args.configs = parse_configs(args.configs, AgGemmConfig if args.op == "ag_gemm" else GemmRsConfig) \
            if args.configs is not None else [{}]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if getattr(args, "plot", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error(f"--plot {args.plot}: needs matplotlib (pip install matplotlib), which is not installed")
    return p, args


def smoke_shape(world):
    """SMOKE_SHAPE with M a multiple of the world."""
    m, n, k = SMOKE_SHAPE
    return (m if m % world == 0 else 32 * world), n, k


def missing_extension(prog, allow_xla):
    """The refusal (printed, exit 2) to time XLA on CUDA GPUs without the extension, else None."""
    built, reason = entwine_jax.extension_status()
    if built or allow_xla:
        return None
    print(f"{prog}: refusing to time the XLA path on CUDA GPUs: {reason}. {_log.EXTENSION_FIX} "
          f"Pass --allow-xla to time the XLA path anyway.", file=sys.stderr)
    return 2


def prepare_timing(args, prog) -> tuple[str, Optional[int]]:
    """What every op's run starts with: (JAX's platform, "cuda" on CUDA GPUs; the exit code when it
    refuses to time the XLA path there, else None); fills in --iters and --warmup for the platform."""
    platform = _log.default_platform()
    on_gpu = platform == "cuda"
    if on_gpu and (refused := missing_extension(prog, args.allow_xla)) is not None:
        return platform, refused
    if args.iters is None:
        args.iters = GPU_ITERS if on_gpu else SMOKE_ITERS
    if args.warmup is None:
        args.warmup = GPU_WARMUP if on_gpu else SMOKE_WARMUP
    return platform, None


def main(argv=None, prog="python benchmarks/bench.py"):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, args = parse_args(argv, prog)
    if args.op != "gemm_rs":
        return main_ag_mlp(parser, args, argv, prog)
    platform, refused = prepare_timing(args, prog)
    if refused is not None:
        return refused
    on_gpu = platform == "cuda"
    if args.sweep_budget or args.profile:
        # Read by the extension when it creates the first communicator: timing events per call.
        os.environ.setdefault("ENTWINE_PROFILE", "1")
    bench = Bench(args)
    if args.shapes:
        shapes = args.shapes
    elif not on_gpu:
        # GPU-sized shapes take minutes each on CPU, for timings that mean nothing there.
        shapes = [smoke_shape(bench.world)]
    else:
        shapes = SWEEP_SHAPES if args.sweep_budget else DESIGN_SUITE[: 3 if args.suite == "quick" else None]
    for m, n, k in shapes:
        if m % bench.world:
            parser.error(f"shape {m}x{n}x{k}: M={m} is not divisible by W={bench.world}")
    device = jax.local_devices()[0]
    machine = f"{bench.world} x {device.device_kind}"
    dtype = SHORT_NAMES[args.dtype]
    print(f"# benchmarks/bench.py: {machine} ({device.platform}), jax {jax.__version__}, {dtype}, W={bench.world}, "
          f"median of >= {args.iters} calls in batches of {args.batch} after {args.warmup} warm-ups, "
          f"the programs of a shape timed in interleaved rounds")
    print(f"# extension: {entwine_jax.extension_status()[1]}")
    if not on_gpu:
        what = ("the given --shapes" if args.shapes else
                f"only the smoke shape {'x'.join(map(str, shapes[0]))} (pass --shapes to time others)")
        print(f"# NOTE: no CUDA GPUs (JAX platform {platform!r}): gemm_rs takes the XLA path and the timings here "
              f"mean nothing; running {what}")
    sys.stdout.flush()
    rows, sweep = [], []
    bench.warm_up()
    # The bar counts timed rounds (the work whose length --iters sets), not compiles.
    progress = Progress(len(shapes) * rounds(args.iters, args.batch))
    if args.sweep_budget:
        for i, (m, n, k) in enumerate(shapes):
            sweep += bench.sweep_rows(m, n, k, progress, args.seed + i)
        progress.close()
        print(f"{'M':>6} {'N':>6} {'K':>5} | {'x':>3} {'entwine_ms':>10} {'gemm_window':>11} {'tail':>6} "
              f"{'xla_gemm_rs_ms':>14} | path config")
        for r in sweep:
            window = f"{r['gemm_window_ms']:11.3f} {r['tail_ms']:6.3f}" if "tail_ms" in r else f"{'-':>11} {'-':>6}"
            print(f"{r['m']:>6} {r['n']:>6} {r['k']:>5} | {r['consumer_grid']:>3} {r['ms']:10.3f} {window} "
                  f"{r['xla_gemm_rs_ms']:14.3f} | {path_note(r)} {r['config']}")
    else:
        for i, (m, n, k) in enumerate(shapes):
            rows.append(bench.shape_row(m, n, k, args.configs, progress, args.seed + i))
        progress.close()
        print_table(rows)
    ok = [r for r in rows if r["check"] == "OK"]
    if args.json:
        result = {"machine": machine, "device_kind": device.device_kind, "platform": device.platform,
                  "device_count": bench.world, "jax": jax.__version__, "dtype": dtype, "world": bench.world,
                  "iters": args.iters, "warmup": args.warmup, "batch": args.batch,
                  "windowed_options": WINDOWED_OPTIONS, "rows": rows, "sweep": sweep,
                  "geomean": {key: geomean([r[key] for r in ok]) for key in ("speedup", "efficiency", "vs_windowed")}}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"JSON written to {args.json}", file=sys.stderr)
    if args.plot:
        plot(args.plot, rows, sweep)
    # Non-zero exit when a result was wrong, so scripts and CI notice.
    return 1 if any(r["check"] == "FAIL" for r in rows) else 0


def main_ag_mlp(parser, args, argv, prog):
    """--op ag_gemm and --op mlp, in either process model (benchmarks/runner.py)."""
    if args.processes > 1 and args.rank is None:
        return bench_run.launch(argv, args.processes, args.timeout)
    if args.rank is not None:
        if args.port is None:
            parser.error("--rank needs --port (both are set by --processes)")
        bench_run.init_rank(args.rank, args.port, args.processes, args.gpus)
    platform, refused = prepare_timing(args, prog)
    if refused is not None:
        return refused
    on_gpu = platform == "cuda"
    runner = bench_run.Runner(args.world, args.dtype, args.iters, args.warmup, args.batch, args.fused_only)
    world, op = runner.world, bench_ag if args.op == "ag_gemm" else bench_mlp
    if args.shapes:
        shapes = args.shapes
    elif not on_gpu:
        shapes = [op.smoke_shape(world)]
    else:
        shapes = op.suite(world) if args.op == "ag_gemm" else op.suite()
        shapes = shapes[: 3 if args.suite == "quick" else None]
    for shape in shapes:
        for layout in args.layout:
            if (error := op.shape_error(*shape, layout, world)) is not None:
                parser.error(error)
    bad = [x for x in args.layout if x not in op.LAYOUTS]
    if bad:
        parser.error(f"--layout {','.join(bad)}: --op {args.op} takes {' or '.join(op.LAYOUTS)}")
    device = runner.home
    processes = jax.process_count()
    model = (f", {processes} processes" + (" sharing one GPU" if runner.shared_gpu else "")) if processes > 1 else ""
    machine = f"{world} x {device.device_kind}{model}"
    dtype = SHORT_NAMES[args.dtype]
    if runner.rank0:
        print(f"# benchmarks/bench.py --op {args.op}: {world} x {device.device_kind} ({device.platform}){model}, "
              f"jax {jax.__version__}, {dtype}, "
              f"W={world}, median of >= {args.iters} calls in batches of {args.batch} after {args.warmup} warm-ups, "
              f"the programs of a shape timed in interleaved rounds, max over "
              f"{'processes' if processes > 1 else 'ranks (one process)'}")
        for line in ([bench_ag.describe(x) for x in args.layout] if args.op == "ag_gemm" else [bench_mlp.describe()]):
            print(line)
        print(f"# extension: {entwine_jax.extension_status()[1]}")
        if not on_gpu:
            what = ("the given --shapes" if args.shapes else
                    f"only the smoke shape {'x'.join(map(str, shapes[0]))} (pass --shapes to time others)")
            print(f"# NOTE: no CUDA GPUs (JAX platform {platform!r}): the ops take the XLA path and the timings here "
                  f"mean nothing; running {what}")
        if runner.shared_gpu:
            print(f"# NOTE: {processes} processes share one GPU: NCCL cannot run there, so every XLA column with a "
                  f"collective is skipped ('-'); the GPU time-slices between the processes, so these timings are "
                  f"not those of {world} GPUs")
        elif runner.fused_only:
            print("# NOTE: --fused-only: the XLA columns with a collective are skipped ('-')")
        sys.stdout.flush()
    runner.warm_up()
    total = len(shapes) * len(args.layout) * rounds(args.iters, args.batch)
    progress = Progress(total) if runner.rank0 else bench_run.QuietProgress()
    rows = []
    timer = bench_ag.AgBench(runner, args.configs) if args.op == "ag_gemm" else bench_mlp.MlpBench(runner)
    for i, shape in enumerate(shapes):
        for layout in args.layout:
            rows.append(timer.row(*shape, layout, progress, args.seed + i))
    progress.close()
    keys = ("speedup", "efficiency", "vs_windowed") if args.op == "ag_gemm" else (
        "speedup", "vs_windowed", "ours_over_bound")
    ok = [r for r in rows if r["check"] == "OK"]
    if runner.rank0:
        op.print_table(rows, geomean)
        if args.json:
            result = {"op": args.op, "layouts": args.layout, "machine": machine, "device_kind": device.device_kind,
                      "platform": device.platform, "device_count": world, "processes": processes,
                      "shared_gpu": runner.shared_gpu, "fused_only": runner.fused_only, "jax": jax.__version__,
                      "dtype": dtype, "world": world, "iters": args.iters, "warmup": args.warmup,
                      "batch": args.batch, "windowed_options": WINDOWED_OPTIONS, "rows": rows,
                      "geomean": {key: geomean([r[key] for r in ok if r[key] is not None]) for key in keys}}
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
            print(f"JSON written to {args.json}", file=sys.stderr)
    # Non-zero exit when a result was wrong or the fused op could not run, so scripts and CI notice.
    return 1 if any(r["check"] in ("FAIL", "SKIP") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
