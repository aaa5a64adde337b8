"""A sequence-parallel MLP block with entwine_jax.ag_gemm and gemm_rs, checked against plain JAX.

Each tp rank holds its slice of the tokens, [T/dp/tp, D]. The column-parallel up projection
(w_up sharded on its output dim) gathers the tokens inside the GEMM (ag_gemm: AllGather + GEMM),
gelu, then the row-parallel down projection reduce-scatters them back to the rank's slice (gemm_rs:
GEMM + ReduceScatter). In the backward pass each op's dx is the other op, so neither direction has
another collective over "tp". Tokens are split over "dp" as well. Forward and gradients are
compared with the unsharded math; exits 1 on mismatch.

Runs anywhere: on CPU it forces 8 host devices (dp=2 x tp=4); on GPUs it uses them all.
"""
import argparse
import os
import sys

# Before jax is imported: 8 CPU devices unless the caller chose a count (harmless on GPUs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import entwine_jax  # noqa: E402

TOKENS, D_MODEL, D_FF = 1024, 512, 2048
DTYPE = jnp.bfloat16
# bf16 inputs and outputs, fp32 accumulation: errors relative to the largest reference entry.
TOL = 2e-2


def mlp_tp(x, w_up, w_down):
    """Per device: x [T/dp/tp, D], w_up [D, F/tp], w_down [F/tp, D] -> [T/dp/tp, D]."""
    h = jax.nn.gelu(entwine_jax.ag_gemm(x, w_up, axis_name="tp"))  # [T/dp, F/tp]
    return entwine_jax.gemm_rs(h, w_down, axis_name="tp")


def mlp_plain(x, w_up, w_down):
    """The unsharded math in fp32."""
    f32 = lambda a: a.astype(jnp.float32)
    return jax.nn.gelu(f32(x) @ f32(w_up)) @ f32(w_down)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def main(argv=None) -> int:
    # No options: --help prints what the example does, without running it.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    n = len(jax.devices())
    dp = 2 if n >= 4 and n % 2 == 0 else 1
    tp = n // dp
    mesh = jax.make_mesh((dp, tp), ("dp", "tp"))
    print(f"mesh dp={dp} x tp={tp} on {jax.devices()[0].platform}; extension: {entwine_jax.extension_status()[1]}")

    kx, ku, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (TOKENS, D_MODEL), jnp.float32).astype(DTYPE)
    w_up = (jax.random.normal(ku, (D_MODEL, D_FF), jnp.float32) / D_MODEL**0.5).astype(DTYPE)
    w_down = (jax.random.normal(kd, (D_FF, D_MODEL), jnp.float32) / D_FF**0.5).astype(DTYPE)

    # Input and output rows: split over dp, then over tp inside each dp group.
    rows = P(("dp", "tp"), None)
    specs = (rows, P(None, "tp"), P("tp", None))
    layer = jax.shard_map(mlp_tp, mesh=mesh, in_specs=specs, out_specs=rows)
    forward = jax.jit(layer)
    loss = lambda f: (lambda x, wu, wd: jnp.mean(f(x, wu, wd).astype(jnp.float32) ** 2))
    grads = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))

    with jax.set_mesh(mesh):
        args = [jax.device_put(a, s) for a, s in zip((x, w_up, w_down), specs)]
        y = forward(*args)
        g_x, g_up, g_down = grads(*args)
    y_ref = mlp_plain(x, w_up, w_down)
    r_x, r_up, r_down = jax.grad(loss(mlp_plain), argnums=(0, 1, 2))(x, w_up, w_down)

    errors = {"forward": rel_err(y, y_ref), "grad x": rel_err(g_x, r_x), "grad w_up": rel_err(g_up, r_up),
              "grad w_down": rel_err(g_down, r_down)}
    for name, err in errors.items():
        print(f"{name:12s} max error {err:.2e} (relative to max |reference|, tolerance {TOL:.0e})")
    if y.shape != y_ref.shape or y.dtype != DTYPE or max(errors.values()) > TOL:
        print(f"MISMATCH: shape {y.shape} dtype {y.dtype}, expected {y_ref.shape} {DTYPE}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
