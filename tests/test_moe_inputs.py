# Inputs a user can pass to moe_dispatch_gemm / moe_gemm_combine and the MoE layers, on fake CPU
# devices (the XLA reference): each either gives the right answer (against float64 NumPy, or a float64
# autodiff of a dense reference for gradients) or a ValueError naming the argument: capacity factors
# (infinite, huge, NumPy scalars, beside a wrong config), num_experts, route()'s arguments, gradients
# where the caller's activation is inf or NaN on the rows no slot took (16-bit and FP8), and edge cases
# (W = 1, 3, 4 with one token; k = E and k > E; all ids -1; odd H and N in float16; 16-bit router
# weights; vmap, remat, scan, a handle carried by scan, a 2-D mesh and an axis tuple; FP8 at W = 1 and
# W = 3 and its scale checks).
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import MoeConfig, fp8, moe_dispatch_gemm, moe_gemm_combine
from entwine_jax.moe.op import capacity_rows

from test_gemm_rs import make_mesh, rel_err
from test_moe import EP, model_layout, model_mlp, moe_mlp, random_case, run, swiglu
from test_moe import _dispatch_only as dispatch_y, _trace as trace


def small(world=2, e_local=2, t=4, k=2, h=5, f=3, dtype=jnp.float32, seed=0):
    """(x, idx, weights, w1 [E, H, 2F], w2 [E, F, H]) of random_case: H and F not multiples of 8."""
    return random_case(seed, world, e_local, t, k, h, f, dtype, "uniform")


def dense64(x, weights, w1, w2, idx, act):
    """float64 autodiff reference: every kept slot gathers its expert's weights (no routing op)."""
    e = jnp.asarray(np.maximum(idx, 0))
    h = act(jnp.einsum("th,tkhn->tkn", x, w1[e]))
    o = jnp.einsum("tkf,tkfh->tkh", h, w2[e])
    return jnp.einsum("tk,tkh->th", jnp.where(jnp.asarray(idx >= 0), weights, 0.0), o)


def grads_against_float64(mesh, args, act, in_specs=None, cot_seed=1):
    """(the op's gradients of sum(out * cot) in x, weights, w1, w2; float64 autodiff's of dense64)."""
    x, idx, weights, w1, w2 = args
    in_specs = in_specs or (EP,) * 5

    def body(x, idx, weights, w1, w2):
        y, handle = moe_dispatch_gemm(x, idx, w1, axis_name="ep")
        return moe_gemm_combine(act(y), w2, weights, handle, axis_name="ep")

    cot = np.random.default_rng(cot_seed).normal(size=x.shape).astype(np.float32)
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=in_specs[0])
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, s) for a, s in zip(args, in_specs)]
        loss = lambda x, wt, w1, w2: jnp.sum(f(x, placed[1], wt, w1, w2).astype(jnp.float32) * cot)  # noqa: E731
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*[placed[i] for i in (0, 2, 3, 4)])
    with jax.enable_x64():
        wide = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, weights, w1, w2)]
        want = jax.grad(lambda *a: jnp.sum(dense64(*a, idx, act) * jnp.asarray(cot, jnp.float64)),
                        argnums=(0, 1, 2, 3))(*wide)
        want = [np.asarray(g) for g in want]
    return [np.asarray(g) for g in got], want


# ---------------------------------------------------------------- bad or extreme arguments

def test_capacity_must_be_a_finite_number():
    # inf and nan are no factor (C = inf * T*k/E rows), nor are bools or strings.
    for bad in (math.inf, math.nan, True, np.bool_(True), "1"):
        with pytest.raises(ValueError, match=r"MoeConfig: capacity must be None \(dropless\) or a finite number > 0"):
            MoeConfig(capacity=bad)
    mesh = make_mesh((2,), ("ep",))
    x, idx, _, w1, _ = small()
    with pytest.raises(ValueError, match="capacity must be None .* finite number > 0, got inf"):
        trace(dispatch_y(capacity=math.inf), mesh, (x, idx, w1))


