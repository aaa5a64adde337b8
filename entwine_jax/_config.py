# What every op's config shares: the paths a call can take, the GEMM block widths the kernels are
# built for, the check of an integer field and of a heuristic's arguments, and how a field becomes an
# FFI attribute.
from typing import Optional

import jax.numpy as jnp
import numpy as np

PATHS = ("auto", "fused", "xla")
BLOCK_N = (128, 256)
# The operand dtypes a call can have (float32 runs the XLA reference; the FP8 ones: an FP8 call's
# e4m3 forward and its e5m2 backward): what a heuristic can be asked about.
HEURISTIC_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn,
                                                jnp.float8_e5m2))


# The kernels' config structs hold 32-bit ints (each field decoded by name from the FFI attribute).
FIELD_MAX = 2**31 - 1


def check_int(name: str, value, lo: int, where: str, hi: Optional[int] = None) -> None:
    """ValueError unless `value` is an int (a NumPy integer too, never a bool) >= lo, and <= hi unless
    hi is None (a config field: FIELD_MAX)."""
    # bool is an int subclass; True as a grid size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{where}: {name} must be an int >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{where}: {name} must be <= {hi}, got {value!r}")


def check_int_choice(name: str, value, choices: tuple, where: str) -> None:
    """ValueError unless `value` is an int (not a bool, nor a float equal to one) among `choices`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value not in choices:
        raise ValueError(f"{where}: {name} must be one of {choices}, got {value!r}")


def check_shape_args(where: str, sizes: dict, world, dtype) -> None:
    """ValueError unless every size in `sizes` ({name: value}) is an int >= 0 (an empty dimension is
    a shape a call may have: its output is empty), world an int >= 1 and dtype one of
    HEURISTIC_DTYPES; the message names the argument, what it must be and what it was."""
    for name, value in sizes.items():
        check_int(name, value, 0, where)
    check_int("world", world, 1, where)
    try:
        ok = jnp.dtype(dtype) in HEURISTIC_DTYPES
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{where}: dtype must be one of {[d.name for d in HEURISTIC_DTYPES]}, got {dtype!r}")


def ffi_attribute(value):
    """A config field as an FFI attribute: bools stay bools, ints are int64."""
    return bool(value) if isinstance(value, (bool, np.bool_)) else np.int64(value)
