# MaxText integration (entwine_jax.maxtext) on 8 fake CPU devices: MaxText's own train loop on its
# own tiny llama2-style decoder (2 layers, synthetic data, 3 steps), stock and with enable(), same
# losses; the lowered train step holds the islands' collectives (stock MaxText's holds none).
# Skipped without MaxText (pip install "maxtext[tpu]==0.2.5"; .ci/maxtext.sh); ~2 min on 2 cores.
import json
import logging
import os
import pathlib

import jax
import pytest

maxtext = pytest.importorskip("maxtext", reason="MaxText is not installed (pip install 'maxtext[tpu]==0.2.5'; "
                                                  "see .ci/maxtext.sh)")

import entwine_jax  # noqa: E402
from entwine_jax import maxtext as entwine_maxtext  # noqa: E402

# MaxText's own base config, shrunk: 2 llama2 decoder layers (scanned, full remat: base.yml's
# defaults), emb 256, 8 heads of 32, mlp 512, vocab 512, 128 tokens per device-batch row.
TINY = ["hardware=cpu", "dataset_type=synthetic", "steps=3", "enable_checkpointing=false", "per_device_batch_size=1",
        "max_target_length=128", "base_emb_dim=256", "base_num_query_heads=8", "base_num_kv_heads=8",
        "base_mlp_dim=512", "head_dim=32", "base_num_decoder_layers=2", "vocab_size=512", "attention=dot_product",
        "log_config=false", "skip_jax_distributed_system=true", "enable_tensorboard=false",
        "jax_cache_dir="]  # no persistent compilation cache: every run compiles its own program

# name -> (MaxText overrides, loss tolerance). float32 runs match stock MaxText to rounding; bf16
# differs a little because gemm_rs reduces its partial products in fp32 (stock XLA in bf16).
VARIANTS = {
    # MaxText's `tensor` axis: the hidden dim scattered (gemm_rs scatter_dimension=2), Shardy.
    "tensor4_fsdp2_bf16": (["ici_tensor_parallelism=4", "ici_fsdp_parallelism=2"], 2e-3),
    # Sequence parallelism on `tensor_sequence`: the sequence dim scattered (dim 1); unscanned layers.
    "tensor_sequence4_fsdp2": (["ici_tensor_sequence_parallelism=4", "ici_fsdp_parallelism=2", "dtype=float32",
                                "scan_layers=false", "remat_policy=minimal"], 1e-5),
    # Batch over fsdp_transpose (and the mlp kernel dim over fsdp_transpose + tensor), GSPMD.
    "tensor4_fsdp_transpose2_gspmd": (["ici_tensor_parallelism=4", "ici_fsdp_parallelism=1",
                                       "ici_fsdp_transpose_parallelism=2", "dtype=float32", "shardy=false"], 1e-5),
    # Explicit sharding: the island's operands are resharded first.
    "tensor4_fsdp2_explicit": (["ici_tensor_parallelism=4", "ici_fsdp_parallelism=2", "dtype=float32",
                                "shard_mode=explicit"], 1e-5),
    # MaxText's gemma3 preset (sizes above, 4 KV heads: GQA), its local and global attention layers,
    # tensor 2 x fsdp 4; the cheapest config of benchmarks/maxtext_matrix.py.
    "gemma3_tensor2_fsdp4": (["model_name=gemma3-4b", "override_model_config=true", "base_num_kv_heads=4",
                              "sliding_window_size=64", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=4",
                              "dtype=float32"], 1e-5),
}
# fp8 / fp8_gpu under bf16 compute, 3 steps on losses of ~6.7: measured up to 2.2e-3 (fp8_gpu) and
# 1.2e-3 (fp8), the tolerance docs/maxtext.md writes. Under float32 the FP8 projections stay stock.
FP8_LOSS_TOL = 3e-3
# Step 0 (equal parameters): stock at tensor 4 x fsdp 2 sums the row-parallel partial products rounded
# to bf16, and the next projections' e4m3 quantisation amplifies that rounding; routed sums them in
# fp32, as MaxText's own model does without tensor parallelism (docs/maxtext.md). Routed against that
# model: bf16 rounding elsewhere in the partitioned program (measured 5e-7 fp8_gpu; fp8 2.5e-5 on jax
# 0.12.0.1, 7.7e-5 on 0.12.1; 3.2e-5 without FP8).
UNSHARDED_STEP0_TOL = 1e-4
# Stock's own offset from that model is at least this many times routed's (measured 8x to over 1000x
# on jax 0.12.0.1 and 0.12.1; its size, 4e-4 to 2.2e-3, moves with the release and the mesh).
STOCK_OFFSET_FACTOR = 4
ROW_SITES = {"mlp/wo", "attention/out"}
GROUPS = {"attention/qkv", "mlp/wi"}
COLUMN_SITES = {"mlp/wi_0", "mlp/wi_1", "attention/query", "attention/key", "attention/value"}


