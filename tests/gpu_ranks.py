"""Multi-process GPU tests of the fused ops (gemm_rs and ag_gemm): W processes (jax.distributed on
localhost), one rank each, sharing one GPU (CUDA IPC between processes of one device) or one GPU
each.

    python tests/gpu_ranks.py --world 2 --suite quick            # 2 ranks on GPU 0
    python tests/gpu_ranks.py --world 4 --suite all              # every checking suite: all but hostcost, smallshapes
    python tests/gpu_ranks.py --world 2 --gpus 2 --suite quick   # one process per GPU
    python tests/gpu_ranks.py --world 4 --mps --suite quick      # 4 ranks at once on GPU 0 (CUDA MPS)

Without --mps, processes sharing a GPU take turns on it in time slices, which hides every problem of
kernels that need SMs at the same time. --mps starts a private MPS server (its own pipe and log
folders), runs the suites' ranks as its clients, so their kernels share the SMs at once as kernels of
other streams do on a real node, and stops it at the end; --mps-percent N also caps each client at N %
of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE).

Suites:
  quick    suite-like and tail shapes, bf16 and fp16, growing (the heap regrows across processes),
           then x [B, S, K] scattered over S, jax.vmap(gemm_rs) (w batched or shared), gemm_rs
           inside lax.scan; results checked against a float64 host reference, repeated calls
           bitwise identical.
  stress   1000 back-to-back calls: two shapes, three input sets, two call sites, other XLA work
           in between, every result checked.
  missing  the last rank skips one call; the others must report the deadline error (with
           ENTWINE_TIMEOUT_MS=2000) through entwine_jax.comm.check_errors(), never hang.
  ag       ag_gemm in both layouts (gathering rows, also a middle dim, and gathering the contraction
           dim), bf16 and fp16, tails, the gathered operand returned, repeated calls bitwise equal,
           every shape and layout pushed by the SM copy kernel and by the copy engines;
           then a sequence-parallel MLP (ag_gemm -> silu -> gemm_rs) forward and backward with both
           directions fused, gradients against a float64 host reference; then the grouped ag_gemm
           with its gradients, groups read in place (the lowered call takes every weight) and
           groups joined (widths not whole blocks).
  mixed    1000 back-to-back calls alternating gemm_rs and ag_gemm (both layouts, both pushes) on
           one communicator, every result checked.
  agmissing  as `missing`, for ag_gemm (the SM push): the ranks waiting for the absent rank's
           chunks or announcement report it.
  cmdbuf   XLA command buffers (CUDA graphs) on for fusions, custom calls, loops and conditionals,
           graphs of any size: gemm_rs (two call sites), ag_gemm (both layouts, both pushes), FP8
           gemm_rs and ag_gemm (scales made in the program from the seed), three
           independent fused calls in one program and a lax.scan of both
           ops, 20 runs each on operands generated in the program from fresh seeds, every
           result checked; the device epoch must advance once per call while the handlers execute
           fewer times (the rest are replays), except in the loop, which XLA keeps out of its graphs.
  cmdbufmissing  as `missing`, under command buffers: the replayed call of the ranks whose peer
           never came traps at the deadline, XLA raises, check_errors() names the absent rank.
  skipcall the last rank skips the first of two different calls (it runs the second while its peers
           run the first): every rank must fail within seconds (a mismatch naming both calls, or the
           abort of a peer that saw it), every output since is NaN, the next call is refused.
  disagree as skipcall, for one shape whose config differs on the last rank (a plan disagreement).
  heapgrow eight gemm_rs call sites of growing size (M = 2048*i*W, N = 8192, K = 256, bf16, i = 1..8),
           each traced and run once, every result checked; then the first site again, after the last
           growth; then rank 0 alone traces a ninth, larger site (jax.eval_shape) and must give up
           within ENTWINE_SETUP_TIMEOUT_MS with its heap unchanged, after which all ranks run that site.
           The device memory the processes gained beyond XLA's own pool must stay within 1.5x the last
           heap per process (retired heaps would add up to about 5x). Then entwine_jax.reserve sizes two
           larger sites at once, and running them must grow nothing. Runs twice: plainly, and with
           XLA command buffers for fusions and custom calls (the first site's graph, recorded before
           every growth, is replayed after them).
  fp8kernels  the FP8 FFI targets called directly (no Python op): entwine_gemm_rs_fp8 (rows and
           columns, bf16 and fp16 out) and entwine_ag_gemm_fp8 (rows layout with per-shard scales,
           the gathered shards and scales returned; contraction layout with a shared scale; each by
           both pushes) on e4m3 operands with a scale per rank, against float64 of the dequantised
           operands.
  fp8      the FP8 calls (float8_e4m3fn operands, fp32 scales, bf16/fp16 out) on the FP8 kernels:
           gemm_rs both layouts with each rank's own scales, tails; ag_gemm both layouts with
           per-shard and shared x_scale, the gathered FP8 operand returned; repeated calls bitwise
           equal; an FP8 then an fp16 ag_gemm in one program; the grouped FP8 ag_gemm (q/k/v widths
           read in place, and a group joined) with its fp16 backward; then an FP8 sequence-parallel MLP (FP8
           forward; backward in e5m2 on the e5m2 x e4m3 kernels, and in fp16 on the fp16 kernels)
           with gradients; all against float64 of the dequantised operands. Fails where the
           extension has no FP8 kernels (the XLA path cannot run several ranks on one GPU).
  fp8half  the FP8 calls' fp16 backward piece by piece: the fp16 ops alone at the FP8 MLP's
           backward shapes (both configs, both pushes), each FP8 op's fp16 backward alone against
           the recipe (FP8-rounded operands) and against the unrounded operands, the FP8 MLP.
  fp8block block-scaled FP8 (1x128 / 128x128 scales) through the ops on the kernels: gemm_rs rows
           and columns, ag_gemm rows and contraction (the gathered FP8 operand too), a block-scaled
           gemm_rs's gradients with its backward ag_gemm; against float64 of the dequantised
           operands. An op without block-scaled kernels in the build is reported, not run.
  moe      moe_dispatch_gemm on the kernels (tokens dispatched to their experts' ranks, the expert
           GEMM starting on each source's rows as they arrive): dropless and dropping capacities,
           tokens routed nowhere, an expert nobody picks, bf16 and fp16, SM push and copy engines,
           repeated calls bitwise equal, no XLA collective left in the program; against float64.
  moemlp   the MoE MLP (moe_layers.moe_mlp) forward and vector-Jacobian product on the kernels (the
           dispatch and the combine, each fused with its GEMM): y and the gradients of
           x, router (this rank's share), wi_0, wi_1 and wo against the dense float64 model on the
           host's CPU backend; no XLA collective left in the program.
  moestack two MoE layers under lax.scan and an independent MoE call site of other shapes in one
           program, on the default config (path 'auto'), three runs with fresh inputs against
           float64; then again under XLA's command buffers (moestack_cmdbuf): the device epoch
           advances by the same count every run and later runs replay some calls.
  hostcost the handlers' host time per execution (validation, plan, TMA descriptors, launches) for
           gemm_rs and ag_gemm (both layouts), over 200 calls each, one at a time, also by phase; then the host
           time per step of a lax.scan over an 8-layer MLP block (ag_gemm -> silu -> gemm_rs);
           reports them and checks the results.
  forward  forward progress: gemm_rs and ag_gemm with explicit configs a user writes (the dataclass
           defaults, the largest grids, both pushes), every result checked; then, on rank 0's GPU, a
           kernel of another stream that holds SMs until released (tests' SmHold): with
           ENTWINE_SM_RESERVE set to its SMs, fused calls run beside it and finish before it is
           released; holding every SM, a call finishes once it is released (after 2 s).
  smallshapes  the fused ops against XLA's path on Llama-8B and -70B projections (q/k/v and
           gate/up: ag_gemm; o and down: gemm_rs) at 16..2048 tokens per rank: XLA's GEMM alone
           plus the transfer at the link rate of tuning/crossover.py (no NCCL between processes of
           one GPU); prints a table, the fixed costs fitted to it, and where the rule of
           tuning/crossover.py disagrees with the measurement. Meaningful with one GPU per rank only:
           processes sharing a GPU take turns on it in time slices, and a fused call waits for its
           peer's turn (2.3 ms per gemm_rs, 4.6 ms per ag_gemm on one H200, whatever the shape).

NCCL refuses two ranks on one GPU, so each rank computes its reference on the host from the shared
seeds. Every rank prints `ENTWINE_RANK <r> PASS|FAIL <detail>`; the launcher kills every rank of a
suite after --timeout seconds and prints a one-line summary last. Exit status 0 iff all ranks passed.

Layout: this script holds the suite table (SUITES); gpu_harness.py the launcher and the Rank base
class with the shared helpers; gpu_<concern>_suites.py the suites, one module per concern. A new
suite is a method of that name on a Rank subclass and one row in SUITES; `--suite all` and the GPU
pytest (tests/test_gpu_gemm_rs.py) pick it up.
"""

