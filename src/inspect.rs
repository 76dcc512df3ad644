//! Read-only inspection of deliveries and chunks.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::clock::to_datetime;
use crate::error::{Error, Result};
use crate::ids::{ChunkId, ClaimantId, DeliveryId};
use crate::outbox::Outbox;
use crate::status::{ChunkStatus, DeliveryStatus};

/// Most rows one [`Outbox::list`] returns.
pub const MAX_LIST_LIMIT: usize = 10_000;

/// One delivery as stored, with its chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeliveryView {
    /// Public id.
    pub id: DeliveryId,
    /// Channel name.
    pub channel: String,
    /// Destination chat.
    pub chat_id: String,
    /// Sender name for `outbound_messages`.
    pub sender: Option<String>,
    /// The caller's idempotency key.
    pub idempotency_key: Option<String>,
    /// Per-reply metadata given at enqueue.
    pub metadata: Option<String>,
    /// For a delayed reply: when it may start.
    pub not_before: Option<DateTime<Utc>>,
    /// Current status.
    pub status: DeliveryStatus,
    /// Full text.
    pub text: String,
    /// Number of chunks.
    pub chunk_count: u32,
    /// Chunks delivered so far.
    pub delivered_count: u32,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// When it was finalized or failed.
    pub finished_at: Option<DateTime<Utc>>,
    /// When an operator acknowledged it as a dead letter.
    pub acknowledged_at: Option<DateTime<Utc>>,
    /// For an [`Unfinalized`](DeliveryStatus::Unfinalized) reply: what the application's
    /// finalization statement met.
    pub finalize_error: Option<String>,
    /// Its chunks in order (empty in [`Outbox::list`] results, and for a cancelled
    /// delivery, whose chunks are removed).
    pub chunks: Vec<ChunkView>,
}

/// One chunk as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ChunkView {
    /// Chunk id.
    pub id: ChunkId,
    /// 0-based position.
    pub index: u32,
    /// Current status.
    pub status: ChunkStatus,
    /// Attempts counted so far.
    pub attempts: u32,
    /// When it is due (`pending`/`retry` chunks that may be claimed).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When the current claim's lease ends (`sending` chunks).
    pub lease_until: Option<DateTime<Utc>>,
    /// Which outbox handle's claim is unsettled on this chunk: the one sending it, or —
    /// for an `uncertain` or `retry` chunk whose lease ran out — the one that was, and
    /// may still report its outcome (or died holding it). `None` otherwise.
    pub claimant: Option<ClaimantId>,
    /// Last error reported for it.
    pub last_error: Option<String>,
    /// The platform's id, once delivered.
    pub platform_message_id: Option<String>,
    /// When it was delivered.
    pub delivered_at: Option<DateTime<Utc>>,
    /// The key every send of it carries.
    pub idempotency_key: String,
    /// Its text.
    pub text: String,
    /// When a send of it was first claimed: the earliest it can have reached the
    /// platform. `None` before its first send (and for a chunk sent only before schema
    /// version 9 on SQLite, 6 on PostgreSQL).
    pub first_sent_at: Option<DateTime<Utc>>,
    /// What its platform was asked about it after a send that may have reached the
    /// platform, what it answered and what was decided (see
    /// [`ReplayPolicy::Ask`](crate::rules::ReplayPolicy::Ask)); `None` if nobody asked
    /// since it last became uncertain.
    pub settlement: Option<String>,
}

/// Which deliveries [`Outbox::list`] returns: all filters must match; newest first.
/// Built from the default with its methods:
/// `ListFilter::default().status(DeliveryStatus::Failed).limit(10)`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListFilter {
    /// Only this status.
    pub status: Option<DeliveryStatus>,
    /// Only this channel.
    pub channel: Option<String>,
    /// Only this chat.
    pub chat_id: Option<String>,
    /// Only the delivery enqueued with this caller idempotency key.
    pub idempotency_key: Option<String>,
    /// Only deliveries not delivered or cancelled: queued, active, uncertain, failed or
    /// unfinalized.
    pub unfinished: bool,
    /// At most this many (default 100, at most [`MAX_LIST_LIMIT`]).
    pub limit: usize,
}

