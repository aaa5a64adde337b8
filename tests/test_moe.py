# moe_dispatch_gemm and moe_gemm_combine on fake CPU devices (the XLA reference, the only path so far):
# a hand-computed layout and output, seeded random MoE MLPs at W = 2, 3, 4 against a float64 NumPy
# model that implements the layout and capacity rule on its own (loops over ranks, experts, sources,
# tokens), -1 slots, empty experts and ranks, capacity overflow, gradients (against autodiff of a dense
# per-slot reference, and check_grads), the fallback reason, the census attribution, and bad input.
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import entwine_jax
from entwine_jax import MoeConfig, census, moe_dispatch_gemm, moe_gemm_combine

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
    return jax.nn.silu(y[:, :f]) * y[:, f:]


def moe_mlp(x, topk_idx, weights, w1, w2, *, capacity=None, act=swiglu):
    """The whole MoE MLP on one rank: (out, the handle's arrays with a leading rank dim)."""
    y, handle = moe_dispatch_gemm(x, topk_idx, w1, axis_name="ep", capacity=capacity)
    out = moe_gemm_combine(act(y, w2.shape[1]), w2, weights, handle, axis_name="ep")
    return out, jax.tree.map(lambda a: a[None], handle)


def model_layout(idx, world, e_local, cap):
    """The layout rule as loops: (kept [W*T, k], pos [W*T, k], counts [W, E], group sizes [W, E_local],
    dropped [W]). Rank r's pool: experts in order, each at a 128-row boundary computed from the counts
    before the capacity; inside, sources in order, then tokens and slots; a row is kept iff below cap."""
    wt, k = idx.shape
    t = wt // world
    kept, pos = np.zeros(idx.shape, bool), np.full(idx.shape, -1)
    counts, sizes = np.zeros((world, world * e_local), int), np.zeros((world, e_local), int)
    for r in range(world):
        base = 0
        for l in range(e_local):
            e, n = r * e_local + l, 0
            for q in range(world):
                for tok in range(q * t, (q + 1) * t):
                    for j in range(k):
                        if idx[tok, j] == e:
                            if base + n < cap:
                                kept[tok, j], pos[tok, j] = True, base + n
                                counts[q, e] += 1
                            n += 1
            sizes[r, l] = -(-counts[:, e].sum() // 128) * 128
            base += -(-n // 128) * 128
    dropped = ((idx >= 0) & ~kept).reshape(world, t * k).sum(axis=1)
    return kept, pos, counts, sizes, dropped


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


def dense_mlp(x, weights, w1, w2, idx, kept):
    """The same MLP in JAX without any routing (every slot gathers its expert's weights), for autodiff."""
    f = w2.shape[1]
    e = jnp.asarray(np.maximum(idx, 0))
    y = jnp.einsum("th,tkhn->tkn", x.astype(jnp.float32), w1[e].astype(jnp.float32))
    h = jax.nn.silu(y[..., :f]) * y[..., f:]
    o = jnp.einsum("tkf,tkfh->tkh", h, w2[e].astype(jnp.float32))
    return jnp.einsum("tk,tkh->th", jnp.where(kept, weights.astype(jnp.float32), 0.0), o)


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


def test_hand_computed():
    # W = 2, E = 4 (experts 0, 1 on rank 0; 2, 3 on rank 1), T = 3, k = 2, H = N = F = 2.
    # w1[e] = (e + 1) I, w2[e] = I, weights 0.5: out[t] = 0.5 * sum over its experts of (e + 1) x[t].
    mesh = make_mesh((2,), ("ep",))
    idx = np.array([[1, 2], [2, -1], [0, 2],    # rank 0's tokens
                    [3, 0], [-1, -1], [2, 3]],  # rank 1's
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
    np.testing.assert_array_equal(np.asarray(out)[:, 0], [2.5 * 1, 1.5 * 2, 2.0 * 3, 2.5 * 4, 0.0, 3.5 * 6])
    # Dropless cap: round_up(W*T*min(k, E_local) + 127*E_local, 128) = round_up(12 + 254, 128) = 384.
    assert y.shape == (2 * 384, 2)
    np.testing.assert_array_equal(handle.counts[0], [[1, 1, 3, 0], [1, 0, 1, 2]])
    np.testing.assert_array_equal(handle.counts[1], handle.counts[0])
    np.testing.assert_array_equal(handle.group_sizes, [[128, 128], [128, 128]])
    np.testing.assert_array_equal(handle.dropped, [0, 0])
    # src = q*T*k + t*k + j. Rank 0: expert 0 gets (q0, t2, j0) then (q1, t0, j1); expert 1 at row 128
    # gets (q0, t0, j0). Rank 1: expert 2 gets q0's t0 j1, t1 j0, t2 j1, then q1's t2 j0; expert 3 q1's
    # t0 j0 and t2 j1.
    src = np.asarray(handle.src)
    assert {i: s for i, s in enumerate(src[0]) if s >= 0} == {0: 4, 1: 7, 128: 0}
    assert {i: s for i, s in enumerate(src[1]) if s >= 0} == {0: 1, 1: 2, 2: 5, 3: 10, 128: 6, 129: 11}
    np.testing.assert_array_equal(handle.pos.reshape(6, 2), [[128, 0], [1, -1], [0, 2], [128, 1], [-1, -1], [3, 129]])
    np.testing.assert_array_equal(handle.expert.reshape(6, 2), idx)
    # y rows: (e + 1) x[token]; padding rows zero.
    y = np.asarray(y)
    np.testing.assert_array_equal(y[[0, 1, 128]], [[3.0, -3.0], [4.0, -4.0], [2.0, -2.0]])
    np.testing.assert_array_equal(y[384 + np.array([0, 3, 128, 129])], [[3, -3], [18, -18], [16, -16], [24, -24]])
    assert np.count_nonzero(y) == 2 * 9


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
    cap = handle.src.shape[1]
    kept, pos, counts, sizes, dropped = model_layout(idx, world, e_local, cap)
    assert kept.sum() == (idx >= 0).sum()  # dropless
    np.testing.assert_array_equal(handle.pos.reshape(pos.shape), pos)
    np.testing.assert_array_equal(handle.counts[0], counts)
    np.testing.assert_array_equal(handle.group_sizes, sizes)
    np.testing.assert_array_equal(handle.dropped, dropped)
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, kept)) < TOL[dtype]


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
    np.testing.assert_array_equal(handle_bad.dropped, [0, 0])


def overflow_case(t=160):
    # W = 2, E_local = 2, every token: slot 0 -> expert 0, slot 1 -> expert 1 (both on rank 0).
    # capacity 0.005: cap = round_up(ceil(0.005 * 320) + 254, 128) = 256. Expert 0 gets 320 rows
    # (rank 0's 160, then rank 1's 160): rows 256.. are dropped, i.e. rank 1's last 64 tokens' slot 0;
    # expert 1's segment would start at 384 > cap: all its rows are dropped.
    rng = np.random.default_rng(5)
    idx = np.tile(np.array([[0, 1]], np.int32), (2 * t, 1))
    x = jnp.asarray(rng.normal(size=(2 * t, 4)), jnp.float32)
    w1 = jnp.asarray(rng.normal(size=(4, 4, 8)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(4, 4, 4)) / 2, jnp.float32)
    weights = jnp.asarray(rng.random((2 * t, 2)), jnp.float32)
    return x, idx, weights, w1, w2


def test_capacity_overflow_is_deterministic_and_counted():
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = overflow_case()
    out, handle = run(lambda *a: moe_mlp(*a, capacity=0.005), mesh, (x, idx, weights, w1, w2), (EP, EP))
    assert handle.src.shape == (2, 256)
    np.testing.assert_array_equal(handle.dropped, [160, 64 + 160])
    np.testing.assert_array_equal(handle.counts[0], [[160, 0, 0, 0], [96, 0, 0, 0]])
    np.testing.assert_array_equal(handle.group_sizes, [[256, 0], [0, 0]])
    kept = model_layout(idx, 2, 2, 256)[0]
    assert kept[:, 1].sum() == 0 and kept[:, 0].sum() == 256
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, kept)) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[2 * 160 - 64:], 0.0)