@pytest.fixture(scope="module")
def train_main():
    if len(jax.devices()) < 8:
        pytest.skip(f"needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), found "
                    f"{len(jax.devices())}")
    from maxtext.trainers.pre_train import train
    return train.main


def _train(train_main, tmp_path, name, overrides, routed: bool, common=None, **enable):
    """Runs MaxText's train.main on `common` (default TINY) and `overrides`, with enable(**enable) if
    routed; returns (losses, StableHLO text of the train step, stats)."""
    run = f"{name}_{'entwine' if routed else 'stock'}"
    metrics, ir_dir = tmp_path / f"{run}.jsonl", tmp_path / f"{run}_ir"
    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["train", str(base), f"run_name={run}", f"base_output_directory={tmp_path / 'out'}",
            f"metrics_file={metrics}", *(TINY if common is None else common), *overrides]
    entwine_maxtext.reset_stats()
    previous = os.environ.get("JAX_DUMP_IR_TO", "")  # the flag's value unless updated
    jax.config.update("jax_dump_ir_to", str(ir_dir))
    try:
        if routed:
            with entwine_maxtext.enabled(**enable):
                train_main(argv)
        else:
            train_main(argv)
    finally:
        jax.config.update("jax_dump_ir_to", previous)
    losses = [json.loads(line)["learning/loss"] for line in metrics.read_text().splitlines()]
    (step,) = sorted(ir_dir.glob("*jit_train_step*.mlir"))
    return losses, step.read_text(), entwine_maxtext.stats()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_losses_match_stock_maxtext(train_main, tmp_path, name):
    overrides, tol = VARIANTS[name]
    stock, stock_ir, stock_stats = _train(train_main, tmp_path, name, overrides, routed=False)
    routed, routed_ir, stats = _train(train_main, tmp_path, name, overrides, routed=True)
    print(f"{name}: stock MaxText losses {stock}, with entwine_jax.maxtext {routed}, routed {stats['routed']}")
    assert len(stock) == len(routed) == 3
    assert max(abs(a - b) for a, b in zip(stock, routed)) <= tol, (stock, routed)
    assert not entwine_maxtext.is_enabled()
    # Both row-parallel projections went through gemm_rs; stock MaxText ran none of them.
    empty = {"routed": {}, "grouped": {}, "kept": {}}
    assert stock_stats == {**empty, "outside_train_step": empty}
    assert set(stats["routed"]) >= ROW_SITES, stats
    # The lowered train step: stock MaxText leaves every collective to the partitioner; with the
    # integration each island's psum_scatter (the reference of gemm_rs on CPU) is in the program.
    assert stock_ir.count("stablehlo.reduce_scatter") == stock_ir.count("stablehlo.all_gather") == 0
    assert routed_ir.count("stablehlo.reduce_scatter") >= len(ROW_SITES)
    # ... and the column-parallel projections, query/key/value and wi_0/wi_1 each as one group with one
    # all_gather (ag_gemm's reference on CPU).
    assert set(stats["routed"]) >= COLUMN_SITES, stats
    assert set(stats["grouped"]) == GROUPS, stats
    assert routed_ir.count("stablehlo.all_gather") >= len(GROUPS)


FP8_RECIPES = {"fp8_gpu": ["quantization=fp8_gpu", "use_qwix_quantization=true"], "fp8": ["quantization=fp8"]}


