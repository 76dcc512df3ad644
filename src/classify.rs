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
    /// The send may have reached the platform (a timeout): follow the channel's
    /// [`ReplayPolicy`](crate::rules::ReplayPolicy).
    Ambiguous,
    /// Anything else: worth retrying with backoff.
    Transient,
}

/// Permanent-failure patterns: each is a list of fragments that must appear in this
/// order (case-insensitive), each as whole words (`bot` does not match inside `robot`).
/// Sources: Telegram Bot API error descriptions, Discord JSON error messages (serenity
/// prints only the message), Slack Web API error strings, and the dead-letter patterns
/// of openclaw's delivery queue.
const PERMANENT: &[&[&str]] = &[
    // Telegram (every "Bad Request:" is a 400: the same request fails again).
    &["bad request:"],
    &["chat not found"],
    &["bot was blocked by the user"],
    &["user is deactivated"],
    &["message is too long"],
    &["forbidden: bot was kicked"],
    &["chat_id is empty"],
    &["can't parse entities"],
    // teloxide's MigrateToChatId: the chat has a new id; re-enqueue to it.
    &["migrated to a supergroup"],
    &["upgraded to a supergroup"],
    &["unauthorized"],
    // Discord
    &["unknown channel"],
    &["unknown user"],
    &["cannot send messages to this user"],
    &["missing permissions"],
    &["missing access"],
    &["invalid form body"],
    &["401: unauthorized"],
    // Generic / openclaw
    &["user not found"],
    &["bot", "not", "member"],
    &["recipient is not a valid"],
    &["no conversation reference found"],
    &["user", "not in room"],
    // Slack
    &["channel_not_found"],
    &["not_in_channel"],
    &["is_archived"],
    &["msg_too_long"],
    &["invalid_auth"],
    &["not_authed"],
    &["account_inactive"],
    &["token_revoked"],
    &["missing_scope"],
];

/// Discord JSON error codes that are permanent: 10003 unknown channel, 10013 unknown
/// user, 50001 missing access, 50007 cannot send messages to this user, 50013 missing
/// permissions, 50035 invalid form body. Read only where a code stands (see
/// [`number_at_code`]), never from a port or an offset.
const PERMANENT_CODES: &[&str] = &["10003", "10013", "50001", "50007", "50013", "50035"];

/// HTTP statuses that are permanent for a send: 400 bad request, 401 bad token, 403
/// forbidden (blocked, kicked, no permission), 404 no such chat or method.
const PERMANENT_STATUSES: &[&str] = &["400", "401", "403", "404"];

/// Words after which a number is a status or an error code. A number anywhere else
/// (a byte offset, a port, a count) says nothing about the failure.
const CODE_WORDS: &[&str] = &["http", "status", "code", "error", "errcode"];

/// The longest wait a rate limit may ask for: 1 hour. A longer one is read as this
/// (see [`Outcome::RateLimited`](crate::Outcome::RateLimited), which is capped the
/// same way), so a garbled or hostile value cannot pause a chat for years.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Classifies an error text as permanent, rate-limited, ambiguous or transient.
///
/// * **Permanent**: a known permanent description (Telegram, Discord, Slack; whole
///   words), a Discord error code or an HTTP 400/401/403/404 where a code stands
///   (`"code": 50007`, `HTTP 403`, `error 10003`, `403 Forbidden`).
/// * **Rate limited**: "too many requests", "rate limit(ed)", "retry after" (or
///   `retry_after`, `Retry-After`), or a 429
///   where a status stands — never a bare number, so "byte offset 429" is not one.
///   The wait is read with its unit (`500ms`, `1.5s`, `2 minutes`; seconds when none)
///   and capped at [`MAX_RETRY_AFTER`].
/// * **Ambiguous**: a timeout (`timed out`, `timeout`, `deadline exceeded`): the request
///   may have been written and acted on, so a resend could duplicate it. The channel's
///   [`ReplayPolicy`](crate::rules::ReplayPolicy) decides.
/// * **Transient**: anything else, retried with backoff.
///
/// A typed mapping from the platform's own response beats any text; see
/// [`platforms`](crate::platforms).
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::platforms::{classify_error, ErrorClass};
///
/// assert_eq!(classify_error("Forbidden: bot was blocked by the user"), ErrorClass::Permanent);
/// assert_eq!(
///     classify_error("Too Many Requests: retry after 35"),
///     ErrorClass::RateLimited { retry_after: Some(Duration::from_secs(35)) },
/// );
/// assert_eq!(classify_error("operation timed out"), ErrorClass::Ambiguous);
/// assert_eq!(classify_error("connection refused"), ErrorClass::Transient);
/// ```
pub fn classify_error(text: &str) -> ErrorClass {
    let lower = text.to_lowercase();
    if PERMANENT.iter().any(|p| in_order(&lower, p))
        || PERMANENT_CODES
            .iter()
            .chain(PERMANENT_STATUSES)
            .any(|code| number_at_code(&lower, code))
    {
        return ErrorClass::Permanent;
    }
    if lower.contains("too many requests")
        || lower.contains("rate limit")
        || lower.contains("ratelimit")
        || lower.contains("rate_limit")
        || lower.contains("retry after")
        || lower.contains("retry_after")
        || lower.contains("retry-after")
        || number_at_code(&lower, "429")
    {
        return ErrorClass::RateLimited {
            retry_after: retry_after(&lower),
        };
    }
    if ["timed out", "timeout", "time out", "deadline exceeded"]
        .iter()
        .any(|t| lower.contains(t))
    {
        return ErrorClass::Ambiguous;
    }
    ErrorClass::Transient
}

