# entwine_jax.moe_layers on fake CPU devices (sub-meshes of W = 2 and 3 over "ep"; the MoE ops take
# their XLA reference): the NNX and Linen MoE MLP against a float64 NumPy model of router, top-k,
# SwiGLU experts and weighted combine (bf16 and f32, both router weightings, a capacity that drops),
# gradients of every parameter against jax.grad of a dense JAX reference, NNX and Linen on the same
# parameters, the ValueErrors for bad arguments, and a few optax SGD steps. Then MaxText's routing
# options (sigmoid scores, routed bias, group limit, scaling, the capacity factor's drops) and the
# load-balance loss against a float64 model of MaxText 0.2.5's rules (the loss the same on every
# rank, its gradients against jax.grad of a dense JAX model), hand-computed drops and group choices.
import math

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
    # No tokens: said before the capacity factor or the load-balance loss would divide by them.
    for options in ({}, {"capacity_factor": 1.0}, {"return_aux": True}):
        with pytest.raises(ValueError, match=r"moe_mlp: every dim of x must be > 0 \(tokens and H\), got shape "
                                             r"\(0, 16\)"):
            trace(mesh, lambda _, x, o=options: moe_layers.moe_mlp(x, num_experts_per_tok=K, router=router, wi_0=wi,
                                                                    wi_1=wi, wo=wo, **o), {}, {}, (0, H))


# ---------------------------------------------------------------- routing options, capacity factor, load-balance loss

def softmax64(a):
    a = np.exp(a - a.max(1, keepdims=True))
    return a / a.sum(1, keepdims=True)


