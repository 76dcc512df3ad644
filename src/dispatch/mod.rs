//! Running the claim → send → record loop: the dispatchers, their builders and
//! handles, the adapter traits, and what a run reports.
//!
//! [`Dispatcher`] runs the loop on threads, for CLI agents and simple bots;
//! [`AsyncDispatcher`] (feature `tokio`) runs it as tasks for async engines. Both take
//! one adapter per channel ([`ChannelAdapter`], [`AsyncChannelAdapter`]); ready ones for
//! teloxide, serenity and slack-morphism are in [`platforms`](crate::platforms#ready-adapters).

// Both dispatchers share `Core` and one `Run` per start. The promises both keep, and
// where each is kept:
//
// * **A claim is a send in flight.** A worker claims exactly the chunks it is about to
//   send at once (`Settings::batch`, one by default), so a crash can leave at most
//   that many chunks possibly sent per worker (`Core::step`).
// * **A known outcome is durable before the next send starts**: the outcomes of a
//   worker's sends are recorded in the same transaction that claims its next ones, and
//   a record that fails with `Busy` or `DiskFull`, or for a lost connection to a
//   PostgreSQL server, is retried — the claim's token makes that safe — before
//   anything new is claimed (`Core::step`).
// * **No send on a lease that cannot cover it**: a claim with less than a quarter of
//   its lease left is given back unsent (`Shared::admit`), and the run's keeper
//   thread renews the leases of claims it still holds (`keep_leases`).
// * **An adapter's panic is an ambiguous send**, not a dead worker (`guarded`).

mod blocking;
mod builder;
#[cfg(feature = "tokio")]
pub(crate) mod tokio;

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{Span, debug, info, info_span, warn};

use crate::claim::Claim;
use crate::claim::Isolation;
use crate::clock::duration_ms;
use crate::error::{Error, Result};
use crate::ids::{ChunkId, DeliveryId};
use crate::outbox::Outbox;
use crate::outcome::Outcome;
use crate::rules::ReplayPolicy;
use crate::settle::{Decision, PossiblySent, Settlement};
use crate::state::Recorded;
use crate::status::ChunkStatus;
use crate::store::connections::ChangeWatch;
use crate::telemetry;

#[cfg(feature = "tokio")]
pub use self::tokio::{
    AsyncChannelAdapter, AsyncDispatcher, AsyncDispatcherBuilder, RunningAsyncDispatcher,
    SendFuture,
};
pub use blocking::{Dispatcher, RunningDispatcher};
pub use builder::{DispatcherBuilder, ShutdownReport};

/// The application's code that talks to one platform (Telegram, Slack, ...).
///
/// `send` gets everything needed for one chunk — ids, chat, index and total, text, the
/// stable idempotency key and the attempt number — and reports a typed [`Outcome`].
/// It should bound its own I/O with a timeout: a dispatcher shuts down only once
/// in-flight sends return (or set
/// [`send_timeout`](crate::dispatch::DispatcherBuilder::send_timeout)). A panic is caught and
/// recorded as an [`Outcome::Ambiguous`] send; the worker carries on.
///
/// How the channel's chunks are treated — whether a possibly-sent chunk may be
/// replayed, how fast its chats and the channel may be sent to, its retry policy — is
/// not the adapter's to say: those rules are stored in the outbox file
/// ([`ChannelPolicy`](crate::rules::ChannelPolicy)), so that every process on the file follows
/// the same ones.
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, Outbox, OutboxOptions, Outcome};
/// use chunked_outbox::rules::ChannelPolicy;
///
/// struct Matrix;
///
/// impl ChannelAdapter for Matrix {
///     fn send(&self, claim: &Claim) -> Outcome {
///         // PUT /rooms/{claim.chat_id}/send/m.room.message/{claim.idempotency_key} ...
///         Outcome::delivered(Some("$event-id".into()))
///     }
/// }
///
/// // Matrix deduplicates by transaction id, so a possibly-sent chunk may be replayed.
/// let rules = ChannelPolicy::replayable().with_lane_interval(Duration::from_millis(200));
/// let outbox = Outbox::open_in_memory(OutboxOptions::default().with_channel("matrix", rules))?;
/// let dispatcher = Dispatcher::builder(outbox).adapter("matrix", Matrix).build()?;
/// # Ok::<(), chunked_outbox::Error>(())
/// ```
pub trait ChannelAdapter: Send + Sync + 'static {
    /// Sends one chunk and says what happened.
    fn send(&self, claim: &Claim) -> Outcome;

    /// Asks the platform about a part that may have reached it, on a channel whose
    /// stored replay policy is [`Ask`](crate::rules::ReplayPolicy::Ask): found (it is
    /// delivered), absent or safe to resend (it is sent again under the same key), or
    /// cannot tell (a person decides). See [`settle`](crate::settle). Bound the I/O
    /// with a timeout. The default cannot ask: it holds the part for a person.
    fn settle(&self, part: &PossiblySent) -> Settlement {
        cannot_ask(part)
    }
}

/// An adapter shared with the rest of the application serves as one too.
impl<T: ChannelAdapter + ?Sized> ChannelAdapter for std::sync::Arc<T> {
    fn send(&self, claim: &Claim) -> Outcome {
        (**self).send(claim)
    }

    fn settle(&self, part: &PossiblySent) -> Settlement {
        (**self).settle(part)
    }
}

/// The answer of an adapter that has no way to ask its platform.
pub(crate) fn cannot_ask(part: &PossiblySent) -> Settlement {
    Settlement::hold(
        format!("the {} adapter", part.claim.channel),
        "it has no way to ask its platform",
    )
}

/// Parts of one channel asked about in one round of settling.
pub(crate) const SETTLE_BATCH: usize = 16;

/// Most sends one worker may have in flight at once ([`DispatcherBuilder::batch_size`]).
pub(crate) const MAX_IN_FLIGHT: usize = 1024;

/// What a dispatcher reports to the application as it happens (see
/// [`DispatcherBuilder::on_event`](crate::dispatch::DispatcherBuilder::on_event)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DispatchEvent {
    /// Every chunk of a reply reached its chat, and the reply was finalized.
    Finalized {
        /// The reply.
        delivery_id: DeliveryId,
        /// Its channel.
        channel: String,
        /// Its chat.
        chat_id: String,
        /// The platform's message id of each chunk, in order (`None` where the adapter
        /// gave none).
        platform_message_ids: Vec<Option<String>>,
    },
    /// Every chunk of a reply reached its chat, but the application's finalization
    /// statement refused its history row: the reply is
    /// [`Unfinalized`](crate::monitoring::DeliveryStatus::Unfinalized) until the
    /// statement takes it
    /// ([`Outbox::finalize_again`](crate::Outbox::finalize_again), or recovery once the
    /// table is fixed).
    Unfinalized {
        /// The reply.
        delivery_id: DeliveryId,
        /// Its channel.
        channel: String,
        /// Its chat.
        chat_id: String,
        /// The platform's message id of each chunk, in order (`None` where the adapter
        /// gave none).
        platform_message_ids: Vec<Option<String>>,
        /// What the statement met.
        error: String,
    },
    /// The platform was asked about a part that may have reached it (channel replay
    /// policy [`Ask`](crate::rules::ReplayPolicy::Ask)), and its answer was recorded on
    /// the part (see [`settle`](crate::settle)).
    Settled {
        /// The reply.
        delivery_id: DeliveryId,
        /// The part's position in the reply.
        index: u32,
        /// Its channel.
        channel: String,
        /// Its chat.
        chat_id: String,
        /// What was asked, what was answered, what it decided.
        settlement: Settlement,
    },
    /// A reply became a dead letter: a chunk failed for good.
    DeadLetter {
        /// The reply.
        delivery_id: DeliveryId,
        /// Its channel.
        channel: String,
        /// Its chat.
        chat_id: String,
        /// Why the chunk failed.
        error: String,
    },
}

/// Where a dispatcher's events go.
pub(crate) type EventSink = Arc<dyn Fn(&DispatchEvent) + Send + Sync>;

/// Settings shared by both dispatcher flavours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settings {
    pub workers: usize,
    /// Sends one worker has in flight at once; it claims exactly that many.
    pub batch: usize,
    pub poll_interval: Duration,
    /// A send that has not returned by then is recorded as ambiguous.
    pub send_timeout: Option<Duration>,
    /// How often the platforms are asked about the parts held uncertain.
    pub settle_interval: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            workers: 2,
            batch: 1,
            poll_interval: Duration::from_millis(50),
            send_timeout: None,
            settle_interval: Duration::from_secs(1),
        }
    }
}

