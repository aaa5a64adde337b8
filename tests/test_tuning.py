# Tuned configs: the shipped table, lookup keys and device classes, the selection order seen through
# gemm_rs (override > user cache > shipped > heuristic, with the ENTWINE_PRINT_CONFIG label), the
# cache writer (merge, atomic), and tune(): refused where the fused path cannot run, and its loop
# (candidates, reference check, winner, cache) on CPU with the fused build stubbed.
import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import GemmRsConfig, _extension, gemm_rs, heuristic_config, set_default_config
from entwine_jax.gemm_rs import op as gemm_rs_op
from entwine_jax.gemm_rs import table
from entwine_jax.tuning import timing
from entwine_jax.tuning import tune as tuner

H200 = ("NVIDIA H200", "hopper-132sm")
TUNED = GemmRsConfig(block_n=128, producer_sms=100, consumer_grid=32, consumer_block=256, raster_rows=4)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Every test: an empty user cache and an empty shipped table in tmp_path, unless it says otherwise."""
    monkeypatch.setenv("ENTWINE_TUNE_CACHE", str(tmp_path / "user" / "tuned.json"))
    monkeypatch.setattr(table, "SHIPPED_PATH", tmp_path / "shipped.json")


def needs_plan():
    """Skip (with the reason) where the extension, and with it the kernels' plan, is not built."""
    if _extension.module()[0] is None:
        pytest.skip(f"the kernels' plan needs the extension: {_extension.module()[1]}")


def entry(config=TUNED, device_kind="NVIDIA H200", world=2, m=32, n=16, k=64, dtype="bfloat16", **extra):
    return dict(device_kind=device_kind, world=world, m=m, n=n, k_local=k, dtype=dtype,
                config=config if isinstance(config, dict) else dataclasses.asdict(config), **extra)


def write_table(path, entries):
    path.write_text(json.dumps({"format": 1, "entries": entries}))


def use_device(monkeypatch, device=H200):
    monkeypatch.setattr(table, "current_device", lambda: device)


def run(world=2, x_shape=(32, 64), n=16, dtype=jnp.bfloat16, columns=False, **kwargs):
    """gemm_rs on `world` CPU devices: x [M, K] sharded on K, scatter over rows (or N); (y, exact)."""
    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (x_shape[-1], n), jnp.float32).astype(dtype)
    f = jax.jit(jax.shard_map(lambda x, w: gemm_rs(x, w, axis_name="tp", scatter_dimension=int(columns), **kwargs),
                              mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                              out_specs=P(None, "tp") if columns else P("tp")))
    with jax.set_mesh(mesh):
        y = f(jax.device_put(x, P(None, "tp")), jax.device_put(w, P("tp", None)))
    return np.asarray(y, np.float64), np.asarray(x, np.float64) @ np.asarray(w, np.float64)


# --- The shipped table --------------------------------------------------------------------------


def test_shipped_table_parses_and_validates(monkeypatch):
    needs_plan()  # the split rule is the kernels' plan
    monkeypatch.undo()  # the real shipped file
    doc = json.loads(table.SHIPPED_PATH.read_text())
    assert doc["format"] == table.FORMAT and "W=8: no measurements" in doc["coverage"]
    keys = set()
    for e in doc["entries"]:
        key, cls, config = table._parse_entry(e)
        assert key not in keys
        keys.add(key)
        assert cls == "hopper-132sm" and e["provenance"]["date"] and e["provenance"]["command"]
        # Each W measured on that many H200s.
        assert e["provenance"]["machine"].startswith(f"{e['world']} x NVIDIA H200")
        # W=2: both dtypes measured (v16); W=4: fp16 is inferred from bf16 and says so.
        assert e["measured"] == (e["world"] == 2 or e["dtype"] == "bfloat16")
        if not e["measured"]:
            assert "not measured" in e["note"]
        assert (config.block_n, config.consumer_block, config.path) == (256, 512, "auto")
        assert config.raster_rows in (8, 16) and config.split_tail in (False, True)
        # A split flag that would not change the producer's schedule is never stored.
        assert not config.split_tail or tuner._split_applies(e["m"], e["n"], e["k_local"], e["world"], config)
        assert config.producer_sms + config.consumer_grid == 132
    assert {k[1] for k in keys} == {2, 4}  # no invented W=8 entries
    assert len(keys) == 32 and {k[5] for k in keys} == {"bfloat16", "float16"}


