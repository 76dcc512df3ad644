//! Claiming due chunks under a lease, and recovering expired leases.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::clock::{duration_ms, to_datetime};
use crate::error::{Error, Result};
use crate::ids::{ChunkId, DeliveryId, chunk_idempotency_key};
use crate::outbox::Outbox;
use crate::rules::Stored;
use crate::state::{self, Expired};
use crate::status::ChunkStatus;
use crate::store::connections::Announce;
use crate::store::{ChannelRow, LaneRef, StoreTx, channel_rows};

/// Most chunks one [`Outbox::claim`] may hand out: one claim transaction holds the
/// database's write lock, so it must stay short.
pub const MAX_CLAIM_BATCH: usize = 10_000;

/// One chunk handed to a worker: everything needed to send it, plus the fencing token.
///
/// Record its outcome with [`Outbox::record`] (or [`ack`](Outbox::ack),
/// [`record_error_text`](Outbox::record_error_text), [`release`](Outbox::release)) before
/// [`lease_until`](Self::lease_until).
///
/// **Drop behaviour:** dropping a claim records nothing. The chunk stays `sending` until
/// its lease expires; then the next claim or [`Outbox::recover`] treats it like a crash
/// mid-send, following the channel's [`ReplayPolicy`](crate::rules::ReplayPolicy). Call
/// [`release`](Outbox::release) for claims you decide not to start.
#[derive(Clone, PartialEq, Eq)]
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
    /// The delivery's metadata, as given at enqueue
    /// ([`NewDelivery::with_metadata`](crate::NewDelivery::with_metadata)).
    pub metadata: Option<String>,
    pub(crate) token: i64,
    /// Whether the chunk's previous send ended by its lease running out: it may be what
    /// crashed that process, so it is sent alone (see [`Isolation`]).
    pub(crate) suspect: bool,
}

/// The message text and metadata are shown by length only, and the fencing token not at
/// all: a claim logged with `{:?}` leaks neither what the user is told nor what would
/// settle the chunk.
impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("chunk_id", &self.chunk_id)
            .field("delivery_id", &self.delivery_id)
            .field("channel", &self.channel)
            .field("chat_id", &self.chat_id)
            .field("index", &self.index)
            .field("total", &self.total)
            .field("text", &format_args!("<{} bytes>", self.text.len()))
            .field("idempotency_key", &self.idempotency_key)
            .field("attempt", &self.attempt)
            .field("lease_until", &self.lease_until)
            .field(
                "metadata",
                &self
                    .metadata
                    .as_ref()
                    .map(|m| format!("<{} bytes>", m.len())),
            )
            .finish_non_exhaustive()
    }
}

impl Claim {
    /// A claim of no outbox, to unit-test an adapter without a database: the first of
    /// one chunk, attempt 1, under a lease of a minute from now, no metadata. Its fields
    /// are public, so a test sets whatever else it needs. Recording its outcome in an
    /// outbox fails with [`Error::StaleClaim`](crate::Error::StaleClaim): it holds no
    /// chunk there.
    ///
    /// ```
    /// use chunked_outbox::{ChannelAdapter, Claim, Outcome};
    ///
    /// struct Echo;
    /// impl ChannelAdapter for Echo {
    ///     fn send(&self, claim: &Claim) -> Outcome {
    ///         Outcome::delivered(Some(format!("{}:{}", claim.chat_id, claim.text)))
    ///     }
    /// }
    ///
    /// let mut claim = Claim::for_testing("telegram", "42", "hello");
    /// claim.metadata = Some(r#"{"reply_to_message_id": 7}"#.into());
    /// assert_eq!(Echo.send(&claim), Outcome::delivered(Some("42:hello".into())));
    /// assert!(!format!("{claim:?}").contains("hello"), "Debug shows no text");
    /// ```
    pub fn for_testing(
        channel: impl Into<String>,
        chat_id: impl Into<String>,
        text: impl Into<String>,
    ) -> Claim {
        let delivery_id = DeliveryId::from(uuid::Uuid::nil());
        Claim {
            chunk_id: ChunkId(0),
            idempotency_key: chunk_idempotency_key(&delivery_id, 0),
            delivery_id,
            channel: channel.into(),
            chat_id: chat_id.into(),
            index: 0,
            total: 1,
            text: text.into(),
            attempt: 1,
            lease_until: Utc::now() + chrono::Duration::minutes(1),
            metadata: None,
            token: 0,
            suspect: false,
        }
    }

