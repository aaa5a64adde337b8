# What an op tells shared code about itself, so that shared code (the collective census) asks the op
# instead of branching on its name: the collective its kernels perform, its custom-call targets, the
# bytes a custom call moves, and the name scope its XLA reference wraps each collective in, which
# says which op it stands for and in what dtype the op's kernels move that data on a GPU.
import dataclasses
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp

# The scope's form: entwine_moves.<op>.<dtype name>; dots and words only, because XLA's op_name already
# uses "/", "(", ")" and ":" (a combined collective's op_name is "(a/...:b/...)").
_PREFIX = "entwine_moves"
_MARK = re.compile(_PREFIX + r"\.(\w+)\.(\w+)")


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """One op, as the census sees it.

    name: the op ("gemm_rs"); kind: the collective its kernels perform (an HLO opcode,
    "reduce-scatter"); targets: its custom-call targets; moved: (operand arrays, result arrays,
    backend_config text) -> (W, the arrays one rank sends W - 1 times) of one custom call, arrays as
    [(HLO element type, dims)]."""
    name: str
    kind: str
    targets: tuple
    moved: Callable


def attribute_is(attrs: str, name: str, value: str) -> bool:
    """Whether a custom call's attribute text sets `name` to `value` (as HLO prints it: true, 1)."""
    return re.search(rf"\b{name}\s*=\s*{value}\b", attrs) is not None


def moves(op: str, dtype):
    """The name scope around a collective of `op`'s XLA reference: on a GPU the op's kernels move this
    data in `dtype` (which may differ from what the reference or a CPU compile moves, e.g. gemm_rs's
    fp32 reference reduce-scatter stands for the kernels' reduce-scatter in the output dtype)."""
    return jax.named_scope(f"{_PREFIX}.{op}.{jnp.dtype(dtype).name}")


def moved_by(op_name: str) -> Optional[tuple]:
    """(op, HLO element type) of the innermost moves() scope in an instruction's op_name, or None."""
    found = _MARK.findall(op_name)
    if not found:
        return None
    op, dtype = found[-1]
    return op, hlo_type(dtype)


def hlo_type(dtype_name: str) -> str:
    """A NumPy / JAX dtype name as HLO prints it: bfloat16 -> bf16, float8_e4m3fn -> f8e4m3fn."""
    return dtype_name.replace("float8_", "f8").replace("bfloat", "bf").replace("float", "f").replace(
        "uint", "u").replace("int", "s")
