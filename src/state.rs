//! The state machine: every transition of a chunk and of its delivery, whoever drives
//! it — an outcome ([`crate::outcome`]), a claim that meets an expired lease or a chunk
//! out of budget ([`crate::claim`]), an operator ([`crate::operator`]), recovery.
//!
//! ```text
//! pending ──claim──▶ sending ──ack──────────────▶ delivered         deliver
//! retry   ──claim──▶ sending ──transient error──▶ retry             retry_or_fail
//!                    sending ──permanent error──▶ failed            fail
//!                    sending ──attempts exhausted▶ failed           fail (expire)
//!                    sending ──rate limited─────▶ retry             (outcome)
//!                    sending ──lease expired────▶ retry | uncertain expire
//!                    sending ──ambiguous────────▶ retry | uncertain hold_uncertain
//! failed | uncertain ──requeue──▶ retry                             requeue
//! uncertain ──late outcome / resolve──▶ delivered | retry | failed  rejoin_lane, deliver
//! unreadable row ──▶ failed (corrupt)                               set_aside_corrupt
//! ```
//!
//! Each transition runs in its caller's transaction, which holds the chunk's lane.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::clock::{duration_ms, to_datetime};
use crate::error::{Error, Result};
use crate::finalize::{self, Tally};
use crate::ids::{ChunkId, DeliveryId};
use crate::lane;
use crate::rules::ReplayPolicy;
use crate::rules::Stored;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::{ChunkRef, LaneRef, StoreTx};

/// Longest error text kept with a chunk; longer texts are cut at a character boundary.
pub const MAX_ERROR_BYTES: usize = 4096;

/// Rate limits of one attempt budget whose attempt is given back. Past them, each rate
/// limit uses an attempt: a chunk refused as "rate limited" forever (a permanent error
/// misread, a platform that never lets up) still becomes a dead letter.
pub const MAX_REFUNDED_RATE_LIMITS: u32 = 20;

/// The state a chunk was left in by [`Outbox::record`](crate::Outbox::record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Recorded {
    /// The chunk's new status.
    pub status: ChunkStatus,
    /// When it is due again (`retry`, or `pending` after a release).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// True when this ack delivered the delivery's last chunk and the delivery was
    /// written to `outbound_messages` in the same transaction.
    pub finalized: bool,
    /// When this ack delivered the last chunk but the application's finalization
    /// statement refused the reply: what the statement met. The reply is then
    /// [`Unfinalized`](crate::monitoring::DeliveryStatus::Unfinalized) (its chunks stay delivered),
    /// and the rest of the transaction was recorded as usual.
    pub finalize_error: Option<String>,
}

impl Recorded {
    pub(crate) fn settled(status: ChunkStatus) -> Self {
        Recorded {
            status,
            next_attempt_at: None,
            finalized: false,
            finalize_error: None,
        }
    }

    pub(crate) fn due(status: ChunkStatus, at: i64) -> Self {
        Recorded {
            status,
            next_attempt_at: Some(to_datetime(at)),
            finalized: false,
            finalize_error: None,
        }
    }
}

/// A delivery that became a dead letter in a transaction, as the dispatcher reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeadLetter {
    pub delivery_id: DeliveryId,
    pub channel: String,
    pub chat_id: String,
    pub error: String,
}

impl DeadLetter {
    /// The dead letters the work on `tx` made so far. A row whose uid cannot be read
    /// (one set aside as corrupt) cannot be named to the application and is left out;
    /// health counts it.
    pub(crate) fn taken(tx: &dyn StoreTx) -> Result<Vec<DeadLetter>> {
        let mut out = Vec::new();
        for (delivery, error) in tx.take_dead_letters() {
            if let Some((uid, channel, chat_id)) = tx.delivery_names(delivery)?
                && let Ok(delivery_id) = uid.parse()
            {
                out.push(DeadLetter {
                    delivery_id,
                    channel,
                    chat_id,
                    error,
                });
            }
        }
        Ok(out)
    }
}

impl ChunkRef {
    /// The chunk's lane.
    pub(crate) fn lane(&self) -> LaneRef<'_> {
        LaneRef::new(&self.channel, &self.chat_id)
    }
}

/// Loads chunk `id` (the chunk of a queued reply included).
pub(crate) fn load_chunk(tx: &dyn StoreTx, id: ChunkId) -> Result<ChunkRef> {
    tx.load_chunk(id.0)?.ok_or(Error::ChunkNotFound(id))
}

