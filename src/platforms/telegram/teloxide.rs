//! Telegram adapter (feature `teloxide`): sends each claimed chunk
//! through the application's own [`teloxide_core::Bot`] and maps teloxide's typed
//! errors — not their `Display` text — to an [`Outcome`].
//!
//! ```no_run
//! use chunked_outbox::{AsyncDispatcher, Outbox, OutboxOptions};
//! use chunked_outbox::platforms::telegram::teloxide::TelegramAdapter;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = Outbox::open("bot.db", OutboxOptions::default())?;
//! let bot = teloxide_core::Bot::new("TOKEN");
//! let dispatcher = AsyncDispatcher::builder(outbox)
//!     .adapter("telegram", TelegramAdapter::new(bot))
//!     .build()?;
//! # drop(dispatcher);
//! # Ok(())
//! # }
//! ```
//!
//! The claim's `chat_id` is the numeric chat id, or `@channelusername`. The delivery's
//! metadata, if any, is JSON read by [`SendOptions`]: `reply_to_message_id` (applied
//! to the first chunk, so a long answer replies once), `message_thread_id`,
//! `parse_mode` (`"HTML"` or `"MarkdownV2"`; split such text with
//! [`Markup::TelegramHtml`](crate::split::Markup::TelegramHtml) so no entity is cut)
//! and `disable_notification`.
//!
//! teloxide waits 10 seconds before it reads an HTTP 5xx answer: give the dispatcher a
//! [`send_timeout`](crate::dispatch::DispatcherBuilder::send_timeout) above that, or
//! such a send is recorded as ambiguous when the timeout ends it.
//!
//! Telegram cannot deduplicate a send and cannot be asked whether one arrived: keep the
//! channel's [`ReplayPolicy::Hold`](crate::rules::ReplayPolicy::Hold) (the default)
//! so an ambiguous send waits for a person, or choose `Replay` and accept a rare
//! duplicate.
//!
//! | teloxide error | outcome |
//! |---|---|
//! | `Ok(message)` | `Delivered`, the message id as platform id |
//! | `RetryAfter(s)` | `RateLimited` for `s` |
//! | `MigrateToChatId(id)` | `Permanent`, naming the new id (send there from now on) |
//! | `Api(_)` — blocked, kicked, chat not found, too long, parse errors, bad token … | `Permanent` |
//! | `Api(Unknown("Internal Server Error" / "Bad Gateway" / "Gateway Timeout"))` | `Ambiguous` |
//! | `Api(Unknown("Service Unavailable"))` | `Transient` |
//! | `Network(e)`, `e.is_connect()` or `e.is_builder()` (nothing was written) | `Transient` |
//! | `Network(e)`, anything else (a timeout or reset after the request was written) | `Ambiguous` |
//! | `InvalidJson` (an answer that cannot be read) | `Ambiguous` |
//! | `Io` (reading a file to upload, before sending) | `Transient` |

use crate::claim::Claim;
use crate::dispatch::tokio::{AsyncChannelAdapter, SendFuture};
use crate::outcome::Outcome;
use crate::platforms::{NoReply, no_reply};
use serde::Deserialize;
use teloxide_core::errors::{ApiError, RequestError};
use teloxide_core::payloads::SendMessageSetters;
use teloxide_core::prelude::Requester;
use teloxide_core::types::{
    ChatId, Message, MessageId, ParseMode, Recipient, ReplyParameters, ThreadId,
};

/// Sends chunks with a teloxide [`Requester`] (a [`teloxide_core::Bot`], or one wrapped
/// in teloxide's adaptors).
#[derive(Debug, Clone)]
pub struct TelegramAdapter<B = teloxide_core::Bot> {
    bot: B,
}

impl<B> TelegramAdapter<B> {
    /// An adapter that sends through `bot`.
    pub fn new(bot: B) -> Self {
        TelegramAdapter { bot }
    }
}

/// What a delivery's metadata may say about its send (JSON; unknown fields are ignored).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct SendOptions {
    /// Reply to this message (the first chunk only).
    pub reply_to_message_id: Option<i32>,
    /// Send into this forum topic.
    pub message_thread_id: Option<i32>,
    /// `"HTML"` or `"MarkdownV2"`.
    pub parse_mode: Option<String>,
    /// Send silently.
    pub disable_notification: Option<bool>,
}

impl SendOptions {
    /// The options in a claim's metadata.
    ///
    /// # Errors
    ///
    /// A message naming what could not be read; the adapter records it as a permanent
    /// failure (the same metadata fails on every attempt).
    pub fn from_claim(claim: &Claim) -> Result<SendOptions, String> {
        let options: SendOptions = crate::platforms::adapter_options(claim)?;
        if let Some(mode) = &options.parse_mode
            && !matches!(mode.as_str(), "HTML" | "MarkdownV2" | "Markdown")
        {
            return Err(format!("unknown parse_mode {mode:?}"));
        }
        Ok(options)
    }