@pytest.mark.parametrize("shape,grid,w4_grid", [((8192, 8192, 1024), 24, 12), ((16384, 8192, 3584), 8, 8),
                                                 ((16384, 16384, 6656), 4, 4)])
def test_shipped_lookup(monkeypatch, shape, grid, w4_grid):
    monkeypatch.undo()  # the real shipped file
    monkeypatch.setenv("ENTWINE_TUNE_CACHE", "/nonexistent/tuned.json")
    for dtype in (jnp.bfloat16, jnp.float16):
        config, source = table.lookup(*shape, 2, dtype, device_kind="NVIDIA H200", device_cls="hopper-132sm")
        assert source == table.SOURCE_SHIPPED and config.consumer_grid == grid
        assert config.producer_sms == 132 - grid
    # H100 SXM: no entry of its own, the class entry (measured on H200).
    config, source = table.lookup(*shape, 2, jnp.bfloat16, device_kind="NVIDIA H100 80GB HBM3",
                                   device_cls="hopper-132sm")
    assert source == "tuned (shipped) via hopper-132sm" and config.consumer_grid == grid
    # W=4: measured on 4x H200 (v6, its own winners: x=12 at K=1024).
    config, source = table.lookup(*shape, 4, jnp.bfloat16, device_kind="NVIDIA H200", device_cls="hopper-132sm")
    assert source == table.SOURCE_SHIPPED and config.consumer_grid == w4_grid
    # Not measured: W=8, float32, another SM count, another GPU.
    assert table.lookup(*shape, 8, jnp.bfloat16, device_kind="NVIDIA H200", device_cls="hopper-132sm") is None
    assert table.lookup(*shape, 2, jnp.float32, device_kind="NVIDIA H200", device_cls="hopper-132sm") is None
    assert table.lookup(*shape, 2, jnp.bfloat16, device_kind="NVIDIA H100 PCIe", device_cls="hopper-114sm") is None
    assert table.lookup(*shape, 2, jnp.bfloat16, device_kind="NVIDIA A100-SXM4-80GB", device_cls=None) is None


# --- Lookup --------------------------------------------------------------------------------------


def test_device_class():
    class D:
        def __init__(self, **kw):
            self.__dict__.update(kw)
    assert table.device_class(D(platform="gpu", compute_capability="9.0", core_count=132)) == "hopper-132sm"
    assert table.device_class(D(platform="gpu", compute_capability="8.0", core_count=108)) is None
    assert table.device_class(jax.devices()[0]) is None  # CPU
    assert table.current_device() == (jax.devices()[0].device_kind, None)


def test_lookup_key_fields(tmp_path):
    write_table(tmp_path / "shipped.json", [entry()])
    hit = dict(m=32, n=16, k=64, world=2, dtype=jnp.bfloat16, device_kind="NVIDIA H200")
    assert table.lookup(**hit) == (TUNED, table.SOURCE_SHIPPED)
    for field, other in [("m", 16), ("n", 32), ("k", 32), ("world", 4), ("dtype", jnp.float16),
                         ("device_kind", "NVIDIA H100 80GB HBM3")]:
        assert table.lookup(**dict(hit, **{field: other})) is None, field


def test_user_cache_beats_shipped_and_exact_beats_class(tmp_path):
    other = dataclasses.replace(TUNED, consumer_grid=8)
    write_table(tmp_path / "shipped.json", [entry(other, device_class="hopper-132sm"),
                                            entry(other, device_kind="NVIDIA H100 80GB HBM3", m=64)])
    table.write_cache([entry(device_class="hopper-132sm"), entry(device_kind="NVIDIA H200", m=64)])
    args = (32, 16, 64, 2, jnp.bfloat16)
    assert table.lookup(*args, device_kind="NVIDIA H200") == (TUNED, table.SOURCE_USER)
    # Another GPU of the class: the user cache's class entry before the shipped one.
    assert table.lookup(*args, device_kind="NVIDIA H100 80GB HBM3", device_cls="hopper-132sm") == (
        TUNED, "tuned (user cache) via hopper-132sm")
    # An exact entry (even shipped) beats a class entry of the user cache.
    assert table.lookup(64, 16, 64, 2, jnp.bfloat16, device_kind="NVIDIA H100 80GB HBM3",
                         device_cls="hopper-132sm") == (other, table.SOURCE_SHIPPED)


