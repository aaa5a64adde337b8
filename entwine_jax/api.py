# The ops as users call them: entwine_jax.gemm_rs and entwine_jax.ag_gemm (bf16/fp16, fp32 on the
# XLA path, FP8 with scales; ag_gemm also on a group of weights), and the MoE pair moe_dispatch_gemm /
# moe_gemm_combine. Each checks what only its public form takes and hands the call to
# entwine_jax.pairing, which runs the op with its backward (the MoE ops: to entwine_jax.moe.op, which
# pairs the two routed ops itself).
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import callsite, fp8, pairing
from entwine_jax.ag_gemm import op as ag_op
from entwine_jax.ag_gemm.config import AgGemmConfig
from entwine_jax.gemm_rs.config import GemmRsConfig
from entwine_jax.moe import fp8_op as moe_fp8
from entwine_jax.moe import op as moe_op
from entwine_jax.moe.config import MoeConfig


def gemm_rs(x, w, *, axis_name, scatter_dimension: int = 0, config: Optional[GemmRsConfig] = None,
            x_scale=None, w_scale=None, out_dtype=None, grad_dtype=None, grad_scale=None):
    """Fused GEMM + ReduceScatter, called inside jax.shard_map.

    Computes jax.lax.psum_scatter(x @ w, axis_name, scatter_dimension=scatter_dimension, tiled=True)
    with fp32 accumulation and the result in x.dtype.

    x: [..., K_local] (contraction dim sharded over axis_name); w: [K_local, N].
    scatter_dimension indexes the output [..., N]; negative values count from the end.
    config: a GemmRsConfig; default: set_default_config(), else the tuned table (user cache, then
    shipped; entwine_jax.tuning), else heuristic_config().

    FP8 (entwine_jax.fp8): with x_scale and w_scale (float32 scalars) computes
    psum_scatter((x * x_scale) @ (w * w_scale)) on float8_e4m3fn operands (or bf16/fp16/fp32 ones the
    op quantises with those scales) in out_dtype (bfloat16 or float16); the backward quantises the
    cotangent to grad_dtype (float8_e5m2 with grad_scale, default each rank's current scale; or
    bfloat16/float16). Block scaling: x_scale [..., ceil(K_local/128)] (one per 1x128 tile of x, x's
    leading dims) and w_scale [ceil(K_local/128), ceil(N/128)] (one per 128x128 block of w), this
    rank's; the backward quantises dy per 1x128 tile (grad_scale not taken).
    """
    if fp8.requested(x, w, x_scale, w_scale, out_dtype, grad_dtype, grad_scale):
        xs, ws, gs, call = fp8.check("gemm_rs", x, (w,), x_scale, w_scale, out_dtype, grad_dtype, grad_scale)
        fp8.check_scales("gemm_rs", (("x", x, xs), ("w", w, ws)))
        return pairing.call_fp8("gemm_rs", x, w, xs, ws, gs, call, axis_name=axis_name, dimension=scatter_dimension,
                                config=config)
    return pairing.call("gemm_rs", x, w, axis_name=axis_name, dimension=scatter_dimension, config=config)


def ag_gemm(x, w, *, axis_name, gather_dimension: int = 0, config: Optional[AgGemmConfig] = None,
            return_gathered: bool = False, x_scale=None, w_scale=None, out_dtype=None, grad_dtype=None,
            grad_scale=None):
    """Fused AllGather + GEMM, called inside jax.shard_map.

    Computes jnp.matmul(jax.lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True), w) with
    fp32 accumulation and the result in x.dtype; with return_gathered=True also returns the
    gathered x.

    Rows layout (gather_dimension a leading or middle dim: sequence parallelism): x [..., M/W, ..., K],
    w [K, N_local] -> [..., M, ..., N_local]. Contraction layout (gather_dimension = -1: activations
    sharded over the hidden dim): x [..., K/W], w [K, N_local] -> [..., N_local].

    Grouped: w a tuple (or list) of weights [K, N_i] (e.g. query, key and value, of any widths) ->
    a tuple of outputs [..., N_i], from one gather of x: one GEMM over the weights side by side,
    each read where it lies and each output written in place (up to 4 weights whose widths are
    multiples of the GEMM block, 128 or config.block_n; otherwise the call concatenates the weights,
    a copy per call, and logs why once), and the backward is one gemm_rs on all the cotangents.
    config: an AgGemmConfig; default: ag_heuristic_config().

    FP8 (entwine_jax.fp8): with x_scale and w_scale (float32 scalars; a group shares one w_scale)
    computes all_gather(x * x_scale) @ (w * w_scale) on float8_e4m3fn operands (or bf16/fp16/fp32
    ones the op quantises) in out_dtype; each rank's x_scale scales its own block of the gathered x.
    return_gathered returns the gathered FP8 x. Block scaling: x_scale [..., ceil(K_shard/128)] (one
    per 1x128 tile of this rank's shard, x's leading dims; gathered with it), w_scale
    [ceil(K/128), ceil(N_local/128)], a group one per weight (a tuple). Backward as for gemm_rs.
    """
    if getattr(x, "ndim", None) == 1:
        return _ag_gemm_rank1(x, w, axis_name=axis_name, gather_dimension=gather_dimension, config=config,
                              return_gathered=return_gathered, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                              grad_dtype=grad_dtype, grad_scale=grad_scale)
    if fp8.requested(x, w, x_scale, w_scale, out_dtype, grad_dtype, grad_scale):
        return _ag_gemm_fp8(x, w, axis_name=axis_name, gather_dimension=gather_dimension, config=config,
                            return_gathered=return_gathered, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                            grad_dtype=grad_dtype, grad_scale=grad_scale)
    if isinstance(w, (tuple, list)):
        # The group goes to the op as a tuple: its forward reads each weight where it lies, and the
        # pairing's backward is one gemm_rs on the joined cotangents (entwine_jax.pairing).
        w = tuple(w)
        ag_op.check_group(x, w)
    return pairing.call("ag_gemm", x, w, axis_name=axis_name, dimension=gather_dimension, config=config,
                        return_gathered=return_gathered)


