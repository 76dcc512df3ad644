//! Typed ids, so a chunk id can never be passed where a delivery id is expected.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The public id of a delivery: a UUID v7 (time ordered), unique across databases.
///
/// It is the prefix of every chunk's idempotency key (see [`chunk_idempotency_key`]),
/// which is why it is a UUID and not a row number: a database deleted and created again
/// must never reuse a key a platform has already seen.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DeliveryId(Uuid);

/// The 62 low bits of a UUID v7 (its `rand_b` field).
const RAND_B: u128 = (1 << 62) - 1;
/// The part of `rand_b` that holds the (salted) row id: 49 bits, as many as a row id
/// can have (a chunk id, `row * 16384 + index`, fits an `i64`). The 13 bits above it are
/// random.
const ROW_BITS: u128 = (1 << 49) - 1;

impl DeliveryId {
    /// The uid of the delivery in row `rowid` of a database whose salt is `salt`: a UUID
    /// v7 with the creation time, 25 random bits (12 in `rand_a`, 13 above the row), and
    /// `rowid XOR salt` in its 49 low bits. Unique within a database because its row ids
    /// are never reused (purge keeps the newest delivery); across databases because
    /// salts and times differ — and across copies of one file (a template, a restored
    /// backup), which share the salt and the row ids, because two uids made in the same
    /// millisecond for the same row still differ in 25 random bits but for one chance in
    /// 33 million.
    pub(crate) fn for_row(rowid: i64, salt: i64, created_ms: i64) -> Self {
        let (high, low) = Self::parts(created_ms);
        DeliveryId(Uuid::from_u128(
            (u128::from(high as u64) << 64)
                | u128::from(low as u64)
                | (u128::from((rowid ^ salt) as u64) & ROW_BITS),
        ))
    }

    /// A uid's two halves without its row (the low half's 49 row bits are zero): the
    /// time, version, variant and random bits. PostgreSQL's `outbound_enqueue` fills
    /// in the row and the salt exactly as [`for_row`](Self::for_row) does.
    pub(crate) fn parts(created_ms: i64) -> (i64, i64) {
        let millis = (created_ms.max(0) as u64) & ((1 << 48) - 1);
        let rand_a = u64::from(fastrand::u16(..) & 0x0fff);
        let spare = fastrand::u64(..) & (RAND_B as u64) & !(ROW_BITS as u64);
        let high = (millis << 16) | (0x7 << 12) | rand_a;
        let low = (0b10 << 62) | spare;
        (high as i64, low as i64)
    }

    /// The row id this uid was made for, if it came from the database with `salt`
    /// (callers confirm by also matching the stored uid).
    pub(crate) fn rowid(&self, salt: i64) -> i64 {
        ((self.0.as_u128() ^ u128::from(salt as u64)) & ROW_BITS) as i64
    }

    /// When the delivery was enqueued (ms since the epoch), from the UUID v7 time field.
    #[cfg(any(feature = "metrics", test))]
    pub(crate) fn created_ms(&self) -> i64 {
        (self.0.as_u128() >> 80) as i64
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

impl From<Uuid> for DeliveryId {
    fn from(uuid: Uuid) -> Self {
        DeliveryId(uuid)
    }
}

/// Chunk ids are derived from their place: `delivery row * CHUNK_STRIDE + index`, so
/// the chunk table's primary key orders chunks by delivery and index (see the schema).
pub(crate) const CHUNK_STRIDE: i64 = 16_384;

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

impl From<i64> for ChunkId {
    fn from(n: i64) -> Self {
        ChunkId(n)
    }
}

/// Which outbox handle holds (or last held) a claim: the high half of its fencing
/// token, random per [`Outbox`](crate::Outbox) handle.
///
/// [`ChunkView::claimant`](crate::monitoring::ChunkView::claimant) shows it for `sending` chunks and
/// for chunks whose lease ran out while their send was unsettled (`uncertain`, or
/// `retry` on a replayable channel): it names the process that may still report an
/// outcome for them, or that died holding them. [`Outbox::claimant`](crate::Outbox::claimant)
/// is this handle's own.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClaimantId(pub(crate) u32);

impl ClaimantId {
    /// A fresh random claimant id (never zero).
    pub(crate) fn random() -> Self {
        ClaimantId(fastrand::u32(1..))
    }

    /// The claimant of a stored fencing token.
    pub(crate) fn of_token(token: i64) -> Self {
        ClaimantId((token as u64 >> 32) as u32)
    }

    /// The fencing token of this claimant's claim number `seq`.
    pub(crate) fn token(self, seq: u32) -> i64 {
        ((u64::from(self.0) << 32) | u64::from(seq)) as i64
    }
}

impl fmt::Display for ClaimantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:08x}", self.0)
    }
}

