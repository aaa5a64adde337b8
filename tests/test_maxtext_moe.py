# MaxText's routed experts through moe_dispatch_gemm / moe_gemm_combine (entwine_jax.maxtext) on 8 fake
# CPU devices: MaxText's own train loop on a tiny Mixtral-like and a tiny DeepSeek-like decoder, stock and
# routed, same losses; stats() and the census name the MoE ops; the configurations left to MaxText say why.
# Skipped without MaxText (pip install "maxtext[tpu]==0.2.5"; .ci/maxtext.sh); ~4 min on 2 cores.
import logging
import pathlib
import sys
import types

import pytest

maxtext = pytest.importorskip("maxtext", reason="MaxText is not installed (pip install 'maxtext[tpu]==0.2.5'; "
                                                  "see .ci/maxtext.sh)")

from entwine_jax import maxtext as entwine_maxtext  # noqa: E402
from test_maxtext import _train as train_loop, train_main  # noqa: E402,F401  (train_main: the fixture)

MOE = entwine_maxtext.MOE_SITE
COMMON = ["hardware=cpu", "dataset_type=synthetic", "steps=3", "enable_checkpointing=false",
          "per_device_batch_size=1", "max_target_length=128", "vocab_size=512", "attention=dot_product",
          "log_config=false", "skip_jax_distributed_system=true", "enable_tensorboard=false", "jax_cache_dir=",
          "override_model_config=true"]
# 2 layers, emb 256, 8 query heads of 32, 4 experts of 128, 2 per token; megablox=false: the ragged_dot
# grouped GEMM MaxText's GPU configs take (base.yml's megablox runs a TPU kernel in interpret mode off TPU).
TINY = ["base_emb_dim=256", "base_num_query_heads=8", "head_dim=32", "base_num_decoder_layers=2", "num_experts=4",
        "num_experts_per_tok=2", "base_moe_mlp_dim=128", "megablox=false"]
# Mixtral: every layer MoE (softmax over the top-k logits), no shared expert.
MIXTRAL = ["model_name=mixtral-8x7b", *TINY, "base_num_kv_heads=4", "base_mlp_dim=128"]
# DeepSeek 3: one dense layer then MoE with one shared expert; sigmoid scores with a learnt bias updated
# without loss (routed_bias_update_rate), group-limited top-k (2 groups, the best one), the weights
# normalised and scaled by routed_scaling_factor 2.5, a load-balance loss; MLA attention.
DEEPSEEK = ["model_name=deepseek3-tiny", *TINY, "base_num_kv_heads=8", "base_mlp_dim=512", "first_num_dense_layers=1",
            "q_lora_rank=32", "kv_lora_rank=16", "qk_nope_head_dim=32", "qk_rope_head_dim=16", "v_head_dim=32",
            "n_routing_groups=2", "topk_routing_group=1", "routed_bias_update_rate=0.01",
            "load_balance_loss_weight=0.01"]
# Routed: expert 4 x fsdp 2 (the tokens' batch over fsdp and expert, one expert per EP rank). Stock MaxText's
# sparse_matmul does not compile with expert parallelism on CPU (its ragged_all_to_all: "HLO opcode
# ragged-all-to-all is not supported by XLA:CPU"), so stock trains the same model without it, fsdp 8: the
# same parameters (jax's partitionable RNG) and the same router, dispatch and sums, within rounding.
EP = ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]
NO_EP = ["ici_expert_parallelism=1", "ici_fsdp_parallelism=8"]
# name -> (model, dtype, loss tolerance). float32 measured equal to the bit (0.0, both models); bf16 1.6e-4
# (the ops sum the k expert outputs and accumulate in fp32; stock's ragged_dot writes bf16), within the
# 2e-3 of tests/test_maxtext.py.
VARIANTS = {
    "mixtral_f32": (MIXTRAL, "float32", 1e-5),
    "deepseek_f32": (DEEPSEEK, "float32", 1e-5),
    "mixtral_bf16": (MIXTRAL, "bfloat16", 2e-3),
}