    /// This chunk's key in [`COMPACT_KEY_LEN`](crate::ids::COMPACT_KEY_LEN) characters, for
    /// Discord's `nonce` and other short key fields (see
    /// [`chunk_compact_key`](crate::ids::chunk_compact_key)).
    pub fn compact_key(&self) -> String {
        crate::ids::chunk_compact_key(&self.delivery_id, self.index)
    }

    /// This chunk's key as a UUID, for LINE's `X-Line-Retry-Key` (see
    /// [`chunk_key_uuid`](crate::ids::chunk_key_uuid)).
    pub fn key_uuid(&self) -> uuid::Uuid {
        crate::ids::chunk_key_uuid(&self.delivery_id, self.index)
    }
}

/// What [`Outbox::recover`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
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

/// How a claim treats a *suspect*: a chunk whose previous send ended by its lease
/// running out (reclaimed from `sending`, or put back to `retry` by recovery with its
/// claim's token). It may be what crashed that process, and every chunk in flight with
/// it when the crash came was charged an attempt: sent beside other chunks again, it
/// would charge them at every crash until an innocent reply ran out of attempts. So a
/// suspect is sent alone, and a crash while it is alone charges only itself. A
/// dispatcher holds its other sends back for one lease of the suspect at most (and a
/// suspect for one lease of the sends before it): a send that hangs beyond that is left
/// to its worker, and the other chats are served (see `dispatcher::Run`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// Nothing else of the claimer is in flight: a suspect is claimed only as the whole
    /// of a claim (first in due order; a claim stops before a later one).
    Alone,
    /// The claimer has sends in flight: a claim stops at the first suspect in due order
    /// and claims nothing more, so the claimer drains and then takes the suspect alone.
    Busy,
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
    /// [`LaneOrder::Fifo`](crate::rules::LaneOrder::Fifo) only the active delivery of a lane.
    /// Concurrent claimers never receive the same chunk.
    ///
    /// A chunk whose previous claim's lease ran out (its process may have crashed on
    /// it) is handed out alone: a claim returns it by itself when it comes first in due
    /// order, and stops before it otherwise. Sent alone, a chunk that crashes its
    /// process charges only itself; a dispatcher also sends nothing else while one is
    /// in flight.
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
        // A claim loop hears of replies staged by applications' transactions too.
        self.listen_for_staged();
        self.write(|tx, rules| {
            let now = self.options().now_ms();
            let (claims, _) = claim_in(tx, self, rules, channels, limit, Isolation::Alone, now)?;
            Ok(claims)
        })
    }

    /// Extends the leases of claims this process still holds to a full lease from now;
    /// per claim, the new expiry, or `None` if the claim no longer owns its chunk.
    pub(crate) fn renew_leases(&self, claims: &[(ChunkId, i64)]) -> Result<Vec<Option<i64>>> {
        let options = self.options();
        self.write(|tx, _| {
            let until = options.now_ms().saturating_add(duration_ms(options.lease));
            // One conditional write per claim: no read to act on, so no lock.
            claims
                .iter()
                .map(|(chunk, token)| Ok(tx.renew_lease(chunk.0, *token, until)?.then_some(until)))
                .collect()
        })
    }

    /// When the next chunk of these channels (all, for `None`) may be claimed: it
    /// becomes due, its lease expires, or its channel's rate allows its next send;
    /// `None` if nothing is scheduled. A read of one index entry per channel; dispatchers
    /// sleep until then.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn next_due(&self, channels: Option<&[&str]>) -> Result<Option<DateTime<Utc>>> {
        let due = self.read(|tx| {
            let mut earliest: Option<i64> = None;
            for channel in channel_rows(tx, channels)? {
                if let Some(due) = tx.next_due(channel.id)? {
                    let due = due.max(channel.rate_slot());
                    earliest = Some(earliest.map_or(due, |e| e.min(due)));
                }
            }
            Ok(earliest)
        })?;
        Ok(due.map(to_datetime))
    }

    /// Settles `sending` chunks whose worker is gone, then finalizes deliveries whose
    /// chunks are all delivered but which were never written to `outbound_messages`.
    ///
    /// Each abandoned chunk follows its channel's stored [`ReplayPolicy`](crate::rules::ReplayPolicy): `retry` (due
    /// now) if the channel may replay, `uncertain` otherwise, `failed` if its attempts
    /// are used up. Claiming does the same for expired leases as it meets them, so
    /// calling this is only needed at start-up.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    /// use chunked_outbox::clock::ManualClock;
    /// use chunked_outbox::maintenance::RecoverScope;
    ///
    /// let clock = ManualClock::new(1_767_225_600_000);
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default().with_clock(Arc::new(clock.clone())))?;
    /// outbox.enqueue(&NewDelivery::single("telegram", "42", "hi"))?;
    /// let claim = outbox.claim(1)?.remove(0);
    /// drop(claim); // the worker died mid-send
    /// clock.advance(Duration::from_secs(120)); // past its lease
    /// let report = outbox.recover(RecoverScope::ExpiredLeases)?;
    /// // Telegram cannot deduplicate, so the default policy holds it for a decision.
    /// assert_eq!(report.held_uncertain, 1);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Busy`] and other database errors; nothing is changed then.
    pub fn recover(&self, scope: RecoverScope) -> Result<RecoveryReport> {
        self.write_and_wake(Announce::Yes, |tx, rules| {
            let now = self.options().now_ms();
            if crate::enqueue::activate_staged(tx, self, rules, now)? {
                self.hint_staged();
            }
            let limit = match scope {
                RecoverScope::ExpiredLeases => now,
                RecoverScope::AllSending => i64::MAX,
            };
            let mut report = RecoveryReport::default();
            for channel in channel_rows(tx, None)? {
                let listed = tx.expired_sending(channel.id, limit)?;
                if listed.is_empty() {
                    continue;
                }
                let mut lanes: Vec<LaneRef<'_>> = listed.iter().map(|c| c.lane()).collect();
                tx.lock_lanes(&mut lanes)?;
                // Read again under the lanes: a claim may have taken one meanwhile.
                for chunk in tx.expired_sending(channel.id, limit)? {
                    if !lanes.contains(&chunk.lane()) {
                        continue;
                    }
                    match state::expire(tx, rules, &chunk, now)? {
                        Expired::Replayable => {
                            state::retry_abandoned(tx, &chunk, now)?;
                            report.retried += 1;
                        }
                        Expired::Held => report.held_uncertain += 1,
                        Expired::Exhausted => report.failed += 1,
                    }
                }
            }
            report.finalized = crate::finalize::sweep(tx, rules, now)?;
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

impl ChannelRow {
    /// The earliest time, ms (rounded up), the channel lets a send start: its rate's
    /// next slot, or the end of a rate limit of the whole channel
    /// ([`LaneStore::pause_channel`](crate::store::LaneStore::pause_channel)),
    /// whichever is later.
    fn rate_slot(&self) -> i64 {
        let slot = match self.next_send_at_us {
            Some(at) if self.interval_us > 0 => at.saturating_add(999).div_euclid(1000),
            _ => i64::MIN,
        };
        slot.max(self.paused_until.unwrap_or(i64::MIN))
    }

    /// The slot after one taken at `now` (ms): one interval after the slot the send
    /// was scheduled for if it started at most a millisecond after that, else one
    /// interval after `now`. The clock reads whole milliseconds, so without keeping the
    /// schedule a rate of 195/s (5,129 µs) would run at one send per 6 ms; and a send
    /// that comes later than that starts a new schedule, so lateness never turns into
    /// a burst.
    fn slot_after(&self, now: i64) -> i64 {
        let now_us = now.saturating_mul(1000);
        let scheduled = match self.next_send_at_us {
            Some(at) if at >= now_us.saturating_sub(1000) => at,
            _ => now_us,
        };
        scheduled.saturating_add(self.interval_us)
    }
}

/// Claims up to `limit` due chunks in the caller's transaction (see [`Outbox::claim`]).
///
/// Each channel's due chunks are a range of the claim index of its own; the oldest due
/// of all of them go first. A channel whose rate has no slot yet is not read at all; a
/// channel with a rate gives at most one chunk, and takes its next slot. A chunk whose
/// lane another transaction holds is left for the next claim (claims never wait); one
/// whose lane interval has not passed since the lane's last send is pushed back to when
/// it has; a row that cannot be read is set aside as corrupt.
pub(crate) fn claim_in(
    tx: &dyn StoreTx,
    outbox: &Outbox,
    rules: &Stored,
    channels: Option<&[&str]>,
    limit: usize,
    isolation: Isolation,
    now: i64,
) -> Result<(Vec<Claim>, bool)> {
    // Replies staged by applications' transactions join their lanes first.
    if outbox.take_staged_hint() {
        // Said again when more may wait, and when this fails: the transaction is rolled
        // back, and its store may run it again (see `Store::write`).
        let more = crate::enqueue::activate_staged(tx, outbox, rules, now);
        if !matches!(more, Ok(false)) {
            outbox.hint_staged();
        }
        more?;
    }
    let lease_until = now.saturating_add(duration_ms(outbox.options().lease));
    let mut candidates = Vec::new();
    let mut paced = Vec::new();
    // Channels the file has never seen have no chunks and are left out.
    for (channel, due) in tx.due_in_channels(channels, now, limit)? {
        let paced_channel = channel.interval_us > 0;
        // A paced channel's slot is read, decided on and written: held until the claim
        // commits, or skipped if another claim holds it.
        let channel = if paced_channel {
            match tx.lock_channel_slot(channel)? {
                Some(channel) => channel,
                None => continue,
            }
        } else {
            channel
        };
        if channel.rate_slot() > now {
            continue;
        }
        let take = if paced_channel {
            paced.push((channel.id, channel.slot_after(now)));
            1
        } else {
            limit
        };
        match due {
            // Read with the channel (no rate, no pause).
            Some(due) => candidates.extend(due),
            None => candidates.extend(tx.due_chunks(&channel, now, take)?),
        }
    }
    candidates.sort_by_key(|c| c.due_at);
    // The lanes of the first `limit` readable candidates are tried in one go (most
    // claims take those); a lane further down is tried when the loop gets there.
    let first: Vec<LaneRef<'_>> = candidates
        .iter()
        .filter_map(|c| c.row.as_ref().ok())
        .take(limit)
        .map(|c| c.chunk.lane())
        .collect();
    let mut first_locked = tx.try_lock_lanes(&first)?.into_iter();
    let mut claims = Vec::with_capacity(limit.min(candidates.len()));
    let mut sending = Vec::with_capacity(claims.capacity());
    let mut slots_taken = Vec::new();
    let mut held_back = false;
    for candidate in candidates {
        if claims.len() == limit {
            break;
        }
        let c = match candidate.row {
            Ok(c) => c,
            Err(reason) => {
                state::set_aside_corrupt(
                    tx,
                    rules,
                    candidate.chunk,
                    candidate.delivery,
                    &reason,
                    now,
                )?;
                continue;
            }
        };
        let locked = match first_locked.next() {
            Some(locked) => locked,
            None => tx.try_lock_lane(c.chunk.lane())?,
        };
        if !locked {
            continue;
        }
        if c.chunk.status == ChunkStatus::Sending
            && state::expire(tx, rules, &c.chunk, now)? != Expired::Replayable
        {
            continue;
        }
        if let Some(reason) = state::out_of_budget(rules, &c.chunk, now) {
            state::fail(tx, rules, &c.chunk, &reason, now)?;
            continue;
        }
        if let Some(by) = c.resend_by.filter(|by| now >= *by) {
            state::hold_late_resend(tx, rules, &c.chunk, by, now)?;
            continue;
        }
        // A due time set through the lane already waits out pauses and intervals as
        // they stood; a lease expiry did not, and under a lane interval another
        // delivery of the chat (parallel lanes) may have started a send since.
        let reclaimed = c.chunk.status == ChunkStatus::Sending;
        if reclaimed
            || !rules
                .policy
                .channel(&c.chunk.channel)
                .lane_interval
                .is_zero()
        {
            let lane_free = tx.lane_due_time(c.chunk.lane(), now)?;
            if lane_free > now {
                tx.set_due(c.chunk.id, lane_free)?;
                continue;
            }
        }
        let suspect = c.suspect;
        if suspect && (isolation == Isolation::Busy || !claims.is_empty()) {
            // Alone, or not now: what is in flight first, then this chunk by itself.
            held_back = true;
            break;
        }
        let token = outbox.next_token();
        sending.push((c.chunk.id, token));
        crate::lane::note_send(tx, rules, c.chunk.lane(), now)?;
        if let Some(slot) = paced.iter().find(|(id, _)| *id == candidate.channel_id) {
            slots_taken.push(*slot);
        }
        claims.push(Claim {
            chunk_id: ChunkId(c.chunk.id),
            idempotency_key: chunk_idempotency_key(&c.uid, c.chunk.index as u32),
            delivery_id: c.uid,
            channel: c.chunk.channel,
            chat_id: c.chunk.chat_id,
            index: c.chunk.index as u32,
            total: c.chunk.total as u32,
            text: c.text,
            attempt: c.chunk.attempts + 1,
            lease_until: to_datetime(lease_until),
            metadata: c.metadata,
            token,
            suspect,
        });
        if suspect {
            break;
        }
    }
    tx.mark_sending_many(&sending, now, lease_until)?;
    for (channel, next) in slots_taken {
        tx.set_channel_slot(channel, next)?;
    }
    Ok((claims, held_back))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::clock::ManualClock;
    use crate::enqueue::NewDelivery;
    use crate::options::OutboxOptions;
    use crate::outbox::Outbox;
    use crate::outcome::Outcome;

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
