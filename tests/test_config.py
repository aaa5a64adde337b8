# GemmRsConfig: validation, printing, the global default and the heuristic.
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from entwine_jax import GemmRsConfig, _extension, heuristic_config, set_default_config, using_config
from entwine_jax.gemm_rs.config import get_default_config, producer_sms_beside, with_overrides


def test_defaults_and_str():
    c = GemmRsConfig()
    assert (c.block_n, c.producer_sms, c.consumer_grid, c.consumer_block, c.raster_rows, c.split_tail,
            c.path) == (128, 0, 16, 512, 8, False, "auto")
    s = str(c)
    assert s == ("GemmRsConfig(block_n=128, producer_sms=0, consumer_grid=16, consumer_block=512, "
                 "raster_rows=8, split_tail=False, path=auto)")
    assert "\n" not in s and "\n" not in repr(c)


def test_frozen_and_hashable():
    c = GemmRsConfig(block_n=256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_n = 128
    assert hash(c) == hash(GemmRsConfig(block_n=256)) and c == GemmRsConfig(block_n=256)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_n=64), r"block_n must be one of \(128, 256\), got 64"),
    (dict(block_n="128"), r"block_n must be one of \(128, 256\), got '128'"),
    (dict(block_n=256.0), r"block_n must be one of \(128, 256\), got 256.0"),
    (dict(consumer_block=512.0), r"consumer_block must be one of \(128, 256, 512\), got 512.0"),
    # The kernels' config fields are int32: a larger value is named here, not by the extension's binding.
    (dict(producer_sms=2**31), r"producer_sms must be <= 2147483647, got 2147483648"),
    (dict(raster_rows=2**31), r"raster_rows must be <= 2147483647, got 2147483648"),
    (dict(producer_sms=-1), r"producer_sms must be an int >= 0, got -1"),
    (dict(producer_sms=1.5), r"producer_sms must be an int >= 0, got 1.5"),
    (dict(consumer_grid=0), r"consumer_grid must be an int >= 1, got 0"),
    (dict(consumer_grid=True), r"consumer_grid must be an int >= 1, got True"),
    (dict(consumer_grid=100), r"consumer_grid must be <= 64 \(the consumer kernel's limit\), got 100"),
    (dict(consumer_block=1024), r"consumer_block must be one of \(128, 256, 512\), got 1024"),
    (dict(path="cuda"), r"path must be one of \('auto', 'fused', 'xla'\), got 'cuda'"),
    (dict(split_tail=2), r"split_tail must be a bool, got 2"),
    (dict(split_tail="no"), r"split_tail must be a bool, got 'no'"),
    (dict(split_tail=1.0), r"split_tail must be a bool, got 1.0"),
])
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match="GemmRsConfig: " + match):
        GemmRsConfig(**kwargs)


def test_split_tail_from_int():
    # bench --configs and JSON tables spell it 0/1; the config stores a bool (equal and same hash).
    assert GemmRsConfig(split_tail=0).split_tail is False and GemmRsConfig(split_tail=1).split_tail is True
    assert GemmRsConfig(split_tail=np.int64(0)) == GemmRsConfig(split_tail=False)
    assert hash(GemmRsConfig(split_tail=0)) == hash(GemmRsConfig())


def test_valid_values():
    for block_n in (128, 256):
        for consumer_block in (128, 256, 512):
            for path in ("auto", "fused", "xla"):
                GemmRsConfig(block_n=block_n, consumer_block=consumer_block, path=path, producer_sms=100,
                             consumer_grid=32)


def test_default_config():
    assert get_default_config() is None
    c = GemmRsConfig(path="xla")
    assert set_default_config(c) is None
    assert get_default_config() is c
    assert set_default_config(None) is c
    with using_config(c):
        assert get_default_config() is c
    assert get_default_config() is None
    with pytest.raises(ValueError, match="set_default_config: config must be a GemmRsConfig or None, got dict"):
        set_default_config({"path": "xla"})


