"""The MoE kernels' block order (ffi/moe/moe.h, segment_block) on a CPU: tests/segment_order_check.cu,
built with nvcc against the repository's headers (no GPU, no CUTLASS), walks seeded random problems
as the kernels' roles do and checks that every block is visited once, the blocks with rows come
first and deal evenly over the grid, each group's segments (an expert's, one per source) stacked in
order, and full segments keep the group order."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    default = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return str(default) if default.exists() else None


def test_moe_block_order(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH or $CUDA_HOME/bin): the check is a host program built with it")
    binary = tmp_path / "segment_order_check"
    subprocess.run([nvcc, "-std=c++17", "-I", str(ROOT / "ffi"), "-o", str(binary),
                    str(ROOT / "tests" / "segment_order_check.cu")], check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout + run.stderr
    assert int(run.stdout.split()[1]) >= 1000
