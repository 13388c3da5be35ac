//! The floor of tollgate's HTTP stack: actix-web serving, awc forwarding to one
//! upstream, and nothing else (no limiter, no middleware, no header rewriting beyond the
//! hop-by-hop ones). `throughput` runs it as a baseline: what any gateway built on these
//! two crates pays before deciding anything, so the table separates the cost of the stack
//! from the cost of tollgate's own work.
//!
//! With `--redis`, it also asks Redis once per request before forwarding, on one
//! multiplexed connection per worker: a `PING`, the floor of any design that must hear
//! from Redis before it forwards; or (`--ask script`) an `EVAL` of a script that only
//! reads `TIME`, the floor of any design that decides in a Redis script by Redis' clock
//! (a script call costs Redis more than a command: its arguments become Lua values, and
//! every 50th call runs a step of Lua's garbage collector). `latency` compares tollgate's
//! added latency with both.

use std::net::SocketAddr;
use std::time::Duration;

use actix_web::http::header;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long)]
    listen: SocketAddr,
    /// `http://host:port` of the upstream.
    #[arg(long)]
    upstream: String,
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// `redis://host:port`: one question per request (`--ask`), answered before forwarding.
    #[arg(long)]
    redis: Option<String>,
    /// What to ask Redis with `--redis`.
    #[arg(long, value_enum, default_value_t = Ask::Ping)]
    ask: Ask,
}

/// What the floor asks Redis once per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Ask {
    /// `PING`.
    Ping,
    /// `EVAL` of [`TIME_LUA`], with one key: `EVAL`, so that Redis counts its calls apart
    /// from the gateway's `EVALSHA`s (hashing a body this short costs Redis well under a
    /// microsecond).
    Script,
}

/// The least a script deciding by Redis' clock runs.
const TIME_LUA: &str = "return redis.call('TIME')[1]";

/// A worker's connection to Redis, opened on its first request.
type RedisLink = tokio::sync::OnceCell<redis::aio::MultiplexedConnection>;

async fn forward(
    req: HttpRequest,
    body: web::Bytes,
    client: web::Data<awc::Client>,
    base: web::Data<String>,
    redis: web::Data<Option<(redis::Client, RedisLink, Ask)>>,
) -> HttpResponse {
    if let Some((client, link, ask)) = redis.get_ref() {
        let conn = link
            .get_or_try_init(|| client.get_multiplexed_async_connection())
            .await;
        let Ok(conn) = conn else {
            return HttpResponse::BadGateway().finish();
        };
        let answer: redis::RedisResult<String> = match ask {
            Ask::Ping => redis::cmd("PING").query_async(&mut conn.clone()).await,
            Ask::Script => {
                redis::cmd("EVAL")
                    .arg(TIME_LUA)
                    .arg(1)
                    .arg("{floor}")
                    .query_async(&mut conn.clone())
                    .await
            }
        };
        if answer.is_err() {
            return HttpResponse::BadGateway().finish();
        }
    }
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let mut out = client.request(req.method().clone(), format!("{}{path}", base.get_ref()));
    for (n, v) in req.headers() {
        if n != header::CONNECTION && n != header::HOST {
            out = out.append_header((n.clone(), v.clone()));
        }
    }
    let Ok(mut res) = out.send_body(body).await else {
        return HttpResponse::BadGateway().finish();
    };
    let mut resp = HttpResponse::build(res.status());
    for (n, v) in res.headers() {
        if n != header::CONNECTION && n != header::CONTENT_LENGTH && n != header::TRANSFER_ENCODING
        {
            resp.append_header((n.clone(), v.clone()));
        }
    }
    match res.body().await {
        Ok(b) => resp.body(b),
        Err(_) => HttpResponse::BadGateway().finish(),
    }
}

/// Serves until killed.
pub fn run(a: &Args) -> anyhow::Result<()> {
    let (upstream, workers, listen, ask) = (a.upstream.clone(), a.workers, a.listen, a.ask);
    let redis = a.redis.as_deref().map(redis::Client::open).transpose()?;
    actix_web::rt::System::new().block_on(async move {
        HttpServer::new(move || {
            let client = awc::Client::builder()
                .timeout(Duration::from_secs(30))
                .connector(awc::Connector::new().limit(4096))
                .finish();
            App::new()
                .app_data(web::Data::new(client))
                .app_data(web::Data::new(upstream.clone()))
                .app_data(web::Data::new(
                    redis.clone().map(|c| (c, RedisLink::new(), ask)),
                ))
                .default_service(web::to(forward))
        })
        .workers(workers)
        .backlog(4096)
        .bind(listen)?
        .run()
        .await
    })?;
    Ok(())
}
