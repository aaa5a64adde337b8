# CPU smoke test of the benchmark machinery (entwine_jax.bench) on 8 fake devices with tiny shapes:
# the table, the JSON fields, the loud XLA-fallback label, the result check, the config list and
# the budget sweep. Timings on CPU mean nothing and are not asserted.
import argparse
import json

import jax
import jax.numpy as jnp
import pytest

import entwine_jax
from entwine_jax import bench

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


def test_plot_written_or_skipped_with_message(tmp_path, capsys):
    png = tmp_path / "speedup.png"
    assert bench.main(["--shapes", "256x128x64", "--world", "2", *FAST, "--plot", str(png)]) == 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib not installed" in capsys.readouterr().err and not png.exists()
    else:
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
    with pytest.raises(SystemExit, match="not divisible"):
        bench.main(["--shapes", "100x128x64", *FAST])


def test_time_interleaved_runs_the_programs_in_rounds():
    calls = []

    def program(name):
        def fn():
            calls.append(name)
            return jnp.zeros(())
        return fn

    times = bench.time_interleaved({"a": (program("a"), ()), "b": (program("b"), ())}, iters=5, warmup=1, batch=2)
    assert set(times) == {"a", "b"} and all(t > 0 for t in times.values())
    # Warm-ups first, then ceil(5 / 2) rounds of one batch of each, round r starting with program r mod 2.
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]


def test_parse_configs_empty_item_is_the_selected_config():
    assert bench.parse_configs(";raster_rows=1") == [{}, {"raster_rows": 1}]
    assert bench.parse_configs("raster_rows=1;") == [{"raster_rows": 1}, {}]
    with pytest.raises(argparse.ArgumentTypeError, match="no config given"):
        bench.parse_configs(" ; ")


def test_package_command_line(capsys):
    from entwine_jax import __main__ as cli
    assert cli.main([]) == 2 and "usage: python -m entwine_jax {bench,tune}" in capsys.readouterr().err
    # CPU: tune refuses to time the XLA fallback, and says why without a traceback.
    assert cli.main(["tune", "--shapes", "256x256x64", "--iters", "1", "--warmup", "1"]) == 2
    assert "the fused path cannot run" in capsys.readouterr().err
    assert cli.main(["bench", "--shapes", "256x128x64", "--world", "2", *FAST]) == 0
