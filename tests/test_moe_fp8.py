# The MoE ops' FP8 calls (per-tensor scales) on fake CPU devices, against the float32 op on the
# dequantised operands: per-rank x scales (each rank's travels beside its rows), quantised and
# high-precision operands, out_dtype, the e5m2 backward (against the float32 op's gradients with the
# cotangent quantised as the recipe does, per rank) and a bf16 backward, the FP8 rows moved (the
# census), bad scales.
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entwine_jax import census, fp8, moe_dispatch_gemm, moe_gemm_combine

from test_gemm_rs import make_mesh
from test_moe import EP, combine_contract, dispatch_contract, moved_pool, run

F32 = jnp.float32


def inputs(world, t=64, h=64, n=96, e_local=2, k=2, seed=0):
    rng = np.random.default_rng(seed)
    experts = world * e_local
    # Each rank's tokens at its own magnitude: the ranks' current scales differ.
    x = np.concatenate([rng.standard_normal((t, h)) * (1 + 3 * r) for r in range(world)]).astype(np.float32)
    idx = np.stack([rng.permutation(experts)[:k] for _ in range(world * t)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.05] = -1
    w1 = (rng.standard_normal((experts, h, n)) / 8).astype(np.float32)
    return x, idx, w1


def combine_inputs(w1, idx, seed):
    """(w2 [E, N, H] for w1 [E, H, N], router weights [T, k] for idx) of a combine after a dispatch."""
    rng = np.random.default_rng(seed)
    w2 = (rng.standard_normal((w1.shape[0], w1.shape[2], w1.shape[1])) / 8).astype(np.float32)
    return w2, rng.random(idx.shape).astype(np.float32)


def per_rank(fn, a, world):
    """fn applied to each rank's shard of a (split over dim 0), joined again."""
    return np.concatenate([np.asarray(fn(s)) for s in np.split(a, world)])


def deq(v, dtype=fp8.E4M3):
    """v quantised with its own current scale and dequantised: what an FP8 call computes with."""
    s = fp8.current_scale(v, dtype)
    return np.asarray(fp8.dequantize(fp8.quantize(v, s, dtype), s))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def dispatch_fp8(x, idx, w1, **kw):
    xs, ws = fp8.current_scale(x), fp8.current_scale(w1)
    return moe_dispatch_gemm(x, idx, w1, axis_name="ep", x_scale=xs, w_scale=ws, **kw)[0]


def dispatch_f32(x, idx, w1):
    return moe_dispatch_gemm(x, idx, w1, axis_name="ep")[0]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("operands", ["high", "e4m3"])
def test_dispatch_matches_float32_of_the_dequantised_operands(world, operands):
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world)
    if operands == "high":
        y = run(lambda x, i, w: dispatch_fp8(x.astype(jnp.bfloat16), i, w.astype(jnp.bfloat16)), mesh, (x, idx, w1), EP)
    else:
        def body(x, i, w):
            xs, ws = fp8.current_scale(x), fp8.current_scale(w)
            return moe_dispatch_gemm(fp8.quantize(x, xs), i, fp8.quantize(w, ws), axis_name="ep", x_scale=xs,
                                     w_scale=ws)[0]
        y = run(body, mesh, (x, idx, w1), EP)
    assert y.dtype == jnp.bfloat16
    # The operands as the call quantised them: from bf16 ("high"), or from float32 by the body.
    high = jnp.bfloat16 if operands == "high" else F32
    xq = per_rank(lambda s: deq(jnp.asarray(s, high).astype(F32)), x, world)
    wq = per_rank(lambda s: deq(jnp.asarray(s, high).astype(F32)), w1, world)
    ref = run(dispatch_f32, mesh, (xq, idx, wq), EP)
    # Only y's rounding to bf16 separates them (2^-9 relative).
    assert rel(y.astype(np.float32), ref) < 4e-3
    # The scales matter: each rank's x is at its own magnitude, so ignoring the sources' scales is far off.
    assert rel(ref, run(dispatch_f32, mesh, (x, idx, w1), EP)) < 0.1


