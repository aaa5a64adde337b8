"""gpu_ranks suites of gemm_rs alone: `quick` (suite-like and tail shapes, x [B, S, K], jax.vmap,
lax.scan) and `stress` (1000 back-to-back calls)."""

from __future__ import annotations

import time

from gpu_harness import Rank


class GemmRsSuites(Rank):
    """The suites of gemm_rs alone; the rank-side helpers they share are in gpu_harness.Rank."""

    def quick(self):
        import jax.numpy as jnp
        import numpy as np

        from entwine_jax import comm

        w_ = self.world
        # Growing sizes: every new shape regrows the heaps of all processes.
        # The two suite-like shapes keep M near 2048 and 4096 rows for any W (M must divide by W).
        shapes = [(w_ * 77, 130, 60), (w_ * 128, 256, 64), (w_ * 200, 1000, 1000), (w_ * 129, 257, 72),
                  (2048 // w_ * w_, 4096, 1024), (4096 // w_ * w_, 8192, 1024)]
        worst = 0.0
        for dtype in (jnp.bfloat16, jnp.float16):
            for i, (m, n, k) in enumerate(shapes):
                xs, ws = self.host_inputs(m, n, k, dtype, seed=100 + i)
                ref = self.reference(xs, ws)
                gx, gw = self.global_arrays(xs, ws)
                f = self.gemm_fn(m, n, k, dtype)
                ys = [self.local(f(gx, gw)) for _ in range(3)]
                comm.check_errors()
                worst = max(worst, self.check(ys[0], ref, f"M={m} N={n} K={k} {dtype.__name__}"))
                for y in ys[1:]:
                    if not np.array_equal(y.view(np.uint16), ys[0].view(np.uint16)):
                        raise AssertionError(f"M={m} N={n} K={k} {dtype.__name__}: repeated calls differ bitwise")
                self.log(f"quick M={m} N={n} K={k} {dtype.__name__}: ok")
        # [B, S, K] scattered over S (sequence parallelism): rows permuted before the fused call.
        for i, (b, s, n, k) in enumerate([(3, w_ * 100, 257, 72), (2, w_ * 1024, 2048, 1024)]):
            worst = max(worst, self.middle_dim(b, s, n, k, jnp.bfloat16, seed=200 + i))
            self.log(f"quick B={b} S={s} N={n} K={k} scattered over S: ok")
        # jax.vmap over a leading batch dim, w batched or shared: one fused call per element.
        for shared_w in (False, True):
            worst = max(worst, self.vmapped(3, w_ * 256, 512, 256, jnp.bfloat16, shared_w, seed=400 + shared_w))
            self.log(f"quick jax.vmap (w {'shared' if shared_w else 'batched'}): ok")
        # MaxText's scan_layers: the custom call inside lax.scan, once per step of a device loop.
        worst = max(worst, self.scan_layers(w_ * 256, 512, 256, layers=3, dtype=jnp.bfloat16, seed=300))
        self.log("quick gemm_rs inside lax.scan (3 steps): ok")
        self.census_of_the_xla_path(w_ * 128, 256, 64)
        self.log("quick census of the XLA path on this GPU: ok")
        return f"quick: {2 * len(shapes) + 5} shapes ok, worst rel error {worst:.2e}"

    def census_of_the_xla_path(self, m, n, k):
        """A gemm_rs compiled for XLA's path on this GPU (path="xla"): its reference reduce-scatters in
        fp32, and the census must report it as the op's, in the dtype the kernels move (bf16: M * N
        * 2 bytes over W ranks), with what the program holds beside it (compiled, not run: NCCL
        refuses two ranks of one GPU)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        import entwine_jax

        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=500)
        gx, gw = self.global_arrays(xs, ws)
        config = entwine_jax.GemmRsConfig(path="xla")
        f = jax.jit(jax.shard_map(lambda x, w: entwine_jax.gemm_rs(x, w, axis_name="tp", config=config),
                                  mesh=self.mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
        found = self.census(f, gx, gw)
        ours = found.select(owner="gemm_rs")
        expected = (m * n * 2) * (self.world - 1) // self.world
        if (len(ours.collectives) != 1 or ours.collectives[0].custom_call or ours.collectives[0].kind != "reduce-scatter"
                or not ours.collectives[0].shape.startswith("bf16") or ours.collectives[0].bytes != expected
                or not ours.collectives[0].program_shape.startswith("f32")):
            raise AssertionError(f"census of gemm_rs on XLA's path: expected one bf16 reduce-scatter of {expected} "
                                 f"bytes standing for an f32 one, got\n{found.table()}")

    def vmapped(self, b, m, n, k, dtype, shared_w, seed):
        """jax.vmap(gemm_rs) over b elements inside shard_map (w batched or shared) against the host
        reference of every element; the program must contain the fused call."""
        import jax
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        elems = [self.host_inputs(m, n, k, dtype, seed + 10 * i) for i in range(b)]
        if shared_w:
            elems = [(xs, elems[0][1]) for xs, _ in elems]
        x_ranks = [np.stack([xs[r] for xs, _ in elems]) for r in range(self.world)]
        w_ranks = [elems[0][1][r] if shared_w else np.stack([ws[r] for _, ws in elems]) for r in range(self.world)]
        gx, gw = self.global_arrays(x_ranks, w_ranks)
        config = self.fused_config(m, n, k, dtype)
        op = jax.vmap(lambda x, w: entwine_jax.gemm_rs(x, w, axis_name="tp", config=config),
                      in_axes=(0, None if shared_w else 0))
        w_spec = P("tp", None) if shared_w else P(None, "tp", None)
        f = jax.jit(jax.shard_map(op, mesh=self.mesh, in_specs=(P(None, None, "tp"), w_spec),
                                  out_specs=P(None, "tp", None)))
        if not self.fused_calls(f, gx, gw).get("gemm_rs"):
            raise AssertionError("jax.vmap(gemm_rs) did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            ys = self.local(f(gx, gw))
        comm.check_errors()
        what = f"vmap over {b} (w {'shared' if shared_w else 'batched'})"
        if ys.shape != (b, m // self.world, n):
            raise AssertionError(f"{what}: local result of shape {ys.shape}")
        return max(self.check(ys[i], self.reference(*elems[i]), f"{what}, element {i}") for i in range(b))

    def scan_layers(self, m, n, k, layers, dtype, seed):
        """jax.lax.scan over `layers` weight matrices, gemm_rs in the body, against the host reference."""
        import jax
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        xs, _ = self.host_inputs(m, n, k, dtype, seed)
        w_layers = [self.host_inputs(m, n, k, dtype, seed + 1 + i)[1] for i in range(layers)]
        # w of every rank stacked over the layers: [layers, K, N] per rank.
        gx, gws = self.global_arrays(xs, [np.stack([wl[r] for wl in w_layers]) for r in range(self.world)])
        config = self.fused_config(m, n, k, dtype)

        def body(x, ws):
            return jax.lax.scan(lambda c, w: (c, entwine_jax.gemm_rs(x, w, axis_name="tp", config=config)), None, ws)[1]

        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, "tp"), P(None, "tp", None)),
                                  out_specs=P(None, "tp", None)))
        # The census counts a call in a loop once per trip (XLA's known_trip_count): `layers` fused
        # calls per run, whether XLA keeps the loop or unrolls it; a loop of unknown trip count must hold it.
        calls = self.census(f, gx, gws).select(owner="gemm_rs", custom_call=True)
        if not (calls.count == layers or (calls.unknown and all(c.loops for c in calls))):
            raise AssertionError(f"gemm_rs inside lax.scan did not lower to the fused call in a loop: {calls.count} "
                                 f"fused calls per run, expected {layers}\n{calls.table()}")
        with jax.set_mesh(self.mesh):
            ys = self.local(f(gx, gws))
        comm.check_errors()
        worst = 0.0
        for i, wl in enumerate(w_layers):
            worst = max(worst, self.check(ys[i], self.reference(xs, wl), f"scan step {i}"))
        return worst

    def middle_dim(self, b, s, n, k, dtype, seed):
        """entwine_jax.gemm_rs on x [B, S, K] with scatter_dimension=1 (the fused path must take it)
        against the host reference: rank r holds rows r*S/W .. of dim 1 of sum_ranks(x @ w)."""
        import jax
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        xs, ws = self.host_inputs(b * s, n, k, dtype, seed)
        xs = [x.reshape(b, s, k) for x in xs]
        part = slice(self.rank * s // self.world, (self.rank + 1) * s // self.world)
        ref = sum(x[:, part].astype(np.float64) @ w.astype(np.float64) for x, w in zip(xs, ws))
        gx, gw = self.global_arrays(xs, ws)
        config = self.fused_config(b * s, n, k, dtype)
        body = lambda x, w: entwine_jax.gemm_rs(x, w, axis_name="tp", scatter_dimension=1, config=config)
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, None, "tp"), P("tp", None)),
                                  out_specs=P(None, "tp", None)))
        if not self.fused_calls(f, gx, gw).get("gemm_rs"):
            raise AssertionError(f"B={b} S={s} N={n} K={k}: a scatter over S did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            ys = [self.local(f(gx, gw)) for _ in range(2)]
        comm.check_errors()
        if ys[0].shape != (b, s // self.world, n):
            raise AssertionError(f"scatter over S: local result of shape {ys[0].shape}")
        if not np.array_equal(ys[1].view(np.uint16), ys[0].view(np.uint16)):
            raise AssertionError(f"B={b} S={s} N={n} K={k} scattered over S: repeated calls differ bitwise")
        return self.check(ys[0], ref, f"B={b} S={s} N={n} K={k} scattered over S")

    def stress(self, calls=1000, batch=16):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from entwine_jax import comm

        w_ = self.world
        shapes = [(w_ * 256, 512, 256), (w_ * 300, 640, 200)]
        variants = 3  # consecutive calls of one shape see other data: a stale slot would show
        data = {}
        for s, (m, n, k) in enumerate(shapes):
            sites = [self.gemm_fn(m, n, k, jnp.bfloat16), self.gemm_fn(m, n, k, jnp.bfloat16, extra_work=True)]
            for v in range(variants):
                xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=1000 + 10 * s + v)
                data[s, v] = (self.global_arrays(xs, ws), self.reference(xs, ws), sites)
        side = jax.device_put(np.ones((512, 512), np.float32), self.device)
        side_fn = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
        first, pending, checked = {}, [], 0
        t0 = time.monotonic()
        for i in range(calls):
            s, v, site = i % 2, (i // 2) % variants, (i // (2 * variants)) % 2
            (gx, gw), ref, sites = data[s, v]
            pending.append(((s, v, site, i), sites[site](gx, gw)))
            if i % 3 == 0:
                side = side_fn(side)  # other XLA work between the calls, on the same device
            if len(pending) == batch or i == calls - 1:
                for (s_, v_, site_, i_), y in pending:
                    y = self.local(y)
                    if (s_, v_) not in first:
                        self.check(y, data[s_, v_][1], f"stress call {i_} shape {s_} variant {v_}")
                        first[s_, v_] = y
                    elif not np.array_equal(y.view(np.uint16), first[s_, v_].view(np.uint16)):
                        self.check(y, data[s_, v_][1], f"stress call {i_} (site {site_})")
                        raise AssertionError(f"stress call {i_} shape {s_} variant {v_} site {site_}: "
                                             "differs bitwise from the first call")
                    checked += 1
                pending.clear()
                comm.check_errors()
        jax.block_until_ready(side)
        return f"stress: {checked} calls checked in {time.monotonic() - t0:.1f} s"
