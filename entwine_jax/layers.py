# Tensor-parallel linear layers for Flax (NNX and Linen), used inside jax.shard_map: the
# row-parallel layer runs entwine_jax.gemm_rs (GEMM + ReduceScatter), its column-parallel partner
# entwine_jax.ag_gemm (AllGather + GEMM) on a sharded input, else a plain XLA dot. Parameters carry
# MaxText-style logical-axis metadata; partition_specs() maps it to the PartitionSpecs of a
# shard_map's in_specs. Needs flax (`pip install "entwine_jax[layers]"`).
"""Tensor-parallel linear layers over entwine_jax.gemm_rs and ag_gemm, for Flax NNX and Linen.

The layer code runs inside ``jax.shard_map`` and sees local shards. With the tensor-parallel mesh
axis ``tp`` of size W:

===============  ============================  ==================================================  =======
layer            kernel (global -> local)      input -> output (local)                             op
===============  ============================  ==================================================  =======
row-parallel     ``[in, out] -> [in/W, out]``  ``[T, in/W] -> [T/W, out]`` (``scatter="rows"``)    gemm_rs
                                               ``[B, S, in/W] -> [B, S/W, out]`` (``"sequence"``)  gemm_rs
                                               ``[T, in/W] -> [T, out/W]`` (``scatter="hidden"``)  gemm_rs
column-parallel  ``[in, out] -> [in, out/W]``  ``[T, in] -> [T, out/W]`` (``gather=None``)         XLA dot
                                               ``[T/W, in] -> [T, out/W]`` (``gather="rows"``)     ag_gemm
                                               ``[B, S/W, in] -> [B, S, out/W]`` (``"sequence"``)  ag_gemm
                                               ``[T, in/W] -> [T, out/W]`` (``gather="hidden"``)   ag_gemm
===============  ============================  ==================================================  =======

``scatter="rows"`` is sequence (token) parallelism, the Entwine paper's layout: the reduce-scatter
splits the output's leading dim (for an N-D input ``[B, S, in/W]`` that is B).
``scatter="sequence"`` splits dim 1, the S of ``[B, S, in/W]``, keeping the batch dim whole.
``scatter="hidden"`` splits the last output dim (MaxText's layout with the embedding sharded over
``tp``). gemm_rs maps all three onto the fused kernels (row or column partitions of the product;
for "sequence" after a permutation of x's rows, one copy of x) where they can run. The
column-parallel layer's ``gather`` undoes any of them: entwine_jax.ag_gemm all-gathers the input
over ``tp`` inside the GEMM (``gather_dimension`` 0, 1 or -1; for "hidden" the gathered dim is the
contraction dim and the kernel holds all of ``in``). Each op's backward is the other op (ag_gemm's
dx is a gemm_rs, gemm_rs's an ag_gemm), so a block built from the two layers has no other
collective over ``tp`` on its activations, forward or backward. (The gradient of a parameter
replicated over ``tp``, a norm scale or the row-parallel bias, is still summed over ``tp``: a
gradient all-reduce, as over a data-parallel axis.)

A tensor-parallel SwiGLU MLP, sequence parallel (per device, x: ``[T/W, D]``, e.g. the output of
an RMSNorm applied to the sequence-sharded residual stream)::

    y = down(jax.nn.silu(gate(x)) * up(x))                       # [T, F/W] -> [T/W, D]

with ``gate = ColumnParallelLinear(D, F, gather="rows", rngs=rngs)`` (same for ``up``) and
``down = RowParallelLinear(F, D, rngs=rngs)``. Each column-parallel call is one ag_gemm and gathers
x itself, so x would travel over ``tp`` twice. ``column_parallel_group`` applies several layers to
one input with one gather (one grouped ag_gemm; its backward is one gemm_rs), each layer keeping
its own parameters (the same for q, k and v, of any widths)::

    g, u = column_parallel_group(x, (gate, up))
    y = down(jax.nn.silu(g) * u)

``column_parallel_linear(x, (k1, k2, ...), (b1, b2, ...), gather=...)`` is the same on kernels.

The attention output projection of ``H`` heads of size ``Dh`` is
``RowParallelLinear((H, Dh), D, kernel_axes=("heads", "kv", "embed"))`` applied to ``[T, H/W, Dh]``.

Bias: the row-parallel bias is added once, after the reduce-scatter, to the output shard (adding it
before the reduction would add it W times). It is a full ``[out]`` vector replicated over ``tp``;
with ``scatter="hidden"`` each rank adds its slice. Its gradient sums the output cotangent over
all rows of all ranks (shard_map inserts the psum over ``tp``, as the bias is replicated there).

Parameters are created at global shape (outside shard_map) with logical-axis metadata
(``nnx.with_partitioning`` / ``nn.with_logical_partitioning``): row kernel ``("mlp", "embed")``,
column kernel ``("embed", "mlp")`` by default. ``partition_specs(params, rules)`` turns the
metadata into the PartitionSpecs of the shard_map's ``in_specs`` with ``DEFAULT_LOGICAL_AXIS_RULES``
(``"mlp"``, ``"heads"`` -> ``"tp"``; ``"exp"`` -> ``"ep"``; ``"embed"`` -> replicated; ``"batch"`` ->
``"dp"``) or your rules.

Flax NNX creates annotated parameters eagerly sharded (``nnx.use_eager_sharding``, on by default):
create NNX layers under ``jax.set_mesh(mesh)`` and ``nnx.logical_axis_rules(rules)`` (then the
parameters come out sharded as the rules say), or under ``nnx.use_eager_sharding(False)``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

try:
    import flax.linen as nn
    from flax import nnx
    from flax.core import meta as flax_meta
except ImportError as e:  # flax is an optional dependency of entwine_jax
    raise ImportError(f"entwine_jax.layers needs flax: pip install 'entwine_jax[layers]' ({e})") from e

from entwine_jax.ag_gemm.config import AgGemmConfig
from entwine_jax.api import ag_gemm, gemm_rs
from entwine_jax.gemm_rs.config import GemmRsConfig
from entwine_jax.layers_fp8 import (FP8_META_NAMES, FP8_MODES, OVERWRITE_WITH_GRADIENT, Fp8Meta, check_fp8,
                                    fp8_call_arguments, fp8_meta, overwrite_with_gradient)

__all__ = ["DEFAULT_LOGICAL_AXIS_RULES", "partition_specs", "row_parallel_linear", "column_parallel_linear",
           "column_parallel_group", "FP8_META_NAMES", "fp8_meta", "Fp8Meta", "overwrite_with_gradient",
           "fp8_call_arguments",
           "RowParallelLinear", "ColumnParallelLinear", "RowParallelDense", "ColumnParallelDense"]

# Logical axis -> mesh axis (None: replicated), MaxText's names on a ("dp", "tp") mesh. A logical
# name may appear once; partition_specs takes the first match.
DEFAULT_LOGICAL_AXIS_RULES: tuple = (
    ("batch", "dp"),
    ("mlp", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("exp", "ep"),  # the MoE layers' experts (entwine_jax.moe_layers)
    ("embed", None),
    ("kv", None),
    ("vocab", None),
    ("norm", None),
)

# The dim each layout splits over the axis: the row-parallel output's (gemm_rs's scatter_dimension)
# and, to undo it, the column-parallel input's (ag_gemm's gather_dimension).
_SPLIT_DIM = {"rows": 0, "sequence": 1, "hidden": -1}
_SCATTER = tuple(_SPLIT_DIM)
_GATHER = (None, *_SPLIT_DIM)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
Array = Any
Initializer = Callable[..., Array]
default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


# ----------------------------------------------------------------------------------------------
# Argument checks (ValueError naming the argument, the expected and the actual value)
# ----------------------------------------------------------------------------------------------

def _features(where: str, name: str, value) -> tuple[int, ...]:
    dims = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise ValueError(f"{where}: {name} must be a positive int or a non-empty tuple of positive ints, "
                         f"got {value!r}")
    return tuple(int(d) for d in dims)


def positive_int(where: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return int(value)


def check_choice(where: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{where}: {name} must be one of {choices}, got {value!r}")


def check_dtype(where: str, name: str, dtype) -> None:
    if dtype is not None and jnp.dtype(dtype) not in _DTYPES:
        raise ValueError(f"{where}: {name} must be bfloat16, float16, float32 or None, got {jnp.dtype(dtype).name}")


def check_param_dtype(where: str, dtype) -> None:
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"{where}: param_dtype must be a floating dtype, got {jnp.dtype(dtype).name}")


def check_config(where: str, config, cls=GemmRsConfig) -> None:
    if config is not None and not isinstance(config, cls):
        raise ValueError(f"{where}: config must be an entwine_jax.{cls.__name__} or None, got {type(config).__name__}")


def _check_axes(where: str, name: str, axes, n: int) -> tuple:
    if not isinstance(axes, (tuple, list)) or len(axes) != n or not all(a is None or isinstance(a, str) for a in axes):
        raise ValueError(f"{where}: {name} must be a tuple of {n} logical axis names (str or None), got {axes!r}")
    return tuple(axes)


def check_axis_name(where: str, axis_name) -> Any:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names or not all(isinstance(a, str) for a in names):
        raise ValueError(f"{where}: axis_name must be a mesh axis name (str) or a tuple of them, got {axis_name!r}")
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else axis_name


def _check_layer_args(where: str, axis_name, mode_name: str, mode, modes, use_bias, dtype, param_dtype) -> Any:
    """The checks every layer shares (NNX constructors, Linen calls); returns the normalised axis_name."""
    axis_name = check_axis_name(where, axis_name)
    check_choice(where, mode_name, mode, modes)
    check_choice(where, "use_bias", use_bias, (True, False))
    check_dtype(where, "dtype", dtype)
    check_param_dtype(where, param_dtype)
    return axis_name


def check_array(where: str, name: str, v) -> None:
    if not (hasattr(v, "shape") and hasattr(v, "dtype")):
        raise ValueError(f"{where}: {name} must be an array, got {type(v).__name__}")


def axis_size_if_bound(axis_name) -> Optional[int]:
    """The size of axis_name in the enclosing shard_map, or None when no shard_map binds it."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        return None


