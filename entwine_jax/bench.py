# The benchmark of DESIGN.md ("Benchmark protocol"): per shape, XLA GEMM, XLA reduce-scatter, XLA
# GEMM->RS (the baseline), XLA windowed einsum and entwine gemm_rs, one process driving every local
# device. Prints one comparable line per shape and a geomean; optional JSON and plot.
# Usage: python -m entwine_jax.bench [--suite design|quick] [--shapes MxNxK,...] [--json f] [--plot f]
import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import entwine_jax
from entwine_jax import ops
from entwine_jax.config import GemmRsConfig, with_overrides
from entwine_jax.tuning import select_config

AXIS = "tp"
# (M, N, K_local) of the bar in DESIGN.md.
DESIGN_SUITE = [(4096, 8192, 1024), (8192, 8192, 1024), (16384, 8192, 1024), (8192, 8192, 3584),
                (16384, 8192, 3584), (8192, 16384, 2048), (16384, 16384, 2048), (16384, 16384, 6656)]
# Budget sweep: same M, N, one communication-bound (small K) and one GEMM-bound (large K) shape.
SWEEP_SHAPES = [(8192, 8192, 1024), (8192, 8192, 3584)]
BUDGETS = (8, 12, 16, 20, 24, 28, 32, 40)
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
# Per-compile DebugOptions overrides: they reach the GPU SPMD partitioner without XLA_FLAGS, so the
# windowed column needs no second process (which would have to share GPU memory with this one).
# Each row records whether the loop was really built; if not, starting the whole bench with these
# flags in XLA_FLAGS is harmless to the other columns (shard_map bodies are never windowed).
WINDOWED_OPTIONS = {"xla_gpu_multi_streamed_windowed_einsum": True,
                    "xla_gpu_threshold_for_windowed_einsum_mib": 0}
FUSED_TARGET = "entwine_gemm_rs"
TOL = 1e-2  # relative Frobenius error vs the baseline, bf16 and fp16 alike (DESIGN.md)


def parse_shapes(text):
    shapes = []
    for item in filter(None, text.split(",")):
        if not re.fullmatch(r"\d+x\d+x\d+", item.strip()):
            raise argparse.ArgumentTypeError(f"--shapes: expected MxNxK_local items like 4096x8192x1024, got {item!r}")
        shapes.append(tuple(int(v) for v in item.strip().split("x")))
    return shapes


def parse_configs(text):
    """'block_n=256,consumer_grid=16;block_n=128' -> [{'block_n': 256, 'consumer_grid': 16}, ...].

    An empty item stands for the config gemm_rs selects itself: ';raster_rows=1' times that config
    and one variant of it."""
    fields = {f.name for f in dataclasses.fields(GemmRsConfig)}
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
            GemmRsConfig(**kwargs)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--configs {item!r}: {e}") from None
        configs.append(kwargs)
    return configs


class Progress:
    """tqdm on stderr when installed, else a plain counter (stdout stays the table)."""

    def __init__(self, total):
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, file=sys.stderr, leave=False)
        except ImportError:
            self._bar, self._n, self._total = None, 0, total

    def step(self, what):
        if self._bar is not None:
            self._bar.set_description(what)
            self._bar.update(1)
        else:
            self._n += 1
            print(f"[{self._n}/{self._total}] {what}", file=sys.stderr, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()


def time_interleaved(programs, iters, warmup, batch):
    """{name: (fn, args)} -> {name: median per-call ms}, the programs timed in rounds: every round
    times one batch of `batch` back-to-back dispatches of each program in turn, >= iters calls per
    program in all.

    Rounds, not one program after the other: back-to-back GEMMs hold an H200 at its power cap,
    where the clock, and with it a program's time, depends on what ran just before (PERF.md v7).
    Interleaving gives every program the same history, and round r starts with program r mod n,
    so no program always runs right after the same one (the position in a round biased a variant
    by up to 5% in the harness, PERF.md v8). Blocking after every call would add
    ~20-50 us of host round trip to 0.2 ms kernels; within a batch the device stays busy because
    each program outlasts its dispatch. One process drives all devices, so a program ends when its
    slowest device does: the max over ranks is built in.
    """
    for fn, args in programs.values():
        for _ in range(warmup):
            out = fn(*args)
        jax.block_until_ready(out)
    times = {name: [] for name in programs}
    names = list(programs)
    for r in range(max(1, math.ceil(iters / batch))):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, args = programs[name]
            t0 = time.perf_counter()
            for _ in range(batch):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) * 1e3 / batch)
    return {name: statistics.median(t) for name, t in times.items()}


