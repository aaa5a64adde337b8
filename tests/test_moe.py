# moe_dispatch_gemm and moe_gemm_combine on fake CPU devices (the XLA reference, the only path so far):
# a hand-computed layout and output, seeded random MoE MLPs at W = 2, 3, 4 against a float64 NumPy
# model that implements the static layout and capacity rule on its own (loops over sources, tokens,
# slots), y's [E_local, W*C, N] rows against a float64 pool, -1 and out-of-range ids, empty experts and
# ranks, capacity drops (a factor, and dropless with a token naming one expert twice), gradients
# (against float64 autodiff of a dense per-slot reference, and check_grads), the fallback reason, the
# census attribution, and bad input.
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import entwine_jax
from entwine_jax import MoeConfig, census, moe_dispatch_gemm, moe_gemm_combine
from entwine_jax.moe.op import capacity_rows

from test_gemm_rs import make_mesh, rel_err

EP = P("ep")
# Max error relative to the largest |reference| entry: two GEMMs (fp32 accumulation) each rounded to
# the dtype, an activation between them and an fp32 weighted sum.
TOL = {jnp.bfloat16: 3e-2, jnp.float32: 1e-5}


def run(fn, mesh, args, out_specs, *, jit=True, check_vma=True):
    """fn under shard_map over "ep" with every argument's leading dim sharded; the outputs as NumPy arrays."""
    f = jax.shard_map(fn, mesh=mesh, in_specs=(EP,) * len(args), out_specs=out_specs, check_vma=check_vma)
    f = jax.jit(f) if jit else f
    with jax.set_mesh(mesh):
        return jax.tree.map(np.asarray, f(*[jax.device_put(a, EP) for a in args]))


def swiglu(y, f):
    return jax.nn.silu(y[..., :f]) * y[..., f:]


def moe_mlp(x, topk_idx, weights, w1, w2, *, capacity=None, act=swiglu):
    """The whole MoE MLP on one rank: (out, the handle's arrays with a leading rank dim)."""
    y, handle = moe_dispatch_gemm(x, topk_idx, w1, axis_name="ep", capacity=capacity)
    out = moe_gemm_combine(act(y, w2.shape[1]), w2, weights, handle, axis_name="ep")
    return out, jax.tree.map(lambda a: a[None], handle)


def model_layout(idx, world, num_experts, c):
    """The layout rule as loops over the global idx [W*T, k]: (kept, place [W*T, k] (-1 where not
    kept), dropped [W]). On each source rank, slot (t, j) of expert e takes the next row of its
    (source, e) segment in (t, j) order; it is kept iff that row is below c."""
    wt, k = idx.shape
    t = wt // world
    kept, place = np.zeros(idx.shape, bool), np.full(idx.shape, -1)
    for q in range(world):
        used = np.zeros(num_experts, int)
        for tok in range(q * t, (q + 1) * t):
            for j in range(k):
                e = idx[tok, j]
                if 0 <= e < num_experts:
                    if used[e] < c:
                        kept[tok, j], place[tok, j] = True, used[e]
                    used[e] += 1
    dropped = ((idx >= 0) & (idx < num_experts) & ~kept).reshape(world, t * k).sum(axis=1)
    return kept, place, dropped


