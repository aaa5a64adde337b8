"""The gemm_rs benchmark (docs/performance.md); same as `python -m entwine_jax.bench` (see --help)."""
import sys

from entwine_jax.bench import main

if __name__ == "__main__":
    sys.exit(main())
