//! Operator actions on SQLite.

use crate::store::sqlite_param;
use rusqlite::{OptionalExtension, params};

use super::chunks::{DELETE_CHUNKS_SQL, chunk_ref, chunk_ref_where};
use super::chunks_of_delivery;
use super::tx::Tx;
use crate::error::Result;
use crate::store::{ChunkProgress, ChunkRef, DeliveryState, OperatorStore, Unasked};

/// The failed chunks of dead letters, oldest delivery first. Starts from the index of
/// unfinished deliveries (a join led by the chunk table would read all of history).
/// `?1` is a channel, or NULL for all.
pub(crate) const DEAD_LETTER_CHUNKS_SQL: &str = chunk_ref_where!(
    "d.id IN (SELECT id FROM outbound_deliveries WHERE status = 'failed'
               AND corrupt IS NULL AND (?1 IS NULL OR channel = ?1))
     AND c.status = 'failed'
     ORDER BY d.id"
);

/// [`OperatorStore::unasked_uncertain`]: the channel's uncertain deliveries from their
/// own index, each one's chunks by the chunk key. `?1` the channel, `?2` the limit.
pub(crate) const UNASKED_SQL: &str = concat!(
    "SELECT c.id, c.delivery_id, c.chunk_index, c.status, c.attempts,
        d.channel, d.chat_id, d.created_at, d.chunk_count, d.uid, coalesce(c.text, d.text),
        d.metadata, coalesce(c.first_sent_at, d.created_at), d.updated_at, c.claim_token,
        coalesce(
            (SELECT p.platform_message_id FROM outbound_delivery_chunks p
             WHERE p.id = c.id - 1 AND c.chunk_index > 0),
            (SELECT l.platform_message_id FROM outbound_deliveries e
             JOIN outbound_delivery_chunks l ON l.id = e.id * ",
    crate::store::chunk_stride!(),
    " + e.chunk_count - 1
             WHERE e.id BETWEEN d.id - ",
    crate::store::previous_replies_read!(),
    " AND d.id - 1
               AND e.channel = d.channel AND e.chat_id = d.chat_id AND e.status = 'delivered'
               AND e.finished_at <= coalesce(c.first_sent_at, d.created_at)
               AND l.platform_message_id IS NOT NULL
             ORDER BY e.id DESC LIMIT 1))
     FROM outbound_deliveries d JOIN outbound_delivery_chunks c ON ",
    chunks_of_delivery!("c", "d.id"),
    " WHERE d.id IN (SELECT id FROM outbound_deliveries WHERE status = 'uncertain' AND channel = ?1)
       AND c.status = 'uncertain' AND c.settlement IS NULL
     ORDER BY c.id
     LIMIT ?2"
);

