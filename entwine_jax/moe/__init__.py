# moe: the mixture-of-experts ops moe_dispatch_gemm (token slots to their experts' static
# [E_local, W*C] segments, times w1) and moe_gemm_combine (times w2, back to the tokens, weighted by
# the router), each the other's backward. op.py checks and plans a call and pairs the two in one
# custom VJP; reference.py is the XLA reference; fused.py and fp8_op.py the kernels' calls; config.py
# its config. docs/design.md, "Mixture of experts".
