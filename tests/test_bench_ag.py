# CPU tests of `python benchmarks/bench.py --op ag_gemm` and `--op mlp` (benchmarks/bench_ag_gemm.py,
# bench_mlp, runner) on 8 fake devices with tiny shapes: argument parsing, the smoke runs (the ops
# take the XLA reference path here), the tables and JSON, --fused-only, what ranks sharing a GPU skip,
# the key-value max over processes, and the --processes launcher. Timings on CPU mean nothing.
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

import entwine_jax
from entwine_jax import _distributed, census
from entwine_jax.tuning import timing

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
BENCH = BENCHMARKS / "bench.py"
sys.path.insert(0, str(BENCHMARKS))  # the benchmark programs
import bench  # noqa: E402
import bench_ag_gemm  # noqa: E402
import bench_mlp  # noqa: E402
import runner  # noqa: E402

FAST = ["--iters", "2", "--warmup", "1", "--batch", "1"]
AG_KEYS = {"m", "n", "k", "layout", "ag_ms", "gemm_ms", "xla_ag_gemm_ms", "windowed_ms", "windowed_loop", "entwine_ms",
           "speedup", "efficiency", "efficiency_of", "vs_windowed", "check", "rel_err", "xla_rel_err", "path", "reason",
           "config", "configs"}
MLP_KEYS = {"t", "d", "f", "layout", "ours_ms", "xla_ms", "windowed_ms", "windowed_loop", "bound_ms", "speedup",
            "vs_windowed", "ours_over_bound", "xla_over_bound", "check", "rel_err", "xla_rel_err", "path", "reason",
            "collectives"}


def run(tmp_path, *argv):
    out = tmp_path / "out.json"
    rc = bench.main([*argv, *FAST, "--json", str(out)])
    return rc, json.loads(out.read_text())


# --- arguments ----------------------------------------------------------------------------------------


def test_op_and_layout_defaults_and_aliases():
    assert bench.parse_args([])[1].op == "gemm_rs"
    args = bench.parse_args(["--op", "ag_gemm"])[1]
    assert args.layout == ["rows"] and args.configs == [{}] and args.processes == 1 and not args.fused_only
    assert bench.parse_args(["--op", "mlp"])[1].layout == ["rows", "hidden"]
    # hidden and contraction name one layout; each op keeps its own name for it.
    assert bench.parse_args(["--op", "ag_gemm", "--layout", "rows,hidden"])[1].layout == ["rows", "contraction"]
    assert bench.parse_args(["--op", "mlp", "--layout", "contraction"])[1].layout == ["hidden"]
    args = bench.parse_args(["--op", "ag_gemm", "--configs", "max_chunks=4;block_n=128,path=xla"])[1]
    assert args.configs == [{"max_chunks": 4}, {"block_n": 128, "path": "xla"}]
    # gemm_rs keeps its own config class.
    assert bench.parse_args(["--configs", "consumer_grid=8"])[1].configs == [{"consumer_grid": 8}]


@pytest.mark.parametrize("argv,message", [
    (["--layout", "rows"], "--layout: --op ag_gemm and --op mlp only"),
    (["--processes", "2"], "--processes: --op ag_gemm and --op mlp only"),
    (["--fused-only"], "--fused-only: --op ag_gemm and --op mlp only"),
    (["--op", "ag_gemm", "--sweep-budget"], "--sweep-budget: not with --op ag_gemm"),
    (["--op", "mlp", "--configs", "block_n=128"], "--configs: not with --op mlp"),
    (["--op", "ag_gemm", "--plot", "x.png"], "--plot: not with --op ag_gemm"),
    (["--op", "ag_gemm", "--configs", "consumer_grid=4"], "--configs: expected key=int"),
    (["--op", "ag_gemm", "--layout", "columns"], "--layout: expected rows, contraction or hidden"),
    (["--op", "mlp", "--processes", "9"], "--processes must be in [1, 8]"),
    (["--op", "fft"], "invalid choice: 'fft'"),
])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--op", "ag_gemm", "--shapes", "100x128x64"], "rows layout splits M=100 over W=8"),
    (["--op", "ag_gemm", "--layout", "contraction", "--shapes", "128x128x60"],
     "contraction layout splits K=60 over W=8"),
    (["--op", "mlp", "--layout", "hidden", "--shapes", "64x60x128"], "the hidden layout splits D=60 over W=8"),
    (["--op", "mlp", "--shapes", "60x64x128"], "the rows layout splits T=60 over W=8"),
])
def test_shapes_not_divisible_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, *FAST])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_suites_are_the_part2_mlp_shapes():
    # Gate/up projection: M = tokens, N = mlp / W, K = embed.
    assert bench_ag_gemm.suite(2) == [(8192, 7168, 4096), (16384, 7168, 4096), (8192, 14336, 8192), (16384, 14336, 8192)]
    assert bench_mlp.suite() == [(8192, 4096, 14336), (16384, 4096, 14336), (8192, 8192, 28672),
                                 (16384, 8192, 28672)]
    for world in (1, 2, 3, 8):
        m, _, k = bench_ag_gemm.smoke_shape(world)
        assert m % world == 0 and k % world == 0
        assert all(v % world == 0 for v in bench_mlp.smoke_shape(world))


