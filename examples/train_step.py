"""A Llama-style decoder trained with entwine_jax.layers on a dp x tp mesh, checked against plain XLA.

The model: token embedding, decoder blocks (RMSNorm, causal attention with rotary embeddings,
RMSNorm, SwiGLU MLP), a final RMSNorm and the vocabulary head. Tensor parallel over "tp" with
sequence parallelism (the Entwine paper's layout): the residual stream of each device holds its
slice of tokens [T/tp, D], and the norms run on that slice. The column-parallel q/k/v and gate/up
projections need every token of the dp shard, on their heads / hidden slice; the row-parallel
attention output and MLP down projections (entwine_jax.gemm_rs: GEMM + ReduceScatter) return to
[T/tp, D]. Data parallel over "dp": tokens split, parameters replicated.

Two ways to gather the tokens for the column-parallel projections:
- presets "tiny", "gpu": one plain jax.lax.all_gather per sub-block feeds q/k/v (gate/up), which
  are plain XLA dots; their backward is a reduce-scatter XLA adds.
- presets "sp-tiny", "sp-gpu" (Config.fused_gather): the projections gather the tokens themselves,
  entwine_jax.ag_gemm (AllGather + GEMM), one per sub-block on the q/k/v (gate/up) kernels
  concatenated. ag_gemm's backward is a gemm_rs and gemm_rs's an ag_gemm, so every tensor-parallel
  collective of a block, forward and backward, is one of the two fused ops. The program checks it
  before training with the collective census of the compiled train step (entwine_jax.census,
  check_census): on every platform no collective over tp outside the ops (their name scopes) and
  the gradient all-reduce (the named scope reduce_gradients); on GPUs also the custom calls
  entwine_ag_gemm and entwine_gemm_rs, 4 of each per block, and no XLA all-gather /
  reduce-scatter left. Exits 1 when a check fails.

The whole train step (forward, backward, optax.adamw update) is one jax.shard_map under jax.jit.
Each rank differentiates its own loss with respect to its own copy of the parameters, and
reduce_gradients then does every gradient all-reduce of the step in one place: over dp for all
parameters, over tp too for the tp-replicated norms, embedding and head (their gradients are
partial sums over this rank's tokens). The out_specs, which do not mention dp, make a missing sum
a trace-time error. The same model written with plain jax.numpy on unsharded arrays is trained in
lockstep from the same initial parameters and batches: both loss curves are printed and must agree
within TOL[dtype]; exits 1 on mismatch.

Runs anywhere: on CPU it forces 8 host devices (dp=2 x tp=4; the ops take their XLA path); on
GPUs it uses them all (tp = up to 8). The fused kernels need Hopper GPUs, bf16/fp16 and aligned
shapes (the "gpu" and "sp-gpu" presets); elsewhere the ops fall back and log why once per call site.

    python examples/train_step.py [--steps 5] [--dtype float32|bfloat16]
                                  [--preset tiny|gpu|sp-tiny|sp-gpu]
"""
import argparse
import collections
import dataclasses
import logging
import math
import os
import sys
import time

# Before jax is imported: 8 CPU devices unless the caller chose a count (harmless on GPUs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import entwine_jax  # noqa: E402
from entwine_jax import census, layers  # noqa: E402

# Max |loss - reference loss| / max(reference loss, 1) over all steps (a loss below 1 is compared
# absolutely: its relative difference says nothing about the model once it has collapsed). float32: both models compute in
# fp32 and differ only in summation order (measured on CPU, tiny preset: 2e-7 over 5 steps, 7e-6
# over 8); adamw's normalised updates amplify that slowly over the steps. bfloat16: the sharded
# model computes in bf16 (its params stay fp32) against the fp32 reference, so this bounds bf16
# rounding (measured: 1.3e-3 over 5 steps, 8e-3 over 10). Negative controls, 3 steps: rows kept
# by the wrong tp rank move the loss by 0.9; a 1% error in every row-parallel output by 2e-3,
# which only the float32 tolerance catches.
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 128
    heads: int = 8
    head_dim: int = 16
    d_ff: int = 256
    layers: int = 2
    seq: int = 32
    batch_per_dp: int = 2
    lr: float = 1e-2
    dtype: str = "float32"  # compute dtype of the sharded model; parameters are float32
    # True: the column-parallel projections gather the sequence with entwine_jax.ag_gemm; False: one
    # plain all_gather per sub-block (see the module docstring).
    fused_gather: bool = False


