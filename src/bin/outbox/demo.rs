//! `outbox demo`: a simulated chat engine sends thousands of replies through flaky
//! simulated platforms; a worker process is killed with SIGKILL mid-flight and
//! restarted; at the end the platforms' own records prove the invariants.
//!
//! The worker (`outbox demo-worker`, hidden) runs a [`Dispatcher`] whose adapters play
//! the platforms. Each platform writes what it accepts to its own SQLite file,
//! separate from the outbox, so the verdict is read from what the "users" received.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chunked_outbox::{DeliveryStatus, Dispatcher, NewDelivery, Outbox, RecoverScope};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use rusqlite::Connection;
use serde::Serialize;

use crate::CliResult;
use crate::sim::{
    CHANNELS, PlatformRecord, SimPlatform, finalizations, open_platform, reply_text,
    resolve_like_an_operator, sim_options,
};

/// Options of `outbox demo`.
#[derive(Args)]
pub struct DemoArgs {
    /// Replies the simulated chat engine sends.
    #[arg(long, default_value_t = 3000)]
    replies: usize,
    /// Chats they go to.
    #[arg(long, default_value_t = 300)]
    chats: usize,
    /// Times the worker process is killed with SIGKILL and restarted.
    #[arg(long, default_value_t = 2)]
    crashes: usize,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// End with one JSON object on the last line (the progress bar goes to stderr).
    #[arg(long)]
    json: bool,
    /// Keep the demo's files instead of deleting them.
    #[arg(long)]
    keep: bool,
}

/// Options of the hidden worker process.
#[derive(Args)]
pub struct WorkerArgs {
    /// The simulated platforms' record.
    #[arg(long)]
    platform: PathBuf,
    /// Seed for this worker's random choices.
    #[arg(long)]
    seed: u64,
}

/// The worker process: recovers what a killed predecessor left in flight, then
/// dispatches until the engine leaves a stop file next to the platform record.
pub fn worker(args: &WorkerArgs) -> CliResult<u8> {
    let db = std::env::var_os("OUTBOX_DB")
        .map(PathBuf::from)
        .ok_or("demo-worker needs OUTBOX_DB")?;
    let outbox = Outbox::open(&db, sim_options())?;
    let mut builder = Dispatcher::builder(outbox.clone())
        .workers(2)
        .batch_size(16)
        .poll_interval(Duration::from_millis(20));
    for (i, channel) in CHANNELS.iter().enumerate() {
        let seed = args.seed.wrapping_mul(31).wrapping_add(i as u64);
        builder = builder.adapter(
            channel.name,
            SimPlatform::new(channel, open_platform(&args.platform)?, seed),
        );
    }
    let dispatcher = builder.build()?;
    // This is the only process sending from the file, so whatever is `sending` was
    // abandoned by the killed worker. Each channel's replay policy decides its fate.
    outbox.recover(RecoverScope::AllSending)?;
    let running = dispatcher.start()?;
    let stop = stop_file(&args.platform);
    while !stop.exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
    running.shutdown(Duration::from_secs(10));
    Ok(0)
}

fn stop_file(platform: &Path) -> PathBuf {
    platform.with_extension("stop")
}

/// The chat engine: enqueues replies in bursts and, like an engine retrying after its
/// own timeout, submits one reply in twenty a second time with the same caller key.
fn simulate_engine(
    outbox: &Outbox,
    replies: usize,
    chats: usize,
    seed: u64,
) -> CliResult<EngineRun> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut run = EngineRun {
        chunks: 0,
        again: 0,
        order: Vec::with_capacity(replies),
    };
    for n in 0..replies {
        let channel = &CHANNELS[rng.usize(0..CHANNELS.len())];
        let chat = format!("{}-chat-{}", channel.name, rng.usize(0..chats));
        let text = reply_text(&mut rng, n);
        let reply = NewDelivery::split(channel.name, chat.clone(), text, &channel.splitter)?
            .with_idempotency_key(format!("engine-reply-{n}"))
            .with_sender("demo-bot");
        run.chunks += reply.chunks().len() as u64;
        let id = outbox.enqueue(&reply)?.id;
        if n % 20 == 0 {
            let again = outbox.enqueue(&reply)?;
            if again.created || again.id != id {
                return Err(format!("re-enqueue of reply {n} was not deduplicated").into());
            }
            run.again += 1;
        }
        run.order.push((chat, id.to_string()));
        if n % 100 == 99 {
            std::thread::sleep(Duration::from_millis(15));
        }
    }
    Ok(run)
}