def test_dropped_slots_get_zero_gradient():
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = overflow_case()
    kept = model_layout(idx, 2, 2, 256)[0]

    def loss(x, weights, w1, w2):
        f = jax.shard_map(lambda *a: moe_mlp(a[0], a[1], a[2], a[3], a[4], capacity=0.005)[0], mesh=mesh,
                          in_specs=(EP,) * 5, out_specs=EP)
        return jnp.sum(f(x, jax.device_put(idx, EP), weights, w1, w2) ** 2)

    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*[jax.device_put(a, EP) for a in (x, weights, w1, w2)])
    dx, dweights, dw1, dw2 = (np.asarray(g) for g in grads)
    np.testing.assert_array_equal(dweights[~kept], 0.0)
    assert np.all(dweights[kept] != 0.0)
    np.testing.assert_array_equal(dx[2 * 160 - 64:], 0.0)  # tokens with every slot dropped
    np.testing.assert_array_equal(dw1[1], 0.0)  # expert 1 received nothing
    dense = jax.grad(lambda *a: jnp.sum(dense_mlp(*a, idx, kept) ** 2), argnums=(0, 1, 2, 3))(x, weights, w1, w2)
    for got, want in zip((dx, dweights, dw1, dw2), dense):
        assert rel_err(got, want) < 1e-5