def test_out_dtype_and_shared_scale():
    world = 2
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world, seed=3)

    def body(x, i, w):
        # One scale for every rank (delayed scaling's shape): nothing travels beside the rows.
        xs = jnp.float32(0.05)
        return moe_dispatch_gemm(x, i, w, axis_name="ep", x_scale=xs, w_scale=fp8.current_scale(w),
                                 out_dtype=jnp.float16)[0]

    y = run(body, mesh, (x, idx, w1), EP)
    assert y.dtype == jnp.float16
    xq = np.asarray(fp8.dequantize(fp8.quantize(x, jnp.float32(0.05)), jnp.float32(0.05)))
    wq = per_rank(lambda s: deq(jnp.asarray(s)), w1, world)
    assert rel(y.astype(np.float32), run(dispatch_f32, mesh, (xq, idx, wq), EP)) < 2e-3


def test_combine_matches_float32_of_the_dequantised_operands():
    """moe_gemm_combine's FP8 call: h and w2 quantised with each rank's own scales, the rows home in
    bf16, summed in fp32: the float32 combine of the dequantised h and w2 to bf16's rounding."""
    world = 3
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world, seed=11)
    w2, weights = combine_inputs(w1, idx, seed=12)
    h = run(dispatch_f32, mesh, (x, idx, w1), EP)  # [W*E_local, W*C, N]: a combine's h, rows of every rank
    hq, wq = per_rank(lambda s: deq(jnp.asarray(s)), h, world), per_rank(lambda s: deq(jnp.asarray(s)), w2, world)

    def body(fp8_call):
        def f(x, i, w1, h, w2, weights):
            handle = moe_dispatch_gemm(x, i, w1, axis_name="ep")[1]
            if fp8_call:
                return moe_gemm_combine(h, w2, weights, handle, axis_name="ep", x_scale=fp8.current_scale(h),
                                        w_scale=fp8.current_scale(w2))
            return moe_gemm_combine(h, w2, weights, handle, axis_name="ep")
        return f

    out8 = run(body(True), mesh, (x, idx, w1, h, w2, weights), EP)
    ref = run(body(False), mesh, (x, idx, w1, hq, wq, weights), EP)
    assert out8.dtype == jnp.bfloat16
    assert rel(out8.astype(np.float32), ref) < 8e-3


def mlp_loss(x, idx, w1, w2, weights, c, fp8_call, grad_dtype=None, output=False):
    """sum(out * c) of dispatch -> gelu -> combine, FP8 or float32 (output: out itself)."""
    def body(x, idx, w1, w2, weights, c):
        if fp8_call:
            y, handle = moe_dispatch_gemm(x, idx, w1, axis_name="ep", x_scale=fp8.current_scale(x),
                                          w_scale=fp8.current_scale(w1),
                                          grad_dtype=grad_dtype)
            h = jax.nn.gelu(y.astype(F32))
            out = moe_gemm_combine(h, w2, weights, handle, axis_name="ep", x_scale=fp8.current_scale(h),
                                   w_scale=fp8.current_scale(w2), grad_dtype=grad_dtype)
        else:
            y, handle = moe_dispatch_gemm(x, idx, w1, axis_name="ep")
            out = moe_gemm_combine(jax.nn.gelu(y), w2, weights, handle, axis_name="ep")
        return out.astype(F32) if output else jnp.sum(out.astype(F32) * c, keepdims=True)
    return body


