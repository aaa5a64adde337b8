# The collectives over "tp" of a tensor-parallel SwiGLU block built from entwine_jax.layers, forward
# and backward under jit, on 8 fake CPU devices (dp=2 x tp=4): in the sequence-parallel layouts
# (gather/scatter "rows", "sequence") and the hidden one, every collective over tp comes from
# ag_gemm or gemm_rs (each op's backward is one call of the other), and the values and gradients
# equal the block written with plain all_gather / psum_scatter, whose collectives the check flags.
import collections
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
pytest.importorskip("optax")  # examples/train_step.py, which holds the jaxpr walk, imports it
from flax import nnx  # noqa: E402

import entwine_jax  # noqa: E402
from entwine_jax import layers, pairing  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
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
def walk():
    spec = importlib.util.spec_from_file_location("train_step_example", REPO / "examples" / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tp_collectives


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"))


class SwiGLU(nnx.Module):
    """gate/up column-parallel on the sharded input (ag_gemm), down row-parallel (gemm_rs);
    fused: gate and up as one ag_gemm on their kernels concatenated."""

    def __init__(self, mode: str, fused: bool, *, rngs):
        self.gate = layers.ColumnParallelLinear(D, F, gather=mode, rngs=rngs)
        self.up = layers.ColumnParallelLinear(D, F, gather=mode, rngs=rngs)
        self.down = layers.RowParallelLinear(F, D, scatter=mode, rngs=rngs)
        self.mode, self.fused = mode, fused

    def __call__(self, x):
        if self.fused:
            kernel = jnp.concatenate([self.gate.kernel[...], self.up.kernel[...]], axis=1)
            g, u = jnp.split(layers.column_parallel_linear(x, kernel, gather=self.mode), 2, axis=-1)
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


def grad_jaxpr_and_values(mesh, fn, params, specs, x, x_spec):
    """The jaxpr of jit(value_and_grad) of sum(block(x) * cot) w.r.t. params and x, and its values."""
    block = jax.shard_map(fn, mesh=mesh, in_specs=(specs, x_spec), out_specs=x_spec)
    cot = jax.random.normal(jax.random.key(3), x.shape, jnp.float32)
    step = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(block(p, x) * cot), argnums=(0, 1)))
    with jax.set_mesh(mesh):
        x = jax.device_put(x, x_spec)
        return jax.make_jaxpr(step)(params, x), step(params, x)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


CASES = [("rows", False), ("sequence", False), ("hidden", False), ("rows", True), ("hidden", True)]


@pytest.mark.parametrize("layout, fused", CASES, ids=[f"{m}{'-fused' if f else ''}" for m, f in CASES])
def test_every_tp_collective_is_a_fused_op(mesh, walk, monkeypatch, layout, fused):
    # Spies on every entry the layers and the two backward rules call the ops through.
    calls = collections.Counter()

    def spy(name, real):
        return lambda *a, **kw: calls.update([(name, kw.get("return_gathered", False))]) or real(*a, **kw)

    monkeypatch.setattr(layers, "ag_gemm", spy("ag_gemm", layers.ag_gemm))
    monkeypatch.setattr(layers, "gemm_rs", spy("gemm_rs", layers.gemm_rs))
    monkeypatch.setattr(pairing, "ag_gemm", spy("ag_gemm", pairing.ag_gemm))
    monkeypatch.setattr(pairing, "gemm_rs", spy("gemm_rs", pairing.gemm_rs))

    x_shape, x_spec, dim, mode = LAYOUTS[layout]
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        model = SwiGLU(mode, fused, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    specs = nnx.to_pure_dict(layers.partition_specs(state, RULES))
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(1), x_shape, jnp.float32)
    jaxpr, (loss, (gp, gx)) = grad_jaxpr_and_values(mesh, lambda p, x: nnx.merge(graphdef, p)(x), params, specs,
                                                     x, x_spec)

    # Forward: gate and up (one ag_gemm when fused), down (one gemm_rs). Backward: each ag_gemm's
    # dx is a gemm_rs, the gemm_rs's dx an ag_gemm that also returns the gathered dy (for dw).
    n_ag = 1 if fused else 2
    assert calls == {("ag_gemm", False): n_ag, ("ag_gemm", True): 1, ("gemm_rs", False): 1 + n_ag}
    found = walk(jaxpr)
    assert [c for c in found if c.owner is None] == []
    assert collections.Counter((c.owner, c.primitive) for c in found) == {
        ("ag_gemm", "all_gather"): n_ag, ("ag_gemm", "reduce_scatter"): n_ag,
        ("gemm_rs", "reduce_scatter"): 1, ("gemm_rs", "all_gather"): 1}

    # The same values and gradients as the plain-XLA block, whose all_gather and psum_scatter
    # (and their transposes) the walk reports as collectives outside the ops.
    plain_jaxpr, (loss_p, (gp_p, gx_p)) = grad_jaxpr_and_values(mesh, plain_swiglu(dim), params, specs, x, x_spec)
    assert rel_err(loss, loss_p) <= TOL and rel_err(gx, gx_p) <= TOL
    for name in ("gate", "up", "down"):
        assert rel_err(gp[name]["kernel"], gp_p[name]["kernel"]) <= TOL
    stray = collections.Counter(c.primitive for c in walk(plain_jaxpr) if c.owner is None)
    assert stray == {"all_gather": 2, "reduce_scatter": 2}


def test_walk_sees_collectives_inside_jit_and_loops(mesh, walk):
    # A psum over tp in a nested jit inside a scan body is found and has no owner; one over dp alone
    # is not a collective over tp; axis_index names tp but moves no data.
    def fn(x):
        inner = jax.jit(lambda c: jax.lax.psum(c, "tp") + jax.lax.psum(c, "dp") + jax.lax.axis_index("tp"))
        return jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=2)[0]

    f = jax.shard_map(fn, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))
    with jax.set_mesh(mesh):
        found = walk(jax.make_jaxpr(f)(jax.device_put(jnp.zeros(8, jnp.int32), P(("dp", "tp")))))
    assert [(c.primitive, c.axes, c.owner) for c in found] == [("psum_invariant", ("tp",), None)]
