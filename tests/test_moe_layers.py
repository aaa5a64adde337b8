# entwine_jax.moe_layers on fake CPU devices (sub-meshes of W = 2 and 3 over "ep"; the MoE ops take
# their XLA reference): the NNX and Linen MoE MLP against a float64 NumPy model of router, top-k,
# SwiGLU experts and weighted combine (bf16 and f32, both router weightings, a capacity that drops),
# gradients of every parameter against jax.grad of a dense JAX reference, NNX and Linen on the same
# parameters, the ValueErrors for bad arguments, and a few optax SGD steps.
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from entwine_jax import MoeConfig, moe_layers  # noqa: E402
from entwine_jax.layers import DEFAULT_LOGICAL_AXIS_RULES, partition_specs  # noqa: E402
from entwine_jax.moe.op import capacity_rows  # noqa: E402
from entwine_jax.moe_layers import MoeMlp, MoeMlpDense  # noqa: E402

from test_gemm_rs import make_mesh, rel_err  # noqa: E402
from test_moe import model_layout  # noqa: E402

RULES = DEFAULT_LOGICAL_AXIS_RULES
EP = P("ep")
# Max error relative to the largest |reference| entry: router, two GEMMs and the combine, each
# rounded to the dtype (fp32 accumulation).
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}
T, H, F, K = 8, 16, 8, 2  # tokens per rank, hidden, expert hidden, experts per token
NAMES = ("router", "wi_0", "wi_1", "wo")


def experts(world):
    return 2 * world


def nnx_moe(mesh, **kwargs):
    """An NNX MoeMlp at global shape, its parameters sharded by RULES; (graphdef, state, specs)."""
    kwargs = {"num_experts": experts(mesh.shape["ep"]), "num_experts_per_tok": K, **kwargs}
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        module = MoeMlp(H, F, rngs=nnx.Rngs(0), **kwargs)
    graphdef, state = nnx.split(module)
    return graphdef, state, partition_specs(state, RULES)


