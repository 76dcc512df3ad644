//! Recording what happened to a claimed chunk: every transition out of `sending`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use rusqlite::{OptionalExtension, Row, params};
use serde::Serialize;

use crate::classify::{ErrorClass, cap_retry_after, classify_error};
use crate::clock::{duration_ms, to_datetime};
use crate::finalize::Tally;
use crate::ids::CHUNK_STRIDE;
use crate::policy::Stored;
use crate::status::ChunkStatus;
use crate::tx::Tx;
use crate::{ChunkId, Claim, Error, Outbox, ReplayPolicy, Result, finalize, lane};

/// Longest error text kept with a chunk; longer texts are cut at a character boundary.
pub const MAX_ERROR_BYTES: usize = 4096;
/// Longest platform message id kept with an ack; a longer one is cut to this length.
pub const MAX_PLATFORM_ID_BYTES: usize = 1024;

/// What the channel adapter reports for one send.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The platform accepted the chunk.
    Delivered {
        /// The platform's id for the sent message, if it returned one.
        platform_message_id: Option<String>,
    },
    /// A failure worth retrying (timeout before sending, 5xx, network down): `retry`
    /// after the backoff, or `failed` when no attempts are left.
    Transient {
        /// What went wrong, kept as the chunk's last error.
        error: String,
    },
    /// A failure that retrying cannot fix (chat not found, bot blocked): `failed` at
    /// once, a dead letter.
    Permanent {
        /// What went wrong.
        error: String,
    },
    /// The platform asked to slow down: `retry` at `retry_after` from now (at most
    /// [`MAX_RETRY_AFTER`](crate::limits::MAX_RETRY_AFTER)), the whole lane paused until then,
    /// and the attempt is given back — for the first
    /// [`MAX_REFUNDED_RATE_LIMITS`] rate limits of the chunk's attempt budget; after
    /// that each one uses an attempt.
    RateLimited {
        /// How long the platform asked to wait.
        retry_after: Duration,
        /// What the platform said.
        error: String,
    },
    /// As [`RateLimited`](Self::RateLimited), for a limit of the whole channel (the
    /// bot's or the app's, not one chat's: Discord's `"global": true`, Slack's per-method
    /// limits, Matrix's per-user limit): besides the chat, **every chat of the channel**
    /// waits until `retry_after` has passed, through the channel's stored schedule, so
    /// every process on the file holds off. Sending on to other chats would only earn
    /// more rate limits (and, on Discord, count toward a ban).
    ChannelRateLimited {
        /// How long the platform asked the whole channel to wait.
        retry_after: Duration,
        /// What the platform said.
        error: String,
    },
    /// The send may or may not have reached the platform (timeout after the request was
    /// written). Follows the channel's [`ReplayPolicy`].
    Ambiguous {
        /// What went wrong.
        error: String,
    },
}

impl Outcome {
    /// Delivered, with an optional platform message id.
    pub fn delivered(platform_message_id: Option<String>) -> Self {
        Outcome::Delivered {
            platform_message_id,
        }
    }

    /// The outcome for a plain error text, classified by [`classify_error`].
    pub fn from_error_text(error: impl Into<String>) -> Self {
        let error = error.into();
        match classify_error(&error) {
            ErrorClass::Permanent => Outcome::Permanent { error },
            ErrorClass::RateLimited { retry_after } => Outcome::RateLimited {
                retry_after: retry_after.unwrap_or(Duration::from_secs(1)),
                error,
            },
            ErrorClass::Ambiguous => Outcome::Ambiguous { error },
            ErrorClass::Transient => Outcome::Transient { error },
        }
    }
}

/// The state a chunk was left in by [`Outbox::record`].
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
    /// [`Unfinalized`](crate::DeliveryStatus::Unfinalized) (its chunks stay delivered),
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

    fn due(status: ChunkStatus, at: i64) -> Self {
        Recorded {
            status,
            next_attempt_at: Some(to_datetime(at)),
            finalized: false,
            finalize_error: None,
        }
    }
}

