//! Typed ids, so a chunk id can never be passed where a delivery id is expected.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{Error, Result};

/// The public id of a delivery: a UUID v7 (time ordered), unique across databases.
///
/// It is the prefix of every chunk's idempotency key (see [`chunk_idempotency_key`]),
/// which is why it is a UUID and not a row number: a database deleted and created again
/// must never reuse a key a platform has already seen.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DeliveryId(Uuid);

impl DeliveryId {
    pub(crate) fn new_v7() -> Self {
        DeliveryId(Uuid::now_v7())
    }

    /// The underlying UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for DeliveryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl fmt::Debug for DeliveryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeliveryId({self})")
    }
}

impl FromStr for DeliveryId {
    type Err = Error;

    /// Parses the hyphenated UUID form printed by `Display`.
    fn from_str(s: &str) -> Result<Self> {
        Uuid::parse_str(s)
            .map(DeliveryId)
            .map_err(|e| Error::invalid("delivery id", format!("{s:?} is not a UUID: {e}")))
    }
}

impl From<Uuid> for DeliveryId {
    fn from(uuid: Uuid) -> Self {
        DeliveryId(uuid)
    }
}

/// The id of one chunk within this database.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ChunkId(pub(crate) i64);

impl ChunkId {
    /// The number as stored in the database.
    pub fn get(&self) -> i64 {
        self.0
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", self.0)
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

impl From<i64> for ChunkId {
    fn from(n: i64) -> Self {
        ChunkId(n)
    }
}

/// The idempotency key of chunk `index` (0-based) of a delivery: `"{delivery}:{index + 1}"`.
///
/// This is the only place the key is derived. Every send of a chunk carries the same
/// key, so platforms that deduplicate by key (Matrix `txnId`, Discord `nonce`, ...) turn a
/// replay into a no-op.
///
/// ```
/// # use chunked_outbox::{chunk_idempotency_key, DeliveryId};
/// let id: DeliveryId = "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap();
/// assert_eq!(chunk_idempotency_key(&id, 1), "01890a5d-ac96-774b-bcce-b302099a8057:2");
/// ```
pub fn chunk_idempotency_key(delivery: &DeliveryId, index: u32) -> String {
    format!("{delivery}:{}", u64::from(index) + 1)
}
