//! A reply to store, [`NewDelivery`], and the limits it is held to: the value an
//! application hands the outbox, and a store keeps.

use crate::error::{Error, Result};

/// Longest accepted channel name, in bytes.
pub const MAX_CHANNEL_BYTES: usize = 128;
/// Longest accepted chat id, in bytes.
pub const MAX_CHAT_ID_BYTES: usize = 512;
/// Longest accepted caller idempotency key or sender name, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;
/// Most chunks one delivery may have.
pub const MAX_CHUNKS: usize = 10_000;
/// Largest accepted delivery: the full text plus all chunk texts, in bytes.
pub const MAX_DELIVERY_BYTES: usize = 16 * 1024 * 1024;
/// Largest per-reply metadata, in bytes (see [`NewDelivery::with_metadata`]).
pub const MAX_METADATA_BYTES: usize = 16 * 1024;
/// Most deliveries one [`Outbox::enqueue_batch`](crate::Outbox::enqueue_batch) may store
/// (one transaction holds the file's write lock while it runs).
pub const MAX_ENQUEUE_BATCH: usize = 10_000;

/// A delivery to enqueue: one logical message to one chat, already split into chunks.
///
/// ```
/// use chunked_outbox::NewDelivery;
///
/// let reply = NewDelivery::chunked("telegram", "42", "Hello\n\nWorld", ["Hello", "World"])
///     .with_idempotency_key("reply-to-update-9001")
///     .with_sender("assistant");
/// assert_eq!(reply.chunks().len(), 2);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewDelivery {
    pub(crate) channel: String,
    pub(crate) chat_id: String,
    pub(crate) text: String,
    pub(crate) chunks: Vec<String>,
    pub(crate) idempotency_key: Option<String>,
    pub(crate) sender: Option<String>,
    pub(crate) metadata: Option<String>,
    pub(crate) not_before: Option<i64>,
}

impl NewDelivery {
    /// A delivery sent as one chunk holding the whole text.
    pub fn single(
        channel: impl Into<String>,
        chat_id: impl Into<String>,
        text: impl Into<String>,
    ) -> Self {
        let text = text.into();
        NewDelivery::chunked(channel, chat_id, text.clone(), [text])
    }