def test_capacity_takes_numpy_scalars():
    # NumPy scalars are numbers, as np.float64 (a float subclass) is.
    assert MoeConfig(capacity=np.float32(1.25)).capacity == 1.25
    assert MoeConfig(capacity=np.int64(2)).capacity == 2
    assert capacity_rows(1024, 8, 16, np.float32(1.25)) == capacity_rows(1024, 8, 16, 1.25) == 640
    mesh = make_mesh((2,), ("ep",))
    x, idx, _, w1, _ = small()
    y = run(dispatch_y(capacity=np.float32(2.0)), mesh, (x, idx, w1), EP)
    np.testing.assert_array_equal(y, run(dispatch_y(capacity=2.0), mesh, (x, idx, w1), EP))


def test_huge_capacity_factor_is_capped_at_the_slots_of_a_source():
    # A source never sends one expert more than its T*k slots, so C stops at round_up(T*k, 128),
    # dropping nothing, however large the factor (1e30 * T*k/E rows could not be allocated).
    assert capacity_rows(4, 2, 4, 1e30) == 128
    assert capacity_rows(300, 2, 4, 1e300) == 640  # round_up(600, 128)
    assert capacity_rows(1000, 1, 1, 1.25) == 1024  # f > E: round_up(1250) would never fill
    assert capacity_rows(1024, 8, 16, 1.25) == 640  # below the cap: the documented formula
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()
    out, handle = run(lambda *a: moe_mlp(*a, capacity=1e30), mesh, (x, idx, weights, w1, w2), (EP, EP))
    np.testing.assert_array_equal(handle.dropped, [0, 0])
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, idx >= 0)) < 1e-5


def test_capacity_beside_a_wrong_config_is_a_value_error():
    # capacity= beside a config of another type: the config's type is named, not replace()'s TypeError.
    mesh = make_mesh((2,), ("ep",))
    x, idx, _, w1, _ = small()
    with pytest.raises(ValueError, match="moe_dispatch_gemm: config must be a MoeConfig or None, got GemmRsConfig"):
        trace(dispatch_y(capacity=1.0, config=entwine_jax.GemmRsConfig()), mesh, (x, idx, w1))
    with pytest.raises(ValueError, match="moe_dispatch_gemm: config must be a MoeConfig or None, got str"):
        trace(dispatch_y(capacity=1.0, config="xla"), mesh, (x, idx, w1))


@pytest.mark.parametrize("num_experts", [0, -4])
def test_num_experts_must_be_positive(num_experts):
    # 0 and -4 are divisible by W, and still no expert count.
    mesh = make_mesh((2,), ("ep",))
    x, idx, _, w1, _ = small()
    with pytest.raises(ValueError, match=rf"num_experts must be an int divisible by the size of axis 'ep' \(2\) and > 0, "
                                         rf"got {num_experts}"):
        trace(dispatch_y(num_experts=num_experts), mesh, (x, idx, w1))


ROUTE_ERRORS = {  # route(x [6, 4], router [4, 8], 2, **changes): the message
    # Each would run and route wrongly without a check: a misspelt score_func, x [B, S, H] with S == H
    # (S contracted with the router's H), a router of rank 1.
    "score-func": (dict(score_func="relu"), r"route: score_func must be one of \('softmax', 'sigmoid'\), got 'relu'"),
    "x-rank-3": (dict(x=np.ones((2, 4, 4), np.float32)), r"route: x must have shape \[T, H = 4\] .* got \(2, 4, 4\)"),
    "router-rank-1": (dict(router=np.ones((4,), np.float32)), r"route: router must have rank 2 \(\[H, E\]\), got shape"),
    # Each would fail inside jax (top_k, dot_general, a reshape, broadcasting).
    "k>E": (dict(k=9), r"route: k must be <= the number of experts \(router.shape\[1\] = 8\), got 9"),
    "k=0": (dict(k=0), "route: k must be a positive int, got 0"),
    "router-H": (dict(router=np.ones((3, 8), np.float32)), r"route: x must have shape \[T, H = 3\]"),
    "groups": (dict(n_routing_groups=3, topk_routing_group=1), "route: n_routing_groups must be -1 or a positive int"),
    "half-groups": (dict(n_routing_groups=2), "route: n_routing_groups and topk_routing_group must both be -1"),
    "bias": (dict(routed_bias=np.zeros(3, np.float32)), r"route: routed_bias must have shape \[E\] = \(8,\) \(whole, not split\), got \(3,\)"),
    "scaling": (dict(routed_scaling_factor=-1.0), "route: routed_scaling_factor must be a positive number, got -1.0"),
    "x-list": (dict(x=[[1.0] * 4]), "route: x must be an array, got list"),
}


