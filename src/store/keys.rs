//! Every Redis key tollgate writes. Each carries a hash tag (`{...}`) so that whatever one
//! script touches sits in one Redis Cluster slot.

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

    /// A client's bucket: `tollgate:b:{acme}`.
    pub fn bucket(&self, client: &ClientId) -> String {
        format!("{}b:{{{}}}", self.prefix, client)
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

    /// Shadow-mode comparison counters (all in the `{shadow}` slot).
    pub fn shadow(&self, part: &str) -> String {
        format!("{}{{shadow}}:{}", self.prefix, part)
    }

    /// The catalog's keys, all in the `{catalog}` slot so one script can write them together.
    pub fn catalog(&self, part: &str) -> String {
        format!("{}{{catalog}}:{}", self.prefix, part)
    }
}

/// The Redis Cluster slot of a key: CRC16 (XMODEM) of its hash tag (the part between
/// the first `{` and the next `}`, if non-empty), else of the whole key, modulo 16384.
pub fn key_slot(key: &str) -> u16 {
    let b = key.as_bytes();
    let tagged = b.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &b[open + 1..];
        let close = rest.iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tagged.unwrap_or(b)) % 16384
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= (byte as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// A key that lands in `slot`, for probing the node that owns it.
pub fn key_in_slot(slot: u16) -> String {
    (0u32..)
        .map(|n| format!("tollgate:probe:{{{n}}}"))
        .find(|k| key_slot(k) == slot)
        .expect("every slot is reachable")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster() {
        // Every number here is what `CLUSTER KEYSLOT <key>` answered on redis-server 7.0.15
        // (cluster-enabled, one node).
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(
            key_slot("{user1000}.following"),
            key_slot("{user1000}.followers")
        );
        assert_eq!(key_slot("tollgate:b:{acme}"), 11304);
        assert_eq!(key_slot("acme"), 11304);
        assert_eq!(key_slot(&key_in_slot(42)), 42);
    }

    #[test]
    fn an_empty_hash_tag_is_no_tag_and_only_the_first_tag_counts() {
        // The Redis Cluster spec: `{}` is not a hash tag, so the whole key is hashed (not
        // the empty string, slot 0; not what follows it: `x` is 16287). Numbers from
        // `CLUSTER KEYSLOT` on redis-server 7.0.15.
        assert_eq!(key_slot("{}x"), 10595);
        assert_eq!(key_slot("{}"), 15257);
        assert_eq!(key_slot("foo{}{bar}"), 8363);
        assert_eq!(key_slot("tollgate:b:{}"), 10481);
        // The tag runs from the first `{` to the first `}` after it.
        assert_eq!(key_slot("foo{{bar}}zap"), 4015); // the tag is `{bar`
        assert_eq!(key_slot("{bar"), 4015);
        assert_eq!(key_slot("foo{bar}{zap}"), 5061); // the tag is `bar`
        assert_eq!(key_slot("bar"), 5061);
        // A `}` before any `{` opens nothing.
        assert_eq!(key_slot("}{x}"), 16287);
        assert_eq!(key_slot("x}"), 11978);
    }

    #[test]
    fn bucket_keys_carry_the_client_as_hash_tag() {
        let k = Keys::new("tollgate:");
        let acme = ClientId::parse("acme").unwrap();
        assert_eq!(k.bucket(&acme), "tollgate:b:{acme}");
        let eu = Region::parse("eu").unwrap();
        assert_eq!(k.regional_bucket(&acme, &eu), "tollgate:b:{acme:eu}");
        assert_eq!(k.catalog("plans"), "tollgate:{catalog}:plans");
    }
}
