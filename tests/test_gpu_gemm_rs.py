# GPU tests of the fused gemm_rs path. (1) One process driving every local GPU (W = local GPU
# count, W = 1 on a single H200): suite shapes and shapes with tails, bf16 and fp16, against the
# fp32-accumulated psum_scatter reference, bitwise repeatable. (2) W processes per GPU or one per GPU,
# through tests/gpu_ranks.py (the multi-process launcher; see its docstring): every suite of its table.
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import entwine_jax
from entwine_jax import comm
from entwine_jax.gemm_rs import fused as rs_fused
from entwine_jax import GemmRsConfig, heuristic_config
from entwine_jax.gemm_rs.reference import gemm_rs_reference

from gpu_harness import checking_suites
from gpu_ranks import SUITES

RANKS = pathlib.Path(__file__).with_name("gpu_ranks.py")

# The benchmarks' design suite (M, N, K_local; entwine_jax.tuning.timing.DESIGN_SUITE), the first ones, scaled
# to fit any GPU count.
SUITE = [(4096, 8192, 1024), (8192, 8192, 1024), (8192, 8192, 3584), (8192, 16384, 2048)]
# Tails: M/W and N not multiples of 128, K not a multiple of 64 (and not of 8).
TAILS = [(200, 1000, 1000), (77, 130, 60), (129, 257, 72), (1, 1, 3)]
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


def _mesh():
    gpus = jax.devices("cuda")[:8]
    return jax.sharding.Mesh(np.array(gpus), ("tp",))


def _inputs(mesh, m, n, k, dtype, seed):
    w_count = mesh.shape["tp"]
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, w_count * k), np.float32) / np.sqrt(w_count * k)).astype(dtype)
    w = rng.standard_normal((w_count * k, n), np.float32).astype(dtype)
    return (jax.device_put(x, NamedSharding(mesh, P(None, "tp"))),
            jax.device_put(w, NamedSharding(mesh, P("tp", None))))


def _fns(mesh, config, scatter_dimension=0):
    world = mesh.shape["tp"]

    def fused_body(x, w):
        return rs_fused.call_local(x, w, axis_name="tp", axis_size=world, config=config,
                                   scatter_dimension=scatter_dimension)

    def ref_body(x, w):
        y = jnp.dot(x, w, preferred_element_type=jnp.float32)
        return jax.lax.psum_scatter(y, "tp", scatter_dimension=scatter_dimension, tiled=True).astype(x.dtype)

    out_spec = P("tp", None) if scatter_dimension == 0 else P(None, "tp")
    specs = dict(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=out_spec)
    return jax.jit(jax.shard_map(fused_body, **specs)), jax.jit(jax.shard_map(ref_body, **specs))


def _check(mesh, m, n, k, dtype, block_n=128, seed=0, scatter_dimension=0):
    world = mesh.shape["tp"]
    config = dataclasses.replace(heuristic_config(m, n, k, world, dtype), block_n=block_n)
    x, w = _inputs(mesh, m, n, k, dtype, seed)
    with jax.set_mesh(mesh):
        reason = rs_fused.unavailable_reason(
            jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype),
            axis_name="tp", axis_size=world, scatter_dimension=scatter_dimension, config=config)
        assert reason is None, reason
        f, ref = _fns(mesh, config, scatter_dimension)
        ys = [np.asarray(f(x, w)) for _ in range(3)]
        expected = np.asarray(ref(x, w))
    comm.check_errors()
    err = np.linalg.norm(ys[0].astype(np.float32) - expected.astype(np.float32))
    norm = np.linalg.norm(expected.astype(np.float32))
    assert err <= TOL[dtype] * norm, f"rel error {err / norm:.3g} for M={m} N={n} K={k} W={world} {dtype.__name__}"
    for y in ys[1:]:
        assert np.array_equal(y.view(np.uint16), ys[0].view(np.uint16)), "repeated calls differ bitwise"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m, n, k", SUITE)
