# The MoE ops' XLA reference (docs/design.md, "Mixture of experts (planned)"): the layout every rank
# computes from the gathered counts (the static capacity rule and its deterministic overflow), the two
# transfers (token slots -> the experts' padded expert-major pool, pool rows -> the token slots), the
# grouped GEMMs (jax.lax.ragged_dot), and both ops' backward, each built from the other's pieces.
#
# The transfers are jax.lax.all_to_all of per-pair blocks, one row per (token, slot) of the source,
# on every platform. ragged_all_to_all (the plan's GPU form, rows landing straight in the pool) does not
# compile on XLA:CPU, and a GPU-only branch under platform_dependent would be a second reference that
# no test here runs; the dense blocks are W x T x k rows per rank, fine for a reference, never the
# kernels' path.
from typing import NamedTuple

import jax
import jax.numpy as jnp

from entwine_jax import opspec

DISPATCH = "moe_dispatch_gemm"
COMBINE = "moe_gemm_combine"
# Each expert's segment of the pool starts on a tile boundary: every 128-row tile has one expert.
TILE = 128
F32 = jnp.float32


class MoeHandle(NamedTuple):
    """What a dispatch hands to its combine and to the backward (a pytree of int32 device arrays).

    counts [W, E]: the rows rank q sends to expert e, every rank's, after the capacity rule;
    src [cap]: the source of each row of this rank's pool, q*T*k + t*k + j, -1 for padding;
    group_sizes [E_local]: each local expert's rows in the pool, padded to 128 (the groups of ragged_dot);
    dropped []: this rank's slots (its tokens') lost to the capacity;
    expert [T, k]: each slot's expert where it is sent, else -1 (a -1 or out-of-range topk_idx, dropped);
    pos [T, k]: each sent slot's row in its expert's rank's pool, else -1."""
    counts: jax.Array
    src: jax.Array
    group_sizes: jax.Array
    dropped: jax.Array
    expert: jax.Array
    pos: jax.Array


def round_up(n, m: int):
    return (n + m - 1) // m * m


def layout(topk_idx, *, axis_name, world: int, e_local: int, cap: int) -> MoeHandle:
    """The routing of this rank's slots and its pool's rows, from every rank's counts: rank r's pool
    is ordered by local expert, then source rank, then token and slot; expert l's segment starts at
    base_l = the padded sizes of experts before it (counts before the capacity); a row is kept iff
    its padded position is below cap (later experts, then later sources lose first)."""
    t, k = topk_idx.shape
    num_experts = world * e_local
    me = jax.lax.axis_index(axis_name)
    flat = topk_idx.reshape(-1)
    # An id outside [0, E) routes nowhere, like -1 (the ids are traced: no ValueError can see them).
    expert = jnp.where((flat >= 0) & (flat < num_experts), flat, -1)
    one_hot = (expert[:, None] == jnp.arange(num_experts, dtype=expert.dtype)[None, :]).astype(jnp.int32)
    # Each slot's place among this rank's slots of its expert, in token order.
    place = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0), jnp.maximum(expert, 0)[:, None], axis=1)[:, 0] - 1
    with opspec.moves(DISPATCH, jnp.int32):
        counts = jax.lax.all_gather(one_hot.sum(axis=0), axis_name)  # [W, E]
    padded = round_up(counts.sum(axis=0), TILE).reshape(world, e_local)
    base = (jnp.cumsum(padded, axis=1) - padded).reshape(num_experts)  # [E]: its segment on its rank
    # Where source q's rows of expert e start in the segment: the rows of the sources before q.
    start = base[None, :] + jnp.cumsum(counts, axis=0) - counts  # [W, E]
    position = start[me, jnp.maximum(expert, 0)] + place
    sent = (expert >= 0) & (position < cap)
    kept_counts = jnp.clip(cap - start, 0, counts)
    kept_here = jax.lax.dynamic_slice_in_dim(kept_counts.sum(axis=0), me * e_local, e_local)
    pos = jnp.where(sent, position, -1)
    expert_sent = jnp.where(sent, expert, -1)
    # The receivers learn which slot each of their rows holds: every source sends its slots' positions.
    dest = jnp.where(sent, expert_sent // e_local, world)
    blocks = jnp.full((world, t * k), -1, jnp.int32).at[dest, jnp.arange(t * k)].set(pos, mode="drop")
    with opspec.moves(DISPATCH, jnp.int32):
        got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True).reshape(-1)  # [W * T*k], source-major
    src = jnp.full((cap,), -1, jnp.int32).at[jnp.where(got >= 0, got, cap)].set(
        jnp.arange(world * t * k, dtype=jnp.int32), mode="drop")
    return MoeHandle(counts=kept_counts.astype(jnp.int32), src=src,
                     group_sizes=round_up(kept_here, TILE).astype(jnp.int32),
                     dropped=((expert >= 0) & ~sent).sum().astype(jnp.int32),
                     expert=expert_sent.reshape(t, k).astype(jnp.int32), pos=pos.reshape(t, k).astype(jnp.int32))


def to_experts(rows, handle: MoeHandle, *, axis_name, world: int, e_local: int, op: str):
    """rows [T*k, C] (one per slot) -> this rank's pool [cap, C]: the kept slots' rows at their
    positions, zeros elsewhere. Moved as `op`'s (the dispatch, or the combine's backward)."""
    tk = rows.shape[0]
    pos = handle.pos.reshape(-1)
    dest = jnp.where(pos >= 0, handle.expert.reshape(-1) // e_local, world)
    blocks = jnp.zeros((world, tk) + rows.shape[1:], rows.dtype).at[dest, jnp.arange(tk)].set(rows, mode="drop")
    with opspec.moves(op, rows.dtype):
        got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True).reshape((world * tk,) + rows.shape[1:])
    src = handle.src
    picked = got[jnp.maximum(src, 0)]
    return jnp.where((src >= 0).reshape((-1,) + (1,) * (rows.ndim - 1)), picked, jnp.zeros_like(picked))


