//! The options struct and the policies it carries.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::clock::{Clock, SystemClock, duration_ms};
use crate::{ChannelPolicy, Error, Result};

/// SQLite's `synchronous` setting for the database.
///
/// Both settings keep every committed transaction across a crash of the *process*. They
/// differ on power loss or an operating-system crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// `synchronous=NORMAL`: in WAL mode, commits are not fsynced one by one; a power
    /// loss may roll back the most recent transactions, but never corrupts the file.
    /// Several times faster. The default.
    #[default]
    Normal,
    /// `synchronous=FULL`: every commit is fsynced; committed transactions also survive
    /// power loss.
    Full,
}

impl Synchronous {
    pub(crate) fn pragma_value(self) -> i64 {
        match self {
            Synchronous::Normal => 1,
            Synchronous::Full => 2,
        }
    }
}

/// What happens to a chunk whose send may have reached the platform: the adapter
/// reported an ambiguous outcome, or the lease expired while it was `sending` (a crash or
/// a hung worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ReplayPolicy {
    /// Hold the chunk as `uncertain` until an operator or the application resolves it
    /// (as delivered, or to be resent). No duplicate can reach the user; the chat waits.
    /// The default, and the right choice for platforms without idempotent sends
    /// (Telegram, Slack).
    #[default]
    Hold,
    /// Send it again with the same idempotency key. Right for platforms that deduplicate
    /// by key (Matrix `txnId`; Discord `nonce` with `enforce_nonce`, using
    /// [`Claim::compact_key`](crate::Claim::compact_key)), or where the application chose
    /// at-least-once delivery.
    Replay,
}

/// How deliveries to the same chat `(channel, chat_id)` are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum LaneOrder {
    /// One delivery in flight per lane: replies to a chat leave in enqueue order. The
    /// default.
    #[default]
    Fifo,
    /// Deliveries of a lane proceed independently (chunks within a delivery stay in
    /// order). Higher throughput for one busy chat, but replies may interleave.
    Parallel,
}

/// What a FIFO lane does when its head delivery fails for good (dead letter) or is held
/// `uncertain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum LaneFailurePolicy {
    /// The next delivery of the lane goes ahead; the failed one stays listed as a dead
    /// letter. If it is later requeued, it waits until the lane is idle and may then
    /// arrive after newer replies. The default: one bad reply does not silence a chat.
    #[default]
    Skip,
    /// The lane waits until the failed delivery is requeued, resolved or acknowledged
    /// ([`Outbox::acknowledge_dead_letters`](crate::Outbox::acknowledge_dead_letters)). Strict order, at the cost of a stalled chat.
    Block,
}

/// How long to wait before retry number `n` after a transient failure.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Backoff {
    /// Fixed delays; the last one repeats.
    Schedule(Vec<Duration>),
    /// `base * factor^(n-1)`, capped at `cap`.
    Exponential {
        /// Delay before the first retry.
        base: Duration,
        /// Growth per retry.
        factor: f64,
        /// Upper bound.
        cap: Duration,
    },
}

impl Backoff {
    /// Delay before the retry that follows failed attempt number `attempt` (1-based).
    pub fn delay(&self, attempt: u32) -> Duration {
        let n = attempt.max(1);
        match self {
            Backoff::Schedule(steps) => {
                let i = (n as usize - 1).min(steps.len().saturating_sub(1));
                steps.get(i).copied().unwrap_or(Duration::ZERO)
            }
            Backoff::Exponential { base, factor, cap } => {
                let exp = factor.max(1.0).powi(n.saturating_sub(1).min(1024) as i32);
                let secs = (base.as_secs_f64() * exp).min(cap.as_secs_f64());
                Duration::try_from_secs_f64(secs).unwrap_or(*cap)
            }
        }
    }
}

/// When and how often a chunk is retried.
///
/// The default is 5 s, 25 s, 2 min, 10 min, then 10 min; 5 attempts, then the chunk
/// fails (dead letter); ±10 % jitter so that a recovered outage does not release every
/// retry at the same instant; no maximum age. Change it with the `with_*` methods
/// (the struct may gain fields, so it is not built by a literal outside this crate):
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::{Backoff, RetryPolicy};
///
/// let fast = RetryPolicy::default()
///     .with_backoff(Backoff::Schedule(vec![Duration::from_millis(100)]))
///     .with_max_attempts(8)
///     .with_jitter(0.0);
/// assert!(fast.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Delay schedule.
    pub backoff: Backoff,
    /// Attempts (claims) a chunk gets before it fails. An attempt is counted when the
    /// chunk is claimed, before any I/O, so a chunk that crashes the process every time
    /// still runs out.
    pub max_attempts: u32,
    /// Relative jitter applied to each delay, in `0.0..=1.0` (0.1 = ±10 %).
    /// [`validate`](Self::validate) refuses anything else, NaN included.
    pub jitter: f64,
    /// A chunk whose delivery is older than this is failed instead of retried.
    pub max_age: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            backoff: Backoff::Schedule(vec![
                Duration::from_secs(5),
                Duration::from_secs(25),
                Duration::from_secs(120),
                Duration::from_secs(600),
            ]),
            max_attempts: 5,
            jitter: 0.1,
            max_age: None,
        }
    }
}

