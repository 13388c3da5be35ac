//! Redis kept busy by the gateway's own store code, without a gateway: `Buckets::take` (as
//! the limiter calls it: one multiplexed connection, `EVALSHA`, the coalescer) from one
//! thread with many takes in flight, and what Redis spent on them by its own counters.
//! Shared by `plans --only redis` (one client per take in flight) and `redis` (keys drawn
//! from N clients, uniformly or Zipf-skewed).

use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use rand::Rng;
use secrecy::SecretString;
use tollgate::domain::Applied;
use tollgate::store::{Keys, Store};
use tollgate_testkit::RedisServer;

/// What a `redis-server` has spent so far, by its own counters.
#[derive(Debug, Clone, Default)]
pub struct RedisSpent {
    /// `INFO commandstats`: command → (calls, µs inside it). A script's own `redis.call`s
    /// are counted as commands too, and their time is also inside the script's.
    pub commands: BTreeMap<String, (u64, u64)>,
    /// `INFO cpu`: `used_cpu_sys + used_cpu_user`, seconds (the whole process).
    pub cpu_s: f64,
}

impl RedisSpent {
    /// What several servers (a cluster's masters) spent, summed.
    pub fn read_all(servers: &[RedisServer]) -> anyhow::Result<RedisSpent> {
        let mut all = RedisSpent::default();
        for s in servers {
            all.add(&RedisSpent::read(s)?);
        }
        Ok(all)
    }

    pub fn read(redis: &RedisServer) -> anyhow::Result<RedisSpent> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .arg("cpu")
            .query(&mut redis.conn()?)?;
        let mut spent = RedisSpent::default();
        for line in info.lines() {
            if let Some(l) = line.strip_prefix("cmdstat_") {
                let Some((name, rest)) = l.split_once(':') else {
                    continue;
                };
                let field = |key: &str| {
                    rest.split(',')
                        .find_map(|kv| kv.strip_prefix(key))
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0)
                };
                spent
                    .commands
                    .insert(name.to_string(), (field("calls="), field("usec=")));
            } else if let Some(v) = line
                .strip_prefix("used_cpu_sys:")
                .or_else(|| line.strip_prefix("used_cpu_user:"))
            {
                spent.cpu_s += v.trim().parse::<f64>().unwrap_or(0.0);
            }
        }
        Ok(spent)
    }

    /// What was spent since `before`; commands not called meanwhile left out, and so are
    /// the bench's own (`INFO`, `HLEN` to check the plans, `DBSIZE` to count clients).
    pub fn since(&self, before: &RedisSpent) -> RedisSpent {
        let mut commands = BTreeMap::new();
        for (name, &(calls, usec)) in &self.commands {
            let (c0, u0) = before.commands.get(name).copied().unwrap_or((0, 0));
            if calls > c0 && !matches!(name.as_str(), "info" | "hlen" | "dbsize") {
                commands.insert(name.clone(), (calls - c0, usec - u0));
            }
        }
        RedisSpent {
            commands,
            cpu_s: self.cpu_s - before.cpu_s,
        }
    }

    /// Adds `other` to these totals (rounds summed).
    pub fn add(&mut self, other: &RedisSpent) {
        for (c, &(calls, usec)) in &other.commands {
            let e = self.commands.entry(c.clone()).or_default();
            *e = (e.0 + calls, e.1 + usec);
        }
        self.cpu_s += other.cpu_s;
    }

    pub fn calls(&self, command: &str) -> u64 {
        self.commands.get(command).map_or(0, |c| c.0)
    }

    pub fn usec(&self, command: &str) -> u64 {
        self.commands.get(command).map_or(0, |c| c.1)
    }
}

/// Which key a take in flight uses, each time it takes.
#[derive(Debug, Clone)]
pub enum Draw {
    /// Take in flight `i` always uses key `i` (as many keys as takes in flight).
    Own,
    /// A key drawn uniformly, anew for every take.
    Uniform,
    /// A key drawn from a Zipf distribution over the keys (rank 1 the most drawn): the
    /// cumulative weights `1/k^s`, normalized.
    Zipf { s: f64, cdf: Vec<f64> },
}

