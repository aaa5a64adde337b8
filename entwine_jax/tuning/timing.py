# The measurement protocol shared by the benchmark programs (benchmarks/) and tune() (entwine_jax.tuning.tune):
# the suite shapes and their command-line spelling, the result check, programs timed in interleaved
# rounds and the max over processes. A library module: it imports neither the CLI nor ops.
import argparse
import itertools
import json
import math
import re
import statistics
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _distributed

# (M, N, K_local) of the design suite (docs/performance.md); the quick suite is its first three (K = 1024).
DESIGN_SUITE = [(4096, 8192, 1024), (8192, 8192, 1024), (16384, 8192, 1024), (8192, 8192, 3584),
                (16384, 8192, 3584), (8192, 16384, 2048), (16384, 16384, 2048), (16384, 16384, 6656)]

# Both spellings on every command line: bench wrote bf16/fp16, tune() names dtypes as numpy does.
DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16}
SHORT_NAMES = {jnp.dtype(jnp.bfloat16).name: "bf16", jnp.dtype(jnp.float16).name: "fp16"}

# Relative Frobenius error of the fused op against the XLA reference, bf16 and fp16 alike (docs/design.md, "Testing without many GPUs").
TOL = 1e-2

# Numbers the key-value exchanges of max_over_processes (each key is written once).
_exchanges = itertools.count()


def parse_shapes(text: str) -> list:
    """'4096x8192x1024,8x16x32' -> [(4096, 8192, 1024), (8, 16, 32)] (an argparse type)."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if not re.fullmatch(r"\d+x\d+x\d+", item):
            raise argparse.ArgumentTypeError(f"expected MxNxK_local items like 4096x8192x1024, got {item!r}")
        shapes.append(tuple(int(v) for v in item.split("x")))
    if not shapes:
        raise argparse.ArgumentTypeError("no shape given")
    return shapes


def parse_dtype(text: str) -> str:
    """bf16|bfloat16|fp16|float16 -> the numpy name ("bfloat16", "float16") (an argparse type)."""
    if text.strip().lower() not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)}, got {text!r}")
    return jnp.dtype(DTYPES[text.strip().lower()]).name


@jax.jit
def rel_err(a, b):
    """||a - b||_F / ||b||_F in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(a - b)) / jnp.sum(jnp.square(b)))


def rounds(iters: int, batch: int) -> int:
    """How many interleaved rounds time_interleaved runs for `iters` calls in batches of `batch`."""
    return max(1, math.ceil(iters / batch))


def time_interleaved(programs: dict, iters: int, warmup: int, batch: int,
                     on_round: Optional[Callable[[int], None]] = None,
                     before_batch: Optional[Callable[[], None]] = None) -> dict:
    """{name: (fn, args)} -> {name: median per-call ms}, the programs timed in rounds: every round
    times one batch of `batch` back-to-back dispatches of each program in turn, >= iters calls per
    program in all. on_round(r) is called after round r (a progress bar counts timed work).
    before_batch() is called before every timed batch, outside its time: with several processes, a
    barrier, so that every process times the same batch of the same program at once.

    Rounds, not one program after the other: back-to-back GEMMs hold an H200 at its power cap,
    where the clock, and with it a program's time, depends on what ran just before (docs/performance.md, "Reading the numbers").
    Interleaving gives every program the same history, and round r starts with program r mod n,
    so no program always runs right after the same one (the position in a round biased a variant
    by up to 5% in the harness; docs/performance.md). Blocking after every call would add
    ~20-50 us of host round trip to 0.2 ms kernels; within a batch the device stays busy because
    each program outlasts its dispatch. One process drives all devices, so a program ends when its
    slowest device does: the max over ranks is built in.
    """
    for fn, args in programs.values():
        out = None
        for _ in range(warmup):
            out = fn(*args)
        jax.block_until_ready(out)
    times = {name: [] for name in programs}
    names = list(programs)
    for r in range(rounds(iters, batch)):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, args = programs[name]
            if before_batch is not None:
                before_batch()
            t0 = time.perf_counter()
            for _ in range(batch):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) * 1e3 / batch)
        if on_round is not None:
            on_round(r)
    return {name: statistics.median(t) for name, t in times.items()}


def max_over_processes(values: list, timeout_ms: int = 1_800_000) -> list:
    """Per-entry max over processes (the protocol: max over ranks of the median); NaN = skipped.

    Every process must call it with a list of the same length, in the same order (it is a
    collective). Through the jax.distributed key-value store, not a device collective: NCCL cannot
    run where several processes share one GPU (the W-processes-on-one-GPU model), the store can.
    timeout_ms bounds the wait for the slowest process (it may still be timing)."""
    if jax.process_count() == 1:
        return values
    client = _distributed.client()
    if client is None:  # no store to use (not started by jax.distributed): a device all-gather
        from jax.experimental import multihost_utils
        gathered = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.float64)))
        return [float(v) for v in np.max(gathered.reshape(jax.process_count(), -1), axis=0)]
    # Keys are written once: every exchange gets its own prefix, the same on every process.
    key = f"entwine_timing/{next(_exchanges)}"
    _distributed.kv_set(f"{key}/{jax.process_index()}", json.dumps([float(v) for v in values]).encode())
    rows = [json.loads(_distributed.kv_get(f"{key}/{p}", timeout_ms)) for p in range(jax.process_count())]
    if any(len(row) != len(values) for row in rows):
        raise RuntimeError(f"max_over_processes: processes passed lists of lengths {[len(r) for r in rows]}")
    return [float(v) for v in np.max(np.asarray(rows, np.float64), axis=0)]
