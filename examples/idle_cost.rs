//! What an idle outbox costs the process it is embedded in: context switches a second
//! of the whole process (every thread, from `/proc/self/task/*/status`) while an open
//! outbox has a default dispatcher running and nothing to send, over 10 s after 30 s
//! of idling; and the time to open a new file and an existing one (median of 15). On an
//! SQLite file in a temporary directory, with the blocking and the async dispatcher;
//! with `--features postgres` and `DATABASE_URL` (or under `scripts/with-postgres`),
//! on PostgreSQL too, in a fresh schema dropped afterwards.
//!
//! ```text
//! cargo run --release --features tokio --example idle_cost
//! scripts/with-postgres cargo run --release --features tokio,postgres --example idle_cost
//! ```
//!
//! Linux only (it reads `/proc`). `SECONDS` sets the window (default 10).

use std::time::{Duration, Instant};

use chunked_outbox::{
    AsyncChannelAdapter, AsyncDispatcher, ChannelAdapter, Claim, Dispatcher, Outbox, OutboxOptions,
    Outcome,
};

/// How long the process idles before the window opens.
const SETTLE: Duration = Duration::from_secs(30);

struct Nothing;

impl ChannelAdapter for Nothing {
    fn send(&self, _claim: &Claim) -> Outcome {
        Outcome::delivered(None)
    }
}

impl AsyncChannelAdapter for Nothing {
    fn send<'a>(
        &'a self,
        _claim: &'a Claim,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send + 'a>> {
        Box::pin(async { Outcome::delivered(None) })
    }
}

/// Voluntary and involuntary context switches of each thread of this process so far,
/// by thread id, with the thread's name.
fn context_switches() -> std::collections::BTreeMap<String, (String, u64)> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Default::default();
    };
    tasks
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let name = status
                .lines()
                .next()?
                .trim_start_matches("Name:")
                .trim()
                .to_owned();
            let switches = status
                .lines()
                .filter(|l| l.contains("ctxt_switches"))
                .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
                .sum();
            Some((
                dir.file_name()?.to_string_lossy().into_owned(),
                (name, switches),
            ))
        })
        .collect()
}

/// Context switches a second over the window, the process otherwise idle (with
/// `THREADS=1`, each thread's too).
fn idle_rate(window: Duration) -> f64 {
    // Idle a while first: what backs off has backed off.
    std::thread::sleep(SETTLE);
    let (before, started) = (context_switches(), Instant::now());
    std::thread::sleep(window);
    let after = context_switches();
    let seconds = started.elapsed().as_secs_f64();
    let mut total = 0;
    for (tid, (name, n)) in &after {
        let delta = n - before.get(tid).map_or(0, |(_, b)| *b);
        total += delta;
        if std::env::var("THREADS").is_ok_and(|v| v == "1") && delta > 0 {
            println!("    {name:<24} {:5.1} a second", delta as f64 / seconds);
        }
    }
    // (The reading thread's own wake-up counts too: one.)
    total as f64 / seconds
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(store: &str, open: impl Fn() -> Outbox, window: Duration) {
    let outbox = open();
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    let open_only = idle_rate(window);
    let running = Dispatcher::builder(outbox.clone())
        .adapter("bot", Nothing)
        .build()
        .expect("a dispatcher")
        .start()
        .expect("start it");
    let blocking = idle_rate(window);
    drop(running);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let running = runtime.block_on(async {
        AsyncDispatcher::builder(outbox.clone())
            .adapter("bot", Nothing)
            .build()
            .expect("a dispatcher")
            .start()
            .expect("start it")
    });
    let async_rate = idle_rate(window);
    runtime.block_on(running.shutdown(Duration::from_secs(5)));
    println!(
        "{store:<10} context switches a second, idle: open outbox {open_only:5.1}, \
         with a blocking dispatcher {blocking:5.1}, with an async one {async_rate:5.1} \
         (the process had {threads} threads with the outbox open)"
    );
}

fn main() {
    let window = Duration::from_secs(
        std::env::var("SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10),
    );
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("idle.db");
    // First, in a process that has opened nothing else.
    report(
        "SQLite",
        || Outbox::open(&path, OutboxOptions::default()).expect("open"),
        window,
    );
    #[cfg(feature = "postgres")]
    if let Ok(url) = std::env::var("DATABASE_URL") {
        postgres(&url, window);
    }

    let mut new = Vec::new();
    let mut existing = Vec::new();
    for i in 0..15 {
        let fresh = dir.path().join(format!("new-{i}.db"));
        let started = Instant::now();
        drop(Outbox::open(&fresh, OutboxOptions::default()).expect("a new file"));
        new.push(started.elapsed().as_secs_f64() * 1000.0);
        let started = Instant::now();
        drop(Outbox::open(&fresh, OutboxOptions::default()).expect("the file again"));
        existing.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    println!(
        "SQLite     open a new file {:.1} ms, an existing one {:.1} ms (median of 15)",
        median(new),
        median(existing)
    );
}
#[cfg(feature = "postgres")]
fn postgres(url: &str, window: Duration) {
    let schema = format!("idle_cost_{}", std::process::id());
    let mut admin = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    admin
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .expect("a schema");
    let separator = if url.contains('?') { '&' } else { '?' };
    let in_schema = format!("{url}{separator}options=-c%20search_path%3D{schema}");
    report(
        "PostgreSQL",
        || Outbox::connect(&in_schema, OutboxOptions::default()).expect("connect"),
        window,
    );
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .expect("drop the schema");
}
