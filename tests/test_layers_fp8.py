# The layers' FP8 modes on 8 fake CPU devices (a dp=2 x tp=4 mesh; the ops take their XLA path):
# current scaling (per tensor and per block) and delayed scaling with Flax's state (collection
# OVERWRITE_WITH_GRADIENT, Flax's names), trained a few steps; the delayed state evolves as Flax's own
# Fp8DirectDotGeneralOp's does on the same model; NNX's Fp8Meta variables; block scaling in NNX = Linen,
# against the block recipe computed by hand, its group; bad fp8 arguments.
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.linen import fp8_ops as flax_fp8  # noqa: E402

from entwine_jax import layers  # noqa: E402
from entwine_jax.layers import (DEFAULT_LOGICAL_AXIS_RULES, ColumnParallelDense, ColumnParallelLinear,  # noqa: E402
                                Fp8Meta, RowParallelDense, RowParallelLinear, partition_specs)

RULES = DEFAULT_LOGICAL_AXIS_RULES
T, D, F = 32, 32, 64
ROWS = P(("dp", "tp"), None)
OWG = flax_fp8.OVERWRITE_WITH_GRADIENT


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"))


def data(seed):
    kx, kt = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (T, D), jnp.float32)
    return x, jnp.tanh(x @ jax.random.normal(kt, (D, D), jnp.float32) / np.sqrt(D))


class MLP(nn.Module):
    """Sequence parallel: [T/tp, D] -> gather -> up -> relu -> down -> [T/tp, D]."""
    fp8: str = None

    @nn.compact
    def __call__(self, x):
        h = ColumnParallelDense(F, gather="rows", fp8=self.fp8, amax_history_length=16, name="up")(x)
        return RowParallelDense(D, fp8=self.fp8, amax_history_length=16, name="down")(jax.nn.relu(h))


class FlaxMLP(nn.Module):
    """The same model with Flax's own FP8 dot (unsharded)."""

    @nn.compact
    def __call__(self, x):
        fp8 = lambda: flax_fp8.Fp8DirectDotGeneralOp(amax_history_length=16)  # noqa: E731
        h = nn.Dense(F, use_bias=False, dot_general_cls=fp8, name="up")(x)
        return nn.Dense(D, use_bias=False, dot_general_cls=fp8, name="down")(jax.nn.relu(h))


def train(mesh, apply, variables, specs, steps, lr=0.5, sharded=True):
    """SGD on mean((apply(x) - t)^2); the OVERWRITE_WITH_GRADIENT collection takes its gradient, as in
    Flax's FP8 training loops. Returns (losses, variables)."""
    f = jax.shard_map(apply, mesh=mesh, in_specs=(specs, ROWS), out_specs=ROWS) if sharded else apply

    def loss(v, x, t):
        return jnp.mean(jnp.square(f(v, x).astype(jnp.float32) - t))

    @jax.jit
    def step(v, x, t):
        value, g = jax.value_and_grad(loss)(v, x, t)
        params = jax.tree.map(lambda p, d: p - lr * d, v["params"], g["params"])
        return value, {**v, "params": params, **({OWG: g[OWG]} if OWG in v else {})}

    losses = []
    with jax.set_mesh(mesh):
        if sharded:
            variables = jax.device_put(variables, specs)
        for i in range(steps):
            x, t = data(100 + i % 2)  # two batches in turn
            if sharded:
                x, t = jax.device_put(x, ROWS), jax.device_put(t, ROWS)
            value, variables = step(variables, x, t)
            losses.append(float(value))
    return losses, variables


@pytest.mark.parametrize("fp8", [None, "current", "delayed", "block"])
def test_linen_mlp_trains(mesh, fp8):
    x, _ = data(0)
    variables = MLP(fp8).init(jax.random.key(1), x)
    assert (OWG in variables) == (fp8 == "delayed")
    losses, _ = train(mesh, MLP(fp8).apply, variables, partition_specs(variables, RULES), steps=6)
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses
    if fp8 is not None:
        # FP8 follows the bf16/fp32 model's losses within FP8's precision.
        exact, _ = train(mesh, MLP(None).apply, variables if fp8 != "delayed" else
                         {"params": variables["params"]}, partition_specs(variables, RULES) if fp8 != "delayed"
                         else partition_specs({"params": variables["params"]}, RULES), steps=6)
        np.testing.assert_allclose(losses, exact, rtol=0.1)


