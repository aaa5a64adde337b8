# The grouped ag_gemm against separate calls on one GPU: one call on (w_1, ..., w_G) (each weight read
# where it lies), the same call on the weights joined first (what a group the kernels cannot read in
# place costs: a copy of the weights per call), G calls (each its own gather and GEMM), and XLA's GEMM
# on the concatenated weights. One process, an axis of size 1 with path="fused" (the kernels run;
# nothing travels), so the numbers are the GEMMs and the copy.
"""Grouped ag_gemm vs separate ag_gemm calls (one GPU, axis of size 1, path="fused").

    python benchmarks/bench_grouped.py [--iters 100]

Shapes: a Llama-3-70B layer's per-rank projections at tensor 8 with 16384 tokens per tensor group:
q/k/v (K 8192, N 1024 + 128 + 128) and gate/up (K 8192, N 3584 + 3584). One line per shape.
"""
import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax.tuning.timing import rel_err, time_interleaved

SHAPES = {"qkv": (16384, 8192, (1024, 128, 128)), "gate/up": (16384, 8192, (3584, 3584))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_grouped: needs a GPU (the fused kernels)", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
    config = entwine_jax.AgGemmConfig(path="fused")
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, bf16, axis of size 1, median of "
          f"{args.iters} calls (ms)")
    print(f"{'shape':>8} {'M':>6} {'K':>5} {'widths':>18} | {'grouped':>8} {'joined':>8} {'separate':>8} "
          f"{'xla dot':>8} | grouped/separate")
    for name, (m, k, widths) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), len(widths) + 1)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        ws = tuple(jax.random.normal(kw, (k, n), jnp.bfloat16) / 64 for kw, n in zip(keys[1:], widths))
        specs = dict(mesh=mesh, in_specs=(P("tp", None),) + (P(None, "tp"),) * len(ws),
                     out_specs=(P(None, "tp"),) * len(ws))
        grouped = jax.jit(jax.shard_map(lambda x, *w: entwine_jax.ag_gemm(x, w, axis_name="tp", config=config),
                                        **specs))
        separate = jax.jit(jax.shard_map(
            lambda x, *w: tuple(entwine_jax.ag_gemm(x, wi, axis_name="tp", config=config) for wi in w), **specs))
        joined = jax.jit(jax.shard_map(lambda x, *w: tuple(jnp.split(
            entwine_jax.ag_gemm(x, jnp.concatenate(w, axis=1), axis_name="tp", config=config),
            np.cumsum(widths)[:-1].tolist(), axis=1)), **specs))
        xla = jax.jit(lambda x, *w: jnp.dot(x, jnp.concatenate(w, axis=1), preferred_element_type=jnp.bfloat16))
        # XLA's programs take the operands as plain arrays; the ops' take them placed on the mesh.
        ref = xla(x, *ws)
        with jax.set_mesh(mesh):
            xm = jax.device_put(x, P("tp", None))
            wm = tuple(jax.device_put(w, P(None, "tp")) for w in ws)
            # The fused call with every weight an operand of its own (x, then the G weights).
            call = re.search(r"custom_call @entwine_ag_gemm\(([^)]*)\)", grouped.lower(xm, *wm).as_text())
            if call is None or len(call.group(1).split(",")) != 1 + len(ws):
                print(f"{name}: the grouped call did not lower to one fused call on the weights in place",
                      file=sys.stderr)
                return 1
            err = rel_err(jnp.concatenate(grouped(xm, *wm), axis=1), ref)
            ms = time_interleaved({"grouped": (grouped, (xm, *wm)), "joined": (joined, (xm, *wm)),
                                   "separate": (separate, (xm, *wm)), "xla": (xla, (x, *ws))}, args.iters, 10, 10)
        print(f"{name:>8} {m:>6} {k:>5} {str(widths):>18} | {ms['grouped']:8.3f} {ms['joined']:8.3f} "
              f"{ms['separate']:8.3f} {ms['xla']:8.3f} | {ms['grouped'] / ms['separate']:.3f} (rel err {err:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
