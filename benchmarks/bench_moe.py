# The MoE MLP's training step (forward and backward) on the kernels against XLA's own ops, on one GPU:
# an expert axis of size 1, so that XLA's path (its all-to-all, trivial at one rank, and its batched
# expert GEMMs) runs in the same process; path="fused" runs the kernels, which still move every
# row through their inboxes. What it measures is the kernels' GEMMs and moves against XLA's GEMMs
# and copies, not NVLink (ranks sharing one GPU cannot run XLA's all-to-all: NCCL). A third
# program is the same MLP as MaxText's sparse path runs it at one rank (tokens sorted by expert,
# jax.lax.ragged_dot over each expert's rows, no padding), the stock path users compare with.
"""MoE MLP step: kernels (path="fused"), XLA (path="xla") and ragged_dot, one GPU, expert axis of size 1.

    python benchmarks/bench_moe.py [--iters 50] [--fp8]

Shapes (T tokens, H, F, E experts, top k, capacity factor or None: dropless): Mixtral-8x7B's MLP at
4096 tokens, and a DeepSeek-V3-like layer (H 7168, F 2048) with 32 experts, each with a capacity
factor of 1 and dropless (C = T: the kernels skip each segment's blocks past the rows sent, XLA's
path multiplies them). One line per shape: median ms of a step (y and the gradients of sum(y * c)
w.r.t. x, router, wi_0, wi_1, wo), the other programs' steps over the kernels', and the relative
difference of y and d wo between the kernels and XLA's path (and of y against ragged_dot, dropless).
"""
import argparse
import functools
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import moe_layers
from entwine_jax.tuning.timing import rel_err, time_interleaved

# name: (T, H, F, E, k, capacity factor; None: dropless)
SHAPES = {"mixtral-8x7b": (4096, 4096, 14336, 8, 2, 1.0),
          "deepseek-like": (4096, 7168, 2048, 32, 8, 1.0),
          "mixtral dropless": (4096, 4096, 14336, 8, 2, None),
          "deepseek dropless": (4096, 7168, 2048, 32, 8, None)}


# x, router, wi_0, wi_1, wo, c. The router (and its gradient, out_specs) replicated: right at an axis of
# size 1 only, where this program runs (at W > 1 its gradient would be each rank's share).
SPECS = (P("ep"), P(), P("ep"), P("ep"), P("ep"), P("ep"))


def step_program(mesh, k: int, config, fp8):
    mlp = functools.partial(moe_layers.moe_mlp, num_experts_per_tok=k, axis_name="ep", config=config, fp8=fp8)

    def body(x, router, wi_0, wi_1, wo, c):
        y, pullback = jax.vjp(mlp, x, router, wi_0, wi_1, wo)
        return (y, *pullback(c))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=SPECS, out_specs=SPECS[-1:] + SPECS[:-1],
                                 check_vma=False))


def ragged_program(mesh, k: int):
    """The MLP's step as MaxText's sparse path computes it at one rank (megablox off): the same
    router, each token's k rows sorted by expert, ragged_dot on gate|up and on wo over each expert's
    rows, the rows weighted and summed back per token (dropless). Under the same shard_map as the
    other programs (at one rank: local arrays, which ragged_dot needs under an explicit mesh)."""
    def mlp(x, router, wi_0, wi_1, wo):
        idx, weights = moe_layers.route(x, router, k)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=router.shape[1]).astype(jnp.int32)
        w1 = jnp.concatenate([wi_0, wi_1], axis=2)
        y = jax.lax.ragged_dot(x[token], w1, sizes, preferred_element_type=jnp.float32)
        f = wi_0.shape[2]
        h = (jax.nn.silu(y[:, :f]) * y[:, f:]).astype(x.dtype)
        o = jax.lax.ragged_dot(h, wo, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
        out = jnp.zeros(x.shape, jnp.float32).at[token].add(o.astype(jnp.float32) * weights.reshape(-1)[order][:, None])
        return out.astype(x.dtype)

    def step(x, router, wi_0, wi_1, wo, c):
        y, pullback = jax.vjp(mlp, x, router, wi_0, wi_1, wo)
        return (y, *pullback(c))

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=SPECS, out_specs=SPECS[-1:] + SPECS[:-1], check_vma=False))


