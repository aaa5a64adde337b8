#!/usr/bin/env bash
# CI step for the MaxText integration (entwine_jax.maxtext, tests/test_maxtext.py and
# tests/test_maxtext_moe.py): a venv of its own
# with the pinned MaxText and the jax, flax and optax it resolves (apart from .ci/run's venv),
# entwine_jax from this checkout on PYTHONPATH (the integration is pure Python; on CPU the ops run
# their XLA references),
# then the test on 8 fake CPU devices. Measured on the 2-core machine: install 125 s (no pip cache),
# test 77-248 s, the longest with other jobs loading it (docs/maxtext.md, "CI").
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${MAXTEXT_VENV:-$REPO/.venv-maxtext}
MAXTEXT_VERSION=0.2.5
T0=$SECONDS

PY=""
for cand in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
  if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    PY=$cand
    break
  fi
done
if [[ -z "$PY" ]]; then
  echo "no working Python 3.12 (tried python3.12, /root/.pyenv/versions/3.12*/bin/python3.12)" >&2
  exit 1
fi

echo "=== venv $VENV: maxtext[tpu]==$MAXTEXT_VERSION"
# Reused when it already holds the pinned MaxText (a developer's second run); CI starts clean.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('maxtext') == '$MAXTEXT_VERSION'" \
    >/dev/null 2>&1; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # The [tpu] extra carries MaxText's dependencies (plain `maxtext` installs none); it runs on CPU
  # with hardware=cpu. MaxText 0.2.5 asks for jax>=0.11.1; jax is pinned so that the losses the tests
  # compare come from one release (they pass on 0.12.0.1 and 0.12.1; each release moves them a little).
  "$VENV/bin/python" -m pip install --quiet "maxtext[tpu]==$MAXTEXT_VERSION" "jax==0.12.0.1" pytest
fi
"$VENV/bin/python" -c 'import jax, flax, maxtext; print("jax", jax.__version__, "flax", flax.__version__)'
echo "=== install: $((SECONDS - T0)) s"

echo "=== tests/test_maxtext.py tests/test_maxtext_moe.py"
T1=$SECONDS
# JAX_PLATFORMS=cpu: the [tpu] extra brings libtpu, which would otherwise probe for a TPU first.
# The conftest forces 8 CPU host devices.
(cd "$REPO" && JAX_PLATFORMS=cpu PYTHONPATH="$REPO" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -W ignore::DeprecationWarning tests/test_maxtext.py tests/test_maxtext_moe.py)
echo "=== test: $((SECONDS - T1)) s"
echo "=== total: $((SECONDS - T0)) s"