def bound_axis_size(where: str, axis_name) -> int:
    size = axis_size_if_bound(axis_name)
    if size is None:
        raise ValueError(f"{where}: axis_name {axis_name!r} is not bound; call the layer inside jax.shard_map over a "
                         "mesh with that axis")
    return size


def compute_dtype(where: str, dtype, *arrays) -> jnp.dtype:
    # Flax's rule: no dtype given -> the promoted dtype of inputs and parameters.
    out = jnp.dtype(dtype) if dtype is not None else jnp.result_type(*[a.dtype for a in arrays])
    if out not in _DTYPES:
        raise ValueError(f"{where}: the compute dtype must be bfloat16, float16 or float32 (set dtype=), "
                         f"got {out.name}")
    return out


def _flat_init(init: Initializer, n_in: int) -> Initializer:
    """An initializer for a [*in, *out] kernel that draws it as the 2-D [prod(in), prod(out)] matrix
    (so fan-in and fan-out count every contracted / produced dim, as flax's DenseGeneral does)."""
    def wrapped(key, shape, dtype=jnp.float32):
        flat = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
        return jnp.reshape(init(key, flat, dtype), shape)
    return wrapped


# ----------------------------------------------------------------------------------------------
# Functional cores (shared by the NNX and Linen modules; usable on their own)
# ----------------------------------------------------------------------------------------------

