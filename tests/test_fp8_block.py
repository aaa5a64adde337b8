# Block-scaled FP8 (1x128 tiles of x, 128x128 blocks of w) on fake CPU devices, the XLA reference path:
# the quantisation helpers by hand, both ops and the grouped ag_gemm against the per-block formula in
# float64 (tails, both layouts of ag_gemm, W = 2, 3, 4), gradients against the dequantised-operand
# formula and float64, bad inputs, the mode never falling back to per-tensor scales, and the layers'
# fp8="block".
import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from entwine_jax import AgGemmConfig, _extension, ag_gemm, fp8, gemm_rs, registry
from entwine_jax.ag_gemm import fused as ag_fused
from entwine_jax.ag_gemm import plan as ag_plan
from entwine_jax.comm import Unavailable
from entwine_jax.gemm_rs import fused as rs_fused
from entwine_jax.gemm_rs import plan as rs_plan
from entwine_jax.gemm_rs.config import GemmRsConfig

from test_fp8 import gpu_side_faked
from test_gemm_rs import make_mesh, rel_err

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16_TOL = 1e-2  # fp32 accumulation, one rounding to bf16 (2^-9), with margin
FP8_TOL = 0.1  # the recipe against float64 of the unquantised operands: e4m3 / e5m2 rounding


def run(fn, args, in_specs, out_specs, world):
    mesh = make_mesh((world,), ("tp",))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    with jax.set_mesh(mesh):
        return f(*[jax.device_put(a, s) for a, s in zip(args, in_specs)])


def f64(v):
    return np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)


def normal(seed, shape, scale=1.0):
    # Rows of very different magnitudes: a per-tensor scale would lose the small ones.
    v = np.random.default_rng(seed).normal(size=shape) * scale
    return jnp.asarray(v * np.logspace(-2, 1, shape[0]).reshape((-1,) + (1,) * (len(shape) - 1)), jnp.float32)


def shards(v, world, axis, quantise):
    """v split into `world` shards along `axis`, each quantised on its own (quantise: fp8.quantize_1x128
    or fp8.quantize_128x128), (q, scales) each concatenated back along `axis`: the global arrays whose
    shards are what each rank holds."""
    parts = [quantise(p) for p in jnp.split(v, world, axis=axis)]
    return (jnp.concatenate([q for q, _ in parts], axis=axis), jnp.concatenate([s for _, s in parts], axis=axis))


