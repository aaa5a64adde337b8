"""gpu_ranks suites of the protocol's failure modes and forward progress: a rank that never calls
(`missing`, `agmissing`), ranks that disagree on the call (`skipcall`, `disagree`), and `forward`
(explicit configs; fused calls beside a kernel of another stream that holds SMs)."""

from __future__ import annotations

import threading
import time

from gpu_harness import MISSING_TIMEOUT_MS, Rank

# forward: SMs that a kernel of another stream holds on rank 0's GPU while fused calls run beside it.
FORWARD_HELD_SMS = 40


class ProtocolSuites(Rank):
    """The suites of failure modes and forward progress; the rank-side helpers they share are in gpu_harness.Rank."""

    def missing(self):
        import jax.numpy as jnp

        from entwine_jax import comm

        m, n, k = self.world * 128, 128, 64  # one tile per rank: one deadline, not one per tile
        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=7)
        gx, gw = self.global_arrays(xs, ws)
        f = self.gemm_fn(m, n, k, jnp.bfloat16)
        self.check(self.local(f(gx, gw)), self.reference(xs, ws), "missing: warm-up call")
        comm.check_errors()
        absent = self.world - 1
        return self.absent_rank("missing", lambda: f(gx, gw), f"from rank {absent}", "entwine gemm_rs")

    def agmissing(self):
        import jax.numpy as jnp

        from entwine_jax import comm

        xs, ws = self.ag_inputs(128, 64, 256, jnp.bfloat16, 17, False)
        call, _ = self.ag_fn(128, 64, 256, jnp.bfloat16, False)
        gx, gw = self.ag_globals(xs, ws, False)
        self.check(self.local(call(gx, gw)), self.ag_reference(xs, ws, False)[0], "agmissing: warm-up call")
        comm.check_errors()
        absent = self.world - 1
        # Either wait may pass its deadline first: the GEMM's for a chunk of the absent rank, or a
        # transfer stream's for the absent rank's announcement of the call.
        return self.absent_rank("agmissing", lambda: call(gx, gw),
                                (f"of the shard of rank {absent}", f"for rank {absent} to start the call"), None)

    def skipcall(self):
        """The last rank skips one call of a sequence of two different calls (a caught error on one
        rank, say): at the same epoch it runs the second call while its peers run the first. Every
        rank must fail with an error (the ranks that see it: one naming both calls), every output
        since is NaN, nothing hangs, and the next call is refused."""
        import jax.numpy as jnp

        w_ = self.world
        first = (w_ * 128, 256, 128)
        second = (w_ * 256, 384, 64)
        calls = {}
        for name, (m, n, k) in (("first", first), ("second", second)):
            xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=len(calls) + 31)
            calls[name] = (self.gemm_fn(m, n, k, jnp.bfloat16), self.global_arrays(xs, ws), self.reference(xs, ws))
        sequence = ["second", "second"] if self.rank == w_ - 1 else ["first", "second", "second"]
        return self.disagreement("skipcall", calls, sequence)

    def disagree(self):
        """Same shape, different plans: the last rank runs the call with another config (a tuned
        table that differs between ranks, say). Its signature differs: every rank fails, one of them
        naming both calls, instead of adding up partial tiles of different layouts."""
        import dataclasses

        import jax.numpy as jnp

        m, n, k = self.world * 256, 512, 256
        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=41)
        config = self.fused_config(m, n, k, jnp.bfloat16)
        other = dataclasses.replace(config, consumer_grid=config.consumer_grid // 2 if config.consumer_grid > 1 else 2)
        calls = {"agreed": (self.gemm_fn(m, n, k, jnp.bfloat16), self.global_arrays(xs, ws), self.reference(xs, ws)),
                 "own": (self.gemm_fn(m, n, k, jnp.bfloat16, config=other if self.rank == self.world - 1 else None),
                         self.global_arrays(xs, ws), self.reference(xs, ws))}
        return self.disagreement("disagree", calls, ["own", "agreed"], warm=["agreed"])

    def disagreement(self, suite, calls, sequence, warm=None):
        """Warm-up: the calls `warm` (default: all) of `calls` ({name: (f, (gx, gw), reference)}) once on
        every rank, checked.
        Then this rank runs `sequence` (ranks differ): every rank must get an error from check_errors
        (a mismatch naming both calls, or the abort of a peer that saw one) within a few seconds, every
        output of the sequence must be all NaN or its call must raise, and the next call must be refused."""
        import jax
        import numpy as np

        from entwine_jax import _distributed, comm

        for name in warm or sorted(calls):
            f, (gx, gw), ref = calls[name]
            self.check(self.local(f(gx, gw)), ref, f"{suite}: warm-up {name}")
        comm.check_errors()
        _distributed.barrier(f"entwine_test/{suite}_warm", range(self.world), self.rank, 120_000)
        t0 = time.monotonic()
        outputs = []
        for name in sequence:
            f, (gx, gw), _ = calls[name]
            try:
                outputs.append((name, self.local(jax.block_until_ready(f(gx, gw)))))
            except Exception as e:  # the handler refused: the error was already seen on this rank
                outputs.append((name, f"{type(e).__name__}"))
        waited = time.monotonic() - t0
        message = self.recorded_error(f"{suite}: no error after {waited:.1f} s although the ranks ran different calls")
        if "while rank" not in message and "gave up on the communicator" not in message:
            raise AssertionError(f"{suite}: the error is neither a mismatch nor an abort: {message}")
        # A process names the calls it traced; a peer's call it never traced is named by its signature.
        if "while rank" in message and message.count("gemm_rs bfloat16") + message.count("(signature ") != 2:
            raise AssertionError(f"{suite}: the mismatch does not name both calls: {message}")
        for name, y in outputs:
            if isinstance(y, np.ndarray) and not np.isnan(y.astype(np.float32)).all():
                raise AssertionError(f"{suite}: an output of call {name} after the failure is not all NaN")
        if waited > 10 * MISSING_TIMEOUT_MS / 1000 + 20:
            raise AssertionError(f"{suite}: the failure took {waited:.1f} s")
        f, (gx, gw), _ = calls[sequence[-1]]
        self.expect_refused(lambda: f(gx, gw), None, f"{suite}: a call after the failure was not refused")
        _distributed.barrier(f"entwine_test/{suite}_done", range(self.world), self.rank, 120_000)
        return f"{suite}: failed after {waited:.1f} s with: {message[:200]}"

    def expect_refused(self, call, op, failure):
        """call() must raise (an XlaRuntimeError from the handler of a poisoned communicator), with `op`
        in its message unless op is None; else AssertionError(failure)."""
        import jax

        try:
            jax.block_until_ready(call())
        except Exception as e:
            if op is not None and op not in str(e):
                raise
        else:
            raise AssertionError(failure)

    def absent_rank(self, suite, call, names_absent, op):
        """The last rank skips one call; every other rank must get the deadline error (naming the
        absent rank as `names_absent`, or one of its phrases, says, and the timeout) within the deadline and never hang; with
        `op`, its next call must then be refused by the poisoned communicator with an error naming it."""
        import jax

        from entwine_jax import _distributed

        absent = self.world - 1
        if self.rank == absent:
            detail = f"{suite}: skipped the call"
        else:
            t0 = time.monotonic()
            jax.block_until_ready(call())
            waited = time.monotonic() - t0
            message = self.recorded_error(
                f"no deadline error after {waited:.1f} s although rank {absent} never called")
            names = (names_absent,) if isinstance(names_absent, str) else names_absent
            if not any(n in message for n in names) or f"waited {MISSING_TIMEOUT_MS} ms" not in message:
                raise AssertionError(f"deadline error does not name rank {absent} and the timeout: {message}")
            if waited > 10 * MISSING_TIMEOUT_MS / 1000 + 20:
                raise AssertionError(f"the deadline took {waited:.1f} s")
            # The communicator is poisoned: the next call fails in the handler, before any launch.
            if op is not None:
                self.expect_refused(call, op, "a call after the deadline error did not fail")
            detail = f"{suite}: deadline reported after {waited:.1f} s: {message[:120]}"
        # The absent rank keeps its heap mapped until the others are done with it.
        _distributed.barrier(f"entwine_test/{suite}_done", range(self.world), self.rank, 120_000)
        return detail

    def forward(self):
        """Explicit configs, then fused calls beside a kernel of another stream that holds SMs."""
        import jax.numpy as jnp

        from entwine_jax import AgGemmConfig, GemmRsConfig, _extension

        w_ = self.world
        sms = _extension.sm_count()
        done = []
        m, n, k = 2048 * w_, 4096, 256
        # The dataclass defaults (producer_sms = 0) and the largest grids a user may write: the GEMM
        # never waits, so its grid may exceed what fits beside the consumer.
        rs_configs = [GemmRsConfig(path="fused"), GemmRsConfig(producer_sms=sms, consumer_grid=16, path="fused"),
                      GemmRsConfig(producer_sms=sms, consumer_grid=64, block_n=256, path="fused")]
        for i, config in enumerate(rs_configs):
            xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=4100 + i)
            ref = self.reference(xs, ws)
            f = self.gemm_fn(m, n, k, jnp.bfloat16, config=config)
            y = self.local(f(*self.global_arrays(xs, ws)))
            self.check(y, ref, f"gemm_rs {config}")
            self.log(f"forward: gemm_rs {config}: ok")
            done.append("rs")
        # ag_gemm: the dataclass defaults and each push at the largest GEMM grid it allows.
        ag_configs = [AgGemmConfig(path="fused"), AgGemmConfig(gemm_sms=sms - 1, push="ce", path="fused"),
                      AgGemmConfig(gemm_sms=sms - 16, push="sm", push_sms=16, path="fused")]
        for i, config in enumerate(ag_configs):
            for gather_k in (False, True):
                self.ag_config_case(1024, 512, 1024, jnp.bfloat16, gather_k, 4200 + 2 * i + gather_k, config)
                self.log(f"forward: ag_gemm {'contraction' if gather_k else 'rows'} {config}: ok")
                done.append("ag")
        # A kernel of another stream holding FORWARD_HELD_SMS SMs of rank 0's GPU, released only after
        # the calls beside it returned: they must fit (the reserve leaves it its SMs). Everything is
        # compiled and placed first: compiling or allocating may synchronise the whole device, which
        # would wait for the held kernel whatever our kernels do.
        xs, ws = self.host_inputs(m, n, k, jnp.bfloat16, seed=4300)
        ref = self.reference(xs, ws)
        gx, gw = self.global_arrays(xs, ws)
        f = self.gemm_fn(m, n, k, jnp.bfloat16, config=GemmRsConfig(path="fused"))
        self.check(self.local(f(gx, gw)), ref, "gemm_rs before holding")
        ag_runs = []
        for gather_k, config in ((False, AgGemmConfig(path="fused")), (True, AgGemmConfig(push="sm", path="fused"))):
            axs, aws = self.ag_inputs(1024, 512, 1024, jnp.bfloat16, 4301 + gather_k, gather_k)
            call, _ = self.ag_fn(1024, 512, 1024, jnp.bfloat16, gather_k, config=config)
            args = self.ag_globals(axs, aws, gather_k)
            aref, _ = self.ag_reference(axs, aws, gather_k)
            self.check(self.local(call(*args)), aref, "ag_gemm before holding")
            ag_runs.append((call, args, aref))
        self.barrier("forward_compiled")
        held = self.hold_sms(FORWARD_HELD_SMS, bound_ms=60000)
        self.log(f"forward: {held.started if held else '-'} held CTAs running")
        t0 = time.monotonic()
        self.check(self.local(f(gx, gw)), ref, "gemm_rs beside")
        for call, args, aref in ag_runs:
            self.check(self.local(call(*args)), aref, "ag_gemm beside")
        beside = time.monotonic() - t0
        self.log(f"forward: gemm_rs and ag_gemm beside the held SMs: ok ({beside:.1f} s)")
        if held is not None:
            if held.started != FORWARD_HELD_SMS:
                raise AssertionError(f"the held kernel has {held.started} of {FORWARD_HELD_SMS} CTAs running")
            if beside > 30:
                raise AssertionError(f"the calls beside the held SMs took {beside:.1f} s: they waited for its bound")
            held.release()
        self.barrier("forward_beside")
        # Every SM held: a call can only finish once the held kernel ends (released after 2 s).
        held = self.hold_sms(sms, bound_ms=60000)
        self.log(f"forward: {held.started if held else '-'} held CTAs running (all SMs)")
        if held is not None:
            threading.Timer(2.0, held.release).start()
        t0 = time.monotonic()
        self.check(self.local(f(gx, gw)), ref, "gemm_rs after release")
        after = time.monotonic() - t0
        return (f"{len(done)} explicit-config calls correct; beside {FORWARD_HELD_SMS} held SMs: 3 calls in "
                f"{beside:.1f} s; all SMs held: finished {after:.1f} s after the call (released at 2 s)")

    def hold_sms(self, ctas, bound_ms):
        """On rank 0: a kernel of another stream holding `ctas` SMs of this GPU (tests' SmHold), once
        they all run; None elsewhere."""
        if self.rank != 0:
            return None
        from entwine_jax import _extension

        held = _extension.ext().SmHold(int(self.device.local_hardware_id), int(ctas), int(bound_ms))
        deadline = time.monotonic() + 30
        while held.started < min(ctas, _extension.sm_count()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return held

    def barrier(self, name):
        from entwine_jax import _distributed

        _distributed.barrier(f"entwine_test/{name}", range(self.world), self.rank, 120_000)

    def ag_config_case(self, rows, cols, n, dtype, gather_k, seed, config):
        """One ag_gemm call with `config` (path="fused") against the host reference."""
        xs, ws = self.ag_inputs(rows, cols, n, dtype, seed, gather_k)
        call, _ = self.ag_fn(rows, cols, n, dtype, gather_k, config=config)
        y = self.local(call(*self.ag_globals(xs, ws, gather_k)))
        ref, _ = self.ag_reference(xs, ws, gather_k)
        self.check(y, ref, f"ag_gemm {'contraction' if gather_k else 'rows'} {config}")
