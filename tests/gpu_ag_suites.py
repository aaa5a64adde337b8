"""gpu_ranks suites of ag_gemm: `ag` (both layouts and pushes, the grouped op's and the MLP's
gradients) and `mixed` (1000 calls alternating gemm_rs and ag_gemm on one communicator)."""

from __future__ import annotations

import time

from gpu_harness import Rank


class AgSuites(Rank):
    """The suites of ag_gemm (and mixed with gemm_rs); the rank-side helpers they share are in gpu_harness.Rank."""

    def ag(self):
        import jax.numpy as jnp

        shapes = [(128, 64, 256), (77, 60, 130), (200, 1000, 1000), (1024, 512, 2048), (2048, 1024, 4096)]
        worst, cases = 0.0, 0
        for d, dtype in enumerate((jnp.bfloat16, jnp.float16)):
            for gather_k in (False, True):
                for i, (rows, cols, n) in enumerate(shapes):
                    # Each shape and layout by both pushes: the SM push in one dtype, the copy engines in the other.
                    push = ("sm", "ce")[(i + gather_k + d) % 2]
                    worst = max(worst, self.ag_case(rows, cols, n, dtype, gather_k, seed=700 + i,
                                                    return_gathered=i % 2 == 1, push=push))
                    cases += 1
                    self.log(f"ag rows={rows} cols={cols} N={n} gather_k={gather_k} {dtype.__name__} push={push}: ok")
        worst = max(worst, self.mlp_grads(self.world * 256, 512, 384, jnp.float16, seed=900))
        self.log("ag: sequence-parallel MLP forward + backward, both directions fused: ok")
        worst = max(worst, self.mlp_grads(self.world * 200, 264, 200, jnp.bfloat16, seed=901))
        self.log("ag: sequence-parallel MLP with tails: ok")
        # Grouped: q/k/v-like weights of unequal widths (8 query heads per kv head) read in place (widths
        # of whole 128-wide blocks: the heuristic's 256-wide ones would straddle; whole 256-wide ones;
        # four weights, the most in place), and groups the kernels cannot read in place (widths not
        # whole blocks, tails), joined into one operand per call.
        groups = [(256, 512, (1024, 128, 128), jnp.bfloat16, True), (200, 264, (256, 512), jnp.float16, True),
                  (128, 256, (128, 256, 128, 384), jnp.bfloat16, True),
                  (256, 512, (512, 64, 64), jnp.bfloat16, False), (77, 60, (130, 17, 17, 40), jnp.float16, False)]
        for i, (rows, cols, widths, dtype, in_place) in enumerate(groups):
            for gather_k in (False, True):
                worst = max(worst, self.grouped_grads(rows, cols, widths, dtype, gather_k, seed=950 + i,
                                                      in_place=in_place))
                self.log(f"ag: grouped rows={rows} cols={cols} widths={widths} gather_k={gather_k} "
                         f"{'in place' if in_place else 'joined'}: ok")
        return f"ag: {cases} cases + 2 MLP gradients + {2 * len(groups)} grouped ok, worst rel error {worst:.2e}"

    def ag_case(self, rows, cols, n, dtype, gather_k, seed, return_gathered=False, repeats=2, push="auto"):
        import numpy as np

        from entwine_jax import comm

        xs, ws = self.ag_inputs(rows, cols, n, dtype, seed, gather_k)
        ref, g_ref = self.ag_reference(xs, ws, gather_k)
        call, f = self.ag_fn(rows, cols, n, dtype, gather_k, return_gathered, push)
        gx, gw = self.ag_globals(xs, ws, gather_k)
        if not self.fused_calls(f, gx, gw).get("ag_gemm"):
            raise AssertionError("ag_gemm did not lower to the fused call")
        outs = [call(gx, gw) for _ in range(repeats)]
        comm.check_errors()
        what = (f"ag_gemm rows={rows} cols={cols} N={n} {'contraction' if gather_k else 'rows'} {dtype.__name__} "
                f"push={push}")
        ys = [self.local(o[0] if return_gathered else o) for o in outs]
        if ys[0].shape != ref.shape:
            raise AssertionError(f"{what}: local result of shape {ys[0].shape}, expected {ref.shape}")
        err = self.check(ys[0], ref, what)
        for y in ys[1:]:
            if not np.array_equal(y.view(np.uint16), ys[0].view(np.uint16)):
                raise AssertionError(f"{what}: repeated calls differ bitwise")
        if return_gathered:
            g = self.local(outs[0][1])
            if g.shape != g_ref.shape or not np.array_equal(g.astype(np.float64), g_ref):
                raise AssertionError(f"{what}: the gathered operand differs from the shards")
        return err

    def grouped_grads(self, rows, cols, widths, dtype, gather_k, seed, in_place):
        """ys = ag_gemm(x, (w_1, ..., w_G)) (one gather, weights of unequal widths), its values and the
        gradients of loss = sum_i sum(y_i c_i) (summed over ranks) against float64: one fused ag_gemm
        forward (taking the G weights where they lie if in_place, else one joined operand), one fused
        gemm_rs backward, no XLA collective."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        rng = np.random.default_rng(seed)
        k = self.world * cols if gather_k else cols
        out_rows = rows if gather_k else self.world * rows
        xs = [(rng.standard_normal((rows, cols), np.float32) / np.sqrt(k)).astype(dtype) for _ in range(self.world)]
        ws = [[rng.standard_normal((k, n), np.float32).astype(dtype) for n in widths] for _ in range(self.world)]
        cs = [[rng.standard_normal((out_rows, n), np.float32).astype(dtype) for n in widths]
              for _ in range(self.world)]
        config = entwine_jax.AgGemmConfig(path="fused")
        gd = -1 if gather_k else 0
        groups = len(widths)

        def values_and_grads(x, *wc):
            w, c = wc[:groups], wc[groups:]

            def loss(x, *w):
                ys = entwine_jax.ag_gemm(x, w, axis_name="tp", gather_dimension=gd, config=config)
                return sum(jnp.sum(y.astype(jnp.float32) * ci.astype(jnp.float32)) for y, ci in zip(ys, c)), ys
            (_, ys), grads = jax.value_and_grad(loss, argnums=tuple(range(groups + 1)), has_aux=True)(x, *w)
            return ys, grads

        x_spec = P(None, "tp") if gather_k else P("tp", None)
        w_spec, c_spec = P(None, "tp"), P(None, "tp")
        f = jax.jit(jax.shard_map(values_and_grads, mesh=self.mesh,
                                  in_specs=(x_spec,) + (w_spec,) * groups + (c_spec,) * groups,
                                  out_specs=((P(None, "tp"),) * groups, (x_spec,) + (w_spec,) * groups)))
        x_global = (rows, self.world * cols) if gather_k else (self.world * rows, cols)
        args = [self.place(xs[self.rank], 1 if gather_k else 0, x_global)]
        args += [self.place(w, 1, (k, self.world * w.shape[1])) for w in ws[self.rank]]
        args += [self.place(c, 1, (out_rows, self.world * c.shape[1])) for c in cs[self.rank]]
        found = self.census(f, *args)
        calls = found.select(custom_call=True).counts("owner")
        if calls != {"ag_gemm": 1, "gemm_rs": 1}:
            raise AssertionError(f"grouped: custom calls {calls}, expected one ag_gemm and one gemm_rs")
        if self.ag_gemm_weights(f, *args) != [groups if in_place else 1]:
            raise AssertionError(f"grouped widths={widths}: the ag_gemm call takes {self.ag_gemm_weights(f, *args)} "
                                 f"weight operands, expected {groups if in_place else 1} "
                                 f"({'in place' if in_place else 'joined'})")
        left = found.select(custom_call=False, kind=("all-gather", "reduce-scatter", "all-reduce"))
        if left:
            raise AssertionError(f"grouped: the compiled program still has XLA collectives:\n{left.table()}")
        with jax.set_mesh(self.mesh):
            ys, grads = f(*args)
        comm.check_errors()
        # float64 reference: G = the gathered x; y_i = G @ W_i^r; dG = sum_r sum_i C_i^r W_i^r.T.
        g = np.concatenate([a.astype(np.float64) for a in xs], axis=1 if gather_k else 0)
        what = f"grouped rows={rows} cols={cols} widths={widths} {'contraction' if gather_k else 'rows'} {dtype.__name__}"
        worst = 0.0
        for i in range(groups):
            worst = max(worst, self.check(self.local(ys[i]), g @ ws[self.rank][i].astype(np.float64), f"{what} y{i}"))
            worst = max(worst, self.check(self.local(grads[1 + i]), g.T @ cs[self.rank][i].astype(np.float64),
                                          f"{what} dw{i}"))
        dg = sum(cs[r][i].astype(np.float64) @ ws[r][i].astype(np.float64).T for r in range(self.world)
                 for i in range(groups))
        mine = (slice(None), slice(self.rank * cols, (self.rank + 1) * cols)) if gather_k else \
            (slice(self.rank * rows, (self.rank + 1) * rows), slice(None))
        return max(worst, self.check(self.local(grads[0]), dg[mine], f"{what} dx"))

    def mlp_grads(self, t, d, f_local, dtype, seed):
        """x [T/W, D] -> h = ag_gemm(x, w1 [D, F/W]) -> silu -> gemm_rs(., w2 [F/W, D]) -> [T/W, D];
        loss = sum(y * c) + sum(y^2) / 2. jax.grad inside shard_map (the sum of every rank's loss) against float64.
        The compiled program must hold both fused calls and no all-gather or reduce-scatter."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm

        rng = np.random.default_rng(seed)
        tl = t // self.world
        xs = [(rng.standard_normal((tl, d), np.float32)).astype(dtype) for _ in range(self.world)]
        w1 = [(rng.standard_normal((d, f_local), np.float32) / np.sqrt(d)).astype(dtype) for _ in range(self.world)]
        w2 = [(rng.standard_normal((f_local, d), np.float32) / np.sqrt(f_local * self.world)).astype(dtype)
              for _ in range(self.world)]
        cs = [rng.standard_normal((tl, d), np.float32).astype(dtype) for _ in range(self.world)]
        up = dataclasses.replace(entwine_jax.ag_heuristic_config(tl, f_local, d, self.world, dtype), path="fused")
        down = dataclasses.replace(entwine_jax.heuristic_config(t, d, f_local, self.world, dtype), path="fused")

        def loss(x, w1_, w2_, c):
            h = entwine_jax.ag_gemm(x, w1_, axis_name="tp", config=up)
            a = jax.nn.silu(h.astype(jnp.float32)).astype(dtype)
            y = entwine_jax.gemm_rs(a, w2_, axis_name="tp", config=down)
            # Squared, so that the forward's y is needed by the backward (a linear loss would let
            # XLA drop the forward gemm_rs).
            return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)) + 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32)))

        grads = jax.grad(loss, argnums=(0, 1, 2))
        f = jax.jit(jax.shard_map(grads, mesh=self.mesh,
                                  in_specs=(P("tp", None), P(None, "tp"), P("tp", None), P("tp", None)),
                                  out_specs=(P("tp", None), P(None, "tp"), P("tp", None))))
        gx = self.place(xs[self.rank], 0, (t, d))
        g1 = self.place(w1[self.rank], 1, (d, self.world * f_local))
        g2 = self.place(w2[self.rank], 0, (self.world * f_local, d))
        gc = self.place(cs[self.rank], 0, (t, d))
        # Forward ag_gemm and gemm_rs; backward gemm_rs' dx an ag_gemm, ag_gemm's dx a gemm_rs: two
        # custom calls of each, and no XLA all-gather, reduce-scatter or all-reduce left.
        found = self.census(f, gx, g1, g2, gc)
        calls = found.select(custom_call=True).counts("owner")
        for op in ("ag_gemm", "gemm_rs"):
            if calls.get(op, 0) != 2:
                raise AssertionError(f"MLP gradients: {calls.get(op, 0)} entwine_{op} custom calls, expected 2")
        left = found.select(custom_call=False, kind=("all-gather", "reduce-scatter", "all-reduce"))
        if left:
            raise AssertionError(f"MLP gradients: the compiled program still has XLA collectives:\n{left.table()}")
        with jax.set_mesh(self.mesh):
            dx, dw1, dw2 = (self.local(o) for o in f(gx, g1, g2, gc))
        comm.check_errors()
        # float64 reference of d(sum over ranks of the loss).
        x = np.concatenate([a.astype(np.float64) for a in xs])
        c = np.concatenate([a.astype(np.float64) for a in cs])
        sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
        y = sum((lambda h: h / (1 + np.exp(-h)))(x @ w1[r].astype(np.float64)) @ w2[r].astype(np.float64)
                for r in range(self.world))
        dy = c + y  # d(sum(y c) + sum(y^2) / 2) / dy
        dx_ref = np.zeros_like(x)
        for r in range(self.world):
            h = x @ w1[r].astype(np.float64)
            da = dy @ w2[r].astype(np.float64).T
            dh = da * (sig(h) * (1 + h * (1 - sig(h))))
            if r == self.rank:
                a = h * sig(h)
                dw1_ref, dw2_ref = x.T @ dh, a.T @ dy
            dx_ref += dh @ w1[r].astype(np.float64).T
        rows = slice(self.rank * tl, (self.rank + 1) * tl)
        what = f"MLP T={t} D={d} F/W={f_local} {dtype.__name__}"
        return max(self.check(dx, dx_ref[rows], what + " dx"), self.check(dw1, dw1_ref, what + " dw1"),
                   self.check(dw2, dw2_ref, what + " dw2"))

    def mixed(self, calls=1000, batch=16):
        """Back-to-back calls of gemm_rs and ag_gemm (both layouts, both pushes) on one communicator:
        the two ops and the two pushes share its epochs, flags and inbox, so a wrong double-buffer
        argument would show as a wrong result."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from entwine_jax import comm

        w_ = self.world
        m, n, k = w_ * 256, 512, 256
        rs_sites, ag_sites = [], []
        for v in range(2):
            xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=1100 + v)
            rs_sites.append((self.gemm_fn(m, n, k, jnp.bfloat16), self.global_arrays(xs, ws), self.reference(xs, ws)))
            for gather_k in (False, True):
                xs, ws = self.ag_inputs(256, 192, 512, jnp.bfloat16, 1200 + v + 10 * gather_k, gather_k)
                call, _ = self.ag_fn(256, 192, 512, jnp.bfloat16, gather_k, push=("sm", "ce")[v])
                ag_sites.append((call, self.ag_globals(xs, ws, gather_k), self.ag_reference(xs, ws, gather_k)[0]))
        sites = [s for pair in zip(rs_sites + rs_sites, ag_sites) for s in pair]
        first, pending, checked = {}, [], 0
        t0 = time.monotonic()
        for i in range(calls):
            j = i % len(sites)
            call, (gx, gw), _ = sites[j]
            pending.append((j, i, call(gx, gw)))
            if len(pending) == batch or i == calls - 1:
                for j_, i_, y in pending:
                    y = self.local(y)
                    if j_ not in first:
                        self.check(y, sites[j_][2], f"mixed call {i_} (site {j_})")
                        first[j_] = y
                    elif not np.array_equal(y.view(np.uint16), first[j_].view(np.uint16)):
                        self.check(y, sites[j_][2], f"mixed call {i_} (site {j_})")
                        raise AssertionError(f"mixed call {i_} site {j_}: differs bitwise from its first call")
                    checked += 1
                pending.clear()
                comm.check_errors()
        jax.block_until_ready(first[0])
        return f"mixed: {checked} calls of both ops checked in {time.monotonic() - t0:.1f} s"
