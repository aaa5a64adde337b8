# ag_gemm values and gradients on fake CPU devices (the XLA reference path): a hand-computable case,
# seeded random cases in both layouts (gathering rows, a middle dim, the contraction dim) over 1-8
# device meshes and every dtype, jit and eager, the gathered operand, gradients (check_grads and
# against autodiff of the plain XLA expression), the pairing with gemm_rs, and bad input.
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import entwine_jax
from entwine_jax import AgGemmConfig, _extension, ag_gemm, gemm_rs
from entwine_jax.ag_gemm import fused as ag_fused
from entwine_jax.ag_gemm import plan as ag_plan

from test_gemm_rs import TOL, make_mesh, random_inputs, rel_err, shard_call


def layout_specs(x_ndim, gd):
    """x sharded over its gathered dim, w over N: the global output is all_gather(x) @ w."""
    x_spec = [None] * x_ndim
    x_spec[gd] = "tp"
    out = [None] * x_ndim
    out[-1] = "tp"
    return (P(*x_spec), P(None, "tp")), P(*out)


def xla_expression(x, w, gd):
    g = jax.lax.all_gather(x, "tp", axis=gd, tiled=True)
    return jnp.matmul(g.astype(jnp.float32), w.astype(jnp.float32)).astype(x.dtype)


def test_hand_computed_rows():
    # 4 ranks, each holding 2 rows of x[i, :] = i (K = 3), w = 1: y[i, n] = 3 i over all 8 rows.
    mesh = make_mesh((4,), ("tp",))
    x = jnp.broadcast_to(jnp.arange(8, dtype=jnp.bfloat16)[:, None], (8, 3))
    w = jnp.ones((3, 4), jnp.bfloat16)
    in_specs, out_spec = layout_specs(2, 0)
    y, _, _ = shard_call(lambda x, w: ag_gemm(x, w, axis_name="tp"), mesh, (x, w), in_specs, out_spec)
    assert y.dtype == jnp.bfloat16 and y.shape == (8, 4)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.repeat(3 * np.arange(8.0)[:, None], 4, axis=1))


def test_hand_computed_contraction():
    # K = 8 split over 4 ranks; x = 1, w[k, n] = k: y = sum_k k = 28 everywhere.
    mesh = make_mesh((4,), ("tp",))
    x = jnp.ones((2, 8), jnp.float16)
    w = jnp.broadcast_to(jnp.arange(8, dtype=jnp.float16)[:, None], (8, 4))
    in_specs, out_spec = layout_specs(2, 1)
    y, _, _ = shard_call(lambda x, w: ag_gemm(x, w, axis_name="tp", gather_dimension=-1), mesh, (x, w), in_specs,
                         out_spec)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.full((2, 4), 28.0))


CASES = [  # (x shape (global), w shape (global), gather dim)
    ((64, 48), (48, 32), 0),
    ((3, 40, 24), (24, 16), 1),
    ((40, 3, 24), (24, 16), 0),
    ((24, 64), (64, 32), -1),
    ((2, 5, 64), (64, 24), -1),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("x_shape,w_shape,gd", CASES)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_matches_xla(dtype, x_shape, w_shape, gd, world):
    mesh = make_mesh((world,), ("tp",))
    x, w = random_inputs(world * 7 + len(x_shape), x_shape, w_shape, dtype)
    in_specs, out_spec = layout_specs(len(x_shape), gd % len(x_shape))
    y, _, placed = shard_call(lambda x, w: ag_gemm(x, w, axis_name="tp", gather_dimension=gd), mesh, (x, w),
                              in_specs, out_spec)
    ref, _, _ = shard_call(lambda x, w: xla_expression(x, w, gd % x.ndim), mesh, (x, w), in_specs, out_spec)
    assert y.shape == x_shape[:-1] + (w_shape[1],) and y.dtype == dtype
    assert rel_err(y, ref) <= TOL[dtype]
    # The unsharded product, as a second witness.
    assert rel_err(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64)) <= TOL[dtype]


def test_eager_equals_jit():
    mesh = make_mesh((4,), ("tp",))
    x, w = random_inputs(3, (32, 16), (16, 8), jnp.bfloat16)
    in_specs, out_spec = layout_specs(2, 0)
    fn = lambda x, w: ag_gemm(x, w, axis_name="tp")  # noqa: E731
    a, _, _ = shard_call(fn, mesh, (x, w), in_specs, out_spec, jit=True)
    b, _, _ = shard_call(fn, mesh, (x, w), in_specs, out_spec, jit=False)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("gd", [0, -1])
