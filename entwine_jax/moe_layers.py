# The expert-parallel MoE MLP for Flax (NNX and Linen), used inside jax.shard_map over the expert
# axis: a router (linear, scores, top-k with MaxText's options, weights), MaxText's capacity-factor
# drop, then moe_dispatch_gemm on gate|up, SwiGLU, and moe_gemm_combine, and the load-balance loss
# (docs/design.md, "Mixture of experts", "Flax and MaxText"). Written like entwine_jax.layers (its
# checks, logical-axis metadata and partition_specs); needs flax.
"""Expert-parallel SwiGLU MoE MLP over entwine_jax.moe_dispatch_gemm and moe_gemm_combine.

The layer runs inside ``jax.shard_map`` over the expert axis ``ep`` of size W and sees local shards:

===========  ==============================  =================================================
parameter    global -> local                 logical axes
===========  ==============================  =================================================
router       ``[H, E] -> [H, E]``            ``("embed", None)`` (replicated)
wi_0, wi_1   ``[E, H, F] -> [E/W, H, F]``    ``("exp", "embed", None)`` (gate, up)
wo           ``[E, F, H] -> [E/W, F, H]``    ``("exp", None, "embed")``
router_bias  ``[E] -> [E]``                  none (replicated; only with ``use_routed_bias``)
===========  ==============================  =================================================

x: ``[..., H]``, this rank's tokens (x split over ``ep`` along dim 0), output of the same shape. Per
token: ``logits = x @ router`` (fp32), then MaxText 0.2.5's routing (``RoutedMoE.get_topk``):

* ``score_func="softmax"`` (default), no bias, no groups: the top ``k`` experts by logit, weights
  the ``softmax`` of the k chosen logits (equal to the full softmax's top k renormalised to sum 1);
  ``norm_topk_prob=False`` keeps the full softmax's probabilities of the k chosen experts instead.
* otherwise (DeepSeek's ``deepseek_routing``): scores ``s = softmax(logits)`` or
  ``sigmoid(logits)``; the experts are chosen on ``s + routed_bias`` (DeepSeek-V3's aux-loss-free
  balancing: the bias moves the choice only, and the choice has no gradient), among the
  ``topk_routing_group`` best of ``n_routing_groups`` equal groups of experts when those are set (a
  group's score: the sum of its two best biased scores); the weights are the unbiased ``s`` of the
  chosen experts, divided by their sum (plus 1e-20) when ``norm_topk_prob`` (MaxText's
  ``deepseek_scale_weights`` for sigmoid).
* the weights times ``routed_scaling_factor``.

Then ``out = sum_j w_j * (silu(x @ wi_0[e_j]) * (x @ wi_1[e_j])) @ wo[e_j]`` with one
moe_dispatch_gemm on ``wi_0|wi_1`` concatenated over F (one transfer of x for both), the activation
in fp32, one moe_gemm_combine. The router's gradient reaches it through the weights (the op's
router-weight gradient) and the load-balance loss; the expert choice itself has none, as in MaxText.

Sequences: the token statistics below are MaxText's, per sequence. An x of rank >= 3 is
``[batch..., S, H]``: every leading index is one sequence of S tokens, whole on its rank (split the
batch over ``ep``, not the sequence). An x of rank 2 ``[T, H]`` is one sequence, the global ``W*T``
tokens in rank order, split over the ranks (the statistics are then summed over ``ep``).

* ``capacity_factor=f`` (MaxText's ``generate_masks``): each expert takes at most
  ``C = int(max(ceil(S*k/E) * f, f))`` (at least 1) slots per sequence, in token order; the later
  slots are dropped (their ``topk_idx`` set to -1 before the ops, so they add nothing and their
  weights get no gradient; the kept weights are not renormalised). The op's own
  ``MoeConfig(capacity=...)`` is a separate, per-rank buffer limit applied after this (its drops
  add nothing either).
* the load-balance loss (MaxText's ``load_balance_loss``, Switch Transformer's): per sequence
  ``E * sum_e (f_e / k) * P_e`` with ``f_e`` the fraction of its tokens that chose expert e (before
  the capacity drop) and ``P_e`` the mean over its tokens of ``softmax(pre-bias scores)`` (the
  logits for softmax; MaxText's ``softmax(sigmoid(logits))`` for sigmoid), averaged over the global
  batch's sequences: the same value on every rank, the single-device value, 1 when perfectly
  balanced, differentiable with respect to the router (through ``P``).

``moe_mlp(..., return_aux=True)`` returns ``(out, aux)`` with ``aux["load_balance_loss"]`` (the loss
above, unweighted), ``aux["expert_counts"]`` (``[E]`` int32, the global batch's slots per expert
before the capacity drop, for ``routed_bias_update``) and ``aux["dropped"]`` (the global number of
slots the capacity factor dropped). The layers sow them (NNX: ``nnx.Intermediate``, read with
``nnx.capture(model, nnx.Intermediate)``; Linen: the ``"intermediates"`` collection) as
``"moe_lb_loss"`` (times ``load_balance_loss_weight``, only when that is > 0, MaxText's name and
rule: add it to the training loss), ``"moe_expert_counts"`` (with ``use_routed_bias``) and
``"moe_dropped"`` (with ``capacity_factor``). The routed bias is state, not a trained parameter
(MaxText's ``MoEBiasVar``): NNX ``RouterBias`` (not an ``nnx.Param``, so an optimizer over
``nnx.Param`` and its weight decay leave it alone), Linen collection ``"moe_bias"``; after each step
add ``routed_bias_update(counts, rate)`` to it.

``DEFAULT_LOGICAL_AXIS_RULES`` map ``"exp"`` to ``"ep"``; ``partition_specs(params, rules)`` gives
the shard_map's in_specs, as for the tensor-parallel layers. The experts' hidden dims are not
sharded (no expert tensor parallelism).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax.api import moe_dispatch_gemm, moe_gemm_combine
# flax through entwine_jax.layers, whose import says how to install it when it is missing.
from entwine_jax.layers import (axis_size_if_bound, bound_axis_size, check_array, check_axis_name, check_choice,
                                check_config, check_dtype, check_param_dtype, compute_dtype, linen_param, nn, nnx,
                                positive_int)
from entwine_jax.layers_fp8 import fp8_call_arguments
from entwine_jax.moe.config import MoeConfig

__all__ = ["moe_mlp", "route", "routed_bias_update", "MoeMlp", "MoeMlpDense", "RouterBias", "ROUTER_AXES",
           "WI_AXES", "WO_AXES"]

ROUTER_AXES = ("embed", None)
WI_AXES = ("exp", "embed", None)
WO_AXES = ("exp", None, "embed")
SCORE_FUNCS = ("softmax", "sigmoid")
# The Linen collection of the routed bias (not "params": it is not trained by gradient).
ROUTER_BIAS_COLLECTION = "moe_bias"
# The layers' FP8 modes: the MoE ops take per-tensor scales only.
MOE_FP8_MODES = (None, "current")
# fan-in is the expert's input dim alone: dim 0 counts experts, not inputs.
default_expert_init = nnx.initializers.lecun_normal(batch_axis=(0,))
default_router_init = nnx.initializers.lecun_normal()
Initializer = Any


class RouterBias(nnx.Variable):
    """MoeMlp's routed bias ``[E]`` (``use_routed_bias=True``): added to the scores for the choice of
    experts only, so it has no gradient. Not an ``nnx.Param`` (MaxText's ``MoEBiasVar``), so an
    optimizer over ``nnx.Param`` and its weight decay leave it alone; update it with
    ``routed_bias_update`` of the sown ``"moe_expert_counts"``."""


def routed_bias_update(expert_counts, rate):
    """DeepSeek-V3's aux-loss-free bias step, ``rate * sign(mean load - load)`` (MaxText's
    ``load_balance_updates_from_counts``), from the global expert counts ``[..., E]``
    (``aux["expert_counts"]``, the sown ``"moe_expert_counts"``): add it to the router bias."""
    counts = jnp.asarray(expert_counts, jnp.float32)
    return rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)


# ---------------------------------------------------------------- routing

def _group_mask(choice, n_groups: int, topk_group: int):
    """[T, E] bool: the experts of each token's topk_group best groups, a group scored by the sum of
    its two best entries of choice (MaxText's expert_group_mask)."""
    t, e = choice.shape
    best_two = jax.lax.top_k(choice.reshape(t, n_groups, e // n_groups), 2)[0]
    _, groups = jax.lax.top_k(jnp.sum(best_two, axis=-1), topk_group)
    chosen = jnp.sum(jax.nn.one_hot(groups, n_groups, dtype=jnp.int32), axis=1) > 0
    return jnp.repeat(chosen, e // n_groups, axis=1)


def _route(x, router, k, norm_topk_prob=True, score_func="softmax", routed_bias=None, n_routing_groups=-1,
           topk_routing_group=-1, routed_scaling_factor=1.0):
    """(topk_idx, weights, the load-balance loss's pre-softmax scores [T, E] fp32); see route."""
    logits = jax.lax.dot_general(x, router, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    if score_func == "softmax" and routed_bias is None and n_routing_groups == -1:
        # The top k by logit are the top k by probability: no softmax over all E needed to choose.
        top_logits, topk_idx = jax.lax.top_k(logits, k)
        if norm_topk_prob:
            weights = jax.nn.softmax(top_logits, axis=-1)
        else:
            # softmax over all E experts, gathered at the chosen ones (exp(top - logsumexp) is that, cheaper).
            weights = jnp.exp(top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
        lb_scores = logits
    else:
        scores = jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
        # Chosen on the biased scores, weighted by the unbiased ones (DeepSeek-V3): the bias moves the
        # choice only. stop_gradient says so (top_k's indices carry no gradient anyway).
        choice = jax.lax.stop_gradient(scores if routed_bias is None else scores + routed_bias.astype(jnp.float32))
        if n_routing_groups != -1:
            choice = jnp.where(_group_mask(choice, n_routing_groups, topk_routing_group), choice, -jnp.inf)
        _, topk_idx = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, topk_idx, axis=-1)
        if norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        # MaxText's loss takes the softmax of the pre-bias gate output: the logits for softmax routers
        # (their probabilities), the sigmoid scores for sigmoid ones.
        lb_scores = logits if score_func == "softmax" else scores
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return topk_idx.astype(jnp.int32), weights, lb_scores


def route(x, router, k: int, norm_topk_prob: bool = True, *, score_func: str = "softmax", routed_bias=None,
          n_routing_groups: int = -1, topk_routing_group: int = -1, routed_scaling_factor: float = 1.0):
    """(topk_idx [T, k] int32, weights [T, k] fp32) of tokens x [T, H] under router [H, E], by the
    rules of the module docstring (routed_bias: None or [E]). No capacity drop: that needs sequences."""
    # moe_mlp's checks: a misspelt score_func, or an x [B, S, H] with S = H (S contracted with the
    # router's H), would otherwise route silently wrong.
    where = "route"
    for name, v in (("x", x), ("router", router)):
        check_array(where, name, v)
    if router.ndim != 2:
        raise ValueError(f"{where}: router must have rank 2 ([H, E]), got shape {tuple(router.shape)}")
    h, e = router.shape
    if x.ndim != 2 or x.shape[1] != h:
        raise ValueError(f"{where}: x must have shape [T, H = {h}] (H: router.shape[0]), got {tuple(x.shape)}")
    k = positive_int(where, "k", k)
    if k > e:
        raise ValueError(f"{where}: k must be <= the number of experts (router.shape[1] = {e}), got {k}")
    check_choice(where, "norm_topk_prob", norm_topk_prob, (True, False))
    routing = _check_routing(where, e, k, score_func, n_routing_groups, topk_routing_group, routed_scaling_factor,
                             None)
    _check_routed_bias(where, routed_bias, e)
    routing.pop("capacity_factor")
    return _route(x, router, k, norm_topk_prob, routed_bias=routed_bias, **routing)[:2]


def _sequences(seq_shape: tuple, world: int) -> tuple[int, bool]:
    """(S, the tokens per sequence; whether one sequence spans the ranks) of x.shape[:-1] (see the
    module docstring's "Sequences")."""
    if len(seq_shape) == 1:
        return seq_shape[0] * world, True
    return seq_shape[-1], False


def _capacity_drop(topk_idx, capacity_factor: float, num_experts: int, seq_len: int, spans: bool, axis_name):
    """topk_idx with each expert's slots past its capacity in their sequence set to -1 (MaxText's
    generate_masks: the slots counted in token order, a token's k slots in order)."""
    n, k = topk_idx.shape
    # MaxText's C; at least 1 (its max(.., f) meant to avoid C = 0, which int() still gives for f < 1),
    # at most the S*k slots of a sequence (no drop either way; a huge factor's C would overflow the
    # int32 comparison below).
    capacity = max(1, int(min(max(math.ceil(seq_len * k / num_experts) * capacity_factor, capacity_factor),
                              seq_len * k)))
    onehot = jax.nn.one_hot(topk_idx.reshape(-1, (n if spans else seq_len) * k), num_experts, dtype=jnp.int32)
    position = jnp.cumsum(onehot, axis=1)  # [sequences, S*k, E]: each slot's 1-based place at its expert
    if spans and axis_name is not None:
        # The sequence continues from the lower ranks: start after their slots at each expert.
        before = jax.lax.all_gather(jnp.sum(onehot, axis=(0, 1)), axis_name)  # [W, E]
        lower = jnp.arange(before.shape[0]) < jax.lax.axis_index(axis_name)
        position = position + jnp.sum(jnp.where(lower[:, None], before, 0), axis=0)
    kept = jnp.sum(onehot * (position <= capacity), axis=-1).reshape(n, k) > 0
    return jnp.where(kept, topk_idx, -1)


def _load_balance_loss(topk_idx, lb_scores, seq_len: int, spans: bool, psum, world: int):
    """MaxText's load_balance_loss (unweighted) over the global batch; see the module docstring."""
    n, k = topk_idx.shape
    e = lb_scores.shape[-1]
    chose = jnp.sum(jax.nn.one_hot(topk_idx, e, dtype=jnp.float32), axis=1)  # [T, E]: 1 where a slot chose e
    probs = jax.nn.softmax(lb_scores, axis=-1)
    if spans:  # one sequence over all ranks: sum its statistics over them first
        tokens = n * world
        density = psum(jnp.sum(chose, axis=0)) / (tokens * k)
        return e * jnp.sum(density * psum(jnp.sum(probs, axis=0)) / tokens)
    density = jnp.mean(chose.reshape(-1, seq_len, e), axis=1) / k
    per_sequence = e * jnp.sum(density * jnp.mean(probs.reshape(-1, seq_len, e), axis=1), axis=-1)
    # Every rank holds the same number of sequences (shard_map's equal shards): the global mean.
    return psum(jnp.sum(per_sequence)) / (per_sequence.shape[0] * world)


def _routing(tokens, router, seq_shape: tuple, k: int, routing: dict, axis_name, return_aux: bool):
    """(topk_idx with the capacity factor's drops as -1, weights, aux or None) of this rank's tokens
    [T, H]; seq_shape: x.shape[:-1]; axis_name None: every token is here (W = 1)."""
    routing = dict(routing)
    capacity_factor = routing.pop("capacity_factor")
    topk_idx, weights, lb_scores = _route(tokens, router, k, **routing)
    world = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    psum = (lambda v: v) if axis_name is None else (lambda v: jax.lax.psum(v, axis_name))
    seq_len, spans = _sequences(seq_shape, world)
    aux = None
    if return_aux:
        aux = {"load_balance_loss": _load_balance_loss(topk_idx, lb_scores, seq_len, spans, psum, world),
               "expert_counts": psum(jnp.sum(jax.nn.one_hot(topk_idx, router.shape[1], dtype=jnp.int32), axis=(0, 1))),
               "dropped": jnp.zeros((), jnp.int32)}
    if capacity_factor is not None:
        routed = topk_idx
        topk_idx = _capacity_drop(topk_idx, capacity_factor, router.shape[1], seq_len, spans, axis_name)
        if aux is not None:
            aux["dropped"] = psum(jnp.sum(routed >= 0) - jnp.sum(topk_idx >= 0)).astype(jnp.int32)
    return topk_idx, weights, aux


# ---------------------------------------------------------------- checks

def _number(where: str, name: str, value, *, positive: bool, allow_none: bool = False) -> Optional[float]:
    if value is None and allow_none:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        kind = "a positive number" if positive else "a number >= 0"
        raise ValueError(f"{where}: {name} must be {kind}{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


def _check_routed_bias(where: str, routed_bias, e: int) -> None:
    if routed_bias is not None:
        check_array(where, "routed_bias", routed_bias)
        if tuple(routed_bias.shape) != (e,):
            raise ValueError(f"{where}: routed_bias must have shape [E] = ({e},) (whole, not split), got "
                             f"{tuple(routed_bias.shape)}")


def _check_routing(where: str, e: int, k: int, score_func, n_routing_groups, topk_routing_group,
                   routed_scaling_factor, capacity_factor) -> dict:
    """The routing options' checks (every entry point's); their normalised values, for _routing."""
    check_choice(where, "score_func", score_func, SCORE_FUNCS)
    if (n_routing_groups == -1) != (topk_routing_group == -1):
        raise ValueError(f"{where}: n_routing_groups and topk_routing_group must both be -1 (no group limit) or both "
                         f"be set, got {n_routing_groups!r} and {topk_routing_group!r}")
    if n_routing_groups != -1:
        g = n_routing_groups
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1 or e % g or e // g < 2:
            raise ValueError(f"{where}: n_routing_groups must be -1 or a positive int dividing num_experts ({e}) into "
                             f"groups of at least 2 experts, got {g!r}")
        t = topk_routing_group
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 1 <= t <= g:
            raise ValueError(f"{where}: topk_routing_group must be -1 or an int in [1, n_routing_groups = {g}], got "
                             f"{t!r}")
        if t * (e // g) < k:
            raise ValueError(f"{where}: topk_routing_group ({t}) groups of {e // g} experts must hold at least "
                             f"num_experts_per_tok ({k}) experts, got {t * (e // g)}")
        n_routing_groups, topk_routing_group = int(g), int(t)
    return dict(score_func=score_func, n_routing_groups=n_routing_groups, topk_routing_group=topk_routing_group,
                routed_scaling_factor=_number(where, "routed_scaling_factor", routed_scaling_factor, positive=True),
                capacity_factor=_number(where, "capacity_factor", capacity_factor, positive=True, allow_none=True))


def _check_moe_args(where: str, axis_name, num_experts, num_experts_per_tok, norm_topk_prob, dtype, param_dtype,
                    config) -> tuple[Any, int, int]:
    """The checks the NNX constructor and the Linen call share; (axis_name, E, k)."""
    axis_name = check_axis_name(where, axis_name)
    e = positive_int(where, "num_experts", num_experts)
    k = positive_int(where, "num_experts_per_tok", num_experts_per_tok)
    if k > e:
        raise ValueError(f"{where}: num_experts_per_tok must be <= num_experts ({e}), got {k}")
    check_choice(where, "norm_topk_prob", norm_topk_prob, (True, False))
    check_dtype(where, "dtype", dtype)
    check_param_dtype(where, param_dtype)
    check_config(where, config, MoeConfig)
    return axis_name, e, k


def _check_layer_routing(where: str, module, e: int, k: int) -> dict:
    """The NNX and Linen layers' routing fields: _check_routing's, use_routed_bias, load_balance_loss_weight."""
    check_choice(where, "use_routed_bias", module.use_routed_bias, (True, False))
    _number(where, "load_balance_loss_weight", module.load_balance_loss_weight, positive=False)
    return _check_routing(where, e, k, module.score_func, module.n_routing_groups, module.topk_routing_group,
                          module.routed_scaling_factor, module.capacity_factor)


def _sown(module, aux) -> dict:
    """What a layer sows of aux: {name: value} (see the module docstring)."""
    out = {}
    if module.load_balance_loss_weight > 0:
        out["moe_lb_loss"] = aux["load_balance_loss"] * module.load_balance_loss_weight
    if module.use_routed_bias:
        out["moe_expert_counts"] = aux["expert_counts"]
    if module.capacity_factor is not None:
        out["moe_dropped"] = aux["dropped"]
    return out


def _wants_aux(module) -> bool:
    return module.load_balance_loss_weight > 0 or module.use_routed_bias or module.capacity_factor is not None


# ---------------------------------------------------------------- the MLP

def _swiglu(y, f: int, dtype):
    """silu(gate) * up over the last dim of y [..., 2F] (the dispatch's [E_local, W*C, 2F])."""
    y = y.astype(jnp.float32)
    return (jax.nn.silu(y[..., :f]) * y[..., f:]).astype(dtype)


def moe_mlp(x, router, wi_0, wi_1, wo, *, num_experts_per_tok: int, axis_name="ep", norm_topk_prob: bool = True,
            dtype=None, config: Optional[MoeConfig] = None, fp8: Optional[str] = None, score_func: str = "softmax",
            routed_bias=None, n_routing_groups: int = -1, topk_routing_group: int = -1,
            routed_scaling_factor: float = 1.0, capacity_factor: Optional[float] = None, return_aux: bool = False,
            where: str = "moe_mlp"):
    """The MoE MLP on local shards inside jax.shard_map over ``axis_name`` (see the module docstring).

    x ``[..., H]`` (split over ``axis_name`` along dim 0); router ``[H, E]`` (whole); wi_0, wi_1
    ``[E/W, H, F]``; wo ``[E/W, F, H]``. dtype: compute and output dtype (default: promoted from x and
    the parameters); the router's logits, scores and weights are fp32. config: the ops' MoeConfig (its
    capacity), None for the default. fp8: None, or "current": both expert GEMMs in FP8 with each
    rank's current per-tensor scales of its tokens, its activations and its experts' weights, e5m2
    gradients (the ops take per-tensor scales only: no "block" or delayed scaling yet); the router
    stays in dtype. Routing (MaxText's names and rules): score_func "softmax" or "sigmoid";
    routed_bias None or ``[E]`` (whole), added to the scores for the choice only; n_routing_groups and
    topk_routing_group, -1 or both set (group-limited routing); routed_scaling_factor; capacity_factor
    None (no drop) or > 0 (MaxText's token-order drop per sequence). return_aux: also return aux,
    ``(out, {"load_balance_loss", "expert_counts", "dropped"})``, the same on every rank.
    """
    check_choice(where, "fp8", fp8, MOE_FP8_MODES)
    check_choice(where, "return_aux", return_aux, (True, False))
    for name, v in (("x", x), ("router", router), ("wi_0", wi_0), ("wi_1", wi_1), ("wo", wo)):
        check_array(where, name, v)
    if x.ndim < 2:
        raise ValueError(f"{where}: x must have rank >= 2 ([..., tokens, H]), got shape {tuple(x.shape)}")
    if 0 in x.shape:
        # The ops refuse empty operands too; said here, before the routing's options divide by them.
        raise ValueError(f"{where}: every dim of x must be > 0 (tokens and H), got shape {tuple(x.shape)}")
    h = x.shape[-1]
    if router.ndim != 2 or router.shape[0] != h:
        raise ValueError(f"{where}: router must have shape [H = {h}, E], got {tuple(router.shape)}")
    e = router.shape[1]
    axis_name, _, k = _check_moe_args(where, axis_name, e, num_experts_per_tok, norm_topk_prob, dtype, jnp.float32,
                                      config)
    routing = _check_routing(where, e, k, score_func, n_routing_groups, topk_routing_group, routed_scaling_factor,
                             capacity_factor)
    _check_routed_bias(where, routed_bias, e)
    world = bound_axis_size(where, axis_name)
    if e % world:
        raise ValueError(f"{where}: num_experts ({e}) must be divisible by the size of {axis_name!r} ({world})")
    e_local = e // world
    if wi_0.ndim != 3 or wi_0.shape[:2] != (e_local, h) or wi_1.shape != wi_0.shape:
        raise ValueError(f"{where}: wi_0 and wi_1 must have local shape [E/W = {e_local}, H = {h}, F] (global "
                         f"[{e}, {h}, F] with dim 0 split over {axis_name!r}), got {tuple(wi_0.shape)} and "
                         f"{tuple(wi_1.shape)}")
    f = wi_0.shape[2]
    if tuple(wo.shape) != (e_local, f, h):
        raise ValueError(f"{where}: wo must have local shape [E/W, F, H] = {(e_local, f, h)}, got {tuple(wo.shape)}")
    dtype = compute_dtype(where, dtype, x, router, wi_0, wi_1, wo)
    tokens = x.reshape(-1, h).astype(dtype)
    topk_idx, weights, aux = _routing(tokens, router.astype(dtype), x.shape[:-1], k,
                                      dict(routing, norm_topk_prob=norm_topk_prob, routed_bias=routed_bias),
                                      axis_name, return_aux)
    # gate|up as one dispatch weight: one transfer of the tokens, one grouped GEMM for both.
    w1 = jnp.concatenate([wi_0, wi_1], axis=2).astype(dtype)
    wo = wo.astype(dtype)
    dispatch_fp8, finish = fp8_call_arguments(where, fp8, tokens, w1, axis_name, dtype)
    y, handle = moe_dispatch_gemm(tokens, topk_idx, w1, axis_name=axis_name, config=config, **dispatch_fp8)
    h = _swiglu(y, f, dtype)
    combine_fp8, _ = fp8_call_arguments(where, fp8, h, wo, axis_name, dtype)
    out = moe_gemm_combine(h, wo, weights, handle, axis_name=axis_name, config=config, **combine_fp8)
    out = finish(out).reshape(x.shape)
    return (out, aux) if return_aux else out


def _dense_moe_mlp(x, router, wi_0, wi_1, wo, *, num_experts_per_tok, norm_topk_prob, dtype, where, routing=None,
                   routed_bias=None, return_aux=False):
    """The same MLP with every expert local (W = 1, only the capacity factor drops): Linen's init
    outside shard_map. routing: _check_routing's dict (None: the defaults)."""
    dtype = compute_dtype(where, dtype, x, router, wi_0, wi_1, wo)
    tokens = x.reshape(-1, x.shape[-1]).astype(dtype)
    routing = routing or _check_routing(where, router.shape[1], num_experts_per_tok, "softmax", -1, -1, 1.0, None)
    topk_idx, weights, aux = _routing(tokens, router.astype(dtype), x.shape[:-1], num_experts_per_tok,
                                      dict(routing, norm_topk_prob=norm_topk_prob, routed_bias=routed_bias), None,
                                      return_aux)
    # Each token's weight on every expert (zero off its top k and on dropped slots, -1, which would
    # otherwise index the last expert): one einsum per GEMM over all experts.
    dense = jnp.zeros((tokens.shape[0], router.shape[1]), jnp.float32)
    dense = dense.at[jnp.arange(tokens.shape[0])[:, None], jnp.maximum(topk_idx, 0)].add(
        jnp.where(topk_idx >= 0, weights, 0.0))
    g = jnp.einsum("th,ehf->etf", tokens, wi_0.astype(dtype), preferred_element_type=jnp.float32)
    u = jnp.einsum("th,ehf->etf", tokens, wi_1.astype(dtype), preferred_element_type=jnp.float32)
    o = jnp.einsum("etf,efh->eth", (jax.nn.silu(g) * u).astype(dtype), wo.astype(dtype),
                   preferred_element_type=jnp.float32)
    out = jnp.einsum("te,eth->th", dense, o).astype(dtype).reshape(x.shape)
    return (out, aux) if return_aux else out


class MoeMlp(nnx.Module):
    """Expert-parallel SwiGLU MoE MLP, Flax NNX (see the module docstring).

    Created at global shape: router ``[in_features, num_experts]``, wi_0 / wi_1
    ``[num_experts, in_features, mlp_features]``, wo ``[num_experts, mlp_features, in_features]``,
    with the logical axes ROUTER_AXES, WI_AXES, WO_AXES, and with ``use_routed_bias`` a
    ``RouterBias`` ``router_bias`` ``[num_experts]`` of zeros (replicated). Called inside shard_map
    over ``axis_name`` with the experts split over it (``partition_specs(state, rules)``) on this
    rank's tokens ``[..., in_features]`` (split along dim 0). kernel_init draws an ``[E, in, out]``
    kernel (default: LeCun normal per expert); config: an entwine_jax.MoeConfig for both ops (its
    capacity); fp8: None or "current" (moe_mlp's). Routing: score_func, n_routing_groups,
    topk_routing_group, routed_scaling_factor, capacity_factor as moe_mlp's. It sows
    ``nnx.Intermediate`` values (read them with ``nnx.capture(model, nnx.Intermediate)(x)``):
    ``"moe_lb_loss"``, the load-balance loss times ``load_balance_loss_weight`` when that is > 0
    (add it to the training loss), ``"moe_expert_counts"`` with ``use_routed_bias`` (then
    ``model.router_bias[...] += routed_bias_update(counts, rate)`` after each step) and
    ``"moe_dropped"`` with ``capacity_factor``; each the same on every rank.
    """

    def __init__(self, in_features: int, mlp_features: int, num_experts: int, num_experts_per_tok: int, *,
                 axis_name="ep", norm_topk_prob: bool = True, dtype=None, param_dtype=jnp.float32,
                 kernel_init: Initializer = default_expert_init, router_init: Initializer = default_router_init,
                 config: Optional[MoeConfig] = None, fp8: Optional[str] = None, score_func: str = "softmax",
                 use_routed_bias: bool = False, n_routing_groups: int = -1, topk_routing_group: int = -1,
                 routed_scaling_factor: float = 1.0, capacity_factor: Optional[float] = None,
                 load_balance_loss_weight: float = 0.0, rngs: nnx.Rngs):
        where = type(self).__name__
        check_choice(where, "fp8", fp8, MOE_FP8_MODES)
        self.in_features = positive_int(where, "in_features", in_features)
        self.mlp_features = positive_int(where, "mlp_features", mlp_features)
        self.axis_name, self.num_experts, self.num_experts_per_tok = _check_moe_args(
            where, axis_name, num_experts, num_experts_per_tok, norm_topk_prob, dtype, param_dtype, config)
        self.norm_topk_prob, self.dtype, self.param_dtype, self.config = norm_topk_prob, dtype, param_dtype, config
        self.fp8 = fp8
        self.score_func, self.use_routed_bias = score_func, use_routed_bias
        self.n_routing_groups, self.topk_routing_group = n_routing_groups, topk_routing_group
        self.routed_scaling_factor, self.capacity_factor = routed_scaling_factor, capacity_factor
        self.load_balance_loss_weight = load_balance_loss_weight
        _check_layer_routing(where, self, self.num_experts, self.num_experts_per_tok)
        h, f, e = self.in_features, self.mlp_features, self.num_experts
        self.router = nnx.Param(nnx.with_partitioning(router_init, ROUTER_AXES)(rngs.params(), (h, e), param_dtype))
        expert = nnx.with_partitioning(kernel_init, WI_AXES)
        self.wi_0 = nnx.Param(expert(rngs.params(), (e, h, f), param_dtype))
        self.wi_1 = nnx.Param(expert(rngs.params(), (e, h, f), param_dtype))
        self.wo = nnx.Param(nnx.with_partitioning(kernel_init, WO_AXES)(rngs.params(), (e, f, h), param_dtype))
        # zeros, as MaxText's gate bias starts.
        self.router_bias = RouterBias(jnp.zeros((e,), param_dtype)) if use_routed_bias else None

    def __call__(self, x):
        where = type(self).__name__
        world = bound_axis_size(where, self.axis_name)
        if self.num_experts % world:
            raise ValueError(f"{where}: num_experts ({self.num_experts}) must be divisible by the size of "
                             f"{self.axis_name!r} ({world})")
        e_local, h, f = self.num_experts // world, self.in_features, self.mlp_features
        for name, expected in (("wi_0", (e_local, h, f)), ("wi_1", (e_local, h, f)), ("wo", (e_local, f, h))):
            got = tuple(getattr(self, name)[...].shape)
            if got != expected:
                raise ValueError(f"{where}: {name} arrived with local shape {got}, expected {expected} (dim 0, the "
                                 f"{self.num_experts} experts, split over {self.axis_name!r} of size {world}); build "
                                 "the shard_map in_specs with partition_specs(params, rules)")
        # Plain attributes (checked in __init__) rather than a stored dict: a graphdef's static fields
        # are hashed.
        routing = _check_layer_routing(where, self, self.num_experts, self.num_experts_per_tok)
        wants_aux = _wants_aux(self)
        out = moe_mlp(x, self.router[...], self.wi_0[...], self.wi_1[...], self.wo[...],
                      num_experts_per_tok=self.num_experts_per_tok, axis_name=self.axis_name,
                      norm_topk_prob=self.norm_topk_prob, dtype=self.dtype, config=self.config, fp8=self.fp8,
                      routed_bias=None if self.router_bias is None else self.router_bias[...],
                      return_aux=wants_aux, where=where, **routing)
        if not wants_aux:
            return out
        out, aux = out
        for name, value in _sown(self, aux).items():
            self.sow(nnx.Intermediate, name, value)
        return out


class MoeMlpDense(nn.Module):
    """Expert-parallel SwiGLU MoE MLP, Flax Linen (the NNX MoeMlp's twin, the same parameter names and
    options).

    ``init`` it outside shard_map on the global input (global parameter shapes; the output then comes
    from the same MLP with every expert local, only the capacity factor dropping), ``apply`` it
    inside shard_map over ``axis_name`` with the parameters placed by ``partition_specs(params,
    rules)``. With ``use_routed_bias`` the bias ``router_bias`` ``[num_experts]`` (zeros) lives in
    the collection ``"moe_bias"`` (``ROUTER_BIAS_COLLECTION``), not ``"params"``: it is not trained by
    gradient; pass it to ``apply`` with the params and update it with ``routed_bias_update``. The
    NNX layer's sown values go to the ``"intermediates"`` collection (``mutable=["intermediates"]``).
    """
    mlp_features: int
    num_experts: int
    num_experts_per_tok: int
    axis_name: Any = "ep"
    norm_topk_prob: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = default_expert_init
    router_init: Initializer = default_router_init
    config: Optional[MoeConfig] = None
    fp8: Optional[str] = None
    score_func: str = "softmax"
    use_routed_bias: bool = False
    n_routing_groups: int = -1
    topk_routing_group: int = -1
    routed_scaling_factor: float = 1.0
    capacity_factor: Optional[float] = None
    load_balance_loss_weight: float = 0.0

    @nn.compact
    def __call__(self, x):
        where = type(self).__name__
        f = positive_int(where, "mlp_features", self.mlp_features)
        axis_name, e, k = _check_moe_args(where, self.axis_name, self.num_experts, self.num_experts_per_tok,
                                          self.norm_topk_prob, self.dtype, self.param_dtype, self.config)
        check_choice(where, "fp8", self.fp8, MOE_FP8_MODES)
        routing = _check_layer_routing(where, self, e, k)
        check_array(where, "x", x)
        if x.ndim < 2:
            raise ValueError(f"{where}: x must have rank >= 2 ([..., tokens, H]), got shape {tuple(x.shape)}")
        h = x.shape[-1]
        world = axis_size_if_bound(axis_name)
        unbound = world is None
        if unbound and not self.is_initializing():
            raise ValueError(f"{where}: axis_name {axis_name!r} is not bound; apply the layer inside jax.shard_map "
                             "over a mesh with that axis")
        world = 1 if unbound else world  # init outside shard_map: global shapes
        if e % world:
            raise ValueError(f"{where}: num_experts ({e}) must be divisible by the size of {axis_name!r} ({world})")
        e_local = e // world
        router = linen_param(self, "router", self.router_init, ROUTER_AXES, (h, e), self.param_dtype, where)
        wi_0 = linen_param(self, "wi_0", self.kernel_init, WI_AXES, (e_local, h, f), self.param_dtype, where)
        wi_1 = linen_param(self, "wi_1", self.kernel_init, WI_AXES, (e_local, h, f), self.param_dtype, where)
        wo = linen_param(self, "wo", self.kernel_init, WO_AXES, (e_local, f, h), self.param_dtype, where)
        routed_bias = (self.variable(ROUTER_BIAS_COLLECTION, "router_bias", jnp.zeros, (e,), self.param_dtype).value
                       if self.use_routed_bias else None)
        wants_aux = _wants_aux(self)
        if unbound:
            out = _dense_moe_mlp(x, router, wi_0, wi_1, wo, num_experts_per_tok=k,
                                 norm_topk_prob=self.norm_topk_prob, dtype=self.dtype, where=where, routing=routing,
                                 routed_bias=routed_bias, return_aux=wants_aux)
        else:
            out = moe_mlp(x, router, wi_0, wi_1, wo, num_experts_per_tok=k, axis_name=axis_name,
                          norm_topk_prob=self.norm_topk_prob, dtype=self.dtype, config=self.config, fp8=self.fp8,
                          routed_bias=routed_bias, return_aux=wants_aux, where=where, **routing)
        if not wants_aux:
            return out
        out, aux = out
        for name, value in _sown(self, aux).items():
            self.sow("intermediates", name, value)
        return out
