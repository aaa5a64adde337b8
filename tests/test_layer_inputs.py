# entwine_jax.layers on inputs the other layer tests leave out, on fake CPU devices (gemm_rs and
# ag_gemm take their XLA path): an axis of size 3 (odd, not a power of two), rank-4 inputs, an
# axis_name that is a tuple of mesh axes, jax.vmap inside shard_map, Linen nn.scan / nn.remat over
# stacked blocks, and an axis name the enclosing shard_map does not bind. Each result is checked
# against the unsharded float64 math.

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from entwine_jax import layers  # noqa: E402
from entwine_jax.layers import (DEFAULT_LOGICAL_AXIS_RULES, ColumnParallelDense, ColumnParallelLinear,  # noqa: E402
                                RowParallelDense, RowParallelLinear, partition_specs)

RULES = DEFAULT_LOGICAL_AXIS_RULES
TOL = 1e-5  # float32 against float64, relative to max |reference|


def tp_mesh(size):
    return Mesh(np.array(jax.devices()[:size]), ("tp",))


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def nnx_apply(mesh, module, x, x_spec, out_spec):
    """The global output of module(x) under shard_map, its parameters placed by partition_specs."""
    graphdef, state = nnx.split(module)
    specs = partition_specs(state, RULES)
    f = jax.jit(jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh, in_specs=(specs, x_spec),
                              out_specs=out_spec))
    with jax.set_mesh(mesh):
        return f(state, x), nnx.to_pure_dict(state)


@pytest.mark.parametrize("layer_cls,mode", [(RowParallelLinear, "rows"), (RowParallelLinear, "hidden"),
                                            (ColumnParallelLinear, "rows"), (ColumnParallelLinear, "hidden")])
def test_parallel_linear_on_an_axis_of_size_3(layer_cls, mode):
    # W = 3, a world size that is not a power of two: the reduce-scatter's tiles and the bias slice of
    # the row layer's "hidden" scatter (rank r adds b[r*n/3:(r+1)*n/3]; the nonzero bias shows a
    # misplaced slice), and the all-gather's order (rows or contraction dim) of the column layer.
    mesh = tp_mesh(3)
    row = layer_cls is RowParallelLinear
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        layer = layer_cls(9, 12, **{("scatter" if row else "gather"): mode}, use_bias=True,
                          bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
    x = normal(1, (6, 9))
    x_spec = P(None, "tp") if row or mode == "hidden" else P("tp", None)
    out_spec = P("tp", None) if row and mode == "rows" else P(None, "tp")
    y, p = nnx_apply(mesh, layer, x, x_spec, out_spec)
    ref = np.asarray(x, np.float64) @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)
    assert y.shape == (6, 12) and rel_err(y, ref) <= TOL


def test_rank4_sequence_round_trip():
    # [B, S, H, D] inputs: scatter="sequence" splits dim 1 and gather="sequence" restores it, with the
    # two middle dims kept whole; the result is the unsharded up- then down-projection.
    mesh = tp_mesh(4)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        up = ColumnParallelLinear(8, 16, gather="sequence", rngs=nnx.Rngs(0))
        down = RowParallelLinear(16, 8, scatter="sequence", rngs=nnx.Rngs(1))
    graphdef, state = nnx.split((up, down))
    specs = partition_specs(state, RULES)

    def fn(s, x):
        u, d = nnx.merge(graphdef, s)
        return d(jnp.tanh(u(x)))

    spec = P(None, "tp", None, None)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, spec), out_specs=spec))
    x = normal(3, (2, 4, 3, 8))
    with jax.set_mesh(mesh):
        y = f(state, x)
    p = nnx.to_pure_dict(state)
    x64 = np.asarray(x, np.float64)
    ref = np.tanh(x64 @ np.asarray(p[0]["kernel"], np.float64)) @ np.asarray(p[1]["kernel"], np.float64)
    assert y.shape == x.shape and rel_err(y, ref) <= TOL


@pytest.mark.parametrize("scatter", ["rows", "hidden"])
def test_row_parallel_over_two_mesh_axes(scatter):
    # axis_name=("dp", "tp"): the reduce-scatter runs over both axes (8 ranks) and the "hidden" bias
    # slice follows the same rank order as the scatter's tiles.
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))
    axes = ("dp", "tp")
    k, b, x = normal(4, (16, 16)), normal(5, (16,)), normal(6, (8, 16))
    out_spec = P(axes, None) if scatter == "rows" else P(None, axes)
    f = jax.jit(jax.shard_map(lambda x, k, b: layers.row_parallel_linear(x, k, b, axis_name=axes, scatter=scatter),
                              mesh=mesh, in_specs=(P(None, axes), P(axes, None), P()), out_specs=out_spec))
    with jax.set_mesh(mesh):
        y = f(x, k, b)
    ref = np.asarray(x, np.float64) @ np.asarray(k, np.float64) + np.asarray(b, np.float64)
    assert rel_err(y, ref) <= TOL


