//! The rules whose effects are stored ([`Rules`], what [`Outbox::rules`](crate::Outbox::rules) reads), and their stored form: lane order, lane failure
//! policy, the retry policy, and per channel the replay policy, lane interval,
//! channel-wide rate and retry policy. Every rule type lives here; the options only
//! declare them.
//!
//! Every process that opens the file — dispatchers, the `outbox` tool, a cron job —
//! reads the same rules, so they all act on the same rows the same way. Each handle
//! keeps the rules it last read and reads them again when `outbound_policy.version`
//! changed (any process changing a rule bumps it), at the start of its next write.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::clock::duration_ms;
use crate::error::{Error, Result};

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
    /// at-least-once delivery. A replay is sent whenever the retry schedule says, even
    /// after a platform's deduplication window has passed: [`Ask`](Self::Ask) is the
    /// safer choice for a platform whose window is limited.
    Replay,
    /// Hold the chunk as `uncertain`, then ask the platform through the channel's adapter
    /// ([`ChannelAdapter::settle`](crate::ChannelAdapter::settle)): a dispatcher marks it
    /// delivered when the platform has it, sends it again under the same key when the
    /// platform does not have it or will deduplicate the resend (inside its window),
    /// and leaves it held for a person only when the platform cannot tell. Every answer
    /// is kept on the chunk ([`ChunkView::settlement`](crate::monitoring::ChunkView::settlement)).
    /// The chat waits for the answer: its next reply is not sent before it (see
    /// [`LaneFailurePolicy::Skip`]).
    /// See [`settle`](crate::settle).
    Ask,
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
    /// letter, an uncertain one waits for a person. If it is later requeued, it waits
    /// until the lane is idle and may then arrive after newer replies. The default: one
    /// bad reply does not silence a chat.
    ///
    /// On a channel that asks its platform ([`ReplayPolicy::Ask`]), a reply whose part
    /// is being asked about holds the lane until the answer is recorded: delivered or
    /// sent again, it goes before the next reply; held for a person, the lane moves on.
    #[default]
    Skip,
    /// The lane waits until the failed delivery is requeued, resolved or acknowledged
    /// ([`Outbox::dismiss_dead_letters`](crate::Outbox::dismiss_dead_letters)). Strict order, at the cost of a stalled chat.
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
/// use chunked_outbox::rules::{Backoff, RetryPolicy};
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

/// The rules of one channel.
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::rules::ChannelPolicy;
///
/// // Telegram: no way to deduplicate, about 1 message/s per chat and 30/s per bot.
/// let telegram = ChannelPolicy::default()
///     .with_lane_interval(Duration::from_secs(1))
///     .with_rate_per_second(30.0);
/// // Matrix deduplicates by transaction id: a possibly-sent chunk may be replayed.
/// let matrix = ChannelPolicy::replayable();
/// assert_ne!(telegram, matrix);
/// ```
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
#[non_exhaustive]
pub struct ChannelPolicy {
    /// What to do with chunks that may have been sent. Default [`ReplayPolicy::Hold`].
    pub replay: ReplayPolicy,
    /// Minimum time between the starts of two sends to the same chat, whoever sends them
    /// (e.g. about 1 s for Telegram). Default zero.
    pub lane_interval: Duration,
    /// Minimum time between the starts of two sends on the whole channel, across every
    /// process on the file (1/30 s for Telegram's 30 messages/s per bot). Default zero.
    /// Stored in whole microseconds. The channel keeps a schedule: a send that starts
    /// up to a millisecond late (the clock's resolution) does not push the next one
    /// back, so a rate such as 195/s is kept although the clock reads milliseconds.
    pub channel_interval: Duration,
    /// The channel's own retry policy; `None` follows the file's.
    pub retry: Option<RetryPolicy>,
}

impl ChannelPolicy {
    /// A policy for platforms that deduplicate by idempotency key: ambiguous sends are
    /// replayed.
    pub fn replayable() -> Self {
        ChannelPolicy {
            replay: ReplayPolicy::Replay,
            ..Self::default()
        }
    }

