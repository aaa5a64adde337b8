# What every op's config shares: the paths a call can take, the GEMM block widths the kernels are
# built for, the check of an integer field, and how a field becomes an FFI attribute.
import numpy as np

PATHS = ("auto", "fused", "xla")
BLOCK_N = (128, 256)


def check_int(name: str, value, lo: int, where: str) -> None:
    """ValueError unless `value` is an int (a NumPy integer too, never a bool) >= lo."""
    # bool is an int subclass; True as a grid size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{where}: {name} must be an int >= {lo}, got {value!r}")


def ffi_attribute(value):
    """A config field as an FFI attribute: bools stay bools, ints are int64."""
    return bool(value) if isinstance(value, (bool, np.bool_)) else np.int64(value)