def test_return_gathered(gd):
    mesh = make_mesh((4,), ("tp",))
    x, w = random_inputs(5, (16, 32), (32, 8) if gd == -1 else (32, 8), jnp.float32)
    in_specs, out_spec = layout_specs(2, gd % 2)
    fn = lambda x, w: ag_gemm(x, w, axis_name="tp", gather_dimension=gd, return_gathered=True)  # noqa: E731
    (y, g), _, _ = shard_call(fn, mesh, (x, w), in_specs, (out_spec, P()), check_vma=False)
    # Every rank holds the whole gathered x: the global g (replicated out_spec) is x itself.
    np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
    assert rel_err(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64)) <= TOL[jnp.float32]


@pytest.mark.parametrize("x_shape,w_shape,gd", CASES)
def test_gradients_match_autodiff_of_xla(x_shape, w_shape, gd):
    mesh = make_mesh((4,), ("tp",))
    x, w = random_inputs(11, x_shape, w_shape, jnp.float32)
    c = jax.random.normal(jax.random.key(12), x_shape[:-1] + (w_shape[1],), jnp.float32)
    in_specs, out_spec = layout_specs(len(x_shape), gd % len(x_shape))

    def loss(op):
        f = jax.shard_map(op, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * c), argnums=(0, 1)))

    ours = lambda x, w: ag_gemm(x, w, axis_name="tp", gather_dimension=gd)  # noqa: E731
    plain = lambda x, w: xla_expression(x, w, gd % x.ndim)  # noqa: E731
    with jax.set_mesh(mesh):
        x, w = (jax.device_put(a, s) for a, s in zip((x, w), in_specs))
        for a, b in zip(loss(ours)(x, w), loss(plain)(x, w)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gd", [0, -1])
def test_check_grads(gd):
    mesh = make_mesh((2,), ("tp",))
    x, w = random_inputs(13, (8, 6), (6, 4), jnp.float32)
    in_specs, out_spec = layout_specs(2, gd % 2)
    f = jax.shard_map(lambda x, w: ag_gemm(x, w, axis_name="tp", gather_dimension=gd), mesh=mesh,
                      in_specs=in_specs, out_specs=out_spec)
    # check_grads perturbs with unplaced arrays: place them again inside.
    g = jax.jit(lambda x, w: f(jax.reshard(x, in_specs[0]), jax.reshard(w, in_specs[1])))
    with jax.set_mesh(mesh):
        x, w = (jax.device_put(a, s) for a, s in zip((x, w), in_specs))
        check_grads(g, (x, w), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_pairing_each_op_is_the_others_backward(monkeypatch):
    """gemm_rs's backward calls ag_gemm (gathering the scattered dim) and ag_gemm's calls gemm_rs."""
    from entwine_jax import pairing

    calls = collections.Counter()
    real_call = pairing.call

    def spy(name, *a, **k):
        calls.update([(name, k.get("dimension"))])
        return real_call(name, *a, **k)

    monkeypatch.setattr(pairing, "call", spy)
    mesh = make_mesh((2,), ("tp",))
    x, w1 = random_inputs(21, (8, 6), (6, 8), jnp.float32)
    _, w2 = random_inputs(22, (8, 8), (8, 6), jnp.float32)

    def block(x, w1, w2):  # sequence parallel: gather rows, then reduce-scatter rows
        return gemm_rs(jnp.tanh(ag_gemm(x, w1, axis_name="tp")), w2, axis_name="tp")

    specs = (P("tp", None), P(None, "tp"), P("tp", None))
    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("tp", None))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, s) for a, s in zip((x, w1, w2), specs)]
        jax.eval_shape(f, *args)
        forward = calls.copy()
        jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))(*args)
    # What the gradient called beyond a forward: gemm_rs's dx, ag_gemm's dx.
    assert calls - forward - forward == {("ag_gemm", 0): 1, ("gemm_rs", 0): 1}


@pytest.mark.parametrize("bad,match", [
    (dict(gather_dimension=2), "gather_dimension must be an int in"),
    (dict(gather_dimension=True), "gather_dimension must be an int in"),
    (dict(axis_name="nope"), "axis_name 'nope' is not bound"),
    (dict(config=entwine_jax.GemmRsConfig()), "config must be an AgGemmConfig"),
    (dict(return_gathered=1), "return_gathered must be a bool"),
])
def test_bad_arguments(bad, match):
    mesh = make_mesh((2,), ("tp",))
    x, w = random_inputs(1, (8, 6), (6, 4), jnp.float32)
    kwargs = dict(axis_name="tp") | bad
    f = jax.shard_map(lambda x, w: ag_gemm(x, w, **kwargs), mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                      out_specs=P(None, "tp"))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        jax.jit(f).trace(jax.device_put(x, P("tp", None)), jax.device_put(w, P(None, "tp")))