def model_pools(idx, x, world, e_local, c):
    """float64 pool [E, W*C, H] of every expert (expert-major over ranks): row q*C + i of expert e is
    source q's token whose slot took row i of segment (q, e); zeros elsewhere."""
    kept, place, _ = model_layout(idx, world, world * e_local, c)
    t = idx.shape[0] // world
    pool = np.zeros((world * e_local, world * c, x.shape[1]))
    for tok, j in zip(*np.nonzero(kept)):
        pool[idx[tok, j], (tok // t) * c + place[tok, j]] = np.asarray(x[tok], np.float64)
    return pool


def model_mlp(x, idx, weights, w1, w2, kept, act=True):
    """float64: out[t] = sum over kept slots of weights * act(x[t] @ w1[e]) @ w2[e]."""
    x, weights, w1, w2 = (np.asarray(a, np.float64) for a in (x, weights, w1, w2))
    f = w2.shape[1]
    out = np.zeros((x.shape[0], w2.shape[2]))
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            if kept[t, j]:
                y = x[t] @ w1[idx[t, j]]
                h = y[:f] / (1 + np.exp(-y[:f])) * y[f:] if act else y
                out[t] += weights[t, j] * (h @ w2[idx[t, j]])
    return out


def dense_mlp(x, weights, w1, w2, idx, kept, dtype=jnp.float32):
    """The same MLP in JAX without any routing (every slot gathers its expert's weights), for autodiff
    (in float64 under jax.enable_x64)."""
    f = w2.shape[1]
    e = jnp.asarray(np.maximum(idx, 0))
    y = jnp.einsum("th,tkhn->tkn", x.astype(dtype), w1[e].astype(dtype))
    h = jax.nn.silu(y[..., :f]) * y[..., f:]
    o = jnp.einsum("tkf,tkfh->tkh", h, w2[e].astype(dtype))
    return jnp.einsum("tk,tkh->th", jnp.where(kept, weights.astype(dtype), 0.0), o)


def random_case(seed, world, e_local, t, k, h, f, dtype, routing):
    rng = np.random.default_rng(seed)
    num_experts = world * e_local
    if routing == "uniform":
        idx = np.stack([rng.permutation(num_experts)[:k] for _ in range(world * t)])
    elif routing == "skewed":  # most slots on expert 1; experts past 2 empty; some -1
        idx = rng.choice([1, 1, 1, 0, 2, -1], size=(world * t, k))
    elif routing == "one-rank":  # every slot on the last rank's experts: the other ranks' pools empty
        idx = rng.integers((world - 1) * e_local, num_experts, size=(world * t, k))
    else:
        raise AssertionError(routing)
    idx = idx.astype(np.int32)
    x = (rng.normal(size=(world * t, h)) / np.sqrt(h)).astype(np.float32)
    w1 = rng.normal(size=(num_experts, h, 2 * f)).astype(np.float32)
    w2 = (rng.normal(size=(num_experts, f, h)) / np.sqrt(f)).astype(np.float32)
    weights = rng.random((world * t, k)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(x), idx, jnp.asarray(weights), cast(w1), cast(w2)


def test_capacity_rows():
    # C: dropless round_up(T, 128); a factor f: max(128, round_up(ceil(f * T * k / E), 128)).
    assert [capacity_rows(t, 2, 8, None) for t in (1, 128, 129, 300)] == [128, 128, 256, 384]
    assert capacity_rows(160, 2, 4, 1.0) == 128  # ceil(80): at least one tile
    assert capacity_rows(1024, 8, 16, 1.25) == 640  # ceil(640)
    assert capacity_rows(1000, 8, 16, 1.0) == 512  # ceil(500) -> 512


def test_hand_computed():
    # W = 2, E = 4 (experts 0, 1 on rank 0; 2, 3 on rank 1), T = 3, k = 2, H = N = F = 2, C = 128.
    # w1[e] = (e + 1) I, w2[e] = I, weights 0.5: out[t] = 0.5 * sum over its experts of (e + 1) x[t].
    mesh = make_mesh((2,), ("ep",))
    idx = np.array([[1, 2], [2, -1], [0, 2],    # rank 0's tokens (x = 1, 2, 3)
                    [3, 0], [-1, -1], [2, 3]],  # rank 1's (x = 4, 5, 6)
                   np.int32)
    x = jnp.asarray(np.repeat(np.arange(1.0, 7.0)[:, None], 2, axis=1) * [1, -1], jnp.float32)
    w1 = jnp.asarray(np.arange(1.0, 5.0)[:, None, None] * np.eye(2), jnp.float32)
    w2 = jnp.broadcast_to(jnp.eye(2, dtype=jnp.float32), (4, 2, 2))
    weights = jnp.full((6, 2), 0.5, jnp.float32)

    def fn(x, idx, weights, w1, w2):
        y, handle = moe_dispatch_gemm(x, idx, w1, axis_name="ep")
        out = moe_gemm_combine(y, w2, weights, handle, axis_name="ep")
        return y, out, jax.tree.map(lambda a: a[None], handle)

    y, out, handle = run(fn, mesh, (x, idx, weights, w1, w2), (EP, EP, EP))
    np.testing.assert_array_equal(out[:, 0], [2.5 * 1, 1.5 * 2, 2.0 * 3, 2.5 * 4, 0.0, 3.5 * 6])
    # y: [E_local, W*C, N] per rank, [E, W*C, N] over the mesh.
    assert y.shape == (4, 2 * 128, 2)
    # place: each slot's index among its rank's slots of its expert, in (t, j) order.
    np.testing.assert_array_equal(handle.place.reshape(6, 2), [[0, 0], [1, -1], [0, 2], [0, 0], [-1, -1], [0, 1]])
    np.testing.assert_array_equal(handle.expert.reshape(6, 2), idx)
    np.testing.assert_array_equal(handle.dropped, [0, 0])
    # Expert 0: source 0's row 0 (x 3), source 1's row 0 at 128 (x 4); expert 1: source 0's x 1;
    # expert 2: source 0's x 1, 2, 3, source 1's x 6; expert 3: source 1's x 4, 6. Times e + 1.
    want = {(0, 0): 3, (0, 128): 4, (1, 0): 2, (2, 0): 3, (2, 1): 6, (2, 2): 9, (2, 128): 18, (3, 128): 16,
            (3, 129): 24}
    for (e, row), v in want.items():
        np.testing.assert_array_equal(y[e, row], [v, -v])
    assert np.count_nonzero(y) == 2 * len(want)  # every other row zero


CASES = [  # (W, E_local, T, k, routing)
    (1, 3, 6, 2, "skewed"),    # nothing leaves the rank
    (2, 2, 8, 2, "uniform"),
    (2, 3, 6, 3, "skewed"),
    (3, 2, 5, 2, "uniform"),   # E = 6
    (3, 4, 4, 4, "skewed"),    # E = 12
    (3, 2, 4, 2, "one-rank"),
    (4, 2, 6, 3, "uniform"),
    (4, 1, 5, 1, "skewed"),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "W{}-El{}-T{}-k{}-{}".format(*c))
def test_mlp_matches_float64_model(case, dtype):
    world, e_local, t, k, routing = case
    mesh = make_mesh((world,), ("ep",))
    x, idx, weights, w1, w2 = random_case(CASES.index(case), world, e_local, t, k, 8, 4, dtype, routing)
    out, handle = run(moe_mlp, mesh, (x, idx, weights, w1, w2), (EP, EP))
    assert out.dtype == dtype and out.shape == x.shape
    kept, place, dropped = model_layout(idx, world, world * e_local, 128)
    assert kept.sum() == (idx >= 0).sum()  # dropless
    np.testing.assert_array_equal(handle.place.reshape(place.shape), place)
    np.testing.assert_array_equal(handle.dropped, dropped)
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, kept)) < TOL[dtype]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatch_pool_layout(world):
    # y [E_local, W*C, N]: row q*C + i of local expert l is source q's slot in row i of segment
    # (q, rank*E_local + l), times w1[l]; rows no slot took are zero (checked against float64).
    e_local, t, k = 2, 5, 2
    mesh = make_mesh((world,), ("ep",))
    x, idx, _, w1, _ = random_case(11 + world, world, e_local, t, k, 8, 4, jnp.float32, "skewed")
    y = run(lambda x, idx, w1: moe_dispatch_gemm(x, idx, w1, axis_name="ep")[0], mesh, (x, idx, w1), EP)
    pool = model_pools(idx, x, world, e_local, 128)
    want = np.einsum("erh,ehn->ern", pool, np.asarray(w1, np.float64))
    assert y.shape == want.shape
    np.testing.assert_array_equal(y[np.all(pool == 0, axis=2)], 0.0)
    assert rel_err(y, want) < TOL[jnp.float32]


def test_eager_equals_jit_and_no_vma():
    mesh = make_mesh((3,), ("ep",))
    args = random_case(3, 3, 2, 5, 2, 8, 4, jnp.float32, "skewed")
    jitted, _ = run(moe_mlp, mesh, args, (EP, EP))
    eager, _ = run(moe_mlp, mesh, args, (EP, EP), jit=False)
    unchecked, _ = run(moe_mlp, mesh, args, (EP, EP), check_vma=False)
    np.testing.assert_array_equal(eager, jitted)
    np.testing.assert_array_equal(unchecked, jitted)


def test_ids_outside_the_experts_route_nowhere():
    # The ids are traced (no ValueError can see them): an id < -1 or >= E is sent nowhere, like -1.
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = random_case(4, 2, 2, 6, 2, 8, 4, jnp.float32, "uniform")
    bad = idx.copy()
    bad[0, 0], bad[7, 1], bad[11, 0] = 4, -7, 1000
    none = np.where((bad >= 0) & (bad < 4), bad, -1).astype(np.int32)
    out_bad, handle_bad = run(moe_mlp, mesh, (x, bad, weights, w1, w2), (EP, EP))
    out_none, handle_none = run(moe_mlp, mesh, (x, none, weights, w1, w2), (EP, EP))
    np.testing.assert_array_equal(out_bad, out_none)
    np.testing.assert_array_equal(handle_bad.expert, handle_none.expert)
    np.testing.assert_array_equal(handle_bad.place, handle_none.place)
    np.testing.assert_array_equal(handle_bad.dropped, [0, 0])


def overflow_case(t=160):
    # W = 2, E = 4, every token: slot 0 -> expert 0, slot 1 -> expert 1 (both on rank 0).
    # capacity 1.0: C = max(128, round_up(ceil(1.0 * 160 * 2 / 4), 128)) = 128 rows per (source,
    # expert): on each rank, tokens 128..159 lose both slots (64 dropped slots per rank).
    rng = np.random.default_rng(5)
    idx = np.tile(np.array([[0, 1]], np.int32), (2 * t, 1))
    x = jnp.asarray(rng.normal(size=(2 * t, 4)), jnp.float32)
    w1 = jnp.asarray(rng.normal(size=(4, 4, 8)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(4, 4, 4)) / 2, jnp.float32)
    weights = jnp.asarray(rng.random((2 * t, 2)), jnp.float32)
    return x, idx, weights, w1, w2


def lost(t=160):
    """The tokens of overflow_case whose slots are all dropped: 128..159 of each rank."""
    return np.r_[128:t, t + 128:2 * t]


def test_capacity_overflow_is_deterministic_and_counted():
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = overflow_case()
    out, handle = run(lambda *a: moe_mlp(*a, capacity=1.0), mesh, (x, idx, weights, w1, w2), (EP, EP))
    np.testing.assert_array_equal(handle.dropped, [64, 64])
    kept, place, _ = model_layout(idx, 2, 4, 128)
    np.testing.assert_array_equal(handle.place.reshape(place.shape), place)
    np.testing.assert_array_equal(np.nonzero(~kept.all(axis=1))[0], lost())
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, kept)) < 1e-5
    np.testing.assert_array_equal(out[lost()], 0.0)
    again, _ = run(lambda *a: moe_mlp(*a, capacity=1.0), mesh, (x, idx, weights, w1, w2), (EP, EP))
    np.testing.assert_array_equal(again, out)
    # Dropless: C = round_up(160, 128) = 256, nothing lost.
    out, handle = run(moe_mlp, mesh, (x, idx, weights, w1, w2), (EP, EP))
    np.testing.assert_array_equal(handle.dropped, [0, 0])
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, np.ones(idx.shape, bool))) < 1e-5


