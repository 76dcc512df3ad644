//! Operator actions and retention on PostgreSQL.

use super::chunks::{chunk_ref, chunk_ref_where};
use super::tx::{PgTx, chunk_key, chunk_status, count, delivery_status};
use crate::error::Result;
use crate::store::pg_param;
use crate::store::{
    ChunkProgress, ChunkRef, DeliveryState, OperatorStore, Purgeable, RetentionStore, Unasked,
    finished_sql, purgeable_sql,
};

/// The failed chunks of dead letters (not set aside as unreadable), oldest first; `$1`
/// a channel, or NULL for all.
pub(crate) const DEAD_LETTER_CHUNKS_SQL: &str = chunk_ref_where!(
    "d.status = 'failed' AND d.corrupt IS NULL
       AND ($1::text IS NULL OR d.channel = $1) AND c.status = 'failed'
     ORDER BY d.id, c.chunk_index"
);

/// [`OperatorStore::unasked_uncertain`]: `$1` the channel, `$2` the limit.
pub(crate) const UNASKED_SQL: &str = concat!(
    "SELECT ",
    super::chunk_id!("c.delivery_id", "c.chunk_index"),
    ", c.delivery_id, c.chunk_index, c.status, c.attempts, d.channel, d.chat_id,
            d.created_at, d.chunk_count, d.uid, coalesce(c.text, d.text), d.metadata,
            coalesce(c.first_sent_at, d.created_at), d.updated_at, c.claim_token,
            coalesce(
                (SELECT p.platform_message_id FROM outbound_delivery_chunks p
                 WHERE p.delivery_id = c.delivery_id AND p.chunk_index = c.chunk_index - 1),
                (SELECT l.platform_message_id FROM outbound_deliveries e
                 JOIN outbound_delivery_chunks l
                   ON l.delivery_id = e.id AND l.chunk_index = e.chunk_count - 1
                 WHERE e.id BETWEEN d.id - ",
    crate::store::previous_replies_read!(),
    " AND d.id - 1
                   AND e.channel = d.channel AND e.chat_id = d.chat_id
                   AND e.status = 'delivered'
                   AND e.finished_at <= coalesce(c.first_sent_at, d.created_at)
                   AND l.platform_message_id IS NOT NULL
                 ORDER BY e.id DESC LIMIT 1))
     FROM outbound_delivery_chunks c JOIN outbound_deliveries d ON d.id = c.delivery_id
     WHERE d.status = 'uncertain' AND d.status <> 'delivered' AND d.status <> 'failed'
       AND d.channel = $1
       AND c.status = 'uncertain' AND c.settlement IS NULL
     ORDER BY d.id, c.chunk_index
     LIMIT $2"
);

