#!/bin/bash
# Producer A/B on one GPU: installs each wheel .devbin/<name>/*.whl (built with
# ENTWINE_BUILD_HARNESS=ON), runs each build's harness test once, optionally (NCU=1) reads the
# isolated counters of each build (ncu: time, L2 sectors, SM cycles, tensor pipe busy; third launch),
# then runs each build's producer bench (which times cuBLASLt, its fastest algorithm, in the same
# interleaved rounds) in alternating rounds.
# Usage: [NCU=1] scripts/ab_producer.sh ROUNDS NAME... ; logs under $OUT (or /tmp/ab), summary last.
# Read the cuBLASLt column too: under the 700 W cap a build that leaves the GPU hotter slows the
# cuBLASLt launches of its own rounds, which moves the ratio without the producer changing.
set -u
ROUNDS=$1; shift
LOGS=${OUT:-/tmp/ab}
mkdir -p "$LOGS" /tmp/ab_logs
CUBLAS=$(find / -name 'libcublasLt.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
[ -n "$CUBLAS" ] && export LD_LIBRARY_PATH=$(dirname "$CUBLAS")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SUMMARY="$LOGS/ab_summary.txt"; : > "$SUMMARY"
for v in "$@"; do
  python3 -m pip install -q --upgrade --no-deps --no-index --no-compile --target /tmp/ab_$v .devbin/$v/*.whl || exit 1
  timeout 120 /tmp/ab_$v/entwine_jax/bin/entwine_harness test > /tmp/ab_logs/test_$v.log 2>&1
  echo "$v: harness test rc=$? ($(tail -1 /tmp/ab_logs/test_$v.log))" >> "$SUMMARY"
done
if [ -n "${NCU:-}" ]; then
  METRICS=gpu__time_duration.sum,lts__t_sectors.sum,sm__cycles_active.avg,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  for shape in "16384 8192 1024" "8192 8192 1024" "8192 8192 3584" "16384 16384 6656"; do
    for v in "$@"; do
      r=$(timeout 60 ncu --clock-control none --metrics $METRICS --kernel-name regex:producer_kernel --launch-skip 2 \
          --launch-count 1 /tmp/ab_$v/entwine_jax/bin/entwine_harness producer $shape 256 132 8 2>&1 \
          | grep -E "^\s+(gpu__|sm__|lts__)" | awk '{printf "%s ", $NF}')
      echo "ncu ${shape// /x} n256 inter+flags r8, $v: µs, L2 sectors, cycles, tensor %: $r" >> "$SUMMARY"
    done
  done
fi
for r in $(seq 1 "$ROUNDS"); do
  for v in "$@"; do
    /tmp/ab_$v/entwine_jax/bin/entwine_harness bench "/tmp/ab_logs/producer_${v}_r$r.jsonl" producer > "/tmp/ab_logs/producer_${v}_r$r.log" 2>&1
  done
done
# Per shape and build: the median over rounds of the producer variant, of cuBLASLt, and their ratio.
python3 - "$ROUNDS" "$@" >> "$SUMMARY" <<'PY'
import json, sys, statistics, collections
rounds, names = int(sys.argv[1]), sys.argv[2:]
shown = ["n256 pers inter+flags r8", "n256 pers inter+flags r8 split", "n128 pers inter+flags r8"]
rows = collections.defaultdict(dict)
for v in names:
    ms = collections.defaultdict(list)
    for r in range(1, rounds + 1):
        for line in open(f"/tmp/ab_logs/producer_{v}_r{r}.jsonl"):
            d = json.loads(line)
            if d.get("kind") == "producer":
                ms[(d["m"], d["n"], d["k"], d["variant"])].append(d["ms"])
    for (m, n, k, var), t in ms.items():
        rows[(m, n, k)][(v, var)] = statistics.median(t)
for s in shown:
    print(f"{s}: producer ms, cuBLASLt ms (same rounds), cuBLASLt / producer")
    print(f"{'shape':>18}" + "".join(f" | {v[:20]:>20}" for v in names))
    for shape, d in rows.items():
        line = f"{'x'.join(map(str, shape)):>18}"
        for v in names:
            c, p = d.get((v, "cublas"), float("nan")), d.get((v, s), float("nan"))
            line += f" | {p:6.3f} {c:6.3f} {c / p:5.3f}"
        print(line)
PY
cat "$SUMMARY"