from __future__ import annotations

import argparse
import os
import sys

# The suite modules sit beside this script, which runs as `python3 -P tests/gpu_ranks.py` from any
# folder (-P: the script's folder is not on the path by itself).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_ag_suites import AgSuites  # noqa: E402
from gpu_cmdbuf_suites import CMDBUF_XLA_FLAGS, NO_CMDBUF_XLA_FLAGS, CmdbufSuites  # noqa: E402
from gpu_cost_suites import CostSuites  # noqa: E402
from gpu_fp8_suites import Fp8BlockSuites, Fp8Suites  # noqa: E402
from gpu_gemm_rs_suites import GemmRsSuites  # noqa: E402
from gpu_harness import MISSING_TIMEOUT_MS, Suite, launch, rank_main  # noqa: E402
from gpu_heap_suites import HEAPGROW_XLA_FLAGS, HeapSuites  # noqa: E402
from gpu_moe_suites import MoeSuites  # noqa: E402
from gpu_protocol_suites import FORWARD_HELD_SMS, ProtocolSuites  # noqa: E402

MISSING_ENV = {"ENTWINE_TIMEOUT_MS": str(MISSING_TIMEOUT_MS)}
# A mismatch fails at once; the longer deadline covers a first compile.
MISMATCH_ENV = {"ENTWINE_TIMEOUT_MS": str(10 * MISSING_TIMEOUT_MS)}
# The MoE suites: a 20 s device deadline; a heap exchange that gives up in 30 s; XLA's autotuning
# unsharded (sharded, each process waits in the KV store for the others' results, without a deadline
# of ours, so one rank that failed early would hold its peers in their next compile).
MOE_ENV = {"ENTWINE_TIMEOUT_MS": "20000", "ENTWINE_SETUP_TIMEOUT_MS": "30000",
           "XLA_FLAGS": "--xla_gpu_shard_autotuning=false"}

