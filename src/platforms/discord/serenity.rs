//! Discord adapter (feature `serenity`): sends each claimed chunk
//! through the application's own serenity [`Http`] client, with the chunk's 24-character
//! [`compact_key`](crate::Claim::compact_key) as an enforced `nonce`, and maps
//! serenity's typed errors — not their `Display` text — to an [`Outcome`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use chunked_outbox::{AsyncDispatcher, Outbox, OutboxOptions};
//! use chunked_outbox::platforms::discord::serenity::DiscordAdapter;
//! use chunked_outbox::rules::ChannelPolicy;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Discord drops a resend with the same nonce for a few minutes: a possibly-sent part
//! // is sent again inside that window, and held for a person after it.
//! let options = OutboxOptions::default().with_channel("discord", ChannelPolicy::asking());
//! let outbox = Outbox::open("bot.db", options)?;
//! let http = Arc::new(serenity::http::Http::new("TOKEN"));
//! let dispatcher = AsyncDispatcher::builder(outbox)
//!     .adapter("discord", DiscordAdapter::new(http))
//!     .build()?;
//! # drop(dispatcher);
//! # Ok(())
//! # }
//! ```
//!
//! The claim's `chat_id` is the channel id. The delivery's metadata, if any, is JSON:
//! `{"reply_to_message_id": "…"}` makes the first chunk a reply.
//!
//! Discord checks the nonce "for uniqueness in the past few minutes": a resend after
//! that is a new message. Under [`ReplayPolicy::Ask`](crate::rules::ReplayPolicy::Ask)
//! the adapter's [`settle`](AsyncChannelAdapter::settle) says a possibly-sent part may
//! be sent again while its first send is less than the nonce window ago
//! ([`NONCE_WINDOW`], 2 minutes; see
//! [`DiscordAdapter::with_nonce_window`]) and holds it for a person after.
//! (`ReplayPolicy::Replay` resends whenever the retry schedule says, window or not.)
//!
//! Keep serenity's ratelimiter on (the default): it reads Discord's buckets and waits
//! out a 429 itself, so sends simply take longer. A 429 that still reaches the adapter
//! (ratelimiter disabled, as with an HTTP proxy) carries no wait in serenity's error and
//! pauses the chat 1 s.
//!
//! | serenity result | outcome |
//! |---|---|
//! | `Ok(message)` | `Delivered`, the message id as platform id |
//! | `Http(UnsuccessfulRequest)` 429 | `RateLimited` (1 s) |
//! | `Http(UnsuccessfulRequest)` other 4xx (JSON `code` 10003, 50001, 50007, 50013, 50035 …) | `Permanent` |
//! | `Http(UnsuccessfulRequest)` 502, 503 | `Transient` |
//! | `Http(UnsuccessfulRequest)` other 5xx | `Ambiguous` |
//! | `Http(Request(e))`, `e.is_connect()` or `e.is_builder()` | `Transient` |
//! | `Http(Request(e))`, anything else (timeout or reset after writing) | `Ambiguous` |
//! | `Json`, `Decode` (an answer that cannot be read) | `Ambiguous` |
//! | `Model` (serenity refused it before sending: content over 2,000 characters …), any other | `Permanent` |

use std::sync::Arc;
use std::time::Duration;

use crate::claim::Claim;
use crate::dispatch::tokio::{AsyncChannelAdapter, SendFuture};
use crate::outcome::Outcome;
use crate::platforms::discord::NONCE_WINDOW;
use crate::platforms::{NoReply, no_reply};
use crate::settle::{PossiblySent, Settlement};
use serde::Deserialize;
use serenity::Error;
use serenity::builder::CreateMessage;
use serenity::http::{Http, HttpError};
use serenity::model::channel::{Message, Nonce};
use serenity::model::id::{ChannelId, MessageId};

/// Sends chunks with a serenity [`Http`] client.
#[derive(Debug, Clone)]
pub struct DiscordAdapter {
    http: Arc<Http>,
    nonce_window: Duration,
}

impl DiscordAdapter {
    /// An adapter that sends through `http`.
    pub fn new(http: Arc<Http>) -> Self {
        DiscordAdapter {
            http,
            nonce_window: NONCE_WINDOW,
        }
    }

    /// How long after a part's first send a resend is taken to be deduplicated by its
    /// nonce ([`NONCE_WINDOW`], 2 minutes, by default).
    pub fn with_nonce_window(self, window: Duration) -> Self {
        DiscordAdapter {
            nonce_window: window,
            ..self
        }
    }
}