PRESETS = {
    "tiny": Config(),
    # Shapes the fused kernels accept (rows per tp group a multiple of tp*128, N and K_local
    # multiples of 128) for tp <= 8.
    # The task is learnt within a step or two, after which adamw overshoots and the loss swings
    # between ~0 and ~3.7 (lr 1e-2 on 4x H200: 7.4, 3e-5, 3.8; lr 1e-3: 7.4, 0.88, 3.6, 0.006,
    # 3.7): hence the absolute comparison below a loss of 1.
    "gpu": Config(vocab=1024, d_model=1024, heads=8, head_dim=128, d_ff=4096, layers=2, seq=1024, batch_per_dp=2,
                  lr=1e-3, dtype="bfloat16"),
}
# Sequence parallel with every tensor-parallel collective of a block in the fused ops.
PRESETS["sp-tiny"] = dataclasses.replace(PRESETS["tiny"], fused_gather=True)
PRESETS["sp-gpu"] = dataclasses.replace(PRESETS["gpu"], fused_gather=True)


# ----------------------------------------------------------------------------------------------
# The tensor-parallel model (Flax NNX + entwine_jax.layers); runs inside shard_map on local shards
# ----------------------------------------------------------------------------------------------

class RMSNorm(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))(
            rngs.params(), (dim,), jnp.float32))

    def __call__(self, x):
        return rms_norm(x, self.scale[...])


