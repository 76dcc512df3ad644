//! The reads of monitoring and inspection on SQLite: each is a few statements over the
//! index of unfinished deliveries and the maintained counters, never the history.

use rusqlite::{Connection, OptionalExtension, Row, params, params_from_iter, types::Value};

use super::chunks::{chunks_supplied, supplied};
use super::tx::Tx;
use crate::clock::to_datetime;
use crate::error::Result;
use crate::ids::{CHUNK_STRIDE, ChunkId, ClaimantId, DeliveryId, chunk_idempotency_key};
use crate::inspect::{ChunkView, CorruptRow, DeliveryView, ListFilter};
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::{ActivityRow, ChunkGroup, DeliveryGroup, HealthRows, ReadStore, StatsRow};

/// Counted per channel and delivery status, over unfinished deliveries only.
pub(crate) const OPEN_DELIVERIES_SQL: &str =
    "SELECT channel, status, acknowledged_at IS NULL, count(*), min(created_at),
        count(corrupt)
 FROM outbound_deliveries INDEXED BY outbound_deliveries_open
 WHERE status <> 'delivered'
 GROUP BY channel, status, acknowledged_at IS NULL";

/// Counted per channel and chunk status, over the chunks of unfinished deliveries only.
/// The unsent rest of a dead letter is not pending work, so it is left out; the chunk of
/// a queued reply whose row is stored at its activation is counted (`supplied!`).
pub(crate) const OPEN_CHUNKS_SQL: &str = concat!(
    "SELECT d.channel, ",
    supplied!(status),
    " AS state, count(*),
        sum(c.due_at IS NOT NULL AND c.due_at <= ?1),
        min(CASE WHEN c.status <> 'sending' THEN c.due_at END),
        sum(c.due_at IS NOT NULL)
 FROM outbound_deliveries d INDEXED BY outbound_deliveries_open",
    chunks_supplied!("d.id"),
    "
 WHERE d.status <> 'delivered' AND ",
    supplied!(seen),
    "
   AND state <> 'delivered' AND NOT (d.status = 'failed' AND state = 'pending')
 GROUP BY d.channel, state"
);

