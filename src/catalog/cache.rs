//! The last-known catalog on disk, so a gateway that starts while its store is down still
//! knows its clients.
//!
//! Each gateway on Redis keeps what it holds of the catalog (plans, clients with their key
//! hashes, modes, shards, safety settings, and the store's epoch and version) in two files,
//! readable by the process owner only, written from the catalog's background task (never
//! on the request path):
//!
//! - `catalog.cache_file`, a **snapshot**, replaced atomically (a unique temporary file,
//!   fsync, rename);
//! - `<catalog.cache_file>.log`, a **journal** of the changes applied since, one JSON line
//!   per batch, appended and fsynced on each catalog tick. Each line carries a sequence
//!   number and the catalog's epoch and version *after* it, and the snapshot says up to
//!   which line it holds, so lines from before it are skipped when read.
//!
//! Both are serialized and written on a thread of their own, `catalog-cache`, below the
//! request path's priority (nice 10): a snapshot of 100,000 clients is about 100 ms of
//! copying and encoding, and a journal line of the 5,000 clients a busy second brings is
//! tens of milliseconds, which on a gateway with as many cores as busy threads delayed the
//! requests of that second (measured on 2 cores: 20-95 ms bursts on the runtime's threads,
//! beside first requests' p99 of 6-8 ms). The request path only hands over its entries
//! (`Arc`s): it copies no record for the files.
//!
//! A change costs a line, never a rewrite of the whole catalog. The snapshot is written
//! again (and the journal started over) only when the journal has grown past the snapshot
//! (at least [`COMPACT_AFTER`] lines), or after the catalog was replaced whole (a reload).
//! In cache mode what is held is bounded (`catalog.cached_clients`), so both files are.
//!
//! At start, when the store does not answer, the gateway serves the snapshot with the
//! journal applied (a torn last line, from a crash mid-write, is ignored); when the store
//! answers, that copy is one more mirror, judged by the same rules as any restore
//! (`Catalog::refresh`): the store's identity and version decide, and nothing deleted or
//! revoked since comes back.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CatalogDump, ClientRecord, PlanRecord, SafetyRecord, Versioned};
use crate::domain::{ClientId, PlanName};

/// Runs the cache files' writes on thread `catalog-cache`, one at a time, at nice 10 (or
/// on the runtime's blocking pool if that thread cannot be started). The thread ends when
/// the writer is dropped.
pub struct Writer {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
}

type Job = Box<dyn FnOnce() + Send>;

impl Writer {
    pub fn start() -> Writer {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let started = std::thread::Builder::new()
            .name("catalog-cache".into())
            .spawn(move || {
                // SAFETY: setpriority only reads its arguments; 0 is the calling thread.
                if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) } != 0 {
                    tracing::debug!("the catalog cache is written at the request path's priority");
                }
                // A job that panics drops its answer's sender: its caller sees a failure,
                // and the thread goes on with the next.
                while let Ok(job) = rx.recv() {
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            });
        if let Err(e) = &started {
            tracing::warn!(error = %e, "the catalog cache's thread could not start; writing on the blocking pool");
        }
        Writer {
            jobs: started.ok().map(|_| tx),
        }
    }

    /// Runs `job` on the writer's thread and waits for it; `None` if it panicked.
    pub async fn run<R: Send + 'static>(
        &self,
        job: impl FnOnce() -> R + Send + 'static,
    ) -> Option<R> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(job());
        });
        let job = match &self.jobs {
            Some(jobs) => match jobs.send(job) {
                Ok(()) => return rx.await.ok(),
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        };
        tokio::task::spawn_blocking(job).await.ok()?;
        rx.await.ok()
    }
}

/// The journal is compacted into a new snapshot once it has more lines than this and
/// than the snapshot has records.
pub const COMPACT_AFTER: u64 = 10_000;

/// The snapshot file's contents.
#[derive(Serialize, Deserialize)]
struct CacheFile {
    /// Unix ms when it was written.
    saved_at_ms: u64,
    /// The last journal line it holds (0: none).
    #[serde(default)]
    seq: u64,
    catalog: CatalogDump,
}

