# entwine_jax.layers on 8 fake CPU devices (a dp=2 x tp=4 mesh; gemm_rs and ag_gemm take their XLA
# path): NNX and Linen row/column-parallel layers against psum_scatter / all_gather + dot and the
# unsharded math, forward and gradients, the three scatter and gather modes, the bias added once
# after the reduce-scatter, logical-axis metadata and partition_specs, and the ValueErrors for bad
# arguments.

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from entwine_jax import AgGemmConfig, GemmRsConfig, layers  # noqa: E402
from entwine_jax.layers import (DEFAULT_LOGICAL_AXIS_RULES, ColumnParallelDense, ColumnParallelLinear,  # noqa: E402
                                RowParallelDense, RowParallelLinear, partition_specs)

RULES = DEFAULT_LOGICAL_AXIS_RULES
# Max error relative to max |reference|: fp32 everywhere except the bf16 case.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
ROWS, IN, OUT = 16, 32, 24  # global rows (split over dp, then tp), in and out features


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"))


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def nnx_layer(mesh, cls, *args, **kwargs):
    """An NNX layer created at global shape with its parameters sharded by RULES; (graphdef, state, specs)."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        module = cls(*args, rngs=nnx.Rngs(0), **kwargs)
    graphdef, state = nnx.split(module)
    return graphdef, state, partition_specs(state, RULES)


def linen_layer(mesh, module, x_global):
    """Linen variables from init on the global input (outside shard_map), placed by partition_specs."""
    variables = module.init(jax.random.key(0), x_global)
    specs = partition_specs(variables, RULES)
    with jax.set_mesh(mesh):
        return jax.device_put(variables, specs), specs


def run(mesh, fn, params, specs, x, x_spec, out_spec, cot):
    """Global output of shard_map(fn) and the gradients of sum(out * cot) w.r.t. params and x."""
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, x_spec), out_specs=out_spec))
    loss = lambda p, x: jnp.sum(f(p, x).astype(jnp.float32) * cot)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, x_spec)
        y = f(params, x)
        gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    return y, gp, gx


def unbox(tree):
    """Plain arrays of an NNX State or a Linen variables dict: {'kernel': ..., 'bias': ...}."""
    if isinstance(tree, nnx.State):
        return {k: np.asarray(v) for k, v in nnx.to_pure_dict(tree).items()}
    return {k: np.asarray(v) for k, v in nn.unbox(tree)["params"].items()}


# ---------------------------------------------------------------- row-parallel, forward + grads

ROW_OUT_SPEC = {"rows": P(("dp", "tp"), None), "hidden": P("dp", "tp")}


ROW_CASES = [("nnx", "rows", False), ("nnx", "rows", True), ("nnx", "hidden", False), ("nnx", "hidden", True),
             ("linen", "rows", True), ("linen", "hidden", True)]


@pytest.mark.parametrize("api, scatter, use_bias", ROW_CASES, ids=["-".join(map(str, c)) for c in ROW_CASES])
def test_row_parallel(mesh, api, scatter, use_bias):
    x = normal(1, (ROWS, IN))
    cot = normal(2, (ROWS, OUT))
    bias_init = nnx.initializers.normal(1.0)  # nonzero, so a bias added W times would show
    if api == "nnx":
        graphdef, params, specs = nnx_layer(mesh, RowParallelLinear, IN, OUT, scatter=scatter, use_bias=use_bias,
                                            bias_init=bias_init)
        fn = lambda p, x: nnx.merge(graphdef, p)(x)
    else:
        module = RowParallelDense(OUT, scatter=scatter, use_bias=use_bias, bias_init=bias_init)
        params, specs = linen_layer(mesh, module, x)
        fn = module.apply
    y, gp, gx = run(mesh, fn, params, specs, x, P("dp", "tp"), ROW_OUT_SPEC[scatter], cot)
    p = unbox(params)
    g = unbox(gp)
    k, b = p["kernel"], p.get("bias", np.zeros(OUT, np.float32))
    xs = np.asarray(x)
    # Both layouts put the global result x @ k + b together (rows: (dp, tp) row blocks; hidden:
    # dp row blocks x tp column blocks).
    assert y.shape == (ROWS, OUT) and y.dtype == jnp.float32
    assert rel_err(y, xs @ k + b) <= TOL[jnp.float32]
    # The same as psum_scatter with the matching scatter dimension, plus the bias shard.
    sd = 0 if scatter == "rows" else 1

    def plain(p, x):
        y = jax.lax.psum_scatter(x @ p["kernel"], "tp", scatter_dimension=sd, tiled=True)
        if "bias" not in p:
            return y
        n = OUT // 4 if scatter == "hidden" else OUT
        return y + jax.lax.dynamic_slice_in_dim(p["bias"], jax.lax.axis_index("tp") * n if sd else 0, n)

    plain_specs = {"kernel": P("tp", None), **({"bias": P()} if use_bias else {})}
    f_plain = jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=(plain_specs, P("dp", "tp")),
                                    out_specs=ROW_OUT_SPEC[scatter]))
    with jax.set_mesh(mesh):
        y_plain = f_plain(jax.device_put(p, plain_specs), jax.device_put(x, P("dp", "tp")))
    assert rel_err(y, y_plain) <= TOL[jnp.float32]
    # Gradients: dk = x^T c, dx = c k^T, db = sum of c over every row of every rank.
    c = np.asarray(cot)
    assert rel_err(g["kernel"], xs.T @ c) <= TOL[jnp.float32]
    assert rel_err(gx, c @ k.T) <= TOL[jnp.float32]
    if use_bias:
        assert rel_err(g["bias"], c.sum(0)) <= TOL[jnp.float32]


@pytest.mark.parametrize("scatter", ["rows", "hidden"])
def test_row_bias_added_once(mesh, scatter):
    # x = 0: every output element is the bias itself (once, not W = 4 times), on every rank.
    graphdef, params, specs = nnx_layer(mesh, RowParallelLinear, IN, OUT, scatter=scatter, use_bias=True,
                                        bias_init=nnx.initializers.normal(1.0))
    f = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh, in_specs=(specs, P("dp", "tp")),
                              out_specs=ROW_OUT_SPEC[scatter]))
    with jax.set_mesh(mesh):
        y = f(params, jax.device_put(jnp.zeros((ROWS, IN)), P("dp", "tp")))
    bias = np.asarray(params["bias"][...])
    np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(bias, (ROWS, OUT)))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_row_attention_output(mesh, api):
    # The attention output projection: x [T, heads, head_dim] (heads over tp), kernel (heads, head_dim, D).
    heads, head_dim = 8, 4
    x = normal(3, (ROWS, heads, head_dim))
    axes = ("heads", "kv", "embed")
    if api == "nnx":
        graphdef, params, specs = nnx_layer(mesh, RowParallelLinear, (heads, head_dim), OUT, kernel_axes=axes)
        fn = lambda p, x: nnx.merge(graphdef, p)(x)
    else:
        module = RowParallelDense(OUT, contract_dims=2, kernel_axes=axes)
        params, specs = linen_layer(mesh, module, x)
        fn = module.apply
    assert jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)) == [P("tp", None, None)]
    y, gp, _ = run(mesh, fn, params, specs, x, P("dp", "tp", None), P(("dp", "tp"), None), normal(4, (ROWS, OUT)))
    k = unbox(params)["kernel"]
    assert k.shape == (heads, head_dim, OUT)
    assert rel_err(y, np.einsum("the,hed->td", np.asarray(x), k)) <= TOL[jnp.float32]


def test_row_bf16_compute(mesh):
    # fp32 parameters, bf16 compute: output in bf16, the math within bf16 rounding.
    x = normal(5, (ROWS, IN))
    graphdef, params, specs = nnx_layer(mesh, RowParallelLinear, IN, OUT, dtype=jnp.bfloat16, use_bias=True,
                                        bias_init=nnx.initializers.normal(1.0))
    assert params["kernel"][...].dtype == jnp.float32
    y, gp, _ = run(mesh, lambda p, x: nnx.merge(graphdef, p)(x), params, specs, x.astype(jnp.bfloat16),
                   P("dp", "tp"), ROW_OUT_SPEC["rows"], normal(6, (ROWS, OUT)))
    assert y.dtype == jnp.bfloat16 and gp["kernel"][...].dtype == jnp.float32
    p = unbox(params)
    assert rel_err(y, np.asarray(x) @ p["kernel"] + p["bias"]) <= TOL[jnp.bfloat16]


def test_row_config_passed_through(mesh, monkeypatch):
    seen = []
    real = layers.gemm_rs
    monkeypatch.setattr(layers, "gemm_rs", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    cfg = GemmRsConfig(consumer_grid=8, path="xla")
    graphdef, params, specs = nnx_layer(mesh, RowParallelLinear, IN, OUT, config=cfg, scatter="hidden")
    run(mesh, lambda p, x: nnx.merge(graphdef, p)(x), params, specs, normal(1, (ROWS, IN)), P("dp", "tp"),
        ROW_OUT_SPEC["hidden"], normal(2, (ROWS, OUT)))
    assert seen and all(kw["config"] is cfg and kw["axis_name"] == "tp" and kw["scatter_dimension"] == -1
                        for kw in seen)


# ---------------------------------------------------------------- column-parallel

# gather -> (x global shape, x spec, output spec, the all-gather's dim): the layouts a row-parallel
# layer leaves behind, and the column-parallel output (features over tp).
COL_CASES = {
    None: ((ROWS, IN), P("dp", None), P("dp", "tp"), None),
    "rows": ((ROWS, IN), P(("dp", "tp"), None), P("dp", "tp"), 0),
    "sequence": ((2, ROWS // 2, IN), P("dp", "tp", None), P("dp", None, "tp"), 1),
    "hidden": ((ROWS, IN), P("dp", "tp"), P("dp", "tp"), 1),
}


def plain_column(gather):
    """The column-parallel layer in plain XLA: all_gather (tiled) then a dot, on a {kernel, bias} dict."""
    dim = COL_CASES[gather][3]

    def fn(p, x):
        if gather is not None:
            x = jax.lax.all_gather(x, "tp", axis=dim, tiled=True)
        return jnp.einsum("...i,io->...o", x, p["kernel"]) + p["bias"]
    return fn, {"kernel": P(None, "tp"), "bias": P("tp")}


@pytest.mark.parametrize("gather", [None, "rows", "sequence", "hidden"], ids=str)
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_column_parallel(mesh, api, gather):
    x_shape, x_spec, out_spec, _ = COL_CASES[gather]
    x = normal(7, x_shape)
    cot = normal(8, x_shape[:-1] + (OUT,))
    if api == "nnx":
        graphdef, params, specs = nnx_layer(mesh, ColumnParallelLinear, IN, OUT, gather=gather, use_bias=True,
                                            bias_init=nnx.initializers.normal(1.0))
        fn = lambda p, x: nnx.merge(graphdef, p)(x)
    else:
        module = ColumnParallelDense(OUT, gather=gather, use_bias=True, bias_init=nn.initializers.normal(1.0))
        params, specs = linen_layer(mesh, module, x)
        fn = module.apply
    assert jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)) == [P("tp"), P(None, "tp")]
    y, gp, gx = run(mesh, fn, params, specs, x, x_spec, out_spec, cot)
    p, g = unbox(params), unbox(gp)
    xs, c = np.asarray(x).reshape(-1, IN), np.asarray(cot).reshape(-1, OUT)
    assert y.shape == x_shape[:-1] + (OUT,) and y.dtype == jnp.float32
    assert rel_err(y, (xs @ p["kernel"] + p["bias"]).reshape(y.shape)) <= TOL[jnp.float32]
    assert rel_err(g["kernel"], xs.T @ c) <= TOL[jnp.float32]
    assert rel_err(g["bias"], c.sum(0)) <= TOL[jnp.float32]
    assert rel_err(gx, (c @ p["kernel"].T).reshape(x_shape)) <= TOL[jnp.float32]
    # The same as all_gather + dot in plain XLA, forward and gradients.
    plain, plain_specs = plain_column(gather)
    with jax.set_mesh(mesh):
        plain_params = jax.device_put(p, plain_specs)
    y_plain, gp_plain, gx_plain = run(mesh, plain, plain_params, plain_specs, x, x_spec, out_spec, cot)
    assert rel_err(y, y_plain) <= TOL[jnp.float32]
    assert rel_err(gx, gx_plain) <= TOL[jnp.float32]
    for name in ("kernel", "bias"):
        assert rel_err(g[name], gp_plain[name]) <= TOL[jnp.float32]


@pytest.mark.parametrize("gather", ["rows", "sequence", "hidden"])
def test_column_parallel_uses_ag_gemm(mesh, monkeypatch, gather):
    # Every gather mode is one ag_gemm (its gather_dimension the split dim, the config passed through);
    # gather=None calls none.
    seen = []
    real = layers.ag_gemm
    monkeypatch.setattr(layers, "ag_gemm", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    cfg = AgGemmConfig(block_n=128, path="xla")
    for g, config, calls in ((gather, cfg, 1), (None, None, 0)):
        seen.clear()
        graphdef, params, specs = nnx_layer(mesh, ColumnParallelLinear, IN, OUT, gather=g, config=config)
        shape, in_spec, y_spec, _ = COL_CASES[g]
        f = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh, in_specs=(specs, in_spec),
                                  out_specs=y_spec))
        with jax.set_mesh(mesh):
            f(params, jax.device_put(jnp.ones(shape), in_spec))
        assert len(seen) == calls
        if calls:
            assert seen[0]["config"] is cfg and seen[0]["axis_name"] == "tp"
            assert seen[0]["gather_dimension"] == {"rows": 0, "sequence": 1, "hidden": -1}[gather]


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_column_parallel_heads_bf16(mesh, api):
    # q/k/v: kernel [D, heads, head_dim] (heads over tp), bf16 compute with fp32 parameters, the
    # input sequence-sharded: ag_gemm on the kernel flattened to [D, heads/W * head_dim].
    heads, head_dim = 8, 4
    x = normal(13, (ROWS, IN))
    axes = ("embed", "heads", "kv")
    if api == "nnx":
        graphdef, params, specs = nnx_layer(mesh, ColumnParallelLinear, IN, (heads, head_dim), gather="rows",
                                            kernel_axes=axes, dtype=jnp.bfloat16)
        fn = lambda p, x: nnx.merge(graphdef, p)(x)
    else:
        module = ColumnParallelDense((heads, head_dim), gather="rows", kernel_axes=axes, dtype=jnp.bfloat16)
        params, specs = linen_layer(mesh, module, x)
        fn = module.apply
    out_spec = P("dp", "tp", None)
    y, gp, gx = run(mesh, fn, params, specs, x.astype(jnp.bfloat16), P(("dp", "tp"), None), out_spec,
                    normal(14, (ROWS, heads, head_dim)))
    k = unbox(params)["kernel"]
    assert y.shape == (ROWS, heads, head_dim) and y.dtype == jnp.bfloat16 and gx.dtype == jnp.bfloat16
    assert unbox(gp)["kernel"].dtype == np.float32
    assert rel_err(y, np.einsum("td,dhe->the", np.asarray(x), k)) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("gather", ["rows", "hidden"])
def test_concatenated_kernels_one_gather(mesh, monkeypatch, gather):
    # The module docstring's recipe: gate and up as one ag_gemm on their local kernels concatenated
    # on the output features, split after: the same values and gradients as two calls.
    seen = []
    real = layers.ag_gemm
    monkeypatch.setattr(layers, "ag_gemm", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    x_shape, x_spec, out_spec, _ = COL_CASES[gather]
    x, cot = normal(15, x_shape), normal(16, x_shape[:-1] + (OUT,))
    with jax.set_mesh(mesh):
        kernels = jax.device_put({"gate": normal(17, (IN, OUT)), "up": normal(18, (IN, OUT))}, P(None, "tp"))

    def separate(p, x):
        g = layers.column_parallel_linear(x, p["gate"], gather=gather)
        return jax.nn.silu(g) * layers.column_parallel_linear(x, p["up"], gather=gather)

    def fused(p, x):
        g, u = jnp.split(layers.column_parallel_linear(x, jnp.concatenate([p["gate"], p["up"]], axis=1),
                                                       gather=gather), 2, axis=-1)
        return jax.nn.silu(g) * u

    specs = {"gate": P(None, "tp"), "up": P(None, "tp")}
    y1, g1, gx1 = run(mesh, separate, kernels, specs, x, x_spec, out_spec, cot)
    calls = len(seen)
    y2, g2, gx2 = run(mesh, fused, kernels, specs, x, x_spec, out_spec, cot)
    assert calls == 2 and len(seen) - calls == 1
    assert rel_err(y2, y1) <= TOL[jnp.float32] and rel_err(gx2, gx1) <= TOL[jnp.float32]
    for name in ("gate", "up"):
        assert rel_err(g2[name], g1[name]) <= TOL[jnp.float32]


def test_linen_mlp_block(mesh):
    # A sequence-parallel SwiGLU MLP in Linen: [T/tp, D] -> gather -> gate/up -> down -> [T/tp, D].
    d, f = IN, 64

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            gate = ColumnParallelDense(f, gather="rows", name="gate")
            up = ColumnParallelDense(f, gather="rows", name="up")
            return RowParallelDense(d, name="down")(jax.nn.silu(gate(x)) * up(x))

    x = normal(9, (ROWS, d))
    params, specs = linen_layer(mesh, MLP(), x)
    y, _, _ = run(mesh, MLP().apply, params, specs, x, P(("dp", "tp"), None), P(("dp", "tp"), None),
                  normal(10, (ROWS, d)))
    p = {k: np.asarray(nn.unbox(v)["kernel"]) for k, v in params["params"].items()}
    xs = np.asarray(x)
    ref = (np.asarray(jax.nn.silu(xs @ p["gate"])) * (xs @ p["up"])) @ p["down"]
    assert rel_err(y, ref) <= TOL[jnp.float32]


# ---------------------------------------------------------------- metadata and partition_specs

def test_nnx_metadata_and_specs(mesh):
    _, state, specs = nnx_layer(mesh, RowParallelLinear, IN, OUT, use_bias=True)
    assert state["kernel"].get_metadata()["out_sharding"] == ("mlp", "embed")
    assert state["bias"].get_metadata()["out_sharding"] == ("embed",)
    assert specs["kernel"] == P("tp", None) and specs["bias"] == P(None)
    # Eager sharding under the mesh and the rules placed the parameters as the specs say.
    assert state["kernel"][...].sharding.spec == P("tp", None)
    # Flax's own API gives the same specs.
    with nnx.logical_axis_rules(RULES):
        flax_specs = nnx.get_partition_spec(state)
    assert flax_specs["kernel"].get_value() == specs["kernel"]
    _, col_state, col_specs = nnx_layer(mesh, ColumnParallelLinear, IN, (4, 6), kernel_axes=("embed", "heads", "kv"))
    assert col_specs["kernel"] == P(None, "tp", None)
    # Rules as a dict, and a different mapping (e.g. MaxText's "tensor" axis name).
    assert partition_specs(state, {"mlp": "tensor", "embed": None})["kernel"] == P("tensor", None)


def test_linen_metadata_and_specs():
    x = jnp.ones((ROWS, IN))
    variables = RowParallelDense(OUT, use_bias=True).init(jax.random.key(0), x)
    assert nn.get_partition_spec(variables)["params"]["kernel"] == P("mlp", "embed")
    specs = partition_specs(variables)
    assert specs == {"params": {"kernel": P("tp", None), "bias": P(None)}}
    assert nn.logical_to_mesh(nn.get_partition_spec(variables), RULES) == specs
    # Plain arrays and Linen's nn.Partitioned (mesh axes already) pass through.
    assert partition_specs({"a": jnp.ones(3), "b": nn.Partitioned(jnp.ones((4, 2)), ("tp", None))}) == {
        "a": P(), "b": P("tp", None)}


def test_partition_specs_errors():
    variables = RowParallelDense(OUT).init(jax.random.key(0), jnp.ones((ROWS, IN)))
    with pytest.raises(ValueError, match=r"\['params'\]\['kernel'\] has logical axes \('mlp', 'embed'\); no rule "
                                         r"for \['mlp'\]"):
        partition_specs(variables, [("embed", None)])
    with pytest.raises(ValueError, match=r"has logical axes \('mlp', 'mlp'\); \['mlp'\] name more than one dim"):
        partition_specs({"k": nn.LogicallyPartitioned(jnp.ones((2, 2)), ("mlp", "mlp"))}, RULES)
    with pytest.raises(ValueError, match=r"rules must be a mapping or a sequence of \(logical axis name, mesh axis"):
        partition_specs(variables, [("mlp",)])
    with pytest.raises(ValueError, match=r"rules must be"):
        partition_specs(variables, {"mlp": 3})


def test_partition_specs_rule_fallback():
    """A rule whose mesh axis another dim already took is skipped for the next rule of that name, as
    in Flax; MaxText's rules (lists of axes) for its MLP and attention-output kernels."""
    variables = RowParallelDense(OUT).init(jax.random.key(0), jnp.ones((ROWS, IN)))
    # embed's only rule is blocked by mlp: replicated, as nn.logical_to_mesh_axes says.
    assert partition_specs(variables, {"mlp": "tp", "embed": "tp"})["params"]["kernel"] == P("tp", None)
    maxtext_rules = [  # excerpt of MaxText 0.2.5's base.yml, in its order
        ["heads", ["tensor", "tensor_sequence", "autoregressive"]],
        ["kv", []],
        ["embed_attn", ["fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert"]],
        ["mlp", ["fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"]],
        ["embed", ["fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert"]],
        ["embed", ["fsdp", "context", "context_usp_ulysses", "expert"]],
    ]
    tree = {"wo": nn.LogicallyPartitioned(jnp.ones((4, 2)), ("mlp", "embed")),
            "out": nn.LogicallyPartitioned(jnp.ones((4, 2, 2)), ("heads", "kv", "embed_attn"))}
    specs = partition_specs(tree, maxtext_rules)
    assert specs["wo"] == P(("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"),
                            ("fsdp", "context", "context_usp_ulysses", "expert"))
    assert specs["out"] == P(("tensor", "tensor_sequence", "autoregressive"), None,
                             ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert"))
    flax_rules = [(n, tuple(a) if a else None) for n, a in maxtext_rules]
    for key, box in tree.items():
        assert specs[key] == nn.logical_to_mesh_axes(box.names, flax_rules)


# ---------------------------------------------------------------- sequence parallelism over dim 1

@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_sequence_parallel_round_trip(mesh, api):
    # [B, S, D]: gather="sequence" (all-gather over S) -> column-parallel -> row-parallel
    # scatter="sequence" (reduce-scatter over S): forward and gradients against the unsharded math.
    b, s, d, f = 2, 16, 24, 32
    x = normal(11, (b, s, d))
    cot = normal(12, (b, s, d))
    if api == "nnx":
        g_up, p_up, s_up = nnx_layer(mesh, ColumnParallelLinear, d, f, gather="sequence", use_bias=True,
                                     bias_init=nnx.initializers.normal(1.0))
        g_dn, p_dn, s_dn = nnx_layer(mesh, RowParallelLinear, f, d, scatter="sequence", use_bias=True,
                                     bias_init=nnx.initializers.normal(1.0))
        params, specs = {"up": p_up, "down": p_dn}, {"up": s_up, "down": s_dn}
        fn = lambda p, x: nnx.merge(g_dn, p["down"])(nnx.merge(g_up, p["up"])(x))
    else:
        up = ColumnParallelDense(f, gather="sequence", use_bias=True, bias_init=nn.initializers.normal(1.0))
        down = RowParallelDense(d, scatter="sequence", use_bias=True, bias_init=nn.initializers.normal(1.0))
        p_up, s_up = linen_layer(mesh, up, x)
        p_dn, s_dn = linen_layer(mesh, down, jnp.ones((b, s, f)))
        params, specs = {"up": p_up, "down": p_dn}, {"up": s_up, "down": s_dn}
        fn = lambda p, x: down.apply(p["down"], up.apply(p["up"], x))
    seq = P("dp", "tp", None)  # [B, S/W, D] per rank: what both ends of the block hold
    y, gp, gx = run(mesh, fn, params, specs, x, seq, seq, cot)
    pu, pd = unbox(params["up"]), unbox(params["down"])
    xs, c = np.asarray(x), np.asarray(cot)
    h = xs @ pu["kernel"] + pu["bias"]
    assert y.shape == (b, s, d)
    assert rel_err(y, h @ pd["kernel"] + pd["bias"]) <= TOL[jnp.float32]
    gd, gu = unbox(gp["down"]), unbox(gp["up"])
    assert rel_err(gd["kernel"], h.reshape(-1, f).T @ c.reshape(-1, d)) <= TOL[jnp.float32]
    assert rel_err(gd["bias"], c.sum((0, 1))) <= TOL[jnp.float32]
    ch = c @ pd["kernel"].T
    assert rel_err(gu["kernel"], xs.reshape(-1, d).T @ ch.reshape(-1, f)) <= TOL[jnp.float32]
    assert rel_err(gx, ch @ pu["kernel"].T) <= TOL[jnp.float32]


def test_sequence_scatter_asks_gemm_rs_for_dim_1(mesh, monkeypatch):
    seen = []
    real = layers.gemm_rs
    monkeypatch.setattr(layers, "gemm_rs", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    graphdef, params, specs = nnx_layer(mesh, RowParallelLinear, IN, OUT, scatter="sequence")
    f = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh,
                              in_specs=(specs, P("dp", None, "tp")), out_specs=P("dp", "tp", None)))
    with jax.set_mesh(mesh):
        y = f(params, jax.device_put(jnp.ones((2, 8, IN)), P("dp", None, "tp")))
    assert y.shape == (2, 8, OUT) and seen and all(kw["scatter_dimension"] == 1 for kw in seen)