/// What a delivery's metadata may say about its send (JSON; unknown fields are ignored).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct SendOptions {
    /// Reply to this message (the first chunk only), as Discord's id string.
    pub reply_to_message_id: Option<String>,
}

impl SendOptions {
    /// The options in a claim's metadata.
    ///
    /// # Errors
    ///
    /// A message naming what could not be read; the adapter records it as a permanent
    /// failure (the same metadata fails on every attempt).
    pub fn from_claim(claim: &Claim) -> Result<SendOptions, String> {
        crate::platforms::adapter_options(claim)
    }
}

/// A Discord id (a positive integer) from text.
fn snowflake(what: &str, text: &str) -> Result<u64, String> {
    text.parse::<u64>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| format!("{what} {text:?} is not a Discord id"))
}

/// The message create for a claim: its text, its compact key as an enforced nonce, and
/// the reply from its metadata on the first chunk.
fn request(claim: &Claim) -> Result<(ChannelId, CreateMessage), String> {
    let channel = ChannelId::new(snowflake("channel id", &claim.chat_id)?);
    let options = SendOptions::from_claim(claim)?;
    let mut message = CreateMessage::new()
        .content(claim.text.clone())
        .nonce(Nonce::String(claim.compact_key()))
        .enforce_nonce(true);
    if let Some(reply) = options.reply_to_message_id.filter(|_| claim.index == 0) {
        let reply = MessageId::new(snowflake("reply_to_message_id", &reply)?);
        message = message.reference_message((channel, reply));
    }
    Ok((channel, message))
}

impl AsyncChannelAdapter for DiscordAdapter {
    fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
        Box::pin(async move {
            match request(claim) {
                Ok((channel, message)) => crate::platforms::discord::resend_outcome(
                    claim,
                    outcome(channel.send_message(&self.http, message).await),
                ),
                Err(error) => Outcome::Permanent { error },
            }
        })
    }

    fn settle<'a>(&'a self, part: &'a PossiblySent) -> SendFuture<'a, Settlement> {
        Box::pin(std::future::ready(crate::platforms::discord::settle(
            part,
            self.nonce_window,
        )))
    }
}

/// Maps the result of a serenity message create to an [`Outcome`] (see the table in
/// the crate docs).
pub fn outcome(result: Result<Message, Error>) -> Outcome {
    let error = match result {
        Ok(message) => return Outcome::delivered(Some(message.id.to_string())),
        Err(error) => error,
    };
    let text = chain(&error);
    match error {
        Error::Http(HttpError::UnsuccessfulRequest(response)) => {
            let status = response.status_code.as_u16();
            let error = format!(
                "{status} {} (code {})",
                response.error.message, response.error.code
            );
            match status {
                429 => Outcome::RateLimited {
                    retry_after: Duration::from_secs(1),
                    error,
                },
                400..=499 => Outcome::Permanent { error },
                502 | 503 => Outcome::Transient { error },
                _ => Outcome::Ambiguous { error },
            }
        }
        Error::Http(HttpError::Request(e)) if e.is_connect() || e.is_builder() => {
            no_reply(NoReply::NotSent, text)
        }
        Error::Http(HttpError::Request(_)) | Error::Json(_) | Error::Decode(..) => {
            no_reply(NoReply::MaybeSent, text)
        }
        _ => Outcome::Permanent { error: text },
    }
}

/// An error and its sources, as one line: serenity's own text ("Error while sending
/// HTTP request.") says nothing of the cause.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_carries_the_compact_key_as_an_enforced_nonce() {
        // The request is built from the claim alone; serialized, it shows what is sent.
        let outbox = crate::Outbox::open_in_memory(Default::default()).unwrap();
        let reply = crate::NewDelivery::chunked("discord", "41771983423143937", "a b", ["a", "b"])
            .with_metadata(r#"{"reply_to_message_id": "1189283621932285982"}"#);
        outbox.enqueue(&reply).unwrap();
        let claim = outbox.claim(1).unwrap().remove(0);
        let (channel, message) = request(&claim).unwrap();
        assert_eq!(channel.get(), 41_771_983_423_143_937);
        let body = serde_json::to_value(&message).unwrap();
        assert_eq!(body["nonce"], claim.compact_key());
        assert!(claim.compact_key().len() <= 25);
        assert_eq!(body["enforce_nonce"], true);
        assert_eq!(
            body["message_reference"]["message_id"],
            "1189283621932285982"
        );
    }

    #[test]
    fn a_channel_id_that_is_not_a_snowflake_is_refused_before_sending() {
        assert!(snowflake("channel id", "general").is_err());
        assert!(snowflake("channel id", "0").is_err());
        assert_eq!(snowflake("channel id", "42"), Ok(42));
    }
}
