//! [`EmbeddedStore`] itself: its state, the lock that keeps a second process off its
//! catalog file, and the catalog file's contents and how they reach the disk. Each concern
//! adds its own `impl EmbeddedStore` block beside this file.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::domain::{ClientId, KeyHash, PlanName};
use crate::store::records::{AuditEntry, ClientRecord, PlanRecord, SafetyRecord, Versioned};
use crate::store::{LocalLimits, StoreError};

const AUDIT_LEN: usize = 10_000;

/// Buckets and catalog of a single instance.
pub struct EmbeddedStore {
    pub(super) limits: LocalLimits,
    pub(super) shards: Mutex<HashMap<ClientId, EmbeddedShard>>,
    pub(super) file: Arc<FileStore>,
    pub(super) shadow: Mutex<HashMap<String, (u64, u64)>>,
    /// When each key was last used (unix s): in memory, lost on restart.
    pub(super) key_use: Mutex<HashMap<String, u64>>,
    /// Names claimed (holder, until when): in memory, lost on restart.
    pub(super) claims: Mutex<HashMap<String, (String, std::time::Instant)>>,
    /// Usage history: in memory, lost on restart.
    pub(super) usage: Mutex<EmbeddedUsage>,
    /// An exclusive lock on `<catalog file>.lock`, held while the store is open: a second
    /// process on the same file is refused (the embedded store is for one instance).
    _lock: std::sync::Arc<std::fs::File>,
}

/// Usage history held in memory: each (client, hour)'s counts by limit, with when its day
/// is forgotten (unix s), and each gateway's last batch added (one gateway: this one, but
/// the port's promise is kept).
#[derive(Default)]
pub(super) struct EmbeddedUsage {
    pub(super) hours: BTreeMap<(ClientId, u64), (u64, BTreeMap<String, crate::store::UsageCounts>)>,
    pub(super) batches: HashMap<String, u64>,
}

/// The catalog and the file it lives in.
///
/// Writes to the file are made off the async workers (the ports run them with
/// `spawn_blocking`, see [`FileStore::off_worker`]), one at a time (`writer`), and without
/// holding the catalog's lock while the file is written and synced: a write is staged under
/// the lock, written to disk without it, then committed under it again, so readers never
/// wait for the disk.
pub(super) struct FileStore {
    pub(super) catalog: Mutex<FileCatalog>,
    /// Held for a whole write (stage, persist, commit); only in blocking threads.
    pub(super) writer: Mutex<()>,
    pub(super) path: PathBuf,
}

impl FileStore {
    /// Runs `f`, which writes the file, on a blocking thread, so an fsync never stalls an
    /// async worker.
    pub(super) async fn off_worker<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&FileStore) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let file = Arc::clone(self);
        tokio::task::spawn_blocking(move || f(&file))
            .await
            .map_err(|e| StoreError::File(format!("catalog file writer: {e}")))?
    }
}

/// The catalog-file locks this process holds, by lock path. A gateway rebuilt in the same
/// process (as the tests restart one) shares its predecessor's lock: the lock keeps other
/// processes out, and background tasks may keep the old store alive for a while.
static LOCKS: Mutex<Vec<(PathBuf, std::sync::Weak<std::fs::File>)>> = Mutex::new(Vec::new());

/// Takes (or, within this process, shares) the exclusive lock on `lock_path`.
fn lock_catalog(
    file: &Path,
    lock_path: PathBuf,
) -> Result<std::sync::Arc<std::fs::File>, StoreError> {
    let err = |e: std::io::Error| StoreError::File(format!("{}: {e}", file.display()));
    let mut locks = LOCKS.lock();
    locks.retain(|(_, l)| l.strong_count() > 0);
    if let Some(held) = locks
        .iter()
        .find(|(p, _)| *p == lock_path)
        .and_then(|(_, l)| l.upgrade())
    {
        return Ok(held);
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(err)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(StoreError::File(format!(
                "{} is in use by another tollgate process (the embedded store is for one instance; use Redis to run several)",
                file.display()
            )))
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(err(e)),
    }
    let lock = std::sync::Arc::new(lock);
    locks.push((lock_path, std::sync::Arc::downgrade(&lock)));
    Ok(lock)
}