def test_delayed_state_evolves_as_flax_fp8(mesh):
    # The same model and data with Flax's Fp8DirectDotGeneralOp: after 1 and 3 steps, every scale and
    # amax history of both layers matches Flax's (the amaxes of x and of the kernels exactly after the
    # first step; the rest within FP8's precision).
    x, _ = data(0)
    ours = MLP("delayed").init(jax.random.key(1), x)
    theirs = FlaxMLP().init(jax.random.key(1), x)
    theirs = {"params": {k: {"kernel": nn.unbox(ours["params"])[k]["kernel"]} for k in ("up", "down")},
              OWG: theirs[OWG]}
    specs = partition_specs(ours, RULES)
    for steps in (1, 3):
        _, a = train(mesh, MLP("delayed").apply, ours, specs, steps)
        _, b = train(mesh, FlaxMLP().apply, theirs, None, steps, sharded=False)
        for layer in ("up", "down"):
            mine, flax_state = a[OWG][layer], b[OWG][layer]["Fp8DirectDotGeneralOp_0"]
            assert set(mine) == set(layers.FP8_META_NAMES) == set(flax_state)
            for name in layers.FP8_META_NAMES:
                got, want = np.asarray(mine[name]), np.asarray(flax_state[name])
                assert got.shape == want.shape and got.dtype == np.float32
                # Exact where both see the same values: the kernels and the model's input at the first step
                # (down's input is up's output, which the FP8 op writes in bf16 and Flax in fp32).
                exact = steps == 1 and (name == "kernel_amax_history" or (layer, name) == ("up", "input_amax_history"))
                np.testing.assert_allclose(got, want, rtol=0 if exact else 0.05, err_msg=f"{layer} {name} {steps}")
        assert np.asarray(a[OWG]["up"]["input_amax_history"])[0] == float(jnp.max(jnp.abs(data(100 + (steps - 1) % 2)[0])))


def test_nnx_delayed_trains(mesh):
    # NNX: the state is Fp8Meta variables; differentiate with respect to them too and overwrite them.
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        up = ColumnParallelLinear(D, F, gather="rows", fp8="delayed", amax_history_length=8, rngs=nnx.Rngs(0))
        down = RowParallelLinear(F, D, fp8="delayed", amax_history_length=8, rngs=nnx.Rngs(1))
    graph, state = nnx.split((up, down))
    specs = partition_specs(state, RULES)

    def apply(state, x):
        up, down = nnx.merge(graph, state)
        return down(jax.nn.relu(up(x)))

    f = jax.shard_map(apply, mesh=mesh, in_specs=(specs, ROWS), out_specs=ROWS)

    @jax.jit
    def step(state, x, t):
        value, g = jax.value_and_grad(lambda s: jnp.mean(jnp.square(f(s, x) - t)))(state)
        state = layers.overwrite_with_gradient(state, g)
        state = jax.tree.map(lambda v, d: v.replace(v[...] - 0.5 * d[...]) if isinstance(v, nnx.Param) else v,
                             state, g, is_leaf=lambda v: isinstance(v, nnx.Variable))
        return value, state

    losses = []
    with jax.set_mesh(mesh):
        state = jax.device_put(state, specs)
        for i in range(5):
            value, state = step(state, *(jax.device_put(a, ROWS) for a in data(100 + i % 2)))
            losses.append(float(value))
    assert losses[-1] < 0.8 * losses[0], losses
    up_meta = nnx.merge(graph, state)[0]
    assert isinstance(up_meta.input_scale, Fp8Meta)
    history = np.asarray(up_meta.input_amax_history[...])
    assert history.shape == (8,) and np.count_nonzero(history) == 5
    assert float(up_meta.input_scale[...][0]) == pytest.approx(history[1:].max() / 448, rel=1e-6)


