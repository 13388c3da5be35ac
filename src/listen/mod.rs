//! The listeners: an actix-web application served on a bound socket, in cleartext (HTTP/1.1,
//! and h2c unless `server.http2` is off) or behind TLS (h2 by ALPN), with every connection
//! first admitted by its client's address ([`Admission`]) before a byte of it is read.
//!
//! This is what `HttpServer::listen*` does, built from its parts (actix-server's builder,
//! actix-http's service, the application's factory), because actix-web's server has no
//! place to refuse a connection before its TLS handshake: its `on_connect` runs after it.
//! The HTTP settings are actix-web's defaults unless named here.

mod admission;

use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_http::body::MessageBody;
use actix_http::{HttpService, KeepAlive, Request, Response, TlsAcceptorConfig};
use actix_rt::net::TcpStream;
use actix_server::{Server, ServerBuilder};
use actix_service::{map_config, IntoServiceFactory, Service, ServiceFactory, ServiceFactoryExt};
use actix_web::dev::AppConfig;
use futures_util::future::LocalBoxFuture;

use crate::metrics::{Exposition, Kind};
pub use admission::{Admission, Bounds, Held, Permit, Refusal, Refused};

/// How a listener serves, besides its application.
pub struct Serving {
    /// The socket, bound.
    pub listener: TcpListener,
    /// TLS, with the ALPN protocols it offers; `None`: cleartext.
    pub tls: Option<rustls::ServerConfig>,
    /// Cleartext only: a client that opens with HTTP/2's preface is spoken HTTP/2 (h2c).
    pub h2c: bool,
    /// Worker threads (`None`: one per core).
    pub workers: Option<usize>,
    /// `server.shutdown_timeout_s`.
    pub shutdown_timeout: Duration,
    pub backlog: u32,
    /// How long a connection lingers, reading and discarding, after an answer that left the
    /// request body unread.
    pub linger: Duration,
    /// Who may connect.
    pub admission: Arc<Admission>,
}

/// How long a refused connection is held unread before its reset (while its address group
/// has fewer than its share held): a client that connects again at once after a reset
/// would otherwise cost an accept every few microseconds; held, it waits on its handshake.
/// Envoy's connection limit filter has this `delay`.
const REFUSED_HOLD: Duration = Duration::from_secs(1);

/// actix-web's defaults, which its `HttpServer` would apply.
const CLIENT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Serves `app` (called once on each worker's thread, as `HttpServer::new`'s factory) as
/// `how` says. Call it on an actix system; the server runs once polled or awaited.
pub fn serve<F, I, S, B>(app: F, how: Serving) -> std::io::Result<Server>
where
    F: Fn() -> I + Send + Clone + 'static,
    I: IntoServiceFactory<S, Request>,
    S: ServiceFactory<Request, Config = AppConfig> + 'static,
    S::Error: Into<actix_web::Error> + 'static,
    S::InitError: fmt::Debug,
    S::Response: Into<Response<B>> + 'static,
    <S::Service as Service<Request>>::Future: 'static,
    S::Service: 'static,
    B: MessageBody + 'static,
{
    let addr = how.listener.local_addr()?;
    let mut builder = ServerBuilder::default()
        .backlog(how.backlog)
        .shutdown_timeout(how.shutdown_timeout.as_secs());
    if let Some(n) = how.workers {
        builder = builder.workers(n);
    }
    let closing = builder.graceful_shutdown_signal();
    let secure = how.tls.is_some();
    let linger = how.linger;
    // One worker's HTTP service, over whichever stream: actix-web's settings, and the
    // application's factory with the configuration actix-web gives it.
    macro_rules! http {
        () => {{
            let closing = closing.clone();
            let app = app()
                .into_factory()
                .map_err(|err| err.into().error_response());
            HttpService::build()
                .graceful_shutdown_signal(move || {
                    let closing = closing.clone();
                    async move { closing.notified().await }
                })
                .keep_alive(KeepAlive::default())
                .client_request_timeout(CLIENT_REQUEST_TIMEOUT)
                .client_disconnect_timeout(linger)
                .h1_allow_half_closed(true)
                .local_addr(addr)
                .finish(map_config(app, move |()| {
                    // actix-web's only public constructor (semver-exempt, for actix-test);
                    // the values are those its `HttpServer` gives: Cargo.lock pins the
                    // version this was checked against.
                    AppConfig::__priv_test_new(secure, addr.to_string(), addr)
                }))
        }};
    }
    let name = format!("tollgate-{}-{addr}", how.admission.listener);
    let admission = how.admission;
    let builder = match how.tls {
        Some(config) => builder.listen(name, how.listener, move || {
            let acceptor = TlsAcceptorConfig::default().handshake_timeout(TLS_HANDSHAKE_TIMEOUT);
            admitted(
                Arc::clone(&admission),
                http!().rustls_0_23_with_config(config.clone(), acceptor),
            )
        })?,
        None if how.h2c => builder.listen(name, how.listener, move || {
            admitted(Arc::clone(&admission), http!().tcp_auto_h2c())
        })?,
        None => builder.listen(name, how.listener, move || {
            admitted(Arc::clone(&admission), http!().tcp())
        })?,
    };
    Ok(builder.run())
}