impl Settings {
    pub(crate) fn validate(&self) -> Result<()> {
        if self.workers == 0 {
            return Err(Error::invalid("workers", "must be at least 1"));
        }
        if self.batch == 0 || self.batch > MAX_IN_FLIGHT {
            return Err(Error::invalid(
                "batch size",
                format!("{} is outside 1..={MAX_IN_FLIGHT}", self.batch),
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::invalid("poll interval", "must be above zero"));
        }
        if self.settle_interval.is_zero() {
            return Err(Error::invalid("settle interval", "must be above zero"));
        }
        if self.send_timeout.is_some_and(|t| t.is_zero()) {
            return Err(Error::invalid(
                "send timeout",
                "must be above zero (None for no timeout)",
            ));
        }
        Ok(())
    }
}

/// Counters of what a dispatcher did since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DispatchStats {
    /// Chunks handed to an adapter.
    pub sent: u64,
    /// Chunks the platform accepted.
    pub delivered: u64,
    /// Deliveries finalized into `outbound_messages`.
    pub finalized: u64,
    /// Sends that will be retried.
    pub retried: u64,
    /// Chunks that failed for good.
    pub failed: u64,
    /// Chunks held as uncertain.
    pub uncertain: u64,
    /// Claims given back unsent: too little of the lease was left to start the send, or
    /// the dispatcher was stopping.
    pub released: u64,
    /// Claims that failed (busy or failing database) and outcomes refused as stale (the
    /// chunk was taken over or settled by someone else meanwhile).
    pub errors: u64,
    /// Known outcomes that could not be recorded even after retrying for a lease: their
    /// chunks are settled by lease expiry instead (possibly as `uncertain`). Should stay
    /// 0; alert on it.
    pub dropped: u64,
    /// Adapter panics, each recorded as an ambiguous send.
    pub panics: u64,
    /// Sends that did not return within the send timeout, recorded as ambiguous.
    pub timed_out: u64,
    /// Lease renewals of claims a running dispatcher still held.
    pub renewed: u64,
    /// Records retried after the database was busy or full.
    pub record_retries: u64,
    /// Possibly-sent parts the platform said it has: delivered without a person.
    pub settled_delivered: u64,
    /// Possibly-sent parts the platform said it lacks or will deduplicate: sent again.
    pub settled_resent: u64,
    /// Possibly-sent parts the platform could not tell about: held for a person.
    pub settled_held: u64,
    /// Questions the platform answered "not yet" (a rate limit, a lookup too early):
    /// asked again later, nothing recorded.
    pub settled_later: u64,
}

#[derive(Debug, Default)]
struct Counters {
    sent: AtomicU64,
    delivered: AtomicU64,
    finalized: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
    uncertain: AtomicU64,
    released: AtomicU64,
    errors: AtomicU64,
    dropped: AtomicU64,
    panics: AtomicU64,
    timed_out: AtomicU64,
    renewed: AtomicU64,
    record_retries: AtomicU64,
    settled_delivered: AtomicU64,
    settled_resent: AtomicU64,
    settled_held: AtomicU64,
    settled_later: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    add(counter, 1);
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    fn snapshot(&self) -> DispatchStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DispatchStats {
            sent: get(&self.sent),
            delivered: get(&self.delivered),
            finalized: get(&self.finalized),
            retried: get(&self.retried),
            failed: get(&self.failed),
            uncertain: get(&self.uncertain),
            released: get(&self.released),
            errors: get(&self.errors),
            dropped: get(&self.dropped),
            panics: get(&self.panics),
            timed_out: get(&self.timed_out),
            renewed: get(&self.renewed),
            record_retries: get(&self.record_retries),
            settled_delivered: get(&self.settled_delivered),
            settled_resent: get(&self.settled_resent),
            settled_held: get(&self.settled_held),
            settled_later: get(&self.settled_later),
        }
    }
}

/// One start of a dispatcher: its stop flag, the claims it holds, and its workers'
/// lives. A dispatcher can be started again after a shutdown; each start gets its own.
#[derive(Default)]
pub(crate) struct Run {
    stopping: AtomicBool,
    /// Claims this run holds (in flight, or waiting for their outcome to be recorded),
    /// with their token and lease expiry (outbox clock, ms), for the keeper to renew,
    /// and the end of their first lease, until which they count for isolation (below).
    held: Mutex<HashMap<ChunkId, (i64, i64, i64)>>,
    /// The held claims that are suspects (see `claim::Isolation`): while one is in
    /// flight, nothing else of this process is claimed — for one lease at most. A send
    /// still in flight after its first lease (one that hangs, with no send timeout) no
    /// longer holds the others back, and is left to its worker like any send that
    /// outlived its lease: the other chats are served.
    suspects: Mutex<HashSet<ChunkId>>,
    /// Whether the last claim stopped at a suspect because other sends were in
    /// flight: the workers then wait until those are recorded, not for a due time.
    held_back: AtomicBool,
    /// One worker at a time decides what it may claim and holds what it claimed, so
    /// two workers cannot each put a suspect (or a suspect and another send) in flight.
    claim_turn: Mutex<()>,
    /// Workers still running; the keeper stops once none is left.
    live: AtomicUsize,
    /// Wakes the keeper, the settler and the watcher when the last worker ends (and
    /// the keeper when a claim is held again, the settler when a part turned uncertain).
    keeper: (Mutex<()>, Condvar),
    /// The keeper sleeps without a deadline, nothing being held: the next claim wakes
    /// it (one wake-up per idle spell, not one per claim).
    keeper_parked: AtomicBool,
    /// Parts this run recorded as uncertain: a new one ends the settler's wait.
    uncertain: AtomicU64,
    /// The same for the async flavour's settler, a task.
    #[cfg(feature = "tokio")]
    pub(crate) settle_now: ::tokio::sync::Notify,
}

impl Run {
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        // The watcher returns at once rather than at its next look.
        self.wake_keepers();
    }

    fn hold(&self, claims: &[Claim]) {
        {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            let mut suspects = self.suspects.lock().unwrap_or_else(|e| e.into_inner());
            for c in claims {
                let until = c.lease_until.timestamp_millis();
                held.insert(c.chunk_id, (c.token, until, until));
                if c.suspect {
                    suspects.insert(c.chunk_id);
                }
            }
        }
        // (After the claims are in: a keeper that parks after this finds them.)
        if !claims.is_empty() && self.keeper_parked.swap(false, Ordering::SeqCst) {
            self.wake_keepers();
        }
    }

    /// Wakes the threads waiting on the run's condition (the keeper, the settler, the
    /// watcher), under its lock so none misses it between its check and its wait.
    fn wake_keepers(&self) {
        let (lock, wake) = &self.keeper;
        let _guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        wake.notify_all();
    }

    /// Notes a part recorded as uncertain: the settler asks about it at once.
    fn note_uncertain(&self) {
        self.uncertain.fetch_add(1, Ordering::SeqCst);
        self.wake_keepers();
        #[cfg(feature = "tokio")]
        self.settle_now.notify_one();
    }

    fn let_go(&self, chunk: ChunkId) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&chunk);
        self.suspects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&chunk);
    }

    /// Whether claims other than those of `done` (about to be recorded) are in flight
    /// within their first lease at `now`, and whether one of those is a suspect.
    fn in_flight_besides(&self, done: &[(Claim, Outcome)], now: i64) -> (bool, bool) {
        let recording = |chunk: &ChunkId| done.iter().any(|(c, _)| c.chunk_id == *chunk);
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let counts = |c: &ChunkId| !recording(c) && held.get(c).is_some_and(|h| now < h.2);
        let suspects = self.suspects.lock().unwrap_or_else(|e| e.into_inner());
        (held.keys().any(counts), suspects.iter().any(counts))
    }

    /// Whether an idle worker must wait for this run's sends in flight to be recorded
    /// before it claims again — a suspect is in flight, or the last claim stopped at
    /// one while other sends were — and if so, until when at most: the end of the
    /// first lease of the sends it waits for. Read afresh at every look, so a recorded
    /// outcome (which wakes the idle workers) ends the wait.
    pub(crate) fn gate(&self, now: i64) -> Option<i64> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let isolating = |c: &ChunkId| held.get(c).map(|h| h.2).filter(|until| now < *until);
        let suspects = self.suspects.lock().unwrap_or_else(|e| e.into_inner());
        let by_suspects = suspects.iter().filter_map(isolating).max();
        if by_suspects.is_some() {
            return by_suspects;
        }
        if self.held_back.load(Ordering::SeqCst) {
            return held.keys().filter_map(isolating).max();
        }
        None
    }

    /// The lease expiry this run knows for a claim it holds (renewals included).
    fn lease_until(&self, claim: &Claim) -> i64 {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&claim.chunk_id)
            .map_or(claim.lease_until.timestamp_millis(), |(_, until, _)| *until)
    }

    /// Counts a worker in; the returned guard counts it out when the worker ends, by
    /// returning or by panicking.
    pub(crate) fn enter(self: &Arc<Self>) -> WorkerGuard {
        self.live.fetch_add(1, Ordering::SeqCst);
        WorkerGuard(self.clone())
    }
}