GRAD_CASES = [(2, 2, 6, 2, "uniform"), (3, 2, 5, 2, "skewed"), (4, 3, 4, 3, "uniform")]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "W{}-El{}-T{}-k{}-{}".format(*c))
def test_grads_match_dense_autodiff(case, dtype):
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
    dense = jax.grad(lambda *a: jnp.sum(dense_mlp(*a, idx, kept) * cot), argnums=(0, 1, 2, 3))(
        x.astype(jnp.float32), weights, w1.astype(jnp.float32), w2.astype(jnp.float32))
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


def test_reason_is_logged_once(caplog):
    mesh = make_mesh((2,), ("ep",))
    args = random_case(2, 2, 2, 4, 2, 8, 4, jnp.float32, "uniform")
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        run(moe_mlp, mesh, args, (EP, EP))
        run(moe_mlp, mesh, args, (EP, EP), jit=False)
    msgs = [r.getMessage() for r in caplog.records if ": XLA reference path: " in r.getMessage()]
    assert len(msgs) == 2, msgs  # one per op's call site, not per call
    assert all("MoE kernels not built yet" in m for m in msgs)
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
    # Forward: dispatch's counts (all-gather) and positions and rows (all-to-all, int32 and bf16);
    # combine's rows back (bf16). Nothing of theirs is XLA's.
    assert not forward.select(owner="xla", kind=("all-to-all", "all-gather")), forward.table()
    dispatch, combine = forward.select(owner="moe_dispatch_gemm"), forward.select(owner="moe_gemm_combine")
    assert dispatch.counts("kind") == {"all-gather": 1, "all-to-all": 2}, forward.table()
    assert combine.counts("kind") == {"all-to-all": 1}, forward.table()
    assert all(c.axes == ("ep",) for c in dispatch.collectives + combine.collectives)
    # Bytes by the ops' formula (docs/design.md, "Census"), not the reference's W per-pair blocks:
    # rows (W-1)/W x T*k x H x 2 = 1/2 x 16 x 8 x 2; counts (W-1) x E x 4.
    rows, = combine.collectives
    assert (rows.shape.split("[")[0], rows.bytes) == ("bf16", 128)
    assert dispatch.select(kind="all-gather").bytes == 16
    assert dispatch.select(kind="all-to-all").bytes == 128 + 16 * 4 // 2  # rows, then the slots' int32 positions
    # Backward adds: dispatch's dx (a combine), combine's dout and weights (dispatches) and the router
    # weights' gradient home (the combine's).
    assert not backward.select(owner="xla", kind=("all-to-all", "all-gather")), backward.table()
    assert backward.select(owner="moe_gemm_combine").counts("kind") == {"all-to-all": 3}, backward.table()
    assert backward.select(owner="moe_dispatch_gemm").counts("kind") == {"all-gather": 1, "all-to-all": 4}
    # The router weights' gradient travels home as f32 [T*k, 1] per pair, labelled the combine's.
    assert [c.shape.split(", ")[0] for c in backward.select(owner="moe_gemm_combine").collectives if
            c.shape.startswith("f32")] == ["f32[1,16,1]"], backward.table()


def _trace(fn, mesh, args):
    f = jax.shard_map(fn, mesh=mesh, in_specs=(EP,) * len(args), out_specs=EP)
    with jax.set_mesh(mesh):
        jax.jit(f).trace(*[jax.device_put(a, EP) for a in args])


def _dispatch_only(**kw):
    return lambda x, idx, w1: moe_dispatch_gemm(x, idx, w1, axis_name="ep", **kw)[0]


