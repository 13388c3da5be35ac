//! Ports on 127.0.0.1, and starting a child on one.
//!
//! A free port is only free when it is looked at: [`free_port`] binds port 0 and lets it
//! go, so another test (or another test binary on the machine) can take it before the
//! child that was meant to listen there does. The child then fails to bind and exits,
//! and a readiness check that merely connects would find the other process listening
//! and call the child ready. So [`crate::wait_for_port`] accepts only a listener owned by
//! the child (or a process it started), and says [`PortTaken`] when the child stopped
//! because the port was in use; [`on_a_free_port`] then starts it again on another.

use std::fmt;
use std::net::TcpListener;

/// A port nobody listens on right now (see the module's note: start children on it with
/// [`on_a_free_port`]).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A child could not listen on `port`: another process had it.
#[derive(Debug)]
pub struct PortTaken {
    pub port: u16,
    /// What the child said, or what found the port taken.
    pub detail: String,
}

impl fmt::Display for PortTaken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "port {} is taken: {}", self.port, self.detail)
    }
}

impl std::error::Error for PortTaken {}

/// How many ports [`on_a_free_port`] tries before giving up.
const ATTEMPTS: usize = 10;

/// Runs `start` with a free port, and again with another whenever it fails with
/// [`PortTaken`] (someone took the port first), up to ten ports; any other error is
/// returned at once.
pub fn on_a_free_port<T>(
    what: &str,
    start: impl FnMut(u16) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    on_ports(what, std::iter::from_fn(|| Some(free_port())), start)
}

/// [`on_a_free_port`] over the ports `ports` yields.
pub(crate) fn on_ports<T>(
    what: &str,
    ports: impl Iterator<Item = anyhow::Result<u16>>,
    mut start: impl FnMut(u16) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let mut taken = Vec::new();
    for port in ports.take(ATTEMPTS) {
        match start(port?) {
            Err(e) if e.downcast_ref::<PortTaken>().is_some() => taken.push(e.to_string()),
            other => return other,
        }
    }
    anyhow::bail!(
        "{what}: no free port in {ATTEMPTS} tries: {}",
        taken.join("; ")
    )
}

/// Whether a TCP socket listening on `port` (IPv4 or IPv6) belongs to the process `pid`
/// or one of its descendants, as `/proc` shows it.
pub(crate) fn listens(pid: u32, port: u16) -> bool {
    let inodes = listening_inodes(port);
    if inodes.is_empty() {
        return false;
    }
    family(pid).into_iter().any(|p| {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{p}/fd")) else {
            return false;
        };
        fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|target| {
                let target = target.to_string_lossy();
                inodes.iter().any(|i| target == format!("socket:[{i}]"))
            })
        })
    })
}

/// The inodes of the sockets listening on `port`, from `/proc/net/tcp` and `tcp6`
/// ("sl local rem st tx:rx tr:when retrnsmt uid timeout inode ..."; `st` 0A is LISTEN).
fn listening_inodes(port: u16) -> Vec<String> {
    let suffix = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    (f.get(1)?.ends_with(&suffix) && *f.get(3)? == "0A")
                        .then(|| f.get(9).map(|i| i.to_string()))?
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `pid` and every process below it (through `/proc/<pid>/task/*/children`).
fn family(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    let mut i = 0;
    while let Some(&p) = all.get(i) {
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for task in tasks.flatten() {
                let children = std::fs::read_to_string(task.path().join("children"));
                all.extend(
                    children
                        .iter()
                        .flat_map(|c| c.split_whitespace())
                        .filter_map(|c| c.parse::<u32>().ok()),
                );
            }
        }
        i += 1;
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_is_found_with_its_owner_only() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listens(std::process::id(), port));
        // A child of ours does not hold it (sockets are not inherited across exec).
        let mut other = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        assert!(!listens(other.id(), port));
        other.kill().unwrap();
        other.wait().unwrap();
        drop(listener);
        assert!(!listens(std::process::id(), port));
    }

    #[test]
    fn a_taken_port_is_left_for_the_next_and_other_errors_stop_at_once() {
        let mut tried = Vec::new();
        let got = on_ports("thing", [Ok(1), Ok(2), Ok(3)].into_iter(), |port| {
            tried.push(port);
            if port < 3 {
                Err(PortTaken {
                    port,
                    detail: "in use".into(),
                }
                .into())
            } else {
                Ok(port)
            }
        })
        .unwrap();
        assert_eq!((got, tried), (3, vec![1, 2, 3]));

        let mut tried = Vec::new();
        let err = on_ports("thing", [Ok(1), Ok(2)].into_iter(), |port| {
            tried.push(port);
            Err::<(), _>(anyhow::anyhow!("no such binary"))
        })
        .unwrap_err();
        assert_eq!(tried, [1]);
        assert!(err.to_string().contains("no such binary"));

        let err = on_ports(
            "thing",
            std::iter::repeat_with(|| Ok(7)),
            |port| -> anyhow::Result<()> {
                Err(PortTaken {
                    port,
                    detail: "in use".into(),
                }
                .into())
            },
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("no free port in 10 tries"),
            "{err}"
        );
    }
}
