#!/usr/bin/env bash
# Instructions the gateway and the floor (bare actix-web + awc) execute per request,
# counted by callgrind: independent of the machine's load, unlike CPU time, so two
# builds can be compared where `throughput` swings 10-30% from run to run. Also counts
# the system calls and allocations behind them (recv, send, malloc per request).
#
#   bench/scripts/gateway-cost.sh [RATE=400] [extra `tollgate-bench latency` options]
#
# It runs the `latency` scenario twice (10 s and 30 s per side, RATE requests/s, 10,000
# clients, a decision budget of 1 s so nothing fails open under valgrind), the gateway
# and the floor each under callgrind, and divides the difference between the two runs by
# the difference in requests. Start-up and warm-up do not quite cancel out: the catalog's
# seed into a fresh Redis (10,000 clients) is polled a different number of times in each
# process, and a timer's work (the key-use flush, every minute) lands in one run and not
# the other, by up to ±5,000 instructions per request at 2,000 requests counted. So two
# more lines count only the gateway's actix worker threads (every request is handled
# there) and, within them, the HTTP/1.1 dispatcher (all request handling; the floor's too):
# those are the figures to compare builds by, to within a few hundred. The release build in
# target/release is used, or BIN=path/to/tollgate-bench (the gateway beside it: to count a
# build kept aside); KEEP=dir keeps the profiles (callgrind_annotate them).
# Per request counts depend on how many takes share a Redis call (printed): at low
# rates about one per call. Needs valgrind and python3 (Debian: valgrind, python3).
set -euo pipefail
rate=${1:-400}
shift || true
out=${KEEP:-$(mktemp -d)}
mkdir -p "$out"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$out"' EXIT
bin=${BIN:-target/release/tollgate-bench}
[ -x "$bin" ] || { echo "build first: cargo build --release --workspace" >&2; exit 1; }
for d in 10 30; do
  TOLLGATE_BENCH_WRAPPER="valgrind --tool=callgrind --callgrind-out-file=$out/gw-$d.%p.out" \
  TOLLGATE_BENCH_FLOOR_WRAPPER="valgrind --tool=callgrind --callgrind-out-file=$out/floor-$d.%p.out" \
    "$bin" latency --rate "$rate" --duration "$d" --clients 10000 --warmup 3 --timeout-ms 1000 \
      --no-redis-floor "$@" \
    >"$out/run-$d.log" 2>&1
done
PYTHONPATH="$(dirname "$0")" python3 - "$out" <<'PY'
import glob, re, sys
from callgrind_profile import inclusive, profile
out = sys.argv[1]
worker = "tokio::runtime::local_runtime::runtime::LocalRuntime::block_on"
dispatch = "<actix_http::h1::dispatcher::Dispatcher<T,S,B,X,U> as core::future::future::Future>::poll"

def requests(d, row):
    for line in open(f"{out}/run-{d}.log"):
        if line.startswith("| " + row):
            return int(line.split("|")[2])

counted = {"recv": r"^recv$", "send": r"^send$", "malloc": r"^mi_malloc_aligned$"}
for kind, row in (("floor", "floor"), ("gw", "through tollgate")):
    runs = [profile(glob.glob(f"{out}/{kind}-{d}.*.out")[0]) for d in (10, 30)]
    n = requests(30, row) - requests(10, row)
    line = f"{row:18s} {(runs[1][0] - runs[0][0]) / n:9,.0f} instructions per request"
    for name, pat in counted.items():
        c = sum(v for k, v in runs[1][1].items() if k and re.search(pat, k))
        c -= sum(v for k, v in runs[0][1].items() if k and re.search(pat, k))
        line += f", {c / n:.2f} {name}"
    print(line + f" ({n} requests)")
    parts = [inclusive(glob.glob(f"{out}/{kind}-{d}.*.out")[0], {worker, dispatch}) for d in (10, 30)]
    for label, fn in (("  actix workers", worker), ("  h1 dispatch", dispatch)):
        # The floor's workers run on actix-rt's runtime, not tokio's LocalRuntime: none.
        if parts[1][fn]:
            print(f"{label:18s} {(parts[1][fn] - parts[0][fn]) / n:9,.0f} instructions per request")
for line in open(f"{out}/run-30.log"):
    if line.startswith("Redis calls"):
        print(line.split(".  ")[0].split(" Fail-opens")[0])
PY
