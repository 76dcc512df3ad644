//! What a health snapshot means for an alert, and an HTTP endpoint to mount in the
//! application's own server.
//!
//! [`Health::verdict`] turns a snapshot into ok / warn / fail with the reasons, by the
//! [`Thresholds`] that `outbox health` and `outbox serve` also use. [`Endpoint`]
//! answers `/metrics` (Prometheus text), `/healthz` (200, or 503 with the reasons) and
//! `/health.json` for any HTTP server: it takes a path and returns a status, a content
//! type and a body, so it needs no HTTP crate of its own.
//!
//! ```
//! use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
//! use chunked_outbox::monitoring::{Endpoint, Thresholds};
//!
//! let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
//! outbox.enqueue(&NewDelivery::single("telegram", "42", "hello"))?;
//! let endpoint = Endpoint::new(outbox, Thresholds::default());
//!
//! let healthz = endpoint.respond("/healthz");
//! assert_eq!((healthz.status, healthz.body.as_str()), (200, "ok\n"));
//! let metrics = endpoint.respond("/metrics");
//! assert!(metrics.body.contains(r#"outbox_pending_chunks{channel="telegram"} 1"#));
//! assert_eq!(endpoint.respond("/elsewhere").status, 404);
//! # Ok::<(), chunked_outbox::Error>(())
//! ```
//!
//! Mounted in axum (each answer reads the file, so it runs on the blocking pool):
//!
//! ```ignore
//! let endpoint = Arc::new(Endpoint::new(outbox.clone(), Thresholds::default()));
//! let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
//!     let endpoint = endpoint.clone();
//!     async move {
//!         let r = tokio::task::spawn_blocking(move || endpoint.respond(uri.path())).await.unwrap();
//!         (StatusCode::from_u16(r.status).unwrap(), [(CONTENT_TYPE, r.content_type)], r.body)
//!     }
//! });
//! ```
//!
//! (`tests/monitoring.rs` runs exactly this against a real HTTP client.)
//!
//! # What else is here
//!
//! [`Health`] is what [`Outbox::health`](crate::Outbox::health) reads, with its
//! Prometheus text ([`Health::to_prometheus`]) and its verdict; [`DeliveryView`] and
//! [`ChunkView`] are what [`Outbox::list`](crate::Outbox::list) and
//! [`Outbox::delivery`](crate::Outbox::delivery) read, in the states [`DeliveryStatus`] and
//! [`ChunkStatus`].
//!
//! # Metrics
//!
//! Counters and histograms through the `metrics` facade (feature `metrics`), so they
//! land in whatever recorder the application installed (a Prometheus exporter, StatsD,
//! OpenTelemetry ...). Without the feature, or without a recorder, each call is a no-op.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `outbox_enqueued_total` | counter | `channel` | deliveries stored by `enqueue` and `enqueue_batch` (not re-enqueues of a caller key; `enqueue_in` commits in the caller's transaction, so it is not counted) |
//! | `outbox_sends_total` | counter | `channel` | sends started by a dispatcher |
//! | `outbox_outcomes_total` | counter | `channel`, `outcome` | outcomes recorded: `delivered`, `transient`, `permanent`, `rate_limited`, `channel_rate_limited`, `ambiguous` |
//! | `outbox_finalized_total` | counter | `channel` | replies finalized (every chunk delivered, history written) |
//! | `outbox_retries_total` | counter | `channel` | chunks put back for a retry |
//! | `outbox_uncertain_total` | counter | `channel` | chunks held as possibly sent |
//! | `outbox_settlements_total` | counter | `channel`, `decision` (`delivered`, `resend`, `hold`) | possibly-sent parts settled by asking the platform ([`settle`](crate::settle)) |
//! | `outbox_dead_letters_total` | counter | `channel` | chunks failed for good |
//! | `outbox_panics_total` | counter | — | adapter panics, recorded as ambiguous sends |
//! | `outbox_send_timeouts_total` | counter | — | sends that outlived the send timeout |
//! | `outbox_record_errors_total` | counter | — | outcomes that could not be recorded |
//! | `outbox_dropped_outcomes_total` | counter | — | known outcomes given up after a lease of retries (alert on it) |
//! | `outbox_send_duration_seconds` | histogram | `channel` | from a chunk's claim to its recorded outcome: the send plus one commit |
//! | `outbox_reply_latency_seconds` | histogram | `channel` | from enqueue to finalization of a reply: the chat bot's delivery SLO |
//!
//! The counters count events, so purging history never lowers them.

