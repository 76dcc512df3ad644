//! The platforms: ready adapters for the client libraries bot authors use, and typed
//! mappings from the platforms' own answers to an [`Outcome`].
//!
//! # Ready adapters
//!
//! Each sits behind a feature of its name so the core stays lean, sends through the
//! application's existing client, and maps that library's error types (never their
//! `Display` text). Each is tested end to end against an emulated platform API on
//! 127.0.0.1 that enforces the platform's documented limits.
//!
//! | feature | adapter | platform | client | key it sends |
//! |---|---|---|---|---|
//! | `teloxide` | `telegram::TelegramAdapter` | Telegram Bot API | `teloxide_core::Bot` | none (Telegram has no idempotency key) |
//! | `serenity` | `discord::DiscordAdapter` | Discord REST API | `serenity::http::Http` | `claim.compact_key()` as `nonce`, `enforce_nonce: true` |
//! | `slack-morphism` | `slack::SlackAdapter` | Slack Web API | `slack_morphism::SlackClient` | none (look a send up instead) |
//!
//! Each reads reply-to, thread and parse mode from the delivery's metadata.
//!
//! # Mappings
//!
//!
//! The outbox keeps its promises (no blind resend where a platform cannot deduplicate,
//! no retry of a permanent error, a rate limit that pauses a chat without using an
//! attempt) only if every send's result is mapped to the right [`Outcome`]. These
//! functions do that from what the HTTP client received — status, `Retry-After` header
//! and JSON body — for the Bot API of Telegram, Discord's REST API, Slack's Web API and
//! the Matrix client-server API ([`matrix`]: `event_id`, `M_LIMIT_EXCEEDED` with
//! `retry_after_ms`, other 4xx permanent, 5xx ambiguous), and [`no_reply`] for a
//! request that got no answer. They read the platform's fields,
//! never its human-readable text, so they do not depend on wording.
//!
//! | answer | Telegram | Discord | Slack |
//! |---|---|---|---|
//! | success | `ok: true` → `Delivered` (`result.message_id`) | 2xx → `Delivered` (`id`) | `ok: true` → `Delivered` (`ts`) |
//! | rate limit | 429 → `RateLimited` (`parameters.retry_after`, s) | 429 → `RateLimited` (`retry_after`, float s); with `"global": true` → `ChannelRateLimited` | HTTP 429 or `ratelimited` → `ChannelRateLimited` (`Retry-After`, s) |
//! | chat moved | `parameters.migrate_to_chat_id` → `Permanent` ([`telegram::migrated_to`]) | — | — |
//! | refused | other 4xx (blocked, kicked, chat not found, bad token, parse error) → `Permanent` | other 4xx (JSON `code`: 10003, 50001, 50007, 50013, 50035 …) → `Permanent` | any other `error` (`channel_not_found`, `invalid_auth`, `account_inactive`, `msg_too_long` …) → `Permanent` |
//! | server error | 500, 502, 504 → `Ambiguous`; 503 → `Transient` | 500, 504 → `Ambiguous`; 502, 503 → `Transient` | HTTP 5xx and `internal_error`, `fatal_error` → `Ambiguous`; `service_unavailable`, `request_timeout` → `Transient` |
//! | unreadable success | 2xx body without the fields → `Ambiguous` | same | same |
//! | no answer | [`no_reply`]: not sent → `Transient`; maybe sent (timeout or reset after the request was written) → `Ambiguous` | same | same |
//!
//! A rate limit has a scope. `RateLimited` pauses the one chat; `ChannelRateLimited`
//! holds every chat of the channel, in every process, until the wait is over: Discord's
//! global limit, Slack's limits (per method and workspace, so per app), and Matrix's
//! `M_LIMIT_EXCEEDED` (a homeserver limits the bot's account across rooms). Telegram's
//! answer does not say whether a flood wait is the chat's or the bot's; it is read as
//! the chat's, and the bot-wide 30 messages/s is kept by the channel's rate
//! ([`ChannelPolicy::with_rate_per_second`](crate::rules::ChannelPolicy::with_rate_per_second))
//! so that it is not hit.
//!
//! A rate limit's wait is capped at [`MAX_RETRY_AFTER`](crate::limits::MAX_RETRY_AFTER); with
//! none given it is 1 s. `Ambiguous` follows the channel's
//! [`ReplayPolicy`](crate::rules::ReplayPolicy): `Hold` for Telegram and Slack (they cannot
//! deduplicate), `Replay` for Discord when the send carries
//! `{"nonce": claim.compact_key(), "enforce_nonce": true}`.
//!
//! ```
//! use chunked_outbox::Outcome;
//! use chunked_outbox::platforms::{HttpReply, telegram};
//!
//! let reply = HttpReply::new(429, r#"{"ok":false,"error_code":429,
//!     "description":"Too Many Requests: retry after 35","parameters":{"retry_after":35}}"#);
//! assert!(matches!(telegram::outcome(&reply),
//!     Outcome::RateLimited { retry_after, .. } if retry_after.as_secs() == 35));
//! ```

use std::time::Duration;

use serde_json::Value;

use crate::classify::cap_retry_after;
use crate::outcome::Outcome;

pub use crate::classify::{ErrorClass, classify_error};

pub mod discord;
pub mod line;
pub mod matrix;
pub mod slack;
pub mod telegram;

/// An HTTP answer to a send, as the adapter's client received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HttpReply<'a> {
    /// The HTTP status code.
    pub status: u16,
    /// The `Retry-After` header's value, if the answer had one.
    pub retry_after: Option<&'a str>,
    /// LINE's `X-Line-Accepted-Request-Id` header, if the answer had one: the request
    /// that was accepted earlier under the same retry key (with a 409).
    pub accepted_request_id: Option<&'a str>,
    /// The body, as text (the platforms answer JSON).
    pub body: &'a str,
}

