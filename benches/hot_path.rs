//! Micro-benchmarks of the request path's pure pieces (`cargo bench`): what the gateway
//! computes per request besides I/O. The end-to-end figures are `tollgate-bench`'s (see
//! BENCHMARKS.md); these show which in-process step costs what, in nanoseconds.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use tollgate::configuration::{Balance, RouteSettings};
use tollgate::domain::{bucket, Applied, BucketState, Decision, Outcome, RateLimitHeaders};
use tollgate::domain::{
    Bucket, KeyHash, Limit, LimitSpec, Limits, PlanName, ServiceName, Upstream,
};
use tollgate::proxy::RouteTable;
use tollgate::store::{LocalBuckets, Store};

fn plan() -> Bucket {
    Bucket::new(100.0, 50.0).expect("a valid plan")
}

/// A plan of one bucket, or of three limits: a burst bucket, a slower bucket and a
/// monthly quota, as the limiter applies them to one request.
fn applied(three: bool, capacity: f64) -> Vec<Applied> {
    let mut items = vec![Limit::default_bucket(
        Bucket::new(capacity, capacity).expect("a valid bucket"),
    )];
    if three {
        let spec = |json: &str| {
            Limit::from_spec(&serde_json::from_str::<LimitSpec>(json).expect("a spec"))
                .expect("a valid limit")
        };
        items.push(spec(r#"{"name":"sustained","capacity":1e9,"rate":1e8}"#));
        items.push(spec(r#"{"name":"monthly","quota":1e15,"period":"month"}"#));
    }
    let limits = Limits::new(items).expect("valid limits");
    limits
        .items()
        .iter()
        .enumerate()
        .map(|(i, l)| l.applied(i))
        .collect()
}

/// The refill-and-take arithmetic, for an existing and for a new bucket.
fn bucket_take(c: &mut Criterion) {
    let p = plan();
    let state = Some(BucketState {
        tokens: 42.5,
        ts_us: 1_000_000,
    });
    c.bench_function("bucket::take (existing bucket)", |b| {
        b.iter(|| bucket::take(black_box(state), black_box(1_020_000), p, 1.0))
    });
    c.bench_function("bucket::take (new bucket)", |b| {
        b.iter(|| bucket::take(black_box(None), black_box(1_020_000), p, 1.0))
    });
}

/// SHA-256 of an API key: done for every request to find the client.
fn key_hash(c: &mut Criterion) {
    let key = "tg_3f9a0c1d2b4e5f60718293a4b5c6d7e8f90123456789abcdef0123456789abcd";
    c.bench_function("KeyHash::of (67-byte key)", |b| {
        b.iter(|| KeyHash::of(black_box(key)))
    });
}

fn routes(n: usize) -> RouteTable {
    let settings: Vec<RouteSettings> = (0..n)
        .map(|i| RouteSettings {
            service: ServiceName::parse(&format!("svc{i}")).expect("a valid service name"),
            prefix: format!("/svc{i}/v1"),
            upstreams: ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
                .map(|u| Upstream::parse(u).expect("a valid upstream"))
                .to_vec(),
            balance: Balance::LeastRequest,
            health_check: None,
            cost: 1.0,
            timeout: Duration::from_secs(30),
            cost_header: None,
            public_plan: None,
        })
        .collect();
    RouteTable::new(&settings)
}

/// Longest-prefix route lookup: a linear scan, so it grows with the number of routes.
fn route_find(c: &mut Criterion) {
    for n in [3, 30, 300] {
        let table = routes(n);
        let path = format!("/svc{}/v1/orders/42", n - 1);
        c.bench_function(
            &format!("RouteTable::find ({n} routes, last matches)"),
            |b| b.iter(|| table.find(black_box(&path)).is_some()),
        );
    }
}

/// The `RateLimit-Policy` and `RateLimit` header values for a response.
fn ratelimit_headers(c: &mut Criterion) {
    let name = PlanName::parse("gold").expect("a valid plan name");
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = Store::embedded(&dir.path().join("catalog.json")).expect("an embedded store");
    let applied = applied(false, 100.0);
    let ruling = at_once(store.buckets.take("k", &applied, 1.0, None)).expect("a ruling");
    let d = Decision {
        outcome: Outcome::Allowed,
        applied,
        ruling: Some(ruling),
        safety_wait_us: None,
        fail_open_reason: None,
        as_planned: false,
        cost: 1.0,
        sharded: false,
    };
    c.bench_function("RateLimitHeaders::new", |b| {
        b.iter(|| RateLimitHeaders::new(black_box(&name), black_box(&d)))
    });
}

/// The embedded store answers without waiting: its futures are ready on their first poll.
fn at_once<T>(f: impl Future<Output = T>) -> T {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the embedded store answers at once"),
    }
}

/// The embedded store's take (a sharded map and the arithmetic), as the limiter calls it
/// through `Store`, and the same map type as the coarse safety limit uses, for one hot key
/// and for many keys.
fn embedded_take(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = Store::embedded(&dir.path().join("catalog.json")).expect("an embedded store");
    let p = Bucket::new(1e9, 1e9).expect("a valid plan");
    let one = applied(false, 1e9);
    let three = applied(true, 1e9);
    c.bench_function("Buckets::take, embedded (one hot key)", |b| {
        b.iter(|| {
            at_once(
                store
                    .buckets
                    .take(black_box("tollgate:b:{acme}"), &one, 1.0, None),
            )
        })
    });
    c.bench_function("Buckets::take, embedded (one hot key, 3 limits)", |b| {
        b.iter(|| {
            at_once(
                store
                    .buckets
                    .take(black_box("tollgate:b:{acme3}"), &three, 1.0, None),
            )
        })
    });
    let keys: Vec<String> = (0..10_000)
        .map(|i| format!("tollgate:b:{{c{i}}}"))
        .collect();
    let mut i = 0;
    c.bench_function("Buckets::take, embedded (10,000 keys in turn)", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            at_once(store.buckets.take(black_box(&keys[i]), &one, 1.0, None))
        })
    });
    let buckets: LocalBuckets<Box<str>> = LocalBuckets::default();
    c.bench_function("LocalBuckets::take_at (new bucket each time)", |b| {
        b.iter_batched(
            || format!("k{}", rand_key()),
            |k| buckets.take_at(k.as_str(), p, 1.0, 1),
            BatchSize::SmallInput,
        )
    });
}

