//! The reads of monitoring and inspection on PostgreSQL, over the index of unfinished
//! deliveries and the maintained counters; of the history, only what the index of
//! finished deliveries finds (the console's charts). They run in one
//! REPEATABLE READ, READ ONLY transaction.

use postgres::Row;
use postgres::types::ToSql;

use super::chunk_id;
use super::tx::{PgTx, chunk_status, count, delivery_status};
use crate::clock::to_datetime;
use crate::error::Result;
use crate::ids::{ChunkId, ClaimantId, DeliveryId, chunk_idempotency_key};
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::{
    ActivityRow, ChunkGroup, DeliveryGroup, HealthRows, ListFrom, ReadStore, StatsRow,
    list_deliveries,
};
use crate::views::{ChunkView, CorruptRow, DeliveryView, ListFilter};

/// Each channel's counters, summed over its rows (see `V3__sharded_stats.sql`).
pub(crate) const STATS_SQL: &str = "SELECT channel, sum(delivered)::bigint, max(last_delivered_at),
        sum(finalized_total)::bigint, sum(latency_count)::bigint, sum(latency_sum_ms)::bigint,
        sum(latency_le_1s)::bigint, sum(latency_le_5s)::bigint, sum(latency_le_30s)::bigint,
        sum(latency_le_120s)::bigint, sum(latency_le_600s)::bigint,
        sum(latency_le_3600s)::bigint
     FROM outbound_channel_stats GROUP BY channel ORDER BY channel";

/// Counted per channel and delivery status, over the unfinished deliveries in flight or
/// waiting for a person; the dead letters are counted by [`DEAD_LETTER_COUNTS_SQL`].
pub(crate) const OPEN_DELIVERIES_SQL: &str =
    "SELECT channel, status, acknowledged_at IS NULL, count(*), min(created_at),
            count(corrupt)
     FROM outbound_deliveries WHERE status <> 'delivered' AND status <> 'failed'
     GROUP BY channel, status, acknowledged_at IS NULL";

/// The dead letters and failed parts of each channel, summed over its rows, as the
/// triggers of `V7__counted_not_read.sql` keep them: a snapshot's cost does not grow
/// with the dead letters kept.
pub(crate) const DEAD_LETTER_COUNTS_SQL: &str =
    "SELECT channel, sum(dead_letters)::bigint, sum(unacknowledged)::bigint,
            sum(corrupt)::bigint, sum(failed_chunks)::bigint
     FROM outbound_dead_letter_counts GROUP BY channel
     HAVING sum(dead_letters) <> 0 OR sum(failed_chunks) <> 0";

/// Counted per channel and chunk status, over the chunks of unfinished deliveries other
/// than dead letters (counted by [`DEAD_LETTER_COUNTS_SQL`]); the chunk of a queued
/// reply whose row is stored at its activation counted as pending.
pub(crate) const OPEN_CHUNKS_SQL: &str = "SELECT d.channel, coalesce(c.status, 'pending') AS state,
        count(*), count(*) FILTER (WHERE c.due_at <= $1),
        min(c.due_at) FILTER (WHERE c.status <> 'sending'), count(c.due_at)
     FROM outbound_deliveries d
          LEFT JOIN outbound_delivery_chunks c ON c.delivery_id = d.id
     WHERE d.status <> 'delivered' AND d.status <> 'failed'
       AND (c.delivery_id IS NOT NULL OR d.status = 'queued')
       AND coalesce(c.status, 'pending') <> 'delivered'
     GROUP BY d.channel, state";

/// The counts kept for minutes `$1..=$2`, summed over each minute's rows.
pub(crate) const ACTIVITY_MINUTES_SQL: &str =
    "SELECT minute, sum(delivered)::bigint, sum(failed)::bigint,
            sum(latency_sum_ms)::bigint, max(latency_max_ms)
     FROM outbound_activity WHERE minute >= $1 AND minute <= $2
     GROUP BY minute ORDER BY minute";

