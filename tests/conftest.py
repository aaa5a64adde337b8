# Test setup: 8 fake CPU devices (set before anything imports jax), the gpu/multigpu markers
# (skip without enough GPUs; fail instead where ENTWINE_REQUIRE_GPUS says they should be there),
# and the CI check that the installed package, not the source tree, is under test (ENTWINE_CI=1).
import functools
import os
import pathlib

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

import entwine_jax  # noqa: E402
from entwine_jax import _log  # noqa: E402
from entwine_jax.ag_gemm import op as ag_gemm_op  # noqa: E402
from entwine_jax.gemm_rs import config  # noqa: E402
from entwine_jax.gemm_rs import op as gemm_rs_op  # noqa: E402
from entwine_jax.moe import op as moe_op  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


@functools.cache
def cuda_gpu_count() -> int:
    try:
        return len(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend in this jaxlib or no GPU
        return 0


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs one CUDA GPU (skipped elsewhere; fails instead when "
                                       "ENTWINE_REQUIRE_GPUS >= 1: the machine is meant to have that many GPUs)")
    config.addinivalue_line("markers", "multigpu: needs two CUDA GPUs (skipped elsewhere; fails instead when "
                                       "ENTWINE_REQUIRE_GPUS >= 2)")
    if os.environ.get("ENTWINE_CI") == "1":
        where = pathlib.Path(entwine_jax.__file__).resolve()
        if where.parent == REPO / "entwine_jax":
            raise pytest.UsageError(f"ENTWINE_CI=1: entwine_jax was imported from the source tree ({where}), not the "
                                    "installed package; run `pytest tests` without PYTHONPATH")
        built, reason = entwine_jax.extension_status()
        if os.environ.get("ENTWINE_BUILD_CUDA", "ON").upper() not in ("OFF", "0") and not built:
            raise pytest.UsageError(f"ENTWINE_CI=1: the CUDA extension did not build or import: {reason}")


def pytest_report_header(config):
    built, reason = entwine_jax.extension_status()
    return [f"entwine_jax {entwine_jax.__version__} from {pathlib.Path(entwine_jax.__file__).parent}",
            f"extension: {reason}",
            f"jax {jax.__version__}, default backend {jax.default_backend()}, {len(jax.devices())} devices, "
            f"{cuda_gpu_count()} CUDA GPUs"]


def pytest_runtest_setup(item):
    need = 2 if item.get_closest_marker("multigpu") else 1 if item.get_closest_marker("gpu") else 0
    if need and cuda_gpu_count() < need:
        msg = f"needs {need} CUDA GPU(s), found {cuda_gpu_count()}"
        required = os.environ.get("ENTWINE_REQUIRE_GPUS", "0")
        if int(required or 0) >= need:
            pytest.fail(f"{msg} and ENTWINE_REQUIRE_GPUS={required}", pytrace=False)
        pytest.skip(msg)


@pytest.fixture(autouse=True)
def _fresh_reports():
    """Each test sees first-call log/print messages and the heuristic default config."""
    _log.reset_once()
    gemm_rs_op.printed.clear()
    ag_gemm_op.printed.clear()
    moe_op.printed.clear()
    previous = config.set_default_config(None)
    yield
    config.set_default_config(previous)


@pytest.fixture(autouse=True)
def _no_small_call_rule(monkeypatch):
    """Tests of the dispatch use tiny shapes that path="auto" would leave to XLA as too small to win
    (entwine_jax.tuning.crossover); the rule's own tests set its real costs back."""
    from entwine_jax.tuning import crossover
    monkeypatch.setattr(crossover, "COSTS", crossover.Costs(fixed_scale=0.0))
