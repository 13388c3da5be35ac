//! What the catalog stores: plans and clients, as JSON records with a revision each.

use serde::{Deserialize, Serialize};

use crate::domain::{
    Bucket, ClientId, KeyHash, Limit, LimitError, LimitSpec, Limits, MaxConnections, Mode,
    Override, PlanName, Region,
};

/// A plan as stored (and, later, as the admin API shows it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRecord {
    pub name: PlanName,
    /// Its limits as written; checked by [`PlanRecord::limits`].
    #[serde(default)]
    pub limits: Vec<LimitSpec>,
    /// The first bucket's values, written beside `limits` so that a gateway from before
    /// plans had several limits reads the plan as that one bucket. Read only when
    /// `limits` is empty (a record such a gateway wrote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A client's open upgraded (WebSocket) connections at most, on each gateway (absent:
    /// no cap; a gateway from before ignores it, and `0` is read as absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// Fields a newer gateway wrote (see [`KeyRecord::extra`]): kept through this one's
    /// edits and restores.
    #[serde(flatten, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl PlanRecord {
    pub fn new(name: PlanName, limits: &Limits, description: Option<String>) -> PlanRecord {
        let headline = limits.headline_bucket();
        PlanRecord {
            name,
            limits: limits.items().iter().map(Limit::spec).collect(),
            capacity: headline.map(|b| b.capacity()),
            rate: headline.map(|b| b.rate()),
            description,
            max_connections: None,
            extra: Default::default(),
        }
    }

    /// This record with a cap on a client's open upgraded connections.
    pub fn with_max_connections(mut self, cap: Option<MaxConnections>) -> PlanRecord {
        self.max_connections = cap.map(MaxConnections::get);
        self
    }

    pub fn limits(&self) -> Result<Limits, LimitError> {
        if self.limits.is_empty() {
            let bucket = Bucket::new(
                self.capacity.unwrap_or(f64::NAN),
                self.rate.unwrap_or(f64::NAN),
            )?;
            return Ok(Limits::single(bucket));
        }
        let items = self
            .limits
            .iter()
            .map(Limit::from_spec)
            .collect::<Result<Vec<_>, _>>()?;
        Limits::new(items)
    }
}

/// Regions a hot client's bucket is sharded over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shards {
    pub regions: Vec<Region>,
}

/// How many keys a client has at most.
pub const MAX_KEYS: usize = 100;

/// One of a client's API keys: only its hash is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyRecord {
    pub key_id: String,
    pub hash: KeyHash,
    /// Unix seconds.
    pub created_at: u64,
    /// When it stops working, unix seconds (absent: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
    /// The key it was rolled from (`POST .../keys/{key_id}/roll`), if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_from: Option<String>,
    /// Fields a newer gateway wrote and this one does not know: kept as they are, so its
    /// read-modify-writes (a key created, a plan changed) never drop them.
    #[serde(flatten, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl KeyRecord {
    /// Whether it has expired at `now_s` (unix seconds).
    pub fn expired(&self, now_s: u64) -> bool {
        self.expires_at.is_some_and(|at| at <= now_s)
    }

    pub fn new(hash: KeyHash) -> KeyRecord {
        KeyRecord {
            key_id: hash.key_id(),
            hash,
            created_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            expires_at: None,
            rolled_from: None,
            extra: serde_json::Map::new(),
        }
    }
}

/// A client as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientRecord {
    pub id: ClientId,
    pub plan: PlanName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<Shards>,
    #[serde(default)]
    pub keys: Vec<KeyRecord>,
    /// Its own values for some of its plan's limits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<Override>,
    /// Fields a newer gateway wrote (see [`KeyRecord::extra`]).
    #[serde(flatten, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Coarse per-(client, service) safety limits: `multiplier` x the plan, overridable per
/// service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SafetyRecord {
    pub multiplier: f64,
    #[serde(default)]
    pub services: std::collections::BTreeMap<String, f64>,
}

/// The id of the safety settings record.
pub const SAFETY: &str = "safety";

/// Who made a change and what it was called, for the audit log.
#[derive(Debug, Clone)]
pub struct Audit {
    /// The JWT `sub` (or `config` for records declared in the configuration).
    pub actor: String,
    /// e.g. `plan.put`, `key.revoke`.
    pub action: String,
    /// Whether the write gives a catalog without an identity (epoch) one. Seeding the
    /// configuration's records does not: a store that lost its catalog must stay
    /// recognisably empty until a gateway restores it (see `Catalog::refresh`).
    pub names_catalog: bool,
}

