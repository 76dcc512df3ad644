//! Matrix client-server API (`PUT /_matrix/client/v3/rooms/{roomId}/send/{eventType}/{txnId}`).
//!
//! The transaction id in the URL makes a send idempotent for the same device (client-
//! server spec 1.7 and later, and Synapse; older servers scoped it to the access
//! token): every dispatcher of the channel must send as the same device — one login
//! whose access token they share, or logins with the same `device_id` — or a resend
//! from another host is a new event. Use [`Claim::idempotency_key`](crate::Claim::idempotency_key) (URL-encoded) or
//! [`Claim::compact_key`](crate::Claim::compact_key). How long a homeserver remembers a
//! transaction id is its own choice (Synapse: 30 minutes), so declare the channel
//! [`ChannelPolicy::asking`](crate::rules::ChannelPolicy::asking) and answer
//! [`settle`](crate::ChannelAdapter::settle) with [`settle`]: a possibly-sent part is
//! sent again while the homeserver still knows its transaction id, and held for a
//! person after.

use std::time::Duration;

use serde_json::Value;

use super::{HttpReply, Scope, delivered, rate_limited, seconds};
use crate::outcome::Outcome;
use crate::settle::{PossiblySent, Settlement};

/// How long Synapse, the reference homeserver, remembers a transaction id: 30 minutes.
pub const SYNAPSE_TRANSACTION_WINDOW: Duration = Duration::from_secs(30 * 60);

/// What a Matrix adapter's [`settle`](crate::ChannelAdapter::settle) answers: a resend
/// under the same transaction id (from the same device) while the first send is
/// less than `window` ago — the homeserver returns the event it made instead of
/// making another — and a hold for a person after.
///
/// ```
/// use chunked_outbox::Claim;
/// use chunked_outbox::platforms::matrix;
/// use chunked_outbox::settle::{Decision, PossiblySent};
///
/// let first = chrono::Utc::now();
/// let part = PossiblySent::for_testing(Claim::for_testing("matrix", "!room:example.org", "hi"),
///     first, first + chrono::Duration::minutes(5));
/// let answer = matrix::settle(&part, matrix::SYNAPSE_TRANSACTION_WINDOW);
/// assert_eq!(answer.decision, Decision::Resend);
/// ```
pub fn settle(part: &PossiblySent, window: Duration) -> Settlement {
    Settlement::within_window(part, window, "Matrix transaction id")
}

/// Maps the homeserver's answer to a send.
///
/// 2xx is `Delivered` with the `event_id`; `M_LIMIT_EXCEEDED` (or 429) is
/// `ChannelRateLimited` (a homeserver limits the bot's account, whatever the room) for
/// `retry_after_ms` (or `Retry-After`); every other 4xx
/// (`M_FORBIDDEN`, `M_UNKNOWN_TOKEN`, `M_NOT_FOUND`, `M_TOO_LARGE` …) is `Permanent`; 5xx
/// is `Ambiguous` (a replay with the same transaction id is safe); a 2xx without an
/// `event_id` is `Ambiguous`.
///
/// ```
/// use chunked_outbox::Outcome;
/// use chunked_outbox::platforms::{HttpReply, matrix};
///
/// let slow_down = HttpReply::new(429,
///     r#"{"errcode": "M_LIMIT_EXCEEDED", "error": "Too many requests", "retry_after_ms": 2000}"#);
/// assert!(matches!(matrix::outcome(&slow_down),
///     Outcome::ChannelRateLimited { retry_after, .. } if retry_after.as_millis() == 2000));
/// ```
pub fn outcome(reply: &HttpReply<'_>) -> Outcome {
    let body = reply.json();
    if (200..300).contains(&reply.status) {
        return delivered(reply, &body["event_id"], "event_id");
    }
    let code = body["errcode"].as_str().unwrap_or_default();
    let error = match body["error"].as_str() {
        Some(text) if !code.is_empty() => format!("{} {code}: {text}", reply.status),
        _ => reply.describe("from the homeserver"),
    };
    if code == "M_LIMIT_EXCEEDED" || reply.status == 429 {
        let millis = body["retry_after_ms"].as_f64().map(|ms| ms / 1000.0);
        return rate_limited(
            &[
                millis.and_then(|s| seconds(&Value::from(s))),
                reply.header_wait(),
            ],
            error,
            Scope::Channel,
        );
    }
    match reply.status {
        400..=499 => Outcome::Permanent { error },
        _ => Outcome::Ambiguous { error },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn map(status: u16, body: &str) -> Outcome {
        outcome(&HttpReply::new(status, body))
    }

    /// Sample answers from the client-server specification.
    #[test]
    fn documented_answers() {
        assert_eq!(
            map(200, r#"{"event_id": "$YUwRidLecu:example.com"}"#),
            Outcome::delivered(Some("$YUwRidLecu:example.com".into()))
        );
        assert!(matches!(
            map(429, r#"{"errcode": "M_LIMIT_EXCEEDED", "error": "Too many requests", "retry_after_ms": 2000}"#),
            Outcome::ChannelRateLimited { retry_after, .. } if retry_after == Duration::from_secs(2)
        ));
        let header =
            HttpReply::new(429, r#"{"errcode": "M_LIMIT_EXCEEDED"}"#).with_retry_after("5");
        assert!(matches!(outcome(&header),
            Outcome::ChannelRateLimited { retry_after, .. } if retry_after == Duration::from_secs(5)));
        for (status, code) in [
            (403, "M_FORBIDDEN"),
            (401, "M_UNKNOWN_TOKEN"),
            (404, "M_NOT_FOUND"),
            (413, "M_TOO_LARGE"),
        ] {
            let body = format!(r#"{{"errcode": "{code}", "error": "no"}}"#);
            match map(status, &body) {
                Outcome::Permanent { error } => assert!(error.contains(code), "{error}"),
                other => panic!("{code}: {other:?}"),
            }
        }
        assert!(matches!(map(502, ""), Outcome::Ambiguous { .. }));
        assert!(matches!(map(200, "{}"), Outcome::Ambiguous { .. }));
        match map(400, r#"{"errcode": "M_BAD_JSON"}"#) {
            Outcome::Permanent { error } => assert!(error.starts_with("HTTP 400"), "{error}"),
            other => panic!("{other:?}"),
        }
    }
}
