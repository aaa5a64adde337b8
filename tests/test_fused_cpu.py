# CPU-checkable parts of the fused path (entwine_jax.gemm_rs.fused, ag_gemm.fused, comm): the reasons
# it gives off-GPU, the padding the kernels' plan chooses (pad, reduce-scatter, slice == the unpadded
# reference), comm ids and device groups,
# mesh discovery, the communicator lifecycle against a fake extension (predicates only answer;
# acquire_comm creates, grows and connects), and the traced ffi_call. Tests of the plan run against
# the C++ plan of the built extension and skip without it.
import dataclasses
import os
import subprocess
import sys

import entwine_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from entwine_jax import AgGemmConfig, GemmRsConfig, _distributed, _extension, comm
from entwine_jax.ag_gemm import fused as ag_fused
from entwine_jax.gemm_rs import fused as rs_fused
from entwine_jax.gemm_rs import plan as rs_plan

CFG = GemmRsConfig()
# The heap regions the two ops register (ffi/<op>/handler.cc).
PARTIAL, INBOX = "gemm_rs.partial", "ag_gemm.inbox"


def needs_plan():
    """Skip (with the reason) where the extension, and with it the kernels' plan, is not built."""
    if _extension.module()[0] is None:
        pytest.skip(f"the kernels' plan needs the extension: {_extension.module()[1]}")


@pytest.fixture(autouse=True)
def _fresh_fused(monkeypatch):
    """Each test starts with no communicators, no setup() meshes and an empty reason cache."""
    monkeypatch.setattr(comm, "_comms", {})
    monkeypatch.setattr(comm, "_setup_meshes", {})
    monkeypatch.setattr(comm, "_reason_cache", {})
    monkeypatch.setattr(comm, "_failed", {})
    monkeypatch.setattr(comm, "_atexit_registered", True)  # no shutdown hook from these tests


def _mesh(shape=(2, 4), names=("dp", "tp")):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _sds(shape, dtype, mesh, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))


def _ids(groups):
    return [[d.id for d in row] for row in groups]


def _in_shard_map(mesh, fn, in_specs=P(None, "tp"), m=256, k=64, n=128, dtype=jnp.bfloat16):
    """Traces fn(x_local, w_local) inside shard_map over mesh; returns what fn returned."""
    out = {}

    def body(x, w):
        out["value"] = fn(x, w)
        return x

    x = _sds((m, k * mesh.shape["tp"]), dtype, mesh, in_specs)
    w = _sds((k * mesh.shape["tp"], n), dtype, mesh, P("tp", None))
    f = jax.shard_map(body, mesh=mesh, in_specs=(in_specs, P("tp", None)), out_specs=in_specs,
                      check_vma=False)
    jax.make_jaxpr(f)(x, w)
    return out["value"]


# --- Reasons off-GPU ------------------------------------------------------------------------------


def _reason(x, w, axis_size=4, config=CFG, scatter_dimension=0, axis_name="tp"):
    return rs_fused.unavailable_reason(x, w, axis_name=axis_name, axis_size=axis_size,
                                    scatter_dimension=scatter_dimension, config=config)


def test_reason_on_cpu_names_the_platform():
    mesh = _mesh()
    for ctx in (jax.set_mesh(mesh), _nullcontext()):
        with ctx:
            reason = _in_shard_map(mesh, lambda x, w: _reason(jax.typeof(x), jax.typeof(w)))
        assert reason is not None and "not running on CUDA GPUs" in reason and "cpu" in reason


def test_reason_extension_or_setup_when_the_platform_looks_like_gpu(monkeypatch):
    # Past the platform check, the next missing piece is the extension (pure-Python install) or,
    # when it is built, the concrete mesh (no set_mesh, no setup()).
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    ext, ext_reason = _extension.registered()
    x, w = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    reason = _reason(x, w)
    if ext is None:
        assert "entwine_jax._entwine" in reason and reason == ext_reason
    else:
        assert "entwine_jax.setup(mesh, 'tp')" in reason


@pytest.mark.parametrize("kwargs, match", [
    (dict(config=GemmRsConfig(path="xla")), "config.path is 'xla'"),
    (dict(scatter_dimension=2), "rows (0) or columns (1)"),
    (dict(scatter_dimension=1, axis_size=3), "scattered size not divisible by the axis size 3"),
    (dict(axis_size=16), "axis size 16 outside"),
    (dict(axis_size=3), "scattered size not divisible by the axis size 3"),
])
def test_reason_for_unsupported_calls(kwargs, match):
    if "axis_size" in kwargs and kwargs["axis_size"] == 16:
        needs_plan()  # the largest world is the kernels' (kMaxWorld)
    x, w = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    assert match in _reason(x, w, **kwargs)