    /// A policy for platforms that can say whether a possibly-sent chunk reached them
    /// (Slack, by a lookup) or deduplicate a resend for a while (Discord, LINE,
    /// Matrix): such chunks are held and settled by asking the platform
    /// ([`ReplayPolicy::Ask`]).
    pub fn asking() -> Self {
        ChannelPolicy {
            replay: ReplayPolicy::Ask,
            ..Self::default()
        }
    }

    /// Sets what happens to a chunk that may have been sent.
    pub fn with_replay(mut self, replay: ReplayPolicy) -> Self {
        self.replay = replay;
        self
    }

    /// Sets the minimum time between two sends to one chat.
    pub fn with_lane_interval(mut self, interval: Duration) -> Self {
        self.lane_interval = interval;
        self
    }

    /// Sets the minimum time between two sends on the whole channel.
    pub fn with_channel_interval(mut self, interval: Duration) -> Self {
        self.channel_interval = interval;
        self
    }

    /// Sets the channel-wide rate as sends per second (the inverse of
    /// [`with_channel_interval`](Self::with_channel_interval)); 0 or less means no limit.
    /// The interval is stored in whole microseconds, rounded up, so the stored rate never
    /// exceeds the one asked for (30/s is kept as 33,334 µs, 29.9999/s).
    pub fn with_rate_per_second(self, rate: f64) -> Self {
        let interval = if rate > 0.0 {
            Duration::try_from_secs_f64(1.0 / rate).unwrap_or(Duration::ZERO)
        } else {
            Duration::ZERO
        };
        self.with_channel_interval(interval)
    }

    /// Gives the channel a retry policy of its own.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }

    /// The policy as the file stores it: the lane interval in whole milliseconds and the
    /// channel's in whole microseconds, rounded up (a send is never allowed sooner than
    /// asked).
    pub(crate) fn stored_form(&self) -> Self {
        ChannelPolicy {
            lane_interval: Duration::from_millis(ceil_ms(self.lane_interval)),
            channel_interval: us(stored_us(self.channel_interval)),
            retry: self.retry.as_ref().map(RetryPolicy::stored_form),
            ..self.clone()
        }
    }

    /// Checks the policy can be followed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for an invalid retry policy
    /// ([`RetryPolicy::validate`]).
    pub fn validate(&self) -> Result<()> {
        self.retry.as_ref().map_or(Ok(()), RetryPolicy::validate)
    }
}

/// Refuses default channel rules that carry a retry policy of their own: the file-wide
/// retry policy ([`Rules::retry`], [`OutboxOptions::with_retry`](crate::OutboxOptions::with_retry))
/// is the one for channels without rules of their own, and the file keeps no second one.
pub(crate) fn check_default_channel(rules: &ChannelPolicy) -> Result<()> {
    rules.validate()?;
    if rules.retry.is_some() {
        return Err(Error::invalid(
            "default channel rules",
            "they carry a retry policy, which the file does not keep for the default channel: \
             give it as the file-wide retry policy (OutboxOptions::with_retry, Rules::retry), \
             which every channel without rules of its own follows",
        ));
    }
    Ok(())
}

/// The rules stored in an outbox file (see [`Outbox::rules`](crate::Outbox::rules)).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Rules {
    /// How deliveries to one chat are ordered.
    pub lane_order: LaneOrder,
    /// What a FIFO lane does when its head fails for good or is held.
    pub lane_failure: LaneFailurePolicy,
    /// The retry policy of channels without one of their own.
    pub retry: RetryPolicy,
    /// The rules of channels without rules of their own.
    pub default_channel: ChannelPolicy,
    /// Channels with rules of their own, by name.
    pub channels: BTreeMap<String, ChannelPolicy>,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            lane_order: LaneOrder::Fifo,
            lane_failure: LaneFailurePolicy::Skip,
            retry: RetryPolicy::default(),
            default_channel: ChannelPolicy::default(),
            channels: BTreeMap::new(),
        }
    }
}

