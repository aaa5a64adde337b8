# The MaxText launch hook (entwine_jax/maxtext_site/sitecustomize.py) in fresh processes: other
# processes import neither entwine_jax nor jax; a MaxText main whose enable() fails stops with the
# reason, or trains stock under ENTWINE_MAXTEXT_FALLBACK=stock; stats() written at exit when asked.
# A stand-in `maxtext` package (one main module, no layers) makes enable() fail without MaxText.
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("absl.app", reason="the hook wraps absl.app.run (MaxText's launcher); absl is not installed")

REPO = pathlib.Path(__file__).resolve().parents[1]
SITE = REPO / "entwine_jax" / "maxtext_site"


def _run(tmp_path, args, **env):
    fake = tmp_path / "fake"
    (fake / "maxtext").mkdir(parents=True, exist_ok=True)
    (fake / "maxtext" / "__init__.py").write_text("")
    (fake / "maxtext" / "main.py").write_text("from absl import app\napp.run(lambda argv: print('main ran'))\n")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), str(fake), str(REPO)]),
               "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run([sys.executable, *args], env=environ, capture_output=True, text=True, timeout=120)


def test_other_processes_do_not_pay_the_import(tmp_path):
    done = _run(tmp_path, ["-c", "import absl.app, sys; print(sorted({'entwine_jax', 'jax'} & set(sys.modules)))"])
    assert done.returncode == 0 and done.stdout.strip() == "[]", done


def test_a_failed_enable_stops_the_job_with_its_reason(tmp_path):
    done = _run(tmp_path, ["-m", "maxtext.main"])
    assert done.returncode != 0 and "main ran" not in done.stdout, done
    assert "entwine_jax sitecustomize: entwine_jax.maxtext.enable() failed: ImportError" in done.stderr, done.stderr


def test_fallback_trains_stock_and_stats_are_written_at_exit(tmp_path):
    out = tmp_path / "stats.json"
    done = _run(tmp_path, ["-m", "maxtext.main"], ENTWINE_MAXTEXT_FALLBACK="stock", ENTWINE_MAXTEXT_STATS=str(out))
    assert done.returncode == 0 and "main ran" in done.stdout, done
    assert "ENTWINE_MAXTEXT_FALLBACK=stock: training stock MaxText" in done.stderr, done.stderr
    assert set(json.loads(out.read_text())) == {"routed", "grouped", "kept", "outside_train_step"}


def test_the_hook_is_off_with_entwine_maxtext_0(tmp_path):
    done = _run(tmp_path, ["-m", "maxtext.main"], ENTWINE_MAXTEXT="0")
    assert done.returncode == 0 and "main ran" in done.stdout, done
