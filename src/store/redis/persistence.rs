//! What Redis keeps across its own restart. A quota's count lives in Redis; a Redis that
//! forgets its data on restart hands every client a fresh period, so the gateway asks at
//! start.
//!
//! `INFO persistence` says whether the append-only file is on (`aof_enabled`), and it
//! answers on managed Redis, where `CONFIG` is often renamed or disabled. `CONFIG GET
//! save` (the snapshot rules) is asked too, as a best effort: when it is refused and the
//! AOF is off, the answer is [`Persistence::Unknown`], not a guess. A reply that the
//! server refused says something about the store; a connection that failed does not, and
//! is an error. A cluster is asked on every master, and answers with its weakest one.

use std::collections::{BTreeSet, HashMap};

use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{RedisError, Value};

use super::backend::{retrying, Backend, RedisStore};
use crate::store::{Lifecycle, Persistence, StoreError};

/// A command's reply, or the error the server answered with (`Err`: its text).
type Reply = Result<Value, String>;

/// Splits a failure the server answered (refused, unknown command, no permission) from
/// one of the connection (which says nothing about persistence: an error).
fn reply(r: Result<Value, RedisError>) -> Result<Reply, StoreError> {
    match r {
        Ok(Value::ServerError(e)) => Ok(Err(server_error(&e))),
        Ok(v) => Ok(Ok(v)),
        Err(e) if e.code().is_some() => Ok(Err(e.to_string().trim_end().to_string())),
        Err(e) => Err(e.into()),
    }
}

fn server_error(e: &redis::ServerError) -> String {
    match e.details() {
        Some(d) => format!("{} {d}", e.code()),
        None => e.code().to_string(),
    }
}

/// One node's persistence, from its `INFO persistence` and `CONFIG GET save` replies.
fn judge(info: Reply, save: Reply) -> Persistence {
    let info = match info {
        Ok(v) => match redis::from_redis_value::<String>(v) {
            Ok(text) => text,
            Err(e) => return Persistence::Unknown(format!("INFO persistence: {e}")),
        },
        Err(e) => return Persistence::Unknown(format!("INFO persistence refused: {e}")),
    };
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    match field("aof_enabled") {
        Some("1") if field("aof_last_write_status") == Some("err") => {
            return Persistence::Unknown(
                "the append-only file is on, but its last write failed".into(),
            )
        }
        Some("1") => return Persistence::Aof,
        Some("0") => {}
        other => {
            return Persistence::Unknown(format!(
                "INFO persistence says aof_enabled:{}",
                other.unwrap_or("(missing)")
            ))
        }
    }
    let rules = save.and_then(|v| {
        let config: HashMap<String, String> =
            redis::from_redis_value(v).map_err(|e| e.to_string())?;
        config
            .get("save")
            .cloned()
            .ok_or_else(|| "no save parameter".to_string())
    });
    match rules {
        Ok(rules) if rules.trim().is_empty() => Persistence::None,
        Ok(rules) => Persistence::Snapshots {
            save: rules.trim().to_string(),
        },
        Err(e) => Persistence::Unknown(format!(
            "the append-only file is off, and whether snapshots are taken is unknown \
             (CONFIG GET save: {e}); INFO says rdb_last_save_time:{} \
             rdb_changes_since_last_save:{}",
            field("rdb_last_save_time").unwrap_or("?"),
            field("rdb_changes_since_last_save").unwrap_or("?"),
        )),
    }
}

impl RedisStore {
    /// What Redis keeps across its restart: asked of the server, or of every master of a
    /// cluster (the weakest answer is the cluster's; a master that does not answer makes
    /// it [`Persistence::Unknown`]).
    pub(super) async fn ask_persistence(&self) -> Result<Persistence, StoreError> {
        let Backend::Cluster(cluster) = &*self.backend else {
            let (info, save) = retrying!(self, |c| async {
                let info = reply(info_persistence().query_async(c).await)?;
                let save = reply(config_get_save().query_async(c).await)?;
                Ok::<_, StoreError>((info, save))
            }
            .await)?;
            return Ok(judge(info, save));
        };
        let every_master = || RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
        let mut conn = cluster.conn();
        let info = per_node(
            conn.route_command(info_persistence(), every_master())
                .await?,
        )?;
        let mut save = per_node(
            conn.route_command(config_get_save(), every_master())
                .await?,
        )?;
        // The cluster client skips a master it holds no connection to: the slot map says
        // which masters there are.
        let masters: BTreeSet<String> = self
            .cluster_slots()
            .await?
            .into_iter()
            .map(|r| r.node)
            .collect();
        let mut answers: Vec<Persistence> = masters
            .iter()
            .filter(|m| !info.contains_key(*m))
            .map(|m| Persistence::Unknown(format!("{m}: did not answer")))
            .collect();
        for (node, info) in info {
            let save = save
                .remove(&node)
                .unwrap_or_else(|| Err("did not answer".into()));
            answers.push(match judge(info, save) {
                Persistence::Unknown(why) => Persistence::Unknown(format!("{node}: {why}")),
                p => p,
            });
        }
        Persistence::weakest(answers).ok_or_else(|| {
            StoreError::Protocol("no cluster master answered INFO persistence".into())
        })
    }
}