    /// A delivery of `text` sent as the given chunks, in order. `text` is what is written
    /// to `outbound_messages` once every chunk is delivered.
    pub fn chunked<I, S>(
        channel: impl Into<String>,
        chat_id: impl Into<String>,
        text: impl Into<String>,
        chunks: I,
    ) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        NewDelivery {
            channel: channel.into(),
            chat_id: chat_id.into(),
            text: text.into(),
            chunks: chunks.into_iter().map(Into::into).collect(),
            idempotency_key: None,
            sender: None,
            metadata: None,
            not_before: None,
        }
    }

    /// A delivery of `text`, split into chunks by `splitter` (see
    /// [`Splitter`](crate::Splitter) for its presets).
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Splitter};
    ///
    /// let long = "word ".repeat(1000);
    /// let reply = NewDelivery::split("discord", "123", long, &Splitter::discord())?;
    /// assert_eq!(reply.chunks().len(), 3);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Splitter::split`](crate::Splitter::split).
    pub fn split(
        channel: impl Into<String>,
        chat_id: impl Into<String>,
        text: impl Into<String>,
        splitter: &crate::split::Splitter,
    ) -> Result<Self> {
        let text = text.into();
        let chunks = splitter.split(&text)?;
        Ok(NewDelivery::chunked(channel, chat_id, text, chunks))
    }

    /// A caller key: enqueueing the same key again on the same channel returns the
    /// first delivery's id and writes nothing (while that delivery is retained; see
    /// [`Outbox::purge`](crate::Outbox::purge)). Keys are scoped per channel, like the ids platforms hand out:
    /// Telegram update 9001 and Slack event 9001 are different replies. The same key
    /// with other content on the same channel is [`Error::IdempotencyConflict`].
    pub fn with_idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// The sender name written to `outbound_messages` at finalization.
    pub fn with_sender(mut self, sender: impl Into<String>) -> Self {
        self.sender = Some(sender.into());
        self
    }

    /// Per-reply data the send needs and the chat id does not carry — Telegram's
    /// `reply_to_message_id`, `parse_mode` or `message_thread_id`, Slack's `thread_ts`,
    /// Discord's `message_reference` — as text the outbox does not read (JSON, say), up
    /// to [`MAX_METADATA_BYTES`]. It is stored with the delivery, handed to the adapter
    /// in every claim of every chunk ([`Claim::metadata`](crate::Claim::metadata)),
    /// shown by `outbox show`, and bound as `:metadata` in the finalization statement.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let reply = NewDelivery::single("telegram", "42", "Sure!")
    ///     .with_metadata(r#"{"reply_to_message_id": 1234}"#);
    /// outbox.enqueue(&reply)?;
    /// let claim = outbox.claim(1)?.pop().unwrap();
    /// assert_eq!(claim.metadata.as_deref(), Some(r#"{"reply_to_message_id": 1234}"#));
    /// # outbox.ack(&claim, None)?;
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub fn with_metadata(mut self, metadata: impl Into<String>) -> Self {
        self.metadata = Some(metadata.into());
        self
    }

    /// A delayed reply: its first chunk is not sent before `at` (a time in the past
    /// means at once). In a FIFO chat the replies enqueued after it wait behind it, as
    /// they wait behind any reply that has not gone out yet.
    ///
    /// ```
    /// use chrono::{Duration, Utc};
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let reminder = NewDelivery::single("telegram", "42", "Your meeting starts now")
    ///     .not_before(Utc::now() + Duration::minutes(30));
    /// outbox.enqueue(&reminder)?;
    /// assert!(outbox.claim(1)?.is_empty(), "not yet");
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub fn not_before(mut self, at: chrono::DateTime<chrono::Utc>) -> Self {
        self.not_before = Some(at.timestamp_millis());
        self
    }

    /// The full text, as it is written to `outbound_messages` once every chunk is delivered.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The chunk texts.
    pub fn chunks(&self) -> &[String] {
        &self.chunks
    }

    pub(crate) fn validate(&self) -> Result<()> {
        fn bounded(what: &'static str, value: &str, max: usize) -> Result<()> {
            if value.trim().is_empty() {
                return Err(Error::invalid(what, "must not be empty or whitespace"));
            }
            if value.len() > max {
                return Err(Error::invalid(
                    what,
                    format!("{} bytes is longer than the limit of {max}", value.len()),
                ));
            }
            Ok(())
        }
        bounded("channel", &self.channel, MAX_CHANNEL_BYTES)?;
        if self.channel.chars().any(char::is_control) {
            return Err(Error::invalid(
                "channel",
                "must not contain control characters",
            ));
        }
        bounded("chat id", &self.chat_id, MAX_CHAT_ID_BYTES)?;
        if let Some(key) = &self.idempotency_key {
            bounded("idempotency key", key, MAX_KEY_BYTES)?;
        }
        if let Some(sender) = &self.sender {
            bounded("sender", sender, MAX_KEY_BYTES)?;
        }
        if let Some(metadata) = &self.metadata
            && metadata.len() > MAX_METADATA_BYTES
        {
            return Err(Error::invalid(
                "metadata",
                format!(
                    "{} bytes is longer than the limit of {MAX_METADATA_BYTES}; keep what the send needs, not the conversation",
                    metadata.len()
                ),
            ));
        }
        if self.text.trim().is_empty() {
            return Err(Error::invalid("text", "must not be empty or whitespace"));
        }
        if self.chunks.is_empty() {
            return Err(Error::invalid(
                "chunks",
                "a delivery needs at least one chunk",
            ));
        }
        if self.chunks.len() > MAX_CHUNKS {
            return Err(Error::invalid(
                "chunks",
                format!(
                    "{} chunks is more than the limit of {MAX_CHUNKS}",
                    self.chunks.len()
                ),
            ));
        }
        if let Some(i) = self.chunks.iter().position(|c| c.trim().is_empty()) {
            return Err(Error::invalid(
                "chunks",
                format!("chunk {i} is empty or whitespace; platforms reject empty messages"),
            ));
        }
        let size = self.text.len() + self.chunks.iter().map(String::len).sum::<usize>();
        if size > MAX_DELIVERY_BYTES {
            return Err(Error::invalid(
                "text",
                format!("{size} bytes is more than the limit of {MAX_DELIVERY_BYTES}"),
            ));
        }
        Ok(())
    }
}
