# Inputs a user can pass to gemm_rs and ag_gemm beyond the common shapes, on fake CPU devices (the XLA
# reference path): each checked against float64 NumPy (values and gradients) or for a ValueError that
# names the argument. Rank-1 x, empty outputs, an odd axis size with rank-4 operands and middle dims,
# the gathered operand's own cotangent, a repeated axis name, FP8 weights of a group that are
# already quantised, FP8 scales and dtype arguments that cannot work, FP8 gradients over a middle dim,
# and a scanned, rematerialised two-layer block on a dp x tp mesh.
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from entwine_jax import ag_gemm, fp8, gemm_rs

from test_gemm_rs import make_mesh, rel_err

E5M2 = jnp.float8_e5m2
F32_TOL = 1e-5  # float32 operands, fp32 accumulation: rounding of sums of a few dozen terms
BF16_TOL = 1e-2  # one rounding to bf16 (2^-9), with margin
FP8_TOL = 0.1  # e4m3 operands (3 mantissa bits) and e5m2 cotangents (2) against unquantised float64


def f64(v):
    return np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)


def normal(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def spec(ndim, axis, name="tp"):
    """A PartitionSpec sharding dim `axis` of an array of rank `ndim` over `name`."""
    s = [None] * ndim
    s[axis] = name
    return P(*s)


def value_and_grads(fn, args, in_specs, out_spec, c, world, check_vma=True):
    """(y, grads of sum(y * c) wrt every arg): fn under jit(shard_map) on a `world`-device mesh, c (the
    global cotangent) placed as y is."""
    mesh = make_mesh((world,), ("tp",))
    f = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)

    def loss(*a):
        *a, c = a
        return jnp.sum(f(*a).astype(jnp.float32) * c)

    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, s) for a, s in zip(args + (c,), in_specs + (out_spec,))]
        y = jax.jit(f)(*placed[:-1])
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*placed)
    return y, grads


def trace(fn, *args, world=4):
    """Trace fn under shard_map (inputs replicated) without compiling it."""
    mesh = make_mesh((world,), ("tp",))
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False)
    with jax.set_mesh(mesh):
        jax.eval_shape(f, *args)


# --- rank-1 x ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["float32", "fp8", "vmap"])
def test_rank1_x_in_the_contraction_layout_has_gradients(mode):
    # x [K/W] (its one dim is the gathered contraction dim) on W = 3: y = x @ w, dx = w @ c, dw = x c^T.
    # The backward reduce-scatters dx over that dim; the FP8 call and a vmap over rows of a 2-D x (each
    # example rank 1) take the same path.
    world, k, n = 3, 12, 6
    x, w = normal(1, (2, k) if mode == "vmap" else (k,)), normal(2, (k, n))
    c = normal(3, x.shape[:-1] + (n,))
    kwargs = dict(axis_name="tp", gather_dimension=-1)
    if mode == "fp8":
        kwargs.update(x_scale=jnp.float32(4 / 448), w_scale=jnp.float32(4 / 448))
    op = lambda x, w: ag_gemm(x, w, **kwargs)  # noqa: E731
    fn = jax.vmap(op, in_axes=(0, None)) if mode == "vmap" else op
    y, (dx, dw) = value_and_grads(fn, (x, w), (spec(x.ndim, -1), P(None, "tp")), spec(x.ndim, -1), c, world)
    xd, wd, cd = f64(x), f64(w), f64(c)
    tol = FP8_TOL if mode == "fp8" else F32_TOL
    assert y.shape == x.shape[:-1] + (n,) and dx.shape == x.shape and dw.shape == w.shape
    assert rel_err(y, xd @ wd) <= tol
    assert rel_err(dx, cd @ wd.T) <= tol
    assert rel_err(dw, xd.reshape(-1, k).T @ cd.reshape(-1, n)) <= tol