def formula(x8, xs, w8, ws):
    """sum over k-blocks kb of (x[..., kb] @ w[kb, :]) * xs[..., kb] * ws[kb, nb] in float64, written from
    the recipe (not the library): x [..., K] with xs [..., ceil(K/128)], w [K, N] with ws [ceil(K/128),
    ceil(N/128)]."""
    x, w, xs, ws = f64(x8), f64(w8), np.asarray(xs, np.float64), np.asarray(ws, np.float64)
    k, n = w.shape
    y = 0.0
    for kb in range(-(-k // 128)):
        part = x[..., kb * 128:(kb + 1) * 128] @ w[kb * 128:(kb + 1) * 128]
        y = y + part * xs[..., kb:kb + 1] * np.repeat(ws[kb], 128)[:n]
    return y


def dequantised(v, world, axis, quantise, dtype=E4M3):
    """float64 of v's shards (along axis) quantised each on its own and dequantised, concatenated."""
    parts = [quantise(p, dtype) for p in jnp.split(v, world, axis=axis)]
    return np.concatenate([f64(fp8.dequantize(q, s)) for q, s in parts], axis=axis)


# --- the helpers --------------------------------------------------------------------------------------


def test_block_scales_and_quantisation_by_hand():
    # x [2, 200]: row 0's first tile has amax 448 (scale 1), its partial second tile (72 columns) amax
    # 896 (scale 2); row 1 is zero (scale 1: any scale represents it).
    x = np.zeros((2, 200), np.float32)
    x[0, :128] = np.linspace(-448, 448, 128)
    x[0, 128:] = 896.0
    x[0, 199] = -896.0
    q, s = fp8.quantize_1x128(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(s), [[1.0, 2.0], [1.0, 1.0]])
    assert q.dtype == E4M3 and q.shape == (2, 200)
    np.testing.assert_array_equal(f64(q[0, 128:]), [448.0] * 71 + [-448.0])
    np.testing.assert_allclose(f64(fp8.dequantize(q, s)), x, rtol=2 ** -3)
    # w [130, 129]: four 128x128 blocks, the tails partial; block (1, 0) holds one element.
    w = np.ones((130, 129), np.float32)
    w[129, 5] = -44.8
    w[:128, 128] = 4480.0
    q, s = fp8.quantize_128x128(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(s), [[1 / 448, 10.0], [0.1, 1 / 448]], rtol=1e-6)
    np.testing.assert_allclose(f64(fp8.dequantize(q, s)), w, rtol=2 ** -3)
    assert fp8.scales_1x128(jnp.ones((3, 4, 129))).shape == (3, 4, 2)
    assert fp8.scales_128x128(jnp.zeros((5, 300))).tolist() == [[1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match=r"scales_128x128: w must have rank 2 \(\[K, N\]\), got shape \(2, 3, 4\)"):
        fp8.scales_128x128(jnp.ones((2, 3, 4)))


def test_gemm_rs_by_hand():
    # x8 and w8 all ones; rank r's tile scale of row m is m + 1, its weight's two column blocks r + 1 and
    # 2 (r + 1): y[m, n] = 128 (m + 1) (1 + 2) for n < 128, twice that after. Rows scattered over W = 2.
    world, m = 2, 4
    x8, w8 = jnp.ones((m, 128 * world), E4M3), jnp.ones((128 * world, 256), E4M3)
    xs = jnp.tile(jnp.arange(1.0, m + 1).reshape(m, 1), (1, world))  # [M, W * 1]
    ws = jnp.asarray([[1.0, 2.0], [2.0, 4.0]])  # rank r's row: [r + 1, 2 (r + 1)]

    def body(x, w, xs, ws):
        return gemm_rs(x, w, axis_name="tp", x_scale=xs, w_scale=ws, out_dtype=jnp.float16)

    y = run(body, (x8, w8, xs, ws), (P(None, "tp"), P("tp", None), P(None, "tp"), P("tp", None)),
            P("tp", None), world)
    want = np.concatenate([np.full((m, 128), 384.0), np.full((m, 128), 768.0)], axis=1) * np.arange(1, m + 1)[:, None]
    np.testing.assert_array_equal(np.asarray(y, np.float64), want)


# --- values against the formula -----------------------------------------------------------------------


@pytest.mark.parametrize("x_shape,n,sd,world", [
    ((16, 512), 256, 0, 2),        # rows, whole blocks
    ((42, 600), 300, 0, 3),        # tails: K_local 200, N 300, 14 rows per rank
    ((8, 1024), 384, -1, 4),       # columns (the hidden dim): 96 per rank
    ((2, 12, 512), 130, 1, 4),     # a middle dim
])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_gemm_rs_matches_the_formula(x_shape, n, sd, world, out_dtype):
    # Each rank's partial carries its own block scales (K slice r of x and of w, quantised on rank r).
    x8, xs = shards(normal(1, x_shape), world, -1, fp8.quantize_1x128)
    w8, ws = shards(normal(2, (x_shape[-1], n)), world, 0, fp8.quantize_128x128)
    lead = [None] * (len(x_shape) - 1)
    out = [None] * len(x_shape)
    out[sd] = "tp"

    def body(x, w, xs, ws):
        return gemm_rs(x, w, axis_name="tp", scatter_dimension=sd, x_scale=xs, w_scale=ws, out_dtype=out_dtype)

    specs = (P(*lead, "tp"), P("tp", None), P(*lead, "tp"), P("tp", None))
    y = run(body, (x8, w8, xs, ws), specs, P(*out), world)
    k_local, kb_local = x_shape[-1] // world, xs.shape[-1] // world
    ref = sum(formula(x8[..., r * k_local:(r + 1) * k_local], xs[..., r * kb_local:(r + 1) * kb_local],
                      w8[r * k_local:(r + 1) * k_local], ws[r * kb_local:(r + 1) * kb_local]) for r in range(world))
    assert y.dtype == out_dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= BF16_TOL


@pytest.mark.parametrize("x_shape,n,gd,world", [
    ((32, 256), 512, 0, 2),         # rows
    ((27, 200), 3 * 70, 0, 3),      # tails: 9 rows per rank, K 200, N_local 70
    ((2, 12, 300), 4 * 40, 1, 4),   # a middle dim
    ((16, 4 * 128), 4 * 64, -1, 4),  # the contraction dim, each source's K slice whole tiles
    ((10, 2 * 256), 2 * 130, -1, 2),
])
def test_ag_gemm_matches_the_formula(x_shape, n, gd, world):
    # Every tile's scale travels with it: rows gathered with theirs; in the contraction layout each
    # source's K slice with its tiles.
    x8, xs = shards(normal(3, x_shape), world, gd, fp8.quantize_1x128)
    w8, ws = shards(normal(4, (x_shape[-1], n)), world, 1, fp8.quantize_128x128)
    x_spec = P(*[("tp" if d == gd % len(x_shape) else None) for d in range(len(x_shape))])

    def body(x, w, xs, ws):
        y, g = ag_gemm(x, w, axis_name="tp", gather_dimension=gd, x_scale=xs, w_scale=ws, return_gathered=True)
        return y, g[None]

    y, g = run(body, (x8, w8, xs, ws), (x_spec, P(None, "tp"), x_spec, P(None, "tp")),
               (P(*[None] * (len(x_shape) - 1), "tp"), P("tp")), world)
    n_local, nb_local = n // world, ws.shape[-1] // world
    ref = np.concatenate([formula(x8, xs, w8[:, r * n_local:(r + 1) * n_local], ws[:, r * nb_local:(r + 1) * nb_local])
                          for r in range(world)], axis=-1)
    assert y.dtype == jnp.bfloat16 and rel_err(y, ref) <= BF16_TOL
    for copy in f64(g):  # every rank's gathered copy is the whole FP8 x
        np.testing.assert_array_equal(copy, f64(x8))


def test_ag_gemm_contraction_slices_of_partial_tiles():
    # K_local = 100: each source's slice ends in a partial tile, so the gathered tiles are not the
    # weight's 128-row blocks; the reference dequantises each source's slice with its own tiles (the
    # dequantised-operand formula) and says why no kernel runs it.
    world, k_local, n = 4, 100, 2 * 128
    x = normal(5, (24, world * k_local))
    x8, xs = shards(x, world, -1, fp8.quantize_1x128)
    w8, ws = shards(normal(6, (world * k_local, n)), world, 1, fp8.quantize_128x128)

    def body(x, w, xs, ws):
        return ag_gemm(x, w, axis_name="tp", gather_dimension=-1, x_scale=xs, w_scale=ws)

    y = run(body, (x8, w8, xs, ws), (P(None, "tp"),) * 4, P(None, "tp"), world)
    ref = dequantised(x, world, -1, fp8.quantize_1x128) @ dequantised(normal(6, (world * k_local, n)), world, 1,
                                                                       fp8.quantize_128x128)
    assert rel_err(y, ref) <= BF16_TOL


@pytest.mark.parametrize("gd,world", [(0, 4), (-1, 2)])
def test_grouped_ag_gemm_matches_its_weights_alone(gd, world):
    # A group with one block scale per weight (widths that are no multiple of 128) equals each weight's
    # own block-scaled call; its gradients equal theirs.
    k = world * 128
    x = normal(7, (16, k))
    widths = (world * 50, world * 34, world * 16)
    weights = tuple(normal(8 + i, (k, n), 0.1) for i, n in enumerate(widths))
    x_spec = P("tp", None) if gd == 0 else P(None, "tp")
    mesh = make_mesh((world,), ("tp",))

    def calls(grouped):
        def body(x, *ws):
            xs = fp8.scales_1x128(x)
            scales = tuple(fp8.scales_128x128(w) for w in ws)
            if grouped:
                return ag_gemm(x, ws, axis_name="tp", gather_dimension=gd, x_scale=xs, w_scale=scales)
            return tuple(ag_gemm(x, w, axis_name="tp", gather_dimension=gd, x_scale=xs, w_scale=s)
                         for w, s in zip(ws, scales))

        f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec,) + (P(None, "tp"),) * 3, out_specs=(P(None, "tp"),) * 3)
        cot = [normal(20 + i, (16, n)) for i, n in enumerate(widths)]
        loss = lambda *a: sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(f(*a), cot))  # noqa: E731
        with jax.set_mesh(mesh):
            args = [jax.device_put(x, x_spec)] + [jax.device_put(w, P(None, "tp")) for w in weights]
            return jax.jit(f)(*args), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

    (ys, grads), (ys1, grads1) = calls(True), calls(False)
    for a, b in zip(ys + grads, ys1 + grads1):
        assert a.shape == b.shape and rel_err(a, b) <= BF16_TOL


