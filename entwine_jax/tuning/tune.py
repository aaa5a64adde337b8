# tune(): fills the user cache of tuned GemmRsConfigs by timing candidate configs of the fused gemm_rs
# end to end on a live mesh (max over processes of the median), and its command line,
# `python -m entwine_jax tune`. Imported only when tune() is called: never by `import entwine_jax`.
from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _distributed, _extension, _log, comm
from entwine_jax.api import gemm_rs
from entwine_jax.gemm_rs import fused
from entwine_jax.gemm_rs import plan as kernel_plan
from entwine_jax.gemm_rs.config import GemmRsConfig, heuristic_config, producer_sms_beside, with_overrides
from entwine_jax.gemm_rs.table import DTYPE_NAMES, device_class, write_cache
from entwine_jax.tuning import timing

# --- tune() -----------------------------------------------------------------------------------------


def _config_dict(config: GemmRsConfig) -> dict:
    return dataclasses.asdict(config)


# Budgets tried by default_candidates. End to end on 2x H200 (W = 2) x = 24-32 won at K = 1024,
# 12 at K = 2048, 8 at K = 3584 and 4 at K = 6656 (docs/performance.md, "gemm_rs end to end, W = 2").
TUNE_BUDGETS = (4, 8, 12, 16, 20, 24, 28, 32)


def _plan_of(m: int, n: int, k: int, world: int, config: GemmRsConfig) -> Optional[kernel_plan.GemmRsPlan]:
    """The kernels' plan of a row scatter of this shape with `config`; None where it has none (no
    extension, or a shape or config the kernels cannot run)."""
    try:
        return kernel_plan.gemm_rs_plan(m, n, k, world, config)
    except (kernel_plan.NoExtension, kernel_plan.PlanError):
        return None


def default_candidates(m: int, n: int, k: int, world: int, dtype, sm_count: Optional[int] = None) -> list:
    """Stage 1 of tune(): GEMM block x budget for one shape, heuristic first.

    The producer's block is the heuristic's (128x256 measured faster than 128x128 on every suite
    shape; 128 only where N is not a multiple of 256), the consumer block 512 (the most loads in
    flight per SM, best in the consumer sweep); the budget x in TUNE_BUDGETS, with the producer
    persistent on the SMs the consumer leaves (producer_sms_beside; persistent measured 1.1-1.25x
    faster than one CTA per block at every shape on H200). A budget above the
    blocks of the local partition (the kernels' plan) would only idle: capped like the heuristic,
    duplicates dropped. The heuristic's own pick is always tried, so the winner is never worse.
    Measurements: docs/performance.md, "What was tried".
    """
    first = heuristic_config(m, n, k, world, dtype)
    out = [first]
    plan = _plan_of(m, n, k, world, first)
    for consumer_grid in TUNE_BUDGETS:
        grid = min(consumer_grid, plan.blocks_per_partition) if plan else consumer_grid
        c = dataclasses.replace(first, producer_sms=producer_sms_beside(grid, sm_count), consumer_grid=grid,
                                consumer_block=512)
        if c not in out:
            out.append(c)
    return out


def _split_applies(m: int, n: int, k: int, world: int, config: GemmRsConfig) -> bool:
    """Whether split_tail=True changes the producer's schedule of a row scatter (the kernels' plan:
    producer_schedule() in ffi/gemm_rs/plan.cc); elsewhere the flag runs the same schedule as
    without it."""
    plan = _plan_of(m, n, k, world, dataclasses.replace(config, split_tail=True))
    return plan is not None and plan.split