def test_rank1_x_returns_its_gathered_operand_and_checks_its_gather_dimension():
    world = 4
    x, w0, w1 = normal(4, (8,)), normal(5, (8, 8)), normal(6, (8, 4))
    mesh = make_mesh((world,), ("tp",))
    f = jax.jit(jax.shard_map(lambda x, a, b: ag_gemm(x, (a, b), axis_name="tp", return_gathered=True), mesh=mesh,
                              in_specs=(P("tp"), P(None, "tp"), P(None, "tp")),
                              out_specs=((P("tp"), P("tp")), P()), check_vma=False))
    with jax.set_mesh(mesh):
        (y0, y1), g = f(*[jax.device_put(a, s) for a, s in ((x, P("tp")), (w0, P(None, "tp")), (w1, P(None, "tp")))])
    assert y0.shape == (8,) and y1.shape == (4,) and g.shape == (8,)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
    assert rel_err(y0, f64(x) @ f64(w0)) <= F32_TOL and rel_err(y1, f64(x) @ f64(w1)) <= F32_TOL
    # Its only dim is 0 (or -1): anything else is named with x's own shape.
    with pytest.raises(ValueError, match=r"ag_gemm: gather_dimension must be an int in \[-1, 1\) for x of rank 1 "
                                         r"\(shape \(2,\)\), got 1"):
        trace(lambda x, w: ag_gemm(x, w, axis_name="tp", gather_dimension=1), jnp.ones((2,)), jnp.ones((8, 4)))


# --- empty outputs -----------------------------------------------------------------------------------


def _fp8_kwargs(mode, x, w):
    if mode == "tensor":
        return dict(x_scale=jnp.float32(4 / 448), w_scale=jnp.float32(4 / 448))
    if mode == "block":
        return dict(x_scale=fp8.scales_1x128(x), w_scale=fp8.scales_128x128(w))
    return {}


# (op, global x shape, global w shape, x spec, w spec, y spec, the op's dimension argument)
EMPTY = {
    "gemm_rs N=0": (gemm_rs, (8, 16), (16, 0), P(None, "tp"), P("tp", None), P("tp", None), {}),
    "gemm_rs M=0 columns": (gemm_rs, (0, 16), (16, 8), P(None, "tp"), P("tp", None), P(None, "tp"),
                            dict(scatter_dimension=-1)),
    "ag_gemm N=0": (ag_gemm, (8, 16), (16, 0), P("tp", None), P(None, "tp"), P(None, "tp"), {}),
    "ag_gemm N=0 contraction": (ag_gemm, (8, 16), (16, 0), P(None, "tp"), P(None, "tp"), P(None, "tp"),
                                dict(gather_dimension=-1)),
    "ag_gemm M=0 contraction": (ag_gemm, (0, 256), (256, 8), P(None, "tp"), P(None, "tp"), P(None, "tp"),
                                dict(gather_dimension=-1)),
    "ag_gemm M=0 batched contraction": (ag_gemm, (2, 0, 200), (200, 8), P(None, None, "tp"), P(None, "tp"),
                                        P(None, None, "tp"), dict(gather_dimension=-1)),
}


@pytest.mark.parametrize("mode", [None, "tensor", "block"])
@pytest.mark.parametrize("case", EMPTY)
def test_empty_outputs_have_zero_gradients(case, mode):
    # An empty output (N = 0 or no rows) is well defined, and so are its gradients: zeros of the
    # operands' shapes (the backward op would contract or scatter the empty dim; an FP8 cotangent has
    # no current scale).
    op, x_shape, w_shape, x_spec, w_spec, y_spec, dim = EMPTY[case]
    x, w = normal(7, x_shape), normal(8, w_shape)
    y_shape = x_shape[:-1] + (w_shape[1],)

    def fn(x, w):
        return op(x, w, axis_name="tp", **dim, **_fp8_kwargs(mode, x, w))

    y, (dx, dw) = value_and_grads(fn, (x, w), (x_spec, w_spec), y_spec, jnp.zeros(y_shape), 4)
    assert y.shape == y_shape
    assert dx.shape == x_shape and dw.shape == w_shape and dx.dtype == dw.dtype == jnp.float32
    assert not np.asarray(dx).any() and not np.asarray(dw).any()


