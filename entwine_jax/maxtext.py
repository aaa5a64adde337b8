# MaxText integration: entwine_jax.maxtext.enable() routes MaxText's tensor-parallel projections
# (MLP wo / wi_*, attention out / query / key / value, MLA's) through gemm_rs and ag_gemm, and its
# routed experts (RoutedMoE.sparse_matmul) through moe_dispatch_gemm / moe_gemm_combine, by patching
# MaxText methods at runtime; disable() puts them back. Parameters, their paths and MaxText's
# checkpoint_name tags are untouched. Written against MaxText 0.2.5 (docs/maxtext.md).
"""Route MaxText's row-parallel projections through ``entwine_jax.gemm_rs``, its column-parallel
ones through ``entwine_jax.ag_gemm`` and its routed experts through ``entwine_jax.moe_dispatch_gemm``
and ``entwine_jax.moe_gemm_combine``.

Call :func:`enable` once at startup, before the train step is traced (e.g. before
``train.main``); nothing in MaxText's files or configs changes::

    import entwine_jax.maxtext
    entwine_jax.maxtext.enable()
    from maxtext.trainers.pre_train import train
    train.main(argv)

What is patched (all restored by :func:`disable`):

* ``MlpBlock.__call__`` and ``Attention.__call__`` (``maxtext.layers.linears`` /
  ``maxtext.layers.attentions``) only mark, for the length of the call, which of their child
  ``DenseGeneral`` modules is which projection, with the activation axis names the layer itself
  uses (``MlpBlock.intermediate_logical``, ``Attention.out_axis_names``, ...), then run MaxText's
  own code unchanged.
* ``DenseGeneral.__call__`` runs a marked projection as a ``jax.shard_map`` island over the whole
  mesh calling ``gemm_rs`` / ``ag_gemm`` on the module's own kernel; any other ``DenseGeneral``
  call, and every marked one this module cannot serve, runs MaxText's code (the reason is logged
  once per projection at INFO on the ``entwine_jax`` logger, and kept in :func:`stats`).

* ``RoutedMoE.__call__`` (``maxtext.layers.moe``) reports the MoE paths that never reach
  ``sparse_matmul`` (the dense einsum path under ``sparse_matmul=false``, TransformerEngine's block,
  vLLM's fused MoE) as kept; ``RoutedMoE.sparse_matmul`` (MaxText's default MoE path, the one its
  GPU configs take) runs, where the configuration allows, one ``jax.shard_map`` island over the mesh
  with MaxText's own in_specs in which each rank runs MaxText's router on its tokens (``get_topk``:
  top-k, softmax or sigmoid scores, DeepSeek's bias and group limit, ``norm_topk_prob``,
  ``routed_scaling_factor``), ``moe_dispatch_gemm`` on wi_0|wi_1 over the expert axis, MaxText's
  activation and ``moe_gemm_combine`` with MaxText's weights, in place of its sort,
  ``ragged_all_to_all``, grouped GEMMs and unsort. Shared experts are ``MlpBlock``s (above).

Layouts come from MaxText's logical-axis rules (the Flax rule context MaxText's train step runs
under, else ``config.logical_axis_rules``), resolved on the layer's mesh with MaxText's own
``logical_to_mesh_axes`` (size-1 mesh axes dropped):

* the tensor axis T: the one mesh axis that shards the projection's contraction dim
  (row-parallel: ``activation_mlp`` / ``activation_heads`` of the input) or its output feature
  dim (column-parallel: ``activation_mlp`` / ``activation_kv_heads``);
* the layout: T on the embed dim of the decoder activations (``activation_embed``, MaxText's
  ``tensor`` axis: gemm_rs scatters the hidden dim, ag_gemm gathers it) or on their sequence dim
  (``activation_norm_length``, the ``tensor_sequence`` axis: scatter / gather dim 1);
* the batch axes: whatever the activation's batch dim maps to (``activation_batch`` ->
  ``data``, ``fsdp``, ``fsdp_transpose``, ``expert``, those of size > 1).

``quantization=fp8_gpu`` (through qwix, ``use_qwix_quantization=true``) and ``quantization=fp8``
(MaxText's ``Fp8Quantization``) run Flax's ``Fp8DirectDotGeneralOp`` in every projection; those
projections are routed through the FP8 ops: the island reads the projection's delayed-scaling state
(scales and amax histories, replicated) and returns its next value as its gradient, as Flax's op
does, so MaxText's train step updates it unchanged. Each FP8 projection runs its own island (no
grouped gather: each keeps its own scales). Under qwix the state exists only after MaxText's own
first call of the projection (qwix creates it there): that call is MaxText's, the later ones are
routed, and the island runs with qwix's interceptions off. Under a float32 (or any other non-bf16/fp16)
compute dtype the FP8 projections stay MaxText's: the FP8 ops write only bf16 or fp16, and a
float32 model rounded to bf16 at every projection drifts from stock FP8.

Routed experts kept as MaxText's (logged once, the reason in :func:`stats` under ``"moe/experts"``):
quantised experts, ``mlp_bias``, ring of experts, embedding chunks, random or hash routing, forced
expert ids, Llama 4 with more than one expert per token, ``ragged_buffer_factor > 0`` (MaxText drops
other tokens than the ops' capacity would), no expert parallelism, expert tensor parallelism, MaxText's
special expert layouts (``shard_exp_on_fsdp``, ...), tokens not sharded over the expert axis.

Kept as MaxText's own layer (logged once): other quantised ``DenseGeneral`` (``quant``: AQT, other
qwix recipes, fp8 or scaled weights, which includes TransformerEngine's ``te_comm_gemm_overlap``), a bias, host-offloaded
parameters, a non-default ``matmul_precision``, kernel axes other than MaxText's, context
parallelism (the sequence dim sharded on the island's input), 2-D tensor parallelism (the
contraction or output features over more than one mesh axis), no tensor parallelism, an output
replicated over T (an all-reduce), inference modes (prefill, decode), and shapes T does not divide.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
from typing import Any, Optional

import jax
import jax.ad_checkpoint as adc
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import entwine_jax
from entwine_jax import _log
from entwine_jax import fp8 as fp8_ops
from entwine_jax.ag_gemm.config import AgGemmConfig
from entwine_jax.gemm_rs.config import GemmRsConfig
from entwine_jax.layers import FP8_META_NAMES, fp8_call_arguments
from entwine_jax.moe.config import MoeConfig

__all__ = ["enable", "disable", "enabled", "is_enabled", "stats", "reset_stats", "TESTED_MAXTEXT_VERSIONS"]

TESTED_MAXTEXT_VERSIONS = ("0.2.5",)

ROW, COLUMN = "gemm_rs", "ag_gemm"
_WHERE = "entwine_jax.maxtext"
_TRAIN = "train"
_QWIX_FIRST_CALL = "quantization=fp8_gpu: qwix creates the FP8 state"
_FP8_FLOAT32 = ("FP8 with compute dtype {dtype}: the FP8 ops write bf16 or fp16, Flax's FP8 dot writes "
                "the compute dtype")
# The decoder layer's activation names around the MLP and attention blocks (LlamaDecoderLayer and
# the other MaxText decoders): the input of wi / query / key / value's callers and the layout the
# decoder constrains wo's and out's outputs to.
_DECODER_ACTIVATION = ("activation_batch", "activation_norm_length", "activation_embed")
# MaxText's kernel logical axes per projection (linears.py, attentions.py); another value means a
# layout this module was not written for.
_KERNEL_AXES = {
    "wo": ("mlp", "embed"),
    "wi": ("embed", "mlp"),
    "out": ("heads", "kv", "embed_attn"),
    "query": ("embed_attn", "q_heads", "kv"),
    "key": ("embed_attn", "kv_heads", "kv_head_dim"),
    "value": ("embed_attn", "kv_heads", "kv_head_dim"),
    "wi_fused": ("embed", "num_activations", "mlp"),
    "qkv_proj": ("embed_attn", "heads", "kv"),
    # MLA (attention_mla.py): the low-rank query and key/value down- (wq_a, wkv_a) and up-projections
    # (wq_b, wkv_b).
    "wq_a": ("embed_attn", "q_lora_up_proj"),
    "wq_b": ("q_lora", "q_heads", "kv"),
    "wkv_a": ("embed_attn", "kv_lora_up_proj"),
    "wkv_b": ("kv_lora", "kv_heads", "kv_head_dim"),
}
# MLA's low-rank activations (attention_mla.py: KV_BATCH, LENGTH, Q_LORA_UP_PROJ / KV_LORA_UP_PROJ).
_MLA_LOW_RANK = {"q": ("activation_kv_batch", "activation_length", "q_lora_up_proj"),
                 "kv": ("activation_kv_batch", "activation_length", "kv_lora_up_proj")}
# RoutedMoE's routed experts (router, dispatch, the experts' GEMMs, combine): one site.
MOE_SITE = "moe/experts"
# The logical axes RoutedMoE.sparse_matmul gives its shard_map: tokens and router logits (batch over
# activation_batch, which holds 'expert'), and its output.
_MOE_TOKENS = ("activation_batch", "activation_norm_length", None)
_MOE_OUT = ("activation_batch", "activation_norm_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class _Site:
    """One projection of one MaxText layer call, as the layer describes it."""
    name: str          # "mlp/wo", "attention/query", ...: the key of stats() and of the log
    kind: str          # ROW or COLUMN
    mesh: Any          # the layer's jax.sharding.Mesh
    config: Any        # the layer's MaxText config (shard_mode, logical_axis_rules)
    kernel_axes: tuple
    x_names: tuple     # logical axes of the projection's input
    out_names: tuple   # logical axes of its output (row-parallel: unless the caller passes out_sharding)
    group: Any = None  # a _Group of column-parallel projections of one input, served by one ag_gemm


@dataclasses.dataclass(eq=False)
class _Group:
    """Column-parallel projections that read the same activations in one layer call (query, key and
    value; wi_0 and wi_1): the first of them to run computes all of them with one grouped ag_gemm,
    the others take their output from here."""
    name: str                      # "attention/qkv", "mlp/wi": the key of stats()["grouped"]
    members: list                  # the DenseGeneral modules, in call order
    results: dict = dataclasses.field(default_factory=dict)  # id(DenseGeneral) -> its output


@dataclasses.dataclass
class _State:
    originals: dict = dataclasses.field(default_factory=dict)  # (class, attribute) -> original function
    gemm_rs_config: Optional[GemmRsConfig] = None
    ag_gemm_config: Optional[AgGemmConfig] = None
    column_parallel: bool = True
    moe: bool = False
    moe_config: Optional[MoeConfig] = None
    # What the traces did, by where they ran: True, MaxText's train step; False, any other trace
    # (the model's initialisation, qwix's dummy forward, an evaluation step, a call by hand).
    reports: dict = dataclasses.field(default_factory=lambda: {True: _Report(), False: _Report()})
    setup_done: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Report:
    routed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    grouped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    kept: dict = dataclasses.field(default_factory=dict)
    traced: bool = False  # a train step was traced (True's report only)

    def as_dict(self) -> dict:
        return {"routed": dict(self.routed), "grouped": dict(self.grouped), "kept": dict(self.kept)}


_state = _State()
# id(DenseGeneral) -> _Site for the DenseGenerals of the MaxText layer calls in progress. A context
# variable rather than an attribute on the module, so that the model's graph (and with it nnx.split,
# checkpoints and parameter paths) is the same with and without the integration.
_sites: contextvars.ContextVar[dict] = contextvars.ContextVar("entwine_maxtext_sites", default={})
# True while MaxText's train step is traced (set by the function get_functional_train_with_signature
# returns): stats() reports that program, not the initialisation's traces of the same layers.
_in_train_step: contextvars.ContextVar[bool] = contextvars.ContextVar("entwine_maxtext_train_step", default=False)


def _report() -> _Report:
    return _state.reports[_in_train_step.get()]


# ----------------------------------------------------------------------------------------------
# The switch
# ----------------------------------------------------------------------------------------------

def enable(*, gemm_rs_config: Optional[GemmRsConfig] = None, ag_gemm_config: Optional[AgGemmConfig] = None,
           column_parallel: bool = True, moe: bool = False, moe_config: Optional[MoeConfig] = None) -> None:
    """Route MaxText's tensor-parallel projections through entwine_jax (see the module docstring).

    Call before MaxText traces its train step (building the model before or after does not
    matter: the routing is decided at trace time). Calling it again replaces the settings.

    gemm_rs_config: passed to every ``gemm_rs`` call (default: the tuned table / heuristic).
    ag_gemm_config: an ``entwine_jax.AgGemmConfig``, passed to every ``ag_gemm`` call (default:
    ``ag_heuristic_config``).
    column_parallel: False keeps MaxText's own wi_* / query / key / value projections.
    moe: True routes MaxText's routed experts (RoutedMoE.sparse_matmul) through the MoE ops; off by
    default: their static layout moves C = round_up(T, 128) rows per (source, expert) when dropless,
    E/k times the rows MaxText's ragged all-to-all moves (docs/maxtext.md, "Routed experts (MoE)").
    moe_config: an ``entwine_jax.MoeConfig``, passed to every ``moe_dispatch_gemm`` / ``moe_gemm_combine``
    call (default: dropless, as MaxText's sparse_matmul without ragged_buffer_factor).
    """
    if gemm_rs_config is not None and not isinstance(gemm_rs_config, GemmRsConfig):
        raise ValueError(f"entwine_jax.maxtext.enable: gemm_rs_config must be an entwine_jax.GemmRsConfig or None, "
                         f"got {type(gemm_rs_config).__name__}")
    if ag_gemm_config is not None and not isinstance(ag_gemm_config, AgGemmConfig):
        raise ValueError(f"entwine_jax.maxtext.enable: ag_gemm_config must be an entwine_jax.AgGemmConfig or None, "
                         f"got {type(ag_gemm_config).__name__}")
    if column_parallel not in (True, False):
        raise ValueError(f"entwine_jax.maxtext.enable: column_parallel must be a bool, got {column_parallel!r}")
    if moe not in (True, False):
        raise ValueError(f"entwine_jax.maxtext.enable: moe must be a bool, got {moe!r}")
    if moe_config is not None and not isinstance(moe_config, MoeConfig):
        raise ValueError(f"entwine_jax.maxtext.enable: moe_config must be an entwine_jax.MoeConfig or None, "
                         f"got {type(moe_config).__name__}")
    linears, attentions, moe_module, maxtext_utils = _maxtext_modules()
    _state.gemm_rs_config, _state.ag_gemm_config, _state.column_parallel = (
        gemm_rs_config, ag_gemm_config, column_parallel)
    _state.moe, _state.moe_config = moe, moe_config
    if _state.originals:
        return  # already patched; the settings above apply from the next trace on
    patches = {
        (linears.DenseGeneral, "__call__"): _dense_general_call,
        (linears.MlpBlock, "__call__"): _mlp_block_call,
        (attentions.Attention, "__call__"): _attention_call,
        (moe_module.RoutedMoE, "__call__"): _moe_call,
        (moe_module.RoutedMoE, "sparse_matmul"): _sparse_matmul,
        (maxtext_utils, "get_functional_train_with_signature"): _train_signature,
    }
    # Attention subclasses with a __call__ of their own bypass _attention_call: MLA's projections are
    # marked by _mla_call; any other is reported as kept (_own_attention_call).
    for cls in _attention_subclasses(attentions.Attention):
        if "__call__" in vars(cls):
            patches[(cls, "__call__")] = _mla_call if cls.__name__ == "MLA" else _own_attention_call
    for (cls, attr), wrapper in patches.items():
        original = cls.__dict__[attr]
        _state.originals[(cls, attr)] = original
        setattr(cls, attr, _patched(original, wrapper))
    # Said by the first patched call (_announce): absl may not have set up logging yet.
    _log.reset_key("maxtext-enabled")


def disable() -> None:
    """Put MaxText's methods back. Programs traced while enabled keep their islands; programs traced
    afterwards are stock MaxText."""
    for (cls, attr), original in _state.originals.items():
        setattr(cls, attr, original)
    _state.originals.clear()


def is_enabled() -> bool:
    return bool(_state.originals)


@contextlib.contextmanager
def enabled(**kwargs):
    """``with enabled(): ...``: enable(**kwargs) for the block, then disable() (if it was off)."""
    was = is_enabled()
    enable(**kwargs)
    try:
        yield
    finally:
        if not was:
            disable()


def stats() -> dict:
    """What MaxText's train step runs, from its traces since the last reset_stats():
    ``{"routed": {site: traced calls}, "grouped": {group: traced calls}, "kept": {site: reason},
    "outside_train_step": {the same three keys}}``, sites such as ``"mlp/wo"``, ``"attention/out"``,
    groups ``"attention/qkv"`` and ``"mlp/wi"`` (projections of one input served by one ag_gemm).

    The top-level keys describe the traces of MaxText's train step (the function
    ``maxtext_utils.get_functional_train_with_signature`` returns, which MaxText's train loop and
    ``train_compile`` jit), once one has been traced; until then (a model called by hand) they
    describe every trace. ``outside_train_step`` holds the other traces: the model's initialisation
    (under ``quantization=fp8_gpu`` qwix's dummy forward, whose calls stay MaxText's), an evaluation
    step. A site is counted each time a routed call is traced (a scanned layer stack traces its body
    once; remat and the backward pass may trace it again)."""
    train, other = _state.reports[True], _state.reports[False]
    main = train if train.traced else other
    return {**main.as_dict(), "outside_train_step": other.as_dict() if train.traced else _Report().as_dict()}


def reset_stats() -> None:
    _state.reports = {True: _Report(), False: _Report()}


def _patched(original, wrapper):
    """A plain function (so that it binds as a method) calling wrapper(original, *args, ...)."""
    def patched(*args, **kwargs):
        return wrapper(original, *args, **kwargs)
    return functools.wraps(original)(patched)


def _maxtext_modules():
    try:
        from maxtext.layers import attentions, linears, moe
        from maxtext.utils import maxtext_utils
    except ImportError as e:
        raise ImportError(f"entwine_jax.maxtext needs MaxText (pip install 'maxtext[tpu]==0.2.5'): {e}") from e
    for cls, attr in ((linears.DenseGeneral, "__call__"), (linears.MlpBlock, "__call__"),
                      (attentions.Attention, "__call__"), (moe.RoutedMoE, "__call__"),
                      (moe.RoutedMoE, "sparse_matmul"),
                      (maxtext_utils, "get_functional_train_with_signature")):
        if attr not in vars(cls):
            raise RuntimeError(f"entwine_jax.maxtext: {getattr(cls, '__module__', None) or ''}.{cls.__name__} has no "
                               f"{attr} of its own in MaxText {_maxtext_version()}; this integration was written for "
                               f"MaxText {', '.join(TESTED_MAXTEXT_VERSIONS)}")
    if _maxtext_version() not in TESTED_MAXTEXT_VERSIONS:
        _log.log_once(("maxtext-version", _maxtext_version()), logging.WARNING,
                      "entwine_jax.maxtext: MaxText %s is not one of the tested versions %s; compare losses with "
                      "and without enable()", _maxtext_version(), TESTED_MAXTEXT_VERSIONS)
    return linears, attentions, moe, maxtext_utils


def _attention_subclasses(base) -> list:
    """Every subclass of MaxText's Attention imported so far, MLA's and CompressedAttention's modules
    imported first (DeepSeek 2/3, Kimi K2 and DeepSeek-V4 use them)."""
    import importlib
    for name in ("maxtext.layers.attention_mla", "maxtext.layers.attention_compressed"):
        try:
            importlib.import_module(name)
        except ImportError:  # another MaxText version: whatever subclasses exist are still found
            pass
    found, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo += cls.__subclasses__()
    return found


def _maxtext_version() -> str:
    try:
        from importlib.metadata import version
        return version("maxtext")
    except Exception:
        return "unknown"


# ----------------------------------------------------------------------------------------------
# The three patched methods
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _marked(sites: dict):
    token = _sites.set({**_sites.get(), **sites})
    try:
        yield
    finally:
        _sites.reset(token)


def _mlp_block_call(original, self, inputs, *args, **kwargs):
    _announce()
    mode = getattr(self, "model_mode", None)
    if mode not in (None, _TRAIN):
        _keep("mlp/wo", f"model_mode={mode!r} (inference) is left to MaxText")
        return original(self, inputs, *args, **kwargs)
    site = functools.partial(_Site, mesh=self.mesh, config=self.config)
    intermediate = tuple(self.intermediate_logical)
    sites = {id(self.wo): site(name="mlp/wo", kind=ROW, kernel_axes=_KERNEL_AXES["wo"], x_names=intermediate,
                               out_names=_DECODER_ACTIVATION)}
    if self.config.fused_mlp:
        # One kernel [embed, num_activations, mlp]: already one GEMM per input, its mlp dim over T.
        sites[id(self.wi)] = site(name="mlp/wi", kind=COLUMN, kernel_axes=_KERNEL_AXES["wi_fused"],
                                  x_names=_DECODER_ACTIVATION, out_names=intermediate[:2] + (None,) + intermediate[2:])
    else:
        names = ["wi"] if len(self.activations) == 1 else [f"wi_{idx}" for idx in range(len(self.activations))]
        modules = [getattr(self, name) for name in names]
        # wi_0, wi_1, ... all read `inputs`: one gather serves them.
        group = _Group("mlp/wi", modules) if len(modules) > 1 else None
        for name, module in zip(names, modules):
            sites[id(module)] = site(name=f"mlp/{name}", kind=COLUMN, kernel_axes=_KERNEL_AXES["wi"],
                                     x_names=_DECODER_ACTIVATION, out_names=intermediate, group=group)
    with _marked(sites):
        return original(self, inputs, *args, **kwargs)


def _attention_left_to_maxtext(kwargs) -> bool:
    """Whether an attention call is MaxText's alone (inference: attention/out kept with the reason);
    announces the integration either way."""
    _announce()
    mode = kwargs.get("model_mode", _TRAIN)
    if mode == _TRAIN:
        return False
    _keep("attention/out", f"model_mode={mode!r} (inference) is left to MaxText")
    return True


def _attention_call(original, self, inputs_q, inputs_kv, *args, **kwargs):
    if _attention_left_to_maxtext(kwargs):
        return original(self, inputs_q, inputs_kv, *args, **kwargs)
    site = functools.partial(_Site, mesh=self.mesh, config=self.config)
    sites = {}
    if getattr(self, "out", None) is not None:
        sites[id(self.out)] = site(name="attention/out", kind=ROW, kernel_axes=_KERNEL_AXES["out"],
                                   x_names=tuple(self.out_axis_names), out_names=_DECODER_ACTIVATION)
    if getattr(self.config, "fused_qkv", False) and getattr(self, "qkv_proj", None) is not None:
        # One kernel [embed, q_heads + 2 kv_heads, head_dim], heads over T: one GEMM already.
        sites[id(self.qkv_proj)] = site(name="attention/qkv_proj", kind=COLUMN, kernel_axes=_KERNEL_AXES["qkv_proj"],
                                        x_names=tuple(self.input_axis_names), out_names=tuple(self.query_axis_names))
    projections = [(proj, getattr(self, proj, None), out_names) for proj, out_names in
                   (("query", self.query_axis_names), ("key", self.key_axis_names), ("value", self.value_axis_names))]
    # value may be key (share_kv_projections): one module, one site.
    projections = [(p, m, o) for i, (p, m, o) in enumerate(projections)
                   if m is not None and all(m is not other for _, other, _ in projections[:i])]
    # Self-attention reads one activation for query, key and value (MaxText passes the same array
    # twice); shared_key / shared_value skip the key and value projections.
    self_attention = inputs_q is inputs_kv and kwargs.get("shared_key") is None and kwargs.get("shared_value") is None
    group = _Group("attention/qkv", [m for _, m, _ in projections]) if self_attention and len(projections) > 1 else None
    for proj, module, out_names in projections:
        if id(module) not in sites:
            sites[id(module)] = site(name=f"attention/{proj}", kind=COLUMN, kernel_axes=_KERNEL_AXES[proj],
                                     x_names=tuple(self.input_axis_names), out_names=tuple(out_names), group=group)
    with _marked(sites):
        return original(self, inputs_q, inputs_kv, *args, **kwargs)


def _train_signature(original, train_step, *args, **kwargs):
    """maxtext_utils.get_functional_train_with_signature, its train step marked: the calls traced in
    it are what stats() reports (the same name, so that jit still calls the program train_step)."""
    functional_train, *rest = original(train_step, *args, **kwargs)

    def marked(*step_args, **step_kwargs):
        token = _in_train_step.set(True)
        _state.reports[True].traced = True
        try:
            return functional_train(*step_args, **step_kwargs)
        finally:
            _in_train_step.reset(token)
    marked.__name__ = getattr(functional_train, "__name__", "train_step")
    return (marked, *rest)


def _mla_call(original, self, inputs_q, inputs_kv, *args, **kwargs):
    """MLA (attention_type=mla): `out` and, without a query LoRA, `query` as Attention's; the LoRA
    down-projections (wq_a, wkv_a: embed -> a rank replicated over T) and up-projections (wq_b, wkv_b:
    a replicated rank -> heads over T) through the same plan, which routes them where the mesh gives
    them a tensor-parallel layout and otherwise keeps them with its reason (with MaxText's rules: no
    sharded output features, and an input with nothing to gather)."""
    if _attention_left_to_maxtext(kwargs):
        return original(self, inputs_q, inputs_kv, *args, **kwargs)
    site = functools.partial(_Site, mesh=self.mesh, config=self.config)
    x_names = tuple(self.input_axis_names)
    candidates = [("out", ROW, tuple(self.out_axis_names), _DECODER_ACTIVATION),
                  ("query", COLUMN, x_names, tuple(self.query_axis_names)),
                  ("wq_a", COLUMN, x_names, _MLA_LOW_RANK["q"]),
                  ("wq_b", COLUMN, _MLA_LOW_RANK["q"], tuple(self.query_axis_names)),
                  ("wkv_a", COLUMN, x_names, _MLA_LOW_RANK["kv"]),
                  ("wkv_b", COLUMN, _MLA_LOW_RANK["kv"], tuple(self.key_axis_names))]
    sites = {}
    for proj, kind, x, out in candidates:
        module = getattr(self, proj, None)
        if module is not None:
            sites[id(module)] = site(name=f"attention/mla/{proj}" if proj != "out" else "attention/out", kind=kind,
                                     kernel_axes=_KERNEL_AXES[proj], x_names=x, out_names=out)
    with _marked(sites):
        return original(self, inputs_q, inputs_kv, *args, **kwargs)


def _own_attention_call(original, self, *args, **kwargs):
    # An Attention subclass with its own __call__ (CompressedAttention: DeepSeek-V4's low-rank and
    # grouped output projections; Gemma4's, Qwen3-custom's): its projections stay MaxText's, said once.
    _announce()
    name = type(self).__name__
    _keep(f"attention/{name}", f"{name} overrides Attention.__call__ with projections of its own layout; its "
          "projections are left to MaxText")
    return original(self, *args, **kwargs)


def _moe_call(original, self, *args, **kwargs):
    # RoutedMoE.__call__: the paths that never reach sparse_matmul are reported here; sparse_matmul's
    # own patch (_sparse_matmul) routes or keeps the rest.
    _announce()
    cfg = self.config
    if cfg.te_moe_block:
        _keep(MOE_SITE, "te_moe_block=true: TransformerEngine's MoE block is left to MaxText")
    elif cfg.attention in ("vllm_rpa", "vllm_batched_rpa") and not self.is_hash_routing:
        _keep(MOE_SITE, f"attention={cfg.attention!r}: vLLM's fused MoE (inference) is left to MaxText")
    elif not cfg.sparse_matmul:
        _keep(MOE_SITE, "sparse_matmul=false: MaxText's dense path (einsums with dispatch/combine masks, "
              "capacity_factor) is left to MaxText; the MoE ops replace sparse_matmul")
    return original(self, *args, **kwargs)


def _dense_general_call(original, self, inputs, _initializing: bool = False, out_sharding=None,
                        slice_bounds=None):
    site = _sites.get().get(id(self))
    if site is None or _initializing:
        return original(self, inputs, _initializing, out_sharding, slice_bounds)
    group = site.group
    if group is not None and id(self) in group.results:
        # An earlier member's call computed this projection with the whole group.
        _report().routed[site.name] += 1
        return group.results.pop(id(self))
    plan = _plan(self, site, inputs, out_sharding, slice_bounds)
    if isinstance(plan, str):
        _keep(site.name, plan)
        return original(self, inputs, _initializing, out_sharding, slice_bounds)
    _report().routed[site.name] += 1
    if group is not None and self is group.members[0]:
        outputs = _grouped_island(group, plan, inputs, out_sharding)
        if outputs is not None:
            _report().grouped[group.name] += 1
            group.results.update((id(m), y) for m, y in zip(group.members[1:], outputs[1:]))
            return outputs[0]
    return _island(self, site, plan, inputs)


def _announce() -> None:
    """Say once, when MaxText first calls a patched layer (absl's logging is set up by then, which it
    may not have been when enable() ran), that the integration is on."""
    _log.log_once("maxtext-enabled", logging.INFO, "entwine_jax.maxtext: enabled (MaxText %s; row-parallel -> "
                  "gemm_rs, column-parallel -> %s, routed experts -> %s)", _maxtext_version(),
                  "ag_gemm" if _state.column_parallel else "MaxText (column_parallel=False)",
                  "moe_dispatch_gemm / moe_gemm_combine" if _state.moe else "MaxText (moe=False)")


def _keep(name: str, reason: str) -> None:
    in_step = _in_train_step.get()
    _report().kept[name] = reason
    # qwix's first call of each projection (the model's initialisation) is always MaxText's and says
    # nothing about the train step: DEBUG, so that the INFO lines do not contradict what the step runs.
    level = logging.DEBUG if reason.startswith(_QWIX_FIRST_CALL) else logging.INFO
    _log.log_once(("maxtext-keep", name, reason, in_step), level,
                  "entwine_jax.maxtext: %s keeps MaxText's %s%s: %s", name,
                  "RoutedMoE" if name == MOE_SITE else "DenseGeneral",
                  "" if in_step else " outside the train step", reason)


# ----------------------------------------------------------------------------------------------
# Layout: from MaxText's logical axes to the island's specs
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    axis: str          # the tensor axis T
    x_spec: P          # the island's in_specs / out_specs
    kernel_spec: P
    out_spec: P
    dimension: int     # gemm_rs's scatter_dimension or ag_gemm's gather_dimension
    layout: str        # "hidden" or "sequence"


def _mesh_dims(names, site: _Site) -> list:
    """Per dim, the mesh axes of size > 1 that MaxText's rules give `names` (a tuple per dim)."""
    import flax.linen as nn
    from maxtext.utils.sharding import logical_to_mesh_axes
    # MaxText's own layers resolve with rules=None, i.e. the Flax rule context of the train step;
    # outside it (a model called by hand) the config's rules are what that context would hold.
    rules = None if nn.get_logical_axis_rules() else site.config.logical_axis_rules
    spec = logical_to_mesh_axes(tuple(names), site.mesh, rules=rules)
    return [_axes(entry, site.mesh) for entry in spec]