def routed_model(x, p, k, *, seq_len=None, score_func="softmax", bias=None, groups=None, scale=1.0,
                 norm_topk_prob=True, capacity_factor=None):
    """float64 NumPy MoE MLP under MaxText 0.2.5's routing on global tokens x [N, H], in sequences of
    seq_len tokens (None: one sequence of all N): (out, topk_idx with dropped slots -1, aux)."""
    f64 = lambda a: np.asarray(a, np.float64)
    x, router, wi_0, wi_1, wo = (f64(x), f64(p["router"]), f64(p["wi_0"]), f64(p["wi_1"]), f64(p["wo"]))
    logits = x @ router
    n, e = logits.shape
    scores = softmax64(logits) if score_func == "softmax" else 1 / (1 + np.exp(-logits))
    choice = scores + (0.0 if bias is None else f64(bias))
    idx = np.zeros((n, k), np.int64)
    for t in range(n):
        c = choice[t].copy()
        if groups is not None:  # (n_routing_groups, topk_routing_group): groups scored by their best two
            g, top_groups = groups
            best_two = np.sort(c.reshape(g, e // g), axis=1)[:, -2:].sum(1)
            allowed = np.zeros(g, bool)
            allowed[np.argsort(-best_two, kind="stable")[:top_groups]] = True
            c[~np.repeat(allowed, e // g)] = -np.inf
        idx[t] = np.argsort(-c, kind="stable")[:k]
    w = np.take_along_axis(scores, idx, 1)
    if norm_topk_prob:
        w = w / (w.sum(1, keepdims=True) + 1e-20)
    w = w * scale
    s = n if seq_len is None else seq_len
    # MaxText: softmax of the pre-bias gate output (logits for softmax, sigmoid scores for sigmoid).
    probs = softmax64(logits if score_func == "softmax" else scores)
    losses, kept = [], np.ones((n, k), bool)
    for b in range(n // s):
        seq = range(b * s, (b + 1) * s)
        fraction = np.zeros(e)
        for t in seq:
            fraction[idx[t]] += 1
        losses.append(e * np.sum(fraction / (s * k) * probs[list(seq)].mean(0)))
        if capacity_factor is not None:
            cap = max(1, int(max(math.ceil(s * k / e) * capacity_factor, capacity_factor)))
            used = np.zeros(e, int)
            for t in seq:
                for j in range(k):
                    used[idx[t, j]] += 1
                    kept[t, j] = used[idx[t, j]] <= cap
    out = np.zeros_like(x)
    for t in range(n):
        for j in range(k):
            if kept[t, j]:
                g, u = x[t] @ wi_0[idx[t, j]], x[t] @ wi_1[idx[t, j]]
                out[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ wo[idx[t, j]])
    aux = {"load_balance_loss": np.mean(losses), "expert_counts": np.bincount(idx.ravel(), minlength=e),
           "dropped": int((~kept).sum())}
    return out, np.where(kept, idx, -1), aux


def with_values(mesh, state, specs, **values):
    """state with the given entries (global NumPy arrays) replaced, placed by specs."""
    nnx.replace_by_pure_dict(state, {**nnx.to_pure_dict(state), **{n: jnp.asarray(v) for n, v in values.items()}})
    with jax.set_mesh(mesh):
        return jax.device_put(state, specs)


def captured(graphdef):
    """fn(state, x) -> (y, {sown name: its value with a leading axis of 1}) of the NNX MoeMlp: out_specs
    EP gives each rank's value."""
    def fn(s, x):
        y, inter = nnx.capture(nnx.merge(graphdef, s), nnx.Intermediate)(x)
        return y, {name: v[0][None] for name, v in nnx.to_pure_dict(inter).items()}
    return fn


def layout_tokens(seed, world, layout):
    """Global tokens, "tokens" [W*T, H] (one sequence over the ranks) or "sequences" [2W, T/2, H]."""
    x = tokens(seed, world)
    return x if layout == "tokens" else x.reshape(2 * world, T // 2, H)


# (id, layer kwargs, experts per rank, layout)
ROUTING_CASES = [
    ("sigmoid-bias-scale", dict(score_func="sigmoid", use_routed_bias=True, routed_scaling_factor=2.5), 2,
     "sequences"),
    ("sigmoid-unnormalised", dict(score_func="sigmoid", norm_topk_prob=False), 2, "tokens"),
    ("softmax-bias-full", dict(use_routed_bias=True, norm_topk_prob=False, routed_scaling_factor=0.5), 2, "tokens"),
    ("groups", dict(score_func="sigmoid", use_routed_bias=True, n_routing_groups=4, topk_routing_group=2), 4,
     "sequences"),
    ("capacity-tokens", dict(capacity_factor=0.5), 2, "tokens"),
    ("capacity-sequences", dict(capacity_factor=1.0, score_func="sigmoid", use_routed_bias=True), 2, "sequences"),
]


@pytest.mark.parametrize("case", ROUTING_CASES, ids=[c[0] for c in ROUTING_CASES])
@pytest.mark.parametrize("world", [2, 3])
def test_routing_options_against_model(world, case):
    # Each option through the sharded NNX layer against the float64 model: output, and the sown
    # load-balance loss, expert counts and drops, the same on every rank and equal to the model's
    # (single-device) values.
    _, kwargs, per_rank, layout = case
    mesh = make_mesh((world,), ("ep",))
    e = per_rank * world
    graphdef, state, specs = nnx_moe(mesh, num_experts=e, load_balance_loss_weight=0.25, **kwargs)
    bias = None
    if kwargs.get("use_routed_bias"):
        assert isinstance(state["router_bias"], moe_layers.RouterBias) and specs["router_bias"] == P()
        bias = 0.3 * np.array(jax.random.normal(jax.random.key(20), (e,)), np.float32)
        state = with_values(mesh, state, specs, router_bias=bias)
    x = layout_tokens(21, world, layout)
    with jax.set_mesh(mesh):
        f = jax.jit(jax.shard_map(captured(graphdef), mesh=mesh, in_specs=(specs, EP), out_specs=(EP, EP)))
        y, sown = f(state, jax.device_put(x, EP))
    p = params_of(state)
    opts = dict(score_func=kwargs.get("score_func", "softmax"), bias=bias, scale=kwargs.get("routed_scaling_factor", 1),
                norm_topk_prob=kwargs.get("norm_topk_prob", True), capacity_factor=kwargs.get("capacity_factor"),
                groups=(kwargs["n_routing_groups"], kwargs["topk_routing_group"]) if "n_routing_groups" in kwargs
                else None)
    ref, idx, aux = routed_model(x.reshape(-1, H), p, K, seq_len=None if layout == "tokens" else T // 2, **opts)
    assert y.shape == x.shape and rel_err(y.reshape(-1, H), ref) <= TOL[jnp.float32]
    lb = np.asarray(sown["moe_lb_loss"])
    assert lb.shape == (world,) and (lb == lb[0]).all()  # every rank the same value
    np.testing.assert_allclose(lb[0], 0.25 * aux["load_balance_loss"], rtol=1e-5)
    if bias is not None:
        np.testing.assert_array_equal(np.asarray(sown["moe_expert_counts"]), np.tile(aux["expert_counts"], (world, 1)))
        # The bias moved the choice of some tokens.
        assert (routed_model(x.reshape(-1, H), p, K, **{**opts, "bias": None, "capacity_factor": None})[1] !=
                routed_model(x.reshape(-1, H), p, K, **{**opts, "capacity_factor": None})[1]).any()
    if opts["groups"] is not None:  # the group limit changed some tokens' experts
        assert (routed_model(x.reshape(-1, H), p, K, **{**opts, "groups": None})[1] != idx).any()
    if opts["capacity_factor"] is not None:
        assert aux["dropped"] > 0
        np.testing.assert_array_equal(np.asarray(sown["moe_dropped"]), aux["dropped"])
    else:
        assert "moe_dropped" not in sown


@pytest.mark.parametrize("layout", ["tokens", "sequences"])
@pytest.mark.parametrize("world", [2, 3])
def test_functional_aux(world, layout):
    # moe_mlp(return_aux=True) on its own: every aux entry on every rank equals the model's.
    mesh = make_mesh((world,), ("ep",))
    e = 2 * world
    _, state, specs = nnx_moe(mesh)
    x = layout_tokens(22, world, layout)
    bias = 0.2 * np.array(jax.random.normal(jax.random.key(23), (e,)), np.float32)

    def fn(s, x):
        y, aux = moe_layers.moe_mlp(x, s["router"][...], s["wi_0"][...], s["wi_1"][...], s["wo"][...],
                                    num_experts_per_tok=K, score_func="sigmoid", routed_bias=jnp.asarray(bias),
                                    capacity_factor=0.75, return_aux=True)
        return y, jax.tree.map(lambda v: v[None], aux)

    with jax.set_mesh(mesh):
        y, aux = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, EP), out_specs=(EP, EP)))(
            state, jax.device_put(x, EP))
    ref, _, ref_aux = routed_model(x.reshape(-1, H), params_of(state), K, score_func="sigmoid", bias=bias,
                                   capacity_factor=0.75, seq_len=None if layout == "tokens" else T // 2)
    assert rel_err(np.asarray(y).reshape(-1, H), ref) <= TOL[jnp.float32]
    assert aux["expert_counts"].dtype == jnp.int32 and aux["dropped"].dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(aux["load_balance_loss"]), ref_aux["load_balance_loss"], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), np.tile(ref_aux["expert_counts"], (world, 1)))
    np.testing.assert_array_equal(np.asarray(aux["dropped"]), ref_aux["dropped"])
    assert ref_aux["dropped"] > 0


def test_capacity_factor_drops_later_tokens():
    # Every token picks experts 0 and 1 (logits [3, 2, 0, 0]); E = 4, k = 2.
    # One sequence of the W*T = 16 tokens over the ranks, f = 0.3: C = int(ceil(16*2/4) * 0.3) = 2,
    # so global tokens 0 and 1 (rank 0's first two) keep both slots, all later ones (rank 1's
    # included) lose them: 28 slots dropped. (ceil(16 * 0.3 * 2 / 4) would be 3.)
    # Sequences [4, 4, H] (2 per rank), f = 0.5: C = int(ceil(4*2/4) * 0.5) = 1: each sequence's
    # first token only; 4 * 3 * 2 = 24 dropped.
    world = 2
    mesh = make_mesh((world,), ("ep",))
    _, state, specs = nnx_moe(mesh)
    p = params_of(state)
    p["router"][:] = 0.0
    p["router"][0] = [3.0, 2.0, 0.0, 0.0]
    state = with_values(mesh, state, specs, router=p["router"])
    x = np.array(jax.random.normal(jax.random.key(24), (world * T, H)), np.float32)
    x[:, 0] = 1.0
    for shape, factor, kept_tokens, dropped in (((world * T, H), 0.3, [0, 1], 28),
                                                ((4, 4, H), 0.5, [0, 4, 8, 12], 24)):
        def fn(s, x, factor=factor):
            y, aux = moe_layers.moe_mlp(x, s["router"][...], s["wi_0"][...], s["wi_1"][...], s["wo"][...],
                                        num_experts_per_tok=K, capacity_factor=factor, return_aux=True)
            return y, aux["dropped"]

        with jax.set_mesh(mesh):
            y, n_dropped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, EP), out_specs=(EP, P())))(
                state, jax.device_put(jnp.asarray(x.reshape(shape)), EP))
        y = np.asarray(y).reshape(-1, H)
        kept = np.zeros((world * T, K), bool)
        kept[kept_tokens] = True
        full = model(x, p, K)[0]
        np.testing.assert_allclose(y[kept_tokens], full[kept_tokens], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.delete(y, kept_tokens, axis=0), 0.0)
        assert int(n_dropped) == dropped


