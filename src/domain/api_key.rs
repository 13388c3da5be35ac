use std::fmt;
use std::str::FromStr;

use rand::RngCore;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A plaintext API key, as a client presents it. Never stored, never printed.
pub struct ApiKey(SecretString);

impl ApiKey {
    pub const MIN_LEN: usize = 8;
    pub const MAX_LEN: usize = 256;

    /// Keys are printable ASCII without spaces, 8-256 characters.
    pub fn parse(s: &str) -> Result<ApiKey, &'static str> {
        if s.len() < Self::MIN_LEN || s.len() > Self::MAX_LEN {
            return Err("an API key must be 8-256 characters");
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("an API key must be printable ASCII without spaces");
        }
        Ok(ApiKey(SecretString::from(s)))
    }

    /// A new random key: `tg_` and 32 random bytes in hex.
    pub fn generate() -> ApiKey {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        ApiKey(SecretString::from(format!("tg_{}", hex::encode(bytes))))
    }

    pub fn hash(&self) -> KeyHash {
        KeyHash::of(self.0.expose_secret())
    }

    /// The plaintext, for the one response that shows it.
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl<'de> Deserialize<'de> for ApiKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ApiKey, D::Error> {
        let s = String::deserialize(d)?;
        ApiKey::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// The schema states what [`ApiKey::parse`] accepts.
impl utoipa::PartialSchema for ApiKey {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
        ObjectBuilder::new()
            .schema_type(SchemaType::Type(Type::String))
            .min_length(Some(Self::MIN_LEN))
            .max_length(Some(Self::MAX_LEN))
            .pattern(Some("^[!-~]+$"))
            .description(Some(
                "An API key: 8-256 printable ASCII characters, no spaces.",
            ))
            .into()
    }
}

impl utoipa::ToSchema for ApiKey {}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(***)")
    }
}

/// SHA-256 of an API key: what the catalog stores and looks keys up by.
///
/// Keys are long random strings, so an unsalted fast hash is the usual choice (it lets the
/// request path find a key with one hash-map lookup); a salted slow hash would protect
/// low-entropy passwords, which API keys are not.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KeyHash([u8; 32]);

/// A map hashes a key's first 8 bytes, one word: they are already SHA-256 output, so
/// hashing all 32 again (the derived `Hash`) spent a request's time for nothing. Only the
/// gateway inserts keys, so a client choosing the keys it sends cannot crowd a bucket.
impl std::hash::Hash for KeyHash {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut word = [0; 8];
        word.copy_from_slice(&self.0[..8]);
        state.write_u64(u64::from_le_bytes(word));
    }
}

impl KeyHash {
    pub fn of(key: &str) -> KeyHash {
        KeyHash(Sha256::digest(key.as_bytes()).into())
    }

    /// The hash's `i`th 32-bit word, big-endian (`i` below 8): what the key filter's bits
    /// are taken from (see `lua/key_filter.lua`).
    pub fn word(&self, i: usize) -> u32 {
        let mut w = [0; 4];
        w.copy_from_slice(&self.0[4 * i..4 * i + 4]);
        u32::from_be_bytes(w)
    }

    /// A short, non-reversible id for a key (first 8 bytes of the hash, in hex).
    pub fn key_id(&self) -> String {
        hex::encode(&self.0[..8])
    }
}

impl FromStr for KeyHash {
    type Err = String;
    fn from_str(s: &str) -> Result<KeyHash, String> {
        let hex_part = s
            .strip_prefix("sha256:")
            .ok_or_else(|| "must look like sha256:<64 hex digits>".to_string())?;
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut out)
            .map_err(|_| "must look like sha256:<64 hex digits>".to_string())?;
        Ok(KeyHash(out))
    }
}

impl TryFrom<String> for KeyHash {
    type Error = String;
    fn try_from(s: String) -> Result<KeyHash, String> {
        s.parse()
    }
}

impl From<KeyHash> for String {
    fn from(h: KeyHash) -> String {
        h.to_string()
    }
}

impl fmt::Display for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHash({})", self.key_id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_hash_round_trips_through_its_text_form() {
        let h = KeyHash::of("dev-key-acme");
        let text = h.to_string();
        assert!(text.starts_with("sha256:"));
        assert_eq!(text.parse::<KeyHash>().unwrap(), h);
    }

    #[test]
    fn generated_keys_are_long_and_distinct() {
        let a = ApiKey::generate();
        let b = ApiKey::generate();
        assert!(a.expose().len() > 60);
        assert_ne!(a.hash(), b.hash());
        assert!(ApiKey::parse(a.expose()).is_ok());
    }

    #[test]
    fn a_key_never_shows_in_debug_output() {
        let k = ApiKey::parse("super-secret-key").unwrap();
        assert!(!format!("{k:?}").contains("super"));
    }

    #[test]
    fn short_or_spaced_keys_are_refused() {
        assert!(ApiKey::parse("short").is_err());
        assert!(ApiKey::parse("has a space in it").is_err());
    }
}