def row_parallel_linear(x, kernel, bias=None, *, axis_name="tp", scatter: str = "rows", dtype=None,
                        config: Optional[GemmRsConfig] = None, fp8=None, where: str = "row_parallel_linear"):
    """Row-parallel linear on local shards, inside jax.shard_map: ``gemm_rs(x, kernel) + bias``.

    x: ``[..., *in_local]``; kernel: ``[*in_local, out]`` (the contraction dims sharded over
    ``axis_name``; ``kernel.ndim - 1`` trailing dims of x are contracted); bias: ``[out]`` or None,
    replicated, added after the reduce-scatter. ``scatter="rows"``: output ``[rows/W, ..., out]``
    (x's leading dim split); ``"sequence"``: ``[B, S/W, ..., out]`` (dim 1 split); ``"hidden"``:
    ``[..., out/W]``. dtype: compute and output dtype
    (default: promoted from x and kernel). config: passed to gemm_rs.
    fp8: None; "current" (the FP8 op with each rank's current scales of its x and kernel shards,
    e5m2 gradients at their current scale); "block" (block scaling: each rank's current scales per
    1x128 tile of x and per 128x128 block of the kernel, this step's, e5m2 gradients per 1x128 tile);
    or a delayed-scaling state (``fp8_meta()``, Flax's
    names), whose gradient is its next value (see the module docstring).
    """
    check_choice(where, "scatter", scatter, _SCATTER)
    check_fp8(where, fp8)
    check_dtype(where, "dtype", dtype)
    check_config(where, config)
    axis_name = check_axis_name(where, axis_name)
    check_array(where, "x", x)
    check_array(where, "kernel", kernel)
    if kernel.ndim < 2:
        raise ValueError(f"{where}: kernel must have rank >= 2 ([*in_local, out]), got shape {tuple(kernel.shape)}")
    n_in = kernel.ndim - 1
    if x.ndim < n_in + 1:
        raise ValueError(f"{where}: x must have rank >= {n_in + 1} (a row dim and {n_in} contracted dim(s)), got "
                         f"shape {tuple(x.shape)}")
    if tuple(x.shape[-n_in:]) != tuple(kernel.shape[:n_in]):
        raise ValueError(f"{where}: the last {n_in} dim(s) of x must equal the kernel's contracted dims "
                         f"{tuple(kernel.shape[:n_in])}, got x shape {tuple(x.shape)} (inside shard_map both are "
                         f"local shards: x [..., in/W], kernel [in/W, out])")
    world = bound_axis_size(where, axis_name)
    n_out = kernel.shape[-1]
    dtype = compute_dtype(where, dtype, x, kernel)
    if scatter == "rows" and x.shape[0] % world:
        raise ValueError(f"{where}: scatter='rows' splits x's leading dim over {axis_name!r} (size {world}); it must "
                         f"be divisible by {world}, got x shape {tuple(x.shape)} (flatten [B, S, ...] to [B*S, ...] to "
                         "split tokens)")
    if scatter == "sequence" and (x.ndim < n_in + 2 or x.shape[1] % world):
        raise ValueError(f"{where}: scatter='sequence' splits x's dim 1 over {axis_name!r} (size {world}); x needs a "
                         f"batch dim, that dim and {n_in} contracted dim(s), and dim 1 divisible by {world}, got x "
                         f"shape {tuple(x.shape)}")
    if scatter == "hidden" and n_out % world:
        raise ValueError(f"{where}: scatter='hidden' splits the output features ({n_out}) over {axis_name!r}; they "
                         f"must be divisible by its size {world}")
    if bias is not None:
        check_array(where, "bias", bias)
        if tuple(bias.shape) != (n_out,):
            raise ValueError(f"{where}: bias must have shape ({n_out},) (all output features, replicated over "
                             f"{axis_name!r}), got {tuple(bias.shape)}")
    x2 = x.reshape(tuple(x.shape[:-n_in]) + (-1,)) if n_in > 1 else x
    w2 = kernel.reshape(-1, n_out) if n_in > 1 else kernel
    x2, w2 = x2.astype(dtype), w2.astype(dtype)
    fp8_kwargs, finish = fp8_call_arguments(where, fp8, x2, w2, axis_name, dtype)
    y = finish(gemm_rs(x2, w2, axis_name=axis_name, scatter_dimension=_SPLIT_DIM[scatter], config=config,
                       **fp8_kwargs))
    if bias is None:
        return y
    b = bias.astype(dtype)
    if scatter == "hidden":
        # This rank holds output features [r*n/W, (r+1)*n/W) (psum_scatter's tiled order).
        shard = n_out // world
        b = jax.lax.dynamic_slice_in_dim(b, jax.lax.axis_index(axis_name) * shard, shard)
    # After the reduce-scatter: every output element gets the bias exactly once.
    return y + b


