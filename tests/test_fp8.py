# FP8 calls of gemm_rs and ag_gemm on fake CPU devices (the XLA reference path): values against a float64
# computation on the dequantised operands (both layouts, tails, a middle dim, per-rank and shared scales,
# the grouped ag_gemm), the FP8 pairing's gradients (e5m2 cotangents with their own scales, or bf16),
# the bad inputs, and the FP8 fused call as the FFI contract has it (traced, and its reasons without the
# FP8 kernels).
import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from entwine_jax import AgGemmConfig, _extension, _log, ag_gemm, callsite, comm, fp8, gemm_rs
from entwine_jax.ag_gemm import fused as ag_fused
from entwine_jax.ag_gemm import plan as ag_plan
from entwine_jax.gemm_rs import fused as rs_fused
from entwine_jax.gemm_rs import plan as rs_plan
from entwine_jax.gemm_rs.config import GemmRsConfig

from test_fused_cpu import FakeExt
from test_gemm_rs import make_mesh, rel_err

W = 4
BF16_TOL = 1e-2  # fp32 accumulation, one rounding to bf16 (2^-9), with margin
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def run(fn, args, in_specs, out_specs, world=W):
    mesh = make_mesh((world,), ("tp",))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    with jax.set_mesh(mesh):
        return f(*[jax.device_put(a, s) for a, s in zip(args, in_specs)])


def grads(loss, args, specs, argnums):
    """jit(grad(loss)) on args placed with their specs on a W-device mesh."""
    with jax.set_mesh(make_mesh((W,), ("tp",))):
        placed = [jax.device_put(a, spec) for a, spec in zip(args, specs)]
        return jax.jit(jax.grad(loss, argnums=argnums))(*placed)


def f64(v):
    return np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)


def quantized(seed, shape):
    """An e4m3 array of normal values of this shape, quantised with its current scale, and that scale."""
    v = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    scale = fp8.current_scale(v)
    return fp8.quantize(v, scale), scale


def per_rank(seed, n=W):
    """One float32 scale per rank, far apart (a wrong pairing of blocks and scales shows), of the size of
    a current scale of normal values (fp16 outputs stay finite)."""
    return jnp.asarray(np.random.default_rng(seed).uniform(0.05, 4.0, n) / 448, jnp.float32)


# --- values -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape,n,sd", [
    ((64, 128), 96, 0),       # rows
    ((20, 12), 12, 0),        # tails: 5 rows and 3 contraction columns per rank
    ((16, 48), 40, -1),       # columns (the hidden dim)
    ((2, 8, 24), 16, 1),      # a middle dim
])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_gemm_rs_matches_float64(x_shape, n, sd, out_dtype):
    # Each rank's partial carries its own x_scale and w_scale: K slice r of x and w scaled by rank r's.
    x8, _ = quantized(1, x_shape)
    w8, _ = quantized(2, (x_shape[-1], n))
    xs, ws = per_rank(3), per_rank(4)
    k_local = x_shape[-1] // W
    x_spec = P(*([None] * (len(x_shape) - 1)), "tp")
    out = [None] * len(x_shape)
    out[sd] = "tp"

    def body(x, w, xs, ws):
        return gemm_rs(x, w, axis_name="tp", scatter_dimension=sd, x_scale=xs, w_scale=ws, out_dtype=out_dtype)

    y = run(body, (x8, w8, xs, ws), (x_spec, P("tp", None), P("tp"), P("tp")), P(*out))
    xd, wd = f64(x8), f64(w8)
    ref = sum((xd[..., r * k_local:(r + 1) * k_local] * float(xs[r]))
              @ (wd[r * k_local:(r + 1) * k_local] * float(ws[r])) for r in range(W))
    assert y.dtype == out_dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= BF16_TOL


@pytest.mark.parametrize("x_shape,n,gd", [
    ((64, 32), 64, 0),        # rows
    ((20, 10), 24, 0),        # tails
    ((2, 12, 16), 8, 1),      # a middle dim
    ((16, 64), 48, -1),       # the contraction dim (w holds all of K)
    ((12, 20), 8, -1),        # contraction tails: 5 columns per rank
])
@pytest.mark.parametrize("shared", [False, True])
def test_ag_gemm_matches_float64(x_shape, n, gd, shared):
    # Per-rank x_scale: each gathered block (rows, or a K slice) is scaled by its source's scale.
    # A replicated x_scale is shared: one scale for all of the gathered x.
    x8, _ = quantized(5, x_shape)
    w8, ws = quantized(6, (x_shape[-1], n))
    xs = per_rank(7)[:1].reshape(()) if shared else per_rank(7)
    ndim = len(x_shape)
    x_spec = [None] * ndim
    x_spec[gd] = "tp"
    out = [None] * ndim
    out[-1] = "tp"

    def body(x, w, xs, ws):
        y, g = ag_gemm(x, w, axis_name="tp", gather_dimension=gd, x_scale=xs, w_scale=ws, return_gathered=True)
        return y, g[None]

    xs_spec = P() if shared else P("tp")
    g_spec = P("tp", *([None] * ndim))  # every rank's gathered copy
    y, g = run(body, (x8, w8, xs, ws), (P(*x_spec), P(None, "tp"), xs_spec, P()), (P(*out), g_spec))
    xd = f64(x8)
    d = x_shape[gd] // W
    blocks = np.split(xd, W, axis=gd)
    scaled = np.concatenate([b * float(xs if shared else xs[r]) for r, b in enumerate(blocks)], axis=gd)
    ref = scaled @ (f64(w8) * float(ws))
    assert y.dtype == jnp.bfloat16 and y.shape == ref.shape and d > 0
    assert rel_err(y, ref) <= BF16_TOL
    # The gathered operand is FP8, all of x on every rank.
    assert g.dtype == E4M3
    for copy in g:
        np.testing.assert_array_equal(f64(copy), xd)


def test_shared_scale_is_seen_in_the_types(capsys, monkeypatch):
    # Replicated over tp (shard_map's types say so): shared; each rank's own: not shared.
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    x8, _ = quantized(8, (32, 16))
    w8, ws = quantized(9, (16, 32))
    for xs, spec, shared in ((jnp.float32(0.5), P(), True), (per_rank(10), P("tp"), False)):
        run(lambda x, w, xs, ws: ag_gemm(x, w, axis_name="tp", x_scale=xs, w_scale=ws),
            (x8, w8, xs, ws), (P("tp", None), P(None, "tp"), spec, P()), P(None, "tp"))
        assert f"shared_scale={shared}" in capsys.readouterr().err


def test_grouped_ag_gemm():
    # q/k/v-like weights of unequal widths sharing one w_scale, one gather of x.
    x8, _ = quantized(11, (16, 32))
    ws_ = [quantized(12 + i, (32, n))[0] for i, n in enumerate((32, 8, 8))]
    xs, w_scale = per_rank(15), jnp.float32(0.25)

    def body(x, xs, ws, *weights):
        return ag_gemm(x, weights, axis_name="tp", x_scale=xs, w_scale=ws)

    ys = run(body, (x8, xs, w_scale, *ws_), (P("tp", None), P("tp"), P()) + (P(None, "tp"),) * 3,
             (P(None, "tp"),) * 3)
    rows = np.split(f64(x8), W)
    xd = np.concatenate([b * float(xs[r]) for r, b in enumerate(rows)])
    for y, w in zip(ys, ws_):
        assert rel_err(y, xd @ (f64(w) * 0.25)) <= BF16_TOL