def _axes(entry, mesh) -> tuple:
    if entry is None or entry == P.UNCONSTRAINED:
        return ()
    entry = (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in entry if mesh.shape.get(a, 1) > 1)


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _fmt(dims) -> str:
    return "P(" + ", ".join(repr(_entry(d)) for d in dims) + ")"


def _module_reason(dense, site: _Site, inputs, slice_bounds) -> Optional[str]:
    """Why MaxText's DenseGeneral must run this call itself, from the module alone."""
    from maxtext.common.common_types import is_fp8_dtype
    if dense.quant is not None and _fp8_state(dense, site) is None:
        return f"quantised DenseGeneral (quant={type(dense.quant).__name__})"
    if _qwix_fp8(site) and _fp8_state(dense, site) is None:
        return _QWIX_FIRST_CALL + " in MaxText's own first call"
    if getattr(site.config, "use_qwix_quantization", False) and getattr(site.config, "quantization", "") and not (
            _qwix_fp8(site)):
        return f"qwix quantization {site.config.quantization!r}"
    if getattr(dense, "kernel_scale", None) is not None or is_fp8_dtype(getattr(dense, "weight_dtype", None)):
        return "quantised weights (kernel_scale / fp8 weight_dtype)"
    # The FP8 ops (XLA path and kernels alike) write bf16 or fp16; Flax's FP8 dot writes the compute
    # dtype. Rounding a float32 model's projections to bf16 moved the losses 8.6e-3 in 3 steps
    # (docs/maxtext.md, "FP8 under float32 compute stays MaxText's").
    if jnp.dtype(dense.dtype) not in fp8_ops.OUT_DTYPES and _fp8_state(dense, site) is not None:
        return _FP8_FLOAT32.format(dtype=jnp.dtype(dense.dtype).name)
    if dense.bias is not None:
        return "a bias (gemm_rs / ag_gemm take none)"
    if slice_bounds is not None:
        return "a sliced kernel (slice_bounds)"
    if dense.parameter_memory_host_offload:
        return "parameter_memory_host_offload"
    if dense.matmul_precision != "default":
        return f"matmul_precision={dense.matmul_precision!r} (the ops compute at the default precision)"
    if tuple(dense.kernel_axes) != site.kernel_axes:
        return f"kernel logical axes {tuple(dense.kernel_axes)}, not MaxText's {site.kernel_axes}"
    n_in = len(dense.axis)
    want_in = n_in if site.kind == ROW else 1
    if n_in != want_in or tuple(a % inputs.ndim for a in dense.axis) != tuple(range(inputs.ndim - n_in, inputs.ndim)):
        return f"contraction axes {dense.axis} of an input of rank {inputs.ndim}: not the trailing {want_in} dim(s)"
    if inputs.ndim != 2 + n_in:
        return f"an input of rank {inputs.ndim} (expected [batch, sequence, *features])"
    return None


