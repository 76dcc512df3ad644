//! Discord REST API (`POST /channels/{channel.id}/messages`).
//!
//! Discord deduplicates a message by its `nonce` when the request sets
//! `enforce_nonce: true`, "in the past few minutes". The nonce allows at most 25
//! characters: send [`Claim::compact_key`](crate::Claim::compact_key), not the
//! 38-character full key. Declare the channel
//! [`ChannelPolicy::asking`](crate::rules::ChannelPolicy::asking) and answer
//! [`settle`](crate::ChannelAdapter::settle) with [`settle`]: a possibly-sent part is
//! sent again inside [`NONCE_WINDOW`] of its first send, when Discord returns the
//! message it made instead of posting another, and held for a person after (a resend
//! then could post it twice; Discord's REST API cannot be asked for a nonce).
//!
//! With the feature `serenity`, `DiscordAdapter` sends through the application's
//! serenity client and maps that library's error types (module `serenity`).

#[cfg(feature = "serenity")]
pub mod serenity;
#[cfg(feature = "serenity")]
pub use serenity::DiscordAdapter;

use std::time::Duration;

use serde_json::Value;

use super::{HttpReply, Scope, delivered, rate_limited, seconds};
use crate::claim::Claim;
use crate::outcome::Outcome;
use crate::settle::{PossiblySent, Settlement};

/// How long after a part's first send a resend is taken to be deduplicated by its
/// nonce: 2 minutes. Discord documents "the past few minutes" without a number, so
/// this stays well inside it, leaving room for the clocks of the outbox and Discord to
/// differ.
pub const NONCE_WINDOW: Duration = Duration::from_secs(120);

/// What a Discord adapter's [`settle`](crate::ChannelAdapter::settle) answers: a resend
/// with the same enforced nonce while the first send is less than `window` ago
/// ([`NONCE_WINDOW`] unless the application knows better), a hold for a person after.
pub fn settle(part: &PossiblySent, window: Duration) -> Settlement {
    Settlement::within_window(part, window, "Discord nonce (enforce_nonce)")
}

/// `outcome` of a send of `claim`, read as what it is when `claim` is a resend:
/// Discord answers `10008 Unknown Message` to a create whose enforced nonce belongs to
/// a message deleted since (by a moderator, say), which means the part's earlier send
/// landed. On a resend (attempt 2 or later) that answer is
/// [`Outcome::DeliveredEarlier`], with why, not a dead letter that would stop the
/// reply's next parts; on a first send it stays [`Outcome::Permanent`].
///
/// ```
/// use chunked_outbox::{Claim, Outcome};
/// use chunked_outbox::platforms::{discord, HttpReply};
///
/// let deleted = HttpReply::new(404, r#"{"message": "Unknown Message", "code": 10008}"#);
/// let mut claim = Claim::for_testing("discord", "1", "hi");
/// assert!(matches!(discord::resend_outcome(&claim, discord::outcome(&deleted)), Outcome::Permanent { .. }));
/// claim.attempt = 2;
/// assert!(matches!(discord::resend_outcome(&claim, discord::outcome(&deleted)), Outcome::DeliveredEarlier { .. }));
/// ```
pub fn resend_outcome(claim: &Claim, outcome: Outcome) -> Outcome {
    match outcome {
        Outcome::Permanent { error } if claim.attempt > 1 && error.contains("(code 10008)") => {
            Outcome::DeliveredEarlier {
                note: format!(
                    "sent again with the same nonce, Discord answered {error}: the first send landed and was deleted since; delivered"
                ),
            }
        }
        other => other,
    }
}