ERRORS = {  # (x, topk_idx, w1) of the global arrays, the call's keywords, the message
    "topk-dtype": ((8, 4), ("f32", (8, 2)), (4, 4, 6), {}, "topk_idx.dtype must be int32"),
    "topk-rows": ((8, 4), ("i32", (6, 2)), (4, 4, 6), {}, r"topk_idx.shape\[0\] must equal x.shape\[0\] \(T = 4\)"),
    "w1-rank": ((8, 4), ("i32", (8, 2)), (4, 24), {}, r"w1 must have rank 3 \(\[E_local, H, N\]\), got rank 2"),
    "w1-hidden": ((8, 4), ("i32", (8, 2)), (4, 5, 6), {}, r"w1.shape\[1\] must equal x.shape\[1\] \(H = 4\)"),
    "capacity": ((8, 4), ("i32", (8, 2)), (400, 4, 6), {"capacity": 0.01}, r"fewer than 128 \* E_local = 25600"),
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


COMBINE_ERRORS = {  # what to change in a good combine call, the message
    "h-rows": (lambda h, w2, wt: (h[:-1], w2, wt), r"h.shape\[0\] must equal the dispatch's pool rows \(cap = 384\)"),
    "w2-shape": (lambda h, w2, wt: (h, w2[:, :2], wt),
                 r"w2 must have shape \[E_local = 2, F = 3, H\], got \(2, 2, 4\)"),
    "weights-shape": (lambda h, w2, wt: (h, w2, wt[:, :1]), r"topk_weights must have shape \[T, k\] = \(4, 2\)"),
    "weights-dtype": (lambda h, w2, wt: (h, w2, wt.astype(jnp.int32)), "topk_weights.dtype must be a float type"),
}


@pytest.mark.parametrize("name", list(COMBINE_ERRORS))
def test_combine_errors(name):
    change, message = COMBINE_ERRORS[name]
    mesh = make_mesh((2,), ("ep",))

    def fn(x, idx, w1, w2, weights):
        y, handle = moe_dispatch_gemm(x, idx, w1, axis_name="ep")
        return moe_gemm_combine(*change(y[:, :3], w2, weights), handle, axis_name="ep")

    args = (jnp.zeros((8, 4)), jnp.zeros((8, 2), jnp.int32), jnp.zeros((4, 4, 6)), jnp.zeros((4, 3, 4)),
            jnp.zeros((8, 2)))
    with pytest.raises(ValueError, match=message):
        _trace(fn, mesh, args)


def test_combine_needs_the_handle():
    mesh = make_mesh((2,), ("ep",))
    fn = lambda h, w2, wt: moe_gemm_combine(h, w2, wt, (1, 2), axis_name="ep")
    with pytest.raises(ValueError, match="handle must be the MoeHandle moe_dispatch_gemm returned, got tuple"):
        _trace(fn, mesh, (jnp.zeros((512, 3)), jnp.zeros((4, 3, 4)), jnp.zeros((8, 2))))


def test_routed_ops_are_not_run_by_the_dense_pairing():
    from entwine_jax import pairing, registry
    assert registry.OPS["moe_dispatch_gemm"].backward == "moe_gemm_combine"
    assert registry.OPS["moe_gemm_combine"].backward == "moe_dispatch_gemm"
    with pytest.raises(ValueError, match="is a routed op"):
        pairing.call("moe_gemm_combine", jnp.zeros((4, 4)), jnp.zeros((4, 4)), axis_name="ep", dimension=0,
                     config=None)
    assert entwine_jax.MoeHandle._fields[:4] == ("counts", "src", "group_sizes", "dropped")


def test_specs_plan_and_forward_match_the_public_ops():
    # The contract's plan / forward (opspec.RoutedInput in place of x) compute what the public ops do.
    from entwine_jax import opspec, registry
    dispatch_spec, combine_spec = registry.OPS["moe_dispatch_gemm"], registry.OPS["moe_gemm_combine"]
    assert dispatch_spec.routed and combine_spec.routed and dispatch_spec.kind == "ragged-all-to-all"
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
    # capacity 0.5: cap = round_up(ceil(0.5 * 4 * 2) + 254, 128) = 384 rows per rank.
    assert out.shape == (2 * 384, 8)
    err = capsys.readouterr().err
    assert ("entwine_jax.moe_dispatch_gemm x=float32[4, 8] topk_idx[4, 2] w1=float32[2, 8, 8] axis='ep' (size 2) "
            "cap=384: path=xla MoeConfig(capacity=0.5, path=xla) source=the call reason: config.path='xla'") in err