@pytest.mark.parametrize("grad_dtype", [None, jnp.bfloat16])
def test_mlp_forward_and_gradients(grad_dtype):
    """An MLP through both FP8 calls: its output near the float32 MLP's, its gradients (x, w1, w2, the
    router weights) near the float32 ones (FP8's rounding of every operand and cotangent), finite."""
    world = 2
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world, seed=5)
    w2, weights = combine_inputs(w1, idx, seed=6)
    c = np.random.default_rng(6).standard_normal(x.shape).astype(np.float32)
    grads = {}
    for fp8_call in (True, False):
        f = jax.shard_map(mlp_loss(x, idx, w1, w2, weights, c, fp8_call, grad_dtype), mesh=mesh,
                          in_specs=(EP,) * 6, out_specs=EP)
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, EP) for a in (x, idx, w1, w2, weights, c)]
            loss = lambda x, w1, w2, weights: jnp.sum(f(x, args[1], w1, w2, weights, args[5]))
            grads[fp8_call] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*[args[i] for i in (0, 2, 3, 4)])
    (_, g8), (_, g32) = grads[True], grads[False]
    out8, out32 = (run(mlp_loss(x, idx, w1, w2, weights, c, f, output=True), mesh, (x, idx, w1, w2, weights, c), EP)
                   for f in (True, False))
    assert np.linalg.norm(out8 - out32) / np.linalg.norm(out32) < 0.06
    tol = 0.15 if grad_dtype is None else 0.08  # e5m2 keeps 2 mantissa bits, bf16 7
    for name, a, b in zip(("x", "w1", "w2", "weights"), g8, g32):
        a = np.asarray(a)
        assert a.dtype == np.float32 and np.all(np.isfinite(a)), name
        err = np.linalg.norm(a - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert err < tol, (name, err)


@pytest.mark.parametrize("grad_dtype", [None, jnp.bfloat16])
def test_reference_fp8_dots_keep_fp32_sums(grad_dtype):
    """Every GEMM of FP8 values on XLA's path (both ops' forward, the e5m2 backward's, or the dequantised
    rows' in a bf16 backward) asks XLA for fp32 sums (test_fp8.assert_fp8_dots_keep_fp32_sums)."""
    from test_fp8 import assert_fp8_dots_keep_fp32_sums
    world = 2
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world, seed=8)
    w2, weights = combine_inputs(w1, idx, seed=9)
    c = np.random.default_rng(9).standard_normal(x.shape).astype(np.float32)
    f = jax.shard_map(mlp_loss(x, idx, w1, w2, weights, c, True, grad_dtype), mesh=mesh, in_specs=(EP,) * 6,
                      out_specs=EP)
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, EP) for a in (x, idx, w1, w2, weights, c)]
        loss = lambda x, w1, w2, weights: jnp.sum(f(x, args[1], w1, w2, weights, args[5]))  # noqa: E731
        count = assert_fp8_dots_keep_fp32_sums(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)),
                                               *[args[i] for i in (0, 2, 3, 4)])
    # The two forward GEMMs, and in FP8 the two backward ones that are the other op's (dx of each).
    assert count == (4 if grad_dtype is None else 2), count


def test_dispatch_gradient_follows_the_recipe():
    """dx and dw1 of an FP8 dispatch equal the float32 op's gradients on the dequantised operands with
    the cotangent quantised to e5m2 by each rank's own current scale of its taken rows (the rows no
    slot took, whose cotangent reaches nothing, are zeroed first), to bf16's rounding of the rows
    sent home."""
    world = 2
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world, seed=7)
    xq, wq = per_rank(lambda s: deq(jnp.asarray(s)), x, world), per_rank(lambda s: deq(jnp.asarray(s)), w1, world)
    probe = run(dispatch_f32, mesh, (xq, idx, wq), EP)
    # bf16 values: the cotangent reaches the op in y's dtype, bf16, before its quantisation.
    c = np.asarray(jnp.asarray(np.random.default_rng(8).standard_normal(probe.shape), jnp.bfloat16), np.float32)
    taken = np.any(probe != 0, axis=-1, keepdims=True)  # y's rows that some slot took
    assert 0 < taken.sum() < taken.size
    cq = per_rank(lambda s: deq(jnp.asarray(s), fp8.E5M2), np.where(taken, c, 0.0), world)

    def grads(fn, x, w, c):
        f = jax.shard_map(lambda x, i, w, c: jnp.sum(fn(x, i, w).astype(F32) * c, keepdims=True), mesh=mesh,
                          in_specs=(EP,) * 4, out_specs=EP)
        with jax.set_mesh(mesh):
            a = [jax.device_put(v, EP) for v in (x, idx, w, c)]
            return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, a[1], w, a[3])), argnums=(0, 1)))(a[0], a[2])

    dx8, dw8 = grads(dispatch_fp8, x, w1, c)
    dx, dw = grads(dispatch_f32, xq, wq, cq)
    assert rel(dx8, dx) < 8e-3  # dx's rows travel home in bf16
    assert rel(dw8, dw) < 1e-5