impl Rules {
    /// The rules that apply to `channel`: its own, or the default.
    pub fn channel(&self, channel: &str) -> &ChannelPolicy {
        self.channels.get(channel).unwrap_or(&self.default_channel)
    }

    /// The retry policy that applies to `channel`.
    pub fn retry_for(&self, channel: &str) -> &RetryPolicy {
        self.channel(channel).retry.as_ref().unwrap_or(&self.retry)
    }

    /// Gives `channel` rules of its own (`Some`), or the default ones (`None`).
    pub(crate) fn set_channel(&mut self, channel: &str, rules: Option<&ChannelPolicy>) {
        match rules {
            Some(rules) => self.channels.insert(channel.to_owned(), rules.clone()),
            None => self.channels.remove(channel),
        };
    }
}

/// What a handle knows of the stored rules: the rules, which of the file-wide ones
/// were declared, the version they were read at, and each channel's number.
#[derive(Debug, Clone, Default)]
pub(crate) struct Stored {
    pub version: i64,
    pub policy: Rules,
    /// The application's finalization statement, if one is set.
    pub finalize_sql: Option<String>,
    pub declared: FileRules,
    pub channel_ids: HashMap<String, i64>,
}

/// A set of the file-wide rules: those declared (stored) so far, or those to store.
/// A rule nobody declared follows its default until a process declares it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FileRules {
    pub lane_order: bool,
    pub lane_failure: bool,
    pub retry: bool,
    pub default_channel: bool,
}

impl FileRules {
    pub fn any(self) -> bool {
        self != FileRules::default()
    }
}

/// The file-wide rules as every store keeps them: one column per rule, NULL for a rule
/// nobody declared (the default channel's three columns declared together).
pub(crate) struct FileColumns<'a> {
    pub lane_order: Option<&'a str>,
    pub lane_failure: Option<&'a str>,
    pub retry: Option<&'a str>,
    pub replay: Option<&'a str>,
    pub lane_ms: Option<i64>,
    pub channel_us: Option<i64>,
}

impl FileColumns<'_> {
    /// The rules they store (a rule nobody declared reads as its default; no channel
    /// rules yet), and which of them are declared.
    pub(crate) fn policy(&self) -> Result<(Rules, FileRules)> {
        let declared = FileRules {
            lane_order: self.lane_order.is_some(),
            lane_failure: self.lane_failure.is_some(),
            retry: self.retry.is_some(),
            default_channel: self.replay.is_some(),
        };
        let defaults = Rules::default();
        let default_channel = match self.replay {
            Some(replay) => channel_from_columns(replay, self.lane_ms, self.channel_us, None)?,
            None => defaults.default_channel,
        };
        let policy = Rules {
            lane_order: self
                .lane_order
                .map_or(Ok(defaults.lane_order), parse_lane_order)?,
            lane_failure: self
                .lane_failure
                .map_or(Ok(defaults.lane_failure), parse_lane_failure)?,
            retry: self.retry.map_or(Ok(defaults.retry), retry_from_json)?,
            default_channel,
            channels: BTreeMap::new(),
        };
        Ok((policy, declared))
    }
}

/// A channel's rules from their stored columns: the replay policy's text, the lane
/// interval in ms, the channel interval in µs, the retry policy's text.
pub(crate) fn channel_from_columns(
    replay: &str,
    lane_ms: Option<i64>,
    channel_us: Option<i64>,
    retry: Option<&str>,
) -> Result<ChannelPolicy> {
    Ok(ChannelPolicy {
        replay: parse_replay(replay)?,
        lane_interval: ms(lane_ms.unwrap_or(0)),
        channel_interval: us(channel_us.unwrap_or(0)),
        retry: retry.map(retry_from_json).transpose()?,
    })
}

/// Whole milliseconds of `d`, rounded up.
fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// An interval as a stored column: whole milliseconds, rounded up.
pub(crate) fn stored_ms(d: Duration) -> i64 {
    i64::try_from(ceil_ms(d)).unwrap_or(i64::MAX)
}

