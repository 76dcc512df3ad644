//! The reads of monitoring and inspection on SQLite: each is a few statements over the
//! index of unfinished deliveries and the maintained counters, never the history.

use rusqlite::{Connection, OptionalExtension, Row, params, params_from_iter, types::Value};

use super::chunks::{chunks_supplied, supplied};
use super::tx::Tx;
use crate::clock::to_datetime;
use crate::error::Result;
use crate::ids::{CHUNK_STRIDE, ChunkId, ClaimantId, DeliveryId, chunk_idempotency_key};
use crate::status::ChunkStatus;
use crate::store::{
    ActivityRow, ChunkGroup, DeliveryGroup, HealthRows, ListFrom, ReadStore, StatsRow,
    list_deliveries,
};
use crate::views::{ChunkView, CorruptRow, DeliveryView, ListFilter};

/// Counted per channel and delivery status, over the unfinished deliveries in flight or
/// waiting for a person; the dead letters are counted by [`DEAD_LETTER_COUNTS_SQL`].
pub(crate) const OPEN_DELIVERIES_SQL: &str =
    "SELECT channel, status, acknowledged_at IS NULL, count(*), min(created_at),
        count(corrupt)
 FROM outbound_deliveries INDEXED BY outbound_deliveries_open
 WHERE status <> 'delivered' AND status <> 'failed'
 GROUP BY channel, status, acknowledged_at IS NULL";

/// The dead letters and failed parts of each channel, as the statements that change them
/// keep them (`super::dead`): a snapshot's cost does not grow with the dead letters kept.
pub(crate) const DEAD_LETTER_COUNTS_SQL: &str =
    "SELECT channel, dead_letters, unacknowledged, corrupt, failed_chunks
 FROM outbound_dead_letter_counts
 WHERE dead_letters <> 0 OR failed_chunks <> 0";