def test_empty_output_keeps_the_gathered_operands_cotangent():
    # ag_gemm with N = 0 and return_gathered: loss = psum(sum(g * d)) over W ranks, g the whole x on
    # each: dx = W * d.
    world = 4
    x, w, d = normal(9, (8, 6)), jnp.zeros((6, 0)), normal(10, (8, 6))
    mesh = make_mesh((world,), ("tp",))

    def loss(x, w, d):
        y, g = ag_gemm(x, w, axis_name="tp", return_gathered=True)
        return jax.lax.psum(jnp.sum(g * d) + jnp.sum(y), "tp")

    f = jax.shard_map(loss, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P()), out_specs=P())
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, s) for a, s in ((x, P("tp", None)), (w, P(None, "tp")), (d, P()))]
        dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(*args)
    assert dw.shape == (6, 0)
    assert rel_err(dx, world * f64(d)) <= F32_TOL


# --- the gathered operand's cotangent ----------------------------------------------------------------


@pytest.mark.parametrize("grouped", [False, True])
def test_gathered_operand_cotangent_over_a_middle_dim(grouped):
    # x [2, 8, 6] gathered over dim 1 on W = 4, y_i = x @ w_i, g (the gathered x, whole on each rank).
    # loss = psum(sum_i sum(y_i * c_i) + sum(g * d)): dx = sum_i c_i @ w_i^T + W * d, dw_i = x^T c_i.
    world = 4
    x, d = normal(11, (2, 8, 6)), normal(12, (2, 8, 6))
    ws = [normal(13, (6, 8)), normal(14, (6, 4))][:2 if grouped else 1]
    cs = [normal(15 + i, (2, 8, w.shape[1])) for i, w in enumerate(ws)]
    mesh = make_mesh((world,), ("tp",))

    def loss(x, d, *wc):
        ws, cs = wc[:len(wc) // 2], wc[len(wc) // 2:]
        ys, g = ag_gemm(x, tuple(ws) if grouped else ws[0], axis_name="tp", gather_dimension=1, return_gathered=True)
        ys = ys if grouped else (ys,)
        return jax.lax.psum(sum(jnp.sum(y * c) for y, c in zip(ys, cs)) + jnp.sum(g * d), "tp")

    specs = (P(None, "tp", None), P()) + (P(None, "tp"),) * len(ws) + (P(None, None, "tp"),) * len(cs)
    f = jax.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=P())
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, s) for a, s in zip([x, d] + ws + cs, specs)]
        grads = jax.jit(jax.grad(f, argnums=(0,) + tuple(range(2, 2 + len(ws)))))(*args)
    xd = f64(x)
    assert rel_err(grads[0], sum(f64(c) @ f64(w).T for c, w in zip(cs, ws)) + world * f64(d)) <= F32_TOL
    for dw, c in zip(grads[1:], cs):
        assert rel_err(dw, np.einsum("bsk,bsn->kn", xd, f64(c))) <= F32_TOL


# --- an odd axis size, rank-4 operands, middle dims --------------------------------------------------


@pytest.mark.parametrize("op,dim", [(gemm_rs, -2), (gemm_rs, 1), (ag_gemm, -3), (ag_gemm, 2)])
def test_rank4_middle_dims_on_three_devices(op, dim):
    # W = 3. gemm_rs: x [2, 3, 6, 24] with K sharded, the output scattered over a middle dim (both
    # signs); ag_gemm: x [2, 6, 3, 8] / [2, 3, 6, 8] gathered over a middle dim. Values and the
    # gradients of sum(y * c) against float64.
    world = 3
    if op is gemm_rs:
        x_shape, w_shape = ((2, 6, 6, 24) if dim == 1 else (2, 3, 6, 24)), (24, 5)
        x_spec, w_spec = spec(4, -1), P("tp", None)
        y_spec = spec(4, dim)
        kwargs = dict(scatter_dimension=dim)
    else:
        x_shape, w_shape = ((2, 6, 3, 8) if dim == -3 else (2, 3, 6, 8)), (8, 6)
        x_spec, w_spec, y_spec = spec(4, dim), P(None, "tp"), spec(4, -1)
        kwargs = dict(gather_dimension=dim)
    x, w = normal(20, x_shape), normal(21, w_shape)
    c = normal(22, x_shape[:-1] + (w_shape[1],))
    y, (dx, dw) = value_and_grads(lambda x, w: op(x, w, axis_name="tp", **kwargs), (x, w), (x_spec, w_spec), y_spec,
                                  c, world)
    xd, wd, cd = f64(x), f64(w), f64(c)
    assert rel_err(y, xd @ wd) <= F32_TOL
    assert rel_err(dx, cd @ wd.T) <= F32_TOL
    assert rel_err(dw, np.einsum("abck,abcn->kn", xd, cd)) <= F32_TOL