def test_cache_path_env_and_default(monkeypatch, tmp_path):
    assert table.cache_path() == tmp_path / "user" / "tuned.json"
    monkeypatch.delenv("ENTWINE_TUNE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert table.cache_path() == tmp_path / ".cache" / "entwine_jax" / "tuned.json"


def test_bad_files_are_ignored_with_a_warning(tmp_path, caplog):
    table.cache_path().parent.mkdir(parents=True)
    table.cache_path().write_text("{not json")
    bad = entry(m=8, config=dict(dataclasses.asdict(TUNED), block_n=64))
    unknown = entry(m=16, config=dict(dataclasses.asdict(TUNED), tiles=3))
    write_table(tmp_path / "shipped.json", [bad, unknown, {"device_kind": "x"}, entry()])
    with caplog.at_level(logging.WARNING, logger="entwine_jax"):
        assert table.lookup(32, 16, 64, 2, jnp.bfloat16, device_kind="NVIDIA H200") == (TUNED, table.SOURCE_SHIPPED)
        assert table.lookup(8, 16, 64, 2, jnp.bfloat16, device_kind="NVIDIA H200") is None
    msgs = [r.getMessage() for r in caplog.records]
    assert any("tuned.json ignored" in m for m in msgs)
    assert any("entry 0 ignored" in m and "block_n must be one of" in m for m in msgs)
    assert any("entry 1 ignored" in m and "tiles" in m for m in msgs)
    assert any("entry 2 ignored" in m and "lacks" in m for m in msgs)


def test_configs_the_kernels_cannot_run_are_ignored(tmp_path, caplog):
    # consumer_grid 100: the consumer kernel serves at most 64 CTAs; an entry asking for more is never picked.
    write_table(tmp_path / "shipped.json", [entry({**dataclasses.asdict(TUNED), "consumer_grid": 100})])
    with caplog.at_level(logging.WARNING, logger="entwine_jax"):
        assert table.lookup(32, 16, 64, 2, jnp.bfloat16, device_kind="NVIDIA H200") is None
    assert "entry 0 ignored" in caplog.text and "consumer_grid must be <= 64" in caplog.text


def test_table_reread_when_file_changes(tmp_path):
    write_table(tmp_path / "shipped.json", [entry()])
    assert table.lookup(32, 16, 64, 2, jnp.bfloat16, device_kind="NVIDIA H200")[0] == TUNED
    other = dataclasses.replace(TUNED, raster_rows=2)
    table.write_cache([entry(other)])
    assert table.lookup(32, 16, 64, 2, jnp.bfloat16, device_kind="NVIDIA H200") == (other, table.SOURCE_USER)


# --- Selection through gemm_rs -------------------------------------------------------------------


def test_selection_order_and_print_label(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    use_device(monkeypatch)
    shipped = dataclasses.replace(TUNED, consumer_grid=8)
    write_table(tmp_path / "shipped.json", [entry(shipped)])

    def printed(**kwargs):
        gemm_rs_op.printed.clear()
        y, exact = run(**kwargs)
        assert np.abs(y - exact).max() <= 2e-2 * np.abs(exact).max()
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("entwine_jax.gemm_rs")]
        assert len(lines) == 1
        return lines[0]

    # Key: x as gemm_rs sees it, [32, 32] per rank here (K_local = 64 / 2 = 32): no entry yet.
    line = printed()
    assert "source=heuristic" in line and str(heuristic_config(32, 16, 32, 2, jnp.bfloat16)) in line
    assert "reason: " in line  # CPU: the XLA path, and still says why
    write_table(tmp_path / "shipped.json", [entry(shipped, k=32)])
    line = printed()
    assert "source=tuned (shipped)" in line and str(shipped) in line
    table.write_cache([entry(k=32)])
    line = printed()
    assert "source=tuned (user cache)" in line and str(TUNED) in line
    # Only row scatters were tuned: a scatter over N is not looked up.
    assert "source=heuristic" in printed(columns=True)
    override = GemmRsConfig(consumer_grid=4)
    line = printed(config=override)
    assert "source=override" in line and str(override) in line
    set_default_config(override)
    line = printed()
    assert "source=override" in line and str(override) in line
    set_default_config(None)
    # Another W, dtype or device kind: the heuristic again.
    assert "source=heuristic" in printed(world=4, x_shape=(32, 128))
    assert "source=heuristic" in printed(dtype=jnp.float16)
    use_device(monkeypatch, ("NVIDIA H100 80GB HBM3", "hopper-132sm"))
    assert "source=heuristic" in printed()  # the entries carry no device_class


def test_class_match_label(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    use_device(monkeypatch, ("NVIDIA H100 80GB HBM3", "hopper-132sm"))
    write_table(tmp_path / "shipped.json", [entry(k=32, device_class="hopper-132sm")])
    run()
    assert "source=tuned (shipped) via hopper-132sm" in capsys.readouterr().err


def test_broken_lookup_falls_back_to_heuristic(monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(table, "lookup", boom)
    with caplog.at_level(logging.WARNING, logger="entwine_jax"):
        config, source = table.select_config(32, 16, 32, 2, jnp.bfloat16)
    assert source == table.SOURCE_HEURISTIC and config == heuristic_config(32, 16, 32, 2, jnp.bfloat16)
    assert any("disk on fire" in r.getMessage() for r in caplog.records)


# --- The cache writer ----------------------------------------------------------------------------


def test_write_cache_merges(tmp_path):
    path = tmp_path / "deep" / "dir" / "tuned.json"
    a, b = entry(m=32), entry(m=64)
    assert table.write_cache([a, b], path) == path
    replaced = entry(dataclasses.replace(TUNED, consumer_grid=2), m=64)
    table.write_cache([replaced, entry(m=128)], path)
    doc = json.loads(path.read_text())
    assert doc["format"] == 1
    assert sorted((e["m"], e["config"]["consumer_grid"]) for e in doc["entries"]) == [(32, 32), (64, 2), (128, 32)]
    assert sorted(os.listdir(path.parent)) == ["tuned.json", "tuned.json.lock"]  # no temp files left


def test_write_cache_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    table.write_cache([entry()], path)
    before = path.read_text()

    def dump_half(doc, f, **kwargs):
        f.write('{"format": 1, "entr')
        raise OSError("disk full")
    monkeypatch.setattr(table.json, "dump", dump_half)
    with pytest.raises(OSError, match="disk full"):
        table.write_cache([entry(m=64)], path)
    assert path.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["tuned.json", "tuned.json.lock"]


def test_write_cache_refuses_invalid_and_replaces_unreadable(tmp_path, caplog):
    path = tmp_path / "tuned.json"
    with pytest.raises(ValueError, match="dtype must be one of"):
        table.write_cache([entry(dtype="float32")], path)
    assert not path.exists()
    path.write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="entwine_jax"):
        table.write_cache([entry()], path)
    assert "unreadable" in caplog.text and len(json.loads(path.read_text())["entries"]) == 1


# --- tune() --------------------------------------------------------------------------------------


def test_tune_exported(monkeypatch):
    # entwine_jax.tune imports the tuner on first use and hands it every argument.
    seen = []
    monkeypatch.setattr(tuner, "tune", lambda *a, **k: seen.append((a, k)) or "result")
    assert entwine_jax.tune("mesh", "tp", [(1, 2, 3)], iters=7) == "result" and "tune" in entwine_jax.__all__
    assert seen == [(("mesh", "tp", [(1, 2, 3)]), {"iters": 7})]


def mesh(world=2):
    return jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])


