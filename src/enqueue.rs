//! Accepting deliveries: validation, idempotency, and the insert.

use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;

use crate::ids::{CHUNK_STRIDE, chunks_of_delivery};
use crate::lane::{self, LaneHead};
use crate::policy::{self, Stored};
use crate::tx::Tx;
use crate::{DeliveryId, DeliveryStatus, Error, LaneOrder, Outbox, Result};

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
/// Most deliveries one [`Outbox::enqueue_batch`] may store (one transaction holds the
/// file's write lock while it runs).
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
    channel: String,
    chat_id: String,
    text: String,
    chunks: Vec<String>,
    idempotency_key: Option<String>,
    sender: Option<String>,
    metadata: Option<String>,
    not_before: Option<i64>,
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
        splitter: &crate::Splitter,
    ) -> Result<Self> {
        let text = text.into();
        let chunks = splitter.split(&text)?;
        Ok(NewDelivery::chunked(channel, chat_id, text, chunks))
    }

    /// A caller key: enqueueing the same key again on the same channel returns the
    /// first delivery's id and writes nothing (while that delivery is retained; see
    /// [`Outbox::purge`]). Keys are scoped per channel, like the ids platforms hand out:
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

    fn validate(&self) -> Result<()> {
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

/// What [`Outbox::enqueue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Enqueued {
    /// The delivery's id.
    pub id: DeliveryId,
    /// False when the idempotency key named an existing delivery with the same content,
    /// so nothing was written.
    pub created: bool,
}

impl Outbox {
    /// Stores a delivery and its chunks in one transaction, before any network call.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let first = outbox.enqueue(&NewDelivery::single("slack", "C042", "deploy finished").with_idempotency_key("k1"))?;
    /// let again = outbox.enqueue(&NewDelivery::single("slack", "C042", "deploy finished").with_idempotency_key("k1"))?;
    /// assert_eq!(first.id, again.id);
    /// assert!(first.created && !again.created);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for an empty channel, chat id or text, no chunks, an
    /// empty or whitespace-only chunk, or anything over the `MAX_*` limits of this
    /// module; [`Error::IdempotencyConflict`] if the key names a delivery with different
    /// content. Nothing is written in either case.
    pub fn enqueue(&self, delivery: &NewDelivery) -> Result<Enqueued> {
        delivery.validate()?;
        let enqueued = self.write_and_wake(|tx, rules| insert(tx, self, rules, delivery))?;
        if enqueued.created {
            crate::telemetry::enqueued(&delivery.channel);
        }
        Ok(enqueued)
    }

