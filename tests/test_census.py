# entwine_jax.census on 8 fake CPU devices: hand-computed bytes for each collective kind, a
# collective the partitioner inserts, a scanned loop's trip count, gemm_rs / ag_gemm (forward and
# backward) attributed to the ops, abstract-shape inputs, the errors, and a plain, a routed bf16 and a
# routed FP8 program checked against an independent count from their compiled HLO.
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import census


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip(f"needs 8 devices, found {len(jax.devices())}")
    return jax.make_mesh((2, 4), ("dp", "tp"), (AxisType.Explicit,) * 2)


def _spec(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _one(c: census.Census) -> census.Collective:
    assert len(c) == 1, c.table()
    return c.collectives[0]


# Each case: a shard_map body over tp (W = 4) on a local block x [8, 8] of float32 (256 B), and
# (kind, axes, bytes per device) computed by hand from the module's formulas.
CASES = {
    "all_gather": (lambda x: jax.lax.all_gather(x, "tp", axis=0, tiled=True), "all-gather", ("tp",), 3 * 256),
    "psum_scatter": (lambda x: jax.lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True), "reduce-scatter",
                     ("tp",), 3 * 256 // 4),
    "psum": (lambda x: jax.lax.psum(x, "tp"), "all-reduce", ("tp",), 2 * 3 * 256 // 4),
    "psum_dp_tp": (lambda x: jax.lax.psum(x, ("dp", "tp")), "all-reduce", ("dp", "tp"), 2 * 7 * 256 // 8),
    "ppermute": (lambda x: jax.lax.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]), "collective-permute",
                 ("tp",), 256),
    "all_to_all": (lambda x: jax.lax.all_to_all(x, "tp", 0, 1, tiled=True), "all-to-all", ("tp",), 3 * 256 // 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hand_computed_bytes(mesh, name):
    body, kind, axes, nbytes = CASES[name]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"), check_vma=False))
    c = census.collectives(f, _spec(mesh, (16, 32), P("dp", "tp")))
    col = _one(c)
    assert (col.kind, col.axes, col.owner, col.custom_call, col.bytes, col.count) == (kind, axes, "xla", False,
                                                                                    nbytes, 1)
    assert c.bytes == nbytes and c.count == 1
    assert c.totals("owner") == {"xla": (1, nbytes)}
    assert c.totals("axes") == {"+".join(axes): (1, nbytes)}
    line = [l for l in c.table().splitlines() if l.startswith("xla ")]
    assert len(line) == 1 and kind in line[0] and "+".join(axes) in line[0]


def test_bf16_keeps_its_dtype_on_cpu(mesh):
    """The CPU compiler runs collectives in f32; the census counts the bf16 the program asks for."""
    def body(x):
        return jax.lax.psum(jax.lax.all_gather(x, "tp", axis=0, tiled=True), "tp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", None), check_vma=False))
    c = census.collectives(f, _spec(mesh, (16, 32), P("dp", "tp"), jnp.bfloat16))
    gather, reduce = (_one(c.select(kind=k)) for k in ("all-gather", "all-reduce"))
    assert (gather.shape, gather.bytes) == ("bf16[8,8]", 3 * 128)
    assert (reduce.shape, reduce.bytes) == ("bf16[32,8]", 2 * 3 * 512 // 4)


def test_partitioner_inserted_collective(mesh):
    """Automatic sharding: the contraction over tp needs a reduction the partitioner inserts; XLA
    prints its groups with its own axis names (or as iota), matched here against the mesh."""
    auto = jax.make_mesh((2, 4), ("dp", "tp"), (AxisType.Auto,) * 2)
    x, w = _spec(auto, (16, 64), P("dp", "tp")), _spec(auto, (64, 32), P("tp", None))
    for out in (P("dp", None), P(("dp", "tp"), None)):
        f = jax.jit(lambda x, w: jnp.tanh(x @ w), out_shardings=NamedSharding(auto, out))
        col = _one(census.collectives(f, x, w))
        # The [8, 32] float32 partial product (1 KiB), all-reduced over tp.
        assert (col.kind, col.axes, col.group_size, col.bytes, col.owner) == ("all-reduce", ("tp",), 4,
                                                                              2 * 3 * 1024 // 4, "xla")
    # The same program as text, without a mesh: the groups, by size.
    text = jax.jit(lambda x, w: jnp.tanh(x @ w), out_shardings=NamedSharding(auto, P("dp", None))).lower(
        x, w).compile().as_text()
    col = _one(census.collectives(text))
    assert col.axes is None and col.group == "groups of size 4"
    assert _one(census.collectives(text, mesh=auto)).axes == ("tp",)


def test_scan_trip_count(mesh):
    def step(c, w):
        return jax.lax.all_gather(c @ w, "tp", axis=1, tiled=True), None

    def body(c, ws):
        return jax.lax.scan(step, c, ws)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, None, "tp")), out_specs=P(), check_vma=False))
    c = census.collectives(f, jax.ShapeDtypeStruct((8, 16), jnp.float32),
                           _spec(mesh, (5, 16, 16), P(None, None, "tp")))
    (loop,) = c.loops
    assert loop.trip_count == 5 and loop.parent is None and "while" in loop.op_name
    col = _one(c)
    # c @ w is [8, 4] float32 (128 B) per device: 3 x 128 B per gather, 5 gathers per step.
    assert (col.kind, col.count, col.bytes, col.loops) == ("all-gather", 5, 3 * 128, (loop.body,))
    assert c.bytes == 5 * 3 * 128
    one = c.per_iteration(loop)
    assert one.count == 1 and one.bytes == 3 * 128
    assert c.per_iteration(loop.body).bytes == one.bytes
    assert len(c.select(loop=loop)) == 1


