//! The [`Buckets`](crate::Buckets) port on Redis ([`RedisBuckets`]): takes for the same
//! limits queued behind a call in flight (`coalesce.rs`), the takes of one worker turn
//! gathered into one script call (`gather.rs`), the call and the replay of its answer
//! (`buckets.rs`), over one server or a cluster (`backend.rs`), with the script
//! `engine/lua/bucket.lua`.

mod backend;
mod buckets;
mod coalesce;
mod gather;

pub use self::backend::{parse_slots, Backend, ClusterBackend, Conn, SlotRange, BUCKET_LUA};
pub use self::buckets::RedisBuckets;
pub use self::gather::{one_bucket, SWEEP_FIELDS};

/// What the engine's benchmarks (`engine/benches/`) measure of the road, without Redis:
/// a call's encoding, and the split and replay of its reply. Not part of the port.
#[doc(hidden)]
pub mod bench {
    pub use super::buckets::replay_call;
    pub use super::gather::encode_takes;
}

/// Values the tests of several files build their limits from.
#[cfg(test)]
pub(crate) mod fixtures {
    use std::sync::Arc;

    use crate::limits::{Applied, AppliedKind, Bucket};

    /// A plan's only limit, a bucket: the one whose state is the client's own field.
    pub(crate) fn default_bucket(bucket: Bucket) -> Applied {
        Applied {
            index: 0,
            name: Arc::from("default"),
            field: Arc::from(""),
            kind: AppliedKind::Bucket {
                bucket,
                initial: None,
            },
        }
    }
}