    /// Stores several deliveries in one transaction: all of them, or none.
    ///
    /// One commit for the lot is what makes it faster than one [`enqueue`](Self::enqueue)
    /// each: an engine that answers several chats at once, or imports a backlog, pays
    /// the commit once. Each delivery is treated as `enqueue` treats it — lanes,
    /// idempotency keys (a key repeated within the batch names the first delivery), the
    /// stored rules — and the results come back in the order given.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let replies: Vec<NewDelivery> = (0..3)
    ///     .map(|chat| NewDelivery::single("telegram", chat.to_string(), "the build is green"))
    ///     .collect();
    /// let stored = outbox.enqueue_batch(&replies)?;
    /// assert_eq!(stored.len(), 3);
    /// assert_eq!(outbox.health()?.totals.due_chunks, 3);
    ///
    /// // One bad delivery refuses the whole batch; nothing of it is written.
    /// let bad = [NewDelivery::single("telegram", "9", "fine"), NewDelivery::single("telegram", "9", "")];
    /// assert!(outbox.enqueue_batch(&bad).is_err());
    /// assert_eq!(outbox.health()?.totals.total_deliveries, 3);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Self::enqueue), for the first delivery that fails, and
    /// [`Error::InvalidInput`] for more than [`MAX_ENQUEUE_BATCH`] deliveries. Nothing
    /// is written in either case.
    pub fn enqueue_batch<'a>(
        &self,
        deliveries: impl IntoIterator<Item = &'a NewDelivery>,
    ) -> Result<Vec<Enqueued>> {
        let deliveries: Vec<&NewDelivery> = deliveries.into_iter().collect();
        if deliveries.len() > MAX_ENQUEUE_BATCH {
            return Err(Error::invalid(
                "deliveries",
                format!(
                    "{} deliveries in one batch; at most {MAX_ENQUEUE_BATCH}: split it",
                    deliveries.len()
                ),
            ));
        }
        for d in &deliveries {
            d.validate()?;
        }
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        let stored = self.write_and_wake(|tx, rules| {
            deliveries
                .iter()
                .map(|d| insert(tx, self, rules, d))
                .collect::<Result<Vec<_>>>()
        })?;
        for (d, e) in deliveries.iter().zip(&stored) {
            if e.created {
                crate::telemetry::enqueued(&d.channel);
            }
        }
        Ok(stored)
    }

    /// Splits `text` with `splitter` and enqueues the chunks in one call.
    ///
    /// ```
    /// use chunked_outbox::{Outbox, OutboxOptions, Splitter};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let id = outbox.enqueue_text("telegram", "42", &"long reply ".repeat(800), &Splitter::telegram())?.id;
    /// assert_eq!(outbox.delivery(id)?.unwrap().chunk_count, 3);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Splitter::split`](crate::Splitter::split) and [`enqueue`](Self::enqueue).
    pub fn enqueue_text(
        &self,
        channel: &str,
        chat_id: &str,
        text: &str,
        splitter: &crate::Splitter,
    ) -> Result<Enqueued> {
        self.enqueue(&NewDelivery::split(channel, chat_id, text, splitter)?)
    }

    /// Enqueues inside a transaction the caller already holds on the same database file
    /// (the transactional-outbox pattern): the delivery exists exactly if the caller's
    /// transaction commits.
    ///
    /// `conn` must be a connection to the file this outbox was opened on (which applied
    /// the schema), inside an open transaction — typically a
    /// [`rusqlite::Transaction`], which dereferences to a connection. Start it with
    /// `BEGIN IMMEDIATE` to avoid lock upgrades failing under contention.
    ///
    /// **Call [`wake`](Self::wake) after your commit.** The reply exists only from
    /// your commit on, and this crate cannot see that commit on your connection (a
    /// commit hook would replace one the application may have set). Without the call a
    /// dispatcher of this process still finds the reply, at its next
    /// [poll](crate::DispatcherBuilder::poll_interval) (50 ms by default); a dispatcher
    /// of another process notices the commit the same way.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let path = dir.path().join("app.db");
    /// let outbox = Outbox::open(&path, OutboxOptions::default())?;
    /// let mut app = rusqlite::Connection::open(&path)?;
    /// app.execute_batch("CREATE TABLE IF NOT EXISTS replies_sent (n INTEGER)")?;
    ///
    /// let tx = app.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    /// tx.execute("INSERT INTO replies_sent VALUES (1)", [])?;
    /// outbox.enqueue_in(&tx, &NewDelivery::single("telegram", "42", "hi"))?;
    /// tx.commit()?; // the reply and the application's own row land together
    /// outbox.wake(); // this process's dispatchers look for it now
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Self::enqueue), and [`Error::InvalidInput`] if `conn` is not inside
    /// a transaction.
    pub fn enqueue_in(&self, conn: &Connection, delivery: &NewDelivery) -> Result<Enqueued> {
        delivery.validate()?;
        if conn.is_autocommit() {
            return Err(Error::invalid(
                "connection",
                "enqueue_in needs an open transaction on the caller's connection",
            ));
        }
        // A savepoint makes our writes all-or-nothing even if the caller goes on to
        // commit after we returned an error. Cached statements: `execute_batch` would
        // compile each of them on every call.
        let tx = Tx::new(conn);
        let run = |sql: &'static str| -> Result<()> {
            tx.prepare_cached(sql)?.execute([])?;
            Ok(())
        };
        run("SAVEPOINT chunked_outbox_enqueue")?;
        match self
            .rules_uncached(conn)
            .and_then(|rules| insert(&tx, self, &rules, delivery))
        {
            Ok(enqueued) => {
                run("RELEASE chunked_outbox_enqueue")?;
                // Not visible before the caller commits: waking dispatchers now would
                // have them look for it too early. The caller wakes them after its
                // commit (see above); otherwise a poll finds it.
                Ok(enqueued)
            }
            Err(e) => {
                run("ROLLBACK TO chunked_outbox_enqueue")?;
                run("RELEASE chunked_outbox_enqueue")?;
                Err(e)
            }
        }
    }
}

