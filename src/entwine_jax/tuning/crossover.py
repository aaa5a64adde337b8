# When path="auto" leaves a call to XLA because the fused op cannot win: the overlap can hide at most
# the shorter of the call's GEMM and its transfer, and the fused op pays a fixed cost XLA does not (its
# side streams, flag round trips, and for ag_gemm the copy-engine pushes, whose enqueueing bounds a
# small push). Where the hideable time is below that fixed cost, XLA's GEMM + collective is at least
# as fast. The constants live here alone, to be refined by measurements on several GPUs.
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
    # Fixed device cost of a fused call beyond XLA's, in microseconds. ag_gemm: 8 chunk pushes and
    # releases took 65 us to enqueue whatever their size below ~30 MB (one H200, docs/performance.md,
    # "ag_gemm"). gemm_rs: the consumer's launch on its own stream and the fork/join events; not
    # measured apart yet, set from its handler's launches.
    fixed_us: tuple = (("gemm_rs", 15.0), ("ag_gemm", 70.0))


COSTS = Costs()


def fused_cannot_win(op: str, flops: float, moved_bytes: float, costs: Optional[Costs] = None) -> Optional[str]:
    """Why path="auto" should leave a call of `op` with this GEMM (flops) and transfer (bytes into
    each GPU) to XLA, or None when the fused op can win."""
    costs = costs or COSTS
    fixed = dict(costs.fixed_us)[op]
    gemm_us = flops / (costs.gemm_tflops * 1e12) * 1e6
    transfer_us = moved_bytes / (costs.link_gbps * 1e9) * 1e6
    hidden = min(gemm_us, transfer_us)
    if hidden > fixed:
        return None
    return (f"a small call: the overlap can hide at most {hidden:.0f} us (the shorter of the GEMM, ~{gemm_us:.0f} us, "
            f"and the transfer, ~{transfer_us:.0f} us), not more than the fused op's fixed cost of ~{fixed:.0f} us "
            f"(entwine_jax.tuning.crossover; path='fused' runs the kernels anyway)")
