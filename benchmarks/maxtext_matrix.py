# MaxText configs the tests do not train (model presets, meshes, dtypes, FP8 recipes), each trained a few
# steps stock and with entwine_jax.maxtext.enable() on 8 fake CPU devices: one line per config with both
# loss curves, their largest difference, the tolerance docs/maxtext.md states, and what stats() says.
"""Stock MaxText against ``entwine_jax.maxtext.enable()`` over a matrix of configs.

Run (a MaxText venv as .ci/maxtext.sh builds it; docs/maxtext.md, "Checked")::

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv-maxtext/bin/python benchmarks/maxtext_matrix.py [--only NAME ...]

Each config trains ``--steps`` steps of MaxText's own train loop (``train.main``, synthetic data, one
process) on a tiny version of a MaxText model preset (``model_name=...`` with its sizes overridden), stock
and then routed. A line: the config, stock and routed losses, max |diff|, the tolerance
(docs/maxtext.md's, for losses of ~7: float32 1e-5, bf16 2e-3, FP8 under bf16 3e-3; scaled by the loss where
it is larger: qwen3's tied, unnormalised logits give ~187), the routed / kept site counts of ``stats()``,
and

* PASS: both trained, within the tolerance, and every projection of the model's parameter tree is named
  in ``stats()`` (routed or kept);
* FAIL: the routed run raised, the losses differ by more, or a projection is named nowhere (listed);
* STOCK-FAILS: stock MaxText itself does not train the config (the routed run is skipped).

The projections are counted from the train step's parameter tree (``mlp/wi_0``, ``self_attention/query``,
..., and a MoE block's experts and gate as ``moe/experts``); other kernels (the embedding, the logits
head) are no tensor-parallel projection (``--verbose`` lists them).
"""
import argparse
import functools
import json
import pathlib
import sys
import tempfile
import time
import traceback

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(8)

import jax  # noqa: E402

COMMON = ["hardware=cpu", "dataset_type=synthetic", "enable_checkpointing=false", "per_device_batch_size=1",
          "max_target_length=128", "vocab_size=512", "attention=dot_product", "log_config=false",
          "skip_jax_distributed_system=true", "enable_tensorboard=false", "jax_cache_dir=",
          "override_model_config=true"]
# A preset shrunk to emb 256, 8 query heads of 32, mlp 512, 2 layers.
TINY = ["base_emb_dim=256", "base_num_query_heads=8", "base_num_kv_heads=4", "head_dim=32", "base_mlp_dim=512",
        "base_num_decoder_layers=2"]
# MoE: 4 experts of 128, 2 per token.
MOE = ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=128"]
# MLA at tiny sizes (8 heads: nope 32 + rope 16 for query/key, values of 32).
MLA = ["base_num_kv_heads=8", "kv_lora_rank=64", "qk_nope_head_dim=32", "qk_rope_head_dim=16", "v_head_dim=32",
       "first_num_dense_layers=1"]
T4F2, T4D2, T2F4, T2D2F2 = (["ici_tensor_parallelism=4", "ici_fsdp_parallelism=2"],
                            ["ici_tensor_parallelism=4", "ici_data_parallelism=2", "ici_fsdp_parallelism=1"],
                            ["ici_tensor_parallelism=2", "ici_fsdp_parallelism=4"],
                            ["ici_tensor_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=2"])
BF16, F32 = ["dtype=bfloat16"], ["dtype=float32"]
FP8_GPU, FP8 = ["quantization=fp8_gpu", "use_qwix_quantization=true"], ["quantization=fp8"]

