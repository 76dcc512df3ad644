//! The health snapshot. It reads maintained counters and unfinished work only, never
//! delivered history, so its cost does not grow as history accumulates.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::clock::to_datetime;
use crate::error::Result;
use crate::outbox::Outbox;
use crate::registry::Process;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::HealthRows;
pub use crate::views::Replica;

/// Counts for one channel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ChannelHealth {
    /// Deliveries stored (enqueued and not purged).
    pub total_deliveries: u64,
    /// Deliveries finalized and still stored.
    pub delivered_deliveries: u64,
    /// Deliveries queued or active with nothing delivered yet.
    pub pending_deliveries: u64,
    /// Deliveries with some chunks delivered.
    pub partial_deliveries: u64,
    /// Deliveries holding an `uncertain` chunk.
    pub uncertain_deliveries: u64,
    /// Dead letters, acknowledged or not.
    pub failed_deliveries: u64,
    /// Dead letters nobody acknowledged yet.
    pub unacknowledged_dead_letters: u64,
    /// Deliveries set aside because their row could not be read (counted among the
    /// dead letters too); `outbox list --status failed` shows them with the reason.
    pub corrupt_deliveries: u64,
    /// Deliveries cancelled before anything of them was sent, still stored (until
    /// purged).
    pub cancelled_deliveries: u64,
    /// Replies every chunk of which reached its chat, but which the application's
    /// finalization statement refused (`outbox list --status unfinalized` shows why);
    /// they are finalized again by `recover` once the application fixed its table.
    pub unfinalized_deliveries: u64,
    /// Chunks not yet sent (due, waiting for their turn, or queued in their lane). The
    /// unsent rest of a dead letter is not counted: nothing will send it unless it is
    /// requeued.
    pub pending_chunks: u64,
    /// Chunks claimed by a worker.
    pub sending_chunks: u64,
    /// Chunks waiting for a retry.
    pub retry_chunks: u64,
    /// Chunks failed for good.
    pub failed_chunks: u64,
    /// Chunks that may have been sent, waiting for a decision.
    pub uncertain_chunks: u64,
    /// `sending` chunks whose lease has expired (a worker died or hangs).
    pub expired_leases: u64,
    /// Chunks due now.
    pub due_chunks: u64,
    /// "Is anything still moving?" Chunks the outbox will send, or is sending, by
    /// itself: due now or later (a retry, a pause, a delay), or under a lease. 0 when
    /// everything left waits for a human or for new work — the answer to "is it
    /// drained?", which [`pending_chunks`](Self::pending_chunks) is not (the replies
    /// queued behind an `uncertain` one stay pending).
    pub moving_chunks: u64,
    /// "Is anything waiting for a human?" Uncertain chunks, dead letters nobody
    /// acknowledged, and unfinalized replies. 0 when nothing needs a decision.
    pub awaiting_decision: u64,
    /// Enqueue time of the oldest delivery still in flight.
    pub oldest_unfinished_at: Option<DateTime<Utc>>,
    /// How long the most overdue chunk has been due, in milliseconds.
    pub oldest_due_age_ms: Option<u64>,
    /// The latest finalization.
    pub last_delivered_at: Option<DateTime<Utc>>,
    /// Replies finalized since the file was created (or upgraded): only grows, so a
    /// purge does not lower it.
    pub finalized_total: u64,
    /// How long replies took from enqueue to finalization; only grows.
    pub reply_latency: LatencyHistogram,
}

/// The upper bounds, in seconds, of the reply-latency buckets (plus `+Inf`).
pub const LATENCY_BUCKETS: [u64; 6] = [1, 5, 30, 120, 600, 3600];

/// A histogram of reply latencies (enqueue to finalization), as Prometheus shows one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct LatencyHistogram {
    /// Replies observed.
    pub count: u64,
    /// Their latencies added up, in milliseconds.
    pub sum_ms: u64,
    /// Replies at most [`LATENCY_BUCKETS`]`[i]` seconds, cumulative.
    pub buckets: [u64; 6],
}

impl LatencyHistogram {
    fn add(&mut self, o: &LatencyHistogram) {
        self.count += o.count;
        self.sum_ms += o.sum_ms;
        for (mine, theirs) in self.buckets.iter_mut().zip(o.buckets) {
            *mine += theirs;
        }
    }
}

/// A point-in-time summary of the outbox for monitoring; `serde::Serialize`.
///
/// The top-level counts cover all channels; [`channels`](Self::channels) has the
/// same counts per channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Health {
    /// When the snapshot was taken.
    pub generated_at: DateTime<Utc>,
    /// Totals over all channels.
    #[serde(flatten)]
    pub totals: ChannelHealth,
    /// Per channel, by name.
    pub channels: BTreeMap<String, ChannelHealth>,
    /// Set when the snapshot was read from a PostgreSQL standby (a replica): its
    /// counts are the primary's as of the last transaction it replayed.
    pub replica: Option<Replica>,
    /// The processes writing the outbox now, each with its build, oldest build first
    /// (see [`Outbox::processes`]): during a rolling upgrade, which releases still run.
    pub processes: Vec<Process>,
}