def test_high_precision_operands_are_quantised_by_the_op():
    # bf16 x and w with their block scales: the same result as the caller quantising them.
    world = 2
    x, w = normal(9, (8, 512)).astype(jnp.bfloat16), normal(10, (512, 256)).astype(jnp.bfloat16)
    specs = (P(None, "tp"), P("tp", None), P(None, "tp"), P("tp", None))
    _, xs = shards(x, world, -1, fp8.quantize_1x128)
    _, ws = shards(w, world, 0, fp8.quantize_128x128)

    def body(x, w, xs, ws):
        q = gemm_rs(fp8.quantize(x, xs), fp8.quantize(w, ws), axis_name="tp", x_scale=xs, w_scale=ws)
        return gemm_rs(x, w, axis_name="tp", x_scale=xs, w_scale=ws), q

    y, q = run(body, (x, w, xs, ws), specs, (P("tp", None),) * 2, world)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(q, np.float32))


# --- gradients ----------------------------------------------------------------------------------------


# (op, x's sharded axis, w's sharded axis, the output's sharded axis, the op's dimension argument)
LAYOUTS = {
    "gemm_rs rows": (gemm_rs, -1, 0, 0, dict(scatter_dimension=0)),
    "gemm_rs columns": (gemm_rs, -1, 0, -1, dict(scatter_dimension=-1)),
    "ag_gemm rows": (ag_gemm, 0, 1, -1, dict(gather_dimension=0)),
    "ag_gemm contraction": (ag_gemm, -1, 1, -1, dict(gather_dimension=-1)),
}


def _spec(axis):
    return P("tp", None) if axis == 0 else P(None, "tp")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gradients_match_the_dequantised_formula(layout, world):
    # f32 x and w, which the op quantises with their current block scales; loss = sum(y * c). The
    # backward: each rank's dy quantised to e5m2 per 1x128 tile of its last dim; dx the other op on it
    # and w8.T with its block scales transposed; dw in fp32 on the dequantised operands. So, in float64
    # of the dequantised shards (x, w, dy each quantised shard by shard): y = X W, dx = D W.T, dw = X.T D.
    op, x_axis, w_axis, y_axis, dim = LAYOUTS[layout]
    m, k, n = 24, world * 160, world * 72
    x, w, c = normal(11, (m, k)), normal(12, (k, n), 0.05), normal(13, (m, n))

    def loss(x, w, c):
        y = op(x, w, axis_name="tp", x_scale=fp8.scales_1x128(x), w_scale=fp8.scales_128x128(w), **dim)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * c), "tp")

    mesh = make_mesh((world,), ("tp",))
    f = jax.shard_map(loss, mesh=mesh, in_specs=(_spec(x_axis), _spec(w_axis), _spec(y_axis)), out_specs=P())
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, _spec(s)) for a, s in ((x, x_axis), (w, w_axis), (c, y_axis))]
        dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(*args)
    xd = dequantised(x, world, x_axis, fp8.quantize_1x128)
    wd = dequantised(w, world, w_axis, fp8.quantize_128x128)
    dd = dequantised(c.astype(jnp.bfloat16), world, y_axis, fp8.quantize_1x128, E5M2)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    assert rel_err(dx, dd @ wd.T) <= BF16_TOL  # dx is written in bf16 (the output dtype)
    assert rel_err(dw, xd.T @ dd) <= 1e-5
    # Against float64 of the unquantised operands: within FP8's precision.
    assert rel_err(dx, f64(c) @ f64(w).T) <= FP8_TOL and rel_err(dw, f64(x).T @ f64(c)) <= FP8_TOL