def _plan(dense, site: _Site, inputs, out_sharding, slice_bounds):
    """The island's layout, or the reason (a str) to keep MaxText's DenseGeneral."""
    if site.kind == COLUMN and not _state.column_parallel:
        return "column_parallel=False"
    reason = _module_reason(dense, site, inputs, slice_bounds)
    if reason is not None:
        return reason
    x = _mesh_dims(site.x_names, site)
    if len(x) != inputs.ndim:
        return f"input logical axes {site.x_names} for an input of rank {inputs.ndim}"
    kernel_shape = tuple(dense.in_features_shape) + tuple(dense.out_features_shape)
    if site.kind == ROW:
        return _row_plan(site, x, kernel_shape, inputs.shape, out_sharding)
    plan = _column_plan(site, x, kernel_shape, inputs.shape)
    if isinstance(plan, _Plan) and _explicit(site) and isinstance(out_sharding, NamedSharding):
        # Under explicit sharding DenseGeneral's output takes out_sharding's layout (its spec padded
        # with replicated dims, as MaxText's truncate_out_sharding leaves it): the island must give
        # that layout, or leave the projection to MaxText.
        rank = 1 + len(kernel_shape)
        want = [_axes(e, site.mesh) for e in tuple(out_sharding.spec)[:rank]]
        want += [()] * (rank - len(want))
        ours = [_axes(e, site.mesh) for e in plan.out_spec] + [()] * (rank - len(plan.out_spec))
        if want != ours:
            return (f"out_sharding {_fmt(want)} is not the column-parallel output layout {_fmt(ours)} (explicit "
                    "sharding: MaxText's dot gives its caller that layout)")
    return plan


