# entwine_jax: fused, overlapped GEMM + ReduceScatter for tensor-parallel JAX on Hopper GPUs.
# gemm_rs runs the fused CUDA kernels where they can run and the XLA reference everywhere else.
from entwine_jax.config import GemmRsConfig, heuristic_config, set_default_config, using_config
from entwine_jax.ops import extension_status, gemm_rs
from entwine_jax.tuning import tune

__version__ = "0.1.0"


def setup(mesh, axis_name) -> None:
    """Tell the fused path which devices `axis_name` of `mesh` runs on (needed under jit when the
    mesh is not set with jax.set_mesh). A no-op for the XLA reference path."""
    # Imported here: the fused module loads the extension, which a pure-Python install lacks.
    from entwine_jax import fused
    fused.setup(mesh, axis_name)


__all__ = ["gemm_rs", "GemmRsConfig", "set_default_config", "using_config", "heuristic_config",
           "extension_status", "setup", "tune", "__version__"]