/// What the run produced, as the JSON line prints it.
#[derive(Debug, Default, Serialize)]
struct Summary {
    deliveries: u64,
    chunks: u64,
    delivered: u64,
    failed: u64,
    uncertain: u64,
    lost: u64,
    out_of_order: u64,
    duplicate_finalizations: u64,
    duplicates_allowed: u64,
    duplicates_unexplained: u64,
    resolved_uncertain: u64,
    idempotent_reenqueues: u64,
    crashes: u64,
    elapsed_ms: u64,
}

/// What the simulated engine enqueued.
struct EngineRun {
    chunks: u64,
    /// Replies submitted a second time with the same caller key.
    again: u64,
    /// (chat, delivery id) in enqueue order.
    order: Vec<(String, String)>,
}

struct Files {
    dir: PathBuf,
    db: PathBuf,
    platform: PathBuf,
    temporary: bool,
}

fn files(db: Option<&Path>) -> CliResult<Files> {
    match db {
        Some(db) => {
            if db.exists() {
                return Err(format!(
                    "{} exists; the demo needs a fresh database path",
                    db.display()
                )
                .into());
            }
            let dir = db
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_owned);
            Ok(Files {
                platform: db.with_extension("platform.db"),
                db: db.to_owned(),
                dir,
                temporary: false,
            })
        }
        None => {
            let dir = std::env::temp_dir().join(format!("outbox-demo-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            Ok(Files {
                db: dir.join("outbox.db"),
                platform: dir.join("platform.db"),
                dir,
                temporary: true,
            })
        }
    }
}

fn spawn_worker(files: &Files, seed: u64) -> CliResult<Child> {
    Ok(Command::new(std::env::current_exe()?)
        .args(["demo-worker", "--platform"])
        .arg(&files.platform)
        .args(["--seed", &seed.to_string()])
        .env("OUTBOX_DB", &files.db)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?)
}

pub fn run(db: Option<&Path>, args: &DemoArgs) -> CliResult<u8> {
    if args.replies == 0 || args.chats == 0 {
        return Err("--replies and --chats must be at least 1".into());
    }
    let started = Instant::now();
    let files = files(db)?;
    let say = |line: String| {
        if args.json {
            eprintln!("{line}")
        } else {
            println!("{line}")
        }
    };
    say(format!(
        "database: {} ({}); platform record: {}",
        files.db.display(),
        if files.temporary {
            "temporary directory, removed at the end unless --keep"
        } else {
            "from --db"
        },
        files.platform.display()
    ));
    say(format!(
        "{} replies to {} chats on telegram (no replay), discord (replays deduplicated by nonce) and slack (no replay); \
         fast retry schedule for the demo: 50, 100, 200, 400 ms",
        args.replies, args.chats
    ));

    let outbox = Outbox::open(&files.db, sim_options())?;
    let platform = open_platform(&files.platform)?;

    // The chat engine runs beside the worker, as in a real deployment.
    let engine = {
        let outbox = outbox.clone();
        let (replies, chats, seed) = (args.replies, args.chats, args.seed);
        std::thread::spawn(move || simulate_engine(&outbox, replies, chats, seed))
    };

    let bar = ProgressBar::new(args.replies as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} replies settled  {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut summary = Summary::default();
    let mut worker = spawn_worker(&files, args.seed)?;
    let kill_at: Vec<u64> = (1..=args.crashes as u64)
        .map(|k| args.replies as u64 * k / (args.crashes as u64 + 1))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut engine = Some(engine);
    let mut engine_result = None;
    loop {
        std::thread::sleep(Duration::from_millis(25));
        summary.resolved_uncertain += resolve_like_an_operator(&outbox, &platform)?;
        let h = outbox.health()?;
        let settled = h.totals.delivered_deliveries + h.totals.failed_deliveries;
        bar.set_position(settled);
        bar.set_message(format!("crashes {}", summary.crashes));
        if summary.crashes < kill_at.len() as u64 && settled >= kill_at[summary.crashes as usize] {
            // A real crash: SIGKILL, no chance to clean up, chunks left in flight.
            worker.kill()?;
            worker.wait()?;
            summary.crashes += 1;
            let in_flight = outbox.health()?.totals.sending_chunks;
            let line = format!(
                "killed worker pid {} with SIGKILL at {settled}/{} replies settled; {in_flight} chunks were in flight; restarting",
                worker.id(),
                args.replies
            );
            if bar.is_hidden() {
                say(line)
            } else {
                bar.println(line)
            }
            worker = spawn_worker(&files, args.seed + summary.crashes)?;
        }
        if engine.as_ref().is_some_and(|e| e.is_finished()) {
            engine_result = Some(
                engine
                    .take()
                    .unwrap()
                    .join()
                    .map_err(|_| "engine thread panicked")??,
            );
        }
        let idle = h.totals.pending_chunks
            + h.totals.retry_chunks
            + h.totals.sending_chunks
            + h.totals.uncertain_chunks
            == 0;
        if engine_result.is_some() && idle && settled == args.replies as u64 {
            break;
        }
        if Instant::now() > deadline {
            return Err("the demo did not settle within 10 minutes".into());
        }
    }
    std::fs::write(stop_file(&files.platform), b"")?;
    worker.wait()?;
    bar.finish_and_clear();

    let run = engine_result.ok_or("engine result missing")?;
    summary.chunks = run.chunks;
    summary.idempotent_reenqueues = run.again;
    summary.deliveries = args.replies as u64;
    verify(&outbox, &platform, &run.order, &mut summary)?;
    summary.elapsed_ms = started.elapsed().as_millis() as u64;

    let h = outbox.health()?;
    if !args.json {
        print!("{}", crate::render::health(&h));
        print_verdict(&summary);
    }
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    }
    drop(outbox);
    if files.temporary && !args.keep {
        std::fs::remove_dir_all(&files.dir)?;
    }
    let ok = summary.lost == 0
        && summary.out_of_order == 0
        && summary.duplicate_finalizations == 0
        && summary.duplicates_unexplained == 0;
    Ok(if ok { 0 } else { 1 })
}