def _explicit(site) -> bool:
    """Whether a site's (or a MaxText module's) config runs under explicit sharding."""
    from maxtext.common.common_types import ShardMode
    return site.config.shard_mode == ShardMode.EXPLICIT


def _row_plan(site: _Site, x: list, kernel_shape: tuple, x_shape: tuple, out_sharding):
    """gemm_rs: x [B, S, *in] with in[0] over T -> [B, S, E/T] ("hidden") or [B, S/T, E] ("sequence")."""
    mesh = site.mesh
    # The layout the caller asks for (LlamaDecoderLayer passes its activation sharding), else the
    # decoder's activation names.
    if isinstance(out_sharding, NamedSharding) and len(out_sharding.spec) == 3:
        out = [_axes(e, mesh) for e in out_sharding.spec]
    else:
        out = _mesh_dims(site.out_names, site)
    contraction = [a for dims in x[2:] for a in dims]
    if not contraction:
        return f"no tensor parallelism: the contraction dims of {site.x_names} are not sharded ({_fmt(x)})"
    if len(contraction) > 1 or not x[2]:
        return (f"2-D tensor parallelism: the contraction dims are sharded over {tuple(contraction)} ({_fmt(x)}); "
                "gemm_rs reduces over one mesh axis, on the leading contraction dim")
    axis = contraction[0]
    width = mesh.shape[axis]
    if x[1]:
        return f"context parallelism: the sequence dim of the input is sharded over {x[1]} ({_fmt(x)})"
    if out[0] != x[0]:
        return f"the output's batch axes {out[0]} are not the input's {x[0]}"
    if axis in x[0]:
        return f"the tensor axis {axis!r} also shards the batch"
    if out[1] == () and out[2] == (axis,):
        layout, dimension = "hidden", 2
    elif out[1] == (axis,) and out[2] == ():
        layout, dimension = "sequence", 1
    else:
        return (f"output layout {_fmt(out)} is neither the hidden nor the sequence scatter of {axis!r} (an all-reduce "
                "keeps MaxText's dot)")
    batch, seq = x_shape[0], x_shape[1]
    n_out = kernel_shape[-1]
    if batch % _size(mesh, x[0]) or kernel_shape[0] % width or (seq if layout == "sequence" else n_out) % width:
        return (f"shapes: batch {batch} over {x[0]}, {kernel_shape[0]} contraction rows and "
                f"{'sequence ' + str(seq) if layout == 'sequence' else str(n_out) + ' features'} over {axis!r} "
                f"(size {width}) do not divide")
    rest = (None,) * (len(kernel_shape) - 2)
    b = _entry(x[0])
    out_spec = P(b, None, axis) if layout == "hidden" else P(b, axis, None)
    return _Plan(axis=axis, x_spec=P(b, None, axis, *rest), kernel_spec=P(axis, *rest, None), out_spec=out_spec,
                 dimension=dimension, layout=layout)


