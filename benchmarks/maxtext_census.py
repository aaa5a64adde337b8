# The collective census of one MaxText training step, stock MaxText against entwine_jax.maxtext.enable(),
# per decoder layer and per step: lowered from abstract shapes (no weights allocated) and compiled on
# fake CPU devices, the way MaxText's own train_compile.py compiles for hardware it does not have.
"""Census of MaxText's train step, stock vs routed through gemm_rs / ag_gemm (and the MoE ops).

Run (a MaxText venv as .ci/maxtext.sh builds it; docs/maxtext.md, "Collective census")::

    JAX_PLATFORMS=cpu PYTHONPATH=. venv-maxtext/bin/python benchmarks/maxtext_census.py --config 70b --layers 2

Configs: ``tiny4`` / ``tiny8``: MaxText's tiny llama2 decoder of tests/test_maxtext.py with GQA (16
query heads, 8 KV heads of 32) at tensor 4 x fsdp 2 / tensor 8; ``70b``: a Llama-3-70B-like decoder
(emb 8192, 64 query heads, 8 KV heads of 128, MLP 28672, vocab 128256, 80 layers scanned) at tensor 8,
2048 tokens x batch 8 = 16384 tokens per tensor group; ``moe``: tests/test_maxtext_moe.py's Mixtral-like
decoder (4 experts of 128, 2 per token) at expert 4 x fsdp 2, its routed experts through
moe_dispatch_gemm / moe_gemm_combine, against stock's dense MoE path (stock's sparse_matmul does not
compile with expert parallelism on CPU). ``--layers N`` compiles N scanned layers
instead of the config's; the per-step line then also gives per layer x the config's layers.

What a line means: bytes per device (census module docstring: ring accounting), per decoder layer
(one trip of the scanned layer loops: forward, and backward with its rematerialised forward) and per
step (the whole program). The program runs on CPU, so gemm_rs / ag_gemm run their XLA references:
their collectives (under the ops' name scopes) are what the fused kernels move on GPUs.
"""
import argparse
import contextlib
import pathlib
import sys
import time

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(8)

import jax  # noqa: E402

from entwine_jax import census  # noqa: E402
from entwine_jax.census import fmt_bytes  # noqa: E402

COMMON = ["hardware=cpu", "dataset_type=synthetic", "enable_checkpointing=false", "attention=dot_product",
          "log_config=false", "skip_jax_distributed_system=true", "enable_tensorboard=false", "jax_cache_dir=",
          "run_name=census", "base_output_directory=/tmp/maxtext_census"]
# name -> (MaxText overrides, decoder layers of the full model)
CONFIGS = {
    "tiny4": (["per_device_batch_size=1", "max_target_length=128", "base_emb_dim=256", "base_num_query_heads=16",
               "base_num_kv_heads=8", "base_mlp_dim=512", "head_dim=32", "base_num_decoder_layers=2",
               "vocab_size=512", "ici_tensor_parallelism=4", "ici_fsdp_parallelism=2"], 2),
    "tiny8": (["per_device_batch_size=1", "max_target_length=128", "base_emb_dim=256", "base_num_query_heads=16",
               "base_num_kv_heads=8", "base_mlp_dim=512", "head_dim=32", "base_num_decoder_layers=2",
               "vocab_size=512", "ici_tensor_parallelism=8", "ici_fsdp_parallelism=1"], 2),
    # 8 devices x 1 sequence of 2048 tokens: 16384 tokens in the one tensor group of 8.
    "70b": (["per_device_batch_size=1", "max_target_length=2048", "base_emb_dim=8192", "base_num_query_heads=64",
             "base_num_kv_heads=8", "head_dim=128", "base_mlp_dim=28672", "base_num_decoder_layers=80",
             "vocab_size=128256", "ici_tensor_parallelism=8", "ici_fsdp_parallelism=1"], 80),
    # tests/test_maxtext_moe.py's Mixtral-like decoder (4 experts of 128, 2 per token) at expert 4 x fsdp 2.
    "moe": (["per_device_batch_size=1", "max_target_length=128", "model_name=mixtral-8x7b",
             "override_model_config=true", "base_emb_dim=256", "base_num_query_heads=8", "base_num_kv_heads=4",
             "head_dim=32", "base_mlp_dim=128", "base_moe_mlp_dim=128", "num_experts=4", "num_experts_per_tok=2",
             "base_num_decoder_layers=2", "vocab_size=512", "megablox=false", "ici_expert_parallelism=4",
             "ici_fsdp_parallelism=2"], 2),
}
# Stock MaxText's overrides where its own path does not compile on CPU: sparse_matmul's
# ragged_all_to_all is not implemented on XLA:CPU, so the MoE config's stock census is the dense path
# (sparse_matmul=false: the GPU presets mixtral_8x1b / 8x2b's), its expert all-to-alls the partitioner's.
STOCK_ONLY = {"moe": ["sparse_matmul=false"]}


def lower_train_step(argv: list):
    """(Lowered train step, mesh, config): MaxText's train_compile.py path (shaped state and batch,
    MaxText's in/out shardings), on this process' CPU devices instead of a target topology."""
    from flax.core.spmd import logical_axis_rules as axis_rules
    from jax.sharding import AxisType, Mesh
    from maxtext.common.common_types import ShardMode
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    config = pyconfig.initialize(argv)
    devices = maxtext_utils.create_device_mesh(config, jax.devices())
    axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
    mesh = Mesh(devices, config.mesh_axes, axis_types=(axis_type,) * len(config.mesh_axes))
    args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    fn, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_shardings, model, config, params_shardings)
    with jax.set_mesh(mesh), axis_rules(config.logical_axis_rules):
        jitted = jax.jit(fn, in_shardings=in_shard, out_shardings=out_shard, static_argnums=static,
                         donate_argnums=donate)
        return jitted.lower(*args, **kwargs), mesh, config