def test_tune_refuses_on_cpu_with_the_reason(tmp_path):
    with pytest.raises(RuntimeError, match=r"cannot run shape \(M, N, K_local\)=\(256, 256, 128\) on this mesh: "
                                           r"not running on CUDA GPUs.*refusing to tune the XLA fallback"):
        entwine_jax.tune(mesh(), "tp", [(256, 256, 128)])
    assert not table.cache_path().exists()


def test_tune_refuses_without_extension(monkeypatch):
    monkeypatch.setattr(_extension, "module", lambda: (None, "ImportError: no _entwine"))
    with pytest.raises(RuntimeError, match=r"the fused path cannot run"):
        entwine_jax.tune(mesh(), "tp", [(256, 256, 128)])


@pytest.mark.parametrize("kwargs,match", [
    (dict(axis_name="dp"), r"axis 'dp' is not an axis of the mesh \(axes \('tp',\)\)"),
    (dict(shapes=[(255, 256, 128)]), r"M=255 \(rows of the local x\) must be divisible by the axis size 2"),
    (dict(shapes=[(256, 256)]), r"shapes must be \(M, N, K_local\) tuples of positive ints, got \(256, 256\)"),
    (dict(shapes=[]), r"shapes is empty"),
    (dict(dtype=jnp.float32), r"dtype must be bfloat16 or float16"),
    (dict(iters=0), r"iters must be an int >= 1, got 0"),
    (dict(candidates=[GemmRsConfig(path="xla")]), r"has path='xla'"),
    (dict(candidates=[{"tiles": 2}]), r"candidate \{'tiles': 2\}"),
    (dict(candidates=["fast"]), r"candidates must be GemmRsConfigs or dicts"),
])
def test_tune_argument_errors(kwargs, match):
    args = dict(dict(mesh=mesh(), axis_name="tp", shapes=[(256, 256, 128)]), **kwargs)
    with pytest.raises(ValueError, match=r"^tune: .*" + match):
        entwine_jax.tune(**args)


