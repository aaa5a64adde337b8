# The grouped ag_gemm against separate calls on one GPU: one call on (w_1, ..., w_G) (each weight read
# where it lies), the same call on the weights joined first (what a group the kernels cannot read in
# place costs: a copy of the weights per call), G calls (each its own gather and GEMM), and XLA's GEMM
# on the concatenated weights. One process, an axis of size 1 with path="fused" (the kernels run;
# nothing travels), so the numbers are the GEMMs and the copy.
"""Grouped ag_gemm vs separate ag_gemm calls (one GPU, axis of size 1, path="fused").

    python benchmarks/bench_grouped.py [--iters 100] [--fp8]

Shapes: a Llama-3-70B layer's per-rank projections at tensor 8 with 16384 tokens per tensor group:
q/k/v (K 8192, N 1024 + 128 + 128) and gate/up (K 8192, N 3584 + 3584). One line per shape.
--fp8: e4m3 operands with per-tensor scales, bf16 out: the group shares one w_scale (the largest of
its weights' current scales), the separate calls each take their weight's own, and XLA's column is
its dot of the e4m3 operands in fp32 times the scales.
"""
import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import fp8
from entwine_jax.tuning.timing import rel_err, time_interleaved

SHAPES = {"qkv": (16384, 8192, (1024, 128, 128)), "gate/up": (16384, 8192, (3584, 3584))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--fp8", action="store_true", help="e4m3 operands, per-tensor scales")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_grouped: needs a GPU (the fused kernels)", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
    config = entwine_jax.AgGemmConfig(path="fused")
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {'e4m3 -> bf16' if args.fp8 else 'bf16'}, "
          f"axis of size 1, median of {args.iters} calls (ms)")
    print(f"{'shape':>8} {'M':>6} {'K':>5} {'widths':>18} | {'grouped':>8} {'joined':>8} {'separate':>8} "
          f"{'xla dot':>8} | grouped/separate")
    for name, (m, k, widths) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), len(widths) + 1)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        ws = tuple(jax.random.normal(kw, (k, n), jnp.bfloat16) / 64 for kw, n in zip(keys[1:], widths))
        splits = np.cumsum(widths)[:-1].tolist()
        if args.fp8:
            # bf16 operands and their scales (replicated operands): each call quantises them, as a
            # layer's step does (the weights' transposed e4m3 copy is made in the same pass).
            x_scale = fp8.current_scale(x)
            w_scales = tuple(fp8.current_scale(w) for w in ws)
            shared = jnp.max(jnp.stack(w_scales))  # one scale for the whole group
            scales, n_scales, g = (x_scale, shared, *w_scales), 2 + len(ws), len(ws)

            def op(x, w, xs, wsc):
                return entwine_jax.ag_gemm(x, w, axis_name="tp", config=config, x_scale=xs, w_scale=wsc,
                                           out_dtype=jnp.bfloat16)
            # Arguments: x, x_scale, the shared w_scale, each weight's own w_scale, the weights.
            grouped_fn = lambda x, xs, sh, *r: op(x, tuple(r[g:]), xs, sh)  # noqa: E731
            separate_fn = lambda x, xs, sh, *r: tuple(op(x, wi, xs, si) for wi, si in zip(r[g:], r[:g]))  # noqa: E731
            joined_fn = lambda x, xs, sh, *r: tuple(jnp.split(  # noqa: E731
                op(x, jnp.concatenate(r[g:], axis=1), xs, sh), splits, axis=1))
            xla = jax.jit(lambda x, xs, sh, *r: (jnp.dot(
                fp8.quantize(x, xs), fp8.quantize(jnp.concatenate(r[g:], axis=1), sh),
                preferred_element_type=jnp.float32) * (xs * sh)).astype(jnp.bfloat16))
        else:
            scales, n_scales = (), 0
            grouped_fn = lambda x, *w: entwine_jax.ag_gemm(x, w, axis_name="tp", config=config)  # noqa: E731
            separate_fn = lambda x, *w: tuple(  # noqa: E731
                entwine_jax.ag_gemm(x, wi, axis_name="tp", config=config) for wi in w)
            joined_fn = lambda x, *w: tuple(jnp.split(  # noqa: E731
                entwine_jax.ag_gemm(x, jnp.concatenate(w, axis=1), axis_name="tp", config=config), splits, axis=1))
            xla = jax.jit(lambda x, *w: jnp.dot(x, jnp.concatenate(w, axis=1), preferred_element_type=jnp.bfloat16))
        specs = dict(mesh=mesh, in_specs=(P("tp", None),) + (P(),) * n_scales + (P(None, "tp"),) * len(ws),
                     out_specs=(P(None, "tp"),) * len(ws))
        grouped, separate, joined = (jax.jit(jax.shard_map(f, **specs)) for f in (grouped_fn, separate_fn, joined_fn))
        # XLA's programs take the operands as plain arrays; the ops' take them placed on the mesh.
        ref = xla(x, *scales, *ws)
        with jax.set_mesh(mesh):
            xm = jax.device_put(x, P("tp", None))
            wm = tuple(jax.device_put(v, P()) for v in scales) + tuple(jax.device_put(w, P(None, "tp")) for w in ws)
            # The fused call with every weight an operand of its own (x, then the G weights; FP8: their
            # scales after them), nothing concatenated.
            text = grouped.lower(xm, *wm).as_text()
            target = "entwine_ag_gemm_fp8" if args.fp8 else "entwine_ag_gemm"
            call = re.search(rf"custom_call @{target}\(([^)]*)\)", text)
            operands = len(call.group(1).split(",")) if call else 0
            if operands != 1 + len(ws) + (2 if args.fp8 else 0) or "stablehlo.concatenate" in text:
                print(f"{name}: the grouped call did not lower to one fused call on the weights in place "
                      f"({target}: {operands} operands; concatenate: {'stablehlo.concatenate' in text})",
                      file=sys.stderr)
                return 1
            err = rel_err(jnp.concatenate(grouped(xm, *wm), axis=1), ref)
            ms = time_interleaved({"grouped": (grouped, (xm, *wm)), "joined": (joined, (xm, *wm)),
                                   "separate": (separate, (xm, *wm)), "xla": (xla, (x, *scales, *ws))},
                                  args.iters, 10, 10)
        print(f"{name:>8} {m:>6} {k:>5} {str(widths):>18} | {ms['grouped']:8.3f} {ms['joined']:8.3f} "
              f"{ms['separate']:8.3f} {ms['xla']:8.3f} | {ms['grouped'] / ms['separate']:.3f} (rel err {err:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
