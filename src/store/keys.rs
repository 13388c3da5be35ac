//! Every Redis key tollgate writes. Each carries a hash tag (`{...}`) so that whatever one
//! script touches sits in one Redis Cluster slot; where bucket state lives in them is the
//! engine's (`tollgate_engine::keys`).

use crate::domain::{ClientId, Region};

/// Key names under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.to_string(),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A client's bucket: `tollgate:b:{acme}`. Its state lives in a group hash
    /// ([`StateGroups`](crate::store::StateGroups)) on Redis, under this key in the
    /// embedded store.
    pub fn bucket(&self, client: &ClientId) -> String {
        format!("{}b:{{{}}}", self.prefix, client)
    }

    /// A public plan's bucket for one client address (see
    /// [`address_tag`](crate::domain::address_tag)): `tollgate:b:{anonymous@203.0.113.7}`.
    pub fn address_bucket(&self, tag: &str) -> String {
        format!("{}b:{{{}}}", self.prefix, tag)
    }

    /// One region's shard of a hot client's bucket: `tollgate:b:{acme:eu}`.
    pub fn regional_bucket(&self, client: &ClientId, region: &Region) -> String {
        format!("{}b:{{{}:{}}}", self.prefix, client, region)
    }

    /// A sharded client's shares, demand and fills (beside its global bucket's slot).
    pub fn shard_state(&self, client: &ClientId) -> String {
        format!("{}shard:{{{}}}", self.prefix, client)
    }

    /// A sharded client's reconciliation history.
    pub fn shard_history(&self, client: &ClientId) -> String {
        format!("{}shardlog:{{{}}}", self.prefix, client)
    }

    /// When each key was last used: one sorted set, `<client>/<key_id>` scored by unix
    /// seconds (`tollgate:{keyuse}:last_used`).
    pub fn key_use(&self) -> String {
        format!("{}{{keyuse}}:last_used", self.prefix)
    }

    /// A name claimed once by the fleet (`tollgate:claim:<name>`: one key each, wherever
    /// its slot is).
    pub fn claim(&self, name: &str) -> String {
        format!("{}claim:{name}", self.prefix)
    }

    /// One client's usage history for one UTC day (`YYYYMMDD`, see
    /// [`day_name`](crate::store::day_name)): a hash of `<limit>|<hour>|<count>` fields,
    /// tagged as the client's state group (`group`, the tag of its key, e.g. `0` for
    /// `tollgate:s:{0}`): `tollgate:u:{0}:acme:20261206`. One flush writes a group's
    /// clients in one script call, in one slot.
    pub fn usage(&self, group: &str, client: &ClientId, day: &str) -> String {
        format!("{}u:{{{}}}:{}:{}", self.prefix, group, client, day)
    }

    /// Usage history's checkpoints and who holds them (all in the `{usage}` slot):
    /// `tollgate:{usage}:gateways`, `tollgate:{usage}:ck:<gateway>`.
    pub fn usage_fold(&self, part: &str) -> String {
        format!("{}{{usage}}:{}", self.prefix, part)
    }

    /// Shadow-mode comparison counters (all in the `{shadow}` slot).
    pub fn shadow(&self, part: &str) -> String {
        format!("{}{{shadow}}:{}", self.prefix, part)
    }

    /// The catalog's keys, all in the `{catalog}` slot so one script can write them together.
    pub fn catalog(&self, part: &str) -> String {
        format!("{}{{catalog}}:{}", self.prefix, part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_keys_carry_the_client_as_hash_tag() {
        let k = Keys::new("tollgate:");
        let acme = ClientId::parse("acme").unwrap();
        assert_eq!(k.bucket(&acme), "tollgate:b:{acme}");
        let eu = Region::parse("eu").unwrap();
        assert_eq!(k.regional_bucket(&acme, &eu), "tollgate:b:{acme:eu}");
        assert_eq!(k.catalog("plans"), "tollgate:{catalog}:plans");
        assert_eq!(
            k.usage("0", &acme, "20261206"),
            "tollgate:u:{0}:acme:20261206"
        );
    }
}
