"""Time XLA's own GEMM (jnp.dot, bf16 in/out, fp32 accumulation) on the design's suite shapes, one GPU.

Default: per-call time = wall time of 20 back-to-back asynchronous calls / 20 (the GPU stays busy:
the kernels are longer than dispatch), median of 15 batches after warm-up.
--steady SECONDS: each shape alone, back to back for SECONDS after a 0.3 s ramp, two passes, the way
`entwine_harness energy suite SECONDS` times the producer and cuBLASLt (the power cap's steady state):
the host keeps two batches of ~20 ms queued and times the window between two batch completions.
Prints a table (with the mean SM clock of the window, from NVML, where it loads) and writes JSON lines.
--fp8: XLA's FP8 GEMM instead (e4m3 x [M, K] and w_t [N, K], each dequantised by an f32 scale, bf16
out: the pattern XLA rewrites to cuBLASLt's FP8 GEMM, as Flax's FP8 dot does) on the suite and the
ag_gemm bench shapes, per-call timing as by default; says whether the rewrite happened.
Usage: python benchmarks/xla_gemm_time.py [--steady SECONDS | --fp8] [out.jsonl]
"""
import collections
import ctypes
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

SUITE = [(4096, 8192, 1024), (8192, 8192, 1024), (16384, 8192, 1024), (8192, 8192, 3584),
         (16384, 8192, 3584), (8192, 16384, 2048), (16384, 16384, 2048), (16384, 16384, 6656)]
# ag_gemm's GEMM in `entwine_harness fp8 bench` (W = 2): tokens x mlp/2 x embed.
AG_SHAPES = [(8192, 7168, 4096), (16384, 7168, 4096), (8192, 14336, 8192)]


def fp8_main(out):
    e4m3 = jnp.float8_e4m3fn

    def dot(x8, w8t, xs, ws):
        x = x8.astype(jnp.bfloat16) * xs.astype(jnp.bfloat16)
        w = w8t.astype(jnp.bfloat16) * ws.astype(jnp.bfloat16)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(
            jnp.bfloat16)

    fn = jax.jit(dot)
    # The fused ops' weight reaches the kernels K-major: quantised and transposed per step (one XLA
    # fusion) instead of quantised alone; the difference is what the transposed copy costs.
    from entwine_jax import fp8
    quantize = jax.jit(lambda w, s: fp8.quantize(w, s))
    quantize_t = jax.jit(lambda w, s: fp8.quantize(w, s).T)
    print(f"{jax.devices()[0].device_kind}: XLA FP8 dot (e4m3 x e4m3, per-tensor scales, bf16 out); quantising the "
          "bf16 weight [K, N] to e4m3 alone and transposed")
    for m, n, k in SUITE + AG_SHAPES:
        kx, kw = jax.random.split(jax.random.key(m + n + k))
        x8 = jax.random.normal(kx, (m, k), jnp.float32).astype(e4m3)
        w8t = jax.random.normal(kw, (n, k), jnp.float32).astype(e4m3)
        xs, ws = jnp.float32(0.5), jnp.float32(0.25)
        hlo = fn.lower(x8, w8t, xs, ws).compile().as_text()
        # What XLA made of it: cuBLASLt's FP8 GEMM, or a GEMM of the converted operands.
        targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
        rewritten = "__cublas$lt$matmul$f8" in targets
        kind = "cuBLASLt FP8" if rewritten else ("triton fusion" if "__triton_gemm" in hlo else ",".join(targets) or "?")
        ms = per_call_ms(fn, x8, w8t, xs, ws)
        w16 = jax.random.normal(kw, (k, n), jnp.bfloat16)
        q_ms, qt_ms = per_call_ms(quantize, w16, ws), per_call_ms(quantize_t, w16, ws)
        print(f"{m:6d} {n:6d} {k:5d}  {ms:8.4f} ms  {2 * m * n * k / ms / 1e9:6.0f} TF/s  "
              f"{kind}  "
              f"quantise w {q_ms * 1e3:6.1f} us, transposed {qt_ms * 1e3:6.1f} us")
        if out:
            out.write(json.dumps({"kind": "xla_fp8_gemm", "m": m, "n": n, "k": k, "ms": ms, "cublaslt_fp8": rewritten, "gemm": kind,
                                  "quantize_ms": q_ms, "quantize_transpose_ms": qt_ms}) + "\n")