def test_bf16_gradients_of_a_block_scaled_call():
    # grad_dtype=bfloat16: the backward in bf16 on the dequantised weight and operand.
    world = 2
    x, w, c = normal(14, (16, 512)), normal(15, (512, 256), 0.05), normal(16, (16, 256))

    def loss(x, w, c):
        y = gemm_rs(x, w, axis_name="tp", x_scale=fp8.scales_1x128(x), w_scale=fp8.scales_128x128(w),
                    grad_dtype=jnp.bfloat16)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * c), "tp")

    mesh = make_mesh((world,), ("tp",))
    f = jax.shard_map(loss, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P("tp", None)), out_specs=P())
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, s) for a, s in ((x, P(None, "tp")), (w, P("tp", None)), (c, P("tp", None)))]
        dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(*args)
    xd = dequantised(x, world, -1, fp8.quantize_1x128)
    wd = dequantised(w, world, 0, fp8.quantize_128x128)
    dd = f64(c.astype(jnp.bfloat16))
    assert rel_err(dx, dd @ wd.T) <= BF16_TOL and rel_err(dw, xd.T @ dd) <= BF16_TOL


# --- bad input ----------------------------------------------------------------------------------------


X8, W8 = jnp.ones((8, 200), E4M3), jnp.ones((200, 136), E4M3)
XS, WS = jnp.ones((8, 2), jnp.float32), jnp.ones((2, 2), jnp.float32)
S = jnp.float32(1.0)


def _trace(op, x, w, **kwargs):
    mesh = make_mesh((1,), ("tp",))
    f = jax.shard_map(lambda x, w: op(x, w, axis_name="tp", **kwargs), mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                      check_vma=False)
    with jax.set_mesh(mesh):
        jax.eval_shape(f, x, w)


@pytest.mark.parametrize("op", [gemm_rs, ag_gemm])
@pytest.mark.parametrize("x,w,kwargs,match", [
    (X8, W8, dict(x_scale=jnp.ones((8, 1)), w_scale=WS),
     r"x_scale must be float32\[8, 2\] \(1x128 tiles of x \[8, 200\]\) in a block-scaled call, got float32\[8, 1\]"),
    (X8, W8, dict(x_scale=XS.T, w_scale=WS), r"x_scale must be float32\[8, 2\] .*got float32\[2, 8\]"),
    (X8, W8, dict(x_scale=XS, w_scale=jnp.ones((2, 1))),
     r"w_scale must be float32\[2, 2\] \(128x128 blocks of w \[200, 136\]\) in a block-scaled call, got float32\[2, 1\]"),
    (X8, W8, dict(x_scale=S, w_scale=WS),
     r"x_scale must be float32\[8, 2\] .* got a per-tensor scalar: mixing block and per-tensor scales"),
    (X8, W8, dict(x_scale=XS, w_scale=S),
     r"x_scale float32\[8, 2\] is not a scalar but w_scale float32\[\] is per tensor: pass both scales per tensor"),
    (X8, W8, dict(x_scale=XS.astype(jnp.float16), w_scale=WS), r"x_scale must be float32\[8, 2\] .*got float16\[8, 2\]"),
    (X8, W8, dict(x_scale=XS, w_scale=WS.astype(jnp.bfloat16)), r"w_scale must be float32\[2, 2\] .*got bfloat16\[2, 2\]"),
    (X8, W8.astype(jnp.float16), dict(x_scale=XS, w_scale=WS),
     r"mixed FP8 and high-precision operands \(x float8_e4m3fn, w float16\)"),
    (X8, W8, dict(x_scale=XS, w_scale=WS, grad_scale=S), r"grad_scale is a per-tensor scale; a block-scaled call"),
    (X8, W8, dict(x_scale=XS, w_scale=(WS,)), r"w_scale is a tuple of 1, which gives a group of weights their block "
                                              r"scales; one weight takes its w_scale array itself"),
])
def test_bad_block_input(op, x, w, kwargs, match):
    with pytest.raises(ValueError, match=f"{op.__name__}: " + match):
        _trace(op, x, w, **kwargs)


def test_bad_group_block_scales():
    group = lambda x, w, **k: ag_gemm(x, (w, w[:, :64]), **k)  # noqa: E731
    with pytest.raises(ValueError, match=r"ag_gemm: a block-scaled group of 2 weights takes a tuple of 2 w_scale "
                                         r"arrays \(one \[ceil\(K/128\), ceil\(N_i/128\)\] per weight\), got one array"):
        _trace(group, X8, W8, x_scale=XS, w_scale=WS)
    with pytest.raises(ValueError, match=r"got 3"):
        _trace(group, X8, W8, x_scale=XS, w_scale=(WS, WS, WS))
    with pytest.raises(ValueError, match=r"ag_gemm: w_scale\[1\] must be float32\[2, 1\] \(128x128 blocks of w\[1\] "
                                         r"\[200, 64\]\) in a block-scaled call, got float32\[2, 2\]"):
        _trace(group, X8, W8, x_scale=XS, w_scale=(WS, WS))
    _trace(group, X8, W8, x_scale=XS, w_scale=(WS, WS[:, :1]))  # the right shapes trace


