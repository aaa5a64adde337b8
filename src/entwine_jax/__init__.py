# entwine_jax: fused, overlapped GEMM + ReduceScatter (gemm_rs) and AllGather + GEMM (ag_gemm) for
# tensor-parallel JAX on Hopper GPUs; each is the other's backward. Both run the fused CUDA kernels
# where they can run and the XLA reference everywhere else.
from entwine_jax.ag_gemm_op import ag_gemm
from entwine_jax.config import (AgGemmConfig, GemmRsConfig, ag_heuristic_config, heuristic_config,
                                set_default_config, using_config)
from entwine_jax.ops import extension_status, gemm_rs
from entwine_jax.tuning import tune
from entwine_jax import _log

_log.warn_if_source_tree()

__version__ = "0.1.0"


def setup(mesh, axis_name) -> None:
    """Tell the fused path which devices `axis_name` of `mesh` runs on (needed under jit when the
    mesh is not set with jax.set_mesh). A no-op for the XLA reference path."""
    # Imported here: the fused module loads the extension, which a pure-Python install lacks.
    from entwine_jax import fused
    fused.setup(mesh, axis_name)


def check_errors() -> None:
    """Raise RuntimeError if a fused call recorded a device error (a peer rank that never arrived:
    rank, peer, tile and epochs in the message). Block on the results first
    (jax.block_until_ready) to cover the calls made so far. A no-op without the extension."""
    try:
        from entwine_jax import fused
    except Exception:  # pure-Python install: no fused calls, no errors
        return
    fused.check_errors()


__all__ = ["gemm_rs", "ag_gemm", "GemmRsConfig", "AgGemmConfig", "ag_heuristic_config", "set_default_config", "using_config", "heuristic_config",
           "extension_status", "setup", "check_errors", "tune", "__version__"]
