# The grouped ag_gemm (one gather feeding several weights, e.g. query/key/value of unequal widths) on
# fake CPU devices: values and gradients against the plain XLA expression in both layouts, any
# number of weights, the gathered operand, one gather forward and one reduce-scatter backward
# (counted by the census), and bad groups. Also: a forward-only call asks the kernels for no
# gathered operand.
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from entwine_jax import AgGemmConfig, ag_gemm, callsite, census
from entwine_jax.ag_gemm import fused as ag_fused
from entwine_jax.ag_gemm import op as ag_gemm_op

from test_ag_gemm import layout_specs
from test_gemm_rs import TOL, make_mesh, rel_err

GROUPS = [  # (x shape (global), gather dim, widths of the weights (global, sharded over tp))
    ((32, 48), 0, (64, 8, 8)),          # q/k/v-like: 8 query heads for each kv head
    ((2, 16, 24), 1, (16, 16)),         # gate/up, sequence parallel (a middle dim)
    ((24, 64), -1, (32, 16, 8, 8)),     # the contraction layout, four weights
    ((16, 40), 0, (24,)),               # a group of one
]


def group_inputs(seed, x_shape, k, widths, dtype):
    keys = jax.random.split(jax.random.key(seed), len(widths) + 1)
    x = jax.random.normal(keys[0], x_shape, jnp.float32).astype(dtype)
    return x, [jax.random.normal(kw, (k, n), jnp.float32).astype(dtype) for kw, n in zip(keys[1:], widths)]


def run_group(x, ws, gd, world, fn):
    """fn(x_local, *w_local) under shard_map: x sharded over its gathered dim, each w over N."""
    mesh = make_mesh((world,), ("tp",))
    (x_spec, w_spec), out_spec = layout_specs(x.ndim, gd)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(x_spec,) + (w_spec,) * len(ws),
                              out_specs=(out_spec,) * len(ws)))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, x_spec)] + [jax.device_put(w, w_spec) for w in ws]
        return f, args


@pytest.mark.parametrize("x_shape,gd,widths", GROUPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_match_the_xla_expression(x_shape, gd, widths, dtype):
    world = 4
    k = x_shape[-1]  # global shapes: in the contraction layout x holds K / W per rank
    x, ws = group_inputs(7, x_shape, k, widths, dtype)
    mesh = make_mesh((world,), ("tp",))

    def ours(x, *ws):
        return ag_gemm(x, ws, axis_name="tp", gather_dimension=gd)

    def xla(x, *ws):
        g = jax.lax.all_gather(x, "tp", axis=gd % x.ndim, tiled=True).astype(jnp.float32)
        return tuple(jnp.matmul(g, w.astype(jnp.float32)).astype(x.dtype) for w in ws)

    f, args = run_group(x, ws, gd, world, ours)
    ref, _ = run_group(x, ws, gd, world, xla)
    with jax.set_mesh(mesh):
        ys, refs = f(*args), ref(*args)
        assert isinstance(ys, tuple) and len(ys) == len(widths)
        for y, r, n in zip(ys, refs, widths):
            assert y.dtype == dtype and y.shape[-1] == n
            assert rel_err(y, r) <= TOL[dtype]
        # Gradients of a loss that uses every output differently.
        def loss(fn):
            return lambda *a: sum(jnp.sum(jnp.sin(y.astype(jnp.float32)) * (i + 1)) for i, y in enumerate(fn(*a)))
        argnums = tuple(range(len(args)))
        grads = jax.jit(jax.grad(loss(f), argnums=argnums))(*args)
        expected = jax.jit(jax.grad(loss(ref), argnums=argnums))(*args)
        for gr, ex in zip(grads, expected):
            assert rel_err(gr, ex) <= 4 * TOL[dtype]


def test_gathered_operand_is_returned_once():
    x, ws = group_inputs(3, (16, 24), 24, (8, 16), jnp.float32)
    mesh = make_mesh((4,), ("tp",))
    # Every rank's gathered x, stacked: [4 * 16, 24], each block the whole x.
    f = jax.jit(jax.shard_map(lambda x, *ws: ag_gemm(x, ws, axis_name="tp", return_gathered=True), mesh=mesh,
                              in_specs=(P("tp", None), P(None, "tp"), P(None, "tp")),
                              out_specs=((P(None, "tp"), P(None, "tp")), P("tp", None))))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, P("tp", None))] + [jax.device_put(w, P(None, "tp")) for w in ws]
        (y0, y1), g = f(*args)
    np.testing.assert_array_equal(np.asarray(g), np.tile(np.asarray(x), (4, 1)))
    np.testing.assert_allclose(np.asarray(y1), np.asarray(x) @ np.asarray(ws[1]), rtol=1e-5, atol=1e-5)


