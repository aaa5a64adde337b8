# What every op does at a call site, at trace time: check its arguments (ValueErrors that name them),
# type its operands for shard_map, choose between the fused kernels and the XLA reference (the reason
# the kernels cannot run, or their call prepared once), report the choice, and dispatch on the
# platform so the same program still lowers for CPU.
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from entwine_jax import _extension, _log, comm
from entwine_jax.comm import Unavailable
from entwine_jax.tuning import crossover

# Every op takes these; the fused kernels take the first two, float32 runs the XLA reference.
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
KERNEL_DTYPES = DTYPES[:2]
# What the FP8 kernels take: the weight in e4m3; x in e4m3 (the forward) or e5m2 (the backward's
# gradient, the hybrid recipe).
KERNEL_FP8_X_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
KERNEL_FP8_W_DTYPE = jnp.dtype(jnp.float8_e4m3fn)


def hashable_axis(axis_name):
    """A list of axis names as a tuple: it goes into the hashable static plan (the collectives take
    either)."""
    return tuple(axis_name) if isinstance(axis_name, list) else axis_name


def check_operands(op: str, x, w, w_rank: str, fp8: bool = False) -> None:
    """ValueError unless x and w are arrays of one supported dtype and w is 2-D (`w_rank`: its shape
    in words, e.g. "[K, N]"). fp8: an FP8 call, whose dtypes entwine_jax.fp8 has checked."""
    for name, v in (("x", x), ("w", w)):
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise ValueError(f"{op}: {name} must be an array, got {type(v).__name__}")
    if w.ndim != 2:
        raise ValueError(f"{op}: w must have rank 2 ({w_rank}), got rank {w.ndim} (shape {tuple(w.shape)})")
    if fp8:
        return
    if jnp.dtype(x.dtype) not in DTYPES:
        raise ValueError(f"{op}: x.dtype must be bfloat16 or float16 (or float32 on the XLA path), got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"{op}: w.dtype must equal x.dtype ({x.dtype}), got {w.dtype}")


def kernel_dtype_reason(x_dtype, w_dtype, out_dtype=None) -> Optional[str]:
    """Why the kernels cannot take these operand dtypes, or None: bf16 or fp16 operands of one dtype,
    or (out_dtype given: an FP8 call) x in e4m3 or e5m2 and w in e4m3, with a bf16 or fp16 output."""
    x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
    if out_dtype is None:
        if x_dtype not in KERNEL_DTYPES or w_dtype != x_dtype:
            return f"fused kernels take bf16 or fp16 operands of one dtype, got {x_dtype} and {w_dtype}"
        return None
    if x_dtype not in KERNEL_FP8_X_DTYPES or w_dtype != KERNEL_FP8_W_DTYPE:
        return (f"the FP8 kernels take x in float8_e4m3fn or float8_e5m2 and w in float8_e4m3fn, got {x_dtype} "
                f"and {w_dtype}")
    if jnp.dtype(out_dtype) not in KERNEL_DTYPES:
        return f"the FP8 kernels write bf16 or fp16, got out_dtype {jnp.dtype(out_dtype)}"
    return None


def axis_size(op: str, axis_name) -> int:
    """The size of the bound axis; ValueError when no enclosing shard_map binds it, or when a tuple
    names one mesh axis twice."""
    names = comm.axis_tuple(axis_name)
    if len(set(names)) != len(names):
        # XLA aborts the process on a collective over a repeated axis.
        raise ValueError(f"{op}: axis_name must name each mesh axis once, got {axis_name!r}")
    # jax.lax.axis_size reads an int as a positional axis of an array, not as a name.
    if any(isinstance(n, (int, np.integer)) for n in names):
        raise ValueError(f"{op}: axis_name must be a mesh axis name (a str) or a tuple of them, got {axis_name!r}")
    # jax raises NameError for an axis name that no enclosing shard_map binds.
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"{op}: axis_name {axis_name!r} is not bound; call {op} inside jax.shard_map "
                         f"over a mesh with that axis ({e})") from None
    # An axis that jax.vmap binds has a size too, but no devices behind it to move data between.
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None)
    if manual is not None and not set(names) <= set(manual):
        raise ValueError(f"{op}: axis_name {axis_name!r} is not an axis of an enclosing jax.shard_map (an axis "
                         f"jax.vmap binds is not one); call {op} inside jax.shard_map over a mesh with that axis")
    return size


def dimension(op: str, name: str, value, shape: tuple, what: str) -> int:
    """`value` as a normalised index into `shape` (an int or NumPy integer, negative from the end);
    ValueError naming `name` otherwise."""
    nd = len(shape)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not -nd <= value < nd:
        raise ValueError(f"{op}: {name} must be an int in [{-nd}, {nd}) for {what} of rank {nd} (shape {shape}), "
                         f"got {value!r}")
    return int(value) % nd