impl ReadStore for Tx<'_> {
    fn health_rows(&self, now: i64) -> Result<HealthRows> {
        let mut rows = HealthRows::default();
        let mut stats = self.prepare_cached(
            "SELECT channel, delivered, last_delivered_at, finalized_total, latency_count,
                    latency_sum_ms, latency_le_1s, latency_le_5s, latency_le_30s,
                    latency_le_120s, latency_le_600s, latency_le_3600s
             FROM outbound_channel_stats",
        )?;
        let mut read = stats.query([])?;
        while let Some(r) = read.next()? {
            let mut latency_le = [0; 6];
            for (i, bucket) in latency_le.iter_mut().enumerate() {
                *bucket = count(r, 6 + i)?;
            }
            rows.stats.push(StatsRow {
                channel: r.get(0)?,
                delivered: count(r, 1)?,
                last_delivered_at: r.get(2)?,
                finalized_total: count(r, 3)?,
                latency_count: count(r, 4)?,
                latency_sum_ms: count(r, 5)?,
                latency_le,
            });
        }
        let mut open = self.prepare_cached(OPEN_DELIVERIES_SQL)?;
        let mut read = open.query([])?;
        while let Some(r) = read.next()? {
            rows.deliveries.push(DeliveryGroup {
                channel: r.get(0)?,
                status: r.get(1)?,
                unacknowledged: r.get(2)?,
                count: count(r, 3)?,
                oldest_created_at: r.get(4)?,
                corrupt: count(r, 5)?,
            });
        }
        let mut chunks = self.prepare_cached(OPEN_CHUNKS_SQL)?;
        let mut read = chunks.query([now])?;
        while let Some(r) = read.next()? {
            rows.chunks.push(ChunkGroup {
                channel: r.get(0)?,
                status: r.get(1)?,
                count: count(r, 2)?,
                due_now: count(r, 3)?,
                oldest_due: r.get(4)?,
                scheduled: count(r, 5)?,
            });
        }
        Ok(rows)
    }

    fn delivery_view(&self, delivery: i64, uid: &str) -> Result<Option<DeliveryView>> {
        let Some((row, mut view)) = Connection::prepare_cached(
            self,
            &format!("{DELIVERY_SELECT} WHERE id = ?1 AND uid = ?2"),
        )?
        .query_row(params![delivery, uid], delivery_row)
        .optional()?
        else {
            return Ok(None);
        };
        view.chunks = chunks_of(self, row, &view.id)?;
        Ok(Some(view))
    }

    fn list(&self, filter: &ListFilter) -> Result<Vec<DeliveryView>> {
        // Asked for unfinished deliveries only, the partial index of those is read (and
        // its rows sorted), not the whole history in id order: SQLite, left to itself,
        // walks the table backwards for the ORDER BY, a million rows for fifty.
        let unfinished = filter.unfinished
            || filter
                .status
                .is_some_and(|status| status != DeliveryStatus::Delivered);
        let mut sql = if unfinished {
            format!(
                "{DELIVERY_SELECT} INDEXED BY outbound_deliveries_open WHERE status <> 'delivered'"
            )
        } else {
            format!("{DELIVERY_SELECT} WHERE 1")
        };
        let mut values = Vec::new();
        if let Some(status) = filter.status {
            values.push(Value::Text(status.as_str().to_owned()));
            sql.push_str(&format!(" AND status = ?{}", values.len()));
        }
        if filter.unfinished {
            sql.push_str(" AND status <> 'cancelled'");
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
            if filter.channel.is_none() {
                // Found through the index of keys per channel, one channel at a time
                // (every delivery's channel is registered), not by walking the history.
                sql.push_str(" AND channel IN (SELECT name FROM outbound_channels)");
            }
        }
        values.push(Value::Integer(filter.limit as i64));
        sql.push_str(&format!(" ORDER BY id DESC LIMIT ?{}", values.len()));
        let mut stmt = Connection::prepare_cached(self, &sql)?;
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
    }

    fn activity(&self, since: i64, bucket: i64) -> Result<Vec<ActivityRow>> {
        let mut stmt = self.prepare_cached(
            "SELECT (finished_at - ?1) / ?2,
                    count(*) FILTER (WHERE status = 'delivered'),
                    count(*) FILTER (WHERE status = 'failed'),
                    coalesce(sum(finished_at - created_at) FILTER (WHERE status = 'delivered'), 0),
                    coalesce(max(finished_at - created_at) FILTER (WHERE status = 'delivered'), 0)
             FROM outbound_deliveries INDEXED BY outbound_deliveries_finished
             WHERE finished_at >= ?1 AND status IN ('delivered', 'failed')
             GROUP BY 1 ORDER BY 1",
        )?;
        let rows = stmt.query_map([since, bucket], |r| {
            Ok(ActivityRow {
                bucket: r.get(0)?,
                delivered: r.get(1)?,
                failed: r.get(2)?,
                latency_sum_ms: r.get(3)?,
                latency_max_ms: r.get(4)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn corrupt_rows(&self) -> Result<Vec<CorruptRow>> {
        let tx = self;
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
    }
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
    let mut stmt = tx.prepare_cached(concat!(
        "SELECT ",
        supplied!(id "?2"),
        ", ",
        supplied!(index),
        ", ",
        supplied!(status),
        ", ",
        supplied!(attempts),
        ", c.due_at, c.last_error,
                c.platform_message_id, c.delivered_at, coalesce(c.text, d.text), c.claim_token,
                c.first_sent_at, c.settlement
         FROM outbound_deliveries d",
        chunks_supplied!("?1"),
        " WHERE d.id = ?1 AND ",
        supplied!(seen),
        " ORDER BY c.id"
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
            first_sent_at: r.get::<_, Option<i64>>(10)?.map(to_datetime),
            settlement: r.get(11)?,
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// A non-negative count column (SQLite integers are signed).
fn count(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<u64> {
    Ok(r.get::<_, Option<i64>>(i)?.unwrap_or(0).max(0) as u64)
}