impl EmbeddedStore {
    /// Opens (or creates) the catalog file, refusing it when another process has it open.
    pub fn open(file: &Path) -> Result<EmbeddedStore, StoreError> {
        let err = |e: std::io::Error| StoreError::File(format!("{}: {e}", file.display()));
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let mut lock_path = file.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock = lock_catalog(file, PathBuf::from(lock_path))?;
        Ok(EmbeddedStore {
            limits: LocalLimits::default(),
            shards: Mutex::new(HashMap::new()),
            file: Arc::new(FileStore {
                catalog: Mutex::new(FileCatalog::open(file)?),
                writer: Mutex::new(()),
                path: file.to_path_buf(),
            }),
            shadow: Mutex::new(HashMap::new()),
            key_use: Mutex::new(HashMap::new()),
            claims: Mutex::new(HashMap::new()),
            usage: Mutex::new(EmbeddedUsage::default()),
            _lock: lock,
        })
    }
}

/// A sharded client's reconciliation state (embedded mode).
pub(super) struct EmbeddedShard {
    pub(super) ts: u64,
    pub(super) since: u64,
    pub(super) seed: f64,
    pub(super) shares: HashMap<String, f64>,
    /// Region → (requests/s, when reported).
    pub(super) demand: HashMap<String, (f64, u64)>,
    pub(super) fill: HashMap<String, f64>,
    pub(super) history: VecDeque<serde_json::Value>,
}

/// The catalog file's contents.
#[derive(Default, Clone, Serialize, Deserialize)]
pub(super) struct CatalogFile {
    /// The catalog's identity, given by its first write (see `CatalogDump::epoch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) epoch: Option<String>,
    pub(super) version: u64,
    pub(super) plans: BTreeMap<PlanName, Versioned<PlanRecord>>,
    pub(super) clients: BTreeMap<ClientId, Versioned<ClientRecord>>,
    #[serde(default)]
    pub(super) safety: Option<Versioned<SafetyRecord>>,
    /// The newest changes, oldest first.
    #[serde(default)]
    pub(super) audit: VecDeque<AuditEntry>,
}

pub(super) fn push_audit(log: &mut VecDeque<AuditEntry>, entry: AuditEntry) {
    log.push_back(entry);
    while log.len() > AUDIT_LEN {
        log.pop_front();
    }
}

pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(super) struct FileCatalog {
    pub(super) data: CatalogFile,
    /// Bucket name → clients on it.
    pub(super) users: HashMap<PlanName, usize>,
    pub(super) keys: HashMap<KeyHash, ClientId>,
    /// Recent changes (version, kind, id), like the Redis change feed.
    pub(super) feed: VecDeque<(u64, &'static str, String)>,
}

impl FileCatalog {
    fn open(path: &Path) -> Result<FileCatalog, StoreError> {
        let data = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| StoreError::File(format!("{}: {e}", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => CatalogFile::default(),
            Err(e) => return Err(StoreError::File(format!("{}: {e}", path.display()))),
        };
        Ok(FileCatalog::from_data(data))
    }

    /// The catalog over `data`, with its derived indexes and an empty change feed.
    pub(super) fn from_data(data: CatalogFile) -> FileCatalog {
        let mut cat = FileCatalog {
            data,
            users: HashMap::new(),
            keys: HashMap::new(),
            feed: VecDeque::new(),
        };
        for c in cat.data.clients.values() {
            *cat.users.entry(c.value.plan.clone()).or_default() += 1;
            for k in &c.value.keys {
                cat.keys.insert(k.hash, c.value.id.clone());
            }
        }
        cat
    }
}

/// Writes to a temporary file beside the target, fsyncs it, renames it over the target
/// and fsyncs the directory: a crash leaves the old file or the new one, never half.
pub(super) fn persist(path: &Path, data: &CatalogFile) -> Result<(), StoreError> {
    let err = |e: std::io::Error| StoreError::File(format!("{}: {e}", path.display()));
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    // A temporary file of its own (a unique name, removed if anything fails), never one
    // another writer could be writing too.
    let mut tmp = tempfile::Builder::new()
        .prefix(".catalog-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(err)?;
    serde_json::to_writer_pretty(&mut tmp, data)
        .map_err(|e| StoreError::File(format!("{}: {e}", path.display())))?;
    tmp.write_all(b"\n").map_err(err)?;
    tmp.as_file().sync_all().map_err(err)?;
    tmp.persist(path).map_err(|e| err(e.error))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