# Every suite by name, in the order `--suite all` runs the checking ones.
SUITES = {
    "quick": Suite(GemmRsSuites),
    "ag": Suite(AgSuites),
    "stress": Suite(GemmRsSuites),
    "mixed": Suite(AgSuites),
    "missing": Suite(ProtocolSuites, env=MISSING_ENV),
    "agmissing": Suite(ProtocolSuites, env=MISSING_ENV),
    "cmdbuf": Suite(CmdbufSuites, env={"XLA_FLAGS": CMDBUF_XLA_FLAGS}),
    "cmdbufmissing": Suite(CmdbufSuites, env={"XLA_FLAGS": CMDBUF_XLA_FLAGS, **MISSING_ENV}),
    "skipcall": Suite(ProtocolSuites, env=MISMATCH_ENV),
    "disagree": Suite(ProtocolSuites, env=MISMATCH_ENV),
    "heapgrow": Suite(HeapSuites),
    "heapgrow_cmdbuf": Suite(HeapSuites, env={"XLA_FLAGS": HEAPGROW_XLA_FLAGS}, part_of="heapgrow"),
    "fp8kernels": Suite(Fp8Suites),
    "fp8": Suite(Fp8Suites),
    "fp8half": Suite(Fp8Suites),
    "fp8block": Suite(Fp8BlockSuites),
    # A deadline well inside the suite's time limit: a wait that never ends reports its peer.
    "moe": Suite(MoeSuites, env=MOE_ENV),
    "moemlp": Suite(MoeSuites, env=MOE_ENV),
    # XLA's default command buffers record some of the scan's calls: the plain launch turns them off.
    "moestack": Suite(MoeSuites, env={**MOE_ENV, "XLA_FLAGS": f"{MOE_ENV['XLA_FLAGS']} {NO_CMDBUF_XLA_FLAGS}"}),
    "moestack_cmdbuf": Suite(MoeSuites, env={**MOE_ENV, "XLA_FLAGS": f"{MOE_ENV['XLA_FLAGS']} {CMDBUF_XLA_FLAGS}"},
                             part_of="moestack"),
    # The SMs that rank 0's held kernel takes (read once per process).
    "forward": Suite(ProtocolSuites, env={"ENTWINE_SM_RESERVE": str(FORWARD_HELD_SMS)}),
    "hostcost": Suite(CostSuites, checking=False),
    "smallshapes": Suite(CostSuites, checking=False),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="number of ranks (processes), 1..8")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs to spread the ranks over (rank r on GPU r %% gpus)")
    parser.add_argument("--suite", default="quick", help=f"{', '.join(SUITES)}, all, or a comma-separated list")
    parser.add_argument("--timeout", type=float, default=900, help="wall-clock limit per suite in seconds; stragglers are killed")
    parser.add_argument("--mps", action="store_true",
                        help="run the ranks as clients of a private CUDA MPS server (concurrent, not time-sliced)")
    parser.add_argument("--mps-percent", type=int, default=None,
                        help="with --mps: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of every rank (1..100)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.world <= 8:
        parser.error(f"--world must be in [1, 8], got {args.world}")
    if args.mps_percent is not None and not (args.mps and 1 <= args.mps_percent <= 100):
        parser.error("--mps-percent needs --mps and a value in [1, 100]")
    unknown = [s for s in args.suite.split(",") if s not in SUITES] if args.suite != "all" else []
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(SUITES)}, all")
    return launch(args, SUITES) if args.rank is None else rank_main(args, SUITES)


if __name__ == "__main__":
    sys.exit(main())