/// Counted per channel and chunk status, over the chunks of unfinished deliveries other
/// than dead letters (whose failed parts are counted by [`DEAD_LETTER_COUNTS_SQL`], and
/// whose unsent rest is not pending work); the chunk of a queued reply whose row is
/// stored at its activation is counted (`supplied!`).
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
 WHERE d.status <> 'delivered' AND d.status <> 'failed' AND ",
    supplied!(seen),
    "
   AND state <> 'delivered'
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
        let mut dead = self.prepare_cached(DEAD_LETTER_COUNTS_SQL)?;
        let mut read = dead.query([])?;
        while let Some(r) = read.next()? {
            rows.add_dead_letters(
                r.get(0)?,
                count(r, 1)?,
                count(r, 2)?,
                count(r, 3)?,
                count(r, 4)?,
            );
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
        // Asked for unfinished deliveries only, the partial indexes of those are read
        // (and their rows sorted), not the whole history in id order: SQLite, left to
        // itself, walks the table backwards for the ORDER BY, a million rows for fifty.
        list_deliveries(
            filter,
            || {
                Ok(self
                    .prepare_cached("SELECT name FROM outbound_channels ORDER BY name")?
                    .query_map([], |r| r.get(0))?
                    .collect::<rusqlite::Result<_>>()?)
            },
            |from, channel| {
                let select = match from {
                    ListFrom::All => LIST_ALL,
                    ListFrom::InFlight => LIST_IN_FLIGHT,
                    ListFrom::Dead => LIST_DEAD,
                };
                self.list_where(select, filter, channel)
            },
        )
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
        let rows = stmt.query_map([since, bucket], activity_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn activity_minutes(&self, from: i64, to: i64) -> Result<Vec<ActivityRow>> {
        let mut stmt = self.prepare_cached(
            "SELECT minute, delivered, failed, latency_sum_ms, latency_max_ms
             FROM outbound_activity WHERE minute >= ?1 AND minute <= ?2 ORDER BY minute",
        )?;
        let rows = stmt.query_map([from, to], activity_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn corrupt_rows(&self) -> Result<Vec<CorruptRow>> {
        let tx = self;
        let mut stmt = tx.prepare_cached(
            "SELECT id, CAST(uid AS BLOB), corrupt FROM outbound_deliveries
             WHERE corrupt IS NOT NULL AND status = 'failed'",
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
            "SELECT id, CAST(uid AS BLOB) FROM outbound_deliveries INDEXED BY outbound_deliveries_open
             WHERE corrupt IS NULL AND status <> 'delivered' AND status <> 'failed'
             UNION ALL
             SELECT id, CAST(uid AS BLOB) FROM outbound_deliveries
             WHERE corrupt IS NULL AND status = 'failed'",
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

/// A bucket's, or a minute's, counts: its number, delivered, failed, and the sum and
/// the longest of the delivered replies' times.
fn activity_row(r: &Row<'_>) -> rusqlite::Result<ActivityRow> {
    Ok(ActivityRow {
        bucket: r.get(0)?,
        delivered: r.get(1)?,
        failed: r.get(2)?,
        latency_sum_ms: r.get(3)?,
        latency_max_ms: r.get(4)?,
    })
}

/// The columns of a delivery's view, from its table.
macro_rules! delivery_select {
    () => {
        "SELECT id, uid, channel, chat_id, sender, idempotency_key, status, text,
        chunk_count, delivered_count, created_at, updated_at, finished_at, acknowledged_at,
        metadata, not_before, finalize_error
 FROM outbound_deliveries"
    };
}
const DELIVERY_SELECT: &str = delivery_select!();

/// The deliveries a list may show, of any status: history included.
const LIST_ALL: &str = concat!(delivery_select!(), " WHERE 1");
/// The work in flight (or waiting for a person), from its index.
pub(crate) const LIST_IN_FLIGHT: &str = concat!(
    delivery_select!(),
    " INDEXED BY outbound_deliveries_open WHERE status <> 'delivered' AND status <> 'failed'"
);
/// The dead letters, from their indexes (a channel is always given).
pub(crate) const LIST_DEAD: &str = concat!(delivery_select!(), " WHERE status = 'failed'");

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

impl Tx<'_> {
    /// The rows `select` (ending in its WHERE clause) finds with `filter`'s other
    /// conditions, on `channel` if given, newest first, at most `filter.limit`; rows that
    /// cannot be read are left out (`corrupt_rows` reports them).
    fn list_where(
        &self,
        select: &'static str,
        filter: &ListFilter,
        channel: Option<&str>,
    ) -> Result<Vec<(i64, DeliveryView)>> {
        let (sql, values) = list_sql(select, filter, channel);
        let mut stmt = Connection::prepare_cached(self, &sql)?;
        let rows = stmt.query_map(params_from_iter(values), |r| Ok(delivery_row(r)))?;
        let mut found = Vec::new();
        for row in rows {
            if let Ok(row) = row? {
                found.push(row);
            }
        }
        Ok(found)
    }
}

/// The statement [`Tx::list_where`] runs, and its values.
pub(crate) fn list_sql(
    select: &'static str,
    filter: &ListFilter,
    channel: Option<&str>,
) -> (String, Vec<Value>) {
    let mut sql = select.to_owned();
    let mut values = Vec::new();
    if let Some(status) = filter.status {
        values.push(Value::Text(status.as_str().to_owned()));
        sql.push_str(&format!(" AND status = ?{}", values.len()));
    }
    if filter.unfinished {
        sql.push_str(" AND status <> 'cancelled'");
    }
    if let Some(channel) = channel.or(filter.channel.as_deref()) {
        values.push(Value::Text(channel.to_owned()));
        sql.push_str(&format!(" AND channel = ?{}", values.len()));
    }
    if let Some(chat_id) = &filter.chat_id {
        values.push(Value::Text(chat_id.clone()));
        sql.push_str(&format!(" AND chat_id = ?{}", values.len()));
    }
    if let Some(key) = &filter.idempotency_key {
        values.push(Value::Text(key.clone()));
        sql.push_str(&format!(" AND idempotency_key = ?{}", values.len()));
        if channel.is_none() && filter.channel.is_none() {
            // Found through the index of keys per channel, one channel at a time
            // (every delivery's channel is registered), not by walking the history.
            sql.push_str(" AND channel IN (SELECT name FROM outbound_channels)");
        }
    }
    values.push(Value::Integer(filter.limit as i64));
    sql.push_str(&format!(" ORDER BY id DESC LIMIT ?{}", values.len()));
    (sql, values)
}

/// A non-negative count column (SQLite integers are signed).
fn count(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<u64> {
    Ok(r.get::<_, Option<i64>>(i)?.unwrap_or(0).max(0) as u64)
}
