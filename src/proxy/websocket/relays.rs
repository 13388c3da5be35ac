//! What every relay of the process shares: how many each client has open (its plan's
//! `max_connections`), when they close (idle, and the gateway's stop), and the signal that
//! closes them all.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::ApiError;
use crate::metrics::{Metrics, UpgradeResult};
use crate::tasks::{CancellationToken, Policy, Tasks};

/// The open relays of this gateway process; cheap to clone.
#[derive(Clone)]
pub struct Relays {
    shared: Arc<Shared>,
}

struct Shared {
    /// Open relays by client (its id, or an address group's tag on a public route), only
    /// of clients whose plan has a `max_connections`. Per process: each gateway counts its
    /// own (the book, "WebSocket").
    by_client: Mutex<HashMap<Box<str>, u32>>,
    /// Cancelled when the gateway stops: every relay closes.
    closing: CancellationToken,
    /// `upstream.websocket_idle_timeout_ms`.
    idle_timeout: Duration,
    /// `server.shutdown_timeout_s`: the grace a relay closes within once the gateway stops.
    grace: Duration,
    metrics: Arc<Metrics>,
}

/// How long a relay that closes waits for the service's own Close and the end of its
/// connection before it drops it: at most this, and at most half the grace at a stop.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

impl Relays {
    pub fn new(idle_timeout: Duration, grace: Duration, metrics: Arc<Metrics>) -> Relays {
        Relays {
            shared: Arc::new(Shared {
                by_client: Mutex::new(HashMap::new()),
                closing: CancellationToken::new(),
                idle_timeout,
                grace,
                metrics,
            }),
        }
    }

    /// Takes one of `client`'s `cap` connections (`None`: no cap), or refuses with `429`
    /// when it has them all open. The slot is given back when it is dropped.
    pub(super) fn take(&self, client: &str, cap: Option<u32>) -> Result<Slot, ApiError> {
        let Some(cap) = cap else {
            return Ok(Slot {
                relays: self.clone(),
                client: None,
            });
        };
        let mut by_client = self.shared.by_client.lock();
        let open = by_client.entry(client.into()).or_default();
        if *open >= cap {
            if *open == 0 {
                by_client.remove(client);
            }
            drop(by_client);
            self.shared
                .metrics
                .websockets
                .upgrade(UpgradeResult::TooManyConnections);
            return Err(ApiError::TooManyConnections(cap));
        }
        *open += 1;
        Ok(Slot {
            relays: self.clone(),
            client: Some(client.into()),
        })
    }

    /// Closes every relay, each at its next frame boundary each way (a Close `1001`), within
    /// the grace; new ones close as soon as they open.
    pub fn close_all(&self) {
        self.shared.closing.cancel();
    }

    pub(super) fn closing(&self) -> &CancellationToken {
        &self.shared.closing
    }

    pub(super) fn idle_timeout(&self) -> Duration {
        self.shared.idle_timeout
    }

    /// How long a closing relay waits for the other side before it drops the connection.
    pub(super) fn close_wait(&self) -> Duration {
        if self.shared.closing.is_cancelled() {
            CLOSE_WAIT.min(self.shared.grace / 2)
        } else {
            CLOSE_WAIT
        }
    }

    pub(super) fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Open relays of `client` counted against a cap.
    #[cfg(test)]
    fn open_of(&self, client: &str) -> u32 {
        self.shared
            .by_client
            .lock()
            .get(client)
            .copied()
            .unwrap_or(0)
    }
}

/// One of a client's connections, given back on drop.
pub(super) struct Slot {
    relays: Relays,
    /// `None`: not counted (no cap).
    client: Option<Box<str>>,
}

impl Slot {
    pub(super) fn relays(&self) -> &Relays {
        &self.relays
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        let mut by_client = self.relays.shared.by_client.lock();
        if let Some(open) = by_client.get_mut(&client) {
            *open -= 1;
            if *open == 0 {
                by_client.remove(&client);
            }
        }
    }
}

/// Starts task `websocket-close-on-sigterm`: at `SIGTERM` (the gateway's graceful stop,
/// which actix-web's servers act on too), every relay closes (see [`Relays::close_all`]).
/// A stop by a server handle (tests) finds the relays still open: actix drops them with
/// their connections when the grace is over.
pub fn close_on_sigterm(relays: &Relays, tasks: &Tasks) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    // Listened for from now on (a SIGTERM before the task's first poll is not lost).
    let first = Mutex::new(Some(signal(SignalKind::terminate())?));
    let relays = relays.clone();
    tasks.spawn(
        "websocket-close-on-sigterm",
        Policy::UntilDone,
        move |stop| {
            let relays = relays.clone();
            let term = first.lock().take();
            async move {
                let Some(mut term) =
                    term.map_or_else(|| signal(SignalKind::terminate()).ok(), Some)
                else {
                    return;
                };
                tokio::select! {
                    _ = term.recv() => {
                        tracing::info!("SIGTERM: closing every WebSocket relay");
                        relays.close_all();
                    }
                    _ = stop.cancelled() => {}
                }
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relays() -> Relays {
        Relays::new(
            Duration::from_secs(60),
            Duration::from_secs(30),
            Arc::new(Metrics::default()),
        )
    }

    #[test]
    fn a_client_at_its_cap_is_refused_until_a_slot_is_given_back() {
        let r = relays();
        let first = r.take("acme", Some(2)).unwrap();
        let _second = r.take("acme", Some(2)).unwrap();
        assert!(matches!(
            r.take("acme", Some(2)),
            Err(ApiError::TooManyConnections(2))
        ));
        assert!(r.take("other", Some(2)).is_ok(), "each client its own");
        drop(first);
        assert_eq!(r.open_of("acme"), 1);
        assert!(r.take("acme", Some(2)).is_ok());
    }

    #[test]
    fn without_a_cap_nothing_is_counted() {
        let r = relays();
        let slots: Vec<_> = (0..5).map(|_| r.take("acme", None).unwrap()).collect();
        assert_eq!(r.open_of("acme"), 0);
        drop(slots);
        assert!(matches!(
            r.take("acme", Some(0)),
            Err(ApiError::TooManyConnections(0))
        ));
        assert_eq!(r.open_of("acme"), 0, "a refusal leaves nothing behind");
    }
}