def refined_candidates(best: GemmRsConfig, m: int, n: int, k: int, world: int) -> list:
    """Stage 2 of tune(): stage 1's winner, then the same config with the producer's split tail
    where it changes the schedule, and with raster groups of 16 tile rows where a partition has
    more than the winner's groups (else 16-row groups are the same order). Both change the producer
    only, so they are tried at the budget that won (the producer alone: the split is 2-3% faster
    where the last wave is nearly empty; r16 1-3% faster at K = 1024 and 0.3-1.6% slower at
    K >= 2048; end to end each won on some suite shapes: docs/performance.md, "What was tried")."""
    out = [best]
    split = dataclasses.replace(best, split_tail=True)
    if split != best and _split_applies(m, n, k, world, split):
        out.append(split)
    wide_raster = dataclasses.replace(best, raster_rows=16)
    plan = _plan_of(m, n, k, world, best)
    if wide_raster != best and plan is not None and plan.m_blocks > best.raster_rows:
        out.append(wide_raster)
    return out


def _candidates(m, n, k, world, dtype, candidates) -> list:
    if candidates is None:
        return default_candidates(m, n, k, world, dtype)
    out = []
    for c in candidates:
        if isinstance(c, GemmRsConfig):
            config = c
        elif isinstance(c, dict):
            # Overrides on the heuristic (as bench --configs); a budget alone moves the producer too.
            try:
                config = with_overrides(heuristic_config(m, n, k, world, dtype), c)
            except TypeError as e:
                raise ValueError(f"tune: candidate {c!r}: {e}") from None
        else:
            raise ValueError(f"tune: candidates must be GemmRsConfigs or dicts of GemmRsConfig fields, got "
                             f"{type(c).__name__}")
        if config.path == "xla":
            raise ValueError(f"tune: candidate {config} has path='xla': tuning times the fused op only")
        config = dataclasses.replace(config, path="auto")
        if config not in out:
            out.append(config)
    if not out:
        raise ValueError("tune: candidates is empty")
    return out


def _axis_size(mesh, axis_name) -> int:
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    names = tuple(getattr(mesh, "axis_names", ()))
    missing = [a for a in axes if a not in names]
    if missing:
        raise ValueError(f"tune: axis {missing[0]!r} is not an axis of the mesh (axes {names})")
    return math.prod(int(mesh.shape[a]) for a in axes)


def _check_shapes(shapes, world: int) -> list:
    out = []
    for s in shapes:
        if (not isinstance(s, (tuple, list)) or len(s) != 3
                or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in s)):
            raise ValueError(f"tune: shapes must be (M, N, K_local) tuples of positive ints, got {s!r}")
        m, n, k = (int(v) for v in s)
        if m % world:
            raise ValueError(f"tune: shape {(m, n, k)}: M={m} (rows of the local x) must be divisible by the "
                             f"axis size {world}")
        out.append((m, n, k))
    if not out:
        raise ValueError("tune: shapes is empty")
    return out


def _unavailable(mesh, axis_name, world, shape, dtype, config) -> Optional[str]:
    m, n, k = shape
    with jax.set_mesh(mesh):
        return fused.unavailable_reason(jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype),
                                        axis_name=axis_name, axis_size=world, scatter_dimension=0, config=config)


