//! Claiming due chunks under a lease, and recovering expired leases.

use chrono::{DateTime, Utc};
use rusqlite::{Connection, OptionalExtension, params, params_from_iter, types::Value};
use serde::Serialize;

use crate::clock::{duration_ms, to_datetime};
use crate::outcome::{self, ChunkRef, Outcome, Recorded};
use crate::status::ChunkStatus;
use crate::{
    ChunkId, DeliveryId, Error, Outbox, ReplayPolicy, Result, chunk_idempotency_key, lane,
};

/// Most chunks one [`Outbox::claim`] may hand out: one claim transaction holds the
/// database's write lock, so it must stay short.
pub const MAX_CLAIM_BATCH: usize = 10_000;

/// One chunk handed to a worker: everything needed to send it, plus the fencing token.
///
/// Record its outcome with [`Outbox::record`] (or [`ack`](Outbox::ack),
/// [`fail`](Outbox::fail), [`release`](Outbox::release)) before
/// [`lease_until`](Self::lease_until).
///
/// **Drop behaviour:** dropping a claim records nothing. The chunk stays `sending` until
/// its lease expires; then the next claim or [`Outbox::recover`] treats it like a crash
/// mid-send, following the channel's [`ReplayPolicy`]. Call
/// [`release`](Outbox::release) for claims you decide not to start.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a claim left without an outcome holds its chunk until the lease expires"]
pub struct Claim {
    /// The chunk.
    pub chunk_id: ChunkId,
    /// Its delivery.
    pub delivery_id: DeliveryId,
    /// Channel name, selects the adapter.
    pub channel: String,
    /// Destination chat.
    pub chat_id: String,
    /// 0-based position of this chunk in its delivery.
    pub index: u32,
    /// Number of chunks in the delivery.
    pub total: u32,
    /// Text to send.
    pub text: String,
    /// Stable key carried by every send of this chunk (see [`chunk_idempotency_key`]).
    pub idempotency_key: String,
    /// 1-based attempt number of this send (already counted).
    pub attempt: u32,
    /// When the claim stops protecting the chunk from other claimers.
    pub lease_until: DateTime<Utc>,
    pub(crate) token: i64,
}

/// What [`Outbox::recover`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RecoveryReport {
    /// Chunks put back to `retry` (channels that may replay).
    pub retried: u64,
    /// Chunks held as `uncertain` (channels that must not replay blindly).
    pub held_uncertain: u64,
    /// Chunks failed because their attempts ran out (poison messages).
    pub failed: u64,
    /// Deliveries whose chunks were all delivered but which were not finalized.
    pub finalized: u64,
}

/// Which `sending` chunks [`Outbox::recover`] treats as abandoned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RecoverScope {
    /// Only chunks whose lease has expired. Safe while other processes send from the
    /// same file. The default.
    #[default]
    ExpiredLeases,
    /// Every chunk in `sending`, whatever its lease says. Only correct when no other
    /// process or outbox handle is sending from this file, e.g. at start-up of the
    /// single process that owns it.
    AllSending,
}

/// How the chunk of an expired lease is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expired {
    Replayable,
    Held,
    Exhausted,
}

impl Outbox {
    /// Claims up to `limit` due chunks of any channel, oldest due first.
    ///
    /// Runs one `BEGIN IMMEDIATE` transaction that also reclaims expired leases it
    /// meets. Each claimed chunk moves to `sending`, gets a lease of
    /// [`with_lease`](crate::OutboxOptions::with_lease) and a fresh token, and has its
    /// attempt counted before this returns — before any I/O — so a chunk that crashes the
    /// process every time still exhausts its attempts.
    ///
    /// Only the head chunk of a delivery is ever claimable, and with
    /// [`LaneOrder::Fifo`](crate::LaneOrder::Fifo) only the active delivery of a lane.
    /// Concurrent claimers never receive the same chunk.
    ///
    /// A claim is a send in flight: if the claimer dies before recording an outcome,
    /// each claimed chunk counts as possibly sent once its lease runs out (`uncertain`
    /// on a channel that must not replay). Claim what you are about to send, record (or
    /// [`release`](Self::release)) every claim, and keep a lease alive for a send slower
    /// than it by recording before it ends — or let a [`Dispatcher`](crate::Dispatcher)
    /// do all of that.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] if `limit` is 0 or above [`MAX_CLAIM_BATCH`];
    /// [`Error::Busy`] if another connection held the lock beyond the busy timeout.
    pub fn claim(&self, limit: usize) -> Result<Vec<Claim>> {
        self.claim_where(None, limit)
    }