def column_parallel_linear(x, kernel, bias=None, *, axis_name="tp", gather: Optional[str] = None, dtype=None,
                           config: Optional[AgGemmConfig] = None, fp8=None, where: str = "column_parallel_linear"):
    """Column-parallel linear on local shards: ``x @ kernel + bias``, with x first all-gathered over
    ``axis_name`` when ``gather`` is set (one entwine_jax.ag_gemm: the gather fused into the GEMM).

    x: ``[..., in]`` (``gather=None``: a plain XLA dot); ``gather="rows"``: ``[rows/W, ..., in]``;
    ``"sequence"``: ``[B, S/W, ..., in]``; ``"hidden"``: ``[..., in/W]``. kernel: ``[in, *out_local]``
    (output dims sharded over ``axis_name``; several kernels concatenated on dim 1 share one gather);
    bias: ``kernel.shape[1:]`` or None, added after the GEMM. Output ``[..., *out_local]`` with the
    gathered dim whole. dtype: compute and output dtype (default: promoted from x and kernel).
    config: passed to ag_gemm (unused with ``gather=None``). fp8: as for row_parallel_linear (an
    ag_gemm: needs ``gather``; a group takes None, "current" (its kernels quantised with one scale) or
    "block" (each kernel with its own block scales).
    """
    if isinstance(kernel, (tuple, list)):
        return _column_parallel_group(x, tuple(kernel), bias, axis_name=axis_name, gather=gather, dtype=dtype,
                                      config=config, fp8=fp8, where=where)
    axis_name, dtype = _check_column(x, kernel, bias, axis_name=axis_name, gather=gather, dtype=dtype, config=config,
                                     fp8=fp8, where=where)
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    if fp8 is not None:
        kernel2d = kernel.reshape(kernel.shape[0], -1)
        fp8_kwargs, finish = fp8_call_arguments(where, fp8, x, kernel2d, axis_name, dtype,
                                                contracted_gather=gather == "hidden")
        y = finish(ag_gemm(x, kernel2d, axis_name=axis_name, gather_dimension=_SPLIT_DIM[gather], config=config,
                           **fp8_kwargs))
        y = y.reshape(tuple(y.shape[:-1]) + tuple(kernel.shape[1:]))
    elif gather is None:
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32).astype(dtype)
    else:
        # ag_gemm takes a [K, N] kernel: the output dims flattened into N and restored after.
        out_local = tuple(kernel.shape[1:])
        y = ag_gemm(x, kernel.reshape(kernel.shape[0], -1), axis_name=axis_name,
                    gather_dimension=_SPLIT_DIM[gather], config=config)
        y = y.reshape(tuple(y.shape[:-1]) + out_local)
    return y if bias is None else y + bias.astype(dtype)


def _check_column(x, kernel, bias, *, axis_name, gather, dtype, config, fp8=None, where):
    """ValueError for a column-parallel call that cannot run; (axis_name, compute dtype) otherwise."""
    check_choice(where, "gather", gather, _GATHER)
    check_fp8(where, fp8)
    if fp8 is not None and gather is None:
        raise ValueError(f"{where}: fp8={fp8 if isinstance(fp8, str) else 'a delayed-scaling state'} runs the FP8 "
                         "ag_gemm, which needs a sharded input: set gather ('rows', 'sequence' or 'hidden')")
    check_dtype(where, "dtype", dtype)
    check_config(where, config, AgGemmConfig)
    axis_name = check_axis_name(where, axis_name)
    check_array(where, "x", x)
    check_array(where, "kernel", kernel)
    if kernel.ndim < 2:
        raise ValueError(f"{where}: kernel must have rank >= 2 ([in, *out_local]), got shape {tuple(kernel.shape)}")
    min_rank = {"rows": 2, "sequence": 3}.get(gather, 1)
    if x.ndim < min_rank:
        raise ValueError(f"{where}: x must have rank >= {min_rank}{f' for gather={gather!r}' if gather else ''}, got "
                         f"shape {tuple(x.shape)}")
    dtype = compute_dtype(where, dtype, x, kernel)
    gathered = list(x.shape)
    if gather is not None:
        gathered[_SPLIT_DIM[gather]] *= bound_axis_size(where, axis_name)
    if gathered[-1] != kernel.shape[0]:
        raise ValueError(f"{where}: x.shape[-1] must equal kernel.shape[0] ({kernel.shape[0]}), got x shape "
                         f"{tuple(gathered)}{' after the all-gather' if gather else ''}")
    if bias is not None:
        check_array(where, "bias", bias)
        if tuple(bias.shape) != tuple(kernel.shape[1:]):
            raise ValueError(f"{where}: bias must have the kernel's output shape {tuple(kernel.shape[1:])} (local "
                             f"shard), got {tuple(bias.shape)}")
    return axis_name, dtype


def _check_local_shards(where: str, axis_name, kernel_shape, expected_global, sharded_dim: int, what: str):
    """Inside shard_map: the kernel must arrive with dim `sharded_dim` split over axis_name."""
    world = bound_axis_size(where, axis_name)
    expected = list(expected_global)
    if expected[sharded_dim] % world:
        raise ValueError(f"{where}: {what} ({expected[sharded_dim]}) must be divisible by the size of {axis_name!r} "
                         f"({world})")
    expected[sharded_dim] //= world
    if tuple(kernel_shape) != tuple(expected):
        raise ValueError(f"{where}: the kernel arrived with local shape {tuple(kernel_shape)}, expected "
                         f"{tuple(expected)} (global {tuple(expected_global)} with dim {sharded_dim} split over "
                         f"{axis_name!r} of size {world}); build the shard_map in_specs with partition_specs(params, "
                         "rules), whose rules map this kernel's sharded logical axis to the same mesh axis")


# ----------------------------------------------------------------------------------------------
# Flax NNX
# ----------------------------------------------------------------------------------------------

