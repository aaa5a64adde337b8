# The compiled extension entwine_jax._entwine: importing it, registering its FFI targets with jax
# (once), the facts it states for every op (the largest axis, the heap size) and the GPU's SM count.
# Each op asks its own plan and target name of the extension in its folder (gemm_rs/plan.py,
# ag_gemm/plan.py). Without the extension (a pure-Python install) there is no fused path.
from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any, Optional

from entwine_jax import _log


class NoExtension(RuntimeError):
    """A plan or a kernel was asked for without the compiled extension."""


class PlanError(ValueError):
    """The kernels cannot run this call: `rule` is the rule it violates (the C++ plan's words);
    `config_error` is True when the rule is one of the config's own, whatever the shape."""

    def __init__(self, rule: str, config_error: bool):
        super().__init__(rule)
        self.rule = rule
        self.config_error = config_error


@functools.cache
def module() -> tuple[Any, Optional[str]]:
    """(entwine_jax._entwine, None), or (None, why it does not import). Imports only: registered()
    also registers the FFI targets, where a call may be made."""
    try:
        from entwine_jax import _entwine
    except Exception as e:  # ImportError, or a broken build
        return None, f"extension entwine_jax._entwine unavailable ({type(e).__name__}: {e})"
    return _entwine, None


def ext():
    """The extension module; NoExtension with the reason when it does not import."""
    mod, reason = module()
    if mod is None:
        raise NoExtension(reason)
    return mod


def status() -> tuple[bool, str]:
    """(built, reason): whether the compiled extension entwine_jax._entwine can be imported."""
    mod, error = module()
    if mod is None:
        reason = f"{error}: pure-Python install, the ops use their XLA reference path"
        _log.log_once("extension_status", logging.WARNING if _log.cuda_gpus_present() else logging.INFO, "%s", reason)
        return False, reason
    return True, f"entwine_jax._entwine built: {getattr(mod, '__file__', '?')}"


_lock = threading.Lock()
_registration: Optional[tuple[Any, Optional[str]]] = None


def registered() -> tuple[Any, Optional[str]]:
    """(module, None) once its FFI targets are registered with jax, or (None, the reason)."""
    global _registration
    with _lock:
        if _registration is None:
            mod, reason = module()
            if mod is not None:
                import jax
                try:
                    for name, capsule in mod.registrations().items():
                        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
                except Exception as e:  # a registration the backend refuses
                    mod, reason = None, f"extension entwine_jax._entwine unavailable ({type(e).__name__}: {e})"
            _registration = (mod, reason)
        return _registration


def fp8_targets() -> frozenset:
    """The FP8 FFI targets the extension registers (its fp8_targets()); empty without the extension
    or in a build without FP8 kernels, where every FP8 call takes the XLA reference path."""
    mod, _ = module()
    if mod is None or not hasattr(mod, "fp8_targets"):
        return frozenset()
    return frozenset(str(t) for t in mod.fp8_targets())


def fp8_reason(target_attribute: str, plan_function: str) -> Optional[str]:
    """Why the extension cannot run an op's FP8 calls (no extension, no FP8 target named by its
    `target_attribute` among fp8_targets(), no FP8 plan function `plan_function`), or None."""
    mod, reason = module()
    if mod is None:
        return reason
    target = getattr(mod, target_attribute, None)
    if target is None or target not in fp8_targets() or not hasattr(mod, plan_function):
        return (f"FP8 kernels not built (the extension has no {target_attribute} among its fp8_targets() and no "
                f"{plan_function})")
    return None


def fp8_block_reason(op: str, plan_function: str) -> Optional[str]:
    """Why the extension cannot run `op`'s block-scaled FP8 calls, or None: its FP8 plan function must
    take `block_scaled` (the build whose FP8 kernels take block scales); fp8_reason's checks first."""
    mod, reason = module()
    if mod is None:
        return reason
    plan = getattr(mod, plan_function, None)
    if plan is None or "block_scaled" not in _keywords(plan):
        return (f"block-scaled FP8 has no fused {op} kernel in this build (its FP8 kernels take per-tensor "
                f"scales only): the XLA reference runs")
    return None


def _keywords(function) -> str:
    """The text that names a function's parameters: nanobind's signature (`__nb_signature__`), else
    the Python signature, and the docstring (where nanobind may open it with the signature)."""
    parts = [str(entry[0]) for entry in getattr(function, "__nb_signature__", None) or ()]
    try:
        parts.append(" ".join(inspect.signature(function).parameters))
    except (TypeError, ValueError):
        pass
    parts.append(function.__doc__ or "")
    return " ".join(parts)


def max_world() -> int:
    """The largest axis the kernels serve (kMaxWorld in the extension)."""
    return int(ext().MAX_WORLD)


def heap_bytes(world: int, flags_per_source: int, regions: dict[str, int]) -> int:
    """Bytes of one rank's heap with room for flags_per_source flags per source rank and
    {region name: bytes} of the ops' registered regions (two flag parities, the ready words, two
    copies of a double-buffered region: docs/design.md, "The communicator and symmetric heap")."""
    return int(ext().heap_bytes(world, flags_per_source, regions))


def gpu_sm_count() -> Optional[int]:
    """SMs of the first GPU (jax reports them as core_count), or None without a GPU."""
    try:
        import jax
        for d in jax.devices():
            count = getattr(d, "core_count", None)
            if d.platform == "gpu" and count:
                return int(count)
    except Exception:  # no GPU backend
        pass
    return None


def sm_count() -> int:
    """gpu_sm_count(), or 132 (H100/H200 SXM) without a GPU, where a config is only printed, never run."""
    return gpu_sm_count() or 132