/// A cheap, varying key for benchmarks that must not hit the same bucket.
fn rand_key() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// The in-process part of one admitted request in embedded mode, end to end: hash the
/// key, find the route, take a token, build the headers.
fn decision_path(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = Store::embedded(&dir.path().join("catalog.json")).expect("an embedded store");
    let table = routes(3);
    let name = PlanName::parse("gold").expect("a valid plan name");
    let one = applied(false, 1e9);
    c.bench_function("hash + route + take + headers (embedded)", |b| {
        b.iter(|| {
            let hash = KeyHash::of(black_box("tg_3f9a0c1d2b4e5f60718293a4b5c6d7e8f9"));
            let route = table.find(black_box("/svc1/v1/orders/42"));
            let ruling = at_once(store.buckets.take("tollgate:b:{acme}", &one, 1.0, None))
                .expect("a ruling");
            let d = Decision {
                outcome: Outcome::Allowed,
                applied: one.clone(),
                ruling: Some(ruling),
                safety_wait_us: None,
                fail_open_reason: None,
                as_planned: false,
                cost: 1.0,
                sharded: false,
            };
            (hash, route.is_some(), RateLimitHeaders::new(&name, &d))
        })
    });
}

criterion_group!(
    benches,
    bucket_take,
    key_hash,
    route_find,
    ratelimit_headers,
    embedded_take,
    decision_path
);
criterion_main!(benches);
