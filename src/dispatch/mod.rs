//! The claim → send → record loop over registered channel adapters.
//!
//! [`Dispatcher`] runs it on threads, for CLI agents and simple bots;
//! [`AsyncDispatcher`](crate::AsyncDispatcher) (feature `tokio`) runs it as tasks for
//! async engines. Both share [`Core`]: which channels are served, the per-channel rate
//! slots, recording outcomes with logs and counters.

mod blocking;
#[cfg(feature = "tokio")]
pub(crate) mod tokio;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{Span, debug, info, info_span, warn};

use crate::clock::duration_ms;
use crate::{
    ChannelPolicy, ChunkStatus, Claim, Error, Outbox, Outcome, Recorded, ReplayPolicy, Result,
};

pub use blocking::{Dispatcher, DispatcherBuilder, RunningDispatcher, ShutdownReport};

/// The application's code that talks to one platform (Telegram, Slack, ...).
///
/// `send` gets everything needed for one chunk — ids, chat, index and total, text, the
/// stable idempotency key and the attempt number — and reports a typed [`Outcome`].
/// It must not panic and should bound its own I/O with a timeout well below the
/// outbox lease: a dispatcher shuts down only once in-flight sends return.
///
/// ```
/// use chunked_outbox::{ChannelAdapter, Claim, Outcome, Pacing, ReplayPolicy};
/// use std::time::Duration;
///
/// struct Matrix;
///
/// impl ChannelAdapter for Matrix {
///     fn send(&self, claim: &Claim) -> Outcome {
///         // PUT /rooms/{claim.chat_id}/send/m.room.message/{claim.idempotency_key} ...
///         Outcome::delivered(Some("$event-id".into()))
///     }
///     // Matrix deduplicates by transaction id, so a possibly-sent chunk may be replayed.
///     fn replay(&self) -> ReplayPolicy {
///         ReplayPolicy::Replay
///     }
///     fn pacing(&self) -> Pacing {
///         Pacing { lane_interval: Duration::from_millis(200), ..Pacing::default() }
///     }
/// }
/// ```
pub trait ChannelAdapter: Send + Sync + 'static {
    /// Sends one chunk and says what happened.
    fn send(&self, claim: &Claim) -> Outcome;

    /// Whether a chunk that may already have reached the platform can be sent again
    /// (the platform deduplicates by idempotency key). Default: hold it.
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Hold
    }

    /// How fast this platform may be sent to. Default: no pacing.
    fn pacing(&self) -> Pacing {
        Pacing::default()
    }
}

/// Pacing of one channel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pacing {
    /// Minimum time between two sends to the same chat (e.g. about 1 s for Telegram).
    /// Enforced by the outbox's due times, so it holds across workers, processes and
    /// retries.
    pub lane_interval: Duration,
    /// Minimum time between two sends on the whole channel from this dispatcher (e.g.
    /// 1/30 s for Telegram's overall bot limit). Zero for none.
    pub channel_interval: Duration,
}

/// Settings shared by both dispatcher flavours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settings {
    pub workers: usize,
    pub batch: usize,
    pub poll_interval: Duration,
    /// Outcomes gathered within this window of the first unrecorded one are recorded in
    /// one transaction. Slow sends exceed it, so each of them is recorded at once.
    pub group_window: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            workers: 2,
            batch: 16,
            poll_interval: Duration::from_millis(50),
            group_window: Duration::from_millis(2),
        }
    }
}

impl Settings {
    pub(crate) fn validate(&self) -> Result<()> {
        if self.workers == 0 {
            return Err(Error::invalid("workers", "must be at least 1"));
        }
        if self.batch == 0 || self.batch > crate::MAX_CLAIM_BATCH {
            return Err(Error::invalid(
                "batch size",
                format!("{} is outside 1..={}", self.batch, crate::MAX_CLAIM_BATCH),
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::invalid("poll interval", "must be above zero"));
        }
        Ok(())
    }
}

/// Counters of what a dispatcher did since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DispatchStats {
    /// Chunks handed to an adapter.
    pub sent: u64,
    /// Chunks the platform accepted.
    pub delivered: u64,
    /// Deliveries finalized into `messages`.
    pub finalized: u64,
    /// Sends that will be retried.
    pub retried: u64,
    /// Chunks that failed for good.
    pub failed: u64,
    /// Chunks held as uncertain.
    pub uncertain: u64,
    /// Claims given back unstarted (channel rate slot taken, or shutting down).
    pub released: u64,
    /// Claims and outcomes that failed (stale claim, busy or failing database).
    pub errors: u64,
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
}

impl Counters {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

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
        }
    }
}

