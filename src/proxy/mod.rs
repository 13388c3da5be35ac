//! The data plane: [`guard`] (path → API key → client → route → decision), then, for an
//! admitted request, [`forward`] (one upstream replica, streamed both ways), in one service. [`NormalPath`] is the one form
//! a path is routed and forwarded in.

mod edge;
mod forward;
mod guard;
mod headers;
mod path;
mod routes;

pub use guard::Guard;
pub use headers::{request_id, RequestId};
pub use path::{NormalPath, PathError, MAX_PATH_BYTES};
pub use routes::{Route, RouteTable};
