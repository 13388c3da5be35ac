//! The data plane: [`guard`] (API key → client → route → decision) wraps [`forward`]
//! (one upstream replica, streamed both ways).

mod forward;
mod guard;
mod headers;
mod path;
mod routes;

pub use forward::{forward, upstream_client};
pub use guard::{guard, Admitted};
pub use headers::{request_id, RequestId};
pub use path::{NormalPath, PathError, MAX_PATH_BYTES};
pub use routes::{Route, RouteTable, Upstream};
