"""gpu_ranks suite `heapgrow` (and `heapgrow_cmdbuf`, its second launch under command buffers): the
symmetric heap grown by eight call sites, a lone trace that gives up, the memory the processes keep,
entwine_jax.reserve."""

from __future__ import annotations

import os
import time

from gpu_harness import Rank

# heapgrow_cmdbuf: graphs of fusions and the fused custom calls.
HEAPGROW_XLA_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
LONE_TRACE_TIMEOUT_MS = 3000


class HeapSuites(Rank):
    """The suites of heap growth; the rank-side helpers they share are in gpu_harness.Rank."""

    def heapgrow(self):
        return self.grow_heap(cmdbuf=False)

    def heapgrow_cmdbuf(self):
        if HEAPGROW_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
            raise AssertionError("heapgrow_cmdbuf runs with command buffers enabled (launch it as --suite heapgrow)")
        return self.grow_heap(cmdbuf=True)

    def grow_heap(self, cmdbuf):
        import jax
        import jax.numpy as jnp

        from entwine_jax import _distributed, comm

        dtype, n, k = jnp.bfloat16, 8192, 256
        mib = 1 << 20
        start_used, start_pool, sharing = self.memory_point("start")
        worst, first, lines = 0.0, None, []

        def site(i):
            m = 2048 * i * self.world
            xs, ws = self.host_inputs(m, n, k, dtype, seed=300 + i)
            gx, gw = self.global_arrays(xs, ws)
            return m, self.gemm_fn(m, n, k, dtype), gx, gw, self.reference(xs, ws)

        def record(i):
            used, pool, _ = self.memory_point(f"site{i}")
            (_, own, imported, reserved), = comm.heap_usage(self.mesh, "tp")
            gained = (used - start_used - (pool - start_pool)) / sharing
            lines.append(f"site {i}: heap {own // mib} MiB (imported {imported // mib} MiB, reserved "
                         f"{reserved // mib} MiB), device memory gained per process beyond XLA's pool "
                         f"{gained / mib:.0f} MiB (XLA's pool {pool // mib} MiB over {sharing} processes)")
            self.log(lines[-1])
            return own, gained

        for i in range(1, 9):
            m, f, gx, gw, ref = site(i)
            worst = max(worst, self.check(self.local(f(gx, gw)), ref, f"heapgrow site {i} (M={m})"))
            if i == 1:  # recorded (under command buffers) and replayed before any growth
                worst = max(worst, self.check(self.local(f(gx, gw)), ref, "heapgrow site 1, second call"))
                first = (f, gx, gw, ref)
            else:
                del f, gx, gw
            record(i)
        # The first site, compiled (and recorded) against the smallest heap, after the last growth.
        f, gx, gw, ref = first
        exec0 = self.handler_executions()
        for r in range(3):
            worst = max(worst, self.check(self.local(f(gx, gw)), ref, f"heapgrow site 1 after the growths, run {r}"))
        comm.check_errors()
        handler_runs = self.handler_executions() - exec0
        if cmdbuf and handler_runs >= 3:
            raise AssertionError("the first site was recorded again after the growths, never replayed")

        # A trace on rank 0 alone (jax.eval_shape) of a larger site: it waits for the others at most
        # ENTWINE_SETUP_TIMEOUT_MS, then gives up and leaves the heap as it was; the site takes the
        # XLA path in that trace only. Then every rank runs the site: the growth is tried again.
        (_, own_before, _, _), = comm.heap_usage(self.mesh, "tp")
        m, f, gx, gw, ref = site(9)
        if self.rank == 0:
            os.environ["ENTWINE_SETUP_TIMEOUT_MS"] = str(LONE_TRACE_TIMEOUT_MS)
            lone = self.gemm_fn(m, n, k, dtype)  # its own trace: f's cache must not keep the XLA path
            t0 = time.monotonic()
            with jax.set_mesh(self.mesh):
                jax.eval_shape(lone.jitted, gx, gw)
            waited = time.monotonic() - t0
            del os.environ["ENTWINE_SETUP_TIMEOUT_MS"]
            (_, own_after, _, _), = comm.heap_usage(self.mesh, "tp")
            if own_after != own_before:
                raise AssertionError(f"a lone trace changed the heap: {own_before} -> {own_after} bytes")
            if not LONE_TRACE_TIMEOUT_MS / 1000 <= waited < LONE_TRACE_TIMEOUT_MS / 1000 + 30:
                raise AssertionError(f"a lone trace waited {waited:.1f} s (deadline {LONE_TRACE_TIMEOUT_MS} ms)")
            lines.append(f"lone trace on rank 0: gave up after {waited:.1f} s, heap unchanged")
            self.log(lines[-1])
        _distributed.barrier("entwine_test/heapgrow/lone", range(self.world), self.rank, 300_000)
        worst = max(worst, self.check(self.local(f(gx, gw)), ref, f"heapgrow site 9 (M={m}) after the lone trace"))
        del f, gx, gw
        heap, gained = record(9)
        # A grown heap frees the one it replaces: the memory gained is about the last heap, not the sum.
        if gained > 1.5 * heap:
            raise AssertionError(f"device memory gained per process {gained / mib:.0f} MiB > 1.5 x the last heap "
                                 f"{heap / mib:.0f} MiB: " + "; ".join(lines))
        # entwine_jax.reserve: two larger sites sized by one growth; running them grows nothing more.
        import entwine_jax

        sites = [site(i) for i in (10, 11)]
        with jax.set_mesh(self.mesh):
            sized = entwine_jax.reserve(lambda: [f.jitted(gx, gw) for _, f, gx, gw, _ in sites])
        (_, reserved_heap, _, _), = comm.heap_usage(self.mesh, "tp")
        for i, (m, f, gx, gw, ref) in zip((10, 11), sites):
            worst = max(worst, self.check(self.local(f(gx, gw)), ref, f"heapgrow site {i} (M={m}) after reserve"))
        (_, own, _, _), = comm.heap_usage(self.mesh, "tp")
        if own != reserved_heap or sized.get("tp") != own:
            raise AssertionError(f"reserve sized {sized} ({reserved_heap} bytes mapped), the sites then had {own} bytes")
        return (f"heapgrow{' (command buffers)' if cmdbuf else ''}: worst rel error {worst:.2e}; first site after "
                f"the growths: {handler_runs} handler runs in 3 calls; last heap {heap // mib} MiB, gained "
                f"{gained / mib:.0f} MiB per process beyond XLA's pool; reserve for two more sites: "
                f"{own // mib} MiB, no growth while they ran")

    def memory_point(self, label):
        """(device bytes in use, summed over the processes on this GPU; XLA's pool bytes, summed
        likewise), measured while every rank waits between two barriers, so no process is mid-call."""
        import json

        from entwine_jax import _distributed, _extension

        _distributed.barrier(f"entwine_test/mem/{label}/before", range(self.world), self.rank, 300_000)
        free, total = _extension.ext().device_memory(self.device.local_hardware_id)
        stats = self.device.memory_stats() or {}
        pool = int(stats.get("pool_bytes", stats.get("bytes_reserved", stats.get("bytes_in_use", 0))))
        _distributed.kv_set(f"entwine_test/mem/{label}/{self.rank}", json.dumps([total - free, pool]).encode())
        sharing = [r for r in range(self.world) if r % self.args.gpus == self.rank % self.args.gpus]
        points = [json.loads(_distributed.kv_get(f"entwine_test/mem/{label}/{r}", 300_000)) for r in sharing]
        _distributed.barrier(f"entwine_test/mem/{label}/after", range(self.world), self.rank, 300_000)
        # Every process on the GPU saw the same device-wide bytes in use; their pools add up.
        return max(p[0] for p in points), sum(p[1] for p in points), len(sharing)
