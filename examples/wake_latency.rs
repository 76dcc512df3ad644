//! How quickly an idle dispatcher notices new work: enqueue → send latency for an
//! enqueue in the same process (woken through the in-process notifier) and from another
//! process on the same file (noticed through `PRAGMA data_version` within the poll
//! interval). Release mode, file database in a temp dir, WAL, synchronous=NORMAL.
//!
//! Run: `cargo run --release --example wake_latency -- [samples] [poll_ms]`

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chunked_outbox::{
    ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox, OutboxOptions, Outcome,
};

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_micros()
}

/// Records, per send, how long ago its text says it was enqueued.
#[derive(Clone, Default)]
struct Stopwatch(Arc<Mutex<Vec<u128>>>);

impl ChannelAdapter for Stopwatch {
    fn send(&self, claim: &Claim) -> Outcome {
        let enqueued: u128 = claim.text.parse().expect("timestamp text");
        self.0
            .lock()
            .unwrap()
            .push(now_us().saturating_sub(enqueued));
        Outcome::delivered(None)
    }
}

fn enqueue_spaced(outbox: &Outbox, samples: usize) {
    for n in 0..samples {
        let _ = outbox
            .enqueue(&NewDelivery::single(
                "bench",
                format!("c{n}"),
                now_us().to_string(),
            ))
            .expect("enqueue");
        std::thread::sleep(Duration::from_millis(7)); // let the dispatcher go idle again
    }
}

fn summary(label: &str, latencies: &mut [u128]) {
    latencies.sort_unstable();
    let pick =
        |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    println!(
        "{label:<14} n={:<4} p50={:>7.2} ms  p99={:>7.2} ms  max={:>7.2} ms",
        latencies.len(),
        pick(0.5),
        pick(0.99),
        pick(1.0)
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        let outbox = Outbox::open(&args[2], OutboxOptions::default())?;
        enqueue_spaced(&outbox, args[3].parse()?);
        return Ok(());
    }
    let samples: usize = args.get(1).map_or(Ok(200), |s| s.parse())?;
    let poll_ms: u64 = args.get(2).map_or(Ok(50), |s| s.parse())?;
    let dir = tempfile_dir()?;
    let path = dir.join("latency.db");
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let stopwatch = Stopwatch::default();
    let running = Dispatcher::builder(outbox.clone())
        .adapter("bench", stopwatch.clone())
        .workers(1)
        .poll_interval(Duration::from_millis(poll_ms))
        .build()?
        .start()?;

    let wait_for = |n: usize| {
        while stopwatch.0.lock().unwrap().len() < n {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    enqueue_spaced(&outbox, samples);
    wait_for(samples);
    let mut same_process = std::mem::take(&mut *stopwatch.0.lock().unwrap());

    let status = std::process::Command::new(std::env::current_exe()?)
        .args(["--child", path.to_str().unwrap(), &samples.to_string()])
        .status()?;
    assert!(status.success());
    wait_for(samples);
    let mut other_process = std::mem::take(&mut *stopwatch.0.lock().unwrap());
    let _ = running.shutdown(Duration::from_secs(5));

    println!("enqueue → send latency, idle dispatcher, poll interval {poll_ms} ms:");
    summary("same process", &mut same_process);
    summary("other process", &mut other_process);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("chunked-outbox-latency-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