def _inputs(mesh, axis_name, shape, world, dtype, seed):
    """Global x [M, W*K] and w [W*K, N] sharded on K; normal values (not zeros), outputs O(1)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    m, n, k = shape
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.jit(lambda key: jax.random.normal(key, (m, world * k), jnp.float32).astype(dtype),
                out_shardings=NamedSharding(mesh, P(None, axis_name)))(kx)
    # fp16 must not overflow at large K: scale w so that each output is ~N(0, 1).
    w = jax.jit(lambda key: (jax.random.normal(key, (world * k, n), jnp.float32) / math.sqrt(world * k)).astype(dtype),
                out_shardings=NamedSharding(mesh, P(axis_name, None)))(kw)
    return x, w


def _compile(mesh, axis_name, fn, x, w):
    """(lowered text, compiled) of shard_map(fn) over axis_name, traced under the concrete mesh."""
    from jax.sharding import PartitionSpec as P
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P(None, axis_name), P(axis_name, None)), out_specs=P(axis_name))
    with jax.set_mesh(mesh):
        lowered = jax.jit(f).lower(x, w)
        return lowered.as_text(), lowered.compile()


def _build(mesh, axis_name, config, x, w):
    """(compiled gemm_rs with `config`, None) or (None, why it would not run the fused kernels)."""
    text, compiled = _compile(mesh, axis_name, lambda x, w: gemm_rs(x, w, axis_name=axis_name, config=config), x, w)
    # The FFI target in the lowered program is the proof that the fused kernels run, not XLA.
    target = kernel_plan.target()
    if target not in text:
        return None, f"{target} not in the lowered program (XLA fallback)"
    return compiled, None


# Identical programs read up to 0.9% apart at 200 timed calls (one H200; docs/performance.md,
# "Reading the numbers"): a lead below this is not a measured difference.
_RESOLUTION = 0.01


def runner_up_margin(trials):
    """How far the fastest timed trial of the deciding round (the last stage that timed any) leads
    the next one of that round: second / first - 1; None with fewer than two timed trials."""
    timed = [t for t in trials if t["ms"] is not None]
    if not timed:
        return None
    stage = max(t["stage"] for t in timed)
    ms = sorted(t["ms"] for t in timed if t["stage"] == stage)
    return ms[1] / ms[0] - 1 if len(ms) > 1 else None


def tune(mesh, axis_name, shapes, dtype=jnp.bfloat16, candidates=None, iters: int = 200, warmup: int = 10,
         cache_path=None) -> dict:
    """Time candidate configs of the fused gemm_rs (scatter over rows) on `mesh`; store each winner.

    shapes:     (M, N, K_local) per call: M rows of x as gemm_rs sees them (before the scatter),
                K_local = x.shape[-1], N = w.shape[1]; the world W is the size of `axis_name`.
    candidates: GemmRsConfigs, or dicts of GemmRsConfig fields applied on heuristic_config (a
                consumer_grid without producer_sms sets producer_sms = producer_sms_beside(consumer_grid));
                default: two stages per shape, default_candidates() (GEMM block x budget), then
                refined_candidates() (stage 1's winner, with the split tail, with 16-row raster
                groups), timed again together; the winner is the fastest of stage 2.
    iters, warmup: timed calls (median of batches of back-to-back dispatches, as bench.py) and
                warm-ups per candidate. Identical programs read up to 2.3% (fused op) and 5.2% (XLA's
                GEMM) apart at 50 calls and at most 0.9% at 200 (one H200; docs/performance.md,
                "Reading the numbers"): fewer calls cannot tell the candidates' few-% differences apart.
    cache_path: the user cache to merge the winners into (default: cache_path()).

    Each candidate is checked once against the XLA reference (relative error <= 1e-2); a wrong
    one, or one that would not run the fused kernels, is skipped with a warning. Returns
    {(M, N, K_local): (best GemmRsConfig or None, its ms or None, [{"config", "ms", "rel_err",
    "skipped", "stage"}, ...])}. Raises RuntimeError, with fused.unavailable_reason's words, when the fused
    path cannot run on this mesh (CPU, no extension, ...): tuning the XLA fallback means nothing.

    Multi-process: every process must call tune() with the same arguments (and environment), so
    that all run the same candidates in the same order (each is a collective program); times are
    the max over processes, so every process picks the same winner; only process 0 writes the
    cache. Other hosts read their own cache: point ENTWINE_TUNE_CACHE at a shared file, or copy
    it, since every rank must pick the same config. Functions already traced keep their config.
    """
    world = _axis_size(mesh, axis_name)
    if world == 1:
        raise ValueError(f"tune: axis {axis_name!r} has size 1: gemm_rs runs XLA's GEMM there (nothing to reduce "
                         f"or scatter), so there is no fused config to tune")
    shapes = _check_shapes(shapes, world)
    dtype = jnp.dtype(dtype)
    if dtype.name not in DTYPE_NAMES:
        raise ValueError(f"tune: dtype must be bfloat16 or float16 (the fused kernels' dtypes), got {dtype}")
    for name, value, lo in (("iters", iters, 1), ("warmup", warmup, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"tune: {name} must be an int >= {lo}, got {value!r}")
    per_shape = {s: _candidates(*s, world, dtype, candidates) for s in shapes}
    # Refuse before any timing: every shape must be able to take the fused path on this mesh.
    for shape in shapes:
        reason = _unavailable(mesh, axis_name, world, shape, dtype, per_shape[shape][0])
        if reason is not None:
            raise RuntimeError(f"entwine_jax.tune: the fused path cannot run shape (M, N, K_local)={shape} on this "
                               f"mesh: {reason}; refusing to tune the XLA fallback")

    first = mesh.devices.flat[0]
    kind, cls = str(first.device_kind), device_class(first)
    batch = min(10, iters)
    results, entries = {}, []
    for i, shape in enumerate(shapes):
        x, w = _inputs(mesh, axis_name, shape, world, dtype, seed=i)
        ref = _compile(mesh, axis_name, lambda x, w: gemm_rs(x, w, axis_name=axis_name,
                                                                  config=GemmRsConfig(path="xla")), x, w)[1](x, w)

        def run_round(configs, stage):
            """Build, check and time `configs` (one interleaved round); their trials, in order."""
            trials, programs = [], {}
            for index, config in enumerate(configs):
                trial = {"config": config, "ms": None, "rel_err": None, "skipped": None, "stage": stage}
                trials.append(trial)
                compiled, trial["skipped"] = None, _unavailable(mesh, axis_name, world, shape, dtype, config)
                if trial["skipped"] is None:
                    try:
                        compiled, trial["skipped"] = _build(mesh, axis_name, config, x, w)
                    except Exception as e:  # lowering/compilation: deterministic, so every process skips it
                        trial["skipped"] = f"does not compile ({type(e).__name__}: {e})"
                if compiled is not None:
                    trial["rel_err"] = float(timing.rel_err(compiled(x, w), ref))
                    # A consumer that timed out waiting for a peer leaves the communicator unusable: stop.
                    comm.check_errors()
                    if not trial["rel_err"] <= timing.TOL:  # NaN too
                        trial["skipped"] = f"wrong result: relative error {trial['rel_err']:.3g} > {timing.TOL}"
                    else:
                        programs[index] = (compiled, (x, w))
                if trial["skipped"]:
                    _log.logger.warning("tune %s %s: %s skipped: %s", kind, shape, config, trial["skipped"])
            # The candidates are timed in interleaved rounds, so each sees the same power-cap history.
            for index, ms in (timing.time_interleaved(programs, iters, warmup, batch) if programs else {}).items():
                trials[index]["ms"] = ms
            ms = timing.max_over_processes([t["ms"] if t["ms"] is not None else math.nan for t in trials])
            for trial, value in zip(trials, ms):
                trial["ms"] = None if math.isnan(value) else value
            return trials

        trials = run_round(per_shape[shape], 1)
        timed = [t for t in trials if t["ms"] is not None]
        if not timed:
            _log.logger.error("tune %s %s: no candidate ran the fused kernels correctly; nothing stored", kind, shape)
            results[shape] = (None, None, trials)
            continue
        if candidates is None:
            # Stage 2: the producer variants at the winning budget, timed again beside the winner
            # (every process has the same stage-1 times, so the same winner and the same round).
            refined = refined_candidates(min(timed, key=lambda t: t["ms"])["config"], *shape, world)
            if len(refined) > 1:
                stage2 = run_round(refined, 2)
                trials += stage2
                timed = [t for t in stage2 if t["ms"] is not None] or timed
        best = min(timed, key=lambda t: t["ms"])
        results[shape] = (best["config"], best["ms"], trials)
        m, n, k = shape
        entry = {"device_kind": kind, "world": world, "m": m, "n": n, "k_local": k, "dtype": dtype.name,
                 "config": _config_dict(best["config"]), "ms": round(best["ms"], 4),
                 "provenance": {
                     "machine": f"{world} x {kind}, {jax.process_count()} process(es)",
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "command": f"entwine_jax.tune(shapes={shapes}, dtype={dtype.name}, iters={iters}, "
                                f"warmup={warmup}, {len(trials)} candidates) in: {' '.join(sys.argv)}",
                     "jax": jax.__version__,
                     "method": "median end-to-end latency of the fused op, max over processes"}}
        if cls is not None:
            entry["device_class"] = cls
        entries.append(entry)
    _publish(entries, cache_path, jax.process_index(), jax.process_count())
    return results


_publications = itertools.count()  # numbers the barriers of _publish (key-value keys are written once)
_PUBLISH_TIMEOUT_MS = 300_000


def _publish(entries: list, cache_path, process: int, processes: int) -> None:
    """Process 0 writes the winners into the cache; then every process waits for that write (tune()
    is a collective, so all of them are here). Without the barrier a process could trace its next
    program before the write and pick another config than its peers: the ranks of one fused call
    would then disagree on the plan."""
    if entries and process == 0:
        written = write_cache(entries, cache_path)
        _log.logger.info("tune: %d winner(s) written to %s", len(entries), written)
    if processes > 1:
        _distributed.barrier(f"entwine_tune/{next(_publications)}/written", range(processes), process,
                             _PUBLISH_TIMEOUT_MS)


def main(argv=None, prog="python -m entwine_jax tune") -> int:
    """python -m entwine_jax tune: tune() over the local GPUs (one process, W = all of them); the
    winners are merged into the user cache. Without CUDA GPUs, or without the compiled extension,
    there is nothing to tune: it says so and exits with 2."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    p.add_argument("--shapes", type=timing.parse_shapes, default=timing.DESIGN_SUITE,
                   help="comma-separated MxNxK_local (default: the design suite)")
    p.add_argument("--dtype", type=timing.parse_dtype, default="bfloat16", metavar="{bf16,bfloat16,fp16,float16}")
    p.add_argument("--iters", type=int, default=200, help="timed calls per candidate (see tune())")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--cache", help="user cache to merge the winners into (default: ENTWINE_TUNE_CACHE or "
                                    "~/.cache/entwine_jax/tuned.json)")
    args = p.parse_args(argv)
    # Checked before the axis size: one CPU device must read as "no GPUs", not as "axis of size 1".
    platform = _log.default_platform()
    if platform != "cuda":
        print(f"{prog}: no CUDA GPUs (JAX platform {platform!r}, {len(jax.local_devices())} device(s)): tune() "
              f"times the fused kernels, which run only on Hopper GPUs, so there is nothing to tune on this machine. "
              f"Run it where the GPUs are.", file=sys.stderr)
        return 2
    built, reason = _extension.status()
    if not built:
        print(f"{prog}: tune() times the fused kernels, which need the compiled extension: {reason}. "
              f"{_log.EXTENSION_FIX}", file=sys.stderr)
        return 2
    devices = jax.local_devices()
    mesh = jax.make_mesh((len(devices),), ("tp",), devices=devices)
    try:
        results = tune(mesh, "tp", args.shapes, dtype=args.dtype, iters=args.iters, warmup=args.warmup,
                       cache_path=args.cache)
    except (RuntimeError, ValueError) as e:  # e.g. no fused path on this machine: say why, no traceback
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    for (m, n, k), (best, ms, trials) in results.items():
        margin = runner_up_margin(trials)
        ahead = f" ({100 * margin:.1f}% ahead of the next in its round)" if margin is not None else ""
        print(f"{m}x{n}x{k}: best {best} {'%.3f ms' % ms if ms is not None else ''}{ahead}")
        if margin is not None and margin < _RESOLUTION:
            print(f"    the winner leads by less than the timing resolves ({100 * _RESOLUTION:.0f}%): "
                  f"the top candidates are equally good; more --iters narrows it")
        for t in trials:
            c = t["config"]
            what = f"{t['ms']:.3f} ms" if t["ms"] is not None else f"skipped: {t['skipped']}"
            split = "/split" if c.split_tail else ""
            print(f"    stage {t['stage']} p{c.producer_sms}/x{c.consumer_grid}/b{c.consumer_block}/n{c.block_n}/"
                  f"r{c.raster_rows}{split}: {what}")
    return 0 if all(best is not None for best, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