def _column_plan(site: _Site, x: list, kernel_shape: tuple, x_shape: tuple):
    """ag_gemm: x [B, S, E/T] ("hidden") or [B, S/T, E] ("sequence") -> [B, S, F/T, ...]."""
    mesh = site.mesh
    out = _mesh_dims(site.out_names, site)
    if len(out) != 1 + len(kernel_shape):
        return f"output logical axes {site.out_names} for an output of rank {1 + len(kernel_shape)}"
    features = [a for dims in out[2:] for a in dims]
    if not features:
        return f"no tensor parallelism: the output features of {site.out_names} are not sharded ({_fmt(out)})"
    if len(features) > 1:
        return f"2-D tensor parallelism: the output features are sharded over {tuple(features)} ({_fmt(out)})"
    axis = features[0]
    # The sharded feature dim: the first for separate projections, a later one for a fused kernel
    # ([embed, num_activations, mlp]); the local kernel block is contiguous either way.
    sharded = next(i for i, dims in enumerate(out[2:]) if dims)
    if out[0] != x[0]:
        return f"the output's batch axes {out[0]} are not the input's {x[0]}"
    if out[1]:
        return f"context parallelism: the output's sequence dim is sharded over {out[1]} ({_fmt(out)})"
    if x[1] == () and x[2] == (axis,):
        layout, dimension = "hidden", -1
    elif x[1] == (axis,) and x[2] == ():
        layout, dimension = "sequence", 1
    elif axis not in x[1] + x[2]:
        return f"the input {_fmt(x)} is replicated over {axis!r}: nothing to all-gather"
    else:
        return f"input layout {_fmt(x)} is neither the hidden nor the sequence split over {axis!r}"
    batch, seq = x_shape[0], x_shape[1]
    # Each divisibility the island needs, named with its own mesh axes.
    splits = [(f"batch {batch}", batch, x[0]), (f"output features {kernel_shape[1 + sharded]}",
                                                 kernel_shape[1 + sharded], (axis,)),
              (f"sequence {seq}" if layout == "sequence" else f"embed {kernel_shape[0]}",
               seq if layout == "sequence" else kernel_shape[0], (axis,))]
    bad = [f"{what} over {axes} (size {_size(mesh, axes)})" for what, n, axes in splits if n % _size(mesh, axes)]
    if bad:
        return "shapes do not divide: " + "; ".join(bad)
    b = _entry(x[0])
    x_spec = P(b, None, axis) if layout == "hidden" else P(b, axis, None)
    features_spec = [None] * (len(kernel_shape) - 1)
    features_spec[sharded] = axis
    return _Plan(axis=axis, x_spec=x_spec, kernel_spec=P(None, *features_spec), out_spec=P(b, None, *features_spec),
                 dimension=dimension, layout=layout)


