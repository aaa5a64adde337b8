# Dispatch between the fused path (entwine_jax.gemm_rs.fused) and the XLA reference: the reason is
# visible (logged once per call site, printed under ENTWINE_PRINT_CONFIG=1), a fused path that
# claims availability is prepared once (its plan and communicator) and wired through
# platform_dependent so the same code still runs on CPU, and a config the kernels cannot run is a
# ValueError at trace time.
import dataclasses
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from entwine_jax import GemmRsConfig, _extension, callsite, gemm_rs, heuristic_config, set_default_config
from entwine_jax.gemm_rs import op as gemm_rs_op
from entwine_jax.gemm_rs.reference import gemm_rs_reference


def run(x_shape=(32, 64), n=16, world=4, dtype=jnp.bfloat16, sd=0, jit=True, **kwargs):
    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (x_shape[-1], n), jnp.float32).astype(dtype)
    xspec = P(*([None] * (len(x_shape) - 1) + ["tp"]))
    out = [None] * len(x_shape)
    out[sd] = "tp"
    f = jax.shard_map(lambda x, w: gemm_rs(x, w, axis_name="tp", scatter_dimension=sd, **kwargs), mesh=mesh,
                      in_specs=(xspec, P("tp", None)), out_specs=P(*out))
    f = jax.jit(f) if jit else f
    with jax.set_mesh(mesh):
        y = f(jax.device_put(x, xspec), jax.device_put(w, P("tp", None)))
    exact = np.einsum("...k,kn->...n", np.asarray(x, np.float64), np.asarray(w, np.float64))
    return np.asarray(y, np.float64), exact


@dataclasses.dataclass(frozen=True)
class FakeCall:
    """Stands in for rs_fused.GemmRsCall (hashable: it lives in the op's static plan)."""
    axis_name: object
    axis_size: int
    config: GemmRsConfig
    scatter_dimension: int