def test_ag_gemm_of_a_replicated_x_differentiates_like_all_gather():
    # x replicated over tp (not varying): each rank gathers W copies, y = [x; x; x; x] @ w. Its
    # gradient sums the W copies' cotangents over the ranks: dx = sum_r c_r @ w^T.
    world = 4
    x, w, c = normal(23, (2, 6)), normal(24, (6, 8)), normal(25, (8, 8))
    y, (dx, dw) = value_and_grads(lambda x, w: ag_gemm(x, w, axis_name="tp"), (x, w), (P(), P(None, "tp")),
                                  P(None, "tp"), c, world)
    xd, wd, cd = f64(x), f64(w), f64(c)
    stacked = np.tile(xd, (world, 1))
    assert rel_err(y, stacked @ wd) <= F32_TOL
    assert rel_err(dx, sum(np.split(cd @ wd.T, world))) <= F32_TOL
    assert rel_err(dw, stacked.T @ cd) <= F32_TOL


def test_scanned_checkpointed_layers_on_a_dp_tp_mesh():
    # Two sequence-parallel layers h <- tanh(ag_gemm(h, a)) @ b (gemm_rs), under lax.scan and
    # jax.checkpoint on a 2 x 4 (dp, tp) mesh: values and gradients against float64 by hand.
    mesh = make_mesh((2, 4), ("dp", "tp"))
    x = normal(30, (4, 8, 6))
    a, b = normal(31, (2, 6, 8), 0.5), normal(32, (2, 8, 6), 0.5)

    def layer(h, ab):
        h = ag_gemm(h, ab[0], axis_name="tp", gather_dimension=1)
        return gemm_rs(jnp.tanh(h), ab[1], axis_name="tp", scatter_dimension=1), None

    def model(x, a, b):
        return jax.lax.scan(jax.checkpoint(layer), x, (a, b))[0]

    specs = (P("dp", "tp", None), P(None, None, "tp"), P(None, "tp", None))
    f = jax.shard_map(model, mesh=mesh, in_specs=specs, out_specs=P("dp", "tp", None))
    with jax.set_mesh(mesh):
        args = [jax.device_put(v, s) for v, s in zip((x, a, b), specs)]
        y = jax.jit(f)(*args)
        dx, da, db = jax.jit(jax.grad(lambda *v: jnp.sum(jnp.sin(f(*v))), argnums=(0, 1, 2)))(*args)
    hs, ts = [f64(x)], []
    for i in range(2):
        ts.append(np.tanh(hs[-1] @ f64(a[i])))
        hs.append(ts[-1] @ f64(b[i]))
    assert rel_err(y, hs[-1]) <= F32_TOL
    g, dA, dB = np.cos(hs[-1]), [None, None], [None, None]
    for i in (1, 0):
        dB[i] = np.einsum("bsk,bsn->kn", ts[i], g)
        dh = (g @ f64(b[i]).T) * (1 - ts[i] ** 2)
        dA[i] = np.einsum("bsk,bsn->kn", hs[i], dh)
        g = dh @ f64(a[i]).T
    assert rel_err(dx, g) <= 1e-4
    assert rel_err(da, np.stack(dA)) <= 1e-4 and rel_err(db, np.stack(dB)) <= 1e-4


# --- axis names --------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [gemm_rs, ag_gemm])
@pytest.mark.parametrize("axis_name", [("tp", "tp"), ["tp", "tp"]])
def test_a_repeated_axis_name_is_a_value_error(op, axis_name):
    # A collective over a repeated axis makes XLA abort the process when it compiles: refused at trace
    # time instead.
    with pytest.raises(ValueError, match=rf"{op.__name__}: axis_name must name each mesh axis once, got "
                                         rf"\[?\(?'tp', 'tp'\)?\]?"):
        trace(lambda x, w: op(x, w, axis_name=axis_name), jnp.ones((32, 8)), jnp.ones((8, 32)))


