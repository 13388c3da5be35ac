//! Child processes: killed with the thread that started them, signalled, waited for,
//! stopped; and the temporary directories that hold their files.

use std::ffi::OsStr;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::ports::{listens, PortTaken};

/// A command for a fixture's child: it gets SIGTERM when the thread that starts it dies,
/// however it dies (Ctrl-C included), so no redis-server or gateway outlives a test run or
/// a load run (start fixtures on the thread that owns them: a test's, the tool's main
/// one); no stdin, and stdout and stderr discarded unless the caller sets them.
pub fn command(program: impl AsRef<OsStr>) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: prctl is async-signal-safe, and this closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    cmd
}

/// Sends `sig` (e.g. `libc::SIGSTOP`) to a child.
pub fn signal(child: &Child, sig: libc::c_int) -> anyhow::Result<()> {
    // SAFETY: kill(2) on the id of a child we spawned and have not reaped.
    if unsafe { libc::kill(child.id() as libc::pid_t, sig) } != 0 {
        bail!(
            "kill({}, {sig}): {}",
            child.id(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Waits until the child listens on `addr` (a listener that accepts a connection and that
/// the child, or a process it started, owns: another process that took the port does not
/// count). Fails at once, with its `logs`, if the child exits first: with [`PortTaken`]
/// when they say the address was in use, so the caller can try another port
/// ([`crate::on_a_free_port`]); and after `within` if it never listens.
pub fn wait_for_port(
    addr: SocketAddr,
    child: &mut Child,
    what: &str,
    logs: &[&Path],
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok()
            && listens(child.id(), addr.port())
        {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            let logs: String = logs
                .iter()
                .filter_map(|l| std::fs::read_to_string(l).ok())
                .collect();
            if logs.contains("Address already in use") {
                return Err(PortTaken {
                    port: addr.port(),
                    detail: format!("{what} exited ({status}):\n{logs}"),
                }
                .into());
            }
            bail!("{what} exited ({status}) before listening on {addr}:\n{logs}");
        }
        if Instant::now() > deadline {
            bail!("{what} did not listen on {addr} within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stops a child: SIGTERM, then SIGKILL if it has not exited within `grace` (at once when
/// `grace` is zero); reaps it either way. A stopped (SIGSTOP) child is continued first, so
/// it can act on the SIGTERM.
pub fn stop(child: &mut Child, grace: Duration) {
    if !grace.is_zero() {
        let _ = signal(child, libc::SIGCONT);
        let _ = signal(child, libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The prefix of every directory [`temp_dir`] makes, followed by the owner's pid.
const PREFIX: &str = "tollgate-testkit-";

/// A new directory under the system's temp dir, removed on drop (unless kept with
/// `TempDir::keep`), named after this process so [`clean_stale_dirs`] can tell when its
/// owner is gone.
pub fn temp_dir(what: &str) -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{}-{what}-", std::process::id()))
        .tempdir()
        .with_context(|| format!("creating a temporary directory for {what}"))
}

/// Removes the [`temp_dir`]s of earlier runs that were killed before they could (or that
/// kept theirs), once the process that made them is gone.
pub fn clean_stale_dirs() {
    let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
