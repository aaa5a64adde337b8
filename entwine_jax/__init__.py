# entwine_jax: fused, overlapped GEMM + ReduceScatter (gemm_rs) and AllGather + GEMM (ag_gemm) for
# tensor-parallel JAX on Hopper GPUs; each is the other's backward. Both run the fused CUDA kernels
# where they can run and the XLA reference everywhere else. The MoE pair (moe_dispatch_gemm,
# moe_gemm_combine) is likewise each the other's backward, fused where it can run. Importing the
# package loads the ops and their configs only: no tuner loop, benchmark or command line;
# entwine_jax.census and entwine_jax.layers load on first use (flax is slow to import).
from entwine_jax._extension import status as extension_status
from entwine_jax.ag_gemm.config import AgGemmConfig, ag_heuristic_config
from entwine_jax.api import ag_gemm, gemm_rs, moe_dispatch_gemm, moe_gemm_combine
from entwine_jax.gemm_rs.config import GemmRsConfig, heuristic_config, set_default_config, using_config
from entwine_jax.moe.config import MoeConfig
from entwine_jax.moe.reference import MoeHandle

__version__ = "0.1.0"


def setup(mesh, axis_name) -> None:
    """Tell the fused path which devices `axis_name` of `mesh` runs on (needed under jit when the
    mesh is not set with jax.set_mesh). A no-op for the XLA reference path."""
    from entwine_jax import comm
    comm.setup(mesh, axis_name)


def check_errors() -> None:
    """Raise RuntimeError if a fused call recorded a device error (a peer rank that never arrived:
    rank, peer, tile and epochs in the message). Block on the results first
    (jax.block_until_ready) to cover the calls made so far. A no-op without the extension."""
    from entwine_jax import comm
    comm.check_errors()


def reserve(fn, *args, **kwargs) -> dict:
    """Size the fused ops' heaps once for every call site of fn (e.g. a training step), so that
    tracing it grows nothing: traces fn(*args, **kwargs) abstractly (arrays or ShapeDtypeStructs) and
    grows each communicator to the largest need of its sites. Call it on every process, under the mesh
    (jax.set_mesh, or after setup). Returns {axis name: heap bytes per device}; {} without the fused
    path. Details: entwine_jax.comm.reserve."""
    from entwine_jax import comm
    return comm.reserve(fn, *args, **kwargs)


def tune(mesh, axis_name, shapes, **kwargs) -> dict:
    """Time candidate GemmRsConfigs of the fused gemm_rs on `mesh` and store each shape's winner in
    the user cache, which later traces look up. Arguments and result: entwine_jax.tuning.tune.tune.
    The tuner is imported here, on first use, not with the package."""
    from entwine_jax.tuning.tune import tune as run_tuner
    return run_tuner(mesh, axis_name, shapes, **kwargs)


__all__ = ["gemm_rs", "ag_gemm", "moe_dispatch_gemm", "moe_gemm_combine", "MoeConfig", "MoeHandle", "GemmRsConfig",
           "AgGemmConfig", "ag_heuristic_config", "set_default_config",
           "using_config", "heuristic_config", "extension_status", "setup", "check_errors", "reserve", "tune", "__version__"]


def __getattr__(name):
    # census and layers on first use (entwine_jax.census after a plain `import entwine_jax`): flax, which
    # layers needs, is slow to import and most programs need neither.
    if name in ("census", "layers"):
        import importlib
        return importlib.import_module(f"entwine_jax.{name}")
    raise AttributeError(f"module 'entwine_jax' has no attribute {name!r}")
