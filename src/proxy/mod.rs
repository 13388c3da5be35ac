//! The data plane: [`guard`] (path → API key → client → route → decision), then, for an
//! admitted request, [`forward`] (one upstream replica, streamed both ways), in one service;
//! [`caller`] tells who sent a request (its key's client, its address), for the guard and
//! a client's own view ([`view`]). [`NormalPath`] is the one form
//! a path is routed and forwarded in. [`wire`] sits under awc on every upstream connection,
//! holding its responses to RFC 9112 (interim responses, bodiless and close-delimited
//! bodies, truncation); for `https://` replicas [`tls`] shakes hands beneath it, and
//! [`clients`] holds the plain and the TLS awc client. [`health`] runs the routes' active health checks, one checker per
//! process.

mod caller;
mod clients;
mod edge;
mod forward;
mod guard;
mod headers;
mod health;
mod keys;
mod path;
mod replicas;
mod routes;
mod tls;
mod view;
mod websocket;
mod wire;

pub use guard::Guard;
pub use headers::{request_id, RequestId};
pub use health::spawn_health_checker;
pub use keys::KeySources;
pub use path::{NormalPath, PathError, MAX_PATH_BYTES};
pub use replicas::{Replica, Replicas, RetryBudget};
pub use routes::{Route, RouteTable};
pub use websocket::{close_on_sigterm, Relays};
pub use wire::{checked_body, client, connector, CheckedBody, Probe, Wire};