# ---------------------------------------------------------------- bad arguments

CTOR_ERRORS = [
    (RowParallelLinear, (IN, OUT), dict(scatter="cols"), r"RowParallelLinear: scatter must be one of \('rows', "
                                                         r"'sequence', 'hidden'\), got 'cols'"),
    (RowParallelLinear, (0, OUT), {}, r"RowParallelLinear: in_features must be a positive int .*got 0"),
    (RowParallelLinear, (IN, (4, 6)), {}, r"out_features must be a positive int, got \(4, 6\)"),
    (RowParallelLinear, (IN, OUT), dict(dtype=jnp.int32),
     r"dtype must be bfloat16, float16, float32 or None, got int32"),
    (RowParallelLinear, (IN, OUT), dict(param_dtype=jnp.int8), r"param_dtype must be a floating dtype, got int8"),
    (RowParallelLinear, (IN, OUT), dict(config={"path": "xla"}), r"config must be an entwine_jax.GemmRsConfig or None, "
                                                                  r"got dict"),
    (RowParallelLinear, (IN, OUT), dict(kernel_axes=("mlp",)), r"kernel_axes must be a tuple of 2 logical axis names"),
    (RowParallelLinear, ((8, 4), OUT), {}, r"kernel_axes is required when in_features is a tuple \(\(8, 4\)\)"),
    (RowParallelLinear, (IN, OUT), dict(axis_name=3), r"axis_name must be a mesh axis name \(str\)"),
    (RowParallelLinear, (IN, OUT), dict(use_bias="yes"), r"use_bias must be one of \(True, False\), got 'yes'"),
    (ColumnParallelLinear, (IN, OUT), dict(gather="cols"), r"ColumnParallelLinear: gather must be one of \(None, "
                                                           r"'rows', 'sequence', 'hidden'\), got 'cols'"),
    (ColumnParallelLinear, (IN, (4, 6)), {}, r"kernel_axes is required when out_features is a tuple"),
    (ColumnParallelLinear, (IN, OUT), dict(gather="rows", config=GemmRsConfig()),
     r"ColumnParallelLinear: config must be an entwine_jax.AgGemmConfig or None, got GemmRsConfig"),
]