/// Reads the verdict from the platforms' record and the `messages` table.
fn verify(
    outbox: &Outbox,
    platform: &Connection,
    order: &[(String, String)],
    s: &mut Summary,
) -> CliResult<()> {
    let h = outbox.health()?;
    s.delivered = h.totals.delivered_deliveries;
    s.failed = h.totals.failed_deliveries;
    s.uncertain = h.totals.uncertain_chunks;

    let record = PlatformRecord::read(platform)?;
    let arrived = record.keys();
    (s.duplicates_allowed, s.duplicates_unexplained) = record.duplicates();

    // Lost: a chunk of a delivered delivery the platform never got, or a delivery that
    // ended neither delivered nor failed.
    let mut position = HashMap::new();
    for (seq, (_, id)) in order.iter().enumerate() {
        let view = outbox.delivery(id.parse()?)?.ok_or("delivery vanished")?;
        match view.status {
            DeliveryStatus::Delivered => {
                s.lost += view
                    .chunks
                    .iter()
                    .filter(|c| !arrived.contains(c.idempotency_key.as_str()))
                    .count() as u64;
            }
            DeliveryStatus::Failed => {}
            _ => s.lost += 1,
        }
        for c in &view.chunks {
            position.insert(c.idempotency_key.clone(), (seq as u64, c.index));
        }
    }
    s.out_of_order = record.chats_out_of_order(&position);

    // Double finalizations: a second row for a delivery, or rows for deliveries that
    // are not delivered.
    let (extra, distinct) = finalizations(outbox.path().ok_or("the demo outbox is a file")?)?;
    s.duplicate_finalizations = extra + distinct.abs_diff(s.delivered);
    Ok(())
}

fn print_verdict(s: &Summary) {
    let mark = |ok: bool| if ok { "✓" } else { "✗" };
    println!();
    println!("verification, read from what the simulated platforms received:");
    println!(
        "  {} deliveries {}: delivered {}, dead letters {} (chats that no longer exist), uncertain {}",
        mark(s.uncertain == 0),
        s.deliveries,
        s.delivered,
        s.failed,
        s.uncertain
    );
    println!(
        "  {} lost chunks: {} (of {} enqueued)",
        mark(s.lost == 0),
        s.lost,
        s.chunks
    );
    println!(
        "  {} chats with chunks out of order: {}",
        mark(s.out_of_order == 0),
        s.out_of_order
    );
    println!(
        "  {} duplicate sends: {} allowed (discord replays, deduplicated by the platform's nonce), {} unexplained",
        mark(s.duplicates_unexplained == 0),
        s.duplicates_allowed,
        s.duplicates_unexplained
    );
    println!(
        "  {} double finalizations into messages: {}",
        mark(s.duplicate_finalizations == 0),
        s.duplicate_finalizations
    );
    println!(
        "  uncertain chunks resolved by asking the platform: {}; engine re-enqueues deduplicated by caller key: {}",
        s.resolved_uncertain, s.idempotent_reenqueues
    );
    println!(
        "  worker processes killed with SIGKILL: {}; elapsed {:.1} s",
        s.crashes,
        s.elapsed_ms as f64 / 1000.0
    );
}