@pytest.mark.parametrize("name", list(ROUTE_ERRORS))
def test_route_checks_its_arguments(name):
    pytest.importorskip("flax")
    from entwine_jax.moe_layers import route
    rng = np.random.default_rng(0)
    args = dict(x=jnp.asarray(rng.normal(size=(6, 4)), jnp.float32), router=jnp.asarray(rng.normal(size=(4, 8)),
                                                                                       jnp.float32), k=2)
    changes, message = ROUTE_ERRORS[name]
    args.update(changes)
    with pytest.raises(ValueError, match=message):
        route(args.pop("x"), args.pop("router"), args.pop("k"), **args)


def test_moe_mlp_huge_capacity_factor_drops_nothing():
    # C stops at the S*k slots of a sequence: int(1e300 * ...) cannot be compared with int32 positions.
    pytest.importorskip("flax")
    from entwine_jax.moe_layers import moe_mlp as layer_mlp
    world, h, f, e = 2, 4, 3, 4
    mesh = make_mesh((world,), ("ep",))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(world * 3, h)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(h, e)), jnp.float32)
    wi_0, wi_1 = (jnp.asarray(rng.normal(size=(e, h, f)), jnp.float32) for _ in range(2))
    wo = jnp.asarray(rng.normal(size=(e, f, h)), jnp.float32)

    def go(**kw):
        fn = lambda x, r, a, b, c: layer_mlp(x, r, a, b, c, num_experts_per_tok=2, axis_name="ep", **kw)  # noqa: E731
        sm = jax.shard_map(fn, mesh=mesh, in_specs=(EP, P(), EP, EP, EP), out_specs=(EP, P()) if kw else EP)
        with jax.set_mesh(mesh):
            return jax.jit(sm)(jax.device_put(x, EP), router, *[jax.device_put(a, EP) for a in (wi_0, wi_1, wo)])

    out, aux = go(capacity_factor=1e300, return_aux=True)
    assert int(aux["dropped"]) == 0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(go()))


def log_abs(y):
    return jnp.log(jnp.abs(y))  # -inf on the rows no slot took (y's zeros)


def sqrt_abs(y):
    return jnp.sqrt(jnp.abs(y) + 0.0)  # finite, but an infinite derivative on y's zero rows


def row_normalised(y):
    return y / jnp.linalg.norm(y, axis=-1, keepdims=True)  # NaN (0 / 0) on y's zero rows


@pytest.mark.parametrize("act", [log_abs, sqrt_abs, row_normalised], ids=lambda a: a.__name__)
def test_gradients_ignore_the_rows_no_slot_took(act):
    # The forward never reads h's rows that no slot took, so an activation that is inf or NaN there (or
    # has an infinite slope there) must not reach dw1 and dw2 (0 * NaN is NaN). Against float64
    # autodiff of the same MLP without padding rows.
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small(seed=4)
    w1 = w1[..., :3]  # act keeps the width: y [.., 3] -> h [.., 3] = F
    got, want = grads_against_float64(mesh, (x, idx, weights, w1, w2), act)
    for name, g, r in zip(("x", "weights", "w1", "w2"), got, want):
        assert np.all(np.isfinite(g)), name
        assert rel_err(g, r) < 1e-4, name


def test_fp8_gradients_ignore_the_rows_no_slot_took():
    # The FP8 backward quantises dy with its current scale: one inf or NaN on a row no slot took (an
    # activation with an infinite slope at y's zeros) would make the scale, and so every gradient, NaN.
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small(seed=6)
    w1 = w1[..., :3]

    def body(x, idx, weights, w1, w2):
        y, handle = moe_dispatch_gemm(x, idx, w1, axis_name="ep", x_scale=fp8.current_scale(x),
                                      w_scale=fp8.current_scale(w1))
        h = sqrt_abs(y.astype(jnp.float32))
        return moe_gemm_combine(h, w2, weights, handle, axis_name="ep", x_scale=fp8.current_scale(h),
                                w_scale=fp8.current_scale(w2)).astype(jnp.float32)

    f = jax.shard_map(body, mesh=mesh, in_specs=(EP,) * 5, out_specs=EP)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, EP) for a in (x, idx, weights, w1, w2)]
        loss = lambda x, wt, w1, w2: jnp.sum(f(x, placed[1], wt, w1, w2))  # noqa: E731
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*[placed[i] for i in (0, 2, 3, 4)])
    for name, g in zip(("x", "weights", "w1", "w2"), grads):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert np.any(np.asarray(g) != 0), name


