//! Why the store could not answer, and the kind each failure counts under in the metrics.

use crate::metrics::StoreErrorKind;

/// Why the store could not answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("redis pool: {0}")]
    Pool(String),
    #[error("store reply not understood: {0}")]
    Protocol(String),
    /// Redis ran the limits script and refused one of its entries: e.g. `OOM` when its
    /// memory is full under `noeviction`, or a group whose slot moved.
    #[error("redis refused the limits script's write or read: {0}")]
    Refused(String),
    #[error("catalog file: {0}")]
    File(String),
    /// The call deciding this request (with others) was abandoned when the request that
    /// sent it ran out of time.
    #[error("the call deciding this request was abandoned at its budget")]
    Abandoned,
    /// The request's budget ran out. `sent`: its call had gone out and did not answer in
    /// time (a slow or dead store); otherwise it ran out while queued for a call, spent
    /// nothing, and says nothing about the store.
    #[error("no answer within the budget ({})", if *sent { "call sent" } else { "queued, not sent" })]
    Deadline { sent: bool },
}

impl StoreError {
    /// The `kind` label this failure counts under in `tollgate_store_errors_total`.
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            StoreError::Redis(r) if r.is_timeout() => StoreErrorKind::Timeout,
            StoreError::Abandoned | StoreError::Deadline { .. } => StoreErrorKind::Timeout,
            StoreError::Redis(r)
                if r.is_io_error() || r.is_connection_dropped() || r.is_connection_refusal() =>
            {
                StoreErrorKind::Connection
            }
            StoreError::Redis(r) if r.code() == Some("NOSCRIPT") => StoreErrorKind::Script,
            StoreError::Redis(_)
            | StoreError::Protocol(_)
            | StoreError::Refused(_)
            | StoreError::File(_) => StoreErrorKind::Reply,
            StoreError::Pool(_) => StoreErrorKind::Pool,
        }
    }
}
