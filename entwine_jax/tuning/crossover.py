# The small-call rules of path="auto", with their constants in one place (to be refined by
# measurements on several GPUs: `entwine_harness ag push` and tests/gpu_ranks.py --suite
# smallshapes print them).
# 1. Fused or XLA: the overlap can hide at most the shorter of the call's GEMM and its transfer, and
#    the fused op pays a fixed cost XLA does not (its side streams, flag round trips, and for ag_gemm
#    the pushes). Where the hideable time is below that fixed cost, XLA's GEMM + collective is at
#    least as fast.
# 2. How ag_gemm pushes a shard: a copy kernel on a few SMs (one launch) below a shard size, the copy
#    engines (no SMs taken from the GEMM, but a copy and a release kernel to enqueue per chunk and
#    peer) above it.
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Costs:
    # Dense bf16/fp16 GEMM rate XLA reaches on large shapes on an H100/H200 (the producer GEMM at
    # 0.95-1.00 of cuBLASLt's best: docs/performance.md, "Producer GEMM alone").
    gemm_tflops: float = 600.0
    # NVLink rate of one GPU's incoming traffic (SM-issued loads reached 372 GB/s per direction on
    # 2 x H200; NCCL's reduce-scatter 180-237 GB/s).
    link_gbps: float = 370.0
    # Every op's fixed cost (its own, declared by the op: fixed_us in <op>/op.py) is multiplied by
    # this; the tests of the dispatch set 0 to turn the small-call rule off.
    fixed_scale: float = 1.0
    # Shards up to this many bytes are pushed by the SM copy kernel: below it the copy engines' cost
    # is their enqueueing (flat ~65 us up to ~30 MB on one H200), above it the SMs the copy kernel
    # takes from the GEMM cost more than the launches it saves. An estimate until `entwine_harness ag push`
    # has measured both paths on NVLink.
    sm_push_max_shard_bytes: int = 16 << 20
    # CTAs of the SM push (the GEMM keeps the other SMs): 16 CTAs of 512 threads keep 8192 16-byte
    # stores in flight, the order of what saturated an NVLink direction with SM-issued loads.
    push_sms: int = 16
    # The automatic config's chunks are at least this many bytes (up to 8 per shard): each chunk's
    # release costs the push a grid-wide arrival, a fence and a flag. One H200, 16-CTA SM push
    # (docs/performance.md, "ag_gemm push latency"): a 1.05 MB shard in 16.3 us as 4 chunks, 11.0 us
    # as one; 8.4 MB in 31.5 us as 8 chunks, 20.4 us as one. Fewer chunks also delay the first peer
    # rows the GEMM can start on; at a chunk of 1 MiB that delay is a few microseconds of NVLink, under
    # the local shard's own GEMM. An estimate of that balance until two GPUs measure it.
    min_chunk_bytes: int = 1 << 20


COSTS = Costs()


def push_engine(shard_bytes: int) -> str:
    """What pushes a (padded) shard of `shard_bytes` to the peers by default: a copy kernel on a
    few SMs ("sm") or the copy engines ("ce")."""
    return "sm" if shard_bytes <= COSTS.sm_push_max_shard_bytes else "ce"


def fused_cannot_win(fixed_us: float, flops: float, moved_bytes: float) -> Optional[str]:
    """Why path="auto" should leave a call with this GEMM (flops) and transfer (bytes into each GPU)
    to XLA, or None when the fused op can win; fixed_us: the op's fixed device cost beyond XLA's, as
    the op declares it for this call."""
    costs = COSTS
    fixed = fixed_us * costs.fixed_scale
    gemm_us = flops / (costs.gemm_tflops * 1e12) * 1e6
    transfer_us = moved_bytes / (costs.link_gbps * 1e9) * 1e6
    hidden = min(gemm_us, transfer_us)
    if hidden > fixed:
        return None
    return (f"a small call: the overlap can hide at most {hidden:.0f} us (the shorter of the GEMM, ~{gemm_us:.0f} us, "
            f"and the transfer, ~{transfer_us:.0f} us), not more than the fused op's fixed cost of ~{fixed:.0f} us "
            f"(entwine_jax.tuning.crossover; path='fused' runs the kernels anyway)")