def test_row_parallel_under_vmap_with_gradient():
    # jax.vmap over micro-batches inside shard_map: gemm_rs is batched, the kernel gradient sums over
    # the mapped batch and every row.
    mesh = tp_mesh(4)
    xb, k, b, cot = normal(7, (3, 8, 16)), normal(8, (16, 16)), normal(9, (16,)), normal(10, (3, 8, 16))
    fn = lambda x, k, b: jax.vmap(lambda xi: layers.row_parallel_linear(xi, k, b))(x)
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None), P()), out_specs=P(None, "tp", None))
    with jax.set_mesh(mesh):
        y = jax.jit(f)(xb, k, b)
        gk = jax.jit(jax.grad(lambda k: jnp.sum(f(xb, k, b) * cot)))(k)
    x64 = np.asarray(xb, np.float64)
    assert rel_err(y, x64 @ np.asarray(k, np.float64) + np.asarray(b, np.float64)) <= TOL
    assert rel_err(gk, np.einsum("bti,bto->io", x64, np.asarray(cot, np.float64))) <= TOL


class _Block(nn.Module):
    """A residual sequence-parallel SwiGLU block; (carry, None) for nn.scan."""
    features: int

    @nn.compact
    def __call__(self, x, _):
        gate = ColumnParallelDense(self.features, gather="rows", use_bias=True, name="gate")(x)
        up = ColumnParallelDense(self.features, gather="rows", use_bias=True, name="up")(x)
        return x + RowParallelDense(x.shape[-1], use_bias=True, name="down")(jax.nn.silu(gate) * up), None


class _Stack(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, x):
        block = nn.remat(_Block) if self.remat else _Block
        scan = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2,
                       metadata_params={nn.PARTITION_NAME: None})
        return scan(32, name="blocks")(x, None)[0]


@pytest.mark.parametrize("remat", [False, True])
def test_linen_scan_over_blocks(remat):
    # nn.scan stacks the parameters on a new leading dim (logical axis None: partition_specs keeps it
    # whole); forward and parameter gradients match the unrolled unsharded blocks.
    mesh = tp_mesh(4)
    x, cot = normal(11, (8, 16)), normal(12, (8, 16))
    model = _Stack(remat)
    variables = model.init(jax.random.key(0), x)
    specs = partition_specs(variables, RULES)
    assert specs["params"]["blocks"]["gate"]["kernel"] == P(None, None, "tp")
    f = jax.shard_map(model.apply, mesh=mesh, in_specs=(specs, P("tp", None)), out_specs=P("tp", None))
    with jax.set_mesh(mesh):
        placed = jax.device_put(variables, specs)
        y = jax.jit(f)(placed, x)
        grads = jax.jit(jax.grad(lambda v: jnp.sum(f(v, x) * cot)))(placed)
    params = nn.unbox(variables)["params"]["blocks"]

    def reference(p, x):
        for i in range(2):
            q = jax.tree.map(lambda a: a[i], p)
            h = lambda n: x @ q[n]["kernel"] + q[n]["bias"]
            x = x + (jax.nn.silu(h("gate")) * h("up")) @ q["down"]["kernel"] + q["down"]["bias"]
        return x

    assert rel_err(y, reference(params, x)) <= TOL
    expected = jax.grad(lambda p: jnp.sum(reference(p, x) * cot))(params)
    got = nn.unbox(grads)["params"]["blocks"]
    for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        assert rel_err(g, e) <= 1e-4, jax.tree_util.keystr(path)


def test_axis_name_missing_from_the_mesh():
    # Inside a shard_map whose mesh has no axis "model": a ValueError naming axis_name, not JAX's
    # unbound-axis NameError from inside the collective.
    mesh = tp_mesh(4)
    with nnx.use_eager_sharding(False):
        layer = ColumnParallelLinear(16, 8, gather="rows", axis_name="model", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    f = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh, in_specs=(P(), P("tp", None)),
                      out_specs=P())
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"ColumnParallelLinear: axis_name 'model' is not bound"):
        jax.eval_shape(f, state, jax.ShapeDtypeStruct((8, 16), jnp.float32))