def test_current_scaling_is_close_to_the_exact_layer(mesh):
    x, _ = data(3)
    variables = MLP(None).init(jax.random.key(1), x)
    specs = partition_specs(variables, RULES)
    outs = {}
    for fp8 in (None, "current"):
        f = jax.jit(jax.shard_map(MLP(fp8).apply, mesh=mesh, in_specs=(specs, ROWS), out_specs=ROWS))
        with jax.set_mesh(mesh):
            outs[fp8] = np.asarray(f(jax.device_put(variables, specs), jax.device_put(x, ROWS)))
    err = np.linalg.norm(outs["current"] - outs[None]) / np.linalg.norm(outs[None])
    assert 0 < err < 0.08


@pytest.mark.parametrize("call, match", [
    (lambda: ColumnParallelLinear(D, F, gather="rows", fp8="e4m3", rngs=nnx.Rngs(0)),
     r"ColumnParallelLinear: fp8 must be one of \(None, 'current', 'block', 'delayed'\), got 'e4m3'"),
    (lambda: RowParallelLinear(F, D, fp8="delayed", amax_history_length=0, rngs=nnx.Rngs(0)),
     r"amax_history_length must be a positive int, got 0"),
    (lambda: layers.row_parallel_linear(jnp.ones((8, 4)), jnp.ones((4, 8)), fp8={"input_scale": 1}),
     r"row_parallel_linear: fp8 must be None, 'current', 'block' or a delayed-scaling state"),
    (lambda: layers.column_parallel_linear(jnp.ones((8, 4)), jnp.ones((4, 8)), fp8="current"),
     r"fp8=current runs the FP8 ag_gemm, which needs a sharded input: set gather"),
    (lambda: layers.column_parallel_linear(jnp.ones((8, 4)), (jnp.ones((4, 8)),) * 2, gather="rows",
                                           fp8=layers.fp8_meta(4)),
     r"a group takes fp8=None, 'current' or 'block'"),
])
def test_bad_fp8_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _block_recipe_by_hand(x, wu, wd, tp):
    """The block recipe of relu(x @ wu) @ wd computed by hand, float64, one dp group of T/2 rows at a
    time: up's columns shard by shard (each row's 1x128 tiles, each 128x128 block of the kernel shard),
    relu, bf16 (the FP8 op's output), down's K slices shard by shard summed."""
    from test_fp8_block import formula
    from entwine_jax import fp8 as fp8_ops
    want = []
    for rows in jnp.split(x, 2):
        h = np.concatenate([formula(*fp8_ops.quantize_1x128(rows), *fp8_ops.quantize_128x128(w))
                            for w in jnp.split(wu, tp, axis=1)], axis=1)
        h = jnp.asarray(np.maximum(h, 0), jnp.bfloat16).astype(jnp.float32)
        want.append(sum(formula(*fp8_ops.quantize_1x128(hs), *fp8_ops.quantize_128x128(ws))
                        for hs, ws in zip(jnp.split(h, tp, axis=1), jnp.split(wd, tp, axis=0))))
    return np.concatenate(want)