/// True if the fragments occur in `text` in this order, without overlapping, each
/// as whole words: no letter or digit right before or after a fragment that starts or
/// ends with one.
fn in_order(text: &str, fragments: &[&str]) -> bool {
    let mut rest = text;
    'fragments: for f in fragments {
        let mut from = 0;
        while let Some(found) = rest[from..].find(f) {
            let at = from + found;
            let end = at + f.len();
            if is_word_start(rest, at, f) && is_word_end(rest, end, f) {
                rest = &rest[end..];
                continue 'fragments;
            }
            from = at + rest[at..].chars().next().map_or(1, char::len_utf8);
        }
        return false;
    }
    true
}

fn is_word_start(text: &str, at: usize, fragment: &str) -> bool {
    !fragment.starts_with(char::is_alphanumeric)
        || !text[..at]
            .chars()
            .next_back()
            .is_some_and(char::is_alphanumeric)
}

fn is_word_end(text: &str, end: usize, fragment: &str) -> bool {
    !fragment.ends_with(char::is_alphanumeric)
        || !text[end..]
            .chars()
            .next()
            .is_some_and(char::is_alphanumeric)
}

/// True if `number` occurs in `text` where a status or error code stands: as a whole
/// number, right after one of [`CODE_WORDS`] (with only spaces, quotes, `:`, `=`, `#`
/// or `(` between), or at the very start, or followed by the status's reason phrase
/// (`403 Forbidden`, `404 Not Found`). Never after `:` that follows a host
/// (`10.0.0.1:50007`), after "port", or inside a longer number.
fn number_at_code(text: &str, number: &str) -> bool {
    text.match_indices(number).any(|(at, _)| {
        let end = at + number.len();
        let before = &text[..at];
        let after = &text[end..];
        if after.starts_with(|c: char| c.is_ascii_digit()) {
            return false;
        }
        let lead = before.trim_end_matches([' ', '"', '\'', ':', '=', '#', '(']);
        if lead.is_empty() {
            return true;
        }
        // The word right before: `error_code` gives `code`; a digit before the number
        // (a longer number, a host such as `10.0.0.1:`) gives no word at all.
        let word = lead
            .rsplit(|c: char| !c.is_ascii_alphanumeric())
            .next()
            .unwrap_or("");
        CODE_WORDS.contains(&word) || has_reason_phrase(number, after)
    })
}

/// Whether `after` (the text after a status number) begins with that status's reason
/// phrase.
fn has_reason_phrase(number: &str, after: &str) -> bool {
    // (401 and 429 need none: "unauthorized" and "too many requests" are read anyway.)
    let phrase = match number {
        "400" => "bad request",
        "403" => "forbidden",
        "404" => "not found",
        _ => return false,
    };
    after
        .trim_start_matches([' ', ':', '-'])
        .starts_with(phrase)
}