class RowParallelLinear(nnx.Module):
    """Row-parallel linear (attention output / MLP down projection) over gemm_rs, Flax NNX.

    Created at global shape: kernel ``[*in_features, out_features]`` with logical axes
    ``kernel_axes`` (default ``("mlp", "embed")``; for ``in_features=(heads, head_dim)`` pass e.g.
    ``("heads", "kv", "embed")``), bias ``[out_features]`` with ``bias_axes`` (default
    ``(kernel_axes[-1],)``, replicated under the default rules). Called inside shard_map on local
    shards: x ``[rows, ..., in_features[0]/W, *in_features[1:]]`` -> ``[rows/W, ..., out]``
    (``scatter="rows"``), ``[B, S/W, ..., out]`` (``"sequence"``) or ``[rows, ..., out/W]``
    (``"hidden"``). See the module docstring.
    """

    def __init__(self, in_features: Union[int, Sequence[int]], out_features: int, *, axis_name="tp",
                 scatter: str = "rows", use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
                 kernel_init: Initializer = default_kernel_init, bias_init: Initializer = default_bias_init,
                 kernel_axes: Optional[Sequence[Optional[str]]] = None,
                 bias_axes: Optional[Sequence[Optional[str]]] = None,
                 config: Optional[GemmRsConfig] = None, fp8: Optional[str] = None, amax_history_length: int = 1024,
                 rngs: nnx.Rngs):
        where = type(self).__name__
        self.fp8 = _nnx_fp8(self, where, fp8, amax_history_length)
        self.in_features = _features(where, "in_features", in_features)
        self.out_features = positive_int(where, "out_features", out_features)
        self.axis_name = _check_layer_args(where, axis_name, "scatter", scatter, _SCATTER, use_bias, dtype, param_dtype)
        check_config(where, config)
        n_in = len(self.in_features)
        if kernel_axes is None and n_in != 1:
            raise ValueError(f"{where}: kernel_axes is required when in_features is a tuple ({self.in_features}); "
                             "e.g. ('heads', 'kv', 'embed')")
        self.kernel_axes = _check_axes(where, "kernel_axes", kernel_axes or ("mlp", "embed"), n_in + 1)
        self.bias_axes = _check_axes(where, "bias_axes", bias_axes or self.kernel_axes[-1:], 1)
        self.scatter, self.use_bias, self.dtype, self.param_dtype, self.config = (
            scatter, use_bias, dtype, param_dtype, config)
        init = nnx.with_partitioning(_flat_init(kernel_init, n_in), self.kernel_axes)
        self.kernel = nnx.Param(init(rngs.params(), self.in_features + (self.out_features,), param_dtype))
        self.bias: Optional[nnx.Param] = nnx.data(None)
        if use_bias:
            binit = nnx.with_partitioning(bias_init, self.bias_axes)
            self.bias = nnx.Param(binit(rngs.params(), (self.out_features,), param_dtype))

    def __call__(self, x):
        where = type(self).__name__
        kernel = self.kernel[...]
        _check_local_shards(where, self.axis_name, kernel.shape, self.in_features + (self.out_features,), 0,
                            "in_features[0]")
        bias = self.bias[...] if self.bias is not None else None
        return row_parallel_linear(x, kernel, bias, axis_name=self.axis_name, scatter=self.scatter, dtype=self.dtype,
                                   config=self.config, fp8=_nnx_fp8_argument(self), where=where)


def _nnx_fp8(module, where: str, fp8, amax_history_length: int) -> Optional[str]:
    """Checks an NNX layer's fp8 mode; "delayed" gives the module its state as Fp8Meta variables."""
    check_choice(where, "fp8", fp8, FP8_MODES)
    if fp8 == "delayed":
        for name, value in fp8_meta(positive_int(where, "amax_history_length", amax_history_length)).items():
            setattr(module, name, Fp8Meta(value))
    return fp8


def _nnx_fp8_argument(module):
    """The fp8 argument of the functional core: the mode, or the module's delayed-scaling state."""
    if module.fp8 != "delayed":
        return module.fp8
    return {name: getattr(module, name)[...] for name in FP8_META_NAMES}


def _column_parallel_group(x, kernels: tuple, biases, *, axis_name, gather, dtype, config, fp8, where):
    """column_parallel_linear of several kernels on one x: one ag_gemm (one gather of x) for all."""
    if not kernels:
        raise ValueError(f"{where}: kernel is an empty group")
    if fp8 not in (None, "current", "block"):
        raise ValueError(f"{where}: a group takes fp8=None, 'current' or 'block' (one gather quantises the group's "
                         f"kernels, with one scale or each with its block scales); delayed scaling keeps a state per "
                         f"layer: call the layers one by one")
    if biases is not None and (not isinstance(biases, (tuple, list)) or len(biases) != len(kernels)):
        raise ValueError(f"{where}: with {len(kernels)} kernels, bias must be None or a tuple of {len(kernels)} "
                         f"(each None or the kernel's output shape), got {type(biases).__name__}")
    biases = tuple(biases) if biases is not None else (None,) * len(kernels)
    for i, k in enumerate(kernels):
        check_array(where, f"kernel[{i}]", k)
        if k.ndim < 2 or k.shape[0] != kernels[0].shape[0]:
            raise ValueError(f"{where}: the kernels of a group must be [in, *out_local] with one `in`: kernel[0] "
                             f"{tuple(kernels[0].shape)}, kernel[{i}] {tuple(k.shape)}")
    if gather is None:
        return tuple(column_parallel_linear(x, k, b, axis_name=axis_name, dtype=dtype, config=config, fp8=fp8,
                                            where=where)
                     for k, b in zip(kernels, biases))
    # Each kernel checked as if alone (shapes, dtypes, bias), then one call: the gathered x serves all.
    for k, b in zip(kernels, biases):
        axis_name, _ = _check_column(x, k, b, axis_name=axis_name, gather=gather, dtype=dtype, config=config,
                                     fp8=fp8, where=where)
    dtype = compute_dtype(where, dtype, x, *kernels)
    x = x.astype(dtype)
    group = tuple(k.astype(dtype).reshape(k.shape[0], -1) for k in kernels)
    # The group's outputs are cast to dtype below: the call's finishing function is that cast.
    fp8_kwargs, _ = fp8_call_arguments(where, fp8, x, group, axis_name, dtype, contracted_gather=gather == "hidden")
    ys = ag_gemm(x, group, axis_name=axis_name, gather_dimension=_SPLIT_DIM[gather], config=config, **fp8_kwargs)
    ys = tuple(y.astype(dtype) for y in ys)
    out = []
    for y, k, b in zip(ys, kernels, biases):
        y = y.reshape(tuple(y.shape[:-1]) + tuple(k.shape[1:]))
        out.append(y if b is None else y + b.astype(dtype))
    return tuple(out)