def test_block_scaled_layers_follow_the_recipe(mesh, monkeypatch):
    # fp8="block" in NNX and in Linen: the outputs of the block recipe computed by hand, and every call
    # the layers make, forward and backward, block-scaled.
    from test_fp8_block import _spied
    d, f, tp = 256, 512, 4
    x = jax.random.normal(jax.random.key(5), (T, d), jnp.float32)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = ColumnParallelDense(f, gather="rows", fp8="block", name="up")(x)
            return RowParallelDense(d, fp8="block", name="down")(jax.nn.relu(h))

    variables = Block().init(jax.random.key(1), x)
    specs = partition_specs(variables, RULES)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        up = ColumnParallelLinear(d, f, gather="rows", fp8="block", rngs=nnx.Rngs(0))
        down = RowParallelLinear(f, d, fp8="block", rngs=nnx.Rngs(1))
    graph, state = nnx.split((up, down))
    nnx_specs = partition_specs(state, RULES)

    def nnx_apply(state, x):
        up, down = nnx.merge(graph, state)
        return down(jax.nn.relu(up(x)))

    seen = _spied(monkeypatch)
    nnx_f = jax.shard_map(nnx_apply, mesh=mesh, in_specs=(nnx_specs, ROWS), out_specs=ROWS)
    with jax.set_mesh(mesh):
        linen = jax.jit(jax.shard_map(Block().apply, mesh=mesh, in_specs=(specs, ROWS), out_specs=ROWS))(
            jax.device_put(variables, specs), jax.device_put(x, ROWS))
        state, xr = jax.device_put(state, nnx_specs), jax.device_put(x, ROWS)
        ours = jax.jit(nnx_f)(state, xr)
        jax.jit(jax.grad(lambda s, x: jnp.sum(jnp.square(nnx_f(s, x)))))(state, xr)
    assert {(op, block) for op, block, _ in seen} == {("ag_gemm", True), ("gemm_rs", True)}
    assert {dtype for *_, dtype in seen} == {"float8_e4m3fn", "float8_e5m2"}
    params = nn.unbox(variables["params"])
    for y, wu, wd in ((linen, params["up"]["kernel"], params["down"]["kernel"]),
                      (ours, up.kernel[...], down.kernel[...])):
        want = _block_recipe_by_hand(x, jnp.asarray(np.asarray(wu)), jnp.asarray(np.asarray(wd)), tp)
        assert np.abs(np.asarray(y, np.float64) - want).max() <= 2e-2 * np.abs(want).max()


@pytest.mark.parametrize("gather", ["rows", "hidden"])
def test_block_scaled_group_equals_its_layers(mesh, gather):
    # Gate and up (widths that are no multiple of 128 per shard) in one gather, each kernel with its own
    # block scales: the layers' outputs, called one by one.
    d = 512
    x = jax.random.normal(jax.random.key(6), (T, d), jnp.float32)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        gate = ColumnParallelLinear(d, 4 * 40, gather=gather, fp8="block", rngs=nnx.Rngs(0))
        up = ColumnParallelLinear(d, 4 * 72, gather=gather, fp8="block", rngs=nnx.Rngs(1))
    graph, state = nnx.split((gate, up))
    specs = partition_specs(state, RULES)
    x_spec = ROWS if gather == "rows" else P("dp", "tp")

    def apply(grouped):
        def body(state, x):
            gate, up = nnx.merge(graph, state)
            return layers.column_parallel_group(x, (gate, up)) if grouped else (gate(x), up(x))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, x_spec), out_specs=(P("dp", "tp"),) * 2))

    with jax.set_mesh(mesh):
        args = jax.device_put(state, specs), jax.device_put(x, x_spec)
        for a, b in zip(apply(True)(*args), apply(False)(*args)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert a.shape == b.shape and np.abs(a - b).max() <= 1e-2 * np.abs(b).max()


@pytest.mark.parametrize("fp8", [None, "current", "block"])
def test_an_empty_batch_passes_every_fp8_mode(fp8):
    # No tokens (a data-parallel rank's last, empty microbatch): the hidden-sharded pair gives an empty
    # output and zero gradients in every mode; current scales of nothing are 1, block scales are none.
    world = 2
    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])
    x, k1, k2 = jnp.zeros((0, 256), jnp.float32), jnp.ones((256, 256), jnp.float32), jnp.ones((256, 128), jnp.float32)

    def block(x, k1, k2):
        h = layers.column_parallel_linear(x, k1, axis_name="tp", gather="hidden", fp8=fp8)
        return layers.row_parallel_linear(h, k2, axis_name="tp", scatter="hidden", fp8=fp8)

    specs = (P(None, "tp"), P(None, "tp"), P("tp", None))
    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P(None, "tp"))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, s) for a, s in zip((x, k1, k2), specs)]
        y = jax.jit(f)(*args)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)))(*args)
    assert y.shape == (0, 128)
    assert [g.shape for g in grads] == [(0, 256), (256, 256), (256, 128)]
    assert not any(np.asarray(g).any() for g in grads)