@pytest.mark.parametrize("xd, wd", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float16)])
def test_reason_for_dtypes(xd, wd):
    x, w = jax.ShapeDtypeStruct((256, 64), xd), jax.ShapeDtypeStruct((64, 128), wd)
    assert "bf16 or fp16" in _reason(x, w)


def test_reason_never_raises_and_is_cached(monkeypatch):
    x, w = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    monkeypatch.setattr(rs_fused, "_unavailable", lambda *a: (_ for _ in ()).throw(KeyError("boom")))
    assert "KeyError" in _reason(x, w)
    mesh = _mesh()
    calls = []
    monkeypatch.setattr(rs_fused, "_unavailable", lambda *a: calls.append(a) or "why")
    with jax.set_mesh(mesh):
        for _ in range(3):
            assert _in_shard_map(mesh, lambda x, w: _reason(jax.typeof(x), jax.typeof(w))) == "why"
    assert len(calls) == 1


def test_heap_cap_is_a_reason(monkeypatch):
    ext = FakeExt()
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    monkeypatch.setenv("ENTWINE_HEAP_MAX_BYTES", str(1 << 20))
    with pytest.raises(comm.Unavailable, match="ENTWINE_HEAP_MAX_BYTES=1048576"):
        comm.acquire_comm(_mesh(), "tp", 32 * 64, {PARTIAL: 8192 * 8192 * 2})
    assert not ext.calls and not comm._comms  # nothing created
    monkeypatch.setenv("ENTWINE_HEAP_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="ENTWINE_HEAP_MAX_BYTES must be an integer"):
        comm.heap_max_bytes()
    monkeypatch.delenv("ENTWINE_HEAP_MAX_BYTES")
    assert comm.heap_max_bytes() == 4 << 30


# --- Padding math (the kernels' plan) -------------------------------------------------------------


@pytest.fixture
def plan():
    needs_plan()


def _reduce_scatter_padded(xs, ws, world, block_n, scatter_cols=False):
    """What the kernels compute, simulated in float64 on padded operands, then sliced: rank r
    receives rows (scatter_cols: columns) r*M/W .. of the sum, as the kernels lay it out."""
    m, k = xs[0].shape
    p = rs_fused.padding(m, k, ws[0].shape[1], world, block_n, scatter_cols=scatter_cols)
    padded = [rs_fused.pad_operands(x, w, p, xp=np) for x, w in zip(xs, ws)]
    full = sum(xp @ wp for xp, wp in padded)
    assert p.mp_pad % 128 == 0 and p.n_pad % block_n == 0 and p.k_pad % 8 == 0
    if scatter_cols:
        assert full.shape == (p.mp_pad, world * p.n_pad)
        return [rs_fused.unpad(full[:, r * p.n_pad:(r + 1) * p.n_pad], p) for r in range(world)]
    assert full.shape == (world * p.mp_pad, p.n_pad)
    return [rs_fused.unpad(full[r * p.mp_pad:(r + 1) * p.mp_pad], p) for r in range(world)]


def _random_terms(world, m, k, n, seed):
    """Every rank's x [m, k] and w [k, n], and the float64 sum of their products."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((m, k)) for _ in range(world)]
    ws = [rng.standard_normal((k, n)) for _ in range(world)]
    return xs, ws, sum(x @ w for x, w in zip(xs, ws))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m_per, k, n, block_n", [
    (128, 64, 128, 128),  # aligned: no padding at all
    (37, 61, 200, 128),   # everything odd
    (130, 8, 255, 256),
    (1, 1, 1, 128),
])
def test_pad_then_slice_equals_reference(plan, world, m_per, k, n, block_n):
    xs, ws, ref = _random_terms(world, m_per * world, k, n, seed=world * 1000 + k)
    got = _reduce_scatter_padded(xs, ws, world, block_n)
    for r in range(world):
        np.testing.assert_allclose(got[r], ref[r * m_per:(r + 1) * m_per], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("m, k, n_per, block_n", [(128, 64, 256, 256), (37, 61, 100, 128), (1, 1, 1, 256)])
def test_pad_then_slice_equals_reference_columns(plan, world, m, k, n_per, block_n):
    xs, ws, ref = _random_terms(world, m, k, n_per * world, seed=world * 100 + k)
    got = _reduce_scatter_padded(xs, ws, world, block_n, scatter_cols=True)
    for r in range(world):
        np.testing.assert_allclose(got[r], ref[:, r * n_per:(r + 1) * n_per], rtol=1e-12, atol=1e-12)


def test_padding_values_and_needed(plan):
    p = rs_fused.padding(m=2 * 200, k=100, n=300, world=2, block_n=256)
    assert (p.mp, p.mp_pad, p.k_pad, p.n_pad) == (200, 256, 104, 512)
    assert p.needed and p.tiles_per_partition == 2 * 4
    assert not rs_fused.padding(512, 64, 256, 4, 128).needed
    with pytest.raises(ValueError, match="M=10 is not divisible by the axis size 4"):
        rs_fused.padding(10, 8, 128, 4, 128)
    c = rs_fused.padding(m=200, k=100, n=2 * 300, world=2, block_n=256, scatter_cols=True)
    assert (c.mp, c.mp_pad, c.k_pad, c.n_part, c.n_pad) == (200, 256, 104, 300, 512)
    assert c.needed and c.tiles_per_partition == 2 * 4
    with pytest.raises(ValueError, match="N=10 is not divisible by the axis size 4"):
        rs_fused.padding(8, 8, 10, 4, 128, scatter_cols=True)


def test_pad_operands_skips_aligned_operands(plan):
    p = rs_fused.padding(256, 64, 128, 2, 128)
    x, w = np.ones((256, 64)), np.ones((64, 128))
    xp, wp = rs_fused.pad_operands(x, w, p, xp=np)
    assert xp is x and wp is w and rs_fused.unpad(x, p) is x


def test_heap_bytes_and_the_plan_capacity(plan):
    # Device memory mapped: [flags parity 0][flags parity 1][ready words][partial 0][partial 1][inbox],
    # each region in whole 2 MiB chunks, the ready words one chunk (comm::mapped_bytes).
    chunk = 2 << 20
    assert _extension.heap_bytes(2, 64, {PARTIAL: 1 << 20}) == 2 * chunk + chunk + 2 * chunk
    assert _extension.heap_bytes(3, 1, {PARTIAL: 100}) == 5 * chunk
    assert _extension.heap_bytes(2, 64, {PARTIAL: 5 << 20, INBOX: 3000}) == 2 * chunk + chunk + 2 * 3 * chunk + chunk
    assert _extension.heap_bytes(8, 32768 + 1, {PARTIAL: 64 << 20}) == 2 * 2 * chunk + chunk + 2 * 32 * chunk
    with pytest.raises(ValueError, match="no region named slot"):
        _extension.heap_bytes(2, 1, {"slot": 1})
    # One slot holds the padded M x N product (2-byte elements); one flag per tile of a partition.
    p = rs_fused.padding(8192, 1024, 8192, 2, 128)
    assert p.slot_bytes == 8192 * 8192 * 2 and p.tiles_per_partition == 32 * 64
    c = rs_fused.padding(m=200, k=100, n=2 * 300, world=2, block_n=256, scatter_cols=True)
    assert c.slot_bytes == 256 * 2 * 512 * 2


def test_plan_blocks_grid_and_split(plan):
    # Hand-computed: 16384x8192x3584 over W=2 with 128x256 blocks: 64 x 32 blocks per partition,
    # 4096 in all on 124 persistent CTAs; 56 k-tiles of 64. The last wave has 4 blocks, leaving
    # 120 CTAs idle for 56 k-tiles each: the split applies, from the last full wave on (block 3968).
    config = GemmRsConfig(block_n=256, producer_sms=124, consumer_grid=8, split_tail=True)
    p = rs_plan.gemm_rs_plan(16384, 8192, 3584, 2, config)
    assert (p.m_blocks, p.n_blocks, p.blocks_per_partition, p.num_blocks) == (64, 32, 2048, 4096)
    assert (p.grid, p.k_tiles, p.split, p.split_first_block) == (124, 56, True, 3968)
    assert not rs_plan.gemm_rs_plan(16384, 8192, 3584, 2, dataclasses.replace(config, split_tail=False)).split
    # One CTA per block; a raster group never spans more tile rows than the partition has.
    p = rs_plan.gemm_rs_plan(300, 200, 10, 2, GemmRsConfig(raster_rows=8))
    assert (p.mp, p.mp_pad, p.n_pad, p.k_pad, p.m_blocks, p.n_blocks) == (150, 256, 256, 16, 2, 2)
    assert (p.grid, p.num_blocks, p.raster_rows, p.split) == (8, 8, 2, False)


def test_plan_refuses_what_the_kernels_cannot_run(plan):
    # GemmRsConfig refuses consumer_grid=100 itself; the kernels' plan refuses it too, past those checks.
    too_wide = GemmRsConfig()
    object.__setattr__(too_wide, "consumer_grid", 100)
    with pytest.raises(rs_plan.PlanError, match=r"config.consumer_grid must be in \[1, 64\]") as e:
        rs_plan.gemm_rs_plan(256, 256, 64, 2, too_wide)
    assert e.value.config_error
    assert rs_plan.config_rule(too_wide) == "config.consumer_grid must be in [1, 64]"
    assert rs_plan.config_rule(GemmRsConfig(consumer_grid=64)) is None
    with pytest.raises(rs_plan.PlanError, match=r"world size must be in \[1, 8\]") as e:
        rs_plan.gemm_rs_plan(256, 256, 64, 16, CFG)
    assert not e.value.config_error
    with pytest.raises(rs_plan.PlanError, match="int32"):
        rs_plan.gemm_rs_plan(2**31, 128, 64, 1, CFG)
    with pytest.raises(ValueError, match=r"gemm_rs: the kernels cannot run x \[256, 64\] @ w \[64, 256\] over 16 "
                                         r"ranks: world size must be in \[1, 8\]"):
        rs_fused.padding(256, 64, 256, 16, 128)


def test_config_attributes_are_named():
    cfg = GemmRsConfig(block_n=256, producer_sms=100, consumer_grid=24, consumer_block=256, raster_rows=4,
                       split_tail=False)
    attrs = cfg.kernel_attributes()
    assert {k: int(v) for k, v in attrs.items()} == dict(block_n=256, producer_sms=100, consumer_grid=24,
                                                        consumer_block=256, raster_rows=4, split_tail=0)
    assert isinstance(attrs["split_tail"], bool) and attrs["block_n"].dtype == np.int64


# --- Groups and comm ids ----------------------------------------------------------------------------


def test_groups_1d():
    mesh = _mesh((8,), ("tp",))
    assert _ids(comm.device_groups(mesh, "tp")) == [list(range(8))]


def test_groups_2d():
    mesh = _mesh()
    assert _ids(comm.device_groups(mesh, "tp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _ids(comm.device_groups(mesh, "dp")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _ids(comm.device_groups(mesh, ("dp", "tp"))) == [list(range(8))]
    assert _ids(comm.device_groups(mesh, ("tp", "dp"))) == [[0, 4, 1, 5, 2, 6, 3, 7]]
    with pytest.raises(ValueError, match="axis 'pp' is not in the mesh axes"):
        comm.device_groups(mesh, "pp")


def test_groups_follow_the_device_order_of_the_mesh():
    devices = np.array(jax.devices()[:8])[::-1].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("dp", "tp"))
    assert _ids(comm.device_groups(mesh, "tp")) == [[7, 6, 5, 4], [3, 2, 1, 0]]


def test_comm_id_is_stable_and_distinguishes_groups():
    mesh = _mesh()
    cid = comm.comm_id(comm.device_groups(mesh, "tp"), "tp")
    again = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    assert comm.comm_id(comm.device_groups(again, "tp"), "tp") == cid
    assert comm.comm_id(comm.device_groups(mesh, "dp"), "dp") != cid
    assert -(2**63) <= cid < 2**63
    # Another process computes the same id (no per-process hash seed).
    code = ("import jax, numpy as np; from entwine_jax import comm; "
            "m = jax.make_mesh((2, 4), ('dp', 'tp'), devices=jax.devices()[:8]); "
            "print(comm.comm_id(comm.device_groups(m, 'tp'), 'tp'))")
    env = dict(os.environ, PYTHONHASHSEED="123",
               XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == cid


# --- Mesh discovery --------------------------------------------------------------------------------


def test_find_mesh_from_set_mesh_or_setup():
    mesh = _mesh()
    assert _in_shard_map(mesh, lambda x, w: comm.find_mesh("tp")) is None
    with jax.set_mesh(mesh):
        assert _in_shard_map(mesh, lambda x, w: comm.find_mesh("tp")) is mesh
    comm.setup(mesh, "tp")
    assert _in_shard_map(mesh, lambda x, w: comm.find_mesh("tp")) is mesh
    # Another shape of mesh is not mistaken for the registered one.
    other = _mesh((4, 2))
    assert _in_shard_map(other, lambda x, w: comm.find_mesh("tp")) is None
    with pytest.raises(ValueError, match="axis 'nope'"):
        comm.setup(mesh, "nope")


# --- The communicator lifecycle against a fake extension ----------------------------------------------


class FakeExt:
    """Records the communicator calls fused.py makes; no CUDA. (The plans are the real extension's.)"""

    def __init__(self):
        self.calls = []
        self.error = None

    def __getattr__(self, name):
        if not name.startswith("comm_") and name not in ("shutdown",):
            raise AttributeError(name)
        return lambda *args: self.calls.append((name,) + args)

    def comm_export(self, comm_id, device):
        self.calls.append(("comm_export", comm_id, device))
        return []

    def can_access_peer(self, a, b):
        return True

    def error_message(self, comm_id):
        return self.error

    def heap_bytes(self, world, flags_per_source, regions):
        # A stand-in (only the cap check reads it): the partial double-buffered, as in the extension.
        return 2 * world * flags_per_source * 8 + sum(regions.values()) + regions.get(PARTIAL, 0)


class FakeKV:
    def __init__(self):
        self.store = {}

    def key_value_set_bytes(self, key, value):
        assert key not in self.store, f"key {key} written twice"
        self.store[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.store:
            raise TimeoutError(f"{key} not set within {timeout_ms} ms")
        return self.store[key]


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    local_hardware_id: int
    platform: str = "gpu"
    compute_capability: str = "9.0"


class FakeMesh:
    def __init__(self, devices, names):
        self.devices = np.array(devices, dtype=object)
        self.axis_names = names


def test_create_grow_and_errors_one_process(monkeypatch):
    mesh = _mesh()
    ext = FakeExt()
    # CPU devices would be refused by the device checks; everything after them is what we test.
    monkeypatch.setattr(comm, "_check_devices", lambda *a: None)
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    slot, tiles = 256 * 128 * 2, 1
    cid = comm.acquire_comm(mesh, "tp", tiles, {PARTIAL: slot})
    entry = comm._comms[cid]
    assert comm.acquire_comm(mesh, "tp", tiles, {PARTIAL: slot}) == cid  # enough room: nothing to do
    assert [c[0] for c in ext.calls] == ["comm_create"] + ["comm_connect"] * 8
    create = ext.calls[0]
    assert create[1:3] == (entry.id, 4)
    assert create[3] == [(d, d % 4) for d in range(8)]
    # The capacity as the extension takes it: flags per source (a granule), {region: bytes} (chunks).
    assert create[4] == 64 and create[5] == {PARTIAL: 2 << 20} and create[6] == comm.heap_max_bytes()
    # One process: every peer is a local ordinal (its heap used directly), the group of the device.
    assert ext.calls[5] == ("comm_connect", entry.id, 4, [4, 5, 6, 7])
    # A larger call grows the heap: map more, reconnect; no synchronisation, the id stays.
    ext.calls.clear()
    assert comm.acquire_comm(mesh, "tp", 32 * 32, {PARTIAL: 4 * 4096 * 4096 * 2}) == cid
    assert [c[0] for c in ext.calls] == ["comm_grow"] + ["comm_connect"] * 8
    assert entry.capacity.bytes(PARTIAL) >= 4 * 4096 * 4096 * 2 and entry.generation == 2
    # A failure during setup is a reason (Unavailable), not a crash of the trace; nothing changed.
    before = entry.capacity
    ext.comm_grow = lambda *a: (_ for _ in ()).throw(RuntimeError("cuMemCreate: out of memory"))
    with pytest.raises(comm.Unavailable, match=r"setup failed \(RuntimeError: cuMemCreate.*is unchanged"):
        comm.acquire_comm(mesh, "tp", 32 * 32, {PARTIAL: 8 * 4096 * 4096 * 2})
    assert entry.capacity == before and cid not in comm._failed
    # check_errors reports what a consumer recorded.
    comm.check_errors()
    ext.error = "entwine gemm_rs: rank 1 waited 2000 ms for tile 7 from rank 0"
    with pytest.raises(RuntimeError, match="waited 2000 ms for tile 7 from rank 0"):
        comm.check_errors()


def _gpu_mesh(world=2):
    """A mesh of `world` fake Hopper GPUs of this process, registered through setup()."""
    mesh = FakeMesh([FakeDevice(i, 0, i) for i in range(world)], ("tp",))
    comm.setup(mesh, "tp")
    return mesh


def test_predicates_only_answer_and_prepare_acquires_once(monkeypatch):
    # Only prepare_* creates or grows a communicator: the predicates of both ops ask, nothing more.
    needs_plan()
    ext = FakeExt()
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    mesh = _gpu_mesh()
    x, w = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    kw = dict(axis_name="tp", axis_size=2)
    assert rs_fused.unavailable_reason(x, w, scatter_dimension=0, config=CFG, **kw) is None
    ag_config = AgGemmConfig(gemm_sms=100)
    assert ag_fused.unavailable_reason(x, w, gather_k=False, config=ag_config, **kw) is None
    assert not ext.calls and not comm._comms
    call = rs_fused.prepare(x, w, scatter_dimension=0, config=CFG, **kw)
    assert [c[0] for c in ext.calls] == ["comm_create"] + ["comm_connect"] * 2
    cid = comm.comm_id(comm.device_groups(mesh, "tp"), "tp")
    # The call carries everything static: the plan (the padding), the communicator, the config.
    assert call.comm_id == cid and call.config == CFG and call.target == rs_plan.target()
    assert (call.plan.mp_pad, call.plan.n_pad, call.plan.k_pad) == (256, 256, 64) and hash(call)
    # The other op's call on the same axis shares the communicator; it grows it once, for its inbox.
    ag_call = ag_fused.prepare(x, w, gather_k=False, config=ag_config, **kw)
    assert ag_call.comm_id == cid and hash(ag_call)
    assert [c[0] for c in ext.calls[3:]] == ["comm_grow"] + ["comm_connect"] * 2
    assert comm._comms[cid].capacity.bytes(INBOX) >= 2 * 512 * 64 * 2
    assert ag_fused.prepare(x, w, gather_k=False, config=ag_config, **kw) == ag_call and len(ext.calls) == 6
    # A call above the heap cap: the predicate says so, and nothing is grown.
    monkeypatch.setenv("ENTWINE_HEAP_MAX_BYTES", str(8 << 20))
    big = jax.ShapeDtypeStruct((8192, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 8192), jnp.bfloat16)
    reason = rs_fused.unavailable_reason(*big, scatter_dimension=0, config=CFG, **kw)
    assert "would exceed ENTWINE_HEAP_MAX_BYTES=" in reason and len(ext.calls) == 6
    with pytest.raises(comm.Unavailable, match="ENTWINE_HEAP_MAX_BYTES"):
        rs_fused.prepare(*big, scatter_dimension=0, config=CFG, **kw)


def test_prepare_without_a_mesh_says_how_to_give_one():
    x, w = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    with pytest.raises(comm.Unavailable, match=r"call entwine_jax.setup\(mesh, 'tp'\) first"):
        rs_fused.prepare(x, w, axis_name="tp", axis_size=2, scatter_dimension=0, config=CFG)


def test_device_checks(monkeypatch):
    ext = FakeExt()
    groups = np.array([[FakeDevice(0, 0, 0), FakeDevice(1, 0, 1)]], dtype=object)
    comm._check_devices(ext, groups)
    monkeypatch.setattr(ext, "can_access_peer", lambda a, b: False)
    with pytest.raises(comm.Unavailable, match="devices not peer-accessible"):
        comm._check_devices(ext, groups)
    ampere = np.array([[FakeDevice(0, 0, 0, compute_capability="8.0")]], dtype=object)
    with pytest.raises(comm.Unavailable, match="compute capability 9.0"):
        comm._check_devices(ext, ampere)
    remote = np.array([[FakeDevice(0, 1, 0)]], dtype=object)
    with pytest.raises(comm.Unavailable, match="no device of the mesh"):
        comm._check_devices(ext, remote)


def test_barrier_waits_for_every_process(monkeypatch):
    kv = FakeKV()
    monkeypatch.setattr(_distributed, "client", lambda: kv)
    kv.store["b/1"] = b"1"
    _distributed.barrier("b", [0, 1], 0, 10)
    with pytest.raises(TimeoutError):
        _distributed.barrier("c", [0, 1], 0, 10)


# --- The traced call ----------------------------------------------------------------------------


def test_gemm_rs_local_traces_one_padded_fused_call(monkeypatch):
    needs_plan()
    mesh = _mesh()
    ext = FakeExt()
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    monkeypatch.setattr(comm, "_check_devices", lambda *a: None)
    m, k, n = 4 * 37, 61, 200

    def body(x, w):
        return rs_fused.call_local(x, w, axis_name="tp", axis_size=4, config=CFG)

    x = _sds((m, 4 * k), jnp.bfloat16, mesh, P(None, "tp"))
    w = _sds((4 * k, n), jnp.bfloat16, mesh, P("tp", None))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                      out_specs=P("tp", None), check_vma=False)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(f)(x, w)
    inner = jaxpr.eqns[0].params["jaxpr"]
    calls = [e for e in inner.eqns if e.primitive.name == "ffi_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.params["target_name"] == rs_plan.target()
    assert [tuple(v.aval.shape) for v in call.invars] == [(4 * 128, 64), (64, 256)]
    assert tuple(call.outvars[0].aval.shape) == (128, 256)
    attrs = dict(call.params["attributes"])
    entry = next(iter(comm._comms.values()))
    assert int(attrs["comm_id"]) == entry.id
    config = {name: int(value) for name, value in dict(attrs["config"]).items()}
    assert config == dict(block_n=128, producer_sms=0, consumer_grid=16, consumer_block=512, raster_rows=8,
                          split_tail=0)
    assert tuple(inner.outvars[0].aval.shape) == (37, n)
    # Lowered for CUDA (no GPU needed): the attribute types the handler binds (int64_t, and bool).
    with jax.set_mesh(mesh):
        text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    call_line = next(line for line in text.splitlines() if rs_plan.target() in line)
    assert f"comm_id = {entry.id} : i64" in call_line
    signature = int(attrs["signature"])
    assert 0 <= signature < 1 << 24 and f"signature = {signature} : i64" in call_line
    for attr in ("block_n = 128 : i64", "producer_sms = 0 : i64", "consumer_grid = 16 : i64",
                 "consumer_block = 512 : i64", "raster_rows = 8 : i64", "split_tail = false"):
        assert attr in call_line, (attr, call_line)


def test_call_signature_names_op_shapes_config_and_the_users_line(monkeypatch):
    """Two calls of one shape from two lines of the user's code get two signatures; the same line
    traced again gets the same one; the description names the call site and the process can name it."""
    needs_plan()
    mesh = _mesh()
    ext = FakeExt()
    named = {}
    ext.name_call = lambda signature, description: named.__setitem__(signature, description)
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    monkeypatch.setattr(comm, "_check_devices", lambda *a: None)
    comm.call_signature.cache_clear()

    def site_a(x, w):
        return rs_fused.call_local(x, w, axis_name="tp", axis_size=4, config=CFG)

    def site_b(x, w):
        return rs_fused.call_local(x, w, axis_name="tp", axis_size=4, config=CFG)

    x = _sds((512, 4 * 64), jnp.bfloat16, mesh, P(None, "tp"))
    w = _sds((4 * 64, 256), jnp.bfloat16, mesh, P("tp", None))

    def signature(body):
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None),
                          check_vma=False)
        with jax.set_mesh(mesh):
            jaxpr = jax.make_jaxpr(f)(x, w)
        call, = [e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "ffi_call"]
        return int(dict(call.params["attributes"])["signature"])

    a, b, a_again = signature(site_a), signature(site_b), signature(site_a)
    assert a != b and a == a_again
    assert set(named) == {a, b}
    assert "gemm_rs bfloat16 x [512, 64] w [64, 256] scattering rows" in named[a]
    assert "test_fused_cpu.py" in named[a] and "(site_a)" in named[a] and "(site_b)" in named[b]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_a_failed_setup_is_undone_and_retried(monkeypatch):
    # A creation whose connection fails is destroyed again: the call site gets the reason (an XLA-path
    # reason), nothing is left half-connected, and the next call site creates the communicator anew.
    mesh = _mesh()
    ext = FakeExt()
    monkeypatch.setattr(comm, "_check_devices", lambda *a: None)
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    cid = comm.comm_id(comm.device_groups(mesh, "tp"), "tp")

    def refuse(*a):
        raise TimeoutError("no heap from rank 3")

    ext.comm_connect = refuse
    with pytest.raises(comm.Unavailable, match=r"setup failed \(TimeoutError: no heap from rank 3.*'tp' is unchanged"):
        comm.acquire_comm(mesh, "tp", 1, {PARTIAL: 1024})
    assert [c[:2] for c in ext.calls] == [("comm_create", cid), ("comm_destroy", cid)]
    assert cid not in comm._comms and comm.mesh_reason(ext, mesh, "tp", 4) is None
    del ext.comm_connect
    assert comm.acquire_comm(mesh, "tp", 1, {PARTIAL: 1024}) == cid and comm._comms[cid].generation == 1
    # A growth that fails is shrunk back to the capacity calls use; if that fails too, no later call
    # site may use the communicator (it says why), and the predicate says so as well.
    ext.calls.clear()
    ext.comm_connect = refuse
    have = comm._comms[cid].capacity
    with pytest.raises(comm.Unavailable, match="is unchanged"):
        comm.acquire_comm(mesh, "tp", 1, {PARTIAL: 64 << 20})
    assert [c[0] for c in ext.calls] == ["comm_grow", "comm_shrink"] and ext.calls[1][2:] == have.args()
    assert comm._comms[cid].capacity == have and comm._comms[cid].generation == 1
    ext.comm_shrink = lambda *a: (_ for _ in ()).throw(RuntimeError("cuMemUnmap: invalid value"))
    with pytest.raises(comm.Unavailable, match=r"could not be undone \(RuntimeError: cuMemUnmap"):
        comm.acquire_comm(mesh, "tp", 1, {PARTIAL: 64 << 20})
    with pytest.raises(comm.Unavailable, match="no longer uses it"):
        comm.acquire_comm(mesh, "tp", 1, {PARTIAL: 16})
    assert "no longer uses it" in comm.mesh_reason(ext, mesh, "tp", 4)


@pytest.mark.parametrize("flags,refused", [
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", True),  # XLA's default set records custom calls
    ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_command_buffer_scheduling_mode=concurrent", True),
    ("--xla_gpu_enable_command_buffer=FUSION --xla_gpu_command_buffer_scheduling_mode=CONCURRENT", False),
    ("--xla_gpu_enable_command_buffer= --xla_gpu_command_buffer_scheduling_mode=CONCURRENT", False),
    ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_command_buffer_scheduling_mode=LHS", False),
    ("", False),
])
def test_concurrent_command_buffers_refuse_the_fused_path(flags, refused, monkeypatch):
    # Two fused calls of one communicator must never overlap; under CONCURRENT scheduling with custom
    # calls in command buffers XLA may overlap them (their kernels trapped): the fused path
    # is refused with a reason naming the flag, and the XLA reference runs.
    reason = comm.command_buffer_hazard(flags)
    assert (reason is not None) == refused
    if refused:
        assert "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT" in reason
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert comm.command_buffer_hazard() == reason


def test_compiler_options_override_xla_flags_in_the_hazard():
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert "compiler_options of jax.jit" in comm.command_buffer_hazard("", concurrent)
    assert comm.command_buffer_hazard("", dict(concurrent, xla_gpu_enable_command_buffer="FUSION")) is None
    assert comm.command_buffer_hazard("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
                                      {"xla_gpu_command_buffer_scheduling_mode": "LHS"}) is None
    assert comm.command_buffer_hazard("--xla_gpu_enable_command_buffer=FUSION", concurrent) is None


def test_concurrent_command_buffers_in_jit_compiler_options_refuse_the_fused_path(monkeypatch):
    # jax.jit(f, compiler_options=...) is seen while f is traced, and not cached with the call site's
    # answer: the same call traced without options is not refused. Options given to
    # .lower(...).compile(compiler_options=...) come after the trace and are not seen (documented).
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    # Calls the kernels can run (without the built extension here there is no plan to say so).
    monkeypatch.setattr(rs_fused, "_unavailable", lambda *a: None)
    monkeypatch.setattr(ag_fused, "_unavailable", lambda *a: None)
    _gpu_mesh()
    x, w = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    kw = dict(axis_name="tp", axis_size=2)
    reasons = []

    def f():
        # A new function each time: jax reuses a function's trace whatever the compiler options.
        def traced(v):
            reasons.append([rs_fused.unavailable_reason(x, w, scatter_dimension=0, config=CFG, **kw),
                            ag_fused.unavailable_reason(x, w, gather_k=False, config=AgGemmConfig(gemm_sms=100),
                                                        **kw)])
            return v
        return traced

    v = jnp.zeros(4)
    jax.jit(f()).trace(v)
    jax.jit(f(), compiler_options={"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}).trace(v)
    jax.jit(f(), compiler_options={"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
                                   "xla_gpu_enable_command_buffer": "FUSION"}).trace(v)
    plain, concurrent, without_custom_calls = reasons
    assert plain == without_custom_calls == [None, None]
    for reason in concurrent:
        assert "compiler_options of jax.jit" in reason and "scheduling_mode=CONCURRENT" in reason


def test_concurrent_command_buffers_are_a_reason_of_both_ops(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT")
    ext = FakeExt()
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    mesh = _gpu_mesh()
    x, w = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    kw = dict(axis_name="tp", axis_size=2)
    del mesh  # found through setup(), as under jit
    for reason in (rs_fused.unavailable_reason(x, w, scatter_dimension=0, config=CFG, **kw),
                   ag_fused.unavailable_reason(x, w, gather_k=False, config=AgGemmConfig(gemm_sms=100), **kw)):
        assert "scheduling_mode=CONCURRENT" in reason
    assert not ext.calls and not comm._comms


def test_reserve_grows_once_for_every_call_site(monkeypatch):
    # reserve() traces the function with growth deferred, then creates the communicator once with the
    # largest need of its call sites (each op's prepare asks acquire_comm, as these sites do); tracing
    # the sites again grows nothing.
    ext = FakeExt()
    monkeypatch.setattr(_extension, "registered", lambda: (ext, None))
    mesh = _gpu_mesh()
    sites = [(512, {PARTIAL: 64 << 20}), (4096, {PARTIAL: 8 << 20}), (64, {INBOX: 32 << 20})]

    def step(scale):
        for flags, regions in sites:
            comm.acquire_comm(mesh, "tp", flags, regions)
        return scale * 2

    sized = entwine_jax.reserve(step, jax.ShapeDtypeStruct((), jnp.float32))
    cid = comm.comm_id(comm.device_groups(mesh, "tp"), "tp")
    assert [c[0] for c in ext.calls] == ["comm_create"] + ["comm_connect"] * 2
    assert ext.calls[0][4:6] == (4096, {INBOX: 32 << 20, PARTIAL: 64 << 20})
    entry = comm._comms[cid]
    assert sized == {"tp": ext.heap_bytes(2, *entry.capacity.args())}
    step(1.0)
    assert len(ext.calls) == 3
    # Sites that fit the cap one by one but not together: reserve says so, naming the function, and
    # grows nothing.
    monkeypatch.setenv("ENTWINE_HEAP_MAX_BYTES", str(ext.heap_bytes(2, 4096, {PARTIAL: 128 << 20, INBOX: 32 << 20})))

    def bigger():
        comm.acquire_comm(mesh, "tp", 512, {PARTIAL: 128 << 20})
        comm.acquire_comm(mesh, "tp", 64, {INBOX: 64 << 20})

    with pytest.raises(RuntimeError, match=r"reserve: the heap of axis 'tp' cannot hold every call site of 'bigger'"):
        entwine_jax.reserve(bigger)
    assert len(ext.calls) == 3
    with comm.deferred_growth():
        with pytest.raises(RuntimeError, match="does not nest"):
            with comm.deferred_growth():
                pass