def test_high_precision_operands_are_quantised_by_the_op():
    # bf16 operands with scales: the op quantises them (clip(v / scale)), as quantize() does.
    x = jax.random.normal(jax.random.key(16), (32, 64), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(17), (64, 24), jnp.float32).astype(jnp.bfloat16)
    xs, ws = jnp.float32(0.005), jnp.float32(0.02)  # x's scale small: its largest values clip at 448

    y = run(lambda x, w: gemm_rs(x, w, axis_name="tp", x_scale=xs, w_scale=ws), (x, w),
            (P(None, "tp"), P("tp", None)), P("tp", None))
    ref = (f64(fp8.quantize(x, xs)) * 0.005) @ (f64(fp8.quantize(w, ws)) * 0.02)
    assert y.dtype == jnp.bfloat16 and rel_err(y, ref) <= BF16_TOL
    assert np.abs(f64(fp8.quantize(x, xs))).max() == 448.0


def test_current_scale_of_nothing_is_one():
    # An empty operand (no tokens, N = 0) has no amax: any scale represents it, as for zeros.
    for v in (jnp.zeros((0, 256)), jnp.zeros((256, 0), jnp.bfloat16), jnp.zeros((4, 4))):
        for dtype in (E4M3, E5M2):
            assert float(fp8.current_scale(v, dtype)) == 1.0
            assert float(jax.jit(fp8.current_scale, static_argnums=1)(v, dtype)) == 1.0


def test_axis_of_size_one():
    x8, xs = quantized(18, (8, 16))
    w8, ws = quantized(19, (16, 8))
    y = run(lambda x, w: gemm_rs(x, w, axis_name="tp", x_scale=xs, w_scale=ws), (x8, w8),
            (P(None, "tp"), P("tp", None)), P("tp", None), world=1)
    assert rel_err(y, (f64(x8) * float(xs)) @ (f64(w8) * float(ws))) <= BF16_TOL


# --- gradients ----------------------------------------------------------------------------------------


def _dequantized_e5m2(v, scale):
    return f64(fp8.quantize(jnp.asarray(v), jnp.float32(scale), E5M2)) * float(scale)


@pytest.mark.parametrize("sd", [0, -1])
def test_gemm_rs_fp8_gradients_exact(sd):
    # grad_scale given: dy in e5m2 with that scale; dx = all_gather(dy) @ w.T and dw = x.T @ all_gather(dy)
    # on the dequantised FP8 values, checked in float64.
    x = jax.random.normal(jax.random.key(20), (32, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(21), (64, 48), jnp.float32)
    c = jax.random.normal(jax.random.key(22), (32, 48), jnp.float32).astype(jnp.bfloat16)
    xs, ws, gs = fp8.current_scale(x), fp8.current_scale(w), jnp.float32(2.0 ** -14)
    out = [None, None]
    out[sd] = "tp"

    def loss(x, w, c):
        def body(x, w):
            return gemm_rs(x, w, axis_name="tp", scatter_dimension=sd, x_scale=xs, w_scale=ws, grad_scale=gs)
        y = jax.shard_map(body, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(*out))(x, w)
        return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32))

    dx, dw = grads(loss, (x, w, c), (P(None, "tp"), P("tp", None), P()), (0, 1))
    g = _dequantized_e5m2(c, gs)
    xd = f64(fp8.quantize(x, xs)) * float(xs)
    wd = f64(fp8.quantize(w, ws)) * float(ws)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32  # the operands' dtypes
    assert rel_err(dx, g @ wd.T) <= BF16_TOL
    assert rel_err(dw, xd.T @ g) <= 1e-5  # fp32 dot of FP8 values, no rounding to bf16


def _spy_plans(monkeypatch, name: str) -> list:
    """The keyword arguments of every plan() of op `name` from now on (the registry's spec swapped)."""
    from entwine_jax import registry
    seen, spec = [], registry.OPS[name]

    def plan(*args, **kwargs):
        seen.append(kwargs)
        return spec.plan(*args, **kwargs)
    monkeypatch.setitem(registry.OPS, name, dataclasses.replace(spec, plan=plan))
    return seen


def test_gemm_rs_fp8_last_dim_backward_shares_its_grad_scale(monkeypatch):
    # A scatter over the last dimension: the backward gathers dy over its contracted dimension, where
    # the kernels run faster with one scale on every rank. The default grad scale is then the largest
    # current scale over the axis (here the current scale of the whole cotangent), and the backward's
    # plan is told it is shared.
    x = jax.random.normal(jax.random.key(30), (32, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(31), (64, 48), jnp.float32)
    c = jax.random.normal(jax.random.key(32), (32, 48), jnp.float32)
    c = (c * jnp.repeat(jnp.asarray([1.0, 8.0, 0.1, 3.0]), 12)[None, :]).astype(jnp.bfloat16)
    xs, ws = fp8.current_scale(x), fp8.current_scale(w)
    backward_plans = _spy_plans(monkeypatch, "ag_gemm")

    def loss(x, w, c):
        def body(x, w):
            return gemm_rs(x, w, axis_name="tp", scatter_dimension=-1, x_scale=xs, w_scale=ws)
        y = jax.shard_map(body, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(None, "tp"))(x, w)
        return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32))

    dx, dw = grads(loss, (x, w, c), (P(None, "tp"), P("tp", None), P()), (0, 1))
    assert [p.get("shared_scale") for p in backward_plans] == [True]
    g = _dequantized_e5m2(c, fp8.current_scale(c, E5M2))
    wd = f64(fp8.quantize(w, ws)) * float(ws)
    xd = f64(fp8.quantize(x, xs)) * float(xs)
    assert rel_err(dx, g @ wd.T) <= BF16_TOL
    assert rel_err(dw, xd.T @ g) <= 1e-5


def test_hidden_gather_layer_current_scaling_shares_the_x_scale(monkeypatch):
    # fp8="current" on a column-parallel layer gathering the hidden (contracted) dimension: one x scale
    # over the axis, so the op's plan is told the scale is shared (the kernels' faster loop there);
    # the rows layout keeps each rank's own scale.
    from entwine_jax import layers
    x = jax.random.normal(jax.random.key(33), (16, 64), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(jax.random.key(34), (64, 32), jnp.float32).astype(jnp.bfloat16)
    for gather, x_spec, expected in (("hidden", P(None, "tp"), True), ("rows", P("tp", None), False)):
        plans = _spy_plans(monkeypatch, "ag_gemm")
        run(lambda x, k: layers.column_parallel_linear(x, k, axis_name="tp", gather=gather, fp8="current"),
            (x, k), (x_spec, P(None, "tp")), P(None, "tp"))
        assert [p.get("shared_scale") for p in plans] == [expected], gather


@pytest.mark.parametrize("gd", [0, -1])
def test_ag_gemm_fp8_gradients_exact(gd):
    # Per-rank x_scale (each shard's own current scale): dw sums each source's block with its scale.
    x = jax.random.normal(jax.random.key(23), (32, 64), jnp.float32)
    x = x * jnp.repeat(jnp.asarray([1.0, 8.0, 0.1, 3.0]), 8 if gd == 0 else 16, axis=gd)[
        (slice(None), None) if gd == 0 else (None, slice(None))]
    w = jax.random.normal(jax.random.key(24), (64, 48), jnp.float32)
    c = jax.random.normal(jax.random.key(25), (32, 48), jnp.float32).astype(jnp.bfloat16)
    ws, gs = fp8.current_scale(w), jnp.float32(2.0 ** -14)
    x_spec = P("tp", None) if gd == 0 else P(None, "tp")

    def loss(x, w, c):
        def body(x, w):
            return ag_gemm(x, w, axis_name="tp", gather_dimension=gd, x_scale=fp8.current_scale(x), w_scale=ws,
                           grad_scale=gs)
        y = jax.shard_map(body, in_specs=(x_spec, P(None, "tp")), out_specs=P(None, "tp"))(x, w)
        return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32))

    dx, dw = grads(loss, (x, w, c), (x_spec, P(None, "tp"), P()), (0, 1))
    blocks = np.split(f64(x), W, axis=gd)
    xd = np.concatenate([f64(fp8.quantize(jnp.asarray(b), fp8.current_scale(jnp.asarray(b)))) *
                         float(fp8.current_scale(jnp.asarray(b))) for b in blocks], axis=gd)
    wd = f64(fp8.quantize(w, ws)) * float(ws)
    g = _dequantized_e5m2(c, gs)
    assert rel_err(dx, g @ wd.T) <= BF16_TOL
    assert rel_err(dw, xd.T @ g) <= 1e-5


