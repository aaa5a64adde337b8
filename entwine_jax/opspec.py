# The op contract: what an op tells shared code about itself, so that shared code (the census, the
# pairing of each op with its backward) asks the op instead of branching on its name. Each op's
# op.py declares one OpSpec; entwine_jax/registry.py lists them. Also the name scope an op's XLA
# reference wraps each collective in, which says which op it stands for and in what dtype the op's
# kernels move that data on a GPU.
import dataclasses
import re
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

# The scope's form: entwine_moves.<op>.<dtype name>; dots and words only, because XLA's op_name already
# uses "/", "(", ")" and ":" (a combined collective's op_name is "(a/...:b/...)").
_PREFIX = "entwine_moves"
_MARK = re.compile(_PREFIX + r"\.(\w+)\.(\w+)")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op, as shared code sees it. Every callable but fixed_us has one signature for every op.

    The census: name (the op, its name scope "entwine_<name>" and its moves() label), kind (the
    collective its kernels perform, an HLO opcode: "reduce-scatter"), targets (its custom-call
    targets), moved(target, operand arrays, result arrays, backend_config text) -> (W, the arrays one
    rank sends W - 1 times) of one custom call, arrays as [(HLO element type, dims)].

    The pairing (entwine_jax.pairing): backward, the op (by name) whose call on (dy, w.T) in the same
    layout (the same dimension) is this op's dx; gathers, whether the op can return the operand it
    gathered (then the op's plan takes return_gathered, and that operand serves dw);
    reference_backward(x, w, dy, *, axis_name, dimension) -> (dx, dw), the op's own XLA
    backward after an XLA forward (None: the backward op on its XLA path).

    The call site: config_type (its config; config_type(path="xla") is the XLA path), and
      plan(x, w, *, axis_name, dimension, config, return_gathered=False, out_dtype=None,
           shared_scale=False, block_scaled=False) -> the op's Plan: checks the call (ValueErrors
           naming the argument), chooses its config and path, reports it; out_dtype: an FP8 call
           writing that dtype, shared_scale: its x_scale the same on every rank, block_scaled: its
           scales per block (1x128 tiles of x, 128x128 blocks of w; entwine_jax.fp8). A Plan has
           axis_name, axis_size, dimension (normalised), config, reason (None: the kernels run it),
           return_gathered.
      forward(x, w, plan, gathered=False) -> y, or (y, gathered x) with gathered;
      forward_fp8(x8, w8, x_scale, w_scale, plan, gathered=False) -> y, or (y, gathered x8, the W
           sources' x_scale, or with block scales x's tiles' scales gathered with it) with gathered;
      why_not_fused(x, w, *, axis_name, axis_size, dimension, config, out_dtype=None,
           shared_scale=False, block_scaled=False) -> why the call takes the XLA path, or None (asks
           only);
      default_config(x, w, axis_size, dimension) -> (config, where it came from);
      fixed_us(...) -> the fused call's fixed cost beyond XLA's in microseconds (the small-call
           rule, tuning/crossover.py), from what that cost depends on for the op (nothing for one,
           the transfer engine for another); the op's why_not_fused passes it on.
    What a fused call needs of the communicator's heap each op asks for itself (its fused.prepare,
    through comm.acquire_comm).

    An op with routing operands (routed=True: a mixture-of-experts op) takes a RoutedInput in place of
    x in plan, forward, why_not_fused and default_config; its dimension is 0, it gathers nothing, and
    its forward returns what its public function returns (a dispatch: its output and its routing handle).
    entwine_jax.pairing runs the dense ops only (its rule, dx = backward op on (dy, w.T), is theirs):
    a routed op's package pairs its ops with their backward itself. moved and fixed_us are None and
    targets empty while an op has no kernels; forward_fp8 is None while it has no FP8 call."""
    name: str
    kind: str
    targets: tuple
    moved: Optional[Callable]
    backward: str
    gathers: bool
    reference_backward: Optional[Callable]
    config_type: type
    plan: Callable
    forward: Callable
    forward_fp8: Optional[Callable]
    why_not_fused: Callable
    default_config: Callable
    fixed_us: Optional[Callable]
    routed: bool = False

    @property
    def scope(self) -> str:
        """The name scope of every operation of a call (forward and backward): how the census tells
        the op's collectives from XLA's own."""
        return f"entwine_{self.name}"


class RoutedInput(NamedTuple):
    """The operands of a routed op in place of x: the rows (tokens, or the rows the experts received),
    each token's experts [T, k] (int32, -1: none), its router weights [T, k], and the routing handle a
    previous call returned (None where the op computes it)."""
    x: Any
    topk_idx: Any = None
    weights: Any = None
    handle: Any = None


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