def test_group_limited_routing_by_hand():
    # E = 8 in 4 groups of 2; router = I, so each token's logits are x. Sigmoid scores of
    # [5, -5 | 4, 4 | 3, 3 | -9, -9]: groups (their best two) 1.0, 1.96, 1.90, 0.0002, so the best two
    # groups are 1 and 2 and the top 2 experts 2 and 3 (expert 0, the best overall, is in group 0).
    x = jnp.array([[5.0, -5.0, 4.0, 4.0, 3.0, 3.0, -9.0, -9.0]])
    eye = jnp.eye(8)
    sig = lambda v: 1 / (1 + np.exp(-v))
    idx, w = moe_layers.route(x, eye, 2, score_func="sigmoid")
    assert sorted(np.asarray(idx)[0]) == [0, 2]  # no group limit
    idx, w = moe_layers.route(x, eye, 2, score_func="sigmoid", n_routing_groups=4, topk_routing_group=2)
    assert sorted(np.asarray(idx)[0]) == [2, 3]
    np.testing.assert_allclose(np.asarray(w), [[0.5, 0.5]], rtol=1e-6)
    # A bias of 2 on group 3 makes it the best group and its experts the choice; the weights stay
    # the unbiased scores (norm_topk_prob=False), times routed_scaling_factor.
    bias = jnp.array([0, 0, 0, 0, 0, 0, 2.0, 2.0])
    idx, w = moe_layers.route(x, eye, 2, False, score_func="sigmoid", routed_bias=bias, n_routing_groups=4,
                              topk_routing_group=2, routed_scaling_factor=2.0)
    assert sorted(np.asarray(idx)[0]) == [6, 7]
    np.testing.assert_allclose(np.asarray(w), [[2 * sig(-9.0)] * 2], rtol=1e-5)
    # softmax scores, one group: group 0 (p(5) + p(-5) beats 2 p(4)) holds experts 0 and 1.
    idx, w = moe_layers.route(x, eye, 2, score_func="softmax", n_routing_groups=4, topk_routing_group=1)
    assert list(np.asarray(idx)[0]) == [0, 1]
    np.testing.assert_allclose(np.asarray(w), [[sig(10.0), sig(-10.0)]], rtol=1e-5)


