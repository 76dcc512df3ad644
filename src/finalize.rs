//! Exactly-once finalization of a delivery into `outbound_messages`.

use crate::error::{Error, Result};
use crate::lane;
use crate::rules::Stored;
use crate::store::{ActivityRow, ChannelTally, LaneRef, StoreTx};

use crate::rules::{FINALIZE_PARAMETERS, parameter_index};

/// Checks an application's finalization statement against the schema of the store:
/// one statement that writes, every parameter one of [`FINALIZE_PARAMETERS`] by name.
pub(crate) fn validate_statement(tx: &dyn StoreTx, sql: &str) -> Result<()> {
    let invalid = |reason: String| Error::invalid("finalization statement", reason);
    let shape = tx.describe_statement(sql)?.map_err(invalid)?;
    if shape.read_only {
        return Err(invalid(
            "it does not write anything; give an INSERT (or another statement that writes)".into(),
        ));
    }
    if shape.returns_rows {
        return Err(invalid(
            "it returns rows (RETURNING); give a statement that only writes".into(),
        ));
    }
    for (i, name) in shape.parameters.iter().enumerate() {
        match name {
            Some(name) if parameter_index(name).is_some() => {}
            Some(name) => {
                return Err(invalid(format!(
                    "parameter {name} is not one of :{}",
                    FINALIZE_PARAMETERS.join(", :")
                )));
            }
            None => {
                return Err(invalid(format!(
                    "parameter {} has no name; values are bound by name (:{})",
                    i + 1,
                    FINALIZE_PARAMETERS.join(", :")
                )));
            }
        }
    }
    Ok(())
}

/// Writes a fully delivered delivery to `outbound_messages` — and runs the application's
/// finalization statement, if the file stores one — and marks it delivered, in the
/// caller's transaction (the one that recorded its last ack), which holds its lane.
/// `outbound_messages.delivery_id` is UNIQUE and written first, so a second
/// finalization fails before it reaches the application's table, whatever that
/// table's own constraints.
///
/// When the application's statement refuses the reply (its table already holds the
/// id, a CHECK or trigger of its own refuses the row), that reply alone is set aside:
/// nothing of its finalization is written, it becomes `unfinalized` with the
/// statement's message, its lane moves on, and the caller's transaction goes on with
/// whatever else it records; the result is that message. Only errors of the database
/// itself (busy, full, I/O) fail the transaction.
pub(crate) fn finalize(
    tx: &dyn StoreTx,
    rules: &Stored,
    delivery: i64,
    lane: LaneRef<'_>,
    (created_at, now): (i64, i64),
    tally: &mut Tally,
) -> Result<Option<String>> {
    match &rules.finalize_sql {
        None => write_history(tx, delivery, now)?,
        Some(sql) => {
            tx.begin_nested()?;
            let written = write_history(tx, delivery, now)
                .and_then(|()| tx.run_statement(sql, delivery, now));
            match written {
                Ok(()) => tx.end_nested(true)?,
                // A trigger's RAISE(ROLLBACK) ended the whole transaction: nothing is
                // left to contain the error in.
                Err(e) if !tx.in_transaction() => return Err(e),
                Err(e) => {
                    tx.end_nested(false)?;
                    let message = match e {
                        // A statement stored by hand with a parameter that is not ours.
                        Error::InvalidInput { what, reason } => format!("{what}: {reason}"),
                        e => tx.refusal(e)?,
                    };
                    tracing::warn!(
                        delivery,
                        error = message,
                        "the application's finalization statement refused a reply; it stays unfinalized"
                    );
                    // Every chunk reached the chat: its lane moves on.
                    tx.mark_unfinalized(delivery, now, &message)?;
                    lane::advance(tx, &rules.policy, lane, now)?;
                    return Ok(Some(message));
                }
            }
        }
    }
    tx.mark_finalized(delivery, now)?;
    tally.add(lane.channel, now, (now - created_at).max(0));
    lane::advance(tx, &rules.policy, lane, now)?;
    Ok(None)
}

/// Copies delivery `delivery` into the crate's history (see
/// [`FinalizeStore::write_history`](crate::store::FinalizeStore::write_history)).
fn write_history(tx: &dyn StoreTx, delivery: i64, now: i64) -> Result<()> {
    if crate::sabotage::planted("missing_finalizations") {
        return Ok(());
    }
    if !tx.write_history(delivery, now)? {
        return Err(Error::invalid(
            "delivery",
            format!("row {delivery} to finalize is not stored"),
        ));
    }
    Ok(())
}

