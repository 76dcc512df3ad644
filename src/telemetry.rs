//! Counters and histograms through the `metrics` facade (feature `metrics`); their names
//! are listed in [`monitoring`](crate::monitoring#metrics).

#[cfg(feature = "metrics")]
mod on {
    use metrics::{counter, histogram};

    pub(crate) fn enqueued(channel: &str) {
        counter!("outbox_enqueued_total", "channel" => channel.to_owned()).increment(1);
    }

    pub(crate) fn send_started(channel: &str) {
        counter!("outbox_sends_total", "channel" => channel.to_owned()).increment(1);
    }

    pub(crate) fn outcome(channel: &str, kind: &'static str) {
        counter!("outbox_outcomes_total", "channel" => channel.to_owned(), "outcome" => kind)
            .increment(1);
    }

    pub(crate) fn chunk_state(name: &'static str, channel: &str) {
        counter!(name, "channel" => channel.to_owned()).increment(1);
    }

    pub(crate) fn events(name: &'static str, n: u64) {
        counter!(name).increment(n);
    }

    pub(crate) fn settled(channel: &str, decision: &'static str) {
        counter!("outbox_settlements_total", "channel" => channel.to_owned(), "decision" => decision)
            .increment(1);
    }

    /// The send's duration (a claim's lease ends `options.lease` after its claim) —
    /// claims are made right before their send, so claim to record is the send — and, for a finalized reply, its enqueue-to-finalization
    /// latency. Computed only here, so a build without the feature reads no clock.
    pub(crate) fn timings(
        options: &crate::options::OutboxOptions,
        channel: &str,
        lease_until: chrono::DateTime<chrono::Utc>,
        delivery: &crate::ids::DeliveryId,
        finalized: bool,
    ) {
        let now = options.now_ms();
        let claimed_at = lease_until.timestamp_millis() - crate::clock::duration_ms(options.lease);
        seconds("outbox_send_duration_seconds", channel, now - claimed_at);
        if finalized {
            let latency = now - delivery.created_ms();
            seconds("outbox_reply_latency_seconds", channel, latency);
        }
    }

    fn seconds(name: &'static str, channel: &str, ms: i64) {
        histogram!(name, "channel" => channel.to_owned()).record(ms.max(0) as f64 / 1000.0);
    }
}

#[cfg(not(feature = "metrics"))]
mod on {
    pub(crate) fn enqueued(_: &str) {}
    pub(crate) fn send_started(_: &str) {}
    pub(crate) fn outcome(_: &str, _: &'static str) {}
    pub(crate) fn chunk_state(_: &'static str, _: &str) {}
    pub(crate) fn events(_: &'static str, _: u64) {}
    pub(crate) fn settled(_: &str, _: &'static str) {}
    pub(crate) fn timings(
        _: &crate::options::OutboxOptions,
        _: &str,
        _: chrono::DateTime<chrono::Utc>,
        _: &crate::ids::DeliveryId,
        _: bool,
    ) {
    }
}

pub(crate) use on::*;
