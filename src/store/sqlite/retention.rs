//! Retention on SQLite: purge batches and their preview.

use rusqlite::params;

use super::chunks::DELETE_CHUNKS_SQL;
use super::tx::Tx;
use crate::error::Result;
use crate::store::{Purgeable, RetentionStore, finished_sql, purgeable_sql};

impl RetentionStore for Tx<'_> {
    fn purgeable(&self, after: i64, cutoff: i64, max: i64) -> Result<Vec<Purgeable>> {
        let mut stmt = self.prepare_cached(concat!(
            "SELECT id, channel, status = 'delivered' FROM outbound_deliveries WHERE ",
            purgeable_sql!("?2"),
            " AND id > ?1 ORDER BY id LIMIT ?3"
        ))?;
        let rows = stmt.query_map(params![after, cutoff, max], |r| {
            Ok(Purgeable {
                id: r.get(0)?,
                channel: r.get(1)?,
                delivered: r.get(2)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn delete_delivery(&self, delivery: i64) -> Result<u64> {
        self.counting(delivery, || {
            let removed = self
                .prepare_cached(concat!(
                    "DELETE FROM outbound_deliveries WHERE id = ?1 AND ",
                    finished_sql!()
                ))?
                .execute([delivery])?;
            if removed == 0 {
                return Ok(0);
            }
            Ok(self
                .prepare_cached(DELETE_CHUNKS_SQL)?
                .execute([delivery])? as u64)
        })
    }

    fn forget_delivered(&self, channel: &str, count: i64) -> Result<()> {
        self.prepare_cached(
            "UPDATE outbound_channel_stats SET delivered = delivered - ?2 WHERE channel = ?1",
        )?
        .execute(params![channel, count])?;
        Ok(())
    }

    fn forget_idle_lanes(&self, now: i64) -> Result<()> {
        self.prepare_cached(
            "DELETE FROM outbound_lanes
             WHERE coalesce(paused_until, 0) < ?1 AND coalesce(next_send_at, 0) < ?1",
        )?
        .execute([now])?;
        Ok(())
    }

    fn tidy_counters(&self, minute: i64) -> Result<()> {
        self.prepare_cached("DELETE FROM outbound_activity WHERE minute < ?1")?
            .execute([minute])?;
        Ok(())
    }

    fn purge_counts(&self, cutoff: i64) -> Result<(u64, u64)> {
        let (deliveries, chunks): (i64, i64) = self.prepare_cached(concat!(
            // A cancelled delivery's chunks are already gone.
            "SELECT count(*), coalesce(sum(CASE WHEN status = 'cancelled' THEN 0 ELSE chunk_count END), 0)
             FROM outbound_deliveries WHERE ",
            purgeable_sql!("?2")
        ))?
        // The condition names the cutoff `?2`, as in the purge itself.
        .query_row(params![0, cutoff], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok((deliveries.max(0) as u64, chunks.max(0) as u64))
    }
}