def per_call_ms(fn, *args, batch=20, batches=15):
    for _ in range(3):
        fn(*args).block_until_ready()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(batch):
            y = fn(*args)
        y.block_until_ready()
        times.append((time.perf_counter() - t0) / batch * 1e3)
    return float(np.median(times))


def sm_clock_reader():
    """A function returning the SM clock of GPU 0 in MHz through NVML, or None without NVML."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        handle = ctypes.c_void_p()
        if nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) != 0:
            return None
    except OSError:
        return None
    mhz = ctypes.c_uint()

    def read():
        nvml.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(mhz))  # 1: NVML_CLOCK_SM
        return mhz.value
    return read


def steady_ms(fn, x, w, seconds, clock, ramp=0.3):
    """ms per call over a window of `seconds` after `ramp`, calls back to back; and the mean SM MHz."""
    batch = max(1, int(20.0 / per_call_ms(fn, x, w, batch=5, batches=3)))
    queued = collections.deque()
    launched = 0
    marks = []  # (host time at a batch's completion, calls completed by then)
    mhz = []
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            y = fn(x, w)
        launched += batch
        queued.append((y, launched))
        if len(queued) < 2:
            continue
        # Block on the older batch while the newer one keeps the GPU busy.
        y_old, done = queued.popleft()
        y_old.block_until_ready()
        now = time.perf_counter()
        if now - start < ramp:
            continue
        marks.append((now, done))
        if clock:
            mhz.append(clock())
        if now - marks[0][0] >= seconds:
            break
    for y_old, _ in queued:
        y_old.block_until_ready()
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    return (t1 - t0) * 1e3 / (n1 - n0), (float(np.mean(mhz)) if mhz else float("nan"))


def main():
    args = sys.argv[1:]
    if {"-h", "--help"} & set(args):
        print(__doc__.strip())
        return
    steady = None
    if args[:1] == ["--steady"]:
        steady = float(args[1])
        args = args[2:]
    if args[:1] == ["--fp8"]:
        return fp8_main(open(args[1], "w") if args[1:] else None)
    out = open(args[0], "w") if args else None
    dot = jax.jit(lambda x, w: jnp.dot(x, w))
    inputs = {}
    for m, n, k in SUITE:
        kx, kw = jax.random.split(jax.random.key(m + n + k))
        inputs[m, n, k] = (jax.random.normal(kx, (m, k), jnp.bfloat16), jax.random.normal(kw, (k, n), jnp.bfloat16))
    if steady is None:
        print(f"{jax.devices()[0].device_kind}: XLA jnp.dot bf16")
        for (m, n, k), (x, w) in inputs.items():
            ms = per_call_ms(dot, x, w)
            print(f"{m:6d} {n:6d} {k:5d}  {ms:8.3f} ms  {2 * m * n * k / ms / 1e9:6.0f} TF/s")
            if out:
                out.write(json.dumps({"kind": "xla_gemm", "m": m, "n": n, "k": k, "ms": ms}) + "\n")
        return
    clock = sm_clock_reader()
    print(f"{jax.devices()[0].device_kind}: XLA jnp.dot bf16, each shape alone for {steady:.1f} s after a 0.3 s ramp, "
          "two passes; ms per call (mean of the passes), SM MHz")
    passes = [{shape: steady_ms(dot, x, w, steady, clock) for shape, (x, w) in inputs.items()} for _ in range(2)]
    for shape in inputs:
        m, n, k = shape
        ms = (passes[0][shape][0] + passes[1][shape][0]) / 2
        mhz = (passes[0][shape][1] + passes[1][shape][1]) / 2
        print(f"{m:6d} {n:6d} {k:5d}  {ms:8.4f} ms  ({passes[0][shape][0]:.4f}, {passes[1][shape][0]:.4f})  {mhz:5.0f} MHz")
        if out:
            out.write(json.dumps({"kind": "xla_gemm_steady", "m": m, "n": n, "k": k, "ms": ms,
                                  "passes_ms": [p[shape][0] for p in passes], "sm_mhz": mhz}) + "\n")


if __name__ == "__main__":
    main()
