# gemm_rs: fused GEMM + ReduceScatter. op.py checks and plans a call site and runs the fused kernels
# (fused.py, as plan.py's C++ plan says) or the XLA reference (reference.py); config.py holds its
# printable config and heuristic. Its custom VJP, which pairs it with ag_gemm, is entwine_jax.pairing.