impl Outbox {
    /// Records the outcome of a claimed send and moves the chunk on (see [`Outcome`]).
    ///
    /// The claim's token is checked first: if the chunk was claimed again by someone
    /// else, resolved or requeued by an operator, or an outcome was already recorded,
    /// nothing changes and the call fails with [`Error::StaleClaim`]. A claim whose
    /// lease ran out still settles its chunk as long as nobody else took it over: the
    /// chunk is then `uncertain` (or `retry`, on a channel that may replay) and still
    /// carries this claim's token, and an outcome recorded now settles it as it
    /// should — a late ack delivers it instead of leaving a sent chunk to be resent. An
    /// ack of the last chunk writes the delivery to `outbound_messages` in the same transaction.
    ///
    /// A platform message id longer than [`MAX_PLATFORM_ID_BYTES`] is cut to that length
    /// (at a character boundary) rather than refused: the ack matters more than the id.
    ///
    /// # Errors
    ///
    /// [`Error::StaleClaim`]; database errors ([`Error::Busy`], [`Error::DiskFull`],
    /// ...), after which nothing was changed and the same call may be retried: the
    /// token makes a retry safe.
    pub fn record(&self, claim: &Claim, outcome: Outcome) -> Result<Recorded> {
        let mut results = self.record_batch([(claim, outcome)])?;
        results.pop().unwrap_or(Err(Error::StaleClaim {
            chunk: claim.chunk_id,
        }))
    }

    /// Records the outcomes of several claims in one transaction (group commit): one
    /// commit instead of one per chunk, which is what makes high throughput possible.
    /// Each claim is checked on its own: a stale one gets [`Error::StaleClaim`] in its
    /// slot of the result, changes nothing, and does not stop the others.
    ///
    /// # Errors
    ///
    /// The outer error is for the transaction as a whole ([`Error::Busy`],
    /// [`Error::DiskFull`], ...): then nothing at all was recorded.
    pub fn record_batch<'a>(
        &self,
        outcomes: impl IntoIterator<Item = (&'a Claim, Outcome)>,
    ) -> Result<Vec<Result<Recorded>>> {
        let outcomes: Vec<(&Claim, Outcome)> = outcomes.into_iter().collect();
        let now = || self.options().now_ms();
        self.write_and_wake(|tx, rules| record_in(tx, rules, outcomes, now()))
    }

    /// Records a successful send: shorthand for [`record`](Self::record) with
    /// [`Outcome::Delivered`].
    ///
    /// # Errors
    ///
    /// As [`record`](Self::record).
    pub fn ack(&self, claim: &Claim, platform_message_id: Option<&str>) -> Result<Recorded> {
        self.record(
            claim,
            Outcome::delivered(platform_message_id.map(str::to_owned)),
        )
    }

    /// Records a failed send described only by its error text, classified by
    /// [`classify_error`]: a permanent failure (dead letter), a rate limit (the lane
    /// paused, the attempt refunded), an ambiguous send (the channel's
    /// [`ReplayPolicy`](crate::ReplayPolicy) decides) or a transient failure (retried
    /// with backoff). So the chunk may well be retried; the name says what is recorded,
    /// not what becomes of it. An adapter that has the platform's answer should map it
    /// with [`platforms`](crate::platforms) instead.
    ///
    /// ```
    /// use chunked_outbox::{ChunkStatus, NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// outbox.enqueue(&NewDelivery::single("telegram", "42", "hello"))?;
    /// let claim = outbox.claim(1)?.pop().unwrap();
    /// let recorded = outbox.record_error_text(&claim, "502 Bad Gateway")?;
    /// assert_eq!(recorded.status, ChunkStatus::Retry);
    ///
    /// outbox.enqueue(&NewDelivery::single("telegram", "43", "hello"))?;
    /// let claim = outbox.claim(1)?.pop().unwrap();
    /// let recorded = outbox.record_error_text(&claim, "Forbidden: bot was blocked by the user")?;
    /// assert_eq!(recorded.status, ChunkStatus::Failed);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`record`](Self::record).
    pub fn record_error_text(&self, claim: &Claim, error: &str) -> Result<Recorded> {
        self.record(claim, Outcome::from_error_text(error))
    }

    /// Gives a claim back unstarted: the chunk is due again at once and the attempt is
    /// refunded.
    ///
    /// # Errors
    ///
    /// As [`record`](Self::record).
    pub fn release(&self, claim: &Claim) -> Result<Recorded> {
        self.release_after(claim, Duration::ZERO)
    }

