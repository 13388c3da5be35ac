//! What a whole catalog, as a file holds it (`PUT /admin/v1/catalog`, `tollgate catalog`),
//! changes in the catalog as it stands: the records added, changed and removed, the
//! clients whose limits in force change, and the writes that make it so, in the order an
//! apply makes them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::domain::{ClientId, LimitSpec, Limits, PlanName};
use crate::store::records::{
    CatalogDump, CatalogWrite, ClientRecord, Condition, PlanRecord, SafetyRecord, Versioned,
};

/// The catalog a file asks for, checked record by record and as a whole (every client's
/// plan is in it, no id or key hash twice).
#[derive(Debug, Default, Clone)]
pub struct Desired {
    pub plans: Vec<PlanRecord>,
    pub clients: Vec<ClientRecord>,
    /// `None`: the stored safety settings stay as they are (they cannot be deleted).
    pub safety: Option<SafetyRecord>,
}

/// The ids of one kind of record that an apply adds, changes and removes, each in order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub added: Vec<String>,
    pub changed: Vec<String>,
    pub removed: Vec<String>,
}

/// What applying a [`Desired`] catalog to the current one changes.
#[derive(Debug, Default)]
pub struct CatalogDiff {
    pub plans: Changes,
    pub clients: Changes,
    /// Whether the safety settings change.
    pub safety: bool,
    /// Clients kept by the apply whose limits in force (their plan's, with their
    /// overrides that hold now) differ after it, in id order.
    pub limits_changed: Vec<String>,
    /// The writes, in order: plans put, clients deleted, clients put, plans deleted, the
    /// safety settings. A plan is there before the clients that move onto it, and no
    /// longer used when it goes.
    pub writes: Vec<CatalogWrite>,
}

impl CatalogDiff {
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }
}

/// What applying `desired` to `current` changes, at `now_s` (unix seconds: which
/// overrides hold). Fields of a newer gateway on records that stay (a record's `extra`)
/// are kept: the file cannot name them, so they are not a change.
pub fn diff(current: &CatalogDump, desired: Desired, now_s: u64) -> CatalogDiff {
    let mut out = CatalogDiff::default();
    let old_plans: BTreeMap<&PlanName, &PlanRecord> = current
        .plans
        .iter()
        .map(|p| (&p.value.name, &p.value))
        .collect();
    let old_clients: BTreeMap<&ClientId, &ClientRecord> = current
        .clients
        .iter()
        .map(|c| (&c.value.id, &c.value))
        .collect();

    let mut plans = desired.plans;
    plans.sort_by(|a, b| a.name.cmp(&b.name));
    let mut clients = desired.clients;
    clients.sort_by(|a, b| a.id.cmp(&b.id));

    let mut plan_puts = Vec::new();
    for mut p in plans.iter().cloned() {
        match old_plans.get(&p.name) {
            None => {
                out.plans.added.push(p.name.to_string());
                plan_puts.push(CatalogWrite::PutPlan(p, Condition::Any));
            }
            Some(old) => {
                p.extra = old.extra.clone();
                if p != **old {
                    out.plans.changed.push(p.name.to_string());
                    plan_puts.push(CatalogWrite::PutPlan(p, Condition::Any));
                }
            }
        }
    }
    let new_plan_names: BTreeSet<&PlanName> = plans.iter().map(|p| &p.name).collect();
    let plan_deletes: Vec<CatalogWrite> = old_plans
        .keys()
        .filter(|n| !new_plan_names.contains(*n))
        .map(|n| {
            out.plans.removed.push(n.to_string());
            CatalogWrite::DeletePlan((*n).clone(), Condition::Any)
        })
        .collect();

    let new_ids: BTreeSet<&ClientId> = clients.iter().map(|c| &c.id).collect();
    let client_deletes: Vec<CatalogWrite> = old_clients
        .keys()
        .filter(|id| !new_ids.contains(*id))
        .map(|id| {
            out.clients.removed.push(id.to_string());
            CatalogWrite::DeleteClient((*id).clone(), Condition::Any)
        })
        .collect();

    // Each plan's limits read once, as they stand and as the file has them.
    let old_limits: HashMap<&PlanName, Option<Limits>> = old_plans
        .iter()
        .map(|(name, p)| (*name, p.limits().ok()))
        .collect();
    let new_limits: HashMap<&PlanName, Option<Limits>> =
        plans.iter().map(|p| (&p.name, p.limits().ok())).collect();
    let mut client_puts = Vec::new();
    for mut c in clients {
        match old_clients.get(&c.id) {
            None => {
                out.clients.added.push(c.id.to_string());
                client_puts.push(CatalogWrite::PutClient(c, Condition::Any));
            }
            Some(old) => {
                keep_extras(&mut c, old);
                let before = in_force(old, old_limits.get(&old.plan), now_s);
                let after = in_force(&c, new_limits.get(&c.plan), now_s);
                if before != after {
                    out.limits_changed.push(c.id.to_string());
                }
                if c != **old {
                    out.clients.changed.push(c.id.to_string());
                    client_puts.push(CatalogWrite::PutClient(c, Condition::Any));
                }
            }
        }
    }

    let safety = desired.safety.and_then(|s| {
        let same = current.safety.as_ref().is_some_and(|old| old.value == s);
        (!same).then_some(CatalogWrite::PutSafety(s, Condition::Any))
    });
    out.safety = safety.is_some();

    out.writes = plan_puts;
    out.writes.extend(client_deletes);
    out.writes.extend(client_puts);
    out.writes.extend(plan_deletes);
    out.writes.extend(safety);
    out
}

