# The small-call rule of path="auto" (entwine_jax.tuning.crossover): a call whose GEMM or transfer is
# too short for the overlap to pay the fused op's fixed cost takes XLA, with a reason that says so;
# the design suite's shapes and the grouped projections of a 70B layer take the fused path.

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from entwine_jax import AgGemmConfig, GemmRsConfig, ag_gemm, callsite, gemm_rs
from entwine_jax.ag_gemm import op as ag_op
from entwine_jax.gemm_rs import op as rs_op
from entwine_jax.tuning import crossover
from entwine_jax.tuning.timing import DESIGN_SUITE


@pytest.fixture(autouse=True)
def _real_costs(monkeypatch):
    monkeypatch.setattr(crossover, "COSTS", crossover.Costs())


def fixed_of(op, push):
    return rs_op.fixed_us() if op == "gemm_rs" else ag_op.fixed_us(push)


def gemm_rs_cost(m, n, k, world):
    return 2.0 * m * n * k, (world - 1) / world * m * n * 2


def ag_gemm_cost(rows, cols, n, world):
    return 2.0 * world * rows * cols * n, (world - 1) * rows * cols * 2


@pytest.mark.parametrize("m,n,k", DESIGN_SUITE)
@pytest.mark.parametrize("world", [2, 8])
def test_design_suite_takes_the_fused_path(m, n, k, world):
    assert crossover.fused_cannot_win(rs_op.fixed_us(), *gemm_rs_cost(m, n, k, world)) is None


@pytest.mark.parametrize("tokens", [16, 64])
def test_few_tokens_per_rank_take_xla(tokens):
    # Llama-3-70B's projections at tensor 8 with a handful of tokens per rank: microseconds of work.
    assert crossover.fused_cannot_win(rs_op.fixed_us(), *gemm_rs_cost(8 * tokens, 8192, 1024, 8)) is not None
    assert crossover.fused_cannot_win(ag_op.fixed_us("ce"), *ag_gemm_cost(tokens, 8192, 1280, 8)) is not None


def test_70b_layer_at_16k_tokens():
    # 2048 tokens per rank, tensor 8: the grouped q/k/v and gate/up calls are fused; key or value
    # alone ([8192, 128] per rank) would hide less than the pushes cost: the reason to group them.
    assert crossover.fused_cannot_win(ag_op.fixed_us("ce"), *ag_gemm_cost(2048, 8192, 1024 + 128 + 128, 8)) is None
    assert crossover.fused_cannot_win(ag_op.fixed_us("ce"), *ag_gemm_cost(2048, 8192, 2 * 3584, 8)) is None
    reason = crossover.fused_cannot_win(ag_op.fixed_us("ce"), *ag_gemm_cost(2048, 8192, 128, 8))
    assert reason.startswith("a small call: the overlap can hide at most") and "fixed cost of ~70 us" in reason


def test_cpu_reason_comes_before_the_rule(capsys, monkeypatch):
    # On CPU the reason is the platform, not the GPU cost model, and path='fused' gets the same one.
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    for config, k in ((None, 96), (GemmRsConfig(path="fused"), 160)):  # two call sites, printed once each
        x, w = jnp.zeros((16, k), jnp.bfloat16), jnp.zeros((k, 32), jnp.bfloat16)
        f = jax.shard_map(lambda x, w: gemm_rs(x, w, axis_name="tp", config=config), mesh=mesh,
                          in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
        with jax.set_mesh(mesh):
            jax.jit(f).lower(jax.device_put(x, P(None, "tp")), jax.device_put(w, P("tp", None)))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("entwine_jax.gemm_rs")]
    assert len(lines) == 2 and all("not on a CUDA GPU (platform 'cpu')" in line for line in lines), lines
    assert not any("a small call" in line for line in lines)