# name -> MaxText overrides. None of these is in tests/test_maxtext.py (llama2 there: MaxText's base
# decoder, tensor 4 x fsdp 2 bf16, tensor_sequence 4 x fsdp 2 f32, fsdp_transpose, explicit).
CONFIGS = {
    "gemma2 t4xf2 bf16": ["model_name=gemma2-2b", *TINY, "sliding_window_size=64", *T4F2, *BF16],
    "gemma3 t4xd2 bf16": ["model_name=gemma3-4b", *TINY, "sliding_window_size=64", *T4D2, *BF16],
    "gemma3 t2xf4 f32": ["model_name=gemma3-4b", *TINY, "sliding_window_size=64", *T2F4, *F32],
    "qwen3 t4xd2 f32": ["model_name=qwen3-0.6b", *TINY, *T4D2, *F32],
    "qwen3 t2xd2xf2 bf16": ["model_name=qwen3-0.6b", *TINY, *T2D2F2, *BF16],
    # Llama 4: one dense and one MoE layer (with its shared expert) per scanned block.
    "llama4 dense+moe t4xf2 f32": ["model_name=llama4-17b-16e", *TINY, *MOE, "num_experts_per_tok=1",
                                   "inhomogeneous_layer_cycle_interval=2", "interleave_moe_layer_step=2",
                                   "nope_layer_interval=2", *T4F2, *F32],
    # DeepSeek 2: MLA without a query LoRA, shared experts, one dense layer then MoE.
    "deepseek2 mla q_lora=0 t4xf2 f32": ["model_name=deepseek2-16b", *TINY, *MOE, *MLA, "shared_experts=2",
                                          *T4F2, *F32],
    "deepseek2 mla q_lora=0 t2xd2xf2 bf16": ["model_name=deepseek2-16b", *TINY, *MOE, *MLA, "shared_experts=2",
                                              *T2D2F2, *BF16],
    # DeepSeek 3: MLA with a query LoRA (rank 32), one shared expert.
    "deepseek3 mla q_lora=32 t4xd2 f32": ["model_name=deepseek3-tiny", *TINY, *MOE, *MLA, "q_lora_rank=32",
                                           "kv_lora_rank=16", *T4D2, *F32],
    # Llama 2/3 with sequence parallelism (tensor_sequence: the sequence dim scattered / gathered).
    "llama3 ts4xd2 bf16": ["model_name=llama3-8b", *TINY, "ici_tensor_sequence_parallelism=4",
                           "ici_data_parallelism=2", "ici_fsdp_parallelism=1", *BF16],
    "llama2 ts2xf4 f32 noscan": ["model_name=llama2-7b", *TINY, "base_num_kv_heads=8",
                                 "ici_tensor_sequence_parallelism=2", "ici_fsdp_parallelism=4", "scan_layers=false",
                                 *F32],
    "llama3 ts2xt2xf2 f32 (2-D TP)": ["model_name=llama3-8b", *TINY, "ici_tensor_sequence_parallelism=2",
                                      "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2", *F32],
    # Tensor 8: 8 KV heads (heads are not split under tensor parallelism).
    "llama3 t8 bf16": ["model_name=llama3-8b", *TINY, "base_num_kv_heads=8", "ici_tensor_parallelism=8",
                       "ici_fsdp_parallelism=1", *BF16],
    "llama3 t2xf4 bf16": ["model_name=llama3-8b", *TINY, *T2F4, *BF16],
    # FP8 under bf16 compute (float32: kept, tests/test_maxtext.py), meshes the test does not use.
    "llama3 fp8_gpu t2xd2xf2 bf16": ["model_name=llama3-8b", *TINY, *T2D2F2, *BF16, *FP8_GPU],
    "llama3 fp8 t4xd2 bf16": ["model_name=llama3-8b", *TINY, *T4D2, *BF16, *FP8],
    "qwen3 fp8_gpu ts4xf2 bf16": ["model_name=qwen3-0.6b", *TINY, "ici_tensor_sequence_parallelism=4",
                                  "ici_fsdp_parallelism=2", *BF16, *FP8_GPU],
}
TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-3, "fp8": 3e-3}
LOSS_OF_TOLERANCES = 7.0  # the tests' losses, which the tolerances were measured on

# The DenseGeneral attribute names of MaxText's tensor-parallel projections -> stats() site names.
MLP_NAMES = ("wi", "wi_0", "wi_1", "wo")
ATTENTION_NAMES = ("query", "key", "value", "out", "qkv_proj")
MLA_NAMES = ("wq_a", "wq_b", "wkv_a", "wkv_b")


def _value(overrides, key, default):
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return values[-1] if values else default


def tolerance(overrides, loss: float) -> float:
    tol = TOLERANCES["fp8"] if _value(overrides, "quantization", "") else TOLERANCES[_value(overrides, "dtype",
                                                                                             "bfloat16")]
    return tol * max(1.0, abs(loss) / LOSS_OF_TOLERANCES)


def projection_sites(param_paths) -> tuple:
    """({stats() site name: kernels in the parameter tree}, other kernel paths) of a train step's parameter
    paths (tuples of names)."""
    sites, other = {}, set()
    parents = {path[:-1] for path in param_paths}
    for path in param_paths:
        leaf, parent = path[-1], (path[-2] if len(path) > 1 else "")
        # A MoE block's experts are arrays of its own (wi_0, wi_1, wo), its router a DenseGeneral "gate".
        if leaf in MLP_NAMES or (parent == "gate" and leaf == "kernel"):
            site = "moe/experts"
        elif leaf != "kernel":
            continue
        elif parent in MLP_NAMES:
            site = f"mlp/{parent}"
        elif parent in MLA_NAMES or (parent == "query" and path[:-2] + ("wkv_a",) in parents):
            site = f"attention/mla/{parent}"
        elif parent in ATTENTION_NAMES:
            site = f"attention/{parent}"
        else:
            other.add("/".join(path[-3:-1]))
            continue
        sites[site] = sites.get(site, 0) + 1
    return sites, sorted(other)