def test_census_counts_the_fp8_rows():
    """The census counts an FP8 MLP's forward moves as the ops': the dispatch's rows in e4m3 (one byte
    an element, half of bf16's) and each rank's x scale beside them, the combine's rows in bf16."""
    world = 2
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world)
    w2, weights = combine_inputs(w1, idx, seed=1)
    c = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    f = jax.jit(jax.shard_map(mlp_loss(x, idx, w1, w2, weights, c, True), mesh=mesh, in_specs=(EP,) * 6,
                              out_specs=EP))
    with jax.set_mesh(mesh):
        report = census.collectives(f, *[jax.device_put(a, EP) for a in (x, idx, w1, w2, weights, c)])
    assert not report.select(owner="xla", kind=("all-to-all", "all-gather")), report.table()
    dispatch = sorted((m.shape.split("[")[0], m.bytes) for m in report.select(owner="moe_dispatch_gemm").collectives)
    combine = [(m.shape.split("[")[0], m.bytes) for m in report.select(owner="moe_gemm_combine").collectives]
    # (W-1)/W of [W, E_local, C, H]: 1/2 x 2 x 2 x 128 x 64 elements; the scales 1/2 x 4 x 4 f32.
    assert dispatch == [("f32", 32), ("f8e4m3fn", 16384)], report.table()
    assert combine == [("bf16", 32768)], report.table()


@pytest.mark.parametrize("kwargs, match", [
    (dict(x_scale=None), "needs both x_scale and w_scale"),
    (dict(w_scale=np.ones((1, 1), np.float32)), "per-tensor scales only"),
    (dict(x_scale=np.ones((64, 1), np.float32)), "per-tensor scales only"),
    (dict(grad_dtype=jnp.float32), "grad_dtype must be"),
    (dict(out_dtype=jnp.float32), "out_dtype must be"),
])
def test_bad_fp8_arguments(kwargs, match):
    mesh = make_mesh((2,), ("ep",))
    x, idx, w1 = inputs(2)
    args = dict(x_scale=np.float32(1.0), w_scale=np.float32(1.0))
    args.update(kwargs)

    def body(x, i, w):
        return moe_dispatch_gemm(x, i, w, axis_name="ep", **args)[0]

    with pytest.raises(ValueError, match=match):
        run(body, mesh, (x, idx, w1), EP)


def test_e5m2_operand_is_refused():
    mesh = make_mesh((2,), ("ep",))
    x, idx, w1 = inputs(2)

    def body(x, i, w):
        return moe_dispatch_gemm(x.astype(fp8.E5M2), i, w.astype(fp8.E5M2), axis_name="ep", x_scale=jnp.float32(1),
                                 w_scale=jnp.float32(1))[0]

    with pytest.raises(ValueError, match="float8_e5m2"):
        run(body, mesh, (x, idx, w1), EP)


