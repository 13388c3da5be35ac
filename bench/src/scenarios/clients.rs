//! Many clients for `throughput` and `latency` (issue 14): the gateway knows N clients, all
//! on a plan that never refuses, and every request carries a random one's key, drawn
//! uniformly or Zipf-skewed. With one client (the default) the scenarios measure what they
//! always did: one hot client, where the coalescer shares script calls among requests.

use rand::rngs::SmallRng;
use rand::SeedableRng;
use tollgate_testkit::{ClientDef, GatewayConfig};

use super::takes::Draw;
use crate::http::get_request;

/// Requests prepared per run when there are many clients: sent in turn, so each is a fresh
/// draw for this many requests (the closed loop starts its connections spread over them).
const DRAWN: usize = 1 << 16;

#[derive(Debug, Clone, clap::Args)]
pub struct Clients {
    /// Clients the gateway knows (all on a plan that never refuses); each request carries
    /// a random one's key. 1: one hot client.
    #[arg(long, default_value_t = 1)]
    clients: usize,
    /// With `--clients` above 1, draw clients Zipf-skewed with this exponent (e.g. 1.0)
    /// instead of uniformly; 0: uniform.
    #[arg(long, default_value_t = 0.0)]
    zipf: f64,
}

impl Clients {
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.clients >= 1, "--clients must be at least 1");
        anyhow::ensure!(
            self.zipf >= 0.0 && self.zipf.is_finite(),
            "--zipf needs S >= 0"
        );
        Ok(())
    }

    pub fn many(&self) -> bool {
        self.clients > 1
    }

    fn draw(&self) -> Draw {
        if self.zipf > 0.0 {
            Draw::zipf(self.clients, self.zipf)
        } else {
            Draw::Uniform
        }
    }

    /// "1 client", "10000 clients, uniform", "10000 clients, Zipf s=1".
    pub fn describe(&self) -> String {
        if self.many() {
            format!("{} clients, {}", self.clients, self.draw().describe())
        } else {
            "1 client".into()
        }
    }

    /// Client `i`'s API key (as long as the scenarios' one-client keys).
    fn key(i: usize) -> String {
        format!("bench-many-key-{i:06}")
    }

    /// Adds the many clients to `config`, on its plan `plan` (one that never refuses).
    /// Nothing with one client: the scenario's own client is it.
    pub fn add_to(&self, config: &mut GatewayConfig, plan: &str) {
        config.clients.extend(self.defs(plan));
    }

    /// The many clients, on plan `plan`; none with one client (the scenario's own is it).
    pub fn defs(&self, plan: &str) -> Vec<ClientDef> {
        if !self.many() {
            return Vec::new();
        }
        (0..self.clients)
            .map(|i| ClientDef {
                id: format!("many-{i}"),
                plan: plan.into(),
                key: Clients::key(i),
            })
            .collect()
    }

    /// The requests to send in turn: `one_key`'s alone with one client; else a fixed,
    /// seeded draw of clients, one request each.
    pub fn requests(&self, path: &str, one_key: &str) -> Vec<Vec<u8>> {
        if !self.many() {
            return vec![get_request(path, Some(one_key))];
        }
        let draw = self.draw();
        let mut rng = SmallRng::seed_from_u64(14);
        (0..DRAWN)
            .map(|task| {
                let i = draw.pick(task, self.clients, &mut rng);
                get_request(path, Some(&Clients::key(i)))
            })
            .collect()
    }
}