def test_tune_refuses_an_axis_of_size_one():
    with pytest.raises(ValueError, match=r"^tune: axis 'tp' has size 1: gemm_rs runs XLA's GEMM there"):
        entwine_jax.tune(mesh(1), "tp", [(256, 256, 128)])


def test_default_candidates():
    needs_plan()  # the budget cap is the blocks of the kernels' plan
    h = heuristic_config(8192, 8192, 1024, 2, jnp.bfloat16)
    c = tuner.default_candidates(8192, 8192, 1024, 2, jnp.bfloat16, sm_count=132)
    assert c[0] == h and len(c) == len(set(c))
    # Stage 1 varies the budget only; the producer keeps the heuristic's order and no split.
    assert {x.consumer_grid for x in c} == set(tuner.TUNE_BUDGETS) | {h.consumer_grid}
    assert {(x.block_n, x.consumer_block, x.raster_rows, x.split_tail) for x in c} == {(256, 512, 8, False)}
    assert all(x.producer_sms + x.consumer_grid == 132 for x in c)
    # N not a multiple of 256: the heuristic's 128-wide block throughout.
    assert {x.block_n for x in tuner.default_candidates(8192, 8320, 1024, 2, jnp.bfloat16, sm_count=132)} == {128}
    # A small partition: budgets capped at its blocks (2 rows x 2 blocks of 256), duplicates dropped.
    small = tuner.default_candidates(512, 512, 64, 2, jnp.bfloat16, sm_count=132)
    assert len(small) == len(set(small)) and max(x.consumer_grid for x in small) == 4