# --- FP8 arguments -----------------------------------------------------------------------------------


def test_a_group_of_fp8_weights_is_a_constant_to_differentiation():
    # x and a group of weights quantised by the caller (fp8.quantize, which JAX differentiates): the
    # FP8 operands are constants, so every gradient through them is zero, as for one weight.
    world, s = 2, jnp.float32(4 / 448)
    x, w0, w1 = normal(40, (8, 32)), normal(41, (32, 16)), normal(42, (32, 8))
    mesh = make_mesh((world,), ("tp",))

    def loss(x, a, b):
        ys = ag_gemm(fp8.quantize(x, s), (fp8.quantize(a, s), fp8.quantize(b, s)), axis_name="tp", x_scale=s,
                     w_scale=s)
        return jax.lax.psum(sum(jnp.sum(y.astype(jnp.float32)) for y in ys), "tp")

    specs = (P("tp", None), P(None, "tp"), P(None, "tp"))
    f = jax.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=P())
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*[jax.device_put(a, p) for a, p in zip((x, w0, w1), specs)])
    assert [g.shape for g in grads] == [(8, 32), (32, 16), (32, 8)]
    assert not any(np.asarray(g).any() for g in grads)


S = jnp.float32(4 / 448)
X16, W16 = normal(43, (8, 16)), normal(44, (16, 8))


@pytest.mark.parametrize("op,kwargs,match", [
    (gemm_rs, dict(x_scale=jnp.float32(0.0), w_scale=S), r"x_scale must be finite and > 0 .*got 0.0\b"),
    (gemm_rs, dict(x_scale=-S, w_scale=S), r"x_scale must be finite and > 0 .*got -0.0089"),
    (ag_gemm, dict(x_scale=S, w_scale=jnp.full((1,), np.nan, jnp.float32)), r"w_scale must be finite and > 0 .*got nan"),
    (gemm_rs, dict(x_scale=S, w_scale=S, grad_scale=jnp.float32(np.inf)), r"grad_scale must be finite and > 0 .*got inf"),
    (ag_gemm, dict(x_scale=jnp.ones((8, 1), jnp.float32), w_scale=jnp.asarray([[1.0]], jnp.float32).at[0, 0].set(0.0)),
     r"w_scale must be finite and > 0 .*got 0.0 at index \(0, 0\)"),
    (ag_gemm, dict(x_scale=jnp.ones((8, 1), jnp.float32).at[5, 0].set(np.inf), w_scale=jnp.ones((1, 1), jnp.float32)),
     r"x_scale must be finite and > 0 .*got inf at index \(5, 0\)"),
])
def test_fp8_scales_must_be_finite_and_positive(op, kwargs, match):
    # A zero scale zeroes the output (its operand quantises to +-448, then times 0), NaN or infinity
    # make it NaN: a ValueError naming the scale where its value is known when the call is traced.
    with pytest.raises(ValueError, match=f"{op.__name__}: " + match):
        trace(lambda x, w: op(x, w, axis_name="tp", **kwargs), X16, W16)


