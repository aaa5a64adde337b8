"""One fused call: the FFI target, its results and its operands, with the attributes the handler binds.
Under jax.vmap the call runs once per batch element (a loop on the device, like lax.scan): each
element is its own collective, with its own epoch."""
from __future__ import annotations

from typing import Any, Sequence

import jax


def fused_call(target: str, results: Sequence[jax.ShapeDtypeStruct], *operands, **attributes) -> list[Any]:
    """Calls the FFI target `target` on `operands` with `attributes` (NumPy scalars, bools, or dicts of
    them); returns the list of results."""
    call = jax.ffi.ffi_call(target, tuple(results), vmap_method="sequential")
    return list(call(*operands, **attributes))
