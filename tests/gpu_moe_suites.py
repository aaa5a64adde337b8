"""gpu_ranks suites of the MoE ops: `moe` (moe_dispatch_gemm on the kernels against a float64 host
reference of the static layout built from the shared seeds), `moemlp` (the MoE MLP's forward and VJP)
and `moestack` / `moestack_cmdbuf` (scanned layers and an independent site, also under command
buffers), the last two against float64 of the dense model."""

from __future__ import annotations

from gpu_harness import Rank


def host_layout(topk_idx, experts: int, capacity: int):
    """One source's rows per global expert, in (token, slot) order: {expert: [token, ...]} with
    at most `capacity` tokens each (later slots dropped), ids outside [0, E) routed nowhere."""
    rows = {e: [] for e in range(experts)}
    for t, ids in enumerate(topk_idx):
        for e in ids:
            if 0 <= e < experts and len(rows[int(e)]) < capacity:
                rows[int(e)].append(t)
    return rows


class MoeSuites(Rank):
    """The MoE suite: every call must lower to the fused call (XLA's all-to-all would need NCCL,
    which cannot run two ranks on one GPU)."""

    def moe(self):
        """moe_dispatch_gemm's y (and its receive pool) at several shapes, capacities and pushes:
        dropless and with a capacity factor that drops, tokens routed nowhere (-1, out of range), an
        expert nobody picks, bf16 and fp16, the SM push and the copy engines, and FP8 (each rank's
        current scale; the e4m3 kernel, against float64 of the dequantised operands); repeated calls
        bitwise equal; and the compiled program holds no XLA collective, only the fused calls."""
        import jax.numpy as jnp

        worst, cases = 0.0, 0
        for t, h, n, e_local, k, capacity, push, dtype, fp8 in (
                (256, 256, 512, 2, 2, None, "copy", jnp.bfloat16, False),
                (200, 384, 256, 1, 2, None, "sm", jnp.bfloat16, False),
                (512, 256, 256, 2, 4, 1.0, "copy", jnp.float16, False),
                (384, 512, 512, 3, 2, 0.5, "sm", jnp.bfloat16, False),
                (256, 256, 384, 2, 2, None, "copy", jnp.bfloat16, True),
                (384, 512, 256, 1, 2, 1.0, "sm", jnp.float16, True)):
            worst = max(worst, self.moe_case(t, h, n, e_local, k, capacity, push, dtype, fp8, seed=1700 + cases))
            cases += 1
        return f"moe: {cases} cases ok, worst rel error {worst:.2e}"

    def moe_case(self, t, h, n, e_local, k, capacity, push, dtype, fp8, seed):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm
        from entwine_jax import fp8 as entwine_fp8
        from entwine_jax.moe.config import MoeConfig

        r, w_ = self.rank, self.world
        experts = w_ * e_local
        rng = np.random.default_rng(seed)
        xs, ids = [], []
        for _ in range(w_):
            xs.append(rng.standard_normal((t, h), np.float32).astype(dtype))
            idx = np.stack([rng.permutation(experts)[:k] for _ in range(t)]).astype(np.int32)
            # Some slots routed nowhere, and the last expert picked by nobody when there are several.
            idx[rng.random(idx.shape) < 0.05] = -1
            idx[rng.random(idx.shape) < 0.02] = experts + 3
            if experts > 2:
                idx[idx == experts - 1] = -1
            ids.append(idx)
        w1s = (rng.standard_normal((experts, h, n), np.float32) / np.sqrt(h)).astype(dtype)
        config = MoeConfig(capacity=capacity, path="fused", push_sms=8 if push == "sm" else 0)

        def body(x, idx, w1):
            scales = dict(x_scale=entwine_fp8.current_scale(x), w_scale=entwine_fp8.current_scale(w1)) if fp8 else {}
            y, _ = entwine_jax.moe_dispatch_gemm(x, idx, w1, axis_name="tp", config=config, **scales)
            return y

        if fp8:
            # What the kernel multiplies: each rank's x and experts quantised with their own current scales.
            cpu = jax.local_devices(backend="cpu")[0]
            deq = jax.jit(lambda v: entwine_fp8.dequantize(entwine_fp8.quantize(v, entwine_fp8.current_scale(v)),
                                                           entwine_fp8.current_scale(v)))
            with jax.default_device(cpu):
                x_ref = [np.asarray(deq(jnp.asarray(v))) for v in xs]
                w_ref = np.concatenate([np.asarray(deq(jnp.asarray(w1s[q * e_local:(q + 1) * e_local])))
                                        for q in range(w_)])
        else:
            x_ref, w_ref = xs, w1s

        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("tp"), P("tp"), P("tp")), out_specs=P("tp")))
        args = (self.place(xs[r], 0, (w_ * t, h)), self.place(ids[r], 0, (w_ * t, k)),
                self.place(w1s[r * e_local:(r + 1) * e_local], 0, (experts, h, n)))
        what = (f"moe_dispatch_gemm T={t} H={h} N={n} E={experts} k={k} capacity={capacity} push={push} "
                f"{jnp.dtype(dtype).name}" + (" fp8" if fp8 else ""))
        self.log(f"{what}: compiling")
        census = self.census(fn, *args)
        fused = census.select(custom_call=True).counts("owner")
        if not fused.get("moe_dispatch_gemm"):
            raise AssertionError(f"{what}: did not lower to the fused call: {fused}")
        others = census.select(custom_call=False).counts("owner")
        if others:
            raise AssertionError(f"{what}: XLA collectives left in the program: {others}")
        self.log(f"{what}: running")
        with jax.set_mesh(self.mesh):
            y = self.local(fn(*args))
            again = self.local(fn(*args))
        comm.check_errors()
        if not np.array_equal(y.view(np.uint16), again.view(np.uint16)):
            raise AssertionError(f"{what}: repeated calls differ")
        # The reference: the static layout's C, every source's rows of this rank's experts.
        cap = -(-t // 128) * 128 if capacity is None else max(128, -(-int(np.ceil(capacity * t * k / experts)) // 128) * 128)
        if y.shape != (e_local, w_ * cap, n):
            raise AssertionError(f"{what}: y has shape {y.shape}, expected {(e_local, w_ * cap, n)}")
        ref = np.zeros((e_local, w_ * cap, n))
        for q in range(w_):
            rows = host_layout(ids[q], experts, cap)
            for e in range(e_local):
                tokens = rows[r * e_local + e]
                if tokens:
                    ref[e, q * cap:q * cap + len(tokens)] = (x_ref[q][tokens].astype(np.float64)
                                                             @ w_ref[r * e_local + e].astype(np.float64))
        self.log(f"{what}: checked")
        # FP8: the host's quantisation may round a value to the other neighbour than the GPU's (x / scale
        # compiled as x times 1 / scale or not): ~0.5% of elements one e4m3 step apart, ~1% of y.
        return self.check(y, ref, what, tol=2e-2 if fp8 else 1e-2)

    def moemlp(self):
        """The MoE MLP (moe_layers.moe_mlp: router, top-k, gate|up through moe_dispatch_gemm, SwiGLU,
        moe_gemm_combine) forward and backward on the kernels: y and the vector-Jacobian product with a
        given cotangent (x, router, wi_0, wi_1, wo) against the dense float64 model on the host's CPU
        backend (every expert computed, the top-k weights zero elsewhere); dropless, fp16 and bf16, and
        bf16 with fp8="current" (the FP8 dispatch and combine kernels; 15%); the
        compiled program must hold no XLA collective (every move is a fused call)."""
        import jax.numpy as jnp

        worst, cases = 0.0, 0
        for t, h, f, e_local, k, dtype, fp8 in ((256, 256, 256, 2, 2, jnp.float16, None),
                                                 (128, 384, 128, 1, 2, jnp.bfloat16, None),
                                                 (384, 256, 256, 3, 4, jnp.float16, None),
                                                 (256, 256, 256, 2, 2, jnp.bfloat16, "current")):
            worst = max(worst, self.moe_mlp_case(t, h, f, e_local, k, dtype, fp8, seed=1800 + cases))
            cases += 1
        return f"moemlp: {cases} cases ok, worst rel error {worst:.2e}"

    def moe_mlp_case(self, t, h, f, e_local, k, dtype, fp8, seed):
        import functools

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        from entwine_jax import comm, moe_layers
        from entwine_jax.moe.config import MoeConfig

        r, w_ = self.rank, self.world
        experts = w_ * e_local
        rng = np.random.default_rng(seed)
        xs = [rng.standard_normal((t, h), np.float32).astype(dtype) for _ in range(w_)]
        cs = [rng.standard_normal((t, h), np.float32).astype(dtype) for _ in range(w_)]
        router = rng.standard_normal((h, experts), np.float32).astype(dtype)
        wi_0, wi_1 = ((rng.standard_normal((experts, h, f), np.float32) / np.sqrt(h)).astype(dtype) for _ in range(2))
        wo = (rng.standard_normal((experts, f, h), np.float32) / np.sqrt(f)).astype(dtype)
        # The default config (path 'auto', the copy engines) on the fp16 cases: the kernels must be
        # what it picks (at W = 1 'auto' keeps XLA's path: nothing moves); the SM push, which moves
        # only the rows sent, on the bf16 ones (forward, and the combine's backward dispatch).
        config = MoeConfig() if dtype == jnp.float16 and w_ > 1 else MoeConfig(path="fused", push_sms=8)
        mlp = functools.partial(moe_layers.moe_mlp, num_experts_per_tok=k, axis_name="tp", config=config, fp8=fp8)

        def body(x, router, wi_0, wi_1, wo, c):
            # The router enters as each rank's own copy ([1, H, E] of a stacked [W, H, E]): its
            # gradient is then this rank's tokens' share. A replicated router's gradient would be summed
            # over ranks by an XLA all-reduce (NCCL, which cannot run two ranks on one GPU).
            y, pullback = jax.vjp(mlp, x, router[0], wi_0, wi_1, wo)
            dx, drouter, d0, d1, do = pullback(c)
            return y, dx, drouter[None], d0, d1, do

        ep = P("tp")
        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(ep,) * 6, out_specs=(ep,) * 6))
        args = (self.place(xs[r], 0, (w_ * t, h)), self.place(router[None], 0, (w_, h, experts)),
                self.place(wi_0[r * e_local:(r + 1) * e_local], 0, (experts, h, f)),
                self.place(wi_1[r * e_local:(r + 1) * e_local], 0, (experts, h, f)),
                self.place(wo[r * e_local:(r + 1) * e_local], 0, (experts, f, h)), self.place(cs[r], 0, (w_ * t, h)))
        what = f"moe_mlp T={t} H={h} F={f} E={experts} k={k} {jnp.dtype(dtype).name}" + (f" fp8={fp8}" if fp8 else "")
        self.log(f"{what}: compiling")
        census = self.census(fn, *args)
        fused = census.select(custom_call=True).counts("owner")
        others = census.select(custom_call=False).counts("owner")
        if not fused.get("moe_dispatch_gemm") or others:
            raise AssertionError(f"{what}: fused calls {fused}, XLA collectives {others} (expected none)")
        # dw1 and dw2 by the weight-gradient kernel over the rows received (every case's H and 2F, F
        # and H are whole blocks).
        with jax.set_mesh(self.mesh):
            text = fn.lower(*args).as_text()
        wgrads = text.count("@entwine_moe_weight_grad(")
        if wgrads != 2:
            raise AssertionError(f"{what}: {wgrads} weight-gradient kernel calls in the program (expected 2)")
        self.log(f"{what}: running")
        with jax.set_mesh(self.mesh):
            outs = [self.local(v) for v in fn(*args)]
        comm.check_errors()
        # The reference: the dense model on every rank's tokens, float64 on the host's CPU backend.
        rows = slice(r * t, (r + 1) * t)
        y_ref, grads, router_share = vjp_f64(functools.partial(dense_moe_mlp_f64, k=k),
                                             (np.concatenate(xs), router, wi_0, wi_1, wo), np.concatenate(cs), rows)
        mine = slice(r * e_local, (r + 1) * e_local)
        refs = [y_ref[rows], grads[0][rows], router_share[None], grads[2][mine], grads[3][mine], grads[4][mine]]
        worst = 0.0
        for name, got, ref in zip(("y", "dx", "drouter", "dwi_0", "dwi_1", "dwo"), outs, refs):
            # FP8 rounds four operands (and e5m2 the cotangents) on the way: ~3-6% each.
            tol = 0.15 if fp8 else 1e-2
            worst = max(worst, self.check(got, ref, f"{what}: {name}", tol=tol))
        self.log(f"{what}: ok")
        return worst


    def moestack(self, runs=3):
        """Two MoE layers under lax.scan (stacked weights, a residual each) and an independent MoE call
        site of other shapes in the same program, on the default config (path 'auto'): the outputs and
        vector-Jacobian products against float64 of the dense model, `runs` times with fresh inputs;
        no XLA collective in the program. Launched again under XLA's command buffers
        (moestack_cmdbuf): then also the device epoch advances by the same number of fused calls every
        run, and later runs execute fewer handlers than that (the rest were replays)."""
        import os

        import jax

        from entwine_jax import comm
        from gpu_cmdbuf_suites import CMDBUF_XLA_FLAGS

        recorded = CMDBUF_XLA_FLAGS in os.environ.get("XLA_FLAGS", "")
        sites = ((256, 256, 256, 2, 2, 2), (128, 384, 128, 2, 2, 1))  # (T, H, F, E_local, k, layers)
        fn, args_of, refs_of = self.moe_stack_program(sites)
        worst, epochs, executions = 0.0, [], []
        for i in range(runs):
            seed = 1900 + 10 * i
            args = args_of(seed)
            if i == 0:
                census = self.census(fn, *args)
                fused = census.select(custom_call=True).counts("owner")
                others = census.select(custom_call=False).counts("owner")
                if not fused.get("moe_dispatch_gemm") or not fused.get("moe_gemm_combine") or others:
                    raise AssertionError(f"moestack: fused calls {fused}, XLA collectives {others} (expected none)")
            epoch0, exec0 = self.device_epoch(), self.handler_executions()
            with jax.set_mesh(self.mesh):
                outs = [self.local(v) for v in fn(*args)]
            comm.check_errors()
            epochs.append(self.device_epoch() - epoch0)
            executions.append(self.handler_executions() - exec0)
            for (name, ref), got in zip(refs_of(seed), outs):
                worst = max(worst, self.check(got, ref, f"moestack run {i}: {name}"))
        calls = sum(fused.values())  # per run, the scan's trips counted
        if set(epochs) != {calls}:
            raise AssertionError(f"moestack: the device epoch advanced {epochs} times per run for {calls} fused calls")
        detail = f"{runs} runs, {calls} fused calls each, handler executions {executions}"
        if not recorded and set(executions) != {calls}:
            raise AssertionError(f"moestack: every call runs its handler without command buffers ({detail})")
        if recorded and min(executions[1:]) >= epochs[0]:
            raise AssertionError(f"moestack under command buffers: no call was replayed ({detail})")
        return f"moestack{' (command buffers)' if recorded else ''}: worst rel error {worst:.2e}; {detail}"

    def moestack_cmdbuf(self):
        import os

        from gpu_cmdbuf_suites import CMDBUF_XLA_FLAGS

        if CMDBUF_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            raise AssertionError("moestack_cmdbuf runs with command buffers enabled (launch it as --suite moestack)")
        return self.moestack()

    def moe_stack_program(self, sites):
        """(jit program, args_of(seed), refs_of(seed)) of moestack: per site, a scan of `layers` MoE MLPs
        with a residual, its output and its VJP (x, router, wi_0, wi_1, wo stacked over layers); refs
        are [(name, float64 array of this rank's part)]."""
        import functools

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        from entwine_jax import moe_layers
        from entwine_jax.moe.config import MoeConfig

        # fp16: the second layer routes the first one's output, rounded; in bf16 its rounding flips
        # enough near-tie top-k choices against float64 to move the gradients by 2-4% (on CPU).
        r, w_, dtype = self.rank, self.world, jnp.float16
        # The default config; at W = 1 'auto' keeps XLA's path (nothing moves), so the kernels are asked for.
        config = MoeConfig() if w_ > 1 else MoeConfig(path="fused")

        def stack(mlp, x, router, wi_0, wi_1, wo):
            def layer(h, p):
                return h + mlp(h, *p), None
            if router.shape[0] == 1:  # one layer: its calls outside any loop
                return layer(x, (router[0], wi_0[0], wi_1[0], wo[0]))[0]
            return jax.lax.scan(layer, x, (router, wi_0, wi_1, wo))[0]

        def body(*args):
            outs = []
            for i, (t, h, f, e_local, k, layers) in enumerate(sites):
                x, router, wi_0, wi_1, wo, c = args[6 * i:6 * i + 6]
                mlp = functools.partial(moe_layers.moe_mlp, num_experts_per_tok=k, axis_name="tp", config=config)
                # The router enters as each rank's own copy ([1, L, H, E]): its gradient is then this
                # rank's tokens' share (a replicated one would be summed by an XLA all-reduce: NCCL).
                y, pullback = jax.vjp(functools.partial(stack, mlp), x, router[0], wi_0, wi_1, wo)
                dx, drouter, d0, d1, do = pullback(c)
                outs += [y, dx, drouter[None], d0, d1, do]
            return tuple(outs)

        ep, experts = P("tp"), P(None, "tp")  # tokens and router copies; stacked experts [L, E, ...]
        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(ep, ep, experts, experts, experts, ep) * len(sites),
                                   out_specs=(ep, ep, ep, experts, experts, experts) * len(sites)))

        def host(seed):
            out = []
            for i, (t, h, f, e_local, k, layers) in enumerate(sites):
                rng = np.random.default_rng(seed + i)
                e = w_ * e_local
                xs = rng.standard_normal((w_ * t, h), np.float32).astype(dtype)
                cs = rng.standard_normal((w_ * t, h), np.float32).astype(dtype)
                router = rng.standard_normal((layers, h, e), np.float32).astype(dtype)
                wi_0, wi_1 = ((rng.standard_normal((layers, e, h, f), np.float32) / np.sqrt(h)).astype(dtype)
                              for _ in range(2))
                wo = (rng.standard_normal((layers, e, f, h), np.float32) / np.sqrt(f)).astype(dtype)
                out.append((t, e_local, k, xs, router, wi_0, wi_1, wo, cs))
            return out

        def args_of(seed):
            args = []
            for t, e_local, k, xs, router, wi_0, wi_1, wo, cs in host(seed):
                mine, rows = slice(r * e_local, (r + 1) * e_local), slice(r * t, (r + 1) * t)
                layers, h, e = router.shape
                args += [self.place(xs[rows], 0, xs.shape), self.place(router[None], 0, (w_, layers, h, e)),
                         self.place(wi_0[:, mine], 1, wi_0.shape), self.place(wi_1[:, mine], 1, wi_1.shape),
                         self.place(wo[:, mine], 1, wo.shape), self.place(cs[rows], 0, cs.shape)]
            return args

        def refs_of(seed):
            refs = []
            for i, (t, e_local, k, xs, router, wi_0, wi_1, wo, cs) in enumerate(host(seed)):
                mine, rows = slice(r * e_local, (r + 1) * e_local), slice(r * t, (r + 1) * t)
                model = functools.partial(stack, functools.partial(dense_moe_mlp_f64, k=k))
                y, grads, router_share = vjp_f64(model, (xs, router, wi_0, wi_1, wo), cs, rows)
                refs += [(f"site {i} y", y[rows]), (f"site {i} dx", grads[0][rows]),
                         (f"site {i} drouter", router_share[None]), (f"site {i} dwi_0", grads[2][:, mine]),
                         (f"site {i} dwi_1", grads[3][:, mine]), (f"site {i} dwo", grads[4][:, mine])]
            return refs

        return fn, args_of, refs_of


