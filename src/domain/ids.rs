use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be 1-{max} characters of A-Z a-z 0-9 - _ ., not only dots (got {got:?})")]
pub struct IdError {
    max: usize,
    got: String,
}

/// Identifiers share one charset. It excludes `{`, `}` and `:` so an id can sit inside a
/// Redis Cluster hash tag (`{client}`) or beside a region (`{client:eu}`) unambiguously,
/// and an id of dots alone: `.` and `..` are a path's dot segments (RFC 3986 5.2.4), so
/// `/admin/v1/clients/..` could never address the client, and a service would be told
/// `x-client-id: ..`.
fn check(s: &str, max: usize) -> Result<(), IdError> {
    let ok = !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().any(|b| b != b'.');
    if ok {
        Ok(())
    } else {
        Err(IdError {
            max,
            got: s.chars().take(80).collect(),
        })
    }
}

/// What [`check`] accepts as a JSON Schema (ECMA-262) pattern: its charset, with one
/// character at least that is not a dot. (No lookahead, which not every tool that reads
/// the document supports.)
pub const ID_PATTERN: &str = "^[A-Za-z0-9._-]*[A-Za-z0-9_-][A-Za-z0-9._-]*$";

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $max:expr, $example:expr) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(Arc<str>);

        impl $name {
            /// Longest accepted id, in bytes.
            pub const MAX_LEN: usize = $max;

            pub fn parse(s: &str) -> Result<Self, IdError> {
                check(s, $max)?;
                Ok(Self(Arc::from(s)))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                Self::parse(&s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0.to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:?}", &*self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        /// The schema states what [`Self::parse`] accepts.
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
                use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
                ObjectBuilder::new()
                    .schema_type(SchemaType::Type(Type::String))
                    .min_length(Some(1))
                    .max_length(Some($max))
                    .pattern(Some(ID_PATTERN))
                    .description(Some(format!(
                        "1-{} characters of A-Z a-z 0-9 - _ ., not only dots",
                        $max
                    )))
                    .examples([serde_json::json!($example)])
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {}
    };
}

id_type!(
    /// A client of the gateway (an account); its API keys map to it.
    ClientId,
    128,
    "acme"
);
id_type!(
    /// The name of a plan (a set of limits).
    PlanName,
    64,
    "gold"
);
id_type!(
    /// An upstream service behind a route (metrics and safety limits name it).
    ServiceName,
    64,
    "orders"
);
id_type!(
    /// The name of one of a plan's limits, e.g. `monthly`: unique within the plan, and the
    /// name its state is kept under, so a plan change keeps what a limit of the same name
    /// has spent.
    LimitName,
    32,
    "burst"
);
impl LimitName {
    /// The name, shared: what a limit as a request sees it carries
    /// ([`Applied::name`](super::Applied::name)).
    pub fn shared(&self) -> Arc<str> {
        Arc::clone(&self.0)
    }
}

id_type!(
    /// A deployment region, e.g. `eu-west`.
    Region,
    32,
    "eu"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_of_the_documented_charset_are_accepted() {
        for s in [
            "acme",
            "a",
            "ACME-01_x.y",
            ".a",
            "a..",
            "-",
            &"a".repeat(128),
        ] {
            assert!(ClientId::parse(s).is_ok(), "{s}");
        }
    }

    #[test]
    fn ids_that_could_break_a_key_or_a_log_are_refused() {
        for s in [
            "",
            "a b",
            "a{b",
            "a}b",
            "a:b",
            "é",
            "a\nb",
            ".",
            "..",
            "...",
            &"a".repeat(129),
        ] {
            assert!(ClientId::parse(s).is_err(), "{s:?}");
        }
        assert!(Region::parse(&"r".repeat(33)).is_err());
        assert!(ServiceName::parse(&"s".repeat(65)).is_err());
    }

    #[test]
    fn the_schema_pattern_accepts_what_parse_accepts() {
        let pattern = regex::Regex::new(ID_PATTERN).unwrap();
        for s in [
            "acme", ".a", "a..", "-", "a.b", ".", "..", "...", "a b", "a:b", "",
        ] {
            assert_eq!(pattern.is_match(s), check(s, 128).is_ok(), "{s:?}");
        }
    }

    #[test]
    fn ids_deserialize_through_parse() {
        assert!(serde_json::from_str::<PlanName>("\"gold\"").is_ok());
        assert!(serde_json::from_str::<PlanName>("\"go ld\"").is_err());
    }
}
