"""gpu_ranks suites of the FP8 operands: `fp8kernels` (the FFI targets called directly), `fp8` (the
FP8 calls of both ops, the grouped op and the MLP with gradients), `fp8half` (the FP8 calls' fp16
backward piece by piece) and `fp8block` (block-scaled calls through the ops), against float64 of the
dequantised operands."""

from __future__ import annotations

from gpu_harness import Rank


def fp8_rounded(v, dtype=None):
    """float64 of v quantised to FP8 (default float8_e4m3fn) with its current scale and dequantised,
    as the ops do: scale = amax times the float32 reciprocal of the type's largest value, in f32."""
    import ml_dtypes
    import numpy as np

    dtype = dtype or ml_dtypes.float8_e4m3fn
    v = np.asarray(v, np.float64)
    top = float(ml_dtypes.finfo(dtype).max)
    s = np.float32(np.abs(v).max()) * np.float32(1.0 / top)
    return np.clip(v / s, -top, top).astype(dtype).astype(np.float64) * s


def rel_error(a, b) -> float:
    """|a - b| / |b| in float64 (Frobenius norms)."""
    import numpy as np

    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


class Fp8Suites(Rank):
    """The suites of the FP8 operands; the rank-side helpers they share are in gpu_harness.Rank."""

    def fp8kernels(self):
        """entwine_gemm_rs_fp8 and entwine_ag_gemm_fp8 on e4m3 operands with a scale per rank,
        against float64 of the dequantised operands (every rank builds all ranks' operands from one
        seed): gemm_rs over rows and columns into bf16 and fp16, ag_gemm's rows layout with
        per-shard scales (the gathered shards and scales returned) and its contraction layout with
        per-shard scales and with a shared one, each by the copy engines and by the SM push. Repeated
        calls bitwise equal."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np

        import entwine_jax
        from entwine_jax import _extension, comm
        from entwine_jax.ag_gemm.config import push_budget

        ext = _extension.ext()
        # every op's FP8 target the module names, and nothing else (a new FP8 op adds its own)
        named = {getattr(ext, a) for a in dir(ext) if a.endswith("_FP8_TARGET")}
        if set(ext.fp8_targets()) != named | {ext.GEMM_RS_FP8_TARGET, ext.AG_GEMM_FP8_TARGET}:
            raise AssertionError(f"fp8_targets() lists {ext.fp8_targets()}, the module names {sorted(named)}")
        w_, r = self.world, self.rank
        f8 = lambda a: a.astype(np.float64)
        scales = [(np.float32(0.5 + 0.125 * s), np.float32(0.25 * (1 + s % 3))) for s in range(w_)]
        worst, cases = 0.0, 0
        for out_dtype in (jnp.bfloat16, jnp.float16):
            for scatter_cols in (False, True):
                m, n, k = (256, w_ * 256, 1040) if scatter_cols else (w_ * 256, 384, 1040)
                rng = np.random.default_rng(1300 + cases)
                xs = [self.fp8_operand(rng, (m, k)) for _ in range(w_)]
                w_ts = [self.fp8_operand(rng, (n, k)) for _ in range(w_)]
                full = sum(float(scales[s][0] * scales[s][1]) * (f8(xs[s]) @ f8(w_ts[s]).T) for s in range(w_))
                part = full[:, r * n // w_:(r + 1) * n // w_] if scatter_cols else full[r * m // w_:(r + 1) * m // w_]
                config = dataclasses.replace(self.fused_config(m, n, k, out_dtype), block_n=128)
                plan = ext.gemm_rs_fp8_plan(m, n, k, w_, scatter_cols, 128, config.producer_sms, config.consumer_grid,
                                            config.consumer_block, config.raster_rows, config.split_tail)
                if plan["error"] or (plan["m"], plan["n"], plan["k"]) != (m, n, k):
                    raise AssertionError(f"fp8 gemm_rs plan of an aligned call: {plan}")
                cid = comm.acquire_comm(self.mesh, "tp", plan["tiles_per_partition"],
                                        {"gemm_rs.partial": plan["slot_bytes"]})
                what = f"gemm_rs fp8 -> {jnp.dtype(out_dtype).name} M={m} N={n} K={k} scatter={'cols' if scatter_cols else 'rows'}"
                signature = comm.call_signature(f"fp8kernels {what}")
                outs = [self.fp8_call(ext.GEMM_RS_FP8_TARGET, [jax.ShapeDtypeStruct(part.shape, out_dtype)],
                                      [xs[r], w_ts[r], np.array([scales[r][0]]), np.array([scales[r][1]])],
                                      comm_id=np.int64(cid), scatter_dimension=np.int64(int(scatter_cols)),
                                      signature=np.int64(signature), config=config.kernel_attributes())[0]
                        for _ in range(2)]
                comm.check_errors()
                worst = max(worst, self.check(outs[0], part, what))
                if not np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16)):
                    raise AssertionError(f"{what}: repeated calls differ bitwise")
                cases += 1
                self.log(f"{what}: ok")

        # Both layouts by both pushes: the SM push carries a per-shard scale in its slot too.
        for gather_k, shared, push_sms in ((False, False, 0), (False, False, -1), (True, False, 0), (True, False, -1),
                                           (True, True, 0), (True, True, -1)):
            rows, cols, n = 256, 512, 384
            rng = np.random.default_rng(1400 + int(gather_k))
            xs = [self.fp8_operand(rng, (rows, cols)) for _ in range(w_)]
            w_t = self.fp8_operand(rng, (n, w_ * cols if gather_k else cols))
            x_scales = [scales[0 if shared else s][0] for s in range(w_)]
            w_scale = scales[r][1]
            deq = [float(x_scales[s]) * f8(xs[s]) for s in range(w_)]
            if gather_k:
                ref = float(w_scale) * (np.concatenate(deq, axis=1) @ f8(w_t).T)
            else:
                ref = float(w_scale) * (np.concatenate(deq, axis=0) @ f8(w_t).T)
            config = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, w_, jnp.bfloat16), block_n=128)
            push_sms = push_budget(config) if push_sms < 0 else 0
            gemm_sms = _extension.sm_count() - max(push_sms, 1)
            plan = ext.ag_gemm_fp8_plan(rows, cols, n, w_, gather_k, 128, gemm_sms, config.raster_rows,
                                        config.max_chunks, push_sms, shared_scale=shared)
            if plan["error"]:
                raise AssertionError(f"fp8 ag plan: {plan['error']}")
            if w_ > 1 and (plan["push_grid"] > 0) != (push_sms > 0):
                raise AssertionError(f"fp8 ag plan: push_grid {plan['push_grid']} with push_sms {push_sms}")
            cid = comm.acquire_comm(self.mesh, "tp", plan["chunks"], {"ag_gemm.inbox": plan["inbox_bytes"]})
            what = (f"ag_gemm fp8 -> bf16 rows={rows} cols={cols} N={n} "
                    f"{'contraction' if gather_k else 'rows'}, {'shared scale' if shared else 'per-shard scales'} "
                    f"push={'sm' if push_sms else 'ce'}")
            signature = comm.call_signature(f"fp8kernels {what}")
            results = [jax.ShapeDtypeStruct(ref.shape, jnp.bfloat16),
                       jax.ShapeDtypeStruct((w_, rows, cols), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((w_,), jnp.float32)]
            outs = [self.fp8_call(ext.AG_GEMM_FP8_TARGET, results,
                                  [xs[r], w_t, np.array([x_scales[r]]), np.array([w_scale])],
                                  comm_id=np.int64(cid), gather_k=bool(gather_k), signature=np.int64(signature),
                                  config=config.kernel_attributes(gemm_sms, push_sms), shared_scale=bool(shared))
                    for _ in range(2)]
            comm.check_errors()
            y, gathered, gathered_scales = outs[0]
            worst = max(worst, self.check(y, ref, what))
            if not np.array_equal(y.view(np.uint16), outs[1][0].view(np.uint16)):
                raise AssertionError(f"{what}: repeated calls differ bitwise")
            if not np.array_equal(gathered.view(np.uint8), np.stack(xs).view(np.uint8)):
                raise AssertionError(f"{what}: the gathered shards differ from the ranks' shards")
            if not np.array_equal(gathered_scales, np.array(x_scales, np.float32)):
                raise AssertionError(f"{what}: gathered scales {gathered_scales}, expected {x_scales}")
            cases += 1
            self.log(f"{what}: ok")
        return f"fp8kernels: {cases} cases, worst rel err {worst:.2e}"

    def fp8_operand(self, rng, shape):
        """float8_e4m3fn values of a standard normal array (ml_dtypes, host)."""
        import ml_dtypes
        import numpy as np

        return rng.standard_normal(shape, np.float32).astype(ml_dtypes.float8_e4m3fn)

    def fp8_call(self, target, results, operands, **attributes):
        """jit(shard_map) of one FP8 FFI call: every operand is this rank's block of a global array
        stacked over ranks ([W, ...], one block each); returns this rank's results."""
        import jax
        import numpy as np
        from jax.sharding import PartitionSpec as P

        from entwine_jax import _ffi

        def body(*blocks):
            outs = _ffi.fused_call(target, results, *(b[0] for b in blocks), **attributes)
            return tuple(o[None] for o in outs)

        stacked = [self.place(np.asarray(a)[None], 0, (self.world, *np.shape(a))) for a in operands]
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("tp"),) * len(operands),
                                  out_specs=(P("tp"),) * len(results), check_vma=False))
        with jax.set_mesh(self.mesh):
            return [self.local(o)[0] for o in f(*stacked)]

    def fp8(self):
        import jax.numpy as jnp

        from entwine_jax import _extension

        if not _extension.fp8_targets():
            raise RuntimeError("the extension registers no FP8 targets (FP8 kernels not built)")
        w_ = self.world
        worst, cases = 0.0, 0
        for out_dtype in (jnp.bfloat16, jnp.float16):
            for columns in (False, True):
                # N divides by W for the columns layout, M for the rows.
                for i, (m, n, k) in enumerate([(w_ * 128, w_ * 128, 64), (w_ * 77, w_ * 65, 60),
                                               (w_ * 512, w_ * 1024, 1024)]):
                    worst = max(worst, self.fp8_gemm_rs_case(m, n, k, out_dtype, columns, seed=1100 + i))
                    cases += 1
                    self.log(f"fp8 gemm_rs M={m} N={n} K={k} columns={columns} {jnp.dtype(out_dtype).name}: ok")
        for gather_k in (False, True):
            for shared in (False, True):
                for i, (rows, cols, n) in enumerate([(128, 64, 256), (77, 60, 130), (1024, 512, 2048)]):
                    what = f"fp8 ag_gemm rows={rows} cols={cols} N={n} gather_k={gather_k} shared={shared}"
                    worst = max(worst, self.fp8_ag_case(rows, cols, n, gather_k, shared, seed=1200 + i))
                    cases += 1
                    self.log(f"{what}: ok")
        # Both backward recipes, each on the kernels.
        failures = []
        try:
            worst = max(worst, self.fp8_then_half())
            self.log("fp8: an FP8 ag_gemm, then an fp16 one with its gathered operand: ok")
        except AssertionError as e:
            failures.append(str(e))
        # The group read in place (widths of whole 128-wide blocks), and joined (a width that is not).
        for widths, in_place in (((1024, 128, 128), True), ((256, 96, 32), False)):
            try:
                worst = max(worst, self.fp8_grouped_grads(widths=widths, in_place=in_place))
            except AssertionError as e:
                failures.append(str(e))
        for grad_dtype in ("float16", "float8_e5m2"):
            try:
                worst = max(worst, self.fp8_mlp_grads(w_ * 256, 512, 384, seed=1300, grad_dtype=grad_dtype))
            except AssertionError as e:
                failures.append(str(e))
        if failures:
            raise AssertionError("; ".join(failures))
        self.log("fp8: MLP FP8 forward, fp16 and e5m2 backward, every call fused: ok")
        return f"fp8: {cases} cases + MLP gradients ok, worst rel error {worst:.2e}"

    def fp8_shards(self, shape, seed, scale_spread):
        """Every rank's e4m3 shard of `shape` and float32 scale (ranks' scales scale_spread apart), as
        float64 dequantised values too."""
        import ml_dtypes
        import numpy as np

        rng = np.random.default_rng(seed)
        scales = (rng.uniform(1.0, scale_spread, self.world) / 448).astype(np.float32)
        shards = [np.clip(rng.standard_normal(shape, np.float32) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
                  for _ in range(self.world)]
        return shards, scales, [a.astype(np.float64) * float(s) for a, s in zip(shards, scales)]

    def fp8_ready(self, op, reason):
        if reason is not None:
            raise RuntimeError(f"FP8 {op} cannot take the fused path: {reason}")

    def fp8_gemm_rs_case(self, m, n, k, out_dtype, columns, seed):
        """gemm_rs FP8 on x [M, K] (this rank's K slice) and w [K, N], each rank's own x_scale and w_scale,
        scattered over rows or columns; against sum over ranks of the dequantised products."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm
        from entwine_jax.gemm_rs import fused as rs_fused

        xs, x_scales, xd = self.fp8_shards((m, k), seed, 8.0)
        ws, w_scales, wd = self.fp8_shards((k, n), seed + 1, 8.0)
        sd = 1 if columns else 0
        config = dataclasses.replace(entwine_jax.heuristic_config(m, n, k, self.world, jnp.float8_e4m3fn,
                                                                  scatter_cols=columns), path="fused")
        with jax.set_mesh(self.mesh):
            self.fp8_ready("gemm_rs", rs_fused.unavailable_reason(
                jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
                axis_name="tp", axis_size=self.world, scatter_dimension=sd, config=config, out_dtype=out_dtype))
        body = lambda x, w, a, b: entwine_jax.gemm_rs(x, w, axis_name="tp", scatter_dimension=sd, config=config,
                                                      x_scale=a, w_scale=b, out_dtype=out_dtype)
        out = P(None, "tp") if columns else P("tp", None)
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, "tp"), P("tp", None), P("tp"), P("tp")),
                                  out_specs=out))
        args = (self.place(xs[self.rank], 1, (m, self.world * k)), self.place(ws[self.rank], 0, (self.world * k, n)),
                self.place(x_scales[self.rank:self.rank + 1], 0, (self.world,)),
                self.place(w_scales[self.rank:self.rank + 1], 0, (self.world,)))
        if not self.fused_calls(f, *args).get("gemm_rs"):
            raise AssertionError("FP8 gemm_rs did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            ys = [self.local(f(*args)) for _ in range(2)]
        comm.check_errors()
        full = sum(x @ w for x, w in zip(xd, wd))
        ref = (full[:, self.rank * n // self.world:(self.rank + 1) * n // self.world] if columns
               else full[self.rank * m // self.world:(self.rank + 1) * m // self.world])
        what = f"FP8 gemm_rs M={m} N={n} K={k} {'columns' if columns else 'rows'} -> {jnp.dtype(out_dtype).name}"
        if ys[0].dtype != jnp.dtype(out_dtype) or not np.array_equal(ys[0].view(np.uint16), ys[1].view(np.uint16)):
            raise AssertionError(f"{what}: dtype {ys[0].dtype}, or repeated calls differ bitwise")
        return self.check(ys[0], ref, what)

    def fp8_ag_case(self, rows, cols, n, gather_k, shared, seed):
        """ag_gemm FP8 on this rank's shard [rows, cols] with its own x_scale (or one shared by all), w
        sharded over N; y and the gathered FP8 operand against the dequantised shards."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm
        from entwine_jax.ag_gemm import fused as ag_fused

        xs, x_scales, _ = self.fp8_shards((rows, cols), seed, 8.0)
        if shared:
            x_scales = np.full_like(x_scales, x_scales[0])
        k = self.world * cols if gather_k else cols
        ws, w_scales, _ = self.fp8_shards((k, n), seed + 1, 1.0)  # one w_scale on every rank
        config = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, self.world, jnp.float8_e4m3fn),
                                     path="fused")
        with jax.set_mesh(self.mesh):
            reason = ag_fused.unavailable_reason(
                jax.ShapeDtypeStruct((rows, cols), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
                axis_name="tp", axis_size=self.world, gather_k=gather_k, config=config, out_dtype=jnp.bfloat16,
                shared_scale=shared)
        self.fp8_ready("ag_gemm", reason)
        gd = -1 if gather_k else 0
        body = lambda x, w, a, b: entwine_jax.ag_gemm(x, w, axis_name="tp", gather_dimension=gd, config=config,
                                                      x_scale=a, w_scale=b, return_gathered=True)
        x_spec = P(None, "tp") if gather_k else P("tp", None)
        # A replicated x_scale (P()) is a shared one: shard_map's types say every rank holds the same.
        s_spec = P() if shared else P("tp")
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(x_spec, P(None, "tp"), s_spec, P()),
                                  out_specs=(P(None, "tp"), P("tp"))))
        x_shape = (rows, self.world * cols) if gather_k else (self.world * rows, cols)
        scale_arg = (self.replicated(x_scales[0]) if shared
                     else self.place(x_scales[self.rank:self.rank + 1], 0, (self.world,)))
        args = (self.place(xs[self.rank], 1 if gather_k else 0, x_shape),
                self.place(ws[self.rank], 1, (k, self.world * n)), scale_arg,
                self.replicated(w_scales[0]))
        if not self.fused_calls(f, *args).get("ag_gemm"):
            raise AssertionError("FP8 ag_gemm did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            outs = [f(*args) for _ in range(2)]
        comm.check_errors()
        axis = 1 if gather_k else 0
        g_ref = np.concatenate([x.astype(np.float64) * float(s) for x, s in zip(xs, x_scales)], axis=axis)
        ref = g_ref @ (ws[self.rank].astype(np.float64) * float(w_scales[0]))
        what = (f"FP8 ag_gemm rows={rows} cols={cols} N={n} {'contraction' if gather_k else 'rows'} "
                f"{'shared' if shared else 'per-shard'} scale")
        ys = [self.local(o[0]) for o in outs]
        if not np.array_equal(ys[0].view(np.uint16), ys[1].view(np.uint16)):
            raise AssertionError(f"{what}: repeated calls differ bitwise")
        g = self.local(outs[0][1])
        if not np.array_equal(g.astype(np.float64), np.concatenate([x.astype(np.float64) for x in xs], axis=axis)):
            raise AssertionError(f"{what}: the gathered FP8 operand differs from the shards")
        return self.check(ys[0], ref, what)

    def fp8_mlp_grads(self, t, d, f_local, seed, grad_dtype="float16"):
        """x [T/W, D] (fp16) -> ag_gemm FP8 -> silu -> gemm_rs FP8 -> [T/W, D], current scaling of every
        operand; loss = sum(y c). grad_dtype float16: the backward on the fp16 kernels, on the
        dequantised FP8 operands; float8_e5m2 (the hybrid recipe): each backward call's cotangent
        quantised to e5m2 with its rank's current scale, on the e5m2 x e4m3 kernels. Gradients against float64 of the same recipe: the forward on the
        dequantised operands, the backward straight through the quantisation, the cotangents quantised
        where the recipe quantises them. (fp16, not bf16: the recipe rounds to the half dtype five times
        on the way to dx, which in bf16 alone reaches the 1e-2 bound.) The e5m2 bound is 3e-2: a
        cotangent the device rounds to fp16 on the other side of an e5m2 step than float64 does (about
        one element in 2^8) moves that element by a whole step (up to 25%)."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import ml_dtypes
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        rng = np.random.default_rng(seed)
        tl = t // self.world
        half = jnp.float16
        e5m2 = grad_dtype == "float8_e5m2"
        gdt = jnp.float8_e5m2 if e5m2 else half
        xs = [rng.standard_normal((tl, d), np.float32).astype(half) for _ in range(self.world)]
        w1 = [(rng.standard_normal((d, f_local), np.float32) / np.sqrt(d)).astype(half) for _ in range(self.world)]
        w2 = [(rng.standard_normal((f_local, d), np.float32) / np.sqrt(f_local * self.world)).astype(half)
              for _ in range(self.world)]
        cs = [rng.standard_normal((tl, d), np.float32).astype(half) for _ in range(self.world)]
        up = dataclasses.replace(entwine_jax.ag_heuristic_config(tl, f_local, d, self.world, half), block_n=128,
                                 path="fused")
        # FP8 operands take 128-wide blocks only (the plan's rule); the fp16 heuristic may pick 256.
        down = dataclasses.replace(entwine_jax.heuristic_config(t, d, f_local, self.world, half), block_n=128,
                                   path="fused")

        def loss(x, w1_, w2_, c):
            h = entwine_jax.ag_gemm(x, w1_, axis_name="tp", config=up, x_scale=fp8.current_scale(x),
                                    w_scale=fp8.current_scale(w1_), grad_dtype=gdt)
            a = jax.nn.silu(h.astype(jnp.float32)).astype(half)
            y = entwine_jax.gemm_rs(a, w2_, axis_name="tp", config=down, x_scale=fp8.current_scale(a),
                                    w_scale=fp8.current_scale(w2_), grad_dtype=gdt)
            return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)), h

        # h (the FP8 forward's output) comes back too: a wrong gradient then says which call it came from.
        grads = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
        f = jax.jit(jax.shard_map(grads, mesh=self.mesh,
                                  in_specs=(P("tp", None), P(None, "tp"), P("tp", None), P("tp", None)),
                                  out_specs=((P("tp", None), P(None, "tp"), P("tp", None)), P(None, "tp"))))
        args = (self.place(xs[self.rank], 0, (t, d)), self.place(w1[self.rank], 1, (d, self.world * f_local)),
                self.place(w2[self.rank], 0, (self.world * f_local, d)), self.place(cs[self.rank], 0, (t, d)))
        calls = self.fused_calls(f, *args)
        # The loss is linear in y, so its gradient never needs y: the forward gemm_rs is dead code under
        # jax.grad. What runs fused: ag_gemm forward (FP8), gemm_rs's backward ag_gemm and ag_gemm's
        # backward gemm_rs (in either recipe).
        want = (2, 1)
        if (calls.get("ag_gemm", 0), calls.get("gemm_rs", 0)) != want:
            raise AssertionError(f"FP8 MLP gradients ({grad_dtype}): fused calls {calls}, expected {want[0]} "
                                 f"ag_gemm and {want[1]} gemm_rs")
        with jax.set_mesh(self.mesh):
            (dx, dw1, dw2), h_out = jax.tree.map(self.local, f(*args))
        comm.check_errors()

        deq = fp8_rounded

        # float64 of every rank's part (the inputs of all ranks come from the shared seed): each x shard
        # quantised with its own scale; the gradient passes straight through the quantisation; the
        # backward's GEMMs use the dequantised weights; e5m2: each rank's cotangent quantised with its scale.
        sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
        rounded = lambda v: v.astype(half).astype(np.float64)  # noqa: E731  (where the device writes fp16)
        cot = (lambda v: deq(v, ml_dtypes.float8_e5m2)) if e5m2 else (lambda v: v)  # noqa: E731
        x_all = np.concatenate([deq(x) for x in xs])
        c_all = np.concatenate([cot(c.astype(np.float64)) for c in cs])
        dx_ref = np.zeros_like(x_all)
        for r in range(self.world):
            h = rounded(x_all @ deq(w1[r]))
            a = rounded(h * sig(h))
            w2_back = deq(w2[r]) if e5m2 else rounded(deq(w2[r]))  # e5m2: the e4m3 weight as it is
            w1_back = deq(w1[r]) if e5m2 else rounded(deq(w1[r]))
            dh = rounded(c_all @ w2_back.T) * (sig(h) * (1 + h * (1 - sig(h))))
            dh = cot(rounded(dh)) if e5m2 else dh
            dx_ref += dh @ w1_back.T
            if r == self.rank:
                h_ref, dw1_ref, dw2_ref = h, x_all.T @ dh, deq(a).T @ c_all
        rows = slice(self.rank * tl, (self.rank + 1) * tl)
        # Every error at once, from the forward's h to dx: which are wrong locates the fault.
        bound = 3e-2 if e5m2 else 1e-2
        errors = {}
        for name, out, ref in (("h", h_out, h_ref), ("dw2", dw2, dw2_ref), ("dw1", dw1, dw1_ref),
                               ("dx", dx, dx_ref[rows])):
            out = np.asarray(out, np.float64)
            errors[name] = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
        if not all(e <= bound for e in errors.values()):
            raise AssertionError(f"FP8 MLP T={t} D={d} F/W={f_local} grad_dtype={grad_dtype}: rel errors " +
                                 ", ".join(f"{k} {v:.3g}" for k, v in errors.items()) + f" (bound {bound:g})")
        self.log(f"FP8 MLP grad_dtype={grad_dtype}: rel errors " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        return max(errors.values())

    def fp8_grouped_grads(self, rows=256, cols=512, widths=(512, 128, 128), seed=1380, in_place=True):
        """The grouped FP8 ag_gemm (one gather of x for q/k/v-like weights of unequal widths, rows
        layout, each rank's own x scale, one scale for the group's weights) with its fp16 backward:
        ys and the gradients of sum_i sum(y_i c_i) against float64 of the recipe. One fused FP8
        ag_gemm forward (the G weights' w_t where they lie if in_place, else one joined operand), one
        fused fp16 gemm_rs backward. Returns the worst rel error."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        w_, r, half = self.world, self.rank, jnp.float16
        rng = np.random.default_rng(seed)
        groups = len(widths)
        xs = [rng.standard_normal((rows, cols), np.float32).astype(half) for _ in range(w_)]
        ws = [[(rng.standard_normal((cols, n), np.float32) / np.sqrt(cols)).astype(half) for n in widths]
              for _ in range(w_)]
        cs = [[rng.standard_normal((w_ * rows, n), np.float32).astype(half) for n in widths] for _ in range(w_)]
        config = entwine_jax.AgGemmConfig(block_n=128, path="fused")

        def values_and_grads(x, *wc):
            w, c = wc[:groups], wc[groups:]

            def loss(x, *w):
                ws_scale = fp8.current_scale(jnp.concatenate(w, axis=1))
                ys = entwine_jax.ag_gemm(x, w, axis_name="tp", config=config, x_scale=fp8.current_scale(x),
                                         w_scale=ws_scale, grad_dtype=half)
                return sum(jnp.sum(y.astype(jnp.float32) * ci.astype(jnp.float32)) for y, ci in zip(ys, c)), ys
            (_, ys), grads = jax.value_and_grad(loss, argnums=tuple(range(groups + 1)), has_aux=True)(x, *w)
            return ys, grads

        f = jax.jit(jax.shard_map(values_and_grads, mesh=self.mesh,
                                  in_specs=(P("tp", None),) + (P(None, "tp"),) * (2 * groups),
                                  out_specs=((P(None, "tp"),) * groups, (P("tp", None),) + (P(None, "tp"),) * groups)))
        args = [self.place(xs[r], 0, (w_ * rows, cols))]
        args += [self.place(w, 1, (cols, w_ * w.shape[1])) for w in ws[r]]
        args += [self.place(c, 1, (w_ * rows, w_ * c.shape[1])) for c in cs[r]]
        calls = self.fused_calls(f, *args)
        if (calls.get("ag_gemm", 0), calls.get("gemm_rs", 0)) != (1, 1):
            raise AssertionError(f"grouped FP8: fused calls {calls}, expected one ag_gemm and one gemm_rs")
        if self.ag_gemm_weights(f, *args) != [groups if in_place else 1]:
            raise AssertionError(f"grouped FP8 widths={widths}: the ag_gemm call takes "
                                 f"{self.ag_gemm_weights(f, *args)} weight operands, expected "
                                 f"{groups if in_place else 1}")
        with jax.set_mesh(self.mesh):
            ys, grads = f(*args)
        comm.check_errors()

        deq = fp8_rounded

        def deq_group(group):  # one scale for the group's weights
            return np.split(deq(np.concatenate(group, axis=1)), np.cumsum(widths)[:-1], axis=1)

        rounded = lambda v: v.astype(half).astype(np.float64)  # noqa: E731
        g = np.concatenate([deq(x) for x in xs])
        mine = deq_group(ws[r])
        errors = {}
        for i in range(groups):
            errors[f"y{i}"] = rel_error(self.local(ys[i]), g @ mine[i])
            errors[f"dw{i}"] = rel_error(self.local(grads[1 + i]), g.T @ cs[r][i].astype(np.float64))
        dg = sum(cs[q][i].astype(np.float64) @ rounded(deq_group(ws[q])[i]).T for q in range(w_) for i in range(groups))
        errors["dx"] = rel_error(self.local(grads[0]), dg[r * rows:(r + 1) * rows])
        self.log(f"grouped FP8 ag_gemm widths={widths} ({'in place' if in_place else 'joined'}), fp16 backward: rel "
                 "errors " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        if max(errors.values()) > 1e-2:
            raise AssertionError("grouped FP8 ag_gemm: rel errors " + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))
        return max(errors.values())

    def fp8_then_half(self, rows=256, cols=512, n=384, seed=1350):
        """An FP8 ag_gemm (per-shard scales) and then an fp16 ag_gemm returning its gathered operand, in one
        program on one communicator (the FP8 MLP's forward and its gemm_rs's fp16 backward): both
        against float64. Returns the worst relative error."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax

        half = jnp.float16
        xs, x_scales, x_deq = self.fp8_shards((rows, cols), seed, 8.0)
        ws, w_scales, _ = self.fp8_shards((cols, n), seed + 1, 1.0)
        rng = np.random.default_rng(seed + 2)
        hs = [rng.standard_normal((rows, cols), np.float32).astype(half) for _ in range(self.world)]
        vs = [(rng.standard_normal((cols, n), np.float32) / np.sqrt(cols)).astype(half) for _ in range(self.world)]
        c8 = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, self.world, jnp.float8_e4m3fn),
                                 path="fused")
        c16 = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, self.world, half), path="fused")

        def body(x, w, a, b, h, v):
            y8 = entwine_jax.ag_gemm(x, w, axis_name="tp", config=c8, x_scale=a, w_scale=b)
            y16, g16 = entwine_jax.ag_gemm(h, v, axis_name="tp", config=c16, return_gathered=True)
            return y8, y16, g16

        f = jax.jit(jax.shard_map(body, mesh=self.mesh,
                                  in_specs=(P("tp", None), P(None, "tp"), P("tp"), P(), P("tp", None), P(None, "tp")),
                                  out_specs=(P(None, "tp"), P(None, "tp"), P("tp", None))))
        r = self.rank
        args = (self.place(xs[r], 0, (self.world * rows, cols)), self.place(ws[r], 1, (cols, self.world * n)),
                self.place(x_scales[r:r + 1], 0, (self.world,)), self.replicated(w_scales[0]),
                self.place(hs[r], 0, (self.world * rows, cols)), self.place(vs[r], 1, (cols, self.world * n)))
        calls = self.fused_calls(f, *args)
        if calls.get("ag_gemm", 0) != 2:
            raise AssertionError(f"FP8 then fp16 ag_gemm: fused calls {calls}, expected 2 ag_gemm")
        with jax.set_mesh(self.mesh):
            y8, y16, g16 = (self.local(o) for o in f(*args))
        h_all = np.concatenate([h.astype(np.float64) for h in hs])
        errors = {"fp8 y": np.concatenate(x_deq) @ (ws[r].astype(np.float64) * float(w_scales[0])),
                  "fp16 y": h_all @ vs[r].astype(np.float64), "fp16 gathered": h_all}
        outs = {"fp8 y": y8, "fp16 y": y16, "fp16 gathered": g16}
        for name, ref in list(errors.items()):
            out = np.asarray(outs[name], np.float64)
            errors[name] = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        if not all(e <= 1e-2 for e in errors.values()):
            raise AssertionError("FP8 then fp16 ag_gemm on one communicator: rel errors " +
                                 ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))
        return max(errors.values())

    def fp8half(self):
        """The FP8 calls' fp16 backward piece by piece: the fp16 ops alone at the MLP's backward shapes
        and configs, each FP8 op's fp16 backward alone (against the recipe, which rounds operands to
        FP8, and against the unrounded operands: XLA folding the rounding away shows as 2.6% from the
        recipe and agreement with the unrounded), then the FP8 MLP with it. Reports every error; fails
        where one against the recipe exceeds 1e-2."""
        import dataclasses

        import jax.numpy as jnp

        from entwine_jax.ag_gemm import op as ag_op
        from entwine_jax.gemm_rs import op as rs_op

        w_, half = self.world, jnp.float16
        t, d, f_local = w_ * 256, 512, 384
        tl = t // w_
        errors = {}
        # The configs the backward takes (the e5m2 rule applied to fp16 operands), and 128-wide blocks.
        ag_default, _ = ag_op.default_config(jnp.zeros((tl, d), half), jnp.zeros((d, f_local), half), w_, 0)
        rs_default, _ = rs_op.default_config(jnp.zeros((t, f_local), half), jnp.zeros((f_local, d), half), w_, 0)
        self.log(f"fp8half: backward configs ag {ag_default}, rs {rs_default}")
        for name, cfg in (("default", ag_default), ("block128", dataclasses.replace(ag_default, block_n=128))):
            for push in ("sm", "ce"):
                c = dataclasses.replace(cfg, path="fused", push=push)
                e_y, e_g = self.half_ag_case(tl, d, f_local, c, seed=1370)
                errors[f"fp16 ag_gemm {name} {push} y"] = e_y
                errors[f"fp16 ag_gemm {name} {push} gathered"] = e_g
        for name, cfg in (("default", rs_default), ("block128", dataclasses.replace(rs_default, block_n=128))):
            errors[f"fp16 gemm_rs {name}"] = self.half_rs_case(t, d, f_local, dataclasses.replace(cfg, path="fused"),
                                                               seed=1371)
        errors.update(self.fp8_half_backward(t, d, f_local))
        try:
            errors["mlp worst"] = self.fp8_mlp_grads(t, d, f_local, seed=1300, grad_dtype="float16")
        except AssertionError as e:
            self.log(f"fp8half: MLP: {e}")
            errors["mlp worst"] = float("inf")
        for k, v in errors.items():
            self.log(f"fp8half: {k}: {v:.3e}")
        bad = {k: v for k, v in errors.items() if not v <= 1e-2 and "unrounded" not in k}
        if bad:
            raise AssertionError("fp8half: " + ", ".join(f"{k} {v:.2e}" for k, v in bad.items()))
        return f"fp8half: {len(errors)} checks, worst {max(errors.values()):.2e}"

    def fp8_half_backward(self, t=512, d=512, f_local=384, seed=1360):
        """Each FP8 op's fp16 backward alone (jax.vjp with a given cotangent), on the kernels: gemm_rs's (an fp16 ag_gemm returning the gathered
        dy, dw from it) and ag_gemm's (an fp16 gemm_rs, dw from the gathered FP8 x); against float64
        of the dequantised operands. Returns {name: rel error}."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        w_, r, half = self.world, self.rank, jnp.float16
        tl = t // w_
        rng = np.random.default_rng(seed)
        a_s = [rng.standard_normal((t, f_local), np.float32).astype(half) for _ in range(w_)]  # gemm_rs x
        w2 = [(rng.standard_normal((f_local, d), np.float32) / np.sqrt(f_local * w_)).astype(half) for _ in range(w_)]
        cs = [rng.standard_normal((tl, d), np.float32).astype(half) for _ in range(w_)]  # gemm_rs dy
        xs = [rng.standard_normal((tl, d), np.float32).astype(half) for _ in range(w_)]  # ag_gemm x
        w1 = [(rng.standard_normal((d, f_local), np.float32) / np.sqrt(d)).astype(half) for _ in range(w_)]
        dhs = [rng.standard_normal((t, f_local), np.float32).astype(half) for _ in range(w_)]  # ag_gemm dy
        up = dataclasses.replace(entwine_jax.ag_heuristic_config(tl, f_local, d, w_, half), block_n=128, path="fused")
        down = dataclasses.replace(entwine_jax.heuristic_config(t, d, f_local, w_, half), block_n=128, path="fused")
        cur = fp8.current_scale

        def rs_bwd(a, w, c):
            _, vjp = jax.vjp(lambda a_, w__: entwine_jax.gemm_rs(a_, w__, axis_name="tp", config=down,
                                                                  x_scale=cur(a_), w_scale=cur(w__), grad_dtype=half),
                             a, w)
            return vjp(c)

        def ag_bwd(x, w, dh):
            _, vjp = jax.vjp(lambda x_, w__: entwine_jax.ag_gemm(x_, w__, axis_name="tp", config=up,
                                                                  x_scale=cur(x_), w_scale=cur(w__), grad_dtype=half),
                             x, w)
            return vjp(dh)

        f_rs = jax.jit(jax.shard_map(rs_bwd, mesh=self.mesh, in_specs=(P(None, "tp"), P("tp", None), P("tp", None)),
                                     out_specs=(P(None, "tp"), P("tp", None))))
        f_ag = jax.jit(jax.shard_map(ag_bwd, mesh=self.mesh, in_specs=(P("tp", None), P(None, "tp"), P(None, "tp")),
                                     out_specs=(P("tp", None), P(None, "tp"))))
        with jax.set_mesh(self.mesh):
            da, dw2 = (self.local(o) for o in f_rs(self.place(a_s[r], 1, (t, w_ * f_local)),
                                                   self.place(w2[r], 0, (w_ * f_local, d)),
                                                   self.place(cs[r], 0, (t, d))))
            dx, dw1 = (self.local(o) for o in f_ag(self.place(xs[r], 0, (t, d)),
                                                   self.place(w1[r], 1, (d, w_ * f_local)),
                                                   self.place(dhs[r], 1, (t, w_ * f_local))))
        comm.check_errors()

        deq = fp8_rounded

        rounded = lambda v: v.astype(half).astype(np.float64)  # noqa: E731
        c_all = np.concatenate([c.astype(np.float64) for c in cs])
        x_all = np.concatenate([deq(x) for x in xs])
        dh_r = dhs[r].astype(np.float64)
        refs = {"gemm_rs bwd da": c_all @ rounded(deq(w2[r])).T,
                "gemm_rs bwd dw": deq(a_s[r]).T @ c_all,
                "ag_gemm bwd dx": sum(dhs[q].astype(np.float64) @ rounded(deq(w1[q])).T for q in range(w_))[
                    r * tl:(r + 1) * tl],
                "ag_gemm bwd dw": x_all.T @ dh_r}
        plain = lambda v: v.astype(np.float64)  # noqa: E731
        x_plain = np.concatenate([plain(x) for x in xs])
        refs.update({"gemm_rs bwd da unrounded": c_all @ plain(w2[r]).T, "gemm_rs bwd dw unrounded": plain(a_s[r]).T @ c_all,
                     "ag_gemm bwd dx unrounded": sum(plain(dhs[q]) @ plain(w1[q]).T for q in range(w_))[
                         r * tl:(r + 1) * tl],
                     "ag_gemm bwd dw unrounded": x_plain.T @ dh_r})
        outs = {"gemm_rs bwd da": da, "gemm_rs bwd dw": dw2, "ag_gemm bwd dx": dx, "ag_gemm bwd dw": dw1}
        return {k: rel_error(outs[k.replace(" unrounded", "")], v) for k, v in refs.items()}

    def half_ag_case(self, rows, cols, n, config, seed):
        """fp16 ag_gemm rows layout with the gathered operand returned: (rel error of y, of gathered)."""
        import jax.numpy as jnp

        xs, ws = self.ag_inputs(rows, cols, n, jnp.float16, seed, False)
        call, _ = self.ag_fn(rows, cols, n, jnp.float16, False, return_gathered=True, config=config)
        y, g = (self.local(o) for o in call(*self.ag_globals(xs, ws, False)))
        ref, g_ref = self.ag_reference(xs, ws, False)
        return rel_error(y, ref), rel_error(g, g_ref)

    def half_rs_case(self, m, n, k, config, seed):
        """fp16 gemm_rs scattering rows: rel error of this rank's block."""
        import jax.numpy as jnp

        xs, ws = self.host_inputs(m, n, k, jnp.float16, seed)
        y = self.local(self.gemm_fn(m, n, k, jnp.float16, config=config)(*self.global_arrays(xs, ws)))
        ref = self.reference(xs, ws)
        return rel_error(y, ref)


class Fp8BlockSuites(Fp8Suites):
    """The block-scaled FP8 suite (1x128 tiles of x, 128x128 blocks of w), through the Python ops."""

    def fp8block(self):
        """Block-scaled FP8 through the ops on the kernels: gemm_rs over rows and columns, ag_gemm's rows
        and contraction layouts, and the gradients of a block-scaled gemm_rs (its backward an ag_gemm),
        against float64 of the dequantised operands (the per-block formula); every call must lower to
        the fused FP8 call. A build without the block-scaled kernels fails the suite (this project's
        build has them; a reference run would pass without checking a kernel)."""
        from entwine_jax.ag_gemm import plan as ag_plan
        from entwine_jax.gemm_rs import plan as rs_plan

        w_ = self.world
        for op, reason in (("gemm_rs", rs_plan.fp8_block_reason()), ("ag_gemm", ag_plan.fp8_block_reason())):
            if reason is not None:
                raise AssertionError(f"fp8block: {op}'s block-scaled kernels are not usable: {reason}")
        worst, cases = 0.0, 0
        for columns in (False, True):
            m, n, k = (256, w_ * 256, 512) if columns else (w_ * 256, 384, 512)
            worst = max(worst, self.block_gemm_rs_case(m, n, k, columns, seed=1500 + cases))
            cases += 1
        for gather_k in (False, True):
            worst = max(worst, self.block_ag_case(200, 256, 384, gather_k, seed=1510 + cases))
            cases += 1
        worst = max(worst, self.block_gemm_rs_grads(w_ * 128, 384, 256, seed=1520))
        cases += 1
        return f"fp8block: {cases} cases ok, worst rel error {worst:.2e}"

    def block_operands(self, shape, seed, quantise):
        """Every rank's operand of `shape` (rows of magnitudes 1e-2 to 10, which one scale per tensor
        would not serve) quantised with its current block scales (quantise: fp8.quantize_1x128 or
        fp8.quantize_128x128): [(FP8 array, scales, float64 of the dequantised values)] by rank."""
        import jax.numpy as jnp
        import numpy as np

        from entwine_jax import fp8

        rng = np.random.default_rng(seed)
        out = []
        for _ in range(self.world):
            v = rng.standard_normal(shape).astype(np.float32) * np.logspace(-2, 1, shape[0], dtype=np.float32)[:, None]
            q, s = quantise(jnp.asarray(v))
            out.append((q, s, np.asarray(fp8.dequantize(q, s), np.float64)))
        return out

    def block_call(self, op, fn, args, what):
        """jit(fn)'s result on this rank (fn: a shard_map), refused unless `op` lowers to its fused call."""
        import jax

        f = jax.jit(fn)
        if not self.fused_calls(f, *args).get(op):
            raise AssertionError(f"{what}: did not lower to the fused call")
        with jax.set_mesh(self.mesh):
            return f(*args)

    def block_gemm_rs_case(self, m, n, k, columns, seed):
        """gemm_rs on every rank's x [M, K] and w [K, N] (the rank's K slices) with their block scales."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        r, w_ = self.rank, self.world
        xs = self.block_operands((m, k), seed, fp8.quantize_1x128)
        ws = self.block_operands((k, n), seed + 1, fp8.quantize_128x128)
        config = dataclasses.replace(entwine_jax.heuristic_config(m, n, k, w_, jnp.float8_e4m3fn, scatter_cols=columns),
                                     path="fused")
        sd = 1 if columns else 0

        def body(x, w, a, b):
            return entwine_jax.gemm_rs(x, w, axis_name="tp", scatter_dimension=sd, x_scale=a, w_scale=b, config=config)

        out = P(None, "tp") if columns else P("tp", None)
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, "tp"), P("tp", None), P(None, "tp"), P("tp", None)),
                           out_specs=out)
        (x8, xs_r, _), (w8, ws_r, _) = xs[r], ws[r]
        args = (self.place(x8, 1, (m, w_ * k)), self.place(w8, 0, (w_ * k, n)),
                self.place(xs_r, 1, (m, w_ * xs_r.shape[1])), self.place(ws_r, 0, (w_ * ws_r.shape[0], ws_r.shape[1])))
        what = f"block-scaled gemm_rs M={m} N={n} K={k} {'columns' if columns else 'rows'}"
        y = self.local(self.block_call("gemm_rs", fn, args, what))
        comm.check_errors()
        full = sum(x[2] @ w[2] for x, w in zip(xs, ws))
        ref = full[:, r * n // w_:(r + 1) * n // w_] if columns else full[r * m // w_:(r + 1) * m // w_]
        self.log(f"{what}: ok")
        return self.check(y, ref, what)

    def block_ag_case(self, rows, cols, n, gather_k, seed):
        """ag_gemm on every rank's shard [rows, cols] with its tile scales, w [K, N] sharded over N (each
        rank's slice with its block scales); y and the gathered FP8 operand."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        r, w_ = self.rank, self.world
        k = w_ * cols if gather_k else cols
        xs = self.block_operands((rows, cols), seed, fp8.quantize_1x128)
        ws = self.block_operands((k, n), seed + 1, fp8.quantize_128x128)
        config = dataclasses.replace(entwine_jax.ag_heuristic_config(rows, n, cols, w_, jnp.float8_e4m3fn), path="fused")
        gd = -1 if gather_k else 0
        x_spec = P(None, "tp") if gather_k else P("tp", None)

        def body(x, w, a, b):
            y, g = entwine_jax.ag_gemm(x, w, axis_name="tp", gather_dimension=gd, x_scale=a, w_scale=b, config=config,
                                       return_gathered=True)
            return y, g[None]

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(x_spec, P(None, "tp"), x_spec, P(None, "tp")),
                           out_specs=(P(None, "tp"), P("tp")))
        (x8, xs_r, _), (w8, ws_r, _) = xs[r], ws[r]
        x_global = (rows, w_ * cols) if gather_k else (w_ * rows, cols)
        s_global = (rows, w_ * xs_r.shape[1]) if gather_k else (w_ * rows, xs_r.shape[1])
        args = (self.place(x8, 1 if gather_k else 0, x_global), self.place(w8, 1, (k, w_ * n)),
                self.place(xs_r, 1 if gather_k else 0, s_global), self.place(ws_r, 1, (ws_r.shape[0], w_ * ws_r.shape[1])))
        what = f"block-scaled ag_gemm rows={rows} cols={cols} N={n} {'contraction' if gather_k else 'rows'}"
        y, g = self.block_call("ag_gemm", fn, args, what)
        comm.check_errors()
        gathered = np.concatenate([x[2] for x in xs], axis=1 if gather_k else 0)
        if not np.array_equal(self.local(g)[0].astype(np.float32),
                              np.concatenate([np.asarray(x[0], np.float32) for x in xs], axis=1 if gather_k else 0)):
            raise AssertionError(f"{what}: the gathered FP8 operand differs from the shards")
        self.log(f"{what}: ok")
        return self.check(self.local(y), gathered @ ws[r][2], what)

    def block_gemm_rs_grads(self, m, n, k, seed):
        """The value and the vector-Jacobian product of a block-scaled gemm_rs (bf16 x and w quantised by
        the op) with the cotangent c, both calls fused: y, dx = D @ W.T and dw = X.T @ D in float64 of
        the dequantised shards (D: each rank's c quantised to e5m2 per 1x128 tile). jax.vjp inside
        shard_map with c given: a loss summed over ranks would need an XLA all-reduce (NCCL, which
        cannot run two ranks on one GPU), and y as an output keeps the forward call in the program."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm, fp8

        r, w_ = self.rank, self.world
        rng = np.random.default_rng(seed)
        xs = [rng.standard_normal((m, k)).astype(jnp.bfloat16) for _ in range(w_)]
        ws = [(rng.standard_normal((k, n)) / 16).astype(jnp.bfloat16) for _ in range(w_)]
        c = rng.standard_normal((m, n)).astype(jnp.bfloat16)
        config = dataclasses.replace(entwine_jax.heuristic_config(m, n, k, w_, jnp.float8_e4m3fn), path="fused")

        def body(x, w, c):
            def f(x, w):
                return entwine_jax.gemm_rs(x, w, axis_name="tp", x_scale=fp8.scales_1x128(x),
                                           w_scale=fp8.scales_128x128(w), config=config)

            y, pullback = jax.vjp(f, x, w)
            return (y, *pullback(c))

        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, "tp"), P("tp", None), P("tp", None)),
                                   out_specs=(P("tp", None), P(None, "tp"), P("tp", None))))
        args = (self.place(xs[r], 1, (m, w_ * k)), self.place(ws[r], 0, (w_ * k, n)),
                self.place(c[r * m // w_:(r + 1) * m // w_], 0, (m, n)))
        what = f"block-scaled gemm_rs vjp M={m} N={n} K={k}"
        census = self.fused_calls(fn, *args)
        if not (census.get("gemm_rs") and census.get("ag_gemm")):
            raise AssertionError(f"{what}: not every call fused: {census}")
        with jax.set_mesh(self.mesh):
            y, dx, dw = fn(*args)
        comm.check_errors()
        deq = lambda v, quantise, dtype=fp8.E4M3: np.asarray(fp8.dequantize(*quantise(jnp.asarray(v), dtype)),  # noqa: E731
                                                             np.float64)
        x_d = [deq(x, fp8.quantize_1x128) for x in xs]
        w_d = [deq(w, fp8.quantize_128x128) for w in ws]
        d = np.concatenate([deq(c[s * m // w_:(s + 1) * m // w_], fp8.quantize_1x128, fp8.E5M2) for s in range(w_)])
        full = sum(x_d[q] @ w_d[q] for q in range(w_))
        worst = self.check(self.local(y), full[r * m // w_:(r + 1) * m // w_], f"{what}: y")
        worst = max(worst, self.check(self.local(dx), d @ w_d[r].T, f"{what}: dx"))
        worst = max(worst, self.check(self.local(dw), x_d[r].T @ d, f"{what}: dw"))
        self.log(f"{what}: ok")
        return worst
