# The command line (python -m entwine_jax {bench,tune}) and what a first-time user sees: help on
# stdout, unknown commands, the answers without CUDA GPUs, the refusal to time XLA on GPUs without
# the extension, the source-tree warning, the level of the fallback message, and that no library
# module imports the bench.
import ast
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
from entwine_jax import _log

PACKAGE = pathlib.Path(entwine_jax.__file__).resolve().parent
# In-process tests of what happens without CUDA GPUs need a default backend that is not CUDA.
cpu_only = pytest.mark.skipif(_log.default_platform() == "cuda", reason="the default backend is CUDA here")


def run_module(*args, env=None, timeout=120):
    """python -m entwine_jax ARGS in a fresh interpreter, on the entwine_jax under test, one CPU device."""
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent), JAX_PLATFORMS="cpu", **(env or {}))
    env.pop("XLA_FLAGS", None)  # no forced host devices: one CPU device, as on a plain machine
    return subprocess.run([sys.executable, "-m", "entwine_jax", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


# --- python -m entwine_jax --------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_goes_to_stdout_with_exit_0(flag, capsys):
    assert cli.main([flag]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m entwine_jax {bench,tune}") and err == ""


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_subcommand_help_goes_to_stdout_with_exit_0(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: python -m entwine_jax {command}") and err == ""
    # Both dtype spellings in both commands.
    assert "{bf16,bfloat16,fp16,float16}" in out


def test_unknown_and_missing_command(capsys):
    assert cli.main(["bnech"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "python -m entwine_jax: unknown command 'bnech' (expected bench or tune)" in err
    assert "usage: python -m entwine_jax {bench,tune}" in err
    assert cli.main([]) == 2
    assert "no command given" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys):
    assert cli.main(["bench", "--dtype", "fp8"]) == 2
    assert "--dtype: expected one of bf16, bfloat16, fp16, float16, got 'fp8'" in capsys.readouterr().err
    assert cli.main(["tune", "--shapes", "4096x8192"]) == 2
    assert "expected MxNxK_local items" in capsys.readouterr().err


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
    out = run_module("bench", "--suite", "quick")
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert "timings here mean nothing" in out.stdout and "geomean over 1 checked shapes" in out.stdout
    assert elapsed < 60, f"{elapsed:.1f} s"  # ~3 s with the interpreter's start


def test_tune_on_gpus_without_extension_says_how_to_fix(monkeypatch, capsys):
    monkeypatch.setattr(_log, "default_platform", lambda: "cuda")
    monkeypatch.setattr(entwine_jax, "extension_status", lambda: (False, "entwine_jax._entwine not importable"))
    monkeypatch.setattr(_log, "source_tree_warning", lambda *a, **k: "imported from the source tree (X)")
    assert cli.main(["tune", "--shapes", "256x256x64"]) == 2
    err = capsys.readouterr().err
    assert "need the compiled extension: entwine_jax._entwine not importable. imported from the source tree (X)" in err


# --- _log: the source-tree warning ------------------------------------------------------------------


def fake_checkout(root: pathlib.Path) -> pathlib.Path:
    (root / "ffi").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'entwine_jax'\n")
    package = root / "entwine_jax"
    package.mkdir()
    (package / "__init__.py").write_text("")
    return package


def test_source_tree_warning_names_the_file_and_the_fix(tmp_path):
    package = fake_checkout(tmp_path / "repo")
    message = _log.source_tree_warning(package, extension=False, gpus=True)
    assert str(package / "__init__.py") in message and "no compiled extension" in message
    assert "XLA reference path" in message and "cd /tmp" in message and "pip install -e ." in message
    # A file inside the package is as good as its directory.
    assert _log.source_tree_warning(package / "__init__.py", extension=False, gpus=True) == message
    # Nothing to say: the extension is there (built in place or an editable install), or no GPUs.
    assert _log.source_tree_warning(package, extension=True, gpus=True) is None
    assert _log.source_tree_warning(package, extension=False, gpus=False) is None
    # An installed package (site-packages: no pyproject.toml or ffi/ beside it) is never a source tree.
    installed = tmp_path / "site-packages" / "entwine_jax"
    installed.mkdir(parents=True)
    assert _log.source_tree_warning(installed, extension=False, gpus=True) is None


def test_this_cpu_machine_gets_no_warning():
    # The tests import the source tree without an extension, but this machine shows no GPUs.
    if _log.cuda_gpus_present():
        pytest.skip("this machine shows NVIDIA GPUs")
    assert _log.source_tree_warning() is None and _log.warn_if_source_tree() is None


def test_warn_if_source_tree_logs_once_at_warning(monkeypatch, caplog):
    monkeypatch.setattr(_log, "source_tree_warning", lambda: "imported from the source tree")
    with caplog.at_level(logging.WARNING, logger="entwine_jax"):
        assert _log.warn_if_source_tree() == "imported from the source tree"
        _log.warn_if_source_tree()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, "imported from the source tree")]


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


def test_extension_fix_without_a_source_tree(monkeypatch):
    monkeypatch.setattr(_log, "source_tree_warning", lambda *a, **k: None)
    assert "nvcc (CUDA >= 12.3)" in _log.extension_fix() and "pip install -v ." in _log.extension_fix()


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


# --- no library module imports the bench ------------------------------------------------------------


def imported_modules(path: pathlib.Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_library_module_imports_the_bench():
    # The command-line modules may import the library; the library never imports them.
    commands = {"bench.py", "__main__.py"}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name in commands:
            continue
        assert "entwine_jax.bench" not in imported_modules(path), f"{path.name} imports entwine_jax.bench"
    # The timing protocol stands alone: neither ops nor tuning (which import it).
    assert not {"entwine_jax.ops", "entwine_jax.tuning"} & imported_modules(PACKAGE / "timing.py")
