//! The rules whose effects are stored, stored in the file (`outbound_policy`,
//! `outbound_channels`): lane order, lane failure policy, the retry policy, and per
//! channel the replay policy, lane interval, channel-wide rate and retry policy.
//!
//! Every process that opens the file — dispatchers, the `outbox` tool, a cron job —
//! reads the same rules, so they all act on the same rows the same way. Each handle
//! keeps the rules it last read and reads them again when `outbound_policy.version`
//! changed (any process changing a rule bumps it), at the start of its next write.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::options::{Backoff, LaneFailurePolicy, LaneOrder, ReplayPolicy, RetryPolicy};
use crate::{Error, Result};

/// The rules of one channel.
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::ChannelPolicy;
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
/// retry policy ([`Policy::retry`], [`OutboxOptions::with_retry`](crate::OutboxOptions::with_retry))
/// is the one for channels without rules of their own, and the file keeps no second one.
pub(crate) fn check_default_channel(rules: &ChannelPolicy) -> Result<()> {
    rules.validate()?;
    if rules.retry.is_some() {
        return Err(Error::invalid(
            "default channel rules",
            "they carry a retry policy, which the file does not keep for the default channel: \
             give it as the file-wide retry policy (OutboxOptions::with_retry, Policy::retry), \
             which every channel without rules of its own follows",
        ));
    }
    Ok(())
}

/// The rules stored in an outbox file (see [`Outbox::policy`](crate::Outbox::policy)).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Policy {
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

impl Default for Policy {
    fn default() -> Self {
        Policy {
            lane_order: LaneOrder::Fifo,
            lane_failure: LaneFailurePolicy::Skip,
            retry: RetryPolicy::default(),
            default_channel: ChannelPolicy::default(),
            channels: BTreeMap::new(),
        }
    }
}

impl Policy {
    /// The rules that apply to `channel`: its own, or the default.
    pub fn channel(&self, channel: &str) -> &ChannelPolicy {
        self.channels.get(channel).unwrap_or(&self.default_channel)
    }

    /// The retry policy that applies to `channel`.
    pub fn retry_for(&self, channel: &str) -> &RetryPolicy {
        self.channel(channel).retry.as_ref().unwrap_or(&self.retry)
    }
}

/// What a handle knows of the stored rules: the rules, which of the file-wide ones
/// were declared, the version they were read at, and each channel's number.
#[derive(Debug, Clone, Default)]
pub(crate) struct Stored {
    pub version: i64,
    pub policy: Policy,
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

/// The stored version of the rules.
pub(crate) fn version(conn: &Connection) -> Result<i64> {
    Ok(conn
        .prepare_cached("SELECT version FROM outbound_policy WHERE id = 1")?
        .query_row([], |r| r.get(0))?)
}

/// Reads every stored rule; a file-wide rule nobody declared reads as its default.
pub(crate) fn load(conn: &Connection) -> Result<Stored> {
    type Row = (
        i64,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<i64>,
        Option<String>,
    );
    let (version, lane_order, lane_failure, retry, replay, lane_ms, channel_us, finalize_sql): Row =
        conn.query_row(
            "SELECT version, lane_order, lane_failure, retry, replay, lane_interval_ms,
                    channel_interval_us, finalize_sql
             FROM outbound_policy WHERE id = 1",
            [],
            |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                ))
            },
        )?;
    let declared = FileRules {
        lane_order: lane_order.is_some(),
        lane_failure: lane_failure.is_some(),
        retry: retry.is_some(),
        default_channel: replay.is_some(),
    };
    let defaults = Policy::default();
    let default_channel = match replay {
        Some(replay) => ChannelPolicy {
            replay: parse_replay(&replay)?,
            lane_interval: ms(lane_ms.unwrap_or(0)),
            channel_interval: us(channel_us.unwrap_or(0)),
            retry: None,
        },
        None => defaults.default_channel,
    };
    let mut policy = Policy {
        lane_order: lane_order
            .as_deref()
            .map_or(Ok(defaults.lane_order), parse_lane_order)?,
        lane_failure: lane_failure
            .as_deref()
            .map_or(Ok(defaults.lane_failure), parse_lane_failure)?,
        retry: retry
            .as_deref()
            .map_or(Ok(defaults.retry), retry_from_json)?,
        default_channel,
        channels: BTreeMap::new(),
    };
    let mut channel_ids = HashMap::new();
    let mut stmt = conn.prepare(
        "SELECT id, name, replay, lane_interval_ms, channel_interval_us, retry
         FROM outbound_channels",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let name: String = r.get(1)?;
        channel_ids.insert(name.clone(), r.get(0)?);
        if let Some(replay) = r.get::<_, Option<String>>(2)? {
            let retry = r.get::<_, Option<String>>(5)?;
            policy.channels.insert(
                name,
                ChannelPolicy {
                    replay: parse_replay(&replay)?,
                    lane_interval: ms(r.get::<_, Option<i64>>(3)?.unwrap_or(0)),
                    channel_interval: us(r.get::<_, Option<i64>>(4)?.unwrap_or(0)),
                    retry: retry.as_deref().map(retry_from_json).transpose()?,
                },
            );
        }
    }
    Ok(Stored {
        version,
        policy,
        finalize_sql,
        declared,
        channel_ids,
    })
}

