#!/usr/bin/env bash
# Instructions Redis executes per decision of the limits script (lua/bucket.lua), counted
# by callgrind: independent of the machine's load, unlike CPU time. Each call carries
# ENTRIES takes of clients drawn from KEYS, on one bucket (CAPACITY and RATE in the
# environment; default 1e9 and 1e9, a bucket that never refuses, as the `redis` scenario
# uses); the count covers everything redis-server does for the calls (reading them, the
# script, its redis.calls, the reply), warm-up excluded. Under callgrind Redis runs about
# 50x slower: with many KEYS a client's state is revisited after its expiry margin, which
# in real time it would not be, so PEXPIRE runs more often than it would (use few KEYS, or
# a low RATE, to see the steady state).
#
#   bench/scripts/script-cost.sh [ENTRIES=32] [CALLS=200] [KEYS=2000] [SCRIPT=lua/bucket.lua]
#
# Only this valgrind process is zeroed and dumped (by its pid), not others on the machine.
# Needs valgrind, redis-server and redis-benchmark (Debian: valgrind, redis-server, redis-tools).
set -euo pipefail
entries=${1:-32}
calls=${2:-200}
keys=${3:-2000}
script=${4:-lua/bucket.lua}
port=${PORT:-7790}
out=$(mktemp -d)
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$out"' EXIT

valgrind --tool=callgrind --vgdb=yes --callgrind-out-file="$out/cg" \
  redis-server --port "$port" --save '' --appendonly no >/dev/null 2>&1 &
vg=$!
for _ in $(seq 200); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat "$script")")
# EVALSHA sha n key... 0 (no undeclared keys) 1 (one limit set: one bucket) then per entry
# t(ake) cost 1, 1 request, set 1.
args=(EVALSHA "$sha" "$entries")
for _ in $(seq "$entries"); do args+=("tollgate:b:{__rand_int__}"); done
args+=(0 1 1 "" b "${CAPACITY:-1000000000}" "${RATE:-1000000000}" "" "")
for _ in $(seq "$entries"); do args+=(t 1 1 1); done
# Warm-up (every client's state created), then count only the measured calls.
redis-benchmark -p "$port" -r "$keys" -c 4 -n $(( (keys * 2) / entries + 1 )) -q "${args[@]}" >/dev/null 2>&1
callgrind_control -z "$vg" >/dev/null 2>&1
redis-benchmark -p "$port" -r "$keys" -c 4 -n "$calls" -q "${args[@]}" >/dev/null 2>&1
callgrind_control -d "$vg" >/dev/null 2>&1
ir=$(callgrind_annotate "$out"/cg.* 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')
echo "$script: $entries entries per call, $calls calls, $keys clients: $(( ir / (calls * entries) )) instructions per decision"