# ----------------------------------------------------------------------------------------------
# The island
# ----------------------------------------------------------------------------------------------

def _kernel_value(dense):
    """The kernel array, as DenseGeneral.__call__ reads it (an nnx.Param, or a bridged value)."""
    kernel = dense.kernel
    if hasattr(kernel, "get_value"):
        kernel = kernel.get_value()
    elif isinstance(kernel, dict) and "value" in kernel:
        kernel = kernel["value"]
    else:
        kernel = getattr(kernel, "value", kernel)
    return getattr(kernel, "value", kernel)


def _qwix_fp8(site: _Site) -> bool:
    """quantization=fp8_gpu through qwix (use_qwix_quantization): qwix intercepts the DenseGeneral's
    dot_general and runs Flax's Fp8DirectDotGeneralOp, whose state it keeps on the DenseGeneral."""
    config = site.config
    return bool(getattr(config, "use_qwix_quantization", False)) and str(
        getattr(getattr(config, "quantization", ""), "value", getattr(config, "quantization", ""))) == "fp8_gpu"


def _fp8_op(dense, site: _Site):
    """The Flax Fp8DirectDotGeneralOp (bridged to NNX) that holds this DenseGeneral's FP8 state: MaxText's
    Fp8Quantization (quantization=fp8) or qwix's (fp8_gpu, created by the first call MaxText runs
    itself); None for a DenseGeneral without one."""
    if type(dense.quant).__name__ == "Fp8Quantization":
        return getattr(dense, "quant_dot_general", None)
    if _qwix_fp8(site):
        ops = [v for name, v in vars(dense).items() if name.startswith("_qwix_fp8_gpu_")]
        return ops[0] if len(ops) == 1 else None
    return None


def _fp8_state(dense, site: _Site) -> Optional[dict]:
    """The delayed-scaling state (Flax's names, in OVERWRITE_WITH_GRADIENT) of a DenseGeneral that
    runs Flax's FP8 dot, as {name: value}; None for any other DenseGeneral."""
    op = _fp8_op(dense, site)
    if op is None or not all(hasattr(op, name) for name in FP8_META_NAMES):
        return None
    return {name: getattr(op, name)[...] for name in FP8_META_NAMES}


def _without_qwix(fn):
    """fn with qwix's interceptions off (under qwix quantization they would turn the island's own
    dot_generals into quantised ones a second time)."""
    try:
        from qwix._src import interception
    except ImportError:
        return fn
    return interception.disable_interceptions(fn)


def _compute_kernel(dense, site: _Site):
    """The kernel in the compute dtype, still in its parameter layout (its FSDP shards), as
    DenseGeneral casts it: the island's in_specs then gather compute-dtype bytes. Without the
    constraint the partitioner moves the cast behind the gather that in_specs asks for, and the FSDP
    all-gather moves the float32 parameter (twice stock's bf16 bytes)."""
    kernel = jnp.asarray(_kernel_value(dense), dense.dtype)
    if _explicit(site):
        return kernel  # explicit sharding: the cast keeps the parameter's sharding by construction
    from maxtext.utils.sharding import logical_to_mesh_axes
    import flax.linen as nn
    rules = None if nn.get_logical_axis_rules() else site.config.logical_axis_rules
    spec = logical_to_mesh_axes(tuple(dense.kernel_axes), site.mesh, rules=rules)
    return jax.lax.with_sharding_constraint(kernel, NamedSharding(site.mesh, spec))


def _island(dense, site: _Site, plan: _Plan, inputs):
    mesh = site.mesh
    x = jnp.asarray(inputs, dense.dtype)
    kernel = _compute_kernel(dense, site)
    # fp8_gpu: the layer's Flax FP8 state goes in replicated; its gradient is its next value, as for
    # MaxText's own Fp8DirectDotGeneralOp (the train step overwrites the state with it).
    fp8 = _fp8_state(dense, site)
    meta_specs = None if fp8 is None else {name: P() for name in fp8}
    if _explicit(site):
        # Under explicit sharding shard_map takes its operands only in the in_specs layout: gather the
        # FSDP shards of the kernel (and move x) first, as MaxText's dot would.
        x = jax.sharding.reshard(x, NamedSharding(mesh, plan.x_spec))
        kernel = jax.sharding.reshard(kernel, NamedSharding(mesh, plan.kernel_spec))
        if fp8 is not None:
            fp8 = {name: jax.sharding.reshard(v, NamedSharding(mesh, P())) for name, v in fp8.items()}
    _setup_fused(mesh, plan.axis)
    if site.kind == ROW:
        local = functools.partial(_row_local, axis=plan.axis, dimension=plan.dimension, config=_state.gemm_rs_config)
    else:
        local = functools.partial(_column_local, axis=plan.axis, dimension=plan.dimension,
                                  config=_state.ag_gemm_config)
    island = jax.shard_map(local, mesh=mesh, in_specs=(plan.x_spec, plan.kernel_spec, meta_specs),
                           out_specs=plan.out_spec)
    return _without_qwix(island)(x, kernel, fp8)


def _row_local(x, kernel, fp8, *, axis, dimension, config):
    # [b, s, *in_local] . [*in_local, E] as the 2-D GEMM gemm_rs takes (heads and head_dim of the
    # attention output contract together: heads is the major dim, so the local block is contiguous).
    k = math.prod(kernel.shape[:-1])
    x, kernel = x.reshape(x.shape[:2] + (k,)), kernel.reshape(k, kernel.shape[-1])
    fp8_kwargs, finish = fp8_call_arguments(_WHERE, fp8, x, kernel, axis, x.dtype)
    return finish(entwine_jax.gemm_rs(x, kernel, axis_name=axis, scatter_dimension=dimension, config=config,
                                      **fp8_kwargs))