/// Counts a worker out of its run when dropped.
pub(crate) struct WorkerGuard(Arc<Run>);

impl Drop for WorkerGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
        self.0.wake_keepers();
    }
}

/// What both flavours share: the outbox, the served channels and the counters.
pub(crate) struct Core {
    pub outbox: Outbox,
    pub settings: Settings,
    channels: Vec<String>,
    counters: Counters,
    events: Option<EventSink>,
    /// Claims failed in a row, and when that was last logged.
    claim_failures: Mutex<(u64, Option<Instant>)>,
    /// Channels whose platform asked to be asked nothing before a time (ms, outbox
    /// clock): a rate-limited lookup's `Retry-After`.
    settle_waits: Mutex<HashMap<String, i64>>,
}

/// How often claims that keep failing are logged (with how many failed): a store out
/// of reach for a minute costs a line every ten seconds, not one per poll.
const CLAIM_FAILURES_LOGGED_EVERY: Duration = Duration::from_secs(10);

/// Adapters by channel with the core, shared by a dispatcher's workers.
pub(crate) struct Shared<A: ?Sized> {
    pub core: Core,
    pub adapters: HashMap<String, Arc<A>>,
}

impl<A: ?Sized> Shared<A> {
    /// Splits freshly claimed chunks into the ones to send now, each with its adapter,
    /// and gives the others back unsent: all of them when the run is stopping; a chunk
    /// whose channel has no adapter; one whose lease has less than a quarter left (a send
    /// must never start on a lease that cannot cover it). Pacing needs nothing here: the
    /// claim itself keeps each lane's interval and each channel's rate, across
    /// processes.
    pub(crate) fn admit(&self, run: &Run, claims: Vec<Claim>) -> Vec<(Claim, Arc<A>)> {
        let core = &self.core;
        let lease = duration_ms(core.outbox.options().lease);
        let mut admitted = Vec::with_capacity(claims.len());
        for claim in claims {
            let adapter = match self.adapters.get(&claim.channel) {
                Some(_) if run.stopping() => None,
                Some(adapter) => {
                    let left = run.lease_until(&claim) - core.outbox.options().now_ms();
                    if left < lease / 4 {
                        warn!(chunk = %claim.idempotency_key, left_ms = left, "too little of the lease left to start the send; giving the claim back");
                        None
                    } else {
                        Some(adapter.clone())
                    }
                }
                None => None,
            };
            match adapter {
                Some(adapter) => admitted.push((claim, adapter)),
                None => core.release(run, &claim),
            }
        }
        admitted
    }
}