def test_routed_bias_update():
    counts = jnp.array([3, 1, 2, 2], jnp.int32)
    np.testing.assert_array_equal(np.asarray(moe_layers.routed_bias_update(counts, 0.25)), [-0.25, 0.25, 0.0, 0.0])


# ---------------------------------------------------------------- the load-balance loss's gradients

def dense_routed(p, x, k, seq_len, *, score_func, bias, scale, weight):
    """JAX MoE MLP with MaxText's routing and load-balance loss, no routing op, for jax.grad:
    (out [N, H], weight * loss)."""
    logits = x @ p["router"]
    scores = jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + bias, k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    w = w / w.sum(-1, keepdims=True) * scale
    g = jnp.einsum("th,tkhf->tkf", x, p["wi_0"][idx])
    u = jnp.einsum("th,tkhf->tkf", x, p["wi_1"][idx])
    out = jnp.einsum("tk,tkh->th", w, jnp.einsum("tkf,tkfh->tkh", jax.nn.silu(g) * u, p["wo"][idx]))
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits if score_func == "softmax" else scores, axis=-1).reshape(-1, seq_len, e)
    fraction = jax.nn.one_hot(idx, e).sum(1).reshape(-1, seq_len, e).mean(1) / k
    return out, weight * e * jnp.mean(jnp.sum(fraction * probs.mean(1), axis=-1))