def _path_names(path) -> tuple:
    names = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return names[:-1] if names[-1:] == ("value",) else names  # an nnx.Variable's value


def train(train_module, argv, routed: bool, metrics: pathlib.Path):
    """(losses, stats() or None, parameter paths) of one train.main run."""
    from entwine_jax import maxtext as entwine_maxtext
    paths = []
    original_step = train_module.train_step

    @functools.wraps(original_step)
    def recording_step(model, config, state_mesh_shardings, params_shardings, *args, **kwargs):
        if not paths:
            paths.extend(_path_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(params_shardings)[0])
        return original_step(model, config, state_mesh_shardings, params_shardings, *args, **kwargs)

    train_module.train_step = recording_step
    entwine_maxtext.reset_stats()
    try:
        if routed:
            with entwine_maxtext.enabled():
                train_module.main(argv)
        else:
            train_module.main(argv)
    finally:
        train_module.train_step = original_step
    losses = [json.loads(line)["learning/loss"] for line in metrics.read_text().splitlines()]
    return losses, (entwine_maxtext.stats() if routed else None), paths


def run_config(name, overrides, steps, out_dir) -> dict:
    import maxtext
    from maxtext.trainers.pre_train import train as train_module
    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    row = {"name": name}
    for routed in (False, True):
        run = f"{name.replace(' ', '_').replace('=', '').replace('(', '').replace(')', '')}_{'routed' if routed else 'stock'}"
        metrics = out_dir / f"{run}.jsonl"
        argv = ["train", str(base), f"run_name={run}", f"base_output_directory={out_dir / 'out'}",
                f"metrics_file={metrics}", f"steps={steps}", *COMMON, *overrides]
        key = "routed" if routed else "stock"
        t0 = time.time()
        try:
            row[key], stats, paths = train(train_module, argv, routed, metrics)
        except Exception as e:  # one config's failure is a line of the table, not the end of the matrix
            row[key + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            traceback.print_exc()
            row["status"] = "FAIL" if routed else "STOCK-FAILS"
            return row
        row[key + "_s"] = time.time() - t0
        if routed:
            row["stats"] = stats
            row["sites"], row["other"] = projection_sites(paths)
    row["diff"] = max(abs(a - b) for a, b in zip(row["stock"], row["routed"]))
    row["tol"] = tolerance(overrides, row["stock"][0])
    named = set(row["stats"]["routed"]) | set(row["stats"]["kept"])
    row["unnamed"] = sorted(set(row["sites"]) - named)
    ok = len(row["stock"]) == len(row["routed"]) == steps and row["diff"] <= row["tol"] and not row["unnamed"]
    row["status"] = "PASS" if ok else "FAIL"
    return row


def line(row) -> str:
    def losses(key):
        return " ".join(f"{v:.6f}" for v in row[key]) if key in row else row.get(key + "_error", "-")
    parts = [f"{row['status']:<11}", f"{row['name']:<38}", f"stock [{losses('stock')}]"]
    if "stock" in row:
        parts.append(f"routed [{losses('routed')}]")
    if "diff" in row:
        stats = row["stats"]
        parts += [f"max|diff| {row['diff']:.2e} (tol {row['tol']:.1e})",
                  f"routed {len(stats['routed'])} kept {len(stats['kept'])} of {len(row['sites'])} sites "
                  f"({sum(row['sites'].values())} kernels)"]
        if row["unnamed"]:
            parts.append(f"NOT IN stats(): {row['unnamed']}")
    return " | ".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="config names to run (default: all): "
                        + "; ".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    parser.add_argument("--json", default=None, help="also write every row (stats() included) to this file")
    parser.add_argument("--verbose", action="store_true", help="print each config's stats() routed and kept")
    args = parser.parse_args()
    names = args.only or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; known: {list(CONFIGS)}")
    if len(jax.devices()) < 8:
        sys.exit(f"needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), found {len(jax.devices())}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="maxtext_matrix_") as tmp:
        for name in names:
            t0 = time.time()
            row = run_config(name, CONFIGS[name], args.steps, pathlib.Path(tmp))
            rows.append(row)
            print(line(row), f"| {time.time() - t0:.0f} s", flush=True)
            if args.verbose and "stats" in row:
                print("    routed:", row["stats"]["routed"], "\n    kept:", row["stats"]["kept"],
                      "\n    sites:", row["sites"], "other:", row["other"], flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print("\n" + "\n".join(line(row) for row in rows))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "STOCK-FAILS")}
    print(f"{len(rows)} configs: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
