//! Slack Web API (`chat.postMessage`).
//!
//! Slack has no idempotency key for `chat.postMessage`, but a bot can look its own
//! messages up (`conversations.history` with the message `metadata` it sent): an
//! uncertain chunk can be settled by asking, then
//! [`resolve_uncertain`](crate::Outbox::resolve_uncertain).
//!
//! With the feature `slack-morphism`, `SlackAdapter` sends through the application's
//! slack-morphism client and maps that library's error types (module `slack_morphism`).

#[cfg(feature = "slack-morphism")]
pub mod slack_morphism;
#[cfg(feature = "slack-morphism")]
pub use slack_morphism::SlackAdapter;

use super::{HttpReply, Scope, delivered, rate_limited};
use crate::outcome::Outcome;

/// Errors after which Slack may have acted on the request ("it's possible some aspect
/// of the operation succeeded before the error was raised").
const AMBIGUOUS: &[&str] = &["internal_error", "fatal_error"];

/// Errors of a request Slack did not act on, worth retrying.
const TRANSIENT: &[&str] = &[
    "service_unavailable",
    "request_timeout",
    "team_added_to_org",
    "accesslimited",
];

/// Maps Slack's answer to a `chat.postMessage`.
///
/// `ok: true` is `Delivered` with the message's `ts`; HTTP 429 or `ratelimited` is
/// `ChannelRateLimited` (Slack's limits are per method and workspace, so the app's) for
/// the `Retry-After` header's seconds; `internal_error`,
/// `fatal_error` and HTTP 5xx are `Ambiguous`; `service_unavailable`,
/// `request_timeout`, `team_added_to_org` and `accesslimited` are `Transient`; every
/// other `error` (`channel_not_found`, `not_in_channel`, `is_archived`,
/// `msg_too_long`, `invalid_auth`, `account_inactive`, `token_revoked`,
/// `missing_scope` …) is `Permanent`: Slack documents them as problems of the request or
/// of the token, which a retry does not fix.
///
/// ```
/// use chunked_outbox::Outcome;
/// use chunked_outbox::platforms::{HttpReply, slack};
///
/// let auth = HttpReply::new(200, r#"{"ok": false, "error": "invalid_auth"}"#);
/// assert!(matches!(slack::outcome(&auth), Outcome::Permanent { .. }));
/// ```
pub fn outcome(reply: &HttpReply<'_>) -> Outcome {
    let body = reply.json();
    let code = body["error"].as_str().unwrap_or_default();
    if reply.status == 429 || code == "ratelimited" {
        let error = if code.is_empty() {
            reply.describe("from Slack")
        } else {
            code.to_owned()
        };
        // Slack limits each method per app and workspace: every chat waits.
        return rate_limited(&[reply.header_wait()], error, Scope::Channel);
    }
    if reply.status >= 500 {
        return Outcome::Ambiguous {
            error: reply.describe("from Slack"),
        };
    }
    if body["ok"] == serde_json::Value::Bool(true) {
        return delivered(reply, &body["ts"], "ts");
    }
    if code.is_empty() {
        // Neither ok nor an error: a proxy's page, a truncated body.
        return if (200..300).contains(&reply.status) {
            Outcome::Ambiguous {
                error: reply.describe("unreadable answer"),
            }
        } else {
            Outcome::Permanent {
                error: reply.describe("from Slack"),
            }
        };
    }
    error_outcome(code)
}

/// The outcome of a Slack `error` code alone, for clients that hand over the code
/// rather than the answer (slack-morphism's `SlackClientApiError::code`): as in
/// [`outcome`], `ratelimited` waits 1 s (the `Retry-After` header is not in the code).
pub fn error_outcome(code: &str) -> Outcome {
    let error = code.to_owned();
    if code == "ratelimited" {
        rate_limited(&[], error, Scope::Channel)
    } else if AMBIGUOUS.contains(&code) {
        Outcome::Ambiguous { error }
    } else if TRANSIENT.contains(&code) {
        Outcome::Transient { error }
    } else {
        Outcome::Permanent { error }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn map(status: u16, body: &str) -> Outcome {
        outcome(&HttpReply::new(status, body))
    }

    /// Sample answers from the `chat.postMessage` reference.
    #[test]
    fn documented_answers() {
        assert_eq!(
            map(
                200,
                r#"{"ok": true, "channel": "C123ABC456", "ts": "1503435956.000247", "message": {"text": "Here's a message for you", "type": "message"}}"#
            ),
            Outcome::delivered(Some("1503435956.000247".into()))
        );
        let limited =
            HttpReply::new(429, r#"{"ok": false, "error": "ratelimited"}"#).with_retry_after("30");
        assert!(matches!(outcome(&limited),
            Outcome::ChannelRateLimited { retry_after, .. } if retry_after == Duration::from_secs(30)));
        // Either sign alone is a rate limit.
        assert!(matches!(
            map(200, r#"{"ok": false, "error": "ratelimited"}"#),
            Outcome::ChannelRateLimited { .. }
        ));
        assert!(matches!(map(429, ""), Outcome::ChannelRateLimited { .. }));
        for code in [
            "channel_not_found",
            "not_in_channel",
            "is_archived",
            "msg_too_long",
            "invalid_auth",
            "account_inactive",
            "token_revoked",
            "not_authed",
            "missing_scope",
            "no_text",
        ] {
            let body = format!(r#"{{"ok": false, "error": "{code}"}}"#);
            assert_eq!(
                map(200, &body),
                Outcome::Permanent { error: code.into() },
                "{code}"
            );
        }
        for code in ["internal_error", "fatal_error"] {
            let body = format!(r#"{{"ok": false, "error": "{code}"}}"#);
            assert!(
                matches!(map(200, &body), Outcome::Ambiguous { .. }),
                "{code}"
            );
        }
        assert!(matches!(
            map(200, r#"{"ok": false, "error": "service_unavailable"}"#),
            Outcome::Transient { .. }
        ));
        assert!(matches!(map(503, ""), Outcome::Ambiguous { .. }));
        assert!(matches!(
            map(401, "Unauthorized"),
            Outcome::Permanent { .. }
        ));
        assert!(matches!(map(200, "<html>"), Outcome::Ambiguous { .. }));
    }
}