def test_fp8_kernel_call_traces_its_operands():
    """The FP8 dispatch kernel's call as the op makes it on CUDA (traced and lowered here, no GPU): x_send
    and w_t in FP8, every source's scale [W] and w's, y in out_dtype and the pool in x_send's dtype,
    received [E_local, W] and sent [E] int32, the config as int64 attributes."""
    from jax.sharding import PartitionSpec as P

    from entwine_jax.moe import fused

    mesh = make_mesh((2,), ("ep",))
    site = fused.MoeCall(comm_id=5, attributes=(("block_n", 128), ("gemm_sms", 64), ("raster_rows", 8),
                                                ("push_sms", 0)), target="entwine_moe_dispatch_gemm_fp8")

    def body(x_send, w_t, xs, ws, received, sent):
        return fused.call_fp8(x_send, w_t, xs, ws, received, sent, site, jnp.bfloat16)

    args = (jax.ShapeDtypeStruct((4, 128, 64), fp8.E5M2), jax.ShapeDtypeStruct((2, 96, 64), fp8.E4M3),
            jax.ShapeDtypeStruct((2,), F32), jax.ShapeDtypeStruct((), F32), jax.ShapeDtypeStruct((2, 2), jnp.int32),
            jax.ShapeDtypeStruct((4,), jnp.int32))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 6, out_specs=(P(), P()), check_vma=False)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(f)(*args)
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    call = next(e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "ffi_call")
    assert call.params["target_name"] == "entwine_moe_dispatch_gemm_fp8"
    assert [(tuple(v.aval.shape), v.aval.dtype) for v in call.invars] == [
        ((4, 128, 64), fp8.E5M2), ((2, 96, 64), fp8.E4M3), ((2,), F32), ((), F32), ((2, 2), jnp.int32),
        ((4,), jnp.int32)]
    assert [(tuple(v.aval.shape), v.aval.dtype) for v in call.outvars] == [
        ((2, 256, 96), jnp.dtype(jnp.bfloat16)), ((2, 256, 64), fp8.E5M2)]
    line = next(line for line in text.splitlines() if "entwine_moe_dispatch_gemm_fp8" in line)
    for attr in ("comm_id = 5 : i64", "block_n = 128 : i64", "gemm_sms = 64 : i64", "push_sms = 0 : i64"):
        assert attr in line, (attr, line)


def test_fp8_combine_kernel_call_traces_its_operands():
    """The FP8 combine kernel's call as the op makes it on CUDA (traced and lowered here, no GPU): h and
    w2_t [E_local, H, F] in FP8, this rank's two scales, o_recv [E, C, H] in out_dtype."""
    from jax.sharding import PartitionSpec as P

    from entwine_jax.moe import fused

    mesh = make_mesh((2,), ("ep",))
    site = fused.MoeCall(comm_id=6, attributes=(("block_n", 128), ("gemm_sms", 64), ("raster_rows", 8),
                                                ("push_sms", 0)), target="entwine_moe_gemm_combine_fp8")

    def body(h, w_t, hs, ws, received):
        return fused.call_combine_fp8(h, w_t, hs, ws, received, site, 2, jnp.float16)

    args = (jax.ShapeDtypeStruct((2, 256, 64), fp8.E4M3), jax.ShapeDtypeStruct((2, 128, 64), fp8.E4M3),
            jax.ShapeDtypeStruct((1,), F32), jax.ShapeDtypeStruct((), F32), jax.ShapeDtypeStruct((2, 2), jnp.int32))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 5, out_specs=P(), check_vma=False)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(f)(*args)
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    call = next(e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "ffi_call")
    assert call.params["target_name"] == "entwine_moe_gemm_combine_fp8"
    assert [(tuple(v.aval.shape), v.aval.dtype) for v in call.invars] == [
        ((2, 256, 64), fp8.E4M3), ((2, 128, 64), fp8.E4M3), ((), F32), ((), F32), ((2, 2), jnp.int32)]
    assert [(tuple(v.aval.shape), v.aval.dtype) for v in call.outvars] == [((4, 128, 128), jnp.dtype(jnp.float16))]
    line = next(line for line in text.splitlines() if "entwine_moe_gemm_combine_fp8" in line)
    for attr in ("comm_id = 6 : i64", "block_n = 128 : i64", "gemm_sms = 64 : i64"):
        assert attr in line, (attr, line)