def _ag_gemm_rank1(x, w, *, axis_name, gather_dimension, x_scale, w_scale, **kwargs):
    """ag_gemm of a rank-1 x [K/W], whose one dim is the gathered contraction dim, as one row [1, K/W]:
    the backward's reduce-scatter of dx (a gemm_rs) scatters a dim of rank >= 2 operands, and the
    kernels see one row either way. Every output drops the row again."""
    callsite.dimension("ag_gemm", "gather_dimension", gather_dimension, tuple(x.shape), "x")
    if fp8.block_scaled(w_scale) and getattr(x_scale, "ndim", 0) == 1:
        x_scale = x_scale[None]  # block scales: the tiles of x's one row
    # Indexing keeps x's own dtype (a NumPy float64 x is refused as it would be at rank 2).
    out = ag_gemm(x[None], w, axis_name=axis_name, gather_dimension=-1, x_scale=x_scale, w_scale=w_scale, **kwargs)
    return jax.tree.map(lambda v: jax.lax.squeeze(v, (0,)), out)


def _ag_gemm_fp8(x, w, *, axis_name, gather_dimension, config, return_gathered, x_scale, w_scale, out_dtype,
                 grad_dtype, grad_scale):
    """ag_gemm's FP8 call, w one weight or a group (entwine_jax.fp8). With return_gathered also
    returns the gathered FP8 x (e4m3, each source's block in its own scale)."""
    grouped = isinstance(w, (tuple, list))
    weights = tuple(w) if grouped else (w,)
    xs, ws, gs, call = fp8.check("ag_gemm", x, weights, x_scale, w_scale, out_dtype, grad_dtype, grad_scale, grouped)
    if grouped:
        ag_op.check_group(x, weights, fp8=True)
    w_scales = ws if grouped and call.block else (ws,) * len(weights)
    fp8.check_scales("ag_gemm", (("x", x, xs),) + tuple((f"w[{i}]" if grouped else "w", w_i, s)
                                                         for i, (w_i, s) in enumerate(zip(weights, w_scales))))
    axis_name = callsite.hashable_axis(axis_name)
    if not (grouped and call.block):
        # One weight, or a group as for bf16/fp16: each weight read where it lies (one w_scale).
        return pairing.call_fp8("ag_gemm", x, weights if grouped else w, xs, ws, gs, call, axis_name=axis_name,
                                dimension=gather_dimension, config=config, return_gathered=return_gathered,
                                shared_scale=not call.block and fp8.shared_over(xs, x, axis_name))
    # A block-scaled group: the block-scaled kernels read one weight, and block scales concatenate
    # over the columns only in whole blocks: each weight but the last is padded with zero columns to
    # a multiple of 128 (its last block's scale covers them), the weights and their scales are
    # joined, and each output's padding is cut off after the split.
    kept = [int(w_i.shape[1]) for w_i in weights]
    widths = [fp8.blocks(n) * fp8.BLOCK for n in kept[:-1]] + kept[-1:]
    w_all = jnp.concatenate([jnp.pad(w_i, ((0, 0), (0, p - n))) for w_i, n, p in zip(weights, kept, widths)], axis=1)
    out = pairing.call_fp8("ag_gemm", x, w_all, xs, jnp.concatenate(ws, axis=1), gs, call, axis_name=axis_name,
                           dimension=gather_dimension, config=config, return_gathered=return_gathered,
                           shared_scale=False)
    ys, g = out if return_gathered else (out, None)
    starts = [sum(widths[:i]) for i in range(len(widths))]
    ys = tuple(ys[..., start:start + n] for start, n in zip(starts, kept))
    return (ys, g) if return_gathered else ys