/// Maps Discord's answer to a message create.
///
/// 2xx is `Delivered` with the message's `id`; 429 is `RateLimited` for `retry_after`
/// (float seconds), or `ChannelRateLimited` when the body says `"global": true` (the
/// bot's limit: every chat waits); every other 4xx is `Permanent`
/// with its JSON `code` (10003 unknown channel, 50001 missing access, 50007 cannot send
/// to this user, 50013 missing permissions, 50035 invalid form body — a nonce or
/// content too long); 502 and 503 are `Transient` (no gateway took the request); other
/// 5xx are `Ambiguous`; a 2xx without an id is `Ambiguous`.
///
/// ```
/// use chunked_outbox::Outcome;
/// use chunked_outbox::platforms::{discord, HttpReply};
///
/// let gone = HttpReply::new(404, r#"{"message": "Unknown Channel", "code": 10003}"#);
/// assert!(matches!(discord::outcome(&gone), Outcome::Permanent { error } if error.contains("10003")));
/// ```
pub fn outcome(reply: &HttpReply<'_>) -> Outcome {
    let body = reply.json();
    if (200..300).contains(&reply.status) {
        return delivered(reply, &body["id"], "id");
    }
    let message = body["message"].as_str().unwrap_or_default();
    let error = match body["code"].as_u64() {
        Some(code) if !message.is_empty() => format!("{} {message} (code {code})", reply.status),
        _ => reply.describe("from Discord"),
    };
    match reply.status {
        429 => {
            let waits = [seconds(&body["retry_after"]), reply.header_wait()];
            if body["global"] == Value::Bool(true) {
                // The bot's limit across every route: the whole channel waits.
                rate_limited(
                    &waits,
                    format!("{error}; global rate limit"),
                    Scope::Channel,
                )
            } else {
                rate_limited(&waits, error, Scope::Chat)
            }
        }
        400..=499 => Outcome::Permanent { error },
        502 | 503 => Outcome::Transient { error },
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

    /// Sample answers from Discord's API reference (rate limits, JSON error codes).
    #[test]
    fn documented_answers() {
        assert_eq!(
            map(
                200,
                r#"{"id":"1189283621932285982","channel_id":"41771983423143937","content":"hi","nonce":"AYkKXayWd0u8zrMCCZqAVwAB"}"#
            ),
            Outcome::delivered(Some("1189283621932285982".into()))
        );
        assert!(matches!(
            map(429, r#"{"message": "You are being rate limited.", "retry_after": 64.57, "global": false}"#),
            Outcome::RateLimited { retry_after, error }
                if retry_after == Duration::from_secs_f64(64.57) && !error.contains("global rate limit")
        ));
        match map(
            429,
            r#"{"message": "You are being rate limited.", "retry_after": 1.5, "global": true}"#,
        ) {
            Outcome::ChannelRateLimited { retry_after, error } => {
                assert_eq!(retry_after, Duration::from_millis(1500));
                assert!(error.contains("global"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        for (status, body, code) in [
            (
                404,
                r#"{"message": "Unknown Channel", "code": 10003}"#,
                "10003",
            ),
            (
                403,
                r#"{"message": "Cannot send messages to this user", "code": 50007}"#,
                "50007",
            ),
            (
                403,
                r#"{"message": "Missing Permissions", "code": 50013}"#,
                "50013",
            ),
            (
                403,
                r#"{"message": "Missing Access", "code": 50001}"#,
                "50001",
            ),
            (
                400,
                r#"{"code": 50035, "errors": {"nonce": {"_errors": [{"code": "BASE_TYPE_MAX_LENGTH", "message": "Must be 25 or fewer in length."}]}}, "message": "Invalid Form Body"}"#,
                "50035",
            ),
            (
                401,
                r#"{"message": "401: Unauthorized", "code": 0}"#,
                "code 0",
            ),
        ] {
            match map(status, body) {
                Outcome::Permanent { error } => assert!(error.contains(code), "{error}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(matches!(map(502, ""), Outcome::Transient { .. }));
        assert!(matches!(map(500, ""), Outcome::Ambiguous { .. }));
        assert!(matches!(map(200, "{}"), Outcome::Ambiguous { .. }));
        assert!(matches!(
            map(200, r#"{"id": ""}"#),
            Outcome::Ambiguous { .. }
        ));
        assert_eq!(
            map(200, r#"{"id": 1234}"#),
            Outcome::delivered(Some("1234".into()))
        );
        // A code without a message: the answer itself is quoted.
        match map(403, r#"{"code": 50013}"#) {
            Outcome::Permanent { error } => assert!(error.starts_with("HTTP 403"), "{error}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_header_stands_in_when_the_body_has_no_wait() {
        let reply = HttpReply::new(429, "").with_retry_after("3");
        assert!(matches!(outcome(&reply),
            Outcome::RateLimited { retry_after, .. } if retry_after == Duration::from_secs(3)));
    }
}