impl Core {
    pub(crate) fn new(outbox: Outbox, settings: Settings, channels: Vec<String>) -> Result<Core> {
        settings.validate()?;
        if channels.is_empty() {
            return Err(Error::invalid(
                "adapters",
                "register at least one channel adapter",
            ));
        }
        if channels.iter().any(|c| c.trim().is_empty()) {
            return Err(Error::invalid(
                "channel",
                "adapter channel names must not be empty",
            ));
        }
        Ok(Core {
            outbox,
            settings,
            channels,
            counters: Counters::default(),
            events: None,
            claim_failures: Mutex::new((0, None)),
            settle_waits: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn channel_names(&self) -> Vec<&str> {
        self.channels.iter().map(String::as_str).collect()
    }

    /// Records the outcomes in `done` and claims up to `limit` new chunks, in one
    /// transaction; `done` is empty afterwards.
    ///
    /// A known outcome is never dropped for a passing condition: when the database is
    /// busy or full, the outcomes are recorded on their own, retried with backoff for
    /// up to a lease (the keeper keeps their claims alive meanwhile, and a claim whose
    /// lease ran out still settles its chunk while nobody else took it), and nothing
    /// new is claimed until they are in. Only a lasting failure drops them — counted and
    /// logged; their chunks are then settled by lease expiry.
    ///
    /// # Errors
    ///
    /// A failed claim when there was nothing to record.
    pub(crate) fn step(
        &self,
        run: &Run,
        done: &mut Vec<(Claim, Outcome)>,
        limit: usize,
    ) -> Result<Vec<Claim>> {
        let _turn = run.claim_turn.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.outbox.options().now_ms();
        let (busy, suspect_in_flight) = run.in_flight_besides(done, now);
        // While a suspect is in flight, this process sends nothing beside it.
        let limit = if suspect_in_flight { 0 } else { limit };
        if done.is_empty() && limit == 0 {
            return Ok(Vec::new());
        }
        let isolation = if busy {
            Isolation::Busy
        } else {
            Isolation::Alone
        };
        let channels = self.channel_names();
        self.record_and_claim(run, done, &channels, limit, isolation)
    }

    /// [`step`](Self::step) once its turn is taken: the outcomes in `done` recorded (with
    /// a claim of up to `limit`), retried while the store is busy, full or out of reach.
    /// A batch the store refuses outright (a value it cannot hold, a constraint) is
    /// recorded again one outcome at a time, so only the outcome it refuses is dropped.
    fn record_and_claim(
        &self,
        run: &Run,
        done: &mut Vec<(Claim, Outcome)>,
        channels: &[&str],
        mut limit: usize,
        isolation: Isolation,
    ) -> Result<Vec<Claim>> {
        let mut pause = Duration::from_millis(2);
        let give_up = Instant::now() + self.outbox.options().lease;
        loop {
            match self
                .outbox
                .record_and_claim(done, channels, limit, isolation)
            {
                Ok(step) => {
                    if limit > 0 {
                        run.held_back.store(step.held_back, Ordering::SeqCst);
                    }
                    self.count_recorded(run, done, step.recorded);
                    done.clear();
                    for dead in step.dead_letters {
                        self.emit(DispatchEvent::DeadLetter {
                            delivery_id: dead.delivery_id,
                            channel: dead.channel,
                            chat_id: dead.chat_id,
                            error: dead.error,
                        });
                    }
                    run.hold(&step.claims);
                    return Ok(step.claims);
                }
                Err(e) if done.is_empty() => return Err(e),
                Err(e) if limit > 0 => {
                    // Whatever made the claim fail, the outcomes go first, on their own.
                    warn!(error = %e, outcomes = done.len(), "recording with the next claim failed; recording alone");
                    limit = 0;
                }
                Err(
                    e @ (Error::Busy
                    | Error::DiskFull
                    | Error::Connection { .. }
                    | Error::CommitUnknown { .. }),
                ) if Instant::now() < give_up => {
                    bump(&self.counters.record_retries);
                    warn!(error = %e, outcomes = done.len(), retry_in_ms = pause.as_millis() as u64, "could not record outcomes yet; retrying");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Err(e) if done.len() > 1 && e.is_refusal() => {
                    warn!(error = %e, outcomes = done.len(), "the store refused the outcomes together; recording each alone");
                    for one in std::mem::take(done) {
                        self.record_and_claim(run, &mut vec![one], channels, 0, isolation)?;
                    }
                    return Ok(Vec::new());
                }
                Err(e) => {
                    add(&self.counters.dropped, done.len() as u64);
                    telemetry::events("outbox_dropped_outcomes_total", done.len() as u64);
                    tracing::error!(error = %e, outcomes = done.len(), "could not record outcomes; their leases will settle them");
                    for (claim, _) in done.drain(..) {
                        run.let_go(claim.chunk_id);
                    }
                    return Ok(Vec::new());
                }
            }
        }
    }

    /// When an idle worker of `run` should look again (ms, outbox clock): when the next
    /// chunk of our channels is due, or — while the run must first see its sends in
    /// flight recorded ([`Run::gate`]) — when that wait ends, unless a wake-up (an
    /// outcome recorded) or the poll comes first.
    pub(crate) fn next_due_in(&self, run: &Run) -> Option<i64> {
        match run.gate(self.outbox.options().now_ms()) {
            Some(opens) => Some(opens),
            None => self.next_due(),
        }
    }

    /// When the next chunk of our channels is due (ms, outbox clock), if any; now, if
    /// replies staged by an application's transaction may be waiting to join their
    /// lanes (the next claim does that).
    pub(crate) fn next_due(&self) -> Option<i64> {
        if self.outbox.staged_hinted() {
            return Some(self.outbox.options().now_ms());
        }
        match self.outbox.next_due(Some(&self.channel_names())) {
            Ok(due) => due.map(|t| t.timestamp_millis()),
            Err(e) => {
                warn!(error = %e, "could not read the next due time");
                // Look again soon rather than sleep through due work.
                Some(self.outbox.options().now_ms())
            }
        }
    }

    /// How long an idle worker may sleep: until `next_due`, at most [`IDLE_SLEEP`];
    /// `None` when it is due now. What else wakes it is a write of this process and
    /// the run's watcher ([`watch_others`]), which sees other processes' commits.
    pub(crate) fn sleep_for(&self, next_due: Option<i64>) -> Option<Duration> {
        let Some(due) = next_due else {
            return Some(IDLE_SLEEP);
        };
        let left = due.saturating_sub(self.outbox.options().now_ms());
        (left > 0).then(|| Duration::from_millis(left as u64).min(IDLE_SLEEP))
    }

    pub(crate) fn stats(&self) -> DispatchStats {
        self.counters.snapshot()
    }

    /// Counts a claim that failed in a running worker, which then waits a poll
    /// interval before trying again; logs the first of a run of failures, then how
    /// many failed at most every [`CLAIM_FAILURES_LOGGED_EVERY`].
    pub(crate) fn claim_failed(&self, e: &Error) {
        bump(&self.counters.errors);
        let mut failures = self
            .claim_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (failed, logged) = &mut *failures;
        *failed += 1;
        if logged.is_none_or(|at| at.elapsed() >= CLAIM_FAILURES_LOGGED_EVERY) {
            *logged = Some(Instant::now());
            warn!(error = %e, failed_in_a_row = *failed, "claim failed; trying again after the poll interval");
        }
    }

    /// Notes a claim that worked: claims that failed before it are logged as over.
    pub(crate) fn claim_worked(&self) {
        let mut failures = self
            .claim_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if failures.0 > 0 {
            info!(failed_in_a_row = failures.0, "claims work again");
            *failures = (0, None);
        }
    }

    /// A span for one send, with the ids that correlate it.
    pub(crate) fn span(claim: &Claim) -> Span {
        let delivery = info_span!("delivery", id = %claim.delivery_id, channel = %claim.channel);
        info_span!(
            parent: &delivery,
            "chunk",
            chunk = %claim.idempotency_key,
            index = claim.index,
            total = claim.total,
            attempt = claim.attempt,
        )
    }

    pub(crate) fn before_send(&self, claim: &Claim) {
        bump(&self.counters.sent);
        telemetry::send_started(&claim.channel);
        // Message text is private: debug level only.
        debug!(text = %claim.text, key = %claim.idempotency_key, "sending");
    }

    /// The outcome for a send whose adapter panicked: it may have reached the platform.
    pub(crate) fn panicked(&self, payload: Box<dyn Any + Send>) -> Outcome {
        bump(&self.counters.panics);
        telemetry::events("outbox_panics_total", 1);
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-text payload".to_owned());
        warn!(panic = %message, "channel adapter panicked; recording an ambiguous send");
        Outcome::Ambiguous {
            error: format!("the channel adapter panicked: {message}"),
        }
    }

    /// The outcome for a send that outlived the send timeout.
    pub(crate) fn timed_out(&self, timeout: Duration) -> Outcome {
        bump(&self.counters.timed_out);
        telemetry::events("outbox_send_timeouts_total", 1);
        warn!(
            timeout_ms = timeout.as_millis() as u64,
            "send did not return in time; recording an ambiguous send"
        );
        Outcome::Ambiguous {
            error: format!("the send did not return within {timeout:?}"),
        }
    }

    fn count_recorded(&self, run: &Run, done: &[(Claim, Outcome)], results: Vec<Result<Recorded>>) {
        for ((claim, outcome), result) in done.iter().zip(results) {
            run.let_go(claim.chunk_id);
            let kind = outcome_kind(outcome);
            let _entered = Core::span(claim).entered();
            match result {
                Ok(recorded) => {
                    self.count(claim, kind, &recorded);
                    if recorded.status == ChunkStatus::Uncertain {
                        run.note_uncertain();
                    }
                }
                Err(e) => {
                    bump(&self.counters.errors);
                    telemetry::events("outbox_record_errors_total", 1);
                    warn!(chunk = %claim.idempotency_key, error = %e, outcome = kind, "could not record outcome");
                }
            }
        }
    }

    fn count(&self, claim: &Claim, kind: &'static str, recorded: &Recorded) {
        let c = &self.counters;
        let channel = claim.channel.as_str();
        telemetry::outcome(channel, kind);
        telemetry::timings(
            self.outbox.options(),
            channel,
            claim.lease_until,
            &claim.delivery_id,
            recorded.finalized,
        );
        match recorded.status {
            ChunkStatus::Delivered => {
                bump(&c.delivered);
                if recorded.finalized {
                    bump(&c.finalized);
                    telemetry::chunk_state("outbox_finalized_total", channel);
                }
            }
            ChunkStatus::Retry => {
                bump(&c.retried);
                telemetry::chunk_state("outbox_retries_total", channel);
            }
            ChunkStatus::Failed => {
                bump(&c.failed);
                telemetry::chunk_state("outbox_dead_letters_total", channel);
            }
            ChunkStatus::Uncertain => {
                bump(&c.uncertain);
                telemetry::chunk_state("outbox_uncertain_total", channel);
            }
            ChunkStatus::Pending | ChunkStatus::Sending => {}
        }
        if recorded.finalized {
            self.report_delivered(claim, None);
        } else if let Some(error) = &recorded.finalize_error {
            self.report_delivered(claim, Some(error));
        }
        let next = recorded.next_attempt_at.map(|t| t.to_rfc3339());
        match recorded.status {
            ChunkStatus::Failed | ChunkStatus::Uncertain => {
                // Named here: at `warn` the info-level span around it is off.
                warn!(chunk = %claim.idempotency_key, channel = %claim.channel, outcome = kind, status = %recorded.status, "chunk needs attention")
            }
            // One line per chunk is for troubleshooting; a finished reply is news.
            _ if recorded.finalized => {
                info!(delivery = %claim.delivery_id, channel = %claim.channel, chunks = claim.total, "reply finalized")
            }
            _ => {
                debug!(outcome = kind, status = %recorded.status, next_attempt_at = ?next, "recorded")
            }
        }
    }

    /// Tells the application's event sink, if it has one, that every chunk of
    /// `claim`'s reply was delivered, with the platform's message id of each: finalized,
    /// or refused by the finalization statement for `refusal`.
    fn report_delivered(&self, claim: &Claim, refusal: Option<&str>) {
        if self.events.is_none() {
            return;
        }
        let view = match self.outbox.delivery(claim.delivery_id) {
            Ok(Some(view)) => view,
            Ok(None) => return, // purged meanwhile
            Err(e) => {
                warn!(chunk = %claim.idempotency_key, error = %e, "could not read the delivery to report it");
                return;
            }
        };
        let (channel, chat_id, delivery_id) = (view.channel, view.chat_id, claim.delivery_id);
        let platform_message_ids = view
            .chunks
            .into_iter()
            .map(|c| c.platform_message_id)
            .collect();
        self.emit(match refusal {
            None => DispatchEvent::Finalized {
                delivery_id,
                channel,
                chat_id,
                platform_message_ids,
            },
            Some(error) => DispatchEvent::Unfinalized {
                delivery_id,
                channel,
                chat_id,
                platform_message_ids,
                error: error.to_owned(),
            },
        });
    }

    /// Hands `event` to the application's event sink, if it has one; a panic there is
    /// logged, not passed on.
    fn emit(&self, event: DispatchEvent) {
        let Some(sink) = &self.events else {
            return;
        };
        let delivered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink(&event)));
        if delivered.is_err() {
            warn!(?event, "the event handler panicked; the event is lost");
        }
    }

    /// The served channels whose stored replay policy is
    /// [`Ask`](ReplayPolicy::Ask), with up to [`SETTLE_BATCH`] of each one's parts
    /// nobody asked the platform about yet.
    pub(crate) fn unasked(&self) -> Vec<PossiblySent> {
        let rules = match self.outbox.rules() {
            Ok(rules) => rules,
            Err(e) => {
                warn!(error = %e, "could not read the rules to settle uncertain parts");
                return Vec::new();
            }
        };
        let mut parts = Vec::new();
        for channel in &self.channels {
            if rules.channel(channel).replay != ReplayPolicy::Ask || !self.may_ask(channel) {
                continue;
            }
            match self.outbox.possibly_sent(channel, SETTLE_BATCH) {
                Ok(found) => parts.extend(found),
                Err(e) => warn!(%channel, error = %e, "could not read the uncertain parts"),
            }
        }
        parts
    }

    /// Whether `channel`'s platform may be asked now (no rate limit's wait running).
    pub(crate) fn may_ask(&self, channel: &str) -> bool {
        let waits = self.settle_waits.lock().unwrap_or_else(|e| e.into_inner());
        waits
            .get(channel)
            .is_none_or(|until| *until <= self.outbox.options().now_ms())
    }

    /// Records the platform's answer about `part`, counts it and reports it; whether it
    /// was recorded (not a `Later`, nor a part someone settled meanwhile).
    pub(crate) fn settled(&self, part: &PossiblySent, settlement: Settlement) -> bool {
        let claim = &part.claim;
        let _entered = Core::span(claim).entered();
        if settlement.decision == Decision::Later {
            // Nothing recorded; the channel is asked no sooner than the wait says.
            bump(&self.counters.settled_later);
            if let Some(wait) = settlement.wait {
                let until = self.outbox.options().now_ms() + duration_ms(wait);
                self.settle_waits
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(claim.channel.clone(), until);
            }
            debug!(chunk = %claim.idempotency_key, wait_ms = settlement.wait.map(|w| w.as_millis() as u64), answer = %settlement.answer, "the platform says: not yet");
            self.report_settled(claim, settlement);
            return false;
        }
        let recorded = match self.outbox.settle(part, &settlement) {
            Ok(Some(recorded)) => recorded,
            Ok(None) => return false,
            Err(e) => {
                bump(&self.counters.errors);
                warn!(chunk = %claim.idempotency_key, error = %e, "could not record the platform's answer");
                return false;
            }
        };
        let mut settlement = settlement;
        if settlement.decision == Decision::Resend && recorded.status == ChunkStatus::Uncertain {
            // A resend with no attempt left: held for a person instead (see
            // `Outbox::settle`).
            settlement.decision = Decision::Hold;
        }
        let c = &self.counters;
        match settlement.decision {
            Decision::Delivered { .. } => bump(&c.settled_delivered),
            Decision::Resend => bump(&c.settled_resent),
            Decision::Hold | Decision::Later => bump(&c.settled_held),
        }
        info!(chunk = %claim.idempotency_key, decision = settlement.decision.as_str(), asked = %settlement.asked, answer = %settlement.answer, "asked the platform about a possibly-sent part");
        self.report_settled(claim, settlement);
        if recorded.finalized {
            bump(&c.finalized);
            self.report_delivered(claim, None);
        } else if let Some(error) = &recorded.finalize_error {
            self.report_delivered(claim, Some(error));
        }
        true
    }

    /// Counts the platform's answer about `claim`'s part in the metrics and hands it to
    /// the event sink.
    fn report_settled(&self, claim: &Claim, settlement: Settlement) {
        telemetry::settled(&claim.channel, settlement.decision.as_str());
        self.emit(DispatchEvent::Settled {
            delivery_id: claim.delivery_id,
            index: claim.index,
            channel: claim.channel.clone(),
            chat_id: claim.chat_id.clone(),
            settlement,
        });
    }

    /// Gives a claim back unsent, due again at once.
    fn release(&self, run: &Run, claim: &Claim) {
        run.let_go(claim.chunk_id);
        match self.outbox.release(claim) {
            Ok(_) => bump(&self.counters.released),
            Err(e) => {
                bump(&self.counters.errors);
                warn!(error = %e, "could not release claim");
            }
        }
    }
}

/// Runs `round` until the run's last worker has ended (woken by it, as the keeper is):
/// every `interval` while a round says it was busy, doubling the wait after each that
/// was not up to [`SETTLE_BACKOFF`] times `interval`, and at once when the run records
/// a part as uncertain.
pub(crate) fn settle_while_live(run: &Run, interval: Duration, mut round: impl FnMut() -> bool) {
    let (lock, wake) = &run.keeper;
    let mut wait = interval;
    loop {
        if run.live.load(Ordering::SeqCst) == 0 {
            return;
        }
        let uncertain = run.uncertain.load(Ordering::SeqCst);
        wait = if round() {
            interval
        } else {
            (wait * 2).min(interval * SETTLE_BACKOFF)
        };
        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, timed_out) = wake
            .wait_timeout_while(guard, wait, |_| {
                run.live.load(Ordering::SeqCst) > 0
                    && run.uncertain.load(Ordering::SeqCst) == uncertain
            })
            .unwrap_or_else(|e| e.into_inner());
        drop(guard);
        if !timed_out.timed_out() {
            wait = interval;
        }
    }
}

/// How many times the settle interval an idle settler waits at most between rounds
/// that find nothing to ask about.
pub(crate) const SETTLE_BACKOFF: u32 = 30;

/// The slowest the run's watcher looks for other processes' commits: every poll
/// interval while anything changes, doubling its wait while nothing does, up to this.
pub(crate) const IDLE_LOOK: Duration = Duration::from_secs(1);

/// The longest an idle worker sleeps without being woken. What wakes it is its next due
/// time, a write of this process and the run's watcher; this only bounds the cost of a
/// wake-up the design missed.
pub(crate) const IDLE_SLEEP: Duration = Duration::from_secs(30);

/// The run's watcher: the one look at other processes' commits for all of its workers,
/// which wait on the outbox's notifier. It looks every poll interval while commits come
/// (its own process's included, read from the notifier's generation), backs off to
/// [`IDLE_LOOK`] while none does (or to what `watcher` says it may wait, a healthy
/// PostgreSQL listener's resync), and wakes the workers when it sees one.
pub(crate) fn watch_others(core: &Core, run: &Run, mut watcher: Box<dyn ChangeWatch>) {
    let poll = core.settings.poll_interval;
    let notifier = core.outbox.notifier();
    let mut seen = notifier.generation();
    let mut beats = core.outbox.heartbeats();
    let mut wait = poll;
    let (lock, wake) = &run.keeper;
    loop {
        {
            let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
            let _ = wake
                .wait_timeout_while(guard, wait, |_| {
                    run.live.load(Ordering::SeqCst) > 0 && !run.stopping()
                })
                .unwrap_or_else(|e| e.into_inner());
        }
        if run.live.load(Ordering::SeqCst) == 0 || run.stopping() {
            return;
        }
        let ours = notifier.generation() != seen;
        // The registry's heartbeat of this handle shows as a change too: the workers
        // are woken (another process may have committed meanwhile), but the watcher
        // goes on backing off.
        let beat = std::mem::replace(&mut beats, core.outbox.heartbeats()) != beats;
        let changed = watcher.changed().unwrap_or(true);
        if changed {
            notifier.notify();
        }
        wait = next_look(wait, poll, (changed && !beat) || ours, watcher.quiet_for());
        seen = notifier.generation();
    }
}

/// The watcher's next wait after one of `wait`: the poll interval after a change (its
/// own process's writes count), else twice as long up to [`IDLE_LOOK`] (never below
/// the poll interval), or as long as the store says nothing can change unseen.
fn next_look(wait: Duration, poll: Duration, changed: bool, quiet: Option<Duration>) -> Duration {
    if changed {
        return poll;
    }
    (wait * 2)
        .min(IDLE_LOOK.max(poll))
        .max(quiet.unwrap_or_default())
}

/// An adapter's `settle` with its panic caught: a part the adapter panicked on is held
/// for a person.
pub(crate) fn settle_guarded(ask: impl FnOnce() -> Settlement) -> Settlement {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(ask))
        .unwrap_or_else(|_| adapter_panicked())
}

