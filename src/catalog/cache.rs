//! The last-known catalog on disk, so a gateway that starts while its store is down still
//! knows its clients.
//!
//! Each gateway on Redis writes the catalog it last mirrored (plans, clients with their key
//! hashes, modes, shards, safety settings, and the store's epoch and version) to
//! `catalog.cache_file` after every change it applies, from the catalog's background task
//! (never on the request path), atomically (a unique temporary file, fsync, rename) and
//! readable by the process owner only. At start, when the store does not answer, the
//! gateway serves from that file; when the store answers, the file's copy is one more
//! mirror, judged by the same rules as any restore (`Catalog::refresh`): the store's
//! identity and version decide, and nothing deleted or revoked since comes back.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::CatalogDump;

/// The file's contents.
#[derive(Serialize, Deserialize)]
struct CacheFile {
    /// Unix ms when it was written.
    saved_at_ms: u64,
    catalog: CatalogDump,
}

/// A catalog read back from the file, with when it was written.
pub struct Cached {
    pub catalog: CatalogDump,
    pub saved_at_ms: u64,
}

/// Reads the file; `None` when there is none (or it cannot be read: logged).
pub fn load(path: &Path) -> Option<Cached> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "the catalog cache cannot be read");
            return None;
        }
    };
    match serde_json::from_slice::<CacheFile>(&bytes) {
        Ok(f) => Some(Cached {
            catalog: f.catalog,
            saved_at_ms: f.saved_at_ms,
        }),
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "the catalog cache is unreadable; ignored");
            None
        }
    }
}

/// Writes `catalog` to `path`, replacing the file atomically; owner-only permissions.
pub fn save(path: &Path, catalog: &CatalogDump) -> std::io::Result<()> {
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
        catalog: catalog.clone(),
    };
    serde_json::to_writer(&mut tmp, &file)?;
    tmp.write_all(b"\n")?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
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
    use crate::catalog::{PlanRecord, Versioned};
    use crate::domain::PlanName;

    #[test]
    fn a_saved_catalog_reads_back_the_same_and_only_its_owner_can_read_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache").join("catalog.json");
        let catalog = CatalogDump {
            epoch: Some("e1".into()),
            version: 7,
            plans: vec![Versioned {
                rev: 3,
                value: PlanRecord::new(
                    PlanName::parse("gold").unwrap(),
                    &crate::domain::Limits::single(crate::domain::Bucket::new(10.0, 0.5).unwrap()),
                    None,
                ),
            }],
            ..CatalogDump::default()
        };
        save(&path, &catalog).unwrap();
        let back = load(&path).unwrap();
        assert_eq!(back.catalog.epoch.as_deref(), Some("e1"));
        assert_eq!(back.catalog.version, 7);
        assert_eq!(back.catalog.plans, catalog.plans);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(load(&dir.path().join("none.json")).is_none());
    }
}