def test_dropless_token_naming_an_expert_twice():
    # Dropless C = round_up(T, 128) holds one row per token: T = 130 tokens each naming expert 0 in
    # both slots need 260 rows of segment (q, 0), 256 exist; slot (t, j) takes row 2t + j, so tokens
    # 128 and 129 of each rank lose both slots (4 dropped per rank), and the rest count twice.
    mesh = make_mesh((2,), ("ep",))
    x, _, weights, w1, w2 = random_case(12, 2, 1, 130, 2, 8, 4, jnp.float32, "uniform")
    idx = np.zeros((260, 2), np.int32)
    out, handle = run(moe_mlp, mesh, (x, idx, weights, w1, w2), (EP, EP))
    np.testing.assert_array_equal(handle.dropped, [4, 4])
    np.testing.assert_array_equal(handle.place[0, :3], [[0, 1], [2, 3], [4, 5]])
    kept, _, dropped = model_layout(idx, 2, 2, 256)
    np.testing.assert_array_equal(dropped, [4, 4])
    np.testing.assert_array_equal(out[[128, 129, 258, 259]], 0.0)
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, kept)) < 1e-5


def test_dropped_slots_get_zero_gradient():
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = overflow_case()
    kept = model_layout(idx, 2, 4, 128)[0]

    def loss(x, weights, w1, w2):
        f = jax.shard_map(lambda *a: moe_mlp(a[0], a[1], a[2], a[3], a[4], capacity=1.0)[0], mesh=mesh,
                          in_specs=(EP,) * 5, out_specs=EP)
        return jnp.sum(f(x, jax.device_put(idx, EP), weights, w1, w2) ** 2)

    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*[jax.device_put(a, EP) for a in (x, weights, w1, w2)])
    dx, dweights, dw1, dw2 = (np.asarray(g) for g in grads)
    np.testing.assert_array_equal(dweights[~kept], 0.0)
    assert np.all(dweights[kept] != 0.0)
    np.testing.assert_array_equal(dx[lost()], 0.0)  # tokens with every slot dropped
    np.testing.assert_array_equal(dw1[2:], 0.0)  # experts 2 and 3 received nothing
    np.testing.assert_array_equal(dw2[2:], 0.0)
    dense = jax.grad(lambda *a: jnp.sum(dense_mlp(*a, idx, kept) ** 2), argnums=(0, 1, 2, 3))(x, weights, w1, w2)
    for got, want in zip((dx, dweights, dw1, dw2), dense):
        assert rel_err(got, want) < 1e-5


GRAD_CASES = [(2, 2, 6, 2, "uniform"), (3, 2, 5, 2, "skewed"), (4, 3, 4, 3, "uniform")]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "W{}-El{}-T{}-k{}-{}".format(*c))
def test_grads_match_float64(case, dtype):
    world, e_local, t, k, routing = case
    mesh = make_mesh((world,), ("ep",))
    x, idx, weights, w1, w2 = random_case(7, world, e_local, t, k, 8, 4, dtype, routing)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    f = jax.shard_map(lambda *a: moe_mlp(*a)[0], mesh=mesh, in_specs=(EP,) * 5, out_specs=EP)

    def loss(x, weights, w1, w2):
        return jnp.sum(f(x, jax.device_put(idx, EP), weights, w1, w2).astype(jnp.float32) * cot)

    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*[jax.device_put(a, EP) for a in (x, weights, w1, w2)])
    kept = idx >= 0
    with jax.enable_x64():
        wide = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, weights, w1, w2)]
        dense = jax.grad(lambda *a: jnp.sum(dense_mlp(*a, idx, kept, jnp.float64) * jnp.asarray(cot, jnp.float64)),
                         argnums=(0, 1, 2, 3))(*wide)
        dense = [np.asarray(g) for g in dense]
    for name, got, want, arg in zip(("x", "weights", "w1", "w2"), grads, dense, (x, weights, w1, w2)):
        assert got.dtype == arg.dtype, name
        assert rel_err(got, want) < 3 * TOL[dtype], name


def test_check_grads():
    # The pair without an activation is multilinear in (x, weights, w1, w2): central differences are
    # exact up to eps^2 terms.
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = random_case(9, 2, 2, 4, 2, 4, 4, jnp.float32, "skewed")
    w1 = w1[..., :4]
    f = jax.shard_map(lambda *a: moe_mlp(*a, act=lambda y, f: y)[0], mesh=mesh, in_specs=(EP,) * 5, out_specs=EP)
    with jax.set_mesh(mesh):
        placed_idx = jax.device_put(idx, EP)
        g = jax.jit(lambda x, wt, w1, w2: f(jax.reshard(x, EP), placed_idx, jax.reshard(wt, EP), jax.reshard(w1, EP),
                                            jax.reshard(w2, EP)))
        check_grads(g, [jax.device_put(a, EP) for a in (x, weights, w1, w2)], order=1, modes=["rev"], eps=1e-2,
                    atol=2e-2, rtol=2e-2)


def test_second_derivatives_see_zero_tokens_and_zero_weights():
    # A token of zeros and a router weight of 0 on a sent slot are ordinary inputs: the gradient of a
    # gradient (a gradient penalty) through them matches float64 autodiff of the dense math. The ops'
    # backward must not mask them out by their values.
    world, e_local, t, k, h, f = 3, 2, 4, 2, 5, 3
    e = world * e_local
    rng = np.random.default_rng(3)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(world * t)]).astype(np.int32)
    x = rng.normal(size=(world * t, h)).astype(np.float32)
    x[1] = 0.0
    weights = rng.random((world * t, k)).astype(np.float32)
    weights[2, 0] = 0.0
    w1 = (rng.normal(size=(e, h, 2 * f)) / 2).astype(np.float32)
    w2 = (rng.normal(size=(e, f, h)) / 2).astype(np.float32)
    cot = rng.normal(size=(world * t, h)).astype(np.float32)
    act = lambda y: jnp.tanh(y[..., :f]) * (1 + y[..., f:])  # noqa: E731  (a slope at zero)

    def ops(x, i, wt, w1, w2):
        y, handle = moe_dispatch_gemm(x, i, w1, axis_name="ep")
        return moe_gemm_combine(act(y), w2, wt, handle, axis_name="ep")

    def dense(x, i, wt, w1, w2):
        y = jnp.einsum("th,tkhn->tkn", x, w1[i])
        return jnp.einsum("tk,tkh->th", wt, jnp.einsum("tkf,tkfh->tkh", act(y), w2[i]))

    def penalty_grads(fn, i):
        # d/d(x, weights) of |dL/dx|^2 + |dL/dw1|^2 + |dL/dw2|^2, L = sum(out * cot).
        def penalty(x, wt, w1, w2):
            grads = jax.grad(lambda *a: jnp.sum(fn(a[0], i, *a[1:]) * cot), argnums=(0, 2, 3))(x, wt, w1, w2)
            return sum(jnp.sum(g ** 2) for g in grads)
        return jax.grad(penalty, argnums=(0, 1))

    mesh = make_mesh((world,), ("ep",))
    f_ops = jax.shard_map(ops, mesh=mesh, in_specs=(EP,) * 5, out_specs=EP)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, EP) for a in (x, idx, weights, w1, w2)]
        got = jax.jit(penalty_grads(f_ops, placed[1]))(placed[0], *placed[2:])
    with jax.enable_x64():
        want = penalty_grads(dense, jnp.asarray(idx))(*[jnp.asarray(a, jnp.float64) for a in (x, weights, w1, w2)])
    for g, w_ in zip(got, want):
        assert rel_err(g, np.asarray(w_)) <= 1e-5
    assert np.abs(np.asarray(want[0][1])).max() > 0.1 and abs(float(want[1][2, 0])) > 0.1  # the cases are live


