//! A plan's cap on a client's open upgraded (WebSocket) connections.

use serde::{Deserialize, Serialize};

/// `max_connections`: how many upgraded connections one client of the plan may have open
/// at once on one gateway, 1 to [`MaxConnections::MAX`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u32")]
pub struct MaxConnections(u32);

impl MaxConnections {
    pub const MAX: u32 = 1_000_000;

    pub fn parse(n: u64) -> Result<MaxConnections, String> {
        match u32::try_from(n) {
            Ok(n) if (1..=Self::MAX).contains(&n) => Ok(MaxConnections(n)),
            _ => Err(format!("must be between 1 and {}", Self::MAX)),
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl TryFrom<u64> for MaxConnections {
    type Error = String;
    fn try_from(n: u64) -> Result<MaxConnections, String> {
        MaxConnections::parse(n)
    }
}

impl From<MaxConnections> for u32 {
    fn from(m: MaxConnections) -> u32 {
        m.0
    }
}

/// The schema states the bounds the parse enforces.
impl utoipa::PartialSchema for MaxConnections {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
        ObjectBuilder::new()
            .schema_type(SchemaType::Type(Type::Integer))
            .minimum(Some(1))
            .maximum(Some(MaxConnections::MAX))
            .description(Some(
                "How many upgraded (WebSocket) connections one client of the plan may have \
                 open at once, counted by each gateway for itself; past it an upgrade is \
                 `429` `too-many-connections` before its decision. Absent: no cap.",
            ))
            .examples([serde_json::json!(100)])
            .into()
    }
}

impl utoipa::ToSchema for MaxConnections {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_is_one_to_a_million() {
        assert_eq!(MaxConnections::parse(1).unwrap().get(), 1);
        assert_eq!(MaxConnections::parse(1_000_000).unwrap().get(), 1_000_000);
        for bad in [0, 1_000_001, u64::MAX] {
            assert!(MaxConnections::parse(bad).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<MaxConnections>("0").is_err());
        assert!(serde_json::from_str::<MaxConnections>("2.5").is_err());
        assert_eq!(serde_json::to_string(&MaxConnections(7)).unwrap(), "7");
    }
}
