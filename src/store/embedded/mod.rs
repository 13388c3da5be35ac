//! The embedded store: buckets in process memory, the catalog in a JSON file. For one
//! gateway instance only (buckets are not shared), and the zero-dependency default.

mod backend;

pub(super) use self::backend::EmbeddedStore;
