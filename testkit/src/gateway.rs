//! The gateway's real binary as a child process, configured through [`GatewayConfig`].

use std::fs::{File, OpenOptions};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use anyhow::Context;
use tempfile::TempDir;

use crate::ports::on_ports;
use crate::process::{command, stop, temp_dir, wait_for_port};
use crate::{free_port, GatewayConfig};

/// How to run the binary: which one, under what, with which environment, and how to stop
/// it. Tests pass `env!("CARGO_BIN_EXE_tollgate")`; the load tool the binary beside it.
#[derive(Debug, Clone)]
pub struct Launcher {
    binary: PathBuf,
    wrapper: Vec<String>,
    env: Vec<(String, String)>,
    stop_grace: Duration,
}

impl Launcher {
    /// Runs `binary` with `RUST_LOG=warn`; dropping the process kills it (SIGKILL).
    pub fn new(binary: impl Into<PathBuf>) -> Launcher {
        Launcher {
            binary: binary.into(),
            wrapper: Vec::new(),
            env: vec![("RUST_LOG".into(), "warn".into())],
            stop_grace: Duration::ZERO,
        }
    }

    /// Sets an environment variable of the gateway (over any set before, `RUST_LOG`
    /// included).
    pub fn env(mut self, name: &str, value: &str) -> Launcher {
        self.env.retain(|(k, _)| k != name);
        self.env.push((name.into(), value.into()));
        self
    }

    /// [`Launcher::env`] for each pair.
    pub fn envs(self, vars: &[(&str, &str)]) -> Launcher {
        vars.iter().fold(self, |l, (k, v)| l.env(k, v))
    }

    /// Runs the binary under a command line, e.g. `["valgrind", "--tool=callgrind"]`.
    pub fn wrapper(mut self, command: Vec<String>) -> Launcher {
        self.wrapper = command;
        self
    }

    /// On drop: SIGTERM (as in production, so a profiler writes its data), and SIGKILL
    /// only if it has not exited within `grace`.
    pub fn stop_grace(mut self, grace: Duration) -> Launcher {
        self.stop_grace = grace;
        self
    }

    /// Starts the gateway with `config` on a free port (another if someone takes that one
    /// first), its files (configuration, catalog, `gateway.log` for stdout, `gateway.err`
    /// for stderr) in a new temporary directory, and waits until it listens.
    pub fn spawn(self, config: &GatewayConfig) -> anyhow::Result<GatewayProcess> {
        self.spawn_on(config, std::iter::from_fn(|| Some(free_port())))
    }

    /// [`Launcher::spawn`] on the first of `ports` that nobody takes first.
    fn spawn_on(
        self,
        config: &GatewayConfig,
        ports: impl Iterator<Item = anyhow::Result<u16>>,
    ) -> anyhow::Result<GatewayProcess> {
        let dir = temp_dir("gateway")?;
        let file = dir.path().join("gateway.toml");
        let (child, addr) = on_ports("the gateway", ports, |port| {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            std::fs::write(&file, config.toml(&addr.to_string(), dir.path()))?;
            Ok((self.start(&file, addr, dir.path())?, addr))
        })?;
        Ok(GatewayProcess {
            child,
            addr,
            address: format!("http://{addr}"),
            catalog: GatewayConfig::catalog_file(dir.path()),
            config: file,
            launcher: self,
            dir,
        })
    }

    fn start(&self, config: &Path, addr: SocketAddr, dir: &Path) -> anyhow::Result<Child> {
        let (log, err) = (dir.join("gateway.log"), dir.join("gateway.err"));
        let append = |p: &Path| -> anyhow::Result<File> {
            Ok(OpenOptions::new().create(true).append(true).open(p)?)
        };
        let mut cmd = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut c = command(program);
                c.args(args).arg(&self.binary);
                c
            }
            None => command(&self.binary),
        };
        let mut child = cmd
            .arg("--config")
            .arg(config)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(append(&log)?)
            .stderr(append(&err)?)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        // Generous: a gateway under a profiler starts many times slower.
        wait_for_port(
            addr,
            &mut child,
            "tollgate",
            &[&log, &err],
            Duration::from_secs(60),
        )?;
        Ok(child)
    }
}

/// A running gateway process, stopped on drop (see [`Launcher::stop_grace`]) and its
/// directory removed.
pub struct GatewayProcess {
    pub child: Child,
    pub addr: SocketAddr,
    /// `http://127.0.0.1:<port>`.
    pub address: String,
    /// Its embedded catalog file.
    pub catalog: PathBuf,
    config: PathBuf,
    launcher: Launcher,
    dir: TempDir,
}

impl GatewayProcess {
    /// Kills it (SIGKILL) and starts it again with the same configuration, files and port
    /// (failing with [`crate::PortTaken`] if another process took the port in between).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        stop(&mut self.child, Duration::ZERO);
        self.child = self
            .launcher
            .start(&self.config, self.addr, self.dir.path())?;
        Ok(())
    }

    /// Its directory: configuration, catalog and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        stop(&mut self.child, self.launcher.stop_grace);
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::ports::listens;

    #[test]
    fn a_gateway_whose_port_was_taken_starts_on_the_next() {
        // A stand-in for the binary (run as `sh -c SCRIPT sh BINARY --config FILE`): a
        // redis-server on the port the configuration's `listen` names, which exits saying
        // "Address already in use" when the port is taken, as the gateway does.
        let script = r#"port=$(sed -n 's/^listen = "127\.0\.0\.1:\([0-9]*\)"$/\1/p' "$3"); exec redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no"#;
        let launcher = Launcher::new("tollgate-stand-in").wrapper(vec![
            "sh".into(),
            "-c".into(),
            script.into(),
            "sh".into(),
        ]);
        let thief = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = thief.local_addr().unwrap().port();

        let ports = std::iter::once(Ok(taken)).chain(std::iter::from_fn(|| Some(free_port())));
        let gw = launcher.spawn_on(&GatewayConfig::default(), ports).unwrap();

        assert_ne!(gw.addr.port(), taken);
        assert!(listens(gw.child.id(), gw.addr.port()));
        let config = std::fs::read_to_string(&gw.config).unwrap();
        assert!(
            config.contains(&format!("listen = \"{}\"", gw.addr)),
            "{config}"
        );
    }
}