def test_one_gather_forward_one_reduce_scatter_backward():
    # The census of the compiled gradient program: three weights, one collective of each kind, both
    # owned by the ops (on CPU the ops run their XLA references, which move the same bytes).
    x, ws = group_inputs(5, (32, 48), 48, (64, 8, 8), jnp.bfloat16)
    f, args = run_group(x, ws, 0, 4, lambda x, *ws: ag_gemm(x, ws, axis_name="tp"))
    step = jax.jit(jax.grad(lambda *a: sum(jnp.sum(y.astype(jnp.float32)) for y in f(*a)),
                            argnums=tuple(range(4))))
    with jax.set_mesh(make_mesh((4,), ("tp",))):
        found = census.collectives(step, *args)
    by_kind = {(c.owner, c.kind): c.count for c in found}
    assert by_kind == {("ag_gemm", "all-gather"): 1, ("gemm_rs", "reduce-scatter"): 1}, found.table()
    # The separate calls it replaces: three gathers of the same x, three reduce-scatters.
    g3, args3 = run_group(x, ws, 0, 4, lambda x, *ws: tuple(ag_gemm(x, w, axis_name="tp") for w in ws))
    step3 = jax.jit(jax.grad(lambda *a: sum(jnp.sum(y.astype(jnp.float32)) for y in g3(*a)),
                             argnums=tuple(range(4))))
    with jax.set_mesh(make_mesh((4,), ("tp",))):
        separate = census.collectives(step3, *args3)
    assert found.bytes < separate.bytes


@pytest.mark.parametrize("weights,match", [
    ((), "w is an empty group"),
    ((np.zeros((8, 4), np.float32), np.zeros((6, 4), np.float32)), r"share K and dtype: w\[0\] is float32\[8, 4\], "
                                                                   r"w\[1\] is float32\[6, 4\]"),
    ((np.zeros((8, 4), np.float32), np.zeros((8, 4), np.float16)), r"share K and dtype"),
    ((np.zeros((8, 4), np.float32), np.zeros((8,), np.float32)), r"w\[1\] must have rank 2"),
    ((np.zeros((8, 4), np.float32), "w"), r"w\[1\] must be an array"),
])
def test_bad_groups_are_value_errors(weights, match):
    mesh = make_mesh((2,), ("tp",))
    x = jnp.zeros((4, 8), jnp.float32)
    f = jax.shard_map(lambda x: ag_gemm(x, weights, axis_name="tp"), mesh=mesh, in_specs=P("tp", None),
                      out_specs=P())
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        jax.jit(f)(jax.device_put(x, P("tp", None)))


@dataclasses.dataclass(frozen=True)
class _Site:
    gather_k: bool


class _RecordingFused:
    """Stands in for entwine_jax.ag_gemm.fused: says the kernels can run, records what each traced
    call asks for, returns zeros of the kernels' shapes (never run: on CPU the reference runs)."""

    def __init__(self):
        self.asked_gathered = []

    def unavailable_reason(self, *a, **k):
        return None

    def prepare(self, x2d, w, *, gather_k, **k):
        return _Site(gather_k)

    def call(self, x2d, w, site, return_gathered):
        self.asked_gathered.append(return_gathered)
        world = 2
        y = jnp.zeros((x2d.shape[0] * (1 if site.gather_k else world), w.shape[1]), x2d.dtype)
        return y, (jnp.zeros((world,) + x2d.shape, x2d.dtype) if return_gathered else None)


