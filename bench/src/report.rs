//! What a scenario hands back: a Markdown table (or several), the same figures as JSON,
//! and SVG charts by file name.

use std::fmt::Write as _;

/// A scenario's results.
pub struct Outcome {
    pub markdown: String,
    pub json: serde_json::Value,
    /// (file name, SVG document).
    pub charts: Vec<(String, String)>,
}

/// A Markdown table, built row by row.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let line = |cells: &[String]| format!("| {} |", cells.join(" | "));
        let _ = writeln!(out, "{}", line(&self.header));
        let sep: Vec<String> = self
            .header
            .iter()
            .enumerate()
            .map(|(i, _)| if i == 0 { "---".into() } else { "---:".into() })
            .collect();
        let _ = writeln!(out, "{}", line(&sep));
        for r in &self.rows {
            let _ = writeln!(out, "{}", line(r));
        }
        out
    }
}

/// Milliseconds with three decimals (microsecond resolution).
pub fn ms(v: f64) -> String {
    format!("{v:.3}")
}

/// A share in %, two decimals.
pub fn mib(v: f64) -> String {
    format!("{v:.1} MiB")
}

pub fn pct(v: f64) -> String {
    format!("{v:.2}%")
}

/// A count or a rate, whole.
pub fn count(v: f64) -> String {
    format!("{v:.0}")
}

/// Rounds to `digits` decimals for JSON, so files diff readably.
pub fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// The median (the mean of the middle two for an even count); 0 for none.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Which way a figure gets worse, for [`OverRuns`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Worse {
    Higher,
    Lower,
    /// An error in %: the run farthest from 0 either way.
    FartherFromZero,
}

impl Worse {
    /// How the report names it ("highest").
    pub fn word(self) -> &'static str {
        match self {
            Worse::Higher => "highest",
            Worse::Lower => "lowest",
            Worse::FartherFromZero => "farthest from 0",
        }
    }
}

/// A figure a scenario of repeated runs reports about each run `R`: (its JSON name, its
/// row label or table header, which way is worse, its value in one run, the cell's
/// format). A scenario lists them once and reports each as [`OverRuns`].
pub type Figure<R> = (
    &'static str,
    &'static str,
    Worse,
    fn(&R) -> f64,
    fn(f64) -> String,
);

/// One figure over repeated runs: the median and the worst run's. On a shared host a run
/// can be lucky as easily as unlucky, so a single run, or the best of several, says little:
/// the median is the typical run, the worst what one must be ready for. The best is never
/// reported.
#[derive(Debug, Clone)]
pub struct OverRuns {
    pub median: f64,
    pub worst: f64,
    pub worse: Worse,
    /// Every run's value, in run order.
    pub runs: Vec<f64>,
}

impl OverRuns {
    pub fn of(runs: Vec<f64>, worse: Worse) -> OverRuns {
        let pick = |a: f64, b: f64| match worse {
            Worse::Higher => a.max(b),
            Worse::Lower => a.min(b),
            Worse::FartherFromZero => {
                if b.abs() > a.abs() {
                    b
                } else {
                    a
                }
            }
        };
        let worst = runs.iter().copied().reduce(pick).unwrap_or(0.0);
        OverRuns {
            median: median(&runs),
            worst,
            worse,
            runs,
        }
    }

    /// A table cell: `median (worst)`, each written by `fmt`; the value alone for one run.
    pub fn cell(&self, fmt: impl Fn(f64) -> String) -> String {
        if self.runs.len() > 1 {
            format!("{} ({})", fmt(self.median), fmt(self.worst))
        } else {
            fmt(self.median)
        }
    }

    /// `{"median", "worst", "worse", "runs"}`, rounded to `digits` decimals.
    pub fn json(&self, digits: i32) -> serde_json::Value {
        serde_json::json!({
            "median": round(self.median, digits),
            "worst": round(self.worst, digits),
            "worse": self.worse.word(),
            "runs": self.runs.iter().map(|&v| round(v, digits)).collect::<Vec<_>>(),
        })
    }
}

/// A one-line description of the machine and its load when the run started, for the
/// record (the reference machine has 2 cores, shared with compiles).
pub fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into());
    format!("{cores} cores, load average {load} at start")
}

/// The machine's CPU time so far (`/proc/stat`, all CPUs, clock ticks).
#[derive(Clone, Copy)]
struct Jiffies {
    /// user + nice + system: time in processes.
    tasks: u64,
    /// irq + softirq: interrupt handling (loopback traffic is mostly softirq).
    irq: u64,
    /// Time the hypervisor ran something else while this VM wanted to run.
    steal: u64,
    total: u64,
}

fn jiffies() -> Option<Jiffies> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    Some(Jiffies {
        tasks: at(0) + at(1) + at(2),
        irq: at(5) + at(6),
        steal: at(7),
        total: f.iter().take(8).sum(),
    })
}

