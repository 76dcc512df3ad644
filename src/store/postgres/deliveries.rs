//! New deliveries and finalization on PostgreSQL.

use super::pipeline::owned;
use super::statement::{self, Value};
use super::tx::{PgTx, delivery_status};
use crate::clock::to_datetime;
use crate::error::{Error, Result};
use crate::reply::NewDelivery;
use crate::store::pg_param;
use crate::store::{
    ActivityRow, ChannelTally, DeliveryLane, DeliveryStore, FinalizeStore, LaneRef, NewRow, Staged,
    StatementShape, StoredContent,
};
use postgres::types::ToSql;

/// Copies delivery `$1` into the crate's history, delivered at `$2`, with `$content`
/// as the content.
macro_rules! history_sql {
    ($content:literal) => {
        concat!(
            "INSERT INTO outbound_messages
                 (delivery_id, channel, chat_id, sender, content, chunk_count, created_at, delivered_at)
             SELECT uid, channel, chat_id, sender, ",
            $content,
            ", chunk_count, created_at, $2
             FROM outbound_deliveries WHERE id = $1"
        )
    };
}

pub(crate) const HISTORY_SQL: &str = history_sql!("text");

/// New deliveries (`$1`..`$12`, one array per column) and the chunk rows of those
/// stored (`$13`..`$17`); a delivery whose caller key another row holds is not stored.
/// The rows stored, and the transaction's id.
pub(crate) const INSERT_SQL: &str = "WITH d AS (
         INSERT INTO outbound_deliveries
             (id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
              created_at, updated_at, text, metadata, not_before)
         SELECT id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
                created_at, created_at, text, metadata, not_before
         FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                     $7::text[], $8::bigint[], $9::bigint[], $10::text[], $11::text[],
                     $12::bigint[])
              AS u(id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
                   created_at, text, metadata, not_before)
         ON CONFLICT (channel, idempotency_key) WHERE idempotency_key IS NOT NULL
         DO NOTHING
         RETURNING id),
     c AS (
         INSERT INTO outbound_delivery_chunks
             (delivery_id, chunk_index, status, due_at, text, channel_id)
         SELECT u.d, u.i, 'pending', u.due, u.t, u.ch
         FROM unnest($13::bigint[], $14::bigint[], $15::bigint[], $16::text[], $17::bigint[])
              AS u(d, i, due, t, ch)
         WHERE u.d = ANY (ARRAY(SELECT id FROM d)))
     SELECT array(SELECT id FROM d), txid_current_if_assigned()";

/// The values of [`INSERT_SQL`] for some rows: the deliveries' columns, then their
/// chunk rows' (one entry each).
struct InsertColumns {
    ids: Vec<i64>,
    uids: Vec<String>,
    channels: Vec<String>,
    chats: Vec<String>,
    senders: Vec<Option<String>>,
    keys: Vec<Option<String>>,
    statuses: Vec<&'static str>,
    counts: Vec<i64>,
    created: Vec<i64>,
    texts: Vec<String>,
    metadata: Vec<Option<String>>,
    not_before: Vec<Option<i64>>,
    of: Vec<i64>,
    index: Vec<i64>,
    due: Vec<Option<i64>>,
    chunk_texts: Vec<Option<String>>,
    channel_ids: Vec<i64>,
}

