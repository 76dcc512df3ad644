//! The core loop without a dispatcher: a simulated chat engine enqueues replies for
//! many chats, one worker claims due chunks in batches, "sends" them through a flaky
//! simulated platform, and records each outcome. At the end it checks, from what the
//! platform received, that nothing was lost, nothing arrived out of order and every
//! reply was finalized exactly once.
//!
//! Run: `cargo run --release --example worker_loop`

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chunked_outbox::rules::{Backoff, ChannelPolicy, RetryPolicy};
use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("chunked-outbox-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("outbox.db");
    println!("database: {}", path.display());

    // A fast schedule so the example finishes in a moment; the default is 5 s, 25 s, ...
    let options = OutboxOptions::default()
        .with_retry(
            RetryPolicy::default()
                .with_backoff(Backoff::Schedule(vec![
                    Duration::from_millis(5),
                    Duration::from_millis(20),
                ]))
                .with_max_attempts(8),
        )
        .with_channel("matrix", ChannelPolicy::replayable());
    let outbox = Outbox::open(&path, options)?;

    let mut rng = fastrand::Rng::with_seed(7);
    let channels = ["telegram", "matrix", "slack"];
    let mut expected: HashMap<(String, String), Vec<String>> = HashMap::new();
    let replies = 2_000;
    for n in 0..replies {
        let channel = channels[n % channels.len()];
        let chat = format!("chat-{}", rng.usize(0..60));
        let parts = rng.usize(1..=4);
        let chunks: Vec<String> = (0..parts)
            .map(|i| format!("reply {n} part {}/{parts}", i + 1))
            .collect();
        let text = chunks.join("\n");
        expected
            .entry((channel.into(), chat.clone()))
            .or_default()
            .extend(chunks.iter().cloned());
        let _ = outbox.enqueue(&NewDelivery::chunked(channel, chat, text, chunks))?;
    }

    // The platform: what each chat received, in arrival order.
    let mut received: HashMap<(String, String), Vec<String>> = HashMap::new();
    let (mut sends, mut failures, mut finalized) = (0, 0, 0);
    let started = Instant::now();
    loop {
        let claims = outbox.claim(64)?;
        if claims.is_empty() {
            let h = outbox.health()?;
            if h.totals.pending_chunks + h.totals.retry_chunks + h.totals.sending_chunks == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        for claim in claims {
            sends += 1;
            let outcome = if rng.u8(0..100) < 15 {
                failures += 1;
                Outcome::Transient {
                    error: "HTTP 502 Bad Gateway".into(),
                }
            } else {
                received
                    .entry((claim.channel.clone(), claim.chat_id.clone()))
                    .or_default()
                    .push(claim.text.clone());
                Outcome::delivered(Some(format!("msg-{sends}")))
            };
            if outbox.record(&claim, outcome)?.finalized {
                finalized += 1;
            }
        }
    }
    let elapsed = started.elapsed();

    let lost: usize = expected
        .iter()
        .map(|(lane, want)| {
            want.len()
                .saturating_sub(received.get(lane).map_or(0, Vec::len))
        })
        .sum();
    let out_of_order = expected
        .iter()
        .filter(|(lane, want)| received.get(*lane) != Some(want))
        .count();
    let stored: i64 = rusqlite::Connection::open(&path)?.query_row(
        "SELECT count(*) FROM outbound_messages",
        [],
        |r| r.get(0),
    )?;
    println!(
        "replies {replies}, sends {sends} ({failures} transient failures retried) in {elapsed:.2?}"
    );
    println!("finalized {finalized}, rows in outbound_messages {stored}");
    println!("lost chunks {lost}, lanes out of order {out_of_order}");
    std::fs::remove_dir_all(&dir)?;
    if lost != 0 || out_of_order != 0 || stored != replies as i64 || finalized != replies {
        return Err("an invariant was violated".into());
    }
    println!("ok: nothing lost, every chat in order, every reply finalized exactly once");
    Ok(())
}