/// What a panic of an adapter's `settle` answers: the part is held for a person.
pub(crate) fn adapter_panicked() -> Settlement {
    warn!("the adapter panicked while asking its platform; the part is held");
    Settlement::hold("the adapter", "it panicked while asking its platform")
}

/// The keeper of a run's leases: renews every claim the run holds once less than half
/// of its lease is left, until the run's last worker ended. Runs on a thread of its
/// own in both flavours (it only does short database writes), so a busy worker — or
/// an async runtime starved of threads — cannot keep it from renewing. While nothing is
/// held it parks, and the first claim held wakes it.
pub(crate) fn keep_leases(core: &Core, run: &Run) {
    let tick = renewal_tick(core.outbox.options().lease);
    let (lock, wake) = &run.keeper;
    loop {
        {
            let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
            // Nothing held: park until a claim is (`Run::hold` wakes it) or the run
            // ends. Marked parked before the look, so a claim held meanwhile is seen.
            run.keeper_parked.store(true, Ordering::SeqCst);
            let idle = run
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty();
            if idle {
                drop(
                    wake.wait_while(guard, |_| {
                        run.live.load(Ordering::SeqCst) > 0
                            && run.keeper_parked.load(Ordering::SeqCst)
                    })
                    .unwrap_or_else(|e| e.into_inner()),
                );
            } else {
                run.keeper_parked.store(false, Ordering::SeqCst);
                let _ = wake
                    .wait_timeout_while(guard, tick, |_| run.live.load(Ordering::SeqCst) > 0)
                    .unwrap_or_else(|e| e.into_inner());
            }
        }
        if run.live.load(Ordering::SeqCst) == 0 {
            return;
        }
        renew_due(core, run);
    }
}

