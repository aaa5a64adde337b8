# CPU smoke test of the benchmark machinery (benchmarks/bench.py, entwine_jax.tuning.timing) on 8 fake devices
# with tiny shapes: the table, the JSON fields, the loud XLA-fallback label, the result check, the
# config list, the budget sweep, the smoke run without CUDA GPUs and the progress count. Timings on
# CPU mean nothing and are not asserted.
import argparse
import pathlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import _log
from entwine_jax.tuning import timing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmark programs
import bench  # noqa: E402

FAST = ["--iters", "2", "--warmup", "1", "--batch", "1"]
ROW_KEYS = {"m", "n", "k", "gemm_ms", "rs_ms", "xla_gemm_rs_ms", "windowed_ms", "windowed_loop", "entwine_ms",
            "speedup", "efficiency", "vs_windowed", "check", "rel_err", "path", "reason", "config", "configs"}


def run(tmp_path, *argv):
    out = tmp_path / "out.json"
    rc = bench.main([*argv, *FAST, "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_suite_table_and_json(tmp_path, capsys):
    rc, result = run(tmp_path, "--shapes", "256x256x64,512x128x32")
    assert rc == 0
    for key in ("machine", "device_kind", "jax", "dtype", "world", "rows", "geomean", "windowed_options"):
        assert key in result, key
    assert result["world"] == len(jax.devices()) == 8 and result["dtype"] == "bf16"
    assert result["jax"] == jax.__version__
    assert [(r["m"], r["n"], r["k"]) for r in result["rows"]] == [(256, 256, 64), (512, 128, 32)]
    for r in result["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["check"] == "OK" and r["rel_err"] <= bench.TOL
        assert all(r[k] > 0 for k in ("gemm_ms", "rs_ms", "xla_gemm_rs_ms", "windowed_ms", "entwine_ms"))
        assert r["speedup"] == pytest.approx(r["xla_gemm_rs_ms"] / r["entwine_ms"])
        assert r["efficiency"] == pytest.approx(max(r["gemm_ms"], r["rs_ms"]) / r["entwine_ms"])
        # CPU: the fused kernels cannot run, and the bench must say why instead of claiming entwine speed.
        assert r["path"] == "xla" and r["reason"]
        assert r["config"].startswith("GemmRsConfig(")
        # CPU's SPMD partitioner ignores the xla_gpu windowed-einsum options.
        assert r["windowed_loop"] is False
    assert set(result["geomean"]) == {"speedup", "efficiency", "vs_windowed"}
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("M "))
    for column in ("gemm_ms", "rs_ms", "xla_gemm_rs_ms", "windowed_ms", "entwine_ms", "speedup", "efficiency",
                   "vs_windowed", "check"):
        assert column in header, column
    rows = [line for line in lines if line.lstrip().startswith(("256 ", "512 "))]
    assert len(rows) == 2 and all("path=xla (" in line and " OK " in line for line in rows)
    assert "geomean over 2 checked shapes" in out and "XLA fallback" in out


def test_fp16_world_and_configs(tmp_path):
    rc, result = run(tmp_path, "--shapes", "256x128x64", "--dtype", "fp16", "--world", "4",
                     "--configs", "consumer_grid=4;block_n=128,consumer_grid=8")
    assert rc == 0 and result["world"] == 4 and result["dtype"] == "fp16"
    (row,) = result["rows"]
    # Every config's time is reported; the row carries one of them.
    assert [("consumer_grid=4" in t["config"], "consumer_grid=8" in t["config"]) for t in row["configs"]] == [
        (True, False), (False, True)]
    assert all(t["ms"] > 0 and t["ok"] for t in row["configs"])
    assert row["entwine_ms"] == min(t["ms"] for t in row["configs"])


def test_wrong_result_is_marked_fail(tmp_path, monkeypatch, capsys):
    def wrong(x, w, *, axis_name, config=None):
        return jax.lax.psum_scatter(2 * jnp.dot(x, w), axis_name, scatter_dimension=0, tiled=True)

    monkeypatch.setattr(entwine_jax, "gemm_rs", wrong)
    rc, result = run(tmp_path, "--shapes", "256x128x64")
    assert rc == 1 and result["rows"][0]["check"] == "FAIL" and result["rows"][0]["rel_err"] > 0.5
    assert " FAIL " in capsys.readouterr().out


def test_sweep_budget(tmp_path, capsys):
    rc, result = run(tmp_path, "--sweep-budget", "--shapes", "256x256x64", "--world", "2")
    assert rc == 0 and result["rows"] == []
    assert [r["consumer_grid"] for r in result["sweep"]] == list(bench.BUDGETS)
    for r in result["sweep"]:
        assert r["ms"] > 0 and r["path"] == "xla" and f"consumer_grid={r['consumer_grid']}," in r["config"]
    assert capsys.readouterr().out.count("path=xla (") == len(bench.BUDGETS)


def test_plot_written_or_refused_before_running(tmp_path, capsys):
    png = tmp_path / "speedup.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        # Refused at once (exit 2, the argparse way), before any benchmark runs.
        with pytest.raises(SystemExit) as e:
            bench.main(["--shapes", "256x128x64", "--world", "2", *FAST, "--plot", str(png)])
        assert e.value.code == 2 and "needs matplotlib" in capsys.readouterr().err
        assert not png.exists()
    else:
        assert bench.main(["--shapes", "256x128x64", "--world", "2", *FAST, "--plot", str(png)]) == 0
        assert png.stat().st_size > 0


def test_parsers():
    assert bench.parse_shapes("4096x8192x1024,8x16x32") == [(4096, 8192, 1024), (8, 16, 32)]
    assert bench.parse_configs("block_n=256,producer_sms=132,consumer_grid=16;block_n=128;path=xla") == [
        {"block_n": 256, "producer_sms": 132, "consumer_grid": 16}, {"block_n": 128}, {"path": "xla"}]
    for bad in ("block_n=7", "nope=1", "consumer_grid=x", "consumer_grid"):
        with pytest.raises(argparse.ArgumentTypeError, match="--configs"):
            bench.parse_configs(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="4096x8192x1024"):
        bench.parse_shapes("4096x8192")
    with pytest.raises(argparse.ArgumentTypeError, match="no shape given"):
        bench.parse_shapes(",")


def test_shape_not_divisible_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--shapes", "100x128x64", *FAST])
    assert e.value.code == 2
    assert "shape 100x128x64: M=100 is not divisible by W=8" in capsys.readouterr().err


def test_time_interleaved_runs_the_programs_in_rounds():
    calls, done = [], []

    def program(name):
        def fn():
            calls.append(name)
            return jnp.zeros(())
        return fn

    times = timing.time_interleaved({"a": (program("a"), ()), "b": (program("b"), ())}, iters=5, warmup=1, batch=2,
                                    on_round=done.append)
    assert set(times) == {"a", "b"} and all(t > 0 for t in times.values())
    # Warm-ups first, then ceil(5 / 2) rounds of one batch of each, round r starting with program r mod 2.
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert done == [0, 1, 2] and timing.rounds(5, 2) == 3
    # The bench's name is the same function (scripts import it from there).
    assert bench.time_interleaved is timing.time_interleaved


def test_rel_err_and_max_over_one_process():
    b = jnp.array([3.0, 4.0])
    assert float(timing.rel_err(b, b)) == 0
    assert float(timing.rel_err(jnp.array([3.0, 4.0 + 5.0]), b)) == pytest.approx(1.0)  # ||(0, 5)|| / ||(3, 4)||
    assert timing.max_over_processes([1.0, float("nan")])[0] == 1.0


def test_cpu_default_runs_one_smoke_shape_in_seconds(tmp_path, capsys):
    # No CUDA GPUs: the GPU suite (the quick one took 49 minutes on CPU) is replaced by one small
    # shape with few calls, and the output says that CPU timings mean nothing.
    out = tmp_path / "out.json"
    t0 = time.perf_counter()
    assert bench.main(["--suite", "quick", "--json", str(out)]) == 0
    elapsed = time.perf_counter() - t0
    result = json.loads(out.read_text())
    assert [(r["m"], r["n"], r["k"]) for r in result["rows"]] == [bench.SMOKE_SHAPE]
    assert (result["iters"], result["warmup"]) == (bench.SMOKE_ITERS, bench.SMOKE_WARMUP)
    stdout = capsys.readouterr().out
    assert "# NOTE: no CUDA GPUs (JAX platform 'cpu')" in stdout and "the timings here mean nothing" in stdout
    assert "only the smoke shape 256x256x64 (pass --shapes to time others)" in stdout
    assert elapsed < 30, f"the CPU smoke run took {elapsed:.1f} s"  # ~2 s; generous for a busy 2-core machine


def test_cpu_explicit_shapes_and_iters_are_kept(tmp_path, capsys):
    rc, result = run(tmp_path, "--shapes", "64x128x32", "--world", "2")
    assert rc == 0 and [(r["m"], r["n"], r["k"]) for r in result["rows"]] == [(64, 128, 32)]
    assert result["iters"] == 2  # FAST's --iters, not the smoke default
    assert "running the given --shapes" in capsys.readouterr().out


def test_smoke_shape_divides_by_the_world():
    assert bench.smoke_shape(8) == bench.SMOKE_SHAPE
    m, _, _ = bench.smoke_shape(3)
    assert m % 3 == 0


def test_progress_counts_timed_rounds_not_compiles(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain counter, whether or not tqdm is installed
    # Two shapes, 2 configs each, 4 calls in batches of 2: 2 timed rounds per shape, 4 in all.
    assert bench.main(["--shapes", "64x128x32,128x128x32", "--world", "2", "--iters", "4", "--batch", "2",
                       "--warmup", "1", "--configs", ";consumer_grid=2"]) == 0
    err = capsys.readouterr().err
    counts = [line.split("]")[0] + "]" for line in err.splitlines() if line.startswith("[")]
    assert counts and all(c.endswith("/4 timed rounds]") for c in counts), err
    assert "[4/4 timed rounds]" in err and "[0/4 timed rounds] 64x128x32: compiling" in err


@pytest.mark.parametrize("spelling,short", [("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16"),
                                            ("float16", "fp16")])
def test_dtype_spellings(spelling, short):
    assert timing.parse_dtype(spelling) == jnp.dtype(timing.DTYPES[spelling]).name
    assert timing.SHORT_NAMES[timing.parse_dtype(spelling)] == short
    with pytest.raises(argparse.ArgumentTypeError, match="^expected one of bf16, bfloat16, fp16, float16"):
        timing.parse_dtype("fp8")


def test_gpu_without_extension_refuses_to_time_xla(tmp_path, monkeypatch, capsys):
    # As on a GPU machine running from the repository root: the default backend is CUDA, the
    # extension is missing. The bench must not time the XLA path as if it were entwine's.
    monkeypatch.setattr(_log, "default_platform", lambda: "cuda")
    monkeypatch.setattr(entwine_jax, "extension_status", lambda: (False, "entwine_jax._entwine not importable"))
    assert bench.main(["--shapes", "64x128x32", "--world", "2", *FAST]) == 2
    err = capsys.readouterr().err
    assert "refusing to time the XLA path on CUDA GPUs: entwine_jax._entwine not importable" in err
    assert "--allow-xla" in err and ("source tree" in err or "nvcc" in err)
    # Forced: it runs (here on the CPU mesh) and labels every row with the fallback.
    rc, result = run(tmp_path, "--shapes", "64x128x32", "--world", "2", "--allow-xla")
    assert rc == 0 and result["rows"][0]["path"] == "xla"


def test_parse_configs_empty_item_is_the_selected_config():
    assert bench.parse_configs(";raster_rows=1") == [{}, {"raster_rows": 1}]
    assert bench.parse_configs("raster_rows=1;") == [{"raster_rows": 1}, {}]
    with pytest.raises(argparse.ArgumentTypeError, match="no config given"):
        bench.parse_configs(" ; ")


def test_bench_moe_needs_a_gpu_and_its_step_is_the_mlps_vjp(capsys, monkeypatch):
    """benchmarks/bench_moe.py: without a GPU it says so (exit 2); its step program is the MoE MLP's
    output and vector-Jacobian product, the same on both paths (here both XLA's: no CUDA)."""
    import numpy as np

    import bench_moe
    from entwine_jax import moe_layers

    monkeypatch.setattr(bench_moe.jax, "default_backend", lambda: "cpu")  # as on a machine without one
    assert bench_moe.main(["--iters", "1"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    t, h, f, e, k = 256, 32, 64, 4, 2
    keys = jax.random.split(jax.random.key(3), 6)
    ops = (jax.random.normal(keys[0], (t, h)), jax.random.normal(keys[1], (h, e)),
           jax.random.normal(keys[2], (e, h, f)) / 6, jax.random.normal(keys[3], (e, h, f)) / 6,
           jax.random.normal(keys[4], (e, f, h)) / 8, jax.random.normal(keys[5], (t, h)))
    config = entwine_jax.MoeConfig(capacity=1.0, path="xla")
    with jax.set_mesh(mesh):
        placed = tuple(jax.device_put(v, spec) for v, spec in zip(ops, bench_moe.SPECS))
        program = bench_moe.step_program(mesh, k, config, None)
        got = program(*placed)
        # The XLA path holds no call of ours, though its metadata names the ops' scopes.
        assert bench_moe.fused_targets(program, placed) == set()
        mlp = lambda *a: moe_layers.moe_mlp(*a, num_experts_per_tok=k, axis_name="ep", config=config)  # noqa: E731
        y, pullback = jax.vjp(jax.shard_map(mlp, mesh=mesh, in_specs=bench_moe.SPECS[:5], out_specs=P("ep")),
                              *placed[:5])
        want = (y, *pullback(placed[5]))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # The stock-like program (MaxText's sparse path at one rank: ragged_dot over sorted rows) computes
    # the same step as the dropless MLP.
    dropless = bench_moe.step_program(mesh, k, entwine_jax.MoeConfig(path="xla"), None)
    with jax.set_mesh(mesh):
        want = dropless(*placed)
        ragged = bench_moe.ragged_program(mesh, k)(*placed)
    for a, b in zip(ragged, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)