def test_block_scaled_high_precision_operands_trace():
    # float16 (or bf16, f32) x and w with block scales: the op quantises them; not an error.
    _trace(gemm_rs, X8.astype(jnp.float16), W8.astype(jnp.float16), x_scale=XS, w_scale=WS)


# --- never per tensor ---------------------------------------------------------------------------------


def _spied(monkeypatch):
    """Every plan the ops make, as (op, block_scaled, x dtype)."""
    seen = []
    for name, spec in list(registry.OPS.items()):
        def plan(x, w, *, _plan=spec.plan, _name=name, **kwargs):
            seen.append((_name, kwargs.get("block_scaled", False), jnp.dtype(x.dtype).name))
            return _plan(x, w, **kwargs)
        monkeypatch.setitem(registry.OPS, name, dataclasses.replace(spec, plan=plan))
    return seen


@pytest.mark.parametrize("op,back,x_spec,w_spec", [(gemm_rs, "ag_gemm", P(None, "tp"), P("tp", None)),
                                                    (ag_gemm, "gemm_rs", P("tp", None), P(None, "tp"))])
def test_forward_and_backward_plans_are_block_scaled(monkeypatch, op, back, x_spec, w_spec):
    seen = _spied(monkeypatch)
    world = 2
    x, w = normal(17, (16, 256)), normal(18, (256, 256))

    def loss(x, w):
        y = op(x, w, axis_name="tp", x_scale=fp8.scales_1x128(x), w_scale=fp8.scales_128x128(w))
        return jax.lax.psum(jnp.sum(jnp.square(y.astype(jnp.float32))), "tp")

    mesh = make_mesh((world,), ("tp",))
    f = jax.shard_map(loss, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=P())
    with jax.set_mesh(mesh):
        jax.jit(jax.grad(f, argnums=(0, 1)))(jax.device_put(x, x_spec), jax.device_put(w, w_spec))
    assert seen == [(op.__name__, True, "float8_e4m3fn"), (back, True, "float8_e5m2")]


def test_no_fused_kernel_for_block_scales_is_a_reason(monkeypatch):
    # An extension whose FP8 kernels take per-tensor scales only: block scales take the XLA path with
    # that reason, and prepare refuses them (they never reach the per-tensor kernels); an FP8 plan
    # that takes block_scaled is the build with block-scaled kernels.
    class PerTensorOnly:
        GEMM_RS_FP8_TARGET, AG_GEMM_FP8_TARGET = "entwine_gemm_rs_fp8", "entwine_ag_gemm_fp8"

        @staticmethod
        def fp8_targets():
            return ["entwine_gemm_rs_fp8", "entwine_ag_gemm_fp8"]

        @staticmethod
        def gemm_rs_fp8_plan(m, n, k, world, scatter_cols, block_n, producer_sms, consumer_grid, consumer_block,
                             raster_rows, split_tail, x_dtype="float8_e4m3fn"):
            raise AssertionError("not asked")

        ag_gemm_fp8_plan = gemm_rs_fp8_plan

    monkeypatch.setattr(_extension, "module", lambda: (PerTensorOnly, None))
    for op, plan in (("gemm_rs", rs_plan), ("ag_gemm", ag_plan)):
        assert plan.fp8_reason() is None
        assert plan.fp8_block_reason() == (f"block-scaled FP8 has no fused {op} kernel in this build (its FP8 kernels "
                                           f"take per-tensor scales only): the XLA reference runs")
    x8, w8 = jax.ShapeDtypeStruct((256, 256), E4M3), jax.ShapeDtypeStruct((256, 256), E4M3)
    with pytest.raises(Unavailable, match="block-scaled FP8 has no fused gemm_rs kernel"):
        rs_fused.prepare(x8, w8, axis_name="tp", axis_size=2, scatter_dimension=0, config=GemmRsConfig(),
                         out_dtype="bfloat16", block_scaled=True)
    with pytest.raises(Unavailable, match="block-scaled FP8 has no fused ag_gemm kernel"):
        ag_fused.prepare(x8, w8, axis_name="tp", axis_size=2, gather_k=False, config=None, out_dtype="bfloat16",
                         block_scaled=True)

    def with_blocks(m, n, k, world, scatter_cols, block_n, producer_sms, consumer_grid, consumer_block, raster_rows,
                    split_tail, x_dtype="float8_e4m3fn", block_scaled=False):
        raise AssertionError("not asked")

    PerTensorOnly.gemm_rs_fp8_plan = staticmethod(with_blocks)
    assert rs_plan.fp8_block_reason() is None and ag_plan.fp8_block_reason() is not None


# --- the fused call (the FFI contract), off-GPU -------------------------------------------------------