def _mlp(mesh, dtype=jnp.float32):
    mesh = jax.make_mesh(mesh.axis_sizes, mesh.axis_names, (AxisType.Auto,) * 2)
    def loss(x, w1, w2):
        h = entwine_jax.ag_gemm(x, w1, axis_name="tp")
        y = entwine_jax.gemm_rs(jnp.tanh(h), w2, axis_name="tp")
        return jax.lax.psum(jnp.sum(jnp.square(y.astype(jnp.float32))), "tp")

    island = jax.shard_map(loss, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P())
    args = (_spec(mesh, (32, 16), P("tp", None), dtype), _spec(mesh, (16, 64), P(None, "tp"), dtype),
            _spec(mesh, (64, 16), P("tp", None), dtype))
    return island, args


def test_ops_are_attributed(mesh):
    island, args = _mlp(mesh)
    c = census.collectives(jax.jit(island), *args)
    gather, scatter = _one(c.select(owner="ag_gemm")), _one(c.select(owner="gemm_rs"))
    # On CPU the ops run their references: ag_gemm gathers x [8, 16] (512 B), gemm_rs reduce-scatters
    # its fp32 product [32, 16] (2 KiB), over tp, not as custom calls.
    assert (gather.kind, gather.axes, gather.bytes, gather.custom_call) == ("all-gather", ("tp",), 3 * 512, False)
    assert (scatter.kind, scatter.axes, scatter.bytes, scatter.custom_call) == ("reduce-scatter", ("tp",),
                                                                                3 * 2048 // 4, False)
    # The loss' psum is XLA's own.
    assert c.select(owner="xla").counts("kind") == {"all-reduce": 1}
    assert not c.select(custom_call=True)


def test_backward_is_attributed(mesh):
    island, args = _mlp(mesh)
    c = census.collectives(jax.jit(jax.grad(island, argnums=(0, 1, 2))), *args)
    # Forward ag_gemm + gemm_rs; backward: gemm_rs' dx is an ag_gemm, ag_gemm's dx a gemm_rs.
    assert c.select(owner="ag_gemm", kind="all-gather").count == 2
    assert c.select(owner="gemm_rs", kind="reduce-scatter").count == 2
    assert c.select(scope="transpose(jvp())", owner="ag_gemm").count >= 1
    assert all(col.axes == ("tp",) for col in c.select(owner=("ag_gemm", "gemm_rs")))
    # No XLA collective over tp outside a given scope.
    assert not c.select(owner="xla", axis="tp", kind=("all-gather", "reduce-scatter"))


def test_abstract_shapes_and_lowered_compiled(mesh):
    """ShapeDtypeStructs (nothing allocated), a Lowered and a Compiled give the same census."""
    island, args = _mlp(mesh, jnp.bfloat16)
    lowered = jax.jit(island).lower(*args)
    from_fn = census.collectives(island, *args)
    from_lowered = census.collectives(lowered)
    assert from_fn.collectives == from_lowered.collectives
    assert from_fn.mesh_axes == (("dp", 2), ("tp", 4))
    from_compiled = census.collectives(lowered.compile())
    assert [c.owner for c in from_compiled] == [c.owner for c in from_fn]


def test_fused_custom_calls_are_read_from_text():
    """A GPU compile's custom calls (this machine has no GPU: a hand-written module in the form XLA
    prints): gemm_rs [4 x 64 rows, 32] -> [64, 16] rows over W = 4; ag_gemm gathers x [64, 32]."""
    text = """HloModule jit_step, num_partitions=8
ENTRY %main (x: bf16[256,32], w: bf16[32,16], a: bf16[64,32], b: bf16[32,48]) -> bf16[64,16] {
  %x = bf16[256,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %a = bf16[64,32]{1,0} parameter(2)
  %b = bf16[32,48]{1,0} parameter(3)
  %rs = bf16[64,16]{1,0} custom-call(%x, %w), custom_call_target="entwine_gemm_rs", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/entwine_gemm_rs/ffi_call"}, backend_config={comm_id = 7 : i64, scatter_dimension = 0 : i64}
  %ag = (bf16[256,48]{1,0}, bf16[0]{0}) custom-call(%a, %b), custom_call_target="entwine_ag_gemm", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/entwine_ag_gemm/ffi_call"}, backend_config={comm_id = 7 : i64, gather_k = false}
  ROOT %r = bf16[64,16]{1,0} add(%rs, %rs)
}
"""
    mesh = jax.sharding.AbstractMesh((2, 4), ("dp", "tp"))
    c = census.collectives(text, mesh=mesh)
    assert c.select(custom_call=True).counts("owner") == {"ag_gemm": 1, "gemm_rs": 1}
    rs, ag = _one(c.select(owner="gemm_rs")), _one(c.select(owner="ag_gemm"))
    assert (rs.kind, rs.group_size, rs.axes, rs.bytes) == ("reduce-scatter", 4, ("tp",), 3 * 64 * 16 * 2)
    assert (ag.kind, ag.group_size, ag.axes, ag.bytes) == ("all-gather", 4, ("tp",), 3 * 64 * 32 * 2)
    assert "(custom call)" in c.table()


def test_fp8_custom_calls_are_read_from_text():
    """The FP8 targets (weights transposed, [N, K]): gemm_rs over columns, y [64, 16] of N = 64 over W = 4
    (the bf16 output's bytes); ag_gemm gathering K slices of an e4m3 x [64, 32] (one byte each) with its scale."""
    text = """HloModule jit_step, num_partitions=8
ENTRY %main (x: f8e4m3fn[64,32], w: f8e4m3fn[64,32], a: f8e4m3fn[64,32], b: f8e4m3fn[48,128], s: f32[1]) -> bf16[64,16] {
  %x = f8e4m3fn[64,32]{1,0} parameter(0)
  %w = f8e4m3fn[64,32]{1,0} parameter(1)
  %a = f8e4m3fn[64,32]{1,0} parameter(2)
  %b = f8e4m3fn[48,128]{1,0} parameter(3)
  %s = f32[1]{0} parameter(4)
  %rs = bf16[64,16]{1,0} custom-call(%x, %w, %s, %s), custom_call_target="entwine_gemm_rs_fp8", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/entwine_gemm_rs/ffi_call"}, backend_config={comm_id = 7 : i64, scatter_dimension = 1 : i64}
  %ag = (bf16[64,48]{1,0}, f8e4m3fn[0]{0}, f32[4]{0}) custom-call(%a, %b, %s, %s), custom_call_target="entwine_ag_gemm_fp8", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/entwine_ag_gemm/ffi_call"}, backend_config={comm_id = 7 : i64, gather_k = true, shared_scale = false}
  ROOT %r = bf16[64,16]{1,0} add(%rs, %rs)
}
"""
    c = census.collectives(text, mesh=jax.sharding.AbstractMesh((2, 4), ("dp", "tp")))
    rs, ag = _one(c.select(owner="gemm_rs")), _one(c.select(owner="ag_gemm"))
    assert (rs.kind, rs.group_size, rs.axes, rs.bytes) == ("reduce-scatter", 4, ("tp",), 3 * 64 * 16 * 2)
    # Each rank's x_scale travels with its shard (shared_scale false): 4 more bytes per peer.
    assert (ag.kind, ag.group_size, ag.axes, ag.bytes) == ("all-gather", 4, ("tp",), 3 * 64 * 32 * 1 + 3 * 4)


def test_moe_custom_calls_are_read_from_text():
    """The MoE targets over W = 4 (E_local 2, C 128): the dispatch kernel (and its FP8 twin, e4m3 rows)
    sends 3/4 of x_send [8, 128, 32] (one destination's share, 2 x 128 x 32, to each of 3 peers); the
    combine kernel (and its FP8 twin, rows in its f16 output) sends each source its 2 x 128 rows of
    o_recv [8, 128, 16]; moe_transfer is the
    combine's unless a moves() scope of the dispatch encloses it (the backward's router weights, f32
    [8, 128])."""
    text = """HloModule jit_step, num_partitions=8
ENTRY %main (x: bf16[8,128,32], w: bf16[2,32,64], o: bf16[8,128,16], r: f32[8,128]) -> bf16[2,512,64] {
  %x = bf16[8,128,32]{2,1,0} parameter(0)
  %w = bf16[2,32,64]{2,1,0} parameter(1)
  %o = bf16[8,128,16]{2,1,0} parameter(2)
  %r = f32[8,128]{1,0} parameter(3)
  %rc = s32[2,4]{1,0} parameter(11)
  %d = (bf16[2,512,64]{2,1,0}, bf16[2,512,32]{2,1,0}) custom-call(%x, %w, %rc), custom_call_target="entwine_moe_dispatch_gemm", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/moe_dispatch_gemm/ffi_call"}, backend_config={comm_id = 7 : i64}
  %t = bf16[2,512,16]{2,1,0} custom-call(%o), custom_call_target="entwine_moe_transfer", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/moe_gemm_combine/entwine_moves.moe_gemm_combine.bfloat16/ffi_call"}, backend_config={comm_id = 7 : i64}
  %u = f32[2,512]{1,0} custom-call(%r), custom_call_target="entwine_moe_transfer", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/moe_gemm_combine/entwine_moves.moe_dispatch_gemm.float32/ffi_call"}, backend_config={comm_id = 7 : i64}
  %q = f8e4m3fn[8,128,32]{2,1,0} convert(%x)
  %wt = f8e4m3fn[2,64,32]{2,1,0} parameter(4)
  %xs = f32[4]{0} parameter(5)
  %ws = f32[] parameter(6)
  %f = (bf16[2,512,64]{2,1,0}, f8e4m3fn[2,512,32]{2,1,0}) custom-call(%q, %wt, %xs, %ws, %rc), custom_call_target="entwine_moe_dispatch_gemm_fp8", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/moe_dispatch_gemm/ffi_call"}, backend_config={comm_id = 7 : i64}
  %h = bf16[2,512,32]{2,1,0} parameter(7)
  %w2 = bf16[2,32,16]{2,1,0} parameter(8)
  %c = bf16[8,128,16]{2,1,0} custom-call(%h, %w2, %rc), custom_call_target="entwine_moe_gemm_combine", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/moe_gemm_combine/ffi_call"}, backend_config={comm_id = 7 : i64}
  %h8 = f8e4m3fn[2,512,32]{2,1,0} parameter(9)
  %w2t = f8e4m3fn[2,16,32]{2,1,0} parameter(10)
  %c8 = f16[8,128,16]{2,1,0} custom-call(%h8, %w2t, %ws, %ws, %rc), custom_call_target="entwine_moe_gemm_combine_fp8", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/shard_map/moe_gemm_combine/ffi_call"}, backend_config={comm_id = 7 : i64}
  ROOT %y = bf16[2,512,64]{2,1,0} get-tuple-element(%d), index=0
}
"""
    c = census.collectives(text, mesh=jax.sharding.AbstractMesh((2, 4), ("dp", "tp")))
    calls = c.select(custom_call=True)
    assert calls.counts("owner") == {"moe_dispatch_gemm": 3, "moe_gemm_combine": 3}
    by_bytes = sorted((x.owner, x.kind, x.group_size, x.axes, x.bytes) for x in calls)
    # The FP8 dispatch kernel sends its e4m3 rows: one byte an element; the FP8 combine kernel its
    # rows in its 16-bit output type.
    assert by_bytes == sorted([("moe_dispatch_gemm", "all-to-all", 4, ("tp",), 3 * 2 * 128 * 32 * 2),
                               ("moe_gemm_combine", "all-to-all", 4, ("tp",), 3 * 2 * 128 * 16 * 2),
                               ("moe_dispatch_gemm", "all-to-all", 4, ("tp",), 3 * 2 * 128 * 4),
                               ("moe_dispatch_gemm", "all-to-all", 4, ("tp",), 3 * 2 * 128 * 32),
                               ("moe_gemm_combine", "all-to-all", 4, ("tp",), 3 * 2 * 128 * 16 * 2),
                               ("moe_gemm_combine", "all-to-all", 4, ("tp",), 3 * 2 * 128 * 16 * 2)])


def test_iota_and_explicit_groups():
    mesh = jax.sharding.AbstractMesh((2, 4), ("dp", "tp"))
    line = "  %{n} = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={g}, to_apply=%add\n"
    groups = {"[2,4]<=[8]": ("tp",), "[4,2]<=[2,4]T(1,0)": ("dp",), "{{0,1,2,3},{4,5,6,7}}": ("tp",),
              "{{0,4},{1,5},{2,6},{3,7}}": ("dp",), "{}": ("dp", "tp"), "[4,2]<=[8]": None}
    body = "".join(line.format(n=f"ar{i}", g=g) for i, g in enumerate(groups))
    text = ("HloModule m\n%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
            "  ROOT %s = f32[] add(%a, %b)\n}\nENTRY %main (p: f32[8]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)\n"
            + body + "  ROOT %r = f32[8]{0} copy(%p)\n}\n")
    found = census.collectives(text, mesh=mesh)
    assert [c.axes for c in found] == list(groups.values())
    assert found.collectives[-1].group == "groups of size 2"


def test_bad_inputs(mesh):
    with pytest.raises(ValueError, match=r"program must be a function, a jax.stages.Lowered or Compiled, or compiled "
                                         r"HLO text, got int"):
        census.collectives(3)
    with pytest.raises(ValueError, match=r"program text is not an HLO module \(no ENTRY computation\): 'hello'"):
        census.collectives("hello")
    with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh or AbstractMesh, got dict"):
        census.collectives(lambda x: x, jnp.ones(2), mesh={"tp": 4})
    island, args = _mlp(mesh)
    lowered = jax.jit(island).lower(*args)
    with pytest.raises(ValueError, match=r"arguments are only taken with a function; program is a Lowered, got 1 "
                                         r"positional and \[\] keyword"):
        census.collectives(lowered, args[0])
    c = census.collectives(lowered)
    with pytest.raises(ValueError, match=r"owner must be one of \('gemm_rs', 'ag_gemm', 'moe_dispatch_gemm', "
                                         r"'moe_gemm_combine', 'xla'\).*got 'rs'"):
        c.select(owner="rs")
    with pytest.raises(ValueError, match=r"kind must be one of .*got 'allgather'"):
        c.select(kind="allgather")
    with pytest.raises(ValueError, match=r"loop must be one of this census' loops .*got 'body'"):
        c.per_iteration("body")
    with pytest.raises(ValueError, match=r"by must be one of \('owner', 'kind', 'axes', 'name'\), got 'mesh'"):
        c.totals("mesh")


def test_fp8_all_gather_counts_one_byte(mesh):
    """A plain all_gather of e4m3: the CPU compiler would widen it to f16; the census compiles it as
    it is and counts one byte per element."""
    f = jax.jit(jax.shard_map(lambda x: jax.lax.all_gather(x, "tp", axis=0, tiled=True), mesh=mesh,
                              in_specs=P("dp", "tp"), out_specs=P("dp", None), check_vma=False))
    col = _one(census.collectives(f, _spec(mesh, (16, 32), P("dp", "tp"), jnp.float8_e4m3fn)))
    assert (col.shape, col.bytes, col.program_shape) == ("f8e4m3fn[8,8]", 3 * 64, "")


# --- Three programs against an independent count from their compiled HLO --------------------------------
# One MLP block, data-parallel over dp (weights replicated there: a gradient all-reduce) and tensor
# parallel over tp, differentiated: in plain JAX (all_gather / psum_scatter), routed through the ops in
# bf16, and routed in FP8 (e4m3 forward, e5m2 backward, bf16 outputs).

def _block(kind: str):
    from entwine_jax import fp8

    def loss(x, w1, w2):
        if kind == "plain":
            h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
            y = jax.lax.psum_scatter(jnp.tanh(h) @ w2, "tp", scatter_dimension=0, tiled=True)
        elif kind == "bf16":
            h = entwine_jax.ag_gemm(x, w1, axis_name="tp")
            y = entwine_jax.gemm_rs(jnp.tanh(h), w2, axis_name="tp")
        else:
            h = entwine_jax.ag_gemm(x, w1, axis_name="tp", x_scale=fp8.current_scale(x), w_scale=fp8.current_scale(w1))
            t = jnp.tanh(h)
            y = entwine_jax.gemm_rs(t, w2, axis_name="tp", x_scale=fp8.current_scale(t), w_scale=fp8.current_scale(w2))
        return jax.lax.psum(jnp.sum(jnp.square(y.astype(jnp.float32))), ("dp", "tp"))
    return loss


@pytest.fixture(scope="module")
def blocks(mesh):
    """{kind: (census, compiled HLO text of a plain compile)} of the block's gradient step."""
    x = _spec(mesh, (64, 128), P(("dp", "tp"), None), jnp.bfloat16)
    w1 = _spec(mesh, (128, 256), P(None, "tp"), jnp.bfloat16)
    w2 = _spec(mesh, (256, 128), P("tp", None), jnp.bfloat16)
    out = {}
    for kind in ("plain", "bf16", "fp8"):
        island = jax.shard_map(_block(kind), mesh=mesh, in_specs=(x.sharding.spec, w1.sharding.spec,
                                                                   w2.sharding.spec), out_specs=P())
        step = jax.jit(jax.grad(island, argnums=(0, 1, 2)))
        out[kind] = (census.collectives(step, x, w1, w2), step.lower(x, w1, w2).compile().as_text())
    return out


def _independent(text: str, itemsize) -> dict:
    """{(kind, axis): bytes per device} from compiled HLO text, read with its own parse: the elements
    of each collective's result (tuple parts added), the axes of its mesh-printed groups, and the
    bytes per element that itemsize(kind, axis, elements) says the program moves on a GPU."""
    sizes = {"dp": 2, "tp": 4}
    out: dict = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) (all-gather|reduce-scatter|all-reduce)(?:-start)?\(", line)
        if m is None:
            continue
        kind = m.group(2)
        elements = sum(math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([\d,]*)\]",
                                                                                             m.group(1)))
        axes = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line).group(1).replace("'", "").split(",")
        (axis,) = [a.strip() for a in axes]
        w = sizes[axis]
        data = elements * itemsize(kind, axis, elements)  # the result's bytes
        # Ring accounting (the census module docstring): from the result's bytes.
        moved = {"all-gather": (w - 1) * data // w, "reduce-scatter": (w - 1) * data,
                 "all-reduce": 2 * (w - 1) * data // w}[kind]
        out[(kind, axis)] = out.get((kind, axis), 0) + moved
    return out


def _by_kind_axis(c: census.Census) -> dict:
    out: dict = {}
    for col in c:
        out[(col.kind, col.group)] = out.get((col.kind, col.group), 0) + col.total_bytes
    return out


def test_three_programs_against_the_hlo(blocks):
    # Plain JAX and routed bf16: every collective moves bf16 (2 bytes an element), whatever the CPU
    # compile reduces in (an op's reference reduce-scatter is fp32: the kernels move bf16).
    bf16 = lambda kind, axis, n: 2  # noqa: E731
    # FP8: the gathers over tp move FP8 (1 byte; e4m3 forward, e5m2 backward) and each shard's fp32
    # scale (a 1-element gather's 4 bytes); the reduce-scatters the bf16 outputs; the gradient
    # all-reduce bf16.
    fp8 = lambda kind, axis, n: (4 if n <= 4 else 1) if (kind, axis) == ("all-gather", "tp") else 2  # noqa: E731
    for kind, itemsize in (("plain", bf16), ("bf16", bf16), ("fp8", fp8)):
        c, text = blocks[kind]
        assert _by_kind_axis(c) == _independent(text, itemsize), (kind, c.table())
        assert not c.unknown


def test_routed_moves_what_plain_jax_moves(blocks):
    plain, routed, fp8 = (blocks[k][0] for k in ("plain", "bf16", "fp8"))
    assert routed.totals("axes") == plain.totals("axes")
    assert census.more_than(routed, plain) == {}
    assert "moves no more than plain over any axes" in census.compare(routed, plain, ("routed", "plain"))
    # FP8 gathers half the bytes over tp (plus 4 bytes of scale per peer and gather).
    assert fp8.totals("axes")["tp"][1] < plain.totals("axes")["tp"][1]
    # A program that moves more says so: plain against the FP8 one.
    extra = census.more_than(plain, fp8)
    assert set(extra) == {"tp"} and extra["tp"] > 0
    assert f"plain moves {census.fmt_bytes(extra['tp'])} more than fp8 over tp" in census.compare(
        plain, fp8, ("plain", "fp8"))


def test_labels_are_the_ops_in_bf16_and_fp8(blocks):
    """Each op's collectives, forward and backward (each op's backward is the other op), labelled alike
    in bf16 and FP8; the gradient all-reduce over dp (AD's psum of the ops' operands, combined by
    XLA) is XLA's."""
    labels = {k: {(col.owner, col.kind, col.group) for col in blocks[k][0]} for k in ("bf16", "fp8")}
    assert labels["bf16"] == labels["fp8"] == {("ag_gemm", "all-gather", "tp"), ("gemm_rs", "reduce-scatter", "tp"),
                                                ("xla", "all-reduce", "dp")}
    for k in ("bf16", "fp8"):
        c = blocks[k][0]
        assert c.select(owner="ag_gemm", kind="all-gather").count == (2 if k == "bf16" else 4)  # + the scales
        assert c.select(owner="gemm_rs").count == 2
        # The reference's fp32 reduce-scatters are counted in bf16, and the table says so.
        assert all(col.shape.startswith("bf16") and col.program_shape.startswith("f32") for col in
                   c.select(owner="gemm_rs"))
        assert "this compile holds their XLA reference" in c.table()
    gathers = sorted(col.shape for col in blocks["fp8"][0].select(owner="ag_gemm"))
    assert gathers == ["f32[1]", "f32[1]", "f8e4m3fn[8,128]", "f8e5m2[8,128]"]


def test_census_is_an_attribute_of_the_package():
    import importlib
    pkg = importlib.import_module("entwine_jax")
    assert pkg.census.collectives is census.collectives
    assert pkg.layers.__name__ == "entwine_jax.layers"


# --- The command line: python -m entwine_jax census --------------------------------------------------------

EXAMPLE = str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "census_mlp.py")
BLOCK_ARGS = ["--mesh", "dp=2,tp=4", "--arg", "bf16[64,128]@dp+tp,_", "--arg", "bf16[128,256]@_,tp",
              "--arg", "bf16[256,128]@tp,_"]


