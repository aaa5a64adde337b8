# examples/train_step.py on 8 fake CPU devices (dp=2 x tp=4): the tensor-parallel decoder built
# from entwine_jax.layers trains for 3 steps in lockstep with the plain-XLA unsharded model, and
# the losses agree within the example's fp32 tolerance.
import dataclasses
import importlib.util
import pathlib

import numpy as np
import pytest

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
    losses, ref_losses, diff = train_step.train(cfg, steps=3, verbose=False)
    assert len(losses) == len(ref_losses) == 3
    assert np.all(np.isfinite(losses))
    assert diff <= train_step.TOL["float32"], (losses, ref_losses)
    # It trains: the next-token task is learnable and the loss falls from ~ln(vocab).
    assert losses[-1] < losses[0] - 1.0, losses


def test_mesh_and_config_checks(train_step):
    mesh = train_step.make_mesh(8, "cpu")
    assert dict(mesh.shape) == {"dp": 2, "tp": 4}
    with pytest.raises(ValueError, match=r"train_step: heads \(6\) must be divisible by tp \(4\)"):
        train_step.check_config(dataclasses.replace(train_step.Config(), heads=6), 2, 4)
