# The expert-parallel MoE MLP for Flax (NNX and Linen), used inside jax.shard_map over the expert
# axis: a router (linear, top-k, softmax weights), then moe_dispatch_gemm on gate|up, SwiGLU, and
# moe_gemm_combine (docs/design.md, "Mixture of experts", "Flax and MaxText"). Written like
# entwine_jax.layers (its checks, logical-axis metadata and partition_specs); needs flax.
"""Expert-parallel SwiGLU MoE MLP over entwine_jax.moe_dispatch_gemm and moe_gemm_combine.

The layer runs inside ``jax.shard_map`` over the expert axis ``ep`` of size W and sees local shards:

==========  ==============================  =================================================
parameter   global -> local                 logical axes
==========  ==============================  =================================================
router      ``[H, E] -> [H, E]``            ``("embed", None)`` (replicated)
wi_0, wi_1  ``[E, H, F] -> [E/W, H, F]``    ``("exp", "embed", None)`` (gate, up)
wo          ``[E, F, H] -> [E/W, F, H]``    ``("exp", None, "embed")``
==========  ==============================  =================================================

x: ``[..., H]``, this rank's tokens (tokens sharded over ``ep``), output of the same shape. Per token:
``logits = x @ router`` (fp32), the top ``k`` experts by logit, their weights ``softmax`` of the k
chosen logits (MaxText's rule; the same as the full softmax's top k renormalised to sum 1);
``norm_topk_prob=False`` keeps the full softmax's probabilities of the k chosen experts instead.
Then ``out = sum_j w_j * (silu(x @ wi_0[e_j]) * (x @ wi_1[e_j])) @ wo[e_j]`` with one
moe_dispatch_gemm on ``wi_0|wi_1`` concatenated over F (one transfer of x for both), the activation
in fp32, one moe_gemm_combine; slots the capacity drops (``config=MoeConfig(capacity=f)``) add
nothing. The router's gradient reaches it through the weights (the op's router-weight gradient);
the expert choice itself has none, as in MaxText.

``DEFAULT_LOGICAL_AXIS_RULES`` map ``"exp"`` to ``"ep"``; ``partition_specs(params, rules)`` gives
the shard_map's in_specs, as for the tensor-parallel layers. The experts' hidden dims are not
sharded (no expert tensor parallelism).
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from entwine_jax.api import moe_dispatch_gemm, moe_gemm_combine
# flax through entwine_jax.layers, whose import says how to install it when it is missing.
from entwine_jax.layers import (axis_size_if_bound, bound_axis_size, check_array, check_axis_name, check_choice,
                                check_config, check_dtype, check_param_dtype, compute_dtype, linen_param, nn, nnx,
                                positive_int)
from entwine_jax.layers_fp8 import fp8_call_arguments
from entwine_jax.moe.config import MoeConfig

__all__ = ["moe_mlp", "route", "MoeMlp", "MoeMlpDense", "ROUTER_AXES", "WI_AXES", "WO_AXES"]

ROUTER_AXES = ("embed", None)
WI_AXES = ("exp", "embed", None)
WO_AXES = ("exp", None, "embed")
# The layers' FP8 modes: the MoE ops take per-tensor scales only.
MOE_FP8_MODES = (None, "current")
# fan-in is the expert's input dim alone: dim 0 counts experts, not inputs.
default_expert_init = nnx.initializers.lecun_normal(batch_axis=(0,))
default_router_init = nnx.initializers.lecun_normal()
Initializer = Any


def route(x, router, k: int, norm_topk_prob: bool = True):
    """(topk_idx [T, k] int32, weights [T, k] fp32) of tokens x [T, H] under router [H, E]."""
    logits = jax.lax.dot_general(x, router, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    top_logits, topk_idx = jax.lax.top_k(logits, k)
    if norm_topk_prob:
        weights = jax.nn.softmax(top_logits, axis=-1)
    else:
        # softmax over all E experts, gathered at the chosen ones (exp(top - logsumexp) is that, cheaper).
        weights = jnp.exp(top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    return topk_idx.astype(jnp.int32), weights


def _swiglu(y, f: int, dtype):
    """silu(gate) * up over the last dim of y [..., 2F] (the dispatch's [E_local, W*C, 2F])."""
    y = y.astype(jnp.float32)
    return (jax.nn.silu(y[..., :f]) * y[..., f:]).astype(dtype)


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


def moe_mlp(x, router, wi_0, wi_1, wo, *, num_experts_per_tok: int, axis_name="ep", norm_topk_prob: bool = True,
            dtype=None, config: Optional[MoeConfig] = None, fp8: Optional[str] = None, where: str = "moe_mlp"):
    """The MoE MLP on local shards inside jax.shard_map over ``axis_name`` (see the module docstring).

    x ``[..., H]``; router ``[H, E]`` (whole); wi_0, wi_1 ``[E/W, H, F]``; wo ``[E/W, F, H]``.
    dtype: compute and output dtype (default: promoted from x and the parameters); the router's
    logits and weights are fp32. config: the ops' MoeConfig (its capacity), None for the default.
    fp8: None, or "current": both expert GEMMs in FP8 with each rank's current per-tensor scales of
    its tokens, its activations and its experts' weights, e5m2 gradients (the ops take per-tensor
    scales only: no "block" or delayed scaling yet); the router stays in dtype.
    """
    check_choice(where, "fp8", fp8, MOE_FP8_MODES)
    for name, v in (("x", x), ("router", router), ("wi_0", wi_0), ("wi_1", wi_1), ("wo", wo)):
        check_array(where, name, v)
    if x.ndim < 2:
        raise ValueError(f"{where}: x must have rank >= 2 ([..., tokens, H]), got shape {tuple(x.shape)}")
    h = x.shape[-1]
    if router.ndim != 2 or router.shape[0] != h:
        raise ValueError(f"{where}: router must have shape [H = {h}, E], got {tuple(router.shape)}")
    e = router.shape[1]
    axis_name, _, k = _check_moe_args(where, axis_name, e, num_experts_per_tok, norm_topk_prob, dtype, jnp.float32,
                                      config)
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
    topk_idx, weights = route(tokens, router.astype(dtype), k, norm_topk_prob)
    # gate|up as one dispatch weight: one transfer of the tokens, one grouped GEMM for both.
    w1 = jnp.concatenate([wi_0, wi_1], axis=2).astype(dtype)
    wo = wo.astype(dtype)
    dispatch_fp8, finish = fp8_call_arguments(where, fp8, tokens, w1, axis_name, dtype)
    y, handle = moe_dispatch_gemm(tokens, topk_idx, w1, axis_name=axis_name, config=config, **dispatch_fp8)
    h = _swiglu(y, f, dtype)
    combine_fp8, _ = fp8_call_arguments(where, fp8, h, wo, axis_name, dtype)
    out = moe_gemm_combine(h, wo, weights, handle, axis_name=axis_name, config=config, **combine_fp8)
    return finish(out).reshape(x.shape)


def _dense_moe_mlp(x, router, wi_0, wi_1, wo, *, num_experts_per_tok, norm_topk_prob, dtype, where):
    """The same MLP with every expert local (W = 1, nothing dropped): Linen's init outside shard_map."""
    dtype = compute_dtype(where, dtype, x, router, wi_0, wi_1, wo)
    tokens = x.reshape(-1, x.shape[-1]).astype(dtype)
    topk_idx, weights = route(tokens, router.astype(dtype), num_experts_per_tok, norm_topk_prob)
    # Each token's weight on every expert (zero off its top k): one einsum per GEMM over all experts.
    dense = jnp.zeros((tokens.shape[0], router.shape[1]), jnp.float32)
    dense = dense.at[jnp.arange(tokens.shape[0])[:, None], topk_idx].add(weights)
    g = jnp.einsum("th,ehf->etf", tokens, wi_0.astype(dtype), preferred_element_type=jnp.float32)
    u = jnp.einsum("th,ehf->etf", tokens, wi_1.astype(dtype), preferred_element_type=jnp.float32)
    o = jnp.einsum("etf,efh->eth", (jax.nn.silu(g) * u).astype(dtype), wo.astype(dtype),
                   preferred_element_type=jnp.float32)
    return jnp.einsum("te,eth->th", dense, o).astype(dtype).reshape(x.shape)


class MoeMlp(nnx.Module):
    """Expert-parallel SwiGLU MoE MLP, Flax NNX (see the module docstring).

    Created at global shape: router ``[in_features, num_experts]``, wi_0 / wi_1
    ``[num_experts, in_features, mlp_features]``, wo ``[num_experts, mlp_features, in_features]``,
    with the logical axes ROUTER_AXES, WI_AXES, WO_AXES. Called inside shard_map over ``axis_name``
    with the experts split over it (``partition_specs(state, rules)``) on this rank's tokens
    ``[..., in_features]``. kernel_init draws an ``[E, in, out]`` kernel (default: LeCun normal per
    expert); config: an entwine_jax.MoeConfig for both ops (its capacity); fp8: None or "current"
    (moe_mlp's).
    """

    def __init__(self, in_features: int, mlp_features: int, num_experts: int, num_experts_per_tok: int, *,
                 axis_name="ep", norm_topk_prob: bool = True, dtype=None, param_dtype=jnp.float32,
                 kernel_init: Initializer = default_expert_init, router_init: Initializer = default_router_init,
                 config: Optional[MoeConfig] = None, fp8: Optional[str] = None, rngs: nnx.Rngs):
        where = type(self).__name__
        check_choice(where, "fp8", fp8, MOE_FP8_MODES)
        self.in_features = positive_int(where, "in_features", in_features)
        self.mlp_features = positive_int(where, "mlp_features", mlp_features)
        self.axis_name, self.num_experts, self.num_experts_per_tok = _check_moe_args(
            where, axis_name, num_experts, num_experts_per_tok, norm_topk_prob, dtype, param_dtype, config)
        self.norm_topk_prob, self.dtype, self.param_dtype, self.config = norm_topk_prob, dtype, param_dtype, config
        self.fp8 = fp8
        h, f, e = self.in_features, self.mlp_features, self.num_experts
        self.router = nnx.Param(nnx.with_partitioning(router_init, ROUTER_AXES)(rngs.params(), (h, e), param_dtype))
        expert = nnx.with_partitioning(kernel_init, WI_AXES)
        self.wi_0 = nnx.Param(expert(rngs.params(), (e, h, f), param_dtype))
        self.wi_1 = nnx.Param(expert(rngs.params(), (e, h, f), param_dtype))
        self.wo = nnx.Param(nnx.with_partitioning(kernel_init, WO_AXES)(rngs.params(), (e, f, h), param_dtype))

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
        return moe_mlp(x, self.router[...], self.wi_0[...], self.wi_1[...], self.wo[...],
                       num_experts_per_tok=self.num_experts_per_tok, axis_name=self.axis_name,
                       norm_topk_prob=self.norm_topk_prob, dtype=self.dtype, config=self.config, fp8=self.fp8,
                       where=where)


class MoeMlpDense(nn.Module):
    """Expert-parallel SwiGLU MoE MLP, Flax Linen (the NNX MoeMlp's twin, the same parameter names).

    ``init`` it outside shard_map on the global input (global parameter shapes; the output then comes
    from the same MLP with every expert local, nothing dropped), ``apply`` it inside shard_map over
    ``axis_name`` with the parameters placed by ``partition_specs(params, rules)``.
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

    @nn.compact
    def __call__(self, x):
        where = type(self).__name__
        f = positive_int(where, "mlp_features", self.mlp_features)
        axis_name, e, k = _check_moe_args(where, self.axis_name, self.num_experts, self.num_experts_per_tok,
                                          self.norm_topk_prob, self.dtype, self.param_dtype, self.config)
        check_choice(where, "fp8", self.fp8, MOE_FP8_MODES)
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
        if unbound:
            return _dense_moe_mlp(x, router, wi_0, wi_1, wo, num_experts_per_tok=k,
                                  norm_topk_prob=self.norm_topk_prob, dtype=self.dtype, where=where)
        return moe_mlp(x, router, wi_0, wi_1, wo, num_experts_per_tok=k, axis_name=axis_name,
                       norm_topk_prob=self.norm_topk_prob, dtype=self.dtype, config=self.config, fp8=self.fp8,
                       where=where)