def column_parallel_group(x, modules: Sequence["ColumnParallelLinear"]) -> tuple:
    """Several ColumnParallelLinear layers applied to one input with one all-gather of it (e.g. gate and
    up of a SwiGLU, or query, key and value): (modules[0](x), modules[1](x), ...), computed by one
    grouped entwine_jax.ag_gemm whose backward is one gemm_rs. The layers keep their own parameters;
    they must share in_features, gather, axis_name, dtype and config."""
    where = "column_parallel_group"
    modules = tuple(modules)
    if not modules or not all(isinstance(m, ColumnParallelLinear) for m in modules):
        raise ValueError(f"{where}: modules must be a non-empty sequence of ColumnParallelLinear, got {modules!r}")
    first = modules[0]
    shared = ("in_features", "gather", "axis_name", "dtype", "config", "fp8")
    for i, m in enumerate(modules[1:], 1):
        differ = [name for name in shared if getattr(m, name) != getattr(first, name)]
        if differ:
            raise ValueError(f"{where}: modules[{i}] differs from modules[0] in {differ}: one gather needs them equal")
    kernels, biases = [], []
    for m in modules:
        kernel = m.kernel[...]
        _check_local_shards(type(m).__name__, m.axis_name, kernel.shape, (m.in_features,) + m.out_features, 1,
                            "out_features[0]")
        kernels.append(kernel)
        biases.append(m.bias[...] if m.bias is not None else None)
    return column_parallel_linear(x, tuple(kernels), tuple(biases), axis_name=first.axis_name, gather=first.gather,
                                  dtype=first.dtype, config=first.config, fp8=first.fp8, where=where)


class ColumnParallelLinear(nnx.Module):
    """Column-parallel linear (MLP up/gate, q/k/v projections), Flax NNX.

    Created at global shape: kernel ``[in_features, *out_features]`` with logical axes
    ``kernel_axes`` (default ``("embed", "mlp")``; for ``out_features=(heads, head_dim)`` pass e.g.
    ``("embed", "heads", "kv")``), bias ``out_features`` with ``bias_axes`` (default
    ``kernel_axes[1:]``). Called inside shard_map: output ``[..., out_features[0]/W, ...]``.
    ``gather=None``: the input is whole (``[..., in_features]``), a plain XLA dot. ``gather="rows"`` /
    ``"sequence"`` / ``"hidden"``: a row- / sequence- / hidden-scattered input (the output of
    RowParallelLinear's ``scatter``), all-gathered over ``axis_name`` inside the GEMM by
    entwine_jax.ag_gemm, whose backward is a gemm_rs. config: an entwine_jax.AgGemmConfig for
    ag_gemm (default: its heuristic).
    """

    def __init__(self, in_features: int, out_features: Union[int, Sequence[int]], *, axis_name="tp",
                 gather: Optional[str] = None, use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
                 kernel_init: Initializer = default_kernel_init, bias_init: Initializer = default_bias_init,
                 kernel_axes: Optional[Sequence[Optional[str]]] = None,
                 bias_axes: Optional[Sequence[Optional[str]]] = None,
                 config: Optional[AgGemmConfig] = None, fp8: Optional[str] = None, amax_history_length: int = 1024,
                 rngs: nnx.Rngs):
        where = type(self).__name__
        self.fp8 = _nnx_fp8(self, where, fp8, amax_history_length)
        self.in_features = positive_int(where, "in_features", in_features)
        self.out_features = _features(where, "out_features", out_features)
        self.axis_name = _check_layer_args(where, axis_name, "gather", gather, _GATHER, use_bias, dtype, param_dtype)
        check_config(where, config, AgGemmConfig)
        n_out = len(self.out_features)
        if kernel_axes is None and n_out != 1:
            raise ValueError(f"{where}: kernel_axes is required when out_features is a tuple ({self.out_features}); "
                             "e.g. ('embed', 'heads', 'kv')")
        self.kernel_axes = _check_axes(where, "kernel_axes", kernel_axes or ("embed", "mlp"), n_out + 1)
        self.bias_axes = _check_axes(where, "bias_axes", bias_axes or self.kernel_axes[1:], n_out)
        self.gather, self.use_bias, self.dtype, self.param_dtype, self.config = (
            gather, use_bias, dtype, param_dtype, config)
        init = nnx.with_partitioning(_flat_init(kernel_init, 1), self.kernel_axes)
        self.kernel = nnx.Param(init(rngs.params(), (self.in_features,) + self.out_features, param_dtype))
        self.bias: Optional[nnx.Param] = nnx.data(None)
        if use_bias:
            binit = nnx.with_partitioning(_flat_init(bias_init, 0), self.bias_axes)
            self.bias = nnx.Param(binit(rngs.params(), self.out_features, param_dtype))

    def __call__(self, x):
        where = type(self).__name__
        kernel = self.kernel[...]
        _check_local_shards(where, self.axis_name, kernel.shape, (self.in_features,) + self.out_features, 1,
                            "out_features[0]")
        bias = self.bias[...] if self.bias is not None else None
        return column_parallel_linear(x, kernel, bias, axis_name=self.axis_name, gather=self.gather, dtype=self.dtype,
                                      config=self.config, fp8=_nnx_fp8_argument(self), where=where)


# ----------------------------------------------------------------------------------------------
# Flax Linen
# ----------------------------------------------------------------------------------------------

def linen_param(module: nn.Module, name: str, init: Initializer, axes, shape, param_dtype, where: str):
    """self.param with logical partitioning; says which shard was expected when the stored one differs."""
    if module.has_variable("params", name):
        stored = flax_meta.unbox(module.get_variable("params", name))
        if tuple(stored.shape) != tuple(shape):
            raise ValueError(f"{where}: parameter {name!r} arrived with shape {tuple(stored.shape)}, expected "
                             f"{tuple(shape)} for this input (inside shard_map: the local shard); build the shard_map "
                             "in_specs with partition_specs(params, rules)")
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, param_dtype)


