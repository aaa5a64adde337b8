# Tuned configs: table.py is the lookup gemm_rs makes at trace time (and the cache format), tune.py
# the timing loop that fills the cache (imported only when tune() runs), timing.py its timing helpers.
