# The GEMMs every op's reference and backward share: an fp32-accumulated dot over x's last dim, the
# weight gradient x.T @ dy over every other dim, each rounded once to the operands' dtype, the FP8
# dot whose gathered operand carries one scale per source rank, and the full-fp32 dot of dequantised
# block-scaled operands.
import jax
import jax.numpy as jnp

# The precision of every dot of FP8 operands (or of operands converted from FP8). XLA's GPU compiler
# runs such a dot as cuBLASLt's FP8 GEMM, at DEFAULT precision with cuBLASLt's fast accumulation,
# whose tensor-core partial sums are never promoted to fp32 (docs/design.md, "FP8"); any other
# precision keeps the promotion. FP8 and bf16 operands have nothing else a precision could change.
FP8_EXACT = jax.lax.Precision.HIGHEST


def dot_type(dtype):
    """Output type of a GEMM whose result is only rounded to `dtype`. XLA's bf16 GEMM accumulates in
    fp32; writing bf16 at once was bitwise equal to fp32-then-cast on an H200, and faster
    (docs/performance.md, "What was tried"). Anything else keeps an explicit fp32 output."""
    return jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32


def dot_last_first(x, w, out_type=jnp.float32, precision=None):
    # x [..., K] . w [K, N] -> [..., N].
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=out_type)


def dot_f32(x, w):
    """x [..., K] . w [K, N] of float32 operands in full float32 (a GPU's default would round them to
    TF32's 10 mantissa bits): the block-scaled GEMM on dequantised operands."""
    return dot_last_first(x, w, precision=jax.lax.Precision.HIGHEST)


def matmul_weight_grad(x, dy, dtype):
    """dw = x.T @ dy, contracting every dim of x and dy but the last (fp32 accumulation)."""
    batch = tuple(range(x.ndim - 1))
    return jax.lax.dot_general(x, dy, ((batch, batch), ((), ())), preferred_element_type=dot_type(dtype)).astype(dtype)


def dot_by_source(a, b, dimension_numbers, a_dim: int, scales):
    """dot_general(a, b) of FP8 operands accumulated in fp32, where dim `a_dim` of `a` is W equal blocks gathered from
    W ranks and block r is scaled by scales[r] (f32 [W]; a scalar: one scale for all of a). A
    gathered dim that is contracted is summed block by block in rank order, each block's product
    scaled before it is added (the scales differ inside the sum); any other gathered dim scales
    its blocks of the product. No batch dims."""
    (a_contract, b_contract), _ = dimension_numbers
    if jnp.ndim(scales) == 0:
        return jax.lax.dot_general(a, b, dimension_numbers, precision=FP8_EXACT,
                                   preferred_element_type=jnp.float32) * scales
    world = scales.shape[0]
    block = a.shape[a_dim] // world
    if a_dim in a_contract:
        b_dim = b_contract[list(a_contract).index(a_dim)]
        out = None
        for r in range(world):
            part = jax.lax.dot_general(jax.lax.slice_in_dim(a, r * block, (r + 1) * block, axis=a_dim),
                                       jax.lax.slice_in_dim(b, r * block, (r + 1) * block, axis=b_dim),
                                       dimension_numbers, precision=FP8_EXACT,
                                       preferred_element_type=jnp.float32) * scales[r]
            out = part if out is None else out + part
        return out
    out = jax.lax.dot_general(a, b, dimension_numbers, precision=FP8_EXACT, preferred_element_type=jnp.float32)
    # The product's dims: a's free dims in order, then b's.
    position = [i for i in range(a.ndim) if i not in a_contract].index(a_dim)
    shape = [1] * out.ndim
    shape[position] = a.shape[a_dim]
    return out * jnp.repeat(scales, block).reshape(shape)