impl OperatorStore for PgTx<'_> {
    fn unasked_uncertain(&self, channel: &str, limit: usize) -> Result<Vec<Unasked>> {
        let limit = limit as i64;
        self.on_indexes(|| self.query(UNASKED_SQL, &[&channel, &limit]))?
            .iter()
            .map(|r| {
                Ok(Unasked {
                    chunk: chunk_ref(r)?,
                    uid: r.try_get(9)?,
                    text: r.try_get(10)?,
                    metadata: r.try_get(11)?,
                    first_sent_at: r.try_get(12)?,
                    since: r.try_get(13)?,
                    token: r.try_get(14)?,
                    previous_platform_id: r.try_get(15)?,
                })
            })
            .collect()
    }

    fn note_settlement(
        &self,
        chunk: i64,
        since: i64,
        settlement: &str,
        resend_by: Option<i64>,
    ) -> Result<bool> {
        let (delivery, index) = chunk_key(chunk);
        let changed = self.execute(
            "UPDATE outbound_delivery_chunks c SET settlement = $4, resend_by = $5
             FROM outbound_deliveries d
             WHERE c.delivery_id = $1 AND c.chunk_index = $2 AND c.status = 'uncertain'
               AND c.settlement IS NULL AND d.id = c.delivery_id AND d.updated_at = $3",
            &[&delivery, &index, &since, &settlement, &resend_by],
        )?;
        Ok(changed == 1)
    }

    fn append_settlement(&self, chunk: i64, text: &str) -> Result<()> {
        let (delivery, index) = chunk_key(chunk);
        self.execute(
            "UPDATE outbound_delivery_chunks
             SET settlement = CASE WHEN settlement IS NULL THEN $3 ELSE settlement || '; ' || $3 END
             WHERE delivery_id = $1 AND chunk_index = $2",
            &[&delivery, &index, &text],
        )?;
        Ok(())
    }

    fn dead_letter_chunks(&self, channel: Option<&str>) -> Result<Vec<ChunkRef>> {
        self.on_indexes(|| self.query(DEAD_LETTER_CHUNKS_SQL, &[&channel]))?
            .iter()
            .map(chunk_ref)
            .collect()
    }

    fn acknowledge_dead_letters(
        &self,
        channel: Option<&str>,
        now: i64,
    ) -> Result<Vec<(String, String)>> {
        self.query(
            "UPDATE outbound_deliveries SET acknowledged_at = $1
             WHERE status = 'failed' AND acknowledged_at IS NULL
               AND ($2::text IS NULL OR channel = $2)
             RETURNING channel, chat_id",
            &[&now, &channel],
        )?
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect()
    }

    fn chunk_progress(&self, delivery: i64) -> Result<Vec<ChunkProgress>> {
        // Every chunk of the delivery locked, so no claim starts one while the caller
        // decides (a claim skips what is locked; one under way is waited for, and its
        // `sending` seen).
        self.query(
            "SELECT chunk_index, status, attempts, sent_before FROM outbound_delivery_chunks
             WHERE delivery_id = $1 ORDER BY chunk_index FOR UPDATE",
            &[&delivery],
        )?
        .iter()
        .map(|r| {
            let index: i64 = r.try_get(0)?;
            Ok(ChunkProgress {
                id: delivery * crate::ids::CHUNK_STRIDE + index,
                index: index as u32,
                status: chunk_status(r, 1)?,
                attempts: count(r, 2)? as u32,
                sent_before: r.try_get(3)?,
            })
        })
        .collect()
    }

    fn delete_chunks(&self, delivery: i64) -> Result<u64> {
        self.execute(
            "DELETE FROM outbound_delivery_chunks WHERE delivery_id = $1",
            &[&delivery],
        )
    }

    fn mark_cancelled(&self, delivery: i64, now: i64) -> Result<()> {
        self.execute(
            crate::store::mark_cancelled_sql!(pg_param),
            &[&delivery, &now],
        )?;
        Ok(())
    }

    fn held_or_head_chunk(&self, delivery: i64, uid: &str) -> Result<Option<ChunkRef>> {
        self.query_opt(
            chunk_ref_where!(
                "d.id = coalesce((SELECT new_id FROM outbound_renumbered WHERE old_id = $1), $1)
                   AND d.uid = $2
                 ORDER BY c.status IN ('failed', 'uncertain') DESC,
                          c.chunk_index = least(d.delivered_count, d.chunk_count - 1) DESC
                 LIMIT 1"
            ),
            &[&delivery, &uid],
        )?
        .as_ref()
        .map(chunk_ref)
        .transpose()
    }

    fn delivery_state(&self, delivery: i64, uid: &str) -> Result<Option<DeliveryState>> {
        self.query_opt(
            "SELECT status, channel, chat_id, id FROM outbound_deliveries
             WHERE id = coalesce((SELECT new_id FROM outbound_renumbered WHERE old_id = $1), $1)
               AND uid = $2",
            &[&delivery, &uid],
        )?
        .map(|r| {
            Ok((
                r.try_get(3)?,
                delivery_status(&r, 0)?,
                r.try_get(1)?,
                r.try_get(2)?,
            ))
        })
        .transpose()
    }
}

