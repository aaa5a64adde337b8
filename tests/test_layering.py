# The package's import graph (every import of entwine_jax/**.py, at module level or inside a function)
# has no cycle and never imports upward: core modules know no op, an op knows the core and itself
# (not its sibling), and the composition (the registry, the pairing, the public API, the census, the
# layers, MaxText, the tuner, the command line) sits on top. A new op is a sibling folder of the ops.
import ast
import pathlib

import pytest

import entwine_jax

PACKAGE = pathlib.Path(entwine_jax.__file__).parent
CORE, OPS, COMPOSITION = 0, 1, 2
# Modules by layer; an op's package (entwine_jax.<op>) is every module under its folder.
LAYER = {
    "entwine_jax._config": CORE, "entwine_jax._log": CORE, "entwine_jax._ffi": CORE, "entwine_jax._dot": CORE,
    "entwine_jax._extension": CORE, "entwine_jax._distributed": CORE, "entwine_jax.opspec": CORE,
    "entwine_jax.callsite": CORE, "entwine_jax.comm": CORE, "entwine_jax.heap_exchange": CORE, "entwine_jax.fp8": CORE,
    "entwine_jax._entwine": CORE,
    "entwine_jax.tuning": CORE, "entwine_jax.tuning.crossover": CORE, "entwine_jax.tuning.timing": CORE,
    "entwine_jax": COMPOSITION, "entwine_jax.__main__": COMPOSITION, "entwine_jax.registry": COMPOSITION,
    "entwine_jax.pairing": COMPOSITION, "entwine_jax.api": COMPOSITION, "entwine_jax.census": COMPOSITION,
    "entwine_jax.layers": COMPOSITION, "entwine_jax.layers_fp8": COMPOSITION, "entwine_jax.moe_layers": COMPOSITION,
    "entwine_jax.maxtext": COMPOSITION,
    "entwine_jax.maxtext_site.sitecustomize": COMPOSITION, "entwine_jax.tuning.tune": COMPOSITION,
}
OP_PACKAGES = ("entwine_jax.gemm_rs", "entwine_jax.ag_gemm", "entwine_jax.moe")
# The compiled extension: a module without a .py file.
COMPILED = ("entwine_jax._entwine",)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: pathlib.Path, known) -> set[str]:
    """The package's modules `name` imports anywhere in its code (`from entwine_jax import comm` is
    the module comm; a name that is no module, the package that defines it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def layer_of(name: str):
    if name in LAYER:
        return LAYER[name], None
    for package in OP_PACKAGES:
        if name == package or name.startswith(package + "."):
            return OPS, package
    raise AssertionError(f"{name} is in no layer: add it to tests/test_layering.py (LAYER or OP_PACKAGES)")


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found) | set(COMPILED)
    return {**{name: imports(name, path, known) for name, path in found.items()}, **{m: set() for m in COMPILED}}


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_no_import_goes_up_or_to_a_sibling_op():
    wrong = []
    for name, targets in graph().items():
        layer, op = layer_of(name)
        for target in sorted(targets):
            target_layer, target_op = layer_of(target)
            if target_layer > layer or (layer == OPS and target_layer == OPS and target_op != op):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layers (core < ops < composition; ops are siblings): " + ", ".join(wrong)


def test_no_import_cycle():
    edges, done, path = graph(), set(), []

    def visit(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(edges[name]):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(edges):
        cycle = visit(name)
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_a_wrong_import(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from entwine_jax import registry\n")
    assert imports("entwine_jax.callsite", tmp_path / "m.py", {"entwine_jax.registry"}) == {"entwine_jax.registry"}
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("entwine_jax.new_module")