/// Stores (declares) the file-wide rules of `policy` that `which` names, bumping the
/// version; the others keep what is stored.
pub(crate) fn store_file_rules(conn: &Connection, policy: &Policy, which: FileRules) -> Result<()> {
    policy.retry.validate()?;
    check_default_channel(&policy.default_channel)?;
    let d = &policy.default_channel;
    conn.execute(
        "UPDATE outbound_policy
         SET version = version + 1,
             lane_order = CASE WHEN ?1 THEN ?2 ELSE lane_order END,
             lane_failure = CASE WHEN ?3 THEN ?4 ELSE lane_failure END,
             retry = CASE WHEN ?5 THEN ?6 ELSE retry END,
             replay = CASE WHEN ?7 THEN ?8 ELSE replay END,
             lane_interval_ms = CASE WHEN ?7 THEN ?9 ELSE lane_interval_ms END,
             channel_interval_us = CASE WHEN ?7 THEN ?10 ELSE channel_interval_us END
         WHERE id = 1",
        params![
            which.lane_order,
            lane_order_str(policy.lane_order),
            which.lane_failure,
            lane_failure_str(policy.lane_failure),
            which.retry,
            retry_to_json(&policy.retry),
            which.default_channel,
            replay_str(d.replay),
            stored_ms(d.lane_interval),
            stored_us(d.channel_interval),
        ],
    )?;
    Ok(())
}

/// Gives `channel` rules of its own (`Some`) or lets it follow the default (`None`),
/// bumping the version.
pub(crate) fn store_channel(
    conn: &Connection,
    channel: &str,
    rules: Option<&ChannelPolicy>,
) -> Result<()> {
    if let Some(rules) = rules {
        rules.validate()?;
    }
    conn.execute(
        "INSERT INTO outbound_channels (name, replay, lane_interval_ms, channel_interval_us, retry)
         VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (name) DO UPDATE SET replay = excluded.replay,
             lane_interval_ms = excluded.lane_interval_ms,
             channel_interval_us = excluded.channel_interval_us, retry = excluded.retry",
        params![
            channel,
            rules.map(|r| replay_str(r.replay)),
            rules.map(|r| stored_ms(r.lane_interval)),
            rules.map(|r| stored_us(r.channel_interval)),
            rules.and_then(|r| r.retry.as_ref()).map(retry_to_json),
        ],
    )?;
    bump(conn)
}

/// The number of `channel`, registering it (with the default rules) on first sight.
pub(crate) fn channel_id(conn: &Connection, stored: &Stored, channel: &str) -> Result<i64> {
    if let Some(id) = stored.channel_ids.get(channel) {
        return Ok(*id);
    }
    let existing: Option<i64> = conn
        .prepare_cached("SELECT id FROM outbound_channels WHERE name = ?1")?
        .query_row([channel], |r| r.get(0))
        .optional()?;
    if let Some(id) = existing {
        return Ok(id);
    }
    conn.prepare_cached("INSERT INTO outbound_channels (name) VALUES (?1)")?
        .execute([channel])?;
    let id = conn.last_insert_rowid();
    // Other handles learn the new channel's number at their next write.
    bump(conn)?;
    Ok(id)
}

fn bump(conn: &Connection) -> Result<()> {
    conn.prepare_cached("UPDATE outbound_policy SET version = version + 1 WHERE id = 1")?
        .execute([])?;
    Ok(())
}

/// Whole milliseconds of `d`, rounded up.
fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// An interval as a stored column: whole milliseconds, rounded up.
fn stored_ms(d: Duration) -> i64 {
    i64::try_from(ceil_ms(d)).unwrap_or(i64::MAX)
}

/// A channel interval as a stored column: whole microseconds, rounded up.
fn stored_us(d: Duration) -> i64 {
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

fn parse_lane_order(s: &str) -> Result<LaneOrder> {
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

fn parse_lane_failure(s: &str) -> Result<LaneFailurePolicy> {
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
    }
}

fn parse_replay(s: &str) -> Result<ReplayPolicy> {
    match s {
        "hold" => Ok(ReplayPolicy::Hold),
        "replay" => Ok(ReplayPolicy::Replay),
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

fn retry_from_json(text: &str) -> Result<RetryPolicy> {
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
}
