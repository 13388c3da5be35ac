//! `redis-server` processes on free ports of 127.0.0.1, with no persistence unless asked
//! (`SAVE`, or [`RedisServer::start_with`] `--appendonly yes`), and a local Redis Cluster of
//! three of them.

use std::collections::{BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use tempfile::TempDir;

use crate::process::{command, signal, stop, temp_dir, wait_for_port};
use crate::{on_a_free_port, FaultProxy, PortTaken};

/// A `redis-server` on a free port, killed on drop. Its directory (where `SAVE` writes)
/// lives as long as it does, across [`RedisServer::restart`].
pub struct RedisServer {
    child: Child,
    pub port: u16,
    /// Arguments beyond the defaults (a cluster node's), for restarts.
    args: Vec<String>,
    /// Its environment beyond ours (a [`crate::FakeClock`]'s), for restarts.
    env: Vec<(String, String)>,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a server on a free port (another if someone takes that one first) and waits
    /// until it answers `PING`.
    pub fn start() -> anyhow::Result<RedisServer> {
        on_a_free_port("redis-server", |port| RedisServer::start_on(port, &[], &[]))
    }

    /// [`RedisServer::start`] with `args` after the defaults (which they override, e.g.
    /// `--appendonly yes`), kept for restarts. The directory is always the server's own.
    pub fn start_with(args: &[&str]) -> anyhow::Result<RedisServer> {
        on_a_free_port("redis-server", |port| {
            RedisServer::start_on(port, args, &[])
        })
    }

    /// [`RedisServer::start`] with `env` added to the server's environment (kept for
    /// restarts), e.g. a [`crate::FakeClock`]'s, so that `TIME` reads the test's clock.
    pub fn start_with_env(env: &[(&str, &str)]) -> anyhow::Result<RedisServer> {
        on_a_free_port("redis-server", |port| RedisServer::start_on(port, &[], env))
    }

    fn start_on(port: u16, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<RedisServer> {
        let dir = temp_dir("redis")?;
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let child = RedisServer::spawn(port, &args, &env, &dir)?;
        let server = RedisServer {
            child,
            port,
            args,
            env,
            dir,
        };
        server.wait_until_ready()?;
        Ok(server)
    }

    fn spawn(
        port: u16,
        args: &[String],
        env: &[(String, String)],
        dir: &TempDir,
    ) -> anyhow::Result<Child> {
        let log = dir.path().join("redis.log");
        let mut child = command("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(args)
            .arg("--dir")
            .arg(dir.path())
            .arg("--logfile")
            .arg(&log)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .spawn()
            .context("starting redis-server (apt-get install -y redis-server)")?;
        wait_for_port(
            SocketAddr::from(([127, 0, 0, 1], port)),
            &mut child,
            "redis-server",
            &[&log],
            Duration::from_secs(60),
        )?;
        Ok(child)
    }

    fn wait_until_ready(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pong = self
                .conn()
                .and_then(|mut c| Ok(redis::cmd("PING").query::<String>(&mut c)?));
            match pong {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(
                        e.context(format!("redis-server on {} did not answer PING", self.port))
                    )
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's process id (its threads' scheduling can be set, e.g. with `chrt -a -p`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A blocking connection, for inspecting what the gateway wrote.
    pub fn conn(&self) -> anyhow::Result<redis::Connection> {
        Ok(redis::Client::open(self.url())?.get_connection()?)
    }

    /// Runs the server out of memory (another tenant's data, a runaway key): 2 MB under a
    /// `maxmemory` of 1 MB, so under `noeviction` it refuses every write and keeps
    /// answering reads. [`RedisServer::free_memory`] undoes it.
    pub fn fill_memory(&self) -> anyhow::Result<()> {
        let mut c = self.conn()?;
        redis::cmd("SET")
            .arg("ballast")
            .arg(vec![b'x'; 2 * 1024 * 1024])
            .exec(&mut c)?;
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg("1mb")
            .exec(&mut c)?;
        Ok(())
    }

    /// Frees what [`RedisServer::fill_memory`] took, under a `maxmemory` of 64 MB.
    pub fn free_memory(&self) -> anyhow::Result<()> {
        let mut c = self.conn()?;
        redis::cmd("DEL").arg("ballast").exec(&mut c)?;
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg("64mb")
            .exec(&mut c)?;
        Ok(())
    }

    /// Freezes the server (SIGSTOP): its connections stay open and nothing answers.
    pub fn stall(&self) -> anyhow::Result<()> {
        signal(&self.child, libc::SIGSTOP)
    }

    /// Thaws a stalled server (SIGCONT).
    pub fn resume(&self) -> anyhow::Result<()> {
        signal(&self.child, libc::SIGCONT)
    }

    /// Kills the server (SIGKILL); [`RedisServer::restart`] brings it back on the port.
    pub fn kill(&mut self) {
        stop(&mut self.child, Duration::ZERO);
    }

    /// Stops the server the way an operator does (SIGTERM: it finishes its shutdown, which
    /// saves nothing unless its configuration says so) and waits until it has exited.
    /// Fails, after killing it, if it has not within 10 s.
    pub fn terminate(&mut self) -> anyhow::Result<()> {
        signal(&self.child, libc::SIGTERM)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                self.kill();
                bail!("redis-server on {} ignored SIGTERM for 10 s", self.port);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Kills the server if it runs and starts a fresh one on the same port, directory and
    /// arguments (empty, unless a `SAVE` left a snapshot there or it keeps an append-only
    /// file). Fails with [`PortTaken`] if another process took the port in between.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.child = RedisServer::spawn(self.port, &self.args, &self.env, &self.dir)?;
        self.wait_until_ready()
    }

    /// `FLUSHALL`.
    pub fn flush(&self) -> anyhow::Result<()> {
        let _: () = redis::cmd("FLUSHALL").query(&mut self.conn()?)?;
        Ok(())
    }

    /// Zeroes `INFO commandstats`, so later counts are only what follows.
    pub fn reset_command_stats(&self) -> anyhow::Result<()> {
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut self.conn()?)?;
        Ok(())
    }

    /// `INFO commandstats` as command (lower case, e.g. `evalsha`) → calls.
    pub fn command_calls(&self) -> anyhow::Result<HashMap<String, u64>> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn()?)?;
        Ok(info
            .lines()
            .filter_map(|l| l.strip_prefix("cmdstat_"))
            .filter_map(|l| {
                let (name, rest) = l.split_once(':')?;
                let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
                Some((name.to_string(), calls.parse().ok()?))
            })
            .collect())
    }

    /// Calls of one command so far (0 if none), e.g. `evalsha`.
    pub fn calls(&self, command: &str) -> anyhow::Result<u64> {
        Ok(self.command_calls()?.get(command).copied().unwrap_or(0))
    }

    /// The last command each connection named `name` ran (`CLIENT LIST`'s `cmd`, e.g.
    /// `evalsha`, `client|setname`).
    pub fn last_commands_of(&self, name: &str) -> anyhow::Result<Vec<String>> {
        let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut self.conn()?)?;
        let name = format!(" name={name} ");
        Ok(list
            .lines()
            .filter(|l| l.contains(&name))
            .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("cmd=")))
            .map(String::from)
            .collect())
    }

    /// `KEYS pattern`.
    pub fn keys(&self, pattern: &str) -> anyhow::Result<Vec<String>> {
        Ok(redis::cmd("KEYS").arg(pattern).query(&mut self.conn()?)?)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A local Redis Cluster of three masters (no replicas), formed with `redis-cli --cluster
/// create`, killed on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three nodes and forms the cluster; returns once every node says
    /// `cluster_state:ok`.
    pub fn start() -> anyhow::Result<RedisCluster> {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            nodes.push(on_a_free_port("a cluster node", |port| {
                // The cluster bus listens on port + 10000.
                if port > 55_000 || TcpListener::bind(("127.0.0.1", port + 10_000)).is_err() {
                    return Err(PortTaken {
                        port,
                        detail: "its cluster bus port (+10000) is not free".into(),
                    }
                    .into());
                }
                RedisServer::start_on(
                    port,
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-node-timeout",
                        "2000",
                        "--cluster-config-file",
                        "nodes.conf",
                    ],
                    &[],
                )
            })?);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let ok = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("running redis-cli")?
            .success();
        ensure!(ok, "redis-cli --cluster create failed");
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &nodes {
            loop {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut n.conn()?)
                    .unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                ensure!(Instant::now() < deadline, "the cluster did not form");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(RedisCluster { nodes })
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }

    /// Puts a fault proxy in front of every node and makes the nodes announce the
    /// proxies' ports (`cluster-announce-port`), so a cluster client reaches every node,
    /// seeds and redirects alike, through its proxy. Returns once every node's slot map
    /// names only proxies.
    pub fn behind_proxies(&self) -> anyhow::Result<Vec<FaultProxy>> {
        let proxies: Vec<_> = self
            .nodes
            .iter()
            .map(|n| FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], n.port))))
            .collect();
        for (n, p) in self.nodes.iter().zip(&proxies) {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("cluster-announce-port")
                .arg(p.port())
                .query(&mut n.conn()?)?;
        }
        let wanted: BTreeSet<i64> = proxies.iter().map(|p| p.port() as i64).collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &self.nodes {
            loop {
                let slots: Vec<Vec<redis::Value>> =
                    redis::cmd("CLUSTER").arg("SLOTS").query(&mut n.conn()?)?;
                let ports: BTreeSet<i64> = slots
                    .iter()
                    .filter_map(|r| match r.get(2)? {
                        redis::Value::Array(m) => redis::from_redis_value_ref(m.get(1)?).ok(),
                        _ => None,
                    })
                    .collect();
                if ports == wanted {
                    break;
                }
                ensure!(
                    Instant::now() < deadline,
                    "nodes did not announce the proxies"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(proxies)
    }

    /// The slot of `key`, as the cluster computes it (`CLUSTER KEYSLOT`).
    pub fn slot_of(&self, key: &str) -> anyhow::Result<i64> {
        Ok(redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut self.nodes[0].conn()?)?)
    }

    /// Moves `key`'s slot, with its keys, from its node to node `to` (what resharding
    /// does), so clients that still route by the old map get `MOVED`.
    pub fn move_slot_of(&self, key: &str, to: usize) -> anyhow::Result<()> {
        let from = self.owner(key)?;
        ensure!(from != to, "{key} is on node {to} already");
        let slot = self.slot_of(key)?;
        let id = |i: usize| -> anyhow::Result<String> {
            Ok(redis::cmd("CLUSTER")
                .arg("MYID")
                .query(&mut self.nodes[i].conn()?)?)
        };
        let (from_id, to_id) = (id(from)?, id(to)?);
        let setslot = |i: usize, args: &[&str]| -> anyhow::Result<()> {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(args)
                .query(&mut self.nodes[i].conn()?)?;
            Ok(())
        };
        setslot(to, &["IMPORTING", &from_id])?;
        setslot(from, &["MIGRATING", &to_id])?;
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query(&mut self.nodes[from].conn()?)?;
        if !keys.is_empty() {
            let _: () = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(self.nodes[to].port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut self.nodes[from].conn()?)?;
        }
        for i in 0..self.nodes.len() {
            setslot(i, &["NODE", &to_id])?;
        }
        Ok(())
    }

    /// The index of the node that serves `key`.
    pub fn owner(&self, key: &str) -> anyhow::Result<usize> {
        let slot = self.slot_of(key)?;
        let ranges: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query(&mut self.nodes[0].conn()?)?;
        for range in ranges {
            let [start, end, master, ..] = range.as_slice() else {
                bail!("CLUSTER SLOTS: a range of {} fields", range.len());
            };
            let (start, end): (i64, i64) = (
                redis::from_redis_value_ref(start)?,
                redis::from_redis_value_ref(end)?,
            );
            if (start..=end).contains(&slot) {
                let master: Vec<redis::Value> = redis::from_redis_value_ref(master)?;
                let port: i64 = redis::from_redis_value_ref(
                    master
                        .get(1)
                        .context("CLUSTER SLOTS: a master without a port")?,
                )?;
                return self
                    .nodes
                    .iter()
                    .position(|n| i64::from(n.port) == port)
                    .with_context(|| format!("no node on port {port}"));
            }
        }
        bail!("slot {slot} of {key} is not served")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::free_port;
    use crate::ports::on_ports;

    /// The process id a server says it has (`INFO server`).
    fn process_id(server: &RedisServer) -> u32 {
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query(&mut server.conn().unwrap())
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|p| p.trim().parse().ok())
            .expect("process_id in INFO server")
    }

    #[test]
    fn a_port_another_server_took_is_not_mistaken_for_ours_and_the_next_is_used() {
        let other = RedisServer::start().unwrap();

        // Straight onto the taken port: ours exits, the other answers PING, and that is
        // not taken for ours.
        match RedisServer::start_on(other.port, &[], &[]) {
            Ok(s) => panic!(
                "started on a taken port, answered by pid {}",
                process_id(&s)
            ),
            Err(e) => assert!(e.downcast_ref::<PortTaken>().is_some(), "{e:#}"),
        }

        // Offered the taken port first, it starts on the next one.
        let ports = std::iter::once(Ok(other.port)).chain(std::iter::from_fn(|| Some(free_port())));
        let ours = on_ports("redis-server", ports, |port| {
            RedisServer::start_on(port, &[], &[])
        })
        .unwrap();
        assert_ne!(ours.port, other.port);
        assert_eq!(process_id(&ours), ours.child.id());
        assert_eq!(process_id(&other), other.child.id());
    }
}