def sharded(mesh, fn, specs):
    """jit(shard_map(fn)) over "ep": parameters by specs, tokens (and the output) split over ep."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, EP), out_specs=EP))


def params_of(tree):
    """{name: float32 NumPy array} of an NNX State or a Linen variables dict."""
    pure = nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else nn.unbox(tree)["params"]
    return {name: np.array(pure[name], np.float32) for name in NAMES}


def model(x, p, k, norm_topk_prob=True, kept=None, dtype=jnp.float32):
    """float64 MoE MLP on global tokens x [N, H] with parameters p rounded to dtype: (out, topk_idx)."""
    r = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)
    x, router, wi_0, wi_1, wo = r(x), r(p["router"]), r(p["wi_0"]), r(p["wi_1"]), r(p["wo"])
    logits = x @ router
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, idx, axis=1)
    if norm_topk_prob:
        weights = np.exp(top - top.max(1, keepdims=True))
        weights /= weights.sum(1, keepdims=True)
    else:
        weights = np.exp(top - logits.max(1, keepdims=True)) / np.exp(logits - logits.max(1, keepdims=True)).sum(
            1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            if kept is None or kept[t, j]:
                e = idx[t, j]
                g, u = x[t] @ wi_0[e], x[t] @ wi_1[e]
                out[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ wo[e])
    return out, idx.astype(np.int32)


def dense_reference(p, x, k):
    """The MoE MLP in JAX with no routing op (each slot gathers its expert's weights), for jax.grad."""
    logits = x @ p["router"]
    top, idx = jax.lax.top_k(logits, k)
    weights = jax.nn.softmax(top, axis=-1)
    g = jnp.einsum("th,tkhf->tkf", x, p["wi_0"][idx])
    u = jnp.einsum("th,tkhf->tkf", x, p["wi_1"][idx])
    o = jnp.einsum("tkf,tkfh->tkh", jax.nn.silu(g) * u, p["wo"][idx])
    return jnp.einsum("tk,tkh->th", weights, o)


def tokens(seed, world, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (world * T, H), jnp.float32).astype(dtype)


# ---------------------------------------------------------------- forward against the NumPy model

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("world", [2, 3])
def test_nnx_against_model(world, dtype):
    mesh = make_mesh((world,), ("ep",))
    graphdef, state, specs = nnx_moe(mesh, dtype=dtype)
    # The experts split over ep, the router whole.
    assert specs["wi_0"] == P("ep", None, None) and specs["wo"] == P("ep", None, None) and specs["router"] == P(None, None)
    x = tokens(1, world, dtype)
    with jax.set_mesh(mesh):
        y = sharded(mesh, lambda s, x: nnx.merge(graphdef, s)(x), specs)(state, jax.device_put(x, EP))
    assert y.shape == x.shape and y.dtype == dtype
    ref, idx = model(x, params_of(state), K, dtype=dtype)
    # Several experts in use on every rank, so the routing is exercised.
    assert len(np.unique(idx)) == experts(world)
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("world", [2, 3])
def test_full_softmax_weights(world):
    # norm_topk_prob=False: the full softmax's probabilities of the chosen experts (summing below 1).
    mesh = make_mesh((world,), ("ep",))
    graphdef, state, specs = nnx_moe(mesh, norm_topk_prob=False)
    x = tokens(2, world)
    with jax.set_mesh(mesh):
        y = sharded(mesh, lambda s, x: nnx.merge(graphdef, s)(x), specs)(state, jax.device_put(x, EP))
    p = params_of(state)
    ref, _ = model(x, p, K, norm_topk_prob=False)
    assert rel_err(y, ref) <= TOL[jnp.float32]
    assert rel_err(y, model(x, p, K)[0]) > 1e-2  # the other weighting is not what ran


def test_capacity_drops():
    # Every token picks experts 0 and 1 (rank 0's). capacity=0.5 gives C = max(128, round_up(ceil(0.5 *
    # 160 * 2 / 4), 128)) = 128 rows per (source, expert), so each rank's tokens 128..159 lose both
    # slots (their output is zero); the slots kept are summed as without the config.
    world, tokens_per_rank = 2, 160
    mesh = make_mesh((world,), ("ep",))
    config = MoeConfig(capacity=0.5)
    graphdef, state, specs = nnx_moe(mesh, config=config)
    p = params_of(state)
    # Feature 0 (set to 3 below) makes experts 0 and 1 the top two.
    p["router"][0] += np.array([30.0, 30.0, 0.0, 0.0], np.float32)
    nnx.replace_by_pure_dict(state, {**nnx.to_pure_dict(state), "router": jnp.asarray(p["router"])})
    with jax.set_mesh(mesh):
        state = jax.device_put(state, specs)
    x = np.array(jax.random.normal(jax.random.key(3), (world * tokens_per_rank, H)), np.float32)
    x[:, 0] = 3.0
    with jax.set_mesh(mesh):
        y = sharded(mesh, lambda s, x: nnx.merge(graphdef, s)(x), specs)(state, jax.device_put(jnp.asarray(x), EP))
    _, idx = model(x, p, K)
    assert (np.sort(idx, axis=1) == [0, 1]).all()
    c = capacity_rows(tokens_per_rank, K, experts(world), config.capacity)
    kept, *_ = model_layout(idx, world, experts(world), c)
    lost = np.r_[128:tokens_per_rank, tokens_per_rank + 128:2 * tokens_per_rank]
    assert c == 128 and kept.sum() == world * 128 * K and not kept[lost].any()
    ref, _ = model(x, p, K, kept=kept)
    assert rel_err(y, ref) <= TOL[jnp.float32]
    np.testing.assert_array_equal(np.asarray(y)[lost], 0.0)
    assert rel_err(y, model(x, p, K)[0]) > 1e-2  # without the drops the output would differ


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("world", [2, 3])
def test_gradients_against_dense(world):
    mesh = make_mesh((world,), ("ep",))
    graphdef, state, specs = nnx_moe(mesh)
    x, cot = tokens(4, world), tokens(5, world)
    f = sharded(mesh, lambda s, x: nnx.merge(graphdef, s)(x), specs)
    loss = lambda s, x: jnp.sum(f(s, x) * cot)
    with jax.set_mesh(mesh):
        gs, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, jax.device_put(x, EP))
    p = {name: jnp.asarray(v) for name, v in params_of(state).items()}
    ref_loss = lambda p, x: jnp.sum(dense_reference(p, x, K) * cot)
    gp_ref, gx_ref = jax.grad(ref_loss, argnums=(0, 1))(p, x)
    g = params_of(gs)
    for name in NAMES:
        assert np.abs(g[name]).max() > 0, name  # every parameter gets a gradient, the router's included
        assert rel_err(g[name], gp_ref[name]) <= 1e-4, name
    assert rel_err(gx, gx_ref) <= 1e-4


