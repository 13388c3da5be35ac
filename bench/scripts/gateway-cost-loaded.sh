#!/usr/bin/env bash
# Instructions and allocations per request of a saturated gateway (or the floor), counted
# by callgrind: `gateway-cost.sh` counts lone requests (one take per Redis call); this
# counts them where throughput is decided, with the takes of many requests sharing calls.
#
#   bench/scripts/gateway-cost-loaded.sh [gw|floor] [CLIENTS=10000]
#
# It runs `tollgate-bench throughput` (256 connections, pinned, one worker) with the target
# under callgrind, zeroes the counts 8 s into its measurement and dumps them 15 s later,
# then divides by the requests served in between (counted by calls that happen once per
# request: `SafetyLimit::take` for the gateway, `HttpRequest`'s drop, twice per request,
# for the floor). The release build in target/release is used, or BIN=path/to/tollgate-bench
# (the gateway beside it); KEEP=dir keeps the profile (callgrind_annotate it).
# Needs valgrind and python3 (Debian: valgrind, python3).
set -euo pipefail
kind=${1:-gw}
clients=${2:-10000}
out=${KEEP:-$(mktemp -d)}
[ -n "${KEEP:-}" ] || trap 'rm -rf "$out"' EXIT
bin=${BIN:-target/release/tollgate-bench}
[ -x "$bin" ] || { echo "build first: cargo build --release --workspace" >&2; exit 1; }
case $kind in
  gw) wrapper=TOLLGATE_BENCH_WRAPPER; row="round 1: tollgate"; only=--no-floor ;;
  floor) wrapper=TOLLGATE_BENCH_FLOOR_WRAPPER; row="round 1: floor"; only= ;;
  *) echo "gw or floor" >&2; exit 2 ;;
esac
env "$wrapper=valgrind --tool=callgrind --callgrind-out-file=$out/cg.%p.out" \
  "$bin" throughput --workers 1 --clients "$clients" --pin --conns 256 --rounds 1 \
  --duration 30 --warmup 3 --no-nginx --no-embedded $only >"$out/run.log" 2>&1 &
bench=$!
for _ in $(seq 1 180); do grep -q "$row" "$out/run.log" && break; sleep 1; done
pid=$(pgrep -f "callgrind-out-file=$out" | head -1)
[ -n "$pid" ] || { echo "the target did not start; see $out/run.log" >&2; exit 1; }
sleep 8
callgrind_control -z "$pid" >/dev/null 2>&1
sleep 15
callgrind_control -d "$pid" >/dev/null 2>&1
wait "$bench"
PYTHONPATH="$(dirname "$0")" python3 - "$out" "$kind" <<'PY'
import glob, sys
from callgrind_profile import profile
out, kind = sys.argv[1], sys.argv[2]
total, calls = profile(sorted(glob.glob(f"{out}/cg.*.out.*"))[0])
if kind == "gw":
    n = calls["tollgate::limiter::safety::SafetyLimit::take"]
else:
    n = calls["<actix_web::request::HttpRequest as core::ops::drop::Drop>::drop"] / 2
malloc = calls["mi_malloc_aligned"]
print(f"{kind}: {total / n:,.0f} instructions per request, {malloc / n:.1f} malloc, "
      f"{calls['send'] / n:.2f} send, {calls['recv'] / n:.2f} recv ({n:.0f} requests)")
PY
[ "$kind" = floor ] || grep -E "takes per Redis call" "$out/run.log" || true