@pytest.mark.parametrize("name", list(FP8_RECIPES))
def test_fp8_losses_match_stock_maxtext(train_main, tmp_path, name):
    """quantization=fp8_gpu (through qwix) and fp8 under bf16 compute: Flax's Fp8DirectDotGeneralOp in
    every projection. The routed projections run the FP8 ops with the same delayed-scaling state, which
    MaxText's train step updates as before; each projection is its own island (its own scales), so
    nothing is grouped."""
    overrides = ["ici_tensor_parallelism=4", "ici_fsdp_parallelism=2", "dtype=bfloat16", *FP8_RECIPES[name]]
    stock, _, _ = _train(train_main, tmp_path, name, overrides, routed=False)
    routed, routed_ir, stats = _train(train_main, tmp_path, name, overrides, routed=True)
    print(f"{name}: stock MaxText losses {stock}, with entwine_jax.maxtext {routed}, routed {stats['routed']}, "
          f"kept {stats['kept']}")
    assert set(stats["routed"]) >= ROW_SITES | COLUMN_SITES and not stats["grouped"], stats
    # stats() reports the train step: every projection routed, none kept. Under qwix the model's
    # initialisation (qwix's dummy forward, which creates the FP8 state) ran MaxText's own calls;
    # those are reported apart, not as what the step runs.
    assert not stats["kept"], stats
    if name == "fp8_gpu":
        assert set(stats["outside_train_step"]["kept"]) >= ROW_SITES | COLUMN_SITES, stats
        assert all(reason.startswith("quantization=fp8_gpu: qwix creates the FP8 state")
                   for reason in stats["outside_train_step"]["kept"].values()), stats
    assert routed_ir.count("stablehlo.reduce_scatter") >= len(ROW_SITES)
    # The islands' FP8 operands: e4m3 forward, e5m2 cotangents.
    assert "f8E4M3FN" in routed_ir and "f8E5M2" in routed_ir
    assert max(abs(a - b) for a, b in zip(stock, routed)) <= FP8_LOSS_TOL, (stock, routed)
    # The step-0 offset is stock's bf16 sum of the tensor-parallel partial products: MaxText's own FP8 model
    # without tensor parallelism (fsdp 8) gives routed's step-0 loss, and stock lies well away from it.
    unsharded, _, _ = _train(train_main, tmp_path, name + "_fsdp8", ["ici_tensor_parallelism=1",
                             "ici_fsdp_parallelism=8", "dtype=bfloat16", "steps=1", *FP8_RECIPES[name]], routed=False)
    routed_offset, stock_offset = abs(routed[0] - unsharded[0]), abs(stock[0] - unsharded[0])
    print(f"{name}: step 0 from MaxText's model without tensor parallelism: routed {routed_offset:.2e}, "
          f"stock {stock_offset:.2e}")
    assert routed_offset <= UNSHARDED_STEP0_TOL, (routed, unsharded)
    assert stock_offset >= STOCK_OFFSET_FACTOR * routed_offset, (stock, routed, unsharded)


@pytest.mark.parametrize("name", list(FP8_RECIPES))
def test_fp8_float32_stays_stock(train_main, tmp_path, name):
    """FP8 under float32 compute: the FP8 ops write bf16 or fp16 only, so every projection stays MaxText's
    (Flax's FP8 dot writes float32), with the reason in stats()["kept"]; the losses are stock's exactly,
    from step 0 (routed, the bf16 outputs would drift from stock's float32 ones)."""
    overrides = ["ici_tensor_parallelism=4", "ici_data_parallelism=2", "ici_fsdp_parallelism=1", "dtype=float32",
                 *FP8_RECIPES[name]]
    stock, _, _ = _train(train_main, tmp_path, name, overrides, routed=False)
    routed, _, stats = _train(train_main, tmp_path, name, overrides, routed=True)
    assert stats["routed"] == {} and not stats["grouped"], stats
    assert stats["kept"] == {site: "FP8 with compute dtype float32: the FP8 ops write bf16 or fp16, Flax's FP8 dot "
                                   "writes the compute dtype" for site in ROW_SITES | COLUMN_SITES}, stats
    assert routed == stock, (stock, routed)


