//! A blocking bot: a dispatcher with worker threads sends replies through a simulated
//! Telegram channel that sometimes fails, printing what the "platform" received.
//!
//! Run: `cargo run --example blocking_bot`

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chunked_outbox::rules::{Backoff, ChannelPolicy, RetryPolicy};
use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, Outbox, OutboxOptions, Outcome, Splitter};

/// Fails every third send with a transient error, like a flaky network.
struct SimulatedTelegram {
    sends: AtomicU32,
}

impl ChannelAdapter for SimulatedTelegram {
    fn send(&self, claim: &Claim) -> Outcome {
        let n = self.sends.fetch_add(1, Ordering::SeqCst);
        if n % 3 == 2 {
            println!(
                "  ✗ chat {} chunk {}/{}: 502, will retry",
                claim.chat_id,
                claim.index + 1,
                claim.total
            );
            return Outcome::Transient {
                error: "HTTP 502 Bad Gateway".into(),
            };
        }
        println!(
            "  ✓ chat {} chunk {}/{} (attempt {}, key {}): {:?}",
            claim.chat_id,
            claim.index + 1,
            claim.total,
            claim.attempt,
            claim.idempotency_key,
            claim.text.chars().take(40).collect::<String>()
        );
        Outcome::delivered(Some(format!("tg-{n}")))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Retries in milliseconds so the example finishes quickly (the default is 5 s, 25 s,
    // ...), and at most one send per chat every 50 ms: rules stored in the file.
    let options = OutboxOptions::default()
        .with_retry(
            RetryPolicy::default()
                .with_backoff(Backoff::Schedule(vec![Duration::from_millis(100)])),
        )
        .with_channel(
            "telegram",
            ChannelPolicy::default().with_lane_interval(Duration::from_millis(50)),
        );
    let outbox = Outbox::open_in_memory(options)?;
    let running = Dispatcher::builder(outbox.clone())
        .adapter(
            "telegram",
            SimulatedTelegram {
                sends: AtomicU32::new(0),
            },
        )
        .workers(2)
        .build()?
        .start()?;

    let long_reply = "This reply is long enough to be split. ".repeat(3);
    for chat in ["alice", "bob"] {
        for n in 1..=2 {
            let text = format!("Reply {n} to {chat}. {long_reply}");
            outbox.enqueue_text(
                "telegram",
                chat,
                &text,
                &Splitter::new(60, chunked_outbox::split::LengthUnit::Chars)?,
            )?;
        }
    }
    while outbox.health()?.totals.delivered_deliveries < 4 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let report = running.shutdown(Duration::from_secs(5));
    println!("done: {:?}", report.stats);
    Ok(())
}