def test_suite_shapes(m, n, k, dtype):
    _check(_mesh(), m, n, k, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("mp, n, k", TAILS)
def test_tails(mp, n, k, block_n, dtype):
    mesh = _mesh()
    _check(mesh, mp * mesh.shape["tp"], n, k, dtype, block_n=block_n, seed=mp)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("m, n_per, k", [(4096, 2048, 1024), (200, 300, 72), (1, 1, 3)])
def test_scatter_columns(m, n_per, k, block_n, dtype):
    # Partition q = columns q*N/W .. (MaxText's hidden-dimension tensor parallelism).
    mesh = _mesh()
    _check(mesh, m, n_per * mesh.shape["tp"], k, dtype, block_n=block_n, seed=m, scatter_dimension=1)


@pytest.mark.gpu
def test_public_api_takes_the_fused_path():
    # entwine_jax.gemm_rs under jit lowers to the custom call (not the reference) on Hopper. On one
    # GPU (W = 1) the default keeps XLA's GEMM (nothing to reduce) and path="fused" forces the call.
    mesh = _mesh()
    world = mesh.shape["tp"]
    x, w = _inputs(mesh, 256 * world, 512, 256, jnp.bfloat16, 3)

    def fn(config):
        return jax.jit(jax.shard_map(lambda x, w: entwine_jax.gemm_rs(x, w, axis_name="tp", config=config), mesh=mesh,
                                     in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))

    with jax.set_mesh(mesh):
        _, ref = _fns(mesh, GemmRsConfig())
        expected = np.asarray(ref(x, w)).astype(np.float32)
        if world == 1:
            assert "entwine_gemm_rs" not in fn(None).lower(x, w).as_text()
        f = fn(GemmRsConfig(path="fused") if world == 1 else None)
        assert "entwine_gemm_rs" in f.lower(x, w).as_text()
        y = np.asarray(f(x, w)).astype(np.float32)
    assert np.linalg.norm(y - expected) <= 1e-2 * np.linalg.norm(expected)


@pytest.mark.gpu
def test_setup_without_set_mesh():
    # Outside jax.set_mesh the mesh comes from entwine_jax.comm.setup().
    mesh = _mesh()
    world = mesh.shape["tp"]
    comm.setup(mesh, "tp")
    config = heuristic_config(128 * world, 256, 64, world, jnp.bfloat16)
    x, w = _inputs(mesh, 128 * world, 256, 64, jnp.bfloat16, 4)
    f, ref = _fns(mesh, config)
    y, expected = np.asarray(f(x, w)), np.asarray(ref(x, w))
    assert np.linalg.norm(y.astype(np.float32) - expected.astype(np.float32)) <= 1e-2 * np.linalg.norm(
        expected.astype(np.float32))


@pytest.mark.gpu
def test_inside_scan_and_remat():
    # MaxText's scan_layers and remat: gemm_rs in the body of lax.scan (a while loop on the device
    # that executes the custom call once per step) and under jax.checkpoint with gradients (the
    # backward recomputes the fused forward). On one GPU (W = 1) path="fused" forces the call.
    mesh = _mesh()
    world = mesh.shape["tp"]
    layers, m, n, k = 3, 256 * world, 512, 256
    config = GemmRsConfig(path="fused") if world == 1 else None
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((m, world * k), np.float32) / np.sqrt(world * k), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((layers, world * k, n), np.float32), jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((layers, m, n), np.float32), jnp.float32)
    specs = dict(mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp", None)), out_specs=P(None, "tp", None))

    def scanned(op):
        def body(x, ws):
            return jax.lax.scan(lambda c, w: (c, op(x, w)), None, ws)[1]
        return jax.shard_map(body, **specs)

    fused_op = lambda x, w: entwine_jax.gemm_rs(x, w, axis_name="tp", config=config)
    ref_op = lambda x, w: gemm_rs_reference(x, w, axis_name="tp")
    f, ref = jax.jit(scanned(jax.checkpoint(fused_op))), jax.jit(scanned(ref_op))
    loss = lambda g: lambda x, ws: jnp.sum(g(x, ws).astype(jnp.float32) * cot)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
        ws = jax.device_put(ws, NamedSharding(mesh, P(None, "tp", None)))
        lowered = f.lower(x, ws).as_text()
        assert "entwine_gemm_rs" in lowered and "while" in lowered
        y, expected = np.asarray(f(x, ws), np.float32), np.asarray(ref(x, ws), np.float32)
        grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, ws)
        grads_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(x, ws)
    comm.check_errors()
    assert y.shape == (layers, m, n)
    for i in range(layers):
        assert np.linalg.norm(y[i] - expected[i]) <= 1e-2 * np.linalg.norm(expected[i]), f"scan step {i}"
    for g, g_ref, name in zip(grads, grads_ref, ("dx", "dw")):
        g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
        assert np.linalg.norm(g - g_ref) <= 1e-2 * np.linalg.norm(g_ref), name


