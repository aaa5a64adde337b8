# `python benchmarks/bench.py --op ag_gemm`: gemm_rs's benchmark protocol, for ag_gemm. Per
# shape: XLA's all-gather, GEMM, all-gather->GEMM (the baseline) and windowed einsum against entwine's
# ag_gemm, in interleaved rounds; one line per shape and a geomean. Both process models (bench_run).
"""ag_gemm against XLA: all-gather alone, GEMM alone, all-gather->GEMM (the baseline) and windowed einsum.

A shape MxNxK is the GEMM every rank runs once x is gathered: [M, K] @ [K, N] -> [M, N], N being the
rank's own columns of w (N_local). Rows layout: each rank holds x [M/W, K] (tokens split: sequence
parallelism); contraction layout: each rank holds x [M, K/W] (the hidden dim split). Either way w is
[K, N] per rank ([K, W*N] in all) and every rank computes [M, N]."""
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import _extension, census
from entwine_jax.ag_gemm import op as ag_gemm_op
from runner import AXIS, WINDOWED_OPTIONS, fmt, ms_or_none, path_note, print_geomeans, ratio
from entwine_jax.ag_gemm.config import AgGemmConfig
from entwine_jax.tuning.timing import TOL

# (embed, mlp) of the MLP block's benchmark (bench_mlp) and the tokens per tensor-parallel group.
MLP_DIMS = [(4096, 14336), (8192, 28672)]
TOKENS = (8192, 16384)
SMOKE_SHAPE = (256, 256, 64)
LAYOUTS = ("rows", "contraction")
# What a row skipped for ranks sharing a GPU needed (runner.path_note).
SKIPPED_NEEDS = "XLA's all-gather needs"



def _fused_target() -> str:
    """The custom-call name the fused ag_gemm lowers to (defined once, in the extension)."""
    ext, _ = _extension.module()
    return ext.AG_GEMM_TARGET if ext is not None else "(no extension)"