def test_a_group_block_scale_is_named_by_its_weight():
    bad = (jnp.ones((1, 1), jnp.float32), jnp.zeros((1, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"ag_gemm: w_scale\[1\] must be finite and > 0 .*got 0.0 at index \(0, 0\)"):
        trace(lambda x, w: ag_gemm(x, (w, w), axis_name="tp", x_scale=jnp.ones((8, 1), jnp.float32), w_scale=bad),
              X16, W16)


def test_traced_zero_scale_is_caught_under_the_debug_flag(monkeypatch):
    # A scale computed in the program (e.g. a delayed-scaling state initialised to zeros) is only known
    # when it runs: ENTWINE_CHECK_FP8_SCALES=1 checks it there.
    monkeypatch.setenv("ENTWINE_CHECK_FP8_SCALES", "1")
    mesh = make_mesh((4,), ("tp",))
    f = jax.jit(jax.shard_map(lambda x, w, s: gemm_rs(x, w, axis_name="tp", x_scale=s, w_scale=fp8.current_scale(w)),
                              mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P()), out_specs=P("tp", None)))
    with jax.set_mesh(mesh):
        args = [jax.device_put(X16, P(None, "tp")), jax.device_put(W16, P("tp", None))]
        jax.block_until_ready(f(*args, jnp.float32(0.01)))  # a good scale runs
        with pytest.raises(Exception, match=r"gemm_rs: x_scale must be finite and > 0 .*got 0.0"):
            jax.block_until_ready(f(*args, jnp.float32(0.0)))
        # A good scale runs again after the failed call, and its effects replace the failed call's on
        # JAX's runtime token (which JAX would otherwise raise again when the interpreter exits).
        jax.block_until_ready(f(*args, jnp.float32(0.01)))
        jax.effects_barrier()


@pytest.mark.parametrize("kwargs,match", [
    (dict(out_dtype="bogus"), r"gemm_rs: out_dtype must be bfloat16 or float16, got 'bogus'"),
    (dict(out_dtype=jnp.float32), r"gemm_rs: out_dtype must be bfloat16 or float16, got float32"),
    (dict(grad_dtype="bfloat15"), r"gemm_rs: grad_dtype must be float8_e5m2 \(the hybrid recipe\), bfloat16 or "
                                  r"float16, got 'bfloat15'"),
])
def test_fp8_dtype_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        trace(lambda x, w: gemm_rs(x, w, axis_name="tp", x_scale=S, w_scale=S, **kwargs), X16, W16)


@pytest.mark.parametrize("mode", ["tensor", "block"])
@pytest.mark.parametrize("op", [gemm_rs, ag_gemm])
def test_fp8_gradients_over_a_middle_dim(op, mode):
    # x [4, 6, 320] scattered (gemm_rs) or gathered (ag_gemm) over dim 1 on W = 2, each rank quantising
    # its own shard (per tensor: x's current scale with a given grad_scale; block: its current 1x128
    # and 128x128 scales, dy per 1x128 tile). In float64 of the dequantised shards X, Wt, C: y = X Wt,
    # dx = C Wt^T, dw = X^T C.
    world, k, n = 2, 320, 272
    x, w, c = normal(50, (4, 6, k)), normal(51, (k, n), 0.1), normal(52, (4, 6, n))
    gs = jnp.float32(2.0 ** -12)
    x_axis, w_axis, y_axis = (2, 0, 1) if op is gemm_rs else (1, 1, 2)
    dim = dict(scatter_dimension=1) if op is gemm_rs else dict(gather_dimension=1)

    def fn(x, w):
        if mode == "block":
            return op(x, w, axis_name="tp", x_scale=fp8.scales_1x128(x), w_scale=fp8.scales_128x128(w), **dim)
        return op(x, w, axis_name="tp", x_scale=fp8.current_scale(x), w_scale=fp8.current_scale(w), grad_scale=gs,
                  **dim)

    y, (dx, dw) = value_and_grads(fn, (x, w), (spec(3, x_axis), spec(2, w_axis)), spec(3, y_axis), c, world)

    def dequantised(v, axis, quantise):
        return np.concatenate([f64(fp8.dequantize(*quantise(p))) for p in jnp.split(v, world, axis=axis)], axis=axis)

    if mode == "block":
        xq = dequantised(x, x_axis, fp8.quantize_1x128)
        wq = dequantised(w, w_axis, fp8.quantize_128x128)
        cq = dequantised(c.astype(jnp.bfloat16), y_axis, lambda v: fp8.quantize_1x128(v, E5M2))
    else:
        per_tensor = lambda v: (fp8.quantize(v, fp8.current_scale(v)), fp8.current_scale(v))  # noqa: E731
        xq, wq = dequantised(x, x_axis, per_tensor), dequantised(w, w_axis, per_tensor)
        cq = f64(fp8.quantize(c.astype(jnp.bfloat16), gs, E5M2)) * float(gs)
    assert rel_err(y, xq @ wq) <= BF16_TOL  # y in bf16
    assert rel_err(dx, cq @ wq.T) <= BF16_TOL  # dx written in bf16 by the backward op
    assert rel_err(dw, np.einsum("abk,abn->kn", xq, cq)) <= 1e-5  # an fp32 dot of FP8 values
