//! Slack adapter (feature `slack-morphism`): sends each claimed chunk with
//! `chat.postMessage` through the application's own slack-morphism [`SlackClient`], and
//! maps slack-morphism's typed errors — not their `Display` text — to an [`Outcome`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use chunked_outbox::{AsyncDispatcher, Outbox, OutboxOptions};
//! use chunked_outbox::platforms::slack::slack_morphism::SlackAdapter;
//! use chunked_outbox::rules::ChannelPolicy;
//! use slack_morphism::prelude::*;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // A possibly-sent part is looked up in the channel's history by its key.
//! let options = OutboxOptions::default().with_channel("slack", ChannelPolicy::asking());
//! let outbox = Outbox::open("bot.db", options)?;
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
//! Slack cannot deduplicate a post, but a bot can look its messages up. Every post
//! carries the part's key in its message metadata (`event_type`
//! [`METADATA_EVENT_TYPE`], `event_payload` `{"key": claim.idempotency_key}`), and under
//! [`ReplayPolicy::Ask`](crate::rules::ReplayPolicy::Ask) the adapter's
//! [`settle`](AsyncChannelAdapter::settle) looks a possibly-sent part up:
//! `conversations.history` of the channel (`conversations.replies` of the thread for a
//! part posted into one) with `include_all_metadata`, from the latest Slack `ts` the
//! outbox holds before the part — its reply's previous part, the chat's last reply
//! delivered before it was sent, the thread's own `ts` — and only without one from a
//! minute before its first send by the outbox's clock. Found: delivered, with its `ts`.
//! Not among every message since: sent again. One read of a conversation serves every
//! part waiting there, and it is kept between questions: under Slack's Tier 1 limits
//! (since 2025 for apps outside the Marketplace: one history read a minute, 15 messages
//! a page) a rate-limited read goes on from its cursor once the `Retry-After` is over,
//! the dispatcher asking nothing more of the channel until then. A lookup that fails,
//! times out, has more than 2,000 messages to read, or has not finished
//! [`SlackAdapter::with_lookup_limit`] (30 minutes) after the part became uncertain is
//! held for a person, with why. It looks only once the
//! part has been uncertain for [`SlackAdapter::with_lookup_grace`] (10 s), so that a
//! post Slack was still working on when the send gave up is in the history by then.
//! The token needs `channels:history` (and `groups:history`, `im:history`,
//! `mpim:history` for those conversations).
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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::claim::Claim;
use crate::dispatch::tokio::{AsyncChannelAdapter, SendFuture};
use crate::outcome::Outcome;
use crate::platforms::{NoReply, no_reply, slack};
use crate::settle::{PossiblySent, Settlement};
use serde::Deserialize;
use slack_morphism::errors::SlackClientError;
use slack_morphism::prelude::*;

/// Sends chunks with a slack-morphism client and a bot token.
pub struct SlackAdapter<C: SlackClientHttpConnector + Send + Sync> {
    client: Arc<SlackClient<C>>,
    token: SlackApiToken,
    timeout: Duration,
    lookup_grace: Duration,
    lookup_limit: Duration,
    /// The history reads under way or done, by conversation (channel, thread).
    readings: Mutex<HashMap<(String, Option<String>), Reading>>,
}

/// A read of one conversation's history (a channel's, or a thread's) from a Slack
/// `ts`, page by page, kept between questions: every part waiting there is answered
/// from the pages read, and a read that Slack rate-limits goes on from its cursor
/// instead of starting again (under Tier 1, one page a minute).
#[derive(Debug)]
struct Reading {
    /// From where, as asked (`oldest`) and as a time.
    oldest: String,
    from: chrono::DateTime<chrono::Utc>,
    /// The outbox's clock when the read began: a part posted after it may be missing.
    started: chrono::DateTime<chrono::Utc>,
    /// Where the next page starts; `None` before the first page.
    cursor: Option<String>,
    /// Whether the last page was read.
    done: bool,
    /// The parts' keys found, with each one's `ts`.
    seen: HashMap<String, String>,
    /// Messages read so far.
    read: usize,
}

impl Reading {
    fn new(from: chrono::DateTime<chrono::Utc>, now: chrono::DateTime<chrono::Utc>) -> Reading {
        Reading {
            oldest: format!("{}.{:06}", from.timestamp(), from.timestamp_subsec_micros()),
            from,
            started: now,
            cursor: None,
            done: false,
            seen: HashMap::new(),
            read: 0,
        }
    }

