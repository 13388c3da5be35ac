#!/usr/bin/env bash
# Two builds' added latency, alternating run by run so that both meet the same host:
#
#   bench/scripts/compare-latency.sh OLD_BENCH NEW_BENCH [RUNS=5] [OUT=dir]
#
# OLD_BENCH and NEW_BENCH are `tollgate-bench` binaries (each starts the gateway built
# beside it). Each run is `latency --rate 1000 --duration 10 --clients 10000
# --no-redis-floor`; the logs go to OUT (default: a new temporary directory), and a line per
# run gives the direct, through-tollgate and added p99 and the host's CPU steal.
set -euo pipefail
old=$1 new=$2 runs=${3:-5} out=${4:-$(mktemp -d)}
mkdir -p "$out"
for i in $(seq "$runs"); do
  for side in old new; do
    bin=$old; [ "$side" = new ] && bin=$new
    "$bin" latency --rate 1000 --duration 10 --clients 10000 --no-redis-floor --wait-idle 20 \
      >"$out/$side-$i.log" 2>&1
    printf '%s run %s: p99 ms direct / through / added:' "$side" "$i"
    grep -E '^\| (direct|through|\*\*added by the gateway)' "$out/$side-$i.log" |
      awk -F'|' '{printf " %s", $7}'
    printf ', %s\n' "$(grep -o 'stole [0-9.]*%' "$out/$side-$i.log")"
  done
done
echo "logs in $out"
