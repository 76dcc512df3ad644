//! The crate's ids and statuses read from text: what `Display` prints parses back, and
//! anything else is an [`Error::InvalidInput`] naming what was read. Above the error
//! type, the ids and the statuses, which name none of each other.

use std::str::FromStr;

use uuid::Uuid;

use crate::error::{Error, Result};
use crate::ids::{ChunkId, DeliveryId};
use crate::status::{ChunkStatus, DeliveryStatus};

impl FromStr for DeliveryId {
    type Err = Error;

    /// Parses the hyphenated UUID form printed by `Display`.
    fn from_str(s: &str) -> Result<Self> {
        Uuid::parse_str(s)
            .map(DeliveryId::from)
            .map_err(|e| Error::invalid("delivery id", format!("{s:?} is not a UUID: {e}")))
    }
}

impl FromStr for ChunkId {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        s.parse::<i64>()
            .ok()
            .filter(|n| *n > 0)
            .map(ChunkId)
            .ok_or_else(|| Error::invalid("chunk id", format!("{s:?} is not a positive integer")))
    }
}

/// Each status parses from the word `as_str` gives it.
macro_rules! status_from_str {
    ($($name:ident),*) => {$(
        impl FromStr for $name {
            type Err = Error;

            fn from_str(s: &str) -> Result<Self> {
                $name::from_word(s).ok_or_else(|| Error::invalid(stringify!($name), format!("unknown status {s:?}")))
            }
        }
    )*};
}
status_from_str!(ChunkStatus, DeliveryStatus);
