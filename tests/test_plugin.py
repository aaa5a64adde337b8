# An op is a plug-in: the modules every op shares ask the op (its spec, its own costs) instead of
# naming it. This fails when a shared module's code names an op, as an identifier or a short string
# key; comments, docstrings and help texts may still mention the ops by name.
import io
import pathlib
import tokenize

import pytest

import entwine_jax

PACKAGE = pathlib.Path(entwine_jax.__file__).parent
OPS = ("gemm_rs", "ag_gemm", "moe_dispatch_gemm", "moe_gemm_combine")
# Shared modules: the communicator, the call-site pipeline, the FFI call, the op contract, the pairing
# of each op with its backward (bf16 and FP8), FP8's helpers, the census, the small-call rule, timing.
# The registry (one line per op), the public API (__init__.py, api.py), gemm_rs's tuner (tuning/tune.py),
# the layers and the MaxText integration are about the ops by design.
SHARED = ("_config.py", "_distributed.py", "_dot.py", "_extension.py", "_ffi.py", "_log.py", "callsite.py",
          "comm.py", "census.py", "fp8.py", "heap_exchange.py", "layers_fp8.py", "opspec.py", "pairing.py",
          "tuning/crossover.py", "tuning/timing.py")
# A string literal up to this long is a key or a value, not prose.
KEY_CHARS = 40


def op_names_in_code(source: str) -> list[tuple[int, str]]:
    found, previous = [], None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        is_docstring = tok.type == tokenize.STRING and previous in (None, tokenize.NEWLINE, tokenize.INDENT,
                                                                    tokenize.DEDENT)
        named = any(op in tok.string for op in OPS)
        if named and tok.type == tokenize.NAME:
            found.append((tok.start[0], tok.string))
        elif named and tok.type == tokenize.STRING and not is_docstring and len(tok.string) <= KEY_CHARS:
            found.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return found


@pytest.mark.parametrize("module", SHARED)
def test_shared_module_names_no_op(module):
    found = op_names_in_code((PACKAGE / module).read_text())
    assert not found, f"entwine_jax/{module} names an op in its code (line, token): {found}"


def test_the_check_finds_an_op_name():
    assert op_names_in_code('x = COSTS["gemm_rs"]\nfrom entwine_jax.ag_gemm import op\n') == [
        (1, '"gemm_rs"'), (2, "ag_gemm")]
    assert op_names_in_code('"""gemm_rs in a docstring"""\n# ag_gemm in a comment\n') == []