impl InsertColumns {
    fn of(rows: &[NewRow<'_>]) -> Self {
        let n = rows.len();
        let mut c = InsertColumns {
            ids: Vec::with_capacity(n),
            uids: Vec::with_capacity(n),
            channels: Vec::with_capacity(n),
            chats: Vec::with_capacity(n),
            senders: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
            statuses: Vec::with_capacity(n),
            counts: Vec::with_capacity(n),
            created: Vec::with_capacity(n),
            texts: Vec::with_capacity(n),
            metadata: Vec::with_capacity(n),
            not_before: Vec::with_capacity(n),
            of: Vec::new(),
            index: Vec::new(),
            due: Vec::new(),
            chunk_texts: Vec::new(),
            channel_ids: Vec::new(),
        };
        for row in rows {
            let d = row.delivery;
            c.ids.push(row.row);
            c.uids.push(row.uid.to_owned());
            c.channels.push(d.channel.clone());
            c.chats.push(d.chat_id.clone());
            c.senders.push(d.sender.clone());
            c.keys.push(d.idempotency_key.clone());
            c.statuses
                .push(if row.active { "pending" } else { "queued" });
            c.counts.push(d.chunks.len() as i64);
            c.created.push(row.now);
            c.texts.push(d.text.clone());
            c.metadata.push(d.metadata.clone());
            c.not_before.push(d.not_before);
            if row.chunk_rows {
                for (i, text) in d.chunks.iter().enumerate() {
                    c.of.push(row.row);
                    c.index.push(i as i64);
                    c.due.push(if i == 0 { row.head_due } else { None });
                    // A chunk that is the whole text points at the delivery's copy (NULL).
                    c.chunk_texts.push((*text != d.text).then(|| text.clone()));
                    c.channel_ids.push(row.channel_id);
                }
            }
        }
        c
    }

    /// The statement's values, in the order of its parameters.
    fn into_values(self) -> Vec<Box<dyn ToSql + Sync + Send>> {
        vec![
            owned(self.ids),
            owned(self.uids),
            owned(self.channels),
            owned(self.chats),
            owned(self.senders),
            owned(self.keys),
            owned(self.statuses),
            owned(self.counts),
            owned(self.created),
            owned(self.texts),
            owned(self.metadata),
            owned(self.not_before),
            owned(self.of),
            owned(self.index),
            owned(self.due),
            owned(self.chunk_texts),
            owned(self.channel_ids),
        ]
    }
}

/// What a finalization adds to a counter row `s` from the row `$from` (named as the
/// table's columns): the update's and the upsert's one list.
macro_rules! stats_added {
    ($from:literal) => {
        concat!(
            "delivered = s.delivered + ",
            $from,
            ".delivered,
             last_delivered_at = greatest(s.last_delivered_at, ",
            $from,
            ".last_delivered_at),
             finalized_total = s.finalized_total + ",
            $from,
            ".finalized_total,
             latency_count = s.latency_count + ",
            $from,
            ".latency_count,
             latency_sum_ms = s.latency_sum_ms + ",
            $from,
            ".latency_sum_ms,
             latency_le_1s = s.latency_le_1s + ",
            $from,
            ".latency_le_1s,
             latency_le_5s = s.latency_le_5s + ",
            $from,
            ".latency_le_5s,
             latency_le_30s = s.latency_le_30s + ",
            $from,
            ".latency_le_30s,
             latency_le_120s = s.latency_le_120s + ",
            $from,
            ".latency_le_120s,
             latency_le_600s = s.latency_le_600s + ",
            $from,
            ".latency_le_600s,
             latency_le_3600s = s.latency_le_3600s + ",
            $from,
            ".latency_le_3600s"
        )
    };
}

/// Adds finalized replies to channels' counters, each to the row of this connection's
/// shard (see `V3__sharded_stats.sql`): `$rows` gives (channel, latest, count, latency
/// sum, the six buckets), in channel name order. Three common table expressions: the
/// rows (`st`), the update of the shard rows that exist (`su`: a plain update, which
/// stays HOT and writes no row lock of its own) and the insert of those missing
/// (`si`; another connection of the same shard may have inserted one meanwhile, then
/// its row is added to). `si` reads `su`, which makes the update run first: unread, a
/// data-modifying expression runs after those declared later, and the upsert would
/// take every row, lock included.
macro_rules! stats_ctes {
    ($rows:literal) => {
        concat!(
            "st AS (
                 SELECT channel, pg_backend_pid() % 16 AS shard, n AS delivered,
                        latest AS last_delivered_at, n AS finalized_total, n AS latency_count,
                        sum_ms AS latency_sum_ms, le_1s AS latency_le_1s,
                        le_5s AS latency_le_5s, le_30s AS latency_le_30s,
                        le_120s AS latency_le_120s, le_600s AS latency_le_600s,
                        le_3600s AS latency_le_3600s
                 FROM ",
            $rows,
            " AS t(channel, latest, n, sum_ms, le_1s, le_5s, le_30s, le_120s, le_600s,
                    le_3600s)),
             su AS (
                 UPDATE outbound_channel_stats s SET ",
            stats_added!("st"),
            " FROM st WHERE s.channel = st.channel AND s.shard = st.shard
                 RETURNING s.channel),
             si AS (
                 INSERT INTO outbound_channel_stats AS s
                     (channel, shard, delivered, last_delivered_at, finalized_total,
                      latency_count, latency_sum_ms, latency_le_1s, latency_le_5s,
                      latency_le_30s, latency_le_120s, latency_le_600s, latency_le_3600s)
                 SELECT * FROM st WHERE channel NOT IN (SELECT channel FROM su)
                 ON CONFLICT (channel, shard) DO UPDATE SET ",
            stats_added!("excluded"),
            ")"
        )
    };
}

const STATS_SQL: &str = concat!(
    "WITH ",
    stats_ctes!(
        "(VALUES ($1::text, $2::bigint, $3::bigint, $4::bigint,
          $5::bigint, $6::bigint, $7::bigint, $8::bigint, $9::bigint, $10::bigint))"
    ),
    " SELECT 1"
);