GRAD_CASES = [("softmax-tokens", dict(), "tokens"),
              ("sigmoid-bias-sequences", dict(score_func="sigmoid", use_routed_bias=True, routed_scaling_factor=2.0),
               "sequences")]


@pytest.mark.parametrize("case", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
@pytest.mark.parametrize("world", [2, 3])
def test_load_balance_loss_gradients(world, case):
    # The sown loss alone, and the output's loss plus it: every parameter's gradient (the router's
    # through the loss's probabilities) finite and equal to jax.grad of the dense model; the routed
    # bias gets none.
    _, kwargs, layout = case
    mesh = make_mesh((world,), ("ep",))
    e = 2 * world
    graphdef, state, specs = nnx_moe(mesh, load_balance_loss_weight=0.5, **kwargs)
    bias = np.zeros(e, np.float32)
    if kwargs.get("use_routed_bias"):
        bias = 0.3 * np.array(jax.random.normal(jax.random.key(25), (e,)), np.float32)
        state = with_values(mesh, state, specs, router_bias=bias)
    x, cot = layout_tokens(26, world, layout), layout_tokens(27, world, layout)
    seq_len = world * T if layout == "tokens" else T // 2

    def fn(s, x):
        y, inter = nnx.capture(nnx.merge(graphdef, s), nnx.Intermediate)(x)
        return y, nnx.to_pure_dict(inter)["moe_lb_loss"][0]

    f = jax.shard_map(fn, mesh=mesh, in_specs=(specs, EP), out_specs=(EP, P()))
    losses = {"lb": lambda s, x: f(s, x)[1], "total": lambda s, x: (lambda y, lb: jnp.sum(y * cot) + lb)(*f(s, x))}
    p = {name: jnp.asarray(v) for name, v in params_of(state).items()}
    opts = dict(score_func=kwargs.get("score_func", "softmax"), bias=jnp.asarray(bias),
                scale=kwargs.get("routed_scaling_factor", 1.0), weight=0.5)
    flat = x.reshape(-1, H)
    refs = {"lb": lambda p: dense_routed(p, flat, K, seq_len, **opts)[1],
            "total": lambda p: (lambda o, lb: jnp.sum(o * cot.reshape(-1, H)) + lb)(
                *dense_routed(p, flat, K, seq_len, **opts))}
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, EP)
        for which in ("lb", "total"):
            grads = jax.jit(jax.grad(losses[which]))(state, xs)
            g, g_ref = params_of(grads), jax.grad(refs[which])(p)
            assert np.isfinite(g["router"]).all() and np.abs(g["router"]).max() > 0, which
            names = ("router",) if which == "lb" else NAMES
            for name in names:
                assert rel_err(g[name], g_ref[name]) <= 1e-4, (which, name)
            if which == "lb":  # the loss reaches the router only
                assert all(np.abs(g[name]).max() == 0 for name in ("wi_0", "wi_1", "wo"))
            if kwargs.get("use_routed_bias"):
                np.testing.assert_array_equal(np.asarray(nnx.to_pure_dict(grads)["router_bias"]), 0.0)