/// One journal line: what changed, and where the catalog stood after it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Line {
    pub seq: u64,
    pub at_ms: u64,
    pub epoch: Option<String>,
    pub version: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plans: Vec<(PlanName, Option<Versioned<PlanRecord>>)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<(ClientId, Option<Versioned<ClientRecord>>)>,
    /// `Some` when the safety settings changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safety: Option<Option<Versioned<SafetyRecord>>>,
}

/// A catalog read back from the files, with when it was last written.
pub struct Cached {
    pub catalog: CatalogDump,
    pub saved_at_ms: u64,
    /// The last journal line applied (the next one written follows it).
    pub seq: u64,
}

/// The journal's file beside the snapshot.
pub fn journal_of(snapshot: &Path) -> PathBuf {
    let mut name = snapshot.as_os_str().to_owned();
    name.push(".log");
    PathBuf::from(name)
}

/// Reads the snapshot and applies the journal's lines after it; `None` when there is no
/// snapshot (or it cannot be read: logged).
pub fn load(path: &Path) -> Option<Cached> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "the catalog cache cannot be read");
            return None;
        }
    };
    let file = match serde_json::from_slice::<CacheFile>(&bytes) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "the catalog cache is unreadable; ignored");
            return None;
        }
    };
    let mut cached = Cached {
        catalog: file.catalog,
        saved_at_ms: file.saved_at_ms,
        seq: file.seq,
    };
    for line in read_journal(&journal_of(path)) {
        if line.seq > cached.seq {
            apply(&mut cached, line);
        }
    }
    Some(cached)
}

/// The journal's lines, in order, up to the first that does not read (a torn write).
fn read_journal(path: &Path) -> Vec<Line> {
    let Ok(file) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    for text in std::io::BufReader::new(file).lines() {
        match text
            .ok()
            .and_then(|t| serde_json::from_str::<Line>(&t).ok())
        {
            Some(line) => lines.push(line),
            None => break,
        }
    }
    lines
}

fn apply(cached: &mut Cached, line: Line) {
    let dump = &mut cached.catalog;
    for (name, rec) in line.plans {
        dump.plans.retain(|p| p.value.name != name);
        dump.plans.extend(rec);
    }
    if !line.clients.is_empty() {
        let mut by_id: std::collections::HashMap<ClientId, Versioned<ClientRecord>> = dump
            .clients
            .drain(..)
            .map(|c| (c.value.id.clone(), c))
            .collect();
        for (id, rec) in line.clients {
            match rec {
                Some(rec) => by_id.insert(id, rec),
                None => by_id.remove(&id),
            };
        }
        dump.clients = by_id.into_values().collect();
    }
    if let Some(safety) = line.safety {
        dump.safety = safety;
    }
    dump.epoch = line.epoch;
    dump.version = line.version;
    cached.saved_at_ms = line.at_ms;
    cached.seq = line.seq;
}

