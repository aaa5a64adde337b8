# The layers on the fused path (GPU): an NNX RowParallelLinear (ColumnParallelLinear) over every
# local GPU in bf16 lowers to the entwine_gemm_rs (entwine_ag_gemm) custom call in every scatter
# (gather) mode and matches the unsharded product, and the training-step example's GPU presets train
# in lockstep with plain XLA (sp-gpu: every tensor-parallel collective fused, checked in the HLO).
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from entwine_jax import AgGemmConfig, GemmRsConfig  # noqa: E402
from entwine_jax.layers import (DEFAULT_LOGICAL_AXIS_RULES, ColumnParallelLinear, RowParallelLinear,  # noqa: E402
                                partition_specs)

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_step.py"


def row_parallel_check(mesh, scatter, expect_fused=True):
    """Forward of a bf16 RowParallelLinear inside shard_map against the float64 product."""
    world = mesh.shape["tp"]
    rows, d_in, d_out = 256 * world, 512 * world, 1024
    # "sequence" splits S of [B, S, in]: the same rows as [2, rows / 2, in].
    x_shape = (2, rows // 2, d_in) if scatter == "sequence" else (rows, d_in)
    x_spec = P(*([None] * (len(x_shape) - 1)), "tp")
    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_LOGICAL_AXIS_RULES):
        # One GPU (W = 1): "auto" would keep XLA's GEMM; the test is about the fused wiring.
        config = GemmRsConfig(path="fused") if world == 1 and expect_fused else None
        layer = RowParallelLinear(d_in, d_out, scatter=scatter, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                  config=config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    specs = partition_specs(state, DEFAULT_LOGICAL_AXIS_RULES)
    out_spec = {"rows": P("tp", None), "sequence": P(None, "tp", None), "hidden": P(None, "tp")}[scatter]
    f = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh,
                              in_specs=(specs, x_spec), out_specs=out_spec))
    x = jax.random.normal(jax.random.key(1), x_shape, jnp.float32).astype(jnp.bfloat16)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, x_spec)
        if expect_fused:
            assert "entwine_gemm_rs" in f.lower(state, x).as_text()
        y = np.asarray(f(state, x), np.float64)
    kernel = np.asarray(nnx.to_pure_dict(state)["kernel"], np.float64)
    ref = np.asarray(x, np.float64) @ kernel
    assert y.shape == ref.shape
    assert np.linalg.norm(y - ref) <= 1e-2 * np.linalg.norm(ref)


@pytest.mark.gpu
@pytest.mark.parametrize("scatter", ["rows", "sequence", "hidden"])
def test_row_parallel_layer_takes_the_fused_path(scatter):
    mesh = jax.make_mesh((len(jax.devices("cuda")[:8]),), ("tp",), devices=jax.devices("cuda")[:8])
    row_parallel_check(mesh, scatter)


@pytest.mark.gpu
@pytest.mark.parametrize("gather", ["rows", "sequence", "hidden"])
def test_column_parallel_layer_takes_the_fused_path(gather):
    devices = jax.devices("cuda")[:8]
    mesh = jax.make_mesh((len(devices),), ("tp",), devices=devices)
    world = len(devices)
    rows, d_in, d_out = 256 * world, 512 * world, 1024 * world
    x_shape = (2, rows // 2, d_in) if gather == "sequence" else (rows, d_in)
    x_spec = {"rows": P("tp", None), "sequence": P(None, "tp", None), "hidden": P(None, "tp")}[gather]
    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_LOGICAL_AXIS_RULES):
        config = AgGemmConfig(path="fused") if world == 1 else None
        layer = ColumnParallelLinear(d_in, d_out, gather=gather, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                     config=config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    specs = partition_specs(state, DEFAULT_LOGICAL_AXIS_RULES)
    out_spec = P(*([None] * (len(x_shape) - 1)), "tp")
    f = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh, in_specs=(specs, x_spec),
                              out_specs=out_spec))
    x = jax.random.normal(jax.random.key(2), x_shape, jnp.float32).astype(jnp.bfloat16)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, x_spec)
        assert "entwine_ag_gemm" in f.lower(state, x).as_text()
        y = np.asarray(f(state, x), np.float64)
    kernel = np.asarray(nnx.to_pure_dict(state)["kernel"], np.float64)
    ref = np.asarray(x, np.float64) @ kernel
    assert y.shape == ref.shape
    assert np.linalg.norm(y - ref) <= 1e-2 * np.linalg.norm(ref)


@pytest.mark.multigpu
def test_train_step_example_sequence_parallel_preset():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--preset", "sp-gpu", "--steps", "3"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


@pytest.mark.gpu
def test_train_step_example_gpu_preset():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--preset", "gpu", "--steps", "3"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
