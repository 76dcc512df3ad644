//! Chunk rows on SQLite, and the delivery rows their transitions move.

use crate::store::sqlite_param;
use rusqlite::{OptionalExtension, Row, params};

use super::chunks_of_delivery;
use super::dead::Table;
use super::tx::Tx;
use crate::error::Result;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::{ChunkRef, ChunkStore};

/// The one place the chunk row a queued reply does not have yet is supplied: a reply
/// sent as one chunk of its whole text stores that row at its activation (see
/// `DeliveryStore::insert_delivery`), and every reader that must see all chunks of a
/// delivery `d` joins them with `chunks_supplied!(d)` as `c`, keeps a row where
/// `supplied!(seen)`, and reads the columns a missing row lacks through `supplied!`:
/// the chunk is `pending`, index 0, no attempts, its id `d * CHUNK_STRIDE` (given as a
/// parameter).
macro_rules! chunks_supplied {
    ($d:literal) => {
        concat!(
            " LEFT JOIN outbound_delivery_chunks c ON ",
            $crate::store::sqlite::chunks_of_delivery!("c", $d),
            " "
        )
    };
}
pub(crate) use chunks_supplied;

/// The columns of [`chunks_supplied!`]'s chunk, a missing row's included.
macro_rules! supplied {
    (seen) => {
        "(c.id IS NOT NULL OR d.status = 'queued')"
    };
    (id $first:literal) => {
        concat!("coalesce(c.id, ", $first, ")")
    };
    (index) => {
        "coalesce(c.chunk_index, 0)"
    };
    (status) => {
        "coalesce(c.status, 'pending')"
    };
    (attempts) => {
        "coalesce(c.attempts, 0)"
    };
}
pub(crate) use supplied;

/// The query that loads a [`ChunkRef`], followed by a literal condition: SQL built at
/// compile time, so loading a chunk on the hot path formats nothing.
macro_rules! chunk_ref_where {
    ($condition:literal) => {
        concat!(
            "SELECT c.id, c.delivery_id, c.chunk_index, c.status, c.attempts,
                    d.channel, d.chat_id, d.created_at, d.chunk_count
             FROM outbound_delivery_chunks c JOIN outbound_deliveries d
                  ON d.id = c.delivery_id AND ",
            $crate::store::sqlite::chunks_of_delivery!("c", "d.id"),
            " WHERE ",
            $condition
        )
    };
}
pub(crate) use chunk_ref_where;

/// Deletes the chunks of delivery `?1` (a purge, a cancel).
pub(crate) const DELETE_CHUNKS_SQL: &str = concat!(
    "DELETE FROM outbound_delivery_chunks AS c WHERE ",
    chunks_of_delivery!("c", "?1")
);

/// The chunk a claim holds (`?1` its id, `?2` its token): `sending` or — after its
/// lease ran out and nobody else took it — `uncertain` or `retry`. Every other
/// transition clears the token. Comparisons joined by OR, as `status IN (...)` would
/// build a temporary b-tree of the list on every ack.
pub(crate) const CLAIMED_SQL: &str = chunk_ref_where!(
    "c.id = ?1 AND c.claim_token = ?2
     AND (c.status = 'sending' OR c.status = 'uncertain' OR c.status = 'retry')"
);

/// Chunk `?1` as a [`ChunkRef`], the chunk a queued reply has no row for yet included:
/// a key lookup of its delivery and one of the chunk.
pub(crate) const LOAD_CHUNK_SQL: &str = concat!(
    "SELECT ",
    supplied!(id "?1"),
    ", d.id, ",
    supplied!(index),
    ", ",
    supplied!(status),
    ", ",
    supplied!(attempts),
    ", d.channel, d.chat_id, d.created_at, d.chunk_count
     FROM outbound_deliveries d LEFT JOIN outbound_delivery_chunks c ON c.id = ?1
     WHERE d.id = ?1 / ",
    crate::store::chunk_stride!(),
    " AND ",
    supplied!(seen),
    " AND (c.id IS NOT NULL OR ?1 % ",
    crate::store::chunk_stride!(),
    " = 0)"
);