@pytest.mark.parametrize("grad_dtype", [None, jnp.bfloat16])
def test_gradients_near_the_high_precision_ones(grad_dtype):
    # A sequence-parallel block ag_gemm -> gemm_rs in FP8, current scaling throughout: gradients within
    # FP8's precision of float32 autodiff (e5m2 dy: 2 mantissa bits; bf16 dy: the e4m3 operands only).
    x = jax.random.normal(jax.random.key(26), (32, 64), jnp.float32)
    w1 = jax.random.normal(jax.random.key(27), (64, 96), jnp.float32) / 8
    w2 = jax.random.normal(jax.random.key(28), (96, 64), jnp.float32) / 8

    def block(x, w1, w2):
        h = ag_gemm(x, w1, axis_name="tp", x_scale=fp8.current_scale(x), w_scale=fp8.current_scale(w1),
                    grad_dtype=grad_dtype)
        h = jnp.tanh(h.astype(jnp.float32))
        return gemm_rs(h, w2, axis_name="tp", x_scale=fp8.current_scale(h), w_scale=fp8.current_scale(w2),
                       grad_dtype=grad_dtype)

    def loss(x, w1, w2):
        y = jax.shard_map(block, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P("tp", None))(
            x, w1, w2)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    def exact(x, w1, w2):
        return jnp.sum(jnp.sin(jnp.tanh(x @ w1) @ w2))

    got_grads = grads(loss, (x, w1, w2), (P("tp", None), P(None, "tp"), P("tp", None)), (0, 1, 2))
    want = jax.grad(exact, argnums=(0, 1, 2))(np.asarray(x), np.asarray(w1), np.asarray(w2))
    tol = 0.15 if grad_dtype is None else 0.08
    for got, ref in zip(got_grads, want):
        err = np.linalg.norm(f64(got) - f64(ref)) / np.linalg.norm(f64(ref))
        assert got.dtype == jnp.float32 and err <= tol, err


def test_fp8_operands_are_constants_to_differentiation():
    # Quantised operands carry no gradient (zero cotangents in their own dtype), as in Flax's recipe.
    x8, xs = quantized(29, (16, 32))
    w8, ws = quantized(30, (32, 16))

    def loss(x8, w8):
        y = jax.shard_map(lambda x, w: gemm_rs(x, w, axis_name="tp", x_scale=xs, w_scale=ws),
                          in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))(x8, w8)
        return jnp.sum(y.astype(jnp.float32))

    dx, dw = grads(loss, (x8, w8), (P(None, "tp"), P("tp", None)), (0, 1))
    assert dx.dtype == E4M3 and dw.dtype == E4M3
    assert not np.any(f64(dx)) and not np.any(f64(dw))


# --- bad input ----------------------------------------------------------------------------------------


def _trace(op, x, w, **kwargs):
    mesh = make_mesh((W,), ("tp",))
    f = jax.shard_map(lambda x, w: op(x, w, axis_name="tp", **kwargs), mesh=mesh, in_specs=(P(), P()),
                      out_specs=P(), check_vma=False)
    with jax.set_mesh(mesh):
        jax.eval_shape(f, x, w)


S = jnp.float32(1.0)
X8, W8 = jnp.ones((8, 16), E4M3), jnp.ones((16, 8), E4M3)


@pytest.mark.parametrize("op", [gemm_rs, ag_gemm])
@pytest.mark.parametrize("x,w,kwargs,match", [
    (X8, W8, dict(), r"an FP8 call .* needs both x_scale and w_scale, got x_scale=None and w_scale=None"),
    (X8, W8, dict(x_scale=S), r"an FP8 call .* needs both x_scale and w_scale, got x_scale=an array and w_scale=None"),
    (X8.astype(jnp.bfloat16), W8.astype(jnp.bfloat16), dict(out_dtype=jnp.bfloat16), r"an FP8 call .* needs both x_scale"),
    (X8, W8, dict(x_scale=jnp.float16(1), w_scale=S), r"x_scale must be a float32 scalar array .*got float16\[\]"),
    (X8, W8, dict(x_scale=S, w_scale=jnp.ones((2,))), r"w_scale must be a float32 scalar array .*got float32\[2\]"),
    (X8, W8, dict(x_scale=1.0, w_scale=S), r"x_scale must be a float32 scalar array .*got float"),
    (X8.astype(E5M2), W8, dict(x_scale=S, w_scale=S), r"x is float8_e5m2, the FP8 forward takes float8_e4m3fn"),
    (X8, W8.astype(E5M2), dict(x_scale=S, w_scale=S), r"w is float8_e5m2"),
    (X8.astype(E5M2), W8.astype(E5M2), dict(x_scale=S, w_scale=S), r"x is float8_e5m2, the FP8 forward takes"),
    (X8, W8.astype(jnp.bfloat16), dict(x_scale=S, w_scale=S),
     r"mixed FP8 and high-precision operands \(x float8_e4m3fn, w bfloat16\)"),
    (X8.astype(jnp.int8), W8, dict(x_scale=S, w_scale=S), r"x.dtype must be float8_e4m3fn .* got int8"),
    (X8, W8, dict(x_scale=S, w_scale=S, out_dtype=jnp.float32), r"out_dtype must be bfloat16 or float16, got float32"),
    (X8, W8, dict(x_scale=S, w_scale=S, grad_dtype=jnp.float8_e4m3fn), r"grad_dtype must be float8_e5m2 .*got float8_e4m3fn"),
    (X8, W8, dict(x_scale=S, w_scale=S, grad_dtype=jnp.bfloat16, grad_scale=S),
     r"grad_scale scales float8_e5m2 gradients; grad_dtype is bfloat16"),
])
def test_bad_fp8_input(op, x, w, kwargs, match):
    name = op.__name__
    with pytest.raises(ValueError, match=f"{name}: " + match):
        _trace(op, x, w, **kwargs)


