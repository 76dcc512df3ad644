//! How quickly an idle dispatcher notices new work: enqueue → send latency for an
//! enqueue in the same process (woken through the in-process notifier) and from another
//! process: on an SQLite file noticed through `PRAGMA data_version` within the poll
//! interval; on PostgreSQL woken by the notification sent with the enqueue's commit
//! (`LISTEN`/`NOTIFY`), and, for comparison, with notifications off (found at a poll).
//! Release mode; the file in a temp dir (WAL, synchronous=NORMAL); PostgreSQL in a
//! fresh schema of `--db URL` (or `DATABASE_URL`), dropped afterwards.
//!
//! Run: `cargo run --release --example wake_latency -- [samples] [poll_ms]`, and with
//! `--features postgres`, under `scripts/with-postgres` for the PostgreSQL rows.

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
        "{label:<40} n={:<4} p50={:>7.2} ms  p99={:>7.2} ms  max={:>7.2} ms",
        latencies.len(),
        pick(0.5),
        pick(0.99),
        pick(1.0)
    );
}

/// Where the outbox lives: a file, or a PostgreSQL URL (with its schema).
fn open(target: &str, listen: bool) -> Result<Outbox, chunked_outbox::Error> {
    let options = OutboxOptions::default().with_listen(listen);
    if target.starts_with("postgres") {
        #[cfg(feature = "postgres")]
        return Outbox::connect(target, options);
    }
    Outbox::open(target, options)
}

/// One row of figures per way of noticing work: the dispatcher runs here, the
/// enqueues come from here and then from a child process.
fn measure(
    target: &str,
    listen: bool,
    samples: usize,
    poll_ms: u64,
) -> Result<[Vec<u128>; 2], Box<dyn std::error::Error>> {
    let outbox = open(target, listen)?;
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
    // The listener (PostgreSQL) connects in the background: let it.
    std::thread::sleep(Duration::from_millis(200));
    enqueue_spaced(&outbox, samples);
    wait_for(samples);
    let same_process = std::mem::take(&mut *stopwatch.0.lock().unwrap());
    let status = std::process::Command::new(std::env::current_exe()?)
        .args(["--child", target, &samples.to_string()])
        .status()?;
    assert!(status.success());
    wait_for(samples);
    let other_process = std::mem::take(&mut *stopwatch.0.lock().unwrap());
    let _ = running.shutdown(Duration::from_secs(5));
    Ok([same_process, other_process])
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        let outbox = open(&args[2], true)?;
        enqueue_spaced(&outbox, args[3].parse()?);
        return Ok(());
    }
    let mut url = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty());
    if let Some(at) = args.iter().position(|a| a == "--db") {
        url = args.get(at + 1).cloned();
        args.drain(at..(at + 2).min(args.len()));
    }
    let samples: usize = args.get(1).map_or(Ok(200), |s| s.parse())?;
    let poll_ms: u64 = args.get(2).map_or(Ok(50), |s| s.parse())?;
    let dir = tempfile_dir()?;
    let path = dir.join("latency.db");
    println!(
        "enqueue → send latency, idle dispatcher (1 worker), poll interval {poll_ms} ms, {samples} samples:"
    );
    let [mut same, mut other] = measure(path.to_str().unwrap(), true, samples, poll_ms)?;
    summary("SQLite, same process", &mut same);
    summary("SQLite, other process", &mut other);
    std::fs::remove_dir_all(dir)?;
    match url {
        #[cfg(feature = "postgres")]
        Some(url) => {
            let mut admin = postgres::Client::connect(&url, postgres::NoTls)?;
            for (listen, label) in [(true, "LISTEN/NOTIFY"), (false, "poll only")] {
                let schema = format!("wake_latency_{}_{listen}", std::process::id());
                admin.batch_execute(&format!("CREATE SCHEMA {schema}"))?;
                let sep = if url.contains('?') { '&' } else { '?' };
                let target = format!("{url}{sep}options=-c%20search_path%3D{schema}");
                let [mut same, mut other] = measure(&target, listen, samples, poll_ms)?;
                summary(&format!("PostgreSQL {label}, same process"), &mut same);
                summary(&format!("PostgreSQL {label}, other process"), &mut other);
                admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))?;
            }
        }
        #[cfg(not(feature = "postgres"))]
        Some(_) => println!("(PostgreSQL rows need --features postgres)"),
        None => println!("(PostgreSQL rows: pass --db URL or set DATABASE_URL)"),
    }
    Ok(())
}

fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("chunked-outbox-latency-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
