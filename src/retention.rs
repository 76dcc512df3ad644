//! Retention: purging finished deliveries and checkpointing the WAL.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::error::Result;
use crate::outbox::Outbox;

/// Deliveries purged per transaction, so a large purge never holds the write lock long.
const PURGE_BATCH: i64 = 1000;

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
    /// Removes deliveries (and their chunks) that finished before `finished_before`
    /// (a time on the outbox's clock: [`now`](Self::now) minus the age to keep):
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
    /// let report = outbox.purge(outbox.now() + chrono::Duration::seconds(1))?;
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
        let (deliveries, chunks) = self.read(|tx| tx.purge_counts(cutoff))?;
        Ok(PurgeReport { deliveries, chunks })
    }

    fn purge_batches(&self, finished_before: DateTime<Utc>) -> Result<PurgeReport> {
        let cutoff = finished_before.timestamp_millis();
        let mut report = PurgeReport::default();
        let mut cursor = 0_i64;
        loop {
            // Finished rows change no more (a requeue of an acknowledged dead letter
            // aside, which the condition, checked again by the delete, excludes once
            // done), so a batch is read and removed without a lane lock.
            let batch = self.write(|tx, _| {
                let rows = tx.purgeable(cursor, cutoff, PURGE_BATCH)?;
                let mut chunks = 0;
                let mut per_channel: BTreeMap<&str, i64> = BTreeMap::new();
                for row in &rows {
                    chunks += tx.delete_delivery(row.id)?;
                    if row.delivered {
                        *per_channel.entry(&row.channel).or_default() += 1;
                    }
                }
                for (channel, delivered) in per_channel {
                    tx.forget_delivered(channel, delivered)?;
                }
                if rows.is_empty() {
                    // Lane rows whose pause and interval have both passed say nothing,
                    // and the counts of minutes before the cutoff go with their rows.
                    tx.forget_idle_lanes(self.options().now_ms())?;
                    tx.tidy_counters(crate::finalize::minute_of(cutoff))?;
                }
                Ok((rows.last().map(|r| r.id), rows.len() as u64, chunks))
            })?;
            report.deliveries += batch.1;
            report.chunks += batch.2;
            match batch.0 {
                Some(last) => cursor = last,
                None => return Ok(report),
            }
        }
    }
}