def test_group_shares_one_w_scale():
    with pytest.raises(ValueError, match=r"ag_gemm: a tuple w_scale gives each weight of a group its 128x128 block "
                                         r"scales; per-tensor scaling takes one float32 scalar shared by the group"):
        _trace(lambda x, w, **k: ag_gemm(x, (w, w), **k), X8, W8, x_scale=S, w_scale=(S, S))
    with pytest.raises(ValueError, match=r"ag_gemm: the weights of a group must share one dtype"):
        _trace(lambda x, w, **k: ag_gemm(x, (w, w.astype(jnp.bfloat16)), **k), X8, W8, x_scale=S, w_scale=S)


def test_bf16_calls_are_unchanged_by_the_fp8_arguments():
    # No FP8 operand and no FP8 argument: the bf16 op, its dtype rules included.
    with pytest.raises(ValueError, match=r"gemm_rs: w.dtype must equal x.dtype \(bfloat16\), got float16"):
        _trace(gemm_rs, jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.float16))


# --- the fused call (the FFI contract), off-GPU -------------------------------------------------------


def test_reason_without_fp8_kernels(monkeypatch):
    # An extension without FP8 targets (or without the extension): the FP8 call takes the XLA path and
    # says why.
    class NoFp8:
        GEMM_RS_FP8_TARGET, AG_GEMM_FP8_TARGET = "entwine_gemm_rs_fp8", "entwine_ag_gemm_fp8"

        @staticmethod
        def fp8_targets():
            return []

    monkeypatch.setattr(_extension, "module", lambda: (NoFp8, None))
    assert "FP8 kernels not built" in rs_plan.fp8_reason()
    assert "FP8 kernels not built" in ag_plan.fp8_reason()
    with pytest.raises(_extension.NoExtension, match="FP8 kernels not built"):
        rs_plan.gemm_rs_plan(256, 256, 64, 2, GemmRsConfig(), fp8=True)
    NoFp8.fp8_targets = staticmethod(lambda: ["entwine_gemm_rs_fp8", "entwine_ag_gemm_fp8"])
    NoFp8.gemm_rs_fp8_plan = NoFp8.ag_gemm_fp8_plan = object()
    assert rs_plan.fp8_reason() is None and ag_plan.fp8_reason() is None
    assert rs_plan.fp8_target() == "entwine_gemm_rs_fp8" and ag_plan.fp8_target() == "entwine_ag_gemm_fp8"


def test_fp8_heuristics_take_128_wide_blocks():
    # The FP8 kernels' plan takes block_n 128 only; bf16 keeps 256 where N allows it.
    from entwine_jax import ag_heuristic_config, heuristic_config
    assert heuristic_config(4096, 8192, 1024, 2, E4M3).block_n == 128
    assert heuristic_config(4096, 8192, 1024, 2, jnp.bfloat16).block_n == 256
    assert ag_heuristic_config(1024, 8192, 1024, 2, E4M3).block_n == 128
    assert ag_heuristic_config(1024, 8192, 1024, 2, jnp.bfloat16).block_n == 256


def test_fused_reasons_name_the_fp8_dtypes():
    # x in e4m3 (the forward) or e5m2 (the backward's gradient), the weight in e4m3 only.
    assert callsite.kernel_dtype_reason(E5M2, E4M3, jnp.bfloat16) is None
    for x, w in ((E5M2, E5M2), (E4M3, E5M2), (jnp.int8, E4M3)):
        reason = callsite.kernel_dtype_reason(x, w, jnp.bfloat16)
        assert reason == (f"the FP8 kernels take x in float8_e4m3fn or float8_e5m2 and w in float8_e4m3fn, got "
                          f"{jnp.dtype(x).name} and {jnp.dtype(w).name}")
    assert "write bf16 or fp16" in callsite.kernel_dtype_reason(E4M3, E4M3, jnp.float32)
    assert "write bf16 or fp16" in callsite.kernel_dtype_reason(E5M2, E4M3, jnp.float32)
    assert callsite.kernel_dtype_reason(E4M3, E4M3, jnp.float16) is None
    assert "bf16 or fp16 operands" in callsite.kernel_dtype_reason(E4M3, E4M3)  # a bf16 call with FP8 operands


def test_cpu_reason_for_an_fp8_call(caplog):
    x8, xs = quantized(31, (32, 64))
    w8, ws = quantized(32, (64, 32))
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        run(lambda x, w: gemm_rs(x, w, axis_name="tp", x_scale=xs, w_scale=ws), (x8, w8),
            (P(None, "tp"), P("tp", None)), P("tp", None))
    msgs = [r.getMessage() for r in caplog.records if "XLA reference path" in r.getMessage()]
    assert len(msgs) == 1 and "out_dtype=bfloat16" in msgs[0]


def _custom_calls(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name == "ffi_call"]


def test_gemm_rs_fp8_call_as_the_ffi_contract_says():
    # x [M, K] e4m3 padded, the weight transposed [N, K], two f32[1] scales; y in the output dtype.
    plan = rs_plan.GemmRsPlan(world=2, m=200, k=40, n=96, scatter_cols=False, mp=100, mp_pad=128, k_pad=48,
                              n_pad=128, tiles_per_partition=1, m_blocks=1, n_blocks=1, raster_rows=1, num_blocks=2,
                              grid=2, k_tiles=1, split_first_block=2, split=False, slot_bytes=0)
    site = rs_fused.GemmRsCall(plan=plan, comm_id=3, config=GemmRsConfig(), target="entwine_gemm_rs_fp8",
                               out_dtype="float16")
    x8, w8 = jnp.ones((200, 40), E4M3), jnp.ones((40, 96), E4M3)
    jaxpr = jax.make_jaxpr(lambda x, w: rs_fused.call_fp8(x, w, S, S, site))(x8, w8)
    eqn, = _custom_calls(jaxpr.jaxpr)
    assert eqn.params["target_name"] == "entwine_gemm_rs_fp8"
    assert [(v.aval.shape, v.aval.dtype) for v in eqn.invars] == [
        ((256, 48), E4M3), ((128, 48), E4M3), ((1,), jnp.float32), ((1,), jnp.float32)]
    assert [(a.shape, a.dtype) for a in eqn.params["result_avals"]] == [((128, 128), jnp.float16)]
    assert jaxpr.out_avals[0].shape == (100, 96)


@pytest.mark.parametrize("gather_k,return_gathered", [(False, True), (True, False)])
def test_ag_gemm_fp8_call_as_the_ffi_contract_says(gather_k, return_gathered):
    # x the shard [rows, cols] e4m3, w transposed [N, W * cols or cols], the scales; results y, the gathered
    # FP8 shards (or empty) and the W sources' scales; attribute shared_scale.
    p = ag_fused.AgPadding(world=2, rows=100, cols=40, n=96, rows_pad=128, cols_pad=48, n_pad=128, gather_k=gather_k)
    site = ag_fused.AgGemmCall(padding=p, gemm_sms=131, push_sms=0, comm_id=1, config=AgGemmConfig(),
                               target="entwine_ag_gemm_fp8", out_dtype="bfloat16")
    k = 2 * 40 if gather_k else 40
    x8, w8 = jnp.ones((100, 40), E4M3), jnp.ones((k, 96), E4M3)
    jaxpr = jax.make_jaxpr(lambda x, w: ag_fused.call_fp8(x, w, S, S, site, return_gathered, True))(x8, w8)
    eqn, = _custom_calls(jaxpr.jaxpr)
    assert [(v.aval.shape, v.aval.dtype) for v in eqn.invars] == [
        ((128, 48), E4M3), ((128, 2 * 48 if gather_k else 48), E4M3), ((1,), jnp.float32), ((1,), jnp.float32)]
    y_rows = 128 if gather_k else 256
    gathered = (2, 128, 48) if return_gathered else (0,)
    assert [(a.shape, a.dtype) for a in eqn.params["result_avals"]] == [
        ((y_rows, 128), jnp.bfloat16), (gathered, E4M3), ((2,), jnp.float32)]
    assert dict(eqn.params["attributes"])["shared_scale"] is True
    shapes = [a.shape for a in jaxpr.out_avals]
    y = (100, 96) if gather_k else (200, 96)
    assert shapes == ([y, (2, 100, 40), (2,)] if return_gathered else [y, (2,)])