impl<'a> HttpReply<'a> {
    /// An answer with this status and body and no `Retry-After` header.
    pub fn new(status: u16, body: &'a str) -> Self {
        HttpReply {
            status,
            retry_after: None,
            accepted_request_id: None,
            body,
        }
    }

    /// The same answer with LINE's `X-Line-Accepted-Request-Id` header.
    pub fn with_accepted_request_id(self, value: &'a str) -> Self {
        HttpReply {
            accepted_request_id: Some(value),
            ..self
        }
    }

    /// The same answer with a `Retry-After` header.
    pub fn with_retry_after(self, value: &'a str) -> Self {
        HttpReply {
            retry_after: Some(value),
            ..self
        }
    }

    /// The body as JSON (`Null` when it is not JSON).
    fn json(&self) -> Value {
        serde_json::from_str(self.body).unwrap_or(Value::Null)
    }

    /// The `Retry-After` header as a wait: delay-seconds (RFC 9110; a fraction is
    /// accepted). An HTTP date is not read (no platform here sends one).
    fn header_wait(&self) -> Option<Duration> {
        seconds(&Value::String(self.retry_after?.trim().to_owned()))
    }

    /// A short description for the outcome's error text: status and body, cut.
    fn describe(&self, what: &str) -> String {
        let body: String = self.body.chars().take(300).collect();
        format!("HTTP {} {what}: {body}", self.status)
    }
}

/// How a request that got no complete HTTP answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NoReply {
    /// It was never written: DNS, connect or TLS failed, or a client-side limit refused
    /// it. The platform saw nothing.
    NotSent,
    /// It was written, or may have been: a timeout waiting for the answer, a connection
    /// reset or closed mid-answer. The platform may have acted on it.
    MaybeSent,
}

/// The outcome of a send that got no answer: [`NoReply::NotSent`] is `Transient`
/// (retry), [`NoReply::MaybeSent`] is `Ambiguous` (the channel's replay policy decides).
/// With reqwest, a `connect` error is `NotSent`; a `timeout` or any other error after
/// the request started is `MaybeSent`.
pub fn no_reply(how: NoReply, error: impl Into<String>) -> Outcome {
    let error = error.into();
    match how {
        NoReply::NotSent => Outcome::Transient { error },
        NoReply::MaybeSent => Outcome::Ambiguous { error },
    }
}

/// A JSON number (or a numeric string) of seconds as a wait, capped.
fn seconds(value: &Value) -> Option<Duration> {
    let secs = match value {
        Value::Number(n) => n.as_f64()?,
        Value::String(s) => s.trim().parse().ok()?,
        _ => return None,
    };
    if secs.is_nan() || secs < 0.0 {
        return None;
    }
    Some(cap_retry_after(
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX),
    ))
}

/// Whom a platform's rate limit holds back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// One chat ([`Outcome::RateLimited`]).
    Chat,
    /// Every chat of the channel: the bot's or app's own limit
    /// ([`Outcome::ChannelRateLimited`]).
    Channel,
}

/// The rate-limited outcome of `scope`, with the first wait given, else 1 s.
fn rate_limited(waits: &[Option<Duration>], error: String, scope: Scope) -> Outcome {
    let retry_after = waits
        .iter()
        .find_map(|w| *w)
        .unwrap_or(Duration::from_secs(1));
    match scope {
        Scope::Chat => Outcome::RateLimited { retry_after, error },
        Scope::Channel => Outcome::ChannelRateLimited { retry_after, error },
    }
}

/// A successful answer's outcome: `Delivered` with the platform's message id (a JSON
/// string or number), or `Ambiguous` when the answer lacks one — the send happened or
/// not, and nothing in the answer says which message it made.
fn delivered(reply: &HttpReply<'_>, id: &Value, field: &str) -> Outcome {
    match id {
        Value::String(s) if !s.is_empty() => Outcome::delivered(Some(s.clone())),
        Value::Number(n) => Outcome::delivered(Some(n.to_string())),
        _ => Outcome::Ambiguous {
            error: reply.describe(&format!("success without {field}")),
        },
    }
}

/// The adapter's options in a claim's metadata (JSON; unknown fields are ignored), or
/// the defaults when the delivery has none.
#[cfg(any(feature = "teloxide", feature = "serenity", feature = "slack-morphism"))]
pub(crate) fn adapter_options<T: serde::de::DeserializeOwned + Default>(
    claim: &crate::claim::Claim,
) -> Result<T, String> {
    match &claim.metadata {
        None => Ok(T::default()),
        Some(metadata) => serde_json::from_str(metadata)
            .map_err(|e| format!("metadata is not the adapter's JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_reply_splits_on_whether_the_request_was_written() {
        assert!(matches!(
            no_reply(NoReply::NotSent, "connect refused"),
            Outcome::Transient { .. }
        ));
        assert!(matches!(
            no_reply(NoReply::MaybeSent, "read timed out"),
            Outcome::Ambiguous { .. }
        ));
    }

    #[test]
    fn waits_are_read_as_seconds_and_capped() {
        assert_eq!(
            seconds(&Value::from(1.5)),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(seconds(&Value::from("7")), Some(Duration::from_secs(7)));
        assert_eq!(seconds(&Value::from(-1)), None);
        assert_eq!(seconds(&Value::from(0)), Some(Duration::ZERO));
        assert_eq!(seconds(&Value::from("soon")), None);
        assert_eq!(
            seconds(&Value::from(1e300)),
            Some(crate::limits::MAX_RETRY_AFTER)
        );
        let reply = HttpReply::new(429, "").with_retry_after(" 12 ");
        assert_eq!(reply.header_wait(), Some(Duration::from_secs(12)));
    }
}
