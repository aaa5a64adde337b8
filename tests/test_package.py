# The package surface: exports, version, extension status, and the example as a user runs it.
import logging
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

import entwine_jax
from entwine_jax import _log

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_exports():
    for name in ("gemm_rs", "GemmRsConfig", "set_default_config", "heuristic_config", "extension_status",
                 "setup", "check_errors", "tune", "__version__"):
        assert hasattr(entwine_jax, name), name
    entwine_jax.check_errors()  # no fused call made: nothing to raise


def test_version_matches_pyproject():
    pyproject = REPO / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("no pyproject.toml next to the tests")
    assert tomllib.loads(pyproject.read_text())["project"]["version"] == entwine_jax.__version__


def test_extension_status(caplog):
    _log.reset_once()
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        built, reason = entwine_jax.extension_status()
        entwine_jax.extension_status()
    assert isinstance(built, bool) and reason
    pure = [r for r in caplog.records if "pure-Python install" in r.getMessage()]
    assert len(pure) == (0 if built else 1)


def test_example_runs():
    # As a user runs it: a fresh interpreter, the same entwine_jax as these tests.
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(entwine_jax.__file__).parents[1]))
    env.pop("XLA_FLAGS", None)  # the example forces its 8 host devices itself
    out = subprocess.run([sys.executable, str(REPO / "examples" / "mlp_shard_map.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("OK")


def _guarded_compile(script):
    """Runs cmake/wgmma_guard.sh with a stand-in compiler (a bash script) and returns the result."""
    guard = REPO / "cmake" / "wgmma_guard.sh"
    if not guard.exists():
        pytest.skip("no cmake/wgmma_guard.sh next to the tests")
    return subprocess.run(["bash", str(guard), "bash", "-c", script], capture_output=True, text=True)


def test_wgmma_guard_fails_a_serialized_compile():
    # ptxas's own line (CUDA 13.0), printed as info with -Xptxas=-v: the build must stop on it.
    info = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized "
            "due to non wgmma instructions reading accumulator registers of a wgmma between start and end of "
            "the pipeline stage in the function 'k'")
    result = _guarded_compile(f'echo "{info}" >&2')
    assert result.returncode == 1
    assert "(C7514)" in result.stderr and "ptxas serialized wgmma" in result.stderr


def test_wgmma_guard_passes_clean_and_failing_compiles_through():
    clean = _guarded_compile('echo "ptxas info    : Used 168 registers, used 16 barriers" >&2')
    assert clean.returncode == 0 and "Used 168 registers" in clean.stderr
    broken = _guarded_compile('echo "producer.cuh(42): error: expected a ;" >&2; exit 2')
    assert broken.returncode == 2 and "expected a ;" in broken.stderr