# ---------------------------------------------------------------- Linen with the routing options

def test_linen_routing_options_equal_nnx():
    # Linen's init (the dense W = 1 MLP) and its apply inside shard_map against the model and the NNX
    # layer on the same parameters and bias; the bias in the "moe_bias" collection, not "params".
    world = 2
    mesh = make_mesh((world,), ("ep",))
    opts = dict(score_func="sigmoid", use_routed_bias=True, n_routing_groups=4, topk_routing_group=2,
                routed_scaling_factor=1.5, capacity_factor=1.0, load_balance_loss_weight=0.1)
    e = 8
    x = layout_tokens(28, world, "sequences")
    module = MoeMlpDense(F, e, K, **opts)
    # init: the dense MLP (W = 1) with the same routing, on its fresh parameters and zero bias.
    init_out, init_vars = module.init_with_output(jax.random.key(3), x, mutable=True)
    assert set(init_vars) == {"params", "moe_bias", "intermediates"}
    np.testing.assert_array_equal(init_vars["moe_bias"]["router_bias"], np.zeros(e))
    init_ref, _, init_aux = routed_model(x.reshape(-1, H), params_of(init_vars), K, seq_len=T // 2,
                                         score_func="sigmoid", scale=1.5, groups=(4, 2), capacity_factor=1.0)
    assert rel_err(np.asarray(init_out).reshape(-1, H), init_ref) <= TOL[jnp.float32]
    np.testing.assert_allclose(init_vars["intermediates"]["moe_lb_loss"][0], 0.1 * init_aux["load_balance_loss"],
                               rtol=1e-5)
    bias = 0.3 * np.array(jax.random.normal(jax.random.key(29), (e,)), np.float32)
    variables = {"params": init_vars["params"], "moe_bias": {"router_bias": jnp.asarray(bias)}}
    p = params_of(variables)
    ref, _, aux = routed_model(x.reshape(-1, H), p, K, seq_len=T // 2, score_func="sigmoid", bias=bias, scale=1.5,
                               groups=(4, 2), capacity_factor=1.0)
    linen_specs = partition_specs(variables, RULES)
    assert linen_specs["moe_bias"]["router_bias"] == P()
    graphdef, state, specs = nnx_moe(mesh, num_experts=e, **opts)
    nnx.replace_by_pure_dict(state, {**{n: jnp.asarray(v) for n, v in p.items()}, "router_bias": jnp.asarray(bias)})
    apply = lambda v, x: module.apply(v, x, mutable=["intermediates"])
    with jax.set_mesh(mesh):
        state = jax.device_put(state, specs)
        xs = jax.device_put(x, EP)
        y_linen, mutated = jax.jit(jax.shard_map(apply, mesh=mesh, in_specs=(linen_specs, EP), out_specs=(EP, P())))(
            jax.device_put(variables, linen_specs), xs)
        y_nnx, sown = jax.jit(jax.shard_map(captured(graphdef), mesh=mesh, in_specs=(specs, EP),
                                            out_specs=(EP, EP)))(state, xs)
    np.testing.assert_array_equal(np.asarray(y_linen), np.asarray(y_nnx))
    assert rel_err(np.asarray(y_linen).reshape(-1, H), ref) <= TOL[jnp.float32]
    inter = mutated["intermediates"]
    np.testing.assert_allclose(inter["moe_lb_loss"][0], 0.1 * aux["load_balance_loss"], rtol=1e-5)
    np.testing.assert_array_equal(inter["moe_expert_counts"][0], aux["expert_counts"])
    np.testing.assert_array_equal(inter["moe_dropped"][0], aux["dropped"])
    np.testing.assert_array_equal(np.asarray(sown["moe_lb_loss"])[0], inter["moe_lb_loss"][0])


