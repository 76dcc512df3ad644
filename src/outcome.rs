//! Recording what happened to a claimed send: the outcome decides which transition of
//! the state machine ([`crate::state`]) the chunk takes.

use std::time::Duration;

use crate::claim::Claim;
use crate::classify::{ErrorClass, cap_retry_after, classify_error};
use crate::clock::duration_ms;
use crate::error::{Error, Result};
use crate::finalize::Tally;
use crate::lane;
use crate::outbox::Outbox;
use crate::rules::ReplayPolicy;
use crate::rules::Stored;
use crate::state::{self, Recorded, cut_at};
use crate::status::ChunkStatus;
use crate::store::connections::Announce;
use crate::store::{ChunkRef, LaneRef, StoreTx};

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
    /// The platform says an earlier send of the chunk landed, though it no longer shows
    /// it (Discord answers a resend whose enforced nonce belongs to a message deleted
    /// since with `10008 Unknown Message`): delivered, without an id, and `note` kept
    /// with what the platform was asked about the part.
    DeliveredEarlier {
        /// Why the chunk counts as delivered.
        note: String,
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
    /// [`MAX_REFUNDED_RATE_LIMITS`](crate::limits::MAX_REFUNDED_RATE_LIMITS) rate limits of the chunk's attempt budget; after
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
        // Other processes are not woken (on PostgreSQL a notification serializes the
        // commits that send it): whoever records claims next, and its claim takes what
        // these outcomes made due, as a dispatcher's does; other processes find the
        // rest when they next look (within a second: `ChangeWatcher`).
        self.write_and_wake(Announce::No, |tx, rules| {
            // (A store may run the transaction again: it records from its own copy.)
            let outcomes = outcomes.iter().map(|(claim, o)| (*claim, o.clone()));
            record_in(tx, rules, outcomes, now())
        })
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
    /// [`ReplayPolicy`](crate::rules::ReplayPolicy) decides) or a transient failure (retried
    /// with backoff). So the chunk may well be retried; the name says what is recorded,
    /// not what becomes of it. An adapter that has the platform's answer should map it
    /// with [`platforms`](crate::platforms) instead.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    /// use chunked_outbox::monitoring::ChunkStatus;
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
        self.write_and_wake(Announce::Yes, |tx, rules| {
            tx.lock_lanes(&mut [LaneRef::new(&claim.channel, &claim.chat_id)])?;
            let chunk = claimed(tx, claim)?;
            let now = self.options().now_ms();
            let earliest = now.saturating_add(duration_ms(delay));
            let attempts = chunk.attempts.saturating_sub(1);
            if chunk.status == ChunkStatus::Uncertain {
                // Its lease ran out and it was held as possibly sent; it was not.
                state::rejoin_lane(tx, rules, &chunk, attempts, earliest, None)?;
                return Ok(Recorded::settled(ChunkStatus::Retry));
            }
            let due = tx.lane_due_time(chunk.lane(), earliest)?;
            let status = if attempts == 0 {
                ChunkStatus::Pending
            } else {
                ChunkStatus::Retry
            };
            state::reschedule(tx, &chunk, status, attempts, due, None)?;
            Ok(Recorded::due(status, due))
        })
    }
}