def test_fp8_mlp_lowers_to_the_fp8_kernels_on_cuda(monkeypatch):
    """Where the plans have the FP8 kernels (faked here: no GPU), an FP8 MLP's forward dispatch (e4m3
    rows) and its combine's backward dispatch (e5m2 rows) lower to the FP8 dispatch kernel, and its
    forward combine (e4m3 h) and its dispatch's backward dx (e5m2 dy) to the FP8 combine kernel."""
    from entwine_jax.moe import fused
    from entwine_jax.moe import op as moe_op

    asked = []

    def fake_prepare(plan, h, n, dtype, out_dtype=None):
        asked.append((jnp.dtype(dtype).name, None if out_dtype is None else jnp.dtype(out_dtype).name))
        attrs = (("block_n", 128), ("gemm_sms", 64), ("raster_rows", 8), ("push_sms", 0))
        target = "entwine_moe_dispatch_gemm" + ("" if out_dtype is None else "_fp8")
        return fused.MoeCall(comm_id=3, attributes=attrs, target=target), None

    def fake_prepare_combine(plan, f, h, dtype, out_dtype=None):
        asked_combine.append((jnp.dtype(dtype).name, None if out_dtype is None else jnp.dtype(out_dtype).name))
        attrs = (("block_n", 128), ("gemm_sms", 64), ("raster_rows", 8), ("push_sms", 0))
        target = "entwine_moe_gemm_combine" + ("" if out_dtype is None else "_fp8")
        return fused.MoeCall(comm_id=3, attributes=attrs, target=target), None

    asked_combine = []
    monkeypatch.setattr(moe_op, "prepare_gemm", fake_prepare)
    monkeypatch.setattr(moe_op, "prepare_combine", fake_prepare_combine)
    world = 2
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world)
    w2, weights = combine_inputs(w1, idx, seed=2)
    c = np.ones(x.shape, np.float32)
    f = jax.shard_map(mlp_loss(x, idx, w1, w2, weights, c, True), mesh=mesh, in_specs=(EP,) * 6, out_specs=EP)
    loss = lambda *a: jnp.sum(f(*a))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, EP) for a in (x, idx, w1, w2, weights, c)]
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert ("float8_e4m3fn", "bfloat16") in asked and ("float8_e5m2", "bfloat16") in asked, asked
    assert ("float8_e4m3fn", "bfloat16") in asked_combine and ("float8_e5m2", "bfloat16") in asked_combine, asked_combine
    for target in ("entwine_moe_dispatch_gemm_fp8", "entwine_moe_gemm_combine_fp8"):
        calls = [line for line in text.splitlines() if f"@{target}(" in line]
        assert len(calls) == 2, (target, calls)
        # one forward call (e4m3 operands only), one backward call (the e5m2 cotangent)
        assert sorted("f8E5M2" in line for line in calls) == [False, True], calls