def layer_loops(c: census.Census, layers: int) -> list:
    """The scanned decoder's loops: those of trip count `layers` at the top level of the step."""
    return [loop for loop in c.loops if loop.trip_count == layers and loop.parent is None]


def per_layer(c: census.Census, layers: int) -> census.Census:
    """One layer: one trip of each top-level loop of `layers` trips (forward, backward)."""
    found = []
    for loop in layer_loops(c, layers):
        found += list(c.per_iteration(loop))
    return census.Census(collectives=tuple(found), loops=c.loops, mesh_axes=c.mesh_axes)


def run(name: str, layers: int, routed: bool) -> tuple:
    """(census of the step, census of one layer, layers compiled, seconds, entwine_jax.maxtext.stats())."""
    import maxtext
    import entwine_jax.maxtext as entwine_maxtext
    overrides, full_layers = CONFIGS[name]
    layers = layers or full_layers
    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    stock_only = [] if routed else STOCK_ONLY.get(name, [])
    argv = ["census", str(base), *COMMON, *overrides, *stock_only, f"base_num_decoder_layers={layers}"]
    t0 = time.monotonic()
    with entwine_maxtext.enabled(moe=True) if routed else contextlib.nullcontext():
        entwine_maxtext.reset_stats()
        lowered, mesh, _ = lower_train_step(argv)
        routed_sites = entwine_maxtext.stats()
    step = census.collectives(lowered, mesh=mesh)
    return step, per_layer(step, layers), layers, time.monotonic() - t0, routed_sites


def side_by_side(stock: census.Census, routed: census.Census, scale: int = 1) -> list:
    """Lines: (owner, kind, axes) -> count and bytes, stock | routed; bytes x scale."""
    def keyed(c):
        out = {}
        for owner, kind, group, _, custom, n, _, total in c.rows():
            key = (owner, kind + (" (custom call)" if custom else ""), group)
            cn, cb = out.get(key, (0, 0))
            out[key] = (cn + (n or 0), cb + (total or 0))
        return out
    a, b = keyed(stock), keyed(routed)
    keys = sorted(set(a) | set(b), key=lambda k: (census.OWNERS.index(k[0]), k[1], k[2]))
    lines = ["| owner | kind | axes | stock count | stock bytes | routed count | routed bytes |",
             "|---|---|---|---:|---:|---:|---:|"]
    for k in keys:
        (sn, sb), (rn, rb) = a.get(k, (0, 0)), b.get(k, (0, 0))
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {sn * scale} | {fmt_bytes(sb * scale)} | {rn * scale} | "
                     f"{fmt_bytes(rb * scale)} |")
    lines.append(f"| **total** | | | {stock.count * scale} | **{fmt_bytes(stock.bytes * scale)}** | "
                 f"{routed.count * scale} | **{fmt_bytes(routed.bytes * scale)}** |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append",
                        help="repeatable; default: tiny4, tiny8, 70b")
    parser.add_argument("--layers", type=int, default=0,
                        help="scanned decoder layers to compile (default: the config's); per step = per layer x "
                             "the config's layers is printed too")
    parser.add_argument("--tables", action="store_true", help="also print each census' full table")
    args = parser.parse_args(argv)
    if args.layers < 0:
        parser.error(f"--layers must be >= 0, got {args.layers}")
    if len(jax.devices()) < 8:
        print(f"needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), found {len(jax.devices())}",
              file=sys.stderr)
        return 1
    for name in args.config or ["tiny4", "tiny8", "70b"]:
        full = CONFIGS[name][1]
        results = {}
        for routed in (False, True):
            step, layer, layers, seconds, sites = run(name, args.layers, routed)
            results[routed] = (step, layer)
            label = "routed" if routed else "stock"
            print(f"# {name} {label}: {layers} layers compiled in {seconds:.0f} s; loops "
                  f"{[(l.body, l.trip_count) for l in step.loops]}; routed sites {sites['routed']}; grouped {sites.get('grouped', {})}; "
                  f"kept {sites['kept']}", flush=True)
            if args.tables:
                print(layer.table(f"{name} {label}: one decoder layer"))
                print(step.table(f"{name} {label}: one step ({layers} layers)"))
        (s_step, s_layer), (r_step, r_layer) = results[False], results[True]
        print(f"\n## {name}: per decoder layer (bytes per device)\n")
        print("\n".join(side_by_side(s_layer, r_layer)))
        print(f"\n## {name}: per step, {layers} layers compiled (bytes per device)\n")
        print("\n".join(side_by_side(s_step, r_step)))
        if layers != full:
            outside = [s_step.bytes - s_layer.bytes * layers, r_step.bytes - r_layer.bytes * layers]
            print(f"\n## {name}: per step at {full} layers = per layer x {full} + outside the layer loops\n")
            print("| | stock | routed |\n|---|---:|---:|")
            print(f"| per layer x {full} | {fmt_bytes(s_layer.bytes * full)} | {fmt_bytes(r_layer.bytes * full)} |")
            print(f"| outside the layer loops | {fmt_bytes(outside[0])} | {fmt_bytes(outside[1])} |")
            print(f"| **per step** | **{fmt_bytes(s_layer.bytes * full + outside[0])}** | "
                  f"**{fmt_bytes(r_layer.bytes * full + outside[1])}** |")
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