/// Records each outcome in the caller's transaction; a stale claim gets
/// [`Error::StaleClaim`] in its slot and changes nothing. The lanes of every claim are
/// locked first, in order.
pub(crate) fn record_in<C: std::borrow::Borrow<Claim>>(
    tx: &dyn StoreTx,
    rules: &Stored,
    outcomes: impl IntoIterator<Item = (C, Outcome)>,
    now: i64,
) -> Result<Vec<Result<Recorded>>> {
    let outcomes: Vec<(C, Outcome)> = outcomes.into_iter().collect();
    {
        let mut lanes: Vec<LaneRef<'_>> = outcomes
            .iter()
            .map(|(c, _)| LaneRef::new(&c.borrow().channel, &c.borrow().chat_id))
            .collect();
        tx.lock_lanes(&mut lanes)?;
    }
    let mut tally = Tally::default();
    if let Some(results) = delivered_at_once(tx, rules, &outcomes, now, &mut tally)? {
        tally.write(tx)?;
        return Ok(results);
    }
    let mut results = Vec::with_capacity(outcomes.len());
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

/// Records a batch of acks of distinct chunks, all `sending`, as [`apply`] one by one
/// would — each chunk delivered, the next chunk of its delivery made due or the
/// delivery finalized, the lanes of the finalized ones advanced — with the chunks read,
/// the finalizations written and the lanes advanced in one go each. `None` (nothing
/// done) for any other batch, or when the application's finalization statement runs
/// per reply: those take the general path.
fn delivered_at_once<C: std::borrow::Borrow<Claim>>(
    tx: &dyn StoreTx,
    rules: &Stored,
    outcomes: &[(C, Outcome)],
    now: i64,
    tally: &mut Tally,
) -> Result<Option<Vec<Result<Recorded>>>> {
    if rules.finalize_sql.is_some()
        || crate::sabotage::planted("missing_finalizations")
        || crate::sabotage::planted("wrong_finalizations")
    {
        return Ok(None);
    }
    let mut seen = std::collections::HashSet::with_capacity(outcomes.len());
    let mut acks = Vec::with_capacity(outcomes.len());
    for (claim, outcome) in outcomes {
        match outcome {
            Outcome::Delivered {
                platform_message_id,
            } if seen.insert(claim.borrow().chunk_id)
                && platform_message_id.as_deref().is_none_or(storable_as_is) =>
            {
                acks.push(platform_message_id.as_deref());
            }
            // (an id to cut or mend takes the general path: `trimmed`)
            _ => return Ok(None),
        }
    }
    let held: Vec<(i64, i64)> = outcomes
        .iter()
        .map(|(c, _)| (c.borrow().chunk_id.0, c.borrow().token))
        .collect();
    let chunks = tx.claimed_chunks(&held)?;
    if chunks
        .iter()
        .flatten()
        .any(|c| c.status != ChunkStatus::Sending)
    {
        // An `uncertain` chunk settles its delivery's place in the lane: in order.
        return Ok(None);
    }
    let mut results = Vec::with_capacity(outcomes.len());
    // The finalizations counted here are written with them.
    let mut finalized = Tally::default();
    let mut last_chunks = Vec::new();
    let mut lanes = Vec::new();
    for (((claim, _), chunk), platform_message_id) in outcomes.iter().zip(&chunks).zip(acks) {
        let Some(chunk) = chunk else {
            results.push(Err(Error::StaleClaim {
                chunk: claim.borrow().chunk_id,
            }));
            continue;
        };
        if chunk.index + 1 < chunk.total {
            results.push(Ok(state::deliver(
                tx,
                rules,
                chunk,
                platform_message_id,
                now,
                true,
                tally,
            )?));
            continue;
        }
        last_chunks.push((chunk.id, chunk.delivery, platform_message_id));
        finalized.add(&chunk.channel, now, (now - chunk.created_at).max(0));
        lanes.push(chunk.lane());
        results.push(Ok(Recorded {
            finalized: true,
            ..Recorded::settled(ChunkStatus::Delivered)
        }));
    }
    if tx.finalize_delivered(&last_chunks, &finalized.channel_tallies(), now)? != last_chunks.len()
    {
        return Err(Error::invalid(
            "delivery",
            "a delivery to finalize is not stored",
        ));
    }
    finalized.write_activity(tx)?;
    lane::advance_many(tx, &rules.policy, &mut lanes, now)?;
    Ok(Some(results))
}

/// Whether a platform message id is stored as it came (see [`trimmed`]).
fn storable_as_is(id: &str) -> bool {
    id.len() <= MAX_PLATFORM_ID_BYTES && !id.contains('\0')
}

/// The outcome with a platform message id cut to [`MAX_PLATFORM_ID_BYTES`]: an ack is
/// never refused for an id too long to keep.
fn trimmed(outcome: Outcome) -> Outcome {
    match outcome {
        Outcome::Delivered {
            platform_message_id: Some(id),
        } if !storable_as_is(&id) => Outcome::delivered(Some(trimmed_id(&id).to_owned())),
        other => other,
    }
}

/// A platform message id cut to [`MAX_PLATFORM_ID_BYTES`] (see [`trimmed`]; the store
/// mends what it cannot hold: [`state::deliver`]).
fn trimmed_id(id: &str) -> &str {
    if id.len() > MAX_PLATFORM_ID_BYTES {
        tracing::warn!(
            bytes = id.len(),
            kept = MAX_PLATFORM_ID_BYTES,
            "platform message id too long; keeping its start"
        );
    }
    cut_at(id, MAX_PLATFORM_ID_BYTES)
}

/// The chunk `claim` holds, if the claim still owns it: it carries the claim's token
/// and is `sending` or — after its lease ran out and nobody else took it — `uncertain`
/// or `retry`. Every other transition clears the token.
fn claimed(tx: &dyn StoreTx, claim: &Claim) -> Result<ChunkRef> {
    tx.claimed_chunk(claim.chunk_id.0, claim.token)?
        .ok_or(Error::StaleClaim {
            chunk: claim.chunk_id,
        })
}

fn apply(
    tx: &dyn StoreTx,
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
        } => state::deliver(
            tx,
            rules,
            chunk,
            platform_message_id.as_deref(),
            now,
            true,
            tally,
        ),
        Outcome::DeliveredEarlier { note } => {
            deliver_earlier(tx, rules, chunk, &note, now, true, tally)
        }
        Outcome::Transient { .. } if crate::sabotage::planted("lost") => {
            state::deliver(tx, rules, chunk, None, now, true, tally)
        }
        Outcome::Transient { error } => state::retry_or_fail(tx, rules, chunk, &error, now),
        Outcome::Ambiguous { error } if crate::sabotage::planted("unexplained_duplicates") => {
            state::retry_or_fail(tx, rules, chunk, &error, now)
        }
        Outcome::Ambiguous { error } => match rules.policy.channel(&chunk.channel).replay {
            ReplayPolicy::Replay => state::retry_or_fail(tx, rules, chunk, &error, now),
            ReplayPolicy::Hold | ReplayPolicy::Ask => {
                state::hold_uncertain(tx, rules, chunk, &error, now)?;
                Ok(Recorded::settled(ChunkStatus::Uncertain))
            }
        },
        Outcome::Permanent { error } => {
            state::fail(tx, rules, chunk, &error, now)?;
            Ok(Recorded::settled(ChunkStatus::Failed))
        }
        Outcome::RateLimited { retry_after, error }
        | Outcome::ChannelRateLimited { retry_after, error } => {
            let attempts = match state::charge_rate_limit(tx, rules, chunk, &error, now)? {
                Ok(attempts) => attempts,
                Err(failure) => {
                    state::fail(tx, rules, chunk, &failure, now)?;
                    return Ok(Recorded::settled(ChunkStatus::Failed));
                }
            };
            let asked = now.saturating_add(duration_ms(cap_retry_after(retry_after)));
            if whole_channel {
                tx.pause_channel(&chunk.channel, asked)?;
            }
            let paused_until = tx.pause_lane(chunk.lane(), asked)?;
            // Through the lane, like every due time: a longer pause of the chat holds.
            let due = tx.lane_due_time(chunk.lane(), paused_until)?;
            state::reschedule(tx, chunk, ChunkStatus::Retry, attempts, due, Some(&error))?;
            Ok(Recorded::due(ChunkStatus::Retry, due))
        }
    }
}