@pytest.mark.parametrize("world, check_vma, jit", [(4, True, True), (3, False, True), (2, True, False)])
def test_fp8_mlp_at_other_worlds_eager_and_untyped(world, check_vma, jit):
    """The FP8 MLP's output and gradients at W = 4 and 3, without shard_map's type checks (every
    scale then counts as each rank's own and travels) and eagerly: near the float32 MLP's."""
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world, t=128, e_local=1, seed=20 + world)
    w2, weights = combine_inputs(w1, idx, seed=30 + world)
    c = np.random.default_rng(40).standard_normal(x.shape).astype(np.float32)
    got = {}
    for fp8_call in (True, False):
        f = jax.shard_map(mlp_loss(x, idx, w1, w2, weights, c, fp8_call), mesh=mesh, in_specs=(EP,) * 6,
                          out_specs=EP, check_vma=check_vma)
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, EP) for a in (x, idx, w1, w2, weights, c)]
            grad = jax.grad(lambda x, w1, w2: jnp.sum(f(x, args[1], w1, w2, args[4], args[5])), argnums=(0, 1, 2))
            got[fp8_call] = (jax.jit(grad) if jit else grad)(args[0], args[2], args[3])
    for name, a, b in zip(("x", "w1", "w2"), got[True], got[False]):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a)) and np.linalg.norm(a - b) / np.linalg.norm(b) < 0.15, name


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp8_kernels_get_their_operands_in_the_layouts_they_read(monkeypatch, world):
    """The FP8 MLP with the kernels' branch taken on CPU and each FP8 kernel replaced by its contract
    written in XLA (the dispatch kernel: y = moved x_send times w_t^T, each row times its source's
    scale and w's; the combine kernel: o_recv = h times w2_t^T times this rank's two scales, sent
    home): values and gradients equal the reference path's, so the ops hand the kernels w_t K-major
    (w1 and w2 transposed per call in the forward, w2 and w1 themselves in the backward), every
    source's scales [W] and the rank's own h scale. F != H != N, so a weight in the wrong layout fails
    on its shape."""
    from entwine_jax import callsite
    from entwine_jax.moe import fused, reference
    from entwine_jax.moe import op as moe_op

    attrs = (("block_n", 128), ("gemm_sms", 64), ("raster_rows", 8), ("push_sms", 0))
    calls = []

    def fake_dispatch(x_send, w_t, x_scales, w_scale, received, sent, site, out_dtype):
        calls.append(("dispatch", jnp.dtype(x_send.dtype).name))
        pool = moved_pool(x_send, received, sent, world)
        rows = jnp.repeat(x_scales, pool.shape[1] // world)[None, :, None]
        y = jnp.einsum("erk,enk->ern", pool.astype(F32), w_t.astype(F32)) * rows * jnp.reshape(w_scale, ())
        return dispatch_contract(y.astype(out_dtype), received, world), pool

    def fake_combine(h, w2_t, x_scale, w_scale, received, site, world_, out_dtype):
        calls.append(("combine", jnp.dtype(h.dtype).name))
        o = jnp.einsum("erf,ehf->erh", h.astype(F32), w2_t.astype(F32)) * jnp.reshape(x_scale * w_scale, ())
        o = combine_contract(o.astype(out_dtype), received, world_)
        return reference.to_sources(o, axis_name="ep", world=world_, op="moe_gemm_combine")

    def site(target):
        def prepare(plan, rows, cols, dtype, out_dtype=None):
            return fused.MoeCall(3, attrs, target + ("" if out_dtype is None else "_fp8")), None
        return prepare

    outs = {}
    mesh = make_mesh((world,), ("ep",))
    x, idx, w1 = inputs(world, t=64, h=64, n=96, seed=11)
    w2, weights = combine_inputs(w1, idx, seed=12)
    w2 = w2[:, :, :48].copy()  # F = 96, H = 48 out: the combine's output width differs from x's
    c = np.random.default_rng(13).standard_normal((x.shape[0], 48)).astype(np.float32)

    def body(x, idx, w1, w2, weights, c):
        y, handle = moe_dispatch_gemm(x, idx, w1, axis_name="ep", x_scale=fp8.current_scale(x),
                                      w_scale=fp8.current_scale(w1))
        h = jax.nn.gelu(y.astype(F32))
        out = moe_gemm_combine(h, w2, weights, handle, axis_name="ep", x_scale=fp8.current_scale(h),
                               w_scale=fp8.current_scale(w2))
        return jnp.sum(out.astype(F32) * c, keepdims=True)

    for emulated in (False, True):
        if emulated:
            monkeypatch.setattr(moe_op, "prepare_gemm", site("entwine_moe_dispatch_gemm"))
            monkeypatch.setattr(moe_op, "prepare_combine", site("entwine_moe_gemm_combine"))
            monkeypatch.setattr(fused, "call_fp8", fake_dispatch)
            monkeypatch.setattr(fused, "call_combine_fp8", fake_combine)
            # The kernels' branch on this platform (it is CUDA's alone otherwise).
            monkeypatch.setattr(callsite, "dispatch", lambda reason, ref, kernel, *a: kernel(*a) if reason is None
                                else ref(*a))
        f = jax.shard_map(body, mesh=mesh, in_specs=(EP,) * 6, out_specs=EP)
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, EP) for a in (x, idx, w1, w2, weights, c)]
            loss = lambda x, w1, w2, weights: jnp.sum(f(x, args[1], w1, w2, weights, args[5]))  # noqa: E731
            outs[emulated] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*[args[i] for i in (0, 2, 3, 4)])
    # Each kernel twice: the forward's e4m3 and the backward's e5m2 (the other op's gradient).
    assert sorted(calls) == [("combine", "float8_e4m3fn"), ("combine", "float8_e5m2"),
                             ("dispatch", "float8_e4m3fn"), ("dispatch", "float8_e5m2")], calls
    (l_ref, g_ref), (l_emu, g_emu) = outs[False], outs[True]
    assert rel(l_emu, l_ref) < 1e-5
    for name, a, b in zip(("x", "w1", "w2", "weights"), g_emu, g_ref):
        assert rel(a, b) < 1e-4, (name, rel(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_the_reference_paths_fp8_gemm_is_exact_on_the_gpu(k):
    """The XLA path multiplies the FP8 values exactly (in bf16, fp32 sums) on the GPU too, where XLA
    rewrites a dot of converted FP8 operands into cuBLASLt's FP8 GEMM (fast accumulation at DEFAULT
    precision: a mean 1.26% off at K = 14336 on an H200 before FP8_EXACT): positive e4m3 operands
    (sums that only grow, so truncation in an FP8 accumulator adds up) against float64, at the K of
    Mixtral's gate|up and down projections."""
    from entwine_jax.moe import fp8_op

    kx, kw = jax.random.split(jax.random.key(k))
    a8 = jax.random.uniform(kx, (2, 256, k), minval=0.5, maxval=2.0).astype(fp8.E4M3)
    w8 = jax.random.uniform(kw, (2, k, 256), minval=0.5, maxval=2.0).astype(fp8.E4M3)
    rows, w_scale = jnp.full((256,), 0.5, jnp.float32), jnp.float32(0.25)
    with jax.default_device(jax.devices("cuda")[0]):
        got = np.asarray(jax.jit(fp8_op._scaled_expert_dot)(a8, rows, w8, w_scale), np.float64)
    exact = np.einsum("erk,ekn->ern", np.asarray(a8.astype(jnp.float32), np.float64),
                      np.asarray(w8.astype(jnp.float32), np.float64)) * 0.5 * 0.25
    rel = np.abs(got - exact) / exact
    # fp32 sums of exact products: ~1e-6; an FP8 tensor-core accumulator: ~1e-3 (docs/performance.md).
    assert rel.mean() < 1e-5 and rel.max() < 1e-4, (rel.mean(), rel.max())


def test_a_token_of_zeros_keeps_its_gradient():
    # dx = dy @ w1^T whatever x is: a token of zeros (padding, or one that underflows e4m3 next to a
    # large one) gets the gradient the bf16 call gives, within FP8's rounding of dy and w1.
    world = 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(world * 4, 8)).astype(np.float32)
    x[0] = 0.0
    x[5] = 2e-5 * rng.normal(size=8)
    x[6] = 50.0
    idx = np.array([[1], [0], [1], [0]] * world, np.int32)
    w1 = (rng.normal(size=(2, 8, 8)) / np.sqrt(8)).astype(np.float32)
    cot = rng.normal(size=(2, world * 128, 8)).astype(np.float32)
    mesh = make_mesh((world,), ("ep",))

    def dx_of(call):
        f = jax.shard_map(lambda x, i, w1: call(x, i, w1), mesh=mesh, in_specs=(EP,) * 3, out_specs=EP)
        with jax.set_mesh(mesh):
            i_, w1_, c_ = (jax.device_put(a, EP) for a in (idx, w1, cot))
            loss = lambda x: jnp.sum(f(x, i_, w1_).astype(F32)[:, :c_.shape[1]] * c_)  # noqa: E731
            return np.asarray(jax.jit(jax.grad(loss))(jax.device_put(x, EP)), np.float64)

    half = dx_of(lambda x, i, w1: moe_dispatch_gemm(x, i, w1, axis_name="ep")[0])
    eight = dx_of(dispatch_fp8)
    for t in (0, 5):
        assert np.abs(half[t]).max() > 0.1
        assert rel(eight[t], half[t]) <= 0.15