def vjp_f64(model, inputs, cotangent, rows):
    """(y, the VJP of every input, the router's share of `rows`) of model(x, router, ...) in float64
    on the host's CPU backend, as numpy arrays. The share is the router's gradient with the cotangent
    of every token outside `rows` (another rank's) zeroed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    mine = np.zeros(np.shape(cotangent), np.float64)
    mine[rows] = np.asarray(cotangent, np.float64)[rows]
    with jax.enable_x64(True), jax.default_device(jax.local_devices(backend="cpu")[0]):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        y, pullback = jax.vjp(model, *(f64(a) for a in inputs))
        grads = [np.asarray(g) for g in pullback(f64(cotangent))]
        return np.asarray(y), grads, np.asarray(pullback(f64(mine))[1])


def dense_moe_mlp_f64(x, router, wi_0, wi_1, wo, *, k):
    """The MoE MLP with every expert computed (softmax router, top k, weights renormalised, SwiGLU),
    in the inputs' dtype (float64 under jax.enable_x64): x [T, H], router [H, E], wi_0 / wi_1
    [E, H, F], wo [E, F, H]."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax(x @ router, axis=-1)
    top, idx = jax.lax.top_k(probs, k)
    weights = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], idx].add(top / top.sum(-1, keepdims=True))
    g = jnp.einsum("th,ehf->etf", x, wi_0)
    u = jnp.einsum("th,ehf->etf", x, wi_1)
    return jnp.einsum("te,etf,efh->th", weights, jax.nn.silu(g) * u, wo)