def _train(train_main, tmp_path, run, overrides, routed: bool):
    """MaxText's train.main on COMMON, routed with the MoE ops: (losses, StableHLO of the step, stats())."""
    return train_loop(train_main, tmp_path, run, overrides, routed, common=COMMON, moe=True)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_losses_match_stock_maxtext(train_main, tmp_path, name):
    model, dtype, tol = VARIANTS[name]
    stock, stock_ir, _ = _train(train_main, tmp_path, f"{name}_stock", [*model, f"dtype={dtype}", *NO_EP], False)
    routed, routed_ir, stats = _train(train_main, tmp_path, f"{name}_entwine", [*model, f"dtype={dtype}", *EP], True)
    print(f"{name}: stock MaxText (fsdp 8) {stock}, routed (expert 4 x fsdp 2) {routed}, routed sites "
          f"{stats['routed']}")
    assert len(stock) == len(routed) == 3
    assert max(abs(a - b) for a, b in zip(stock, routed)) <= tol, (stock, routed)
    # The experts went through the ops (the scanned MoE layers trace their body once), none was kept; the
    # ops' XLA reference moves the tokens with all_to_all, which stock's program without EP has none of.
    assert stats["routed"].get(MOE, 0) >= 1 and MOE not in stats["kept"], stats
    assert stock_ir.count("stablehlo.all_to_all") == 0
    assert routed_ir.count("stablehlo.all_to_all") >= 2
    if name == "deepseek_f32":
        # The shared expert is an MlpBlock: reported as mlp/* (kept here: no tensor parallelism).
        assert "mlp/wo" in stats["kept"], stats


def test_moe_dense_path_on_the_same_mesh_matches(train_main, tmp_path):
    """Stock MaxText's dense path (sparse_matmul=false, the partitioner's all-to-alls) compiles with expert
    parallelism on CPU: on the routed run's own mesh it gives the same losses (measured 4.8e-7), and it
    stays MaxText's, with the reason."""
    overrides = [*MIXTRAL, "dtype=float32", *EP, "sparse_matmul=false"]
    dense, _, stats = _train(train_main, tmp_path, "dense", overrides, routed=True)
    routed, _, _ = _train(train_main, tmp_path, "sparse", [*MIXTRAL, "dtype=float32", *EP], routed=True)
    assert max(abs(a - b) for a, b in zip(dense, routed)) <= 1e-5, (dense, routed)
    assert stats["kept"][MOE].startswith("sparse_matmul=false: MaxText's dense path"), stats
    assert MOE not in stats["routed"], stats


def _census_program():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import maxtext_census
    return maxtext_census


def test_moe_census_counts_the_moe_ops(train_main):
    """benchmarks/maxtext_census.py's "moe" config (the Mixtral-like decoder, bf16, expert 4 x fsdp 2):
    in the routed step every all-to-all over the expert axis is the MoE ops', and the experts' FSDP
    gathers move bf16 (the kernels are cast before the island's gather, as stock's dense path does)."""
    program = _census_program()
    step, layer, layers, _, stats = program.run("moe", 0, routed=True)
    assert stats["routed"].get(MOE, 0) >= 1 and MOE not in stats["kept"], stats
    ops = layer.select(owner=("moe_dispatch_gemm", "moe_gemm_combine"))
    # Forward: the dispatch's tokens and the combine's rows; backward: each the other's (and the rematerialised
    # forward of the scanned layer).
    assert ops.select(owner="moe_dispatch_gemm", kind="all-to-all").count >= 2, layer.table()
    assert ops.select(owner="moe_gemm_combine", kind="all-to-all").count >= 1, layer.table()
    # XLA's own all-to-alls over the expert axis alone (the partitioner's expert dispatch): none. (Two over
    # fsdp+expert, the batch axes, are stock's too: outside the experts.)
    assert not [c for c in step.select(owner="xla", kind="all-to-all") if c.axes == ("expert",)], step.table()
    gathers = step.select(owner="xla", kind="all-gather", axis="fsdp")
    assert not [c.shape for c in gathers if c.shape.startswith("f32")], gathers.table()
    # Stock's census for this config is its dense path (sparse_matmul's ragged_all_to_all does not compile on
    # CPU): the routed layer moves less.
    _, stock_layer, _, _, _ = program.run("moe", 0, routed=False)
    assert layer.bytes <= stock_layer.bytes, (layer.table(), stock_layer.table())


