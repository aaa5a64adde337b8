# How far apart do identical programs read under bench.time_interleaved, the timing of the bench and
# of tune()? Times `copies` copies of one program, each compiled on its own, in interleaved rounds,
# and prints the spread (slowest / fastest - 1) of each repetition: for XLA's GEMM and for the fused
# op on one GPU (W = 1, path="fused"). A spread is the smallest difference those tools can resolve.
# Usage: python scripts/timing_spread.py [copies]   (one GPU is enough; docs/PERF.md v17)
import sys

import jax
import jax.numpy as jnp

import entwine_jax
from entwine_jax import GemmRsConfig, tuning
from entwine_jax.bench import time_interleaved

copies = int(sys.argv[1]) if len(sys.argv) > 1 else 6
mesh = jax.make_mesh((1,), ("tp",), devices=jax.local_devices()[:1])
entwine_jax.setup(mesh, "tp")
fused = GemmRsConfig(block_n=256, producer_sms=116, consumer_grid=16, raster_rows=8, path="fused")
for shape, dtype in [((8192, 8192, 1024), jnp.bfloat16), ((16384, 16384, 6656), jnp.float16)]:
    x, w = tuning._inputs(mesh, "tp", shape, 1, dtype, seed=0)
    makers = {
        "XLA dot": lambda: tuning._compile(mesh, "tp", lambda x, w: jnp.dot(x, w), x, w)[1],
        "fused W=1": lambda: tuning._build(mesh, "tp", fused, x, w)[0],
    }
    for kind, make in makers.items():
        programs = {c: (make(), (x, w)) for c in range(copies)}
        if programs[0][0] is None:
            print(f"{kind}: the fused path does not run here")
            continue
        for iters, batch in [(50, 10), (50, 10), (50, 10), (200, 10), (200, 2)]:
            ms = time_interleaved(programs, iters, 10, batch)
            lo, hi = min(ms.values()), max(ms.values())
            print(f"{'x'.join(map(str, shape))} {jnp.dtype(dtype).name} {kind:9s} iters {iters:3d} batch {batch:2d}: "
                  f"spread {100 * (hi / lo - 1):4.1f}% | " + " ".join(f"{ms[c]:.4f}" for c in range(copies)), flush=True)