class _LinenLinear(nn.Module):
    """The fields both Linen layers take (as the NNX layers' keyword arguments)."""
    features: Any
    axis_name: Any = "tp"
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init
    kernel_axes: Optional[Sequence[Optional[str]]] = None
    bias_axes: Optional[Sequence[Optional[str]]] = None
    fp8: Optional[str] = None
    amax_history_length: int = 1024


class RowParallelDense(_LinenLinear):
    """Row-parallel linear over gemm_rs, Flax Linen (the NNX RowParallelLinear's twin).

    ``features``: output features. The last ``contract_dims`` dims of x are contracted (2 for an
    attention output ``[T, heads, head_dim]``, with ``kernel_axes=("heads", "kv", "embed")``).
    ``init`` it outside shard_map on the global input (the kernel then has global shape
    ``[*in, features]``; gemm_rs is skipped while initializing with an unbound axis), ``apply`` it
    inside shard_map with the parameters placed by ``partition_specs(params, rules)``.
    """
    features: int
    scatter: str = "rows"
    contract_dims: int = 1
    config: Optional[GemmRsConfig] = None

    @nn.compact
    def __call__(self, x):
        where = type(self).__name__
        fp8 = _linen_fp8(self, where)
        features = positive_int(where, "features", self.features)
        n_in = positive_int(where, "contract_dims", self.contract_dims)
        axis_name = _check_layer_args(where, self.axis_name, "scatter", self.scatter, _SCATTER, self.use_bias,
                                      self.dtype, self.param_dtype)
        check_config(where, self.config)
        check_array(where, "x", x)
        if x.ndim < n_in + 1:
            raise ValueError(f"{where}: x must have rank >= {n_in + 1} (contract_dims={n_in}), got shape "
                             f"{tuple(x.shape)}")
        if self.kernel_axes is None and n_in != 1:
            raise ValueError(f"{where}: kernel_axes is required when contract_dims={n_in}; "
                             "e.g. ('heads', 'kv', 'embed')")
        kernel_axes = _check_axes(where, "kernel_axes", self.kernel_axes or ("mlp", "embed"), n_in + 1)
        bias_axes = _check_axes(where, "bias_axes", self.bias_axes or kernel_axes[-1:], 1)
        # The kernel's declared shape follows x: global at init (outside shard_map), local inside.
        kernel = linen_param(self, "kernel", _flat_init(self.kernel_init, n_in), kernel_axes,
                              tuple(x.shape[-n_in:]) + (features,), self.param_dtype, where)
        bias = (linen_param(self, "bias", self.bias_init, bias_axes, (features,), self.param_dtype, where)
                if self.use_bias else None)
        if self.is_initializing() and axis_size_if_bound(axis_name) is None:
            # init outside shard_map: the unsharded math (W = 1), only to give init an output.
            flat_x = x.reshape(tuple(x.shape[:-n_in]) + (-1,))
            y = column_parallel_linear(flat_x, kernel.reshape(-1, features), bias, dtype=self.dtype, where=where)
            return y
        return row_parallel_linear(x, kernel, bias, axis_name=axis_name, scatter=self.scatter, dtype=self.dtype,
                                   config=self.config, fp8=fp8, where=where)


def _linen_fp8(module: nn.Module, where: str):
    """Checks a Linen layer's fp8 mode; "delayed" declares its state in Flax's OVERWRITE_WITH_GRADIENT
    collection (Flax's names and initial values) and returns the state's values."""
    check_choice(where, "fp8", module.fp8, FP8_MODES)
    if module.fp8 != "delayed":
        return module.fp8
    initial = fp8_meta(positive_int(where, "amax_history_length", module.amax_history_length))
    return {name: module.variable(OVERWRITE_WITH_GRADIENT, name, lambda v=value: v).value
            for name, value in initial.items()}