impl RetryPolicy {
    /// The same policy with this delay schedule.
    pub fn with_backoff(self, backoff: Backoff) -> Self {
        RetryPolicy { backoff, ..self }
    }

    /// The same policy with this many attempts per chunk.
    pub fn with_max_attempts(self, max_attempts: u32) -> Self {
        RetryPolicy {
            max_attempts,
            ..self
        }
    }

    /// The same policy with this relative jitter (`0.0..=1.0`).
    pub fn with_jitter(self, jitter: f64) -> Self {
        RetryPolicy { jitter, ..self }
    }

    /// The same policy with this maximum age (`None`: none).
    pub fn with_max_age(self, max_age: Option<Duration>) -> Self {
        RetryPolicy { max_age, ..self }
    }

    /// Checks that the policy can be followed: at least one attempt, a non-empty
    /// schedule, an exponential factor that is a finite number of at least 1, a jitter
    /// in `0.0..=1.0`, and a maximum age above zero.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] naming the field and the value.
    pub fn validate(&self) -> Result<()> {
        if self.max_attempts == 0 {
            return Err(Error::invalid(
                "retry policy",
                "max_attempts is 0; a chunk needs at least one attempt",
            ));
        }
        match &self.backoff {
            Backoff::Schedule(steps) if steps.is_empty() => {
                return Err(Error::invalid(
                    "retry policy",
                    "the backoff schedule is empty; give at least one delay",
                ));
            }
            Backoff::Exponential { factor, .. } if !(factor.is_finite() && *factor >= 1.0) => {
                return Err(Error::invalid(
                    "retry policy",
                    format!("the exponential factor {factor} is not a finite number >= 1"),
                ));
            }
            _ => {}
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(Error::invalid(
                "retry policy",
                format!("jitter {} is outside 0.0..=1.0", self.jitter),
            ));
        }
        if self.max_age.is_some_and(|age| age.is_zero()) {
            return Err(Error::invalid(
                "retry policy",
                "max_age is zero; every chunk would fail at once (use None for no limit)",
            ));
        }
        Ok(())
    }

    /// The policy as the file stores it: delays and the maximum age in whole
    /// milliseconds, rounded up, so what is stored is never shorter than what was
    /// validated (a maximum age of 500 µs is kept as 1 ms, not as a zero every reader
    /// would refuse).
    pub(crate) fn stored_form(&self) -> Self {
        let ms = |d: &Duration| {
            let whole = d.as_nanos().div_ceil(1_000_000);
            Duration::from_millis(u64::try_from(whole).unwrap_or(u64::MAX))
        };
        let backoff = match &self.backoff {
            Backoff::Schedule(steps) => Backoff::Schedule(steps.iter().map(ms).collect()),
            Backoff::Exponential { base, factor, cap } => Backoff::Exponential {
                base: ms(base),
                factor: *factor,
                cap: ms(cap),
            },
        };
        RetryPolicy {
            backoff,
            max_age: self.max_age.as_ref().map(ms),
            ..self.clone()
        }
    }

    /// Delay in milliseconds before the retry after attempt `attempt`, with jitter.
    pub(crate) fn delay_ms(&self, attempt: u32) -> i64 {
        let base = duration_ms(self.backoff.delay(attempt));
        if self.jitter == 0.0 || base == 0 {
            return base;
        }
        let factor = 1.0 + self.jitter * (fastrand::f64() * 2.0 - 1.0);
        (base as f64 * factor).round() as i64
    }
}