def test_auto_reports_the_rule_and_fused_is_not_subject_to_it(capsys, monkeypatch):
    # Past the platform (taken as CUDA here): the rule is asked first and names itself.
    monkeypatch.setattr(callsite, "platform_reason", lambda axis_name: None)
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    for config, k in ((None, 64), (GemmRsConfig(path="fused"), 128)):  # two call sites, printed once each
        x, w = jnp.zeros((16, k), jnp.bfloat16), jnp.zeros((k, 32), jnp.bfloat16)
        f = jax.shard_map(lambda x, w: gemm_rs(x, w, axis_name="tp", config=config), mesh=mesh,
                          in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
        with jax.set_mesh(mesh):
            jax.jit(f).lower(jax.device_put(x, P(None, "tp")), jax.device_put(w, P("tp", None)))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("entwine_jax.gemm_rs")]
    assert "a small call" in lines[0] and "a small call" not in lines[1]
    x, w = jnp.zeros((16, 64), jnp.bfloat16), jnp.zeros((64, 32), jnp.bfloat16)
    g = jax.shard_map(lambda x, w: ag_gemm(x, w, axis_name="tp", config=AgGemmConfig()), mesh=mesh,
                      in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
    with jax.set_mesh(mesh):
        jax.jit(g).lower(jax.device_put(x, P("tp", None)), jax.device_put(w, P(None, "tp")))
    assert "a small call" in capsys.readouterr().err


def test_push_crossover_and_its_fixed_cost():
    # One constant decides the push by shard size; the SM push's smaller fixed cost lets smaller calls
    # take the fused path than the copy engines' would.
    limit = crossover.COSTS.sm_push_max_shard_bytes
    assert crossover.push_engine(limit) == "sm" and crossover.push_engine(limit + 1) == "ce"
    cost = ag_gemm_cost(1024, 4096, 1024, 2)
    assert crossover.fused_cannot_win(ag_op.fixed_us("sm"), *cost) is None
    assert "fixed cost of ~70 us" in crossover.fused_cannot_win(ag_op.fixed_us("ce"), *cost)


def test_automatic_chunks_are_at_least_the_minimum_size():
    # Small shards travel in fewer, larger chunks (each chunk's release costs the push); 8 at most.
    from entwine_jax import ag_heuristic_config
    mib = crossover.COSTS.min_chunk_bytes
    assert mib == 1 << 20
    assert ag_heuristic_config(16, 4096, 4096, 2, jnp.bfloat16).max_chunks == 1
    assert ag_heuristic_config(512, 4096, 1024, 2, jnp.bfloat16).max_chunks == 1  # 1 MiB
    assert ag_heuristic_config(1024, 4096, 1024, 2, jnp.bfloat16).max_chunks == 2
    assert ag_heuristic_config(1024, 4096, 1024, 2, jnp.float8_e4m3fn).max_chunks == 1  # half the bytes
    assert ag_heuristic_config(8192, 4096, 4096, 2, jnp.bfloat16).max_chunks == 8
    # An explicit config keeps its own.
    assert AgGemmConfig().max_chunks == 8


def llama_projections(hidden, mlp, kv, tokens, world):
    """(op, flops, moved bytes, push) of a Llama layer's projections at `tokens` per rank: q/k/v and
    gate/up gather the tokens (ag_gemm), o and down scatter them (gemm_rs); as gpu_ranks' smallshapes."""
    shard = lambda cols: tokens * cols * 2  # noqa: E731
    return [("ag_gemm", *ag_gemm_cost(tokens, hidden, (hidden + 2 * kv) // world, world),
             crossover.push_engine(shard(hidden))),
            ("gemm_rs", *gemm_rs_cost(world * tokens, hidden, hidden // world, world), None),
            ("ag_gemm", *ag_gemm_cost(tokens, hidden, 2 * mlp // world, world), crossover.push_engine(shard(hidden))),
            ("gemm_rs", *gemm_rs_cost(world * tokens, hidden, mlp // world, world), None)]


@pytest.mark.parametrize("hidden,mlp,kv", [(4096, 14336, 1024), (8192, 28672, 1024)])
def test_llama_projections_tiny_take_xla_large_take_fused(hidden, mlp, kv):
    # Llama-8B and -70B at W = 2: a handful of tokens per rank is microseconds of work, XLA's path;
    # 2048 tokens per rank hide more than either push's fixed cost.
    for tokens in (16, 64):
        for op, flops, moved, push in llama_projections(hidden, mlp, kv, tokens, 2):
            assert crossover.fused_cannot_win(fixed_of(op, push), flops, moved) is not None, (op, tokens)
    for op, flops, moved, push in llama_projections(hidden, mlp, kv, 2048, 2):
        assert crossover.fused_cannot_win(fixed_of(op, push), flops, moved) is None, (op, 2048)
