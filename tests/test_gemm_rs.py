# gemm_rs values and gradients on fake CPU devices (the XLA reference path): a hand-computable
# case, seeded random cases over 1/2/4/8-device and dp x tp meshes, every dtype and scatter dim,
# jit and eager, and gradients (check_grads and against the reference's autodiff).
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from entwine_jax import gemm_rs

# Max error relative to the largest |reference| entry, per dtype: fp32 accumulation then one
# rounding to the output dtype (bf16 2^-9, fp16 2^-11), with margin.
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}


def make_mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])


def shard_call(fn, mesh, args, in_specs, out_specs, *, jit=True, check_vma=True):
    """Run fn under jax.shard_map on mesh with args placed per in_specs; returns (global out, f)."""
    f = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    if jit:
        f = jax.jit(f)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, s) for a, s in zip(args, in_specs)]
        return f(*placed), f, placed


def rel_err(y, ref):
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    return np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)


def random_inputs(seed, x_shape, w_shape, dtype):
    kx, kw = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, x_shape, jnp.float32).astype(dtype),
            jax.random.normal(kw, w_shape, jnp.float32).astype(dtype))


def specs_1d(x_ndim, sd):
    """x: K sharded; w: K sharded; output: scatter dim sharded (so the global output is x @ w)."""
    out = [None] * x_ndim
    out[sd] = "tp"
    return (P(*([None] * (x_ndim - 1) + ["tp"])), P("tp", None)), P(*out)


def test_hand_computed():
    # x[i, j] = i, w = 1, K = 8: y[i, n] = 8 i; rank r keeps rows 2r, 2r+1.
    mesh = make_mesh((4,), ("tp",))
    x = jnp.broadcast_to(jnp.arange(8, dtype=jnp.bfloat16)[:, None], (8, 8))
    w = jnp.ones((8, 3), jnp.bfloat16)
    in_specs, out_spec = specs_1d(2, 0)
    y, _, _ = shard_call(lambda x, w: gemm_rs(x, w, axis_name="tp"), mesh, (x, w), in_specs, out_spec)
    expected = np.array([[0] * 3, [8] * 3, [16] * 3, [24] * 3, [32] * 3, [40] * 3, [48] * 3, [56] * 3])
    assert y.dtype == jnp.bfloat16 and y.shape == (8, 3)
    np.testing.assert_array_equal(np.asarray(y, np.float32), expected)
    # Each device holds its own 2 rows.
    assert {s.data.shape for s in y.addressable_shards} == {(2, 3)}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_random_2d(world, dtype, jit):
    mesh = make_mesh((world,), ("tp",))
    x, w = random_inputs(world, (16 * world, 32 * world), (32 * world, 48), dtype)
    in_specs, out_spec = specs_1d(2, 0)
    y, _, _ = shard_call(lambda x, w: gemm_rs(x, w, axis_name="tp"), mesh, (x, w), in_specs, out_spec, jit=jit)
    assert y.dtype == dtype and y.shape == (16 * world, 48)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert rel_err(y, exact) <= TOL[dtype]
    # Same as the plain psum_scatter(x @ w) the op stands for (that one rounds in dtype, so 2x).
    plain = lambda x, w: jax.lax.psum_scatter(x @ w, "tp", scatter_dimension=0, tiled=True)
    y_plain, _, _ = shard_call(plain, mesh, (x, w), in_specs, out_spec, jit=jit)
    assert rel_err(y, y_plain) <= 2 * TOL[dtype]


