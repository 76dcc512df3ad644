//! An async bot on tokio: an AsyncDispatcher sends replies through a simulated Matrix
//! channel (which deduplicates by transaction id, so ambiguous sends are replayed) and
//! prints what it received.
//!
//! Run: `cargo run --example tokio_bot --features tokio`

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chunked_outbox::dispatch::SendFuture;
use chunked_outbox::rules::{Backoff, ChannelPolicy, RetryPolicy};
use chunked_outbox::{
    AsyncChannelAdapter, AsyncDispatcher, Claim, NewDelivery, Outbox, OutboxOptions, Outcome,
    Splitter,
};

struct SimulatedMatrix {
    sends: AtomicU32,
}

impl AsyncChannelAdapter for SimulatedMatrix {
    fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(5)).await; // network round trip
            let n = self.sends.fetch_add(1, Ordering::SeqCst);
            if n % 4 == 3 {
                println!(
                    "  ? room {} txn {}: timed out after sending, will replay",
                    claim.chat_id, claim.idempotency_key
                );
                return Outcome::Ambiguous {
                    error: "read timeout".into(),
                };
            }
            println!(
                "  ✓ room {} chunk {}/{} txn {}: {:?}",
                claim.chat_id,
                claim.index + 1,
                claim.total,
                claim.idempotency_key,
                claim.text.chars().take(40).collect::<String>()
            );
            Outcome::delivered(Some(format!("$event{n}")))
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Matrix deduplicates by transaction id, so a possibly-sent chunk may be replayed:
    // a rule stored in the file, like the fast retry schedule of this example.
    let options = OutboxOptions::default()
        .with_retry(
            RetryPolicy::default()
                .with_backoff(Backoff::Schedule(vec![Duration::from_millis(100)])),
        )
        .with_channel("matrix", ChannelPolicy::replayable());
    let outbox = Outbox::open_in_memory(options)?;
    let dispatcher = AsyncDispatcher::builder(outbox.clone())
        .adapter(
            "matrix",
            SimulatedMatrix {
                sends: AtomicU32::new(0),
            },
        )
        .build()?;
    let running = dispatcher.start()?;

    // Every Outbox call blocks on SQLite; in async code they go to the blocking pool.
    let splitter = Splitter::new(50, chunked_outbox::split::LengthUnit::Bytes)?;
    for room in ["!ops:example.org", "!dev:example.org"] {
        let text = format!("Deploy finished for {room}.\n\nAll checks passed; nothing to do.");
        outbox
            .enqueue_async(NewDelivery::split("matrix", room, &text, &splitter)?)
            .await?;
    }
    while outbox.health_async().await?.totals.delivered_deliveries < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = running.shutdown(Duration::from_secs(5)).await;
    println!("done: {:?}", report.stats);
    Ok(())
}
