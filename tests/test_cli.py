# The command lines (python -m entwine_jax tune, and the benchmark program benchmarks/bench.py) and
# what a first-time user sees: help on stdout, unknown commands, argument errors said once, the answers
# without CUDA GPUs, the refusal to time XLA on GPUs without the extension, and the level of the
# fallback message.
import logging
import os
import pathlib
import subprocess
import sys
import time

import jax
import pytest

import entwine_jax
from entwine_jax import __main__ as cli
from entwine_jax import _extension, _log

PACKAGE = pathlib.Path(entwine_jax.__file__).resolve().parent
BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"
# In-process tests of what happens without CUDA GPUs need a default backend that is not CUDA.
cpu_only = pytest.mark.skipif(_log.default_platform() == "cuda", reason="the default backend is CUDA here")


def run_program(*args, env=None, timeout=120):
    """`python ARGS` in a fresh interpreter, on the entwine_jax under test, one CPU device."""
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent), JAX_PLATFORMS="cpu", **(env or {}))
    env.pop("XLA_FLAGS", None)  # no forced host devices: one CPU device, as on a plain machine
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd="/")


def run_module(*args, **kwargs):
    """python -m entwine_jax ARGS (see run_program)."""
    return run_program("-m", "entwine_jax", *args, **kwargs)


# --- python -m entwine_jax --------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_goes_to_stdout_with_exit_0(flag, capsys):
    assert cli.main([flag]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m entwine_jax {tune,census}") and "benchmarks/bench.py" in out and err == ""


def test_subcommand_help_goes_to_stdout_with_exit_0(capsys):
    assert cli.main(["tune", "--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m entwine_jax tune") and err == ""
    assert "{bf16,bfloat16,fp16,float16}" in out  # both dtype spellings


def test_bench_program_help_and_bad_arguments():
    out = run_program(str(BENCH), "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: ") and "{bf16,bfloat16,fp16,float16}" in out.stdout
    out = run_program(str(BENCH), "--dtype", "fp8")
    # argparse names the option once: "argument --dtype: expected one of ...".
    assert out.returncode == 2 and "--dtype: expected one of bf16, bfloat16, fp16, float16, got 'fp8'" in out.stderr
    assert "--dtype: --dtype:" not in out.stderr


def test_unknown_and_missing_command(capsys):
    assert cli.main(["bnech"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "python -m entwine_jax: unknown command 'bnech' (expected tune or census)" in err
    assert "usage: python -m entwine_jax {tune,census}" in err
    assert cli.main(["bench"]) == 2  # the benchmarks are a program of the repository, not a command
    assert cli.main([]) == 2
    assert "no command given" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys):
    assert cli.main(["tune", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "--dtype: expected one of bf16, bfloat16, fp16, float16, got 'fp8'" in err and "--dtype: --dtype:" not in err
    assert cli.main(["tune", "--shapes", "4096x8192"]) == 2
    assert "--shapes: expected MxNxK_local items" in capsys.readouterr().err


@cpu_only
@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "fp16", "float16"])
def test_tune_on_cpu_answers_at_once_and_blames_the_missing_gpus(dtype, capsys, tmp_path):
    t0 = time.perf_counter()
    assert cli.main(["tune", "--dtype", dtype, "--cache", str(tmp_path / "c.json")]) == 2
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert f"python -m entwine_jax tune: no CUDA GPUs (JAX platform 'cpu', {len(jax.local_devices())} device(s))" in err
    assert "nothing to tune on this machine" in err and not (tmp_path / "c.json").exists()


def test_tune_one_cpu_device_blames_the_gpus_not_the_axis():
    # The real entry point in a fresh interpreter, one CPU device (the user's plain machine).
    out = run_module("tune")
    assert out.returncode == 2, out.stderr
    assert "no CUDA GPUs (JAX platform 'cpu', 1 device(s))" in out.stderr
    assert "size 1" not in out.stderr and "Traceback" not in out.stderr


def test_bench_quick_suite_on_cpu_is_a_smoke_run():
    # The command of the issue (49 minutes on CPU before): one small shape, a note, a table.
    t0 = time.perf_counter()
    out = run_program(str(BENCH), "--suite", "quick")
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert "timings here mean nothing" in out.stdout and "geomean over 1 checked shapes" in out.stdout
    assert elapsed < 60, f"{elapsed:.1f} s"  # ~3 s with the interpreter's start


def test_tune_on_gpus_without_extension_says_how_to_fix(monkeypatch, capsys):
    monkeypatch.setattr(_log, "default_platform", lambda: "cuda")
    monkeypatch.setattr(_extension, "status", lambda: (False, "entwine_jax._entwine not importable"))
    assert cli.main(["tune", "--shapes", "256x256x64"]) == 2
    err = capsys.readouterr().err
    assert "need the compiled extension: entwine_jax._entwine not importable. Install entwine_jax where nvcc" in err


# --- _log: GPUs on this machine --------------------------------------------------------------------


def test_cuda_gpus_present_reads_devices_and_environment(monkeypatch):
    monkeypatch.setattr(_log.glob, "glob", lambda pattern: ["/dev/nvidia0"] if pattern == "/dev/nvidia[0-9]*" else [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert _log.cuda_gpus_present()
    for name, value in (("CUDA_VISIBLE_DEVICES", ""), ("CUDA_VISIBLE_DEVICES", "-1"), ("JAX_PLATFORMS", "cpu")):
        monkeypatch.setenv(name, value)
        assert not _log.cuda_gpus_present(), (name, value)
        monkeypatch.delenv(name)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert _log.cuda_gpus_present()
    monkeypatch.setattr(_log.glob, "glob", lambda pattern: [])
    assert not _log.cuda_gpus_present()


def test_extension_fix_says_how_to_build():
    assert "nvcc (CUDA >= 12.3)" in _log.EXTENSION_FIX and "pip install -v ." in _log.EXTENSION_FIX


# --- _log: the level of the fallback message --------------------------------------------------------


@pytest.mark.parametrize("path,backend,level", [
    ("auto", "cuda", logging.WARNING),  # a CUDA machine was meant to run the fused kernels
    ("auto", "cpu", logging.INFO),      # on CPU the XLA path is the only one
    ("auto", "gpu", logging.INFO),      # ROCm: the kernels are CUDA-only
    ("fused", "cpu", logging.WARNING),  # asked for the kernels and did not get them
    ("fused", "cuda", logging.WARNING),
    ("xla", "cuda", logging.DEBUG),     # asked for XLA
    ("xla", "cpu", logging.DEBUG),
])
def test_fallback_level(path, backend, level):
    assert _log.fallback_level(path, backend) == level


def test_fallback_level_follows_the_default_backend():
    try:
        cuda = jax.default_backend() == "gpu" and bool(jax.devices("cuda"))
    except RuntimeError:
        cuda = False
    assert (_log.default_platform() == "cuda") == cuda
    assert _log.fallback_level("auto") == (logging.WARNING if cuda else logging.INFO)


# --- Every program of the repository answers --help without running --------------------------------------

PROGRAMS = sorted(p for d in ("examples", "benchmarks") for p in (PACKAGE.parent / d).glob("*.py")
                  if 'if __name__ == "__main__"' in p.read_text())


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_program_answers_help(program):
    start = time.perf_counter()
    out = run_program(str(program), "--help", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip(), "no help printed"
    # Help is printed, nothing is computed: no error lines, no table (a run takes far longer).
    assert "max error" not in out.stdout and "TF/s" not in out.stdout
    assert time.perf_counter() - start < 60
