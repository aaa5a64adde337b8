"""Host cost of the fused calls' ordered effect: the dispatch time of a tiny jitted program with and
without an order point (no fused call needed, so it runs on any device). Prints microseconds per
dispatch, each dispatch waited for. Usage: python scripts/order_cost.py [calls]"""
import sys
import time

import jax
import jax.numpy as jnp

from entwine_jax import _ordered


def per_call_us(f, x, calls):
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    for _ in range(calls):
        x = jax.block_until_ready(f(x))
    return (time.perf_counter() - t0) / calls * 1e6


calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
x = jnp.zeros((8,), jnp.float32)
plain = jax.jit(lambda v: v + 1)
ordered = jax.jit(lambda v: _ordered.order_point(v)[0] + 1)
for name, f in (("plain", plain), ("ordered", ordered), ("plain", plain), ("ordered", ordered)):
    print(f"order_cost {jax.devices()[0].platform}: {name}: {per_call_us(f, x, calls):.1f} us per dispatch")
