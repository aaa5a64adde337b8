# `python benchmarks/bench.py --op mlp`: the layer-level benchmark. A tensor-parallel SwiGLU
# MLP block, forward and backward under jit, with every collective fused (entwine), in plain XLA
# (default flags; with its windowed-einsum flags) and with no collective at all (the bound: the
# block's GEMMs alone). Both process models (bench_run).
"""The SwiGLU MLP block y = silu(x @ w_gate) * (x @ w_up) @ w_down, forward and backward under jit:
one step returns y and the gradients of sum(y * c) (c a random cotangent) w.r.t. x, w_gate, w_up
and w_down. A shape TxDxF is T tokens per tensor-parallel group, embed D, mlp F (F/W per rank).

Layouts (per rank, W = mesh axis size; w_gate, w_up [D, F/W], w_down [F/W, D] in both):
  rows    sequence parallel: x, y [T/W, D]; gate/up: ag_gemm gathering rows; down: gemm_rs
          scattering rows.
  hidden  embed split: x, y [T, D/W]; gate/up: ag_gemm gathering the contraction dim; down:
          gemm_rs scattering the last dim.
Columns:
  ours         entwine: one ag_gemm on [w_gate | w_up] (x gathered once), gemm_rs for the down
               projection; their backwards are the other op, so every collective is fused.
  xla          shard_map with all_gather + dots and dot + psum_scatter, XLA's default flags.
  windowed     the same block written on global arrays with output shardings (XLA inserts the
               collectives), compiled with XLA's windowed-einsum flags.
  bound        the block's GEMMs alone: the same forward and backward on the gathered shapes
               (x [T, D] per rank, y [T, D]) with no collective: the same FLOPs per rank; a
               perfect overlap reaches it.
"""
import collections
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import census
from entwine_jax.ag_gemm import op as ag_gemm_op
from entwine_jax.gemm_rs import op as gemm_rs_op
from runner import AXIS, WINDOWED_OPTIONS, fmt, ms_or_none, path_note, print_geomeans, ratio
from entwine_jax.gemm_rs.config import get_default_config
from entwine_jax.tuning.timing import TOL
from entwine_jax.gemm_rs.table import select_config

# (embed, mlp) of Llama-class models (Llama 3 8B and 70B), and the tokens per tensor-parallel group.
MLP_DIMS = [(4096, 14336), (8192, 28672)]
TOKENS = (8192, 16384)
LAYOUTS = ("rows", "hidden")
# Without CUDA GPUs: T x D x F that compiles and runs in about a second on CPU (adjusted to W).
SMOKE_SHAPE = (64, 64, 128)


def xla_collectives(program) -> dict:
    """{kind: instructions} of the XLA collectives (not the fused ops' custom calls) of a compiled
    program or its census (entwine_jax.census)."""
    found = program if isinstance(program, census.Census) else census.collectives(program)
    return dict(collections.Counter(c.kind for c in found.select(custom_call=False)))


def suite() -> list:
    return [(t, d, f) for d, f in MLP_DIMS for t in TOKENS]


def smoke_shape(world: int) -> tuple:
    t, d, f = SMOKE_SHAPE
    return tuple(v if v % world == 0 else 16 * world for v in (t, d, f))


def shape_error(t: int, d: int, f: int, layout: str, world: int):
    """The usage error of a shape that cannot be split over W in the layout, else None."""
    split = {"T": t} if layout == "rows" else {"D": d}
    split["F"] = f
    bad = [f"{name}={v}" for name, v in split.items() if v % world]
    if bad:
        return f"shape {t}x{d}x{f}: the {layout} layout splits {', '.join(bad)} over W={world}, not divisible"
    return None


def describe() -> str:
    return ("# mlp: SwiGLU block y = silu(x @ w_gate) * (x @ w_up) @ w_down, forward + backward (y and the gradients "
            "of sum(y * c) w.r.t. x, w_gate, w_up, w_down) under jit; a shape TxDxF is T tokens per tensor group, "
            "embed D, mlp F (F/W per rank); rows: x [T/W, D] per rank, hidden: x [T, D/W]; bound: the same GEMMs "
            "with no collective")


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def block_plain(x, w1, w2, w3):
    """The block on whole (or local, gathered) arrays: the reference and the bound."""
    return jnp.dot(swiglu(jnp.dot(x, w1), jnp.dot(x, w3)), w2)


def step(block):
    """block -> a step returning y and the cotangents of (x, w1, w2, w3) for the output cotangent c."""
    def run(x, w1, w2, w3, c):
        y, vjp = jax.vjp(block, x, w1, w2, w3)
        return (y, *vjp(c))
    return run