def _rs_site(scatter_cols):
    # x [200, 256] over 2 ranks: rows, partitions of 100 rows padded to 128, N 96 padded to 128; columns,
    # N 256 in two slices of 128, M 200 padded to 256.
    plan = rs_plan.GemmRsPlan(world=2, m=200, k=256, n=96 if not scatter_cols else 256, scatter_cols=scatter_cols,
                              mp=100 if not scatter_cols else 200, mp_pad=128 if not scatter_cols else 256, k_pad=256,
                              n_pad=128, tiles_per_partition=1, m_blocks=1, n_blocks=1, raster_rows=1, num_blocks=2,
                              grid=2, k_tiles=2, split_first_block=2, split=False, slot_bytes=0)
    return rs_fused.GemmRsCall(plan=plan, comm_id=3, config=GemmRsConfig(), target="entwine_gemm_rs_fp8",
                               out_dtype="bfloat16", block_scaled=True)


@pytest.mark.parametrize("scatter_cols", [False, True])
def test_gemm_rs_block_call_as_the_ffi_contract_says(scatter_cols):
    # The FP8 target with x_scale [K/128, padded M] (M-major) and w_scale [padded N / 128, K/128] for w_t;
    # padded rows and columns scaled by 1, each partition's rows (or N slice) where its padded block is.
    site = _rs_site(scatter_cols)
    n = site.plan.n
    x8, w8 = jnp.ones((200, 256), E4M3), jnp.ones((256, n), E4M3)
    xs = jnp.arange(1.0, 401.0).reshape(200, 2)
    ws = jnp.arange(1.0, 1 + 2 * fp8.blocks(n)).reshape(2, -1)
    jaxpr = jax.make_jaxpr(lambda x, w, a, b: rs_fused.call_fp8(x, w, a, b, site))(x8, w8, xs, ws)
    eqn, = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "ffi_call"]
    assert eqn.params["target_name"] == "entwine_gemm_rs_fp8"
    assert [(v.aval.shape, v.aval.dtype) for v in eqn.invars] == [
        ((256, 256), E4M3), ((256 if scatter_cols else 128, 256), E4M3), ((2, 256), jnp.float32),
        ((2, 2) if scatter_cols else (1, 2), jnp.float32)]
    px, pw = jax.jit(rs_fused.pad_block_scales, static_argnums=2)(xs, ws, site.plan)
    if scatter_cols:
        want_x = np.concatenate([np.asarray(xs), np.ones((56, 2))]).T
    else:
        want_x = np.concatenate([np.asarray(xs[:100]), np.ones((28, 2)), np.asarray(xs[100:]), np.ones((28, 2))]).T
    np.testing.assert_array_equal(np.asarray(px), want_x)
    np.testing.assert_array_equal(np.asarray(pw), np.asarray(ws).T)


def test_block_scaled_columns_need_whole_blocks_per_rank(monkeypatch):
    # N / W = 96: w's 128-column scale blocks would straddle the ranks' slices, which the kernels pad
    # apart: the XLA path, with the reason.
    class BlockKernels:
        GEMM_RS_FP8_TARGET, MAX_WORLD = "entwine_gemm_rs_fp8", 8

        @staticmethod
        def fp8_targets():
            return ["entwine_gemm_rs_fp8"]

        @staticmethod
        def gemm_rs_fp8_plan(*args, x_dtype="float8_e4m3fn", block_scaled=False):
            raise AssertionError("not asked")

    monkeypatch.setattr(_extension, "module", lambda: (BlockKernels, None))
    reason = rs_fused._unavailable(jax.ShapeDtypeStruct((64, 256), E4M3), jax.ShapeDtypeStruct((256, 192), E4M3),
                                   "tp", 2, 1, GemmRsConfig(path="fused"), "bfloat16", True)
    assert reason == ("block-scaled FP8 scattering columns needs N / W % 128 == 0 (w's 128x128 scale blocks within "
                      "each rank's output slice), got N = 192 over 2 ranks")