# (x shape builder from world, scatter_dimension)
CASES = {
    "2d-sd0": (lambda W: (8 * W, 16 * W), 0),
    "2d-sd-1": (lambda W: (8, 16 * W), -1),
    "3d-sd0": (lambda W: (2 * W, 4, 16 * W), 0),
    "3d-sd1": (lambda W: (3, 4 * W, 16 * W), 1),
    "3d-sd-1": (lambda W: (2, 3, 16 * W), -1),
    "4d-sd2": (lambda W: (2, 3, W, 8 * W), -2),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", [2, 8])
def test_shapes_and_scatter_dims(world, case, dtype):
    x_shape_fn, sd = CASES[case]
    x_shape = x_shape_fn(world)
    n = 8 * world  # divisible by world, for the scatter over N
    mesh = make_mesh((world,), ("tp",))
    x, w = random_inputs(len(x_shape) + world, x_shape, (x_shape[-1], n), dtype)
    in_specs, out_spec = specs_1d(len(x_shape), sd)
    fn = lambda x, w: gemm_rs(x, w, axis_name="tp", scatter_dimension=sd)
    y, _, _ = shard_call(fn, mesh, (x, w), in_specs, out_spec)
    assert y.dtype == dtype and y.shape == x_shape[:-1] + (n,)
    exact = np.einsum("...k,kn->...n", np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert rel_err(y, exact) <= TOL[dtype]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_dp_tp_mesh(jit):
    # dp=2 splits the batch (rows); gemm_rs reduces over tp=4 only and scatters within each dp group.
    mesh = make_mesh((2, 4), ("dp", "tp"))
    x, w = random_inputs(7, (4, 16, 64), (64, 24), jnp.bfloat16)
    fn = lambda x, w: gemm_rs(x, w, axis_name="tp", scatter_dimension=1)
    y, _, _ = shard_call(fn, mesh, (x, w), (P("dp", None, "tp"), P("tp", None)), P("dp", "tp", None), jit=jit)
    exact = np.einsum("bsk,kn->bsn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert rel_err(y, exact) <= TOL[jnp.bfloat16]
    # 2-D x, rows split over dp then scattered over tp: global row blocks in (dp, tp) order.
    x2, _ = random_inputs(8, (64, 64), (64, 24), jnp.bfloat16)
    y2, _, _ = shard_call(lambda x, w: gemm_rs(x, w, axis_name="tp"), mesh, (x2, w),
                          (P("dp", "tp"), P("tp", None)), P(("dp", "tp"), None), jit=jit)
    assert rel_err(y2, np.asarray(x2, np.float64) @ np.asarray(w, np.float64)) <= TOL[jnp.bfloat16]


def test_deterministic():
    mesh = make_mesh((4,), ("tp",))
    x, w = random_inputs(3, (64, 128), (128, 32), jnp.bfloat16)
    in_specs, out_spec = specs_1d(2, 0)
    y1, f, placed = shard_call(lambda x, w: gemm_rs(x, w, axis_name="tp"), mesh, (x, w), in_specs, out_spec)
    with jax.set_mesh(mesh):
        y2 = f(*placed)
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y2, np.float32))


# ---- gradients ----

GRAD_CASES = {
    # name: (mesh shape, mesh names, x shape, w shape, x spec, w spec, out spec, scatter_dimension)
    "2d": ((4,), ("tp",), (16, 32), (32, 8), P(None, "tp"), P("tp", None), P("tp", None), 0),
    "3d-sd1": ((4,), ("tp",), (2, 8, 32), (32, 8), P(None, None, "tp"), P("tp", None), P(None, "tp", None), 1),
    "3d-sd-1": ((2,), ("tp",), (2, 4, 16), (16, 8), P(None, None, "tp"), P("tp", None), P(None, None, "tp"), -1),
    "dp-tp": ((2, 4), ("dp", "tp"), (16, 32), (32, 8), P("dp", "tp"), P("tp", None), P(("dp", "tp"), None), 0),
    # x replicated over tp (not varying): its cotangent needs the psum the reference's AD inserts.
    "x-replicated": ((4,), ("tp",), (16, 32), (32, 8), P(), P(None, "tp"), P("tp", None), 0),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_check_grads(case):
    mshape, names, xs, ws, xspec, wspec, ospec, sd = GRAD_CASES[case]
    mesh = make_mesh(mshape, names)
    x, w = random_inputs(11, xs, ws, jnp.float32)
    fn = lambda x, w: gemm_rs(x, w, axis_name="tp", scatter_dimension=sd)
    _, f, placed = shard_call(fn, mesh, (x, w), (xspec, wspec), ospec)
    # check_grads perturbs with unplaced numpy arrays: place them again inside.
    g = jax.jit(lambda x, w: f(jax.reshard(x, xspec), jax.reshard(w, wspec)))
    # gemm_rs is bilinear, so central differences are exact for any eps; a large eps keeps fp32
    # rounding (~1e-7 |f| / eps) far below check_grads' tolerance.
    with jax.set_mesh(mesh):
        check_grads(g, placed, order=1, modes=["rev"], eps=1e-1)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_grads_match_reference(case, dtype, check_vma):
    mshape, names, xs, ws, xspec, wspec, ospec, sd = GRAD_CASES[case]
    mesh = make_mesh(mshape, names)
    x, w = random_inputs(12, xs, ws, dtype)

    def loss(fn):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(xspec, wspec), out_specs=ospec, check_vma=check_vma))
        # A fixed, non-uniform cotangent: sum(y * c).
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * jnp.cos(jnp.arange(f(x, w).size)).reshape(-1)
                                    .reshape(f(x, w).shape))

    ours = lambda x, w: gemm_rs(x, w, axis_name="tp", scatter_dimension=sd)
    # The reference in fp32 (what the op's fp32 accumulation stands for).
    ref = lambda x, w: jax.lax.psum_scatter(
        jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w.astype(jnp.float32)), "tp",
        scatter_dimension=sd, tiled=True)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, xspec), jax.device_put(w, wspec)]
        gx, gw = jax.grad(loss(ours), argnums=(0, 1))(*placed)
        rx, rw = jax.grad(loss(ref), argnums=(0, 1))(*placed)
    assert gx.dtype == dtype and gw.dtype == dtype
    assert rel_err(gx, rx) <= TOL[dtype] and rel_err(gw, rw) <= TOL[dtype]



