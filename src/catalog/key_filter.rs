//! Cache mode's key filter: a copy of the store's Bloom filter of every key hash
//! (`lua/key_filter.lua`), so a key that no client has is refused without a store read.
//!
//! A Bloom filter has no false negatives: a key it says is absent was never given. So
//! the copy must hold every key the gateway may be asked about, and is trusted only once
//! it does ([`KeyFilter::trust`]):
//!
//! 1. the copy is made empty ([`KeyFilter::begin`]); from then on every key the change
//!    feed names is set in it (`Catalog::note_changed`);
//! 2. the store's filter is read, and ORed in; it must hold every key (its build is
//!    complete) before and after, and be the same build (its id);
//! 3. trusted. A key given before 1 is in the store's filter (its build read it, or its
//!    writer set it); one given after 1 is in the feed.
//!
//! A gap in the feed (or another catalog) may have missed keys: the copy is dropped
//! ([`KeyFilter::reset`]) and made again. Bits are never cleared: a revoked or deleted
//! key costs a store read, never a refusal of a valid key.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use arc_swap::ArcSwapOption;

use crate::domain::KeyHash;
use crate::store::records::{KeyFilterHead, KeyFilterStep};
use crate::store::{Store, StoreError};

/// How many bits a key sets (the first seven 32-bit words of its hash, see
/// `lua/key_filter.lua`).
const HASHES: usize = 7;

/// Keys a build step reads: each step is a script, which Redis runs alone.
const BUILD_STEP: u64 = 1000;

/// Builds the store's key filter to the end, a step at a time (a filter of `size` bits,
/// if none is started; steps of other gateways, or of an import, share the build).
pub async fn build(store: &Store, size: u64) -> Result<KeyFilterHead, StoreError> {
    let mut read = 0;
    loop {
        match store.catalog.key_filter_step(size, BUILD_STEP).await? {
            KeyFilterStep::Complete(head) => {
                if read > 0 {
                    tracing::info!(keys = read, "key filter built");
                }
                return Ok(head);
            }
            KeyFilterStep::Building(n) => read += n,
        }
    }
}

/// A gateway's copy of the store's key filter.
#[derive(Default)]
pub struct KeyFilter {
    bits: ArcSwapOption<Bits>,
}

/// The copy's bits, in Redis' order (bit n is bit `7 - n % 8` of byte `n / 8`), eight
/// bytes to a word (byte `b` is bits `8 * (b % 8)..` of word `b / 8`): an eighth of the
/// atomic operations a byte each would cost to make and fill.
pub struct Bits {
    words: Box<[AtomicU64]>,
    size: u64,
    /// The store filter's build it copies.
    id: String,
    /// It holds every key (see the module's documentation).
    trusted: AtomicBool,
}

impl Bits {
    fn new(size: u64, id: String) -> Bits {
        let len = usize::try_from(size.div_ceil(64)).unwrap_or(0);
        Bits {
            words: std::iter::repeat_with(|| AtomicU64::new(0))
                .take(len)
                .collect(),
            size,
            id,
            trusted: AtomicBool::new(false),
        }
    }

