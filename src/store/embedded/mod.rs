//! The embedded store: buckets in process memory, the catalog in a JSON file. For one
//! gateway instance only (buckets are not shared), and the zero-dependency default.
//!
//! `backend.rs` holds [`EmbeddedStore`], its catalog-file lock and the file's persistence;
//! each of the store's ports is implemented in a file of its own: `buckets.rs`, `catalog.rs`,
//! `audit.rs`, `shadow.rs`, `shards.rs` and `lifecycle.rs`.

mod audit;
mod backend;
mod buckets;
mod catalog;
mod claims;
mod key_use;
mod lifecycle;
mod shadow;
mod shards;
mod usage;

pub(super) use self::backend::EmbeddedStore;