def suite(world: int) -> list:
    """The gate (or up) projection of the MLP block's shapes: M = tokens per tensor group, N = mlp/W
    (a rank's columns of w_gate), K = embed."""
    return [(t, f // world, d) for d, f in MLP_DIMS for t in TOKENS]


def smoke_shape(world: int) -> tuple:
    """SMOKE_SHAPE with M and K multiples of the world (rows split M, contraction splits K)."""
    m, n, k = SMOKE_SHAPE
    return (m if m % world == 0 else 32 * world, n, k if k % world == 0 else 8 * world)


def shape_error(m: int, n: int, k: int, layout: str, world: int):
    """The usage error of a shape that the layout cannot split over W, else None."""
    if layout == "rows" and m % world:
        return f"shape {m}x{n}x{k}: rows layout splits M={m} over W={world}, not divisible"
    if layout == "contraction" and k % world:
        return f"shape {m}x{n}x{k}: contraction layout splits K={k} over W={world}, not divisible"
    return None


def describe(layout: str) -> str:
    split = "x [M/W, K] (rows split)" if layout == "rows" else "x [M, K/W] (contraction dim split)"
    return (f"# ag_gemm, {layout} layout: a shape MxNxK is the GEMM [M, K] @ [K, N] -> [M, N] that every rank runs "
            f"after the all-gather; each rank holds {split} and w [K, N] (N = its own columns)")


class AgBench:
    def __init__(self, runner, configs: list):
        self.r = runner
        self.configs = configs

    def specs(self, layout):
        gd = 0 if layout == "rows" else 1  # x is [., .]: the contraction dim is 1
        return gd, (P(AXIS, None) if layout == "rows" else P(None, AXIS)), P(None, AXIS)

    def config(self, m, n, k, layout, overrides) -> AgGemmConfig:
        w = self.r.world
        rows, cols = (m // w, k) if layout == "rows" else (m, k // w)
        return dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, w, self.r.dtype), **overrides)

    def entwine(self, x, w, layout, config):
        """(compiled, path, reason): path is what the compiled program really runs."""
        r = self.r
        gd, x_spec, w_spec = self.specs(layout)
        fn = r.shard_map(lambda x, w: entwine_jax.ag_gemm(x, w, axis_name=AXIS, gather_dimension=gd, config=config),
                         (x_spec, w_spec), P(None, AXIS))
        lowered, compiled = r.compile(fn, x, w)
        if _fused_target() in lowered.as_text():
            return compiled, "fused", None
        m, k = x.shape
        local = (m // r.world, k) if layout == "rows" else (m, k // r.world)
        try:
            with jax.set_mesh(r.mesh):
                reason = ag_gemm_op.why_not_fused(
                    jax.ShapeDtypeStruct(local, x.dtype), jax.ShapeDtypeStruct((k, w.shape[1] // r.world), w.dtype),
                    axis_name=AXIS, axis_size=r.world, dimension=gd, config=config)
        except Exception as e:
            reason = f"the fused path's availability check raised ({type(e).__name__}: {e})"
        return compiled, "xla", reason or f"{_fused_target()} not in the lowered program"

    def row(self, m, n, k, layout, progress, seed) -> dict:
        """Compiles every program of one shape, checks each entwine config against a reference
        made on this process's device, then times them all in interleaved rounds."""
        r = self.r
        name = f"{m}x{n}x{k} {layout}"
        gd, x_spec, w_spec = self.specs(layout)
        progress.phase(f"{name}: inputs and reference")
        # x [M, K] (gathered), w [K, W*N]: w scaled so outputs stay O(1) (fp16 must not overflow).
        x_full, w_full = r.normal(seed, [(m, k), (k, r.world * n)], [1.0, 1.0 / math.sqrt(k)])
        ref = jnp.matmul(x_full, w_full, preferred_element_type=jnp.float32)
        x, w = r.place(x_full, x_spec), r.place(w_full, w_spec)
        # GEMM alone: every rank multiplies the whole (already gathered) x by its w; no collective.
        xg = r.tile(x_full, P(AXIS, None))
        gemm = r.compile(r.shard_map(jnp.matmul, (P(AXIS, None), w_spec), P(None, AXIS)), xg, w)[1]
        programs = {"gemm": (gemm, (xg, w))}
        windowed_built, base_err = None, None
        if not r.fused_only:
            progress.phase(f"{name}: compiling XLA all-gather, all-gather->GEMM, windowed einsum")
            ag = r.compile(r.shard_map(lambda x: jax.lax.all_gather(x, AXIS, axis=gd, tiled=True),
                                       (x_spec,), P(AXIS)), x)[1]
            base = r.compile(r.shard_map(
                lambda x, w: jnp.matmul(jax.lax.all_gather(x, AXIS, axis=gd, tiled=True), w),
                (x_spec, w_spec), P(None, AXIS)), x, w)[1]
            out = r.sharding(P(None, AXIS))
            _, windowed = r.compile(lambda x, w: jnp.dot(x, w, out_sharding=out), x, w,
                                    options=WINDOWED_OPTIONS)
            # XLA built a windowed-einsum loop: collective-permutes inside a while loop.
            windowed_built = any(c.loops for c in census.collectives(windowed).select(kind="collective-permute"))
            base_err = r.max_over_processes([r.shard_error([base(x, w)], [ref])])[0]
            programs.update({"ag": (ag, (x,)), "base": (base, (x, w)), "windowed": (windowed, (x, w))})
        trials = []
        for i, overrides in enumerate(self.configs):
            progress.phase(f"{name}: compiling and checking entwine config {i + 1}/{len(self.configs)}")
            config = self.config(m, n, k, layout, overrides)
            compiled, path, reason = self.entwine(x, w, layout, config)
            trial = {"config": str(config), "path": path, "reason": reason}
            if path != "fused" and r.shared_gpu and r.on_gpu:
                # The XLA path's all-gather needs NCCL, which cannot run two ranks on one GPU.
                trial.update(rel_err=None, ok=False, skipped=True)
            else:
                r.barrier()  # the first fused call: no rank waits out another's compile in it
                err = r.max_over_processes([r.shard_error([compiled(x, w)], [ref])])[0]
                trial.update(rel_err=err, ok=err <= TOL, skipped=False)
                programs[f"entwine {i}"] = (compiled, (x, w))
            trials.append(trial)
        del ref
        progress.phase(f"{name}: timing {len(programs)} programs")
        times = r.time(programs, progress)
        for i, trial in enumerate(trials):
            trial["ms"] = ms_or_none(times.get(f"entwine {i}"))
        gemm_ms = ms_or_none(times["gemm"])
        ag_ms, base_ms, windowed_ms = (ms_or_none(times.get(key)) for key in ("ag", "base", "windowed"))
        ran = [t for t in trials if not t["skipped"]]
        # Best: right results first, then the fused path, then time (as in the gemm_rs bench).
        best = min(ran, key=lambda t: (not t["ok"], t["path"] != "fused", t["ms"])) if ran else trials[0]
        ms = best["ms"]
        check = "SKIP" if best["skipped"] else "OK" if best["ok"] else "FAIL"
        longer = max(gemm_ms, ag_ms) if ag_ms is not None else gemm_ms
        return {"m": m, "n": n, "k": k, "layout": layout, "ag_ms": ag_ms, "gemm_ms": gemm_ms,
                "xla_ag_gemm_ms": base_ms, "windowed_ms": windowed_ms, "windowed_loop": windowed_built,
                "entwine_ms": ms, "speedup": ratio(base_ms, ms), "efficiency": ratio(longer, ms),
                "efficiency_of": "max(gemm, ag)" if ag_ms is not None else "gemm (XLA's all-gather not timed)",
                "vs_windowed": ratio(windowed_ms, ms), "check": check, "rel_err": best["rel_err"],
                "xla_rel_err": base_err, "path": best["path"], "reason": best["reason"], "config": best["config"],
                "configs": trials}


def print_table(rows, geomean) -> None:
    print(f"{'layout':<11} {'M':>6} {'N':>6} {'K':>5} | {'ag_ms':>8} {'gemm_ms':>8} {'xla_ag_gemm_ms':>14} "
          f"{'windowed_ms':>11} {'entwine_ms':>10} | {'speedup':>7} {'efficiency':>10} {'vs_windowed':>11} | "
          f"check path config")
    for r in rows:
        star = "*" if r["windowed_loop"] is False else " "
        print(f"{r['layout']:<11} {r['m']:>6} {r['n']:>6} {r['k']:>5} | {fmt(r['ag_ms'], 8)} {fmt(r['gemm_ms'], 8)} "
              f"{fmt(r['xla_ag_gemm_ms'], 14)} {fmt(r['windowed_ms'], 10)}{star} {fmt(r['entwine_ms'], 10)} | "
              f"{fmt(r['speedup'], 7)} {fmt(r['efficiency'], 10)} {fmt(r['vs_windowed'], 11)} | "
              f"{r['check']:<4} {path_note(r, SKIPPED_NEEDS)} {r['config']}")
    print_geomeans(rows, geomean, ("speedup", "efficiency", "vs_windowed"), "shapes")
    if any(r["windowed_loop"] is False for r in rows):
        print("* no windowed-einsum loop in the compiled program: XLA kept all-gather + dot for that column")
    if any(r["efficiency_of"] != "max(gemm, ag)" for r in rows):
        print("efficiency here is XLA's GEMM alone / entwine: XLA's all-gather was not timed (--fused-only or ranks "
              "sharing a GPU)")
