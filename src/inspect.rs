//! Read-only inspection of deliveries and chunks.

use chrono::{DateTime, Utc};
use rusqlite::{Connection, OptionalExtension, Row, params, params_from_iter, types::Value};
use serde::Serialize;

use crate::clock::to_datetime;
use crate::error::{Error, Result};
use crate::ids::CHUNK_STRIDE;
use crate::ids::{ChunkId, ClaimantId, DeliveryId, chunk_idempotency_key};
use crate::outbox::Outbox;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::sqlite::chunks::chunks_of_delivery;
use crate::store::sqlite::tx::Tx;

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
        self.read(|tx| {
            let Some((rowid, mut view)) = Connection::prepare_cached(
                tx,
                &format!("{DELIVERY_SELECT} WHERE id = ?1 AND uid = ?2"),
            )?
            .query_row(
                params![self.delivery_rowid(id), id.to_string()],
                delivery_row,
            )
            .optional()?
            else {
                return Ok(None);
            };
            view.chunks = chunks_of(tx, rowid, &view.id)?;
            Ok(Some(view))
        })
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
        let mut sql = format!("{DELIVERY_SELECT} WHERE 1");
        let mut values = Vec::new();
        if let Some(status) = filter.status {
            values.push(Value::Text(status.as_str().to_owned()));
            sql.push_str(&format!(" AND status = ?{}", values.len()));
            if status != DeliveryStatus::Delivered {
                // Lets SQLite use the partial index of unfinished deliveries.
                sql.push_str(" AND status <> 'delivered'");
            }
        }
        if let Some(channel) = &filter.channel {
            values.push(Value::Text(channel.clone()));
            sql.push_str(&format!(" AND channel = ?{}", values.len()));
        }
        if let Some(chat_id) = &filter.chat_id {
            values.push(Value::Text(chat_id.clone()));
            sql.push_str(&format!(" AND chat_id = ?{}", values.len()));
        }
        if let Some(key) = &filter.idempotency_key {
            values.push(Value::Text(key.clone()));
            sql.push_str(&format!(" AND idempotency_key = ?{}", values.len()));
        }
        values.push(Value::Integer(filter.limit as i64));
        sql.push_str(&format!(" ORDER BY id DESC LIMIT ?{}", values.len()));
        self.read(|tx| {
            let mut stmt = Connection::prepare_cached(tx, &sql)?;
            let rows = stmt.query_map(params_from_iter(values), |r| Ok(delivery_row(r)))?;
            let mut views = Vec::new();
            for row in rows {
                // A row that cannot be read is skipped here, not a reason to list
                // nothing; `corrupt_rows` reports it.
                if let Ok((_, view)) = row? {
                    views.push(view);
                }
            }
            Ok(views)
        })
    }

    /// Deliveries whose rows cannot be read, or that a claim set aside because of that:
    /// what `outbox health` counts as corrupt and `outbox list` reports apart. Empty on
    /// a healthy file.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn corrupt_rows(&self) -> Result<Vec<CorruptRow>> {
        self.read(|tx| {
            let mut stmt = tx.prepare_cached(
                "SELECT id, CAST(uid AS BLOB), corrupt FROM outbound_deliveries
                 WHERE corrupt IS NOT NULL AND status <> 'delivered'",
            )?;
            let mut found: Vec<CorruptRow> = stmt
                .query_map([], |r| {
                    Ok(CorruptRow {
                        row: r.get(0)?,
                        uid: String::from_utf8_lossy(&r.get::<_, Vec<u8>>(1)?).into_owned(),
                        reason: r.get(2)?,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            // Rows no claim has met yet: a uid that does not parse.
            let mut stmt = tx.prepare_cached(
                "SELECT id, CAST(uid AS BLOB) FROM outbound_deliveries
                 WHERE corrupt IS NULL AND status <> 'delivered'",
            )?;
            let mut rows = stmt.query([])?;
            while let Some(r) = rows.next()? {
                let uid = String::from_utf8_lossy(&r.get::<_, Vec<u8>>(1)?).into_owned();
                if uid.parse::<DeliveryId>().is_err() {
                    found.push(CorruptRow {
                        row: r.get(0)?,
                        reason: format!("its delivery uid {uid:?} is not a UUID"),
                        uid,
                    });
                }
            }
            Ok(found)
        })
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

const DELIVERY_SELECT: &str =
    "SELECT id, uid, channel, chat_id, sender, idempotency_key, status, text,
        chunk_count, delivered_count, created_at, updated_at, finished_at, acknowledged_at,
        metadata, not_before, finalize_error
 FROM outbound_deliveries";

fn delivery_row(r: &Row<'_>) -> rusqlite::Result<(i64, DeliveryView)> {
    let uid: String = r.get(1)?;
    let id = uid.parse::<DeliveryId>().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(1, rusqlite::types::Type::Text, Box::new(e))
    })?;
    Ok((
        r.get(0)?,
        DeliveryView {
            id,
            channel: r.get(2)?,
            chat_id: r.get(3)?,
            sender: r.get(4)?,
            idempotency_key: r.get(5)?,
            status: r.get(6)?,
            text: r.get(7)?,
            chunk_count: r.get(8)?,
            delivered_count: r.get(9)?,
            created_at: to_datetime(r.get(10)?),
            updated_at: to_datetime(r.get(11)?),
            finished_at: r.get::<_, Option<i64>>(12)?.map(to_datetime),
            acknowledged_at: r.get::<_, Option<i64>>(13)?.map(to_datetime),
            metadata: r.get(14)?,
            not_before: r.get::<_, Option<i64>>(15)?.map(to_datetime),
            finalize_error: r.get(16)?,
            chunks: Vec::new(),
        },
    ))
}

fn chunks_of(tx: &Tx<'_>, delivery: i64, id: &DeliveryId) -> Result<Vec<ChunkView>> {
    // A queued delivery without a chunk row has one pending chunk, stored when the
    // delivery becomes active (see `enqueue::stored_at_activation`).
    let mut stmt = tx.prepare_cached(concat!(
        "SELECT coalesce(c.id, ?2), coalesce(c.chunk_index, 0),
                coalesce(c.status, 'pending'), coalesce(c.attempts, 0), c.due_at, c.last_error,
                c.platform_message_id, c.delivered_at, coalesce(c.text, d.text), c.claim_token
         FROM outbound_deliveries d LEFT JOIN outbound_delivery_chunks c ON ",
        chunks_of_delivery!("c", "?1"),
        " WHERE d.id = ?1 AND (c.id IS NOT NULL OR d.status = 'queued')
         ORDER BY c.id"
    ))?;
    let rows = stmt.query_map(params![delivery, delivery * CHUNK_STRIDE], |r| {
        let index: u32 = r.get(1)?;
        let status: ChunkStatus = r.get(2)?;
        let due = r.get::<_, Option<i64>>(4)?.map(to_datetime);
        let sending = status == ChunkStatus::Sending;
        Ok(ChunkView {
            id: ChunkId(r.get(0)?),
            index,
            status,
            attempts: r.get(3)?,
            next_attempt_at: if sending { None } else { due },
            lease_until: if sending { due } else { None },
            last_error: r.get(5)?,
            platform_message_id: r.get(6)?,
            delivered_at: r.get::<_, Option<i64>>(7)?.map(to_datetime),
            idempotency_key: chunk_idempotency_key(id, index),
            text: r.get(8)?,
            claimant: r.get::<_, Option<i64>>(9)?.map(ClaimantId::of_token),
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}