/// A channel interval as a stored column: whole microseconds, rounded up.
pub(crate) fn stored_us(d: Duration) -> i64 {
    i64::try_from(d.as_nanos().div_ceil(1_000)).unwrap_or(i64::MAX)
}

fn us(us: i64) -> Duration {
    Duration::from_micros(us.max(0) as u64)
}

fn ms(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}

/// A stored rule that this build cannot read (written by hand, or by a newer build).
fn unreadable(what: &'static str, value: &str) -> Error {
    Error::invalid(
        what,
        format!("the stored value {value:?} is not one this build knows"),
    )
}

pub(crate) fn lane_order_str(order: LaneOrder) -> &'static str {
    match order {
        LaneOrder::Fifo => "fifo",
        LaneOrder::Parallel => "parallel",
    }
}

pub(crate) fn parse_lane_order(s: &str) -> Result<LaneOrder> {
    match s {
        "fifo" => Ok(LaneOrder::Fifo),
        "parallel" => Ok(LaneOrder::Parallel),
        other => Err(unreadable("lane order", other)),
    }
}

pub(crate) fn lane_failure_str(policy: LaneFailurePolicy) -> &'static str {
    match policy {
        LaneFailurePolicy::Skip => "skip",
        LaneFailurePolicy::Block => "block",
    }
}

pub(crate) fn parse_lane_failure(s: &str) -> Result<LaneFailurePolicy> {
    match s {
        "skip" => Ok(LaneFailurePolicy::Skip),
        "block" => Ok(LaneFailurePolicy::Block),
        other => Err(unreadable("lane failure policy", other)),
    }
}

pub(crate) fn replay_str(replay: ReplayPolicy) -> &'static str {
    match replay {
        ReplayPolicy::Hold => "hold",
        ReplayPolicy::Replay => "replay",
        ReplayPolicy::Ask => "ask",
    }
}

pub(crate) fn parse_replay(s: &str) -> Result<ReplayPolicy> {
    match s {
        "hold" => Ok(ReplayPolicy::Hold),
        "replay" => Ok(ReplayPolicy::Replay),
        "ask" => Ok(ReplayPolicy::Ask),
        other => Err(unreadable("replay policy", other)),
    }
}