def fused_targets(program, operands) -> set:
    """The entwine custom-call targets in program's compiled HLO (by target: its metadata names the
    ops' scopes on either path)."""
    return set(re.findall(r'custom_call_target="(entwine_[a-z0-9_]+)"', program.lower(*operands).compile().as_text()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--fp8", action="store_true", help='fp8="current" (both expert GEMMs in FP8)')
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_moe: needs a GPU (the fused kernels)", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    fp8 = "current" if args.fp8 else None
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, bf16{' fp8=current' if fp8 else ''}, expert "
          f"axis of size 1, median of {args.iters} steps (ms)")
    print(f"{'shape':>17} {'T':>5} {'H':>5} {'F':>6} {'E':>3} {'k':>2} {'C':>5} | {'kernels':>8} {'xla':>8} {'ragged':>8} | "
          f"{'xla/kernels':>11} {'ragged/kern':>11} {'rel y':>8} {'rel dwo':>8} {'rel y rg':>8}")
    bad = 0
    for name, (t, h, f, e, k, factor) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), 6)
        x = jax.random.normal(keys[0], (t, h), jnp.bfloat16)
        router = jax.random.normal(keys[1], (h, e), jnp.bfloat16)
        wi_0, wi_1 = (jax.random.normal(kk, (e, h, f), jnp.bfloat16) / h ** 0.5 for kk in keys[2:4])
        wo = jax.random.normal(keys[4], (e, f, h), jnp.bfloat16) / f ** 0.5
        c = jax.random.normal(keys[5], (t, h), jnp.bfloat16)
        fused = step_program(mesh, k, entwine_jax.MoeConfig(capacity=factor, path="fused"), fp8)
        xla = step_program(mesh, k, entwine_jax.MoeConfig(capacity=factor, path="xla"), fp8)
        with jax.set_mesh(mesh):
            operands = tuple(jax.device_put(v, spec) for v, spec in zip((x, router, wi_0, wi_1, wo, c), SPECS))
            # Both must be what they say: the kernels' compiled program holds both GEMM kernels, XLA's
            # no call of ours.
            held, held_by_xla = fused_targets(fused, operands), fused_targets(xla, operands)
            want = {f"entwine_moe_dispatch_gemm{'_fp8' if fp8 else ''}", f"entwine_moe_gemm_combine{'_fp8' if fp8 else ''}"}
            if not want <= held or held_by_xla:
                print(f"{name}: the kernels' program holds {sorted(held)}, not {sorted(want)} (ENTWINE_PRINT_CONFIG=1 "
                      "says why), or XLA's holds a call of ours", file=sys.stderr)
                return 1
            got, ref = fused(*operands), xla(*operands)
            err_y, err_dwo = float(rel_err(got[0], ref[0])), float(rel_err(got[5], ref[5]))
            # Same routing, same capacity, GEMMs of the same operands: only summation order differs.
            bound = 0.15 if fp8 else 2e-2
            ok = err_y < bound and err_dwo < bound
            programs = {"kernels": (fused, operands), "xla": (xla, operands)}
            err_rg, ragged_failed = float("nan"), ""
            if factor is None and not fp8:  # the stock path drops nothing and multiplies bf16
                ragged = ragged_program(mesh, k)
                try:
                    err_rg = float(rel_err(got[0], ragged(*operands)[0]))
                except jax.errors.JaxRuntimeError as failure:  # not `e`: the experts' count
                    # XLA expands ragged_dot into dense dots over every expert's masked copy of the
                    # rows: at DeepSeek's shape its buffers can outgrow the GPU. Said in the row.
                    ragged_failed = f"  ragged: {str(failure).splitlines()[0][:120]}"
                else:
                    ok = ok and err_rg < bound
                    programs["ragged"] = (ragged, operands)
            bad += not ok
            # In the mesh, as above: outside it the kernels' program would be traced again without
            # its mesh and take XLA's path.
            ms = time_interleaved(programs, args.iters, 5, 5)
        capacity = entwine_jax.moe.op.capacity_rows(t, k, e, factor)
        rg = ms.get("ragged", float("nan"))
        print(f"{name:>17} {t:>5} {h:>5} {f:>6} {e:>3} {k:>2} {capacity:>5} | {ms['kernels']:8.3f} {ms['xla']:8.3f} "
              f"{rg:8.3f} | {ms['xla'] / ms['kernels']:11.3f} {rg / ms['kernels']:11.3f} {err_y:8.1e} {err_dwo:8.1e} "
              f"{err_rg:8.1e}{'' if ok else '  PATHS DISAGREE'}{ragged_failed}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