    /// As [`claim`](Self::claim), restricted to the named channels (those with an
    /// adapter). Chunks of other channels stay due.
    ///
    /// # Errors
    ///
    /// As [`claim`](Self::claim), and [`Error::InvalidInput`] for an empty channel list.
    pub fn claim_channels(&self, channels: &[&str], limit: usize) -> Result<Vec<Claim>> {
        if channels.is_empty() {
            return Err(Error::invalid("channels", "name at least one channel"));
        }
        self.claim_where(Some(channels), limit)
    }

    fn claim_where(&self, channels: Option<&[&str]>, limit: usize) -> Result<Vec<Claim>> {
        check_limit(limit)?;
        let options = self.options();
        self.write(|tx| claim_in(tx, self, channels, limit, options.now_ms()))
    }

    /// Records the outcomes of a dispatcher's finished sends and claims its next ones in
    /// one transaction, so a known outcome is durable before the next send starts and
    /// one commit serves both. `limit` 0 only records.
    pub(crate) fn record_and_claim(
        &self,
        outcomes: &[(Claim, Outcome)],
        channels: &[&str],
        limit: usize,
    ) -> Result<(Vec<Result<Recorded>>, Vec<Claim>)> {
        // `limit` is a dispatcher's validated batch size (or 0), so within range.
        let options = self.options();
        let step = |tx: &rusqlite::Transaction<'_>| {
            let now = options.now_ms();
            let recorded = outcome::record_in(
                tx,
                options,
                outcomes.iter().map(|(c, o)| (c, o.clone())),
                now,
            )?;
            let claims = if limit > 0 {
                claim_in(tx, self, Some(channels), limit, now)?
            } else {
                Vec::new()
            };
            Ok((recorded, claims))
        };
        if outcomes.is_empty() {
            self.write(step)
        } else {
            self.write_and_wake(step)
        }
    }

    /// Extends the leases of claims this process still holds to a full lease from now;
    /// per claim, the new expiry, or `None` if the claim no longer owns its chunk.
    pub(crate) fn renew_leases(&self, claims: &[(ChunkId, i64)]) -> Result<Vec<Option<i64>>> {
        let options = self.options();
        self.write(|tx| {
            let until = options.now_ms().saturating_add(duration_ms(options.lease));
            let mut stmt = tx.prepare_cached(
                "UPDATE outbound_delivery_chunks SET due_at = ?3
                 WHERE id = ?1 AND claim_token = ?2 AND status = 'sending'",
            )?;
            claims
                .iter()
                .map(|(chunk, token)| {
                    Ok((stmt.execute(params![chunk.0, token, until])? == 1).then_some(until))
                })
                .collect()
        })
    }

    /// When the next chunk of these channels (all, for `None`) becomes due, or its
    /// lease expires; `None` if nothing is scheduled. A read; dispatchers sleep until
    /// then.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn next_due(&self, channels: Option<&[&str]>) -> Result<Option<DateTime<Utc>>> {
        let sql = next_due_sql(channels.map_or(0, <[_]>::len));
        let due: Option<i64> = self.read(|tx| {
            Ok(tx
                .prepare_cached(&sql)?
                .query_row(params_from_iter(due_params(channels, 0, 1)), |r| r.get(0))
                .optional()?)
        })?;
        Ok(due.map(to_datetime))
    }

    /// Settles `sending` chunks whose worker is gone, then finalizes deliveries whose
    /// chunks are all delivered but which were never written to `messages`.
    ///
    /// Each abandoned chunk follows its channel's [`ReplayPolicy`]: `retry` (due now) if
    /// the channel may replay, `uncertain` otherwise, `failed` if its attempts are used
    /// up. Claiming does the same for expired leases as it meets them, so calling this
    /// is only needed at start-up.
    ///
    /// # Errors
    ///
    /// [`Error::Busy`] and other database errors; nothing is changed then.
    pub fn recover(&self, scope: RecoverScope) -> Result<RecoveryReport> {
        let options = self.options();
        self.write_and_wake(|tx| {
            let now = options.now_ms();
            let limit = match scope {
                RecoverScope::ExpiredLeases => now,
                RecoverScope::AllSending => i64::MAX,
            };
            let mut report = RecoveryReport::default();
            for chunk in sending_chunks(tx, limit)? {
                match expire(tx, options, &chunk, now)? {
                    Expired::Replayable => {
                        let due = lane::due_time(tx, &chunk.channel, &chunk.chat_id, now)?;
                        outcome::retry_abandoned(tx, &chunk, due)?;
                        report.retried += 1;
                    }
                    Expired::Held => report.held_uncertain += 1,
                    Expired::Exhausted => report.failed += 1,
                }
            }
            report.finalized = crate::finalize::sweep(tx, options, now)?;
            Ok(report)
        })
    }
}