def test_taken_rows_from_the_counts_and_from_the_pool_agree():
    # The kernels' path marks the taken rows by the handle's counts, the reference by the pool's
    # nonzero rows: the same rows wherever the taken rows are nonzero and the rest zero.
    from entwine_jax.moe.op import taken_rows
    rng = np.random.default_rng(2)
    e_local, world, c, h = 3, 3, 8, 4
    received = rng.integers(0, c + 1, size=(e_local, world)).astype(np.int32)
    received[0, 1], received[2, 0] = 0, c  # an empty and a full segment
    rows = np.arange(c)[None, None, :] < received[:, :, None]  # [E_local, W, C]
    pool = np.where(rows[..., None], rng.uniform(1, 2, size=(e_local, world, c, h)), 0.0)
    pool = jnp.asarray(pool.reshape(e_local, world * c, h), jnp.float32)
    by_counts = np.asarray(taken_rows(pool, jnp.asarray(received), world))
    by_pool = np.asarray(taken_rows(pool, None, world))
    assert by_counts.shape == (e_local, world * c, 1)
    np.testing.assert_array_equal(by_counts, rows.reshape(e_local, world * c, 1))
    np.testing.assert_array_equal(by_counts, by_pool)


def test_combine_checks_h_against_the_handles_counts():
    # A handle whose dispatch ran a kernel carries its counts [E_local, W]: an h of another layout is
    # refused (the gap below is the reference path's, whose handle has no counts).
    from entwine_jax.moe.reference import MoeHandle
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()

    def fn(x, idx, weights, w1, w2):
        y, handle = moe_dispatch_gemm(x, idx, w1[..., :3], axis_name="ep")
        handle = MoeHandle(handle.expert, handle.place, handle.dropped, jnp.zeros((2, 2), jnp.int32))
        return moe_gemm_combine(y[:1], w2[:1], weights, handle, axis_name="ep")

    with pytest.raises(ValueError, match=r"h must be in the layout of the handle's dispatch: h has E_local = 1 "
                                         r"\(shape \(1, 256, 3\)\), the handle's received counts are \(2, 2\)"):
        trace(fn, mesh, (x, idx, weights, w1, w2))


# ---------------------------------------------------------------- a problem left open (by design)

@pytest.mark.xfail(strict=True, reason="the MoeHandle carries no static E or C (its fields are int32 arrays whose "
                                       "shapes are [T, k]): moe_gemm_combine cannot tell h's layout from another "
                                       "dispatch's and reads clamped rows")
def test_combine_with_h_of_another_layout_is_a_value_error():
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()

    def fn(x, idx, weights, w1, w2):
        y, handle = moe_dispatch_gemm(x, idx, w1[..., :3], axis_name="ep")
        # h and w2 of one local expert, for a handle that routes to two per rank.
        return moe_gemm_combine(y[:1], w2[:1], weights, handle, axis_name="ep")

    with pytest.raises(ValueError, match="h"):
        trace(fn, mesh, (x, idx, weights, w1, w2))


# ---------------------------------------------------------------- edge cases that work

@pytest.mark.parametrize("world, e_local, k", [(1, 1, 1), (3, 1, 3), (4, 1, 4)])
def test_one_token_per_rank(world, e_local, k):
    # T = 1, E_local = 1, k up to E: every rank's single token against the float64 model.
    mesh = make_mesh((world,), ("ep",))
    x, idx, weights, w1, w2 = random_case(20 + world, world, e_local, 1, k, 5, 3, jnp.float32, "uniform")
    out, handle = run(moe_mlp, mesh, (x, idx, weights, w1, w2), (EP, EP))
    assert out.shape == (world, 5)
    kept, place, _ = model_layout(idx, world, world * e_local, 128)
    np.testing.assert_array_equal(handle.place.reshape(place.shape), place)
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, kept)) < 1e-5