/// What both flavours share: the outbox, the served channels and their pacing, rate
/// slots, the stop flag and the counters.
pub(crate) struct Core {
    pub outbox: Outbox,
    pub settings: Settings,
    channels: Vec<String>,
    pacing: HashMap<String, Pacing>,
    /// Per channel, the earliest time (outbox clock, ms) the next send may start.
    slots: Mutex<HashMap<String, i64>>,
    stopping: AtomicBool,
    counters: Counters,
}

/// Adapters by channel with the core, shared by a dispatcher's workers.
pub(crate) struct Shared<A: ?Sized> {
    pub core: Core,
    pub adapters: HashMap<String, Arc<A>>,
}

impl<A: ?Sized> DispatcherBuilder<A> {
    /// Registers each adapter's declarations (`declare` reads them) with the outbox.
    pub(crate) fn into_shared(
        self,
        declare: impl Fn(&A) -> (ReplayPolicy, Pacing),
    ) -> Result<Arc<Shared<A>>> {
        let declared = self
            .adapters
            .iter()
            .map(|(name, a)| {
                let (replay, pacing) = declare(a);
                (name.clone(), replay, pacing)
            })
            .collect();
        let core = Core::new(self.outbox, self.settings, declared)?;
        Ok(Arc::new(Shared {
            core,
            adapters: self.adapters,
        }))
    }
}

impl<A: ?Sized> Shared<A> {
    /// The adapter to send `claim` with, or how long to wait before it may be tried
    /// again: at once when stopping or when no adapter serves the channel, later when
    /// the channel's rate slot is taken.
    pub(crate) fn admit(&self, claim: &Claim) -> Result<&Arc<A>, Duration> {
        if self.core.stopping() {
            return Err(Duration::ZERO);
        }
        let adapter = self.adapters.get(&claim.channel).ok_or(Duration::ZERO)?;
        self.core.take_slot(claim)?;
        Ok(adapter)
    }
}

/// Outcomes waiting to be recorded together (group commit).
pub(crate) struct Unrecorded {
    outcomes: Vec<(Claim, Outcome)>,
    since: Instant,
    window: Duration,
}

impl Unrecorded {
    pub(crate) fn new(window: Duration) -> Self {
        Unrecorded {
            outcomes: Vec::new(),
            since: Instant::now(),
            window,
        }
    }

    /// Adds an outcome; returns the batch to record now if the window since the first
    /// unrecorded outcome has passed (always, for a send slower than the window).
    pub(crate) fn push(&mut self, claim: Claim, outcome: Outcome) -> Option<Vec<(Claim, Outcome)>> {
        if self.outcomes.is_empty() {
            self.since = Instant::now();
        }
        self.outcomes.push((claim, outcome));
        (self.since.elapsed() >= self.window).then(|| self.take())
    }

    /// Everything not yet recorded.
    pub(crate) fn take(&mut self) -> Vec<(Claim, Outcome)> {
        std::mem::take(&mut self.outcomes)
    }
}

impl Core {
    /// Registers each adapter's declarations with the outbox, so recovery and retries
    /// follow them too.
    pub(crate) fn new(
        outbox: Outbox,
        settings: Settings,
        declared: Vec<(String, ReplayPolicy, Pacing)>,
    ) -> Result<Core> {
        settings.validate()?;
        if declared.is_empty() {
            return Err(Error::invalid(
                "adapters",
                "register at least one channel adapter",
            ));
        }
        let mut pacing = HashMap::new();
        let mut channels = Vec::new();
        for (channel, replay, pace) in declared {
            if channel.trim().is_empty() {
                return Err(Error::invalid(
                    "channel",
                    "adapter channel names must not be empty",
                ));
            }
            outbox.set_channel_policy(
                &channel,
                ChannelPolicy {
                    replay,
                    min_interval: pace.lane_interval,
                },
            );
            pacing.insert(channel.clone(), pace);
            channels.push(channel);
        }
        Ok(Core {
            outbox,
            settings,
            channels,
            pacing,
            slots: Mutex::default(),
            stopping: AtomicBool::new(false),
            counters: Counters::default(),
        })
    }

    pub(crate) fn channel_names(&self) -> Vec<&str> {
        self.channels.iter().map(String::as_str).collect()
    }

    pub(crate) fn claim(&self) -> Result<Vec<Claim>> {
        self.outbox
            .claim_channels(&self.channel_names(), self.settings.batch)
    }

    /// When the next chunk of our channels is due (ms, outbox clock), if any.
    pub(crate) fn next_due(&self) -> Option<i64> {
        match self.outbox.next_due(Some(&self.channel_names())) {
            Ok(due) => due.map(|t| t.timestamp_millis()),
            Err(e) => {
                warn!(error = %e, "could not read the next due time");
                // Look again soon rather than sleep through due work.
                Some(self.outbox.options().now_ms())
            }
        }
    }

