# The GEMMs every op's reference and backward share: an fp32-accumulated dot over x's last dim, and the
# weight gradient x.T @ dy over every other dim, each rounded once to the operands' dtype.
import jax
import jax.numpy as jnp


def dot_type(dtype):
    """Output type of a GEMM whose result is only rounded to `dtype`. XLA's bf16 GEMM accumulates in
    fp32; writing bf16 at once was bitwise equal to fp32-then-cast on an H200, and faster
    (docs/performance.md, "What was tried"). Anything else keeps an explicit fp32 output."""
    return jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32


def dot_last_first(x, w, out_type=jnp.float32):
    # x [..., K] . w [K, N] -> [..., N].
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=out_type)


def matmul_weight_grad(x, dy, dtype):
    """dw = x.T @ dy, contracting every dim of x and dy but the last (fp32 accumulation)."""
    batch = tuple(range(x.ndim - 1))
    return jax.lax.dot_general(x, dy, ((batch, batch), ((), ())), preferred_element_type=dot_type(dtype)).astype(dtype)