fn insert(tx: &Tx<'_>, outbox: &Outbox, rules: &Stored, d: &NewDelivery) -> Result<Enqueued> {
    if let Some(key) = &d.idempotency_key
        && let Some((rowid, existing)) = find_by_key(tx, &d.channel, key)?
    {
        return if same_content(tx, rowid, d)? {
            Ok(Enqueued {
                id: existing,
                created: false,
            })
        } else {
            Err(Error::IdempotencyConflict {
                key: key.clone(),
                existing,
            })
        };
    }

    let now = outbox.options().now_ms();
    let channel_id = policy::channel_id(tx, rules, &d.channel)?;
    // The next row id, chosen here (under the write lock) so the uid can be derived
    // from it: the uid needs no index of its own.
    let rowid: i64 = tx
        .prepare_cached("SELECT coalesce(max(id), 0) + 1 FROM outbound_deliveries")?
        .query_row([], |r| r.get(0))?;
    let first_chunk = rowid.checked_mul(CHUNK_STRIDE).ok_or(Error::invalid(
        "delivery",
        "the database has used up its row ids; purge it or start a new file",
    ))?;
    let id = outbox.new_delivery_id(rowid, now);
    let active = match rules.policy.lane_order {
        LaneOrder::Parallel => true,
        LaneOrder::Fifo => match lane::head(tx, &rules.policy, &d.channel, &d.chat_id)? {
            LaneHead::Idle => true,
            LaneHead::Busy => false,
            // A queued delivery with nothing in front of it: start that one first.
            LaneHead::Next(waiting) => {
                lane::activate(tx, &waiting, &d.channel, &d.chat_id, now)?;
                false
            }
        },
    };
    tx.prepare_cached(
        "INSERT INTO outbound_deliveries
             (id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
              created_at, updated_at, text, metadata, not_before)
         VALUES (?10, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8, ?9, ?11, ?12)",
    )?
    .execute(params![
        id.to_string(),
        d.channel,
        d.chat_id,
        d.sender,
        d.idempotency_key,
        if active { "pending" } else { "queued" },
        d.chunks.len() as i64,
        now,
        d.text,
        rowid,
        d.metadata,
        d.not_before,
    ])?;
    // The head chunk of an active delivery is inserted already due, so it enters the
    // claim index once instead of being inserted and then updated.
    let head_due = if active {
        let earliest = now.max(d.not_before.unwrap_or(i64::MIN));
        Some(lane::due_time(tx, &d.channel, &d.chat_id, earliest)?)
    } else {
        None
    };
    if !active && stored_at_activation(d) {
        return Ok(Enqueued { id, created: true });
    }
    let mut chunk = tx.prepare_cached(
        "INSERT INTO outbound_delivery_chunks
             (id, delivery_id, chunk_index, status, due_at, text, channel_id)
         VALUES (?1, ?2, ?3, 'pending', ?4, ?5, ?6)",
    )?;
    for (index, text) in d.chunks.iter().enumerate() {
        // A chunk that is the whole text points at the delivery's copy (NULL).
        let text = (*text != d.text).then_some(text);
        let index = index as i64;
        let due = if index == 0 { head_due } else { None };
        chunk.execute(params![
            first_chunk + index,
            rowid,
            index,
            due,
            text,
            channel_id
        ])?;
    }
    Ok(Enqueued { id, created: true })
}

/// Whether a queued delivery's chunk row waits for its activation: a reply sent as one
/// chunk holding its whole text has nothing to store in that row but its state, which
/// is `pending` with nothing due until the lane reaches it. [`lane::activate`] inserts
/// the row then, so a reply enqueued behind another writes two b-tree pages instead of
/// three — most of an enqueue's cost is its commit's page writes.
fn stored_at_activation(d: &NewDelivery) -> bool {
    matches!(d.chunks.as_slice(), [only] if *only == d.text)
}

/// The delivery with caller key `?2` on channel `?1`.
pub(crate) const KEY_LOOKUP_SQL: &str =
    "SELECT id, uid FROM outbound_deliveries WHERE channel = ?1 AND idempotency_key = ?2";

fn find_by_key(tx: &Tx<'_>, channel: &str, key: &str) -> Result<Option<(i64, DeliveryId)>> {
    let row = tx
        .prepare_cached(KEY_LOOKUP_SQL)?
        .query_row([channel, key], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
        })
        .optional()?;
    row.map(|(rowid, uid)| Ok((rowid, uid.parse()?)))
        .transpose()
}

fn same_content(tx: &Tx<'_>, rowid: i64, d: &NewDelivery) -> Result<bool> {
    type Row = (
        String,
        String,
        Option<String>,
        String,
        Option<String>,
        DeliveryStatus,
    );
    let (channel, chat_id, sender, text, metadata, status): Row = tx
        .prepare_cached(
            "SELECT channel, chat_id, sender, text, metadata, status
             FROM outbound_deliveries WHERE id = ?1",
        )?
        .query_row([rowid], |r| r.try_into())?;
    if channel != d.channel
        || chat_id != d.chat_id
        || sender != d.sender
        || text != d.text
        || metadata != d.metadata
    {
        return Ok(false);
    }
    if status == DeliveryStatus::Cancelled {
        // Its chunks were removed; the key names it, whatever chunks it was given.
        return Ok(true);
    }
    let mut stmt = tx.prepare_cached(concat!(
        "SELECT c.text FROM outbound_delivery_chunks c WHERE ",
        chunks_of_delivery!("c", "?1"),
        " ORDER BY c.id"
    ))?;
    let mut chunks = stmt
        .query_map([rowid], |r| r.get::<_, Option<String>>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    if chunks.is_empty() && status == DeliveryStatus::Queued {
        // One chunk of the whole text, its row not stored yet (`stored_at_activation`).
        chunks.push(None);
    }
    Ok(chunks.len() == d.chunks.len()
        && chunks
            .iter()
            .zip(&d.chunks)
            .all(|(stored, new)| stored.as_ref().unwrap_or(&text) == new))
}