def platform_reason(axis_name) -> Optional[str]:
    """Why no call on this axis can reach the kernels, whatever its shape or config: not on a CUDA GPU
    (the mesh's platform, else the default backend's), or no compiled kernels; None on CUDA with
    the extension. Said before any rule of the GPU cost model, which is about GPUs only."""
    try:
        mesh = comm.find_mesh(axis_name)
    except Exception:  # no mesh to ask: the default backend says where the program runs
        mesh = None
    # A mesh's CUDA devices say "gpu"; the default backend says "cuda" (and "gpu" for ROCm).
    platform = mesh.devices.flat[0].platform if mesh is not None else _log.default_platform()
    if platform != ("gpu" if mesh is not None else "cuda"):
        return f"not on a CUDA GPU (platform {platform!r}): the XLA reference runs, whatever the config's path"
    if _extension.module()[0] is None:
        return ("no compiled kernels (entwine_jax._entwine is not built: a pure-Python install or "
                "ENTWINE_BUILD_CUDA=OFF): the XLA reference runs")
    return None


def early_reason(config, size: int, dtype, nothing: str, flops: float, moved_bytes: float, fixed_us: float,
                 axis_name=None) -> Optional[str]:
    """The reasons every op takes the XLA path before its kernels are asked: the user asked for it,
    not on a CUDA GPU or no compiled kernels (platform_reason, for `axis_name`), an axis of size 1
    (`nothing`: what there is nothing of), float32 operands, and (path "auto") a call too small for
    the overlap to pay for the fused op's fixed cost (flops: the call's GEMM, moved_bytes: what its
    collective brings into each GPU, fixed_us: the op's fixed cost for this call; tuning/crossover.py)."""
    if config.path == "xla":
        return "config.path='xla'"
    if reason := platform_reason(axis_name):
        return reason
    if size == 1 and config.path == "auto":
        return (f"axis size 1: nothing to {nothing}, XLA's GEMM alone is faster (path='fused' runs the kernels "
                f"anyway)")
    if jnp.dtype(dtype) == jnp.float32:
        return "float32 inputs (the fused kernels take bfloat16/float16)"
    if config.path == "auto":
        return crossover.fused_cannot_win(fixed_us, flops, moved_bytes)
    return None


def prepare(op: str, unavailable: Callable[[], Optional[str]], prepare_call: Callable[[], Any]) -> tuple[Any, Optional[str]]:
    """(the prepared fused call, None) when the kernels run this call, else (None, the reason the
    XLA reference runs). `unavailable` only answers; `prepare_call` makes the call's communicator."""
    try:
        reason = unavailable()
    except Exception as e:  # a bug there must not take the reference path down with it
        reason = f"entwine_jax.{op}.fused.unavailable_reason raised {type(e).__name__}: {e}"
    if reason is not None:
        return None, reason
    try:
        return prepare_call(), None
    except Unavailable as e:  # e.g. the communicator could not be set up: a visible fallback
        return None, str(e)
    except Exception as e:  # a bug there must not take the reference path down with it
        return None, f"entwine_jax.{op}.fused.prepare raised {type(e).__name__}: {e}"


def report(op: str, key, site: str, config, reason: Optional[str], source: str, printed: set, note: str = "") -> None:
    """Log the XLA-path reason once per call site; print the choice (and where the config came from)
    under ENTWINE_PRINT_CONFIG=1."""
    _log.report_call_site(op, key, site, config, reason, source, printed, note)


def dispatch(reason: Optional[str], reference: Callable, fused: Callable, *args):
    """reference(*args) where the fused path cannot run (reason); else fused(*args) on CUDA and
    reference(*args) on any other platform of the same program."""
    if reason is not None:
        return reference(*args)
    return jax.lax.platform_dependent(*args, cuda=fused, default=reference)


def varying_axes(v) -> frozenset:
    aval = jax.typeof(v)
    # jax 0.11 keeps the varying axes in aval.manual_axis_type.varying (earlier: aval.vma).
    varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", frozenset())
    return frozenset(varying)


def make_varying(v, names):
    # The bwd rule's dx, dw vary over every axis x, w or the collective vary over. Under shard_map's
    # type checks an input that does not vary over one of them must be cast first; AD then turns
    # that cast into the psum its cotangent needs (e.g. w replicated over a data axis gets dw summed
    # over it). Without type checks nothing varies and the cast is a no-op.
    missing = [n for n in names if n not in varying_axes(v)]
    for name in missing:
        v = jax.lax.pcast(v, name, to="varying")
    return v


def varying_over(*operands, axis_name=()) -> list:
    """Every axis any operand (an array or a tuple of them) varies over, plus `axis_name`'s: what
    the op's outputs vary over."""
    names = set(comm.axis_tuple(axis_name))
    for v in jax.tree.leaves(operands):
        names |= varying_axes(v)
    return sorted(names, key=str)


def typed_like(names, *values):
    """values (arrays or tuples of them) cast to vary over `names` (platform_dependent needs both
    branches typed alike: the reference's output varies over every axis its operands vary over, an
    FFI call's may not)."""
    out = tuple(jax.tree.map(lambda a: make_varying(a, names), v) for v in values)
    return out[0] if len(out) == 1 else out