/// The finalizations of one transaction, per channel, for `outbound_channel_stats`:
/// written once per channel when the transaction's work is done ([`Tally::write`])
/// rather than once per reply — a batch of 64 acks updates the row once.
#[derive(Default)]
pub(crate) struct Tally {
    /// Channel → (replies, latest finalization, latencies in ms).
    channels: Vec<(String, i64, Vec<i64>)>,
}

impl Tally {
    pub(crate) fn add(&mut self, channel: &str, now: i64, latency_ms: i64) {
        match self.channels.iter_mut().find(|(c, ..)| c == channel) {
            Some((_, at, latencies)) => {
                *at = (*at).max(now);
                latencies.push(latency_ms);
            }
            None => self
                .channels
                .push((channel.to_owned(), now, vec![latency_ms])),
        }
    }

    /// Adds the tally to the stored count and to the totals that only grow: finalized
    /// replies and their enqueue-to-finalization latency (buckets as in
    /// `health::LATENCY_BUCKETS`).
    ///
    /// The channels' rows are written in name order: a store with concurrent writers
    /// locks each row until the transaction ends, and two transactions that finalize
    /// replies of the same channels must not wait for each other in a circle.
    pub(crate) fn write(mut self, tx: &dyn StoreTx) -> Result<()> {
        for tally in self.channel_tallies() {
            tx.add_channel_stats(&tally)?;
        }
        self.write_activity(tx)
    }

    /// Adds the tally's replies to the count of the minute they finished in (the
    /// console's charts), if there are any.
    pub(crate) fn write_activity(&self, tx: &dyn StoreTx) -> Result<()> {
        let latencies = self.channels.iter().flat_map(|(_, _, l)| l);
        let Some(latest) = self.channels.iter().map(|(_, at, _)| *at).max() else {
            return Ok(());
        };
        tx.add_activity(&ActivityRow {
            bucket: minute_of(latest),
            delivered: latencies.clone().count() as i64,
            failed: 0,
            latency_sum_ms: latencies.clone().sum(),
            latency_max_ms: latencies.max().copied().unwrap_or(0),
        })
    }

    /// What [`write`](Self::write) adds to each channel's counters, in name order.
    pub(crate) fn channel_tallies(&mut self) -> Vec<ChannelTally<'_>> {
        self.channels.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        self.channels
            .iter()
            .map(|(channel, latest, latencies)| {
                let le =
                    |limit_ms: i64| latencies.iter().filter(|l| **l <= limit_ms).count() as i64;
                ChannelTally {
                    channel,
                    latest: *latest,
                    count: latencies.len() as i64,
                    latency_sum_ms: latencies.iter().sum(),
                    latency_le: [
                        le(1_000),
                        le(5_000),
                        le(30_000),
                        le(120_000),
                        le(600_000),
                        le(3_600_000),
                    ],
                }
            })
            .collect()
    }
}

/// The minute `ms` falls in: its start in ms, divided by 60,000.
pub(crate) fn minute_of(ms: i64) -> i64 {
    ms.div_euclid(MINUTE_MS)
}

/// A minute, in ms.
pub(crate) const MINUTE_MS: i64 = 60_000;

/// Counts a dead letter made at `now` in the minute it failed in.
pub(crate) fn count_failed(tx: &dyn StoreTx, now: i64) -> Result<()> {
    tx.add_activity(&ActivityRow {
        bucket: minute_of(now),
        delivered: 0,
        failed: 1,
        latency_sum_ms: 0,
        latency_max_ms: 0,
    })
}

/// Finalizes unfinished deliveries whose chunks are all delivered: what a crash in a
/// path that recorded chunk acks separately from finalization (an older outbox, a
/// manual repair) leaves behind, and `unfinalized` replies, whose statement refused
/// them before (one refused again stays so). Reads only unfinished deliveries, never
/// history. Returns how many it finalized.
pub(crate) fn sweep(tx: &dyn StoreTx, rules: &Stored, now: i64) -> Result<u64> {
    let listed = tx.finished_unfinalized()?;
    if listed.is_empty() {
        return Ok(0);
    }
    let mut lanes: Vec<LaneRef<'_>> = listed
        .iter()
        .map(|(d, _)| LaneRef::new(&d.channel, &d.chat_id))
        .collect();
    tx.lock_lanes(&mut lanes)?;
    let mut tally = Tally::default();
    let mut finalized = 0;
    // Read again under the lanes: another process may have finalized one meanwhile.
    for (d, created_at) in tx.finished_unfinalized()? {
        let lane = LaneRef::new(&d.channel, &d.chat_id);
        if !lanes.contains(&lane) {
            continue;
        }
        if finalize(tx, rules, d.id, lane, (created_at, now), &mut tally)?.is_none() {
            finalized += 1;
        }
    }
    tally.write(tx)?;
    Ok(finalized)
}
