"""The collective census of one MLP block's training step: written in plain JAX, routed through
entwine_jax.ag_gemm / gemm_rs in bf16, and routed in FP8; each program's collectives, what each device
moves on a GPU, and whether the routed programs move more than the plain one.

Each function is one block's loss on this rank's tokens, x [T, D] sharded over dp and tp, w1 [D, F]
over its columns, w2 [F, D] over its rows (tensor parallel over tp, data parallel over dp):

    python examples/census_mlp.py            # the three tables and the comparisons (8 CPU devices)
    python -m entwine_jax census examples/census_mlp.py:routed --grad --mesh dp=2,tp=4 \\
        --arg 'bf16[256,512]@dp+tp,_' --arg 'bf16[512,1024]@_,tp' --arg 'bf16[1024,512]@tp,_' \\
        --twin examples/census_mlp.py:plain

Nothing runs and nothing is allocated: the programs are compiled from shapes.
"""
import argparse
import os
import sys

# Before jax is imported: 8 CPU devices unless the caller chose a count (harmless on GPUs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import entwine_jax  # noqa: E402
from entwine_jax import census, fp8  # noqa: E402

SPECS = (P(("dp", "tp"), None), P(None, "tp"), P("tp", None))


def _island(block):
    # The mesh comes from jax.set_mesh (census.collectives sets it); the loss is summed over every rank.
    def loss(x, w1, w2):
        return jax.lax.psum(jnp.sum(jnp.square(block(x, w1, w2).astype(jnp.float32))), ("dp", "tp"))
    return jax.shard_map(loss, in_specs=SPECS, out_specs=P())


def _plain(x, w1, w2):
    h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
    return jax.lax.psum_scatter(jnp.tanh(h) @ w2, "tp", scatter_dimension=0, tiled=True)


def _routed(x, w1, w2):
    h = entwine_jax.ag_gemm(x, w1, axis_name="tp")
    return entwine_jax.gemm_rs(jnp.tanh(h), w2, axis_name="tp")


def _routed_fp8(x, w1, w2):
    # Current scaling: each rank's scales of its own operands (entwine_jax.fp8).
    h = entwine_jax.ag_gemm(x, w1, axis_name="tp", x_scale=fp8.current_scale(x), w_scale=fp8.current_scale(w1))
    t = jnp.tanh(h)
    return entwine_jax.gemm_rs(t, w2, axis_name="tp", x_scale=fp8.current_scale(t), w_scale=fp8.current_scale(w2))


plain, routed, routed_fp8 = _island(_plain), _island(_routed), _island(_routed_fp8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=1024)
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    shapes = ((args.tokens, args.d_model), (args.d_model, args.d_ff), (args.d_ff, args.d_model))
    inputs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p)) for s, p in zip(shapes, SPECS)]
    found = {}
    for name, fn in (("plain", plain), ("routed", routed), ("routed_fp8", routed_fp8)):
        found[name] = census.collectives(jax.grad(fn, argnums=(0, 1, 2)), *inputs, mesh=mesh)
        print(found[name].table(title=f"{name}: one training step, bytes per device"), end="\n\n")
    for name in ("routed", "routed_fp8"):
        print(census.compare(found[name], found["plain"], (name, "plain")), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