def test_forward_only_calls_ask_for_no_gathered_operand(monkeypatch):
    fake = _RecordingFused()
    monkeypatch.setattr(ag_gemm_op, "fused", fake)
    # The fake stands for the GPU side: past the platform check, its answers decide.
    monkeypatch.setattr(callsite, "platform_reason", lambda axis_name: None)
    mesh = make_mesh((2,), ("tp",))
    x, (w,) = group_inputs(1, (8, 16), 16, (8,), jnp.bfloat16)
    f = jax.shard_map(lambda x, w: ag_gemm(x, w, axis_name="tp", config=AgGemmConfig(path="fused")), mesh=mesh,
                      in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
    with jax.set_mesh(mesh):
        args = (jax.device_put(x, P("tp", None)), jax.device_put(w, P(None, "tp")))
        jax.jit(f).lower(*args)
        assert fake.asked_gathered == [False]  # inference / evaluation: no [W * rows, K] write
        jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1))).lower(*args)
        assert fake.asked_gathered[1:] == [True]  # the backward's dw needs it


# --- The fused call of a group, without a GPU ----------------------------------------------------


class _GroupRecordingFused(_RecordingFused):
    """_RecordingFused that also records the weight operand each traced call passes (a tuple: the
    group read in place; one array: the group joined) and answers a group with one output each."""

    def __init__(self):
        super().__init__()
        self.operands = []
        self.configs = []

    def prepare(self, x2d, w, *, gather_k, config, **k):
        self.configs.append(config)
        return super().prepare(x2d, w, gather_k=gather_k)

    def call(self, x2d, w, site, return_gathered):
        self.operands.append(tuple(v.shape for v in w) if isinstance(w, tuple) else w.shape)
        if not isinstance(w, tuple):
            return super().call(x2d, w, site, return_gathered)
        ys = tuple(super(_GroupRecordingFused, self).call(x2d, v, site, False)[0] for v in w)
        return ys, (jnp.zeros((2,) + x2d.shape, x2d.dtype) if return_gathered else None)


def _fake_fused_group(monkeypatch, max_weights=4):
    fake = _GroupRecordingFused()
    monkeypatch.setattr(ag_gemm_op, "fused", fake)
    monkeypatch.setattr(callsite, "platform_reason", lambda axis_name: None)
    # The extension's bound on a group (AG_GEMM_MAX_WEIGHTS), absent without the extension.
    monkeypatch.setattr(ag_gemm_op._plan, "max_weights", lambda: max_weights)
    return fake


def _lower_group(widths, config=None, grad=False):
    mesh = make_mesh((2,), ("tp",))
    x, ws = group_inputs(1, (256, 64), 64, widths, jnp.bfloat16)
    f = jax.shard_map(lambda x, *ws: ag_gemm(x, ws, axis_name="tp", config=config), mesh=mesh,
                      in_specs=(P("tp", None),) + (P(),) * len(ws), out_specs=(P(),) * len(ws), check_vma=False)
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, P("tp", None))] + [jax.device_put(w, P()) for w in ws]
        if grad:
            jax.jit(jax.grad(lambda *a: sum(jnp.sum(y.astype(jnp.float32)) for y in f(*a)),
                             argnums=tuple(range(len(args))))).lower(*args)
        else:
            jax.jit(f).lower(*args)


@pytest.mark.parametrize("widths,config,block_n", [
    ((1024, 128, 128), None, 128),  # the heuristic's 256-wide blocks would straddle: 128-wide ones
    ((512, 256), None, 256),
    ((128, 128), AgGemmConfig(block_n=128, path="fused"), 128),
    # A config's 256-wide blocks would straddle too: 128-wide ones, and the user is told.
    ((1024, 128, 128), AgGemmConfig(block_n=256, path="fused"), 128),
])
def test_a_group_of_whole_blocks_is_read_in_place(monkeypatch, caplog, widths, config, block_n):
    fake = _fake_fused_group(monkeypatch)
    _log_reset()
    with caplog.at_level("DEBUG", logger="entwine_jax"):
        _lower_group(widths, config, grad=True)
    assert fake.operands == [tuple((64, n) for n in widths)]  # each weight, no concatenation
    assert fake.configs[0].block_n == block_n
    assert "concatenated" not in caplog.text
    assert ("runs 128-wide blocks, not config.block_n = 256" in caplog.text) == (
        config is not None and config.block_n != block_n)