fn check_limit(limit: usize) -> Result<()> {
    if limit == 0 || limit > MAX_CLAIM_BATCH {
        return Err(Error::invalid(
            "limit",
            format!("{limit} is outside 1..={MAX_CLAIM_BATCH}"),
        ));
    }
    Ok(())
}

/// Claims up to `limit` due chunks in the caller's transaction (see [`Outbox::claim`]).
fn claim_in(
    tx: &Connection,
    outbox: &Outbox,
    channels: Option<&[&str]>,
    limit: usize,
    now: i64,
) -> Result<Vec<Claim>> {
    let options = outbox.options();
    let lease_until = now.saturating_add(duration_ms(options.lease));
    let candidates = due_chunks(tx, channels, now, limit)?;
    let mut claims = Vec::with_capacity(candidates.len());
    for c in candidates {
        if c.chunk.status == ChunkStatus::Sending
            && expire(tx, options, &c.chunk, now)? != Expired::Replayable
        {
            continue;
        }
        if let Some(reason) = outcome::out_of_budget(options, &c.chunk, now) {
            outcome::fail_chunk(tx, options, &c.chunk, &reason, now)?;
            continue;
        }
        let token = outbox.next_token();
        tx.prepare_cached(
            "UPDATE outbound_delivery_chunks
             SET status = 'sending', attempts = attempts + 1, due_at = ?2,
                 claim_token = ?3
             WHERE id = ?1",
        )?
        .execute(params![c.chunk.id, lease_until, token])?;
        let delivery_id: DeliveryId = c.uid.parse()?;
        claims.push(Claim {
            chunk_id: ChunkId(c.chunk.id),
            idempotency_key: chunk_idempotency_key(&delivery_id, c.chunk.index as u32),
            delivery_id,
            channel: c.chunk.channel,
            chat_id: c.chunk.chat_id,
            index: c.chunk.index as u32,
            total: c.chunk.total as u32,
            text: c.text,
            attempt: c.chunk.attempts + 1,
            lease_until: to_datetime(lease_until),
            token,
        });
    }
    Ok(claims)
}

/// A claimable (or lease-expired) chunk read by the claim query.
struct Candidate {
    chunk: ChunkRef,
    uid: String,
    text: String,
}

/// The claim query: a range search on the partial `due_at` index, in index order, so
/// its cost is proportional to what it returns (plus rows of channels filtered out),
/// never to backlog or history. `?1` is now, `?2` the limit, `?3..` the channels.
pub(crate) fn claim_sql(channels: usize) -> String {
    due_sql(
        "c.id, c.delivery_id, c.chunk_index, c.status, c.attempts,
         d.channel, d.chat_id, d.created_at, d.chunk_count, d.uid, coalesce(c.text, d.text)",
        "c.due_at <= ?1",
        channels,
    )
}

/// The earliest due time among the given channels (`?1` unused, `?2` = 1): the same
/// index search as the claim, stopping at the first row.
pub(crate) fn next_due_sql(channels: usize) -> String {
    due_sql("c.due_at", "?1 IS NOT NULL", channels)
}