/// The last chunks (`$1`, `$2`) delivered at `$4` with platform ids `$3`, their
/// deliveries finalized and copied into the history in the order given, and the
/// channels' counters (`$5`..`$14`, as [`stats_ctes!`] reads them) added to: 1 and the
/// transaction's id, or the statement fails as [`CHECK_FAILED`](super::CHECK_FAILED)
/// says unless it copied every delivery.
pub(crate) const FINALIZE_DELIVERED_SQL: &str = concat!(
    "WITH u AS (
         SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[])
             WITH ORDINALITY AS u(d, i, platform_id, n)),
     c AS (
         UPDATE outbound_delivery_chunks c
         SET status = 'delivered', due_at = NULL, claim_token = NULL,
             platform_message_id = u.platform_id, delivered_at = $4
         FROM u WHERE c.delivery_id = u.d AND c.chunk_index = u.i),
     f AS (
         UPDATE outbound_deliveries d
         SET status = 'delivered', delivered_count = chunk_count, updated_at = $4,
             finished_at = $4, finalize_error = NULL
         FROM u WHERE d.id = u.d
         RETURNING u.n, d.uid, d.channel, d.chat_id, d.sender, d.text, d.chunk_count,
                   d.created_at),
     h AS (
         INSERT INTO outbound_messages
             (delivery_id, channel, chat_id, sender, content, chunk_count, created_at,
              delivered_at)
         SELECT f.uid, f.channel, f.chat_id, f.sender, f.text, f.chunk_count,
                f.created_at, $4
         FROM f ORDER BY f.n
         RETURNING 1),
     ",
    stats_ctes!(
        "unnest($5::text[], $6::bigint[], $7::bigint[], $8::bigint[], $9::bigint[],
        $10::bigint[], $11::bigint[], $12::bigint[], $13::bigint[], $14::bigint[])"
    ),
    "
     SELECT 1 / (count(*) = cardinality($1::bigint[]))::int, txid_current_if_assigned()
     FROM h"
);

/// [`HISTORY_SQL`] with the first character cut off: the planted fault
/// `wrong_finalizations`.
const HISTORY_SQL_CUT: &str = history_sql!("substr(text, 2)");

/// Unfinished deliveries that have chunks, all delivered: each one's chunks counted
/// through the chunk key (an aggregate the planner cannot turn into a join that reads
/// all chunks).
pub(crate) const SWEEP_SQL: &str =
    "SELECT d.id, d.channel, d.chat_id, d.created_at FROM outbound_deliveries d
     CROSS JOIN LATERAL (
         SELECT count(*) AS chunks, count(*) FILTER (WHERE c.status <> 'delivered') AS open
         FROM outbound_delivery_chunks c WHERE c.delivery_id = d.id) n
     WHERE d.status <> 'delivered' AND d.status <> 'failed' AND n.chunks > 0 AND n.open = 0";

/// The columns of a staged reply, as [`staged`] reads them.
macro_rules! staged_select {
    () => {
        "SELECT id, uid, channel, chat_id, sender, idempotency_key, text, new_chunks,
                metadata, not_before
         FROM outbound_deliveries"
    };
}

fn staged(r: &postgres::Row) -> Result<Staged> {
    Ok(Staged {
        row: r.try_get(0)?,
        uid: r.try_get(1)?,
        delivery: NewDelivery {
            channel: r.try_get(2)?,
            chat_id: r.try_get(3)?,
            sender: r.try_get(4)?,
            idempotency_key: r.try_get(5)?,
            text: r.try_get(6)?,
            chunks: r.try_get(7)?,
            metadata: r.try_get(8)?,
            not_before: r.try_get(9)?,
        },
    })
}