def test_k_up_to_and_past_e_repeats_and_all_none():
    # W = 2, E = 4, k = 5 > E: every expert named, one expert twice in a token, a token of -1 only,
    # ids past E and below -1 (nowhere). The same expert twice counts twice (two rows, two weights).
    mesh = make_mesh((2,), ("ep",))
    x, _, weights, w1, w2 = random_case(7, 2, 2, 3, 5, 5, 3, jnp.float32, "uniform")
    idx = np.array([[0, 1, 2, 3, -1], [2, 2, 2, 0, 0], [-1, -1, -1, -1, -1],
                    [3, 1, 4, -5, 1], [0, 3, 3, 3, 3], [1, 2, 3, 0, 1]], np.int32)
    out, handle = run(moe_mlp, mesh, (x, idx, weights, w1, w2), (EP, EP))
    kept = (idx >= 0) & (idx < 4)
    np.testing.assert_array_equal(handle.expert.reshape(idx.shape), np.where(kept, idx, -1))
    np.testing.assert_array_equal(handle.dropped, [0, 0])
    np.testing.assert_array_equal(out[2], 0.0)
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, kept)) < 1e-5


def test_all_ids_none_gives_zeros_and_zero_gradients():
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()
    idx = np.full_like(idx, -1)
    y, out = run(lambda x, i, wt, w1, w2: (moe_dispatch_gemm(x, i, w1, axis_name="ep")[0], moe_mlp(x, i, wt, w1, w2)[0]),
                 mesh, (x, idx, weights, w1, w2), (EP, EP))
    assert not y.any() and not out.any()
    got, _ = grads_against_float64(mesh, (x, idx, weights, w1, w2), lambda y: swiglu(y, 3))
    for g in got:
        np.testing.assert_array_equal(g, 0.0)


def test_float16_odd_sizes_forward_and_gradients():
    # H = 5, F = 3 (N = 6) in float16 at W = 3: output and every gradient against float64.
    mesh = make_mesh((3,), ("ep",))
    x, idx, weights, w1, w2 = small(world=3, t=3, dtype=jnp.float16, seed=5)
    out, _ = run(moe_mlp, mesh, (x, idx, weights, w1, w2), (EP, EP))
    assert out.dtype == np.float16
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, idx >= 0)) < 5e-3
    got, want = grads_against_float64(mesh, (x, idx, weights, w1, w2), lambda y: jax.nn.silu(y[..., :3]) * y[..., 3:])
    for name, g, r, a in zip(("x", "weights", "w1", "w2"), got, want, (x, weights, w1, w2)):
        assert g.dtype == a.dtype, name
        assert rel_err(g, r) < 1e-2, name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_sixteen_bit_router_weights(dtype):
    # topk_weights are summed in fp32: 16-bit weights give the fp32 answer of their rounded values,
    # and their gradient comes back in their dtype.
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()
    low = weights.astype(dtype)
    out_low, _ = run(moe_mlp, mesh, (x, idx, low, w1, w2), (EP, EP))
    out_f32, _ = run(moe_mlp, mesh, (x, idx, low.astype(jnp.float32), w1, w2), (EP, EP))
    np.testing.assert_array_equal(out_low, out_f32)
    f = jax.shard_map(lambda *a: moe_mlp(*a)[0], mesh=mesh, in_specs=(EP,) * 5, out_specs=EP)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, EP) for a in (x, idx, low, w1, w2)]
        g = jax.jit(jax.grad(lambda wt: jnp.sum(f(placed[0], placed[1], wt, *placed[3:]))))(placed[2])
    assert g.dtype == dtype and np.all(np.isfinite(np.asarray(g, np.float32)))


def test_vmap_over_token_sets():
    # Not promised by the docs, but it works: a batch of token sets, each routed on its own.
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()
    rng = np.random.default_rng(9)
    xb = jnp.stack([x, x[::-1], jnp.asarray(rng.normal(size=x.shape), jnp.float32)])
    idxb = np.stack([idx, idx[::-1], np.full_like(idx, -1)])
    specs = (P(None, "ep"), P(None, "ep"), EP, EP, EP)
    f = jax.shard_map(lambda xb, ib, wt, w1, w2: jax.vmap(lambda x, i: moe_mlp(x, i, wt, w1, w2)[0])(xb, ib),
                      mesh=mesh, in_specs=specs, out_specs=P(None, "ep"))
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(f)(*[jax.device_put(a, s) for a, s in zip((xb, idxb, weights, w1, w2), specs)]))
    for b in range(3):
        assert rel_err(got[b], model_mlp(xb[b], idxb[b], weights, w1, w2, idxb[b] >= 0)) < 1e-5, b


