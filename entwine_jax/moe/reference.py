# The MoE ops' XLA reference (docs/design.md, "Mixture of experts"): the static layout (each
# slot's row in its (source, expert) segment of C rows, computed locally: no counts phase), the two
# kernel-boundary functions dispatch_pool and combine_pool (one all_to_all and one batched GEMM each),
# and the token-side pieces around them (the send buffer, the weighted gather-sum); entwine_jax.moe.op
# composes them into both ops and their backward.
#
# Layout (DeepEP low-latency's recv layout, [E_local, W*C, H]):
#
#   source q, send buffer [E, C, H]         rank r, pool [E_local, W*C, H]
#   expert e = r*E_local + l:               expert l: | q=0: C rows | q=1: C rows | ... | q=W-1 |
#     row i = the i-th slot of e on q  ---->            row q*C + i
#
# Pitfalls: rows past a segment's valid ones are zero in the send buffer, so they are zero in y and add
# nothing to the weight gradients; the token side reads back only the rows it sent (place < C), and
# selects them (never multiplies a row by a zero weight): the combine kernel leaves the rows past a
# segment's sent ones unwritten.
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from entwine_jax import opspec

DISPATCH = "moe_dispatch_gemm"
COMBINE = "moe_gemm_combine"
# C, the rows of a (source, expert) segment, is a multiple of this (one GEMM tile of rows).
TILE = 128
F32 = jnp.float32


class MoeHandle(NamedTuple):
    """What a dispatch hands to its combine and to the backward (a pytree of int32 device arrays).

    expert [T, k]: each slot's global expert where it is sent, else -1 (a -1 or out-of-range
                   topk_idx, or dropped);
    place [T, k]:  each sent slot's row i in its (this rank, expert) segment, else -1;
    dropped []:    this rank's slots (its tokens') lost to the capacity C;
    received [E_local, W]: the rows source s sent this rank's expert l, at [l, s], where a kernel
                   reads them (it skips the GEMM blocks past them), else None;
    sent [E]:      the rows this rank sends each expert, where a kernel pushes them (an SM push
                   moves only those, in whole 128-row blocks), else None."""
    expert: jax.Array
    place: jax.Array
    dropped: jax.Array
    received: Optional[jax.Array] = None
    sent: Optional[jax.Array] = None


def round_up(n, m: int):
    return (n + m - 1) // m * m


def layout(topk_idx, *, num_experts: int, capacity: int) -> MoeHandle:
    """This rank's routing, from its own topk_idx only: slot (t, j) to expert e takes row `place` = its
    index among this rank's slots of e in (t, j) order; it is sent iff place < capacity."""
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    # An id outside [0, E) routes nowhere, like -1 (the ids are traced: no ValueError can see them).
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    # A stable sort by expert keeps (t, j) order inside each expert: place = index minus the expert's start.
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)
    start = jnp.cumsum(counts) - counts
    ranked = jnp.arange(t * k, dtype=jnp.int32) - start[key[order]]
    place = jnp.zeros((t * k,), jnp.int32).at[order].set(ranked)
    sent = valid & (place < capacity)
    return MoeHandle(expert=jnp.where(sent, flat, -1).reshape(t, k).astype(jnp.int32),
                     place=jnp.where(sent, place, -1).reshape(t, k).astype(jnp.int32),
                     dropped=(valid & ~sent).sum().astype(jnp.int32))


def sent_rows(handle: MoeHandle, *, num_experts: int):
    """[E] int32: the rows this rank sends each expert (its segments' valid rows; the rest are zero)."""
    e = jnp.where(handle.expert >= 0, handle.expert, num_experts).reshape(-1)
    return jnp.zeros((num_experts,), jnp.int32).at[e].add(1, mode="drop")