    /// Gives a claim back unstarted, due again after `delay` (or when its lane's
    /// rate-limit pause ends, if later); the attempt is refunded. A dispatcher uses it
    /// when a channel-wide rate limit leaves no slot for the chunk yet.
    ///
    /// # Errors
    ///
    /// As [`record`](Self::record).
    pub fn release_after(&self, claim: &Claim, delay: Duration) -> Result<Recorded> {
        self.write_and_wake(|tx, rules| {
            let chunk = claimed(tx, claim)?;
            let now = self.options().now_ms();
            let earliest = now.saturating_add(duration_ms(delay));
            let attempts = chunk.attempts.saturating_sub(1);
            if chunk.status == ChunkStatus::Uncertain {
                // Its lease ran out and it was held as possibly sent; it was not.
                rejoin_lane(tx, rules, &chunk, attempts, earliest, None)?;
                return Ok(Recorded::settled(ChunkStatus::Retry));
            }
            let due = lane::due_time(tx, &chunk.channel, &chunk.chat_id, earliest)?;
            let status = if attempts == 0 {
                ChunkStatus::Pending
            } else {
                ChunkStatus::Retry
            };
            reschedule(tx, &chunk, status, attempts, due, None)?;
            Ok(Recorded::due(status, due))
        })
    }
}

/// Records each outcome in the caller's transaction; a stale claim gets
/// [`Error::StaleClaim`] in its slot and changes nothing.
pub(crate) fn record_in(
    tx: &Tx<'_>,
    rules: &Stored,
    outcomes: impl IntoIterator<Item = (impl std::borrow::Borrow<Claim>, Outcome)>,
    now: i64,
) -> Result<Vec<Result<Recorded>>> {
    let mut results = Vec::new();
    let mut tally = Tally::default();
    for (claim, outcome) in outcomes {
        match claimed(tx, claim.borrow()) {
            Ok(chunk) => {
                let recorded = apply(tx, rules, &chunk, trimmed(outcome), now, &mut tally)?;
                results.push(Ok(recorded));
            }
            Err(e @ Error::StaleClaim { .. }) => results.push(Err(e)),
            Err(e) => return Err(e),
        }
    }
    tally.write(tx)?;
    Ok(results)
}

/// The outcome with a platform message id cut to [`MAX_PLATFORM_ID_BYTES`]: an ack is
/// never refused for an id too long to keep.
fn trimmed(outcome: Outcome) -> Outcome {
    match outcome {
        Outcome::Delivered {
            platform_message_id: Some(id),
        } if id.len() > MAX_PLATFORM_ID_BYTES => {
            tracing::warn!(
                bytes = id.len(),
                kept = MAX_PLATFORM_ID_BYTES,
                "platform message id too long; keeping its start"
            );
            Outcome::delivered(Some(cut_at(&id, MAX_PLATFORM_ID_BYTES).to_owned()))
        }
        other => other,
    }
}

/// A delivery that became a dead letter in a transaction, as the dispatcher reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeadLetter {
    pub delivery_id: crate::DeliveryId,
    pub channel: String,
    pub chat_id: String,
    pub error: String,
}