@pytest.mark.parametrize("cls, args, kwargs, match", CTOR_ERRORS, ids=[m[:40] for *_, m in CTOR_ERRORS])
def test_constructor_errors(cls, args, kwargs, match):
    with nnx.use_eager_sharding(False), pytest.raises(ValueError, match=match):
        cls(*args, rngs=nnx.Rngs(0), **kwargs)


def trace_local(mesh, fn, params, specs, x_shape, x_spec):
    """Trace fn under shard_map (no compile) with global params and an x of x_shape."""
    f = jax.shard_map(fn, mesh=mesh, in_specs=(specs, x_spec), out_specs=P())
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32, sharding=jax.sharding.NamedSharding(mesh, x_spec))
    with jax.set_mesh(mesh):
        jax.eval_shape(f, params, x)


def test_call_errors(mesh):
    graphdef, params, specs = nnx_layer(mesh, RowParallelLinear, IN, OUT)
    fn = lambda p, x: nnx.merge(graphdef, p)(x)
    # The kernel replicated instead of split over tp (in_specs not from partition_specs).
    with jax.set_mesh(mesh):
        replicated = jax.device_put(params, P())
    with pytest.raises(ValueError, match=r"RowParallelLinear: the kernel arrived with local shape \(32, 24\), expected "
                                         r"\(8, 24\) \(global \(32, 24\) with dim 0 split over 'tp' of size 4\)"):
        trace_local(mesh, fn, replicated, P(), (ROWS, IN), P("dp", "tp"))
    # x not split over tp along its features.
    with pytest.raises(ValueError, match=r"the last 1 dim\(s\) of x must equal the kernel's contracted dims "
                                         r"\(8,\), got x shape \(8, 32\)"):
        trace_local(mesh, fn, params, specs, (ROWS, IN), P("dp", None))
    # Rows not divisible by tp.
    with pytest.raises(ValueError, match=r"scatter='rows' splits x's leading dim over 'tp' \(size 4\); .*got x shape "
                                         r"\(6, 8\)"):
        trace_local(mesh, fn, params, specs, (12, IN), P("dp", "tp"))
    # Outside shard_map.
    model = nnx.merge(graphdef, params)
    with pytest.raises(ValueError, match=r"axis_name 'tp' is not bound; call the layer inside jax.shard_map"):
        model(jnp.ones((ROWS, IN)))
    # Linen: a parameter of the wrong shard shape.
    variables = RowParallelDense(OUT).init(jax.random.key(0), jnp.ones((ROWS, IN)))
    with pytest.raises(ValueError, match=r"RowParallelDense: parameter 'kernel' arrived with shape \(32, 24\), "
                                         r"expected \(8, 24\)"):
        trace_local(mesh, RowParallelDense(OUT).apply, variables, P(), (ROWS, IN), P("dp", "tp"))