def to_tokens(pool_rows, handle: MoeHandle, *, axis_name, world: int, e_local: int, op: str):
    """pool_rows [cap, C] -> [T*k, C]: each sent slot's row back at its token's rank, zeros for the
    slots not sent. Moved as `op`'s (the combine, or the dispatch's backward)."""
    t, k = handle.pos.shape
    tk = t * k
    src = handle.src
    blocks = jnp.zeros((world * tk,) + pool_rows.shape[1:], pool_rows.dtype)
    blocks = blocks.at[jnp.where(src >= 0, src, world * tk)].set(pool_rows, mode="drop")
    with opspec.moves(op, pool_rows.dtype):
        got = jax.lax.all_to_all(blocks.reshape((world, tk) + pool_rows.shape[1:]), axis_name, 0, 0, tiled=True)
    pos = handle.pos.reshape(-1)
    picked = got[jnp.maximum(handle.expert.reshape(-1), 0) // e_local, jnp.arange(tk)]
    return jnp.where((pos >= 0).reshape((-1,) + (1,) * (pool_rows.ndim - 1)), picked, jnp.zeros_like(picked))


def grouped_dot(pool, w, group_sizes):
    """pool [cap, K] @ w[expert of the row] [E_local, K, N] -> [cap, N] in fp32 (rows past the groups: zero)."""
    return jax.lax.ragged_dot(pool, w, group_sizes, preferred_element_type=F32)


def grouped_weight_grad(pool, dy, group_sizes):
    """[E_local, K, N]: per expert, its rows of pool [cap, K] transposed times its rows of dy [cap, N]."""
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                             rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(pool, dy, group_sizes, dims, preferred_element_type=F32)


def dispatch_reference(x, w1, handle: MoeHandle, *, axis_name, world: int, e_local: int):
    """(y [cap, N] in x.dtype, the dispatched pool [cap, H]): each kept slot's row of x at its place
    in its expert's rank's pool, times its expert's w1, accumulated in fp32."""
    k = handle.pos.shape[1]
    pool = to_experts(jnp.repeat(x, k, axis=0), handle, axis_name=axis_name, world=world, e_local=e_local, op=DISPATCH)
    return grouped_dot(pool, w1, handle.group_sizes).astype(x.dtype), pool


def combine_reference(h, w2, weights, handle: MoeHandle, *, axis_name, world: int, e_local: int, op: str = COMBINE):
    """out [T, H] in h.dtype: out[t] = sum_j weights[t, j] * (h[row(t, j)] @ w2[expert(t, j)]) over the
    sent slots; each row travels in h.dtype (as the kernels send it) and the sum is fp32, in j order."""
    t, k = handle.pos.shape
    o = grouped_dot(h, w2, handle.group_sizes).astype(h.dtype)
    slots = to_tokens(o, handle, axis_name=axis_name, world=world, e_local=e_local, op=op).reshape(t, k, -1)
    weights = jnp.where(handle.pos >= 0, weights.astype(F32), 0.0)
    return jnp.einsum("tk,tkh->th", weights, slots.astype(F32)).astype(h.dtype)


def dispatch_backward(pool, w1, handle: MoeHandle, dy, *, axis_name, world: int, e_local: int, x_dtype):
    """(dx, dw1) of dispatch: dx is a combine of dy with w1^T and unit weights (the gradient of copying
    x[t] to its slots' rows is the sum of those rows' gradients); dw1 from the dispatched pool."""
    ones = jnp.ones(handle.pos.shape, F32)
    dx = combine_reference(dy, jnp.swapaxes(w1, 1, 2), ones, handle, axis_name=axis_name, world=world,
                           e_local=e_local, op=COMBINE)
    dw1 = grouped_weight_grad(pool, dy, handle.group_sizes)
    return dx.astype(x_dtype), dw1.astype(w1.dtype)


def combine_backward(h, w2, weights, handle: MoeHandle, dout, *, axis_name, world: int, e_local: int):
    """(dh, dw2, dweights) of combine: dout's rows and the router weights dispatched in the handle's
    layout, g = dout_row @ w2^T on the expert side; dh = w * g, dw2 from h and w * dout_row, and the
    router weights' gradient <g, h> per row, sent home (labelled the combine's, docs/design.md "Census")."""
    t, k = handle.pos.shape
    kw = dict(axis_name=axis_name, world=world, e_local=e_local)
    dy_pool = to_experts(jnp.repeat(dout, k, axis=0), handle, op=DISPATCH, **kw)
    w_pool = to_experts(weights.astype(F32).reshape(-1, 1), handle, op=DISPATCH, **kw)  # [cap, 1]
    g = grouped_dot(dy_pool, jnp.swapaxes(w2, 1, 2), handle.group_sizes)  # [cap, F] fp32
    dh = (w_pool * g).astype(h.dtype)
    dw2 = grouped_weight_grad(h.astype(F32), w_pool * dy_pool.astype(F32), handle.group_sizes)
    dw_rows = jnp.sum(g * h.astype(F32), axis=1, keepdims=True)  # [cap, 1]
    dweights = to_tokens(dw_rows, handle, op=COMBINE, **kw).reshape(t, k)
    return dh, dw2.astype(w2.dtype), dweights.astype(weights.dtype)