def _up(v, multiple):
    return -(-v // multiple) * multiple


class SimulatedKernels:
    """The extension as far as planning calls goes, block-scaled FP8 included (its FP8 plans take
    block_scaled): the targets, and plans that pad as the C++ plans do (rows and N to whole 128-blocks,
    K to 16 elements) and refuse block scales unless K (ag_gemm: each shard's cols) % 128 == 0. Nothing
    runs: programs are lowered for CUDA only."""
    GEMM_RS_TARGET, AG_GEMM_TARGET = "entwine_gemm_rs", "entwine_ag_gemm"
    GEMM_RS_FP8_TARGET, AG_GEMM_FP8_TARGET = "entwine_gemm_rs_fp8", "entwine_ag_gemm_fp8"
    MAX_WORLD = 8

    @staticmethod
    def fp8_targets():
        return [SimulatedKernels.GEMM_RS_FP8_TARGET, SimulatedKernels.AG_GEMM_FP8_TARGET]

    @staticmethod
    def gemm_rs_plan(m, n, k, world, scatter_cols, block_n, producer_sms, consumer_grid, consumer_block, raster_rows,
                     split_tail, x_dtype="float8_e4m3fn", block_scaled=False):
        mp, n_part = (m, n // world) if scatter_cols else (m // world, n)
        return dict(error="block-scaled FP8 needs K % 128 == 0" if block_scaled and k % 128 else None,
                    config_error=False, part_rows=_up(mp, 128), part_cols=_up(n_part, 128), k=_up(k, 16),
                    tiles_per_partition=1, m_blocks=1, n_blocks=1, raster_rows=1, num_blocks=world, grid=1, k_tiles=1,
                    split_first_block=world, split=False, slot_bytes=0)

    gemm_rs_fp8_plan = gemm_rs_plan

    @staticmethod
    def ag_gemm_fp8_plan(rows, cols, n, world, gather_k, block_n, gemm_sms, raster_rows, max_chunks, push_sms,
                         shared_scale=False, x_dtype="float8_e4m3fn", block_scaled=False):
        return dict(error="block-scaled FP8 needs cols % 128 == 0" if block_scaled and cols % 128 else None,
                    rows_pad=_up(rows, 128), cols_pad=_up(cols, 16), n_pad=_up(n, 128), chunks=1, chunk_tiles=1,
                    num_blocks=1, grid=1, k_tiles=1, inbox_bytes=0, push_grid=0, sms_needed=2)


@pytest.fixture
def simulated_kernels(monkeypatch):
    """The fused path as on CUDA GPUs with block-scaled kernels for both ops, as far as lowering (the
    plans SimulatedKernels', the rest test_fp8.gpu_side_faked)."""
    monkeypatch.setattr(_extension, "module", lambda: (SimulatedKernels, None))
    gpu_side_faked(monkeypatch)
    rs_plan._asked.cache_clear()
    ag_plan._asked.cache_clear()
    yield
    rs_plan._asked.cache_clear()  # no simulated plan outlives the test
    ag_plan._asked.cache_clear()


def _lowered_grads(op, x_shape, w_shape, x_spec, w_spec, y_spec, **dim):
    """(the CUDA lowering's text of the gradients of a block-scaled call on the fused path, its
    XLA-path reasons logged), operands bf16 quantised by the op."""
    world = 4
    mesh = make_mesh((world,), ("tp",))
    config = GemmRsConfig(path="fused") if op is gemm_rs else AgGemmConfig(path="fused", block_n=128)

    def body(x, w):
        return op(x, w, axis_name="tp", x_scale=fp8.scales_1x128(x), w_scale=fp8.scales_128x128(w), config=config,
                  **dim)

    def loss(x, w):
        return jnp.sum(jnp.sin(jax.shard_map(body, in_specs=(x_spec, w_spec), out_specs=y_spec)(x, w)
                               .astype(jnp.float32)))

    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, spec))
            for shape, spec in ((x_shape, x_spec), (w_shape, w_spec))]
    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _block_calls(text):
    """(target, x's element type, the f32 operands' shapes, the results' shapes) of every FP8 custom call."""
    calls = []
    for target, operands, results in re.findall(r"custom_call @(entwine_\w+_fp8)\(.* : \((.*?)\) -> (.*)$", text,
                                                re.M):
        calls.append((target, re.match(r"tensor<[\dx]*x(\w+)>", operands).group(1),
                      re.findall(r"tensor<([\dx]*)xf32>", operands), re.findall(r"tensor<([\dx]*)x\w+>", results)))
    return sorted(calls)


def test_block_scaled_calls_lower_to_the_fp8_kernels(simulated_kernels, caplog):
    # gemm_rs (rows) forward and its backward ag_gemm, on the FP8 targets with 2-D scales in the kernels'
    # layout: x_scale [K/128, padded M], w_scale [padded N/128, K/128]; the ag_gemm returns its gathered
    # e5m2 dy with the tiles' scales [W, K/128, rows] for dw. Nothing on XLA's path.
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        text = _lowered_grads(gemm_rs, (512, 1024), (1024, 512), P(None, "tp"), P("tp", None), P("tp", None))
    assert not [r.getMessage() for r in caplog.records if "XLA reference path" in r.getMessage()]
    (ag, ag_x, ag_scales, ag_results), (rs, rs_x, rs_scales, _) = _block_calls(text)
    assert (rs, rs_x, rs_scales) == ("entwine_gemm_rs_fp8", "f8E4M3FN", ["2x512", "4x2"])  # K_local 256, M, N 512
    # dy [128, 512] per rank, gathered; w.T [512, 256]: w_t [256, 512].
    assert (ag, ag_x, ag_scales) == ("entwine_ag_gemm_fp8", "f8E5M2", ["4x128", "2x4"])
    assert ag_results[1:] == ["4x128x512", "4x4x128"]


def test_block_scaled_ag_gemm_contraction_lowers_to_the_fp8_kernels(simulated_kernels, caplog):
    # ag_gemm gathering the contracted dim (cols 256 per rank) and its backward gemm_rs scattering it.
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        text = _lowered_grads(ag_gemm, (256, 1024), (1024, 512), P(None, "tp"), P(None, "tp"), P(None, "tp"),
                              gather_dimension=-1)
    assert not [r.getMessage() for r in caplog.records if "XLA reference path" in r.getMessage()]
    (ag, ag_x, ag_scales, ag_results), (rs, rs_x, rs_scales, _) = _block_calls(text)
    assert (ag, ag_x, ag_scales) == ("entwine_ag_gemm_fp8", "f8E4M3FN", ["2x256", "1x8"])  # w_t [128, 1024]
    assert ag_results[1:] == ["4x256x256", "4x2x256"]
    # dy [256, 128] (N_local 128) scattered over K: w.T [128, 1024], w_t [1024, 128] split in 4 slices.
    assert (rs, rs_x, rs_scales) == ("entwine_gemm_rs_fp8", "f8E5M2", ["1x256", "8x1"])


