"""gpu_ranks suite `moe`: moe_dispatch_gemm on the kernels (the token dispatch fused with the expert
GEMM), against a float64 host reference of the static layout built from the shared seeds."""

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
        expert nobody picks, bf16 and fp16, the SM push and the copy engines; repeated calls bitwise
        equal; and the compiled program holds no XLA collective, only the fused call."""
        import jax.numpy as jnp

        w_ = self.world
        worst, cases = 0.0, 0
        for t, h, n, e_local, k, capacity, push, dtype in (
                (256, 256, 512, 2, 2, None, "copy", jnp.bfloat16),
                (200, 384, 256, 1, 2, None, "sm", jnp.bfloat16),
                (512, 256, 256, 2, 4, 1.0, "copy", jnp.float16),
                (384, 512, 512, 3, 2, 0.5, "sm", jnp.bfloat16)):
            worst = max(worst, self.moe_case(t, h, n, e_local, k, capacity, push, dtype, seed=1700 + cases))
            cases += 1
        return f"moe: {cases} cases ok, worst rel error {worst:.2e}"

    def moe_case(self, t, h, n, e_local, k, capacity, push, dtype, seed):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import PartitionSpec as P

        import entwine_jax
        from entwine_jax import comm
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
        w1s = rng.standard_normal((experts, h, n), np.float32).astype(dtype) / np.sqrt(h)
        config = MoeConfig(capacity=capacity, path="fused", push_sms=8 if push == "sm" else 0)

        def body(x, idx, w1):
            y, _ = entwine_jax.moe_dispatch_gemm(x, idx, w1, axis_name="tp", config=config)
            return y

        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("tp"), P("tp"), P("tp")), out_specs=P("tp")))
        args = (self.place(xs[r], 0, (w_ * t, h)), self.place(ids[r], 0, (w_ * t, k)),
                self.place(w1s[r * e_local:(r + 1) * e_local], 0, (experts, h, n)))
        what = (f"moe_dispatch_gemm T={t} H={h} N={n} E={experts} k={k} capacity={capacity} push={push} "
                f"{jnp.dtype(dtype).name}")
        census = self.census(fn, *args)
        fused = census.select(custom_call=True).counts("owner")
        if not fused.get("moe_dispatch_gemm"):
            raise AssertionError(f"{what}: did not lower to the fused call: {fused}")
        others = census.select(custom_call=False).counts("owner")
        if others:
            raise AssertionError(f"{what}: XLA collectives left in the program: {others}")
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
                    ref[e, q * cap:q * cap + len(tokens)] = (xs[q][tokens].astype(np.float64)
                                                             @ w1s[r * e_local + e].astype(np.float64))
        self.log(f"{what}: checked")
        return self.check(y, ref, what)
