//! Telegram Bot API (`sendMessage` and the other `send*` methods).
//!
//! Telegram has no idempotency key and no call that tells whether a message arrived:
//! an ambiguous send can only be held for a person (`ReplayPolicy::Hold`, the default)
//! or resent at the risk of a duplicate (`Replay`).
//!
//! With the feature `teloxide`, `TelegramAdapter` sends through the application's
//! teloxide client and maps that library's error types (module `teloxide`).

#[cfg(feature = "teloxide")]
pub mod teloxide;
#[cfg(feature = "teloxide")]
pub use teloxide::TelegramAdapter;

use serde_json::Value;

use super::{HttpReply, Scope, delivered, rate_limited, seconds};
use crate::outcome::Outcome;

/// Maps the Bot API's answer to a send.
///
/// `ok: true` is `Delivered` with `result.message_id` — or, for the methods that send
/// several messages (`sendMediaGroup`, `forwardMessages`, `copyMessages`), with the
/// `message_id` of each element of the `result` array, joined by commas; 429 is `RateLimited` for
/// `parameters.retry_after` seconds; a chat that moved
/// (`parameters.migrate_to_chat_id`, see [`migrated_to`]) and every other 4xx are
/// `Permanent`; 500, 502 and 504 are `Ambiguous` (the request reached Telegram, which may
/// have sent it); 503 is `Transient`; anything else, a 2xx whose body cannot be read
/// included, is `Ambiguous`.
///
/// ```
/// use chunked_outbox::Outcome;
/// use chunked_outbox::platforms::{HttpReply, telegram};
///
/// let blocked = HttpReply::new(403,
///     r#"{"ok":false,"error_code":403,"description":"Forbidden: bot was blocked by the user"}"#);
/// assert!(matches!(telegram::outcome(&blocked), Outcome::Permanent { .. }));
/// ```
pub fn outcome(reply: &HttpReply<'_>) -> Outcome {
    let body = reply.json();
    let description = body["description"].as_str().unwrap_or_default();
    if body["ok"] == Value::Bool(true) {
        // `true` is the result of methods that return no message.
        if body["result"] == Value::Bool(true) {
            return Outcome::delivered(None);
        }
        // `sendMediaGroup` answers an array of messages, `forwardMessages` and
        // `copyMessages` one of message ids: every one has its `message_id`.
        if let Value::Array(messages) = &body["result"] {
            return delivered_all(reply, messages);
        }
        return delivered(reply, &body["result"]["message_id"], "result.message_id");
    }
    let code = body["error_code"]
        .as_u64()
        .and_then(|c| u16::try_from(c).ok())
        .unwrap_or(reply.status);
    let error = if description.is_empty() {
        reply.describe("from Telegram")
    } else {
        format!("{code} {description}")
    };
    if let Some(chat) = migrated_to(reply) {
        return Outcome::Permanent {
            error: format!("{error} (the chat is now {chat}: send to that id)"),
        };
    }
    match code {
        429 => rate_limited(
            &[
                seconds(&body["parameters"]["retry_after"]),
                reply.header_wait(),
            ],
            error,
            // The answer does not name the scope; see the module docs of `platforms`.
            Scope::Chat,
        ),
        400..=499 => Outcome::Permanent { error },
        503 => Outcome::Transient { error },
        _ => Outcome::Ambiguous { error },
    }
}

/// A successful answer of several messages: `Delivered` with their ids joined by
/// commas, in the platform's order; `Ambiguous` when the array is empty or an element
/// has no id (the send happened or not, and the answer does not say which messages
/// it made).
fn delivered_all(reply: &HttpReply<'_>, messages: &[Value]) -> Outcome {
    let ids: Option<Vec<String>> = messages
        .iter()
        .map(|m| match &m["message_id"] {
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        })
        .collect();
    match ids {
        Some(ids) if !ids.is_empty() => Outcome::delivered(Some(ids.join(","))),
        _ => Outcome::Ambiguous {
            error: reply.describe("success without result[].message_id"),
        },
    }
}