def test_reason_is_logged_once(caplog):
    mesh = make_mesh((2,), ("ep",))
    args = random_case(2, 2, 2, 4, 2, 8, 4, jnp.float32, "uniform")
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        run(moe_mlp, mesh, args, (EP, EP))
        run(moe_mlp, mesh, args, (EP, EP), jit=False)
    msgs = [r.getMessage() for r in caplog.records if ": XLA reference path: " in r.getMessage()]
    assert len(msgs) == 2, msgs  # one per op's call site, not per call
    assert all("not on a CUDA GPU" in m for m in msgs)
    assert {m.split()[0] for m in msgs} == {"moe_dispatch_gemm", "moe_gemm_combine"}


def test_census_attributes_the_collectives():
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = random_case(4, 2, 2, 8, 2, 8, 4, jnp.bfloat16, "uniform")
    f = jax.shard_map(lambda *a: moe_mlp(*a)[0], mesh=mesh, in_specs=(EP,) * 5, out_specs=EP)

    def loss(x, weights, w1, w2):
        return jnp.sum(f(x, idx, weights, w1, w2).astype(jnp.float32))

    with jax.set_mesh(mesh):
        args = [jax.device_put(a, EP) for a in (x, weights, w1, w2)]
        idx = jax.device_put(idx, EP)  # what loss reads
        forward = census.collectives(jax.jit(loss), *args)
        # value_and_grad: with grad alone the forward combine's result is dead code.
        backward = census.collectives(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))), *args)
    # Forward: one all-to-all each, the static segments (no counts phase); nothing of theirs is XLA's.
    assert not forward.select(owner="xla", kind=("all-to-all", "all-gather")), forward.table()
    dispatch, combine = forward.select(owner="moe_dispatch_gemm"), forward.select(owner="moe_gemm_combine")
    assert dispatch.counts("kind") == {"all-to-all": 1}, forward.table()
    assert combine.counts("kind") == {"all-to-all": 1}, forward.table()
    assert all(c.axes == ("ep",) for c in dispatch.collectives + combine.collectives)
    # Bytes: (W-1)/W of [W, E_local, C, H] bf16 = 1/2 x 2 x 2 x 128 x 8 x 2, the rows the kernels send.
    for c in dispatch.collectives + combine.collectives:
        assert (c.shape.split("[")[0], c.bytes) == ("bf16", 4096), forward.table()
    # Backward adds: dispatch's dx (a combine); combine's dout (a dispatch), its router weights (f32,
    # the dispatch's) and the router weights' gradient home (f32, the combine's).
    assert not backward.select(owner="xla", kind=("all-to-all", "all-gather")), backward.table()
    assert backward.select(owner="moe_gemm_combine").counts("kind") == {"all-to-all": 3}, backward.table()
    assert backward.select(owner="moe_dispatch_gemm").counts("kind") == {"all-to-all": 3}, backward.table()
    for owner in ("moe_dispatch_gemm", "moe_gemm_combine"):
        f32 = [c for c in backward.select(owner=owner).collectives if c.shape.startswith("f32")]
        assert [c.bytes for c in f32] == [1024], backward.table()  # 1/2 x 2 x 2 x 128 x 4


def _trace(fn, mesh, args):
    f = jax.shard_map(fn, mesh=mesh, in_specs=(EP,) * len(args), out_specs=EP)
    with jax.set_mesh(mesh):
        jax.jit(f).trace(*[jax.device_put(a, EP) for a in args])


def _dispatch_only(**kw):
    return lambda x, idx, w1: moe_dispatch_gemm(x, idx, w1, axis_name="ep", **kw)[0]