def test_heuristic():
    c = heuristic_config(8192, 8192, 1024, 2, jnp.bfloat16)
    # CPU: no GPU core count, so the H100/H200 SXM 132 SMs; 24 of them go to the consumer (K <= 1024).
    assert c == GemmRsConfig(block_n=256, producer_sms=108, consumer_grid=24, consumer_block=512, raster_rows=8)
    assert heuristic_config(8192, 16384, 2048, 2, jnp.bfloat16).consumer_grid == 12
    assert heuristic_config(8192, 8192, 3584, 2, jnp.bfloat16).consumer_grid == 8
    assert heuristic_config(8192, 8192, 6656, 2, jnp.bfloat16).consumer_grid == 4
    assert heuristic_config(8192, 8320, 1024, 2, jnp.bfloat16).block_n == 128  # N % 256 != 0


def test_heuristic_caps_the_budget_at_the_partition_blocks():
    # The blocks of the local partition come from the kernels' plan (padded: whole blocks).
    if _extension.module()[0] is None:
        pytest.skip(f"the kernels' plan needs the extension: {_extension.module()[1]}")
    # Fewer producer blocks in the local partition than the budget: one consumer CTA per block.
    assert heuristic_config(256, 256, 64, 2, jnp.float16).consumer_grid == 1
    assert heuristic_config(512, 384, 64, 2, jnp.float16).consumer_grid == 6  # 2 rows x 3 blocks of 128
    assert heuristic_config(16, 16, 16, 8, "bfloat16").consumer_grid == 1
    # A partition of 100 rows is one padded tile row: 1 x 3 blocks of 128 (a floor would say 0).
    assert heuristic_config(200, 384, 64, 2, jnp.float16).consumer_grid == 3
    # Scattered over N: the partition is [M, N / W], whatever M is.
    c = heuristic_config(30, 1024, 64, 4, jnp.bfloat16, scatter_cols=True)
    assert (c.block_n, c.consumer_grid, c.producer_sms) == (256, 1, 131)


def test_producer_beside_the_consumer():
    # The one statement of the SM split: the persistent producer takes the SMs the consumer leaves.
    assert producer_sms_beside(24, sm_count=132) == 108 and producer_sms_beside(200, sm_count=132) == 1
    assert producer_sms_beside(16) == 132 - 16  # CPU: the H100/H200 SXM count
    base = GemmRsConfig(block_n=256, producer_sms=100, consumer_grid=32)
    assert with_overrides(base, {"consumer_grid": 8}) == GemmRsConfig(block_n=256, producer_sms=124, consumer_grid=8)
    assert with_overrides(base, {"consumer_grid": 8, "producer_sms": 0}).producer_sms == 0


@pytest.mark.parametrize("args, message", [
    ((8192, 8192, 1024, 0, jnp.bfloat16), r"heuristic_config: world must be an int >= 1, got 0"),
    ((-1, 8192, 1024, 2, jnp.bfloat16), r"heuristic_config: m must be an int >= 0, got -1"),
    ((64, -5, 1024, 2, jnp.bfloat16), r"heuristic_config: n must be an int >= 0, got -5"),
    ((64, 64, 2.5, 2, jnp.bfloat16), r"heuristic_config: k must be an int >= 0, got 2.5"),
    ((64, 64, 64, 2, jnp.int32), r"heuristic_config: dtype must be one of \['bfloat16', 'float16', 'float32', "
                                 r"'float8_e4m3fn', 'float8_e5m2'\], got <class 'jax.numpy.int32'>"),
    ((64, 64, 64, 2, "nope"), r"heuristic_config: dtype must be one of .*got 'nope'"),
])
def test_heuristic_checks_its_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        heuristic_config(*args)


def test_ag_heuristic_checks_its_arguments():
    from entwine_jax import ag_heuristic_config
    with pytest.raises(ValueError, match=r"ag_heuristic_config: world must be an int >= 1, got 0"):
        ag_heuristic_config(64, 64, 64, 0, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"ag_heuristic_config: rows must be an int >= 0, got -4"):
        ag_heuristic_config(-4, 64, 64, 2, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"ag_heuristic_config: dtype must be one of .*got dtype\('int32'\)"):
        ag_heuristic_config(64, 64, 64, 2, jnp.dtype("int32"))
    with pytest.raises(ValueError, match=r"ag_heuristic_config: path must be one of \('auto', 'fused', 'xla'\), "
                                         r"got 'gpu'"):
        ag_heuristic_config(64, 64, 64, 2, jnp.bfloat16, path="gpu")
    assert ag_heuristic_config(64, 64, 64, 2, jnp.float8_e4m3fn).block_n == 128