    /// Takes in a page read.
    fn take(&mut self, page: History) {
        self.read += page.messages.len();
        for message in page.messages {
            if let Some(key) = message.key() {
                self.seen.insert(key, message.ts);
            }
        }
        self.cursor = page
            .response_metadata
            .and_then(|m| m.next_cursor)
            .filter(|c| !c.is_empty() && page.has_more.unwrap_or(true));
        self.done = self.cursor.is_none();
    }
}

/// The `event_type` of the message metadata every post carries; its `event_payload` is
/// `{"key": claim.idempotency_key}`.
pub const METADATA_EVENT_TYPE: &str = "chunked_outbox_part";

/// Messages asked for per page of a lookup (Slack gives Tier 1 apps 15 at most), pages
/// read per question at most, and messages read before a part is held for a person.
const LOOKUP_PAGE: u16 = 200;
const LOOKUP_PAGES: usize = 10;
const LOOKUP_MAX_READ: usize = 2_000;

/// How far before a part's first send a lookup starts: room for the outbox's clock and
/// Slack's to differ.
const CLOCK_MARGIN: Duration = Duration::from_secs(60);

/// A Slack `ts` (`"1767225600.000100"`) as the time it names.
fn slack_time(ts: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    let (seconds, micros) = ts.split_once('.')?;
    let micros: u32 = micros.parse().ok().filter(|_| micros.len() == 6)?;
    chrono::DateTime::from_timestamp(seconds.parse().ok()?, micros * 1000)
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
            lookup_grace: Duration::from_secs(10),
            lookup_limit: Duration::from_secs(30 * 60),
            readings: Mutex::new(HashMap::new()),
        }
    }

    /// Looks a possibly-sent part up only once it has been uncertain for `grace` (10 s
    /// by default): a post Slack was still making when the send gave up is in the
    /// history by then. Until then its question is asked again later.
    pub fn with_lookup_grace(self, grace: Duration) -> Self {
        SlackAdapter {
            lookup_grace: grace,
            ..self
        }
    }

    /// Holds a part whose lookup has not finished `limit` after it became uncertain (30
    /// minutes by default), for a person: under Slack's Tier 1 (one history read a
    /// minute, 15 messages a page) a busy channel can take longer than is worth waiting.
    pub fn with_lookup_limit(self, limit: Duration) -> Self {
        SlackAdapter {
            lookup_limit: limit,
            ..self
        }
    }

    /// Looks `part` up by its key in its conversation's history: the channel's, or the
    /// thread's for a part posted into one. The read starts from a Slack `ts` the outbox
    /// holds — the reply's previous part, or the chat's last reply delivered before the
    /// part was sent, or the thread's own `ts`, whichever is latest — and only without
    /// one from a minute before its first send by the outbox's clock. The pages read
    /// are kept between questions ([`Reading`]).
    async fn look_up(&self, part: &PossiblySent) -> Settlement {
        let claim = &part.claim;
        let thread = SendOptions::from_claim(claim)
            .ok()
            .and_then(|o| o.thread_ts);
        let known = [part.previous_platform_id.as_deref(), thread.as_deref()]
            .into_iter()
            .flatten()
            .filter_map(slack_time)
            .max();
        let from = known.unwrap_or_else(|| {
            part.first_sent_at - chrono::Duration::from_std(CLOCK_MARGIN).unwrap_or_default()
        });
        let method = match thread {
            Some(_) => "conversations.replies",
            None => "conversations.history",
        };
        let asked = format!(
            "{method} of {} since {} for the key {}",
            claim.chat_id,
            from.format("%Y-%m-%dT%H:%M:%SZ"),
            claim.idempotency_key
        );
        let conversation = (claim.chat_id.clone(), thread.clone());
        // A read that started before the part's post would be in the history proves
        // nothing about its absence.
        let posted_by = part.uncertain_since
            + chrono::Duration::from_std(self.lookup_grace).unwrap_or_default();
        let stale_after = chrono::Duration::from_std(self.lookup_limit).unwrap_or_default();
        let session = self.client.open_session(&self.token);
        for _ in 0..LOOKUP_PAGES {
            // What the pages read so far tell, or where the next page starts.
            let (oldest, cursor) = {
                let mut readings = self.readings.lock().unwrap_or_else(|e| e.into_inner());
                readings.retain(|_, r| part.now - r.started < stale_after * 2);
                let reading = readings
                    .entry(conversation.clone())
                    .or_insert_with(|| Reading::new(from, part.now));
                if let Some(ts) = reading.seen.get(&claim.idempotency_key) {
                    return Settlement::found(
                        asked,
                        format!("a message with the key, ts {ts}"),
                        Some(ts.clone()),
                    );
                }
                let serves = reading.from <= from && reading.started >= posted_by;
                if serves && reading.done {
                    return Settlement::resend(
                        asked,
                        format!(
                            "no message with the key among the {} since then",
                            reading.read
                        ),
                    );
                }
                if !serves && (reading.done || part.now - reading.started > stale_after) {
                    // A read of its own, from where this part needs it.
                    *reading = Reading::new(from, part.now);
                }
                if part.uncertain_for() >= self.lookup_limit {
                    return Settlement::hold(
                        asked,
                        format!(
                            "the lookup had not finished {} s after the part became uncertain ({} messages read; Slack's rate limit allows so few reads)",
                            self.lookup_limit.as_secs(),
                            reading.read
                        ),
                    );
                }
                if reading.read >= LOOKUP_MAX_READ {
                    let read = reading.read;
                    readings.remove(&conversation);
                    return Settlement::hold(
                        asked,
                        format!(
                            "more than {read} messages since the first send; not all were read"
                        ),
                    );
                }
                (reading.oldest.clone(), reading.cursor.clone())
            };
            let mut params: Vec<(&str, Option<String>)> = vec![
                ("channel", Some(claim.chat_id.clone())),
                ("oldest", Some(oldest.clone())),
                ("inclusive", Some("true".into())),
                ("include_all_metadata", Some("true".into())),
                ("limit", Some(LOOKUP_PAGE.to_string())),
                ("cursor", cursor.clone()),
            ];
            if let Some(ts) = &thread {
                params.push(("ts", Some(ts.clone())));
            }
            let page = session.http_session_api.http_get(method, &params, None);
            let failed = match tokio::time::timeout(self.timeout, page).await {
                Ok(Ok(page)) => {
                    let mut readings = self.readings.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(reading) = readings
                        .get_mut(&conversation)
                        .filter(|r| r.oldest == oldest && r.cursor == cursor)
                    {
                        reading.take(page);
                    }
                    continue;
                }
                Ok(Err(SlackClientError::RateLimitError(limited))) => {
                    // Asked again once Slack's wait is over (a minute when it names none:
                    // Tier 1's one request a minute), from where the read stands.
                    let wait = limited.retry_after.unwrap_or(Duration::from_secs(60));
                    return Settlement::later_after(
                        asked,
                        format!("ratelimited, retry after {} s", wait.as_secs()),
                        wait,
                    );
                }
                Ok(Err(e)) => format!("the lookup failed: {e}"),
                Err(_) => format!("the lookup got no answer within {:?}", self.timeout),
            };
            self.readings
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&conversation);
            return Settlement::hold(asked, failed);
        }
        Settlement::later(
            asked,
            format!("{LOOKUP_PAGES} pages read; the rest at the next round"),
        )
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
        crate::platforms::adapter_options(claim)
    }
}