def test_remat_and_scan_over_layers():
    # Two layers in lax.scan (stacked weights), each under jax.checkpoint, against the unrolled loop:
    # the same loss and gradients.
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()
    w1s, w2s = jnp.stack([w1, 0.5 * w1]), jnp.stack([w2, -w2])

    def layer(h, w1, w2, i, wt):
        return h + moe_mlp(h, i, wt, w1, w2)[0]

    def scanned(x, i, wt, w1s, w2s):
        body = jax.checkpoint(lambda h, ws: (layer(h, ws[0], ws[1], i, wt), None))
        return jax.lax.scan(body, x, (w1s, w2s))[0]

    def unrolled(x, i, wt, w1s, w2s):
        for n in range(2):
            x = layer(x, w1s[n], w2s[n], i, wt)
        return x

    specs = (EP, EP, EP, P(None, "ep"), P(None, "ep"))
    results = []
    for fn in (scanned, unrolled):
        f = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=EP)
        with jax.set_mesh(mesh):
            placed = [jax.device_put(a, s) for a, s in zip((x, idx, weights, w1s, w2s), specs)]
            loss = lambda x, wt, a, b: jnp.sum(f(x, placed[1], wt, a, b) ** 2)  # noqa: E731
            value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*[placed[i] for i in (0, 2, 3, 4)])
        results.append([np.asarray(value)] + [np.asarray(g) for g in grads])
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-5


def test_handle_carried_by_scan_and_reused():
    # A handle is a pytree of int32 arrays: it goes through a scan carry, and two combines (of two h in
    # its layout) take it.
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()

    def fn(x, i, wt, w1, w2):
        y, handle = moe_dispatch_gemm(x, i, w1, axis_name="ep")
        step = lambda hd, s: (hd, moe_gemm_combine(s * swiglu(y, 3), w2, wt, hd, axis_name="ep"))  # noqa: E731
        return jax.lax.scan(step, handle, jnp.asarray([1.0, -2.0]))[1]

    outs = run(lambda *a: jnp.moveaxis(fn(*a), 0, 1), mesh, (x, idx, weights, w1, w2), EP)
    want = model_mlp(x, idx, weights, w1, w2, idx >= 0)
    assert rel_err(outs[:, 0], want) < 1e-5 and rel_err(outs[:, 1], -2 * want) < 1e-5


def test_two_dimensional_mesh_and_axis_tuple():
    # Tokens over (dp, ep) with the experts over ep only (replicated over dp): forward and gradients
    # against float64 (dw summed over dp). Then the experts over both axes, axis_name a tuple.
    mesh = make_mesh((2, 2), ("dp", "ep"))
    x, idx, weights, w1, w2 = random_case(6, 2, 2, 6, 2, 5, 3, jnp.float32, "uniform")  # 12 tokens, E = 4
    tok = P(("dp", "ep"))
    specs = (tok, tok, tok, P("ep"), P("ep"))
    act = lambda y: swiglu(y, 3)  # noqa: E731
    got, want = grads_against_float64(mesh, (x, idx, weights, w1, w2), act, in_specs=specs)
    for name, g, r in zip(("x", "weights", "w1", "w2"), got, want):
        assert rel_err(g, r) < 1e-5, name
    x, idx, weights, w1, w2 = random_case(8, 4, 2, 3, 2, 5, 3, jnp.float32, "uniform")  # E = 8 over 4 ranks

    def both(x, i, wt, w1, w2):
        y, handle = moe_dispatch_gemm(x, i, w1, axis_name=("dp", "ep"))
        return moe_gemm_combine(act(y), w2, wt, handle, axis_name=("dp", "ep"))

    f = jax.shard_map(both, mesh=mesh, in_specs=(tok,) * 5, out_specs=tok)
    with jax.set_mesh(mesh):
        out = np.asarray(jax.jit(f)(*[jax.device_put(a, tok) for a in (x, idx, weights, w1, w2)]))
    assert rel_err(out, model_mlp(x, idx, weights, w1, w2, idx >= 0)) < 1e-5


