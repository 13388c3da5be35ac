//! `tollgate import FILE`: loads clients in bulk into the store's catalog.
//!
//! The file is JSON Lines, one client per line, in the form the admin API reads: the
//! client's body (`id`, `plan`, `mode`, `shards`) and its `keys`, each as
//! `POST /admin/v1/clients/{id}/keys` takes one (`key`, `expires_at`), or as the `hash`
//! (`sha256:<hex>`) of a key kept elsewhere:
//!
//! ```json
//! {"id": "acme", "plan": "gold", "keys": [{"key": "acme-key-0123456789"}]}
//! ```
//!
//! 1. The whole file is checked first (every field of every line, every plan named exists,
//!    no id or key twice): any problem is reported by line, and nothing is written.
//! 2. Then it is written in chunks (`--chunk`, 1,000 clients), each one atomic script
//!    (`lua/catalog_import.lua`) that also records the import's progress. A client or key
//!    the store has already refuses its chunk, which writes nothing.
//! 3. An import stopped anywhere (a crash, Redis down, a refusal) resumes where it stopped
//!    when run again with the same id: by default the file's SHA-256, so rerunning the same
//!    file resumes it. The last chunk writes the import's one audit entry
//!    (`catalog.import`).
//!
//! Each client is one catalog version and one change-feed entry, as an admin write: the
//! gateways follow an import as they follow the admin API.

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::str::FromStr;
use std::time::Instant;

use anyhow::Context;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::domain::{unix_s_of_rfc3339, ApiKey, ClientId, KeyHash, Mode, PlanName, Region};
use crate::store::records::{
    ClientRecord, ImportChunk, ImportOutcome, KeyRecord, Shards, MAX_KEYS,
};
use crate::store::{Store, StoreKind};

/// How many problems of a file are reported at most.
const PROBLEMS_SHOWN: usize = 20;

/// One line of the file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    id: String,
    plan: String,
    #[serde(default)]
    mode: Option<Mode>,
    #[serde(default)]
    shards: Option<LineShards>,
    #[serde(default)]
    keys: Vec<LineKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LineShards {
    regions: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LineKey {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    hash: Option<String>,
    #[serde(default)]
    expires_at: Option<String>,
}

/// What an import did.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub import: String,
    /// Clients in the file.
    pub clients: u64,
    /// Chunks written now, and written by an earlier run (resumed past).
    pub written: u64,
    pub resumed: u64,
    pub seconds: f64,
}

