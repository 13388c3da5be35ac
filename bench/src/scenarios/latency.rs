//! `latency`: what the gateway adds. The same open-loop load (fixed rate, latency from the
//! intended send time) goes to the upstream directly and through the gateway in Redis
//! mode, alternating every `--slice` seconds in one run, so drift in the machine's load
//! (the other engineer's compiles) falls on both sides alike. With `--otlp` a third side
//! joins the alternation: a second gateway, configured alike, exporting spans over OTLP.

use std::time::Duration;

use serde_json::json;
use tollgate_testkit::RedisServer;

use super::clients::Clients;
use super::{seconds, summary_json};
use crate::load::{run_open, sorted_ns, Arrivals, Stream, Summary};
use crate::procs::{one_unlimited_client, raise_fd_limit, Gateway};
use crate::report::{machine, ms, round, Outcome, Table};
use crate::svg;
use crate::upstream::{Server, Upstreams};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Requests per second, on each side.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Seconds measured on each side (direct and gateway), after the warm-up.
    #[arg(long, default_value = "30", value_parser = seconds)]
    duration: f64,
    /// Seconds of warm-up on each side, not counted.
    #[arg(long, default_value = "2", value_parser = seconds)]
    warmup: f64,
    /// Seconds per alternation slice (under the gateway's 5 s keep-alive, so pooled
    /// connections stay open across slices).
    #[arg(long, default_value = "2", value_parser = seconds)]
    slice: f64,
    /// Gateway worker threads.
    #[arg(long, default_value_t = 1)]
    gateway_workers: usize,
    /// The gateway's decision budget (`redis.timeout_ms`); past it a request fails open.
    #[arg(long, default_value_t = 5)]
    timeout_ms: u64,
    /// Add a third side: a second gateway, configured alike, exporting spans over OTLP
    /// (`telemetry.otlp_endpoint`) to a local collector that answers 200 at once. Every
    /// request to it starts a sampled trace (3 spans). The first gateway exports nothing.
    #[arg(long)]
    otlp: bool,
    #[command(flatten)]
    clients: Clients,
}