fn cpu_jiffies() -> Option<(u64, u64)> {
    let j = jiffies()?;
    Some((j.tasks + j.irq, j.total - j.steal))
}

/// The share of CPU time the hypervisor steals while every CPU is busy: spins one
/// thread per CPU for 300 ms. Steal shows only when the VM wants to run, so an idle
/// machine cannot tell a contended host from a free one without this.
fn steal_probe() -> Option<f64> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let a = jiffies()?;
    let until = std::time::Instant::now() + std::time::Duration::from_millis(300);
    let spinners: Vec<_> = (0..cpus)
        .map(|_| {
            std::thread::spawn(move || {
                while std::time::Instant::now() < until {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    for s in spinners {
        let _ = s.join();
    }
    let b = jiffies()?;
    Some((b.steal - a.steal) as f64 / (b.total - a.total).max(1) as f64)
}

/// Waits (at most `max`) until the machine's CPUs were under 15% busy for a second and
/// the hypervisor steals under 5% of a busy VM's time.
pub fn wait_idle(max: std::time::Duration) {
    let deadline = std::time::Instant::now() + max;
    loop {
        let Some((b0, t0)) = cpu_jiffies() else {
            return;
        };
        std::thread::sleep(std::time::Duration::from_secs(1));
        let Some((b1, t1)) = cpu_jiffies() else {
            return;
        };
        let busy = (b1 - b0) as f64 / (t1 - t0).max(1) as f64;
        let steal = if busy < 0.15 { steal_probe() } else { None };
        if busy < 0.15 && steal.is_none_or(|s| s < 0.05) {
            return;
        }
        let why = match steal {
            Some(s) => format!("the hypervisor steals {:.0}%", s * 100.0),
            None => format!("{:.0}% busy", busy * 100.0),
        };
        if std::time::Instant::now() > deadline {
            eprintln!("still not idle ({why}) after waiting; running anyway");
            return;
        }
        eprintln!("waiting for an idle machine ({why})");
        std::thread::sleep(std::time::Duration::from_secs(4));
    }
}

/// CPU time of this process and its descendants, in clock ticks: live descendants from
/// `/proc`, reaped ones through our `cutime`/`cstime`.
fn own_ticks() -> u64 {
    let me = std::process::id();
    let mut parent = std::collections::HashMap::new();
    let mut ticks = std::collections::HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name, which is in parentheses and may hold spaces.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        // rest[0] is the state (field 3): ppid is field 4, utime 14, stime 15, cutime 16,
        // cstime 17.
        parent.insert(pid, num(1) as u32);
        let own = num(11) + num(12);
        let reaped = if pid == me { num(13) + num(14) } else { 0 };
        ticks.insert(pid, own + reaped);
    }
    let is_ours = |mut pid: u32| {
        for _ in 0..64 {
            if pid == me {
                return true;
            }
            match parent.get(&pid) {
                Some(&p) if p != 0 => pid = p,
                _ => return false,
            }
        }
        false
    };
    ticks
        .iter()
        .filter(|(pid, _)| is_ours(**pid))
        .map(|(_, t)| *t)
        .sum()
}

/// Watches what else used the machine during a run: other processes, and the
/// hypervisor's steal time (the "2 cores" are virtual; when the host is busy, they stall
/// for milliseconds at a time). On a shared machine these say whether a run was disturbed.
pub struct CpuWatch {
    start: Jiffies,
    own: u64,
}

/// What [`CpuWatch`] saw, as shares of all CPUs' time (0..1).
pub struct Disturbance {
    pub other_processes: f64,
    pub steal: f64,
}

impl Disturbance {
    /// `other_processes_cpu_pct` and `steal_cpu_pct`, as every scenario's JSON has them.
    pub fn json_fields(&self) -> [(&'static str, serde_json::Value); 2] {
        [
            (
                "other_processes_cpu_pct",
                serde_json::json!(round(self.other_processes * 100.0, 1)),
            ),
            (
                "steal_cpu_pct",
                serde_json::json!(round(self.steal * 100.0, 1)),
            ),
        ]
    }

    /// The same as a JSON object.
    pub fn json(&self) -> serde_json::Value {
        serde_json::Value::Object(
            self.json_fields()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        )
    }
}

/// For scenarios of repeated runs, each watched by its own [`CpuWatch`]: a sentence giving
/// each run's steal and other processes' CPU (the worst run is often the disturbed one),
/// and the same as a JSON array (`null` where `/proc/stat` could not be read).
pub fn runs_disturbance<'a>(
    runs: impl IntoIterator<Item = Option<&'a Disturbance>>,
) -> (String, serde_json::Value) {
    let runs: Vec<_> = runs.into_iter().collect();
    let pct = |f: fn(&Disturbance) -> f64| {
        runs.iter()
            .map(|d| d.map_or("?".into(), |d| format!("{:.1}%", f(d) * 100.0)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let text = format!(
        "Per run, the hypervisor stole {} and other processes used {} of the machine's CPU time.\n",
        pct(|d| d.steal),
        pct(|d| d.other_processes)
    );
    let json = runs
        .iter()
        .map(|d| d.map_or(serde_json::Value::Null, Disturbance::json))
        .collect();
    (text, json)
}

impl CpuWatch {
    pub fn start() -> Option<CpuWatch> {
        Some(CpuWatch {
            start: jiffies()?,
            own: own_ticks(),
        })
    }

    pub fn stop(&self) -> Option<Disturbance> {
        let now = jiffies()?;
        let total = (now.total - self.start.total).max(1) as f64;
        let own = own_ticks().saturating_sub(self.own) as f64;
        let tasks = (now.tasks - self.start.tasks) as f64;
        Some(Disturbance {
            other_processes: ((tasks - own) / total).max(0.0),
            steal: (now.steal - self.start.steal) as f64 / total,
        })
    }
}

/// Each figure over the runs, as a "median (worst)" table and as JSON by name.
pub fn figures_over<R>(
    runs: &[R],
    figures: &[Figure<R>],
) -> (Table, serde_json::Map<String, serde_json::Value>) {
    let mut table = Table::new(&["figure", "median (worst)"]);
    let mut json = serde_json::Map::new();
    for (name, label, worse, of, fmt) in figures {
        let over = OverRuns::of(runs.iter().map(of).collect(), *worse);
        table.row(vec![label.to_string(), over.cell(fmt)]);
        json.insert((*name).into(), over.json(3));
    }
    (table, json)
}

/// The platform's pauses, as a thread at the bench's priority sees them (as jHiccup
/// measures a JVM's): it sleeps 1 ms at a time and records every wake-up later than
/// [`Hiccups::AT_LEAST`]. On this kind of host both virtual cores can stop at once for
/// tens of milliseconds while the steal counter stays at 0; a tail that coincides with
/// such a pause is the host's, not the code's.
pub struct Hiccups {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Hiccup>>,
}

/// One pause: when it ended (from the meter's `origin`) and how long past the 1 ms sleep.
#[derive(Debug, Clone, Copy)]
pub struct Hiccup {
    pub ended: std::time::Duration,
    pub late: std::time::Duration,
}

impl Hiccups {
    /// Wake-ups later than this are recorded.
    pub const AT_LEAST: std::time::Duration = std::time::Duration::from_millis(5);

    /// Starts the meter; its times are offsets from `origin` (e.g. an open run's start).
    pub fn start(origin: std::time::Instant) -> Hiccups {
        use std::sync::atomic::Ordering::Relaxed;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("bench-hiccups".into())
            .spawn(move || {
                // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack.
                unsafe {
                    libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
                }
                let tick = std::time::Duration::from_millis(1);
                let mut seen = Vec::new();
                while !stopped.load(Relaxed) {
                    let asked = std::time::Instant::now();
                    std::thread::sleep(tick);
                    let now = std::time::Instant::now();
                    let late = now.saturating_duration_since(asked).saturating_sub(tick);
                    if late >= Hiccups::AT_LEAST {
                        seen.push(Hiccup {
                            ended: now.saturating_duration_since(origin),
                            late,
                        });
                    }
                }
                seen
            })
            .expect("spawning the hiccup meter");
        Hiccups { stop, thread }
    }

    /// The same meter for a Redis server: a `PING` every millisecond on a connection of its
    /// own, recording every round trip of at least [`Hiccups::AT_LEAST`] (`late` is the
    /// round trip). A store that stops answering shows here even when none of its
    /// commands is slow by its own clock (`LATENCY`).
    pub fn start_redis(origin: std::time::Instant, port: u16) -> std::io::Result<Hiccups> {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering::Relaxed;
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port))?;
        conn.set_nodelay(true)?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("bench-redis-hiccups".into())
            .spawn(move || {
                let mut seen = Vec::new();
                let mut reply = [0u8; 7];
                while !stopped.load(Relaxed) {
                    let asked = std::time::Instant::now();
                    if conn.write_all(b"PING\r\n").is_err() || conn.read_exact(&mut reply).is_err()
                    {
                        break;
                    }
                    let now = std::time::Instant::now();
                    let took = now.saturating_duration_since(asked);
                    if took >= Hiccups::AT_LEAST {
                        seen.push(Hiccup {
                            ended: now.saturating_duration_since(origin),
                            late: took,
                        });
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                seen
            })?;
        Ok(Hiccups { stop, thread })
    }

    /// Stops the meter: the pauses it saw, in order.
    pub fn stop(self) -> Vec<Hiccup> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}