/// A [`ChunkRef`] from a row of [`chunk_ref_where!`].
pub(crate) fn chunk_ref(r: &Row<'_>) -> rusqlite::Result<ChunkRef> {
    Ok(ChunkRef {
        id: r.get(0)?,
        delivery: r.get(1)?,
        index: r.get(2)?,
        status: r.get(3)?,
        attempts: r.get(4)?,
        channel: r.get(5)?,
        chat_id: r.get(6)?,
        created_at: r.get(7)?,
        total: r.get(8)?,
    })
}

impl ChunkStore for Tx<'_> {
    fn load_chunk(&self, id: i64) -> Result<Option<ChunkRef>> {
        Ok(self
            .prepare_cached(LOAD_CHUNK_SQL)?
            .query_row([id], chunk_ref)
            .optional()?)
    }

    fn claimed_chunk(&self, id: i64, token: i64) -> Result<Option<ChunkRef>> {
        Ok(self
            .prepare_cached(CLAIMED_SQL)?
            .query_row(params![id, token], chunk_ref)
            .optional()?)
    }

    fn reschedule(
        &self,
        chunk: i64,
        status: ChunkStatus,
        attempts: u32,
        due: i64,
        error: Option<&str>,
    ) -> Result<()> {
        self.counting_chunk(chunk, || {
            self.prepare_cached(
                "UPDATE outbound_delivery_chunks
                 SET status = ?2, attempts = ?3, due_at = ?4, claim_token = NULL,
                     last_error = coalesce(?5, last_error)
                 WHERE id = ?1",
            )?
            .execute(params![chunk, status.as_str(), attempts, due, error])?;
            Ok(())
        })
    }

    fn set_retry_unscheduled(&self, chunk: i64, attempts: u32, error: Option<&str>) -> Result<()> {
        self.counting_chunk(chunk, || {
            self.prepare_cached(
                "UPDATE outbound_delivery_chunks
                 SET status = 'retry', attempts = ?2, due_at = NULL, claim_token = NULL,
                     last_error = coalesce(?3, last_error)
                 WHERE id = ?1",
            )?
            .execute(params![chunk, attempts, error])?;
            Ok(())
        })
    }

    fn reset_budget(&self, chunk: i64) -> Result<()> {
        self.counting_chunk(chunk, || {
            self.prepare_cached(
                "UPDATE outbound_delivery_chunks
                 SET status = 'retry', attempts = 0, rate_limits = 0, due_at = NULL,
                     claim_token = NULL, sent_before = (sent_before OR attempts > 0),
                     resend_by = NULL
                 WHERE id = ?1",
            )?
            .execute([chunk])?;
            Ok(())
        })
    }

    fn count_rate_limit(&self, chunk: i64) -> Result<u32> {
        Ok(self
            .prepare_cached(
                "UPDATE outbound_delivery_chunks SET rate_limits = rate_limits + 1
                 WHERE id = ?1 RETURNING rate_limits",
            )?
            .query_row([chunk], |r| r.get(0))?)
    }

    fn mark_delivered(
        &self,
        chunk: i64,
        platform_message_id: Option<&str>,
        now: i64,
    ) -> Result<()> {
        self.debug_not_dead(Table::Chunks, chunk)?;
        self.prepare_cached(
            "UPDATE outbound_delivery_chunks
             SET status = 'delivered', due_at = NULL, claim_token = NULL,
                 platform_message_id = ?2, delivered_at = ?3
             WHERE id = ?1",
        )?
        .execute(params![chunk, platform_message_id, now])?;
        Ok(())
    }

    fn count_delivered(
        &self,
        delivery: i64,
        now: i64,
        status: Option<DeliveryStatus>,
    ) -> Result<()> {
        // One write to the delivery row: the count, and its status if it changes.
        self.debug_not_dead(Table::Deliveries, delivery)?;
        self.prepare_cached(crate::store::count_delivered_sql!(sqlite_param))?
            .execute(params![delivery, now, status.map(DeliveryStatus::as_str)])?;
        Ok(())
    }

    fn set_chunk_aside(
        &self,
        chunk: i64,
        status: ChunkStatus,
        error: &str,
        keep_token: bool,
    ) -> Result<()> {
        self.counting_chunk(chunk, || {
            if keep_token {
                self.prepare_cached(
                    "UPDATE outbound_delivery_chunks
                     SET status = ?2, due_at = NULL, last_error = ?3,
                         settlement = CASE WHEN ?2 = 'uncertain' THEN NULL ELSE settlement END
                     WHERE id = ?1",
                )?
                .execute(params![chunk, status.as_str(), error])?;
            } else {
                self.prepare_cached(
                    "UPDATE outbound_delivery_chunks
                     SET status = ?2, due_at = NULL, claim_token = NULL, last_error = ?3,
                         settlement = CASE WHEN ?2 = 'uncertain' THEN NULL ELSE settlement END
                     WHERE id = ?1",
                )?
                .execute(params![chunk, status.as_str(), error])?;
            }
            Ok(())
        })
    }

    fn retry_keeping_token(&self, chunk: i64, due: i64) -> Result<()> {
        self.counting_chunk(chunk, || {
            self.prepare_cached(
                "UPDATE outbound_delivery_chunks SET status = 'retry', due_at = ?2 WHERE id = ?1",
            )?
            .execute(params![chunk, due])?;
            Ok(())
        })
    }

    fn set_delivery_aside(
        &self,
        delivery: i64,
        status: ChunkStatus,
        now: i64,
        finished: Option<i64>,
    ) -> Result<()> {
        self.counting(delivery, || {
            self.prepare_cached(crate::store::set_delivery_aside_sql!(sqlite_param))?
                .execute(params![delivery, status.as_str(), now, finished])?;
            Ok(())
        })
    }

    fn set_corrupt(
        &self,
        chunk: i64,
        delivery: i64,
        reason: &str,
        now: i64,
    ) -> Result<Option<(String, String)>> {
        self.counting(delivery, || {
            self.prepare_cached(
                "UPDATE outbound_delivery_chunks
                 SET status = 'failed', due_at = NULL, claim_token = NULL, last_error = ?2
                 WHERE id = ?1",
            )?
            .execute(params![chunk, reason])?;
            // Read back as bytes: the text may be what cannot be read.
            let lane: Option<(Vec<u8>, Vec<u8>)> = self
                .prepare_cached(
                    "UPDATE outbound_deliveries
                     SET status = 'failed', updated_at = ?2, finished_at = ?2, corrupt = ?3
                     WHERE id = ?1 RETURNING CAST(channel AS BLOB), CAST(chat_id AS BLOB)",
                )?
                .query_row(params![delivery, now, reason], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .optional()?;
            Ok(lane.and_then(|(channel, chat_id)| {
                Some((
                    String::from_utf8(channel).ok()?,
                    String::from_utf8(chat_id).ok()?,
                ))
            }))
        })
    }

    fn delivery_names(&self, delivery: i64) -> Result<Option<(String, String, String)>> {
        Ok(self
            .prepare_cached("SELECT uid, channel, chat_id FROM outbound_deliveries WHERE id = ?1")?
            .query_row([delivery], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .optional()?)
    }
}

#[cfg(test)]
mod tests {
    use crate::ids::CHUNK_STRIDE;
    use crate::store::sqlite::chunks_of_delivery;

    #[test]
    fn the_sql_range_uses_the_chunk_stride() {
        assert_eq!(CHUNK_STRIDE, 16_384);
        assert_eq!(
            chunks_of_delivery!("c", "d.id"),
            "c.id BETWEEN d.id * 16384 AND d.id * 16384 + 16383"
        );
    }
}