impl RetentionStore for PgTx<'_> {
    fn purgeable(&self, after: i64, cutoff: i64, max: i64) -> Result<Vec<Purgeable>> {
        let rows = self.on_indexes(|| {
            self.query(
                concat!(
                    "SELECT id, channel, status = 'delivered' FROM outbound_deliveries WHERE ",
                    purgeable_sql!("$2"),
                    " AND id > $1 ORDER BY id LIMIT $3"
                ),
                &[&after, &cutoff, &max],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(Purgeable {
                    id: r.try_get(0)?,
                    channel: r.try_get(1)?,
                    delivered: r.try_get(2)?,
                })
            })
            .collect()
    }

    fn delete_delivery(&self, delivery: i64) -> Result<u64> {
        // The purge listed it without a lock: the condition is checked again on the row
        // as it stands (a requeue of an acknowledged dead letter may have won the race).
        self.execute(
            concat!(
                "WITH gone AS (DELETE FROM outbound_deliveries WHERE id = $1 AND ",
                finished_sql!(),
                " RETURNING id),
                 renumbered AS (
                     DELETE FROM outbound_renumbered WHERE new_id = (SELECT id FROM gone))
                 DELETE FROM outbound_delivery_chunks WHERE delivery_id = (SELECT id FROM gone)"
            ),
            &[&delivery],
        )
    }

    fn forget_delivered(&self, channel: &str, count: i64) -> Result<()> {
        self.execute(
            "INSERT INTO outbound_channel_stats AS s (channel, shard, delivered)
             VALUES ($1, pg_backend_pid() % 16, -$2::bigint)
             ON CONFLICT (channel, shard) DO UPDATE SET delivered = s.delivered - $2",
            &[&channel, &count],
        )?;
        Ok(())
    }

    fn tidy_counters(&self, minute: i64) -> Result<()> {
        self.execute(
            "DELETE FROM outbound_activity WHERE minute < $1",
            &[&minute],
        )?;
        // The dead letters' counts of connections that ended, into row 0 (no live
        // connection writes it: a backend's process id is never 0).
        self.execute(
            "WITH gone AS (
                 DELETE FROM outbound_dead_letter_counts c
                 WHERE c.shard <> 0
                   AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = c.shard)
                 RETURNING c.*)
             INSERT INTO outbound_dead_letter_counts AS c
                 (channel, shard, dead_letters, unacknowledged, corrupt, failed_chunks)
             SELECT channel, 0, sum(dead_letters), sum(unacknowledged), sum(corrupt),
                    sum(failed_chunks)
             FROM gone GROUP BY channel
             ON CONFLICT (channel, shard) DO UPDATE
             SET dead_letters = c.dead_letters + excluded.dead_letters,
                 unacknowledged = c.unacknowledged + excluded.unacknowledged,
                 corrupt = c.corrupt + excluded.corrupt,
                 failed_chunks = c.failed_chunks + excluded.failed_chunks",
            &[],
        )?;
        Ok(())
    }

    fn forget_idle_lanes(&self, now: i64) -> Result<()> {
        // Only lanes with nothing unfinished, and none another transaction holds: the
        // row of a lane in use is what its writers lock.
        self.on_indexes(|| {
            self.execute(
                "DELETE FROM outbound_lanes WHERE (channel, chat_id) IN (
                 SELECT l.channel, l.chat_id FROM outbound_lanes l
                 WHERE coalesce(l.paused_until, 0) < $1 AND coalesce(l.next_send_at, 0) < $1
                   AND NOT EXISTS (SELECT 1 FROM outbound_deliveries d
                                   WHERE d.channel = l.channel AND d.chat_id = l.chat_id
                                     AND d.status <> 'delivered'
                                     AND d.status NOT IN ('cancelled', 'failed'))
                 FOR UPDATE SKIP LOCKED)",
                &[&now],
            )
        })?;
        Ok(())
    }

    fn purge_counts(&self, cutoff: i64) -> Result<(u64, u64)> {
        let r = self.on_indexes(|| {
            self.query_one(
                concat!(
                    // A cancelled delivery's chunks are already gone.
                    "SELECT count(*), coalesce(sum(CASE WHEN status = 'cancelled' THEN 0
                                                    ELSE chunk_count END), 0)::bigint
                 FROM outbound_deliveries WHERE $1::bigint IS NOT NULL AND ",
                    purgeable_sql!("$2")
                ),
                &[&0i64, &cutoff],
            )
        })?;
        Ok((count(&r, 0)?, count(&r, 1)?))
    }
}