/// The stored form of a [`RetryPolicy`]: durations in milliseconds.
#[derive(Serialize, Deserialize)]
struct RetryJson {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    schedule_ms: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exponential: Option<ExponentialJson>,
    max_attempts: u32,
    jitter: f64,
    max_age_ms: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct ExponentialJson {
    base_ms: u64,
    factor: f64,
    cap_ms: u64,
}

fn to_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The stored text of a retry policy: its [stored form](RetryPolicy::stored_form), so
/// the file holds exactly what a reader compares against.
pub(crate) fn retry_to_json(retry: &RetryPolicy) -> String {
    let retry = &retry.stored_form();
    let (schedule_ms, exponential) = match &retry.backoff {
        Backoff::Schedule(steps) => (Some(steps.iter().copied().map(to_ms).collect()), None),
        Backoff::Exponential { base, factor, cap } => (
            None,
            Some(ExponentialJson {
                base_ms: to_ms(*base),
                factor: *factor,
                cap_ms: to_ms(*cap),
            }),
        ),
    };
    let json = RetryJson {
        schedule_ms,
        exponential,
        max_attempts: retry.max_attempts,
        jitter: retry.jitter,
        max_age_ms: retry.max_age.map(to_ms),
    };
    serde_json::to_string(&json).unwrap_or_default()
}

pub(crate) fn retry_from_json(text: &str) -> Result<RetryPolicy> {
    let json: RetryJson =
        serde_json::from_str(text).map_err(|_| unreadable("retry policy", text))?;
    let backoff = match (json.schedule_ms, json.exponential) {
        (Some(steps), None) => {
            Backoff::Schedule(steps.into_iter().map(Duration::from_millis).collect())
        }
        (None, Some(e)) => Backoff::Exponential {
            base: Duration::from_millis(e.base_ms),
            factor: e.factor,
            cap: Duration::from_millis(e.cap_ms),
        },
        _ => return Err(unreadable("retry policy", text)),
    };
    let retry = RetryPolicy {
        backoff,
        max_attempts: json.max_attempts,
        jitter: json.jitter,
        max_age: json.max_age_ms.map(Duration::from_millis),
    };
    retry
        .validate()
        .map_err(|_| unreadable("retry policy", text))?;
    Ok(retry)
}

/// The named parameters an application's finalization statement may use (written
/// `:name`, `@name` or `$name`), each bound from the finalized delivery:
///
/// | parameter | value |
/// |---|---|
/// | `delivery_id` | the delivery's id (UUID text) |
/// | `channel`, `chat_id` | where it went |
/// | `sender` | the sender name given at enqueue, or NULL |
/// | `content` | the whole text |
/// | `chunk_count` | how many chunks it was sent as |
/// | `created_at`, `delivered_at` | enqueue and finalization time, ms since the epoch |
/// | `delivered_at_rfc3339` | finalization time as RFC 3339 text (UTC, milliseconds) |
/// | `platform_message_ids` | the platform's message id of each chunk, a JSON array in chunk order (`null` where the platform gave none) |
/// | `metadata` | the metadata given at enqueue, or NULL |
pub const FINALIZE_PARAMETERS: &[&str] = &[
    "delivery_id",
    "channel",
    "chat_id",
    "sender",
    "content",
    "chunk_count",
    "created_at",
    "delivered_at",
    "delivered_at_rfc3339",
    "platform_message_ids",
    "metadata",
];

/// Which of [`FINALIZE_PARAMETERS`] a statement's parameter (`:name`, `@name`,
/// `$name`) names.
pub(crate) fn parameter_index(name: &str) -> Option<usize> {
    let name = name.get(1..)?;
    FINALIZE_PARAMETERS.iter().position(|p| *p == name)
}

/// What, besides an active delivery, keeps a FIFO lane's next reply waiting: the
/// lane's failure policy, and whether its channel asks the platform about a part that
/// may have been sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaneHold {
    /// Nothing: a reply set aside (dead letter, uncertain) lets the next one go
    /// ([`LaneFailurePolicy::Skip`]).
    Nothing,
    /// A reply whose part is uncertain and its platform not asked yet: the chat waits
    /// for the answer, and goes on once it is "hold" ([`LaneFailurePolicy::Skip`] on a
    /// channel under [`ReplayPolicy::Ask`]).
    Asking,
    /// Every uncertain reply and every dead letter nobody acknowledged
    /// ([`LaneFailurePolicy::Block`]).
    Everything,
}

impl LaneHold {
    /// What holds the lanes of `channel` under `rules`.
    pub(crate) fn of(rules: &Rules, channel: &str) -> LaneHold {
        match rules.lane_failure {
            LaneFailurePolicy::Block => LaneHold::Everything,
            LaneFailurePolicy::Skip if rules.channel(channel).replay == ReplayPolicy::Ask => {
                LaneHold::Asking
            }
            LaneFailurePolicy::Skip => LaneHold::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_policies_round_trip_through_their_stored_form() {
        for retry in [
            RetryPolicy::default(),
            RetryPolicy {
                backoff: Backoff::Exponential {
                    base: Duration::from_millis(250),
                    factor: 1.5,
                    cap: Duration::from_secs(90),
                },
                max_attempts: 9,
                jitter: 0.0,
                max_age: Some(Duration::from_secs(3600)),
            },
        ] {
            assert_eq!(retry_from_json(&retry_to_json(&retry)).unwrap(), retry);
        }
        for bad in [
            "",
            "{}",
            r#"{"max_attempts":0,"jitter":0.1,"max_age_ms":null,"schedule_ms":[1]}"#,
        ] {
            assert!(retry_from_json(bad).is_err(), "{bad}");
        }
    }

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