def test_kept_layouts_are_logged(train_main, tmp_path, caplog):
    """Context parallelism is not served: MaxText's layers run, the reason is logged once, and the
    losses are stock MaxText's exactly."""
    overrides = ["ici_tensor_parallelism=2", "ici_context_parallelism=2", "ici_fsdp_parallelism=2", "dtype=float32"]
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        routed, routed_ir, stats = _train(train_main, tmp_path, "context", overrides, routed=True)
    assert stats["routed"] == {}, stats
    assert stats["kept"]["mlp/wo"].startswith("context parallelism: the sequence dim of the input is sharded over "
                                              "('context',)")
    assert caplog.text.count("mlp/wo keeps MaxText's DenseGeneral: context parallelism") == 1
    assert routed_ir.count("stablehlo.reduce_scatter") == 0


def test_enable_disable_restores_maxtext():
    from maxtext.layers import attentions, linears, moe
    before = (linears.DenseGeneral.__call__, linears.MlpBlock.__call__, attentions.Attention.__call__,
              moe.RoutedMoE.__call__, moe.RoutedMoE.sparse_matmul)
    entwine_maxtext.enable()
    entwine_maxtext.enable()  # idempotent
    assert linears.DenseGeneral.__call__ is not before[0] and entwine_maxtext.is_enabled()
    assert linears.DenseGeneral.__call__.__wrapped__ is before[0]
    entwine_maxtext.disable()
    assert (linears.DenseGeneral.__call__, linears.MlpBlock.__call__, attentions.Attention.__call__,
            moe.RoutedMoE.__call__, moe.RoutedMoE.sparse_matmul) == before
    assert not entwine_maxtext.is_enabled()
    with pytest.raises(ValueError, match=r"gemm_rs_config must be an entwine_jax.GemmRsConfig or None, got dict"):
        entwine_maxtext.enable(gemm_rs_config={})
    with pytest.raises(ValueError, match=r"ag_gemm_config must be an entwine_jax.AgGemmConfig or None, got "
                                         r"GemmRsConfig"):
        entwine_maxtext.enable(ag_gemm_config=entwine_jax.GemmRsConfig())
    assert not entwine_maxtext.is_enabled()


# --- The collective census of a training step: routed never moves more than stock ------------------

def _census_program():
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import maxtext_census
    return maxtext_census


@pytest.mark.parametrize("config", ["tiny4", "tiny8"])
def test_routed_gqa_step_gathers_once_and_moves_no_more_than_stock(train_main, config):
    """MaxText's tiny decoder with GQA (16 query heads, 8 KV heads), scanned, default remat, at tensor
    4 (x fsdp 2) and tensor 8, compiled from abstract shapes: the census of the program itself."""
    program = _census_program()
    stock_step, stock_layer, layers, _, _ = program.run(config, 0, routed=False)
    step, layer, _, _, stats = program.run(config, 0, routed=True)
    # query/key/value and wi_0/wi_1 took one grouped ag_gemm each; nothing was kept.
    assert set(stats["grouped"]) == GROUPS and not stats["kept"], stats
    loops = program.layer_loops(step, layers)
    assert len(loops) == 2, step.loops  # the scanned layers' forward and backward
    gathers = [step.per_iteration(loop).select(owner="ag_gemm", kind="all-gather").count for loop in loops]
    # The forward layer gathers each distinct activation once (the attention input, the MLP input);
    # the backward loop's rematerialised forward gathers them again, and gemm_rs's backward is a gather.
    assert min(gathers) == len(GROUPS), (gathers, layer.table())
    # Every tensor-parallel collective of a layer on its activations is one of the ops'; XLA keeps
    # only small all-reduces (norm statistics, the replicated parameters' gradients).
    xla = layer.select(owner="xla", axis="tensor")
    assert not xla.select(kind=("all-gather", "reduce-scatter", "all-to-all")), xla.table()
    assert layer.bytes <= stock_layer.bytes, (layer.table(), stock_layer.table())
    assert step.bytes <= stock_step.bytes, (step.table(), stock_step.table())
    # FSDP (tiny4): the islands gather the weight shards in the compute dtype (bf16), as stock does;
    # they gathered the float32 parameters before (twice the bytes).
    weights, stock_weights = (c.select(owner="xla", kind="all-gather", axis="fsdp") for c in (step, stock_step))
    assert weights.bytes <= stock_weights.bytes, (weights.table(), stock_weights.table())
    assert not [c.shape for c in weights if c.shape.startswith("f32")], weights.table()
    if config == "tiny4":
        assert weights.count > 0, step.table()


