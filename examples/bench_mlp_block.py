"""The SwiGLU MLP block benchmark, forward and backward in both tensor-parallel layouts: entwine (every
collective fused), plain XLA, XLA windowed einsum and the no-collective bound. Same as
`python -m entwine_jax bench --op mlp` (see --help), e.g. `--processes 2` for two ranks on one GPU."""
import sys

from entwine_jax.bench import main

if __name__ == "__main__":
    sys.exit(main(["--op", "mlp", *sys.argv[1:]]))
