//! `latency`: what the gateway adds. The same open-loop load (fixed rate, latency from the
//! intended send time) goes to the upstream directly and through the gateway in Redis
//! mode, alternating every `--slice` seconds in one run, so drift in the machine's load
//! (the other engineer's compiles) falls on both sides alike. With `--otlp` a side joins
//! the alternation: a second gateway, configured alike, exporting spans over OTLP; with
//! `--embedded`, a second gateway on the embedded store (the gateway's own work without
//! its Redis round trip).
//!
//! Beside the floor (actix-web + awc alone) run the floor with one Redis round trip per
//! request (a `PING` before forwarding, to the same Redis, under the same load): the
//! least any design that asks Redis before forwarding can add, measured rather than
//! estimated; and the floor with one call of a script that only reads `TIME`: the least
//! any design that decides in a Redis script by Redis' clock can add. Issue 14's latency
//! goal compares tollgate with them.

use std::time::Duration;

use serde_json::json;
use tollgate_testkit::RedisServer;

use super::clients::Clients;
use super::takes::RedisSpent;
use super::throughput::pinned;
use super::{seconds, summary_json};
use crate::floor::Ask;
use crate::load::{run_open, sorted_ns, Arrivals, Stream, Summary};
use crate::procs::{one_unlimited_client, raise_fd_limit, Floor, Gateway, Pin, Steal, StealSpec};
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
    /// Skip the floor (bare actix-web + awc, no limiter, as many workers as the gateway).
    #[arg(long)]
    no_floor: bool,
    /// Skip the floors with one Redis `PING`, and one call of a script reading `TIME`, per
    /// request (they run whenever the floor does).
    #[arg(long)]
    no_redis_floor: bool,
    /// The gateway and the floor alone on CPU 1, everything else on CPU 0 (see
    /// `throughput --pin`).
    #[arg(long)]
    pin: bool,
    /// Add a side: a second gateway, configured alike, exporting spans over OTLP
    /// (`telemetry.otlp_endpoint`) to a local collector that answers 200 at once. Every
    /// request to it starts a sampled trace (3 spans). The first gateway exports nothing.
    #[arg(long)]
    otlp: bool,
    /// Add a side: a second gateway, configured alike but on the embedded store (no
    /// Redis), which separates the gateway's own work from its Redis round trip.
    #[arg(long)]
    embedded: bool,
    /// Takes the gateway's CPU away while it is measured, `STOP_MS/PERIOD_MS` (e.g.
    /// `3/18`: 17%), as a hypervisor's steal would (see `procs::Steal`).
    #[arg(long, value_name = "STOP_MS/PERIOD_MS")]
    steal: Option<StealSpec>,
    #[command(flatten)]
    clients: Clients,
}

const PATH: &str = "/api/items/42";
const KEY: &str = "bench-latency-key-1";