def test_block_scales_off_whole_blocks_take_the_xla_path_with_the_reason(simulated_kernels, caplog):
    # K_local 200: the plan refuses it; the reference runs, and says why.
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        text = _lowered_grads(gemm_rs, (512, 800), (800, 512), P(None, "tp"), P("tp", None), P("tp", None))
    assert "entwine_gemm_rs_fp8" not in text
    reasons = [r.getMessage() for r in caplog.records if "XLA reference path" in r.getMessage()]
    assert any("block-scaled FP8 needs K % 128 == 0" in r for r in reasons), reasons


def test_reciprocal_block_scales_are_caught():
    # Block scales in the reciprocal convention (448 / amax) zero the operand, as per-tensor ones do (for
    # amaxes under 21, fp8._scale_problem).
    x = jax.random.normal(jax.random.key(19), (8, 256), jnp.float32)
    fp8.check_scales("gemm_rs", (("x", x, fp8.scales_1x128(x)),))
    with pytest.raises(ValueError, match=r"gemm_rs: x quantises to FP8 values that all lie below 1"):
        fp8.check_scales("gemm_rs", (("x", x, 1 / fp8.scales_1x128(x)),))


@pytest.mark.parametrize("gather_k,return_gathered", [(False, True), (True, False)])
def test_ag_gemm_block_call_as_the_ffi_contract_says(gather_k, return_gathered):
    # The FP8 target with the shard's x_scale [cols/128, rows_pad] (M-major) and w_scale [n_pad/128,
    # K/128] for w_t; results y, the gathered shards and their scales [W, cols/128, rows_pad] (or empty).
    p = ag_fused.AgPadding(world=2, rows=100, cols=256, n=96, rows_pad=128, cols_pad=256, n_pad=128, gather_k=gather_k)
    site = ag_fused.AgGemmCall(padding=p, gemm_sms=131, push_sms=0, comm_id=1, config=AgGemmConfig(),
                               target="entwine_ag_gemm_fp8", out_dtype="bfloat16", block_scaled=True)
    k = 2 * 256 if gather_k else 256
    x8, w8 = jnp.ones((100, 256), E4M3), jnp.ones((k, 96), E4M3)
    xs, ws = jnp.arange(1.0, 201.0).reshape(100, 2), jnp.ones((k // 128, 1))

    def call(x, w, a, b):
        return ag_fused.call_fp8(x, w, a, b, site, return_gathered, False)

    jaxpr = jax.make_jaxpr(call)(x8, w8, xs, ws)
    eqn, = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "ffi_call"]
    assert [(v.aval.shape, v.aval.dtype) for v in eqn.invars] == [
        ((128, 256), E4M3), ((128, k), E4M3), ((2, 128), jnp.float32), ((1, k // 128), jnp.float32)]
    gathered = ((2, 128, 256), (2, 2, 128)) if return_gathered else ((0,), (0,))
    assert [a.shape for a in eqn.params["result_avals"]][1:] == list(gathered)
    if return_gathered:
        assert jaxpr.out_avals[2].shape == (2, 2, 100)
    px, _ = ag_fused.pad_block_scales(xs, ws, p)
    np.testing.assert_array_equal(np.asarray(px), np.concatenate([np.asarray(xs), np.ones((28, 2))]).T)


@pytest.mark.parametrize("shape,gd", [((6, 3), 0), ((2, 6, 3), 1), ((2, 3, 4, 3), 1), ((5, 3), 1), ((2, 5, 3), 2)])
def test_gathered_block_scales_are_placed_as_the_gathered_x(shape, gd):
    # The kernels return each source's tile scales [W, cols/128, rows]; placed, they are what the
    # reference gathers: the sources' x_scale concatenated over the gathered dim (the last: its tiles).
    from entwine_jax.ag_gemm import op as ag_op
    world = 2
    sources = [jnp.asarray(np.random.default_rng(r).normal(size=shape)) for r in range(world)]
    kernels = jnp.stack([s.reshape(-1, shape[-1]).T for s in sources])
    plan = ag_op.Plan(axis_name="tp", axis_size=world, dimension=gd, config=None, return_gathered=True, reason="")
    placed = ag_op._in_x_layout(jnp.swapaxes(kernels, 1, 2), shape[:-1], shape[-1], plan)
    np.testing.assert_array_equal(np.asarray(placed), np.concatenate(sources, axis=gd))


def test_block_kernels_found_in_a_nanobind_signature(monkeypatch):
    # nanobind's functions: inspect.signature may fail or show only (*args, **kwargs) depending on the
    # nanobind version; the parameters are in __nb_signature__ (and the docstring may not name them).
    class NbFunction:
        __doc__ = "the plan of one FP8 call"

        def __init__(self, names):
            self.__nb_signature__ = ((f"def f(m: int, {names}) -> dict", "the plan", ()),)

        def __call__(self, *args, **kwargs):
            raise AssertionError("not asked")

    class Extension:
        GEMM_RS_FP8_TARGET, AG_GEMM_FP8_TARGET = "entwine_gemm_rs_fp8", "entwine_ag_gemm_fp8"
        gemm_rs_fp8_plan = NbFunction("x_dtype: str = \\0, block_scaled: bool = \\1")
        ag_gemm_fp8_plan = NbFunction("x_dtype: str = \\0")

        @staticmethod
        def fp8_targets():
            return ["entwine_gemm_rs_fp8", "entwine_ag_gemm_fp8"]

    monkeypatch.setattr(_extension, "module", lambda: (Extension, None))
    assert rs_plan.fp8_block_reason() is None
    assert "no fused ag_gemm kernel" in ag_plan.fp8_block_reason()