def test_fp8_signatures_name_the_call_site(monkeypatch):
    # As for bf16 calls: two FP8 calls of one shape from two lines get two signatures (a swap of them
    # between ranks fails naming both instead of summing silently), the same line traced again the same.
    named = {}
    ext = FakeExt()
    ext.name_call = lambda signature, description: named.__setitem__(signature, description)
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    comm.call_signature.cache_clear()
    plan = rs_plan.GemmRsPlan(world=2, m=200, k=40, n=96, scatter_cols=False, mp=100, mp_pad=128, k_pad=48,
                              n_pad=128, tiles_per_partition=1, m_blocks=1, n_blocks=1, raster_rows=1, num_blocks=2,
                              grid=2, k_tiles=1, split_first_block=2, split=False, slot_bytes=0)
    rs_site = rs_fused.GemmRsCall(plan=plan, comm_id=3, config=GemmRsConfig(), target="entwine_gemm_rs_fp8",
                                  out_dtype="float16")
    p = ag_fused.AgPadding(world=2, rows=100, cols=40, n=96, rows_pad=128, cols_pad=48, n_pad=128, gather_k=False)
    ag_site = ag_fused.AgGemmCall(padding=p, gemm_sms=131, push_sms=0, comm_id=1, config=AgGemmConfig(),
                                  target="entwine_ag_gemm_fp8", out_dtype="bfloat16")

    def rs_a(x, w):
        return rs_fused.call_fp8(x, w, S, S, rs_site)

    def rs_b(x, w):
        return rs_fused.call_fp8(x, w, S, S, rs_site)

    def ag_a(x, w):
        return ag_fused.call_fp8(x, w, S, S, ag_site, False, True)

    def ag_b(x, w):
        return ag_fused.call_fp8(x, w, S, S, ag_site, False, True)

    def signature(body, x_shape):
        eqn, = _custom_calls(jax.make_jaxpr(body)(jnp.ones(x_shape, E4M3), jnp.ones((40, 96), E4M3)).jaxpr)
        return int(dict(eqn.params["attributes"])["signature"])

    for a, b, x_shape in ((rs_a, rs_b, (200, 40)), (ag_a, ag_b, (100, 40))):
        first, second, again = signature(a, x_shape), signature(b, x_shape), signature(a, x_shape)
        assert first != second and first == again
        assert "test_fp8.py" in named[first] and f"({a.__name__})" in named[first]
        assert f"({b.__name__})" in named[second]


# --- the fused FP8 program, lowered for CUDA off-GPU --------------------------------------------------


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused path as on CUDA GPUs, as far as lowering: the fake CPU devices pass for GPUs, the
    communicators are a fake extension's (test_fused_cpu.FakeExt), the plans the built extension's."""
    for reason in (rs_plan.fp8_reason(), ag_plan.fp8_reason()):
        if reason is not None:
            pytest.skip(f"the FP8 plans need the extension with its FP8 kernels: {reason}")
    gpu_side_faked(monkeypatch)


def gpu_side_faked(monkeypatch):
    """The CPU devices pass for GPUs and the communicators are a fake extension's (FakeExt); the plans
    stay the extension's (_extension.module)."""
    ext = FakeExt()
    for name, value in (("_comms", {}), ("_setup_meshes", {}), ("_reason_cache", {}), ("_failed", {}),
                        ("_atexit_registered", True)):
        monkeypatch.setattr(comm, name, value)
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    monkeypatch.setattr(comm, "_check_devices", lambda *a: None)
    monkeypatch.setattr(comm, "platform_reason", lambda axis_name: (None, comm.find_mesh(axis_name), ext))
    monkeypatch.setattr(callsite, "platform_reason", lambda axis_name: None)  # the CPU devices pass for GPUs


def _fp8_calls(text):
    """(target, x's element type) of every FP8 custom call in a lowered module's text."""
    calls = []
    for line in text.splitlines():
        if (m := re.search(r"custom_call @(entwine_\w+_fp8)\(.* : \(tensor<[\dx]*x(\w+)>", line)):
            calls.append(m.groups())
    return calls


def _lowered_block_grads(grad_dtype, block_n=128):
    """The lowered text (for CUDA) of the gradients of an ag_gemm -> gemm_rs block in FP8 on the fused
    path (path "fused": the crossover would send these small shapes to XLA), both configs block_n wide.
    Both backward calls have N a multiple of 256, where a bf16 call's heuristic takes 256-wide blocks
    and FP8 takes 128 only."""
    mesh = make_mesh((W,), ("tp",))

    def block(x, w1, w2):
        h = ag_gemm(x, w1, axis_name="tp", x_scale=fp8.current_scale(x), w_scale=S, grad_dtype=grad_dtype,
                    config=AgGemmConfig(path="fused", block_n=block_n))
        h = jnp.tanh(h.astype(jnp.float32))
        return gemm_rs(h, w2, axis_name="tp", x_scale=fp8.current_scale(h), w_scale=S, grad_dtype=grad_dtype,
                       config=GemmRsConfig(path="fused", block_n=block_n))

    specs = (P("tp", None), P(None, "tp"), P("tp", None))

    def loss(x, w1, w2):
        y = jax.shard_map(block, in_specs=specs, out_specs=P("tp", None))(x, w1, w2)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=jax.sharding.NamedSharding(mesh, spec))
            for shape, spec in zip(((256, 256), (256, 1024), (1024, 256)), specs)]
    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_fp8_backward_lowers_to_the_fused_fp8_calls(fused_on_cpu, caplog):
    # The default grad_dtype (e5m2, the hybrid recipe): the forward's two e4m3 calls and the backward's
    # two e5m2 x e4m3 calls, gemm_rs's dx an ag_gemm and ag_gemm's dx a gemm_rs; no call on the XLA path.
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        text = _lowered_block_grads(grad_dtype=None)
    assert sorted(_fp8_calls(text)) == [("entwine_ag_gemm_fp8", "f8E4M3FN"), ("entwine_ag_gemm_fp8", "f8E5M2"),
                                        ("entwine_gemm_rs_fp8", "f8E4M3FN"), ("entwine_gemm_rs_fp8", "f8E5M2")]
    assert not [r.getMessage() for r in caplog.records if "XLA reference path" in r.getMessage()]
    # The backward ag_gemm returns its gathered e5m2 dy (for dw): [W, rows, cols] of x's type.
    gathered = re.findall(r"custom_call @entwine_ag_gemm_fp8\(.*-> \(tensor<[^>]*>, tensor<([\dx]*)x(\w+)>", text)
    assert sorted(gathered) == [("4x128x256", "f8E4M3FN"), ("4x128x256", "f8E5M2")]