/// A bucket's, or a minute's, counts: its number, delivered, failed, and the sum and
/// the longest of the delivered replies' times.
fn activity_row(r: &Row) -> Result<ActivityRow> {
    Ok(ActivityRow {
        bucket: r.try_get(0)?,
        delivered: r.try_get(1)?,
        failed: r.try_get(2)?,
        latency_sum_ms: r.try_get(3)?,
        latency_max_ms: r.try_get(4)?,
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

/// The deliveries a list may show, of any status: history included.
const LIST_ALL: &str = concat!(delivery_select!(), " WHERE true");
/// The work in flight (or waiting for a person), from its index.
const LIST_IN_FLIGHT: &str = concat!(
    delivery_select!(),
    " WHERE status <> 'delivered' AND status <> 'failed'"
);
/// The dead letters, from their indexes (a channel is always given).
const LIST_DEAD: &str = concat!(delivery_select!(), " WHERE status = 'failed'");

const VIEW_SQL: &str = "SELECT id, uid, channel, chat_id, sender, idempotency_key, status, text,
        chunk_count, delivered_count, created_at, updated_at, finished_at, acknowledged_at,
        metadata, not_before, finalize_error
     FROM outbound_deliveries
     WHERE id = coalesce((SELECT new_id FROM outbound_renumbered WHERE old_id = $1), $1)
       AND uid = $2";

const CHUNKS_SQL: &str = concat!(
    "SELECT ",
    chunk_id!("d.id", "coalesce(c.chunk_index, 0)"),
    ",
        coalesce(c.chunk_index, 0), coalesce(c.status, 'pending'), coalesce(c.attempts, 0),
        c.due_at, c.last_error, c.platform_message_id, c.delivered_at,
        coalesce(c.text, d.text), c.claim_token, c.first_sent_at, c.settlement
     FROM outbound_deliveries d
          LEFT JOIN outbound_delivery_chunks c ON c.delivery_id = d.id
     WHERE d.id = $1 AND (c.delivery_id IS NOT NULL OR d.status = 'queued')
     ORDER BY c.chunk_index"
);

/// Whether the server is a standby, and then how far behind its primary it is (see
/// [`crate::views::Replica`]).
const REPLICA_SQL: &str = "SELECT pg_is_in_recovery(),
            (extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())
                 * 1000)::int8,
            coalesce(pg_last_wal_receive_lsn() <= pg_last_wal_replay_lsn(), true)";

impl ReadStore for PgTx<'_> {
    fn health_rows(&self, now: i64) -> Result<HealthRows> {
        self.on_indexes(|| self.health_rows_here(now))
    }
    fn delivery_view(&self, delivery: i64, uid: &str) -> Result<Option<DeliveryView>> {
        let Some(r) = self.query_opt(VIEW_SQL, &[&delivery, &uid])? else {
            return Ok(None);
        };
        let Ok((row, mut view)) = delivery_row(&r) else {
            return Ok(None);
        };
        view.chunks = self
            .query(CHUNKS_SQL, &[&row])?
            .iter()
            .map(|r| chunk_view(r, &view.id))
            .collect::<Result<_>>()?;
        Ok(Some(view))
    }

    fn list(&self, filter: &ListFilter) -> Result<Vec<DeliveryView>> {
        list_deliveries(
            filter,
            || {
                self.query("SELECT name FROM outbound_channels ORDER BY name", &[])?
                    .iter()
                    .map(|r| Ok(r.try_get(0)?))
                    .collect()
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
        let rows = self.query(
            "SELECT (finished_at - $1) / $2,
                    count(*) FILTER (WHERE status = 'delivered'),
                    count(*) FILTER (WHERE status = 'failed'),
                    coalesce(sum(finished_at - created_at) FILTER (WHERE status = 'delivered'), 0)::bigint,
                    coalesce(max(finished_at - created_at) FILTER (WHERE status = 'delivered'), 0)
             FROM outbound_deliveries
             WHERE finished_at >= $1 AND status IN ('delivered', 'failed')
             GROUP BY 1 ORDER BY 1",
            &[&since, &bucket],
        )?;
        rows.iter().map(activity_row).collect()
    }

    fn activity_minutes(&self, from: i64, to: i64) -> Result<Vec<ActivityRow>> {
        let rows = self.query(ACTIVITY_MINUTES_SQL, &[&from, &to])?;
        rows.iter().map(activity_row).collect()
    }

    fn corrupt_rows(&self) -> Result<Vec<CorruptRow>> {
        let mut found = Vec::new();
        for r in self.query(
            "SELECT id, uid, corrupt FROM outbound_deliveries
             WHERE status <> 'delivered' AND status <> 'failed' AND uid !~ '^[0-9a-fA-F-]{36}$'
             UNION ALL
             SELECT id, uid, corrupt FROM outbound_deliveries
             WHERE status = 'failed' AND (corrupt IS NOT NULL OR uid !~ '^[0-9a-fA-F-]{36}$')",
            &[],
        )? {
            let uid: String = r.try_get(1)?;
            let reason = match r.try_get::<_, Option<String>>(2)? {
                Some(reason) => reason,
                None if uid.parse::<DeliveryId>().is_err() => {
                    format!("its delivery uid {uid:?} is not a UUID")
                }
                None => continue,
            };
            found.push(CorruptRow {
                row: r.try_get(0)?,
                uid,
                reason,
            });
        }
        Ok(found)
    }
}

impl PgTx<'_> {
    /// The rows of `filter` that `select` (ending in its WHERE clause) finds, on
    /// `channel` if given, newest first, at most `filter.limit`; a row that cannot be
    /// read is left out (`corrupt_rows` reports it).
    fn list_where(
        &self,
        select: &'static str,
        filter: &ListFilter,
        channel: Option<&str>,
    ) -> Result<Vec<(i64, DeliveryView)>> {
        let mut sql = select.to_owned();
        let limit = filter.limit as i64;
        let status = filter.status.map(DeliveryStatus::as_str);
        let mut values: Vec<&(dyn ToSql + Sync)> = Vec::new();
        if let Some(status) = &status {
            values.push(status);
            // A reply staged by an application's transaction shows as queued.
            sql.push_str(&format!(
                " AND (status = ${} OR (${} = 'queued' AND status = 'new'))",
                values.len(),
                values.len()
            ));
        }
        if filter.unfinished {
            sql.push_str(" AND status <> 'delivered' AND status <> 'cancelled'");
        }
        let channel = channel.or(filter.channel.as_deref());
        if let Some(channel) = &channel {
            values.push(channel);
            sql.push_str(&format!(" AND channel = ${}", values.len()));
        }
        if let Some(chat_id) = &filter.chat_id {
            values.push(chat_id);
            sql.push_str(&format!(" AND chat_id = ${}", values.len()));
        }
        if let Some(key) = &filter.idempotency_key {
            values.push(key);
            sql.push_str(&format!(" AND idempotency_key = ${}", values.len()));
            if channel.is_none() {
                // Found through the index of keys per channel, one channel at a time,
                // not by walking the history: every delivery's channel is registered,
                // but for a reply an application's transaction staged (status `new`).
                sql.push_str(
                    " AND channel IN (SELECT name FROM outbound_channels
                       UNION ALL SELECT channel FROM outbound_deliveries WHERE status = 'new')",
                );
            }
        }
        values.push(&limit);
        sql.push_str(&format!(" ORDER BY id DESC LIMIT ${}", values.len()));
        Ok(self
            .query_dynamic(&sql, &values)?
            .iter()
            .filter_map(|r| delivery_row(r).ok())
            .collect())
    }

    fn health_rows_here(&self, now: i64) -> Result<HealthRows> {
        let mut rows = HealthRows::default();
        let server = self.query_one(REPLICA_SQL, &[])?;
        if server.try_get(0)? {
            rows.replica = Some(crate::views::Replica {
                replay_lag_ms: server
                    .try_get::<_, Option<i64>>(1)?
                    .map(|ms| ms.max(0) as u64),
                replayed_all_received: server.try_get(2)?,
            });
        }
        for r in self.query(STATS_SQL, &[])? {
            let mut latency_le = [0; 6];
            for (i, bucket) in latency_le.iter_mut().enumerate() {
                *bucket = count(&r, 6 + i)?;
            }
            rows.stats.push(StatsRow {
                channel: r.try_get(0)?,
                delivered: count(&r, 1)?,
                last_delivered_at: r.try_get(2)?,
                finalized_total: count(&r, 3)?,
                latency_count: count(&r, 4)?,
                latency_sum_ms: count(&r, 5)?,
                latency_le,
            });
        }
        for r in self.query(OPEN_DELIVERIES_SQL, &[])? {
            rows.deliveries.push(DeliveryGroup {
                channel: r.try_get(0)?,
                status: delivery_status(&r, 1)?,
                unacknowledged: r.try_get(2)?,
                count: count(&r, 3)?,
                oldest_created_at: r.try_get(4)?,
                corrupt: count(&r, 5)?,
            });
        }
        for r in self.query(DEAD_LETTER_COUNTS_SQL, &[])? {
            rows.add_dead_letters(
                r.try_get(0)?,
                count(&r, 1)?,
                count(&r, 2)?,
                count(&r, 3)?,
                count(&r, 4)?,
            );
        }
        for r in self.query(OPEN_CHUNKS_SQL, &[&now])? {
            rows.chunks.push(ChunkGroup {
                channel: r.try_get(0)?,
                status: chunk_status(&r, 1)?,
                count: count(&r, 2)?,
                due_now: count(&r, 3)?,
                oldest_due: r.try_get(4)?,
                scheduled: count(&r, 5)?,
            });
        }
        Ok(rows)
    }
}

fn delivery_row(r: &Row) -> Result<(i64, DeliveryView)> {
    let uid: String = r.try_get(1)?;
    let id: DeliveryId = uid.parse()?;
    let time = |i: usize| -> Result<Option<chrono::DateTime<chrono::Utc>>> {
        Ok(r.try_get::<_, Option<i64>>(i)?.map(to_datetime))
    };
    Ok((
        r.try_get(0)?,
        DeliveryView {
            id,
            channel: r.try_get(2)?,
            chat_id: r.try_get(3)?,
            sender: r.try_get(4)?,
            idempotency_key: r.try_get(5)?,
            status: delivery_status(r, 6)?,
            text: r.try_get(7)?,
            chunk_count: count(r, 8)? as u32,
            delivered_count: count(r, 9)? as u32,
            created_at: to_datetime(r.try_get(10)?),
            updated_at: to_datetime(r.try_get(11)?),
            finished_at: time(12)?,
            acknowledged_at: time(13)?,
            metadata: r.try_get(14)?,
            not_before: time(15)?,
            finalize_error: r.try_get(16)?,
            chunks: Vec::new(),
        },
    ))
}

fn chunk_view(r: &Row, id: &DeliveryId) -> Result<ChunkView> {
    let index = count(r, 1)? as u32;
    let status = chunk_status(r, 2)?;
    let due = r.try_get::<_, Option<i64>>(4)?.map(to_datetime);
    let sending = status == ChunkStatus::Sending;
    Ok(ChunkView {
        id: ChunkId(r.try_get(0)?),
        index,
        status,
        attempts: count(r, 3)? as u32,
        next_attempt_at: if sending { None } else { due },
        lease_until: if sending { due } else { None },
        last_error: r.try_get(5)?,
        platform_message_id: r.try_get(6)?,
        delivered_at: r.try_get::<_, Option<i64>>(7)?.map(to_datetime),
        idempotency_key: chunk_idempotency_key(id, index),
        text: r.try_get(8)?,
        claimant: r.try_get::<_, Option<i64>>(9)?.map(ClaimantId::of_token),
        first_sent_at: r.try_get::<_, Option<i64>>(10)?.map(to_datetime),
        settlement: r.try_get(11)?,
    })
}
