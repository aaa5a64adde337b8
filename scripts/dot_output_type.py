# The XLA reference's GEMMs with an fp32 output cast to bf16 against a bf16 output (fp32 accumulation
# inside XLA's GEMM), one GPU: the backward's dx = g @ w.T and dw = x.T @ g, and the forward (what
# the reference runs on an axis of size 1). Checks that both give the same bits.
# Usage: python scripts/dot_output_type.py   (docs/PERF.md v12)
import time, jax, jax.numpy as jnp, numpy as np
from jax import lax

def timeit(f, *a, n=50, reps=7):
    f(*a).block_until_ready() if not isinstance(f(*a), tuple) else jax.block_until_ready(f(*a))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n): r = f(*a)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / n * 1e3)
    return float(np.median(out))

def bwd(dt):
    def f(x, w, g):
        dx = lax.dot_general(g, w, (((1,), (1,)), ((), ())), preferred_element_type=dt).astype(x.dtype)
        dw = lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=dt).astype(w.dtype)
        return dx, dw
    return jax.jit(f)

def fwd(dt):
    return jax.jit(lambda x, w: lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=dt).astype(x.dtype))

for (m, n, k) in [(4096, 8192, 1024), (8192, 8192, 1024), (16384, 8192, 1024), (8192, 8192, 3584), (16384, 16384, 2048), (16384, 16384, 6656)]:
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16); w = jax.random.normal(kw, (k, n), jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)
    a32, a16 = bwd(jnp.float32), bwd(jnp.bfloat16)
    d32, d16 = a32(x, w, g), a16(x, w, g)
    same = all(np.array_equal(np.asarray(p).view(np.uint16), np.asarray(q).view(np.uint16)) for p, q in zip(d32, d16))
    t = [timeit(a32, x, w, g), timeit(a16, x, w, g), timeit(a32, x, w, g), timeit(a16, x, w, g)]
    f32, f16 = fwd(jnp.float32), fwd(jnp.bfloat16)
    tf = [timeit(f32, x, w), timeit(f16, x, w), timeit(f32, x, w), timeit(f16, x, w)]
    print(f"{m}x{n}x{k}: bwd fp32-out {min(t[0], t[2]):.3f} ms, bf16-out {min(t[1], t[3]):.3f} ms, bitwise equal {same}; "
          f"fwd fp32-out {min(tf[0], tf[2]):.3f}, bf16-out {min(tf[1], tf[3]):.3f}", flush=True)
