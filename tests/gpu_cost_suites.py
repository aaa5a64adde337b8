"""gpu_ranks measurements (not in `--suite all`): `hostcost` (the handlers' host time per call and
per step of a scanned block) and `smallshapes` (the fused ops against XLA's path on Llama
projections at small token counts)."""

from __future__ import annotations

import time

from gpu_harness import Rank


class CostSuites(Rank):
    """The suites of host cost and small shapes (measurements); the rank-side helpers they share are
    in gpu_harness.Rank."""

    def hostcost(self, calls=200):
        """Mean host time of one handler execution, per op, from the extension's own counters."""
        import jax
        import jax.numpy as jnp

        from entwine_jax import _extension, comm

        w_ = self.world
        m, n, k = w_ * 1024, 4096, 1024
        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=1300)
        sites = [("gemm_rs", self.gemm_fn(m, n, k, jnp.bfloat16), self.global_arrays(xs, ws), self.reference(xs, ws))]
        for gather_k in (False, True):
            xs, ws = self.ag_inputs(1024, 1024, 2048, jnp.bfloat16, 1310 + gather_k, gather_k)
            call, _ = self.ag_fn(1024, 1024, 2048, jnp.bfloat16, gather_k)
            sites.append((f"ag_gemm {'contraction' if gather_k else 'rows'}", call,
                          self.ag_globals(xs, ws, gather_k), self.ag_reference(xs, ws, gather_k)[0]))
        parts = []
        # Twice per site: the ranks calling together, then every rank but 0 starting each call 2 ms
        # late, so that rank 0's handler runs while no other process has a kernel on the GPU (as with
        # a GPU per process); ranks sharing a GPU slow each other's launches.
        for lag in (0.0, 0.002):
            for name, call, (gx, gw), ref in sites:
                self.check(self.local(call(gx, gw)), ref, f"hostcost {name} warm-up")
                (_, calls0, mean0), = comm.handler_cost(self.mesh, "tp")
                (_, _, phases0), = comm.handler_phases(self.mesh, "tp")
                # One call at a time, each waited for: with work queued, a launch can block until the
                # GPU frees a slot of its queue, and the handler's time would measure the GPU instead.
                for _ in range(calls):
                    if lag and self.rank != 0:
                        time.sleep(lag)
                    y = jax.block_until_ready(call(gx, gw))
                comm.check_errors()
                self.check(self.local(y), ref, f"hostcost {name}")
                (_, calls1, mean1), = comm.handler_cost(self.mesh, "tp")
                (_, _, phases1), = comm.handler_phases(self.mesh, "tp")
                execs = calls1 - calls0
                per_exec = (calls1 * mean1 - calls0 * mean0) / max(execs, 1)
                by_phase = ", ".join(f"{p} {(calls1 * phases1[p] - calls0 * phases0[p]) / max(execs, 1):.1f}"
                                     for p in comm.HOST_PHASES)
                parts.append(f"{name}{' (ranks > 0 late)' if lag else ''}: {execs} handler executions for "
                             f"{calls} calls, {per_exec:.1f} us each ({by_phase})")
        parts.append(self.scanned_block_cost())
        # gemm_rs's CUDA calls alone (two launches, the second a programmatic dependent) from this
        # process's main thread: their floor here, against the launch phases above (handler on XLA's
        # thread); with the GPU idle, then while an XLA program runs (dispatched, not yet waited for).
        device = jax.local_devices()[0].local_hardware_id
        floor = _extension.ext().call_sequence_us(device, 200)
        a = jnp.ones((8192, 8192), jnp.bfloat16)
        busy = jax.jit(lambda a: jax.lax.fori_loop(0, 200, lambda i, b: (b @ a) * 1e-4, a))
        jax.block_until_ready(busy(a))
        pending = busy(a)
        during = _extension.ext().call_sequence_us(device, 200)
        jax.block_until_ready(pending)
        parts.append(f"gemm_rs's CUDA calls alone from the main thread: {floor:.1f} us (GPU idle), "
                     f"{during:.1f} us (an XLA program running)")
        return "hostcost: " + "; ".join(parts)

    def scanned_block_cost(self, layers=8, runs=50):
        """Host time per step of a lax.scan over `layers` MLP blocks (ag_gemm over rows -> silu ->
        gemm_rs over rows: MaxText's scan_layers, where XLA 0.11.2 runs the handlers at every step),
        every step's result checked against float64 on the host."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        w_, bf = self.world, jnp.bfloat16
        tl, d, fl = 256, 512, 512  # tokens, embed and mlp width per rank
        rng = np.random.default_rng(1400)
        xs = [(rng.standard_normal((tl, d), np.float32) / np.sqrt(d)).astype(bf) for _ in range(w_)]
        w1 = [[rng.standard_normal((d, fl), np.float32).astype(bf) for _ in range(w_)] for _ in range(layers)]
        w2 = [[(rng.standard_normal((fl, d), np.float32) / np.sqrt(w_ * fl)).astype(bf) for _ in range(w_)]
              for _ in range(layers)]
        r = self.rank
        gx = self.place(xs[r], 0, (w_ * tl, d))
        gw1 = self.place(np.stack([w1[i][r] for i in range(layers)]), 2, (layers, d, w_ * fl))
        gw2 = self.place(np.stack([w2[i][r] for i in range(layers)]), 1, (layers, w_ * fl, d))
        ag_config = dataclasses.replace(entwine_jax.ag_heuristic_config(tl, fl, d, w_, bf), path="fused")
        rs_config = self.fused_config(w_ * tl, d, fl, bf)

        def body(x, w1s, w2s):
            def step(carry, ws):
                h = entwine_jax.ag_gemm(x, ws[0], axis_name="tp", gather_dimension=0, config=ag_config)
                return carry, entwine_jax.gemm_rs(jax.nn.silu(h), ws[1], axis_name="tp", config=rs_config)
            return jax.lax.scan(step, None, (w1s, w2s))[1]

        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("tp", None), P(None, None, "tp"),
                                                                  P(None, "tp", None)),
                                  out_specs=P(None, "tp", None), check_vma=False))

        def run():
            with jax.set_mesh(self.mesh):
                return jax.block_until_ready(f(gx, gw1, gw2))

        ys = self.local(run())
        comm.check_errors()
        g = np.concatenate([x.astype(np.float64) for x in xs])
        rows = slice(r * tl, (r + 1) * tl)
        silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
        for i in range(layers):
            ref = sum(silu(g @ w1[i][q].astype(np.float64))[rows] @ w2[i][q].astype(np.float64) for q in range(w_))
            self.check(ys[i], ref, f"scanned block, step {i}")
        (_, calls0, mean0), = comm.handler_cost(self.mesh, "tp")
        t0 = time.perf_counter()
        for _ in range(runs):
            run()
        wall = time.perf_counter() - t0
        comm.check_errors()
        (_, calls1, mean1), = comm.handler_cost(self.mesh, "tp")
        steps = runs * layers
        host_us = (calls1 * mean1 - calls0 * mean0) / steps
        return (f"scanned {layers}-layer MLP block (ag_gemm + gemm_rs per step): {(calls1 - calls0) / steps:.1f} "
                f"handler executions and {host_us:.1f} us of handler time per step, {wall / steps * 1e6:.0f} us "
                f"wall per step")

    # Llama projections per model (hidden, mlp, kv width): q/k/v and gate/up gather the tokens
    # (ag_gemm, rows layout), o and down scatter them (gemm_rs): (name, op, K of the call, N of the call).
    SMALL_MODELS = (("8B", 4096, 14336, 1024), ("70B", 8192, 28672, 1024))

    SMALL_TOKENS = (16, 64, 256, 1024, 2048)

    def small_projections(self, hidden, mlp, kv):
        w_ = self.world
        return (("qkv", "ag_gemm", hidden, (hidden + 2 * kv) // w_), ("o", "gemm_rs", hidden // w_, hidden),
                ("gate/up", "ag_gemm", hidden, 2 * mlp // w_), ("down", "gemm_rs", mlp // w_, hidden))

    def smallshapes(self, iters=40, batch=10):
        """The fused op (path="fused") against XLA's path on every projection and token count: XLA's
        GEMM alone on this rank's operands plus the transfer at tuning.crossover's link rate (XLA's
        collective cannot run between processes of one GPU). Max over ranks of interleaved medians."""
        import itertools

        import jax
        import jax.numpy as jnp
        import numpy as np

        import entwine_jax
        from entwine_jax import _distributed, comm
        from entwine_jax.ag_gemm import config as ag_config
        from entwine_jax.ag_gemm import op as ag_op
        from entwine_jax.gemm_rs import op as rs_op
        from entwine_jax.tuning import crossover, timing

        w_, bf = self.world, jnp.bfloat16
        batches = itertools.count()
        costs = crossover.COSTS
        key = jax.random.key(1500 + self.rank)
        rows, fits = [], {"gemm_rs": [], "ag_gemm": []}
        header = f"{'model':5} {'proj':7} {'tokens':>6} {'M':>6} {'N':>6} {'K':>6} {'fused_us':>9} {'xla_us':>8} " \
                 f"{'gemm_us':>8} {'link_us':>8} {'rule':>5} {'winner':>6}"
        for model, hidden, mlp, kv in self.SMALL_MODELS:
            for proj, op, k, n in self.small_projections(hidden, mlp, kv):
                for t in self.SMALL_TOKENS:
                    m = w_ * t  # the GEMM's rows: the gathered tokens (ag_gemm) or the unscattered ones (gemm_rs)
                    ka, kb = jax.random.split(jax.random.fold_in(key, len(rows)))
                    with jax.default_device(self.device):
                        if op == "gemm_rs":
                            x = (jax.random.normal(ka, (m, k), jnp.float32) / np.sqrt(w_ * k)).astype(bf)
                            gx = self.place(x, 1, (m, w_ * k))
                            a_full = x
                            moved = (w_ - 1) / w_ * m * n * 2
                        else:
                            x = (jax.random.normal(ka, (t, k), jnp.float32) / np.sqrt(k)).astype(bf)
                            gx = self.place(x, 0, (m, k))
                            a_full = jnp.concatenate([x] * w_)  # the gathered operand's shape
                            moved = (w_ - 1) * t * k * 2
                        w = jax.random.normal(kb, (k, n), jnp.float32).astype(bf)
                    if op == "gemm_rs":
                        gw = self.place(w, 0, (w_ * k, n))
                        fused = self.gemm_fn(m, n, k, bf)
                    else:
                        gw = self.place(w, 1, (k, w_ * n))
                        fused, _ = self.ag_fn(t, k, n, bf, False)
                    gemm = jax.jit(lambda a, b: a @ b)
                    # Every process times the same batch of the same program at once (they share the GPU).
                    barrier = lambda: _distributed.barrier(f"entwine_test/small/{next(batches)}", range(w_),  # noqa: E731
                                                           self.rank, 120_000)
                    ms = timing.time_interleaved({"fused": (fused, (gx, gw)), "gemm": (gemm, (a_full, w))},
                                                 iters=iters, warmup=5, batch=batch, before_batch=barrier)
                    comm.check_errors()
                    fused_ms, gemm_ms = timing.max_over_processes([ms["fused"], ms["gemm"]])
                    link_ms = moved / (costs.link_gbps * 1e9) * 1e3
                    xla_ms = gemm_ms + link_ms
                    flops = 2.0 * m * n * k
                    push = ag_config.push_of(entwine_jax.ag_heuristic_config(t, n, k, w_, bf), t * k * 2) \
                        if op == "ag_gemm" else None
                    fixed = rs_op.fixed_us() if op == "gemm_rs" else ag_op.fixed_us(push)
                    rule = "xla" if crossover.fused_cannot_win(fixed, flops, moved) else "fused"
                    winner = "fused" if fused_ms < xla_ms else "xla"
                    # The fixed cost the rule assumes: what the fused op takes beyond the longer of its
                    # GEMM and its transfer (the overlap's bound).
                    fits[op].append((fused_ms - max(gemm_ms, link_ms)) * 1e3)
                    rows.append((model, proj, t, m, n, k, fused_ms * 1e3, xla_ms * 1e3, gemm_ms * 1e3, link_ms * 1e3,
                                 rule, winner))
                    self.log(f"smallshapes {model} {proj} T={t}: fused {fused_ms * 1e3:.1f} us, XLA path "
                             f"{xla_ms * 1e3:.1f} us")
        if self.rank == 0:
            print(header, flush=True)
            for r in rows:
                print(f"{r[0]:5} {r[1]:7} {r[2]:>6} {r[3]:>6} {r[4]:>6} {r[5]:>6} {r[6]:>9.1f} {r[7]:>8.1f} {r[8]:>8.1f} "
                      f"{r[9]:>8.1f} {r[10]:>5} {r[11]:>6}", flush=True)
        fitted = {op: float(np.median(v)) for op, v in fits.items()}
        wrong = [f"{r[0]} {r[1]} T={r[2]}" for r in rows if r[10] != r[11]]
        # Processes sharing one GPU without MPS take turns on it (time slices of milliseconds): a fused
        # call waits for its peer's turn, so its time is the slice, not the op's.
        shared = (" (ranks share a GPU: the fused times are the driver's time slices between processes, not "
                  "the ops' costs; only --gpus W measures the crossover)" if self.args.gpus < self.world else "")
        return (f"smallshapes{shared}: {len(rows)} shapes; fitted fixed_us (median of fused - max(GEMM, link)): "
                f"gemm_rs {fitted['gemm_rs']:.1f}, ag_gemm {fitted['ag_gemm']:.1f} (the ops declare gemm_rs "
                f"{rs_op.fixed_us():.0f}, ag_gemm {ag_op.fixed_us('ce'):.0f} / {ag_op.fixed_us('sm'):.0f} with the copy "
                f"engines / the SM push); the rule disagrees with the measurement on {len(wrong)}: "
                f"{', '.join(wrong) or 'none'}")