impl DeliveryStore for PgTx<'_> {
    fn find_by_key(&self, channel: &str, key: &str) -> Result<Option<(i64, String)>> {
        self.query_opt(
            "SELECT id, uid FROM outbound_deliveries WHERE channel = $1 AND idempotency_key = $2",
            &[&channel, &key],
        )?
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .transpose()
    }

    fn stored_content(&self, delivery: i64) -> Result<StoredContent> {
        let r = self.query_one(
            "SELECT channel, chat_id, sender, text, metadata, status, new_chunks, id
             FROM outbound_deliveries
             WHERE id = coalesce((SELECT new_id FROM outbound_renumbered WHERE old_id = $1), $1)",
            &[&delivery],
        )?;
        let delivery: i64 = r.try_get(7)?;
        let mut content = StoredContent {
            channel: r.try_get(0)?,
            chat_id: r.try_get(1)?,
            sender: r.try_get(2)?,
            text: r.try_get(3)?,
            metadata: r.try_get(4)?,
            status: delivery_status(&r, 5)?,
            chunks: Vec::new(),
        };
        if let Some(staged) = r.try_get::<_, Option<Vec<String>>>(6)? {
            content.chunks = staged.into_iter().map(Some).collect();
            return Ok(content);
        }
        content.chunks = self
            .query(
                "SELECT c.text FROM outbound_deliveries d
                      LEFT JOIN outbound_delivery_chunks c ON c.delivery_id = d.id
                 WHERE d.id = $1 AND (c.delivery_id IS NOT NULL OR d.status = 'queued')
                 ORDER BY c.chunk_index",
                &[&delivery],
            )?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<std::result::Result<_, _>>()?;
        Ok(content)
    }

    fn next_delivery_row(&self) -> Result<i64> {
        // Drawn under the lanes the enqueue holds: in commit order within each lane.
        Ok(self
            .query_one("SELECT nextval('outbound_deliveries_id_seq')", &[])?
            .try_get(0)?)
    }

    fn insert_delivery(&self, row: &NewRow<'_>) -> Result<bool> {
        Ok(self.insert_deliveries(std::slice::from_ref(row))? == [true])
    }

    fn insert_deliveries(&self, rows: &[NewRow<'_>]) -> Result<Vec<bool>> {
        // (A row its caller key keeps out makes this an announcement too many, not one
        // too few.)
        if rows.iter().any(|r| r.active) {
            self.made_due.set(true);
        }
        let columns = InsertColumns::of(rows);
        if rows.iter().all(|r| r.delivery.idempotency_key.is_none()) {
            // Only a caller key can make the insert leave a row out: without one, each
            // row is stored or the statement fails. Its answer unread, it is sent with
            // the transaction's next statement (or its COMMIT, which a failure makes a
            // rollback).
            self.defer(INSERT_SQL, columns.into_values(), Some(1))?;
            return Ok(vec![true; rows.len()]);
        }
        let ids = columns.ids.clone();
        let values = columns.into_values();
        let params: Vec<&(dyn ToSql + Sync)> =
            values.iter().map(|v| &**v as &(dyn ToSql + Sync)).collect();
        let r = self.query_one(INSERT_SQL, &params)?;
        self.note_xid(&r, 1)?;
        // The key's lock does not cover an application's transaction that staged a
        // reply with the same key (it takes no lock of ours): its row decides.
        let stored: std::collections::HashSet<i64> =
            r.try_get::<_, Vec<i64>>(0)?.into_iter().collect();
        Ok(ids.iter().map(|id| stored.contains(id)).collect())
    }

    fn next_delivery_row_in(&self, lane: LaneRef<'_>) -> Result<(i64, bool)> {
        // One round trip: the row, and whether staged replies of the lane go first.
        let r = self.query_one(
            "SELECT nextval('outbound_deliveries_id_seq'), EXISTS (
                 SELECT 1 FROM outbound_deliveries
                 WHERE channel = $1 AND chat_id = $2 AND status = 'new')",
            &[&lane.channel, &lane.chat_id],
        )?;
        Ok((r.try_get(0)?, r.try_get(1)?))
    }

    fn staged(&self, limit: i64) -> Result<Vec<Staged>> {
        self.query(
            concat!(
                staged_select!(),
                " WHERE status = 'new' ORDER BY staged_order NULLS FIRST, id LIMIT $1"
            ),
            &[&limit],
        )?
        .iter()
        .map(staged)
        .collect()
    }

    fn staged_in_lane(&self, lane: LaneRef<'_>) -> Result<Vec<Staged>> {
        self.query(
            concat!(
                staged_select!(),
                " WHERE channel = $1 AND chat_id = $2 AND status = 'new'
                 ORDER BY staged_order NULLS FIRST, id"
            ),
            &[&lane.channel, &lane.chat_id],
        )?
        .iter()
        .map(staged)
        .collect()
    }

    fn take_staged(&self, row: i64) -> Result<bool> {
        Ok(self.execute(
            "DELETE FROM outbound_deliveries WHERE id = $1 AND status = 'new'",
            &[&row],
        )? == 1)
    }

    fn note_renumbered(&self, old: i64, new: i64) -> Result<()> {
        self.execute(
            "INSERT INTO outbound_renumbered (old_id, new_id) VALUES ($1, $2)",
            &[&old, &new],
        )?;
        Ok(())
    }
}

