//! `throughput`: the closed-loop maximum, direct to the upstream, through nginx (the
//! baseline, when installed) and through tollgate, each as a ratio to direct. Everything
//! shares the machine's cores with the load generator and the upstream, so the ratio, not
//! the absolute rate, is what carries over to other machines.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;

use super::seconds;
use crate::http::get_request;
use crate::load::{run_closed, ClosedResult};
use crate::procs::{
    raise_fd_limit, ClientDef, Gateway, GatewayConfig, Nginx, PlanDef, Redis, RouteDef,
};
use crate::report::{machine, round, Outcome, Table};
use crate::svg;
use crate::upstream::{Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// Seconds measured per target, after the warm-up.
    #[arg(long, default_value = "10", value_parser = seconds)]
    duration: f64,
    /// Seconds of warm-up per target, not counted.
    #[arg(long, default_value = "2", value_parser = seconds)]
    warmup: f64,
    /// Worker counts to measure nginx and tollgate with (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    workers: Vec<usize>,
    /// Skip the nginx baseline even when nginx is installed.
    #[arg(long)]
    no_nginx: bool,
    /// Skip the embedded-store rows.
    #[arg(long)]
    no_embedded: bool,
}

const PATH: &str = "/api/items/42";
const KEY: &str = "bench-throughput-key-1";

struct Row {
    name: String,
    result: ClosedResult,
}

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    raise_fd_limit();
    let machine = machine();
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
    let requests = vec![get_request(PATH, Some(KEY))];
    let (warmup, duration) = (
        Duration::from_secs_f64(a.warmup),
        Duration::from_secs_f64(a.duration),
    );
    let measure = |addr: SocketAddr| run_closed(addr, requests.clone(), a.conns, warmup, duration);
    eprintln!(
        "throughput: {} connections, {} s per target ({machine})",
        a.conns, a.duration
    );

    let mut rows = Vec::new();
    eprintln!("  direct");
    rows.push(Row {
        name: "direct to the upstream".into(),
        result: measure(upstream.addrs[0])?,
    });
    let mut nginx_missing = false;
    if !a.no_nginx {
        for &w in &a.workers {
            match Nginx::start(upstream.addrs[0], w)? {
                Some(nginx) => {
                    eprintln!("  nginx, {w} worker(s)");
                    rows.push(Row {
                        name: format!("nginx proxy, {w} worker{}", plural(w)),
                        result: measure(nginx.addr)?,
                    });
                }
                None => {
                    nginx_missing = true;
                    break;
                }
            }
        }
    }
    let redis = Redis::start()?;
    for &w in &a.workers {
        for embedded in [false, true] {
            if embedded && a.no_embedded {
                continue;
            }
            let store = if embedded { "embedded" } else { "Redis" };
            let mut config = GatewayConfig::new(
                (!embedded).then(|| redis.url()),
                vec![RouteDef {
                    service: "api".into(),
                    prefix: "/api".into(),
                    upstreams: upstream.urls(),
                }],
            );
            config.workers = w;
            config.plans.push(PlanDef {
                name: "large".into(),
                capacity: 1e9,
                rate: 1e9,
            });
            config.clients.push(ClientDef {
                id: "throughput-client".into(),
                plan: "large".into(),
                key: KEY.into(),
            });
            let gateway = Gateway::start(&config, PATH)?;
            eprintln!("  tollgate ({store}), {w} worker(s)");
            rows.push(Row {
                name: format!("tollgate ({store}), {w} worker{}", plural(w)),
                result: measure(gateway.addr)?,
            });
        }
    }

    let direct = rows[0].result.rate();
    let mut table = Table::new(&["target", "requests/s", "x direct", "non-2xx", "errors"]);
    let mut json_rows = Vec::new();
    for r in &rows {
        let rate = r.result.rate();
        table.row(vec![
            r.name.clone(),
            format!("{rate:.0}"),
            format!("{:.2}", rate / direct),
            r.result.non_2xx.to_string(),
            r.result.errors.to_string(),
        ]);
        json_rows.push(json!({
            "target": r.name,
            "requests_per_s": round(rate, 0),
            "ratio_to_direct": round(rate / direct, 3),
            "non_2xx": r.result.non_2xx,
            "errors": r.result.errors,
        }));
    }
    let best = |prefix: &str| {
        rows.iter()
            .filter(|r| r.name.starts_with(prefix))
            .map(|r| r.result.rate())
            .fold(0.0, f64::max)
    };
    let (gw, gw_embedded, nginx) = (
        best("tollgate (Redis)"),
        best("tollgate (embedded)"),
        best("nginx"),
    );
    let mut markdown = format!(
        "### throughput: closed loop, {} connections, {} s per target\n\n{}\n",
        a.conns,
        a.duration,
        table.render()
    );
    markdown.push_str(&format!(
        "Best tollgate (Redis) / direct: **{:.2}x**",
        gw / direct
    ));
    if nginx > 0.0 {
        markdown.push_str(&format!(
            "; nginx / direct: {:.2}x; tollgate (Redis) / nginx: {:.2}x",
            nginx / direct,
            gw / nginx
        ));
    } else if nginx_missing {
        markdown.push_str("; nginx is not installed, so no baseline row");
    }
    markdown.push_str(&format!(". {machine}.\n"));

    let json = json!({
        "scenario": "throughput",
        "conns": a.conns,
        "duration_s": a.duration,
        "direct_rps": round(direct, 0),
        "gateway_rps": round(gw, 0),
        "gateway_ratio": round(gw / direct, 3),
        "gateway_embedded_rps": round(gw_embedded, 0),
        "nginx_rps": if nginx > 0.0 { json!(round(nginx, 0)) } else { json!(null) },
        "nginx_ratio": if nginx > 0.0 { json!(round(nginx / direct, 3)) } else { json!(null) },
        "rows": json_rows,
        "machine": machine,
    });
    let names: Vec<String> = rows.iter().map(|r| short(&r.name)).collect();
    let chart = svg::bars(
        "Closed-loop throughput",
        &format!(
            "{} connections, {} s per target, one 2-core machine for everything",
            a.conns, a.duration
        ),
        "requests/s",
        &names,
        &[(
            "requests/s",
            svg::BLUE,
            rows.iter().map(|r| r.result.rate().round()).collect(),
        )],
    );
    Ok(Outcome {
        markdown,
        json,
        charts: vec![("throughput.svg".into(), chart)],
    })
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// A bar label that fits under the bar.
fn short(name: &str) -> String {
    name.replace("direct to the upstream", "direct")
        .replace("nginx proxy, ", "nginx ")
        .replace("tollgate (Redis), ", "redis ")
        .replace("tollgate (embedded), ", "embed. ")
        .replace(" workers", "w")
        .replace(" worker", "w")
}