impl Audit {
    pub fn new(actor: &str, action: &str) -> Audit {
        Audit {
            actor: actor.to_string(),
            action: action.to_string(),
            names_catalog: true,
        }
    }

    /// A record declared in the configuration, created at start when absent.
    pub fn seed(action: &str) -> Audit {
        Audit {
            names_catalog: false,
            ..Audit::new("config", action)
        }
    }
}

/// One audit log entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEntry {
    /// Unix milliseconds, on the store's clock.
    pub at_ms: u64,
    pub actor: String,
    pub action: String,
    pub kind: String,
    pub id: String,
    /// The catalog version this change produced.
    pub rev: u64,
    /// The record before the change (`null` when it was created).
    #[schema(value_type = Option<Object>)]
    pub before: Option<serde_json::Value>,
    /// The record after the change (`null` when it was deleted).
    #[schema(value_type = Option<Object>)]
    pub after: Option<serde_json::Value>,
}

/// A record and the catalog version that last wrote it (its ETag).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Versioned<T> {
    pub rev: u64,
    pub value: T,
}

/// The whole catalog, read at `version` or later.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CatalogDump {
    /// The catalog's identity: written with its first write (a random id), kept by
    /// restores, gone when the store loses its data. `None`: a catalog that has none yet.
    pub epoch: Option<String>,
    pub version: u64,
    pub plans: Vec<Versioned<PlanRecord>>,
    pub clients: Vec<Versioned<ClientRecord>>,
    pub safety: Option<Versioned<SafetyRecord>>,
}

/// Which client records a gateway following the change feed wants.
#[derive(Clone, Copy)]
pub enum Wants<'a> {
    /// Every changed client's record, and every client in a reload: a gateway holding
    /// the whole catalog.
    Whole,
    /// Only the records of the clients it holds (this says which); of the others, the key
    /// hashes the feed names. A reload carries no clients: a gateway that caches the
    /// clients it uses forgets them all, and looks each up again.
    Held(&'a (dyn Fn(&ClientId) -> bool + Send + Sync)),
}

impl Wants<'_> {
    /// Whether a changed client's record is wanted.
    pub fn record_of(&self, id: &ClientId) -> bool {
        match self {
            Wants::Whole => true,
            Wants::Held(held) => held(id),
        }
    }
}

impl std::fmt::Debug for Wants<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Wants::Whole => "Whole",
            Wants::Held(_) => "Held",
        })
    }
}

/// One chunk of a bulk import (`tollgate import`): its clients are created together or
/// not at all, and the import's progress moves with them.
#[derive(Debug)]
pub struct ImportChunk<'a> {
    /// The import's id: its progress is kept under it, so a rerun resumes.
    pub import: &'a str,
    /// 0, 1, ...: a chunk is written only when it is the next one.
    pub chunk: u64,
    /// The import's last chunk (it writes the import's one audit entry).
    pub last: bool,
    /// How many clients the whole file has, for the audit entry.
    pub in_file: u64,
    pub clients: &'a [ClientRecord],
    pub actor: &'a str,
}

/// What writing an import chunk did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImportOutcome {
    /// Written; the catalog's version after it.
    Written { version: u64 },
    /// Written before (a rerun): nothing changed.
    Done,
    /// Not the next chunk, which is `next`: nothing changed.
    OutOfOrder { next: u64 },
    /// Refused, nothing written: a client that exists already (its id).
    Exists(String),
    /// Refused: a client on a plan that does not exist (the client's id).
    UnknownPlan(String),
    /// Refused: a key another client has, or two clients of the chunk share (its hash).
    KeyConflict(String),
}

/// How far an import got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportProgress {
    /// The next chunk to write.
    pub next: u64,
    /// Clients written.
    pub clients: u64,
    /// Its last chunk is written.
    pub done: bool,
}

/// The client a key belongs to, as the store answered, with where its catalog stood
/// (read in the same step): a gateway caches the answer only if no change it has applied
/// since that version touched the client or the key.
#[derive(Debug, Clone)]
pub struct KeyLookup {
    pub epoch: Option<String>,
    pub version: u64,
    /// `None`: no client has the key.
    pub client: Option<Versioned<ClientRecord>>,
}

/// The store's key filter, when it holds every key (see `lua/key_filter.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFilterHead {
    /// Its size in bits.
    pub bits: u64,
    /// Which build it is: another id is another filter.
    pub id: String,
}

/// What one step of building the key filter came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFilterStep {
    /// Keys read in this step; more to read.
    Building(u64),
    /// Every key is in.
    Complete(KeyFilterHead),
}