fn info_persistence() -> redis::Cmd {
    let mut cmd = redis::cmd("INFO");
    cmd.arg("persistence");
    cmd
}

fn config_get_save() -> redis::Cmd {
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET").arg("save");
    cmd
}

/// A fanned-out command's replies by node ("host:port").
fn per_node(v: Value) -> Result<HashMap<String, Reply>, StoreError> {
    let Value::Map(pairs) = v else {
        return Err(StoreError::Protocol(format!(
            "a command sent to every master answered {v:?}"
        )));
    };
    pairs
        .into_iter()
        .map(|(node, v)| {
            let node = redis::from_redis_value::<String>(node)
                .map_err(|e| StoreError::Protocol(format!("a node's name: {e}")))?;
            Ok((node, reply(Ok(v))?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(aof: &str) -> Reply {
        Ok(Value::BulkString(
            format!(
                "# Persistence\r\nloading:0\r\nrdb_changes_since_last_save:7\r\n\
                 rdb_last_save_time:1700000000\r\naof_enabled:{aof}\r\n\
                 aof_last_write_status:ok\r\n"
            )
            .into_bytes(),
        ))
    }

    fn save(rules: &str) -> Reply {
        Ok(Value::Array(vec![
            Value::BulkString(b"save".to_vec()),
            Value::BulkString(rules.as_bytes().to_vec()),
        ]))
    }

    fn refused() -> Reply {
        Err("ERR unknown command 'CONFIG'".into())
    }

    #[test]
    fn an_append_only_file_is_enough_even_when_config_is_refused() {
        assert_eq!(judge(info("1"), refused()), Persistence::Aof);
        assert_eq!(judge(info("1"), save("")), Persistence::Aof);
    }

    #[test]
    fn without_an_append_only_file_the_save_rules_decide() {
        assert_eq!(judge(info("0"), save("")), Persistence::None);
        assert_eq!(
            judge(info("0"), save("3600 1 300 100")),
            Persistence::Snapshots {
                save: "3600 1 300 100".into()
            }
        );
    }

    #[test]
    fn rules_nobody_would_tell_are_unknown_and_say_what_info_knows() {
        let Persistence::Unknown(why) = judge(info("0"), refused()) else {
            panic!("not unknown");
        };
        assert!(why.contains("unknown command"), "{why}");
        assert!(
            why.contains("rdb_last_save_time:1700000000")
                && why.contains("rdb_changes_since_last_save:7"),
            "{why}"
        );
    }

    #[test]
    fn a_refused_info_or_a_failing_append_only_file_is_unknown() {
        assert!(matches!(
            judge(Err("NOPERM no permissions".into()), save("")),
            Persistence::Unknown(_)
        ));
        let failing = Ok(Value::BulkString(
            b"aof_enabled:1\r\naof_last_write_status:err\r\n".to_vec(),
        ));
        assert!(matches!(judge(failing, save("")), Persistence::Unknown(_)));
    }

    #[test]
    fn a_cluster_keeps_what_its_weakest_master_keeps() {
        let snapshots = Persistence::Snapshots {
            save: "60 1".into(),
        };
        let unknown = Persistence::Unknown("x".into());
        let w = |v: Vec<Persistence>| Persistence::weakest(v).unwrap();
        assert_eq!(w(vec![Persistence::Aof, snapshots.clone()]), snapshots);
        assert_eq!(w(vec![Persistence::Aof, unknown.clone()]), unknown);
        assert_eq!(w(vec![unknown, Persistence::None]), Persistence::None);
        assert_eq!(
            w(vec![Persistence::Aof, Persistence::Aof]),
            Persistence::Aof
        );
    }

    #[test]
    fn only_an_append_only_file_keeps_quotas() {
        assert!(Persistence::Aof.keeps_quotas());
        for p in [
            Persistence::Embedded,
            Persistence::Snapshots { save: "1 1".into() },
            Persistence::None,
            Persistence::Unknown("x".into()),
        ] {
            assert!(!p.keeps_quotas(), "{p:?}");
        }
    }
}