    /// The word and the mask of each of `hash`'s bits.
    fn places(&self, hash: &KeyHash) -> impl Iterator<Item = (usize, u64)> + use<'_> {
        let hash = *hash;
        (0..HASHES).map(move |i| {
            let bit = u64::from(hash.word(i)) % self.size;
            let byte = bit / 8;
            let mask = u64::from(0x80u8 >> (bit % 8)) << (8 * (byte % 8));
            ((byte / 8) as usize, mask)
        })
    }

    fn set(&self, hash: &KeyHash) {
        for (word, mask) in self.places(hash) {
            self.words[word].fetch_or(mask, Relaxed);
        }
    }

    fn has(&self, hash: &KeyHash) -> bool {
        self.places(hash)
            .all(|(word, mask)| self.words[word].load(Relaxed) & mask != 0)
    }

    /// ORs `bytes`, read from the store's filter at byte `offset` (a multiple of 8), in.
    pub fn or_at(&self, offset: usize, bytes: &[u8]) {
        debug_assert_eq!(offset % 8, 0);
        for (slot, chunk) in self.words.iter().skip(offset / 8).zip(bytes.chunks(8)) {
            let mut le = [0u8; 8];
            le[..chunk.len()].copy_from_slice(chunk);
            let w = u64::from_le_bytes(le);
            if w != 0 {
                slot.fetch_or(w, Relaxed);
            }
        }
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.words.len() * 8
    }

    /// The store filter's build it copies.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl KeyFilter {
    /// Whether a client may have `hash`: `false` only from a trusted copy that lacks one
    /// of its bits. No I/O.
    pub fn may_have(&self, hash: &KeyHash) -> bool {
        match &*self.bits.load() {
            Some(b) if b.trusted.load(Relaxed) => b.has(hash),
            _ => true,
        }
    }

    /// A key a client has now (named by the change feed): set in the copy, if there is
    /// one, trusted or being made.
    pub fn add(&self, hash: &KeyHash) {
        if let Some(b) = &*self.bits.load() {
            b.set(hash);
        }
    }

    /// Starts a copy of the store's filter `id` of `size` bits, empty and not trusted
    /// (step 1), in place of any other.
    pub fn begin(&self, size: u64, id: String) -> Arc<Bits> {
        let bits = Arc::new(Bits::new(size, id));
        self.bits.store(Some(Arc::clone(&bits)));
        bits
    }

    /// Trusts `bits` (step 3), if it is still the copy in place (not reset since it
    /// began); whether it is.
    pub fn trust(&self, bits: &Arc<Bits>) -> bool {
        let current = self.bits.load();
        match &*current {
            Some(b) if Arc::ptr_eq(b, bits) => {
                b.trusted.store(true, Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Drops the copy (keys may have been missed): every key is read until a new one is
    /// trusted.
    pub fn reset(&self) {
        self.bits.store(None);
    }

    /// The trusted copy's size in bytes (0: none).
    pub fn trusted_len(&self) -> usize {
        match &*self.bits.load() {
            Some(b) if b.trusted.load(Relaxed) => b.len(),
            _ => 0,
        }
    }

    /// The build the trusted copy is of, if there is one.
    pub fn trusted_id(&self) -> Option<String> {
        match &*self.bits.load() {
            Some(b) if b.trusted.load(Relaxed) => Some(b.id.clone()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(i: u32) -> KeyHash {
        KeyHash::of(&format!("key-{i}"))
    }

    #[test]
    fn until_trusted_every_key_may_be_had() {
        let f = KeyFilter::default();
        assert!(f.may_have(&hash(1)), "no copy");
        let bits = f.begin(1 << 16, "b1".into());
        assert!(f.may_have(&hash(1)), "a copy being made");
        f.add(&hash(2));
        assert!(f.trust(&bits));
        assert!(
            f.may_have(&hash(2)),
            "a key the feed named while it was made"
        );
        let absent = (100..200).filter(|i| !f.may_have(&hash(*i))).count();
        assert!(absent > 95, "{absent} of 100 keys never given said absent");
    }

    #[test]
    fn a_copy_reset_while_it_was_made_is_not_trusted() {
        let f = KeyFilter::default();
        let bits = f.begin(1 << 16, "b1".into());
        f.reset();
        assert!(!f.trust(&bits));
        assert!(f.may_have(&hash(1)));
        assert_eq!(f.trusted_id(), None);
    }

    #[test]
    fn bits_read_from_the_store_are_ored_in_redis_order() {
        // Arrange: a key whose bits are set the way SETBIT numbers them.
        let f = KeyFilter::default();
        let size = 1 << 12;
        let bits = f.begin(size, "b1".into());
        let mut store = vec![0u8; (size / 8) as usize];
        let k = hash(7);
        for i in 0..HASHES {
            let bit = u64::from(k.word(i)) % size;
            store[(bit / 8) as usize] |= 0x80 >> (bit % 8);
        }

        // Act: read in two parts.
        bits.or_at(0, &store[..104]);
        bits.or_at(104, &store[104..]);
        assert!(f.trust(&bits));

        // Assert
        assert!(f.may_have(&k));
        assert!(!f.may_have(&hash(8)));
    }
}