/// A late outcome for a chunk held `uncertain` after its lease ran out: its delivery was
/// set aside from its lane, so it goes back through the lane like an operator's
/// decision would — delivered (and on to its next chunk, or finalized), retried, or a
/// dead letter. Another ambiguous outcome leaves it held.
/// [`Outcome::DeliveredEarlier`]: delivered without an id (as [`state::deliver`] with
/// `claimed`), the platform's word added to what the part keeps of its answers.
fn deliver_earlier(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    note: &str,
    now: i64,
    claimed: bool,
    tally: &mut Tally,
) -> Result<Recorded> {
    let recorded = state::deliver(tx, rules, chunk, None, now, claimed, tally)?;
    tx.append_settlement(chunk.id, &state::storable_error(note))?;
    Ok(recorded)
}

fn settle_held(
    tx: &dyn StoreTx,
    rules: &Stored,
    chunk: &ChunkRef,
    outcome: Outcome,
    now: i64,
    tally: &mut Tally,
) -> Result<Recorded> {
    let whole_channel = matches!(outcome, Outcome::ChannelRateLimited { .. });
    // A dead letter: its delivery is out of the lane already, so the lane moves on.
    let fail = |error: &str| -> Result<Recorded> {
        state::set_held(tx, chunk, ChunkStatus::Failed, error, now)?;
        lane::advance(tx, &rules.policy, chunk.lane(), now)?;
        Ok(Recorded::settled(ChunkStatus::Failed))
    };
    let (earliest, attempts, error) = match outcome {
        Outcome::Delivered {
            platform_message_id,
        } => {
            return state::deliver(
                tx,
                rules,
                chunk,
                platform_message_id.as_deref(),
                now,
                false,
                tally,
            );
        }
        Outcome::DeliveredEarlier { note } => {
            return deliver_earlier(tx, rules, chunk, &note, now, false, tally);
        }
        Outcome::Permanent { error } => return fail(&error),
        Outcome::Ambiguous { error } => {
            state::set_held(tx, chunk, ChunkStatus::Uncertain, &error, now)?;
            return Ok(Recorded::settled(ChunkStatus::Uncertain));
        }
        Outcome::Transient { error } => {
            if let Some(reason) = state::out_of_budget(rules, chunk, now) {
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
            let attempts = match state::charge_rate_limit(tx, rules, chunk, &error, now)? {
                Ok(attempts) => attempts,
                Err(failure) => return fail(&failure),
            };
            let until = now.saturating_add(duration_ms(cap_retry_after(retry_after)));
            if whole_channel {
                tx.pause_channel(&chunk.channel, until)?;
            }
            tx.pause_lane(chunk.lane(), until)?;
            (until, attempts, error)
        }
    };
    state::rejoin_lane(tx, rules, chunk, attempts, earliest, Some(&error))?;
    Ok(Recorded::settled(ChunkStatus::Retry))
}
