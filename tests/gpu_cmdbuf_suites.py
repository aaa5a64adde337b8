"""gpu_ranks suites under XLA's command buffers (CUDA graphs): `cmdbuf` (both ops recorded and
replayed, bf16 and FP8, every result checked, the device epoch against the handler's executions) and
`cmdbufmissing` (a replayed call whose peer never came traps at the deadline)."""

from __future__ import annotations

import os
import time

from gpu_harness import MISSING_TIMEOUT_MS, Rank

# Command buffers for fusions and custom calls, however small the graph.
CMDBUF_XLA_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL "
                    "--xla_gpu_graph_min_graph_size=1")
# No command buffers at all (XLA's defaults record custom calls and loops too).
NO_CMDBUF_XLA_FLAGS = "--xla_gpu_enable_command_buffer="


class CmdbufSuites(Rank):
    """The suites of XLA command buffers; the rank-side helpers they share are in gpu_harness.Rank."""

    def cmdbuf(self, runs=20):
        """Every site run `runs` times with fresh seeds (and again with repeated ones), every result
        checked against the host reference. Then the proof that the calls ran inside command buffers:
        the device epoch advanced once per fused call, while the handlers executed fewer times (the
        rest were replays of recorded graphs)."""
        from entwine_jax import comm

        if CMDBUF_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            raise AssertionError("the cmdbuf suite runs with command buffers enabled (launch it through the launcher)")
        worst, parts, counts = 0.0, [], []
        for name, call, per_run, ref, replays in self.cmdbuf_sites():
            call(0)  # compile and record once
            comm.check_errors()
            epoch0, exec0 = self.device_epoch(), self.handler_executions()
            for i in range(runs):
                seed = 1 + i % (runs // 2 + 1) * 7  # fresh seeds, then some again
                out = call(seed)
                outs = [self.local(o) for o in (out if isinstance(out, tuple) else (out,))]
                if per_run > len(outs):  # scan: stacked over the steps, one stack per op
                    outs = [o[t] for t in range(per_run // len(outs)) for o in outs]
                comm.check_errors()
                for j, (y, r) in enumerate(zip(outs, ref(seed))):
                    worst = max(worst, self.check(y, r, f"cmdbuf {name}, run {i} (seed {seed}), result {j}"))
            epoch1, exec1 = self.device_epoch(), self.handler_executions()
            calls = runs * per_run
            if epoch1 - epoch0 != calls:
                raise AssertionError(f"cmdbuf {name}: the device epoch advanced {epoch1 - epoch0} times for {calls} calls")
            parts.append(f"{name}: {calls} calls, {exec1 - exec0} handler executions")
            counts.append((name, calls, exec1 - exec0, replays))
            self.log(f"cmdbuf {name}: {calls} calls checked, handler executed {exec1 - exec0} times")
        not_replayed = [name for name, calls, executions, replays in counts if replays and executions >= calls]
        if not_replayed:
            raise AssertionError("no call of " + ", ".join(not_replayed) + " was replayed from a command buffer: " +
                                 "; ".join(parts))
        return f"cmdbuf: worst rel error {worst:.2e}; " + "; ".join(parts)

    def cmdbufmissing(self):
        """Under command buffers, after replayed calls, the last rank skips one: the others' replayed
        call must trap at the deadline (no handler runs between replays to report it), XLA must raise,
        and check_errors() must name the absent rank. A replay that kept the epoch of its recording
        would instead pass its waits on the flags of the earlier calls and return without error."""
        import jax

        from entwine_jax import _distributed, comm

        if CMDBUF_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            raise AssertionError("the cmdbufmissing suite runs with command buffers enabled")
        _, call, _, ref, _ = self.cmdbuf_sites()[0]
        for seed in (1, 2, 3):
            self.check(self.local(call(seed)), ref(seed)[0], f"cmdbufmissing warm-up (seed {seed})")
        comm.check_errors()
        absent = self.world - 1
        if self.rank == absent:
            detail = "cmdbufmissing: skipped the call"
        else:
            exec0 = self.handler_executions()
            t0 = time.monotonic()
            try:
                jax.block_until_ready(call(4))
            except Exception as e:  # XlaRuntimeError: the kernel trapped
                xla_error = f"{type(e).__name__}: {str(e)[:160]}"
            else:
                raise AssertionError(f"no error after {time.monotonic() - t0:.1f} s although rank {absent} never called")
            waited = time.monotonic() - t0
            if self.handler_executions() != exec0:
                raise AssertionError("the call without the absent rank was recorded again, not replayed")
            message = self.recorded_error(f"XLA raised ({xla_error}) but no deadline was recorded")
            if f"from rank {absent}" not in message or f"waited {MISSING_TIMEOUT_MS} ms" not in message:
                raise AssertionError(f"deadline error does not name rank {absent} and the timeout: {message}")
            if waited > 10 * MISSING_TIMEOUT_MS / 1000 + 20:
                raise AssertionError(f"the deadline took {waited:.1f} s")
            detail = f"cmdbufmissing: replayed call trapped after {waited:.1f} s ({xla_error[:60]}); {message[:100]}"
        _distributed.barrier("entwine_test/cmdbufmissing_done", range(self.world), self.rank, 120_000)
        return detail

    def gen(self, seed, rank, shape, salt, xp):
        """A rank's operand from (seed, rank, salt) by integer hashing, in jnp (inside the program, on
        the device) or np (the host reference) alike: values k/16 for k in -8..8, exact in bf16."""
        import numpy as np

        size = int(np.prod(shape))
        h = xp.arange(size, dtype=xp.uint32) * xp.uint32(2654435761)
        h = h + (xp.asarray(seed).astype(xp.uint32) * xp.uint32(40503) + xp.asarray(rank).astype(xp.uint32) *
                 xp.uint32(7919) + xp.uint32(salt * 104729))
        h = h ^ (h >> xp.uint32(13))
        h = h * xp.uint32(0x5BD1E995)
        h = h ^ (h >> xp.uint32(15))
        return ((h % xp.uint32(17)).astype(xp.int32) - 8).astype(xp.float32).reshape(shape) / 16

    def cmdbuf_sites(self):
        """Programs f(seed) whose fused calls consume operands generated inside the program from the
        seed: a call of fresh data reuses the command buffer's addresses, so XLA may replay the
        recorded calls. Each: (name, f, fused calls per run, host reference of seed -> [local results],
        whether XLA replays its calls: not the loop's; XLA 0.11.2 ran the handler at every step of it,
        also with a body of nothing but the slicing and the two calls)."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax

        w_, bf = self.world, jnp.bfloat16
        m, n, k = w_ * 256, 512, 256
        rows, cols, n_ag = 256, 192, 512
        rs_config = self.fused_config(m, n, k, bf)
        ag_config = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n_ag, cols, w_, bf), path="fused")
        host = lambda seed, rank, shape, salt: self.gen(seed, rank, shape, salt, np).astype(bf)  # noqa: E731

        def rs_local(seed, step=0):
            xs = [host(seed + step, q, (m, k), 1) for q in range(w_)]
            ws = [host(seed + step, q, (k, n), 2) for q in range(w_)]
            return self.reference(xs, ws)

        def ag_local(seed, gather_k, step=0):
            kk = w_ * cols if gather_k else cols
            xs = [host(seed + step, q, (rows, cols), 3) for q in range(w_)]
            ws = [host(seed + step, q, (kk, n_ag), 4) for q in range(w_)]
            return self.ag_reference(xs, ws, gather_k)[0]

        def program(body, out_specs):
            f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(), out_specs=out_specs, check_vma=False))

            def call(seed):
                with jax.set_mesh(self.mesh):
                    return f(np.int32(seed))
            return call

        def dev(seed, shape, salt):
            return self.gen(seed, jax.lax.axis_index("tp"), shape, salt, jnp).astype(bf)

        def rs(seed, extra_work):
            y = entwine_jax.gemm_rs(dev(seed, (m, k), 1), dev(seed, (k, n), 2), axis_name="tp", config=rs_config)
            if extra_work:  # local XLA work next to the custom call, in the same command buffer
                y = y + jnp.tanh(jnp.zeros((1, n), jnp.float32)).astype(bf)
            return y

        def ag(seed, gather_k):
            # Both pushes replayed: the SM push in the rows layout, the copy engines in the other.
            kk = w_ * cols if gather_k else cols
            return entwine_jax.ag_gemm(dev(seed, (rows, cols), 3), dev(seed, (kk, n_ag), 4), axis_name="tp",
                                       gather_dimension=-1 if gather_k else 0,
                                       config=dataclasses.replace(ag_config, push=("sm", "ce")[gather_k]))

        def independent(seed):
            # Three fused calls that share no data, two of them of one shape: XLA's schedule orders
            # them, the same on every rank (the call site in each signature would expose a swap).
            y1 = rs(seed, False)
            y2 = entwine_jax.gemm_rs(dev(seed, (m, k), 5), dev(seed, (k, n), 6), axis_name="tp", config=rs_config)
            return y1, y2, ag(seed, False)

        def independent_local(seed):
            xs = [host(seed, q, (m, k), 5) for q in range(w_)]
            ws = [host(seed, q, (k, n), 6) for q in range(w_)]
            return [rs_local(seed), self.reference(xs, ws), ag_local(seed, False)]

        # FP8 (e4m3 operands, per-tensor scales): the hashed values k/16 are exact in e4m3, and the
        # scales come from the seed and the rank inside the program, so a replay that kept a recorded
        # scale instead of reading this run's would give the previous seed's result.
        e4m3 = jnp.float8_e4m3fn
        rs8_config = self.fused_config(m, n, k, e4m3)
        ag8_config = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n_ag, cols, w_, e4m3), path="fused")

        def scale(seed, rank, salt, xp):
            return ((seed + rank + salt) % xp.int32(5) + 1).astype(xp.float32) / 64

        def rs8(seed):
            q = jax.lax.axis_index("tp")
            return entwine_jax.gemm_rs(dev(seed, (m, k), 7).astype(e4m3), dev(seed, (k, n), 8).astype(e4m3),
                                       axis_name="tp", config=rs8_config, x_scale=scale(seed, q, 1, jnp),
                                       w_scale=scale(seed, q, 2, jnp))

        def rs8_local(seed):
            s = np.int32(seed)
            xs = [host(seed, q, (m, k), 7).astype(np.float64) * scale(s, np.int32(q), 1, np) for q in range(w_)]
            ws = [host(seed, q, (k, n), 8).astype(np.float64) * scale(s, np.int32(q), 2, np) for q in range(w_)]
            return [self.reference(xs, ws)]

        def ag8(seed):
            # One x_scale for every shard (rows layout), this rank's w_scale.
            q = jax.lax.axis_index("tp")
            return entwine_jax.ag_gemm(dev(seed, (rows, cols), 9).astype(e4m3), dev(seed, (cols, n_ag), 10).astype(e4m3),
                                       axis_name="tp", gather_dimension=0, config=ag8_config,
                                       x_scale=scale(seed, 0, 3, jnp), w_scale=scale(seed, q, 4, jnp))

        def ag8_local(seed):
            s = np.int32(seed)
            xs = [host(seed, q, (rows, cols), 9).astype(np.float64) * scale(s, np.int32(0), 3, np) for q in range(w_)]
            ws = [host(seed, q, (cols, n_ag), 10).astype(np.float64) * scale(s, np.int32(q), 4, np) for q in range(w_)]
            return [self.ag_reference(xs, ws, False)[0]]

        layers = 3

        def scanned(seed):
            # Both ops in the body of a device loop (MaxText's scan_layers): with WHILE command buffers
            # the body's graph is replayed once per step, with no host in between. The operands are
            # made before the loop, so that the body holds only the calls and slicing.
            steps = seed + jnp.arange(layers, dtype=jnp.int32)
            stacked = [jax.vmap(lambda t, shape=shape, salt=salt: dev(t, shape, salt))(steps)
                       for shape, salt in (((m, k), 1), ((k, n), 2), ((rows, cols), 3), ((cols, n_ag), 4))]

            def step(carry, ops):
                x1, w1, x2, w2 = ops
                return carry, (entwine_jax.gemm_rs(x1, w1, axis_name="tp", config=rs_config),
                               entwine_jax.ag_gemm(x2, w2, axis_name="tp", gather_dimension=0, config=ag_config))
            return jax.lax.scan(step, None, tuple(stacked))[1]

        return [
            ("gemm_rs", program(lambda s: rs(s, False), P("tp", None)), 1, lambda s: [rs_local(s)], True),
            ("gemm_rs + XLA work", program(lambda s: rs(s, True), P("tp", None)), 1, lambda s: [rs_local(s)], True),
            ("ag_gemm rows", program(lambda s: ag(s, False), P(None, "tp")), 1, lambda s: [ag_local(s, False)],
             True),
            ("ag_gemm contraction", program(lambda s: ag(s, True), P(None, "tp")), 1, lambda s: [ag_local(s, True)],
             True),
            ("FP8 gemm_rs", program(rs8, P("tp", None)), 1, rs8_local, True),
            ("FP8 ag_gemm rows", program(ag8, P(None, "tp")), 1, ag8_local, True),
            ("three independent calls", program(independent, (P("tp", None), P("tp", None), P(None, "tp"))), 3,
             independent_local, True),
            (f"scan of {layers} steps of both ops", program(scanned, (P(None, "tp", None), P(None, None, "tp"))),
             2 * layers, lambda s: [r for t in range(layers) for r in (rs_local(s, t), ag_local(s, False, t))],
             False),
        ]