const PATH: &str = "/api/items/42";
const KEY: &str = "bench-latency-key-1";

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    a.clients.check()?;
    raise_fd_limit();
    let machine = machine();
    let redis = RedisServer::start()?;
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
    let mut config =
        one_unlimited_client(Some(redis.url()), upstream.urls(), "latency-client", KEY);
    config.workers = a.gateway_workers;
    config.timeout_ms = Some(a.timeout_ms);
    a.clients.add_to(&mut config, "large");
    let gateway = Gateway::start(&config, PATH)?;
    let traced = if a.otlp {
        let collector = Upstreams::start(vec![Server::Fast(Default::default())])?;
        let mut config = config.clone();
        config.extra.push_str(&format!(
            "\n[telemetry]\notlp_endpoint = \"{}\"\n",
            collector.urls()[0]
        ));
        let gateway = Gateway::start(&config, PATH)?;
        Some((collector, gateway))
    } else {
        None
    };

    let requests = a.clients.requests(PATH, KEY);
    let direct_addr = upstream.addrs[0];
    let stream = |addr, from: f64, until: f64| Stream {
        addr,
        requests: requests.clone(),
        rate: a.rate,
        arrivals: Arrivals::Uniform,
        from: Duration::from_secs_f64(from),
        until: Duration::from_secs_f64(until),
    };
    // The sides: direct, the gateway, and with `--otlp` the gateway exporting spans.
    let mut sides = vec![direct_addr, gateway.addr];
    if let Some((_, traced)) = &traced {
        sides.push(traced.addr);
    }
    let n = sides.len();
    // Warm-up: each side in turn; then alternate slices.
    let mut streams: Vec<Stream> = sides
        .iter()
        .enumerate()
        .map(|(i, addr)| stream(*addr, i as f64 * a.warmup, (i + 1) as f64 * a.warmup))
        .collect();
    let mut t = n as f64 * a.warmup;
    let mut left = a.duration;
    while left > 1e-9 {
        let len = left.min(a.slice);
        for addr in &sides {
            streams.push(stream(*addr, t, t + len));
            t += len;
        }
        left -= len;
    }
    let evalsha_before = redis.calls("evalsha")?;
    eprintln!(
        "latency: {} req/s, {} s per side, alternating every {} s ({machine})",
        a.rate, a.duration, a.slice
    );
    let result = run_open(streams)?;
    let evalsha = redis.calls("evalsha")? - evalsha_before;

    let mut direct = Vec::new();
    let mut through = Vec::new();
    let mut exporting = Vec::new();
    let mut gateway_sent = 0usize;
    for (i, samples) in result.samples.iter().enumerate() {
        let side = i % n;
        if side > 0 {
            gateway_sent += samples.len();
        }
        if i < n {
            continue; // warm-up
        }
        match side {
            0 => direct.extend_from_slice(samples),
            1 => through.extend_from_slice(samples),
            _ => exporting.extend_from_slice(samples),
        }
    }
    let errors = |v: &[crate::load::Sample]| v.iter().filter(|s| s.status != 200).count();
    let (direct_errors, gateway_errors) = (errors(&direct), errors(&through));
    let d = Summary::of(&direct);
    let g = Summary::of(&through);
    let metrics = gateway.metrics()?;
    // The exporting gateway: its latency, and what its exporter did.
    let exported = match &traced {
        Some((_, gw)) => {
            let m = gw.metrics()?;
            let get = |name: &str| m.get(name).copied().unwrap_or(0.0);
            Some((
                Summary::of(&exporting),
                errors(&exporting),
                get("tollgate_trace_spans_exported_total"),
                get("tollgate_trace_spans_dropped_total{reason=\"queue_full\"}")
                    + get("tollgate_trace_spans_dropped_total{reason=\"export_failed\"}"),
            ))
        }
        None => None,
    };
    let fail_open = metrics
        .get("tollgate_fail_open_total")
        .copied()
        .unwrap_or(0.0);

    let tracing_note = match &exported {
        Some((_, _, exported, dropped)) => {
            format!(" Spans exported over OTLP: {exported}, dropped: {dropped}.")
        }
        None => String::new(),
    };

    let mut table = Table::new(&[
        "path", "requests", "non-200", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms",
    ]);
    for (name, s, e) in [
        ("direct to the upstream", &d, direct_errors),
        ("through tollgate (Redis)", &g, gateway_errors),
    ] {
        table.row(vec![
            name.into(),
            s.count.to_string(),
            e.to_string(),
            ms(s.p50_ms),
            ms(s.p90_ms),
            ms(s.p99_ms),
            ms(s.p999_ms),
            ms(s.max_ms),
        ]);
    }
    if let Some((t, e, _, _)) = &exported {
        table.row(vec![
            "through tollgate, spans exported".into(),
            t.count.to_string(),
            e.to_string(),
            ms(t.p50_ms),
            ms(t.p90_ms),
            ms(t.p99_ms),
            ms(t.p999_ms),
            ms(t.max_ms),
        ]);
    }
    table.row(vec![
        "**added by the gateway**".into(),
        String::new(),
        String::new(),
        format!("**{}**", ms(g.p50_ms - d.p50_ms)),
        ms(g.p90_ms - d.p90_ms),
        format!("**{}**", ms(g.p99_ms - d.p99_ms)),
        ms(g.p999_ms - d.p999_ms),
        String::new(),
    ]);
    if let Some((t, _, _, _)) = &exported {
        table.row(vec![
            "**added by exporting spans**".into(),
            String::new(),
            String::new(),
            format!("**{}**", ms(t.p50_ms - g.p50_ms)),
            ms(t.p90_ms - g.p90_ms),
            format!("**{}**", ms(t.p99_ms - g.p99_ms)),
            ms(t.p999_ms - g.p999_ms),
            String::new(),
        ]);
    }
    let calls_per_request = evalsha as f64 / gateway_sent.max(1) as f64;
    let markdown = format!(
        "### latency: {} req/s open loop, {} s per side, {}\n\n{}\n\
         Redis calls per gateway request: {:.3} (EVALSHA). Fail-opens: {}.{} \
         Generator wake-up lateness p50/p99: {:.0}/{:.0} µs (included in both sides). {}.\n",
        a.rate,
        a.duration,
        a.clients.describe(),
        table.render(),
        calls_per_request,
        fail_open,
        tracing_note,
        result.dispatch_late_p50.as_secs_f64() * 1e6,
        result.dispatch_late_p99.as_secs_f64() * 1e6,
        machine
    );
    let json = json!({
        "scenario": "latency",
        "clients": a.clients.describe(),
        "rate": a.rate,
        "duration_s": a.duration,
        "gateway_workers": a.gateway_workers,
        "timeout_ms": a.timeout_ms,
        "direct": summary_json(&d),
        "gateway": summary_json(&g),
        "added_p50_ms": round(g.p50_ms - d.p50_ms, 3),
        "added_p99_ms": round(g.p99_ms - d.p99_ms, 3),
        "added_p999_ms": round(g.p999_ms - d.p999_ms, 3),
        "direct_non_200": direct_errors,
        "gateway_non_200": gateway_errors,
        "redis_calls_per_request": round(calls_per_request, 4),
        "fail_open": fail_open,
        "otlp": exported.as_ref().map(|(t, e, exported, dropped)| json!({
            "gateway": summary_json(t),
            "non_200": e,
            "added_p50_ms": round(t.p50_ms - g.p50_ms, 3),
            "added_p99_ms": round(t.p99_ms - g.p99_ms, 3),
            "added_p999_ms": round(t.p999_ms - g.p999_ms, 3),
            "spans_exported": exported,
            "spans_dropped": dropped,
        })),
        "generator_late_p50_us": round(result.dispatch_late_p50.as_secs_f64() * 1e6, 1),
        "generator_late_p99_us": round(result.dispatch_late_p99.as_secs_f64() * 1e6, 1),
        "machine": machine,
    });

    let nines = (d.count.min(g.count) as f64)
        .log10()
        .floor()
        .clamp(1.0, 4.0);
    let chart = svg::Plot {
        title: "Latency percentiles: direct vs through tollgate",
        subtitle: &format!(
            "{} req/s open loop, {} s per side, Redis mode; added p99 {:.3} ms",
            a.rate,
            a.duration,
            g.p99_ms - d.p99_ms
        ),
        x_label: "percentile",
        y_label: "latency (ms, from intended send time)",
        x_ticks: svg::percentile_ticks(nines),
        x_max: nines,
        log_y: false,
        markers: vec![],
    }
    .render(&[
        svg::Series {
            name: "direct",
            color: svg::BLUE,
            points: svg::percentile_curve(&sorted_ns(&direct), nines),
            dots: false,
        },
        svg::Series {
            name: "through tollgate",
            color: svg::ORANGE,
            points: svg::percentile_curve(&sorted_ns(&through), nines),
            dots: false,
        },
    ]);
    drop(gateway);
    drop(traced);
    Ok(Outcome {
        markdown,
        json,
        charts: vec![("latency-percentiles.svg".into(), chart)],
    })
}