@jax.jit
def reference(x, w1, w2, w3, c):
    """The whole block's step in float32 on one device: what every rank's shards are checked against."""
    return step(block_plain)(*(a.astype(jnp.float32) for a in (x, w1, w2, w3, c)))


def block_ours(gd: int, sd: int):
    def block(x, w1, w2, w3):
        # One ag_gemm for both projections: x is gathered once, and the backward's dx is one
        # gemm_rs over [dgate | dup] (the concatenation costs a copy of the two weights per step).
        h = entwine_jax.ag_gemm(x, jnp.concatenate([w1, w3], axis=1), axis_name=AXIS, gather_dimension=gd)
        gate, up = jnp.split(h, 2, axis=-1)
        return entwine_jax.gemm_rs(swiglu(gate, up), w2, axis_name=AXIS, scatter_dimension=sd)
    return block


def block_xla(gd: int, sd: int):
    def block(x, w1, w2, w3):
        g = jax.lax.all_gather(x, AXIS, axis=gd, tiled=True)
        return jax.lax.psum_scatter(block_plain(g, w1, w2, w3), AXIS, scatter_dimension=sd, tiled=True)
    return block


class MlpBench:
    def __init__(self, runner):
        self.r = runner
        self._bounds = {}  # (T, D, F) -> the compiled bound: the same program in both layouts

    def specs(self, layout):
        """(gather dim, scatter dim, x/y/c spec, (w1, w2, w3) specs)."""
        xs = P(AXIS, None) if layout == "rows" else P(None, AXIS)
        dim = 0 if layout == "rows" else 1  # the gathered (and scattered) dim of x [., .] and y
        return dim, dim, xs, (P(None, AXIS), P(AXIS, None), P(None, AXIS))

    def fused_reason(self, t, d, f, layout) -> str:
        """Why the ops would not run fused on this block's shapes (their own words), for the row."""
        r = self.r
        w, dtype = r.world, r.dtype
        x_local = (t // w, d) if layout == "rows" else (t, d // w)
        gd, sd, _, _ = self.specs(layout)
        up_config = entwine_jax.ag_heuristic_config(x_local[0], 2 * f // w, x_local[1], w, dtype)
        down_config = get_default_config() or select_config(t, d, f // w, w, dtype, rows=layout == "rows")[0]
        with jax.set_mesh(r.mesh):
            up = ag_gemm_op.why_not_fused(jax.ShapeDtypeStruct(x_local, dtype),
                                          jax.ShapeDtypeStruct((d, 2 * f // w), dtype), axis_name=AXIS, axis_size=w,
                                          dimension=gd, config=up_config)
            down = gemm_rs_op.why_not_fused(jax.ShapeDtypeStruct((t, f // w), dtype),
                                            jax.ShapeDtypeStruct((f // w, d), dtype), axis_name=AXIS, axis_size=w,
                                            dimension=sd, config=down_config)
        reasons = [f"{name}: {why}" for name, why in (("ag_gemm", up), ("gemm_rs", down)) if why]
        return "; ".join(reasons)

    def row(self, t, d, f, layout, progress, seed) -> dict:
        r = self.r
        name = f"{t}x{d}x{f} {layout}"
        gd, sd, xs, wspecs = self.specs(layout)
        progress.phase(f"{name}: inputs and reference")
        # Normal values scaled so every activation and output stays O(1) (fp16 must not overflow).
        full = r.normal(seed, [(t, d), (d, f), (f, d), (d, f), (t, d)],
                        [1.0, 1 / math.sqrt(d), 1 / math.sqrt(f), 1 / math.sqrt(d), 1.0])
        ref = reference(*full)  # on this process's device: no collective
        args = tuple(r.place(a, spec) for a, spec in zip(full, (xs, *wspecs, xs)))
        # The bound's per-rank x and c are the gathered [T, D]: every rank's block a copy of them.
        bound_args = (r.tile(full[0], P(AXIS, None)), *args[1:4], r.tile(full[4], P(AXIS, None)))
        del full
        out_specs = (xs, xs, *wspecs)
        progress.phase(f"{name}: compiling entwine and the bound")
        ours = r.compile(r.shard_map(step(block_ours(gd, sd)), (xs, *wspecs, xs), out_specs), *args)[1]
        if (t, d, f) not in self._bounds:
            self._bounds[(t, d, f)] = r.compile(r.shard_map(step(block_plain), (P(AXIS, None), *wspecs, P(AXIS, None)),
                                                            (P(AXIS, None), P(AXIS, None), *wspecs)), *bound_args)[1]
        bound = self._bounds[(t, d, f)]
        # Fused: both ops' custom calls and no XLA collective left (entwine_jax.census).
        ours_census = census.collectives(ours)
        ours_collectives = xla_collectives(ours_census)
        calls = {c.owner for c in ours_census.select(custom_call=True)}
        missing = [f"entwine_{op} custom call" for op in ("ag_gemm", "gemm_rs") if op not in calls]
        fused = not missing and not ours_collectives
        reason = None
        if not fused:
            reason = self.fused_reason(t, d, f, layout) or (
                f"{', '.join(missing) or 'no custom call'} missing, XLA collectives {ours_collectives}")
        programs = {"bound": (bound, bound_args)}
        skipped = not fused and r.shared_gpu and r.on_gpu
        err = None
        if not skipped:  # the XLA path's collectives need NCCL, which cannot run ranks sharing a GPU
            r.barrier()  # the first fused call: no rank waits out another's compile in it
            err = r.max_over_processes([r.shard_error(ours(*args), ref)])[0]
            programs["ours"] = (ours, args)
        xla_err, windowed_built, kinds = None, None, {"ours": ours_collectives}
        if not r.fused_only:
            progress.phase(f"{name}: compiling XLA (default flags) and XLA windowed einsum")
            xla = r.compile(r.shard_map(step(block_xla(gd, sd)), (xs, *wspecs, xs), out_specs), *args)[1]
            h_out, y_out = r.sharding(P(None, AXIS)), r.sharding(xs)

            def block_global(x, w1, w2, w3):
                # Global arrays, output shardings given: XLA's partitioner inserts (and may window)
                # the all-gathers and reduce-scatters.
                a = swiglu(jnp.dot(x, w1, out_sharding=h_out), jnp.dot(x, w3, out_sharding=h_out))
                return jnp.dot(a, w2, out_sharding=y_out)

            windowed = r.compile(step(block_global), *args, options=WINDOWED_OPTIONS)[1]
            # XLA built a windowed-einsum loop: collective-permutes inside a while loop.
            windowed_census = census.collectives(windowed)
            windowed_built = any(c.loops for c in windowed_census.select(kind="collective-permute"))
            kinds.update(xla=xla_collectives(xla), windowed=xla_collectives(windowed_census))
            xla_err = r.max_over_processes([r.shard_error(xla(*args), ref)])[0]
            programs.update({"xla": (xla, args), "windowed": (windowed, args)})
        del ref
        progress.phase(f"{name}: timing {len(programs)} programs")
        times = r.time(programs, progress)
        ours_ms, xla_ms, windowed_ms, bound_ms = (ms_or_none(times.get(key))
                                                  for key in ("ours", "xla", "windowed", "bound"))
        check = "SKIP" if skipped else "OK" if err <= TOL else "FAIL"
        return {"t": t, "d": d, "f": f, "layout": layout, "ours_ms": ours_ms, "xla_ms": xla_ms,
                "windowed_ms": windowed_ms, "windowed_loop": windowed_built, "bound_ms": bound_ms,
                "speedup": ratio(xla_ms, ours_ms), "vs_windowed": ratio(windowed_ms, ours_ms),
                "ours_over_bound": ratio(ours_ms, bound_ms), "xla_over_bound": ratio(xla_ms, bound_ms),
                "check": check, "rel_err": err, "xla_rel_err": xla_err, "path": "fused" if fused else "xla",
                "reason": reason, "collectives": kinds}


def print_table(rows, geomean) -> None:
    print(f"{'layout':<6} {'T':>6} {'D':>5} {'F':>6} | {'ours_ms':>8} {'xla_ms':>8} {'windowed_ms':>11} "
          f"{'bound_ms':>8} | {'speedup':>7} {'vs_windowed':>11} {'ours/bound':>10} {'xla/bound':>9} | check path")
    for r in rows:
        star = "*" if r["windowed_loop"] is False else " "
        print(f"{r['layout']:<6} {r['t']:>6} {r['d']:>5} {r['f']:>6} | {fmt(r['ours_ms'], 8)} {fmt(r['xla_ms'], 8)} "
              f"{fmt(r['windowed_ms'], 10)}{star} {fmt(r['bound_ms'], 8)} | {fmt(r['speedup'], 7)} "
              f"{fmt(r['vs_windowed'], 11)} {fmt(r['ours_over_bound'], 10)} {fmt(r['xla_over_bound'], 9)} | "
              f"{r['check']:<4} {path_note(r, 'its collectives need')}")
    print_geomeans(rows, geomean, ("speedup", "vs_windowed", "ours_over_bound"), "rows")
    if any(r["windowed_loop"] is False for r in rows):
        print("* no windowed-einsum loop in the compiled program: XLA kept plain all-gathers and reduce-scatters")