/// The catalog `writes` make of `current`: the n-th write's record at version
/// `current.version + n` (as a store making them one by one gives it), the others at
/// their own revisions; the catalog at the last write's.
pub fn whole(current: &CatalogDump, writes: &[CatalogWrite]) -> CatalogDump {
    let mut plans: BTreeMap<PlanName, Versioned<PlanRecord>> = current
        .plans
        .iter()
        .map(|p| (p.value.name.clone(), p.clone()))
        .collect();
    let mut clients: BTreeMap<ClientId, Versioned<ClientRecord>> = current
        .clients
        .iter()
        .map(|c| (c.value.id.clone(), c.clone()))
        .collect();
    let mut safety = current.safety.clone();
    let mut version = current.version;
    for w in writes {
        version += 1;
        let rev = version;
        match w {
            CatalogWrite::PutPlan(p, _) => {
                plans.insert(p.name.clone(), at(rev, p));
            }
            CatalogWrite::DeletePlan(name, _) => {
                plans.remove(name);
            }
            CatalogWrite::PutClient(c, _) => {
                clients.insert(c.id.clone(), at(rev, c));
            }
            CatalogWrite::DeleteClient(id, _) => {
                clients.remove(id);
            }
            CatalogWrite::PutSafety(s, _) => safety = Some(at(rev, s)),
        }
    }
    CatalogDump {
        epoch: current.epoch.clone(),
        version,
        plans: plans.into_values().collect(),
        clients: clients.into_values().collect(),
        safety,
    }
}

/// `value` at revision `rev`.
fn at<T: Clone>(rev: u64, value: &T) -> Versioned<T> {
    Versioned {
        rev,
        value: value.clone(),
    }
}

/// A stored client's fields of a newer gateway, and its keys', kept on the file's record.
fn keep_extras(c: &mut ClientRecord, old: &ClientRecord) {
    c.extra = old.extra.clone();
    let old_keys: HashMap<_, _> = old.keys.iter().map(|k| (k.hash, &k.extra)).collect();
    for k in &mut c.keys {
        if let Some(extra) = old_keys.get(&k.hash) {
            k.extra = (*extra).clone();
        }
    }
}