impl DeadLetter {
    /// The dead letters the work on `tx` made so far. A row whose uid cannot be read
    /// (one set aside as corrupt) cannot be named to the application and is left out;
    /// health counts it.
    pub(crate) fn taken(tx: &Tx<'_>) -> Result<Vec<DeadLetter>> {
        let mut out = Vec::new();
        for (delivery, error) in tx.take_dead_letters() {
            let row: Option<(String, String, String)> = tx
                .prepare_cached(
                    "SELECT uid, channel, chat_id FROM outbound_deliveries WHERE id = ?1",
                )?
                .query_row([delivery], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .optional()?;
            if let Some((uid, channel, chat_id)) = row
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

/// A chunk with the delivery facts its transitions need.
#[derive(Debug, Clone)]
pub(crate) struct ChunkRef {
    pub id: i64,
    pub delivery: i64,
    pub index: i64,
    pub status: ChunkStatus,
    pub attempts: u32,
    pub channel: String,
    pub chat_id: String,
    pub created_at: i64,
    /// Chunks in the delivery.
    pub total: i64,
}

/// The query that loads a [`ChunkRef`], followed by a literal condition: SQL built at
/// compile time, so loading a chunk on the hot path formats nothing.
macro_rules! chunk_ref_where {
    ($condition:literal) => {
        concat!(
            "SELECT c.id, c.delivery_id, c.chunk_index, c.status, c.attempts,
                    d.channel, d.chat_id, d.created_at, d.chunk_count
             FROM outbound_delivery_chunks c JOIN outbound_deliveries d
                  ON d.id = c.delivery_id AND ",
            $crate::ids::chunks_of_delivery!("c", "d.id"),
            " WHERE ",
            $condition
        )
    };
}
pub(crate) use chunk_ref_where;

impl ChunkRef {
    pub fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
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

    /// Loads a chunk by id, including the one chunk of a queued delivery whose row is
    /// stored when the delivery becomes active (see `enqueue::stored_at_activation`).
    pub fn load(tx: &Tx<'_>, id: ChunkId) -> Result<ChunkRef> {
        let mut chunk = tx
            .prepare_cached(chunk_ref_where!("c.id = ?1"))?
            .query_row([id.0], Self::from_row)
            .optional()?;
        if chunk.is_none() && id.0 % CHUNK_STRIDE == 0 {
            chunk = tx
                .prepare_cached(
                    "SELECT ?1, id, 0, 'pending', 0, channel, chat_id, created_at, chunk_count
                     FROM outbound_deliveries WHERE id = ?2 AND status = 'queued'",
                )?
                .query_row([id.0, id.0 / CHUNK_STRIDE], Self::from_row)
                .optional()?;
        }
        chunk.ok_or(Error::ChunkNotFound(id))
    }
}

/// The claimed chunk, if the claim still owns it: it carries the claim's token, either
/// The chunk a claim holds (`?1` its id, `?2` its token). Comparisons joined by OR, as
/// `status IN (...)` would build a temporary b-tree of the list on every ack.
pub(crate) const CLAIMED_SQL: &str = chunk_ref_where!(
    "c.id = ?1 AND c.claim_token = ?2
     AND (c.status = 'sending' OR c.status = 'uncertain' OR c.status = 'retry')"
);

/// `sending` or — after its lease ran out and nobody else took it — `uncertain` or
/// `retry`. Every other transition clears the token.
fn claimed(tx: &Tx<'_>, claim: &Claim) -> Result<ChunkRef> {
    let chunk = tx
        .prepare_cached(CLAIMED_SQL)?
        .query_row(params![claim.chunk_id.0, claim.token], ChunkRef::from_row)
        .optional()?;
    chunk.ok_or(Error::StaleClaim {
        chunk: claim.chunk_id,
    })
}

fn apply(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    outcome: Outcome,
    now: i64,
    tally: &mut Tally,
) -> Result<Recorded> {
    if chunk.status == ChunkStatus::Uncertain {
        return settle_held(tx, rules, chunk, outcome, now, tally);
    }
    let whole_channel = matches!(outcome, Outcome::ChannelRateLimited { .. });
    match outcome {
        Outcome::Delivered {
            platform_message_id,
        } => deliver_chunk(
            tx,
            rules,
            chunk,
            platform_message_id.as_deref(),
            now,
            true,
            tally,
        ),
        Outcome::Transient { .. } if crate::sabotage::planted("lost") => {
            deliver_chunk(tx, rules, chunk, None, now, true, tally)
        }
        Outcome::Transient { error } => retry_or_fail(tx, rules, chunk, &error, now),
        Outcome::Ambiguous { error } if crate::sabotage::planted("unexplained_duplicates") => {
            retry_or_fail(tx, rules, chunk, &error, now)
        }
        Outcome::Ambiguous { error } => match rules.policy.channel(&chunk.channel).replay {
            ReplayPolicy::Replay => retry_or_fail(tx, rules, chunk, &error, now),
            ReplayPolicy::Hold => {
                hold_uncertain(tx, rules, chunk, &error, now)?;
                Ok(Recorded::settled(ChunkStatus::Uncertain))
            }
        },
        Outcome::Permanent { error } => {
            fail_chunk(tx, rules, chunk, &error, now)?;
            Ok(Recorded::settled(ChunkStatus::Failed))
        }
        Outcome::RateLimited { retry_after, error }
        | Outcome::ChannelRateLimited { retry_after, error } => {
            let attempts = match charge_rate_limit(tx, rules, chunk, &error, now)? {
                Ok(attempts) => attempts,
                Err(failure) => {
                    fail_chunk(tx, rules, chunk, &failure, now)?;
                    return Ok(Recorded::settled(ChunkStatus::Failed));
                }
            };
            let asked = now.saturating_add(duration_ms(cap_retry_after(retry_after)));
            if whole_channel {
                lane::pause_channel(tx, &chunk.channel, asked)?;
            }
            let paused_until = lane::pause(tx, &chunk.channel, &chunk.chat_id, asked)?;
            // Through the lane, like every due time: a longer pause of the chat holds.
            let due = lane::due_time(tx, &chunk.channel, &chunk.chat_id, paused_until)?;
            reschedule(tx, chunk, ChunkStatus::Retry, attempts, due, Some(&error))?;
            Ok(Recorded::due(ChunkStatus::Retry, due))
        }
    }
}

/// A late outcome for a chunk held `uncertain` after its lease ran out: its delivery was
/// set aside from its lane, so it goes back through the lane like an operator's
/// decision would — delivered (and on to its next chunk, or finalized), retried, or a
/// dead letter. Another ambiguous outcome leaves it held.
fn settle_held(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    outcome: Outcome,
    now: i64,
    tally: &mut Tally,
) -> Result<Recorded> {
    let whole_channel = matches!(outcome, Outcome::ChannelRateLimited { .. });
    // A dead letter: its delivery is out of the lane already, so the lane moves on.
    let fail = |error: &str| -> Result<Recorded> {
        set_held(tx, chunk, ChunkStatus::Failed, error, now)?;
        lane::advance(tx, &rules.policy, &chunk.channel, &chunk.chat_id, now)?;
        Ok(Recorded::settled(ChunkStatus::Failed))
    };
    let (earliest, attempts, error) = match outcome {
        Outcome::Delivered {
            platform_message_id,
        } => {
            return deliver_chunk(
                tx,
                rules,
                chunk,
                platform_message_id.as_deref(),
                now,
                false,
                tally,
            );
        }
        Outcome::Permanent { error } => return fail(&error),
        Outcome::Ambiguous { error } => {
            set_held(tx, chunk, ChunkStatus::Uncertain, &error, now)?;
            return Ok(Recorded::settled(ChunkStatus::Uncertain));
        }
        Outcome::Transient { error } => {
            if let Some(reason) = out_of_budget(rules, chunk, now) {
                return fail(&format!("{error} ({reason})"));
            }
            let backoff = now.saturating_add(
                rules
                    .policy
                    .retry_for(&chunk.channel)
                    .delay_ms(chunk.attempts),
            );
            (backoff, chunk.attempts, error)
        }
        Outcome::RateLimited { retry_after, error }
        | Outcome::ChannelRateLimited { retry_after, error } => {
            let attempts = match charge_rate_limit(tx, rules, chunk, &error, now)? {
                Ok(attempts) => attempts,
                Err(failure) => return fail(&failure),
            };
            let until = now.saturating_add(duration_ms(cap_retry_after(retry_after)));
            if whole_channel {
                lane::pause_channel(tx, &chunk.channel, until)?;
            }
            lane::pause(tx, &chunk.channel, &chunk.chat_id, until)?;
            (until, attempts, error)
        }
    };
    rejoin_lane(tx, rules, chunk, attempts, earliest, Some(&error))?;
    Ok(Recorded::settled(ChunkStatus::Retry))
}

/// Sends a chunk whose delivery was set aside again from its lane, as a requeue would:
/// `retry` with `attempts`, due no earlier than `earliest` once its lane lets it.
fn rejoin_lane(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    attempts: u32,
    earliest: i64,
    error: Option<&str>,
) -> Result<()> {
    tx.prepare_cached(
        "UPDATE outbound_delivery_chunks
         SET status = 'retry', attempts = ?2, due_at = NULL, claim_token = NULL,
             last_error = coalesce(?3, last_error)
         WHERE id = ?1",
    )?
    .execute(params![chunk.id, attempts, error.map(truncate_error)])?;
    lane::rejoin(
        tx,
        &rules.policy,
        chunk.delivery,
        &chunk.channel,
        &chunk.chat_id,
        earliest,
    )
}

/// Rate limits of one attempt budget whose attempt is given back. Past them, each rate
/// limit uses an attempt: a chunk refused as "rate limited" forever (a permanent error
/// misread, a platform that never lets up) still becomes a dead letter.
pub const MAX_REFUNDED_RATE_LIMITS: u32 = 20;

/// The attempts a chunk keeps after a rate limit: one fewer (the attempt given back)
/// for its first [`MAX_REFUNDED_RATE_LIMITS`], the same after that — or, when that
/// leaves it out of budget, `Err` with the dead letter's error.
fn charge_rate_limit(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<std::result::Result<u32, String>> {
    let count: u32 = tx
        .prepare_cached(
            "UPDATE outbound_delivery_chunks SET rate_limits = rate_limits + 1
             WHERE id = ?1 RETURNING rate_limits",
        )?
        .query_row([chunk.id], |r| r.get(0))?;
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

fn retry_or_fail(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<Recorded> {
    if let Some(reason) = out_of_budget(rules, chunk, now) {
        fail_chunk(tx, rules, chunk, &format!("{error} ({reason})"), now)?;
        return Ok(Recorded::settled(ChunkStatus::Failed));
    }
    let backoff = now.saturating_add(
        rules
            .policy
            .retry_for(&chunk.channel)
            .delay_ms(chunk.attempts),
    );
    let due = lane::due_time(tx, &chunk.channel, &chunk.chat_id, backoff)?;
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
    tx: &Tx<'_>,
    chunk: &ChunkRef,
    status: ChunkStatus,
    attempts: u32,
    due: i64,
    error: Option<&str>,
) -> Result<()> {
    tx.prepare_cached(
        "UPDATE outbound_delivery_chunks
         SET status = ?2, attempts = ?3, due_at = ?4, claim_token = NULL,
             last_error = coalesce(?5, last_error)
         WHERE id = ?1",
    )?
    .execute(params![
        chunk.id,
        status.as_str(),
        attempts,
        due,
        error.map(truncate_error)
    ])?;
    Ok(())
}

/// Marks a chunk delivered and moves its delivery on: the next chunk becomes due, or
/// the delivery is finalized. `active` says whether the delivery currently holds its
/// lane (an ack) or was held aside (resolving an `uncertain` chunk), in which case it
/// queues up in its lane again. The result says whether the delivery was finalized.
pub(crate) fn deliver_chunk(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    platform_message_id: Option<&str>,
    now: i64,
    active: bool,
    tally: &mut Tally,
) -> Result<Recorded> {
    tx.prepare_cached(
        "UPDATE outbound_delivery_chunks
         SET status = 'delivered', due_at = NULL, claim_token = NULL,
             platform_message_id = ?2, delivered_at = ?3
         WHERE id = ?1",
    )?
    .execute(params![chunk.id, platform_message_id, now])?;
    if chunk.index + 1 >= chunk.total {
        let lane = (chunk.channel.as_str(), chunk.chat_id.as_str());
        let times = (chunk.created_at, now);
        let refused = finalize::finalize(tx, rules, chunk.delivery, lane, times, tally)?;
        return Ok(Recorded {
            finalized: refused.is_none(),
            finalize_error: refused,
            ..Recorded::settled(ChunkStatus::Delivered)
        });
    }
    // One write to the delivery row: the count, and for an active delivery its status.
    tx.prepare_cached(
        "UPDATE outbound_deliveries
         SET delivered_count = delivered_count + 1, updated_at = ?2,
             status = CASE WHEN ?3 THEN 'partial' ELSE status END
         WHERE id = ?1",
    )?
    .execute(params![chunk.delivery, now, active])?;
    if active {
        let next = chunk.index + 1;
        lane::make_due(
            tx,
            chunk.delivery,
            next,
            &chunk.channel,
            &chunk.chat_id,
            now,
        )?;
    } else {
        lane::rejoin(
            tx,
            &rules.policy,
            chunk.delivery,
            &chunk.channel,
            &chunk.chat_id,
            now,
        )?;
    }
    Ok(Recorded::settled(ChunkStatus::Delivered))
}

/// Fails a chunk for good and its delivery with it (a dead letter); the lane moves on
/// according to the [`LaneFailurePolicy`](crate::LaneFailurePolicy).
pub(crate) fn fail_chunk(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<()> {
    set_aside(tx, rules, chunk, ChunkStatus::Failed, error, now)
}

/// Sets aside a chunk whose row cannot be read (a delivery uid that does not parse,
/// text that is not UTF-8): it and its delivery are failed, the reason is kept in
/// `outbound_deliveries.corrupt` for health and the tool, and its lane moves on. Works
/// from the row ids alone, since the rest of the row may be what is unreadable.
pub(crate) fn set_aside_corrupt(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: i64,
    delivery: i64,
    reason: &str,
    now: i64,
) -> Result<()> {
    let reason = truncate_error(reason);
    tracing::warn!(chunk, delivery, reason, "setting aside an unreadable row");
    tx.note_dead_letter(delivery, reason);
    tx.prepare_cached(
        "UPDATE outbound_delivery_chunks
         SET status = 'failed', due_at = NULL, claim_token = NULL, last_error = ?2
         WHERE id = ?1",
    )?
    .execute(params![chunk, reason])?;
    let lane: Option<(Vec<u8>, Vec<u8>)> = tx
        .prepare_cached(
            "UPDATE outbound_deliveries
             SET status = 'failed', updated_at = ?2, finished_at = ?2, corrupt = ?3
             WHERE id = ?1 RETURNING CAST(channel AS BLOB), CAST(chat_id AS BLOB)",
        )?
        .query_row(params![delivery, now, reason], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?;
    if let Some((channel, chat_id)) = lane
        && let (Ok(channel), Ok(chat_id)) = (String::from_utf8(channel), String::from_utf8(chat_id))
    {
        lane::advance(tx, &rules.policy, &channel, &chat_id, now)?;
    }
    Ok(())
}

/// Holds a chunk that may have been sent as `uncertain` until someone decides.
pub(crate) fn hold_uncertain(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<()> {
    set_aside(tx, rules, chunk, ChunkStatus::Uncertain, error, now)
}

/// Holds a chunk whose lease ran out while `sending` as `uncertain`, keeping the
/// claim's token: the worker that held it may still be alive and report its outcome
/// ([`Outbox::record`] accepts it until someone else decides).
pub(crate) fn hold_abandoned(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    error: &str,
    now: i64,
) -> Result<()> {
    tx.prepare_cached(
        "UPDATE outbound_delivery_chunks
         SET status = 'uncertain', due_at = NULL, last_error = ?2
         WHERE id = ?1",
    )?
    .execute(params![chunk.id, truncate_error(error)])?;
    set_delivery_held(tx, chunk, ChunkStatus::Uncertain, now)?;
    lane::advance(tx, &rules.policy, &chunk.channel, &chunk.chat_id, now)
}

/// Puts a chunk whose lease ran out on a channel that may replay back to `retry`, due
/// at `due`, keeping the claim's token until it is claimed again (see
/// [`hold_abandoned`]).
pub(crate) fn retry_abandoned(tx: &Tx<'_>, chunk: &ChunkRef, due: i64) -> Result<()> {
    tx.prepare_cached(
        "UPDATE outbound_delivery_chunks SET status = 'retry', due_at = ?2 WHERE id = ?1",
    )?
    .execute(params![chunk.id, due])?;
    Ok(())
}

/// Takes a chunk and its delivery out of the lane as `failed` or `uncertain`.
fn set_aside(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    status: ChunkStatus,
    error: &str,
    now: i64,
) -> Result<()> {
    set_held(tx, chunk, status, error, now)?;
    lane::advance(tx, &rules.policy, &chunk.channel, &chunk.chat_id, now)
}

fn set_held(
    tx: &Tx<'_>,
    chunk: &ChunkRef,
    status: ChunkStatus,
    error: &str,
    now: i64,
) -> Result<()> {
    tx.prepare_cached(
        "UPDATE outbound_delivery_chunks
         SET status = ?2, due_at = NULL, claim_token = NULL, last_error = ?3
         WHERE id = ?1",
    )?
    .execute(params![chunk.id, status.as_str(), truncate_error(error)])?;
    if status == ChunkStatus::Failed {
        tx.note_dead_letter(chunk.delivery, truncate_error(error));
    }
    set_delivery_held(tx, chunk, status, now)
}

/// The delivery of a chunk set aside takes the chunk's status (`failed`, `uncertain`).
fn set_delivery_held(tx: &Tx<'_>, chunk: &ChunkRef, status: ChunkStatus, now: i64) -> Result<()> {
    let finished = (status == ChunkStatus::Failed).then_some(now);
    tx.prepare_cached(
        "UPDATE outbound_deliveries SET status = ?2, updated_at = ?3, finished_at = ?4
         WHERE id = ?1",
    )?
    .execute(params![chunk.delivery, status.as_str(), now, finished])?;
    Ok(())
}

fn truncate_error(error: &str) -> &str {
    cut_at(error, MAX_ERROR_BYTES)
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character
/// boundary.
fn cut_at(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}