/// How often the keeper looks at its leases: four times a lease, at least once a second,
/// so a lease is renewed while more than a quarter of it is left.
fn renewal_tick(lease: Duration) -> Duration {
    Duration::from_millis((duration_ms(lease) / 4).clamp(1, 1_000) as u64)
}

/// One look of the keeper: renews the claims the run holds with half of their lease
/// or less left; returns how many it renewed.
fn renew_due(core: &Core, run: &Run) -> usize {
    let lease = duration_ms(core.outbox.options().lease);
    let now = core.outbox.options().now_ms();
    let due: Vec<(ChunkId, i64)> = run
        .held
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(_, (_, until, _))| until - now <= lease / 2)
        .map(|(chunk, (token, ..))| (*chunk, *token))
        .collect();
    if due.is_empty() {
        return 0;
    }
    match core.outbox.renew_leases(&due) {
        Ok(renewed) => {
            let mut held = run.held.lock().unwrap_or_else(|e| e.into_inner());
            let mut n = 0;
            for ((chunk, token), until) in due.into_iter().zip(renewed) {
                if let (Some(until), Some(h)) = (until, held.get_mut(&chunk))
                    && h.0 == token
                {
                    h.1 = until;
                    n += 1;
                    bump(&core.counters.renewed);
                }
            }
            n
        }
        Err(e) => {
            warn!(error = %e, claims = due.len(), "could not renew leases; trying again");
            0
        }
    }
}

/// Runs a blocking send, turning a panic into an ambiguous outcome.
pub(crate) fn guarded(core: &Core, send: impl FnOnce() -> Outcome) -> Outcome {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(send))
        .unwrap_or_else(|payload| core.panicked(payload))
}