/// `client`'s limits in force at `now_s` on a plan whose limits are `limits` (`None`: no
/// such plan, or limits that do not read), as specs.
fn in_force(
    client: &ClientRecord,
    limits: Option<&Option<Limits>>,
    now_s: u64,
) -> Option<Vec<LimitSpec>> {
    let limits = limits?.as_ref()?;
    Some(
        limits
            .overridden(&client.overrides, now_s)
            .items()
            .iter()
            .map(|l| l.spec())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Bucket, KeyHash, Override};
    use crate::store::records::KeyRecord;

    fn plan(name: &str, capacity: f64) -> PlanRecord {
        PlanRecord::new(
            PlanName::parse(name).unwrap(),
            &Limits::single(Bucket::new(capacity, 1.0).unwrap()),
            None,
        )
    }

    fn client(id: &str, plan: &str, key: &str) -> ClientRecord {
        ClientRecord {
            id: ClientId::parse(id).unwrap(),
            plan: PlanName::parse(plan).unwrap(),
            mode: None,
            shards: None,
            keys: vec![KeyRecord {
                created_at: 1,
                ..KeyRecord::new(KeyHash::of(key))
            }],
            overrides: Vec::new(),
            extra: Default::default(),
        }
    }

    fn dump(plans: Vec<PlanRecord>, clients: Vec<ClientRecord>) -> CatalogDump {
        CatalogDump {
            epoch: Some("e".into()),
            version: 9,
            plans: plans
                .into_iter()
                .map(|value| Versioned { rev: 1, value })
                .collect(),
            clients: clients
                .into_iter()
                .map(|value| Versioned { rev: 2, value })
                .collect(),
            safety: None,
        }
    }

    fn names(writes: &[CatalogWrite]) -> Vec<String> {
        writes
            .iter()
            .map(|w| {
                let op = match w {
                    CatalogWrite::PutPlan(..)
                    | CatalogWrite::PutClient(..)
                    | CatalogWrite::PutSafety(..) => "put",
                    _ => "delete",
                };
                format!("{op} {} {}", w.kind(), w.id())
            })
            .collect()
    }

    #[test]
    fn the_same_catalog_changes_nothing() {
        let current = dump(vec![plan("gold", 10.0)], vec![client("acme", "gold", "k1")]);
        let d = diff(
            &current,
            Desired {
                plans: vec![plan("gold", 10.0)],
                clients: vec![client("acme", "gold", "k1")],
                safety: None,
            },
            0,
        );
        assert!(d.is_empty(), "{d:?}");
        assert!(d.plans == Changes::default() && d.clients == Changes::default() && !d.safety);
    }

    #[test]
    fn writes_put_plans_first_and_delete_them_last() {
        let current = dump(
            vec![plan("old", 10.0), plan("gold", 10.0)],
            vec![client("acme", "old", "k1"), client("gone", "gold", "k2")],
        );
        let d = diff(
            &current,
            Desired {
                plans: vec![plan("gold", 20.0), plan("new", 5.0)],
                clients: vec![client("acme", "new", "k1"), client("beta", "gold", "k3")],
                safety: Some(SafetyRecord {
                    multiplier: 5.0,
                    services: Default::default(),
                }),
            },
            0,
        );
        assert_eq!(
            names(&d.writes),
            [
                "put plan gold",
                "put plan new",
                "delete client gone",
                "put client acme",
                "put client beta",
                "delete plan old",
                "put setting safety"
            ]
        );
        assert_eq!(d.plans.added, ["new"]);
        assert_eq!(d.plans.changed, ["gold"]);
        assert_eq!(d.plans.removed, ["old"]);
        assert_eq!(d.clients.added, ["beta"]);
        assert_eq!(d.clients.changed, ["acme"]);
        assert_eq!(d.clients.removed, ["gone"]);
        assert_eq!(d.limits_changed, ["acme"]);
        assert!(d.safety);
    }

    #[test]
    fn a_plan_changed_changes_the_limits_of_its_clients_unless_an_override_holds_them() {
        let mut held = client("held", "gold", "k2");
        held.overrides.push(Override {
            limit: crate::domain::LimitName::parse("default").unwrap(),
            capacity: Some(50.0),
            rate: Some(3.0),
            quota: None,
            until: None,
        });
        let current = dump(
            vec![plan("gold", 10.0)],
            vec![client("acme", "gold", "k1"), held.clone()],
        );
        let d = diff(
            &current,
            Desired {
                plans: vec![plan("gold", 20.0)],
                clients: vec![client("acme", "gold", "k1"), held],
                safety: None,
            },
            0,
        );
        assert_eq!(d.clients, Changes::default());
        assert_eq!(d.limits_changed, ["acme"]);
        assert_eq!(names(&d.writes), ["put plan gold"]);
    }

    #[test]
    fn a_newer_gateways_fields_are_kept_and_are_no_change() {
        let mut stored = client("acme", "gold", "k1");
        stored.extra.insert("tier".into(), serde_json::json!("x"));
        stored.keys[0]
            .extra
            .insert("label".into(), serde_json::json!("ci"));
        let mut stored_plan = plan("gold", 10.0);
        stored_plan
            .extra
            .insert("burst_debt".into(), serde_json::json!(3));
        let current = dump(vec![stored_plan], vec![stored]);
        let d = diff(
            &current,
            Desired {
                plans: vec![plan("gold", 10.0)],
                clients: vec![client("acme", "gold", "k1")],
                safety: None,
            },
            0,
        );
        assert!(d.is_empty(), "{:?}", names(&d.writes));
        let mut moved = client("acme", "gold", "k1");
        moved.mode = Some(crate::domain::Mode::Shadow);
        let d = diff(
            &current,
            Desired {
                plans: vec![plan("gold", 10.0)],
                clients: vec![moved],
                safety: None,
            },
            0,
        );
        let CatalogWrite::PutClient(written, _) = &d.writes[0] else {
            panic!("{:?}", names(&d.writes));
        };
        assert_eq!(written.extra["tier"], "x");
        assert_eq!(written.keys[0].extra["label"], "ci");
        assert!(d.limits_changed.is_empty());
    }
}