impl fmt::Debug for ClaimantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClaimantId({self})")
    }
}

/// The idempotency key of chunk `index` (0-based) of a delivery: `"{delivery}:{index + 1}"`.
///
/// This module is the only place the key is derived, in three forms: this one (38
/// characters), [`chunk_compact_key`] (24, for Discord's 25-character `nonce`) and
/// [`chunk_key_uuid`] (for LINE's `X-Line-Retry-Key`). Every send of a chunk carries the
/// same key, so platforms that deduplicate by key (Matrix `txnId`, Discord `nonce`,
/// LINE's retry key) turn a replay into a no-op.
///
/// ```
/// # use chunked_outbox::ids::chunk_idempotency_key;
/// # use chunked_outbox::DeliveryId;
/// let id: DeliveryId = "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap();
/// assert_eq!(chunk_idempotency_key(&id, 1), "01890a5d-ac96-774b-bcce-b302099a8057:2");
/// ```
pub fn chunk_idempotency_key(delivery: &DeliveryId, index: u32) -> String {
    format!("{delivery}:{}", u64::from(index) + 1)
}

/// Length of [`chunk_compact_key`]: 24 characters, within Discord's 25-character `nonce`.
pub const COMPACT_KEY_LEN: usize = 24;

/// The same chunk's key in [`COMPACT_KEY_LEN`] characters of URL-safe base64
/// (`A-Z a-z 0-9 - _`): the delivery id's 16 bytes and the chunk index as 2 big-endian
/// bytes. For platforms whose key field is short: Discord's `nonce` allows at most 25
/// characters, and the full key has 38. Stable like the full key (every send of a chunk
/// carries the same one), and as unique: it encodes the same two values, losslessly.
///
/// ```
/// # use chunked_outbox::ids::chunk_compact_key;
/// # use chunked_outbox::DeliveryId;
/// let id: DeliveryId = "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap();
/// assert_eq!(chunk_compact_key(&id, 1), "AYkKXayWd0u8zrMCCZqAVwAB");
/// ```
pub fn chunk_compact_key(delivery: &DeliveryId, index: u32) -> String {
    use base64::Engine as _;
    let mut bytes = [0_u8; 18];
    bytes[..16].copy_from_slice(delivery.as_uuid().as_bytes());
    // A delivery has at most 10,000 chunks (MAX_CHUNKS): the index fits in 2 bytes.
    let index = u16::try_from(index).unwrap_or(u16::MAX);
    bytes[16..].copy_from_slice(&index.to_be_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// The same chunk's key as a UUID, for platforms that require one: LINE's
/// `X-Line-Retry-Key` must be a UUID. A name-based UUID (version 5): the delivery id is
/// the namespace, the chunk number (`index + 1`, as in the full key) the name, so it
/// is stable and differs per chunk.
///
/// ```
/// # use chunked_outbox::ids::chunk_key_uuid;
/// # use chunked_outbox::DeliveryId;
/// let id: DeliveryId = "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap();
/// assert_eq!(chunk_key_uuid(&id, 1), chunk_key_uuid(&id, 1));
/// assert_ne!(chunk_key_uuid(&id, 1), chunk_key_uuid(&id, 2));
/// assert_eq!(chunk_key_uuid(&id, 0).get_version_num(), 5);
/// ```
pub fn chunk_key_uuid(delivery: &DeliveryId, index: u32) -> Uuid {
    Uuid::new_v5(
        &delivery.as_uuid(),
        (u64::from(index) + 1).to_string().as_bytes(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two copies of one file share the salt and the row ids: their k-th deliveries made
    /// in the same millisecond must still get different uids (with the 12 random bits
    /// of old, 20,000 such pairs collided about five times).
    #[test]
    fn uids_of_the_same_row_salt_and_time_differ() {
        let (salt, ms) = (fastrand::i64(..), 1_790_000_000_000);
        let same = (1..=20_000)
            .filter(|row| {
                let (a, b) = (
                    DeliveryId::for_row(*row, salt, ms),
                    DeliveryId::for_row(*row, salt, ms),
                );
                assert_eq!((a.rowid(salt), b.rowid(salt)), (*row, *row));
                a == b
            })
            .count();
        assert_eq!(same, 0, "pairs of copies that made the same uid");
    }

    /// Uids written before the spare bits were random (the whole 62 bits were the
    /// salted row) still give back their row.
    #[test]
    fn older_uids_still_give_back_their_row() {
        let (row, salt) = (123_456, fastrand::i64(..));
        let old = u128::from((row ^ salt) as u64) & RAND_B;
        let uid = DeliveryId(Uuid::from_u128((0x7 << 76) | (0b10 << 62) | old));
        assert_eq!(uid.rowid(salt), row);
    }

    #[test]
    fn a_uid_gives_back_its_row_with_its_salt_only() {
        for _ in 0..1000 {
            let (row, salt) = (fastrand::i64(1..1 << 49), fastrand::i64(..));
            let id = DeliveryId::for_row(row, salt, 1_790_000_000_000);
            assert_eq!(id.rowid(salt), row);
            assert_ne!(id.rowid(salt ^ 1), row);
            assert_eq!(id.as_uuid().get_version_num(), 7);
            assert_eq!(id.as_uuid().get_variant(), uuid::Variant::RFC4122);
            let (secs, _) = id.as_uuid().get_timestamp().unwrap().to_unix();
            assert_eq!(secs, 1_790_000_000);
        }
    }

    #[test]
    fn a_token_names_its_claimant_and_differs_per_claim() {
        let me = ClaimantId::random();
        assert_ne!(me.0, 0);
        for seq in [0, 1, u32::MAX] {
            assert_eq!(ClaimantId::of_token(me.token(seq)), me);
        }
        assert_ne!(me.token(1), me.token(2));
        assert_eq!(ClaimantId(0xdead_beef).to_string(), "deadbeef");
        assert_eq!(format!("{:?}", ClaimantId(7)), "ClaimantId(00000007)");
    }

    /// The SQL range spells the stride out (SQL text is built at compile time); it must
    /// be the stride the ids are made with.
    #[test]
    fn compact_keys_are_short_lossless_and_distinct() {
        use base64::Engine as _;
        let mut seen = std::collections::HashSet::new();
        for row in 1..200 {
            let delivery = DeliveryId::for_row(row, 77, 1_700_000_000_000);
            for index in [0, 1, 2, 9_999] {
                let key = chunk_compact_key(&delivery, index);
                assert_eq!(key.len(), COMPACT_KEY_LEN, "{key}");
                assert!(
                    key.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                    "{key}"
                );
                let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(&key)
                    .unwrap();
                assert_eq!(&bytes[..16], delivery.as_uuid().as_bytes());
                assert_eq!(u16::from_be_bytes([bytes[16], bytes[17]]), index as u16);
                assert!(seen.insert(key));
                let uuid = chunk_key_uuid(&delivery, index);
                let name = (index + 1).to_string();
                assert_eq!(uuid, Uuid::new_v5(&delivery.as_uuid(), name.as_bytes()));
                assert!(seen.insert(uuid.to_string()));
            }
        }
    }

    #[test]
    fn a_uid_carries_its_creation_time() {
        let id = DeliveryId::for_row(7, 99, 1_767_225_600_123);
        assert_eq!(id.created_ms(), 1_767_225_600_123);
    }
}