def to_segments(slot_rows, handle: MoeHandle, *, num_experts: int, capacity: int):
    """slot_rows [T, k, ...] (one per slot) -> the send buffer [E, C, ...]: each sent slot's row at its
    (expert, place), zeros elsewhere (local: no transfer)."""
    sent = handle.expert >= 0
    # Slots not sent scatter to expert E, outside the buffer: mode="drop" discards them.
    e = jnp.where(sent, handle.expert, num_experts).reshape(-1)
    i = jnp.where(sent, handle.place, 0).reshape(-1)
    rest = slot_rows.shape[2:]
    buf = jnp.zeros((num_experts, capacity) + rest, slot_rows.dtype)
    return buf.at[e, i].set(slot_rows.reshape((-1,) + rest), mode="drop")


def from_segments(o_recv, weights, handle: MoeHandle):
    """out [T, H] in fp32: sum_j weights[t, j] * o_recv[expert(t, j), place(t, j)] over the sent slots,
    in j order (local: no transfer). o_recv's other rows may hold anything (even NaN): never read."""
    sent = handle.expert >= 0
    rows = o_recv[jnp.maximum(handle.expert, 0), jnp.maximum(handle.place, 0)].astype(F32)  # [T, k, H]
    rows = jnp.where(sent[..., None], rows, 0.0)
    w = jnp.where(sent, weights.astype(F32), 0.0)
    # A contraction, not a multiply and a sum: jit would fuse those into FMAs and differ from eager.
    return jnp.einsum("tk,tkh->th", w, rows)


def to_experts(send, *, axis_name, world: int, op: str):
    """send [E, C, ...] (this rank's segments for every expert) -> pool [E_local, W*C, ...]: row q*C + i
    of local expert l is source q's row i for expert rank*E_local + l. Moved as `op`'s."""
    e, c = send.shape[:2]
    rest = send.shape[2:]
    with opspec.moves(op, send.dtype):
        # [W dest, E_local, C, ...] -> [W source, E_local, C, ...]
        got = jax.lax.all_to_all(send.reshape((world, e // world, c) + rest), axis_name, 0, 0, tiled=True)
    return jnp.swapaxes(got, 0, 1).reshape((e // world, world * c) + rest)


def to_sources(pool, *, axis_name, world: int, op: str):
    """pool [E_local, W*C, ...] -> [E, C, ...] at the sources, to_experts' inverse: source q receives
    rows (l, q*C + i) of rank r at (r*E_local + l, i). Moved as `op`'s."""
    e_local, wc = pool.shape[:2]
    rest = pool.shape[2:]
    c = wc // world
    send = jnp.swapaxes(pool.reshape((e_local, world, c) + rest), 0, 1)  # [W source, E_local, C, ...]
    with opspec.moves(op, pool.dtype):
        got = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [W expert rank, E_local, C, ...]
    return got.reshape((world * e_local, c) + rest)


def expert_dot(a, w, precision=None):
    """a [E_local, R, K] @ w [E_local, K, N] per expert -> [E_local, R, N] in fp32."""
    return jnp.einsum("erk,ekn->ern", a, w, precision=precision, preferred_element_type=F32)


def expert_weight_grad(a, dy):
    """[E_local, K, N]: per expert, a [E_local, R, K] transposed times dy [E_local, R, N], fp32."""
    return jnp.einsum("erk,ern->ekn", a, dy, preferred_element_type=F32)


def dispatch_pool(x_send, w1, *, axis_name, world: int):
    """The dispatch's transfer and GEMM (what the kernel replaces): x_send [E, C, H], w1 [E_local, H, N]
    -> (y [E_local, W*C, N] in x_send.dtype, pool [E_local, W*C, H]); y[l] = pool[l] @ w1[l], fp32
    accumulation."""
    pool = to_experts(x_send, axis_name=axis_name, world=world, op=DISPATCH)
    return expert_dot(pool, w1).astype(x_send.dtype), pool


def combine_pool(h, w2, *, axis_name, world: int):
    """The combine's GEMM and transfer (what the kernel replaces): h [E_local, W*C, F], w2 [E_local, F, H]
    -> o_recv [E, C, H] in h.dtype at the sources: o = h[l] @ w2[l] (fp32 accumulation, rounded to
    h.dtype as the rows travel), row (l, q*C + i) sent to source q's (rank*E_local + l, i)."""
    return to_sources(expert_dot(h, w2).astype(h.dtype), axis_name=axis_name, world=world, op=COMBINE)

