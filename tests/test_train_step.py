# examples/train_step.py on 8 fake CPU devices (dp=2 x tp=4): the tensor-parallel decoder built
# from entwine_jax.layers trains for 3 steps in lockstep with the plain-XLA unsharded model, and
# the losses agree within the example's fp32 tolerance, in the plain-all-gather preset and the
# sequence-parallel one (ag_gemm), whose collectives over tp all come from the fused ops; the
# collectives check (the census of the compiled step, entwine_jax.census) catches what it must.
import collections
import dataclasses
import importlib.util
import pathlib

import jax
import numpy as np
import pytest

from entwine_jax import census

REPO = pathlib.Path(__file__).resolve().parents[1]

pytest.importorskip("flax")
pytest.importorskip("optax")


@pytest.fixture(scope="module")
def train_step():
    spec = importlib.util.spec_from_file_location("train_step_example", REPO / "examples" / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_losses_match_plain_xla(train_step):
    # One decoder block keeps the compile short; the example's default has two.
    cfg = dataclasses.replace(train_step.PRESETS["tiny"], layers=1, dtype="float32")
    result = train_step.train(cfg, steps=3, verbose=False, check=True)
    losses, ref_losses = result.losses, result.ref_losses
    assert len(losses) == len(ref_losses) == 3
    assert np.all(np.isfinite(losses))
    assert result.diff <= train_step.TOL["float32"], (losses, ref_losses)
    # It trains: the next-token task is learnable and the loss falls from ~ln(vocab).
    assert losses[-1] < losses[0] - 1.0, losses
    # The collectives check flags this preset's plain all-gather of each sub-block (and its
    # transpose, a reduce-scatter): what the sp presets replace by ag_gemm.
    assert sorted(p.split(" over")[0] for p in result.problems) == ["HLO: all-gather"] * 2 + [
        "HLO: reduce-scatter"] * 2, result.problems


def test_sequence_parallel_preset(train_step):
    # sp-tiny: q/k/v and gate/up gather the sequence with ag_gemm; the collectives over tp, forward
    # and backward, all come from the two ops and the gradient all-reduce; same loss curve.
    cfg = dataclasses.replace(train_step.PRESETS["sp-tiny"], layers=1)
    assert cfg.fused_gather and cfg.dtype == "float32"
    result = train_step.train(cfg, steps=3, verbose=False, check=True)
    assert result.problems == []
    assert result.diff <= train_step.TOL["float32"], (result.losses, result.ref_losses)
    assert result.losses[-1] < result.losses[0] - 1.0, result.losses
    # Per block: 2 ag_gemm (an all-gather forward, their backward a gemm_rs) and 2 gemm_rs (a
    # reduce-scatter forward, their backward an ag_gemm); the census counts a backward as its op.
    assert ("ag_gemm 4 all-gather, gemm_rs 4 reduce-scatter, reduce_gradients 1 all-reduce"
            in result.report[0]), result.report


def test_compiled_hlo_check(train_step):
    # On CPU the ops run their XLA reference: the HLO check (meant for GPUs) finds no custom calls and
    # the reference's all-gathers and reduce-scatters over tp, and counts the gradient all-reduce.
    cfg = dataclasses.replace(train_step.PRESETS["sp-tiny"], layers=1)
    mesh = train_step.make_mesh(8, "cpu")
    step, _, place, (params, opt_state, _, _) = train_step.build(cfg, mesh)
    tokens, targets = train_step.make_batch(np.random.default_rng(0), cfg, mesh.shape["dp"])
    with jax.set_mesh(mesh):
        text = step.lower(params, opt_state, *place(tokens, targets)).compile().as_text()
    report, problems = train_step.check_census(census.collectives(text, mesh=mesh), cfg.layers, fused=True)
    assert "0 entwine_ag_gemm and 0 entwine_gemm_rs custom calls, 1 gradient all-reduce(s) over 'tp'" in report[1]
    kinds = collections.Counter(p.split(" over")[0] if " over" in p else p.split(" custom")[0] for p in problems)
    assert kinds == {"HLO: all-gather": 4, "HLO: reduce-scatter": 4, "HLO: 0 entwine_ag_gemm": 1,
                     "HLO: 0 entwine_gemm_rs": 1}, problems
    # What the fused path leaves (the lines as XLA prints them): the custom calls, a combined
    # gradient all-reduce over (dp, tp), one over dp alone; a stray all-gather over tp fails it.
    calls = "\n".join(f'%c{i} = bf16[256,128]{{1,0}} custom-call(%x, %w), custom_call_target="entwine_{t}"'
                      for i, t in enumerate(["ag_gemm", "gemm_rs"] * 4))

    def hlo(lines):  # the lines as the body of an HLO module's entry computation
        body = "".join(f"  {line}\n" for line in ["%x = bf16[64,128]{1,0} parameter(0)", *lines.splitlines()])
        return census.collectives(f"HloModule m\nENTRY %main () -> f32[] {{\n{body}}}\n", mesh=mesh)

    grads = ("%all-reduce = (f32[128]{0}, f32[]) all-reduce(%a, %b), channel_id=1, replica_groups=mesh['dp'=2,'tp'=4] "
             "{'dp','tp'}, to_apply=%add, metadata={op_name=\"jit(local_step)/shard_map/reduce_gradients/psum\"}\n"
             "%all-reduce.1 = f32[64,128]{1,0} all-reduce(%c), channel_id=2, replica_groups=mesh['dp'=2,'tp'=4] "
             "{'dp'}, to_apply=%add, metadata={op_name=\"jit(local_step)/shard_map/transpose(jvp())/psum\"}")
    report, problems = train_step.check_census(hlo(calls + "\n" + grads), 1, fused=True)
    assert problems == [] and "4 entwine_ag_gemm and 4 entwine_gemm_rs custom calls, 1 gradient" in report[1]
    stray = "%ag = bf16[64,128]{1,0} all-gather-start(%x), replica_groups=mesh['dp'=2,'tp'=4] {'tp'}, dimensions={0}"
    assert train_step.check_census(hlo(calls + "\n" + stray), 1, fused=True)[1] == [
        "HLO: all-gather over tp outside ag_gemm, gemm_rs and the gradient all-reduce: %ag bf16[64,128] (no op_name)"]


def test_mesh_and_config_checks(train_step):
    mesh = train_step.make_mesh(8, "cpu")
    assert dict(mesh.shape) == {"dp": 2, "tp": 4}
    with pytest.raises(ValueError, match=r"train_step: heads \(6\) must be divisible by tp \(4\)"):
        train_step.check_config(dataclasses.replace(train_step.Config(), heads=6), 2, 4)
