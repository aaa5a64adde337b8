# Every bad input raises a ValueError at trace time that names the argument, the expected and the
# actual value (never an XLA error).
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from entwine_jax import gemm_rs


def trace(x_shape, w_shape, x_dtype=jnp.bfloat16, w_dtype=None, world=4, **kwargs):
    """Trace gemm_rs on these per-device shapes (inputs replicated) inside a shard_map over `world` devices."""
    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])
    replicated = jax.sharding.NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct(x_shape, x_dtype, sharding=replicated)
    w = jax.ShapeDtypeStruct(w_shape, w_dtype or x_dtype, sharding=replicated)
    f = jax.shard_map(lambda x, w: gemm_rs(x, w, **kwargs), mesh=mesh, in_specs=(P(), P()), out_specs=P())
    with jax.set_mesh(mesh):
        jax.eval_shape(f, x, w)


ERRORS = [
    # (x local shape, w local shape, kwargs, message regex)
    ((8,), (8, 4), dict(axis_name="tp"), r"x must have rank >= 2 \(\[\.\.\., K_local\]\), got rank 1 \(shape \(8,\)\)"),
    ((2, 8), (8,), dict(axis_name="tp"), r"w must have rank 2 \(\[K_local, N\]\), got rank 1 \(shape \(8,\)\)"),
    ((2, 8), (8, 4, 1), dict(axis_name="tp"), r"w must have rank 2 .*got rank 3"),
    ((2, 8), (6, 4), dict(axis_name="tp"), r"x.shape\[-1\] \(K_local\) must equal w.shape\[0\], got 8 and 6"),
    ((2, 8), (8, 4), dict(axis_name="sp"), r"axis_name 'sp' is not bound; call gemm_rs inside jax.shard_map"),
    ((2, 8), (8, 4), dict(axis_name=0), r"axis_name must be a mesh axis name \(a str\) or a tuple of them, got 0"),
    ((2, 8), (8, 4), dict(axis_name="tp", scatter_dimension=2),
     r"scatter_dimension must be an int in \[-2, 2\) for an output of rank 2 \(shape \(2, 4\)\), got 2"),
    ((2, 8), (8, 4), dict(axis_name="tp", scatter_dimension=-3), r"scatter_dimension must be an int in \[-2, 2\).*got -3"),
    ((2, 8), (8, 4), dict(axis_name="tp", scatter_dimension=0.0), r"scatter_dimension must be an int.*got 0.0"),
    ((2, 8), (8, 4), dict(axis_name="tp", scatter_dimension=True), r"scatter_dimension must be an int.*got True"),
    ((6, 8), (8, 4), dict(axis_name="tp"),
     r"output dim 0 \(size 6\) must be divisible by the size of axis 'tp' \(4\); output shape \(6, 4\)"),
    ((8, 8), (8, 6), dict(axis_name="tp", scatter_dimension=-1), r"output dim 1 \(size 6\) must be divisible .*\(4\)"),
    ((2, 3, 8), (8, 4), dict(axis_name="tp", scatter_dimension=1), r"output dim 1 \(size 3\) must be divisible"),
    ((4, 0), (0, 4), dict(axis_name="tp"), r"x.shape\[-1\] \(K_local\) must be > 0, got shape \(4, 0\)"),
    ((0, 8), (8, 4), dict(axis_name="tp"), r"output dim 0 \(the scattered dim\) must be > 0, got output shape \(0, 4\)"),
    ((4, 8), (8, 4), dict(axis_name="tp", config={"block_n": 128}), r"config must be a GemmRsConfig or None, got dict"),
]


@pytest.mark.parametrize("x_shape,w_shape,kwargs,match", ERRORS)
def test_shape_and_argument_errors(x_shape, w_shape, kwargs, match):
    with pytest.raises(ValueError, match="gemm_rs: " + match):
        trace(x_shape, w_shape, **kwargs)


def test_an_axis_of_vmap_is_not_a_mesh_axis():
    # jax.vmap(axis_name=...) binds a name with a size but no devices: the ops say so, before JAX's
    # own error from deep inside the call.
    from entwine_jax import ag_gemm
    x, w = jnp.ones((4, 8, 16)), jnp.ones((4, 16, 8))
    for op in (gemm_rs, ag_gemm):
        with pytest.raises(ValueError, match=rf"{op.__name__}: axis_name 'i' is not an axis of an enclosing "
                                             r"jax.shard_map \(an axis jax.vmap binds is not one\)"):
            jax.eval_shape(jax.vmap(lambda x, w, op=op: op(x, w, axis_name="i"), axis_name="i"), x, w)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.complex64])
def test_bad_dtype(dtype):
    name = jnp.dtype(dtype).name
    match = rf"gemm_rs: x.dtype must be bfloat16 or float16 \(or float32 on the XLA path\), got {name}"
    with pytest.raises(ValueError, match=match):
        trace((4, 8), (8, 4), x_dtype=dtype, axis_name="tp")


def test_mixed_dtypes():
    with pytest.raises(ValueError, match=r"gemm_rs: w.dtype must equal x.dtype \(bfloat16\), got float16"):
        trace((4, 8), (8, 4), x_dtype=jnp.bfloat16, w_dtype=jnp.float16, axis_name="tp")
    with pytest.raises(ValueError, match=r"w.dtype must equal x.dtype \(float16\), got float32"):
        trace((4, 8), (8, 4), x_dtype=jnp.float16, w_dtype=jnp.float32, axis_name="tp")


def test_outside_shard_map():
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 4), jnp.bfloat16)
    with pytest.raises(ValueError, match="axis_name 'tp' is not bound"):
        gemm_rs(x, w, axis_name="tp")
    with pytest.raises(ValueError, match="axis_name 'tp' is not bound"):
        jax.jit(lambda x, w: gemm_rs(x, w, axis_name="tp"))(x, w)


def test_not_an_array():
    with pytest.raises(ValueError, match="gemm_rs: x must be an array, got list"):
        gemm_rs([[1.0]], np.ones((1, 1)), axis_name="tp")


def test_float64_numpy_input_rejected():
    # numpy float64 must not be silently narrowed to float32.
    with pytest.raises(ValueError, match="got float64"):
        gemm_rs(np.ones((4, 8)), np.ones((8, 4)), axis_name="tp")


def test_error_in_eager_shard_map_is_value_error():
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    f = jax.shard_map(lambda x, w: gemm_rs(x, w, axis_name="tp"), mesh=mesh,
                      in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp"))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((3, 8), jnp.bfloat16), P(None, "tp"))
        w = jax.device_put(jnp.ones((8, 4), jnp.bfloat16), P("tp"))
        with pytest.raises(ValueError, match=re.escape("output dim 0 (size 3) must be divisible by the size of axis 'tp' (2)")):
            f(x, w)