def test_command_line_prints_the_table_and_the_comparison(mesh, capsys, blocks):
    from entwine_jax import __main__ as cli
    assert cli.main(["census", f"{EXAMPLE}:routed_fp8", "--grad", *BLOCK_ARGS, "--twin", f"{EXAMPLE}:plain"]) == 0
    out = capsys.readouterr().out
    assert "census_mlp.py:routed_fp8 (grad) on mesh dp=2,tp=4: bytes per device" in out
    assert "f8e4m3fn[8,128]" in out and "xla      all-reduce" in out
    # The same numbers as the test's own programs (the same shapes), and the comparison lines.
    assert f"all 7 {census.fmt_bytes(blocks['fp8'][0].bytes)}" in out
    assert "routed_fp8 moves no more than plain over any axes" in out
    assert cli.main(["census", f"{EXAMPLE}:plain", "--grad", *BLOCK_ARGS, "--twin", f"{EXAMPLE}:routed_fp8"]) == 0
    assert "plain moves" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["x.py"], "the function must be MODULE:FUNCTION"),
    ([f"{EXAMPLE}:nope"], "has no function 'nope'"),
    ([f"{EXAMPLE}:plain", "--mesh", "dp:2"], "--mesh must be NAME=SIZE"),
    ([f"{EXAMPLE}:plain", "--arg", "bf16(4,4)"], "--arg must be DTYPE\\[dims\\]"),
    ([f"{EXAMPLE}:plain", "--arg", "bf16[4,4]@pp,_"], "axis 'pp' is not one of the mesh's"),
    ([f"{EXAMPLE}:plain", "--arg", "b17[4,4]"], "unknown dtype 'b17'"),
])
def test_command_line_errors(mesh, capsys, argv, message):
    from entwine_jax import __main__ as cli
    argv = argv if "--mesh" in argv else argv + ["--mesh", "dp=2,tp=4"]
    assert cli.main(["census", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
