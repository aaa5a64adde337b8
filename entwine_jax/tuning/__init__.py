# Tuning: tune.py the timing loop that fills gemm_rs's tuned-config cache (imported only when tune()
# runs; the table it fills is entwine_jax/gemm_rs/table.py), timing.py its timing helpers,
# crossover.py the small-call rule every op's call site asks.