impl Outbox {
    /// Takes a health snapshot in one read transaction.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let _ = outbox.enqueue(&NewDelivery::chunked("discord", "7", "a b", ["a", "b"]))?;
    /// let health = outbox.health()?;
    /// assert_eq!(health.totals.pending_chunks, 2);
    /// assert_eq!(health.channels["discord"].due_chunks, 1);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn health(&self) -> Result<Health> {
        let now = self.options().now_ms();
        let since = now - crate::registry::PROCESS_LEASE.as_millis() as i64;
        let (rows, processes) = self.read(|tx| Ok((tx.health_rows(now)?, tx.processes(since)?)))?;
        let mut health = snapshot(rows, now);
        health.processes = processes.into_iter().map(Process::from).collect();
        Ok(health)
    }
}

/// One Prometheus metric family: name, help, and how to read it from a channel.
type Family = (
    &'static str,
    &'static str,
    fn(&ChannelHealth, i64) -> Option<f64>,
);

const FAMILIES: &[Family] = &[
    (
        "outbox_deliveries",
        "Deliveries stored (enqueued and not purged).",
        |h, _| Some(h.total_deliveries as f64),
    ),
    (
        "outbox_delivered_deliveries",
        "Deliveries finalized into outbound_messages and still stored.",
        |h, _| Some(h.delivered_deliveries as f64),
    ),
    (
        "outbox_pending_deliveries",
        "Deliveries queued or active with nothing delivered yet.",
        |h, _| Some(h.pending_deliveries as f64),
    ),
    (
        "outbox_partial_deliveries",
        "Deliveries with some chunks delivered.",
        |h, _| Some(h.partial_deliveries as f64),
    ),
    (
        "outbox_uncertain_deliveries",
        "Deliveries holding a chunk that may have been sent.",
        |h, _| Some(h.uncertain_deliveries as f64),
    ),
    (
        "outbox_unfinalized_deliveries",
        "Replies delivered in full whose finalization the application's statement refused.",
        |h, _| Some(h.unfinalized_deliveries as f64),
    ),
    (
        "outbox_failed_deliveries",
        "Dead letters, acknowledged or not.",
        |h, _| Some(h.failed_deliveries as f64),
    ),
    (
        "outbox_unacknowledged_dead_letters",
        "Dead letters nobody acknowledged yet.",
        |h, _| Some(h.unacknowledged_dead_letters as f64),
    ),
    (
        "outbox_corrupt_deliveries",
        "Deliveries set aside because their row could not be read.",
        |h, _| Some(h.corrupt_deliveries as f64),
    ),
    (
        "outbox_cancelled_deliveries",
        "Deliveries cancelled before anything of them was sent, still stored.",
        |h, _| Some(h.cancelled_deliveries as f64),
    ),
    ("outbox_pending_chunks", "Chunks not sent yet.", |h, _| {
        Some(h.pending_chunks as f64)
    }),
    (
        "outbox_sending_chunks",
        "Chunks claimed by a worker.",
        |h, _| Some(h.sending_chunks as f64),
    ),
    (
        "outbox_retry_chunks",
        "Chunks waiting for a retry.",
        |h, _| Some(h.retry_chunks as f64),
    ),
    ("outbox_failed_chunks", "Chunks failed for good.", |h, _| {
        Some(h.failed_chunks as f64)
    }),
    (
        "outbox_uncertain_chunks",
        "Chunks that may have been sent, waiting for a decision.",
        |h, _| Some(h.uncertain_chunks as f64),
    ),
    (
        "outbox_expired_leases",
        "Chunks in sending whose lease expired.",
        |h, _| Some(h.expired_leases as f64),
    ),
    ("outbox_due_chunks", "Chunks due now.", |h, _| {
        Some(h.due_chunks as f64)
    }),
    (
        "outbox_moving_chunks",
        "Chunks the outbox will send or is sending by itself (0: drained or waiting for a human).",
        |h, _| Some(h.moving_chunks as f64),
    ),
    (
        "outbox_awaiting_decision",
        "Uncertain chunks and unacknowledged dead letters: what waits for a human.",
        |h, _| Some(h.awaiting_decision as f64),
    ),
    (
        "outbox_oldest_due_age_seconds",
        "How long the most overdue chunk has been due.",
        |h, _| h.oldest_due_age_ms.map(|ms| ms as f64 / 1000.0),
    ),
    (
        "outbox_oldest_unfinished_age_seconds",
        "Age of the oldest delivery still in flight.",
        |h, now| {
            h.oldest_unfinished_at
                .map(|t| (now - t.timestamp_millis()).max(0) as f64 / 1000.0)
        },
    ),
    (
        "outbox_last_delivered_timestamp_seconds",
        "Unix time of the latest finalization.",
        |h, _| {
            h.last_delivered_at
                .map(|t| t.timestamp_millis() as f64 / 1000.0)
        },
    ),
];