def _grouped_island(group: _Group, plan: _Plan, inputs, out_sharding):
    """The outputs of every projection of `group` from one grouped ag_gemm (in member order), or
    None when some member cannot share this plan (each then runs on its own)."""
    sites = _sites.get()
    plans = [plan]
    for module in group.members[1:]:
        other = _plan(module, sites[id(module)], inputs, out_sharding, None)
        if isinstance(other, str) or (other.axis, other.x_spec, other.dimension) != (plan.axis, plan.x_spec,
                                                                                     plan.dimension):
            return None
        plans.append(other)
    if len({m.dtype for m in group.members}) != 1 or any(_fp8_op(m, sites[id(m)]) is not None
                                                          for m in group.members):
        # FP8 projections keep a delayed-scaling state each: they run one island each.
        return None
    first = sites[id(group.members[0])]
    mesh = first.mesh
    x = jnp.asarray(inputs, group.members[0].dtype)
    kernels = [_compute_kernel(m, sites[id(m)]) for m in group.members]
    if _explicit(first):
        x = jax.sharding.reshard(x, NamedSharding(mesh, plan.x_spec))
        kernels = [jax.sharding.reshard(k, NamedSharding(mesh, p.kernel_spec)) for k, p in zip(kernels, plans)]
    _setup_fused(mesh, plan.axis)
    local = functools.partial(_grouped_local, axis=plan.axis, dimension=plan.dimension, config=_state.ag_gemm_config)
    return jax.shard_map(local, mesh=mesh, in_specs=(plan.x_spec, *(p.kernel_spec for p in plans)),
                         out_specs=tuple(p.out_spec for p in plans))(x, *kernels)


def _grouped_local(x, *kernels, axis, dimension, config):
    # One gather of x for every kernel [E, F_i local, *rest_i]: ag_gemm's group of 2-D kernels.
    ys = entwine_jax.ag_gemm(x, tuple(k.reshape(k.shape[0], -1) for k in kernels), axis_name=axis,
                             gather_dimension=dimension, config=config)
    return tuple(y.reshape(y.shape[:2] + k.shape[1:]) for y, k in zip(ys, kernels))


def _column_local(x, kernel, fp8, *, axis, dimension, config):
    # [b, s, E(/T)] . [E, F_local, *rest] -> [b, s, F_local, *rest] through the 2-D [E, F_local * rest].
    out_features = kernel.shape[1:]
    kernel = kernel.reshape(kernel.shape[0], -1)
    fp8_kwargs, finish = fp8_call_arguments(_WHERE, fp8, x, kernel, axis, x.dtype)
    y = finish(entwine_jax.ag_gemm(x, kernel, axis_name=axis, gather_dimension=dimension, config=config,
                                   **fp8_kwargs))
    return y.reshape(y.shape[:2] + out_features)


def _setup_fused(mesh, axis) -> None:
    """entwine_jax.setup for the fused path (a no-op without the extension): MaxText traces under
    jax.set_mesh, but not every trace of a model is (e.g. nnx.eval_shape)."""
    key = (id(mesh), axis)
    if key in _state.setup_done:
        return
    _state.setup_done.add(key)
    if entwine_jax.extension_status()[0]:
        entwine_jax.setup(mesh, axis)


# ----------------------------------------------------------------------------------------------
# The routed experts: RoutedMoE.sparse_matmul through moe_dispatch_gemm / moe_gemm_combine
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _MoePlan:
    axis: str          # the expert axis EP
    x_spec: P          # tokens and router logits [batch, sequence, *]: MaxText's own in_specs
    w_spec: P          # every expert kernel [E, *, *]: the experts over EP, the rest whole
    out_spec: P
    batch_axes: tuple  # the mesh axes of the tokens' batch and sequence dims (the bias update's psum)
    flag_axes: tuple   # every mesh axis the in_specs name: moe_has_overflow's layout, as MaxText's


def _sparse_matmul(original, self, inputs, gate_logits, pre_bias_logits, w0_kernel, w1_kernel, wo_kernel, w0_bias,
                   w1_bias, wo_bias, input_ids=None, forced_routed_experts=None):
    plan = _moe_plan(self, inputs, (w0_kernel, w1_kernel, wo_kernel), input_ids, forced_routed_experts)
    if isinstance(plan, str):
        _keep(MOE_SITE, plan)
        return original(self, inputs, gate_logits, pre_bias_logits, w0_kernel, w1_kernel, wo_kernel, w0_bias,
                        w1_bias, wo_bias, input_ids=input_ids, forced_routed_experts=forced_routed_experts)
    _report().routed[MOE_SITE] += 1
    return _moe_island(self, plan, inputs, gate_logits, pre_bias_logits, w0_kernel, w1_kernel, wo_kernel)


def _moe_plan(module, inputs, kernels, input_ids, forced_routed_experts):
    """The island's layout, or the reason (a str) to keep MaxText's sparse_matmul. Each rule keeps a
    configuration whose math or layout the ops do not reproduce exactly (docs/maxtext.md, "MoE")."""
    from maxtext.common import common_types
    cfg, mesh = module.config, module.mesh
    if not _state.moe:
        return "moe=False (the default; enable(moe=True) routes the routed experts)"
    # Quantised experts (AQT, qwix, FP8 weights with scales, serve mode) run MaxText's quantised GEMMs.
    if module.quant is not None:
        return f"quantised experts (quant={type(module.quant).__name__})"
    if getattr(cfg, "use_qwix_quantization", False) and getattr(cfg, "quantization", ""):
        return f"qwix quantization {cfg.quantization!r}"
    if any(getattr(module, name, None) is not None for name in ("wi_scale", "wi_0_scale", "wo_scale")) or any(
            not isinstance(k, jax.Array) for k in kernels):
        return "quantised expert weights (scales or a quantised array)"
    if cfg.mlp_bias:
        return "mlp_bias: the MoE ops take no bias"
    if cfg.use_ring_of_experts:
        return ("use_ring_of_experts: MaxText's all-gather / psum_scatter schedule of the experts, not an "
                "all-to-all dispatch")
    if cfg.num_moe_emb_chunks > 0:
        return f"num_moe_emb_chunks={cfg.num_moe_emb_chunks}: MaxText's chunked gather over the embedding"
    if cfg.use_random_routing:
        return "use_random_routing (a debug router)"
    if module.is_hash_routing or input_ids is not None:
        return "hash routing (token ids pick the experts: DeepSeek-V4's first layers)"
    if forced_routed_experts is not None:
        return "forced_routed_experts (expert ids given by the caller)"
    if cfg.decoder_block == common_types.DecoderBlockType.LLAMA4 and module.num_experts_per_tok != 1:
        return (f"llama4 scales each copy of a token by its router score before the experts; with "
                f"num_experts_per_tok={module.num_experts_per_tok} > 1 the copies differ, and the op sends tokens")
    factor = module.get_ragged_buffer_factor()
    if factor > 0 and not getattr(module, "force_dropless", False):
        return (f"ragged_buffer_factor={factor}: MaxText drops the tokens past its buffer by source rank, the ops "
                "by expert; the dropped tokens would differ (dropless runs are routed)")
    axis = module._expert_parallelism_name
    if not isinstance(axis, str):
        return f"expert parallelism over {axis} (more than one mesh axis)"
    width = mesh.shape.get(axis, 1)
    if width == 1:
        return f"no expert parallelism: the expert axis {axis!r} has size 1 (nothing to dispatch across ranks)"
    if module.num_experts % width:
        return f"num_experts {module.num_experts} over {axis!r} (size {width}) does not divide"
    if cfg.shard_exp_on_fsdp or cfg.use_2d_fsdp_sharding or cfg.use_batch_split_schedule:
        return ("shard_exp_on_fsdp / use_2d_fsdp_sharding / use_batch_split_schedule: MaxText's own layouts of the "
                "experts")
    # MaxText gives sparse_matmul's kernels (exp, None, mlp_no_fsdp) minus fsdp: any mesh axis of size > 1 on
    # the hidden dim is expert tensor parallelism (a psum_scatter over 'tensor' after the experts).
    hidden = _axes(module._logical_to_mesh_axes((None, None, "mlp_no_fsdp"))[2], mesh)
    hidden = tuple(a for a in hidden if a != "fsdp")
    if hidden:
        return (f"expert tensor parallelism: the experts' hidden dim is sharded over {hidden}; the MoE ops take "
                "whole experts")
    if inputs.shape[0] == 1:
        return "a batch of 1 (decoding: MaxText replicates the tokens over the experts)"
    x_spec = module._logical_to_mesh_axes(_MOE_TOKENS)
    x_dims = [_axes(e, mesh) for e in x_spec]
    if axis not in x_dims[0]:
        return f"tokens not sharded over {axis!r} (their batch is over {x_dims[0]}): nothing to dispatch"
    if x_dims[2]:
        return f"the tokens' embed dim is sharded over {x_dims[2]}"
    out_spec = module._logical_to_mesh_axes(_MOE_OUT)
    out_dims = [_axes(e, mesh) for e in out_spec]
    if out_dims[:2] != x_dims[:2] or out_dims[2]:
        return f"output layout {_fmt(out_dims)} is not the tokens' {_fmt(x_dims)}"
    batch, seq = inputs.shape[0], inputs.shape[1]
    if batch % _size(mesh, x_dims[0]) or seq % _size(mesh, x_dims[1]):
        return (f"shapes: batch {batch} over {x_dims[0]} or sequence {seq} over {x_dims[1]} does not divide")
    from maxtext.layers.moe import _batch_axis_names
    flag_axes = tuple(a for a in mesh.axis_names if any(a in _axes_all(e) for e in tuple(x_spec)) or a == axis)
    return _MoePlan(axis=axis, x_spec=x_spec, w_spec=P(axis, None, None), out_spec=out_spec,
                    batch_axes=_batch_axis_names(x_spec), flag_axes=flag_axes)