def gathered_projections(h, projections, dtype):
    """The column-parallel projections of the sequence-sharded h [T/tp, D], one ag_gemm for all of
    them: their local kernels [D, ...] concatenated on dim 1, the gather fused into the GEMM
    (gather="rows"), the output split back -> one [T, ...] per projection."""
    kernel = jnp.concatenate([p.kernel[...] for p in projections], axis=1)
    y = layers.column_parallel_linear(h, kernel, gather="rows", dtype=dtype)
    return jnp.split(y, len(projections), axis=1)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, *, rngs):
        h, dh, d, dt = cfg.heads, cfg.head_dim, cfg.d_model, cfg.dtype
        qkv = dict(kernel_axes=("embed", "heads", "kv"), dtype=dt, rngs=rngs)
        self.q = layers.ColumnParallelLinear(d, (h, dh), **qkv)
        self.k = layers.ColumnParallelLinear(d, (h, dh), **qkv)
        self.v = layers.ColumnParallelLinear(d, (h, dh), **qkv)
        self.out = layers.RowParallelLinear((h, dh), d, kernel_axes=("heads", "kv", "embed"), dtype=dt, rngs=rngs)
        self.seq, self.dtype, self.fused_gather = cfg.seq, dt, cfg.fused_gather

    def __call__(self, h):
        # h: [T, D], every token of this dp shard, sequences back to back (fused_gather: its
        # [T/tp, D] slice, gathered by the projection) -> [T/tp, D].
        if self.fused_gather:
            q, k, v = gathered_projections(h, (self.q, self.k, self.v), self.dtype)
        else:
            q, k, v = (p(h) for p in (self.q, self.k, self.v))
        t = q.shape[0]
        q, k, v = (a.reshape(t // self.seq, self.seq, *a.shape[1:]) for a in (q, k, v))
        o = causal_attention(rope(q), rope(k), v)  # [B, S, heads/tp, Dh]
        return self.out(o.reshape(t, *o.shape[2:]))


class MLP(nnx.Module):
    def __init__(self, cfg: Config, *, rngs):
        d, f, dt = cfg.d_model, cfg.d_ff, cfg.dtype
        self.gate = layers.ColumnParallelLinear(d, f, dtype=dt, rngs=rngs)
        self.up = layers.ColumnParallelLinear(d, f, dtype=dt, rngs=rngs)
        self.down = layers.RowParallelLinear(f, d, dtype=dt, rngs=rngs)
        self.dtype, self.fused_gather = dt, cfg.fused_gather

    def __call__(self, h):
        # h: [T, D] (fused_gather: [T/tp, D]) -> [T/tp, D]
        if self.fused_gather:
            g, u = gathered_projections(h, (self.gate, self.up), self.dtype)
        else:
            g, u = self.gate(h), self.up(h)
        return self.down(jax.nn.silu(g) * u)


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, rngs):
        self.attn_norm, self.attn = RMSNorm(cfg.d_model, rngs=rngs), Attention(cfg, rngs=rngs)
        self.mlp_norm, self.mlp = RMSNorm(cfg.d_model, rngs=rngs), MLP(cfg, rngs=rngs)
        self.fused_gather = cfg.fused_gather

    def __call__(self, x):
        # x: [T/tp, D] (sequence parallel); the norms run on it.
        if self.fused_gather:
            # The projections gather the normed tokens themselves (ag_gemm).
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))
        # One plain all-gather per sub-block feeds all its projections.
        gather = lambda a: jax.lax.all_gather(a, "tp", axis=0, tiled=True)
        x = x + self.attn(gather(self.attn_norm(x)))
        return x + self.mlp(gather(self.mlp_norm(x)))


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, *, rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Param(init(rngs.params(), (cfg.vocab, cfg.d_model), jnp.float32))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.d_model, rngs=rngs)
        head_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab"))
        self.head = nnx.Param(head_init(rngs.params(), (cfg.d_model, cfg.vocab), jnp.float32))
        self.dtype = cfg.dtype

    def __call__(self, tokens):
        # tokens: [T/tp] -> logits [T/tp, vocab] in fp32.
        x = self.embed[...][tokens].astype(self.dtype)
        for block in self.blocks:
            x = block(x)
        return jnp.dot(self.norm(x), self.head[...].astype(self.dtype), preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Math shared by both models (shape-agnostic: local shards or whole arrays)
# ----------------------------------------------------------------------------------------------

def rms_norm(x, scale, eps=1e-6):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def rope(x, base=10000.0):
    # x: [B, S, heads, Dh]; rotate pairs (i, i + Dh/2) by position-dependent angles.
    s, dh = x.shape[1], x.shape[-1]
    freq = base ** (-jnp.arange(dh // 2, dtype=jnp.float32) / (dh // 2))
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def causal_attention(q, k, v):
    # q, k, v: [B, S, heads, Dh]; fp32 scores and softmax.
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, preferred_element_type=jnp.float32).astype(v.dtype)


def cross_entropy(logits, targets):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


# ----------------------------------------------------------------------------------------------
# The plain-XLA reference: the same model on unsharded arrays, jax.numpy only, fp32
# ----------------------------------------------------------------------------------------------

def reference_loss(p, tokens, targets, cfg: Config):
    """p: the pure-dict parameters (global arrays); tokens, targets: [B*S] -> scalar loss."""
    x = p["embed"][tokens]
    for blk in p["blocks"].values():
        h = rms_norm(x, blk["attn_norm"]["scale"])
        q, k, v = (jnp.einsum("td,dhe->the", h, blk["attn"][n]["kernel"]).reshape(-1, cfg.seq, cfg.heads,
                                                                                    cfg.head_dim)
                   for n in ("q", "k", "v"))
        o = causal_attention(rope(q), rope(k), v).reshape(-1, cfg.heads, cfg.head_dim)
        x = x + jnp.einsum("the,hed->td", o, blk["attn"]["out"]["kernel"])
        h = rms_norm(x, blk["mlp_norm"]["scale"])
        m = blk["mlp"]
        x = x + (jax.nn.silu(h @ m["gate"]["kernel"]) * (h @ m["up"]["kernel"])) @ m["down"]["kernel"]
    return cross_entropy(rms_norm(x, p["norm"]["scale"]) @ p["head"], targets)


# ----------------------------------------------------------------------------------------------
# Where the collectives over tp come from (the sequence-parallel presets' checks)
# ----------------------------------------------------------------------------------------------

OPS = ("ag_gemm", "gemm_rs")


def check_census(c: census.Census, n_layers: int, *, fused: bool, axis: str = "tp") -> tuple[list, list]:
    """(report lines, problems) for the census of the compiled train step (entwine_jax.census).

    Every collective over `axis` must be one of the fused ops' (the census' owner: the op whose
    custom call it is or whose XLA reference issued it, entwine_jax.opspec; an op's backward, a call
    of the other op, counts as the other op) or a gradient all-reduce (under the named scope
    reduce_gradients; XLA's all-reduce combiner keeps its metadata). A collective whose device
    groups match no mesh axis counts as one over `axis`.

    fused=False (the ops may take their XLA path, as on CPU): the ops' XLA collectives are theirs.
    fused=True (GPUs): the ops must be their custom calls, entwine_ag_gemm and entwine_gemm_rs,
    4 of each per block (2 forward, 2 backward: each op's backward is one call of the other), and
    no XLA collective over `axis` is left but the gradient all-reduce."""
    grads = c.select(axis=axis, kind="all-reduce", scope="reduce_gradients")
    # XLA collectives (not custom calls) that may run over `axis`, but the gradient all-reduce.
    over = [x for x in c.select(custom_call=False) if (x.axes is None or axis in x.axes) and x not in grads]
    ops = c.select(owner=OPS)
    by = [f"{owner} {n} {kind}" for owner in OPS for kind, n in ops.select(owner=owner).counts("kind").items()]
    by.append(f"reduce_gradients {grads.count} all-reduce")
    report = [f"HLO: {c.select(axis=axis).count} collective(s) over {axis!r}; by ag_gemm, gemm_rs (an op's backward "
              f"counts as the other op) and reduce_gradients: {', '.join(by)}"]
    problems = [f"HLO: {x.kind} over {x.group} outside ag_gemm, gemm_rs and the gradient all-reduce: %{x.name} "
                f"{x.shape} ({x.op_name or 'no op_name'})" for x in over if x.owner == "xla"]
    if not ops:
        problems.append("HLO: no collective of ag_gemm or gemm_rs: the check saw nothing to attribute")
    if fused:
        calls = c.select(custom_call=True).counts("owner")
        expected = 4 * n_layers
        report.append(f"HLO: {calls.get('ag_gemm', 0)} entwine_ag_gemm and {calls.get('gemm_rs', 0)} entwine_gemm_rs "
                      f"custom calls, {grads.count} gradient all-reduce(s) over {axis!r}")
        problems += [f"HLO: {calls.get(op, 0)} entwine_{op} custom calls, expected {expected} (2 forward + 2 backward "
                     "per block; ENTWINE_PRINT_CONFIG=1 prints each call's path and why it fell back)"
                     for op in OPS if calls.get(op, 0) != expected]
        problems += [f"HLO: {x.kind} over {x.group} by {x.owner}'s XLA path, not its custom call: %{x.name} {x.shape} "
                     f"({x.op_name or 'no op_name'})" for x in over if x.owner != "xla"]
    return report, problems


def check_collectives(cfg: Config, mesh, train_step, args) -> tuple[list, list]:
    """The sequence-parallel presets' checks (module docstring, check_census) on the census of the
    compiled train step; on GPUs the ops must be their custom calls. Returns (report lines, problems)."""
    on_gpu = mesh.devices.flat[0].platform == "gpu"
    c = census.collectives(train_step, *args, mesh=mesh)
    report, problems = check_census(c, cfg.layers, fused=on_gpu)
    if on_gpu and mesh.shape["tp"] == 1:
        problems.append("HLO: tp = 1, nothing to gather or scatter: the ops run XLA's GEMM alone (the fused "
                        "path needs 2 or more GPUs)")
    return report, problems


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def _spec_axes(spec) -> set:
    return {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}


def reduce_gradients(loss, grads, specs, axes=("dp", "tp")):
    """The global mean loss and its gradients from this rank's: every gradient all-reduce of the step.

    loss: this rank's mean over its tokens; grads: the gradient of every rank's loss summed with
    respect to this rank's copy of each parameter. A gradient is summed over the axes its parameter
    is replicated on (specs: the parameters' PartitionSpecs) and divided by the number of ranks
    (equal token shards)."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    with jax.named_scope("reduce_gradients"):
        grads = jax.tree.map(lambda g, s: jax.lax.psum(g, tuple(a for a in axes if a not in _spec_axes(s))) / n,
                             grads, specs)
        return jax.lax.pmean(loss, axes), grads


def make_mesh(n_devices: int, platform: str):
    """dp x tp over all devices: tp = 4 on CPU (8 forced devices: 2 x 4), up to 8 on GPUs."""
    tp = min(n_devices, 4 if platform == "cpu" else 8)
    while n_devices % tp:
        tp -= 1
    return jax.make_mesh((n_devices // tp, tp), ("dp", "tp"))


def make_batch(rng: np.random.Generator, cfg: Config, dp: int):
    """Random walks through a fixed permutation of the vocabulary (learnable: the next token is a
    function of the current one); returns tokens and next-token targets, [B*S] each, sequences
    back to back."""
    perm = np.random.default_rng(1234).permutation(cfg.vocab)
    seq = np.empty((cfg.batch_per_dp * dp, cfg.seq + 1), np.int64)
    seq[:, 0] = rng.integers(0, cfg.vocab, size=seq.shape[0])
    for i in range(cfg.seq):
        seq[:, i + 1] = perm[seq[:, i]]
    return seq[:, :-1].reshape(-1).astype(np.int32), seq[:, 1:].reshape(-1).astype(np.int32)


def check_config(cfg: Config, dp: int, tp: int) -> None:
    rows = cfg.batch_per_dp * cfg.seq
    for name, value in (("heads", cfg.heads), ("d_ff", cfg.d_ff), ("rows per dp shard (batch_per_dp*seq)", rows)):
        if value % tp:
            raise ValueError(f"train_step: {name} ({value}) must be divisible by tp ({tp})")


def build(cfg: Config, mesh, *, seed: int = 0):
    """Returns (train_step, ref_step, state): the jitted sharded and reference steps and the
    initial (params, opt_state, ref_params, ref_opt_state)."""
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    check_config(cfg, dp, tp)
    rules = layers.DEFAULT_LOGICAL_AXIS_RULES
    # Created at global shape; eager sharding places every parameter as the rules say.
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        model = Decoder(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    param_specs = nnx.to_pure_dict(layers.partition_specs(state, rules))
    params = nnx.to_pure_dict(state)
    tx = optax.adamw(cfg.lr, weight_decay=0.01)
    with jax.set_mesh(mesh):
        opt_state = tx.init(params)
    opt_specs = optax.tree_map_params(tx, lambda _, s: s, opt_state, param_specs, transform_non_params=lambda _: P(),
                                      is_leaf=lambda s: isinstance(s, P))
    # Tokens, sequences back to back: dp splits whole sequences, tp splits each dp shard's rows.
    tok_spec = P(("dp", "tp"))

    def local_step(params, opt_state, tokens, targets):
        # This rank's own copy of each parameter (varying over every mesh axis): differentiating
        # this rank's loss then gives partial gradients, which reduce_gradients sums, instead of AD
        # inserting the sums wherever a replicated parameter meets sharded activations.
        local = jax.tree.map(lambda p, s: jax.lax.pcast(p, tuple(a for a in ("dp", "tp") if a not in _spec_axes(s)),
                                                        to="varying"), params, param_specs)

        def loss_fn(params):
            return cross_entropy(nnx.merge(graphdef, params)(tokens), targets)

        loss, grads = jax.value_and_grad(loss_fn)(local)
        loss, grads = reduce_gradients(loss, grads, param_specs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(jax.shard_map(local_step, mesh=mesh,
                                       in_specs=(param_specs, opt_specs, tok_spec, tok_spec),
                                       out_specs=(param_specs, opt_specs, P())), donate_argnums=(0, 1))

    # The reference: one device, whole arrays, fp32.
    ref_tx = optax.adamw(cfg.lr, weight_decay=0.01)
    dev = jax.devices()[0]
    ref_params = jax.device_put(jax.tree.map(np.asarray, params), dev)
    # Committed to the device like the step's outputs, so the second step does not recompile.
    ref_opt_state = jax.device_put(ref_tx.init(ref_params), dev)

    @jax.jit
    def ref_step(p, s, tokens, targets):
        loss, grads = jax.value_and_grad(reference_loss)(p, tokens, targets, dataclasses.replace(cfg, dtype="float32"))
        updates, s = ref_tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    def place(tokens, targets):
        sharding = jax.sharding.NamedSharding(mesh, tok_spec)
        return jax.device_put(tokens, sharding), jax.device_put(targets, sharding)

    return train_step, ref_step, place, (params, opt_state, ref_params, ref_opt_state)


class TrainResult(collections.namedtuple("TrainResult", "losses ref_losses diff report problems")):
    """losses, ref_losses: per step; diff: the max loss difference (relative, absolute below 1);
    report, problems: the lines of check_collectives (empty without check=True)."""


def train(cfg: Config, steps: int, *, seed: int = 0, verbose: bool = True, check: bool = False) -> TrainResult:
    """Trains both models for `steps` steps; with check=True runs check_collectives on the train
    step first (with the first batch)."""
    mesh = make_mesh(len(jax.devices()), jax.devices()[0].platform)
    dp = mesh.shape["dp"]
    train_step, ref_step, place, (params, opt_state, ref_params, ref_opt_state) = build(cfg, mesh, seed=seed)
    rng = np.random.default_rng(seed)
    losses, ref_losses, report, problems = [], [], [], []
    for step in range(steps):
        tokens, targets = make_batch(rng, cfg, dp)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            if check and step == 0:
                args = (params, opt_state, *place(tokens, targets))
                report, problems = check_collectives(cfg, mesh, train_step, args)
                if verbose:
                    print("\n".join(report + problems), flush=True)
                t0 = time.perf_counter()
            params, opt_state, loss = train_step(params, opt_state, *place(tokens, targets))
        ref_params, ref_opt_state, ref_loss = ref_step(ref_params, ref_opt_state, tokens, targets)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
        if verbose:
            print(f"step {step}: loss {losses[-1]:.6f}  reference {ref_losses[-1]:.6f}  "
                  f"({time.perf_counter() - t0:.2f} s)", flush=True)
    diff = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(losses, ref_losses))
    return TrainResult(losses, ref_losses, diff, report, problems)


def main(argv=None) -> int:
    on_gpu = jax.devices()[0].platform == "gpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if on_gpu else "tiny")
    ap.add_argument("--dtype", choices=sorted(TOL), default=None,
                    help="compute dtype of the sharded model (default: the preset's; the fused path needs bfloat16)")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]
    if args.dtype:
        cfg = dataclasses.replace(cfg, dtype=args.dtype)
    # Says once per call site why an op takes the XLA path (CPU, float32, shapes, no extension).
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("entwine_jax").setLevel(logging.INFO)

    mesh = make_mesh(len(jax.devices()), jax.devices()[0].platform)
    print(f"mesh dp={mesh.shape['dp']} x tp={mesh.shape['tp']} on {jax.devices()[0].platform} "
          f"({jax.devices()[0].device_kind}); extension: {entwine_jax.extension_status()[1]}")
    print(f"preset {args.preset}: {cfg}")
    t0 = time.perf_counter()
    # The sequence-parallel presets check where their collectives come from before the first step.
    losses, ref_losses, diff, _, problems = train(cfg, args.steps, check=cfg.fused_gather)
    tol = TOL[cfg.dtype]
    print(f"losses    {' '.join(f'{v:.5f}' for v in losses)}")
    print(f"reference {' '.join(f'{v:.5f}' for v in ref_losses)}")
    print(f"max loss difference (relative, absolute below 1) {diff:.2e} (tolerance {tol:.0e} for {cfg.dtype}); "
          f"{time.perf_counter() - t0:.1f} s")
    if not diff <= tol or not all(np.isfinite(losses)):
        print("MISMATCH")
        return 1
    if problems:
        print(f"COLLECTIVES CHECK FAILED ({len(problems)} problem(s), above)")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
