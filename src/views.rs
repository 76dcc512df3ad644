//! What the store reads for an inspection, a listing and health: the read model every
//! store fills and the rules above it show. Below the store (it names no rule module),
//! re-exported where users find it ([`inspect`](crate::inspect), `monitoring`).

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::ids::{ChunkId, ClaimantId, DeliveryId};
use crate::status::{ChunkStatus, DeliveryStatus};

/// Most rows one [`Outbox::list`](crate::Outbox::list) returns.
pub const MAX_LIST_LIMIT: usize = 10_000;

/// One delivery as stored, with its chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeliveryView {
    /// Public id.
    pub id: DeliveryId,
    /// Channel name.
    pub channel: String,
    /// Destination chat.
    pub chat_id: String,
    /// Sender name for `outbound_messages`.
    pub sender: Option<String>,
    /// The caller's idempotency key.
    pub idempotency_key: Option<String>,
    /// Per-reply metadata given at enqueue.
    pub metadata: Option<String>,
    /// For a delayed reply: when it may start.
    pub not_before: Option<DateTime<Utc>>,
    /// Current status.
    pub status: DeliveryStatus,
    /// Full text.
    pub text: String,
    /// Number of chunks.
    pub chunk_count: u32,
    /// Chunks delivered so far.
    pub delivered_count: u32,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// When it was finalized or failed.
    pub finished_at: Option<DateTime<Utc>>,
    /// When an operator acknowledged it as a dead letter.
    pub acknowledged_at: Option<DateTime<Utc>>,
    /// For an [`Unfinalized`](DeliveryStatus::Unfinalized) reply: what the application's
    /// finalization statement met.
    pub finalize_error: Option<String>,
    /// Its chunks in order (empty in [`Outbox::list`](crate::Outbox::list) results, and for a cancelled
    /// delivery, whose chunks are removed).
    pub chunks: Vec<ChunkView>,
}

/// One chunk as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ChunkView {
    /// Chunk id.
    pub id: ChunkId,
    /// 0-based position.
    pub index: u32,
    /// Current status.
    pub status: ChunkStatus,
    /// Attempts counted so far.
    pub attempts: u32,
    /// When it is due (`pending`/`retry` chunks that may be claimed).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When the current claim's lease ends (`sending` chunks).
    pub lease_until: Option<DateTime<Utc>>,
    /// Which outbox handle's claim is unsettled on this chunk: the one sending it, or —
    /// for an `uncertain` or `retry` chunk whose lease ran out — the one that was, and
    /// may still report its outcome (or died holding it). `None` otherwise.
    pub claimant: Option<ClaimantId>,
    /// Last error reported for it.
    pub last_error: Option<String>,
    /// The platform's id, once delivered.
    pub platform_message_id: Option<String>,
    /// When it was delivered.
    pub delivered_at: Option<DateTime<Utc>>,
    /// The key every send of it carries.
    pub idempotency_key: String,
    /// Its text.
    pub text: String,
    /// When a send of it was first claimed: the earliest it can have reached the
    /// platform. `None` before its first send (and for a chunk sent only before schema
    /// version 9 on SQLite, 6 on PostgreSQL).
    pub first_sent_at: Option<DateTime<Utc>>,
    /// What its platform was asked about it after a send that may have reached the
    /// platform, what it answered and what was decided (see
    /// [`ReplayPolicy::Ask`](crate::rules::ReplayPolicy::Ask)); `None` if nobody asked
    /// since it last became uncertain.
    pub settlement: Option<String>,
}

/// Which deliveries [`Outbox::list`](crate::Outbox::list) returns: all filters must match; newest first.
/// Built from the default with its methods:
/// `ListFilter::default().status(DeliveryStatus::Failed).limit(10)`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListFilter {
    /// Only this status.
    pub status: Option<DeliveryStatus>,
    /// Only this channel.
    pub channel: Option<String>,
    /// Only this chat.
    pub chat_id: Option<String>,
    /// Only the delivery enqueued with this caller idempotency key.
    pub idempotency_key: Option<String>,
    /// Only deliveries not delivered or cancelled: queued, active, uncertain, failed or
    /// unfinalized.
    pub unfinished: bool,
    /// At most this many (default 100, at most [`MAX_LIST_LIMIT`]).
    pub limit: usize,
}

impl Default for ListFilter {
    fn default() -> Self {
        ListFilter {
            status: None,
            channel: None,
            chat_id: None,
            idempotency_key: None,
            unfinished: false,
            limit: 100,
        }
    }
}

impl ListFilter {
    /// Only deliveries in this status.
    pub fn status(self, status: DeliveryStatus) -> Self {
        ListFilter {
            status: Some(status),
            ..self
        }
    }

    /// Only deliveries of this channel.
    pub fn channel(self, channel: impl Into<String>) -> Self {
        ListFilter {
            channel: Some(channel.into()),
            ..self
        }
    }

    /// Only deliveries to this chat.
    pub fn chat_id(self, chat_id: impl Into<String>) -> Self {
        ListFilter {
            chat_id: Some(chat_id.into()),
            ..self
        }
    }

    /// Only the delivery enqueued with this caller key.
    pub fn idempotency_key(self, key: impl Into<String>) -> Self {
        ListFilter {
            idempotency_key: Some(key.into()),
            ..self
        }
    }

    /// Only deliveries not delivered or cancelled.
    pub fn unfinished(self) -> Self {
        ListFilter {
            unfinished: true,
            ..self
        }
    }

    /// At most this many.
    pub fn limit(self, limit: usize) -> Self {
        ListFilter { limit, ..self }
    }
}

/// A delivery row that cannot be read (see [`Outbox::corrupt_rows`](crate::Outbox::corrupt_rows)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CorruptRow {
    /// Its row number in `outbound_deliveries`.
    pub row: i64,
    /// Its uid as stored (lossily decoded).
    pub uid: String,
    /// What is wrong with it.
    pub reason: String,
}

/// How far behind its primary the standby a snapshot was read from is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Replica {
    /// Time since the last transaction it replayed committed on the primary (`None`
    /// before it replayed any). It grows while the primary writes nothing, too.
    pub replay_lag_ms: Option<u64>,
    /// Whether it has replayed all the WAL it received.
    pub replayed_all_received: bool,
}
