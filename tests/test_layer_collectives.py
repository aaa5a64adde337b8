# The collectives over "tp" of a tensor-parallel SwiGLU block built from entwine_jax.layers, forward
# and backward under jit, on 8 fake CPU devices (dp=2 x tp=4): in the sequence-parallel layouts
# (gather/scatter "rows", "sequence") and the hidden one, every collective over tp comes from
# ag_gemm or gemm_rs (each op's backward is one call of the other; counted by the collective census of
# the compiled program), and the values and gradients equal the block written with plain all_gather /
# psum_scatter, whose collectives the census reports as XLA's. "fused": gate and up as one
# column_parallel_group (one gather).
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from entwine_jax import census, layers, pairing  # noqa: E402

RULES = layers.DEFAULT_LOGICAL_AXIS_RULES
D, F, ROWS = 32, 64, 32  # model and hidden features, global tokens
TOL = 1e-5  # float32: max error relative to max |reference|

# layout -> (x global shape, x spec = output spec, the split dim, the layers' gather / scatter).
LAYOUTS = {
    "rows": ((ROWS, D), P(("dp", "tp"), None), 0, "rows"),
    "sequence": ((2, ROWS // 2, D), P("dp", "tp", None), 1, "sequence"),
    "hidden": ((ROWS, D), P("dp", "tp"), -1, "hidden"),
}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"))


class SwiGLU(nnx.Module):
    """gate/up column-parallel on the sharded input (ag_gemm), down row-parallel (gemm_rs);
    fused: gate and up as one column_parallel_group (one grouped ag_gemm)."""

    def __init__(self, mode: str, fused: bool, *, rngs):
        self.gate = layers.ColumnParallelLinear(D, F, gather=mode, rngs=rngs)
        self.up = layers.ColumnParallelLinear(D, F, gather=mode, rngs=rngs)
        self.down = layers.RowParallelLinear(F, D, scatter=mode, rngs=rngs)
        self.mode, self.fused = mode, fused

    def __call__(self, x):
        if self.fused:
            g, u = layers.column_parallel_group(x, (self.gate, self.up))
        else:
            g, u = self.gate(x), self.up(x)
        return self.down(jax.nn.silu(g) * u)


def plain_swiglu(dim):
    """The same block with XLA's collectives: all_gather, two dots, a dot and psum_scatter."""
    def fn(p, x):
        h = jax.lax.all_gather(x, "tp", axis=dim % x.ndim, tiled=True)
        y = jax.nn.silu(h @ p["gate"]["kernel"]) * (h @ p["up"]["kernel"])
        return jax.lax.psum_scatter(y @ p["down"]["kernel"], "tp", scatter_dimension=dim % x.ndim, tiled=True)
    return fn


def grad_census_and_values(mesh, fn, params, specs, x, x_spec):
    """The census of jit(value_and_grad) of sum(block(x) * cot) w.r.t. params and x, and its values."""
    block = jax.shard_map(fn, mesh=mesh, in_specs=(specs, x_spec), out_specs=x_spec)
    cot = jax.random.normal(jax.random.key(3), x.shape, jnp.float32)
    step = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(block(p, x) * cot), argnums=(0, 1)))
    with jax.set_mesh(mesh):
        x = jax.device_put(x, x_spec)
        return census.collectives(step, params, x), step(params, x)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


CASES = [("rows", False), ("sequence", False), ("hidden", False), ("rows", True), ("hidden", True)]


@pytest.mark.parametrize("layout, fused", CASES, ids=[f"{m}{'-fused' if f else ''}" for m, f in CASES])
def test_every_tp_collective_is_a_fused_op(mesh, monkeypatch, layout, fused):
    # Spies on the one entry the layers' calls and the backward rules run the ops through.
    calls = collections.Counter()
    real_call = pairing.call

    def spy(name, *a, **kw):
        calls.update([(name, kw.get("return_gathered", False))])
        return real_call(name, *a, **kw)

    monkeypatch.setattr(pairing, "call", spy)

    x_shape, x_spec, dim, mode = LAYOUTS[layout]
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        model = SwiGLU(mode, fused, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    specs = nnx.to_pure_dict(layers.partition_specs(state, RULES))
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(1), x_shape, jnp.float32)
    found, (loss, (gp, gx)) = grad_census_and_values(mesh, lambda p, x: nnx.merge(graphdef, p)(x), params, specs,
                                                      x, x_spec)

    # Forward: gate and up (one ag_gemm when fused), down (one gemm_rs). Backward: each ag_gemm's
    # dx is a gemm_rs, the gemm_rs's dx an ag_gemm that also returns the gathered dy (for dw).
    n_ag = 1 if fused else 2
    assert calls == {("ag_gemm", False): n_ag, ("ag_gemm", True): 1, ("gemm_rs", False): 1 + n_ag}
    # Over tp, every collective is an op's: ag_gemm's gathers (gemm_rs's backward is one) and
    # gemm_rs's reduce-scatters (ag_gemm's backward is one); the census names each by the innermost
    # op. (On CPU XLA may merge the references' identical gathers of x, so counts are not asserted.)
    # (The loss, summed by the jitted sum around the block, is not the block's: only what the block's
    # shard_map traced counts.)
    tp = [c for c in found if c.axes == ("tp",) and "shard_map" in c.op_name]
    assert {(c.owner, c.kind) for c in tp} == {("ag_gemm", "all-gather"), ("gemm_rs", "reduce-scatter")}, \
        found.table()

    # The same values and gradients as the plain-XLA block, whose all_gather and psum_scatter
    # (and their transposes) the walk reports as collectives outside the ops.
    plain, (loss_p, (gp_p, gx_p)) = grad_census_and_values(mesh, plain_swiglu(dim), params, specs, x, x_spec)
    assert rel_err(loss, loss_p) <= TOL and rel_err(gx, gx_p) <= TOL
    for name in ("gate", "up", "down"):
        assert rel_err(gp[name]["kernel"], gp_p[name]["kernel"]) <= TOL
    stray = {c.kind for c in plain if c.axes == ("tp",) and c.owner == "xla" and "shard_map" in c.op_name}
    assert stray >= {"all-gather", "reduce-scatter"}, plain.table()