class Bench:
    def __init__(self, args):
        self.args = args
        self.dtype = DTYPES[args.dtype]
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
        otherwise lands on the first shape's columns (measured: its XLA and entwine times ~20% high;
        one second was not enough in PERF.md v6/v7, when the columns were timed one after the other;
        they are now timed in interleaved rounds, so a slow start weighs on all of them alike).
        GPUs only: on CPU the timings mean nothing anyway."""
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

    def timed_interleaved(self, programs):
        a = self.args
        return time_interleaved(programs, a.iters, a.warmup, a.batch)

    def entwine(self, x, w, config):
        """(compiled, path, reason) of gemm_rs with `config`; path is what the program really runs."""
        fn = self.shard_map(lambda x, w: entwine_jax.gemm_rs(x, w, axis_name=AXIS, config=config),
                            (self.x_spec, self.w_spec), P(AXIS))
        lowered, compiled = self.compile(fn, x, w)
        # The FFI target in the lowered program is the proof; the reason is for the user.
        if FUSED_TARGET in lowered.as_text():
            return compiled, "fused", None
        try:
            m, k, n = x.shape[0], x.shape[1] // self.world, w.shape[1]
            with jax.set_mesh(self.mesh):
                reason = ops._fused_unavailable(
                    jax.ShapeDtypeStruct((m, k), x.dtype), jax.ShapeDtypeStruct((k, n), w.dtype),
                    AXIS, self.world, 0, config)
        except Exception as e:
            reason = f"entwine_jax.fused unavailable ({type(e).__name__}: {e})"
        return compiled, "xla", reason or f"{FUSED_TARGET} not in the lowered program"

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
        x, w = self.inputs(m, n, k, seed)
        name = f"{m}x{n}x{k}"
        gemm = self.compile(self.shard_map(jnp.dot, (self.x_spec, self.w_spec), P(AXIS)), x, w)[1]
        progress.step(f"{name} gemm")
        # RS alone scatters the per-device [M, N] GEMM output (non-zero), the bytes gemm_rs moves.
        partial = gemm(x, w)
        rs = self.compile(self.shard_map(lambda y: jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True),
                                         P(AXIS), P(AXIS)), partial)[1]
        progress.step(f"{name} rs")
        base = self.baseline(x, w)
        progress.step(f"{name} xla gemm->rs")
        out = NamedSharding(self.mesh, P(AXIS, None))
        _, windowed = self.compile(lambda x, w: jnp.dot(x, w, out_sharding=out), x, w, options=WINDOWED_OPTIONS)
        # A windowed reduce-scatter einsum is a while loop of collective-permutes; without one XLA
        # kept the plain dot + reduce-scatter (e.g. on CPU, whose partitioner ignores the gpu flags).
        text = windowed.as_text()
        windowed_loop = bool(re.search(r"\bwhile\b", text)) and "collective-permute" in text
        progress.step(f"{name} windowed einsum")
        ref = base(x, w)
        rel_err = jax.jit(lambda a, b: jnp.sqrt(jnp.sum(jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)))
                                                / jnp.sum(jnp.square(b.astype(jnp.float32)))))
        programs = {"gemm": (gemm, (x, w)), "rs": (rs, (partial,)), "base": (base, (x, w)),
                    "windowed": (windowed, (x, w))}
        trials = []
        for i, overrides in enumerate(configs):
            config = self.config(m, n, k, overrides)
            compiled, path, reason = self.entwine(x, w, config)
            err = float(rel_err(compiled(x, w), ref))
            trials.append({"config": str(config), "path": path, "reason": reason, "rel_err": err,
                           "ok": err <= TOL, **(self.profile(compiled, (x, w)) or {})})
            programs[f"entwine {i}"] = (compiled, (x, w))
            progress.step(f"{name} entwine {config}")
        times = self.timed_interleaved(programs)
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
        from entwine_jax import fused
        windows, ends = [], []
        for _ in range(calls):
            jax.block_until_ready(compiled(*args))
            try:
                timings = fused.last_call_ms(self.mesh, AXIS)
            except RuntimeError:
                return None
            windows.append(max(t[1] for t in timings))
            ends.append(max(max(t[1], t[2]) for t in timings))
        window, end = statistics.median(windows), statistics.median(ends)
        return {"gemm_window_ms": window, "tail_ms": end - window, "isolated_ms": end}

    def sweep_rows(self, m, n, k, progress, seed):
        x, w = self.inputs(m, n, k, seed)
        programs = {"base": (self.baseline(x, w), (x, w))}
        progress.step(f"{m}x{n}x{k} xla gemm->rs")
        rows = []
        for budget in BUDGETS:
            config = self.config(m, n, k, {"consumer_grid": budget})
            compiled, path, reason = self.entwine(x, w, config)
            programs[budget] = (compiled, (x, w))
            row = {"m": m, "n": n, "k": k, "consumer_grid": budget, "path": path, "reason": reason,
                   "config": str(config)}
            row.update(self.profile(compiled, (x, w)) or {})
            rows.append(row)
            progress.step(f"{m}x{n}x{k} consumer_grid={budget}")
        times = self.timed_interleaved(programs)
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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib not installed, no plot written", file=sys.stderr)
        return
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


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m entwine_jax.bench", description=__doc__)
    p.add_argument("--suite", choices=("design", "quick"), default="design", help="quick: the first 3 design shapes")
    p.add_argument("--shapes", type=parse_shapes, help="comma-separated MxNxK_local (per-device K); overrides --suite")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--world", type=int, default=8, help="W = min(world, local devices)")
    p.add_argument("--iters", type=int, default=100, help="timed calls per measurement (at least)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=10, help="back-to-back dispatches per timed batch")
    p.add_argument("--configs", type=parse_configs, default=[{}],
                   help="';'-separated GemmRsConfig overrides (e.g. 'block_n=256,consumer_grid=16;block_n=128'); "
                        "unspecified fields come from the config gemm_rs selects (tuned table, else heuristic_config), "
                        "a consumer_grid alone also sets producer_sms = SMs - consumer_grid; the best per shape is reported")
    p.add_argument("--sweep-budget", action="store_true", help="latency vs consumer_grid x in %s" % (BUDGETS,))
    p.add_argument("--profile", action="store_true",
                   help="also time the GEMM window and communication tail of isolated calls (on with --sweep-budget)")
    p.add_argument("--json", help="write machine, versions and rows to this file")
    p.add_argument("--plot", help="write a PNG (speedup per shape, or latency vs x with --sweep-budget)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.sweep_budget or args.profile:
        # Read by the extension when it creates the first communicator: timing events per call.
        os.environ.setdefault("ENTWINE_PROFILE", "1")
    bench = Bench(args)
    default_shapes = SWEEP_SHAPES if args.sweep_budget else DESIGN_SUITE[: 3 if args.suite == "quick" else None]
    shapes = args.shapes or default_shapes
    for m, n, k in shapes:
        if m % bench.world:
            raise SystemExit(f"shape {m}x{n}x{k}: M={m} is not divisible by W={bench.world}")
    device = jax.local_devices()[0]
    machine = f"{bench.world} x {device.device_kind}"
    print(f"# entwine_jax.bench: {machine} ({device.platform}), jax {jax.__version__}, {args.dtype}, W={bench.world}, "
          f"median of >= {args.iters} calls in batches of {args.batch} after {args.warmup} warm-ups, "
          f"the programs of a shape timed in interleaved rounds")
    print(f"# extension: {entwine_jax.extension_status()[1]}")
    rows, sweep = [], []
    bench.warm_up()
    if args.sweep_budget:
        progress = Progress(len(shapes) * (1 + len(BUDGETS)))
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
        progress = Progress(len(shapes) * (4 + len(args.configs)))
        for i, (m, n, k) in enumerate(shapes):
            rows.append(bench.shape_row(m, n, k, args.configs, progress, args.seed + i))
        progress.close()
        print_table(rows)
    ok = [r for r in rows if r["check"] == "OK"]
    if args.json:
        result = {"machine": machine, "device_kind": device.device_kind, "platform": device.platform,
                  "device_count": bench.world, "jax": jax.__version__, "dtype": args.dtype, "world": bench.world,
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


if __name__ == "__main__":
    sys.exit(main())
