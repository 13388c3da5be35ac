use std::path::PathBuf;

use clap::Parser;
use tollgate::cli::{Cli, Command};
use tollgate::configuration::{Settings, SettingsError};
use tollgate::startup::Application;

/// glibc's allocator was ~13% of a saturated worker's time (malloc, free and
/// `malloc_consolidate` under the request path's many short-lived buffers); mimalloc's
/// per-thread free lists make those allocations cheap.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for a configuration that cannot start.
const BAD_CONFIG: i32 = 2;

/// Exit code of `healthcheck` when the gateway does not answer 200 (what Docker's
/// HEALTHCHECK reads as unhealthy).
const UNHEALTHY: i32 = 1;

/// How long `healthcheck` waits to connect, and for each read and write.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if let Some(Command::Openapi) = cli.command {
        print!("{}", tollgate::admin::openapi_json());
        return;
    }
    // Over a gateway's admin API: no configuration of its own.
    if let Some(Command::Catalog {
        action,
        url,
        token,
        ca_file,
    }) = cli.command
    {
        std::process::exit(catalog(action, &url, token, ca_file.as_deref()).await);
    }
    // Before the gateway's own settings load: the global files are part of each check.
    if let Some(Command::CheckConfig { files }) = &cli.command {
        std::process::exit(check_config(&cli.config, files));
    }
    tollgate::telemetry::init();
    let settings = match Settings::load(&cli.config) {
        Ok(s) => s,
        Err(SettingsError::Invalid(problems)) => {
            for p in problems {
                eprintln!("tollgate: invalid configuration: {p}");
            }
            std::process::exit(BAD_CONFIG);
        }
        Err(e) => {
            eprintln!("tollgate: invalid configuration: {e}");
            std::process::exit(BAD_CONFIG);
        }
    };
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            let app = match Application::build(settings).await {
                Ok(app) => app,
                Err(e) => {
                    eprintln!("tollgate: cannot start: {e:#}");
                    std::process::exit(BAD_CONFIG);
                }
            };
            // SIGHUP reads the same files again and swaps the routes.
            if let Err(e) = app.reload_on_sighup(cli.config.clone()) {
                eprintln!("tollgate: cannot listen for SIGHUP: {e}");
                std::process::exit(1);
            }
            if let Err(e) = app.run_until_stopped().await {
                eprintln!("tollgate: {e}");
                std::process::exit(1);
            }
            tracing::info!("stopped");
        }
        Command::Token { scope, sub, ttl } => {
            match tollgate::admin::auth::mint(&settings.admin, &sub, &scope, ttl) {
                Ok(token) => println!("{token}"),
                Err(e) => {
                    eprintln!("tollgate token: {e}");
                    std::process::exit(BAD_CONFIG);
                }
            }
        }
        Command::Healthcheck { path } => {
            let tls = settings.tls.public.is_some();
            match tollgate::ops::probe(settings.server.listen, &path, PROBE_TIMEOUT, tls) {
                Ok(200) => {}
                Ok(status) => {
                    eprintln!("tollgate healthcheck: {path} answered {status}");
                    std::process::exit(UNHEALTHY);
                }
                Err(e) => {
                    eprintln!("tollgate healthcheck: {e:#}");
                    std::process::exit(UNHEALTHY);
                }
            }
        }
        Command::Import {
            file,
            id,
            chunk,
            actor,
        } => import(&settings, &file, id.as_deref(), chunk.into(), &actor).await,
        Command::Openapi | Command::Catalog { .. } | Command::CheckConfig { .. } => {
            unreachable!("handled before loading settings")
        }
    }
}

/// `tollgate import`: a summary on stdout; problems on stderr, exit 2 (the file: nothing
/// written) or 1 (the store: what was written is resumed by a rerun).
async fn import(
    settings: &Settings,
    file: &std::path::Path,
    id: Option<&str>,
    chunk: usize,
    actor: &str,
) {
    use tollgate::import::ImportError;
    let keys = tollgate::store::Keys::new(&settings.redis.key_prefix);
    let store = match tollgate::startup::open_store(settings, &keys) {
        Ok(store) => store,
        Err(e) => {
            eprintln!("tollgate import: {e:#}");
            std::process::exit(BAD_CONFIG);
        }
    };
    let key_filter_bits = match settings.catalog.holding {
        tollgate::configuration::Holding::Cache(bounds) => bounds.key_filter_bits,
        tollgate::configuration::Holding::Mirror => 0,
    };
    match tollgate::import::run(&store, file, id, chunk, actor, key_filter_bits).await {
        Ok(r) => println!(
            "imported {} clients in {:.1} s: import {}, {} chunk(s) written now, {} written before",
            r.clients, r.seconds, r.import, r.written, r.resumed
        ),
        Err(e @ ImportError::Invalid(_)) => {
            eprintln!("tollgate import: {e}");
            std::process::exit(BAD_CONFIG);
        }
        Err(e) => {
            eprintln!("tollgate import: {e:#}");
            std::process::exit(1);
        }
    }
}

/// `tollgate check-config`: the exit code, after a line on stdout per file: 0 when every
/// file is ok, 1 when any is not, 2 when any cannot be read (as diff(1): trouble wins).
fn check_config(global: &[PathBuf], files: &[PathBuf]) -> i32 {
    let mut code = 0;
    for file in files {
        let layered: Vec<PathBuf> = global.iter().chain([file]).cloned().collect();
        let (line, status) = match Settings::load(&layered) {
            Ok(_) => ("ok".to_string(), 0),
            Err(SettingsError::Unreadable {
                file: named,
                reason,
            }) if named == *file => (format!("cannot be read: {reason}"), 2),
            Err(e @ SettingsError::Unreadable { .. }) => (e.to_string(), 2),
            Err(e) => (one_line(&e.to_string()), 1),
        };
        println!("{}: {line}", file.display());
        code = code.max(status);
    }
    code
}

/// `message` on one line, for a report with one line per file: the TOML parser draws the
/// bad line and a caret under it in a gutter (`1 | a =`, `  |     ^`), over several lines;
/// what it says around the drawing is kept.
fn one_line(message: &str) -> String {
    let drawing = |l: &&str| {
        l.trim_start_matches(|c: char| c.is_ascii_digit() || c == ' ')
            .starts_with('|')
    };
    message
        .lines()
        .filter(|l| !drawing(l))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(": ")
}

/// `tollgate catalog`: the exit code. `diff` exits as diff(1) does: 0 when nothing would
/// change, 1 when something would, 2 on trouble; `export` and `apply` 0, or 2 on trouble.
async fn catalog(
    action: tollgate::cli::CatalogAction,
    url: &str,
    token: Option<String>,
    ca_file: Option<&std::path::Path>,
) -> i32 {
    use tollgate::cli::CatalogAction;
    use tollgate::sync;
    let run = async {
        let remote = sync::Remote::new(url, &sync::token(token)?, ca_file)?;
        anyhow::Ok(match action {
            CatalogAction::Export { out } => (sync::export(&remote, out.as_deref()).await?, 0),
            CatalogAction::Diff { file } => {
                let (text, changes) = sync::diff(&remote, &file).await?;
                (text, i32::from(changes))
            }
            CatalogAction::Apply {
                file,
                dry_run,
                force,
                if_version,
            } => (
                sync::apply(&remote, &file, dry_run, force, if_version).await?,
                0,
            ),
        })
    };
    match run.await {
        Ok((text, code)) => {
            if !text.is_empty() {
                println!("{}", text.trim_end());
            }
            code
        }
        Err(e) => {
            eprintln!("tollgate catalog: {e:#}");
            2
        }
    }
}