def test_refined_candidates():
    needs_plan()  # the split rule and the tile rows are the kernels' plan
    best = GemmRsConfig(block_n=256, producer_sms=124, consumer_grid=8)
    # 16384x8192x3584, W=2: 2 x 64 x 32 = 4096 blocks on 124 CTAs leave 4 of them in the last wave,
    # 120 CTAs idle for 56 k-tiles each: the split applies (producer_schedule in ffi/gemm_rs/plan.cc).
    r = tuner.refined_candidates(best, 16384, 8192, 3584, 2)
    # The winner first, then the split tail and 16-row raster groups at the winning budget.
    assert r == [best, dataclasses.replace(best, split_tail=True), dataclasses.replace(best, raster_rows=16)]
    # A partition of 8 tile rows or fewer: 16-row groups would be the same order, so not tried.
    assert tuner.refined_candidates(best, 2048, 8192, 3584, 2) == [best, dataclasses.replace(best, split_tail=True)]
    # A winner that already splits: no duplicate.
    split = dataclasses.replace(best, split_tail=True)
    assert tuner.refined_candidates(split, 2048, 8192, 3584, 2) == [split]
    # 4096x8192x1024 on 100 CTAs: 1024 blocks leave 24 in the last wave, 76 CTAs idle for 16 k-tiles
    # each (< 16 per CTA of the grid on average): the split would run the same schedule, not tried.
    wide = GemmRsConfig(block_n=256, producer_sms=100, consumer_grid=32)
    assert tuner.refined_candidates(wide, 4096, 8192, 1024, 2) == [wide, dataclasses.replace(wide, raster_rows=16)]
    # Whole waves (no remainder) and grids of more than 161 CTAs never split.
    assert not tuner._split_applies(4096, 8192, 1024, 2, dataclasses.replace(wide, producer_sms=128, split_tail=True))
    assert not tuner._split_applies(16384, 8192, 3584, 2, GemmRsConfig(block_n=256, producer_sms=0, split_tail=True))


def test_tune_loop_on_cpu_with_stubbed_fused_build(monkeypatch, caplog):
    # The real fused path cannot run here: stub the availability and the build (the reference
    # program stands in for the fused one) and make one candidate wrong, to exercise the loop.
    wrong = GemmRsConfig(block_n=256, producer_sms=100, consumer_grid=32)
    broken = GemmRsConfig(block_n=256, producer_sms=124, consumer_grid=8)
    good = [GemmRsConfig(block_n=128, producer_sms=124, consumer_grid=8),
            GemmRsConfig(block_n=128, producer_sms=116, consumer_grid=16)]
    built = []

    def build(mesh, axis_name, config, x, w):
        built.append(config)
        if config == broken:
            raise RuntimeError("ptxas died")
        fn = lambda x, w: gemm_rs(x, w, axis_name=axis_name, config=GemmRsConfig(path="xla"))  # noqa: E731
        if config == wrong:
            fn = lambda x, w: 2 * gemm_rs(x, w, axis_name=axis_name, config=GemmRsConfig(path="xla"))  # noqa: E731
        return tuner._compile(mesh, axis_name, fn, x, w)[1], None

    monkeypatch.setattr(tuner, "_unavailable", lambda *a: None)
    monkeypatch.setattr(tuner, "_build", build)
    shapes = [(64, 128, 32), (128, 128, 64)]
    with caplog.at_level(logging.WARNING, logger="entwine_jax"):
        result = entwine_jax.tune(mesh(), "tp", shapes, candidates=[wrong, good[0], {"consumer_grid": 16}, broken],
                                  iters=2, warmup=1)
    assert caplog.text.count("skipped: wrong result") == 2 and caplog.text.count("skipped: does not compile") == 2
    assert set(result) == set(shapes) and len(built) == 8
    for shape in shapes:
        best, ms, trials = result[shape]
        assert best in good and ms > 0 and [t["config"] for t in trials] == [wrong, *good, broken]
        assert trials[0]["ms"] is None and "wrong result: relative error" in trials[0]["skipped"]
        assert all(t["ms"] > 0 and t["rel_err"] <= 1e-2 and t["skipped"] is None for t in trials[1:3])
        assert trials[3]["ms"] is None and "does not compile (RuntimeError: ptxas died)" == trials[3]["skipped"]
    doc = json.loads(table.cache_path().read_text())
    assert len(doc["entries"]) == 2
    e = doc["entries"][0]
    assert (e["device_kind"], e["world"], e["dtype"]) == (jax.devices()[0].device_kind, 2, "bfloat16")
    assert "entwine_jax.tune(" in e["provenance"]["command"] and e["provenance"]["date"]
    # The winners are what gemm_rs picks next on this (CPU) device kind.
    config, source = table.select_config(64, 128, 32, 2, jnp.bfloat16)
    assert source == table.SOURCE_USER and config == result[(64, 128, 32)][0]


