//! `latency`: what the gateway adds. The same open-loop load (fixed rate, latency from the
//! intended send time) goes to the upstream directly and through the gateway in Redis
//! mode, alternating every `--slice` seconds in one run, so drift in the machine's load
//! (the other engineer's compiles) falls on both sides alike.

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
    /// Export spans over OTLP (`telemetry.otlp_endpoint`) to a local collector that answers
    /// 200 at once: what tracing costs when it is on. Every request starts a sampled trace.
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
    let collector = if a.otlp {
        let c = Upstreams::start(vec![Server::Fast(Default::default())])?;
        config.extra.push_str(&format!(
            "\n[telemetry]\notlp_endpoint = \"{}\"\n",
            c.urls()[0]
        ));
        Some(c)
    } else {
        None
    };
    let gateway = Gateway::start(&config, PATH)?;

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
    // Warm-up: direct, then gateway; then alternate slices.
    let mut streams = vec![
        stream(direct_addr, 0.0, a.warmup),
        stream(gateway.addr, a.warmup, 2.0 * a.warmup),
    ];
    let mut t = 2.0 * a.warmup;
    let mut left = a.duration;
    while left > 1e-9 {
        let len = left.min(a.slice);
        streams.push(stream(direct_addr, t, t + len));
        streams.push(stream(gateway.addr, t + len, t + 2.0 * len));
        t += 2.0 * len;
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
    let mut gateway_sent = 0usize;
    for (i, samples) in result.samples.iter().enumerate() {
        let is_gateway = i % 2 == 1;
        if is_gateway {
            gateway_sent += samples.len();
        }
        if i < 2 {
            continue; // warm-up
        }
        if is_gateway {
            through.extend_from_slice(samples);
        } else {
            direct.extend_from_slice(samples);
        }
    }
    let errors = |v: &[crate::load::Sample]| v.iter().filter(|s| s.status != 200).count();
    let (direct_errors, gateway_errors) = (errors(&direct), errors(&through));
    let d = Summary::of(&direct);
    let g = Summary::of(&through);
    let metrics = gateway.metrics()?;
    let fail_open = metrics
        .get("tollgate_fail_open_total")
        .copied()
        .unwrap_or(0.0);

    let spans = |name: &str| metrics.get(name).copied().unwrap_or(0.0);
    let exported = spans("tollgate_trace_spans_exported_total");
    let dropped = spans("tollgate_trace_spans_dropped_total{reason=\"queue_full\"}")
        + spans("tollgate_trace_spans_dropped_total{reason=\"export_failed\"}");
    let tracing_note = if a.otlp {
        format!(" Spans exported over OTLP: {exported}, dropped: {dropped}.")
    } else {
        " Span export off.".to_string()
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
        "otlp": a.otlp,
        "spans_exported": exported,
        "spans_dropped": dropped,
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
    drop(collector);
    Ok(Outcome {
        markdown,
        json,
        charts: vec![("latency-percentiles.svg".into(), chart)],
    })
}