def test_explicit_sharding_out_sharding_is_honoured(train_main):
    """shard_mode=explicit with tensor_sequence: MaxText asks its column-parallel projections for a
    sequence-sharded output (out_sharding); that is not the column-parallel layout, so they stay
    MaxText's (with the reason), and the step traces (it failed in rope before)."""
    program = _census_program()
    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["census", str(base), *program.COMMON, *TINY[4:13], "ici_tensor_sequence_parallelism=4",
            "ici_fsdp_parallelism=2", "shard_mode=explicit", "scan_layers=false", "num_vocab_tiling=2",
            "dtype=float32"]
    with entwine_maxtext.enabled():
        entwine_maxtext.reset_stats()
        program.lower_train_step(argv)
        stats = entwine_maxtext.stats()
    assert set(stats["routed"]) >= ROW_SITES, stats
    assert stats["kept"].get("attention/query", "").startswith("out_sharding"), stats


def test_moe_dense_path_is_reported_as_kept(caplog):
    # MaxText's dense MoE path stays MaxText's (sparse_matmul is routed: tests/test_maxtext_moe.py).
    import types
    entwine_maxtext.reset_stats()
    entwine_maxtext._log.reset_key("maxtext-enabled")
    config = types.SimpleNamespace(te_moe_block=False, attention="dot_product", sparse_matmul=False)
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        assert entwine_maxtext._moe_call(lambda self, x: x + 1, types.SimpleNamespace(config=config), 1) == 2
    assert set(entwine_maxtext.stats()["kept"]) == {"moe/experts"}
    # The first patched call says the integration is on (absl's logging is set up by then).
    assert "entwine_jax.maxtext: enabled" in caplog.text and "moe/experts keeps MaxText's" in caplog.text


def test_shape_reasons_name_the_axis_that_does_not_divide(monkeypatch):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=jax.devices()[:8])
    site = entwine_maxtext._Site(name="attention/query", kind=entwine_maxtext.COLUMN, mesh=mesh, config=None,
                                 kernel_axes=(), x_names=(), out_names=("b", "s", "h", "d"))
    monkeypatch.setattr(entwine_maxtext, "_mesh_dims", lambda names, site: [("fsdp",), (), ("tensor",), ()])
    reason = entwine_maxtext._column_plan(site, [("fsdp",), (), ("tensor",)], (256, 8, 32), (3, 128, 64))
    assert reason == "shapes do not divide: batch 3 over ('fsdp',) (size 2)"


def test_mla_projections_are_routed_or_reported(train_main):
    """attention_type=mla (DeepSeek 2/3) overrides Attention.__call__: its out projection (and its
    query without a LoRA) are routed as Attention's; its low-rank down- and up-projections have no
    tensor-parallel layout under MaxText's rules, so each is kept with its reason. Nothing passes in
    silence."""
    program = _census_program()
    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["census", str(base), *program.COMMON, *TINY[4:13], "ici_tensor_parallelism=4", "ici_fsdp_parallelism=2",
            "decoder_block=deepseek", "attention_type=mla", "first_num_dense_layers=2", "q_lora_rank=0",
            "kv_lora_rank=64", "qk_nope_head_dim=32", "qk_rope_head_dim=16", "v_head_dim=32", "num_experts=4",
            "num_experts_per_tok=2", "base_moe_mlp_dim=256"]
    with entwine_maxtext.enabled():
        entwine_maxtext.reset_stats()
        program.lower_train_step(argv)
        stats = entwine_maxtext.stats()
    assert set(stats["routed"]) >= ROW_SITES | {"attention/mla/query"}, stats
    assert stats["kept"]["attention/mla/wkv_a"].startswith("no tensor parallelism: the output features"), stats
    assert stats["kept"]["attention/mla/wkv_b"].endswith("is replicated over 'tensor': nothing to all-gather"), stats


def test_attention_overriding_call_is_reported_as_kept(caplog):
    entwine_maxtext.reset_stats()
    attention = type("CompressedAttention", (), {})()
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        assert entwine_maxtext._own_attention_call(lambda self, x: x + 1, attention, 1) == 2
    assert entwine_maxtext.stats()["kept"] == {
        "attention/CompressedAttention": "CompressedAttention overrides Attention.__call__ with projections of its "
                                         "own layout; its projections are left to MaxText"}
    assert "attention/CompressedAttention keeps MaxText's" in caplog.text
