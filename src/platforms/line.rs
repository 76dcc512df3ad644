//! LINE Messaging API (`POST /v2/bot/message/push`).
//!
//! A push sent with an `X-Line-Retry-Key` (a UUID: [`Claim::key_uuid`](crate::Claim::key_uuid))
//! is accepted once: LINE answers a request repeated with the same key within 24 hours
//! with 409 Conflict and the accepted request's id in `X-Line-Accepted-Request-Id`, and
//! posts nothing. So a resend tells what happened, and [`outcome`] reads that 409 as
//! delivered. Declare the channel
//! [`ChannelPolicy::asking`](crate::rules::ChannelPolicy::asking) and answer
//! [`settle`](crate::ChannelAdapter::settle) with [`settle`]: a possibly-sent part is
//! sent again inside the key's 24 hours, and held for a person after.

use std::time::Duration;

use super::{HttpReply, Scope, delivered, rate_limited};
use crate::outcome::Outcome;
use crate::settle::{PossiblySent, Settlement};

/// How long LINE keeps a retry key: 24 hours from the first request with it.
pub const RETRY_KEY_WINDOW: Duration = Duration::from_secs(24 * 60 * 60);

/// Maps LINE's answer to a push.
///
/// 2xx is `Delivered` with the first `sentMessages[].id`; 409 (the retry key was
/// accepted before: this is a resend of a push LINE has) is `Delivered` with the
/// `sentMessages` id when the body has one, else the accepted request's id; 429 is
/// `ChannelRateLimited` (LINE limits the bot's channel, and sends no wait: 1 s); every
/// other 4xx is `Permanent`; 5xx is `Ambiguous` (a resend under the same key is safe).
///
/// ```
/// use chunked_outbox::Outcome;
/// use chunked_outbox::platforms::{HttpReply, line};
///
/// let again = HttpReply::new(409, r#"{"message": "The retry key is already accepted"}"#)
///     .with_accepted_request_id("3a5f2c7e-0d51-4a47-9a8e-0f6f3d9b1b77");
/// assert_eq!(line::outcome(&again),
///     Outcome::delivered(Some("3a5f2c7e-0d51-4a47-9a8e-0f6f3d9b1b77".into())));
/// ```
pub fn outcome(reply: &HttpReply<'_>) -> Outcome {
    let body = reply.json();
    let sent = &body["sentMessages"][0]["id"];
    if (200..300).contains(&reply.status) {
        return delivered(reply, sent, "sentMessages[].id");
    }
    if reply.status == 409 {
        return match (sent.as_str(), reply.accepted_request_id) {
            (Some(id), _) if !id.is_empty() => Outcome::delivered(Some(id.to_owned())),
            (_, Some(request)) => Outcome::delivered(Some(request.trim().to_owned())),
            _ => Outcome::delivered(None),
        };
    }
    let error = reply.describe("from LINE");
    match reply.status {
        429 => rate_limited(&[reply.header_wait()], error, Scope::Channel),
        400..=499 => Outcome::Permanent { error },
        _ => Outcome::Ambiguous { error },
    }
}

/// What a LINE adapter's [`settle`](crate::ChannelAdapter::settle) answers: a resend
/// under the same retry key while the first send is less than [`RETRY_KEY_WINDOW`] ago
/// (LINE then answers 409 if it has the push, which [`outcome`] reads as delivered),
/// a hold for a person after.
pub fn settle(part: &PossiblySent) -> Settlement {
    Settlement::within_window(part, RETRY_KEY_WINDOW, "LINE X-Line-Retry-Key")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(status: u16, body: &str) -> Outcome {
        outcome(&HttpReply::new(status, body))
    }

    /// Sample answers from the Messaging API reference.
    #[test]
    fn documented_answers() {
        assert_eq!(
            map(
                200,
                r#"{"sentMessages":[{"id":"461230966842064897","quoteToken":"IStG5h1Tz7b..."}]}"#
            ),
            Outcome::delivered(Some("461230966842064897".into()))
        );
        assert_eq!(
            map(
                409,
                r#"{"message":"The retry key is already accepted","sentMessages":[{"id":"461230966842064897"}]}"#
            ),
            Outcome::delivered(Some("461230966842064897".into()))
        );
        assert_eq!(
            map(409, r#"{"message":"The retry key is already accepted"}"#),
            Outcome::delivered(None)
        );
        assert!(matches!(
            map(429, r#"{"message":"The API rate limit has been exceeded. Try again later."}"#),
            Outcome::ChannelRateLimited { retry_after, .. } if retry_after == Duration::from_secs(1)
        ));
        assert!(matches!(
            map(400, r#"{"message":"The request body has 1 error(s)"}"#),
            Outcome::Permanent { .. }
        ));
        assert!(matches!(
            map(401, r#"{"message":"Authentication failed"}"#),
            Outcome::Permanent { .. }
        ));
        assert!(matches!(
            map(500, r#"{"message":"Internal server error"}"#),
            Outcome::Ambiguous { .. }
        ));
        assert!(matches!(map(200, "{}"), Outcome::Ambiguous { .. }));
    }
}