def _axes_all(entry) -> tuple:
    """Every mesh axis a PartitionSpec entry names, size 1 included."""
    if entry is None or entry == P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _moe_island(module, plan: _MoePlan, inputs, gate_logits, pre_bias_logits, w0, w1, wo):
    """sparse_matmul's contract (output, load-balance loss, bias updates) from one shard_map over the
    whole mesh, as MaxText's own: per rank, MaxText's router (get_topk) on this rank's tokens, then
    moe_dispatch_gemm on wi_0|wi_1, MaxText's activation (apply_ffn_activation), moe_gemm_combine
    with MaxText's weights, over the expert axis."""
    from maxtext.layers import moe as mt_moe
    cfg, mesh = module.config, module.mesh
    use_megatron = (cfg.load_balance_loss_weight > 0.0 and not module.is_hash_routing
                    and mt_moe.uses_megatron_seq_aux_loss(cfg))
    logical = _MOE_TOKENS
    inputs = module._maybe_shard_with_pspec(inputs, plan.x_spec, logical_axes=logical)
    gate_logits = module._maybe_shard_with_pspec(gate_logits, plan.x_spec, logical_axes=logical)
    pre_spec = None if pre_bias_logits is None else plan.x_spec
    if pre_bias_logits is not None:
        pre_bias_logits = module._maybe_shard_with_pspec(pre_bias_logits, plan.x_spec, logical_axes=logical)
    # The experts whole on each EP rank (MaxText's in_specs gather them over fsdp the same way), cast first.
    w0, w1, wo = (module._maybe_shard_with_pspec(_expert_kernel(module, w, axes), plan.w_spec)
                  for w, axes in ((w0, module.wi_kernel_axes), (w1, module.wi_kernel_axes), (wo, module.wo_kernel_axes)))
    _setup_fused(mesh, plan.axis)
    local = functools.partial(_moe_local, module=module, plan=plan, compute_lb=not use_megatron,
                              config=_state.moe_config)
    island = jax.shard_map(local, mesh=mesh, in_specs=(plan.x_spec, plan.x_spec, pre_spec, plan.w_spec, plan.w_spec,
                                                       plan.w_spec),
                           out_specs=(plan.out_spec, P(), P(), P(plan.flag_axes)), check_vma=cfg.check_vma)
    output, lb_loss, bias_updates, overflow = island(inputs, gate_logits, pre_bias_logits, w0, w1, wo)
    if use_megatron:
        # MaxText computes the sigmoid router's sequence-wise loss once on the global logits, after its shard_map.
        lb_loss = module.megatron_seq_aux_loss(pre_bias_logits if pre_bias_logits is not None else gate_logits)
    from flax import nnx
    # MaxText's sparse_matmul sows each device's overflow flag (its train step reads them under
    # moe_dropless_fallback=step); dropless, the ops drop nothing.
    module.sow(nnx.Intermediate, "moe_has_overflow", overflow)
    return output, lb_loss, bias_updates


def _expert_kernel(module, kernel, kernel_axes):
    """An expert kernel in the compute dtype, still in its parameter layout (as _compute_kernel): without the
    constraint the partitioner casts after the FSDP gather and moves the float32 parameter (twice the bytes)."""
    kernel = jnp.asarray(kernel, module.dtype)
    if _explicit(module):
        return kernel  # explicit sharding: the cast keeps the parameter's sharding by construction
    from maxtext.utils.sharding import logical_to_mesh_axes
    import flax.linen as nn
    rules = None if nn.get_logical_axis_rules() else module.config.logical_axis_rules
    spec = logical_to_mesh_axes(tuple(kernel_axes), module.mesh, rules=rules)
    return jax.lax.with_sharding_constraint(kernel, NamedSharding(module.mesh, spec))


def _moe_local(x, logits, pre_bias_logits, w0, w1, wo, *, module, plan: _MoePlan, compute_lb: bool, config):
    """One rank of the island: MaxText's permute's router half (top-k, load-balance loss, bias-update
    counts), then the two ops in place of its sort, ragged_all_to_all, ragged_dot and unpermute."""
    from maxtext.common import common_types
    from maxtext.layers import moe as mt_moe
    cfg = module.config
    b, s, h = x.shape
    # MaxText's router, unchanged: softmax / sigmoid scores, DeepSeek's bias and group limit, norm_topk_prob,
    # routed_scaling_factor, per-expert scales.
    weights, experts = module.get_topk(logits, pre_bias_logits)
    lb_loss = None
    if compute_lb and cfg.load_balance_loss_weight > 0.0 and not module.is_hash_routing:
        probs = pre_bias_logits if pre_bias_logits is not None else logits
        lb_loss = module.load_balance_loss(experts, jax.nn.softmax(probs.astype(jnp.float32), axis=-1).astype(
            module.dtype))
    bias_updates = None
    if module.should_update_load_balance():
        counts = mt_moe.calculate_expert_counts(experts, cfg.num_experts, axis_names=plan.batch_axes)
        # As sparse_matmul's finalize_bias_updates: raw counts under gradient accumulation, else the sign update.
        bias_updates = counts if getattr(cfg, "gradient_accumulation_steps", 1) > 1 else (
            mt_moe.load_balance_updates_from_counts(counts, cfg.num_experts, cfg.routed_bias_update_rate))
    tokens = x.reshape(b * s, h)
    k = experts.shape[-1]
    weights = weights.reshape(b * s, k)
    if cfg.decoder_block == common_types.DecoderBlockType.LLAMA4:
        # Llama 4 (one expert per token): the token times the sigmoid of its score goes in, weight 1 comes out.
        tokens = tokens * jax.nn.sigmoid(weights.astype(jnp.float32))
        weights = jnp.ones_like(weights)
    tokens = tokens.astype(module.dtype)
    if cfg.float32_weight_sum:
        weights = weights.astype(jnp.float32)
    f = w0.shape[-1]
    # gate|up as one dispatch weight: one transfer of the tokens for both GEMMs.
    y, handle = entwine_jax.moe_dispatch_gemm(tokens, experts.reshape(b * s, k).astype(jnp.int32),
                                              jnp.concatenate([w0, w1], axis=-1).astype(module.dtype),
                                              axis_name=plan.axis, config=config)
    # y's rows in the ops' layout (whatever it is), each row's gate then up columns.
    layer_w0 = adc.checkpoint_name(adc.checkpoint_name(y[..., :f], "mlpwi_0"), "moe_mlpwi_0")
    layer_w1 = adc.checkpoint_name(y[..., f:], "moe_mlpwi_1")
    hidden = module.apply_ffn_activation(layer_w0, layer_w1)
    out = entwine_jax.moe_gemm_combine(hidden, wo.astype(module.dtype), weights, handle, axis_name=plan.axis,
                                       config=config)
    dropped = getattr(handle, "dropped", None)
    overflow = jnp.zeros((1,), jnp.bool_) if dropped is None else jnp.reshape(dropped > 0, (1,))
    return out.reshape(b, s, h).astype(module.dtype), lb_loss, bias_updates, overflow