    fn parse_mode(&self) -> Option<ParseMode> {
        match self.parse_mode.as_deref()? {
            "HTML" => Some(ParseMode::Html),
            "MarkdownV2" => Some(ParseMode::MarkdownV2),
            _ =>
            {
                #[allow(deprecated)]
                Some(ParseMode::Markdown)
            }
        }
    }
}

/// The claim's chat as teloxide names it: a numeric id, or `@channelusername`.
fn recipient(chat_id: &str) -> Result<Recipient, String> {
    if chat_id.starts_with('@') {
        return Ok(Recipient::ChannelUsername(chat_id.to_owned()));
    }
    chat_id
        .parse()
        .map(|id| Recipient::Id(ChatId(id)))
        .map_err(|_| format!("chat id {chat_id:?} is neither a number nor @channelusername"))
}

impl<B> AsyncChannelAdapter for TelegramAdapter<B>
where
    B: Requester<Err = RequestError> + Send + Sync + 'static,
    B::SendMessage: Send,
{
    fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
        Box::pin(async move {
            let (chat, options) = match recipient(&claim.chat_id)
                .and_then(|chat| Ok((chat, SendOptions::from_claim(claim)?)))
            {
                Ok(ready) => ready,
                Err(error) => return Outcome::Permanent { error },
            };
            let mut request = self.bot.send_message(chat, claim.text.clone());
            if let Some(id) = options.reply_to_message_id.filter(|_| claim.index == 0) {
                request = request.reply_parameters(ReplyParameters {
                    allow_sending_without_reply: Some(true),
                    ..ReplyParameters::new(MessageId(id))
                });
            }
            if let Some(thread) = options.message_thread_id {
                request = request.message_thread_id(ThreadId(MessageId(thread)));
            }
            if let Some(mode) = options.parse_mode() {
                request = request.parse_mode(mode);
            }
            if let Some(silent) = options.disable_notification {
                request = request.disable_notification(silent);
            }
            outcome(request.await)
        })
    }
}

/// Maps the result of a teloxide send to an [`Outcome`] (see the table in the crate
/// docs).
pub fn outcome(result: Result<Message, RequestError>) -> Outcome {
    let error = match result {
        Ok(message) => return Outcome::delivered(Some(message.id.0.to_string())),
        Err(error) => error,
    };
    let text = error.to_string();
    match error {
        RequestError::RetryAfter(wait) => Outcome::RateLimited {
            retry_after: wait.duration(),
            error: text,
        },
        RequestError::MigrateToChatId(chat) => Outcome::Permanent {
            error: format!("{text}: send to chat {chat} from now on"),
        },
        RequestError::Api(ApiError::Unknown(description)) => match description.as_str() {
            "Internal Server Error" | "Bad Gateway" | "Gateway Timeout" => {
                Outcome::Ambiguous { error: text }
            }
            "Service Unavailable" => Outcome::Transient { error: text },
            _ => Outcome::Permanent { error: text },
        },
        RequestError::Api(_) => Outcome::Permanent { error: text },
        RequestError::Network(e) if e.is_connect() || e.is_builder() => {
            no_reply(NoReply::NotSent, text)
        }
        RequestError::Network(_) | RequestError::InvalidJson { .. } => {
            no_reply(NoReply::MaybeSent, text)
        }
        RequestError::Io(_) => Outcome::Transient { error: text },
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use teloxide_core::types::Seconds;

    use super::*;

    #[test]
    fn typed_errors_map_without_reading_their_text() {
        let unknown = |d: &str| outcome(Err(RequestError::Api(ApiError::Unknown(d.into()))));
        assert!(matches!(
            unknown("Internal Server Error"),
            Outcome::Ambiguous { .. }
        ));
        assert!(matches!(
            unknown("Gateway Timeout"),
            Outcome::Ambiguous { .. }
        ));
        assert!(matches!(
            unknown("Service Unavailable"),
            Outcome::Transient { .. }
        ));
        assert!(matches!(
            unknown("Bad Request: something new"),
            Outcome::Permanent { .. }
        ));
        assert!(matches!(
            outcome(Err(RequestError::Api(ApiError::BotBlocked))),
            Outcome::Permanent { .. }
        ));
        assert!(matches!(
            outcome(Err(RequestError::RetryAfter(Seconds::from_seconds(35)))),
            Outcome::RateLimited { retry_after, .. } if retry_after.as_secs() == 35
        ));
        assert!(matches!(
            outcome(Err(RequestError::MigrateToChatId(ChatId(-100_123)))),
            Outcome::Permanent { error } if error.contains("-100123")
        ));
        let io = std::io::Error::other("file vanished");
        assert!(matches!(
            outcome(Err(RequestError::Io(Arc::new(io)))),
            Outcome::Transient { .. }
        ));
    }

    #[test]
    fn chat_ids_and_metadata_are_checked_before_sending() {
        assert_eq!(
            recipient("-100123").unwrap(),
            Recipient::Id(ChatId(-100_123))
        );
        assert!(matches!(
            recipient("@news").unwrap(),
            Recipient::ChannelUsername(_)
        ));
        assert!(recipient("news").is_err());
    }
}