def test_functional_errors(mesh):
    k = jnp.ones((IN // 4, OUT))
    with pytest.raises(ValueError, match=r"row_parallel_linear: bias must have shape \(24,\) \(all output features, "
                                         r"replicated over 'tp'\), got \(6,\)"):
        trace_local(mesh, lambda p, x: layers.row_parallel_linear(x, k, jnp.ones(OUT // 4)), {}, {}, (ROWS, IN),
                    P("dp", "tp"))
    with pytest.raises(ValueError, match=r"scatter='hidden' splits the output features \(22\) over 'tp'; they must be "
                                         r"divisible by its size 4"):
        trace_local(mesh, lambda p, x: layers.row_parallel_linear(x, jnp.ones((IN // 4, 22)), scatter="hidden"),
                    {}, {}, (ROWS, IN), P("dp", "tp"))
    with pytest.raises(ValueError, match=r"scatter='sequence' splits x's dim 1 over 'tp' \(size 4\); x needs a batch "
                                         r"dim, that dim and 1 contracted dim\(s\), .*got x shape \(8, 8\)"):
        trace_local(mesh, lambda p, x: layers.row_parallel_linear(x, k, scatter="sequence"), {}, {}, (ROWS, IN),
                    P("dp", "tp"))
    with pytest.raises(ValueError, match=r"scatter='sequence' .*dim 1 divisible by 4, got x shape \(1, 6, 8\)"):
        trace_local(mesh, lambda p, x: layers.row_parallel_linear(x, k, scatter="sequence"), {}, {}, (2, 6, IN),
                    P("dp", None, "tp"))
    with pytest.raises(ValueError, match=r"column_parallel_linear: x must have rank >= 3 for gather='sequence', got "
                                         r"shape \(8, 32\)"):
        trace_local(mesh, lambda p, x: layers.column_parallel_linear(x, jnp.ones((IN, 6)), gather="sequence"), {},
                    {}, (ROWS, IN), P("dp", None))
    with pytest.raises(ValueError, match=r"column_parallel_linear: x.shape\[-1\] must equal kernel.shape\[0\] \(32\), "
                                         r"got x shape \(32, 8\) after the all-gather"):
        trace_local(mesh, lambda p, x: layers.column_parallel_linear(x, jnp.ones((IN, 6)), gather="rows"), {}, {},
                    (ROWS, IN), P("dp", "tp"))
    with pytest.raises(ValueError, match=r"ColumnParallelDense: config must be an entwine_jax.AgGemmConfig or None, "
                                         r"got GemmRsConfig"):
        ColumnParallelDense(OUT, gather="rows", config=GemmRsConfig()).init(jax.random.key(0), jnp.ones((ROWS, IN)))



def test_column_parallel_group_checks_its_layers():
    rngs = nnx.Rngs(0)
    with nnx.use_eager_sharding(False):
        gate = ColumnParallelLinear(8, 16, gather="rows", rngs=rngs)
        other = ColumnParallelLinear(8, 16, gather="hidden", rngs=rngs)
    with pytest.raises(ValueError, match=r"column_parallel_group: modules\[1\] differs from modules\[0\] in "
                                         r"\['gather'\]"):
        layers.column_parallel_group(jnp.zeros((4, 8)), (gate, other))
    with pytest.raises(ValueError, match="non-empty sequence of ColumnParallelLinear"):
        layers.column_parallel_group(jnp.zeros((4, 8)), ())
    with pytest.raises(ValueError, match=r"bias must be None or a tuple of 2"):
        layers.column_parallel_linear(jnp.zeros((4, 8)), (jnp.zeros((8, 4)), jnp.zeros((8, 4))), jnp.zeros(4))
