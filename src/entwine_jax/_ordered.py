# The fused calls as one primitive with an ordered effect. Every fused call of every op takes the
# effect's token and yields the next one, so JAX threads one token through all of them in program order (through
# jit, shard_map, scan, while, cond, custom_vjp and remat) and the lowered program orders them by data
# flow: XLA's scheduler, stream assignment and command buffers scheduled in LHS mode cannot run two
# fused calls in different orders on different ranks. A call takes the token; entwine_order makes the
# next one from the call's first result. (XLA's CONCURRENT command-buffer mode orders
# commands by buffer conflicts alone and ignores tokens: comm.command_buffer_hazard refuses it.)
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax._src import core, dispatch, effects
from jax._src.interpreters import ad, batching, mlir
from jax._src.lib.mlir import ir

from entwine_jax import _extension


@dataclasses.dataclass(frozen=True)
class FusedCollectiveEffect(effects.Effect):
    """The effect of a fused collective call: ordered (one token, program order), shardable (each
    device keeps its own order; SPMD ranks run the same program) and allowed everywhere a user
    puts a layer."""

    def __str__(self):
        return "entwine fused collective"


EFFECT = FusedCollectiveEffect()
for _kind in (effects.ordered_effects, effects.shardable_ordered_effects, effects.lowerable_effects,
              effects.control_flow_allowed_effects, effects.remat_allowed_effects,
              effects.custom_derivatives_allowed_effects, effects.partial_eval_kept_effects):
    _kind.add_type(FusedCollectiveEffect)


def _frozen(value):
    """An attribute value in a hashable form for the primitive's params (dicts become item tuples)."""
    if isinstance(value, dict):
        return ("__dict__", tuple((k, _frozen(v)) for k, v in value.items()))
    return value


def _thawed(value):
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__dict__":
        return {k: _thawed(v) for k, v in value[1]}
    return value


def _ir_attribute(value) -> ir.Attribute:
    if isinstance(value, dict):
        return ir.DictAttr.get({k: _ir_attribute(v) for k, v in value.items()})
    return mlir.ir_attribute(value)


fused_call_p = core.Primitive("entwine_fused_call")
fused_call_p.multiple_results = True
dispatch.simple_impl(fused_call_p)


def _abstract_eval(*avals_in, target, result_avals, attributes):
    del avals_in, target, attributes
    # As jax.ffi.ffi_call types its results: on the current mesh (inside shard_map, its manual axes).
    return tuple(r.update(sharding=core.get_cur_mesh_sharding()) for r in result_avals), {EFFECT}


fused_call_p.def_effectful_abstract_eval(_abstract_eval)


def _no_derivative(*args, target, **_):
    raise ValueError(f"the fused call {target} has no derivative of its own: the ops' custom VJPs pair them")


ad.primitive_jvps[fused_call_p] = _no_derivative
ad.primitive_transposes[fused_call_p] = _no_derivative


def _batch(args, dims, *, target, result_avals, attributes):
    # One call per batch element, in order (a loop on the device, like lax.scan): each element is its
    # own collective with its own epoch.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [a if d is None else batching.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    batched = [d is not None for d in dims]

    def step(_, xs):
        it = iter(xs)
        operands = [next(it) if b else a for a, b in zip(args, batched)]
        return (), fused_call_p.bind(*operands, target=target, result_avals=result_avals, attributes=attributes)

    _, outs = jax.lax.scan(step, (), [a for a, b in zip(args, batched) if b], length=size)
    return list(outs), [0] * len(outs)


batching.primitive_batchers[fused_call_p] = _batch


def _row_major(aval) -> Sequence[int]:
    return tuple(range(len(aval.shape) - 1, -1, -1))


def _lower(ctx: mlir.LoweringRuleContext, *operands, target, result_avals, attributes):
    del result_avals
    token = ctx.tokens_in.get(EFFECT)
    # The call takes the token; the next token comes from entwine_order applied to the call's first
    # result (comm/order.cc says why the call does not return it).
    op = mlir.custom_call(
        target,
        result_types=[mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out],
        operands=[*operands, token],
        backend_config={k: _ir_attribute(_thawed(v)) for k, v in attributes},
        api_version=4,
        has_side_effect=True,
        operand_layouts=[_row_major(a) for a in ctx.avals_in] + [()],
        result_layouts=[_row_major(a) for a in ctx.avals_out],
    )
    outs = list(op.results)
    link = mlir.custom_call(
        _extension.ext().ORDER_TARGET,
        result_types=[mlir.token_type()],
        operands=[outs[0], token],
        backend_config={},
        api_version=4,
        has_side_effect=True,
        operand_layouts=[_row_major(ctx.avals_out[0]), ()],
        result_layouts=[()],
    )
    ctx.set_tokens_out(mlir.TokenSet({EFFECT: link.result}))
    return outs


mlir.register_lowering(fused_call_p, _lower)


def fused_call(target: str, results: Sequence[jax.ShapeDtypeStruct], *operands, **attributes) -> list[Any]:
    """Calls the FFI target `target` on operands (arrays) with attributes (NumPy scalars, bools, or
    dicts of them), ordered after every earlier fused call of the program; returns the results."""
    avals = tuple(core.ShapedArray(tuple(r.shape), np.dtype(r.dtype)) for r in results)
    frozen = tuple((k, _frozen(v)) for k, v in attributes.items())
    return fused_call_p.bind(*operands, target=target, result_avals=avals, attributes=frozen)


# A point in the fused calls' order that computes nothing: the XLA reference branch passes its
# operands through it, so that every branch of a platform_dependent carries the effect and splits
# like the fused branch under partial evaluation (a branch without it lowers without the token, which
# jax rejects when it selects that branch for the platform).
order_point_p = core.Primitive("entwine_order_point")
order_point_p.multiple_results = True
dispatch.simple_impl(order_point_p)
order_point_p.def_effectful_abstract_eval(lambda *avals: (avals, {EFFECT}))
batching.primitive_batchers[order_point_p] = lambda args, dims: (order_point_p.bind(*args), dims)


def _order_point_jvp(primals, tangents):
    return order_point_p.bind(*primals), list(tangents)


ad.primitive_jvps[order_point_p] = _order_point_jvp


def _lower_point(ctx: mlir.LoweringRuleContext, *operands):
    ctx.set_tokens_out(ctx.tokens_in)
    return list(operands)


mlir.register_lowering(order_point_p, _lower_point)


def order_point(*operands):
    """The operands, unchanged, at the XLA path's place in the fused calls' order (nothing runs)."""
    return tuple(order_point_p.bind(*operands))