impl Health {
    /// The releases of the processes writing the outbox, oldest build first, each with
    /// how many of its processes run.
    pub fn builds(&self) -> Vec<(&str, usize)> {
        let mut builds: Vec<(&str, usize)> = Vec::new();
        for process in &self.processes {
            match builds.last_mut() {
                Some((release, count)) if *release == process.release => *count += 1,
                _ => builds.push((&process.release, 1)),
            }
        }
        builds
    }

    /// The snapshot in the Prometheus text exposition format, a `channel` label per
    /// channel: one gauge family per count, and what the file keeps that only grows —
    /// `outbox_file_finalized_total` (counter) and `outbox_file_reply_latency_seconds`
    /// (histogram, buckets [`LATENCY_BUCKETS`]). The `file_` prefix keeps them apart
    /// from the per-process counters of the `metrics` feature.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// outbox.enqueue(&NewDelivery::single("slack", "C1", "hi"))?;
    /// let text = outbox.health()?.to_prometheus();
    /// assert!(text.contains("# TYPE outbox_pending_chunks gauge"));
    /// assert!(text.contains("outbox_pending_chunks{channel=\"slack\"} 1"));
    /// assert!(text.contains("# TYPE outbox_file_reply_latency_seconds histogram"));
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub fn to_prometheus(&self) -> String {
        let now = self.generated_at.timestamp_millis();
        let mut out = String::new();
        for (name, help, value) in FAMILIES {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
            for (channel, h) in &self.channels {
                if let Some(v) = value(h, now) {
                    out.push_str(&format!(
                        "{name}{{channel=\"{}\"}} {v}\n",
                        escape_label(channel)
                    ));
                }
            }
        }
        if !self.processes.is_empty() {
            let name = "outbox_processes";
            out.push_str(&format!(
                "# HELP {name} Processes writing the outbox, by the release of their build.\n# TYPE {name} gauge\n"
            ));
            for (release, count) in self.builds() {
                out.push_str(&format!(
                    "{name}{{release=\"{}\"}} {count}\n",
                    escape_label(release)
                ));
            }
        }
        if self.replica.is_some() {
            let name = "outbox_read_from_replica";
            out.push_str(&format!(
                "# HELP {name} Present (1) when this snapshot was read from a PostgreSQL standby.\n# TYPE {name} gauge\n{name} 1\n"
            ));
        }
        if let Some(lag) = self.replica.as_ref().and_then(|r| r.replay_lag_ms) {
            let name = "outbox_replica_replay_lag_seconds";
            out.push_str(&format!(
                "# HELP {name} Since the last transaction the standby replayed committed on the primary.\n# TYPE {name} gauge\n{name} {}\n",
                lag as f64 / 1000.0
            ));
        }
        let name = "outbox_file_finalized_total";
        out.push_str(&format!(
            "# HELP {name} Replies finalized in this file, whichever process sent them (not lowered by purge).\n# TYPE {name} counter\n"
        ));
        for (channel, h) in &self.channels {
            let channel = escape_label(channel);
            out.push_str(&format!(
                "{name}{{channel=\"{channel}\"}} {}\n",
                h.finalized_total
            ));
        }
        let name = "outbox_file_reply_latency_seconds";
        out.push_str(&format!(
            "# HELP {name} Enqueue to finalization of the replies finalized in this file.\n# TYPE {name} histogram\n"
        ));
        for (channel, h) in &self.channels {
            let channel = escape_label(channel);
            let l = &h.reply_latency;
            for (le, n) in LATENCY_BUCKETS.iter().zip(l.buckets) {
                out.push_str(&format!(
                    "{name}_bucket{{channel=\"{channel}\",le=\"{le}\"}} {n}\n"
                ));
            }
            out.push_str(&format!(
                "{name}_bucket{{channel=\"{channel}\",le=\"+Inf\"}} {}\n",
                l.count
            ));
            out.push_str(&format!(
                "{name}_sum{{channel=\"{channel}\"}} {}\n{name}_count{{channel=\"{channel}\"}} {}\n",
                l.sum_ms as f64 / 1000.0,
                l.count
            ));
        }
        out
    }
}