impl Default for ListFilter {
    fn default() -> Self {
        ListFilter {
            status: None,
            channel: None,
            chat_id: None,
            idempotency_key: None,
            unfinished: false,
            limit: 100,
        }
    }
}

impl ListFilter {
    /// Only deliveries in this status.
    pub fn status(self, status: DeliveryStatus) -> Self {
        ListFilter {
            status: Some(status),
            ..self
        }
    }

    /// Only deliveries of this channel.
    pub fn channel(self, channel: impl Into<String>) -> Self {
        ListFilter {
            channel: Some(channel.into()),
            ..self
        }
    }

    /// Only deliveries to this chat.
    pub fn chat_id(self, chat_id: impl Into<String>) -> Self {
        ListFilter {
            chat_id: Some(chat_id.into()),
            ..self
        }
    }

    /// Only the delivery enqueued with this caller key.
    pub fn idempotency_key(self, key: impl Into<String>) -> Self {
        ListFilter {
            idempotency_key: Some(key.into()),
            ..self
        }
    }

    /// Only deliveries not delivered or cancelled.
    pub fn unfinished(self) -> Self {
        ListFilter {
            unfinished: true,
            ..self
        }
    }

    /// At most this many.
    pub fn limit(self, limit: usize) -> Self {
        ListFilter { limit, ..self }
    }
}

impl Outbox {
    /// One delivery with its chunks, or `None` if there is no such delivery.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn delivery(&self, id: DeliveryId) -> Result<Option<DeliveryView>> {
        let row = self.delivery_rowid(id);
        self.read(|tx| tx.delivery_view(row, &id.to_string()))
    }

    /// Deliveries matching `filter`, newest first, without their chunks.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a limit of 0 or above [`MAX_LIST_LIMIT`].
    pub fn list(&self, filter: &ListFilter) -> Result<Vec<DeliveryView>> {
        if filter.limit == 0 || filter.limit > MAX_LIST_LIMIT {
            return Err(Error::invalid(
                "limit",
                format!("{} is outside 1..={MAX_LIST_LIMIT}", filter.limit),
            ));
        }
        self.read(|tx| tx.list(filter))
    }

    /// Deliveries whose rows cannot be read, or that a claim set aside because of that:
    /// what `outbox health` counts as corrupt and `outbox list` reports apart. Empty on
    /// a healthy file.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn corrupt_rows(&self) -> Result<Vec<CorruptRow>> {
        self.read(|tx| tx.corrupt_rows())
    }
}

/// The most buckets one [`Outbox::activity`] asks for.
pub const MAX_ACTIVITY_BUCKETS: u32 = 1_440;

/// Replies that finished over a window of time, bucket by bucket, from the stored rows
/// (see [`Outbox::activity`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Activity {
    /// The start of the first bucket.
    pub since: DateTime<Utc>,
    /// Each bucket's width, ms.
    pub bucket_ms: u64,
    /// Every bucket from `since` to now, oldest first (empty ones included).
    pub buckets: Vec<ActivityBucket>,
}

/// One bucket of an [`Activity`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ActivityBucket {
    /// When it starts.
    pub start: DateTime<Utc>,
    /// Replies delivered (their last part acknowledged) in it.
    pub delivered: u64,
    /// Replies that failed for good (became dead letters) in it.
    pub failed: u64,
    /// The mean enqueue-to-delivery time of its delivered replies, ms (`None` when none).
    pub mean_latency_ms: Option<u64>,
    /// The longest enqueue-to-delivery time of its delivered replies, ms.
    pub max_latency_ms: Option<u64>,
}

