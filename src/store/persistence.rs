//! What a store keeps across its own restart: asked at start, so a gateway whose quotas
//! a restart would forget says so.

/// What the store keeps across its own restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Persistence {
    /// The embedded store: buckets live in this process's memory, so a gateway restart
    /// forgets every one of them (only the catalog is in its file).
    Embedded,
    /// Every node appends every write (AOF): a restart loses at most `appendfsync`'s
    /// second.
    Aof,
    /// Snapshots only: a restart loses what changed since the last one (`save` rules
    /// given).
    Snapshots { save: String },
    /// Nothing is persisted: a restart forgets every bucket and quota.
    None,
    /// The store would not say (INFO/CONFIG refused or failed).
    Unknown(String),
}

impl Persistence {
    /// One line for the start-up log.
    pub fn describe(&self) -> String {
        match self {
            Persistence::Embedded => {
                "embedded: buckets live in this process's memory; a restart of the gateway \
                 forgets them"
                    .to_string()
            }
            Persistence::Aof => "append-only file (AOF): a restart of Redis loses at most the \
                                 writes appendfsync has not synced yet (one second with everysec)"
                .to_string(),
            Persistence::Snapshots { save } => format!(
                "snapshots only (save \"{save}\"): a restart of Redis loses what changed since \
                 the last snapshot"
            ),
            Persistence::None => {
                "none: a restart of Redis forgets every bucket and quota".to_string()
            }
            Persistence::Unknown(why) => format!("unknown: {why}"),
        }
    }

    /// Whether a quota's count survives a restart of the store: only when every write is
    /// appended to a file.
    pub fn keeps_quotas(&self) -> bool {
        matches!(self, Persistence::Aof)
    }

    /// How much it keeps: the lower, the less (a cluster keeps what its weakest node
    /// keeps). Nothing is worse than not knowing, which may still be something.
    fn strength(&self) -> u8 {
        match self {
            Persistence::None | Persistence::Embedded => 0,
            Persistence::Unknown(_) => 1,
            Persistence::Snapshots { .. } => 2,
            Persistence::Aof => 3,
        }
    }

    /// The weakest of `answers` (the first of equals); `None` when there are none.
    pub fn weakest(answers: impl IntoIterator<Item = Persistence>) -> Option<Persistence> {
        answers
            .into_iter()
            .reduce(|w, p| if p.strength() < w.strength() { p } else { w })
    }
}
