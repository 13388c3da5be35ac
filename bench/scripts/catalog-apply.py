#!/usr/bin/env python3
"""How long `tollgate catalog diff` and `apply` take on a catalog file of N clients
(issue 37's goal: 10,000 clients, diff under 5 s, apply under 30 s, atomic).

Usage: bench/scripts/catalog-apply.py [--clients 10000] [--runs 5] [--json FILE]
       (needs target/release/tollgate and redis-server)

A real redis-server and the release gateway on free ports. Two TOML files of N clients
(one key each, on two plans) that differ in every client's mode, so each apply writes N
records: the catalog is first put from file A (forced), then each run diffs the other
file (a dry run of N changes) and applies it over the version diffed, alternating. Each
is the wall time of the whole command (process start, reading and sending the file, the
gateway's checks and diff, the store's staging and commit). Reports the median and the
worst of the runs, and the host's CPU steal over them.
"""

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "target" / "release" / "tollgate"
SECRET = "bench-secret-please-change-0123456789"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_times():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[7] if len(fields) > 7 else 0


def catalog_toml(n, mode):
    out = ['[[plans]]\nname = "gold"\n\n[[plans.limits]]\nname = "burst"\ncapacity = 100.0\nrate = 10.0\n',
           '[[plans]]\nname = "silver"\ncapacity = 10.0\nrate = 1.0\n']
    for i in range(n):
        plan = "gold" if i % 2 else "silver"
        out.append(
            f'[[clients]]\nid = "c{i:06}"\nplan = "{plan}"\nmode = "{mode}"\nshards = {{ regions = ["eu"] }}\n'
            f'overrides = []\n\n[[clients.keys]]\nhash = "sha256:{i:064x}"\ncreated_at = 1700000000\n'
        )
    return "\n".join(out)


def script_names():
    """Each Lua script's SHA-1 as the gateway loads it (key_filter.lua before those that
    use it), to name the calls in the slow log."""
    lua = REPO / "lua"
    prefix = (lua / "key_filter.lua").read_bytes()
    names = {}
    for f in lua.glob("*.lua"):
        body = f.read_bytes()
        for text in (body, prefix + body):
            names[hashlib.sha1(text).hexdigest()] = f.name
    return names


def slow_durations(port):
    """The duration (µs) of every call in Redis' slow log, read as JSON-free RESP lines."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "--json", "SLOWLOG", "GET", "10000"],
        check=True, capture_output=True, text=True,
    ).stdout
    return [(entry[2], " ".join(str(a) for a in entry[3][:2])[:60]) for entry in json.loads(out)]


def run(cmd, env):
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.monotonic() - t0
    return p.returncode, took, p.stdout + p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not BIN.exists():
        sys.exit(f"{BIN} is missing: cargo build --release --bin tollgate")
    tmp = Path(tempfile.mkdtemp(prefix="catalog-apply-"))
    rport, gport = free_port(), free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    cfg = tmp / "gw.toml"
    cfg.write_text(
        f'[server]\nlisten = "127.0.0.1:{gport}"\n[admin]\njwt_hs256_secret = "{SECRET}"\n'
        f'[redis]\nurl = "redis://127.0.0.1:{rport}"\ncontrol_timeout_ms = 30000\n'
        f'[catalog]\ncache_file = ""\nfile = "{tmp}/catalog.json"\n'
        f'[[routes]]\nservice = "s"\nprefix = "/s"\nupstreams = ["http://127.0.0.1:9"]\n'
    )
    gw = subprocess.Popen([BIN, "--config", cfg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        token = subprocess.run(
            [BIN, "--config", cfg, "token", "--sub", "bench"], capture_output=True, text=True, check=True
        ).stdout.strip()
        env = dict(os.environ, TOLLGATE_URL=f"http://127.0.0.1:{gport}", TOLLGATE_ADMIN_TOKEN=token)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", gport), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        files = []
        for mode in ("enforce", "shadow"):
            f = tmp / f"catalog-{mode}.toml"
            f.write_text(catalog_toml(a.clients, mode))
            files.append(f)
        size = files[0].stat().st_size
        code, _, said = run([BIN, "catalog", "apply", files[0], "--force"], env)
        if code != 0:
            sys.exit(f"seeding failed: {said}")
        # Every call over 1 ms is kept: the longest hold Redis (and every gateway's
        # decisions on it) while they run.
        subprocess.run(["redis-cli", "-p", str(rport), "CONFIG", "SET", "slowlog-log-slower-than", "1000"],
                       check=True, capture_output=True)
        subprocess.run(["redis-cli", "-p", str(rport), "CONFIG", "SET", "slowlog-max-len", "10000"],
                       check=True, capture_output=True)
        subprocess.run(["redis-cli", "-p", str(rport), "SLOWLOG", "RESET"], check=True, capture_output=True)
        diffs, applies = [], []
        total0, steal0 = cpu_times()
        for i in range(a.runs):
            f = files[(i + 1) % 2]
            code, took, said = run([BIN, "catalog", "diff", f], env)
            if code != 1 or f"{a.clients} record(s)" not in said:
                sys.exit(f"diff {i}: exit {code}: {said[:500]}")
            diffs.append(took)
            code, took, said = run([BIN, "catalog", "apply", f], env)
            if code != 0 or "applied" not in said:
                sys.exit(f"apply {i}: exit {code}: {said[:500]}")
            applies.append(took)
        total1, steal1 = cpu_times()
        # The longest call of each kind (a staging chunk, the commit, a dump's page).
        names = script_names()
        longest = {}
        for d, what in slow_durations(rport):
            parts = what.split()
            what = names.get(parts[1], parts[1]) if parts[0] == "EVALSHA" and len(parts) > 1 else what
            longest[what] = max(longest.get(what, 0), d)
        slowest = sorted(((d, w) for w, d in longest.items()), reverse=True)
        commits = [d for d, _ in slowest]
        steal = 100.0 * (steal1 - steal0) / max(1, total1 - total0)
        result = {
            "clients": a.clients,
            "file_bytes": size,
            "runs": a.runs,
            "diff_s": {"median": statistics.median(diffs), "worst": max(diffs), "all": diffs},
            "apply_s": {"median": statistics.median(applies), "worst": max(applies), "all": applies},
            "cpu_steal_pct": round(steal, 2),
            "longest_store_calls_ms": [round(d / 1000, 1) for d in commits],
            "longest_store_calls": [f"{d / 1000:.1f} ms {what}" for d, what in slowest],
        }
        print(
            f"{a.clients} clients ({size / 1e6:.1f} MB of TOML), {a.runs} runs, steal {steal:.1f}%:\n"
            f"  diff  median {result['diff_s']['median']:.2f} s, worst {result['diff_s']['worst']:.2f} s\n"
            f"  apply median {result['apply_s']['median']:.2f} s, worst {result['apply_s']['worst']:.2f} s"
            f" (its own diff included; {a.clients} records written)\n"
            f"  the longest store calls: {'; '.join(f'{d / 1000:.1f} ms {w}' for d, w in slowest)}"
        )
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        gw.terminate()
        redis.terminate()
        gw.wait()
        redis.wait()


if __name__ == "__main__":
    main()