# ---------------------------------------------------------------- NNX and Linen

@pytest.mark.parametrize("world", [2, 3])
def test_linen_equals_nnx(world):
    mesh = make_mesh((world,), ("ep",))
    x = tokens(6, world)
    module = MoeMlpDense(F, experts(world), K)
    variables = module.init(jax.random.key(1), x)
    # init outside shard_map gives the global parameters and the unsharded MLP's output.
    init_out = module.init_with_output(jax.random.key(1), x)[0]
    p = params_of(variables)
    assert rel_err(init_out, model(x, p, K)[0]) <= TOL[jnp.float32]
    linen_specs = partition_specs(variables, RULES)
    graphdef, state, specs = nnx_moe(mesh)
    nnx.replace_by_pure_dict(state, {name: jnp.asarray(v) for name, v in p.items()})
    with jax.set_mesh(mesh):
        state = jax.device_put(state, specs)
        xs = jax.device_put(x, EP)
        y_linen = sharded(mesh, module.apply, linen_specs)(jax.device_put(variables, linen_specs), xs)
        y_nnx = sharded(mesh, lambda s, x: nnx.merge(graphdef, s)(x), specs)(state, xs)
    np.testing.assert_array_equal(np.asarray(y_linen), np.asarray(y_nnx))
    assert rel_err(y_linen, model(x, p, K)[0]) <= TOL[jnp.float32]


def test_config_reaches_both_ops(monkeypatch):
    seen = []
    for name in ("moe_dispatch_gemm", "moe_gemm_combine"):
        real = getattr(moe_layers, name)
        monkeypatch.setattr(moe_layers, name, lambda *a, real=real, name=name, **kw: seen.append((name, kw)) or
                            real(*a, **kw))
    mesh = make_mesh((2,), ("ep",))
    config = MoeConfig(capacity=2.0, path="xla")
    graphdef, state, specs = nnx_moe(mesh, config=config, axis_name="ep")
    with jax.set_mesh(mesh):
        sharded(mesh, lambda s, x: nnx.merge(graphdef, s)(x), specs)(state, jax.device_put(tokens(7, 2), EP))
    assert [name for name, _ in seen] == ["moe_dispatch_gemm", "moe_gemm_combine"]
    assert all(kw["config"] is config and kw["axis_name"] == "ep" for _, kw in seen)


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_current_near_bf16_and_trains(world):
    """fp8="current": the NNX and Linen MLPs through the ops' FP8 calls, near the float64 model (FP8's
    rounding of tokens, activations and weights), Linen equal to NNX, and every parameter's gradient
    near the bf16 MLP's."""
    mesh = make_mesh((world,), ("ep",))
    x, cot = tokens(10, world, jnp.bfloat16), tokens(11, world)
    module = MoeMlpDense(F, experts(world), K, dtype=jnp.bfloat16, fp8="current")
    variables = module.init(jax.random.key(2), x)
    linen_specs = partition_specs(variables, RULES)
    graphdef, state, specs = nnx_moe(mesh, fp8="current", dtype=jnp.bfloat16)
    graphdef16, _, _ = nnx_moe(mesh, dtype=jnp.bfloat16)
    nnx.replace_by_pure_dict(state, {name: jnp.asarray(v) for name, v in params_of(variables).items()})
    with jax.set_mesh(mesh):
        state = jax.device_put(state, specs)
        xs = jax.device_put(x, EP)
        y = sharded(mesh, lambda s, x: nnx.merge(graphdef, s)(x), specs)(state, xs)
        y_linen = sharded(mesh, module.apply, linen_specs)(jax.device_put(variables, linen_specs), xs)
        grads = {}
        for name, gd in (("fp8", graphdef), ("bf16", graphdef16)):
            f = sharded(mesh, lambda s, x, gd=gd: nnx.merge(gd, s)(x), specs)
            grads[name] = params_of(jax.jit(jax.grad(lambda s: jnp.sum(f(s, xs).astype(jnp.float32) * cot)))(state))
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y_linen), np.asarray(y))
    ref = model(x, params_of(state), K, dtype=jnp.bfloat16)[0]
    # e4m3 keeps 3 mantissa bits: ~3% per rounded operand, four of them on the way (H = 16, F = 8).
    assert np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref) < 0.15
    for name in NAMES:
        a, b = grads["fp8"][name], grads["bf16"][name]
        assert np.all(np.isfinite(a)) and np.linalg.norm(a - b) / np.linalg.norm(b) < 0.2, name