pub use crate::health::{ChannelHealth, Health, LATENCY_BUCKETS, LatencyHistogram, Replica};
pub use crate::inspect::{
    Activity, ActivityBucket, ChunkView, CorruptRow, DeliveryView, ListFilter, MAX_ACTIVITY_BUCKETS,
};
pub use crate::status::{ChunkStatus, DeliveryStatus};

use std::time::Duration;

use serde::Serialize;

use crate::outbox::Outbox;

/// When a snapshot warns or fails. The defaults are those of `outbox health`: fail on
/// any unacknowledged dead letter, uncertain chunk or corrupt row; warn on any expired
/// lease or a chunk due for more than five minutes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Thresholds {
    /// Warn when a chunk has been due longer than this.
    pub warn_due_age: Duration,
    /// Warn when more than this many leases have expired.
    pub warn_expired_leases: u64,
    /// Fail when more than this many dead letters are unacknowledged.
    pub fail_dead_letters: u64,
    /// Fail when more than this many chunks are uncertain.
    pub fail_uncertain: u64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            warn_due_age: Duration::from_secs(5 * 60),
            warn_expired_leases: 0,
            fail_dead_letters: 0,
            fail_uncertain: 0,
        }
    }
}

impl Thresholds {
    /// Warn when a chunk has been due longer than `age`.
    #[must_use]
    pub fn with_warn_due_age(mut self, age: Duration) -> Self {
        self.warn_due_age = age;
        self
    }

    /// Warn when more than `n` leases have expired.
    #[must_use]
    pub fn with_warn_expired_leases(mut self, n: u64) -> Self {
        self.warn_expired_leases = n;
        self
    }

    /// Fail when more than `n` dead letters are unacknowledged.
    #[must_use]
    pub fn with_fail_dead_letters(mut self, n: u64) -> Self {
        self.fail_dead_letters = n;
        self
    }

    /// Fail when more than `n` chunks are uncertain.
    #[must_use]
    pub fn with_fail_uncertain(mut self, n: u64) -> Self {
        self.fail_uncertain = n;
        self
    }
}

/// How bad a snapshot is, from best to worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Nothing needs attention.
    Ok,
    /// Something is slow or stuck; look soon.
    Warn,
    /// Something needs a decision now (dead letters, uncertain sends, corrupt rows).
    Fail,
}

impl Level {
    /// `ok`, `warn` or `fail`.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "fail",
        }
    }
}

/// A snapshot's verdict: the worst level reached and one reason per threshold crossed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Verdict {
    /// The worst level any reason reached; [`Level::Ok`] when there is no reason.
    pub level: Level,
    /// What crossed a threshold, such as `"2 unacknowledged dead letters"`.
    pub reasons: Vec<String>,
}

impl std::fmt::Display for Verdict {
    /// `ok`, or the level and its reasons: `fail: 1 unacknowledged dead letters`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.level.as_str())?;
        if !self.reasons.is_empty() {
            write!(f, ": {}", self.reasons.join("; "))?;
        }
        Ok(())
    }
}

impl Health {
    /// Judges the snapshot by `thresholds`.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};
    /// use chunked_outbox::monitoring::{Level, Thresholds};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// outbox.enqueue(&NewDelivery::single("telegram", "42", "hello"))?;
    /// let claim = outbox.claim(1)?.pop().unwrap();
    /// let error = "403 Forbidden: bot was blocked by the user".to_owned();
    /// outbox.record(&claim, Outcome::Permanent { error })?;
    ///
    /// let verdict = outbox.health()?.verdict(&Thresholds::default());
    /// assert_eq!(verdict.level, Level::Fail);
    /// assert_eq!(verdict.to_string(), "fail: 1 unacknowledged dead letters");
    /// // One dead letter is tolerated when the threshold says so.
    /// let lenient = Thresholds::default().with_fail_dead_letters(1);
    /// assert_eq!(outbox.health()?.verdict(&lenient).level, Level::Ok);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub fn verdict(&self, thresholds: &Thresholds) -> Verdict {
        let t = &self.totals;
        let mut verdict = Verdict {
            level: Level::Ok,
            reasons: Vec::new(),
        };
        let mut flag = |level: Level, reason: String| {
            verdict.level = verdict.level.max(level);
            verdict.reasons.push(reason);
        };
        if t.unacknowledged_dead_letters > thresholds.fail_dead_letters {
            flag(
                Level::Fail,
                format!(
                    "{} unacknowledged dead letters",
                    t.unacknowledged_dead_letters
                ),
            );
        }
        if t.uncertain_chunks > thresholds.fail_uncertain {
            flag(
                Level::Fail,
                format!("{} uncertain chunks", t.uncertain_chunks),
            );
        }
        if t.corrupt_deliveries > 0 {
            flag(
                Level::Fail,
                format!("{} corrupt rows set aside", t.corrupt_deliveries),
            );
        }
        if t.expired_leases > thresholds.warn_expired_leases {
            flag(Level::Warn, format!("{} expired leases", t.expired_leases));
        }
        if let Some(age) = t
            .oldest_due_age_ms
            .filter(|ms| u128::from(*ms) > thresholds.warn_due_age.as_millis())
        {
            flag(
                Level::Warn,
                format!("a chunk has been due for {}", whole_seconds(age)),
            );
        }
        verdict
    }
}