# ---------------------------------------------------------------- bad routing arguments

ROUTING_ERRORS = [
    (dict(score_func="relu"), r"score_func must be one of \('softmax', 'sigmoid'\), got 'relu'"),
    (dict(n_routing_groups=2), r"n_routing_groups and topk_routing_group must both be -1 \(no group limit\) or both "
                               r"be set, got 2 and -1"),
    (dict(n_routing_groups=3, topk_routing_group=1), r"n_routing_groups must be -1 or a positive int dividing "
                                                     r"num_experts \(8\) into groups of at least 2 experts, got 3"),
    (dict(n_routing_groups=8, topk_routing_group=1), r"n_routing_groups must be -1 or a positive int dividing "
                                                     r"num_experts \(8\) into groups of at least 2 experts, got 8"),
    (dict(n_routing_groups=2, topk_routing_group=3), r"topk_routing_group must be -1 or an int in "
                                                     r"\[1, n_routing_groups = 2\], got 3"),
    (dict(n_routing_groups=4, topk_routing_group=1, num_experts_per_tok=3),
     r"topk_routing_group \(1\) groups of 2 experts must hold at least num_experts_per_tok \(3\) experts, got 2"),
    (dict(routed_scaling_factor=0), r"routed_scaling_factor must be a positive number, got 0"),
    (dict(capacity_factor=-1.0), r"capacity_factor must be a positive number or None, got -1.0"),
    (dict(capacity_factor=float("nan")), r"capacity_factor must be a positive number or None, got nan"),
    (dict(load_balance_loss_weight=-0.1), r"load_balance_loss_weight must be a number >= 0, got -0.1"),
    (dict(use_routed_bias="yes"), r"use_routed_bias must be one of \(True, False\), got 'yes'"),
]


@pytest.mark.parametrize("kwargs, match", ROUTING_ERRORS, ids=[f"{i}" for i in range(len(ROUTING_ERRORS))])
def test_routing_argument_errors(kwargs, match):
    kwargs = {"num_experts": 8, "num_experts_per_tok": K, **kwargs}
    with nnx.use_eager_sharding(False), pytest.raises(ValueError, match="MoeMlp: " + match):
        MoeMlp(H, F, **kwargs, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="MoeMlpDense: " + match):
        MoeMlpDense(F, **kwargs).init(jax.random.key(0), jnp.ones((T, H)))


def test_functional_routing_errors():
    mesh = make_mesh((2,), ("ep",))
    router, wi, wo = jnp.ones((H, 4)), jnp.ones((2, H, F)), jnp.ones((2, F, H))

    def call(**kwargs):
        trace(mesh, lambda _, x: moe_layers.moe_mlp(x, router, wi, wi, wo, num_experts_per_tok=K, **kwargs), {}, {},
              (2 * T, H))

    with pytest.raises(ValueError, match=r"moe_mlp: routed_bias must have shape \[E\] = \(4,\) \(whole, not split\), "
                                         r"got \(2,\)"):
        call(routed_bias=jnp.zeros(2))
    with pytest.raises(ValueError, match=r"moe_mlp: routed_bias must be an array, got list"):
        call(routed_bias=[0.0] * 4)
    with pytest.raises(ValueError, match=r"moe_mlp: return_aux must be one of \(True, False\), got 'yes'"):
        call(return_aux="yes")
    with pytest.raises(ValueError, match=r"moe_mlp: capacity_factor must be a positive number or None, got 0"):
        call(capacity_factor=0)
    with pytest.raises(ValueError, match=r"moe_mlp: score_func must be one of \('softmax', 'sigmoid'\), got None"):
        call(score_func=None)
