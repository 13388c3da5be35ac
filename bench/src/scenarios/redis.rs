//! `redis`: what a decision costs Redis with 1, 1,000 and 10,000 active clients (issue 14).
//!
//! Redis alone, kept busy by the gateway's own store code (`Buckets::take` through the
//! coalescer, one multiplexed connection, `EVALSHA`) from one thread with `--concurrency`
//! takes in flight, on a one-bucket plan that never refuses. Every take draws its client
//! anew from N clients, uniformly (and, with `--zipf S`, Zipf-skewed as a second row per
//! N): with one client most takes share a script call (the coalescer), with 10,000 nearly
//! every take is a call of its own. Per N, in alternating rounds: decisions/s, takes per
//! `EVALSHA`, the µs inside `EVALSHA` per call (`INFO commandstats`), and Redis' process
//! CPU per decision (`used_cpu_sys + used_cpu_user`, minus what an idle Redis spends over
//! the same wall time, over the decisions). Each row starts with every one of its clients'
//! state in Redis.

use std::rc::Rc;
use std::time::Instant;

use serde_json::{json, Value};
use tollgate::domain::{Bucket, Limit, Limits};
use tollgate_testkit::{RedisCluster, RedisServer};

use super::seconds;
use super::takes::{client_key, Draw, Driver, RedisSpent};
use crate::report::{machine, round, Outcome, Table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Active clients, one row (or two, with `--zipf`) per count (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,1000,10000")]
    clients: Vec<usize>,
    /// Also draw clients Zipf-skewed with this exponent (a second row per count above 1);
    /// 0: uniform only.
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Takes in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Seconds per row per round.
    #[arg(long, default_value = "3", value_parser = seconds)]
    seconds: f64,
    /// Rounds: every row is measured once per round, in turn.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Seconds an idle Redis is watched for, to subtract its own CPU (timers, `hz`).
    #[arg(long, default_value = "2", value_parser = seconds)]
    idle_seconds: f64,
    /// On a local Redis Cluster of three masters (the gateway's cluster store) instead of
    /// one Redis; Redis CPU is then the masters' summed
    #[arg(long)]
    pub cluster: bool,
}

/// One row: N clients and how a take draws one.
struct Row {
    clients: usize,
    draw: Rc<Draw>,
    keys: Rc<Vec<String>>,
    spent: RedisSpent,
    ok: u64,
    failed: u64,
    wall: f64,
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(
        !a.clients.is_empty() && a.clients.iter().all(|&n| n > 0),
        "--clients needs counts above 0"
    );
    anyhow::ensure!(a.zipf >= 0.0 && a.zipf.is_finite(), "--zipf needs S >= 0");
    let machine = machine();
    // One Redis, or a cluster's three masters: what Redis spent is summed over `servers`.
    let cluster = if a.cluster {
        Some(RedisCluster::start()?)
    } else {
        None
    };
    let single;
    let (servers, driver): (&[RedisServer], Driver) = match &cluster {
        Some(c) => (&c.nodes, Driver::cluster(&c.urls())?),
        None => {
            single = [RedisServer::start()?];
            (&single, Driver::new(&single[0])?)
        }
    };
    let plan = Limits::new(vec![Limit::default_bucket(Bucket::new(1e9, 1e9)?)])?;
    let applied = plan.every();

    let mut rows = Vec::new();
    for &n in &a.clients {
        // Each row its own clients, so a row's first takes do not find another's state.
        let mut draws = vec![Draw::Uniform];
        if a.zipf > 0.0 && n > 1 {
            draws.push(Draw::zipf(n, a.zipf));
        }
        for draw in draws {
            let tag = match &draw {
                Draw::Zipf { .. } => "z",
                _ => "u",
            };
            let keys = (0..n)
                .map(|i| client_key(&format!("c{n}{tag}-{i}")))
                .collect();
            rows.push(Row {
                clients: n,
                draw: Rc::new(draw),
                keys: Rc::new(keys),
                spent: RedisSpent::default(),
                ok: 0,
                failed: 0,
                wall: 0.0,
            });
        }
    }
    eprintln!(
        "redis: {} rows, {} takes in flight, {} s per row x {} rounds ({machine})",
        rows.len(),
        a.concurrency,
        a.seconds,
        a.rounds
    );
    // Warm-up: loads the script, opens the connection.
    for row in &rows {
        driver.drive(&row.keys, &row.draw, &applied, a.concurrency, 0.3);
    }
    // Redis' own CPU when nobody calls it, per second of wall time.
    let idle_before = RedisSpent::read_all(servers)?;
    let idle_started = Instant::now();
    std::thread::sleep(std::time::Duration::from_secs_f64(a.idle_seconds));
    let idle = RedisSpent::read_all(servers)?.since(&idle_before);
    let idle_cpu_per_s = idle.cpu_s / idle_started.elapsed().as_secs_f64();

    for _round in 0..a.rounds {
        for row in &mut rows {
            // Every client's state created (each key taken once) just before: a client's
            // hash lives about 1 s past its last take on this plan (its time to refill,
            // plus 1 s), so a row measured after the others would otherwise start with
            // first-time inserts. Rarely drawn clients (Zipf's tail) still expire and
            // are created anew during the row, as in production.
            driver.touch(&row.keys, &applied, a.concurrency);
            let before = RedisSpent::read_all(servers)?;
            let started = Instant::now();
            let (ok, failed) =
                driver.drive(&row.keys, &row.draw, &applied, a.concurrency, a.seconds);
            row.wall += started.elapsed().as_secs_f64();
            row.spent
                .add(&RedisSpent::read_all(servers)?.since(&before));
            row.ok += ok;
            row.failed += failed;
        }
    }
    // Client state: fields of the state groups (`tollgate:s:{..}`), not counting each
    // group's sweep cursor (`~`).
    let (mut fields, mut groups) = (0u64, 0u64);
    for s in servers {
        let mut c = s.conn()?;
        let keys: Vec<String> = redis::cmd("KEYS").arg("tollgate:s:*").query(&mut c)?;
        for k in keys {
            let n: u64 = redis::cmd("HLEN").arg(&k).query(&mut c)?;
            let cursor: bool = redis::cmd("HEXISTS").arg(&k).arg("~").query(&mut c)?;
            fields += n - u64::from(cursor);
            groups += 1;
        }
    }

    let mut table = Table::new(&[
        "active clients",
        "draw",
        "decisions/s",
        "takes per EVALSHA",
        "µs inside EVALSHA per call",
        "µs inside EVALSHA per decision",
        "Redis CPU per decision µs",
        "Redis CPU s/s",
        "failed",
    ]);
    let mut json_rows = Vec::new();
    for row in &rows {
        let ok = row.ok.max(1) as f64;
        let evalsha = row.spent.calls("evalsha");
        let usec = row.spent.usec("evalsha") as f64;
        let per_call = usec / evalsha.max(1) as f64;
        let per_decision = usec / ok;
        let takes_per_call = row.ok as f64 / evalsha.max(1) as f64;
        let cpu_s = (row.spent.cpu_s - idle_cpu_per_s * row.wall).max(0.0);
        let cpu = cpu_s * 1e6 / ok;
        let rate = row.ok as f64 / row.wall;
        table.row(vec![
            row.clients.to_string(),
            row.draw.describe(),
            format!("{rate:.0}"),
            format!("{takes_per_call:.2}"),
            format!("{per_call:.1}"),
            format!("{per_decision:.2}"),
            format!("**{cpu:.2}**"),
            format!("{:.2}", row.spent.cpu_s / row.wall),
            row.failed.to_string(),
        ]);
        json_rows.push(json!({
            "clients": row.clients,
            "draw": row.draw.describe(),
            "takes": row.ok,
            "decisions_per_s": round(rate, 0),
            "evalsha": evalsha,
            "takes_per_evalsha": round(takes_per_call, 3),
            "evalsha_usec_per_call": round(per_call, 2),
            "evalsha_usec_per_decision": round(per_decision, 3),
            "redis_cpu_s": round(row.spent.cpu_s, 4),
            "redis_cpu_per_decision_us": round(cpu, 3),
            "redis_cpu_s_per_s": round(row.spent.cpu_s / row.wall, 3),
            "other_commands": row.spent.commands.iter()
                .filter(|(c, _)| c.as_str() != "evalsha")
                .map(|(c, &(calls, usec))| (c.clone(), json!({"calls": calls, "usec": usec})))
                .collect::<serde_json::Map<String, Value>>(),
            "failed": row.failed,
        }));
    }
    let markdown = format!(
        "### redis: Redis CPU per decision by active clients{}, {} takes in flight through \
         `Buckets::take`, one bucket that never refuses, {} s per row x {} rounds\n\n{}\n\
         Redis CPU per decision: `used_cpu_sys + used_cpu_user` over the rounds, minus an \
         idle Redis' {:.2} ms/s over the same wall time, / decisions; µs inside EVALSHA: \
         `INFO commandstats`; Redis CPU s/s: how busy Redis was (1.00: one full core, what \
         one Redis core decides at most is then decisions/s). Takes per EVALSHA above 1: \
         takes shared a script call (of one client: the coalescer; of several: the \
         gathering of a worker's turn, on a cluster within one master). {} clients' states \
         in {} state groups in Redis at the end. The caller shares the machine's two cores with Redis. \
         {machine}.\n",
        if a.cluster {
            " on a Redis Cluster of three masters (their CPU summed)"
        } else {
            ""
        },
        a.concurrency,
        a.seconds,
        a.rounds,
        table.render(),
        idle_cpu_per_s * 1e3,
        fields,
        groups,
    );
    let json = json!({
        "scenario": "redis",
        "cluster": a.cluster,
        "concurrency": a.concurrency,
        "seconds_per_round": a.seconds,
        "rounds": a.rounds,
        "idle_redis_cpu_ms_per_s": round(idle_cpu_per_s * 1e3, 3),
        "client_states": fields,
        "state_groups": groups,
        "rows": json_rows,
        "machine": machine,
    });
    Ok(Outcome {
        markdown,
        json,
        charts: Vec::new(),
    })
}