def moe_dispatch_gemm(x, topk_idx, w1, *, axis_name, capacity=None, num_experts: Optional[int] = None,
                      config: Optional[MoeConfig] = None, x_scale=None, w_scale=None, out_dtype=None, grad_dtype=None,
                      grad_scale=None):
    """Each token's rows sent to its top-k experts' ranks, times the expert's w1; called inside
    jax.shard_map over the expert axis (size W; E = W * E_local experts, expert e on rank e // E_local).

    x [T, H]; topk_idx [T, k] int32: global expert ids, -1 (or any id outside [0, E)): no expert;
    w1 [E_local, H, N] (e.g. gate and up concatenated over N). Returns (y [E_local, W*C, N], handle):
    y[l, q*C + i] is source rank q's i-th slot routed to local expert l (in its token, slot order),
    times w1[l]; rows no slot took are zero; fp32 accumulation, y in x.dtype (DeepEP low-latency's
    receive layout). handle (a MoeHandle of int32 arrays) is what moe_gemm_combine and the backward
    need; its `dropped` counts this rank's slots lost to the capacity, and where a kernel runs its
    `received` [E_local, W] holds the rows each source sent each local expert (the kernels skip the
    GEMM blocks past them), else None.
    capacity: C, the static rows per (source, expert), is round_up(T, 128) (None: dropless; a token
    naming one expert twice takes two rows, so even then rows past C can drop) or, with a factor f
    (a finite number > 0), max(128, round_up(ceil(f*T*k/E), 128)), at most round_up(T*k, 128), the
    slots a source has (entwine_jax.moe.config.MoeConfig). A slot past C is dropped: never sent,
    zero in the output, zero gradient.
    num_experts: E, checked against W * w1.shape[0] when given.
    Differentiable in x and w1; the backward is a moe_gemm_combine (docs/design.md, "The pairing").
    FP8 (entwine_jax.fp8, per-tensor scales only): with x_scale and w_scale (float32 scalars; w_scale
    one for this rank's experts) computes (x * x_scale) rows times (w1 * w_scale) on float8_e4m3fn
    operands (or higher-precision ones the op quantises) in out_dtype: the e4m3 rows travel, each
    rank's x_scale beside them; the backward quantises dy to grad_dtype (float8_e5m2 by default, with
    grad_scale or each rank's current scale). Where the kernels run, the FP8 dispatch kernel does (w1
    read K-major: a transposed copy per call).
    """
    if capacity is not None:
        # The config's type checked first: dataclasses.replace of anything else is a TypeError.
        config = dataclasses.replace(moe_op._config("moe_dispatch_gemm", config)[0], capacity=capacity)
    if num_experts is not None:
        size = callsite.axis_size("moe_dispatch_gemm", callsite.hashable_axis(axis_name))
        e_local = w1.shape[0] if hasattr(w1, "shape") and w1.ndim == 3 else None
        if (isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1
                or num_experts % size):
            raise ValueError(f"moe_dispatch_gemm: num_experts must be an int divisible by the size of axis "
                             f"{axis_name!r} ({size}) and > 0, got {num_experts!r}")
        if e_local is not None and num_experts != size * e_local:
            raise ValueError(f"moe_dispatch_gemm: w1.shape[0] must be num_experts / W = {num_experts // size} "
                             f"(the local experts), got w1 shape {tuple(w1.shape)}")
    if fp8.requested(x, w1, x_scale, w_scale, out_dtype, grad_dtype, grad_scale):
        return moe_fp8.dispatch(x, topk_idx, w1, axis_name=axis_name, config=config, x_scale=x_scale,
                                w_scale=w_scale, out_dtype=out_dtype, grad_dtype=grad_dtype, grad_scale=grad_scale)
    return moe_op.dispatch(x, topk_idx, w1, axis_name=axis_name, config=config)


def moe_gemm_combine(h, w2, topk_weights, handle, *, axis_name, config: Optional[MoeConfig] = None, x_scale=None,
                     w_scale=None, out_dtype=None, grad_dtype=None, grad_scale=None):
    """The experts' rows times their expert's w2, sent back to their tokens and summed with the router
    weights; called inside jax.shard_map with the handle of the moe_dispatch_gemm whose layout h has.

    h [E_local, W*C, F] in y's layout (e.g. the activation of moe_dispatch_gemm's y), w2 [E_local, F, H],
    topk_weights [T, k] (float). Returns out [T, H] in h.dtype: out[t] = sum_j topk_weights[t, j] *
    (h[row(t, j)] @ w2[expert(t, j)]) over the slots that were sent (-1 and dropped slots contribute
    zero); the rows travel in h.dtype and are summed in fp32, in j order. Differentiable in h, w2 and
    topk_weights; the backward is a moe_dispatch_gemm of the cotangent in the handle's layout
    (docs/design.md, "The pairing").
    FP8 (per-tensor scales): x_scale scales h and w_scale w2, as for moe_dispatch_gemm; the rows travel
    in out_dtype; the backward dispatches the cotangent in grad_dtype (e5m2 by default).
    """
    if fp8.requested(h, w2, x_scale, w_scale, out_dtype, grad_dtype, grad_scale):
        return moe_fp8.combine(h, w2, topk_weights, handle, axis_name=axis_name, config=config, x_scale=x_scale,
                               w_scale=w_scale, out_dtype=out_dtype, grad_dtype=grad_dtype, grad_scale=grad_scale)
    return moe_op.combine(h, w2, topk_weights, handle, axis_name=axis_name, config=config)
