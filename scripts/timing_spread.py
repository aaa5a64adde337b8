# How far apart do identical programs read under bench.time_interleaved, the timing of the bench and
# of tune()? Times `copies` copies of one program, each compiled on its own, in interleaved rounds,
# and prints the spread (slowest / fastest - 1) of each repetition: gemm_rs on the XLA path and on
# the fused path, over the first W local GPUs (W = 1: XLA's GEMM, and the fused kernels with
# path="fused"). A spread is the smallest difference those tools can resolve.
# Usage: python scripts/timing_spread.py [copies] [W]   (docs/PERF.md v17)
import sys

import jax
import jax.numpy as jnp

import entwine_jax
from entwine_jax import GemmRsConfig, gemm_rs, tuning
from entwine_jax.bench import time_interleaved

copies = int(sys.argv[1]) if len(sys.argv) > 1 else 6
world = min(int(sys.argv[2]) if len(sys.argv) > 2 else 1, len(jax.local_devices()))
mesh = jax.make_mesh((world,), ("tp",), devices=jax.local_devices()[:world])
entwine_jax.setup(mesh, "tp")
configs = {"XLA path": GemmRsConfig(path="xla"),
           "fused": GemmRsConfig(block_n=256, producer_sms=116, consumer_grid=16, raster_rows=8, path="fused")}


def compile_copy(config, x, w):
    """One more compiled gemm_rs program with `config`; None where the fused path does not run."""
    if config.path == "fused":
        return tuning._build(mesh, "tp", config, x, w)[0]
    return tuning._compile(mesh, "tp", lambda x, w: gemm_rs(x, w, axis_name="tp", config=config), x, w)[1]


for shape, dtype in [((8192, 8192, 1024), jnp.bfloat16), ((16384, 16384, 6656), jnp.float16)]:
    x, w = tuning._inputs(mesh, "tp", shape, world, dtype, seed=0)
    for kind, config in configs.items():
        programs = {c: (compile_copy(config, x, w), (x, w)) for c in range(copies)}
        if programs[0][0] is None:
            print(f"{kind}: the fused path does not run here")
            continue
        for iters, batch in [(50, 10), (50, 10), (50, 10), (200, 10), (200, 2)]:
            ms = time_interleaved(programs, iters, 10, batch)
            lo, hi = min(ms.values()), max(ms.values())
            print(f"W={world} {'x'.join(map(str, shape))} {jnp.dtype(dtype).name} {kind:8s} iters {iters:3d} batch {batch:2d}: "
                  f"spread {100 * (hi / lo - 1):4.1f}% | " + " ".join(f"{ms[c]:.4f}" for c in range(copies)), flush=True)