/// `1h 2m 3s`, `5m 0s`, `42s`: a due age as an operator reads it.
fn whole_seconds(ms: u64) -> String {
    let s = ms / 1000;
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m {s}s"),
        _ => format!("{h}h {m}m {s}s"),
    }
}

/// `/metrics`, `/healthz` and `/health.json` for the application's own HTTP server.
///
/// Every answer takes a fresh snapshot in one read transaction, so it shows what every
/// process on the file has done; it blocks for that read (run it on a blocking pool in
/// async code, or use `respond_async` with feature `tokio`). See the
/// [module](self) for an example and for mounting it in axum.
#[derive(Clone)]
pub struct Endpoint {
    outbox: Outbox,
    thresholds: Thresholds,
}

/// An [`Endpoint`]'s (or the console's) answer, for the server to send as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Response {
    /// 200; 503 from `/healthz` when the verdict is [`Level::Fail`] or the file cannot
    /// be read (from the console: when the outbox cannot be read); 404 for another
    /// path; 405 from the console for a method other than `GET`.
    pub status: u16,
    /// The `Content-Type` header.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

const TEXT: &str = "text/plain; charset=utf-8";

impl Endpoint {
    /// Answers for `outbox`, judging `/healthz` by `thresholds`.
    pub fn new(outbox: Outbox, thresholds: Thresholds) -> Self {
        Self { outbox, thresholds }
    }

    /// The answer to a request for `path` (a query string is ignored):
    ///
    /// * `/metrics`: [`Health::to_prometheus`], Prometheus text format 0.0.4;
    /// * `/healthz`: `ok`, `warn: …` (both 200) or `fail: …` (503), the
    ///   [verdict](Health::verdict) with its reasons; 503 also when the file cannot be
    ///   read;
    /// * `/health.json`: the snapshot as JSON.
    pub fn respond(&self, path: &str) -> Response {
        let path = path.split('?').next().unwrap_or(path);
        let answer = |status, content_type, body| Response {
            status,
            content_type,
            body,
        };
        if !matches!(path, "/metrics" | "/healthz" | "/health.json") {
            return answer(
                404,
                TEXT,
                "not found: try /metrics, /healthz or /health.json\n".into(),
            );
        }
        let health = match self.outbox.health() {
            Ok(h) => h,
            Err(e) => return answer(503, TEXT, format!("fail: cannot read the outbox: {e}\n")),
        };
        match path {
            "/metrics" => answer(200, "text/plain; version=0.0.4", health.to_prometheus()),
            "/health.json" => match serde_json::to_string_pretty(&health) {
                Ok(json) => answer(200, "application/json", json),
                Err(e) => answer(500, TEXT, format!("cannot write JSON: {e}\n")),
            },
            _ => {
                let verdict = health.verdict(&self.thresholds);
                let status = if verdict.level == Level::Fail {
                    503
                } else {
                    200
                };
                answer(status, TEXT, format!("{verdict}\n"))
            }
        }
    }

    /// [`respond`](Self::respond) on tokio's blocking pool.
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub async fn respond_async(&self, path: &str) -> Response {
        let (endpoint, path) = (self.clone(), path.to_owned());
        match tokio::task::spawn_blocking(move || endpoint.respond(&path)).await {
            Ok(response) => response,
            Err(e) => Response {
                status: 500,
                content_type: TEXT,
                body: format!("the health read did not finish: {e}\n"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_ages_read_as_an_operator_says_them() {
        assert_eq!(whole_seconds(42_999), "42s");
        assert_eq!(whole_seconds(300_000), "5m 0s");
        assert_eq!(whole_seconds(3_723_000), "1h 2m 3s");
    }
}