@pytest.mark.parametrize("x_shape,w_shape,gd,match", [
    ((8, 6), (5, 4), 0, r"x.shape\[-1\] \(K\) must equal w.shape\[0\]"),
    ((8, 6), (6, 4), -1, r"needs w.shape\[0\] == x.shape\[-1\] \* axis size"),
    ((8,), (8, 4), 0, "w.shape"),
])
def test_bad_shapes(x_shape, w_shape, gd, match):
    mesh = make_mesh((2,), ("tp",))
    x = jnp.ones(x_shape, jnp.bfloat16)
    w = jnp.ones(w_shape, jnp.bfloat16)
    f = jax.shard_map(lambda x, w: ag_gemm(x, w, axis_name="tp", gather_dimension=gd), mesh=mesh,
                      in_specs=(P(), P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=match):
        jax.jit(f).trace(x, w)


def test_bad_dtypes():
    mesh = make_mesh((2,), ("tp",))
    f = jax.shard_map(lambda x, w: ag_gemm(x, w, axis_name="tp"), mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                      check_vma=False)
    with pytest.raises(ValueError, match="x.dtype must be bfloat16 or float16"):
        jax.jit(f).trace(jnp.ones((4, 4), jnp.int32), jnp.ones((4, 4), jnp.int32))
    with pytest.raises(ValueError, match="w.dtype must equal x.dtype"):
        jax.jit(f).trace(jnp.ones((4, 4), jnp.bfloat16), jnp.ones((4, 4), jnp.float16))


@pytest.mark.parametrize("field,value,match", [
    ("block_n", 64, "block_n must be one of"), ("gemm_sms", -1, "gemm_sms must be an int >= 0"),
    ("raster_rows", 0, "raster_rows must be an int >= 1"), ("max_chunks", 65, "max_chunks must be <= 64"),
    ("push", "dma", "push must be one of"), ("push_sms", 65, "push_sms must be <= 64"),
    ("push_sms", -1, "push_sms must be an int >= 0"), ("path", "gpu", "path must be one of"),
    ("block_n", 128.0, r"block_n must be one of \(128, 256\), got 128.0"),
    ("gemm_sms", 2**31, "gemm_sms must be <= 2147483647"), ("raster_rows", 2**31, "raster_rows must be <= 2147483647"),
])
def test_config_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        AgGemmConfig(**{field: value})


def test_plan_pads_each_shard():
    # The plan pads a shard to whole 128-row tiles and 16-byte rows, N to whole blocks.
    if _extension.module()[0] is None:
        pytest.skip("the plan is the compiled extension's (pure-Python install)")
    plan = ag_plan.ag_plan(77, 60, 130, 2, False, AgGemmConfig(block_n=128), 131)
    assert (plan.rows_pad, plan.cols_pad, plan.n_pad) == (128, 64, 256)
    assert plan.chunks == 1 and plan.inbox_bytes == 2 * 128 * 64 * 2
    plan = ag_plan.ag_plan(1024, 512, 1024, 4, True, AgGemmConfig(max_chunks=3), 131)
    assert plan.chunks == 2 and plan.chunk_tiles == 4  # 8 tile rows: the largest divisor <= 3
    with pytest.raises(ag_plan.PlanError, match="gemm_sms"):
        ag_plan.ag_plan(128, 64, 256, 2, False, AgGemmConfig(), 0)


def test_padding_round_trip():
    # Rows: each shard padded to 128 rows and 8 columns, N to block_n; unpad restores every shard.
    p = ag_fused.AgPadding(2, 77, 60, 130, 128, 64, 256, gather_k=False)
    x = np.arange(77 * 60, dtype=np.float32).reshape(77, 60)
    w = np.ones((60, 130), np.float32)
    xp, wp = ag_fused.pad_operands(x, w, p, xp=np)
    assert xp.shape == (128, 64) and wp.shape == (64, 256) and xp[:77, :60].tolist() == x.tolist()
    y = np.zeros((2 * 128, 256), np.float32)
    y[:77, :130], y[128:205, :130] = 1, 2
    g = np.zeros((2, 128, 64), np.float32)
    yu, gu = ag_fused.unpad(y, g, p)
    assert yu.shape == (154, 130) and (yu[:77] == 1).all() and (yu[77:] == 2).all() and gu.shape == (2, 77, 60)
    # Contraction: w [W * cols, N] padded slice by slice, so slice s starts at row s * cols_pad.
    p = ag_fused.AgPadding(2, 100, 60, 128, 128, 64, 128, gather_k=True)
    w = np.concatenate([np.full((60, 128), 1.0), np.full((60, 128), 2.0)]).astype(np.float32)
    _, wp = ag_fused.pad_operands(np.zeros((100, 60), np.float32), w, p, xp=np)
    assert wp.shape == (128, 128) and (wp[:60] == 1).all() and (wp[60:64] == 0).all() and (wp[64:124] == 2).all()


def test_numpy_integer_gather_dimension_is_accepted():
    # As gemm_rs takes a NumPy integer scatter_dimension, ag_gemm takes one for gather_dimension.
    mesh = make_mesh((2,), ("tp",))
    x, w = random_inputs(3, (8, 4), (4, 6), jnp.float32)
    in_specs, out_spec = layout_specs(2, 0)
    y, _, _ = shard_call(lambda x, w: ag_gemm(x, w, axis_name="tp", gather_dimension=np.int64(0)), mesh, (x, w),
                         in_specs, out_spec)
    assert rel_err(y, np.asarray(x) @ np.asarray(w)) <= TOL[jnp.float32]


def test_gemm_sms_error_says_which_gpu_it_assumed():
    # Without a GPU the limit comes from an assumed 132-SM Hopper, and the message says so.
    if _extension.gpu_sm_count():
        pytest.skip("a GPU is visible: the message names it")
    mesh = make_mesh((2,), ("tp",))
    x, w = random_inputs(4, (8, 4), (4, 6), jnp.bfloat16)
    in_specs, out_spec = layout_specs(2, 0)
    with pytest.raises(ValueError, match=r"at most 131 on a 132-SM Hopper GPU \(no GPU seen here\), got 100000"):
        shard_call(lambda x, w: ag_gemm(x, w, axis_name="tp", config=AgGemmConfig(gemm_sms=100000)), mesh, (x, w),
                   in_specs, out_spec)


def test_push_and_grids_resolved_per_shard(monkeypatch):
    # push="auto": the SM push up to the crossover's shard size, the copy engines above it; the GEMM
    # takes every SM the push leaves (132-SM GPU assumed without one).
    monkeypatch.setattr(_extension, "sm_count", lambda: 132)
    small, large = 1 << 20, 64 << 20
    assert ag_fused.launch_sms(AgGemmConfig(), small) == (132 - 16, 16)
    assert ag_fused.launch_sms(AgGemmConfig(), large) == (131, 0)
    assert ag_fused.launch_sms(AgGemmConfig(push="ce"), small) == (131, 0)
    assert ag_fused.launch_sms(AgGemmConfig(push="sm", push_sms=4), large) == (128, 4)
    # A user's GEMM grid that leaves the SM push no room keeps the copy engines.
    assert ag_fused.launch_sms(AgGemmConfig(gemm_sms=130), small) == (130, 0)
    assert ag_fused.launch_sms(AgGemmConfig(gemm_sms=100), small) == (100, 16)
    # The kernels read the resolved grids, never `push`.
    attrs = AgGemmConfig(push="sm").kernel_attributes(116, 16)
    assert "push" not in attrs and "path" not in attrs and (attrs["gemm_sms"], attrs["push_sms"]) == (116, 16)


def test_sm_push_must_leave_its_sms():
    if _extension.gpu_sm_count():
        pytest.skip("a GPU is visible: the message names it")
    mesh = make_mesh((2,), ("tp",))
    x, w = random_inputs(4, (8, 4), (4, 6), jnp.bfloat16)
    in_specs, out_spec = layout_specs(2, 0)
    with pytest.raises(ValueError, match=r"leave the SM push its 16 SMs: at most 116 on a 132-SM Hopper GPU"):
        shard_call(lambda x, w: ag_gemm(x, w, axis_name="tp", config=AgGemmConfig(gemm_sms=120, push="sm")), mesh,
                   (x, w), in_specs, out_spec)


def test_plan_sizes_the_sm_push():
    if _extension.module()[0] is None:
        pytest.skip("the plan is the compiled extension's (pure-Python install)")
    # 128 x 1024 bf16 in one chunk: 16384 vectors, 32 per thread of one CTA: the grid is the budget.
    plan = ag_plan.ag_plan(128, 1024, 256, 2, False, AgGemmConfig(), 116, 16)
    assert (plan.push_grid, plan.sms_needed) == (16, min(plan.grid, 116) + 16)
    # A tiny shard gives one CTA per peer something to copy, no more.
    plan = ag_plan.ag_plan(128, 8, 256, 4, False, AgGemmConfig(), 116, 16)
    assert plan.push_grid == 3
    # The copy engines: no push grid, one SM for the releases.
    plan = ag_plan.ag_plan(128, 1024, 256, 2, False, AgGemmConfig(), 131, 0)
    assert plan.push_grid == 0 and plan.sms_needed == plan.grid + 1
