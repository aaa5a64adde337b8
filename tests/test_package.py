# The package surface: exports, version, extension status, and the example as a user runs it.
import ast
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


# --- The package's structure: no import circle, no private name across modules, a light import ------

PACKAGE = pathlib.Path(entwine_jax.__file__).resolve().parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


EXTENSION = "entwine_jax._entwine"  # the compiled module: a leaf, it imports nothing of the package


def _modules() -> dict:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, modules: dict) -> list:
    """(imported module, names taken from it, line) of every import in the file, lazy ones included."""
    out = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno) for a in node.names if a.name.startswith("entwine_jax")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("entwine_jax"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                is_module = full in modules or full == EXTENSION
                out.append((full, (), node.lineno) if is_module else (base, (a.name,), node.lineno))
    return out


def test_import_graph_has_no_circle():
    # Every import of every module, lazy ones included: module-level, inside functions, relative.
    modules = _modules()
    graph = {name: {t for t, _, _ in _imports(name, path, modules) if t in modules} - {name}
             for name, path in modules.items()}

    def circle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    for name in sorted(modules):
        circle = circle_from(name)
        assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_no_private_name_crosses_a_module_boundary():
    modules = _modules()
    for name, path in modules.items():
        for target, names, line in _imports(name, path, modules):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            assert not private, f"{path.relative_to(PACKAGE)}:{line} imports {private} from {target}"


def test_import_loads_no_tuner_benchmark_or_command_line():
    code = ("import sys, entwine_jax; print(sorted(m for m in sys.modules if m.startswith('entwine_jax')))")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(PACKAGE.parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd="/")
    loaded = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    assert not loaded & {"entwine_jax.tuning.tune", "entwine_jax.tuning.timing", "entwine_jax.__main__",
                         "entwine_jax.layers", "entwine_jax.maxtext", "entwine_jax.census"}, loaded