@pytest.mark.parametrize("widths,config,max_weights,reason", [
    ((1024, 320), AgGemmConfig(block_n=256, path="fused"), 4,
     r"w\[1\] has 320 columns, not a multiple of config.block_n \(256\)"),
    ((1024, 96), None, 4, r"w\[1\] has 96 columns, not a multiple of config.block_n \(128\)"),
    ((128,) * 5, None, 4, "5 weights, the kernels read at most 4 in place"),
])
def test_a_group_the_kernels_cannot_read_in_place_is_joined_visibly(monkeypatch, caplog, widths, config,
                                                                     max_weights, reason):
    fake = _fake_fused_group(monkeypatch, max_weights)
    _log_reset()
    with caplog.at_level("DEBUG", logger="entwine_jax"):
        _lower_group(widths, config)
        _lower_group(widths, config)
    assert fake.operands == [(64, sum(widths))] * 2  # one concatenated operand per call
    messages = [r.getMessage() for r in caplog.records if "concatenated" in r.getMessage()]
    assert len(messages) == 1, messages  # logged once per call site
    assert re.search(reason, messages[0]), messages[0]


def _log_reset():
    from entwine_jax import _log
    _log.reset_once()


@pytest.mark.parametrize("gather_k", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_ffi_call_takes_every_weight_and_returns_every_output(gather_k, fp8):
    # The operands and results of one grouped FFI call as the handler binds them: x, w_0 (FP8: w_t_0
    # and the two scales), then the further weights; y_0, the gathered operand (FP8: and its scales),
    # then the further outputs. Each weight is padded in K alone; each output unpadded on its own.
    world, rows, cols, widths = 2, 100, 60, (1024, 128, 128)
    k = world * cols if gather_k else cols
    padding = ag_fused.AgPadding(world, rows, cols, sum(widths), 128, 64, sum(widths), gather_k)
    site = ag_fused.AgGemmCall(padding=padding, gemm_sms=100, push_sms=0, comm_id=3,
                               config=AgGemmConfig(block_n=128), target="entwine_ag_gemm" + ("_fp8" if fp8 else ""),
                               out_dtype="bfloat16" if fp8 else None)
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    x = jnp.zeros((rows, cols), dtype)
    ws = tuple(jnp.zeros((k, n), dtype) for n in widths)
    if fp8:
        one = jnp.float32(1)
        fn = lambda x, *ws: ag_fused.call_fp8(x, ws, one, one, site, True, False)  # noqa: E731
    else:
        fn = lambda x, *ws: ag_fused.call(x, ws, site, True)  # noqa: E731
    jaxpr = jax.make_jaxpr(fn)(x, *ws)
    call, = [e for e in jaxpr.eqns if e.primitive.name == "ffi_call"]
    k_pad = world * 64 if gather_k else 64
    y_rows = 128 if gather_k else world * 128
    scales = [(1,), (1,)] if fp8 else []
    weights = [(n, k_pad) if fp8 else (k_pad, n) for n in widths]
    assert [tuple(v.aval.shape) for v in call.invars] == [(128, 64), weights[0]] + scales + weights[1:]
    gathered = [(world, 128, 64)] + ([(world,)] if fp8 else [])
    assert [tuple(v.aval.shape) for v in call.outvars] == [(y_rows, widths[0])] + gathered + [(y_rows, n) for n in
                                                                                              widths[1:]]
    out = jax.eval_shape(fn, x, *ws)
    ys, g = out[0], out[1]
    out_rows = rows if gather_k else world * rows
    assert [y.shape for y in ys] == [(out_rows, n) for n in widths]
    assert g.shape == (world, rows, cols)