@pytest.mark.gpu
def test_heap_cap_gives_the_xla_path(monkeypatch):
    mesh = _mesh()
    world = mesh.shape["tp"]
    monkeypatch.setenv("ENTWINE_HEAP_MAX_BYTES", str(1 << 20))
    m, n, k = 16384 * world, 16384, 64  # larger than every heap the other tests grew
    with jax.set_mesh(mesh):
        reason = rs_fused.unavailable_reason(
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
            axis_name="tp", axis_size=world, scatter_dimension=0, config=GemmRsConfig())
    assert reason is not None and "ENTWINE_HEAP_MAX_BYTES" in reason


# The launcher's limit per suite, below this test's limit for the whole command: the launcher, not
# pytest, kills a suite that runs too long, after its ranks printed their stacks.
SUITE_TIMEOUT_S = 600


def _ranks(*args, timeout=3600):
    cmd = [sys.executable, str(RANKS), "--timeout", str(SUITE_TIMEOUT_S), *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    except subprocess.TimeoutExpired as e:
        shown = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{shown[-6000:]}")
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    return out.stdout


# Every checking suite of gpu_ranks' table runs at W = 2 time-sliced (a new suite joins by its row);
# these also at W = 3 (a world that no power of two hides), and these under MPS.
AT_W3 = ["quick", "cmdbuf", "skipcall", "disagree", "fp8", "fp8half", "forward", "moe", "moemlp", "moestack"]
UNDER_MPS = "quick,ag,forward,moe,moemlp,moestack"


def test_suite_table():
    # CPU: every row names a Rank class with the suite's method, the pytest lists name rows, and
    # `--suite all` runs every checking suite (a second launch comes with its first).
    for name, spec in SUITES.items():
        assert callable(getattr(spec.ranks, name, None)), f"{spec.ranks.__name__} has no suite method {name}"
        assert spec.part_of is None or spec.part_of in SUITES, name
    assert set(AT_W3) | set(UNDER_MPS.split(",")) <= set(SUITES)
    covered = {n for s in checking_suites(SUITES) for n in [s, *(m for m, x in SUITES.items() if x.part_of == s)]}
    assert covered == {n for n, spec in SUITES.items() if spec.checking}


def test_ranks_help_from_another_folder(tmp_path):
    # scripts run `python3 -P tests/gpu_ranks.py` from /tmp: the suite modules load from its folder.
    out = subprocess.run([sys.executable, "-P", str(RANKS), "--help"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert all(name in out.stdout for name in SUITES)


@pytest.mark.gpu
@pytest.mark.parametrize("suite", checking_suites(SUITES))
def test_suite_time_sliced(suite):
    _ranks("--world", "2", "--gpus", "1", "--suite", suite)


@pytest.mark.gpu
@pytest.mark.parametrize("suite", AT_W3)
def test_suite_three_ranks(suite):
    _ranks("--world", "3", "--gpus", "1", "--suite", suite)


@pytest.mark.gpu
def test_four_processes_sharing_one_gpu():
    _ranks("--world", "4", "--gpus", "1", "--suite", "quick")


@pytest.mark.gpu
def test_forward_progress_one_rank():
    # Explicit configs (the dataclass defaults, the largest grids, both pushes) and fused calls
    # beside a kernel of another stream that holds SMs until it is released.
    _ranks("--world", "1", "--gpus", "1", "--suite", "forward")


def _needs_mps():
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control not found: the concurrent (MPS) mode cannot start")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_at_once_under_mps(world):
    # The ranks' kernels share the SMs at once (a private MPS server), as kernels of other streams
    # do on a real node: every call must still finish, correctly.
    _needs_mps()
    _ranks("--world", str(world), "--gpus", "1", "--mps", "--suite", UNDER_MPS)


@pytest.mark.gpu
def test_ranks_under_mps_with_a_thread_percentage():
    _needs_mps()
    _ranks("--world", "2", "--gpus", "1", "--mps", "--mps-percent", "50", "--suite", "quick,ag")


@pytest.mark.multigpu
def test_one_process_per_gpu():
    _ranks("--world", "2", "--gpus", "2", "--suite", "all")
