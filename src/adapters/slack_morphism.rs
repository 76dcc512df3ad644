//! Slack adapter (feature `slack-morphism`): sends each claimed chunk with
//! `chat.postMessage` through the application's own slack-morphism [`SlackClient`], and
//! maps slack-morphism's typed errors — not their `Display` text — to an [`Outcome`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use chunked_outbox::{AsyncDispatcher, Outbox, OutboxOptions};
//! use chunked_outbox::platforms::slack::slack_morphism::SlackAdapter;
//! use slack_morphism::prelude::*;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = Outbox::open("bot.db", OutboxOptions::default())?;
//! let client = Arc::new(SlackClient::new(SlackClientHyperConnector::new()?));
//! let token = SlackApiToken::new("xoxb-…".into());
//! let dispatcher = AsyncDispatcher::builder(outbox)
//!     .adapter("slack", SlackAdapter::new(client, token))
//!     .build()?;
//! # drop(dispatcher);
//! # Ok(())
//! # }
//! ```
//!
//! The claim's `chat_id` is the channel id. The delivery's metadata, if any, is JSON:
//! `{"thread_ts": "…"}` posts every chunk into that thread, so a long answer stays in
//! one place.
//!
//! Slack cannot deduplicate a post, but a bot can look its messages up
//! (`conversations.history`): keep the channel's
//! [`ReplayPolicy::Hold`](crate::rules::ReplayPolicy::Hold) (the default) and settle an
//! uncertain chunk by looking, then
//! [`resolve_uncertain`](crate::Outbox::resolve_uncertain).
//!
//! hyper puts no time limit on a request: the adapter bounds each send itself
//! ([`SlackAdapter::with_timeout`], 30 s by default) and records one that runs out as
//! ambiguous (it may have been posted).
//!
//! | slack-morphism result | outcome |
//! |---|---|
//! | `Ok(response)` | `Delivered`, the message `ts` as platform id |
//! | `RateLimitError` | `ChannelRateLimited` (Slack limits the app, see [`platforms`](crate::platforms)) for its `retry_after` (1 s when none) |
//! | `ApiError` (`code`) | as [`platforms::slack::error_outcome`](crate::platforms::slack::error_outcome): `internal_error`, `fatal_error` → `Ambiguous`; `service_unavailable`, `request_timeout` … → `Transient`; every other code → `Permanent` |
//! | `HttpError` 429 / 4xx / 5xx | `ChannelRateLimited` (1 s) / `Permanent` / `Ambiguous` |
//! | `HttpProtocolError` that never connected | `Transient` |
//! | `HttpProtocolError` otherwise, `EndOfStream`, the adapter's timeout | `Ambiguous` |
//! | `ProtocolError` (an answer that cannot be read), any other | `Ambiguous` |

use std::sync::Arc;
use std::time::Duration;

use crate::claim::Claim;
use crate::dispatch::tokio::{AsyncChannelAdapter, SendFuture};
use crate::outcome::Outcome;
use crate::platforms::{NoReply, no_reply, slack};
use serde::Deserialize;
use slack_morphism::errors::SlackClientError;
use slack_morphism::prelude::*;

/// Sends chunks with a slack-morphism client and a bot token.
pub struct SlackAdapter<C: SlackClientHttpConnector + Send + Sync> {
    client: Arc<SlackClient<C>>,
    token: SlackApiToken,
    timeout: Duration,
}

impl<C: SlackClientHttpConnector + Send + Sync> std::fmt::Debug for SlackAdapter<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token stays out of logs.
        f.debug_struct("SlackAdapter")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl<C: SlackClientHttpConnector + Send + Sync> SlackAdapter<C> {
    /// An adapter that posts through `client` with `token`.
    pub fn new(client: Arc<SlackClient<C>>, token: SlackApiToken) -> Self {
        SlackAdapter {
            client,
            token,
            timeout: Duration::from_secs(30),
        }
    }

    /// Bounds each send to `timeout` (30 s by default); a send that runs out is
    /// ambiguous.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        SlackAdapter { timeout, ..self }
    }
}

/// What a delivery's metadata may say about its send (JSON; unknown fields are ignored).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct SendOptions {
    /// Post every chunk into this thread.
    pub thread_ts: Option<String>,
}

