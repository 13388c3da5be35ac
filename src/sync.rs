//! `tollgate catalog export | diff | apply`: the catalog as code, over a gateway's admin
//! API (`GET` and `PUT /admin/v1/catalog`). A file is TOML, or JSON when its name ends in
//! `.json`, in the shape the export has: plans, clients with their keys' hashes (never
//! keys) and overrides, and the safety settings. `diff` is a dry run of the apply, so
//! what it shows is what the gateway computes; `apply` diffs, then applies guarded by the
//! version it diffed (or the one given), so a catalog changed in between is refused.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::Value;

/// How long one call to the gateway may take (an apply of 100,000 clients included).
const CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// The largest answer read (a whole catalog).
const MAX_ANSWER: usize = 1 << 30;

/// A gateway's admin API.
pub struct Remote {
    url: String,
    token: String,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

/// What a call answered: its status and its JSON body.
struct Answer {
    status: u16,
    body: Value,
}

impl Remote {
    /// The admin API of the gateway at `url` (`http(s)://host:port`), with `token`;
    /// `ca_file` is trusted beside the public roots.
    pub fn new(url: &str, token: &str, ca_file: Option<&Path>) -> anyhow::Result<Remote> {
        Ok(Remote {
            url: url.trim_end_matches('/').to_string(),
            token: token.to_string(),
            client: crate::tls::https_client(ca_file, "--ca-file")?,
        })
    }

    async fn call(
        &self,
        method: http::Method,
        path: &str,
        if_match: Option<u64>,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<Answer> {
        let uri = format!("{}/admin/v1{path}", self.url);
        let mut req = http::Request::builder()
            .method(method)
            .uri(&uri)
            .header("authorization", format!("Bearer {}", self.token))
            .header("accept", "application/json");
        if let Some(v) = if_match {
            req = req.header("if-match", format!("\"{v}\""));
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .with_context(|| format!("{uri} is not a URL"))?;
        let call = async {
            let resp = self.client.request(req).await?;
            let status = resp.status().as_u16();
            let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| anyhow!("{e}"))?
                .to_bytes();
            anyhow::Ok((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .map_err(|_| anyhow!("{uri} did not answer within {CALL_TIMEOUT:?}"))?
            .with_context(|| format!("calling {uri}"))?;
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Answer { status, body })
    }
}

/// A refusal as the problem document says it: its detail and each field named.
fn refused(a: &Answer) -> anyhow::Error {
    let mut text = format!(
        "the gateway answered {}: {}",
        a.status,
        a.body["detail"].as_str().unwrap_or("(no detail)")
    );
    for e in a.body["errors"].as_array().into_iter().flatten() {
        text.push_str(&format!(
            "\n  {}: {}",
            e["field"].as_str().unwrap_or("?"),
            e["message"].as_str().unwrap_or("?")
        ));
    }
    anyhow!(text)
}

/// `tollgate catalog export`: the catalog to `out` (`None` or `-`: stdout, TOML).
pub async fn export(remote: &Remote, out: Option<&Path>) -> anyhow::Result<String> {
    let a = remote
        .call(http::Method::GET, "/catalog", None, None)
        .await?;
    if a.status != 200 {
        return Err(refused(&a));
    }
    let version = a.body["version"].as_u64().unwrap_or(0);
    let out = out.filter(|p| *p != Path::new("-"));
    let text = match out {
        Some(p) if is_json(p) => serde_json::to_string_pretty(&a.body)? + "\n",
        _ => format!(
            "# The tollgate catalog, exported from {} at version {version}.\n\
             # Keys are by hash; `tollgate catalog diff` / `apply` take this file back.\n{}",
            remote.url,
            toml::to_string_pretty(&a.body).context("the catalog as TOML")?
        ),
    };
    match out {
        Some(p) => {
            std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
            Ok(format!(
                "exported version {version} to {}: {} plans, {} clients",
                p.display(),
                a.body["plans"].as_array().map_or(0, Vec::len),
                a.body["clients"].as_array().map_or(0, Vec::len)
            ))
        }
        None => {
            print!("{text}");
            Ok(String::new())
        }
    }
}

fn is_json(p: &Path) -> bool {
    p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// A catalog file as the JSON body the admin API takes.
fn read_file(file: &Path) -> anyhow::Result<Vec<u8>> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let value: Value = if is_json(file) {
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))?
    } else {
        toml::from_str(&text).with_context(|| format!("{} is not TOML", file.display()))?
    };
    Ok(serde_json::to_vec(&value)?)
}

/// `PUT /catalog` with `query`, `If-Match` when given: the report.
async fn put(
    remote: &Remote,
    body: Vec<u8>,
    query: &str,
    if_match: Option<u64>,
) -> anyhow::Result<Value> {
    let a = remote
        .call(
            http::Method::PUT,
            &format!("/catalog{query}"),
            if_match,
            Some(body),
        )
        .await?;
    if a.status != 200 {
        return Err(refused(&a));
    }
    Ok(a.body)
}

/// `tollgate catalog diff`: the dry run's report, and whether anything would change.
pub async fn diff(remote: &Remote, file: &Path) -> anyhow::Result<(String, bool)> {
    let report = put(remote, read_file(file)?, "?dry_run=true", None).await?;
    let changes = report["writes"].as_u64().unwrap_or(0) > 0;
    Ok((render(&report), changes))
}

/// `tollgate catalog apply`: diffed, then applied at the version diffed (or
/// `if_version`, or over anything when `force`).
pub async fn apply(
    remote: &Remote,
    file: &Path,
    dry_run: bool,
    force: bool,
    if_version: Option<u64>,
) -> anyhow::Result<String> {
    let body = read_file(file)?;
    let report = put(remote, body.clone(), "?dry_run=true", if_version).await?;
    let mut text = render(&report);
    if dry_run || report["writes"].as_u64().unwrap_or(0) == 0 {
        return Ok(text);
    }
    let at = if_version.or(report["from_version"].as_u64());
    let (query, guard) = if force {
        ("?force=true", None)
    } else {
        ("", at)
    };
    let done = put(remote, body, query, guard).await?;
    text.push_str(&format!(
        "applied: the catalog is at version {} (from {})\n",
        done["version"], done["from_version"]
    ));
    Ok(text)
}

/// A report as people read it.
fn render(r: &Value) -> String {
    let list = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    let mut out = format!(
        "against catalog version {}: {} record(s) to write\n",
        r["from_version"], r["writes"]
    );
    for kind in ["plans", "clients"] {
        for (what, sign) in [("added", '+'), ("changed", '~'), ("removed", '-')] {
            for id in list(&r[kind][what]) {
                out.push_str(&format!("  {sign} {} {id}\n", &kind[..kind.len() - 1]));
            }
        }
    }
    if r["safety"] == true {
        out.push_str("  ~ safety settings\n");
    }
    let limits = list(&r["limits_changed"]);
    if !limits.is_empty() {
        out.push_str(&format!(
            "limits in force change for {} client(s): {}\n",
            limits.len(),
            limits.join(", ")
        ));
    }
    out
}

/// What `tollgate catalog` needs from its flags: the token, or why there is none.
pub fn token(given: Option<String>) -> anyhow::Result<String> {
    match given {
        Some(t) if !t.trim().is_empty() => Ok(t.trim().to_string()),
        _ => bail!(
            "an admin token is needed: --token or TOLLGATE_ADMIN_TOKEN (`tollgate token` \
             mints one for a development gateway)"
        ),
    }
}