/// Why a chunk may not be sent (again), if it may not.
pub(crate) fn out_of_budget(rules: &Stored, chunk: &ChunkRef, now: i64) -> Option<String> {
    let max = rules.policy.retry_for(&chunk.channel).max_attempts;
    if chunk.attempts >= max {
        return Some(format!(
            "no attempts left ({} of {max} used)",
            chunk.attempts
        ));
    }
    let max_age = rules.policy.retry_for(&chunk.channel).max_age?;
    (now.saturating_sub(chunk.created_at) > duration_ms(max_age))
        .then(|| format!("delivery is older than the maximum age of {max_age:?}"))
}

/// The attempts a chunk keeps after a rate limit: one fewer (the attempt given back)
/// for its first [`MAX_REFUNDED_RATE_LIMITS`], the same after that — or, when that
/// leaves it out of budget, `Err` with the dead letter's error.
pub(crate) fn charge_rate_limit(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<std::result::Result<u32, String>> {
    let count = tx.count_rate_limit(chunk.id)?;
    if count <= MAX_REFUNDED_RATE_LIMITS {
        return Ok(Ok(chunk.attempts.saturating_sub(1)));
    }
    Ok(match out_of_budget(rules, chunk, now) {
        Some(reason) => Err(format!(
            "{error} (rate limited {count} times; past {MAX_REFUNDED_RATE_LIMITS} each one uses an attempt: {reason})"
        )),
        None => Ok(chunk.attempts),
    })
}

/// `retry` after the channel's backoff, through the lane; `failed` if the chunk is out
/// of budget.
pub(crate) fn retry_or_fail(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<Recorded> {
    if let Some(reason) = out_of_budget(rules, chunk, now) {
        fail(tx, rules, chunk, &format!("{error} ({reason})"), now)?;
        return Ok(Recorded::settled(ChunkStatus::Failed));
    }
    let backoff = now.saturating_add(
        rules
            .policy
            .retry_for(&chunk.channel)
            .delay_ms(chunk.attempts),
    );
    let due = tx.lane_due_time(chunk.lane(), backoff)?;
    reschedule(
        tx,
        chunk,
        ChunkStatus::Retry,
        chunk.attempts,
        due,
        Some(error),
    )?;
    Ok(Recorded::due(ChunkStatus::Retry, due))
}

/// Puts a chunk back in the claimable set (or keeps it there) with the given status,
/// attempt count and due time.
pub(crate) fn reschedule(
    tx: &dyn StoreTx,
    chunk: &ChunkRef,
    status: ChunkStatus,
    attempts: u32,
    due: i64,
    error: Option<&str>,
) -> Result<()> {
    let error = error.map(storable_error);
    tx.reschedule(chunk.id, status, attempts, due, error.as_deref())
}

/// Marks an `uncertain` chunk delivered — a person or its platform said it arrived — and
/// moves its delivery, held aside, on ([`deliver`]), with the counters written.
pub(crate) fn deliver_held(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    platform_message_id: Option<&str>,
    now: i64,
) -> Result<Recorded> {
    let mut tally = Tally::default();
    let recorded = deliver(
        tx,
        rules,
        chunk,
        platform_message_id,
        now,
        false,
        &mut tally,
    )?;
    tally.write(tx)?;
    Ok(recorded)
}

/// Marks a chunk delivered and moves its delivery on: the next chunk becomes due, or
/// the delivery is finalized. `active` says whether the delivery currently holds its
/// lane (an ack) or was held aside (resolving an `uncertain` chunk), in which case it
/// queues up in its lane again. The result says whether the delivery was finalized.
pub(crate) fn deliver(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    platform_message_id: Option<&str>,
    now: i64,
    active: bool,
    tally: &mut Tally,
) -> Result<Recorded> {
    let platform_message_id = platform_message_id.map(storable);
    tx.mark_delivered(chunk.id, platform_message_id.as_deref(), now)?;
    if chunk.index + 1 >= chunk.total {
        let refused = finalize::finalize(
            tx,
            rules,
            chunk.delivery,
            chunk.lane(),
            (chunk.created_at, now),
            tally,
        )?;
        return Ok(Recorded {
            finalized: refused.is_none(),
            finalize_error: refused,
            ..Recorded::settled(ChunkStatus::Delivered)
        });
    }
    // An active delivery with a chunk delivered is `partial`; one held aside keeps its
    // status.
    let status = active.then_some(DeliveryStatus::Partial);
    tx.count_delivered(chunk.delivery, now, status)?;
    if active {
        tx.make_due(chunk.delivery, chunk.index + 1, chunk.lane(), now)?;
    } else {
        lane::rejoin(tx, &rules.policy, chunk.delivery, chunk.lane(), now)?;
    }
    Ok(Recorded::settled(ChunkStatus::Delivered))
}

/// Fails a chunk for good and its delivery with it (a dead letter); the lane moves on
/// according to the [`LaneFailurePolicy`](crate::rules::LaneFailurePolicy).
pub(crate) fn fail(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<()> {
    set_aside(tx, rules, chunk, ChunkStatus::Failed, error, now)
}

/// Holds a chunk that may have been sent as `uncertain` until someone decides.
pub(crate) fn hold_uncertain(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<()> {
    set_aside(tx, rules, chunk, ChunkStatus::Uncertain, error, now)
}

/// Takes a chunk and its delivery out of the lane as `failed` or `uncertain`; the lane
/// moves on.
fn set_aside(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    status: ChunkStatus,
    error: &str,
    now: i64,
) -> Result<()> {
    set_held(tx, chunk, status, error, now)?;
    lane::advance(tx, &rules.policy, chunk.lane(), now)
}

/// A chunk and its delivery take `status` (`failed` or `uncertain`); a dead letter is
/// noted for the dispatcher's events. Its lane is left to the caller.
pub(crate) fn set_held(
    tx: &dyn StoreTx,
    chunk: &ChunkRef,
    status: ChunkStatus,
    error: &str,
    now: i64,
) -> Result<()> {
    let error = storable_error(error);
    let error = error.as_ref();
    tx.set_chunk_aside(chunk.id, status, error, false)?;
    if status == ChunkStatus::Failed {
        tx.note_dead_letter(chunk.delivery, error);
    }
    set_delivery_aside(tx, chunk.delivery, status, now)
}

/// The delivery takes the status of its chunk set aside; a failed one (a dead letter)
/// is finished now, an uncertain one is not.
fn set_delivery_aside(
    tx: &dyn StoreTx,
    delivery: i64,
    status: ChunkStatus,
    now: i64,
) -> Result<()> {
    let finished = (status == ChunkStatus::Failed).then_some(now);
    tx.set_delivery_aside(delivery, status, now, finished)?;
    if finished.is_some() {
        crate::finalize::count_failed(tx, now)?;
    }
    Ok(())
}

/// Sets aside a chunk whose row cannot be read (a delivery uid that does not parse,
/// text that is not UTF-8): it and its delivery are failed, the reason is kept for
/// health and the tool, and its lane moves on. Works from the row ids alone, since the
/// rest of the row may be what is unreadable.
pub(crate) fn set_aside_corrupt(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: i64,
    delivery: i64,
    reason: &str,
    now: i64,
) -> Result<()> {
    let reason = storable_error(reason);
    let reason = reason.as_ref();
    tracing::warn!(chunk, delivery, reason, "setting aside an unreadable row");
    tx.note_dead_letter(delivery, reason);
    // The claim that met the row did not know its lane: it moves the lane on only if
    // no other writer holds it (claims never wait). A holder that read the row as the
    // lane's head before this commit may leave the next reply queued until the lane's
    // next enqueue starts it.
    let lane = tx.set_corrupt(chunk, delivery, reason, now)?;
    crate::finalize::count_failed(tx, now)?;
    if let Some((channel, chat_id)) = lane {
        let lane = LaneRef::new(&channel, &chat_id);
        if tx.try_lock_lane(lane)? {
            lane::advance(tx, &rules.policy, lane, now)?;
        }
    }
    Ok(())
}

/// How the chunk of an expired lease is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expired {
    Replayable,
    Held,
    Exhausted,
}

/// Settles a chunk whose lease expired while `sending`. A replayable chunk is left for
/// the caller to claim or reschedule ([`retry_abandoned`]); a held one becomes
/// `uncertain`, keeping the claim's token (its worker may still be alive and report its
/// outcome, which [`Outbox::record`](crate::Outbox::record) accepts until someone else
/// decides); one with no attempts left fails.
pub(crate) fn expire(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    now: i64,
) -> Result<Expired> {
    let max_attempts = rules.policy.retry_for(&chunk.channel).max_attempts;
    if chunk.attempts >= max_attempts {
        let reason = format!(
            "lease expired without an outcome on attempt {} of {max_attempts}; the worker may crash on this chunk",
            chunk.attempts
        );
        fail(tx, rules, chunk, &reason, now)?;
        return Ok(Expired::Exhausted);
    }
    match rules.policy.channel(&chunk.channel).replay {
        ReplayPolicy::Replay => Ok(Expired::Replayable),
        ReplayPolicy::Hold | ReplayPolicy::Ask => {
            let error = "lease expired while sending; the chunk may have reached the platform";
            tx.set_chunk_aside(chunk.id, ChunkStatus::Uncertain, error, true)?;
            set_delivery_aside(tx, chunk.delivery, ChunkStatus::Uncertain, now)?;
            lane::advance(tx, &rules.policy, chunk.lane(), now)?;
            Ok(Expired::Held)
        }
    }
}

/// Holds as `uncertain` a part whose resend, allowed by its platform's deduplication
/// window, could not be claimed before the deadline `by` (see
/// [`Settlement::within_window`](crate::settle::Settlement::within_window)): sent now it
/// could be posted twice. Under `ask` it is asked about again, and the platform's answer
/// (past its window: hold) or a person decides.
pub(crate) fn hold_late_resend(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    by: i64,
    now: i64,
) -> Result<()> {
    let error = format!(
        "not sent again: the resend had to go by {} to stay inside the platform's deduplication window, and could not",
        to_datetime(by).format("%Y-%m-%d %H:%M:%S%.3f UTC")
    );
    hold_uncertain(tx, rules, chunk, &error, now)
}

/// Puts a chunk whose lease ran out on a channel that may replay back to `retry`, due
/// when its lane lets it from `now`, keeping the claim's token until it is claimed
/// again (see [`expire`]).
pub(crate) fn retry_abandoned(tx: &dyn StoreTx, chunk: &ChunkRef, now: i64) -> Result<()> {
    let due = tx.lane_due_time(chunk.lane(), now)?;
    tx.retry_keeping_token(chunk.id, due)
}

/// Sends a chunk whose delivery was set aside again from its lane, as a requeue would:
/// `retry` with `attempts`, due no earlier than `earliest` once its lane lets it.
pub(crate) fn rejoin_lane(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    attempts: u32,
    earliest: i64,
    error: Option<&str>,
) -> Result<()> {
    let error = error.map(storable_error);
    tx.set_retry_unscheduled(chunk.id, attempts, error.as_deref())?;
    lane::rejoin(tx, &rules.policy, chunk.delivery, chunk.lane(), earliest)
}

/// Sends a `failed` or `uncertain` chunk again with a fresh attempt budget; its
/// delivery rejoins its lane.
pub(crate) fn requeue(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    action: &'static str,
    now: i64,
) -> Result<()> {
    expect_status(
        chunk,
        &[ChunkStatus::Failed, ChunkStatus::Uncertain],
        action,
        "failed or uncertain",
    )?;
    tx.reset_budget(chunk.id)?;
    lane::rejoin(tx, &rules.policy, chunk.delivery, chunk.lane(), now)
}

/// [`Error::InvalidState`] unless the chunk is in one of `allowed`.
pub(crate) fn expect_status(
    chunk: &ChunkRef,
    allowed: &[ChunkStatus],
    action: &'static str,
    expected: &'static str,
) -> Result<()> {
    if allowed.contains(&chunk.status) {
        Ok(())
    } else {
        Err(Error::InvalidState {
            chunk: ChunkId(chunk.id),
            status: chunk.status,
            action,
            expected,
        })
    }
}

/// Error text as every store keeps it: at most [`MAX_ERROR_BYTES`], and no NUL
/// character (PostgreSQL's text cannot hold one; it shows as U+FFFD).
pub(crate) fn storable_error(error: &str) -> std::borrow::Cow<'_, str> {
    storable(cut_at(error, MAX_ERROR_BYTES))
}

/// `text` without NUL characters, which PostgreSQL's text cannot hold (a write of one
/// fails): each becomes U+FFFD, the replacement character. Text from a platform (an
/// error message, a message id) is kept for people to read, never compared.
pub(crate) fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\u{FFFD}"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character
/// boundary.
pub(crate) fn cut_at(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}