impl Draw {
    pub fn zipf(n: usize, s: f64) -> Draw {
        let mut cdf = Vec::with_capacity(n);
        let mut sum = 0.0;
        for k in 1..=n {
            sum += 1.0 / (k as f64).powf(s);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Draw::Zipf { s, cdf }
    }

    pub fn describe(&self) -> String {
        match self {
            Draw::Own => "one per take in flight".into(),
            Draw::Uniform => "uniform".into(),
            Draw::Zipf { s, .. } => format!("Zipf s={s}"),
        }
    }

    pub fn pick(&self, task: usize, keys: usize, rng: &mut impl Rng) -> usize {
        match self {
            Draw::Own => task % keys,
            Draw::Uniform => rng.random_range(0..keys),
            Draw::Zipf { cdf, .. } => {
                let u: f64 = rng.random();
                cdf.partition_point(|&c| c < u).min(keys - 1)
            }
        }
    }
}

/// One thread driving `Buckets::take` against one Redis.
pub struct Driver {
    rt: tokio::runtime::Runtime,
    local: tokio::task::LocalSet,
    store: Store,
}

impl Driver {
    pub fn new(redis: &RedisServer) -> anyhow::Result<Driver> {
        Driver::with(|| {
            Ok(Store::redis(
                &SecretString::from(redis.url()),
                2,
                Duration::from_secs(1),
                Keys::new("tollgate:"),
            )?)
        })
    }

    /// The same on a Redis Cluster, through the gateway's cluster store.
    pub fn cluster(urls: &[String]) -> anyhow::Result<Driver> {
        let nodes: Vec<SecretString> = urls.iter().map(|u| SecretString::from(u.clone())).collect();
        Driver::with(|| {
            Ok(Store::cluster(
                &nodes,
                Duration::from_secs(1),
                Keys::new("tollgate:"),
            )?)
        })
    }

    fn with(store: impl FnOnce() -> anyhow::Result<Store>) -> anyhow::Result<Driver> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // The store's pool starts its timers on the runtime it is made in.
        let store = {
            let _in_rt = rt.enter();
            store()?
        };
        Ok(Driver {
            rt,
            local: tokio::task::LocalSet::new(),
            store,
        })
    }

    /// One take of `applied` on every key, `concurrency` in flight (creates each client's
    /// state, so a measurement after it finds every client already there).
    pub fn touch(&self, keys: &[String], applied: &[Applied], concurrency: usize) {
        self.local.block_on(&self.rt, async {
            for chunk in keys.chunks(concurrency.max(1)) {
                let takes: Vec<_> = chunk
                    .iter()
                    .map(|key| self.store.buckets.take(key, applied, 1.0, None))
                    .collect();
                for t in takes {
                    let _ = t.await;
                }
            }
        })
    }

    /// Takes of `applied` at cost 1, `concurrency` in flight, each on a key `draw` picks
    /// from `keys`, for `seconds`: (takes answered, takes failed).
    pub fn drive(
        &self,
        keys: &Rc<Vec<String>>,
        draw: &Rc<Draw>,
        applied: &[Applied],
        concurrency: usize,
        seconds: f64,
    ) -> (u64, u64) {
        let applied: Rc<Vec<Applied>> = Rc::new(applied.to_vec());
        self.local.block_on(&self.rt, async {
            let until = tokio::time::Instant::now() + Duration::from_secs_f64(seconds);
            let tasks: Vec<_> = (0..concurrency)
                .map(|i| {
                    let store = self.store.clone();
                    let (keys, draw, applied) = (keys.clone(), draw.clone(), applied.clone());
                    tokio::task::spawn_local(async move {
                        let mut rng = rand::rng();
                        let (mut ok, mut failed) = (0u64, 0u64);
                        while tokio::time::Instant::now() < until {
                            let key = &keys[draw.pick(i, keys.len(), &mut rng)];
                            match store.buckets.take(key, &applied, 1.0, None).await {
                                Ok(_) => ok += 1,
                                Err(_) => failed += 1,
                            }
                        }
                        (ok, failed)
                    })
                })
                .collect();
            let mut total = (0u64, 0u64);
            for t in tasks {
                let (ok, failed) = t.await.unwrap_or((0, 0));
                total = (total.0 + ok, total.1 + failed);
            }
            total
        })
    }
}

/// The state key of client `id`, as the gateway names it.
pub fn client_key(id: &str) -> String {
    format!("tollgate:b:{{{id}}}")
}