fn due_sql(columns: &str, bound: &str, channels: usize) -> String {
    let mut sql = format!(
        "SELECT {columns}
         FROM outbound_delivery_chunks c JOIN outbound_deliveries d ON d.id = c.delivery_id
         WHERE c.due_at IS NOT NULL AND {bound}"
    );
    if channels > 0 {
        let placeholders: Vec<String> = (0..channels).map(|i| format!("?{}", i + 3)).collect();
        sql.push_str(&format!(" AND d.channel IN ({})", placeholders.join(", ")));
    }
    sql.push_str(" ORDER BY c.due_at LIMIT ?2");
    sql
}

fn due_params(channels: Option<&[&str]>, now: i64, limit: usize) -> Vec<Value> {
    let mut values = vec![Value::Integer(now), Value::Integer(limit as i64)];
    values.extend(
        channels
            .unwrap_or_default()
            .iter()
            .map(|c| Value::Text((*c).to_owned())),
    );
    values
}

fn due_chunks(
    tx: &Connection,
    channels: Option<&[&str]>,
    now: i64,
    limit: usize,
) -> Result<Vec<Candidate>> {
    let sql = claim_sql(channels.map_or(0, <[_]>::len));
    let mut stmt = tx.prepare_cached(&sql)?;
    let rows = stmt.query_map(params_from_iter(due_params(channels, now, limit)), |r| {
        Ok(Candidate {
            // The claim query selects ChunkRef's columns first, in its order.
            chunk: ChunkRef::from_row(r)?,
            uid: r.get(9)?,
            text: r.get(10)?,
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// `sending` chunks whose lease ends at or before `until`.
fn sending_chunks(tx: &Connection, until: i64) -> Result<Vec<ChunkRef>> {
    let mut stmt = tx.prepare_cached(outcome::chunk_ref_where!(
        "c.due_at IS NOT NULL AND c.due_at <= ?1 AND c.status = 'sending'"
    ))?;
    let rows = stmt.query_map([until], ChunkRef::from_row)?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Settles a chunk whose lease expired while `sending`. A replayable chunk is left for
/// the caller to claim or reschedule; a held one becomes `uncertain`; one with no
/// attempts left fails.
fn expire(
    tx: &Connection,
    options: &crate::OutboxOptions,
    chunk: &ChunkRef,
    now: i64,
) -> Result<Expired> {
    if chunk.attempts >= options.retry.max_attempts {
        let reason = format!(
            "lease expired without an outcome on attempt {} of {}; the worker may crash on this chunk",
            chunk.attempts, options.retry.max_attempts
        );
        outcome::fail_chunk(tx, options, chunk, &reason, now)?;
        return Ok(Expired::Exhausted);
    }
    match options.channel(&chunk.channel).replay {
        ReplayPolicy::Replay => Ok(Expired::Replayable),
        _ => {
            outcome::hold_abandoned(
                tx,
                options,
                chunk,
                "lease expired while sending; the chunk may have reached the platform",
                now,
            )?;
            Ok(Expired::Held)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::{ManualClock, NewDelivery, Outbox, OutboxOptions, Outcome};

    /// A renewal extends a live claim to a full lease from now, and refuses a claim that
    /// no longer owns its chunk (another token, or settled).
    #[test]
    fn renewing_extends_live_claims_only() {
        let clock = ManualClock::new(1_000_000);
        let options = OutboxOptions::default()
            .with_lease(Duration::from_secs(10))
            .with_clock(Arc::new(clock.clone()));
        let ob = Outbox::open_in_memory(options).unwrap();
        for chat in ["a", "b"] {
            ob.enqueue(&NewDelivery::single("t", chat, "x")).unwrap();
        }
        let claims = ob.claim(2).unwrap();
        clock.advance(Duration::from_secs(8));
        ob.record(&claims[1], Outcome::delivered(None)).unwrap();
        let held = [
            (claims[0].chunk_id, claims[0].token),
            (claims[0].chunk_id, claims[0].token ^ 1),
            (claims[1].chunk_id, claims[1].token),
        ];
        let renewed = ob.renew_leases(&held).unwrap();
        assert_eq!(renewed, [Some(1_018_000), None, None]);
        // The renewed lease protects the chunk past its first expiry.
        clock.advance(Duration::from_secs(5));
        assert!(ob.claim(2).unwrap().is_empty());
        assert!(
            ob.record(&claims[0], Outcome::delivered(None))
                .unwrap()
                .finalized
        );
    }
}
