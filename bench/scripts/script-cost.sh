#!/usr/bin/env bash
# Instructions Redis executes per decision of the limits script (engine/lua/bucket.lua), counted
# by callgrind: independent of the machine's load, unlike CPU time. Each call carries
# ENTRIES takes of clients drawn from KEYS, on one bucket (CAPACITY and RATE in the
# environment; default 1e9 and 1e9, a bucket that never refuses, as the `redis` scenario
# uses), on one server (one state group); SWEEP fields of the group are swept every
# tenth call (default 256, what a gateway sends at most every 100 ms). The count covers
# everything redis-server does for the calls (reading them, the script, its redis.calls,
# the reply), warm-up excluded.
#
#   bench/scripts/script-cost.sh [ENTRIES=32] [CALLS=200] [KEYS=2000] [SCRIPT=engine/lua/bucket.lua]
#
# The calls are sent by python3 over a plain socket (the arguments are binary). Only this
# valgrind process is zeroed and dumped (by its pid), not others on the machine.
# Needs valgrind, redis-server, redis-cli and python3 (Debian: valgrind, redis-server,
# redis-tools, python3).
set -euo pipefail
entries=${1:-32}
calls=${2:-200}
keys=${3:-2000}
script=${4:-engine/lua/bucket.lua}
port=${PORT:-7790}
out=${KEEP:-$(mktemp -d)}
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; [ -n "${KEEP:-}" ] || rm -rf "$out"' EXIT

valgrind --tool=callgrind --vgdb=yes --callgrind-out-file="$out/cg" \
  redis-server --port "$port" --save '' --appendonly no >/dev/null 2>&1 &
vg=$!
for _ in $(seq 200); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat "$script")")

# Sends N calls: EVALSHA sha 1 <group> 0 <sweep> 1 (one limit set: one bucket) then the
# entries as one run (struct '<HBdIHH': ENTRIES takes, cost 1, 1 request, set 1, group 1)
# and their tags, distinct clients.
drive() {
  python3 - "$port" "$sha" "$entries" "$keys" "$1" "${CAPACITY:-1000000000}" \
    "${RATE:-1000000000}" "${SWEEP:-256}" <<'PY'
import random, socket, struct, sys
port, sha, entries, keys, n, cap, rate, sweep = sys.argv[1:9]
entries, keys, n, sweep = int(entries), int(keys), int(n), int(sweep)
s = socket.create_connection(("127.0.0.1", int(port)))
f = s.makefile("rb")
def cmd(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)
def skip():
    line = f.readline()
    if line[:1] == b"*":
        for _ in range(int(line[1:])):
            skip()
    elif line[:1] == b"$" and int(line[1:]) >= 0:
        f.read(int(line[1:]) + 2)
    elif line[:1] == b"-":
        sys.exit("redis: " + line.decode())
spec = struct.pack("<HBdIHH", entries, ord("t"), 1.0, 1, 1, 1)
for i in range(n):
    tags = ["c%d" % c for c in random.sample(range(keys), entries)]
    swept = sweep if i % 10 == 0 else 0
    s.sendall(cmd(["EVALSHA", sha, 1, "tollgate:s:{0}", 0, swept, 1, 1, "", "b", cap, rate,
                   "", "", spec] + tags))
    skip()
PY
}
# Warm-up (every client's state created), then count only the measured calls.
drive $(( (keys * 2) / entries + 1 ))
callgrind_control -z "$vg" >/dev/null 2>&1
drive "$calls"
callgrind_control -d "$vg" >/dev/null 2>&1
ir=$(callgrind_annotate "$out"/cg.* 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')
echo "$script: $entries entries per call, $calls calls, $keys clients: $(( ir / (calls * entries) )) instructions per decision"
