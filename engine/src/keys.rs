//! Where bucket state lives on Redis: state groups, the field of a limit's state in a
//! group, and Redis Cluster's hash slots. Every key carries a hash tag (`{...}`) so that
//! whatever one script touches sits in one Redis Cluster slot.

/// State groups on Redis Cluster: a master holds the groups of its slots, so up to this
/// many masters share the state evenly. One server holds a single group.
pub const CLUSTER_STATE_GROUPS: usize = 256;

/// Most state groups: each is found a tag in its own slice of the slots.
pub const MAX_STATE_GROUPS: usize = 1024;

/// Where client state lives in Redis: `n` group hashes (see `engine/lua/bucket.lua`), not a key
/// per client. A bucket key's state (`tollgate:b:{acme}`) is the field `acme` of the group
/// whose slice of the 16384 slots holds the key's slot; group `i`'s own key carries a tag
/// chosen to sit in slice `i`, so on Redis Cluster a group lives on the master that serves
/// its clients' slots, and groups spread over masters as slots do.
#[derive(Debug, Clone)]
pub struct StateGroups {
    keys: Vec<String>,
}

impl StateGroups {
    /// `n` groups (1 to [`MAX_STATE_GROUPS`]) under `prefix`.
    pub fn new(prefix: &str, n: usize) -> StateGroups {
        let n = n.clamp(1, MAX_STATE_GROUPS);
        let mut tags: Vec<Option<u32>> = vec![None; n];
        let mut left = n;
        // The first number whose slot falls in each slice: the same on every gateway.
        for t in 0u32.. {
            let g = usize::from(key_slot(&t.to_string())) * n / 16384;
            if tags[g].is_none() {
                tags[g] = Some(t);
                left -= 1;
                if left == 0 {
                    break;
                }
            }
        }
        StateGroups {
            keys: tags
                .into_iter()
                .map(|t| format!("{prefix}s:{{{}}}", t.expect("every slice is reached")))
                .collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Never: there is at least one group.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// A bucket key's group (its index) and its field: the key's hash tag.
    pub fn locate<'a>(&self, bucket_key: &'a str) -> (usize, &'a str) {
        let tag = hashed_part(bucket_key);
        let g = usize::from(slot_of(tag)) * self.keys.len() / 16384;
        (g, tag)
    }

    /// Group `g`'s hash.
    pub fn key(&self, g: usize) -> &str {
        &self.keys[g]
    }
}

/// The field of a limit's state in a group: the tag for the plan's first limit (field
/// prefix `""`), `<tag>/<prefix>` for the others.
pub fn state_field(tag: &str, prefix: &str) -> String {
    if prefix.is_empty() {
        tag.to_string()
    } else {
        format!("{tag}/{prefix}")
    }
}

/// The part of a key between the first `{` and the next `}`, if non-empty.
fn hash_tag(key: &str) -> Option<&str> {
    // Bytes, not `str::find`: its searcher costs more than the short keys it searches
    // (every decision's key is located). An ASCII brace is always a character boundary.
    let b = key.as_bytes();
    let open = b.iter().position(|&c| c == b'{')? + 1;
    let len = b[open..].iter().position(|&c| c == b'}')?;
    (len > 0).then(|| &key[open..open + len])
}

/// The Redis Cluster slot of a key: CRC16 (XMODEM) of its hash tag (the part between
/// the first `{` and the next `}`, if non-empty), else of the whole key, modulo 16384.
pub fn key_slot(key: &str) -> u16 {
    slot_of(hashed_part(key))
}

/// What of `key` Redis Cluster hashes: its hash tag, else the whole key.
fn hashed_part(key: &str) -> &str {
    hash_tag(key).unwrap_or(key)
}

/// The slot of a key whose hashed part is `part`.
fn slot_of(part: &str) -> u16 {
    crc16(part.as_bytes()) % 16384
}

/// CRC16 (XMODEM) a byte at a time: the slot of every decision's key is computed on the
/// request path.
fn crc16(data: &[u8]) -> u16 {
    data.iter().fold(0u16, |crc, &byte| {
        (crc << 8) ^ CRC16_TABLE[usize::from((crc >> 8) as u8 ^ byte)]
    })
}

/// The CRC of each byte value alone (polynomial 0x1021).
const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

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
        // Found by bytes, cut on characters.
        assert_eq!(key_slot("é{bar}é"), 5061);
        // A `}` before any `{` opens nothing.
        assert_eq!(key_slot("}{x}"), 16287);
        assert_eq!(key_slot("x}"), 11978);
    }

    #[test]
    fn each_state_group_sits_in_its_own_slice_of_the_slots_and_holds_the_keys_of_that_slice() {
        for n in [1, 3, 16, 256, MAX_STATE_GROUPS] {
            let groups = StateGroups::new("tollgate:", n);
            assert_eq!(groups.len(), n);
            for g in 0..n {
                let slot = usize::from(key_slot(groups.key(g)));
                assert_eq!(slot * n / 16384, g, "group {g} of {n}: slot {slot}");
            }
        }
        let groups = StateGroups::new("tollgate:", 16);
        // tollgate:b:{acme} is slot 11304: slice 11 of 16.
        assert_eq!(groups.locate("tollgate:b:{acme}"), (11, "acme"));
        assert_eq!(groups.locate("tollgate:b:{acme:eu}").1, "acme:eu");
        assert_eq!(StateGroups::new("tollgate:", 1).key(0), "tollgate:s:{0}");
        assert_eq!(state_field("acme", ""), "acme");
        assert_eq!(state_field("acme:eu", "day:"), "acme:eu/day:");
    }
}
