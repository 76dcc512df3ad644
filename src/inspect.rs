//! Read-only inspection of deliveries and chunks.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::ids::{ChunkId, ClaimantId, DeliveryId};
use crate::outbox::Outbox;
use crate::status::{ChunkStatus, DeliveryStatus};

/// Most rows one [`Outbox::list`] returns.
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
    /// Its chunks in order (empty in [`Outbox::list`] results, and for a cancelled
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
}

/// Which deliveries [`Outbox::list`] returns: all filters must match; newest first.
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

impl Outbox {
    /// One delivery with its chunks, or `None` if there is no such delivery.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn delivery(&self, id: DeliveryId) -> Result<Option<DeliveryView>> {
        let row = self.delivery_rowid(id);
        self.read(|tx| tx.delivery_view(row, &id.to_string()))
    }

    /// Deliveries matching `filter`, newest first, without their chunks.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a limit of 0 or above [`MAX_LIST_LIMIT`].
    pub fn list(&self, filter: &ListFilter) -> Result<Vec<DeliveryView>> {
        if filter.limit == 0 || filter.limit > MAX_LIST_LIMIT {
            return Err(Error::invalid(
                "limit",
                format!("{} is outside 1..={MAX_LIST_LIMIT}", filter.limit),
            ));
        }
        self.read(|tx| tx.list(filter))
    }

    /// Deliveries whose rows cannot be read, or that a claim set aside because of that:
    /// what `outbox health` counts as corrupt and `outbox list` reports apart. Empty on
    /// a healthy file.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn corrupt_rows(&self) -> Result<Vec<CorruptRow>> {
        self.read(|tx| tx.corrupt_rows())
    }
}

/// A delivery row that cannot be read (see [`Outbox::corrupt_rows`]).
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