def test_an_fp8_call_runs_128_wide_blocks_whatever_its_config(fused_on_cpu, caplog):
    # A config written for 16-bit operands (AgGemmConfig's default block_n is 256) still runs every FP8
    # call, forward and backward, on the kernels in 128-wide blocks, and each op says so once.
    _log.reset_once()
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        text = _lowered_block_grads(grad_dtype=None, block_n=256)
        _lowered_block_grads(grad_dtype=None, block_n=256)
    assert len(_fp8_calls(text)) == 4
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "XLA reference path" in m]
    told = sorted(m.split(":")[0] for m in messages if "FP8 operands run 128-wide blocks, not config.block_n = 256" in m)
    assert told == ["ag_gemm", "gemm_rs"]
    widths = re.findall(r"custom_call @entwine_\w+_fp8\(.*block_n = (\d+)", text)
    assert widths == ["128"] * 4, widths


def test_hidden_layout_runs_every_fp8_call_on_the_kernels(fused_on_cpu, caplog):
    # The hidden-sharded layout through the layers with fp8="current": ag_gemm gathers over the
    # contracted dimension (x's scale taken over the axis) and gemm_rs scatters its last dimension
    # (its backward gathers dy over the contracted dimension, at a grad scale taken over the axis).
    # The kernels take one scale there, so all four FP8 calls run on them, none on XLA's path.
    from entwine_jax import layers
    mesh = make_mesh((W,), ("tp",))

    def block(x, w1, w2):
        h = layers.column_parallel_linear(x, w1, axis_name="tp", gather="hidden", fp8="current",
                                          config=AgGemmConfig(path="fused", block_n=128))
        h = jnp.tanh(h.astype(jnp.float32)).astype(jnp.bfloat16)
        return layers.row_parallel_linear(h, w2, axis_name="tp", scatter="hidden", fp8="current",
                                          config=GemmRsConfig(path="fused"))

    specs = (P(None, "tp"), P(None, "tp"), P("tp", None))

    def loss(x, w1, w2):
        y = jax.shard_map(block, in_specs=specs, out_specs=P(None, "tp"))(x, w1, w2)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, spec))
            for shape, spec in zip(((256, 1024), (1024, 1024), (1024, 1024)), specs)]
    with caplog.at_level(logging.INFO, logger="entwine_jax"), jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert sorted(_fp8_calls(text)) == [("entwine_ag_gemm_fp8", "f8E4M3FN"), ("entwine_ag_gemm_fp8", "f8E5M2"),
                                        ("entwine_gemm_rs_fp8", "f8E4M3FN"), ("entwine_gemm_rs_fp8", "f8E5M2")]
    assert not [r.getMessage() for r in caplog.records if "XLA reference path" in r.getMessage()]


def test_bf16_backward_runs_on_the_bf16_kernels(fused_on_cpu):
    # grad_dtype bfloat16: the FP8 forward on the FP8 kernels, the backward on the bf16 ones, one call
    # per op, each on the dequantised FP8 operands (no XLA collective left).
    text = _lowered_block_grads(grad_dtype=jnp.bfloat16)
    assert sorted(_fp8_calls(text)) == [("entwine_ag_gemm_fp8", "f8E4M3FN"), ("entwine_gemm_rs_fp8", "f8E4M3FN")]
    assert len(re.findall(r"custom_call @entwine_gemm_rs\(", text)) == 1
    assert len(re.findall(r"custom_call @entwine_ag_gemm\(", text)) == 1
    assert "all_gather" not in text and "reduce_scatter" not in text


def test_dequantize_keeps_the_fp8_rounding_under_jit():
    # quantize then dequantize in one program: XLA may not fold the converts away (allowed excess
    # precision on GPUs) - the result is the FP8 value, not the input.
    v = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)), jnp.float16)
    s = fp8.current_scale(v)
    got = jax.jit(lambda v_, s_: fp8.dequantize(fp8.quantize(v_, s_), s_, jnp.float32))(v, s)
    want = np.clip(np.asarray(v, np.float32) / np.float32(s), -448, 448).astype(jnp.float8_e4m3fn).astype(
        np.float32) * np.float32(s)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert float(np.abs(np.asarray(got) - np.asarray(v, np.float32)).max()) > 0  # the rounding is there


def test_e5m2_times_e5m2_is_refused_by_the_fused_path(fused_on_cpu):
    # The kernels take an e5m2 x with an e4m3 weight only: an e5m2 weight is the XLA path, with the reason.
    mesh = make_mesh((W,), ("tp",))
    x, w = jax.ShapeDtypeStruct((256, 64), E5M2), jax.ShapeDtypeStruct((64, 128), E5M2)
    with jax.set_mesh(mesh):
        rs = rs_fused.unavailable_reason(x, w, axis_name="tp", axis_size=W, scatter_dimension=0,
                                         config=GemmRsConfig(path="fused"), out_dtype="bfloat16")
        ag = ag_fused.unavailable_reason(x, w, axis_name="tp", axis_size=W, gather_k=False,
                                         config=AgGemmConfig(path="fused"), out_dtype="bfloat16")
        e4m3_w = jax.ShapeDtypeStruct((64, 128), E4M3)
        assert rs_fused.unavailable_reason(x, e4m3_w, axis_name="tp", axis_size=W, scatter_dimension=0,
                                           config=GemmRsConfig(path="fused"), out_dtype="bfloat16") is None
    want = ("the FP8 kernels take x in float8_e4m3fn or float8_e5m2 and w in float8_e4m3fn, got float8_e5m2 and "
            "float8_e5m2")
    assert rs == want and ag == want


def test_fp8_plans_take_x_dtype():
    # The FP8 plans of an e5m2 x are the e4m3 ones (one byte each); another x dtype is a ValueError.
    for reason in (rs_plan.fp8_reason(), ag_plan.fp8_reason()):
        if reason is not None:
            pytest.skip(f"the FP8 plans need the extension with its FP8 kernels: {reason}")
    config = GemmRsConfig()
    e4m3 = rs_plan.gemm_rs_plan(256, 256, 200, 2, config, fp8=True)
    e5m2 = rs_plan.gemm_rs_plan(256, 256, 200, 2, config, fp8=True, x_dtype="float8_e5m2")
    assert e5m2 == e4m3 and e5m2.k_pad == 208
    ag_e4m3 = ag_plan.ag_plan(128, 200, 256, 2, False, AgGemmConfig(block_n=128), 100, fp8=True)
    ag_e5m2 = ag_plan.ag_plan(128, 200, 256, 2, False, AgGemmConfig(block_n=128), 100, fp8=True, x_dtype="float8_e5m2")
    assert ag_e5m2 == ag_e4m3 and ag_e5m2.cols_pad == 208
    ext = _extension.ext()
    with pytest.raises(ValueError, match="x_dtype must be float8_e4m3fn or float8_e5m2, got bfloat16"):
        ext.gemm_rs_fp8_plan(256, 256, 200, 2, False, 128, 0, 16, 512, 8, False, x_dtype="bfloat16")
    with pytest.raises(ValueError, match="x_dtype must be float8_e4m3fn or float8_e5m2, got float8_e4m3fnuz"):
        ext.ag_gemm_fp8_plan(128, 200, 256, 2, False, 128, 100, 8, 8, 0, x_dtype="float8_e4m3fnuz")


