//! The command line: `tollgate [serve|token|openapi|healthcheck|import|catalog|check-config]
//! [--config FILE]...`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tollgate",
    version,
    about = "One token bucket per client, enforced once at the edge."
)]
pub struct Cli {
    /// TOML file layered over the defaults (repeatable; later files win).
    #[arg(long = "config", global = true, value_name = "FILE")]
    pub config: Vec<PathBuf>,

    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start the gateway (the default).
    Serve,
    /// Print a signed admin JWT, using the configured HS256 secret (for development).
    Token {
        /// Space-separated scopes, e.g. "admin:read admin:write".
        #[arg(long, default_value = "admin:read admin:write")]
        scope: String,
        /// The token's subject: who the audit log says made the changes.
        #[arg(long, default_value = "dev")]
        sub: String,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
    },
    /// Print the admin API's OpenAPI 3.1 document as JSON.
    Openapi,
    /// Load clients in bulk from a JSON Lines file (one client per line, as the admin API
    /// reads it, with its keys) into the configured Redis: checked whole first, then
    /// written in atomic chunks; run again, it resumes where it stopped.
    Import {
        /// The file.
        file: PathBuf,
        /// The import's id, to resume one (default: the file's SHA-256).
        #[arg(long)]
        id: Option<String>,
        /// Clients per atomic chunk.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u16).range(1..=10000))]
        chunk: u16,
        /// Who the audit log says imported them.
        #[arg(long, default_value = "import")]
        actor: String,
    },
    /// The catalog as code, over a gateway's admin API: export it to a file (TOML, or JSON
    /// by a `.json` name), diff a file against it, apply a file in one atomic step.
    Catalog {
        #[command(subcommand)]
        action: CatalogAction,
        /// The gateway, e.g. http://127.0.0.1:8080.
        #[arg(
            long,
            global = true,
            env = "TOLLGATE_URL",
            default_value = "http://127.0.0.1:8080"
        )]
        url: String,
        /// An admin token (`tollgate token`, or your identity provider's).
        #[arg(
            long,
            global = true,
            env = "TOLLGATE_ADMIN_TOKEN",
            hide_env_values = true
        )]
        token: Option<String>,
        /// A PEM file of CA certificates to trust beside the public roots (https).
        #[arg(long, global = true)]
        ca_file: Option<PathBuf>,
    },
    /// Check configuration files as `serve` would load them, starting nothing: a line per
    /// FILE, `FILE: ok` or its problems.
    ///
    /// Each FILE is loaded on its own as `tollgate --config FILE serve` loads it: over the
    /// compiled-in defaults and the global --config files, if any, under the TOLLGATE__*
    /// variables, and validated the same way, every problem naming its key. Like a --config
    /// file, it must be named *.toml. Exits 0 when every file is ok, 1 when any is not, 2
    /// when one cannot be read. No listener is bound, no store opened, nothing asked over
    /// the network.
    ///
    /// Files the configuration names are checked as the load checks them: upstream.ca_file
    /// (or SSL_CERT_FILE, when it is empty) must hold certificates; admin.jwt_public_key_pem,
    /// telemetry.otlp_ca_file and the ca_file of each issuer and webhook must be files.
    /// Not checked, as the gateway reads them only at start: the TLS certificates and keys,
    /// what those other PEM files hold, catalog.file and catalog.cache_file, that a
    /// declared client's plan exists, and whatever is over the network (the listen
    /// addresses, Redis, upstreams, identity providers, webhooks).
    CheckConfig {
        /// A configuration file (TOML), checked over the defaults and the --config files.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
    },
    /// Exit 0 when the gateway on `server.listen` answers 200 to `GET PATH`, else 1
    /// (the container image's HEALTHCHECK: it has no shell or curl).
    Healthcheck {
        /// `/healthz` (liveness) or `/readyz` (readiness: the store answers).
        #[arg(long, default_value = "/healthz")]
        path: String,
    },
}

/// `tollgate catalog ...`.
#[derive(Debug, Subcommand)]
pub enum CatalogAction {
    /// Write the whole catalog (plans, clients with key hashes, overrides, safety) to FILE,
    /// or to stdout as TOML.
    Export {
        /// `-` or absent: stdout.
        #[arg(short, long)]
        out: Option<PathBuf>,
    },
    /// Say what applying FILE would change, and whose limits; exit 0 when nothing, 1 when
    /// something would change, 2 on trouble (as diff(1)).
    Diff { file: PathBuf },
    /// Apply FILE in one atomic step: diffed first, then applied only if the catalog is
    /// still at the version diffed (or `--if-version`'s).
    Apply {
        file: PathBuf,
        /// Only diff.
        #[arg(long)]
        dry_run: bool,
        /// Apply over whatever the catalog is now.
        #[arg(long, conflicts_with = "if_version")]
        force: bool,
        /// The catalog version the change was reviewed at (from `diff`): refused if the
        /// catalog has moved since.
        #[arg(long)]
        if_version: Option<u64>,
    },
}
