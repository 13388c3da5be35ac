//! Why the store could not answer, and the kind each failure counts under in the metrics.

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
    /// led it went away (its client hung up): it says nothing about the store.
    #[error("the call deciding this request was abandoned by the request that led it")]
    Abandoned,
    /// The store did not answer a call within its budget, counted from when the call was
    /// written to its connection (see [`Budget`](crate::Budget)): a slow or dead store.
    #[error("the store did not answer within its budget")]
    Deadline,
}

impl StoreError {
    /// Whether Redis refused a write because its memory is full (`maxmemory` under
    /// `noeviction`): it still answers, and reads, but every decision fails.
    pub fn out_of_memory(&self) -> bool {
        const SAYS: &str = "OOM command not allowed";
        match self {
            StoreError::Redis(r) => {
                r.code() == Some("OOM")
                    || r.detail().is_some_and(|d| d.contains(SAYS))
                    || r.to_string().contains(SAYS)
            }
            StoreError::Refused(s) => s.starts_with("OOM") || s.contains(SAYS),
            _ => false,
        }
    }

    /// The `kind` label this failure counts under in `tollgate_store_errors_total`.
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            StoreError::Redis(r) if r.is_timeout() => StoreErrorKind::Timeout,
            StoreError::Abandoned | StoreError::Deadline => StoreErrorKind::Timeout,
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

/// What kind of store failure a call met: the `kind` label it counts under in the gateway's
/// `tollgate_store_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    Timeout,
    Connection,
    Script,
    Reply,
    Pool,
}

impl StoreErrorKind {
    /// Every kind's label, in [`StoreErrorKind`] order.
    pub const LABELS: [&'static str; 5] = ["timeout", "connection", "script", "reply", "pool"];

    /// The `kind` label of `tollgate_store_errors_total`.
    pub fn label(self) -> &'static str {
        Self::LABELS[self as usize]
    }
}
