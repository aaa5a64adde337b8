#!/bin/bash
# Producer A/B on one GPU: installs each wheel .devbin/<name>/*.whl (built with
# ENTWINE_BUILD_HARNESS=ON), runs each build's harness test once, then its producer bench
# (which times cuBLASLt, its fastest algorithm, in the same interleaved rounds) in alternating rounds.
# Usage: scripts/ab_producer.sh ROUNDS NAME... ; logs under $OUT (or /tmp/ab).
set -u
ROUNDS=$1; shift
LOGS=${OUT:-/tmp/ab}
mkdir -p "$LOGS"
CUBLAS=$(find / -name 'libcublasLt.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
[ -n "$CUBLAS" ] && export LD_LIBRARY_PATH=$(dirname "$CUBLAS")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for v in "$@"; do
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/ab_$v .devbin/$v/*.whl || exit 1
  /tmp/ab_$v/entwine_jax/bin/entwine_harness test > "$LOGS/test_$v.log" 2>&1
  echo "$v: harness test rc=$? ($(tail -1 "$LOGS/test_$v.log"))"
done
for r in $(seq 1 "$ROUNDS"); do
  for v in "$@"; do
    /tmp/ab_$v/entwine_jax/bin/entwine_harness bench "$LOGS/producer_${v}_r$r.jsonl" producer > "$LOGS/producer_${v}_r$r.log" 2>&1
  done
done
# Summary: per shape, the median over rounds of each block width's interleaved+flags variant and its
# ratio to cuBLAS, per build.
python3 - "$LOGS" "$ROUNDS" "$@" <<'PY'
import json, sys, statistics, collections
logs, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
shown = ["n256 pers inter+flags r8", "n256 pers inter+flags r8 split", "n128 pers inter+flags r8"]
print("producer ms (median over rounds) and cuBLAS / producer, cuBLAS timed in the same rounds")
rows = collections.defaultdict(dict)
for v in names:
    ms = collections.defaultdict(list)
    for r in range(1, rounds + 1):
        for line in open(f"{logs}/producer_{v}_r{r}.jsonl"):
            d = json.loads(line)
            if d.get("kind") == "producer":
                ms[(d["m"], d["n"], d["k"], d["variant"])].append(d["ms"])
    for (m, n, k, var), t in ms.items():
        rows[(m, n, k)][(v, var)] = statistics.median(t)
print(f"{'shape':>18}" + "".join(f" | {v}:{s.split()[0] + (' split' if s.endswith('split') else ''):>5} ms ratio" for v in names for s in shown) + " | cuBLAS")
for shape, d in rows.items():
    line = f"{'x'.join(map(str, shape)):>18}"
    for v in names:
        c = d.get((v, "cublas"), float("nan"))
        for s in shown:
            p = d.get((v, s), float("nan"))
            line += f" | {' ' * (len(v) + 1)}{p:8.3f} {c / p:5.3f}"
    print(line + f" | {d.get((names[0], 'cublas'), float('nan')):.3f}")
PY