/// Options for [`Outbox::open`](crate::Outbox::open) and
/// [`Outbox::open_in_memory`](crate::Outbox::open_in_memory).
///
/// Two kinds of option live here. Settings of this process — busy timeout,
/// `synchronous`, lease, readers, size cap, checkpoints, clock — apply to this handle
/// only. **Rules whose effects are stored** — lane order, lane failure policy, retry
/// policy, channel rules — live in the file, so every process acts on the same rows by
/// the same rules ([`Policy`](crate::Policy)). A rule given here that the file does not
/// store yet (nobody declared it: a new file, one from before rules were stored, one
/// created by the `outbox` tool) is stored; one the file stores is checked, where a
/// difference is [`Error::PolicyConflict`] unless
/// [`with_policy_update`](Self::with_policy_update) says to replace it. Change them
/// on a running outbox with [`Outbox::set_policy`](crate::Outbox::set_policy) and
/// [`Outbox::set_channel_policy`](crate::Outbox::set_channel_policy), or with `outbox
/// config set`.
///
/// | option | default |
/// |---|---|
/// | busy timeout | 5 s |
/// | `synchronous` | [`Synchronous::Normal`] |
/// | lease | 60 s (at least 1 ms) |
/// | create if missing | yes |
/// | upgrade an older schema | yes |
/// | reader connections | 4 |
/// | maximum database size | none |
/// | background WAL checkpoints | every 100 ms |
/// | clock | [`SystemClock`] |
/// | stored: retry | [`RetryPolicy::default`] (5 s, 25 s, 2 min, 10 min; 5 attempts; ±10 %) |
/// | stored: channel rules | [`ChannelPolicy::default`] (hold ambiguous sends, no pacing) for every channel |
/// | stored: lane order | [`LaneOrder::Fifo`] |
/// | stored: lane failure | [`LaneFailurePolicy::Skip`] |
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::{ChannelPolicy, OutboxOptions, Synchronous};
///
/// let options = OutboxOptions::default()
///     .with_synchronous(Synchronous::Full)
///     .with_lease(Duration::from_secs(30))
///     .with_channel("matrix", ChannelPolicy::replayable())
///     .with_channel("telegram", ChannelPolicy::default().with_lane_interval(Duration::from_secs(1)));
/// ```
#[derive(Debug, Clone)]
pub struct OutboxOptions {
    pub(crate) busy_timeout: Duration,
    pub(crate) synchronous: Synchronous,
    pub(crate) lease: Duration,
    pub(crate) create_if_missing: bool,
    pub(crate) upgrade_schema: bool,
    pub(crate) readers: u32,
    pub(crate) max_size: Option<u64>,
    pub(crate) checkpoint_every: Option<Duration>,
    pub(crate) clock: Arc<dyn Clock>,
    /// Stored rules this process declares (`None`: whatever the file stores).
    pub(crate) retry: Option<RetryPolicy>,
    pub(crate) default_channel: Option<ChannelPolicy>,
    pub(crate) channels: Vec<(String, ChannelPolicy)>,
    pub(crate) lane_order: Option<LaneOrder>,
    pub(crate) lane_failure: Option<LaneFailurePolicy>,
    pub(crate) policy_update: bool,
}

impl Default for OutboxOptions {
    fn default() -> Self {
        OutboxOptions {
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::Normal,
            lease: Duration::from_secs(60),
            create_if_missing: true,
            upgrade_schema: true,
            readers: 4,
            max_size: None,
            checkpoint_every: Some(Duration::from_millis(100)),
            clock: Arc::new(SystemClock),
            retry: None,
            default_channel: None,
            channels: Vec::new(),
            lane_order: None,
            lane_failure: None,
            policy_update: false,
        }
    }
}

impl OutboxOptions {
    /// Checks every option against its documented range; [`Outbox::open`](crate::Outbox::open)
    /// calls it before touching the file.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a lease under 1 ms (a claim that protects nothing:
    /// two claimers would get the same chunk), an invalid retry policy (see
    /// [`RetryPolicy::validate`]), default channel rules with a retry policy of their
    /// own (give the file-wide one with [`with_retry`](Self::with_retry)), or a zero
    /// background checkpoint interval.
    pub fn validate(&self) -> Result<()> {
        if duration_ms(self.lease) < 1 {
            return Err(Error::invalid(
                "lease",
                format!(
                    "{:?} is under 1 ms; a lease must cover a send, or another claimer gets the same chunk",
                    self.lease
                ),
            ));
        }
        if let Some(retry) = &self.retry {
            retry.validate()?;
        }
        if let Some(rules) = &self.default_channel {
            crate::policy::check_default_channel(rules)?;
        }
        for (_, policy) in &self.channels {
            policy.validate()?;
        }
        if self.checkpoint_every.is_some_and(|every| every.is_zero()) {
            return Err(Error::invalid(
                "background checkpoints",
                "the interval is zero; use None to turn them off",
            ));
        }
        Ok(())
    }

    /// How long a connection waits for another one's write lock before giving up with
    /// [`Error::Busy`](crate::Error::Busy).
    pub fn with_busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Durability of commits; see [`Synchronous`].
    pub fn with_synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a claim owns its chunk unless renewed. A claim whose lease expired can be
    /// recovered by any claimer; a running [`Dispatcher`](crate::Dispatcher) renews the
    /// leases of the sends it has in flight, so the lease bounds how long a crashed
    /// dispatcher's chunks stay held, not how long a send may take. At least 1 ms.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Stored rule: the retry schedule and attempt budget of channels without one of
    /// their own.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }

    /// Stored rule: the rules of one channel, by name.
    pub fn with_channel(mut self, channel: impl Into<String>, policy: ChannelPolicy) -> Self {
        let channel = channel.into();
        self.channels.retain(|(name, _)| *name != channel);
        self.channels.push((channel, policy));
        self
    }

