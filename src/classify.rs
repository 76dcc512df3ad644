//! Classifying plain error texts, for adapters that only have a message.

use std::time::Duration;

use serde::Serialize;

/// What kind of failure an error text describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum ErrorClass {
    /// Retrying cannot help: the chat is gone, the bot is blocked or not a member, the
    /// message is malformed or too long.
    Permanent,
    /// The platform asked to slow down; `retry_after` if the text says how long.
    RateLimited {
        /// The wait the platform asked for, when the text names one.
        retry_after: Option<Duration>,
    },
    /// Anything else: worth retrying with backoff.
    Transient,
}

/// Permanent-failure patterns: each is a list of fragments that must appear in this
/// order (case-insensitive). Sources: Telegram Bot API error descriptions, Discord JSON
/// error codes, Slack Web API error strings, and the dead-letter patterns of openclaw's
/// delivery queue.
const PERMANENT: &[&[&str]] = &[
    // Telegram
    &["chat not found"],
    &["bot was blocked by the user"],
    &["user is deactivated"],
    &["message is too long"],
    &["forbidden: bot was kicked"],
    &["chat_id is empty"],
    // Generic / openclaw
    &["user not found"],
    &["bot", "not", "member"],
    &["recipient is not a valid"],
    &["no conversation reference found"],
    &["user ", " not in room"],
    // Slack
    &["channel_not_found"],
    &["not_in_channel"],
    &["is_archived"],
    &["msg_too_long"],
];

/// Discord JSON error codes that are permanent: 10003 unknown channel, 50007 cannot
/// send messages to this user, 50013 missing permissions.
const PERMANENT_CODES: &[&str] = &["10003", "50007", "50013"];

/// Classifies an error text as permanent, rate-limited or transient.
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::{classify_error, ErrorClass};
///
/// assert_eq!(classify_error("Forbidden: bot was blocked by the user"), ErrorClass::Permanent);
/// assert_eq!(
///     classify_error("Too Many Requests: retry after 35"),
///     ErrorClass::RateLimited { retry_after: Some(Duration::from_secs(35)) },
/// );
/// assert_eq!(classify_error("connection reset by peer"), ErrorClass::Transient);
/// ```
pub fn classify_error(text: &str) -> ErrorClass {
    let lower = text.to_lowercase();
    if PERMANENT.iter().any(|p| in_order(&lower, p))
        || PERMANENT_CODES.iter().any(|code| has_number(&lower, code))
    {
        return ErrorClass::Permanent;
    }
    if lower.contains("too many requests")
        || lower.contains("rate limit")
        || lower.contains("ratelimit")
        || lower.contains("rate_limited")
        || lower.contains("retry after")
        || lower.contains("retry_after")
        || has_number(&lower, "429")
    {
        return ErrorClass::RateLimited {
            retry_after: retry_after(&lower),
        };
    }
    ErrorClass::Transient
}

/// True if the fragments occur in `text` in this order, without overlapping.
fn in_order(text: &str, fragments: &[&str]) -> bool {
    let mut rest = text;
    for f in fragments {
        match rest.find(f) {
            Some(at) => rest = &rest[at + f.len()..],
            None => return false,
        }
    }
    true
}

/// True if `number` occurs in `text` as a whole number (no digit right before or after).
fn has_number(text: &str, number: &str) -> bool {
    text.match_indices(number).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + number.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_digit()) && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

/// The first number after "retry after" / "retry_after", read as seconds.
fn retry_after(text: &str) -> Option<Duration> {
    let at = text
        .find("retry after")
        .or_else(|| text.find("retry_after"))?;
    let digits: String = text[at + "retry after".len()..]
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let secs: f64 = digits.parse().ok()?;
    Duration::try_from_secs_f64(secs).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_permanent_texts() {
        for text in [
            "Bad Request: chat not found",
            "Forbidden: bot was blocked by the user",
            "Forbidden: user is deactivated",
            "Bad Request: message is too long",
            "Forbidden: bot was kicked from the group chat",
            "Bad Request: chat_id is empty",
            "Forbidden: bot is not a member of the channel chat",
            "recipient is not a valid phone number",
            "No conversation reference found for this user",
            "User @bob:example.org not in room",
            "slack error: channel_not_found",
            "not_in_channel",
            "is_archived",
            "msg_too_long",
            "Discord API error 50007: Cannot send messages to this user",
            "{\"code\": 10003, \"message\": \"Unknown Channel\"}",
            "code 50013 Missing Permissions",
            "user not found",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Permanent, "{text}");
        }
    }

    #[test]
    fn rate_limits_with_and_without_a_wait() {
        assert_eq!(
            classify_error("Too Many Requests: retry after 35"),
            ErrorClass::RateLimited {
                retry_after: Some(Duration::from_secs(35))
            }
        );
        assert_eq!(
            classify_error("{\"retry_after\": 1.5, \"message\": \"You are being rate limited.\"}"),
            ErrorClass::RateLimited {
                retry_after: Some(Duration::from_millis(1500))
            }
        );
        assert_eq!(
            classify_error("HTTP 429"),
            ErrorClass::RateLimited { retry_after: None }
        );
        assert_eq!(
            classify_error("slack: ratelimited"),
            ErrorClass::RateLimited { retry_after: None }
        );
    }

    #[test]
    fn everything_else_is_transient() {
        for text in [
            "connection reset by peer",
            "HTTP 502 Bad Gateway",
            "timeout",
            "error code 100030", // contains 10003 only as part of a longer number
            "port 4290 refused", // not a 429
            "",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Transient, "{text}");
        }
    }
}
