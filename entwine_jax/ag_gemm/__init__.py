# ag_gemm: fused AllGather + GEMM. op.py checks and plans a call site and runs the fused kernels
# (fused.py, as plan.py's C++ plan says) or the XLA reference (reference.py); config.py holds its
# printable config and heuristic. op.SPEC declares it to shared code (entwine_jax.opspec), its backward a
# gemm_rs.
