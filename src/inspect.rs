//! Read-only inspection of deliveries and chunks.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::clock::to_datetime;
use crate::error::{Error, Result};
use crate::ids::DeliveryId;
use crate::outbox::Outbox;
pub use crate::views::{ChunkView, CorruptRow, DeliveryView, ListFilter, MAX_LIST_LIMIT};

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

    /// The row of the reply that, set aside, holds the chat (`channel`, `chat_id`) under
    /// `rules` (the stored ones), if any: what the lanes ask before they let the chat's
    /// next reply go ([`lane::held`](crate::lane::held)).
    #[cfg(feature = "console")]
    pub(crate) fn lane_holder(
        &self,
        rules: &crate::rules::Rules,
        channel: &str,
        chat_id: &str,
    ) -> Result<Option<i64>> {
        let hold = crate::rules::LaneHold::of(rules, channel);
        self.read(|tx| crate::lane::held(tx, hold, crate::store::LaneRef::new(channel, chat_id)))
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
