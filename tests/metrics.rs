//! The dispatcher's counters and histograms reach the application's own exporter
//! through the `metrics` facade: here a Prometheus recorder, rendered as a scraper
//! would read it.

mod common;

use std::time::Duration;

use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, NewDelivery, Outcome, Result};
use common::*;
use metrics_exporter_prometheus::PrometheusBuilder;

/// Delivers everything except to chat "gone", which no longer exists.
struct Platform;

impl ChannelAdapter for Platform {
    fn send(&self, claim: &Claim) -> Outcome {
        if claim.chat_id == "gone" {
            Outcome::Permanent {
                error: "chat not found".into(),
            }
        } else {
            Outcome::delivered(Some(format!("m-{}", claim.index)))
        }
    }
}

#[test]
fn counters_and_histograms_land_in_the_applications_exporter() -> Result<()> {
    let recorder = PrometheusBuilder::new()
        .set_buckets(&[0.1, 1.0, 10.0, 60.0])
        .unwrap()
        .install_recorder()
        .expect("the only recorder of this test binary");

    let db = TestDb::default();
    let ob = &db.outbox;
    for (chat, chunks) in [("1", 2), ("2", 1), ("gone", 1)] {
        let parts: Vec<String> = (0..chunks).map(|i| format!("part {i}")).collect();
        ob.enqueue(&NewDelivery::chunked(
            "telegram",
            chat,
            parts.join(" "),
            parts,
        ))?;
    }
    // The same caller key again stores nothing, so it is not counted.
    let key = NewDelivery::single("telegram", "3", "once").with_idempotency_key("k");
    ob.enqueue(&key)?;
    ob.enqueue(&key)?;
    let running = Dispatcher::builder(ob.clone())
        .adapter("telegram", Platform)
        .build()?
        .start()?;
    wait_until("every reply settled", || {
        ob.health().is_ok_and(|h| h.totals.moving_chunks == 0)
    });
    let report = running.shutdown(Duration::from_secs(10));
    assert!(report.clean, "{report:?}");

    let text = recorder.render();
    for line in [
        "outbox_enqueued_total{channel=\"telegram\"} 4",
        "outbox_sends_total{channel=\"telegram\"} 5",
        "outbox_outcomes_total{channel=\"telegram\",outcome=\"delivered\"} 4",
        "outbox_outcomes_total{channel=\"telegram\",outcome=\"permanent\"} 1",
        "outbox_finalized_total{channel=\"telegram\"} 3",
        "outbox_dead_letters_total{channel=\"telegram\"} 1",
        "outbox_reply_latency_seconds_count{channel=\"telegram\"} 3",
        "outbox_send_duration_seconds_count{channel=\"telegram\"} 5",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    assert!(
        text.contains("outbox_reply_latency_seconds_bucket{channel=\"telegram\",le=\"1\"}"),
        "{text}"
    );
    Ok(())
}