DISPATCH_INPUT_ERRORS = {  # (x, topk_idx, w1) changes of a good call, the message
    "idx-uint32": (lambda x, i, w: (x, i.astype(jnp.uint32), w), "topk_idx.dtype must be int32 .* got uint32"),
    "idx-int16": (lambda x, i, w: (x, i.astype(jnp.int16), w), "topk_idx.dtype must be int32 .* got int16"),
    "x-int": (lambda x, i, w: (x.astype(jnp.int32), i, w.astype(jnp.int32)),
              r"x.dtype must be bfloat16 or float16 \(or float32 on the XLA path\), got int32"),
    "w1-f16": (lambda x, i, w: (x, i, w.astype(jnp.float16)), r"w1.dtype must equal x.dtype \(float32\), got float16"),
    "k=0": (lambda x, i, w: (x, i[:, :0], w), "every dim must be > 0"),
    "N=0": (lambda x, i, w: (x, i, w[..., :0]), "every dim must be > 0"),
}


@pytest.mark.parametrize("name", list(DISPATCH_INPUT_ERRORS))
def test_dispatch_input_errors(name):
    change, message = DISPATCH_INPUT_ERRORS[name]
    mesh = make_mesh((2,), ("ep",))
    x, idx, _, w1, _ = small()
    with pytest.raises(ValueError, match=message):
        trace(lambda x, i, w: moe_dispatch_gemm(*change(x, i, w), axis_name="ep")[0], mesh, (x, idx, w1))


# ---------------------------------------------------------------- FP8

@pytest.mark.parametrize("world, t, k", [(1, 4, 2), (3, 1, 3)])
def test_fp8_dispatch_at_other_worlds(world, t, k):
    # W = 1 (nothing moves) and W = 3 with one token naming every expert, H = 5, N = 3, scales of
    # shape (1,): the float32 op on the dequantised operands, to bf16's rounding.
    from test_moe_fp8 import deq, inputs, per_rank, rel
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world, t=t, h=5, n=3, e_local=1, k=k, seed=2)

    def body(x, i, w):
        xs, ws = fp8.current_scale(x).reshape(1), fp8.current_scale(w).reshape(1)
        return moe_dispatch_gemm(x, i, w, axis_name="ep", x_scale=xs, w_scale=ws)[0]

    y = run(body, mesh, (x, idx, w1), EP)
    assert y.dtype == jnp.bfloat16
    xq, wq = (per_rank(lambda s: deq(jnp.asarray(s)), a, world) for a in (x, w1))
    assert rel(y.astype(np.float32), run(dispatch_y(), mesh, (xq, idx, wq), EP)) < 4e-3


@pytest.mark.parametrize("scale, match", [
    (1.0, "x_scale must be a float32 scalar array .* got float"),
    (np.float64(1.0), r"x_scale must be a float32 scalar array .* got float64\[\]"),
    (jnp.bfloat16(1.0), r"x_scale must be a float32 scalar array .* got bfloat16\[\]"),
], ids=["python-float", "float64", "bfloat16"])
def test_fp8_scale_types(scale, match):
    mesh = make_mesh((2,), ("ep",))
    x, idx, _, w1, _ = small()
    with pytest.raises(ValueError, match=match):
        trace(dispatch_y(x_scale=scale, w_scale=jnp.float32(1.0)), mesh, (x, idx, w1))


def test_fp8_combine_scale_must_be_per_tensor():
    mesh = make_mesh((2,), ("ep",))
    x, idx, weights, w1, w2 = small()

    def fn(x, i, wt, w1, w2):
        y, handle = moe_dispatch_gemm(x, i, w1[..., :3], axis_name="ep")
        return moe_gemm_combine(y, w2, wt, handle, axis_name="ep", x_scale=jnp.ones((3,), jnp.float32),
                                w_scale=jnp.float32(1.0))

    with pytest.raises(ValueError, match=r"moe_gemm_combine: x_scale must be a float32 scalar .* per-tensor scales "
                                         r"only .* got shape \(3,\)"):
        trace(fn, mesh, (x, idx, weights, w1, w2))