    /// How long an idle worker may sleep: until `next_due`, at most the poll interval;
    /// `None` when it is due now.
    pub(crate) fn sleep_for(&self, next_due: Option<i64>) -> Option<Duration> {
        let poll = self.settings.poll_interval;
        let Some(due) = next_due else {
            return Some(poll);
        };
        let left = due.saturating_sub(self.outbox.options().now_ms());
        (left > 0).then(|| Duration::from_millis(left as u64).min(poll))
    }

    /// Counts an error the dispatcher logged instead of returning (a failed claim).
    pub(crate) fn note_error(&self) {
        Counters::bump(&self.counters.errors);
    }

    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.outbox.wake();
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub(crate) fn stats(&self) -> DispatchStats {
        self.counters.snapshot()
    }

    /// Takes the channel's next rate slot for this claim, or says how long to wait.
    fn take_slot(&self, claim: &Claim) -> Result<(), Duration> {
        let interval = self
            .pacing
            .get(&claim.channel)
            .map_or(Duration::ZERO, |p| p.channel_interval);
        if interval.is_zero() {
            return Ok(());
        }
        let now = self.outbox.options().now_ms();
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = slots.entry(claim.channel.clone()).or_insert(i64::MIN);
        if *slot > now {
            return Err(Duration::from_millis((*slot - now) as u64));
        }
        *slot = now.saturating_add(duration_ms(interval));
        Ok(())
    }

    /// A span for one send, with the ids that correlate it.
    pub(crate) fn span(claim: &Claim) -> Span {
        let delivery = info_span!("delivery", id = %claim.delivery_id, channel = %claim.channel);
        info_span!(
            parent: &delivery,
            "chunk",
            chunk = %claim.chunk_id,
            index = claim.index,
            total = claim.total,
            attempt = claim.attempt,
        )
    }

    pub(crate) fn before_send(&self, claim: &Claim) {
        Counters::bump(&self.counters.sent);
        // Message text is private: debug level only.
        debug!(text = %claim.text, key = %claim.idempotency_key, "sending");
    }

    /// Records the adapters' outcomes in one transaction and counts them. Errors are
    /// logged and counted, not returned: the chunks' leases then settle them.
    pub(crate) fn record_all(&self, outcomes: &[(Claim, Outcome)]) {
        if outcomes.is_empty() {
            return;
        }
        let batch = outcomes.iter().map(|(c, o)| (c, o.clone()));
        match self.outbox.record_batch(batch) {
            Ok(results) => {
                for ((claim, outcome), result) in outcomes.iter().zip(results) {
                    let kind = outcome_kind(outcome);
                    let _entered = Core::span(claim).entered();
                    match result {
                        Ok(recorded) => self.count(kind, &recorded),
                        Err(e) => {
                            Counters::bump(&self.counters.errors);
                            warn!(error = %e, outcome = kind, "could not record outcome");
                        }
                    }
                }
            }
            Err(e) => {
                for _ in outcomes {
                    Counters::bump(&self.counters.errors);
                }
                warn!(error = %e, outcomes = outcomes.len(), "could not record outcomes; their leases will settle them");
            }
        }
    }

    fn count(&self, kind: &'static str, recorded: &Recorded) {
        let c = &self.counters;
        match recorded.status {
            ChunkStatus::Delivered => {
                Counters::bump(&c.delivered);
                if recorded.finalized {
                    Counters::bump(&c.finalized);
                }
            }
            ChunkStatus::Retry => Counters::bump(&c.retried),
            ChunkStatus::Failed => Counters::bump(&c.failed),
            ChunkStatus::Uncertain => Counters::bump(&c.uncertain),
            _ => {}
        }
        let next = recorded.next_attempt_at.map(|t| t.to_rfc3339());
        match recorded.status {
            ChunkStatus::Failed | ChunkStatus::Uncertain => {
                warn!(outcome = kind, status = %recorded.status, "chunk needs attention")
            }
            _ => {
                info!(outcome = kind, status = %recorded.status, next_attempt_at = ?next, finalized = recorded.finalized, "recorded")
            }
        }
    }

    /// Gives a claim back unstarted, due again after `delay`.
    pub(crate) fn release(&self, claim: &Claim, delay: Duration) {
        match self.outbox.release_after(claim, delay) {
            Ok(_) => Counters::bump(&self.counters.released),
            Err(e) => {
                Counters::bump(&self.counters.errors);
                warn!(error = %e, "could not release claim");
            }
        }
    }
}

fn outcome_kind(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Delivered { .. } => "delivered",
        Outcome::Transient { .. } => "transient",
        Outcome::Permanent { .. } => "permanent",
        Outcome::RateLimited { .. } => "rate_limited",
        Outcome::Ambiguous { .. } => "ambiguous",
    }
}