def test_empty_n():
    # N = 0 is well defined (an empty output); empty K or scattered dims are ValueErrors (test_errors).
    mesh = make_mesh((2,), ("tp",))
    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 0), jnp.bfloat16)
    in_specs, out_spec = specs_1d(2, 0)
    y, _, _ = shard_call(lambda x, w: gemm_rs(x, w, axis_name="tp"), mesh, (x, w), in_specs, out_spec)
    assert y.shape == (8, 0) and y.dtype == jnp.bfloat16


def test_tuple_axis_name():
    # Reduce-scatter over both axes of a 2x4 mesh at once (world 8), with gradients.
    mesh = make_mesh((2, 4), ("dp", "tp"))
    x, w = random_inputs(5, (32, 64), (64, 8), jnp.float32)
    specs = dict(mesh=mesh, in_specs=(P(None, ("dp", "tp")), P(("dp", "tp"), None)), out_specs=P(("dp", "tp"), None))
    ours = jax.jit(jax.shard_map(lambda x, w: gemm_rs(x, w, axis_name=("dp", "tp")), **specs))
    plain = jax.jit(jax.shard_map(lambda x, w: jax.lax.psum_scatter(x @ w, ("dp", "tp"), tiled=True), **specs))
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, specs["in_specs"][0]), jax.device_put(w, specs["in_specs"][1])]
        y = ours(*placed)
        g = jax.grad(lambda x, w: jnp.sum(jnp.sin(ours(x, w))), argnums=(0, 1))(*placed)
        r = jax.grad(lambda x, w: jnp.sum(jnp.sin(plain(x, w))), argnums=(0, 1))(*placed)
    assert rel_err(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64)) <= TOL[jnp.float32]
    assert rel_err(g[0], r[0]) <= TOL[jnp.float32] and rel_err(g[1], r[1]) <= TOL[jnp.float32]


@pytest.mark.parametrize("shared_w", [False, True], ids=["w-batched", "w-shared"])
def test_vmap(shared_w):
    # jax.vmap over a leading batch dim: element b is psum_scatter(x[b] @ w[b]), with gradients.
    mesh = make_mesh((4,), ("tp",))
    x, w = random_inputs(6, (3, 32, 64), (64, 8) if shared_w else (3, 64, 8), jnp.float32)
    w_spec = P("tp", None) if shared_w else P(None, "tp", None)
    specs = dict(mesh=mesh, in_specs=(P(None, None, "tp"), w_spec), out_specs=P(None, "tp", None))
    in_axes = (0, None if shared_w else 0)
    ours = jax.jit(jax.shard_map(jax.vmap(lambda x, w: gemm_rs(x, w, axis_name="tp"), in_axes=in_axes), **specs))
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, specs["in_specs"][0]), jax.device_put(w, specs["in_specs"][1])]
        y = ours(*placed)
        g = jax.grad(lambda x, w: jnp.sum(jnp.sin(ours(x, w))), argnums=(0, 1))(*placed)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = x64 @ w64  # [3, 32, 8], batched or broadcast w
    assert y.shape == (3, 32, 8) and rel_err(y, ref) <= TOL[jnp.float32]
    # d/dx sum(sin(x @ w)) = cos(x @ w) @ w^T; d/dw = sum over the batch (if shared) of x^T cos(x @ w).
    c = np.cos(ref)
    gx = c @ np.swapaxes(w64, -1, -2)
    gw = np.swapaxes(x64, -1, -2) @ c
    assert rel_err(g[0], gx) <= 1e-4 and rel_err(g[1], gw.sum(0) if shared_w else gw) <= 1e-4