/// What changed after a version.
#[derive(Debug, Clone)]
pub enum CatalogChanges {
    Unchanged,
    /// The named records changed (`None`: deleted); `more` when the feed has further entries.
    Delta {
        version: u64,
        plans: Vec<(PlanName, Option<Versioned<PlanRecord>>)>,
        clients: Vec<(ClientId, Option<Versioned<ClientRecord>>)>,
        /// `Some` when the safety settings changed.
        safety: Option<Option<Versioned<SafetyRecord>>>,
        /// The clients changed whose records were not wanted (see [`Wants`]), each with
        /// the key hashes the feed names for it.
        keys: Vec<(ClientId, Vec<KeyHash>)>,
        more: bool,
    },
    /// The feed no longer reaches back that far, or the catalog is another one (its epoch
    /// differs): start over from everything.
    Reload(CatalogDump),
}

/// One page of clients in id order.
#[derive(Debug, Default)]
pub struct ClientsPage {
    pub items: Vec<Versioned<ClientRecord>>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<String>,
}

/// Preconditions of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Condition {
    Any,
    /// Only if the record does not exist yet.
    Absent,
    /// Only if the record is at this revision (`If-Match`).
    Rev(u64),
}

/// One atomic catalog change.
#[derive(Debug, Clone)]
pub enum CatalogWrite {
    PutPlan(PlanRecord, Condition),
    DeletePlan(PlanName, Condition),
    PutClient(ClientRecord, Condition),
    DeleteClient(ClientId, Condition),
    PutSafety(SafetyRecord, Condition),
}

/// A whole set of catalog changes written as one (`PUT /admin/v1/catalog`), only if the
/// catalog is still at `at`: the n-th write at version `at_version + n`, as single writes
/// would be; one audit entry stands for all of them. The writes were checked against
/// the catalog at `at` (plans exist, keys are owned once, no plan in use is deleted): the
/// store checks only that it is still there, and applies them as given (their conditions
/// are not read). A store may make them one by one, or put `whole` (the catalog they
/// give) in the old one's place.
#[derive(Debug)]
pub struct CatalogApply<'a> {
    /// The epoch and version the writes were computed against.
    pub at_epoch: Option<&'a str>,
    pub at_version: u64,
    pub writes: &'a [CatalogWrite],
    /// The catalog after the writes: every record, each written one at its version.
    pub whole: &'a CatalogDump,
    /// Who applied it; its action is `catalog.apply`.
    pub audit: &'a Audit,
    /// What the audit entry's `after` says besides the versions: the changes counted.
    pub summary: serde_json::Value,
}

/// What an apply did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// Written: the catalog is at `version`.
    Applied { version: u64 },
    /// The catalog is no longer at the version (or epoch) the writes were computed
    /// against: nothing was written. `version` is where it is now.
    Moved { version: u64 },
}

/// What a write did. Every refusal wrote nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum WriteOutcome {
    /// Written at version `rev`; `before` is the previous JSON, if there was a record.
    Written {
        rev: u64,
        before: Option<String>,
    },
    Exists,
    Stale {
        current: u64,
    },
    Missing,
    UnknownPlan,
    PlanInUse,
    KeyConflict,
}

impl CatalogWrite {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            CatalogWrite::PutPlan(..) | CatalogWrite::DeletePlan(..) => "plan",
            CatalogWrite::PutClient(..) | CatalogWrite::DeleteClient(..) => "client",
            CatalogWrite::PutSafety(..) => "setting",
        }
    }

    pub(crate) fn id(&self) -> &str {
        match self {
            CatalogWrite::PutPlan(p, _) => p.name.as_str(),
            CatalogWrite::DeletePlan(n, _) => n.as_str(),
            CatalogWrite::PutClient(c, _) => c.id.as_str(),
            CatalogWrite::DeleteClient(i, _) => i.as_str(),
            CatalogWrite::PutSafety(..) => SAFETY,
        }
    }

    /// The record written, as JSON (`None` for deletes).
    pub(crate) fn json(&self) -> Option<String> {
        let j = match self {
            CatalogWrite::PutPlan(p, _) => serde_json::to_string(p),
            CatalogWrite::PutClient(c, _) => serde_json::to_string(c),
            CatalogWrite::PutSafety(s, _) => serde_json::to_string(s),
            CatalogWrite::DeletePlan(..) | CatalogWrite::DeleteClient(..) => return None,
        };
        j.ok()
    }

    pub(crate) fn condition(&self) -> Condition {
        match self {
            CatalogWrite::PutPlan(_, c)
            | CatalogWrite::DeletePlan(_, c)
            | CatalogWrite::PutClient(_, c)
            | CatalogWrite::DeleteClient(_, c)
            | CatalogWrite::PutSafety(_, c) => *c,
        }
    }
}