# ---------------------------------------------------------------- training

def test_sgd_decreases_loss():
    world = 2
    mesh = make_mesh((world,), ("ep",))
    graphdef, state, specs = nnx_moe(mesh)
    x, target = tokens(8, world), 0.5 * tokens(9, world)
    f = sharded(mesh, lambda s, x: nnx.merge(graphdef, s)(x), specs)
    loss = lambda s, x: jnp.mean((f(s, x) - target) ** 2)
    opt = optax.sgd(0.5)
    opt_state = opt.init(state)

    @jax.jit
    def step(state, opt_state, x):
        value, grads = jax.value_and_grad(loss)(state, x)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, value

    losses = []
    with jax.set_mesh(mesh):
        x = jax.device_put(x, EP)
        for _ in range(5):
            state, opt_state, value = step(state, opt_state, x)
            losses.append(float(value))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


# ---------------------------------------------------------------- bad arguments

CTOR_ERRORS = [
    (dict(num_experts=0), r"MoeMlp: num_experts must be a positive int, got 0"),
    (dict(num_experts_per_tok=5), r"MoeMlp: num_experts_per_tok must be <= num_experts \(4\), got 5"),
    (dict(norm_topk_prob="yes"), r"MoeMlp: norm_topk_prob must be one of \(True, False\), got 'yes'"),
    (dict(dtype=jnp.int32), r"MoeMlp: dtype must be bfloat16, float16, float32 or None, got int32"),
    (dict(param_dtype=jnp.int8), r"MoeMlp: param_dtype must be a floating dtype, got int8"),
    (dict(config={"capacity": 1.0}), r"MoeMlp: config must be an entwine_jax.MoeConfig or None, got dict"),
    (dict(axis_name=3), r"MoeMlp: axis_name must be a mesh axis name \(str\)"),
    (dict(fp8="block"), r"MoeMlp: fp8 must be one of \(None, 'current'\), got 'block'"),
]


@pytest.mark.parametrize("kwargs, match", CTOR_ERRORS, ids=[m[8:40] for _, m in CTOR_ERRORS])
def test_constructor_errors(kwargs, match):
    with nnx.use_eager_sharding(False), pytest.raises(ValueError, match=match):
        MoeMlp(H, F, **{"num_experts": 4, "num_experts_per_tok": K, **kwargs}, rngs=nnx.Rngs(0))


