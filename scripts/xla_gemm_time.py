"""Time XLA's own GEMM (jnp.dot, bf16 in/out, fp32 accumulation) on the design's suite shapes, one GPU.

Per-call time = wall time of 20 back-to-back asynchronous calls / 20 (the GPU stays busy: the kernels
are longer than dispatch), median of 15 batches after warm-up. Prints a table and writes JSON lines.
Usage: python scripts/xla_gemm_time.py [out.jsonl]
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

SUITE = [(4096, 8192, 1024), (8192, 8192, 1024), (16384, 8192, 1024), (8192, 8192, 3584),
         (16384, 8192, 3584), (8192, 16384, 2048), (16384, 16384, 2048), (16384, 16384, 6656)]


def per_call_ms(fn, *args, batch=20, batches=15):
    for _ in range(3):
        fn(*args).block_until_ready()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(batch):
            y = fn(*args)
        y.block_until_ready()
        times.append((time.perf_counter() - t0) / batch * 1e3)
    return float(np.median(times))


def main():
    out = open(sys.argv[1], "w") if len(sys.argv) > 1 else None
    dot = jax.jit(lambda x, w: jnp.dot(x, w))
    print(f"{jax.devices()[0].device_kind}: XLA jnp.dot bf16")
    for m, n, k in SUITE:
        kx, kw = jax.random.split(jax.random.key(m + n + k))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = jax.random.normal(kw, (k, n), jnp.bfloat16)
        ms = per_call_ms(dot, x, w)
        print(f"{m:6d} {n:6d} {k:5d}  {ms:8.3f} ms  {2 * m * n * k / ms / 1e9:6.0f} TF/s")
        if out:
            out.write(json.dumps({"kind": "xla_gemm", "m": m, "n": n, "k": k, "ms": ms}) + "\n")


if __name__ == "__main__":
    main()