# --- Scales that zero the output (the reciprocal convention, 448 / amax) ---------------------------------

def _rs_island(mesh, scale):
    # Each rank's scales of its own shards, by `scale` (current scaling, or its reciprocal).
    def f(x, w):
        return gemm_rs(x, w, axis_name="tp", x_scale=scale(x), w_scale=scale(w))
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None),
                                 check_vma=False))


def test_fp8_contraction_plan_takes_per_shard_scales():
    # The contraction layout with per-shard scales runs the per-slice kernels (docs/design.md, "FP8
    # operands"): it plans like a shared scale, with one scale slot per source.
    if (reason := ag_plan.fp8_reason()) is not None:
        pytest.skip(f"the FP8 plans need the extension with its FP8 kernels: {reason}")
    config = AgGemmConfig(block_n=128)
    for world in (2, 3, 4):
        own = ag_plan.ag_plan(128, 256, 256, world, True, config, 100, fp8=True, shared_scale=False)
        shared = ag_plan.ag_plan(128, 256, 256, world, True, config, 100, fp8=True, shared_scale=True)
        assert own.inbox_bytes == shared.inbox_bytes == world * 128 * 256 + world * 16


def test_reciprocal_scales_are_caught_when_concrete():
    # The ops run inside shard_map, where values are traced; concrete values reach the check directly.
    x = jnp.full((8, 16), 0.5, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"gemm_rs: x quantises to FP8 values that all lie below 1 \(largest "
                                         r"\|x / scale\| is 0.000558.*reciprocal convention, 448 / amax"):
        fp8.check_scales("gemm_rs", (("x", x, jnp.float32(448 / 0.5)),))
    fp8.check_scales("gemm_rs", (("x", x, fp8.current_scale(x)),))  # amax / 448: fine
    fp8.check_scales("gemm_rs", (("x", jnp.zeros((4,), jnp.float32), jnp.float32(448.0)),))  # zeros: any scale
    fp8.check_scales("gemm_rs", (("x", fp8.quantize(x, 448.0), jnp.float32(448.0)),))  # already FP8: no evidence


def test_reciprocal_scales_are_caught_under_the_debug_flag(monkeypatch):
    mesh = make_mesh((4,), ("tp",))
    # Small operands (activations and weights of ~0.05): the reciprocal convention zeroes them.
    x = (0.05 * jax.random.normal(jax.random.key(0), (16, 64), jnp.float32)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)).astype(jnp.bfloat16)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(w, jax.sharding.NamedSharding(mesh, P("tp", None)))
    recip = lambda v: 448.0 / jnp.max(jnp.abs(v)).astype(jnp.float32)  # noqa: E731
    # Off by default: the output is silently (nearly) zero.
    good = _rs_island(mesh, fp8.current_scale)(x, w)
    assert float(jnp.max(jnp.abs(_rs_island(mesh, recip)(x, w)))) < 1e-2 * float(jnp.max(jnp.abs(good)))
    monkeypatch.setenv("ENTWINE_CHECK_FP8_SCALES", "1")
    with pytest.raises(Exception, match=r"reciprocal convention, 448 / amax"):
        jax.block_until_ready(_rs_island(mesh, recip)(x, w))
    jax.block_until_ready(_rs_island(mesh, fp8.current_scale)(x, w))


# --- the e4m3 weight's layout: no transposed copy of an e4m3 array -----------------------------------


@pytest.fixture
def fused_stand_in(monkeypatch):
    """Both ops' fused FP8 calls as fused.py builds them (padding, w_t, operand order), with no
    extension: a site made here (shapes that need no padding) and each FFI call replaced by an opaque
    host callback on the same operands, which XLA:CPU must hand over in the layout given (row-major),
    as to the handler. The compiled CPU program then shows what XLA does to the weights per call."""
    def ag_prepare(x2d, w, *, axis_size, gather_k, config, out_dtype=None, **_):
        (rows, cols), n = x2d.shape, w.shape[1]
        padding = ag_fused.AgPadding(axis_size, rows, cols, n, rows, cols, n, gather_k)
        return ag_fused.AgGemmCall(padding, 100, 0, 0, config, "ag_gemm_fp8", out_dtype)

    def rs_prepare(x2d, w, *, axis_size, config, out_dtype=None, **_):
        (m, k), n = x2d.shape, w.shape[1]
        plan = rs_plan.GemmRsPlan(axis_size, m, k, n, False, m // axis_size, m // axis_size, k, n, 1, 1, 1, 1, 1, 1,
                                  1, 1, False, 0)
        return rs_fused.GemmRsCall(plan, 0, config, "gemm_rs_fp8", out_dtype)

    def opaque(target, results, *operands, **attributes):
        return list(jax.pure_callback(lambda *a: tuple(np.zeros(r.shape, r.dtype) for r in results), tuple(results),
                                      *operands))

    from entwine_jax import _ffi
    from entwine_jax.ag_gemm import op as ag_op
    from entwine_jax.gemm_rs import op as rs_op
    for op, prepare, fused in ((ag_op, ag_prepare, ag_fused), (rs_op, rs_prepare, rs_fused)):
        monkeypatch.setattr(op, "fused", dataclasses.make_dataclass("Fused", ())())
        for name, value in (("unavailable_reason", lambda *a, **k: None), ("prepare", prepare),
                            ("call", fused.call), ("call_fp8", fused.call_fp8)):
            setattr(op.fused, name, value)
    monkeypatch.setattr(ag_plan, "max_weights", lambda: 4)
    monkeypatch.setattr(_ffi, "fused_call", opaque)
    monkeypatch.setattr(callsite, "platform_reason", lambda axis_name: None)
    # The fused branch on the CPU devices (lax.platform_dependent would pick the reference there).
    monkeypatch.setattr(callsite, "dispatch", lambda reason, reference, fused, *a: (fused if reason is None
                                                                                    else reference)(*a))