impl SendOptions {
    /// The options in a claim's metadata.
    ///
    /// # Errors
    ///
    /// A message naming what could not be read; the adapter records it as a permanent
    /// failure (the same metadata fails on every attempt).
    pub fn from_claim(claim: &Claim) -> Result<SendOptions, String> {
        super::options_from(claim)
    }
}

/// The `chat.postMessage` request for a claim.
fn request(claim: &Claim) -> Result<SlackApiChatPostMessageRequest, String> {
    let options = SendOptions::from_claim(claim)?;
    let mut request = SlackApiChatPostMessageRequest::new(
        claim.chat_id.clone().into(),
        SlackMessageContent::new().with_text(claim.text.clone()),
    );
    if let Some(ts) = options.thread_ts {
        request = request.with_thread_ts(ts.into());
    }
    Ok(request)
}

impl<C> AsyncChannelAdapter for SlackAdapter<C>
where
    C: SlackClientHttpConnector + Send + Sync + 'static,
{
    fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
        Box::pin(async move {
            let request = match request(claim) {
                Ok(request) => request,
                Err(error) => return Outcome::Permanent { error },
            };
            let session = self.client.open_session(&self.token);
            match tokio::time::timeout(self.timeout, session.chat_post_message(&request)).await {
                Ok(result) => outcome(result),
                Err(_) => no_reply(
                    NoReply::MaybeSent,
                    format!("no answer from Slack within {:?}", self.timeout),
                ),
            }
        })
    }
}

/// Maps the result of a slack-morphism `chat.postMessage` to an [`Outcome`] (see the
/// table in the crate docs).
pub fn outcome(result: Result<SlackApiChatPostMessageResponse, SlackClientError>) -> Outcome {
    let error = match result {
        Ok(response) => return Outcome::delivered(Some(response.ts.0)),
        Err(error) => error,
    };
    let text = error.to_string();
    match error {
        SlackClientError::RateLimitError(e) => Outcome::ChannelRateLimited {
            retry_after: e.retry_after.unwrap_or(Duration::from_secs(1)),
            error: text,
        },
        SlackClientError::ApiError(e) => match slack::error_outcome(&e.code) {
            Outcome::Permanent { .. } => Outcome::Permanent { error: text },
            other => other,
        },
        SlackClientError::HttpError(e) => match e.status_code.as_u16() {
            429 => Outcome::ChannelRateLimited {
                retry_after: Duration::from_secs(1),
                error: text,
            },
            400..=499 => Outcome::Permanent { error: text },
            _ => Outcome::Ambiguous { error: text },
        },
        SlackClientError::HttpProtocolError(e) if never_connected(e.cause.as_deref()) => {
            no_reply(NoReply::NotSent, text)
        }
        _ => no_reply(NoReply::MaybeSent, text),
    }
}

/// Whether a transport error is hyper's "could not connect" (nothing was written).
fn never_connected(cause: Option<&(dyn std::error::Error + Send + Sync + 'static)>) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = match cause {
        Some(cause) => Some(cause),
        None => return false,
    };
    while let Some(error) = source {
        if let Some(e) = error.downcast_ref::<hyper_util::client::legacy::Error>() {
            return e.is_connect();
        }
        source = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use slack_morphism::errors::{SlackClientApiError, SlackClientHttpError};

    use super::*;

    fn api(code: &str) -> Outcome {
        outcome(Err(SlackClientError::ApiError(SlackClientApiError::new(
            code.into(),
        ))))
    }

    #[test]
    fn api_codes_map_like_the_core_mapping() {
        assert!(matches!(
            api("ratelimited"),
            Outcome::ChannelRateLimited { .. }
        ));
        assert!(matches!(api("internal_error"), Outcome::Ambiguous { .. }));
        assert!(matches!(
            api("service_unavailable"),
            Outcome::Transient { .. }
        ));
        assert!(
            matches!(api("not_in_channel"), Outcome::Permanent { error } if error.contains("not_in_channel"))
        );
    }

    #[test]
    fn http_statuses_map_by_class() {
        let http = |status: u16| {
            outcome(Err(SlackClientError::HttpError(SlackClientHttpError::new(
                http::StatusCode::from_u16(status).unwrap(),
            ))))
        };
        assert!(matches!(http(429), Outcome::ChannelRateLimited { .. }));
        assert!(matches!(http(403), Outcome::Permanent { .. }));
        assert!(matches!(http(502), Outcome::Ambiguous { .. }));
    }
}