/// `inner`, for the connections `admission` admits; the others are held unread (while
/// their group has its share to hold), then reset.
fn admitted<T>(admission: Arc<Admission>, inner: T) -> Admitted<T> {
    Admitted { admission, inner }
}

/// A service factory whose services admit each connection before passing it on.
struct Admitted<T> {
    admission: Arc<Admission>,
    inner: T,
}

impl<T> ServiceFactory<TcpStream> for Admitted<T>
where
    T: ServiceFactory<TcpStream, Config = (), Response = (), InitError = ()>,
    T::Service: 'static,
    T::Error: 'static,
    T::Future: 'static,
{
    type Response = ();
    type Error = T::Error;
    type Config = ();
    type Service = AdmittedService<T::Service>;
    type InitError = ();
    type Future = LocalBoxFuture<'static, Result<Self::Service, ()>>;

    fn new_service(&self, (): ()) -> Self::Future {
        let admission = Arc::clone(&self.admission);
        let inner = self.inner.new_service(());
        Box::pin(async move {
            Ok(AdmittedService {
                admission,
                inner: std::rc::Rc::new(inner.await?),
            })
        })
    }
}

struct AdmittedService<S> {
    admission: Arc<Admission>,
    inner: std::rc::Rc<S>,
}

impl<S> Service<TcpStream> for AdmittedService<S>
where
    S: Service<TcpStream, Response = ()> + 'static,
{
    type Response = ();
    type Error = S::Error;
    type Future = LocalBoxFuture<'static, Result<(), S::Error>>;

    actix_service::forward_ready!(inner);

    fn call(&self, io: TcpStream) -> Self::Future {
        let peer = io.peer_addr().ok().map(|a: SocketAddr| a.ip());
        match self.admission.admit(peer, Instant::now()) {
            Ok(permit) => {
                let connection = self.inner.call(io);
                Box::pin(async move {
                    let served = connection.await;
                    drop(permit);
                    served
                })
            }
            Err(refused) => {
                tracing::debug!(peer = ?peer, reason = ?refused.reason, listener = self.admission.listener, "connection refused");
                match refused.hold {
                    Some(held) => Box::pin(async move {
                        tokio::time::sleep(REFUSED_HOLD).await;
                        reset(io);
                        drop(held);
                        Ok(())
                    }),
                    None => {
                        reset(io);
                        Box::pin(async { Ok(()) })
                    }
                }
            }
        }
    }
}

/// Closes `io` with a reset, not a close: the gateway keeps no TIME_WAIT for a connection
/// it never served.
fn reset(io: TcpStream) {
    let _ = socket2::SockRef::from(&io).set_linger(Some(Duration::ZERO));
    drop(io);
}

/// The listeners' admissions, for `/metrics`.
#[derive(Debug, Clone)]
pub struct Admissions {
    pub public: Arc<Admission>,
    /// When `server.admin_listen` is set.
    pub admin: Option<Arc<Admission>>,
}

impl Admissions {
    /// `tollgate_connections_open` and `tollgate_connections_refused_total`.
    pub fn write_metrics(&self, out: &mut Exposition) {
        let each: Vec<&Arc<Admission>> = std::iter::once(&self.public)
            .chain(self.admin.as_ref())
            .collect();
        let mut family = out.family(
            "tollgate_connections_open",
            Kind::Gauge,
            "Client connections a listener has open (TCP, before and after any TLS handshake).",
        );
        for a in &each {
            family.sample(&[("listener", a.listener)], a.open.load(Relaxed));
        }
        let mut family = out.family(
            "tollgate_connections_refused_total",
            Kind::Counter,
            "Connections reset unread because their address group had server.max_connections_per_address open (open) or had opened server.new_connections_per_address in the last second (rate).",
        );
        for a in &each {
            family
                .sample(
                    &[("listener", a.listener), ("reason", "open")],
                    a.refused_open.load(Relaxed),
                )
                .sample(
                    &[("listener", a.listener), ("reason", "rate")],
                    a.refused_rate.load(Relaxed),
                );
        }
    }
}
