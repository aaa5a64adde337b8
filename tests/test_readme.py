# The README's code blocks marked runnable (an HTML comment starting "<!-- runnable" on the line
# before the fence) run as pasted, each in a fresh process on CPU, against the entwine_jax this test
# imported (installed, or the source tree).
import os
import pathlib
import re
import subprocess
import sys

import pytest

import entwine_jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^<!-- runnable[^\n]*-->\n```python\n(.*?)^```", re.S | re.M)


def runnable_blocks():
    return BLOCK.findall(README.read_text())


def test_the_readme_has_a_runnable_usage_block():
    assert runnable_blocks(), "no block of README.md is marked runnable"


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_readme_block_runs_as_pasted(index):
    code = runnable_blocks()[index]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(entwine_jax.__file__).parents[1]))
    env.pop("XLA_FLAGS", None)  # the block sets its own, as a user's fresh process would
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"README block {index} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    # The block's own comments say what it prints.
    for expected in re.findall(r"print\(.*\)\s*#\s*(\(\d+, \d+\) \w+)", code):
        assert expected in out.stdout, f"README block {index} printed {out.stdout!r}, its comment says {expected!r}"