/// The chat's new id when a group became a supergroup: the Bot API's
/// `parameters.migrate_to_chat_id`. Send (and enqueue) to that id from now on.
pub fn migrated_to(reply: &HttpReply<'_>) -> Option<i64> {
    reply.json()["parameters"]["migrate_to_chat_id"].as_i64()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn map(status: u16, body: &str) -> Outcome {
        outcome(&HttpReply::new(status, body))
    }

    /// `sendMediaGroup` answers an array of messages, `copyMessages` one of message
    /// ids: a success, with every id kept in order. An empty array, or an element
    /// without an id, says nothing of what was sent.
    #[test]
    fn answers_of_several_messages_are_deliveries_with_every_id() {
        assert_eq!(
            map(
                200,
                r#"{"ok":true,"result":[{"message_id":11,"chat":{"id":42,"type":"private"},"date":1700000000,"photo":[]},{"message_id":12,"chat":{"id":42,"type":"private"},"date":1700000000,"photo":[]}]}"#
            ),
            Outcome::delivered(Some("11,12".into()))
        );
        assert_eq!(
            map(200, r#"{"ok":true,"result":[{"message_id":7}]}"#),
            Outcome::delivered(Some("7".into()))
        );
        for body in [
            r#"{"ok":true,"result":[]}"#,
            r#"{"ok":true,"result":[{"message_id":7},{"chat":{}}]}"#,
        ] {
            assert!(
                matches!(map(200, body), Outcome::Ambiguous { .. }),
                "{body}"
            );
        }
    }

    /// Sample answers as the Bot API documentation and real bots show them.
    #[test]
    fn documented_answers() {
        assert_eq!(
            map(
                200,
                r#"{"ok":true,"result":{"message_id":1234,"chat":{"id":42,"type":"private"},"date":1700000000,"text":"hi"}}"#
            ),
            Outcome::delivered(Some("1234".into()))
        );
        assert!(matches!(
            map(429, r#"{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 35","parameters":{"retry_after":35}}"#),
            Outcome::RateLimited { retry_after, .. } if retry_after == Duration::from_secs(35)
        ));
        for (status, body) in [
            (
                403,
                r#"{"ok":false,"error_code":403,"description":"Forbidden: bot was blocked by the user"}"#,
            ),
            (
                400,
                r#"{"ok":false,"error_code":400,"description":"Bad Request: chat not found"}"#,
            ),
            (
                401,
                r#"{"ok":false,"error_code":401,"description":"Unauthorized"}"#,
            ),
            (
                403,
                r#"{"ok":false,"error_code":403,"description":"Forbidden: bot was kicked from the group chat"}"#,
            ),
            (
                400,
                r#"{"ok":false,"error_code":400,"description":"Bad Request: message is too long"}"#,
            ),
            // A parse error at byte offset 429 is not a rate limit.
            (
                400,
                r#"{"ok":false,"error_code":400,"description":"Bad Request: can't parse entities: Can't find end of the entity starting at byte offset 429"}"#,
            ),
        ] {
            assert!(
                matches!(map(status, body), Outcome::Permanent { .. }),
                "{body}"
            );
        }
        assert!(matches!(
            map(
                502,
                "<html><head><title>502 Bad Gateway</title></head></html>"
            ),
            Outcome::Ambiguous { .. }
        ));
        assert!(matches!(map(503, ""), Outcome::Transient { .. }));
        match map(200, "{\"ok\":tr") {
            Outcome::Ambiguous { error } => assert!(error.contains("HTTP 200"), "{error}"),
            other => panic!("{other:?}"),
        }
        // Methods that return no message answer `true`; a result without an id is odd.
        assert_eq!(
            map(200, r#"{"ok":true,"result":true}"#),
            Outcome::delivered(None)
        );
        assert!(matches!(
            map(200, r#"{"ok":true,"result":{}}"#),
            Outcome::Ambiguous { .. }
        ));
    }

    #[test]
    fn a_migrated_chat_names_its_new_id() {
        let body = r#"{"ok":false,"error_code":400,"description":"Bad Request: group chat was upgraded to a supergroup chat","parameters":{"migrate_to_chat_id":-1001234567890}}"#;
        let reply = HttpReply::new(400, body);
        assert_eq!(migrated_to(&reply), Some(-1_001_234_567_890));
        match outcome(&reply) {
            Outcome::Permanent { error } => assert!(error.contains("-1001234567890"), "{error}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_rate_limit_without_parameters_uses_the_header_then_one_second() {
        let body = r#"{"ok":false,"error_code":429,"description":"Too Many Requests"}"#;
        let with_header = HttpReply::new(429, body).with_retry_after("4");
        assert!(matches!(outcome(&with_header),
            Outcome::RateLimited { retry_after, .. } if retry_after == Duration::from_secs(4)));
        assert!(matches!(map(429, body),
            Outcome::RateLimited { retry_after, .. } if retry_after == Duration::from_secs(1)));
        let huge = r#"{"ok":false,"error_code":429,"parameters":{"retry_after":9999999999999}}"#;
        assert!(matches!(map(429, huge),
            Outcome::RateLimited { retry_after, .. } if retry_after == crate::limits::MAX_RETRY_AFTER));
    }
}