def _e4m3_copies(hlo: str) -> list:
    """The instructions of the optimized program's entry computation that read an e4m3 array and
    write one of as many elements (a copy, transposed or not: a pass over an e4m3 weight that its
    quantisation could have written in the layout it needed)."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[: entry.index("\n}")]
    shapes = dict(re.findall(r"%([\w.-]+) = (f8e4m3fn\[[\d,]*\])", entry))
    copies = []
    for name, shape, operands in re.findall(r"%([\w.-]+) = (f8e4m3fn\[[\d,]*\])\S* \w[\w-]*\(([^)]*)\)", entry):
        size = np.prod([int(d) for d in re.findall(r"\d+", shape)])
        for operand in re.findall(r"%([\w.-]+)", operands):
            if operand in shapes and np.prod([int(d) for d in re.findall(r"\d+", shapes[operand])]) == size:
                copies.append(name)
    return copies


def _compiled_fp8_step(widths, weight_dtype):
    """The optimized CPU program of an FP8 ag_gemm (one weight, or a group of `widths`) on the fused
    path: with high-precision weights its gradients (forward, gemm_rs dx, dw), with e4m3 ones the
    forward (FP8 operands are constants to differentiation)."""
    mesh = make_mesh((W,), ("tp",))
    grouped = len(widths) > 1

    def call(x, *ws):
        return ag_gemm(x, ws if grouped else ws[0], axis_name="tp", x_scale=S, w_scale=S,
                       config=AgGemmConfig(path="fused", block_n=128))

    specs = (P("tp", None),) + (P(None, "tp"),) * len(widths)
    f = jax.shard_map(call, in_specs=specs, out_specs=(P("tp", None),) * len(widths) if grouped else P("tp", None))

    def loss(*a):
        return sum(jnp.sum(y.astype(jnp.float32)) for y in jax.tree.leaves(f(*a)))

    args = [jax.ShapeDtypeStruct(shape, weight_dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
            for shape, spec in zip([(512, 256)] + [(256, W * n) for n in widths], specs)]
    fn = loss if weight_dtype == E4M3 else jax.grad(loss, argnums=tuple(range(len(args))))
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("widths", [(256,), (256, 128)])
def test_the_quantised_weight_is_never_copied_in_e4m3(fused_stand_in, widths):
    # The op quantises a high-precision weight itself: the forward's w_t [N, K] (K-major, as FP8 wgmma
    # reads B) comes from one fusion of the convert and the transpose, and the backward's gemm_rs reads
    # w8.T.T, which cancels: w8 [K, N] straight from the convert. No e4m3 array is copied.
    hlo = _compiled_fp8_step(widths, jnp.bfloat16)
    assert hlo.count(" custom-call(") == 2  # the forward's ag_gemm and the backward's gemm_rs
    assert not _e4m3_copies(hlo)


def test_an_e4m3_weight_is_transposed_once_per_forward(fused_stand_in):
    # A weight passed in e4m3 [K, N] has no quantisation to write it K-major: the forward makes the
    # one transposed copy the FP8 kernels' layout needs (an e4m3 [N, K] weight has no public form).
    hlo = _compiled_fp8_step((256,), E4M3)
    assert len(_e4m3_copies(hlo)) == 1


@pytest.mark.parametrize("fp8_call", [False, True])
@pytest.mark.parametrize("widths,weights", [((1024, 128, 128), 3), ((256, 96, 32), 1)])
def test_a_group_lowers_to_one_call_on_its_weights(fused_on_cpu, fp8_call, widths, weights):
    # With the kernels' plan: a group of whole 128-wide blocks is one ag_gemm call taking each weight
    # (x, w_1 [, the scales], w_2 .. w_G) and returning each output; one with a width that is not takes
    # the weights joined into one operand.
    mesh = make_mesh((W,), ("tp",))
    scales = dict(x_scale=S, w_scale=S) if fp8_call else {}

    def call(x, *ws):
        return ag_gemm(x, ws, axis_name="tp", config=AgGemmConfig(path="fused", block_n=128), **scales)

    specs = (P("tp", None),) + (P(None, "tp"),) * len(widths)
    f = jax.shard_map(call, in_specs=specs, out_specs=(P("tp", None),) * len(widths))
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, spec))
            for shape, spec in zip([(512, 256)] + [(256, W * n) for n in widths], specs)]
    with jax.set_mesh(mesh):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    target = "entwine_ag_gemm_fp8" if fp8_call else "entwine_ag_gemm"
    calls = re.findall(rf"custom_call @{target}\(([^)]*)\).*-> \(([^)]*)\)", text)
    assert len(calls) == 1, text
    operands, results = calls[0]
    fixed = 3 if fp8_call else 1  # x (and the two scales)
    assert len(operands.split(",")) == fixed + weights
    assert len(re.findall(r"tensor<", results)) == (2 if fp8_call else 1) + weights


# --- the reference's FP8 dots keep fp32 sums on a GPU ----------------------------------------------

# Primitives that pass an FP8 value on unchanged up to its layout or type: XLA sees through them when
# it turns a dot of FP8 values into its FP8 GEMM.
_CARRIERS = {"convert_element_type", "optimization_barrier", "transpose", "reshape", "squeeze",
             "expand_dims", "broadcast_in_dim", "slice", "copy", "copy_p"}


def fp8_dot_precisions(jaxpr) -> list:
    """The precision of every dot_general (nested jaxprs too) whose two operands are FP8 values, or
    FP8 values converted, transposed or reshaped (what XLA's GPU compiler runs as an FP8 GEMM)."""
    from jax.extend.core import jaxprs_in_params
    from_fp8, found = set(), []

    def fp8_like(v):
        return not hasattr(v, "val") and (v in from_fp8 or v.aval.dtype in (jnp.dtype(E4M3), jnp.dtype(E5M2)))

    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CARRIERS and any(fp8_like(v) for v in eqn.invars):
            from_fp8.update(eqn.outvars)
        if eqn.primitive.name == "dot_general" and all(fp8_like(v) for v in eqn.invars[:2]):
            found.append(eqn.params["precision"])
        for sub in jaxprs_in_params(eqn.params):
            found += fp8_dot_precisions(sub)
    return found


def assert_fp8_dots_keep_fp32_sums(fn, *args):
    """Every dot of FP8 values in jax.make_jaxpr(fn)(*args) has a precision other than DEFAULT, which
    keeps XLA's GPU FP8 GEMM off cuBLASLt's fast (unpromoted) accumulation; returns how many there are."""
    precisions = fp8_dot_precisions(jax.make_jaxpr(fn)(*args).jaxpr)
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert precisions and all(p == highest for p in precisions), precisions
    return len(precisions)


@pytest.mark.parametrize("op,sd", [("gemm_rs", 0), ("gemm_rs", -1), ("ag_gemm", 0), ("ag_gemm", -1)])
@pytest.mark.parametrize("scales", ["per_rank", "shared"])
def test_reference_fp8_dots_keep_fp32_sums(op, sd, scales):
    # The forward's and the backward's dots of FP8 values on XLA's path (e5m2 dy, e4m3 x and w).
    x = jax.random.normal(jax.random.key(30), (32, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(31), (64, 48), jnp.float32)
    ws = fp8.current_scale(w)
    gs = jnp.float32(2.0 ** -10)
    x_spec = P(None, "tp") if op == "gemm_rs" else P(*(["tp", None] if sd == 0 else [None, "tp"]))
    w_spec = P("tp", None) if op == "gemm_rs" else P(None, "tp")
    out = [None, None]
    out[sd if op == "gemm_rs" else -1] = "tp"

    def loss(x, w):
        def body(x, w):
            xs = fp8.current_scale(x) if scales == "per_rank" else fp8.current_scale(jnp.ones(()))
            if op == "gemm_rs":
                return gemm_rs(x, w, axis_name="tp", scatter_dimension=sd, x_scale=xs, w_scale=ws, grad_scale=gs)
            return ag_gemm(x, w, axis_name="tp", gather_dimension=sd, x_scale=xs, w_scale=ws, grad_scale=gs)
        y = jax.shard_map(body, in_specs=(x_spec, w_spec), out_specs=P(*out))(x, w)
        return jnp.sum(y.astype(jnp.float32))

    with jax.set_mesh(make_mesh((W,), ("tp",))):
        placed = (jax.device_put(x, x_spec), jax.device_put(w, w_spec))
        # Forward, dx's op and dw: at least one dot each.
        assert assert_fp8_dots_keep_fp32_sums(jax.value_and_grad(loss, argnums=(0, 1)), *placed) >= 3
