#!/bin/bash
# Compiler launcher of the kernel sources (CMakeLists.txt, ENTWINE_WGMMA_GUARD): runs the compile,
# passes its output through, and fails it when ptxas reports serialized wgmma (C7510/C7514/C7520).
# ptxas prints that as "info", not as a warning, and a serialized mainloop runs 10-30% slower with
# correct results, so without this it only shows up in a benchmark on a GPU (docs/performance.md,
# "What was tried").
output=$("$@" 2>&1)
status=$?
[ -n "$output" ] && printf '%s\n' "$output" >&2
if [ $status -eq 0 ] && grep -q "Potential Performance Loss: wgmma" <<<"$output"; then
  echo "error: ptxas serialized wgmma instructions (see the info line above); a mainloop must not read" \
       "its accumulators while its wgmma are in flight. Configure with -DENTWINE_WGMMA_GUARD=OFF to build anyway." >&2
  exit 1
fi
exit $status