/// Why an import stopped.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The file has problems (by line); nothing was written.
    #[error("{} problem(s) in the file; nothing was written:\n{}", .0.len(), .0.join("\n"))]
    Invalid(Vec<String>),
    /// The store refused a chunk (nothing of it written); the chunks before it are.
    #[error("chunk {chunk} (the file's clients {first}-{last}) was refused: {reason}; nothing of it was written, and the {written} chunk(s) before it are: fix it and run again with --id {import} to resume")]
    Refused {
        import: String,
        chunk: u64,
        first: u64,
        last: u64,
        reason: String,
        written: u64,
    },
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// Imports `file` into `store`: checks it whole, then writes it chunk by chunk, resuming
/// the import `id` (default: the file's SHA-256) where it stopped. With `key_filter_bits`
/// (cache mode's `catalog.key_filter_mib`), the store's key filter is built first if it
/// has none, so the chunks' keys go in it as they are written.
pub async fn run(
    store: &Store,
    file: &Path,
    id: Option<&str>,
    chunk: usize,
    actor: &str,
    key_filter_bits: u64,
) -> Result<Report, ImportError> {
    if store.lifecycle.kind() == StoreKind::Embedded {
        return Err(anyhow::anyhow!(
            "a bulk import needs Redis (redis.url or redis.cluster_nodes); the embedded store takes clients through the admin API"
        )
        .into());
    }
    let started = Instant::now();
    let plans: HashSet<PlanName> = store
        .catalog
        .plans()
        .await
        .context("reading the plans")?
        .into_iter()
        .map(|p| p.value.name)
        .collect();
    let (clients, digest) = check(open(file)?, &plans)?;
    if key_filter_bits > 0 {
        crate::catalog::key_filter::build(store, key_filter_bits)
            .await
            .context("building the key filter")?;
    }
    let import = id.map_or_else(|| digest[..32].to_string(), str::to_string);
    let progress = store
        .catalog
        .import_progress(&import)
        .await
        .context("reading the import's progress")?;
    let chunks = clients.div_ceil(chunk as u64);
    let (mut written, mut batch, mut number) = (0u64, Vec::with_capacity(chunk), 0u64);
    let mut lines = numbered(open(file)?);
    let now_s = unix_now_s();
    loop {
        batch.clear();
        let first = number * chunk as u64 + 1;
        for (_, text) in lines.by_ref().take(chunk) {
            // Checked above: the file did not change in between, or this fails.
            let text = text.context("reading the file")?;
            batch.push(record(&text, now_s).map_err(|e| anyhow::anyhow!("{e}"))?);
        }
        if batch.is_empty() {
            break;
        }
        if number >= progress.next {
            let outcome = store
                .catalog
                .import(&ImportChunk {
                    import: &import,
                    chunk: number,
                    last: number + 1 == chunks,
                    in_file: clients,
                    clients: &batch,
                    actor,
                })
                .await
                .with_context(|| format!("writing chunk {number}"))?;
            let refused = |reason: String| ImportError::Refused {
                import: import.clone(),
                chunk: number,
                first,
                last: first + batch.len() as u64 - 1,
                reason,
                written: number,
            };
            match outcome {
                ImportOutcome::Written { .. } => written += 1,
                ImportOutcome::Done => {}
                ImportOutcome::OutOfOrder { next } => {
                    return Err(refused(format!(
                        "another run of this import is at chunk {next}"
                    )))
                }
                ImportOutcome::Exists(id) => {
                    return Err(refused(format!("client {id:?} exists already")))
                }
                ImportOutcome::UnknownPlan(id) => {
                    return Err(refused(format!("client {id:?}'s plan no longer exists")))
                }
                ImportOutcome::KeyConflict(hash) => {
                    return Err(refused(format!(
                        "key {hash} belongs to a client in the store already"
                    )))
                }
            }
            if written.is_multiple_of(100) {
                tracing::info!(import, chunk = number, of = chunks, "importing");
            }
        }
        number += 1;
    }
    Ok(Report {
        import,
        clients,
        written,
        resumed: progress.next.min(chunks),
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn open(file: &Path) -> anyhow::Result<BufReader<std::fs::File>> {
    let f = std::fs::File::open(file).with_context(|| format!("{}", file.display()))?;
    Ok(BufReader::with_capacity(1 << 20, f))
}

/// The file's lines that are not blank, numbered from 1.
fn numbered(reader: impl BufRead) -> impl Iterator<Item = (u64, std::io::Result<String>)> {
    reader
        .lines()
        .enumerate()
        .map(|(i, l)| (i as u64 + 1, l))
        .filter(|(_, l)| l.as_ref().map_or(true, |l| !l.trim().is_empty()))
}

/// Checks every line: its fields, its plan, and that no id or key comes twice (by a
/// 64-bit fingerprint, so a file of millions fits in memory: a collision, about one in
/// 10^12 files of 10 million clients, is reported as a duplicate). The number of clients,
/// and the file's SHA-256.
fn check(
    mut reader: impl BufRead,
    plans: &HashSet<PlanName>,
) -> Result<(u64, String), ImportError> {
    let mut digest = Sha256::new();
    let mut problems = Vec::new();
    let seeds = foldhash::quality::RandomState::default();
    let (mut ids, mut keys) = (HashSet::new(), HashSet::new());
    let (mut clients, mut number, mut text) = (0u64, 0u64, String::new());
    let now_s = unix_now_s();
    loop {
        text.clear();
        let n = reader.read_line(&mut text).context("reading the file")?;
        if n == 0 {
            break;
        }
        digest.update(text.as_bytes());
        number += 1;
        if text.trim().is_empty() {
            continue;
        }
        clients += 1;
        let mut problem = |p: String| {
            if problems.len() < PROBLEMS_SHOWN {
                problems.push(format!("line {number}: {p}"));
            } else if problems.len() == PROBLEMS_SHOWN {
                problems.push("(more problems not shown)".into());
            }
        };
        match record(text.trim_end(), now_s) {
            Err(p) => problem(p),
            Ok(c) => {
                if !plans.contains(&c.plan) {
                    problem(format!("plan: no plan {:?} in the store", c.plan.as_str()));
                }
                if !ids.insert(seeds.hash_one(c.id.as_str())) {
                    problem(format!("id: {:?} comes twice in the file", c.id.as_str()));
                }
                for k in &c.keys {
                    if !keys.insert(seeds.hash_one(k.hash)) {
                        problem(format!("keys: key {} comes twice in the file", k.key_id));
                    }
                }
            }
        }
    }
    if !problems.is_empty() {
        return Err(ImportError::Invalid(problems));
    }
    Ok((clients, hex::encode(digest.finalize())))
}

/// A line as the client record it creates, or the problem with it (naming the field).
fn record(text: &str, now_s: u64) -> Result<ClientRecord, String> {
    let line: Line = serde_json::from_str(text).map_err(|e| format!("{e}"))?;
    let id = ClientId::parse(&line.id).map_err(|e| format!("id: {e}"))?;
    let plan = PlanName::parse(&line.plan).map_err(|e| format!("plan: {e}"))?;
    let shards = match line.shards {
        None => None,
        Some(s) => Some(Shards {
            regions: s
                .regions
                .iter()
                .map(|r| Region::parse(r).map_err(|e| format!("shards.regions: {e}")))
                .collect::<Result<_, _>>()?,
        }),
    };
    if line.keys.len() > MAX_KEYS {
        return Err(format!("keys: a client has at most {MAX_KEYS} keys"));
    }
    let mut keys = Vec::with_capacity(line.keys.len());
    for (i, k) in line.keys.iter().enumerate() {
        let hash = match (&k.key, &k.hash) {
            (Some(key), None) => ApiKey::parse(key)
                .map_err(|e| format!("keys[{i}].key: {e}"))?
                .hash(),
            (None, Some(hash)) => {
                KeyHash::from_str(hash).map_err(|e| format!("keys[{i}].hash: {e}"))?
            }
            _ => return Err(format!("keys[{i}]: one of key or hash")),
        };
        let expires_at = match &k.expires_at {
            None => None,
            Some(at) => match unix_s_of_rfc3339(at) {
                Ok(s) if s > now_s => Some(s),
                Ok(_) => return Err(format!("keys[{i}].expires_at: must be in the future")),
                Err(e) => return Err(format!("keys[{i}].expires_at: {e}")),
            },
        };
        if keys.iter().any(|r: &KeyRecord| r.hash == hash) {
            return Err(format!("keys[{i}]: the same key twice"));
        }
        keys.push(KeyRecord {
            expires_at,
            created_at: now_s,
            ..KeyRecord::new(hash)
        });
    }
    Ok(ClientRecord {
        id,
        plan,
        mode: line.mode,
        shards,
        keys,
        overrides: Vec::new(),
        extra: Default::default(),
    })
}

fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plans() -> HashSet<PlanName> {
        [PlanName::parse("gold").unwrap()].into_iter().collect()
    }

    #[test]
    fn a_line_reads_as_the_admin_api_would_take_it() {
        let c = record(
            r#"{"id":"acme","plan":"gold","mode":"shadow","keys":[{"key":"acme-key-0123456789","expires_at":"2999-01-01T00:00:00Z"},{"hash":"sha256:0000000000000000000000000000000000000000000000000000000000000001"}]}"#,
            1,
        )
        .unwrap();
        assert_eq!(c.id.as_str(), "acme");
        assert_eq!(c.mode, Some(Mode::Shadow));
        assert_eq!(c.keys.len(), 2);
        assert_eq!(c.keys[0].hash, KeyHash::of("acme-key-0123456789"));
        assert_eq!(c.keys[0].expires_at, Some(32_472_144_000));
    }

    #[test]
    fn every_problem_is_named_by_line_and_field() {
        let file = [
            r#"{"id":"ok","plan":"gold"}"#,
            r#"{"id":"bad id!","plan":"gold"}"#,
            r#"{"id":"p","plan":"silver"}"#,
            r#"{"id":"ok","plan":"gold"}"#,
            r#"{"id":"k","plan":"gold","keys":[{"key":"short"}]}"#,
            r#"{"id":"x","plan":"gold","extra":1}"#,
            "",
            r#"{"id":"e","plan":"gold","keys":[{"key":"eeeeeeeeeeee","expires_at":"2001-01-01T00:00:00Z"}]}"#,
        ]
        .join("\n");
        let Err(ImportError::Invalid(problems)) = check(file.as_bytes(), &plans()) else {
            panic!("invalid");
        };
        assert_eq!(problems.len(), 6, "{problems:#?}");
        assert!(problems[0].starts_with("line 2: id:"), "{problems:#?}");
        assert!(problems[1].starts_with("line 3: plan:"), "{problems:#?}");
        assert!(problems[2].starts_with("line 4: id:"), "{problems:#?}");
        assert!(
            problems[3].starts_with("line 5: keys[0].key:"),
            "{problems:#?}"
        );
        assert!(
            problems[4].starts_with("line 6: unknown field"),
            "{problems:#?}"
        );
        assert!(
            problems[5].starts_with("line 8: keys[0].expires_at:"),
            "{problems:#?}"
        );
    }

    #[test]
    fn a_good_file_counts_its_clients_and_has_a_stable_id() {
        let file = "{\"id\":\"a\",\"plan\":\"gold\"}\n\n{\"id\":\"b\",\"plan\":\"gold\"}\n";
        let (n, digest) = check(file.as_bytes(), &plans()).unwrap();
        assert_eq!(n, 2);
        assert_eq!(digest, check(file.as_bytes(), &plans()).unwrap().1);
    }
}