def test_moe_expert_tensor_parallelism_is_kept(train_main):
    """tensor 2 x expert 2 x fsdp 2: MaxText shards the experts' hidden dim over 'tensor' (mlp_no_fsdp) and
    psum_scatters after them; the ops take whole experts, so sparse_matmul stays MaxText's, with the reason.
    The attention projections are still routed over 'tensor'."""
    program = _census_program()
    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["census", str(base), *program.COMMON, "per_device_batch_size=1", "max_target_length=128", "vocab_size=512",
            "override_model_config=true", *MIXTRAL, "ici_tensor_parallelism=2",
            "ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "dtype=float32"]
    with entwine_maxtext.enabled(moe=True):
        entwine_maxtext.reset_stats()
        program.lower_train_step(argv)
        stats = entwine_maxtext.stats()
    assert stats["kept"][MOE].startswith("expert tensor parallelism: the experts' hidden dim is sharded over "
                                         "('tensor',)"), stats
    assert {"attention/out", "attention/query"} <= set(stats["routed"]), stats


def test_moe_paths_before_sparse_matmul_are_reported(caplog):
    """RoutedMoE.__call__ reports the paths that never reach sparse_matmul; the call itself is MaxText's."""
    def module(**config):
        cfg = {"te_moe_block": False, "attention": "dot_product", "sparse_matmul": True, **config}
        return types.SimpleNamespace(config=types.SimpleNamespace(**cfg), is_hash_routing=False)

    cases = [({"sparse_matmul": False}, "sparse_matmul=false: MaxText's dense path (einsums with dispatch/combine "
                                        "masks, capacity_factor) is left to MaxText; the MoE ops replace "
                                        "sparse_matmul"),
             ({"te_moe_block": True}, "te_moe_block=true: TransformerEngine's MoE block is left to MaxText"),
             ({"attention": "vllm_rpa"}, "attention='vllm_rpa': vLLM's fused MoE (inference) is left to MaxText")]
    for config, reason in cases:
        entwine_maxtext.reset_stats()
        with caplog.at_level(logging.INFO, logger="entwine_jax"):
            assert entwine_maxtext._moe_call(lambda self, x: x + 1, module(**config), 1) == 2
        assert entwine_maxtext.stats()["kept"] == {MOE: reason}
    assert "moe/experts keeps MaxText's RoutedMoE outside the train step: sparse_matmul=false" in caplog.text
    # sparse_matmul itself: nothing is recorded until it runs.
    entwine_maxtext.reset_stats()
    assert entwine_maxtext._moe_call(lambda self, x: x, module(), 3) == 3
    assert entwine_maxtext.stats()["kept"] == {}


def test_enable_checks_the_moe_arguments():
    import entwine_jax
    with pytest.raises(ValueError, match=r"moe must be a bool, got 'yes'"):
        entwine_maxtext.enable(moe="yes")
    with pytest.raises(ValueError, match=r"moe_config must be an entwine_jax.MoeConfig or None, got GemmRsConfig"):
        entwine_maxtext.enable(moe_config=entwine_jax.GemmRsConfig())
    assert not entwine_maxtext.is_enabled()
    from maxtext.layers import moe
    before = moe.RoutedMoE.sparse_matmul
    with entwine_maxtext.enabled(moe=True, moe_config=entwine_jax.MoeConfig(path="xla")):
        assert moe.RoutedMoE.sparse_matmul.__wrapped__ is before
    assert moe.RoutedMoE.sparse_matmul is before