def trace(mesh, fn, params, specs, x_shape=(3 * T, H)):
    """Trace fn under shard_map over ep (no compile) on tokens of x_shape split over ep."""
    f = jax.shard_map(fn, mesh=mesh, in_specs=(specs, EP), out_specs=EP)
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32, sharding=jax.sharding.NamedSharding(mesh, EP))
    with jax.set_mesh(mesh):
        jax.eval_shape(f, params, x)


def unsharded(num_experts):
    """(fn, state) of an NNX MoeMlp created without sharding, its parameters plain global arrays."""
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(MoeMlp(H, F, num_experts, K, rngs=nnx.Rngs(0)))
    return lambda s, x: nnx.merge(graphdef, s)(x), state


def test_call_errors():
    mesh = make_mesh((3,), ("ep",))
    # 4 experts over 3 ranks.
    fn, state = unsharded(4)
    with pytest.raises(ValueError, match=r"MoeMlp: num_experts \(4\) must be divisible by the size of 'ep' \(3\)"):
        trace(mesh, fn, state, P())
    # The experts replicated instead of split over ep (in_specs not from partition_specs).
    fn, state = unsharded(6)
    with pytest.raises(ValueError, match=r"MoeMlp: wi_0 arrived with local shape \(6, 16, 8\), expected \(2, 16, 8\)"):
        trace(mesh, fn, state, P())
    with pytest.raises(ValueError, match=r"MoeMlp: axis_name 'ep' is not bound; call the layer inside jax.shard_map"):
        fn(state, jnp.ones((T, H)))
    # Linen: applied outside shard_map; a parameter of the wrong shard shape.
    variables = MoeMlpDense(F, 6, K).init(jax.random.key(0), jnp.ones((T, H)))
    with pytest.raises(ValueError, match=r"MoeMlpDense: axis_name 'ep' is not bound; apply the layer inside"):
        MoeMlpDense(F, 6, K).apply(variables, jnp.ones((T, H)))
    with pytest.raises(ValueError, match=r"MoeMlpDense: parameter 'wi_0' arrived with shape \(6, 16, 8\), expected "
                                         r"\(2, 16, 8\)"):
        trace(mesh, MoeMlpDense(F, 6, K).apply, variables, P())


def test_functional_errors():
    mesh = make_mesh((2,), ("ep",))
    router, wi, wo = jnp.ones((H, 4)), jnp.ones((2, H, F)), jnp.ones((2, F, H))

    def call(**changes):
        args = {"router": router, "wi_0": wi, "wi_1": wi, "wo": wo, **changes}
        trace(mesh, lambda _, x: moe_layers.moe_mlp(x, num_experts_per_tok=K, **args), {}, {}, (2 * T, H))

    with pytest.raises(ValueError, match=r"moe_mlp: router must have shape \[H = 16, E\], got \(8, 4\)"):
        call(router=jnp.ones((8, 4)))
    with pytest.raises(ValueError, match=r"moe_mlp: wi_0 and wi_1 must have local shape \[E/W = 2, H = 16, F\] "
                                         r"\(global \[4, 16, F\] with dim 0 split over 'ep'\), got \(4, 16, 8\)"):
        call(wi_0=jnp.ones((4, H, F)))
    with pytest.raises(ValueError, match=r"moe_mlp: wo must have local shape \[E/W, F, H\] = \(2, 8, 16\), got "
                                         r"\(2, 16, 8\)"):
        call(wo=jnp.ones((2, H, F)))
    with pytest.raises(ValueError, match=r"moe_mlp: num_experts \(5\) must be divisible by the size of 'ep' \(2\)"):
        call(router=jnp.ones((H, 5)))
    with pytest.raises(ValueError, match=r"moe_mlp: x must be an array, got list"):
        moe_layers.moe_mlp([1.0], router, wi, wi, wo, num_experts_per_tok=K)
    with pytest.raises(ValueError, match=r"moe_mlp: x must have rank >= 2"):
        moe_layers.moe_mlp(jnp.ones(H), router, wi, wi, wo, num_experts_per_tok=K)
