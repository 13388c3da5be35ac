use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Whether a client's decisions are enforced or only observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Over-limit requests are answered `429` by the gateway.
    Enforce,
    /// Decisions are counted but every request is forwarded.
    Shadow,
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "enforce" => Ok(Mode::Enforce),
            "shadow" => Ok(Mode::Shadow),
            other => Err(format!("must be \"enforce\" or \"shadow\" (got {other:?})")),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        })
    }
}