impl Outbox {
    /// The replies delivered and failed for good over the last `window`, in `buckets`
    /// buckets of equal width ending now, with their enqueue-to-delivery times: the
    /// console's charts. Stored, so every host sees the same and a restart loses
    /// nothing.
    ///
    /// When a bucket is a whole number of minutes wide (the console's are: a minute for
    /// the last hour, half an hour for the last day), the buckets end with the current
    /// minute and sum the counts the outbox keeps per minute as replies finish (a dead
    /// letter requeued later stays counted where it failed): the cost is the buckets',
    /// however many replies finished. Otherwise they end now and are counted from the
    /// rows finished in the window, over the index of finished deliveries (a reply
    /// requeued since is not counted). Either way a [`purge`](Self::purge) takes what
    /// finished before its cutoff with it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// outbox.enqueue(&NewDelivery::single("telegram", "42", "hi"))?;
    /// let claim = outbox.claim(1)?.remove(0);
    /// outbox.ack(&claim, None)?;
    /// let hour = outbox.activity(Duration::from_secs(3600), 60)?;
    /// assert_eq!(hour.buckets.len(), 60);
    /// assert_eq!(hour.buckets.iter().map(|b| b.delivered).sum::<u64>(), 1);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for 0 or more than [`MAX_ACTIVITY_BUCKETS`] buckets, or a
    /// window shorter than a millisecond per bucket; database errors.
    pub fn activity(&self, window: std::time::Duration, buckets: u32) -> Result<Activity> {
        if buckets == 0 || buckets > MAX_ACTIVITY_BUCKETS {
            return Err(Error::invalid(
                "buckets",
                format!("{buckets} is outside 1..={MAX_ACTIVITY_BUCKETS}"),
            ));
        }
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let width = i64::try_from(window_ms.div_ceil(u64::from(buckets))).unwrap_or(i64::MAX);
        if width == 0 || width > i64::MAX / 2 / i64::from(buckets) {
            return Err(Error::invalid(
                "window",
                format!("{window:?} in {buckets} buckets is out of range"),
            ));
        }
        let now = self.options().now_ms();
        use crate::finalize::{MINUTE_MS, minute_of};
        let (since, rows) = if width % MINUTE_MS == 0 {
            // The last bucket ends with the current minute; each minute kept goes to
            // the bucket it starts in.
            let since = (minute_of(now) + 1) * MINUTE_MS - width * i64::from(buckets);
            let minutes = self.read(|tx| tx.activity_minutes(minute_of(since), minute_of(now)))?;
            let in_buckets = minutes.into_iter().map(|m| crate::store::ActivityRow {
                bucket: (m.bucket * MINUTE_MS - since) / width,
                ..m
            });
            (since, crate::store::ActivityRow::merged(in_buckets))
        } else {
            // The last bucket ends just after now.
            let since = now + 1 - width * i64::from(buckets);
            (since, self.read(|tx| tx.activity(since, width))?)
        };
        let mut out: Vec<ActivityBucket> = (0..i64::from(buckets))
            .map(|n| ActivityBucket {
                start: to_datetime(since + n * width),
                delivered: 0,
                failed: 0,
                mean_latency_ms: None,
                max_latency_ms: None,
            })
            .collect();
        for row in rows {
            // A row finished "in the future" by a clock ahead of this one is left out.
            let Some(bucket) = usize::try_from(row.bucket)
                .ok()
                .and_then(|b| out.get_mut(b))
            else {
                continue;
            };
            bucket.delivered = u64::try_from(row.delivered).unwrap_or(0);
            bucket.failed = u64::try_from(row.failed).unwrap_or(0);
            if row.delivered > 0 {
                bucket.mean_latency_ms = u64::try_from(row.latency_sum_ms / row.delivered).ok();
                bucket.max_latency_ms = u64::try_from(row.latency_max_ms).ok();
            }
        }
        Ok(Activity {
            since: to_datetime(since),
            bucket_ms: width as u64,
            buckets: out,
        })
    }
}

impl Outbox {
    /// The channels paused as a whole now — a rate limit of the platform's that stops
    /// every send on the channel, from every process — with when each pause ends.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn channel_pauses(&self) -> Result<std::collections::BTreeMap<String, DateTime<Utc>>> {
        let now = self.options().now_ms();
        self.read(|tx| {
            Ok(tx
                .channels(None)?
                .into_iter()
                .filter_map(|c| {
                    let until = c.paused_until.filter(|&until| until > now)?;
                    Some((c.name, to_datetime(until)))
                })
                .collect())
        })
    }
}

/// A delivery row that cannot be read (see [`Outbox::corrupt_rows`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CorruptRow {
    /// Its row number in `outbound_deliveries`.
    pub row: i64,
    /// Its uid as stored (lossily decoded).
    pub uid: String,
    /// What is wrong with it.
    pub reason: String,
}
