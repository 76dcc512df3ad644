//! The dead letters' counts on SQLite (`outbound_dead_letter_counts`), kept by the
//! statements that change what they count, in their transaction.
//!
//! Until schema version 12 triggers kept them; a trigger made every claim,
//! acknowledgement and activation run with a statement journal and the trigger's frame,
//! for counts that move only when a reply fails, is requeued, dismissed, set aside or
//! purged (see `migrations/sqlite/0012_counted_by_the_writer.sql`). Each primitive that
//! can make or unmake a dead letter or a failed part runs inside [`Tx::counting`], which
//! reads what the delivery's rows add to their channels' counts before and after it and
//! adds the difference. The hot path's primitives (an enqueue's inserts, a claim, an
//! acknowledgement, a finalization, an activation) never change a failed row; in debug
//! builds [`Tx::debug_not_dead`] checks that each of them finds none.

use rusqlite::params;
use rusqlite::types::{ToSqlOutput, ValueRef};

use super::chunks_of_delivery;
use super::tx::Tx;
use crate::error::Result;
use crate::ids::CHUNK_STRIDE;

/// The table of a row [`Tx::debug_not_dead`] checks.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Table {
    Deliveries,
    Chunks,
}

/// What a delivery's rows add to their channels' counts: per channel name (raw bytes: a
/// row set aside as unreadable may not be UTF-8), dead letters, unacknowledged ones,
/// unreadable ones, failed parts.
type Part = Vec<(Vec<u8>, [i64; 4])>;

impl Tx<'_> {
    /// Runs `write`, which changes delivery row `delivery` or its parts, and moves the
    /// dead letters' counts by what it changed.
    pub(crate) fn counting<T>(
        &self,
        delivery: i64,
        write: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let before = self.dead_part(delivery)?;
        let done = write()?;
        let after = self.dead_part(delivery)?;
        // The planted fault the torture's verdict `dead_letters_miscounted` catches: a
        // dead letter counted once more by every write that leaves it dead, so the
        // counts stay wrong whether it is then acknowledged, requeued or purged.
        if crate::sabotage::planted("dead_letters_miscounted") {
            for (channel, counts) in &after {
                self.add_dead(channel, *counts)?;
            }
        }
        for (channel, counts) in &before {
            self.add_dead(channel, counts.map(|n| -n))?;
        }
        for (channel, counts) in &after {
            self.add_dead(channel, *counts)?;
        }
        Ok(done)
    }

    /// [`counting`](Self::counting) for a write to part `chunk` (and its delivery).
    pub(crate) fn counting_chunk<T>(
        &self,
        chunk: i64,
        write: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        self.counting(chunk.div_euclid(CHUNK_STRIDE), write)
    }

    fn dead_part(&self, delivery: i64) -> Result<Part> {
        let mut part: Part = self
            .prepare_cached(
                "SELECT CAST(channel AS BLOB), 1, acknowledged_at IS NULL, corrupt IS NOT NULL
                 FROM outbound_deliveries WHERE id = ?1 AND status = 'failed'",
            )?
            .query_map([delivery], |r| {
                Ok((r.get(0)?, [1, r.get(2)?, r.get(3)?, 0]))
            })?
            .collect::<rusqlite::Result<_>>()?;
        let mut failed = self.prepare_cached(concat!(
            "SELECT CAST(ch.name AS BLOB), count(*)
             FROM outbound_delivery_chunks c JOIN outbound_channels ch ON ch.id = c.channel_id
             WHERE ",
            chunks_of_delivery!("c", "?1"),
            " AND c.status = 'failed' GROUP BY ch.name"
        ))?;
        let rows = failed.query_map([delivery], |r| Ok((r.get::<_, Vec<u8>>(0)?, r.get(1)?)))?;
        for row in rows {
            let (channel, chunks) = row?;
            part.push((channel, [0, 0, 0, chunks]));
        }
        Ok(part)
    }

    /// Adds `[dead letters, unacknowledged, unreadable, failed parts]` to the counts of
    /// `channel`.
    pub(crate) fn add_dead(&self, channel: &[u8], counts: [i64; 4]) -> Result<()> {
        if counts == [0; 4] {
            return Ok(());
        }
        let [dead, unacked, corrupt, chunks] = counts;
        self.prepare_cached(
            "INSERT INTO outbound_dead_letter_counts
                 (channel, dead_letters, unacknowledged, corrupt, failed_chunks)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (channel) DO UPDATE
             SET dead_letters = dead_letters + excluded.dead_letters,
                 unacknowledged = unacknowledged + excluded.unacknowledged,
                 corrupt = corrupt + excluded.corrupt,
                 failed_chunks = failed_chunks + excluded.failed_chunks",
        )?
        .execute(params![
            ToSqlOutput::Borrowed(ValueRef::Text(channel)),
            dead,
            unacked,
            corrupt,
            chunks
        ])?;
        Ok(())
    }

    /// In debug builds, that row `id` of `table` is not failed: a primitive of the hot
    /// path, which does not count, is about to change its status.
    pub(crate) fn debug_not_dead(&self, table: Table, id: i64) -> Result<()> {
        if cfg!(debug_assertions) {
            let sql = match table {
                Table::Deliveries => {
                    "SELECT count(*) FROM outbound_deliveries WHERE id = ?1 AND status = 'failed'"
                }
                Table::Chunks => {
                    "SELECT count(*) FROM outbound_delivery_chunks
                     WHERE id = ?1 AND status = 'failed'"
                }
            };
            let failed: bool = self.prepare_cached(sql)?.query_row([id], |r| r.get(0))?;
            debug_assert!(
                !failed,
                "{table:?} row {id} is failed but changed uncounted"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tx::Tx;
    use crate::ids::CHUNK_STRIDE;
    use crate::store::{ChunkStore, FinalizeStore};
    use crate::{NewDelivery, Outbox, OutboxOptions};

    /// A dead letter and its failed part, on a fresh outbox: the delivery's row number.
    fn dead_letter(ob: &Outbox) -> i64 {
        ob.enqueue(&NewDelivery::single("t", "gone", "x")).unwrap();
        let claim = ob.claim(1).unwrap().pop().unwrap();
        ob.record_error_text(&claim, "Forbidden: bot was blocked by the user")
            .unwrap();
        claim.chunk_id.0 / CHUNK_STRIDE
    }

    /// In a debug build the hot path's writes, which do not count, stop at a dead
    /// letter's rows: a change they made there would leave the counts wrong.
    #[test]
    #[cfg(debug_assertions)]
    fn the_hot_path_stops_at_a_dead_letter_in_debug_builds() {
        let ob = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
        let delivery = dead_letter(&ob);
        let conn = ob.sqlite("test").unwrap().writer();
        for write in [
            &(|tx: &Tx<'_>| tx.mark_delivered(delivery * CHUNK_STRIDE, None, 0))
                as &dyn Fn(&Tx<'_>) -> crate::Result<()>,
            &|tx: &Tx<'_>| tx.mark_finalized(delivery, 0),
        ] {
            let tx = Tx::new(&conn);
            let stopped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| write(&tx)));
            assert!(stopped.is_err(), "a write to a dead letter went through");
        }
        drop(conn);
        // Nothing was changed: still one dead letter with its failed part.
        let totals = ob.health().unwrap().totals;
        assert_eq!(
            (totals.failed_deliveries, totals.failed_chunks),
            (1, 1),
            "{totals:?}"
        );
    }
}