fn outcome_kind(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Delivered { .. } | Outcome::DeliveredEarlier { .. } => "delivered",
        Outcome::Transient { .. } => "transient",
        Outcome::Permanent { .. } => "permanent",
        Outcome::RateLimited { .. } => "rate_limited",
        Outcome::ChannelRateLimited { .. } => "channel_rate_limited",
        Outcome::Ambiguous { .. } => "ambiguous",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::enqueue::NewDelivery;
    use crate::options::OutboxOptions;

    /// Whether `run` waits for its sends in flight, at `core`'s time.
    fn gated(run: &Run, core: &Core) -> bool {
        run.gate(core.outbox.options().now_ms()).is_some()
    }

    /// A platform that accepts every send (also for the send threads' tests).
    pub(super) struct Accept;

    impl ChannelAdapter for Accept {
        fn send(&self, _: &Claim) -> Outcome {
            Outcome::delivered(None)
        }
    }

    /// A dispatcher core for channel "t" on an in-memory outbox with a 40 s lease and a
    /// clock the test moves, with `chats` replies enqueued (one per chat).
    fn setup(chats: usize) -> (Arc<Shared<dyn ChannelAdapter>>, ManualClock) {
        let clock = ManualClock::new(1_700_000_000_000);
        let options = OutboxOptions::default()
            .with_lease(Duration::from_secs(40))
            .with_clock(Arc::new(clock.clone()));
        let outbox = Outbox::open_in_memory(options).unwrap();
        for chat in 0..chats {
            outbox
                .enqueue(&NewDelivery::single("t", chat.to_string(), "x"))
                .unwrap();
        }
        let shared = Dispatcher::builder(outbox)
            .adapter("t", Accept)
            .batch_size(chats.max(1))
            .into_shared()
            .unwrap();
        (shared, clock)
    }

    /// On a channel that may replay, claims the one due chunk in a run that then dies:
    /// once its lease runs out, the chunk is a suspect.
    fn claim_in_a_run_that_dies(core: &Core) {
        core.outbox
            .set_channel_policy("t", Some(crate::rules::ChannelPolicy::replayable()))
            .unwrap();
        let claimed = core.step(&Run::default(), &mut Vec::new(), 1).unwrap();
        assert_eq!(claimed.len(), 1);
    }

    /// Item 8 of the review: after a crash, the chunks whose leases ran out (suspects)
    /// go out one at a time, each alone in the process. A worker claims one; another
    /// worker claims nothing while it is in flight, and waits for its outcome (the run
    /// is gated, so its next look is not at a due time); the outcome recorded, the next
    /// suspect goes, alone.
    #[test]
    fn suspects_go_out_one_at_a_time_and_alone() {
        let (shared, clock) = setup(3);
        let core = &shared.core;
        let outbox = &core.outbox;
        outbox
            .set_channel_policy("t", Some(crate::rules::ChannelPolicy::replayable()))
            .unwrap();
        let crashed = Run::default();
        assert_eq!(core.step(&crashed, &mut Vec::new(), 3).unwrap().len(), 3);
        clock.advance(Duration::from_secs(41)); // the process died; its leases ran out

        let run = Run::default();
        assert!(!gated(&run, core));
        let first = core.step(&run, &mut Vec::new(), 3).unwrap();
        assert_eq!(first.len(), 1, "a suspect goes alone");
        assert!(first[0].suspect);
        assert!(gated(&run, core), "nothing beside a suspect in flight");
        assert_eq!(
            core.next_due_in(&run),
            Some(first[0].lease_until.timestamp_millis()),
            "wait for the outcome, for one lease at most; not for a due time"
        );
        assert!(core.next_due().is_some(), "the other suspects are due");
        assert!(
            core.step(&run, &mut Vec::new(), 3).unwrap().is_empty(),
            "another worker claims nothing meanwhile"
        );
        let mut done = vec![(first[0].clone(), Outcome::delivered(None))];
        let second = core.step(&run, &mut done, 3).unwrap();
        assert_eq!(
            second.len(),
            1,
            "its outcome recorded, the next suspect goes"
        );
        assert_ne!(second[0].chunk_id, first[0].chunk_id);

        let mut done = vec![(second[0].clone(), Outcome::delivered(None))];
        let third = core.step(&run, &mut done, 3).unwrap();
        assert_eq!(third.len(), 1, "and the last, alone too");
        let mut done = vec![(third[0].clone(), Outcome::delivered(None))];
        assert!(core.step(&run, &mut done, 3).unwrap().is_empty());
        assert!(!gated(&run, core));
        assert_eq!(outbox.health().unwrap().totals.finalized_total, 3);
    }

    /// A run with an ordinary send in flight (a fresh reply, due first) whose next
    /// claim stopped at the suspect behind it (claimed by a run that died), so it is
    /// gated; the run and the send in flight.
    fn a_send_in_flight_before_a_suspect(core: &Core, clock: &ManualClock) -> (Run, Claim) {
        claim_in_a_run_that_dies(core);
        core.outbox
            .enqueue(&NewDelivery::single("t", "fresh", "y"))
            .unwrap();
        clock.advance(Duration::from_secs(41)); // the first claim's process died

        let run = Run::default();
        let mut ordinary = core.step(&run, &mut Vec::new(), 1).unwrap();
        assert_eq!(ordinary.len(), 1);
        assert!(!ordinary[0].suspect, "the fresh reply was due first");
        assert!(!gated(&run, core));
        assert!(
            core.step(&run, &mut Vec::new(), 1).unwrap().is_empty(),
            "the suspect is next: not beside a send in flight"
        );
        assert!(gated(&run, core), "wait for the send in flight");
        (run, ordinary.remove(0))
    }

    /// A suspect that comes after an ordinary chunk in flight waits for that chunk's
    /// outcome: the other worker's claim stops at it, claims nothing, and the run is
    /// gated until the chunk in flight is recorded; then the suspect goes alone.
    #[test]
    fn a_suspect_waits_for_the_sends_in_flight() {
        let (shared, clock) = setup(1);
        let core = &shared.core;
        let (run, ordinary) = a_send_in_flight_before_a_suspect(core, &clock);
        let mut done = vec![(ordinary, Outcome::delivered(None))];
        let suspect = core.step(&run, &mut done, 1).unwrap();
        assert_eq!(suspect.len(), 1);
        assert!(suspect[0].suspect);
    }

    /// Lets a 40 s lease all but run out (1 ms short) while a send hangs: the keeper
    /// renews what the run holds, and nothing more is claimed meanwhile.
    fn hang_to_just_before_the_first_lease_ends(core: &Core, clock: &ManualClock, run: &Run) {
        for _ in 0..2 {
            clock.advance(Duration::from_millis(19_999));
            renew_due(core, run);
            assert!(
                core.step(run, &mut Vec::new(), 1).unwrap().is_empty(),
                "held back while within the first lease"
            );
        }
    }

    /// Issue 37, item 2: a suspect whose send hangs (no send timeout; the keeper renews
    /// its lease) holds the process's other chats back for one lease at most, then they
    /// are served beside it.
    #[test]
    fn a_hanging_suspect_holds_the_other_chats_back_for_one_lease_at_most() {
        let (shared, clock) = setup(1);
        let core = &shared.core;
        let outbox = &core.outbox;
        claim_in_a_run_that_dies(core);
        clock.advance(Duration::from_secs(41)); // that process died; its lease ran out
        outbox
            .enqueue(&NewDelivery::single("t", "other", "y"))
            .unwrap();

        let run = Run::default();
        let suspect = core.step(&run, &mut Vec::new(), 1).unwrap();
        assert!(suspect.len() == 1 && suspect[0].suspect, "{suspect:?}");
        let lease_end = suspect[0].lease_until.timestamp_millis();
        // Its send hangs; the keeper keeps its lease.
        hang_to_just_before_the_first_lease_ends(core, &clock, &run);
        assert_eq!(
            core.next_due_in(&run),
            Some(lease_end),
            "an idle worker looks then"
        );
        clock.advance(Duration::from_millis(2));
        assert!(
            core.next_due_in(&run) < Some(lease_end),
            "the wait is over: the other chat's reply is due"
        );
        let other = core.step(&run, &mut Vec::new(), 1).unwrap();
        assert_eq!(other.len(), 1, "served once the suspect outlived its lease");
        assert_eq!(
            (other[0].chat_id.as_str(), other[0].suspect),
            ("other", false)
        );
    }

    /// The same bound for an ordinary send that hangs after a claim stopped at a
    /// suspect behind it: the suspect waits one lease of that send at most, then goes.
    #[test]
    fn a_hanging_send_holds_a_suspect_back_for_one_lease_at_most() {
        let (shared, clock) = setup(1);
        let core = &shared.core;
        let (run, _hangs) = a_send_in_flight_before_a_suspect(core, &clock);
        hang_to_just_before_the_first_lease_ends(core, &clock, &run);
        clock.advance(Duration::from_millis(2));
        let suspect = core.step(&run, &mut Vec::new(), 1).unwrap();
        assert!(suspect.len() == 1 && suspect[0].suspect, "{suspect:?}");
    }

    /// What a run has in flight besides the claims being recorded, and whether it is
    /// gated: a suspect in flight gates it; an ordinary claim in flight gates it only
    /// after a claim stopped at a suspect.
    #[test]
    fn a_run_knows_what_is_in_flight_besides_what_it_records() {
        let claim = |n: i64, suspect: bool| {
            let mut c = Claim::for_testing("t", n.to_string(), "x");
            c.chunk_id = ChunkId(n);
            c.suspect = suspect;
            c
        };
        let (ordinary, suspect) = (claim(1, false), claim(2, true));
        let now = ordinary
            .lease_until
            .timestamp_millis()
            .min(suspect.lease_until.timestamp_millis())
            - 1;
        let run = Run::default();
        assert_eq!(run.in_flight_besides(&[], now), (false, false));
        assert!(run.gate(now).is_none());
        run.hold(&[ordinary.clone(), suspect.clone()]);
        let done = |c: &Claim| vec![(c.clone(), Outcome::delivered(None))];
        assert_eq!(run.in_flight_besides(&[], now), (true, true));
        assert_eq!(run.in_flight_besides(&done(&ordinary), now), (true, true));
        assert_eq!(run.in_flight_besides(&done(&suspect), now), (true, false));
        let both = [done(&ordinary), done(&suspect)].concat();
        assert_eq!(run.in_flight_besides(&both, now), (false, false));
        assert!(run.gate(now).is_some(), "a suspect is in flight");
        run.let_go(suspect.chunk_id);
        assert!(
            run.gate(now).is_none(),
            "an ordinary claim alone does not gate"
        );
        run.held_back.store(true, Ordering::SeqCst);
        assert!(
            run.gate(now).is_some(),
            "a claim stopped at a suspect while it was in flight"
        );
        run.let_go(ordinary.chunk_id);
        assert!(run.gate(now).is_none(), "nothing in flight: claim again");
    }

    /// As [`setup`], on a file (so another connection can lock it or change its
    /// schema), with a lease of `lease` and a busy timeout of 1 ms.
    fn on_file(
        dir: &std::path::Path,
        chats: usize,
        lease: Duration,
    ) -> Arc<Shared<dyn ChannelAdapter>> {
        let options = OutboxOptions::default()
            .with_lease(lease)
            .with_busy_timeout(Duration::from_millis(1));
        let outbox = Outbox::open(dir.join("outbox.db"), options).unwrap();
        for chat in 0..chats {
            outbox
                .enqueue(&NewDelivery::single("t", chat.to_string(), "x"))
                .unwrap();
        }
        Dispatcher::builder(outbox)
            .adapter("t", Accept)
            .into_shared()
            .unwrap()
    }

    #[test]
    fn a_claim_that_fails_with_nothing_to_record_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let shared = on_file(dir.path(), 1, Duration::from_secs(1));
        let blocker = rusqlite::Connection::open(dir.path().join("outbox.db")).unwrap();
        blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
        let run = Run::default();
        assert!(matches!(
            shared.core.step(&run, &mut Vec::new(), 1),
            Err(Error::Busy)
        ));
    }

    #[test]
    fn outcomes_are_recorded_alone_when_the_claim_beside_them_fails() {
        let dir = tempfile::tempdir().unwrap();
        let shared = on_file(dir.path(), 2, Duration::from_secs(60));
        let run = Run::default();
        let claim = shared.core.step(&run, &mut Vec::new(), 1).unwrap();
        // From now on every claim fails (not as Busy); recording does not.
        rusqlite::Connection::open(dir.path().join("outbox.db"))
            .unwrap()
            .execute_batch(
                "CREATE TRIGGER no_claims BEFORE UPDATE OF status ON outbound_delivery_chunks
                 WHEN NEW.status = 'sending' BEGIN SELECT RAISE(ABORT, 'no claims'); END",
            )
            .unwrap();
        let mut done = vec![(claim[0].clone(), Outcome::delivered(None))];
        assert!(shared.core.step(&run, &mut done, 1).unwrap().is_empty());
        let stats = shared.core.stats();
        assert_eq!((stats.delivered, stats.dropped), (1, 0));
    }

    #[test]
    fn a_lasting_lock_drops_outcomes_after_a_lease_of_backed_off_retries() {
        let dir = tempfile::tempdir().unwrap();
        let shared = on_file(dir.path(), 1, Duration::from_millis(100));
        let run = Run::default();
        let claim = shared.core.step(&run, &mut Vec::new(), 1).unwrap();
        let blocker = rusqlite::Connection::open(dir.path().join("outbox.db")).unwrap();
        blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = shared.clone();
        std::thread::spawn(move || {
            let run = Run::default();
            run.hold(&claim);
            let mut done = vec![(claim[0].clone(), Outcome::delivered(None))];
            let claimed = worker.core.step(&run, &mut done, 1).map(|c| c.len());
            let _ = tx.send((claimed, done.len(), run.held.lock().unwrap().len()));
        });
        // A bound on a hang, not a wait for time: the step gives up after its lease.
        let (claimed, left, held) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a lasting lock must not hold a worker forever");
        assert_eq!((claimed.unwrap(), left, held), (0, 0, 0));
        let stats = shared.core.stats();
        assert_eq!(stats.dropped, 1);
        // Backed off from 2 ms, doubling: a handful of retries in 100 ms, not hundreds.
        assert!(
            (1..=10).contains(&stats.record_retries),
            "{} retries",
            stats.record_retries
        );
    }

    /// With nothing held the keeper sleeps without a deadline; the first claim held
    /// wakes it, and it renews that claim's lease.
    #[test]
    fn the_keeper_sleeps_while_nothing_is_held_and_wakes_for_a_claim() {
        let (shared, clock) = setup(1);
        let run = Arc::new(Run::default());
        let live = run.enter();
        let keeper = {
            let (shared, run) = (shared.clone(), run.clone());
            std::thread::spawn(move || keep_leases(&shared.core, &run))
        };
        // A bound on a hang, not a wait for time: the keeper parks at once.
        let parked = |want: bool| {
            let give_up = Instant::now() + Duration::from_secs(10);
            while run.keeper_parked.load(Ordering::SeqCst) != want && Instant::now() < give_up {
                std::thread::yield_now();
            }
            run.keeper_parked.load(Ordering::SeqCst) == want
        };
        assert!(parked(true), "nothing held: the keeper parks");
        let claims = shared.core.step(&run, &mut Vec::new(), 1).unwrap();
        assert_eq!(claims.len(), 1);
        assert!(parked(false), "a claim held wakes it");
        // Past half the lease on the outbox's clock: the keeper's next look renews it.
        clock.advance(Duration::from_secs(25));
        let give_up = Instant::now() + Duration::from_secs(10);
        while shared.core.stats().renewed == 0 && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(shared.core.stats().renewed, 1);
        drop(live);
        keeper.join().unwrap();
    }

    #[test]
    fn the_watcher_looks_often_while_things_change_and_backs_off_while_nothing_does() {
        let poll = Duration::from_millis(50);
        let mut wait = poll;
        let mut waits = Vec::new();
        for _ in 0..7 {
            wait = next_look(wait, poll, false, None);
            waits.push(wait.as_millis());
        }
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000, 1000]);
        assert_eq!(
            next_look(wait, poll, true, None),
            poll,
            "a change: look again soon"
        );
        let resync = Duration::from_secs(7);
        assert_eq!(
            next_look(poll, poll, false, Some(resync)),
            resync,
            "a listener that hears every commit: look at the resync"
        );
        assert_eq!(next_look(resync, poll, true, Some(resync)), poll);
        let slow = Duration::from_secs(3);
        assert_eq!(
            next_look(slow, slow, false, None),
            slow,
            "never below the poll interval"
        );
    }

    #[test]
    fn an_idle_worker_sleeps_until_the_next_due_time_at_most_the_idle_sleep() {
        let (shared, clock) = setup(0);
        let core = &shared.core;
        assert_eq!(core.next_due(), None, "nothing stored");
        assert_eq!(core.sleep_for(None), Some(IDLE_SLEEP));
        let now = core.outbox.options().now_ms();
        assert_eq!(
            core.sleep_for(Some(now + 10)),
            Some(Duration::from_millis(10))
        );
        assert_eq!(core.sleep_for(Some(now + 3_600_000)), Some(IDLE_SLEEP));
        assert_eq!(core.sleep_for(Some(now)), None, "due now");
        assert_eq!(core.sleep_for(Some(now - 5)), None, "overdue");

        core.outbox
            .enqueue(&NewDelivery::single("t", "c", "x"))
            .unwrap();
        assert_eq!(core.next_due(), Some(now));
        let claim = core.outbox.claim(1).unwrap();
        core.outbox
            .record(
                &claim[0],
                Outcome::Transient {
                    error: "later".into(),
                },
            )
            .unwrap();
        let due = core.next_due().unwrap();
        assert!(due > now, "due after its backoff");
        clock.advance(Duration::from_millis((due - now) as u64));
        assert_eq!(core.sleep_for(core.next_due()), None);
    }

    #[test]
    fn a_send_starts_only_with_a_quarter_of_its_lease_left() {
        let (shared, clock) = setup(1);
        let run = Run::default();
        let claims = shared.core.step(&run, &mut Vec::new(), 1).unwrap();
        clock.advance(Duration::from_secs(30)); // exactly a quarter (10 s) left
        let admitted = shared.admit(&run, claims);
        assert_eq!(admitted.len(), 1, "a quarter left is enough");

        let (shared, clock) = setup(1);
        let claims = shared.core.step(&run, &mut Vec::new(), 1).unwrap();
        clock.advance(Duration::from_millis(30_001));
        assert!(shared.admit(&run, claims).is_empty(), "less is not");
        assert_eq!(shared.core.stats().released, 1);
        assert_eq!(
            shared.core.outbox.claim(1).unwrap().len(),
            1,
            "given back: due again at once"
        );
    }

    #[test]
    fn a_stopping_run_sends_nothing_it_claimed() {
        let (shared, _clock) = setup(2);
        let run = Run::default();
        let claims = shared.core.step(&run, &mut Vec::new(), 2).unwrap();
        assert_eq!(claims.len(), 2);
        run.stop();
        assert!(shared.admit(&run, claims).is_empty());
        assert_eq!(shared.core.stats().released, 2);
        assert!(
            run.held.lock().unwrap().is_empty(),
            "released claims are let go"
        );
    }

    #[test]
    fn a_run_holds_exactly_the_claims_whose_outcome_is_not_recorded() {
        let (shared, _clock) = setup(3);
        let run = Run::default();
        let claims = shared.core.step(&run, &mut Vec::new(), 3).unwrap();
        assert_eq!(run.held.lock().unwrap().len(), 3);
        let mut done: Vec<_> = claims
            .into_iter()
            .take(2)
            .map(|c| (c, Outcome::delivered(None)))
            .collect();
        shared.core.step(&run, &mut done, 0).unwrap();
        assert!(done.is_empty());
        assert_eq!(
            run.held.lock().unwrap().len(),
            1,
            "recorded claims are no longer renewed"
        );
    }

    #[test]
    fn the_keeper_renews_a_lease_once_half_of_it_is_left() {
        let (shared, clock) = setup(1);
        let core = &shared.core;
        let run = Run::default();
        let claims = core.step(&run, &mut Vec::new(), 1).unwrap();
        let until = |run: &Run| run.held.lock().unwrap()[&claims[0].chunk_id].1;
        let first = until(&run);
        clock.advance(Duration::from_millis(19_999));
        assert_eq!(renew_due(core, &run), 0, "more than half left");
        clock.advance(Duration::from_millis(1));
        assert_eq!(renew_due(core, &run), 1, "half left");
        assert_eq!(until(&run), first + 20_000, "a whole lease from now");
        assert_eq!(core.stats().renewed, 1);
        assert_eq!(renew_due(core, &run), 0, "renewed: not due again");

        // A claim taken over by someone else (another token) is not renewed for it.
        run.held
            .lock()
            .unwrap()
            .get_mut(&claims[0].chunk_id)
            .unwrap()
            .0 += 1;
        clock.advance(Duration::from_secs(20));
        assert_eq!(renew_due(core, &run), 0, "a stale token renews nothing");
    }

    #[test]
    fn the_keeper_looks_four_times_a_lease_and_at_least_once_a_second() {
        assert_eq!(
            renewal_tick(Duration::from_secs(40)),
            Duration::from_secs(1)
        );
        assert_eq!(
            renewal_tick(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        assert_eq!(
            renewal_tick(Duration::from_millis(3)),
            Duration::from_millis(1)
        );
    }

    #[test]
    fn a_failed_claim_in_a_worker_is_counted() {
        let (shared, _clock) = setup(0);
        shared.core.claim_failed(&Error::Busy);
        assert_eq!(shared.core.stats().errors, 1);
    }

    /// Claims failing in a row are counted, and logged once, not once each, until a
    /// claim works again.
    #[test]
    fn claims_failing_in_a_row_are_logged_as_a_count() {
        let (shared, _clock) = setup(0);
        let core = &shared.core;
        let state = || *core.claim_failures.lock().unwrap();
        core.claim_failed(&Error::Busy);
        let (failed, first_logged) = state();
        assert_eq!(failed, 1);
        assert!(first_logged.is_some(), "the first failure is logged");
        core.claim_failed(&Error::Busy);
        core.claim_failed(&Error::Busy);
        assert_eq!(state(), (3, first_logged), "counted, not logged again");
        core.claim_worked();
        assert_eq!(state(), (0, None), "a claim that works ends the run");
        core.claim_failed(&Error::Busy);
        assert_eq!(state().0, 1, "a new run");
    }

    /// "Claims work again" is said once, after failures, not at every claim.
    #[test]
    fn a_claim_that_works_is_logged_only_after_failures() {
        #[derive(Clone, Default)]
        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let (shared, _clock) = setup(0);
        let core = &shared.core;
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let logged = || String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        tracing::subscriber::with_default(subscriber, || {
            core.claim_worked();
            core.claim_worked();
            assert!(!logged().contains("claims work again"), "{}", logged());
            core.claim_failed(&Error::Busy);
            core.claim_worked();
            core.claim_worked();
        });
        assert_eq!(
            logged().matches("claims work again").count(),
            1,
            "{}",
            logged()
        );
    }
}