impl OperatorStore for Tx<'_> {
    fn unasked_uncertain(&self, channel: &str, limit: usize) -> Result<Vec<Unasked>> {
        let mut stmt = self.prepare_cached(UNASKED_SQL)?;
        let rows = stmt.query_map(params![channel, limit as i64], |r| {
            Ok(Unasked {
                chunk: chunk_ref(r)?,
                uid: r.get(9)?,
                text: r.get(10)?,
                metadata: r.get(11)?,
                first_sent_at: r.get(12)?,
                since: r.get(13)?,
                token: r.get(14)?,
                previous_platform_id: r.get(15)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn note_settlement(
        &self,
        chunk: i64,
        since: i64,
        settlement: &str,
        resend_by: Option<i64>,
    ) -> Result<bool> {
        let changed = self
            .prepare_cached(
                "UPDATE outbound_delivery_chunks SET settlement = ?3, resend_by = ?4
                 WHERE id = ?1 AND status = 'uncertain' AND settlement IS NULL
                   AND (SELECT updated_at FROM outbound_deliveries WHERE id = delivery_id) = ?2",
            )?
            .execute(params![chunk, since, settlement, resend_by])?;
        Ok(changed == 1)
    }

    fn append_settlement(&self, chunk: i64, text: &str) -> Result<()> {
        self.prepare_cached(
            "UPDATE outbound_delivery_chunks
             SET settlement = CASE WHEN settlement IS NULL THEN ?2 ELSE settlement || '; ' || ?2 END
             WHERE id = ?1",
        )?
        .execute(params![chunk, text])?;
        Ok(())
    }

    fn dead_letter_chunks(&self, channel: Option<&str>) -> Result<Vec<ChunkRef>> {
        let mut stmt = self.prepare_cached(DEAD_LETTER_CHUNKS_SQL)?;
        let rows = stmt.query_map([channel], chunk_ref)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn acknowledge_dead_letters(
        &self,
        channel: Option<&str>,
        now: i64,
    ) -> Result<Vec<(String, String)>> {
        let mut stmt = self.prepare_cached(
            "UPDATE outbound_deliveries SET acknowledged_at = ?1
             WHERE status = 'failed' AND acknowledged_at IS NULL
               AND (?2 IS NULL OR channel = ?2)
             RETURNING channel, chat_id",
        )?;
        let rows = stmt.query_map(params![now, channel], |r| Ok((r.get(0)?, r.get(1)?)))?;
        let lanes: Vec<(String, String)> = rows.collect::<rusqlite::Result<_>>()?;
        // Each one acknowledged is one fewer unacknowledged dead letter of its channel.
        let mut channels: Vec<&str> = lanes.iter().map(|(channel, _)| channel.as_str()).collect();
        channels.sort_unstable();
        for run in channels.chunk_by(|a, b| a == b) {
            self.add_dead(run[0].as_bytes(), [0, -(run.len() as i64), 0, 0])?;
        }
        Ok(lanes)
    }

    fn chunk_progress(&self, delivery: i64) -> Result<Vec<ChunkProgress>> {
        // The writer's lock holds every chunk until the transaction ends.
        let mut stmt = self.prepare_cached(concat!(
            "SELECT id, chunk_index, status, attempts, sent_before
             FROM outbound_delivery_chunks AS c WHERE ",
            chunks_of_delivery!("c", "?1"),
            " ORDER BY id"
        ))?;
        let rows = stmt.query_map([delivery], |r| {
            Ok(ChunkProgress {
                id: r.get(0)?,
                index: r.get(1)?,
                status: r.get(2)?,
                attempts: r.get(3)?,
                sent_before: r.get(4)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn delete_chunks(&self, delivery: i64) -> Result<u64> {
        self.counting(delivery, || {
            Ok(self
                .prepare_cached(DELETE_CHUNKS_SQL)?
                .execute([delivery])? as u64)
        })
    }

    fn mark_cancelled(&self, delivery: i64, now: i64) -> Result<()> {
        self.counting(delivery, || {
            self.prepare_cached(crate::store::mark_cancelled_sql!(sqlite_param))?
                .execute(params![delivery, now])?;
            Ok(())
        })
    }

    fn held_or_head_chunk(&self, delivery: i64, uid: &str) -> Result<Option<ChunkRef>> {
        Ok(self
            .prepare_cached(chunk_ref_where!(
                "d.id = ?1 AND d.uid = ?2
                 ORDER BY c.status IN ('failed', 'uncertain') DESC,
                          c.chunk_index = min(d.delivered_count, d.chunk_count - 1) DESC
                 LIMIT 1"
            ))?
            .query_row(params![delivery, uid], chunk_ref)
            .optional()?)
    }

    fn delivery_state(&self, delivery: i64, uid: &str) -> Result<Option<DeliveryState>> {
        Ok(self
            .prepare_cached(
                "SELECT status, channel, chat_id FROM outbound_deliveries WHERE id = ?1 AND uid = ?2",
            )?
            .query_row(params![delivery, uid], |r| {
                Ok((delivery, r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .optional()?)
    }
}