ERRORS = {  # (x, topk_idx, w1) of the global arrays, the call's keywords, the message
    "topk-dtype": ((8, 4), ("f32", (8, 2)), (4, 4, 6), {}, "topk_idx.dtype must be int32"),
    "topk-rows": ((8, 4), ("i32", (6, 2)), (4, 4, 6), {}, r"topk_idx.shape\[0\] must equal x.shape\[0\] \(T = 4\)"),
    "x-rank": ((8, 4, 1), ("i32", (8, 2)), (4, 4, 6), {}, r"x must have rank 2 \(\[T, H\]\), got rank 3"),
    "w1-rank": ((8, 4), ("i32", (8, 2)), (4, 24), {}, r"w1 must have rank 3 \(\[E_local, H, N\]\), got rank 2"),
    "w1-hidden": ((8, 4), ("i32", (8, 2)), (4, 5, 6), {}, r"w1.shape\[1\] must equal x.shape\[1\] \(H = 4\)"),
    "num-experts": ((8, 4), ("i32", (8, 2)), (4, 4, 6), {"num_experts": 5}, "num_experts must be an int divisible"),
    "e-local": ((8, 4), ("i32", (8, 2)), (4, 4, 6), {"num_experts": 6}, r"w1.shape\[0\] must be num_experts / W = 3"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_dispatch_errors(name):
    xs, (idx_kind, idx_shape), ws, kw, message = ERRORS[name]
    mesh = make_mesh((2,), ("ep",))
    idx = jnp.zeros(idx_shape, jnp.int32 if idx_kind == "i32" else jnp.float32)
    with pytest.raises(ValueError, match=message):
        _trace(_dispatch_only(**kw), mesh, (jnp.zeros(xs), idx, jnp.zeros(ws)))


def test_dtype_mismatch_and_config_errors():
    mesh = make_mesh((2,), ("ep",))
    args = (jnp.zeros((8, 4), jnp.bfloat16), jnp.zeros((8, 2), jnp.int32), jnp.zeros((4, 4, 6), jnp.float32))
    with pytest.raises(ValueError, match=r"w1.dtype must equal x.dtype \(bfloat16\), got float32"):
        _trace(_dispatch_only(), mesh, args)
    with pytest.raises(ValueError, match="capacity must be None .* got -1"):
        MoeConfig(capacity=-1)
    with pytest.raises(ValueError, match="config must be a MoeConfig or None, got GemmRsConfig"):
        _trace(_dispatch_only(config=entwine_jax.GemmRsConfig()), mesh,
               (args[0], args[1], args[2].astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="axis_name 'nope' is not bound"):
        moe_dispatch_gemm(*args[:2], args[2].astype(jnp.bfloat16), axis_name="nope")


COMBINE_ERRORS = {  # what to change in a good combine call (h [E_local = 2, W*C = 256, F = 3]), the message
    "h-rank": (lambda h, w2, wt: (h[0], w2, wt), r"h must have rank 3 \(\[E_local, W\*C, F\]\), got rank 2"),
    "h-rows": (lambda h, w2, wt: (h[:, :-1], w2, wt),
               r"h must have shape \[E_local, W\*C, F\] with W = 2 \(axis 'ep'\) and C a multiple of 128 \(the "
               r"dispatch's y\), got \(2, 255, 3\)"),
    "w2-shape": (lambda h, w2, wt: (h, w2[:, :2], wt),
                 r"w2 must have shape \[E_local = 2, F = 3, H\], got \(2, 2, 4\)"),
    "w2-experts": (lambda h, w2, wt: (h, w2[:1], wt), r"w2 must have shape \[E_local = 2, F = 3, H\], got \(1, 3, 4\)"),
    "weights-shape": (lambda h, w2, wt: (h, w2, wt[:, :1]), r"topk_weights must have shape \[T, k\] = \(4, 2\)"),
    "weights-dtype": (lambda h, w2, wt: (h, w2, wt.astype(jnp.int32)), "topk_weights.dtype must be a float type"),
}


@pytest.mark.parametrize("name", list(COMBINE_ERRORS))
def test_combine_errors(name):
    change, message = COMBINE_ERRORS[name]
    mesh = make_mesh((2,), ("ep",))

    def fn(x, idx, w1, w2, weights):
        y, handle = moe_dispatch_gemm(x, idx, w1, axis_name="ep")
        return moe_gemm_combine(*change(y[..., :3], w2, weights), handle, axis_name="ep")

    args = (jnp.zeros((8, 4)), jnp.zeros((8, 2), jnp.int32), jnp.zeros((4, 4, 6)), jnp.zeros((4, 3, 4)),
            jnp.zeros((8, 2)))
    with pytest.raises(ValueError, match=message):
        _trace(fn, mesh, args)


def test_combine_needs_the_handle():
    mesh = make_mesh((2,), ("ep",))
    fn = lambda h, w2, wt: moe_gemm_combine(h, w2, wt, (1, 2), axis_name="ep")
    with pytest.raises(ValueError, match="handle must be the MoeHandle moe_dispatch_gemm returned, got tuple"):
        _trace(fn, mesh, (jnp.zeros((4, 256, 3)), jnp.zeros((4, 3, 4)), jnp.zeros((8, 2))))


def test_routed_ops_are_not_run_by_the_dense_pairing():
    from entwine_jax import pairing, registry
    assert registry.OPS["moe_dispatch_gemm"].backward == "moe_gemm_combine"
    assert registry.OPS["moe_gemm_combine"].backward == "moe_dispatch_gemm"
    with pytest.raises(ValueError, match="is a routed op"):
        pairing.call("moe_gemm_combine", jnp.zeros((4, 4)), jnp.zeros((4, 4)), axis_name="ep", dimension=0,
                     config=None)
    assert entwine_jax.MoeHandle._fields == ("expert", "place", "dropped", "received", "sent")


def test_specs_plan_and_forward_match_the_public_ops():
    # The contract's plan / forward (opspec.RoutedInput in place of x) compute what the public ops do.
    from entwine_jax import opspec, registry
    dispatch_spec, combine_spec = registry.OPS["moe_dispatch_gemm"], registry.OPS["moe_gemm_combine"]
    assert dispatch_spec.routed and combine_spec.routed and dispatch_spec.kind == "all-to-all"
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = random_case(6, 2, 2, 5, 2, 8, 4, jnp.float32, "skewed")

    def by_spec(x, idx, weights, w1, w2):
        routed = opspec.RoutedInput(x, idx)
        y, handle = dispatch_spec.forward(routed, w1, dispatch_spec.plan(routed, w1, axis_name="ep", dimension=0,
                                                                         config=None))
        routed = opspec.RoutedInput(swiglu(y, 4), weights=weights, handle=handle)
        return combine_spec.forward(routed, w2, combine_spec.plan(routed, w2, axis_name="ep", dimension=0,
                                                                  config=None))

    np.testing.assert_array_equal(run(by_spec, mesh, (x, idx, weights, w1, w2), EP),
                                  run(moe_mlp, mesh, (x, idx, weights, w1, w2), (EP, EP))[0])


def test_config_path_and_printed_choice(monkeypatch, capsys):
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = random_case(8, 2, 2, 4, 2, 8, 4, jnp.float32, "uniform")
    config = MoeConfig(capacity=0.5, path="xla")
    out = run(lambda x, idx, w1: moe_dispatch_gemm(x, idx, w1, axis_name="ep", config=config)[0], mesh, (x, idx, w1),
              EP)
    # capacity 0.5: C = max(128, round_up(ceil(0.5 * 4 * 2 / 4), 128)) = 128; y [E_local, W*C, N] per rank.
    assert out.shape == (4, 2 * 128, 8)
    err = capsys.readouterr().err
    assert ("entwine_jax.moe_dispatch_gemm x=float32[4, 8] topk_idx[4, 2] w1=float32[2, 8, 8] axis='ep' (size 2) "
            "C=128: path=xla MoeConfig(capacity=0.5, path=xla, block_n=0, gemm_sms=0, raster_rows=8, push_sms=0) "
            "source=the call reason: config.path='xla'") in err


def test_config_kernel_fields_are_checked():
    assert "push_sms=4" in str(MoeConfig(push_sms=4))
    for kwargs, match in (({"block_n": 64}, "block_n must be 0, 128 or 256"), ({"push_sms": 65}, "push_sms in"),
                          ({"raster_rows": 0}, r"raster_rows in \[1, 2147483647\]"),
                          ({"gemm_sms": 2**31}, r"gemm_sms must be in \[0, 2147483647\]"),
                          ({"gemm_sms": 1.5}, "gemm_sms must be an int"),
                          ({"push_sms": True}, "push_sms must be an int")):
        with pytest.raises(ValueError, match=match):
            MoeConfig(**kwargs)


def test_kernel_plans_state_their_rules(caplog):
    """The extension's plans (where it is built): the dispatch kernel's and moe_transfer's rules, as
    entwine_jax.moe.fused asks them."""
    from entwine_jax import _extension, _log
    from entwine_jax.moe import fused
    _log.reset_once()

    if _extension.module()[0] is None or fused.kernels_reason() is not None:
        pytest.skip("the CUDA extension with the MoE kernels is not built here")
    plan = fused.moe_plan(2, 8, 256, 1024, 2048, jnp.bfloat16, MoeConfig(gemm_sms=64))
    assert (plan.e_local, plan.grid, plan.flags_per_source, plan.push_grid) == (4, 64, 4, 0)
    assert plan.inbox_bytes == 4 * 2 * 256 * 1024 * 2
    with pytest.raises(_extension.PlanError, match="capacity % 128 == 0"):
        fused.moe_plan(2, 8, 200, 1024, 2048, jnp.bfloat16, MoeConfig(gemm_sms=64))
    with pytest.raises(_extension.PlanError, match="multiple of config.block_n"):
        fused.moe_plan(2, 8, 256, 1024, 200, jnp.bfloat16, MoeConfig(gemm_sms=64, block_n=128))
    # FP8 (x_send e4m3, or e5m2 for a gradient): one byte an element, 128-wide blocks only.
    if fused.kernels_reason(fp8=True) is None:
        plan = fused.moe_plan(2, 8, 256, 1024, 2048, jnp.float8_e4m3fn, MoeConfig(gemm_sms=64))
        assert plan.inbox_bytes == 4 * 2 * 256 * 1024 and plan.num_blocks == 4 * 2 * 2 * 2048 // 128
        assert fused.moe_plan(2, 8, 256, 1024, 2048, jnp.float8_e5m2, MoeConfig(gemm_sms=64)).grid == 64
        # A config asking for 256-wide blocks gets 128-wide ones with FP8 (the extension's rule below).
        with caplog.at_level(logging.INFO, logger="entwine_jax"):
            assert fused.moe_plan(2, 8, 256, 1024, 2048, jnp.float8_e4m3fn,
                                  MoeConfig(gemm_sms=64, block_n=256)).num_blocks == plan.num_blocks
        assert "moe: FP8 operands run 128-wide blocks, not config.block_n = 256" in caplog.text
        asked = _extension.ext().moe_plan(2, 8, 256, 1024, 2048, "float8_e4m3fn", 256, 64, 8, 0)
        assert "128-wide blocks" in asked["error"]
        with pytest.raises(_extension.PlanError, match="% 16 for FP8"):
            fused.moe_plan(2, 8, 256, 1000, 2048, jnp.float8_e4m3fn, MoeConfig(gemm_sms=64))
    # The combine kernel: h [E_local, W*C, F] -> o_recv [E, C, H]; FP8 h (e4m3 or e5m2) in 128-wide
    # blocks, its rows in the 16-bit output type (two bytes an element, as bf16's).
    if hasattr(_extension.ext(), "moe_combine_plan"):
        h, w2 = jax.ShapeDtypeStruct((4, 512, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((4, 1024, 2048), jnp.bfloat16)
        d = fused._combine_plan(2, h, w2, MoeConfig(gemm_sms=64))
        assert (d["e_local"], d["grid"], d["inbox_bytes"]) == (4, 64, 8 * 256 * 2048 * 2)
        if fused.kernels_reason(fp8=True) is None:
            h8, w8 = h.update(dtype=jnp.float8_e5m2), w2.update(dtype=jnp.float8_e4m3fn)
            d8 = fused._combine_plan(2, h8, w8, MoeConfig(gemm_sms=64))
            assert (d8["inbox_bytes"], d8["num_blocks"]) == (8 * 256 * 2048 * 2, 4 * 2 * 2 * 2048 // 128)
            assert fused._combine_plan(2, h8, w8, MoeConfig(gemm_sms=64, block_n=256))["num_blocks"] == d8["num_blocks"]
            asked = _extension.ext().moe_combine_plan(2, 8, 256, 1024, 2048, "float8_e5m2", 256, 64, 8)
            assert "128-wide blocks" in asked["error"]
        with pytest.raises(_extension.PlanError, match="capacity % 128 == 0"):
            fused._combine_plan(2, h.update(shape=(4, 400, 1024)), w2, MoeConfig(gemm_sms=64))
    # A float32 [E, C] of router weights: 4-byte rows, any dtype moves.
    d = fused._transfer_plan(3, jax.ShapeDtypeStruct((6, 128), jnp.float32))
    assert (d["e_local"], d["inbox_bytes"], d["push_grid"]) == (2, 2 * 3 * 128 * 4, 0)


def test_weight_gradient_plan_states_its_rules(caplog):
    """The weight-gradient kernel's plan (where the extension is built): dw [E_local, M, N] in whole
    128 x block_n blocks over segments of whole k-tiles, 16-bit only; each refusal is a rule, and the
    op's preparation turns it into XLA's GEMM over the layout, said once per call site."""
    import dataclasses

    from entwine_jax import _extension
    from entwine_jax.moe import fused
    from entwine_jax.moe import op as moe_op

    if _extension.module()[0] is None or not hasattr(_extension.ext(), "moe_wgrad_plan"):
        pytest.skip("the CUDA extension with the MoE weight-gradient kernel is not built here")
    d = fused._wgrad_plan(2, 4, 256, 1024, 2048, jnp.bfloat16, MoeConfig())
    assert (d["num_blocks"], d["grid"]) == (4 * (1024 // 128) * (2048 // 256), _extension.sm_count())
    assert fused._wgrad_plan(3, 1, 128, 128, 384, jnp.float16, MoeConfig())["num_blocks"] == 3  # block_n 128
    for args, rule in (((2, 4, 256, 200, 2048, jnp.bfloat16), "M .* multiple of 128"),
                       ((2, 4, 256, 1024, 200, jnp.bfloat16), "multiple of config.block_n"),
                       ((2, 4, 200, 1024, 2048, jnp.bfloat16), "capacity % 128 == 0"),
                       ((2, 4, 256, 1024, 2048, jnp.float8_e4m3fn), "bf16 or fp16 operands")):
        with pytest.raises(_extension.PlanError, match=rule):
            fused._wgrad_plan(*args, MoeConfig(block_n=128) if args[4] == 200 else MoeConfig())
    call, reason = fused.prepare_wgrad(7, world=2, e_local=4, capacity=256, m=1024, n=2048, dtype=jnp.bfloat16,
                                       config=MoeConfig())
    assert reason is None and call.comm_id == 7 and call.dtype == jnp.bfloat16
    assert dict(call.attributes)["block_n"] == 256 and call.target == "entwine_moe_weight_grad"
    assert "float32 operands" in fused.prepare_wgrad(7, world=2, e_local=4, capacity=256, m=1024, n=2048,
                                                     dtype=jnp.float32, config=MoeConfig())[1]
    # A plan whose kernels run (faked) but whose dw has H = 200: XLA's GEMM, logged once.
    plan = moe_op.Plan(axis_name="ep", axis_size=2, config=MoeConfig(), reason=None, e_local=4, capacity=256,
                       gemm_call=call)
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        for _ in range(2):
            got, why = moe_op.prepare_wgrad(plan, "moe_dispatch_gemm", 200, 2048, jnp.bfloat16)
            assert got is None and "multiple of 128" in why
    said = [r.getMessage() for r in caplog.records if "weight gradient [E_local, 200, 2048]" in r.getMessage()]
    assert len(said) == 1 and "XLA's GEMM over every row of the layout" in said[0], said
    assert moe_op.prepare_wgrad(dataclasses.replace(plan, gemm_call=None), "moe_dispatch_gemm", 1024, 2048,
                                jnp.bfloat16)[0] is None


def test_auto_path_takes_the_kernels_on_cuda(monkeypatch):
    """path 'auto' on a CUDA mesh takes the kernels for 16-bit inputs; it keeps the reference where
    the user asks, for float32, and at axis size 1 (path 'fused' still runs them there)."""
    from entwine_jax.moe import op as moe_op

    monkeypatch.setattr(moe_op.callsite, "platform_reason", lambda axis_name: None)
    for dtype in (jnp.bfloat16, jnp.float16):
        assert moe_op._early_reason(MoeConfig(), "ep", 2, dtype) is None
        assert moe_op._early_reason(MoeConfig(path="fused"), "ep", 3, dtype) is None
    assert moe_op._early_reason(MoeConfig(path="xla"), "ep", 2, jnp.bfloat16) == "config.path='xla'"
    assert "float32" in moe_op._early_reason(MoeConfig(), "ep", 2, jnp.float32)
    assert "axis size 1" in moe_op._early_reason(MoeConfig(), "ep", 1, jnp.bfloat16)
    assert moe_op._early_reason(MoeConfig(path="fused"), "ep", 1, jnp.bfloat16) is None


def test_mlp_lowers_to_the_dispatch_and_combine_kernels_on_cuda(monkeypatch):
    """Where the plans have the kernels (faked here: no GPU), an MLP's forward and backward lower for
    CUDA to the dispatch kernel (the dispatch's forward, the combine's backward), the combine kernel
    (the combine's forward, the dispatch's backward) and the weight-gradient kernel (dw1, dw2), each
    twice."""
    from entwine_jax.moe import fused
    from entwine_jax.moe import op as moe_op

    attrs = (("block_n", 128), ("gemm_sms", 64), ("raster_rows", 8), ("push_sms", 0))
    monkeypatch.setattr(moe_op, "prepare_gemm", lambda *a, **k: (fused.MoeCall(3, attrs, "entwine_moe_dispatch_gemm"),
                                                                  None))
    monkeypatch.setattr(moe_op, "prepare_combine", lambda *a, **k: (fused.MoeCall(3, attrs, "entwine_moe_gemm_combine"),
                                                                     None))
    monkeypatch.setattr(moe_op, "prepare_wgrad", lambda *a, **k: (fused.MoeCall(3, attrs, "entwine_moe_weight_grad",
                                                                                jnp.dtype(jnp.bfloat16)), None))
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = random_case(4, 2, 2, 64, 2, 32, 16, jnp.bfloat16, "uniform")
    f = jax.shard_map(lambda *a: moe_mlp(*a)[0], mesh=mesh, in_specs=(EP,) * 5, out_specs=EP)
    loss = lambda x, w1, w2: jnp.sum(f(x, idx, weights, w1, w2).astype(jnp.float32))  # noqa: E731
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, EP) for a in (x, w1, w2)]
        idx, weights = jax.device_put(idx, EP), jax.device_put(weights, EP)
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = {t: sum(f"@{t}(" in line for line in text.splitlines())
             for t in ("entwine_moe_dispatch_gemm", "entwine_moe_gemm_combine", "entwine_moe_weight_grad")}
    assert calls == {"entwine_moe_dispatch_gemm": 2, "entwine_moe_gemm_combine": 2, "entwine_moe_weight_grad": 2}, calls


def past_received(received, world: int, rows: int):
    """[E_local, W*C] bool: the pool rows in 128-row blocks wholly past their segment's received rows
    (the kernels skip those blocks). received [E_local, W] int32, as the kernels get it."""
    e_local, capacity = received.shape[0], rows // world
    assert received.shape == (e_local, world) and received.dtype == jnp.int32, (received.shape, received.dtype)
    block_start = jnp.arange(capacity) // 128 * 128  # [C]
    return (block_start[None, None, :] >= received[:, :, None]).reshape(e_local, rows)


def moved_pool(x_send, received, sent, world: int):
    """The dispatch kernel's pool [E_local, W*C, H] of x_send [E, C, H]: each segment's rows sent
    (sent [E]) rounded up to whole 128-row blocks move (the SM push moves no more; the inbox past them
    holds older calls' rows, NaN here), and the pool keeps the received rows so rounded, zeros past
    them."""
    from entwine_jax.moe import reference

    assert sent.shape == (x_send.shape[0],) and sent.dtype == jnp.int32, (sent.shape, sent.dtype)
    block_start = jnp.arange(x_send.shape[1]) // 128 * 128  # [C]
    moved = block_start[None, :] < sent[:, None]
    stale = jnp.where(moved[..., None], x_send, jnp.array(jnp.nan, x_send.dtype))
    pool = reference.to_experts(stale, axis_name="ep", world=world, op="moe_dispatch_gemm")
    return jnp.where(past_received(received, world, pool.shape[1])[..., None], jnp.zeros((), pool.dtype), pool)


def dispatch_contract(y, received, world: int):
    """The dispatch kernel's y [E_local, W*C, N]: zeros in the blocks past the received rows."""
    return jnp.where(past_received(received, world, y.shape[1])[..., None], jnp.zeros((), y.dtype), y)


def wgrad_contract(a, dy, received, world: int, block_k: int = 64):
    """The weight-gradient kernel's dw [E_local, M, N] in fp32 of a [E_local, W*C, M] and dy
    [E_local, W*C, N]: per segment it reads the received rows rounded up to whole k-tiles (block_k
    rows) and never the rows past them (zeros here: a count too small drops rows that hold data; a row
    read past the count must be zero in a or dy, which the op's masks make so)."""
    from entwine_jax.moe import reference

    e_local, rows = a.shape[:2]
    capacity = rows // world
    i = jnp.arange(rows)
    tiles = (jnp.maximum(received, 0) + block_k - 1) // block_k * block_k  # [E_local, W]
    read = (i % capacity)[None, :] < tiles[:, i // capacity]  # [E_local, W*C]
    unread = lambda v: jnp.where(read[..., None], v, jnp.zeros((), v.dtype))  # noqa: E731
    return reference.expert_weight_grad(unread(a), unread(dy))


def combine_contract(o, received, world: int):
    """The combine kernel's rows o [E_local, W*C, H] before they travel: the blocks past the received
    rows are never written (NaN here: the token side must not read them)."""
    return jnp.where(past_received(received, world, o.shape[1])[..., None], jnp.array(jnp.nan, o.dtype), o)


@pytest.mark.parametrize("world", [2, 3])
def test_kernels_get_their_operands_in_the_layouts_they_read(monkeypatch, world):
    """The bf16 MLP with the kernels' branch taken on CPU and each kernel replaced by its contract in
    XLA (the dispatch kernel: y = the moved x_send times w, and the moved pool; the combine kernel:
    o_recv = h times w, sent home; both with the blocks past the handle's received rows skipped: zeros
    in y, NaN in the rows sent home): values and gradients equal the reference path's, each kernel
    called for its forward and the other op's backward. F, H and 2F differ, so a weight in the wrong
    layout fails on its shape. C = 256; rank 0 sends all its 160 tokens to experts 0 and 1 (two
    blocks each), the others spread theirs (one block): counts too small would zero or NaN rows that
    are read (the rows past the sent counts move as NaN), and every kernel call's received and sent
    are checked against a NumPy count."""
    from entwine_jax import callsite
    from entwine_jax.moe import fused, reference
    from entwine_jax.moe import op as moe_op

    attrs = (("block_n", 128), ("gemm_sms", 64), ("raster_rows", 8), ("push_sms", 0))
    calls, seen, seen_sent = [], [], []

    def record(received, into=seen):
        jax.debug.callback(lambda r: into.append(np.asarray(r).tolist()), received)

    def fake_dispatch(x_send, w, received, sent, site, return_pool):
        calls.append("dispatch")
        record(received)
        record(sent, seen_sent)
        pool = moved_pool(x_send, received, sent, world)
        return dispatch_contract(reference.expert_dot(pool, w).astype(x_send.dtype), received, world), pool

    def fake_combine(h, w, received, site, world_):
        calls.append("combine")
        record(received)
        o = combine_contract(reference.expert_dot(h, w).astype(h.dtype), received, world_)
        return reference.to_sources(o, axis_name="ep", world=world_, op="moe_gemm_combine")

    def fake_wgrad(a, dy, received, site, world_):
        calls.append("wgrad")
        record(received)
        assert a.dtype == dy.dtype == jnp.bfloat16, (a.dtype, dy.dtype)
        return wgrad_contract(a, dy, received, world_).astype(a.dtype)

    mesh = make_mesh((world,), ("ep",))
    t, e_local = 160, 2
    x, idx, weights, w1, w2 = random_case(21, world, e_local, t, 2, 40, 24, jnp.bfloat16, "uniform")
    idx[:t] = [0, 1]
    c = np.random.default_rng(22).standard_normal(x.shape).astype(np.float32)
    outs = {}
    for emulated in (False, True):
        if emulated:
            monkeypatch.setattr(moe_op, "prepare_gemm",
                                lambda *a, **k: (fused.MoeCall(3, attrs, "entwine_moe_dispatch_gemm"), None))
            monkeypatch.setattr(moe_op, "prepare_combine",
                                lambda *a, **k: (fused.MoeCall(3, attrs, "entwine_moe_gemm_combine"), None))
            monkeypatch.setattr(moe_op, "prepare_wgrad",
                                lambda *a, **k: (fused.MoeCall(3, attrs, "entwine_moe_weight_grad",
                                                               jnp.dtype(jnp.bfloat16)), None))
            monkeypatch.setattr(fused, "call", fake_dispatch)
            monkeypatch.setattr(fused, "call_combine", fake_combine)
            monkeypatch.setattr(fused, "weight_grad", fake_wgrad)
            # The kernels' branch on this platform (it is CUDA's alone otherwise).
            monkeypatch.setattr(callsite, "dispatch", lambda reason, ref, kernel, *a: kernel(*a) if reason is None
                                else ref(*a))
        f = jax.shard_map(lambda *a: moe_mlp(*a)[0], mesh=mesh, in_specs=(EP,) * 5, out_specs=EP)
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, EP) for a in (x, idx, weights, w1, w2)]
            cc = jax.device_put(c, EP)
            loss = lambda x, weights, w1, w2: jnp.sum(f(x, args[1], weights, w1, w2).astype(jnp.float32) * cc)  # noqa
            outs[emulated] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*[args[i] for i in (0, 2, 3, 4)])
    assert sorted(calls) == ["combine", "combine", "dispatch", "dispatch", "wgrad", "wgrad"], calls
    jax.effects_barrier()
    # received[l, s] of rank r: source s's slots of expert r * E_local + l.
    counts = [[int(np.sum(idx[s * t:(s + 1) * t] == g)) for s in range(world)] for g in range(world * e_local)]
    want = [counts[r * e_local:(r + 1) * e_local] for r in range(world)]
    assert sorted(seen) == sorted(want * 6), (seen, want)
    # sent[g] of source s: its slots of expert g (each dispatch call, forward and the combine's backward).
    want_sent = [[counts[g][s] for g in range(world * e_local)] for s in range(world)]
    assert sorted(seen_sent) == sorted(want_sent * 2), (seen_sent, want_sent)
    (l_ref, g_ref), (l_emu, g_emu) = outs[False], outs[True]
    assert rel_err(np.asarray(l_emu, np.float32), np.asarray(l_ref, np.float32)) < 1e-6
    # dw2's kernel multiplies dy times the router weights rounded to bf16 (XLA's path: in fp32).
    for name, a, b, tol in zip(("x", "weights", "w1", "w2"), g_emu, g_ref, (1e-6, 1e-6, 1e-6, 5e-3)):
        assert rel_err(np.asarray(a, np.float32), np.asarray(b, np.float32)) < tol, name


@pytest.mark.parametrize("world,routing,capacity", [(2, "skewed", 1.0), (3, "uniform", None), (4, "one-rank", 0.5)])
def test_received_rows_count_each_sources_rows_per_expert(world, routing, capacity):
    """Where a kernel will read them, the handle carries received [E_local, W]: the rows source s sent
    this rank's expert l (its slots of that expert kept under the capacity), moved from every source
    (here by the XLA reference of moe_transfer), checked against a NumPy count; empty segments
    included. Without a kernel the handle has none."""
    import dataclasses

    from entwine_jax import opspec
    from entwine_jax.moe import op as moe_op

    e_local, t, k = 2, 150, 2
    x, idx, _, w1, _ = random_case(31, world, e_local, t, k, 8, 8, jnp.float32, routing)
    idx[5, 1] = world * e_local + 3  # out of range: routed nowhere

    def body(x, idx, w1, with_kernel):
        plan = moe_op.plan_dispatch(opspec.RoutedInput(x, idx), w1, axis_name="ep", config=MoeConfig(capacity=capacity))
        if with_kernel:
            plan = dataclasses.replace(plan, gemm_call="a kernel")
        handle = moe_op.layout(idx, plan)
        return handle.received if with_kernel else jnp.int32(handle.received is None)[None]

    mesh = make_mesh((world,), ("ep",))
    got = run(lambda *a: body(*a, True), mesh, (x, idx, w1), EP)
    assert run(lambda *a: body(*a, False), mesh, (x, idx, w1), EP).tolist() == [1] * world
    c = capacity_rows(t, k, world * e_local, capacity)
    want = np.zeros((world * e_local, world), np.int32)  # [global expert, source]
    for s in range(world):
        ids = idx[s * t:(s + 1) * t].reshape(-1)
        for g in range(world * e_local):
            want[g, s] = min(int(np.sum(ids == g)), c)
    assert got.tolist() == want.tolist()
    assert (want == 0).any() or routing == "uniform"


def test_kernel_calls_trace_their_operands():
    """The 16-bit dispatch and combine kernels' calls as the ops make them on CUDA (traced here, no
    GPU): the operands in the handlers' order, received [E_local, W] int32 (and the dispatch's sent
    [E] int32) last, and the outputs."""
    from entwine_jax.moe import fused

    mesh = make_mesh((2,), ("ep",))
    attrs = (("block_n", 128), ("gemm_sms", 64), ("raster_rows", 8), ("push_sms", 0))
    dispatch = fused.MoeCall(5, attrs, "entwine_moe_dispatch_gemm")
    combine = fused.MoeCall(5, attrs, "entwine_moe_gemm_combine")

    wgrad = fused.MoeCall(5, attrs, "entwine_moe_weight_grad", jnp.dtype(jnp.bfloat16))

    def body(x_send, w1, h, w2, received, sent):
        y, pool = fused.call(x_send, w1, received, sent, dispatch, return_pool=True)
        return y, fused.weight_grad(pool, y, received, wgrad, 2), fused.call_combine(h, w2, received, combine, 2)

    args = (jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2, 64, 96), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 256, 96), jnp.bfloat16), jax.ShapeDtypeStruct((2, 96, 48), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 2), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 6, out_specs=(P(),) * 3, check_vma=False)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(f)(*args)
    calls = [e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "ffi_call"]
    shapes = lambda vs: [(tuple(v.aval.shape), jnp.dtype(v.aval.dtype).name) for v in vs]  # noqa: E731
    assert [c.params["target_name"] for c in calls] == ["entwine_moe_dispatch_gemm", "entwine_moe_weight_grad",
                                                        "entwine_moe_gemm_combine"]
    assert shapes(calls[0].invars) == [((4, 128, 64), "bfloat16"), ((2, 64, 96), "bfloat16"), ((2, 2), "int32"),
                                       ((4,), "int32")]
    assert shapes(calls[0].outvars) == [((2, 256, 96), "bfloat16"), ((2, 256, 64), "bfloat16")]
    # dw1 = pool^T y: the pool transposed, K-major [E_local, H, W*C]; y [E_local, W*C, N] as it is.
    assert shapes(calls[1].invars) == [((2, 64, 256), "bfloat16"), ((2, 256, 96), "bfloat16"), ((2, 2), "int32")]
    assert shapes(calls[1].outvars) == [((2, 64, 96), "bfloat16")]
    assert shapes(calls[2].invars) == [((2, 256, 96), "bfloat16"), ((2, 96, 48), "bfloat16"), ((2, 2), "int32")]
    assert shapes(calls[2].outvars) == [((4, 128, 48), "bfloat16")]
    with pytest.raises(ValueError, match=r"received must be int32 \[E_local, W\] = \[2, 2\]"):
        jax.make_jaxpr(jax.shard_map(lambda *a: body(*a[:4], a[4][:1], a[5]), mesh=mesh, in_specs=(P(),) * 6,
                                     out_specs=(P(),) * 3, check_vma=False))(*args)
    with pytest.raises(ValueError, match=r"sent must be int32 \[E\] = \[4\], got int32\[2\]"):
        jax.make_jaxpr(jax.shard_map(lambda *a: body(*a[:5], a[5][:2]), mesh=mesh, in_specs=(P(),) * 6,
                                     out_specs=(P(),) * 3, check_vma=False))(*args)


def test_default_config_pushes_by_sms_where_the_layout_is_mostly_empty():
    """A call without a config takes the SM push (which moves only the rows sent) where the rows
    routed fill at most an eighth of the static layout's E x C rows, else the copy engines (whole
    segments); a config the caller gave is kept, push_sms included."""
    import dataclasses

    from entwine_jax import opspec
    from entwine_jax.moe import op as moe_op

    assert moe_op.default_push(MoeConfig(), "default", 4096, 8, 256, 4096).push_sms == 8  # DeepSeek-V3: 1/32
    assert moe_op.default_push(MoeConfig(), "default", 4096, 2, 8, 4096).push_sms == 0  # Mixtral: 1/4
    assert moe_op.default_push(MoeConfig(), "default", 512, 2, 8, 1024).push_sms == 8  # exactly 1/8
    assert moe_op.default_push(MoeConfig(), "the call", 4096, 8, 256, 4096).push_sms == 0
    assert moe_op.default_push(MoeConfig(push_sms=4), "default", 4096, 8, 256, 4096).push_sms == 4
    mesh = make_mesh((2,), ("ep",))
    seen = {}

    def body(x, idx, w1, config):
        plan = moe_op.plan_dispatch(opspec.RoutedInput(x, idx), w1, axis_name="ep", config=config)
        seen[config] = dataclasses.replace(plan.config)
        return x

    for experts_per_rank, config in ((8, None), (2, None), (8, MoeConfig())):
        # 256 tokens per rank.
        args = (jnp.zeros((512, 64), jnp.bfloat16), jnp.zeros((512, 2), jnp.int32),
                jnp.zeros((2 * experts_per_rank, 64, 32), jnp.bfloat16))
        _trace(lambda x, idx, w1: body(x, idx, w1, config), mesh, args)
        # 16 experts of 2 per token, C = 256: 1/16 of the rows; 4 experts: 1/2.
        want = 8 if experts_per_rank == 8 and config is None else 0
        assert seen[config].push_sms == want, (experts_per_rank, config, seen[config])