# --- smoke runs on CPU ---------------------------------------------------------------------------------


def test_ag_gemm_cpu_smoke_run_both_layouts(tmp_path, capsys):
    out = tmp_path / "out.json"
    # No --shapes, no --iters: the smoke shape with the smoke call counts, and a note that says so.
    assert bench.main(["--op", "ag_gemm", "--layout", "rows,contraction", "--world", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["op"] == "ag_gemm" and result["layouts"] == ["rows", "contraction"]
    assert result["world"] == 4 and result["processes"] == 1 and not result["shared_gpu"] and not result["fused_only"]
    assert (result["iters"], result["warmup"]) == (bench.SMOKE_ITERS, bench.SMOKE_WARMUP)
    assert [(r["m"], r["n"], r["k"], r["layout"]) for r in result["rows"]] == [
        (*bench_ag_gemm.SMOKE_SHAPE, "rows"), (*bench_ag_gemm.SMOKE_SHAPE, "contraction")]
    for r in result["rows"]:
        assert AG_KEYS <= set(r), AG_KEYS - set(r)
        assert r["check"] == "OK" and r["rel_err"] <= timing.TOL and r["xla_rel_err"] <= timing.TOL
        assert all(r[k] > 0 for k in ("ag_ms", "gemm_ms", "xla_ag_gemm_ms", "windowed_ms", "entwine_ms"))
        assert r["speedup"] == pytest.approx(r["xla_ag_gemm_ms"] / r["entwine_ms"])
        assert r["efficiency"] == pytest.approx(max(r["gemm_ms"], r["ag_ms"]) / r["entwine_ms"])
        assert r["vs_windowed"] == pytest.approx(r["windowed_ms"] / r["entwine_ms"])
        # CPU: the XLA reference path, and the row says why; the CPU partitioner builds no windowed loop.
        assert r["path"] == "xla" and "CUDA" in r["reason"] and r["config"].startswith("AgGemmConfig(")
        assert r["windowed_loop"] is False
    assert set(result["geomean"]) == {"speedup", "efficiency", "vs_windowed"}
    stdout = capsys.readouterr().out
    assert "# NOTE: no CUDA GPUs (JAX platform 'cpu')" in stdout and "the timings here mean nothing" in stdout
    assert "a shape MxNxK is the GEMM [M, K] @ [K, N] -> [M, N]" in stdout and "x [M/W, K]" in stdout
    assert "x [M, K/W]" in stdout
    header = next(line for line in stdout.splitlines() if line.startswith("layout "))
    for column in ("ag_ms", "gemm_ms", "xla_ag_gemm_ms", "windowed_ms", "entwine_ms", "speedup", "efficiency"):
        assert column in header
    assert "geomean over 2 checked shapes" in stdout and "XLA fallback" in stdout


def test_ag_gemm_configs_each_checked_and_timed(tmp_path):
    rc, result = run(tmp_path, "--op", "ag_gemm", "--shapes", "128x256x64", "--world", "2",
                     "--configs", ";max_chunks=2")
    assert rc == 0
    (row,) = result["rows"]
    # The heuristic's config (a tiny shard: one chunk, crossover.min_chunk_bytes), then the override.
    assert [("max_chunks=1" in t["config"], "max_chunks=2" in t["config"]) for t in row["configs"]] == [
        (True, False), (False, True)]
    assert all(t["ok"] and t["ms"] > 0 for t in row["configs"])


def test_mlp_cpu_smoke_run_both_layouts(tmp_path, capsys):
    out = tmp_path / "out.json"
    # No --shapes, no --iters: the smoke shape with the smoke call counts, and a note that says so.
    assert bench.main(["--op", "mlp", "--world", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["op"] == "mlp" and result["layouts"] == ["rows", "hidden"] and result["world"] == 2
    assert (result["iters"], result["warmup"]) == (bench.SMOKE_ITERS, bench.SMOKE_WARMUP)
    assert [(r["t"], r["d"], r["f"], r["layout"]) for r in result["rows"]] == [(*bench_mlp.SMOKE_SHAPE, "rows"),
                                                                               (*bench_mlp.SMOKE_SHAPE, "hidden")]
    for r in result["rows"]:
        assert MLP_KEYS <= set(r), MLP_KEYS - set(r)
        # y and all four gradients against the float32 reference; plain XLA too.
        assert r["check"] == "OK" and r["rel_err"] <= timing.TOL and r["xla_rel_err"] <= timing.TOL
        assert all(r[k] > 0 for k in ("ours_ms", "xla_ms", "windowed_ms", "bound_ms"))
        assert r["speedup"] == pytest.approx(r["xla_ms"] / r["ours_ms"])
        assert r["ours_over_bound"] == pytest.approx(r["ours_ms"] / r["bound_ms"])
        assert r["path"] == "xla" and "ag_gemm: " in r["reason"] and "gemm_rs: " in r["reason"]
        # Plain XLA gathers and scatters; on CPU the ops' reference path does too.
        assert r["collectives"]["xla"].get("all-gather", 0) >= 1 and r["collectives"]["ours"]
    assert set(result["geomean"]) == {"speedup", "vs_windowed", "ours_over_bound"}
    stdout = capsys.readouterr().out
    assert "SwiGLU block" in stdout and "only the smoke shape 64x64x128" in stdout
    assert "the timings here mean nothing" in stdout
    header = next(line for line in stdout.splitlines() if line.startswith("layout "))
    for column in ("ours_ms", "xla_ms", "windowed_ms", "bound_ms", "speedup", "ours/bound"):
        assert column in header
    assert "geomean over 2 checked rows" in stdout


def test_mlp_wrong_result_is_marked_fail(tmp_path, monkeypatch, capsys):
    real = bench_mlp.entwine_jax.gemm_rs

    def wrong(x, w, **kwargs):
        return 2 * real(x, w, **kwargs)

    monkeypatch.setattr(bench_mlp.entwine_jax, "gemm_rs", wrong)
    rc, result = run(tmp_path, "--op", "mlp", "--layout", "rows", "--shapes", "32x32x64", "--world", "2",
                     "--fused-only")
    assert rc == 1 and result["rows"][0]["check"] == "FAIL" and result["rows"][0]["rel_err"] > 0.5
    assert " FAIL " in capsys.readouterr().out


def test_fused_only_skips_the_xla_collectives(tmp_path, capsys):
    rc, result = run(tmp_path, "--op", "ag_gemm", "--shapes", "64x128x32", "--world", "2", "--fused-only")
    assert rc == 0 and result["fused_only"] and not result["shared_gpu"]
    (row,) = result["rows"]
    assert row["ag_ms"] is None and row["xla_ag_gemm_ms"] is None and row["windowed_ms"] is None
    assert row["speedup"] is None and row["gemm_ms"] > 0 and row["entwine_ms"] > 0
    assert row["efficiency"] == pytest.approx(row["gemm_ms"] / row["entwine_ms"])
    stdout = capsys.readouterr().out
    assert "--fused-only: the XLA columns with a collective are skipped" in stdout
    assert "efficiency here is XLA's GEMM alone / entwine" in stdout
    rc, result = run(tmp_path, "--op", "mlp", "--layout", "hidden", "--shapes", "32x32x64", "--world", "2",
                     "--fused-only")
    (row,) = result["rows"]
    assert rc == 0 and row["xla_ms"] is None and row["windowed_ms"] is None and row["bound_ms"] > 0
    assert row["ours_ms"] > 0 and row["check"] == "OK" and set(row["collectives"]) == {"ours"}


def test_ranks_sharing_a_gpu_skip_an_xla_fallback(tmp_path, monkeypatch, capsys):
    # As on one GPU shared by W processes: NCCL cannot run, so an ag_gemm or MLP that would take the
    # XLA path (its collectives) is not run, the row says why, and the exit status is 1.
    monkeypatch.setattr(runner, "shares_a_gpu", lambda devices: True)
    monkeypatch.setattr(runner.Runner, "on_gpu", property(lambda self: True))
    monkeypatch.setattr(runner.Runner, "warm_up", lambda self, seconds=1.0: None)
    rc, result = run(tmp_path, "--op", "ag_gemm", "--shapes", "64x128x32", "--world", "2")
    (row,) = result["rows"]
    assert rc == 1 and result["shared_gpu"] and result["fused_only"]
    assert row["check"] == "SKIP" and row["entwine_ms"] is None and row["gemm_ms"] > 0 and row["ag_ms"] is None
    stdout = capsys.readouterr().out
    assert "share one GPU: NCCL cannot run there" in stdout and "not run: XLA's all-gather needs NCCL" in stdout
    rc, result = run(tmp_path, "--op", "mlp", "--layout", "rows", "--shapes", "32x32x64", "--world", "2")
    (row,) = result["rows"]
    assert rc == 1 and row["check"] == "SKIP" and row["ours_ms"] is None and row["bound_ms"] > 0
    assert "not run: its collectives need NCCL" in capsys.readouterr().out


# --- tables ---------------------------------------------------------------------------------------------


def test_tables_print_skipped_columns_as_dashes(capsys):
    ag = {"m": 8192, "n": 7168, "k": 4096, "layout": "rows", "ag_ms": None, "gemm_ms": 0.5, "xla_ag_gemm_ms": None,
          "windowed_ms": None, "windowed_loop": None, "entwine_ms": 0.55, "speedup": None, "efficiency": 0.5 / 0.55,
          "efficiency_of": "gemm (XLA's all-gather not timed)", "vs_windowed": None, "check": "OK", "path": "fused",
          "reason": None, "config": "AgGemmConfig(...)"}
    bench_ag_gemm.print_table([ag], bench.geomean)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("rows "))
    assert line.split("|")[1].split() == ["-", "0.500", "-", "-", "0.550"]
    assert "path=fused AgGemmConfig(...)" in line
    mlp = {"t": 8192, "d": 4096, "f": 14336, "layout": "hidden", "ours_ms": 2.0, "xla_ms": 3.0, "windowed_ms": 3.3,
           "windowed_loop": True, "bound_ms": 1.8, "speedup": 1.5, "vs_windowed": 1.65, "ours_over_bound": 2 / 1.8,
           "xla_over_bound": 3 / 1.8, "check": "OK", "path": "fused", "reason": None}
    bench_mlp.print_table([mlp], bench.geomean)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("hidden "))
    assert line.split("|")[1].split() == ["2.000", "3.000", "3.300", "1.800"]
    assert line.split("|")[2].split() == ["1.500", "1.650", "1.111", "1.667"]
    assert "geomean over 1 checked rows: speedup 1.500  vs_windowed 1.650  ours_over_bound 1.111" in out
    assert "no windowed-einsum loop" not in out


def _module(*lines: str, body: tuple = ()) -> str:
    """An HLO module: `lines` in its entry computation; `body`: the lines of a while loop's body
    called by the entry (the loop added to the entry)."""
    entry = ["%x = f32[8]{0} parameter(0)", *lines]
    text = "HloModule m\n"
    if body:
        text += ("%body (p: f32[8]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)\n"
                 + "".join(f"  {line}\n" for line in body) + "}\n")
        text += "%cond (p: f32[8]) -> pred[] {\n  %p = f32[8]{0} parameter(0)\n  ROOT %t = pred[] constant(true)\n}\n"
        entry.append("%w = f32[8]{0} while(%x), condition=%cond, body=%body")
    return text + "ENTRY %main (x: f32[8]) -> f32[8] {\n" + "".join(f"  {line}\n" for line in entry) + "}\n"


def test_collectives_census():
    # What bench_mlp's "collectives" and the windowed_loop columns read from entwine_jax.census: the
    # XLA collectives by kind (an async pair once, the fused ops' custom calls not), and whether
    # collective-permutes run inside a while loop.
    text = _module("%a = f32[8]{0} all-gather-start(%x)", "%b = f32[8]{0} all-gather-done(%a)",
                   "%c = f32[4]{0} reduce-scatter(%x), dimensions={0}", "%d = f32[8]{0} all-reduce(%x)")
    assert bench_mlp.xla_collectives(text) == {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1}
    fused = _module("%e = f32[8]{0} custom-call(%x, %x), custom_call_target=\"entwine_ag_gemm\"")
    assert bench_mlp.xla_collectives(fused) == {}

    def windowed_loop(text):  # as bench.py, bench_ag_gemm and bench_mlp decide it
        return any(c.loops for c in census.collectives(text).select(kind="collective-permute"))

    permute = "%cp = f32[8]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}"
    assert windowed_loop(_module(body=(permute, "ROOT %r = f32[8]{0} copy(%cp)")))
    assert not windowed_loop(_module(body=("ROOT %r = f32[8]{0} copy(%p)",)))
    assert not windowed_loop(_module(permute.replace("%p", "%x")))


# --- several processes -----------------------------------------------------------------------------------


class FakeClient:
    """The jax.distributed key-value store of one process, with another process's keys preset."""

    def __init__(self, others):
        self.kv, self.others = {}, others

    def key_value_set_bytes(self, key, value):
        self.kv[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key in self.kv:
            return self.kv[key]
        return self.others(key)


def test_max_over_processes_through_the_store(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    client = FakeClient(lambda key: json.dumps([3.0, 1.0, float("nan")]).encode())
    monkeypatch.setattr(_distributed, "client", lambda: client)
    out = timing.max_over_processes([2.0, 5.0, 1.0])
    assert out[:2] == [3.0, 5.0] and out[2] != out[2]  # NaN (skipped somewhere) stays NaN
    # Every exchange writes fresh keys.
    timing.max_over_processes([1.0, 1.0, 1.0])
    assert len(client.kv) == 2 and len(set(client.kv)) == 2
    with pytest.raises(RuntimeError, match="lengths"):
        timing.max_over_processes([1.0])


def test_shares_a_gpu_compares_the_processes_gpus(monkeypatch):
    class Dev:
        def __init__(self, process_index, ordinal):
            self.process_index, self.local_hardware_id, self.platform = process_index, ordinal, "gpu"

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    for peer_ordinal, shared in ((0, True), (1, False)):
        def others(key, ordinal=peer_ordinal):
            import socket
            return f"{socket.gethostname()}|{os.environ.get('CUDA_VISIBLE_DEVICES', '')}|{ordinal}".encode()

        client = FakeClient(others)
        monkeypatch.setattr(_distributed, "client", lambda: client)
        assert runner.shares_a_gpu([Dev(0, 0), Dev(1, peer_ordinal)]) is shared
    # One process, or no GPU: nothing is shared.
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert runner.shares_a_gpu([Dev(0, 0)]) is False


RANK_SCRIPT = textwrap.dedent("""
    import sys, time
    rank = int(sys.argv[sys.argv.index("--rank") + 1])
    print(f"out of rank {rank}: argv {sys.argv[1:sys.argv.index('--rank')]}", flush=True)
    print(f"err of rank {rank}", file=sys.stderr, flush=True)
    if "--sleep" in sys.argv and rank == 1:
        time.sleep(60)
    sys.exit(3 if "--fail" in sys.argv and rank == 1 else 0)
""")


def test_launcher_starts_the_ranks_and_collects_their_output(capfd):
    program = [sys.executable, "-c", RANK_SCRIPT]
    assert runner.launch(["--op", "mlp"], 2, 60, program=program) == 0
    out, err = capfd.readouterr()
    # Rank 0 writes to this process's stdout and stderr; rank 1's lines go to stderr, prefixed.
    assert "out of rank 0: argv ['--op', 'mlp']" in out and "rank 1" not in out
    assert "err of rank 0" in err and "[rank 1] out of rank 1" in err and "[rank 1] err of rank 1" in err
    assert runner.launch(["--fail"], 2, 60, program=program) == 3
    assert runner.launch(["--sleep"], 2, 2, program=program) == 1
    assert "killed the ranks still running after --timeout 2 s" in capfd.readouterr().err


def test_two_processes_on_cpu_end_to_end(tmp_path):
    # The real launcher: 2 processes (jax.distributed on localhost, CPU), the timings' max through
    # the key-value store, rank 0's table and JSON.
    out = tmp_path / "out.json"
    # The ranks import the entwine_jax this test imported (installed, or the source tree).
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(entwine_jax.__file__).parents[1]))
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    proc = subprocess.run([sys.executable, str(BENCH), "--op", "ag_gemm", "--processes", "2",
                           "--fused-only", *FAST, "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and result["world"] == 2 and result["fused_only"]
    (row,) = result["rows"]
    assert row["check"] == "OK" and row["entwine_ms"] > 0 and row["xla_ag_gemm_ms"] is None
    assert "2 processes" in proc.stdout and "max over processes" in proc.stdout
    assert proc.stdout.count("geomean over") == 1  # only rank 0 prints the table