class ColumnParallelDense(_LinenLinear):
    """Column-parallel linear, Flax Linen (the NNX ColumnParallelLinear's twin).

    ``features``: global output features (int or tuple, e.g. ``(heads, head_dim)`` with
    ``kernel_axes=("embed", "heads", "kv")``); inside shard_map the kernel is
    ``[in, features[0]/W, ...]``. ``gather`` (entwine_jax.ag_gemm on a sharded input, a plain XLA
    dot for None) and ``config`` (an AgGemmConfig) as in ColumnParallelLinear.
    """
    features: Union[int, Sequence[int]]
    gather: Optional[str] = None
    config: Optional[AgGemmConfig] = None

    @nn.compact
    def __call__(self, x):
        where = type(self).__name__
        fp8 = _linen_fp8(self, where)
        features = _features(where, "features", self.features)
        axis_name = _check_layer_args(where, self.axis_name, "gather", self.gather, _GATHER, self.use_bias,
                                      self.dtype, self.param_dtype)
        check_config(where, self.config, AgGemmConfig)
        check_array(where, "x", x)
        if self.kernel_axes is None and len(features) != 1:
            raise ValueError(f"{where}: kernel_axes is required when features is a tuple ({features}); e.g. "
                             "('embed', 'heads', 'kv')")
        kernel_axes = _check_axes(where, "kernel_axes", self.kernel_axes or ("embed", "mlp"), len(features) + 1)
        bias_axes = _check_axes(where, "bias_axes", self.bias_axes or kernel_axes[1:], len(features))
        world = axis_size_if_bound(axis_name)
        gather = self.gather
        if world is None and self.is_initializing():
            world, gather, fp8 = 1, None, None  # init outside shard_map: global shapes, nothing to gather
        elif world is None:
            raise ValueError(f"{where}: axis_name {axis_name!r} is not bound; apply the layer inside jax.shard_map "
                             "over a mesh with that axis")
        if features[0] % world:
            raise ValueError(f"{where}: features[0] ({features[0]}) must be divisible by the size of {axis_name!r} "
                             f"({world})")
        local = (features[0] // world,) + features[1:]
        in_features = x.shape[-1] * (world if gather == "hidden" else 1)
        kernel = linen_param(self, "kernel", _flat_init(self.kernel_init, 1), kernel_axes, (in_features,) + local,
                              self.param_dtype, where)
        bias = (linen_param(self, "bias", _flat_init(self.bias_init, 0), bias_axes, local, self.param_dtype, where)
                if self.use_bias else None)
        return column_parallel_linear(x, kernel, bias, axis_name=axis_name, gather=gather, dtype=self.dtype,
                                      config=self.config, fp8=fp8, where=where)


# ----------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpecs
# ----------------------------------------------------------------------------------------------

def _rules_list(rules) -> list:
    """rules as an ordered list of (logical name, mesh axes) pairs; mesh axes a str, a tuple of
    str, or None (an empty list or tuple, as in MaxText's ``['activation_kv_length', []]``, is None).
    Lists of mesh axes (MaxText's yml) become tuples."""
    items = rules.items() if isinstance(rules, Mapping) else rules
    out: list = []
    try:
        for logical, mesh_axes in items:
            if isinstance(mesh_axes, list):
                mesh_axes = tuple(mesh_axes)
            if not isinstance(logical, str) or not (
                    mesh_axes is None or isinstance(mesh_axes, str)
                    or (isinstance(mesh_axes, tuple) and all(isinstance(a, str) for a in mesh_axes))):
                raise TypeError
            out.append((logical, mesh_axes if mesh_axes != () else None))
    except (TypeError, ValueError):
        raise ValueError("partition_specs: rules must be a mapping or a sequence of (logical axis name, mesh axis "
                         f"name | tuple of names | None) pairs, got {rules!r}") from None
    return out


def _resolve(names: tuple, rules: list) -> list:
    """Flax's rule resolution (flax.linen.spmd._logical_to_mesh_axes): the rules are walked in
    order; a rule assigns its mesh axes to the dim named by its logical name when that dim is still
    unassigned and none of the axes is taken by another dim, else the next rule for that name gets
    its chance. A dim whose rules are all blocked stays replicated (None)."""
    unassigned = object()
    result: list = [unassigned if n is not None else None for n in names]
    taken: set = set()
    for logical, mesh_axes in rules:
        if logical not in names:
            continue
        pos = names.index(logical)
        axes = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
        if result[pos] is unassigned and not taken.intersection(axes):
            result[pos] = mesh_axes
            taken.update(axes)
    return [None if r is unassigned else r for r in result]


def partition_specs(tree, rules=DEFAULT_LOGICAL_AXIS_RULES):
    """PartitionSpecs for the parameters in `tree`, from their logical-axis metadata and `rules`.

    tree: an NNX ``State`` (``nnx.split(model)[1]``, ``nnx.state(model)``), a Linen variables /
    params dict as ``init`` returns it (with ``LogicallyPartitioned`` boxes), or any pytree of
    these and plain arrays. Returns a tree that is a prefix of `tree` (each annotated variable or
    box replaced by its ``PartitionSpec``; plain arrays: ``P()``, replicated), ready as the
    ``in_specs`` / ``out_specs`` of ``jax.shard_map`` and for ``NamedSharding``.

    rules: ``(logical name, mesh axis | tuple or list of mesh axes | None)`` pairs or a dict;
    default ``DEFAULT_LOGICAL_AXIS_RULES``. They are resolved as Flax resolves them
    (``nn.logical_to_mesh_axes``): in order of precedence, and a rule whose mesh axes another dim
    of the same parameter already took is skipped for the next rule of that name (MaxText's
    ``("mlp", "embed")`` kernel: ``mlp`` takes ``fsdp_transpose`` and ``tensor``, so ``embed``
    falls back from its first rule, which also names ``fsdp_transpose``, to its second). A dim
    whose rules are all blocked is replicated. Every logical name in use must have a rule, so a
    typo cannot silently replicate a parameter. Linen ``nn.Partitioned`` boxes (mesh axes already)
    are taken as they are. The flax-native equivalents: ``nnx.get_partition_spec(state)`` under
    ``nnx.logical_axis_rules(rules)``, and ``nn.logical_to_mesh(nn.get_partition_spec(variables), rules)``.
    """
    table = _rules_list(rules)
    known = {logical for logical, _ in table}

    def spec(path, leaf):
        where = jax.tree_util.keystr(path) or "<root>"
        if isinstance(leaf, nnx.Variable):
            names = leaf.get_metadata().get("out_sharding")
            logical = True
        elif isinstance(leaf, nn.LogicallyPartitioned):
            names, logical = leaf.names, True
        elif isinstance(leaf, flax_meta.Partitioned):
            names, logical = leaf.names, False
        elif hasattr(leaf, "shape"):
            return P()
        else:
            return None
        if not names:
            return P()
        names = tuple(names.spec if isinstance(names, jax.sharding.NamedSharding) else names)
        if not logical:
            return P(*names)
        missing = [n for n in names if n is not None and n not in known]
        if missing:
            raise ValueError(f"partition_specs: {where} has logical axes {names}; no rule for {missing} (rules: "
                             f"{dict(table)})")
        repeated = sorted({n for n in names if n is not None and names.count(n) > 1})
        if repeated:
            raise ValueError(f"partition_specs: {where} has logical axes {names}; {repeated} name more than one dim")
        return P(*_resolve(names, table))

    is_leaf = lambda v: isinstance(v, (nnx.Variable, flax_meta.AxisMetadata))
    return jax.tree_util.tree_map_with_path(spec, tree, is_leaf=is_leaf)
