//! Retention: purging finished deliveries and checkpointing the WAL.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rusqlite::params;
use serde::Serialize;

use crate::ids::DELETE_CHUNKS_SQL;
use crate::{Outbox, Result};

/// Deliveries purged per transaction, so a large purge never holds the write lock long.
const PURGE_BATCH: i64 = 1000;

/// The deliveries a purge may remove (`?2` the cutoff): finished before it — delivered,
/// cancelled, or dead letters someone acknowledged — and never the newest one.
macro_rules! purgeable {
    () => {
        "finished_at < ?2
         AND (status IN ('delivered', 'cancelled')
              OR (status = 'failed' AND acknowledged_at IS NOT NULL))
         AND id < (SELECT max(id) FROM outbound_deliveries)"
    };
}

/// What [`Outbox::purge`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Deliveries removed.
    pub deliveries: u64,
    /// Chunks removed with them.
    pub chunks: u64,
}

impl Outbox {
    /// Removes deliveries (and their chunks) that finished before `finished_before`:
    /// delivered ones, cancelled ones, and dead letters that were acknowledged. Their
    /// `outbound_messages` rows stay. Unacknowledged dead letters and unfinished deliveries are never purged, nor
    /// is the newest delivery: keeping it means row ids, from which delivery ids are
    /// derived, are never handed out twice.
    ///
    /// The retention window is also the idempotency window: once a delivery is purged,
    /// its caller key may be used again.
    ///
    /// Runs in batches of 1000 deliveries, one transaction each; an error stops it with
    /// the earlier batches committed (each one is complete on its own).
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// for chat in ["1", "2"] {
    ///     outbox.enqueue(&NewDelivery::single("telegram", chat, "hi"))?;
    /// }
    /// for claim in outbox.claim(10)? {
    ///     outbox.record(&claim, Outcome::delivered(None))?;
    /// }
    /// let report = outbox.purge(chrono::Utc::now() + chrono::Duration::seconds(1))?;
    /// assert_eq!(report.deliveries, 1, "the newest delivery is kept");
    /// assert_eq!(outbox.health()?.totals.finalized_total, 2, "totals never drop");
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn purge(&self, finished_before: DateTime<Utc>) -> Result<PurgeReport> {
        self.purge_batches(finished_before)
    }

    /// What [`purge`](Self::purge) with the same cutoff would remove now, without
    /// removing anything (`outbox purge --dry-run`).
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn purge_preview(&self, finished_before: DateTime<Utc>) -> Result<PurgeReport> {
        let cutoff = finished_before.timestamp_millis();
        self.read(|tx| {
            let (deliveries, chunks): (i64, i64) = tx.query_row(
                concat!(
                    // A cancelled delivery's chunks are already gone.
                    "SELECT count(*), coalesce(sum(CASE WHEN status = 'cancelled' THEN 0 ELSE chunk_count END), 0)
                     FROM outbound_deliveries WHERE ",
                    purgeable!()
                ),
                // The condition names the cutoff `?2`, as in the purge itself.
                params![0, cutoff],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            Ok(PurgeReport {
                deliveries: deliveries.max(0) as u64,
                chunks: chunks.max(0) as u64,
            })
        })
    }

    fn purge_batches(&self, finished_before: DateTime<Utc>) -> Result<PurgeReport> {
        let cutoff = finished_before.timestamp_millis();
        let mut report = PurgeReport::default();
        let mut cursor = 0_i64;
        loop {
            let batch = self.write(|tx, _| {
                let mut stmt = tx.prepare_cached(concat!(
                    "SELECT id, channel, status = 'delivered' FROM outbound_deliveries WHERE ",
                    purgeable!(),
                    " AND id > ?1 ORDER BY id LIMIT ?3"
                ))?;
                let rows = stmt
                    .query_map(params![cursor, cutoff, PURGE_BATCH], |r| {
                        Ok((
                            r.get::<_, i64>(0)?,
                            r.get::<_, String>(1)?,
                            r.get::<_, bool>(2)?,
                        ))
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                let mut chunks = 0;
                let mut per_channel: BTreeMap<&str, i64> = BTreeMap::new();
                for (id, channel, delivered) in &rows {
                    chunks += tx.prepare_cached(DELETE_CHUNKS_SQL)?.execute([id])? as u64;
                    tx.prepare_cached("DELETE FROM outbound_deliveries WHERE id = ?1")?
                        .execute([id])?;
                    if *delivered {
                        *per_channel.entry(channel).or_default() += 1;
                    }
                }
                for (channel, delivered) in per_channel {
                    tx.prepare_cached(
                        "UPDATE outbound_channel_stats SET delivered = delivered - ?2
                         WHERE channel = ?1",
                    )?
                    .execute(params![channel, delivered])?;
                }
                if rows.is_empty() {
                    // Lane rows whose pause and interval have both passed say nothing.
                    tx.prepare_cached(
                        "DELETE FROM outbound_lanes
                         WHERE coalesce(paused_until, 0) < ?1 AND coalesce(next_send_at, 0) < ?1",
                    )?
                    .execute([self.options().now_ms()])?;
                }
                Ok((rows.last().map(|r| r.0), rows.len() as u64, chunks))
            })?;
            report.deliveries += batch.1;
            report.chunks += batch.2;
            match batch.0 {
                Some(last) => cursor = last,
                None => return Ok(report),
            }
        }
    }

    /// Copies the WAL back into the database file and truncates it. The outbox already
    /// checkpoints in the background
    /// ([`with_background_checkpoints`](crate::OutboxOptions::with_background_checkpoints));
    /// call this after a large purge or in quiet periods to shrink the `-wal` file.
    ///
    /// # Errors
    ///
    /// Database errors; [`Error::Busy`](crate::Error::Busy) if readers, or a checkpoint
    /// by another process, kept it from completing. (This outbox's own background
    /// checkpoints wait while it runs.)
    pub fn checkpoint(&self) -> Result<()> {
        let _background = self.pause_background_checkpoints();
        let conn = self.writer();
        let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
        if busy != 0 {
            return Err(crate::Error::Busy);
        }
        Ok(())
    }
}