pub fn run(a: &Args) -> anyhow::Result<Outcome> {
    a.clients.check()?;
    raise_fd_limit();
    let machine = machine();
    // Before anything starts: every thread and child inherits it.
    let pin = a.pin.then(Pin::this_process).transpose()?;
    let redis = RedisServer::start()?;
    let upstream = Upstreams::start(vec![Server::Fast(Default::default())])?;
    let mut config =
        one_unlimited_client(Some(redis.url()), upstream.urls(), "latency-client", KEY);
    config.workers = a.gateway_workers;
    config.timeout_ms = Some(a.timeout_ms);
    let mut embedded_config = config.clone();
    a.clients.add_to(&mut config, "large");
    let gateway = Gateway::start_pinned(&config, PATH, pin)?;
    let floor = (!a.no_floor)
        .then(|| Floor::start(&upstream.urls()[0], a.gateway_workers, pin, None))
        .transpose()?;
    let url = redis.url();
    let asking = |ask| {
        (!a.no_floor && !a.no_redis_floor)
            .then(|| {
                Floor::start(
                    &upstream.urls()[0],
                    a.gateway_workers,
                    pin,
                    Some((&url, ask)),
                )
            })
            .transpose()
    };
    let (floor_redis, floor_script) = (asking(Ask::Ping)?, asking(Ask::Script)?);
    let embedded = if a.embedded {
        embedded_config.redis_url = Some(String::new());
        // Into its catalog file in one write (see `add_clients_and_restart`).
        let mut gateway = Gateway::start_pinned(&embedded_config, PATH, pin)?;
        gateway.add_clients_and_restart(&a.clients.defs("large"), PATH)?;
        Some(gateway)
    } else {
        None
    };
    let traced = if a.otlp {
        let collector = Upstreams::start(vec![Server::Fast(Default::default())])?;
        let mut config = config.clone();
        config.extra.push_str(&format!(
            "\n[telemetry]\notlp_endpoint = \"{}\"\n",
            collector.urls()[0]
        ));
        let gateway = Gateway::start_pinned(&config, PATH, pin)?;
        Some((collector, gateway))
    } else {
        None
    };

    let requests = a.clients.requests(PATH, KEY);
    // The targets, in the order each slice visits them: direct, the floor, the floor with
    // a Redis round trip, the floor with a script call, the gateway, the gateway on the
    // embedded store, the gateway exporting spans.
    let mut targets = vec![upstream.addrs[0]];
    targets.extend(floor.as_ref().map(|f| f.addr));
    targets.extend(floor_redis.as_ref().map(|f| f.addr));
    targets.extend(floor_script.as_ref().map(|f| f.addr));
    let at_gateway = targets.len();
    targets.push(gateway.addr);
    let at_embedded = targets.len();
    targets.extend(embedded.as_ref().map(|e| e.addr));
    targets.extend(traced.as_ref().map(|(_, t)| t.addr));
    let n = targets.len();
    let stream = |addr, from: f64, until: f64| Stream {
        addr,
        requests: requests.clone(),
        rate: a.rate,
        arrivals: Arrivals::Uniform,
        from: Duration::from_secs_f64(from),
        until: Duration::from_secs_f64(until),
    };
    // Warm-up: each target in turn; then alternate slices.
    let mut streams = Vec::new();
    let mut t = 0.0;
    for &addr in &targets {
        streams.push(stream(addr, t, t + a.warmup));
        t += a.warmup;
    }
    let mut left = a.duration;
    while left > 1e-9 {
        let len = left.min(a.slice);
        for &addr in &targets {
            streams.push(stream(addr, t, t + len));
            t += len;
        }
        left -= len;
    }
    let spent_before = RedisSpent::read(&redis)?;
    eprintln!(
        "latency: {} req/s, {} s per side, alternating every {} s{} ({machine})",
        a.rate,
        a.duration,
        a.slice,
        pinned(pin)
    );
    let steal = a.steal.map(|s| Steal::start(gateway.child.id(), s));
    let result = run_open(streams)?;
    drop(steal);
    let spent = RedisSpent::read(&redis)?.since(&spent_before);
    let evalsha = spent.calls("evalsha");

    // Samples by target; the first round of streams is the warm-up.
    let mut by_target = vec![Vec::new(); n];
    let mut gateway_sent = 0usize;
    for (i, samples) in result.samples.iter().enumerate() {
        let target = i % n;
        if embedded.is_some() && target == at_embedded {
            // No Redis calls.
        } else if target >= at_gateway {
            gateway_sent += samples.len();
        }
        if i >= n {
            by_target[target].extend_from_slice(samples);
        }
    }
    let exporting = if traced.is_some() {
        by_target.pop().expect("the exporting gateway is a target")
    } else {
        Vec::new()
    };
    let on_embedded = embedded.as_ref().and_then(|_| by_target.pop());
    let through = by_target.pop().expect("the gateway is a target");
    let direct = by_target.remove(0);
    let via_floor_script = floor_script.as_ref().and_then(|_| by_target.pop());
    let via_floor_redis = floor_redis.as_ref().and_then(|_| by_target.pop());
    let via_floor = by_target.pop();
    let errors = |v: &[crate::load::Sample]| v.iter().filter(|s| s.status != 200).count();
    let (direct_errors, gateway_errors) = (errors(&direct), errors(&through));
    let d = Summary::of(&direct);
    let g = Summary::of(&through);
    let f = via_floor.as_deref().map(|v| (Summary::of(v), errors(v)));
    let fr = via_floor_redis
        .as_deref()
        .map(|v| (Summary::of(v), errors(v)));
    let fscript = via_floor_script
        .as_deref()
        .map(|v| (Summary::of(v), errors(v)));
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
    let mut rows = vec![("direct to the upstream", &d, direct_errors)];
    if let Some((fs, fe)) = &f {
        rows.push(("floor: actix-web + awc, no limiter", fs, *fe));
    }
    if let Some((rs, re)) = &fr {
        rows.push(("floor + one Redis PING per request", rs, *re));
    }
    if let Some((ss, se)) = &fscript {
        rows.push(("floor + one script call (TIME) per request", ss, *se));
    }
    rows.push(("through tollgate (Redis)", &g, gateway_errors));
    let emb = on_embedded.as_deref().map(|v| (Summary::of(v), errors(v)));
    if let Some((es, ee)) = &emb {
        rows.push(("through tollgate (embedded store)", es, *ee));
    }
    for (name, s, e) in rows {
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
    // What a side adds over direct, at each percentile.
    let added = |name: &str, s: &Summary| {
        vec![
            name.into(),
            String::new(),
            String::new(),
            ms(s.p50_ms - d.p50_ms),
            ms(s.p90_ms - d.p90_ms),
            ms(s.p99_ms - d.p99_ms),
            ms(s.p999_ms - d.p999_ms),
            String::new(),
        ]
    };
    if let Some((fs, _)) = &f {
        table.row(added("added by the floor", fs));
    }
    if let Some((rs, _)) = &fr {
        table.row(added("added by the floor + a Redis round trip", rs));
    }
    if let Some((ss, _)) = &fscript {
        table.row(added("added by the floor + a script call", ss));
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
    if let Some((es, _)) = &emb {
        table.row(added("added by tollgate on the embedded store", es));
    }
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
    // Time inside Redis per call (`INFO commandstats`): the gateway's script, the floors'
    // `PING` and `EVAL`.
    let usec_per_call = |c: &str| spent.usec(c) as f64 / spent.calls(c).max(1) as f64;
    let (in_evalsha, in_ping, in_eval) = (
        usec_per_call("evalsha"),
        usec_per_call("ping"),
        usec_per_call("eval"),
    );
    let floors_inside = if floor_redis.is_some() {
        format!(", the floors' PING {in_ping:.1} µs and EVAL {in_eval:.1} µs")
    } else {
        String::new()
    };
    // When the gateway's slowest requests were sent: a stall at a slice's start (idle
    // connections, a cold cache) reads differently from one anywhere in it.
    let cycle = n as f64 * a.slice;
    let mut slowest: Vec<_> = through.iter().collect();
    slowest.sort_by_key(|s| std::cmp::Reverse(s.latency));
    let slowest = slowest
        .iter()
        .take(5)
        .map(|s| {
            let at = s.at.as_secs_f64();
            let into = (at - n as f64 * a.warmup).rem_euclid(cycle) - at_gateway as f64 * a.slice;
            format!(
                "{:.2} ms at {at:.2} s ({:.0} ms into its slice)",
                s.latency.as_secs_f64() * 1e3,
                into * 1e3
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let markdown = format!(
        "### latency: {} req/s open loop, {} s per side, {}{}\n\n{}\n\
         Redis calls per gateway request: {:.3} (EVALSHA). Inside Redis per call: the \
         gateway's EVALSHA {:.1} µs{}. \
         Fail-opens: {}.{}{} The gateway's slowest requests: {slowest}. \
         Generator wake-up lateness p50/p99: {:.0}/{:.0} µs (included in both sides). {}.\n",
        a.rate,
        a.duration,
        a.clients.describe(),
        pinned(pin),
        table.render(),
        calls_per_request,
        in_evalsha,
        floors_inside,
        fail_open,
        a.steal.map_or(String::new(), |s| format!(
            " Steal emulated: {}.",
            s.describe()
        )),
        tracing_note,
        result.dispatch_late_p50.as_secs_f64() * 1e6,
        result.dispatch_late_p99.as_secs_f64() * 1e6,
        machine
    );
    let json = json!({
        "scenario": "latency",
        "steal": a.steal.map(|s| s.describe()),
        "clients": a.clients.describe(),
        "rate": a.rate,
        "duration_s": a.duration,
        "gateway_workers": a.gateway_workers,
        "timeout_ms": a.timeout_ms,
        "pinned": pin.is_some(),
        "direct": summary_json(&d),
        "floor": f.as_ref().map(|(fs, _)| summary_json(fs)),
        "floor_added_p50_ms": f.as_ref().map(|(fs, _)| round(fs.p50_ms - d.p50_ms, 3)),
        "floor_added_p99_ms": f.as_ref().map(|(fs, _)| round(fs.p99_ms - d.p99_ms, 3)),
        "floor_redis": fr.as_ref().map(|(rs, _)| summary_json(rs)),
        "floor_redis_added_p50_ms": fr.as_ref().map(|(rs, _)| round(rs.p50_ms - d.p50_ms, 3)),
        "floor_redis_added_p99_ms": fr.as_ref().map(|(rs, _)| round(rs.p99_ms - d.p99_ms, 3)),
        "floor_script": fscript.as_ref().map(|(ss, _)| summary_json(ss)),
        "floor_script_added_p50_ms": fscript.as_ref().map(|(ss, _)| round(ss.p50_ms - d.p50_ms, 3)),
        "floor_script_added_p99_ms": fscript.as_ref().map(|(ss, _)| round(ss.p99_ms - d.p99_ms, 3)),
        "gateway": summary_json(&g),
        "embedded": emb.as_ref().map(|(es, _)| summary_json(es)),
        "embedded_added_p50_ms": emb.as_ref().map(|(es, _)| round(es.p50_ms - d.p50_ms, 3)),
        "embedded_added_p99_ms": emb.as_ref().map(|(es, _)| round(es.p99_ms - d.p99_ms, 3)),
        "added_p50_ms": round(g.p50_ms - d.p50_ms, 3),
        "added_p99_ms": round(g.p99_ms - d.p99_ms, 3),
        "added_p999_ms": round(g.p999_ms - d.p999_ms, 3),
        "direct_non_200": direct_errors,
        "gateway_non_200": gateway_errors,
        "redis_calls_per_request": round(calls_per_request, 4),
        "usec_per_evalsha": round(in_evalsha, 2),
        "usec_per_floor_ping": floor_redis.as_ref().map(|_| round(in_ping, 2)),
        "usec_per_floor_eval": floor_script.as_ref().map(|_| round(in_eval, 2)),
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
    drop(floor);
    drop(gateway);
    drop(traced);
    Ok(Outcome {
        markdown,
        json,
        charts: vec![("latency-percentiles.svg".into(), chart)],
    })
}