/// The wait after "retry after" / "retry_after" / "retry-after", with its unit (ms,
/// s, min, h; seconds when none), capped at [`MAX_RETRY_AFTER`].
fn retry_after(text: &str) -> Option<Duration> {
    let (at, len) = ["retry after", "retry_after", "retry-after"]
        .iter()
        .find_map(|k| text.find(k).map(|at| (at, k.len())))?;
    let rest = &text[at + len..];
    let start = rest.find(|c: char| c.is_ascii_digit())?;
    let rest = &rest[start..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let value: f64 = rest[..end].parse().ok()?;
    let unit = rest[end..].trim_start();
    let unit: String = unit
        .chars()
        .take_while(|c| c.is_ascii_alphabetic())
        .collect();
    let secs = match unit.as_str() {
        "ms" | "msec" | "millis" | "millisecond" | "milliseconds" => value / 1000.0,
        "m" | "min" | "mins" | "minute" | "minutes" => value * 60.0,
        "h" | "hr" | "hour" | "hours" => value * 3600.0,
        _ => value,
    };
    Some(cap_retry_after(
        Duration::try_from_secs_f64(secs).unwrap_or(MAX_RETRY_AFTER),
    ))
}

/// A rate limit's wait, at most [`MAX_RETRY_AFTER`].
pub(crate) fn cap_retry_after(wait: Duration) -> Duration {
    wait.min(MAX_RETRY_AFTER)
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
            "error code 100030", // contains 10003 only as part of a longer number
            "port 4290 refused", // not a 429
            "",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Transient, "{text}");
        }
    }

    /// serenity's `Display` prints only Discord's message, without the JSON code.
    #[test]
    fn discord_messages_without_their_code_are_permanent() {
        for text in [
            "Unknown Channel",
            "Cannot send messages to this user",
            "Missing Permissions",
            "Missing Access",
            "Invalid Form Body",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Permanent, "{text}");
        }
    }

    /// teloxide: a network timeout may have reached Telegram, which cannot deduplicate,
    /// so it is ambiguous, not a blind retry; a migrated chat is permanent.
    #[test]
    fn teloxide_timeouts_are_ambiguous_and_a_migrated_chat_is_permanent() {
        for text in [
            "A network error: error sending request for url (https://api.telegram.org/bot.../sendMessage): operation timed out",
            "request timeout",
            "deadline exceeded",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Ambiguous, "{text}");
        }
        assert_eq!(
            classify_error("The group has been migrated to a supergroup with ID #-1001234567890"),
            ErrorClass::Permanent
        );
        assert_eq!(
            classify_error("Bad Request: group chat was upgraded to a supergroup chat"),
            ErrorClass::Permanent
        );
    }

    #[test]
    fn slack_and_http_auth_failures_are_permanent() {
        for text in [
            "invalid_auth",
            "slack error: account_inactive",
            "token_revoked",
            "HTTP 401",
            "status: 403",
            "401 Unauthorized",
            "Unauthorized",
            "400 Bad Request",
            "403 Forbidden",
            "404 Not Found",
            "{\"status_code\": 404}",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Permanent, "{text}");
        }
    }

    /// A 429 is a rate limit only where a status stands: a Telegram parse error at byte
    /// offset 429 is permanent, and a bare 429 elsewhere says nothing.
    #[test]
    fn a_bare_429_is_not_a_rate_limit() {
        assert_eq!(
            classify_error(
                "Bad Request: can't parse entities: Can't find end of the entity starting at byte offset 429"
            ),
            ErrorClass::Permanent
        );
        for text in [
            "can't find end of the entity starting at byte offset 429",
            "sent 429 bytes, then the connection reset",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Transient, "{text}");
        }
        for text in [
            "HTTP 429",
            "status=429",
            "{\"error_code\":429,\"description\":\"Too Many Requests\"}",
            "HTTP/1.1 429 Too Many Requests",
            "429",
        ] {
            assert!(
                matches!(classify_error(text), ErrorClass::RateLimited { .. }),
                "{text}"
            );
        }
    }

    /// Codes are never read from port numbers or addresses.
    #[test]
    fn ports_are_not_error_codes() {
        for text in [
            "error trying to connect: tcp connect error: 10.0.0.1:50007: connection refused",
            "connection to gateway.discord.gg port 10003 failed",
            "dns error for 127.0.0.1:50013",
            "proxy at [::1]:401 refused the connection",
            "error 1429 in the parser",
            "error 1.403 in the model",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Transient, "{text}");
        }
        assert_eq!(classify_error("error:50007"), ErrorClass::Permanent);
    }

    #[test]
    fn a_retry_after_is_read_with_its_unit() {
        for (text, wait) in [
            ("Retry after 500ms", Duration::from_millis(500)),
            ("retry after 1.5s", Duration::from_millis(1500)),
            (
                "rate limited, retry after 2 minutes",
                Duration::from_secs(120),
            ),
            ("Too Many Requests: retry after 35", Duration::from_secs(35)),
            ("Retry-After: 7", Duration::from_secs(7)),
            ("retry after 0.5 h", Duration::from_secs(1800)),
        ] {
            assert_eq!(
                classify_error(text),
                ErrorClass::RateLimited {
                    retry_after: Some(wait)
                },
                "{text}"
            );
        }
    }

    #[test]
    fn a_retry_after_is_capped() {
        for text in [
            "Too Many Requests: retry after 9999999999999",
            "retry after 2 hours",
            "retry_after: 99999999999999999999999999",
        ] {
            assert_eq!(
                classify_error(text),
                ErrorClass::RateLimited {
                    retry_after: Some(MAX_RETRY_AFTER)
                },
                "{text}"
            );
        }
    }

    /// Patterns match whole words: "robot ... not ... members" is not "bot ... not ...
    /// member".
    #[test]
    fn patterns_match_whole_words() {
        for text in [
            "the robot did not reach its members in time",
            // Only the start of "bot" is wrong here ...
            "the robot is not a member of staff",
            // ... and only its end here.
            "botany is not a member of the sciences",
        ] {
            assert_eq!(classify_error(text), ErrorClass::Transient, "{text}");
        }
        assert_eq!(
            classify_error("Forbidden: bot is not a member of the supergroup chat"),
            ErrorClass::Permanent
        );
    }
}