    /// Stored rule: the rules of channels without rules of their own. Their retry
    /// policy is the file-wide one ([`with_retry`](Self::with_retry)): rules given here
    /// with a retry policy of their own are refused at open.
    pub fn with_default_channel(mut self, policy: ChannelPolicy) -> Self {
        self.default_channel = Some(policy);
        self
    }

    /// Stored rule: ordering of deliveries within a chat.
    pub fn with_lane_order(mut self, order: LaneOrder) -> Self {
        self.lane_order = Some(order);
        self
    }

    /// Stored rule: what a FIFO lane does when its head fails for good.
    pub fn with_lane_failure(mut self, policy: LaneFailurePolicy) -> Self {
        self.lane_failure = Some(policy);
        self
    }

    /// Whether stored rules given in these options replace the file's when they
    /// differ (`true`), instead of failing the open with
    /// [`Error::PolicyConflict`](crate::Error::PolicyConflict) (`false`, the default).
    /// For an application that keeps its rules in its code and owns the file.
    pub fn with_policy_update(mut self, update: bool) -> Self {
        self.policy_update = update;
        self
    }

    /// Whether [`Outbox::open`](crate::Outbox::open) may create a missing file. When
    /// false, a missing file is [`Error::DatabaseMissing`](crate::Error::DatabaseMissing)
    /// and nothing appears on disk.
    pub fn with_create_if_missing(mut self, create: bool) -> Self {
        self.create_if_missing = create;
        self
    }

    /// Whether [`Outbox::open`](crate::Outbox::open) may bring an older schema up to
    /// date. When false, a file at an older schema version is
    /// [`Error::SchemaTooOld`](crate::Error::SchemaTooOld), and a file that is not an
    /// outbox is [`Error::NotAnOutbox`](crate::Error::NotAnOutbox); either is left as it
    /// was. Default true.
    pub fn with_schema_upgrade(mut self, upgrade: bool) -> Self {
        self.upgrade_schema = upgrade;
        self
    }

    /// Number of pooled read-only connections (at least 1).
    pub fn with_readers(mut self, readers: u32) -> Self {
        self.readers = readers.max(1);
        self
    }

    /// Caps the database file at about `bytes` (SQLite's `max_page_count`). A write
    /// that would grow it further fails with [`Error::DiskFull`](crate::Error::DiskFull)
    /// and changes nothing; reopening with a larger cap (or none) lifts it. Default: no
    /// cap beyond the disk's.
    pub fn with_max_size(mut self, bytes: Option<u64>) -> Self {
        self.max_size = bytes;
        self
    }

    /// Passive WAL checkpoints on a background thread at this interval, so that the
    /// checkpoint rarely falls inside a commit (which then stalls for an fsync). SQLite's
    /// automatic checkpoint stays on as the bound under sustained writes, at
    /// [`BACKGROUND_AUTOCHECKPOINT_PAGES`](crate::StorageSettings::BACKGROUND_AUTOCHECKPOINT_PAGES)
    /// instead of 1000. `None` leaves checkpoints to it alone, at SQLite's default.
    /// Files only. Default 100 ms.
    pub fn with_background_checkpoints(mut self, every: Option<Duration>) -> Self {
        self.checkpoint_every = every;
        self
    }

    /// The clock every timestamp is read from.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The retry policy these options give the file, if they give one.
    pub fn retry_policy(&self) -> Option<&RetryPolicy> {
        self.retry.as_ref()
    }

    pub(crate) fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_schedule_matches_the_documented_one() {
        let b = RetryPolicy::default().backoff;
        let secs: Vec<u64> = (1..=6).map(|n| b.delay(n).as_secs()).collect();
        assert_eq!(secs, [5, 25, 120, 600, 600, 600]);
    }

    #[test]
    fn exponential_backoff_grows_and_caps() {
        let b = Backoff::Exponential {
            base: Duration::from_secs(1),
            factor: 2.0,
            cap: Duration::from_secs(10),
        };
        let secs: Vec<u64> = (1..=6).map(|n| b.delay(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 10, 10]);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(10));
    }

    #[test]
    fn jitter_stays_within_its_band_and_spreads_across_it() {
        let policy = RetryPolicy::default();
        let delays: Vec<i64> = (0..1000).map(|_| policy.delay_ms(1)).collect();
        for d in &delays {
            assert!((4_500..=5_500).contains(d), "{d}");
        }
        // Spread on both sides of the base delay, over most of the band.
        let (min, max) = (delays.iter().min().unwrap(), delays.iter().max().unwrap());
        assert!(*min < 4_600 && *max > 5_400, "{min}..{max}");
        let exact = RetryPolicy {
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        assert_eq!(exact.delay_ms(2), 25_000);
    }
}