/// Writes the snapshot of `catalog`, holding the journal up to line `seq`, replacing the
/// file atomically, then starts the journal over (its lines are in the snapshot).
/// Owner-only permissions.
pub fn save(path: &Path, catalog: CatalogDump, seq: u64) -> std::io::Result<()> {
    let dir: PathBuf = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    std::fs::create_dir_all(&dir)?;
    // tempfile creates the file with mode 0600, and the rename keeps it.
    let mut tmp = tempfile::Builder::new()
        .prefix(".catalog-cache-")
        .suffix(".tmp")
        .tempfile_in(&dir)?;
    let file = CacheFile {
        saved_at_ms: now_ms(),
        seq,
        catalog,
    };
    serde_json::to_writer(std::io::BufWriter::new(&mut tmp), &file)?;
    tmp.write_all(b"\n")?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    // A crash here leaves the old journal: its lines are at or below `seq`, skipped.
    match std::fs::remove_file(journal_of(path)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Appends `lines` to the journal beside `snapshot` and syncs it (created owner-only).
pub fn append(snapshot: &Path, lines: &[Line]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(journal_of(snapshot))?;
    let mut text = Vec::new();
    for line in lines {
        serde_json::to_writer(&mut text, line)?;
        text.push(b'\n');
    }
    file.write_all(&text)?;
    file.sync_data()
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{KeyRecord, PlanRecord, Versioned};
    use crate::domain::{KeyHash, PlanName};

    #[tokio::test]
    async fn the_writer_runs_each_job_on_its_own_thread_below_the_request_paths_priority() {
        let writer = Writer::start();
        let (name, nice) = writer
            .run(|| {
                // SAFETY: getpriority only reads its arguments; 0 is the calling thread.
                let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
                (std::thread::current().name().map(str::to_owned), nice)
            })
            .await
            .expect("the job ran");
        assert_eq!(name.as_deref(), Some("catalog-cache"));
        assert!(nice >= 10, "nice {nice}");
        assert!(
            writer.run(|| panic!("a job that panics")).await.is_none(),
            "a job that panics is a failure"
        );
        assert_eq!(writer.run(|| 7).await, Some(7), "and the next job runs");
    }

    fn gold() -> Versioned<PlanRecord> {
        Versioned {
            rev: 3,
            value: PlanRecord::new(
                PlanName::parse("gold").unwrap(),
                &crate::domain::Limits::single(crate::domain::Bucket::new(10.0, 0.5).unwrap()),
                None,
            ),
        }
    }

    fn client(id: &str, rev: u64) -> Versioned<ClientRecord> {
        Versioned {
            rev,
            value: ClientRecord {
                id: ClientId::parse(id).unwrap(),
                plan: PlanName::parse("gold").unwrap(),
                mode: None,
                shards: None,
                keys: vec![KeyRecord::new(KeyHash::of(id))],
                overrides: Vec::new(),
                extra: Default::default(),
            },
        }
    }

    #[test]
    fn a_saved_catalog_reads_back_the_same_and_only_its_owner_can_read_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache").join("catalog.json");
        let catalog = CatalogDump {
            epoch: Some("e1".into()),
            version: 7,
            plans: vec![gold()],
            ..CatalogDump::default()
        };
        save(&path, catalog.clone(), 0).unwrap();
        let back = load(&path).unwrap();
        assert_eq!(back.catalog.epoch.as_deref(), Some("e1"));
        assert_eq!(back.catalog.version, 7);
        assert_eq!(back.catalog.plans, catalog.plans);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(load(&dir.path().join("none.json")).is_none());
    }

    #[test]
    fn the_journal_applies_over_the_snapshot_in_order_skipping_what_it_holds_and_a_torn_line() {
        // Arrange: a snapshot holding line 1; lines 1-3 in the journal, then a torn one.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.json");
        let snapshot = CatalogDump {
            epoch: Some("e1".into()),
            version: 10,
            plans: vec![gold()],
            clients: vec![client("a", 9), client("b", 10)],
            safety: None,
        };
        save(&path, snapshot.clone(), 1).unwrap();
        let line = |seq, version, clients| Line {
            seq,
            at_ms: seq,
            epoch: Some("e1".into()),
            version,
            clients,
            ..Line::default()
        };
        append(
            &path,
            &[
                // Held by the snapshot already: would delete b.
                line(1, 10, vec![(ClientId::parse("b").unwrap(), None)]),
                line(2, 11, vec![(ClientId::parse("a").unwrap(), None)]),
                line(
                    3,
                    12,
                    vec![(ClientId::parse("c").unwrap(), Some(client("c", 12)))],
                ),
            ],
        )
        .unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(journal_of(&path))
            .unwrap()
            .write_all(br#"{"seq":4,"at_ms":4,"epoch":"e1","version":13,"clients":[["c",nu"#)
            .unwrap();

        // Act.
        let back = load(&path).unwrap();

        // Assert.
        let mut ids: Vec<&str> = back
            .catalog
            .clients
            .iter()
            .map(|c| c.value.id.as_str())
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, ["b", "c"]);
        assert_eq!((back.catalog.version, back.seq), (12, 3));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(journal_of(&path))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);

        // A new snapshot starts the journal over.
        save(&path, back.catalog.clone(), back.seq).unwrap();
        assert!(!journal_of(&path).exists());
        assert_eq!(load(&path).unwrap().catalog.version, 12);
    }
}