class FakeFused(types.SimpleNamespace):
    """Stands in for entwine_jax.gemm_rs.fused: records calls; its 'kernel' returns zeros (wrong on purpose)."""

    class Unavailable(Exception):
        pass

    def __init__(self, reason=None):
        super().__init__(reason=reason, reason_calls=[], prepare_calls=[], local_calls=[])

    def unavailable_reason(self, x_local_aval, w_aval, **kwargs):
        self.reason_calls.append((x_local_aval, w_aval, kwargs))
        return self.reason

    def prepare(self, x_local_aval, w_aval, *, axis_name, axis_size, scatter_dimension, config):
        self.prepare_calls.append((x_local_aval.shape, w_aval.shape))
        return FakeCall(axis_name, axis_size, config, scatter_dimension)

    def call(self, x2d, w, call):
        self.local_calls.append((x2d.shape, w.shape, call.axis_name, call.axis_size, call.config,
                                 call.scatter_dimension))
        if call.scatter_dimension == 1:
            return jnp.zeros((x2d.shape[0], w.shape[1] // call.axis_size), x2d.dtype)
        return jnp.zeros((x2d.shape[0] // call.axis_size, w.shape[1]), x2d.dtype)


@pytest.fixture
def fake(monkeypatch):
    f = FakeFused()
    monkeypatch.setattr(gemm_rs_op, "fused", f)
    # The fake stands for the GPU side: past the platform check, its unavailable_reason decides.
    monkeypatch.setattr(callsite, "platform_reason", lambda axis_name: None)
    return f


def test_cpu_takes_xla_path_with_visible_reason(caplog, capsys, monkeypatch):
    # The real fused path (or the extension's absence): on CPU the reference runs and says why.
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        y, exact = run()
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()
    msgs = [r.getMessage() for r in caplog.records if ": XLA reference path: " in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].split("XLA reference path: ")[1].strip()
    err = capsys.readouterr().err
    assert "path=xla" in err and "reason: " in err


def test_fused_available_uses_platform_dependent(fake, capsys, monkeypatch):
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    y, exact = run(x_shape=(8, 4, 64), sd=0)
    # The fake's zeros never run on CPU: platform_dependent picked the reference.
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()
    x_aval, w_aval, kwargs = fake.reason_calls[0]
    assert x_aval.shape == (32, 16) and w_aval.shape == (16, 16)  # N-D x seen as its 2-D row view
    assert kwargs["axis_name"] == "tp" and kwargs["axis_size"] == 4 and kwargs["scatter_dimension"] == 0
    assert isinstance(kwargs["config"], GemmRsConfig)
    # Prepared once, at the call site, for the 2-D view.
    assert fake.prepare_calls == [((32, 16), (16, 16))]
    # The CUDA branch was traced with the 2-D view (and discarded at CPU lowering).
    assert fake.local_calls and fake.local_calls[0][:4] == ((32, 16), (16, 16), "tp", 4)
    assert fake.local_calls[0][5] == 0
    assert "path=fused" in capsys.readouterr().err


@pytest.mark.parametrize("x_shape,sd", [((8, 3, 64), 0), ((8, 3, 64), 2), ((3, 8, 64), 1), ((2, 8, 3, 64), 1),
                                         ((2, 3, 12, 64), 2), ((1, 8, 5, 64), 1), ((2, 4, 5, 64), 3)])
def test_fused_branch_reshapes_nd(fake, x_shape, sd):
    # _fused_forward with a correct stand-in kernel (psum_scatter on the 2-D view, rows or columns)
    # == reference on N-D x, scattered over the leading dim, a middle dim (rows permuted so that
    # every rank's slice is a block of rows) or N. Bitwise: the stand-in sums exactly as the reference.
    fake.call = lambda x2d, w, call: (
        gemm_rs_reference(x2d, w, axis_name=call.axis_name, scatter_dimension=call.scatter_dimension))
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    call = FakeCall("tp", 4, GemmRsConfig(), gemm_rs_op.kernel_scatter_dim(jnp.zeros(x_shape), sd))
    plan = gemm_rs_op.Plan(axis_name="tp", axis_size=4, dimension=sd, config=GemmRsConfig(), reason=None,
                           fused_call=call)
    x = jax.random.normal(jax.random.key(1), x_shape, jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (64, 8), jnp.float32).astype(jnp.bfloat16)
    x_spec = P(*([None] * (len(x_shape) - 1)), "tp")
    out_spec = P(*[("tp" if d == sd else None) for d in range(len(x_shape))])
    specs = dict(mesh=mesh, in_specs=(x_spec, P("tp", None)), out_specs=out_spec)
    fused = jax.jit(jax.shard_map(lambda x, w: gemm_rs_op._fused_forward(x, w, plan=plan), **specs))
    ref = jax.jit(jax.shard_map(lambda x, w: gemm_rs_reference(x, w, axis_name="tp", scatter_dimension=sd),
                                **specs))
    with jax.set_mesh(mesh):
        xp, wp = jax.device_put(x, x_spec), jax.device_put(w, P("tp", None))
        y = np.asarray(fused(xp, wp), np.float32)
        np.testing.assert_array_equal(y, np.asarray(ref(xp, wp), np.float32))
    assert y.shape == x_shape[:-1] + (8,)


@pytest.mark.parametrize("kwargs,dtype,sd,reason", [
    (dict(config=GemmRsConfig(path="xla")), jnp.bfloat16, 0, "config.path='xla'"),
    ({}, jnp.float32, 0, "float32 inputs (the fused kernels take bfloat16/float16)"),
])
def test_xla_reasons_before_asking_fused(fake, capsys, monkeypatch, kwargs, dtype, sd, reason):
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    run(dtype=dtype, sd=sd, **kwargs)
    assert not fake.reason_calls and not fake.prepare_calls and not fake.local_calls
    assert "path=xla" in (err := capsys.readouterr().err) and f"reason: {reason}" in err


def test_axis_of_size_one_takes_xla_path_unless_fused_is_asked(fake, capsys, monkeypatch):
    # W = 1: nothing to reduce or scatter; "auto" keeps XLA's GEMM, "fused" still runs the kernels.
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    y, exact = run(world=1)
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()
    assert not fake.reason_calls and not fake.local_calls
    assert "reason: axis size 1: nothing to reduce or scatter" in capsys.readouterr().err
    run(world=1, x_shape=(64, 64), config=GemmRsConfig(path="fused"))
    assert fake.reason_calls[0][2]["axis_size"] == 1 and fake.local_calls
    assert "path=fused" in capsys.readouterr().err


def test_middle_scatter_dimension_asks_for_row_partitions(fake, capsys, monkeypatch):
    # [B, S, K] scattered over S: the fused path, as a row scatter of the permuted [B*S, K] view.
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    y, exact = run(x_shape=(3, 8, 64), sd=1)
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()  # CPU: the reference ran
    assert fake.reason_calls[0][0].shape == (24, 16) and fake.reason_calls[0][2]["scatter_dimension"] == 0
    assert fake.local_calls and fake.local_calls[0][0] == (24, 16) and fake.local_calls[0][5] == 0
    err = capsys.readouterr().err
    assert "path=fused" in err and "x's rows are permuted first, one copy of x" in err


def test_scatter_over_n_asks_for_column_partitions(fake):
    y, exact = run(x_shape=(8, 4, 64), n=16, sd=-1)
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()  # CPU: the reference ran
    assert fake.reason_calls[0][2]["scatter_dimension"] == 1
    assert fake.local_calls and fake.local_calls[0][0] == (32, 16) and fake.local_calls[0][5] == 1


def test_fused_reason_logged_once_per_call_site(fake, caplog):
    fake.reason = "no CUDA device in the mesh"
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        run()
        run(jit=False)  # same call site (shapes, dtype, axis, scatter dim): no repeat
        run(x_shape=(64, 64))  # a new call site
    msgs = [r.getMessage() for r in caplog.records if ": XLA reference path: " in r.getMessage()]
    assert len(msgs) == 2 and all("no CUDA device in the mesh" in m for m in msgs)
    assert all(r.levelno == logging.INFO for r in caplog.records if ": XLA reference path: " in r.getMessage())


def test_path_fused_that_cannot_run_warns(fake, caplog):
    fake.reason = "extension not built"
    with caplog.at_level(logging.INFO, logger="entwine_jax"):
        y, exact = run(config=GemmRsConfig(path="fused"))
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "extension not built" in warnings[0].getMessage()


def test_fused_module_errors_fall_back(monkeypatch, capsys):
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    broken = FakeFused()
    broken.unavailable_reason = lambda *a, **k: 1 / 0
    monkeypatch.setattr(gemm_rs_op, "fused", broken)
    monkeypatch.setattr(callsite, "platform_reason", lambda axis_name: None)  # as the fake fixture does
    y, exact = run(x_shape=(16, 64))
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()
    assert "unavailable_reason raised ZeroDivisionError" in capsys.readouterr().err


def test_failed_preparation_falls_back_with_its_reason(fake, capsys, monkeypatch):
    # The predicate said yes, but the communicator could not be set up: the reference runs and says why.
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")

    def refuse(*a, **k):
        raise fake.Unavailable("communicator setup failed (RuntimeError: cudaMalloc(heap): out of memory)")
    fake.prepare = refuse
    y, exact = run()
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()
    assert not fake.local_calls
    assert "path=xla" in (err := capsys.readouterr().err) and "cudaMalloc(heap): out of memory" in err
    fake.prepare = lambda *a, **k: 1 / 0
    run(x_shape=(16, 64))
    assert "prepare raised ZeroDivisionError" in capsys.readouterr().err


def unchecked_config(**fields) -> GemmRsConfig:
    """A GemmRsConfig with `fields` set past its own checks."""
    config = GemmRsConfig()
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config


def needs_plan():
    if _extension.module()[0] is None:
        pytest.skip(f"the kernels' plan needs the extension: {_extension.module()[1]}")


@pytest.mark.parametrize("jit", [True, False])
def test_config_the_kernels_cannot_run_is_a_value_error(jit):
    # A config that slipped past GemmRsConfig's own checks (as a rule the C++ plan adds before Python
    # does would): the kernels' plan refuses it at trace time.
    needs_plan()
    with pytest.raises(ValueError, match=r"gemm_rs: config GemmRsConfig\(.*consumer_grid=100.*\) cannot run on "
                                         r"the fused kernels: config.consumer_grid must be in \[1, 64\]"):
        run(jit=jit, config=unchecked_config(consumer_grid=100))
    # The XLA path runs no kernel: any config is fine there.
    y, exact = run(jit=jit, config=unchecked_config(consumer_grid=100, path="xla"))
    assert np.abs(y - exact).max() <= 1e-2 * np.abs(exact).max()


def test_print_config_once_per_call_site(capsys, monkeypatch):
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    run()
    run()
    run(x_shape=(16, 32), n=8, world=2)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("entwine_jax.gemm_rs x=bfloat16[32, 16] w=bfloat16[16, 16] axis='tp' (size 4) "
                               f"scatter_dimension=0: path=xla {heuristic_config(32, 16, 16, 4, jnp.bfloat16)}")
    if _extension.module()[0] is not None:  # the budget capped at the partition's one block (the kernels' plan)
        assert "GemmRsConfig(block_n=128, producer_sms=131, " in lines[0]
    assert "axis='tp' (size 2)" in lines[1]


def test_no_print_without_env(capsys, monkeypatch):
    monkeypatch.delenv("ENTWINE_PRINT_CONFIG", raising=False)
    run()
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "0")
    run(x_shape=(64, 64))
    assert capsys.readouterr().err == ""


def test_config_choice_reaches_the_fused_path(fake, capsys, monkeypatch):
    monkeypatch.setenv("ENTWINE_PRINT_CONFIG", "1")
    mine = GemmRsConfig(block_n=256, consumer_grid=8)
    run(config=mine)  # explicit
    assert fake.reason_calls[-1][2]["config"] is mine and fake.local_calls[-1][4] is mine
    default = GemmRsConfig(consumer_grid=4, consumer_block=256)
    set_default_config(default)
    run(x_shape=(64, 64))  # global default
    assert fake.reason_calls[-1][2]["config"] is default
    set_default_config(None)
    run(x_shape=(128, 64))  # heuristic
    assert fake.reason_calls[-1][2]["config"] == heuristic_config(128, 16, 16, 4, jnp.bfloat16)
    if _extension.module()[0] is not None:  # the budget capped at the partition's one block (the kernels' plan)
        assert fake.reason_calls[-1][2]["config"] == GemmRsConfig(consumer_grid=1, producer_sms=131)
    err = capsys.readouterr().err
    assert str(mine) in err and str(default) in err
