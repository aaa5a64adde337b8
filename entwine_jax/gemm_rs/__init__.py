# gemm_rs: fused GEMM + ReduceScatter. op.py checks and plans a call site and runs the fused kernels
# (fused.py, as plan.py's C++ plan says) or the XLA reference (reference.py); config.py holds its
# printable config and heuristic, table.py its tuned configs (tuned_configs.json shipped, the user
# cache tune() writes). op.SPEC declares it to shared code (entwine_jax.opspec), its backward an ag_gemm.