impl FinalizeStore for PgTx<'_> {
    fn write_history(&self, delivery: i64, now: i64) -> Result<bool> {
        let sql = if crate::sabotage::planted("wrong_finalizations") {
            HISTORY_SQL_CUT
        } else {
            HISTORY_SQL
        };
        Ok(self.execute(sql, &[&delivery, &now])? == 1)
    }

    fn describe_statement(&self, sql: &str) -> Result<std::result::Result<StatementShape, String>> {
        statement::describe(self, sql)
    }

    fn run_statement(&self, sql: &str, delivery: i64, now: i64) -> Result<()> {
        let r = self.query_one(
            "SELECT uid, channel, chat_id, sender, text, chunk_count, created_at, metadata,
                    array(SELECT platform_message_id FROM outbound_delivery_chunks
                          WHERE delivery_id = $1 ORDER BY chunk_index)
             FROM outbound_deliveries WHERE id = $1",
            &[&delivery],
        )?;
        let ids: Vec<Option<String>> = r.try_get(8)?;
        let text = |i: usize| -> Result<Value> {
            Ok(r.try_get::<_, Option<String>>(i)?
                .map_or(Value::Null, Value::Text))
        };
        // In the order of FINALIZE_PARAMETERS.
        let values = [
            text(0)?,
            text(1)?,
            text(2)?,
            text(3)?,
            text(4)?,
            Value::Int(r.try_get(5)?),
            Value::Int(r.try_get(6)?),
            Value::Int(now),
            Value::Text(
                to_datetime(now)
                    .format("%Y-%m-%dT%H:%M:%S%.3fZ")
                    .to_string(),
            ),
            Value::Text(
                serde_json::to_string(&ids)
                    .map_err(|e| Error::invalid("platform message ids", e.to_string()))?,
            ),
            text(7)?,
        ];
        statement::run(self, sql, &values)
    }

    fn refusal(&self, error: Error) -> Result<String> {
        statement::refusal(error)
    }

    fn mark_finalized(&self, delivery: i64, now: i64) -> Result<()> {
        self.execute(
            crate::store::mark_finalized_sql!(pg_param),
            &[&delivery, &now],
        )?;
        Ok(())
    }

    fn mark_unfinalized(&self, delivery: i64, now: i64, message: &str) -> Result<()> {
        self.execute(
            crate::store::mark_unfinalized_sql!(pg_param),
            &[&delivery, &now, &message],
        )?;
        Ok(())
    }

    fn add_channel_stats(&self, t: &ChannelTally<'_>) -> Result<()> {
        let le = &t.latency_le;
        self.execute(
            STATS_SQL,
            &[
                &t.channel,
                &t.latest,
                &t.count,
                &t.latency_sum_ms,
                &le[0],
                &le[1],
                &le[2],
                &le[3],
                &le[4],
                &le[5],
            ],
        )?;
        Ok(())
    }

    fn add_activity(&self, m: &ActivityRow) -> Result<()> {
        // Written just before the COMMIT (`PgTx::commit_or_lose`).
        self.activity.borrow_mut().push(*m);
        Ok(())
    }

    fn finished_unfinalized(&self) -> Result<Vec<(DeliveryLane, i64)>> {
        self.on_indexes(|| self.query(SWEEP_SQL, &[]))?
            .iter()
            .map(|r| {
                Ok((
                    DeliveryLane {
                        id: r.try_get(0)?,
                        channel: r.try_get(1)?,
                        chat_id: r.try_get(2)?,
                    },
                    r.try_get(3)?,
                ))
            })
            .collect()
    }

    fn created_at(&self, delivery: i64) -> Result<i64> {
        Ok(self
            .query_one(
                "SELECT created_at FROM outbound_deliveries WHERE id = $1",
                &[&delivery],
            )?
            .try_get(0)?)
    }
}