/// Escapes a label value as the exposition format requires.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The snapshot from the rows a store counted: its per-channel counters of finalized
/// replies, and its unfinished deliveries and their chunks grouped by channel and status.
fn snapshot(rows: HealthRows, now: i64) -> Health {
    let mut channels: BTreeMap<String, ChannelHealth> = BTreeMap::new();
    for s in rows.stats {
        let h = channels.entry(s.channel).or_default();
        h.delivered_deliveries = s.delivered;
        h.total_deliveries += s.delivered;
        h.last_delivered_at = s.last_delivered_at.map(to_datetime);
        h.finalized_total = s.finalized_total;
        h.reply_latency.count = s.latency_count;
        h.reply_latency.sum_ms = s.latency_sum_ms;
        h.reply_latency.buckets = s.latency_le;
    }
    for d in rows.deliveries {
        let h = channels.entry(d.channel).or_default();
        let n = d.count;
        h.total_deliveries += n;
        match d.status {
            DeliveryStatus::Queued | DeliveryStatus::Pending => h.pending_deliveries += n,
            DeliveryStatus::Partial => h.partial_deliveries += n,
            DeliveryStatus::Uncertain => h.uncertain_deliveries += n,
            DeliveryStatus::Failed => {
                h.failed_deliveries += n;
                h.corrupt_deliveries += d.corrupt;
                if d.unacknowledged {
                    h.unacknowledged_dead_letters += n;
                }
            }
            DeliveryStatus::Cancelled => h.cancelled_deliveries += n,
            DeliveryStatus::Unfinalized => h.unfinalized_deliveries += n,
            // Counted from the maintained per-channel counters above (the store does
            // not read delivered rows).
            DeliveryStatus::Delivered => {}
        }
        if d.status.is_in_flight() {
            let oldest = to_datetime(d.oldest_created_at);
            h.oldest_unfinished_at = Some(h.oldest_unfinished_at.map_or(oldest, |o| o.min(oldest)));
        }
    }
    for c in rows.chunks {
        let h = channels.entry(c.channel).or_default();
        let n = c.count;
        if matches!(
            c.status,
            ChunkStatus::Pending | ChunkStatus::Retry | ChunkStatus::Sending
        ) {
            h.moving_chunks += c.scheduled;
        }
        match c.status {
            ChunkStatus::Pending => h.pending_chunks += n,
            ChunkStatus::Sending => {
                h.sending_chunks += n;
                h.expired_leases += c.due_now;
            }
            ChunkStatus::Retry => h.retry_chunks += n,
            ChunkStatus::Failed => h.failed_chunks += n,
            ChunkStatus::Uncertain => h.uncertain_chunks += n,
            // Left out by the store: delivered chunks are history.
            ChunkStatus::Delivered => {}
        }
        if c.status != ChunkStatus::Sending {
            h.due_chunks += c.due_now;
            if let Some(due) = c.oldest_due.filter(|due| *due <= now) {
                let age = (now - due) as u64;
                h.oldest_due_age_ms = Some(h.oldest_due_age_ms.map_or(age, |a| a.max(age)));
            }
        }
    }

    for h in channels.values_mut() {
        h.awaiting_decision =
            h.uncertain_chunks + h.unacknowledged_dead_letters + h.unfinalized_deliveries;
    }
    let mut totals = ChannelHealth::default();
    for h in channels.values() {
        totals.add(h);
    }
    Health {
        generated_at: to_datetime(now),
        totals,
        channels,
        replica: rows.replica,
        processes: Vec::new(),
    }
}

impl ChannelHealth {
    fn add(&mut self, o: &ChannelHealth) {
        self.total_deliveries += o.total_deliveries;
        self.delivered_deliveries += o.delivered_deliveries;
        self.pending_deliveries += o.pending_deliveries;
        self.partial_deliveries += o.partial_deliveries;
        self.uncertain_deliveries += o.uncertain_deliveries;
        self.unfinalized_deliveries += o.unfinalized_deliveries;
        self.failed_deliveries += o.failed_deliveries;
        self.unacknowledged_dead_letters += o.unacknowledged_dead_letters;
        self.corrupt_deliveries += o.corrupt_deliveries;
        self.cancelled_deliveries += o.cancelled_deliveries;
        self.pending_chunks += o.pending_chunks;
        self.sending_chunks += o.sending_chunks;
        self.retry_chunks += o.retry_chunks;
        self.failed_chunks += o.failed_chunks;
        self.uncertain_chunks += o.uncertain_chunks;
        self.expired_leases += o.expired_leases;
        self.due_chunks += o.due_chunks;
        self.moving_chunks += o.moving_chunks;
        self.awaiting_decision += o.awaiting_decision;
        self.oldest_unfinished_at = min_opt(self.oldest_unfinished_at, o.oldest_unfinished_at);
        self.oldest_due_age_ms = self.oldest_due_age_ms.max(o.oldest_due_age_ms);
        self.last_delivered_at = self.last_delivered_at.max(o.last_delivered_at);
        self.finalized_total += o.finalized_total;
        self.reply_latency.add(&o.reply_latency);
    }
}

fn min_opt<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
