//! [`FakeClock`]: one wall clock of the test's choosing for the processes it starts (the
//! gateway, `redis-server`), which the test moves while they run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context};
use tempfile::TempDir;

use crate::process::temp_dir;

/// The preloaded library (see the file's comment for why not libfaketime).
const SOURCE: &str = include_str!("fake_clock.c");

/// A wall clock for child processes: every process started with [`FakeClock::env`] reads
/// the realtime clock as the real time plus this clock's offset (or, once frozen, as one
/// instant), kept in one file that it reads at every call. So the gateway and Redis agree
/// on the time (the script's `TIME` and the gateway's quota windows), and
/// [`FakeClock::set`] moves all of them at once.
/// Monotonic clocks are left alone: timers and timeouts run in real time.
///
/// The library is compiled with `cc` when the clock is made (a C compiler is there
/// wherever Rust links).
pub struct FakeClock {
    dir: TempDir,
    file: PathBuf,
    library: PathBuf,
}

impl FakeClock {
    /// A clock reading `unix_s` (seconds since the epoch, fractions allowed) now, and
    /// advancing in real time from there.
    pub fn at(unix_s: f64) -> anyhow::Result<FakeClock> {
        let dir = temp_dir("fake-clock")?;
        let source = dir.path().join("fake_clock.c");
        std::fs::write(&source, SOURCE)?;
        let library = dir.path().join("fake_clock.so");
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&library)
            .arg(&source)
            .output()
            .context("running cc to build the fake clock")?;
        ensure!(
            out.status.success(),
            "cc could not build the fake clock: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let clock = FakeClock {
            file: dir.path().join("offset"),
            library,
            dir,
        };
        clock.set(unix_s)?;
        Ok(clock)
    }

    /// Moves the clock: from now on it reads `unix_s`, advancing in real time.
    pub fn set(&self, unix_s: f64) -> anyhow::Result<()> {
        let real = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
        let offset = unix_s - real;
        self.write(&format!("{offset:+.6}"))
    }

    /// Stops the clock at `unix_s` (to the microsecond): every read gives that instant
    /// until the clock is moved again, so a test decides each instant exactly.
    pub fn freeze(&self, unix_s: f64) -> anyhow::Result<()> {
        self.write(&format!("@{unix_s:.6}"))
    }

    /// Replaces the file's contents. A process running under the clock may do the same
    /// itself: the file is [`FakeClock::env`]'s `TOLLGATE_FAKE_CLOCK`, its format
    /// `fake_clock.c`'s.
    fn write(&self, contents: &str) -> anyhow::Result<()> {
        // Renamed into place: a process reading the file sees the old contents or the new.
        let next = self.dir.path().join("offset.next");
        std::fs::write(&next, contents)?;
        std::fs::rename(&next, &self.file)?;
        Ok(())
    }

    /// The environment a process reads this clock under.
    pub fn env(&self) -> [(&str, &str); 2] {
        [
            ("LD_PRELOAD", path_str(&self.library)),
            ("TOLLGATE_FAKE_CLOCK", path_str(&self.file)),
        ]
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `date +%s` says under `clock`.
    fn date(clock: &FakeClock) -> f64 {
        let out = Command::new("date")
            .arg("+%s.%N")
            .envs(clock.env())
            .output()
            .unwrap();
        String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    #[test]
    fn a_child_reads_the_clock_the_test_sets_and_follows_it_when_moved() {
        // 2026-12-31T23:59:57Z
        let clock = FakeClock::at(1_798_761_597.0).unwrap();
        let t = date(&clock);
        assert!((1_798_761_597.0..1_798_761_599.0).contains(&t), "{t}");

        clock.set(1_000_000_000.5).unwrap();
        let t = date(&clock);
        assert!((1_000_000_000.5..1_000_000_002.0).contains(&t), "{t}");
    }

    #[test]
    fn a_frozen_clock_reads_one_instant_until_it_is_moved() {
        let clock = FakeClock::at(1_798_761_597.0).unwrap();
        clock.freeze(1_798_761_597.123456).unwrap();
        assert_eq!(date(&clock), 1_798_761_597.123456);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(date(&clock), 1_798_761_597.123456);

        clock.set(1_000_000_000.5).unwrap();
        let t = date(&clock);
        assert!((1_000_000_000.5..1_000_000_002.0).contains(&t), "{t}");
    }
}