def test_tune_two_stages_on_cpu_with_stubbed_timing(monkeypatch):
    needs_plan()  # stage 2's 16-row raster candidate is tried where the plan has more tile rows
    # Default candidates: stage 1 picks a budget, stage 2 times the winner again beside its split
    # and 16-row raster variants; the fastest of stage 2 is stored. Timing and build are stubbed.
    slow = GemmRsConfig(block_n=256, producer_sms=116, consumer_grid=16)
    fast = GemmRsConfig(block_n=256, producer_sms=108, consumer_grid=24)
    rounds = iter([{0: 2.0, 1: 1.0}, {0: 1.0, 1: 0.9, 2: 1.1}])
    monkeypatch.setattr(tuner, "default_candidates", lambda *a, **k: [slow, fast])
    monkeypatch.setattr(tuner, "_unavailable", lambda *a: None)
    monkeypatch.setattr(tuner, "_build", lambda mesh, axis_name, config, x, w: (tuner._compile(
        mesh, axis_name, lambda x, w: gemm_rs(x, w, axis_name=axis_name, config=GemmRsConfig(path="xla")), x, w)[1], None))
    monkeypatch.setattr(timing, "time_interleaved", lambda programs, *a, **k: next(rounds))
    # A small shape for the CPU, on which the split is taken to change the schedule.
    monkeypatch.setattr(tuner, "_split_applies", lambda *a: True)
    best, ms, trials = entwine_jax.tune(mesh(), "tp", [(4096, 128, 32)], iters=2, warmup=1)[(4096, 128, 32)]
    assert best == dataclasses.replace(fast, split_tail=True) and ms == 0.9
    assert [(t["stage"], t["config"]) for t in trials] == [
        (1, slow), (1, fast), (2, fast), (2, dataclasses.replace(fast, split_tail=True)),
        (2, dataclasses.replace(fast, raster_rows=16))]
    doc = json.loads(table.cache_path().read_text())
    assert doc["entries"][0]["config"]["split_tail"] is True
    # The deciding round is stage 2: the winner (0.9 ms) leads the next of that round (1.0) by 11%.
    assert tuner.runner_up_margin(trials) == pytest.approx(1.0 / 0.9 - 1)


def test_runner_up_margin():
    def trial(stage, ms):
        return {"stage": stage, "ms": ms}

    # The last stage that timed anything decides; untimed (skipped) trials do not count.
    assert tuner.runner_up_margin([trial(1, 1.0), trial(1, 2.0), trial(2, 1.5), trial(2, 1.2), trial(2, None)]) \
        == pytest.approx(1.5 / 1.2 - 1)
    assert tuner.runner_up_margin([trial(1, 1.0), trial(1, 1.004), trial(2, None)]) == pytest.approx(0.004)
    assert tuner.runner_up_margin([trial(1, 1.0)]) is None
    assert tuner.runner_up_margin([trial(1, None)]) is None
    assert tuner.runner_up_margin([]) is None


def test_other_processes_wait_for_process_0s_write(monkeypatch, tmp_path):
    # tune() is a collective: after it, every process must see the winners process 0 wrote, or the
    # ranks of the next program's fused calls could pick different configs.
    events = []
    monkeypatch.setattr(tuner, "write_cache", lambda entries, path: events.append(("write", len(entries))) or path)
    monkeypatch.setattr(tuner._distributed, "barrier", lambda name, ids, me, timeout: events.append(("barrier", me)))
    tuner._publish([{"m": 1}], tmp_path / "c.json", process=0, processes=2)
    tuner._publish([{"m": 1}], tmp_path / "c.json", process=1, processes=2)
    assert events == [("write", 1), ("barrier", 0), ("barrier", 1)]
    events.clear()
    tuner._publish([{"m": 1}], tmp_path / "c.json", process=0, processes=1)  # one process: no barrier
    assert events == [("write", 1)]