/// A page of `conversations.history` or `conversations.replies`, as much of it as a
/// lookup reads (another app's metadata of any shape does not stop it).
#[derive(Debug, Deserialize)]
struct History {
    #[serde(default)]
    messages: Vec<HistoryMessage>,
    has_more: Option<bool>,
    response_metadata: Option<Cursor>,
}

#[derive(Debug, Deserialize)]
struct HistoryMessage {
    ts: String,
    metadata: Option<serde_json::Value>,
}

impl HistoryMessage {
    /// The key of the part the message is a post of, if it is one.
    fn key(&self) -> Option<String> {
        let m = self.metadata.as_ref()?;
        if m["event_type"] != METADATA_EVENT_TYPE {
            return None;
        }
        m["event_payload"]["key"].as_str().map(str::to_owned)
    }
}

#[derive(Debug, Deserialize)]
struct Cursor {
    next_cursor: Option<String>,
}

/// The `chat.postMessage` request for a claim: its text, its key in the message
/// metadata, its thread from the delivery's metadata.
fn request(claim: &Claim) -> Result<SlackApiChatPostMessageRequest, String> {
    let options = SendOptions::from_claim(claim)?;
    let metadata = SlackMessageMetadata::new(METADATA_EVENT_TYPE.into()).with_event_payload(
        std::collections::HashMap::from([("key".to_owned(), claim.idempotency_key.clone())]),
    );
    let mut request = SlackApiChatPostMessageRequest::new(
        claim.chat_id.clone().into(),
        SlackMessageContent::new()
            .with_text(claim.text.clone())
            .with_metadata(metadata),
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

    fn settle<'a>(&'a self, part: &'a PossiblySent) -> SendFuture<'a, Settlement> {
        Box::pin(async move {
            if part.uncertain_for() < self.lookup_grace {
                return Settlement::later(
                    "the channel's history",
                    format!(
                        "not before the part has been uncertain for {:?}",
                        self.lookup_grace
                    ),
                );
            }
            self.look_up(part).await
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
