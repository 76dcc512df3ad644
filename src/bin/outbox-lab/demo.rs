//! `outbox-lab demo`: a simulated chat engine sends thousands of replies through flaky
//! simulated platforms; a worker process is killed with SIGKILL mid-flight and
//! restarted; an operator settles what the crashes left uncertain the way a real one
//! could; at the end the platforms' own records prove the invariants.
//!
//! The worker (`outbox-lab demo-worker`, hidden) runs a [`Dispatcher`] whose adapters play
//! the platforms. Each platform writes what it accepts to its own SQLite file,
//! separate from the outbox, so the verdict is read from what the "users" received —
//! and only the verdict reads it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::monitoring::DeliveryStatus;
use chunked_outbox::{Dispatcher, NewDelivery, Outbox};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::CliResult;
use crate::sim::{
    CHANNELS, OperatorLog, PlatformApi, PlatformRecord, Settling, SimPlatform, chat_is_gone,
    open_platform, reply_text, settle_like_an_operator, sim_options,
};
use crate::target::Target;

/// Options of `outbox-lab demo`.
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
    /// How long to wait for every reply to settle; the verdict is printed either way
    /// (unsettled replies count against it).
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    settle_timeout: Duration,
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
    /// Which start of the worker this is (logged with its claimant).
    #[arg(long)]
    generation: u64,
    /// Where it logs its claimant.
    #[arg(long)]
    claimants: PathBuf,
    /// Where its platforms log their answers about possibly-sent parts.
    #[arg(long)]
    settlements: PathBuf,
}

/// The worker's dispatcher: workers, and sends each has in flight. Their product bounds
/// what one crash may leave `uncertain`.
const WORKERS: usize = 2;
const BATCH: usize = 4;

/// How long the operator leaves a chunk `uncertain` before deciding.
const OPERATOR_GRACE: Duration = Duration::from_secs(1);

/// The worker process: recovers what a killed predecessor left in flight, then
/// dispatches until the engine leaves a stop file next to the platform record.
pub fn worker(args: &WorkerArgs) -> CliResult<u8> {
    let db = std::env::var_os("OUTBOX_DB")
        .map(PathBuf::from)
        .ok_or("demo-worker needs OUTBOX_DB")?;
    let outbox = Target::of(&db).open(sim_options())?;
    let mut claimants = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.claimants)?;
    std::io::Write::write_all(
        &mut claimants,
        format!("{} {}\n", args.generation, outbox.claimant()).as_bytes(),
    )?;
    let mut builder = Dispatcher::builder(outbox.clone())
        .workers(WORKERS)
        .batch_size(BATCH)
        .poll_interval(Duration::from_millis(20))
        .settle_interval(Duration::from_millis(100));
    for (i, channel) in CHANNELS.iter().enumerate() {
        let seed = args.seed.wrapping_mul(31).wrapping_add(i as u64);
        builder = builder.adapter(
            channel.name,
            SimPlatform::new(channel, open_platform(&args.platform)?, seed)
                .logging_settlements(&args.settlements)?,
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
        run.order.push((id.to_string(), reply.text().to_owned()));
        if n % 100 == 99 {
            std::thread::sleep(Duration::from_millis(15));
        }
    }
    Ok(run)
}

/// What the run produced, as the JSON line prints it. Every check can fail: each was
/// seen failing on a build broken on purpose.
#[derive(Debug, Default, Serialize)]
struct Summary {
    deliveries: u64,
    chunks: u64,
    delivered: u64,
    failed: u64,
    /// Dead letters to chats that still exist: the platform refused something a real
    /// one accepts (a nonce too long, a message over its limit), or a refusal was misread.
    unexpected_dead_letters: u64,
    /// Chunks still uncertain at the end.
    uncertain_left: u64,
    /// Chunks of delivered replies that never arrived, and replies that ended unsettled.
    lost: u64,
    out_of_order: u64,
    /// Delivered replies with no `outbound_messages` row.
    missing_finalizations: u64,
    /// `outbound_messages` rows that are not what was enqueued, or for replies not delivered.
    wrong_finalizations: u64,
    replays_deduplicated: u64,
    duplicates_by_policy: u64,
    unexplained_duplicates: u64,
    settled_by_lookup: u64,
    resent_blind: u64,
    /// What asking the platforms settled, what was left for a person, and what each
    /// channel's chats saw twice.
    settling: Settling,
    max_uncertain_per_kill: u64,
    max_sends_in_flight: u64,
    idempotent_reenqueues: u64,
    crashes: u64,
    elapsed_ms: u64,
}

/// What the simulated engine enqueued.
struct EngineRun {
    chunks: u64,
    /// Replies submitted a second time with the same caller key.
    again: u64,
    /// (delivery id, text) in enqueue order.
    order: Vec<(String, String)>,
}

struct Files {
    dir: PathBuf,
    db: Target,
    /// The PostgreSQL schema made for this run (removed with the directory).
    schema: Option<(Target, String)>,
    platform: PathBuf,
    /// The operator's decisions, each worker start's claimant, and the platforms'
    /// answers about possibly-sent parts.
    operator_log: PathBuf,
    claimants: PathBuf,
    settlements: PathBuf,
    temporary: bool,
}

fn files(db: Option<&Path>) -> CliResult<Files> {
    match db {
        // On PostgreSQL: a fresh schema of that database for the outbox, the files of
        // the world (platform record, logs) in a temporary directory.
        Some(url) if matches!(Target::of(url), Target::Postgres(_)) => {
            let mut files = files(None)?;
            let server = Target::of(url);
            let name = format!("outbox_demo_{}", std::process::id());
            files.db = server.fresh_schema(&name, "", None)?;
            files.schema = Some((server, name));
            Ok(files)
        }
        Some(db) => {
            let dir = db
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_owned);
            let files = Files {
                platform: db.with_extension("platform.db"),
                operator_log: db.with_extension("operator.log"),
                claimants: db.with_extension("claimants.log"),
                settlements: db.with_extension("settle.log"),
                db: Target::File(db.to_owned()),
                schema: None,
                dir,
                temporary: false,
            };
            // A file left by an earlier run would be read as this run's: an old platform
            // record or claimant log skews the verdict, an old stop signal stops the worker.
            let stop = stop_file(&files.platform);
            let stale: Vec<String> = [
                &db.to_owned(),
                &files.platform,
                &stop,
                &files.operator_log,
                &files.claimants,
                &files.settlements,
            ]
            .into_iter()
            .filter(|f| f.exists())
            .map(|f| f.display().to_string())
            .collect();
            if !stale.is_empty() {
                return Err(format!(
                    "{} exist{}; the demo needs a fresh database path and writes these beside it \
                     (remove them or choose another --db)",
                    stale.join(", "),
                    if stale.len() == 1 { "s" } else { "" }
                )
                .into());
            }
            Ok(files)
        }
        None => {
            let dir = std::env::temp_dir().join(format!("outbox-demo-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            Ok(Files {
                db: Target::File(dir.join("outbox.db")),
                schema: None,
                platform: dir.join("platform.db"),
                operator_log: dir.join("operator.log"),
                claimants: dir.join("claimants.log"),
                settlements: dir.join("settle.log"),
                dir,
                temporary: true,
            })
        }
    }
}

fn spawn_worker(files: &Files, seed: u64, generation: u64) -> CliResult<Child> {
    Ok(Command::new(std::env::current_exe()?)
        .args(["demo-worker", "--platform"])
        .arg(&files.platform)
        .args(["--seed", &seed.to_string()])
        .args(["--generation", &generation.to_string()])
        .arg("--claimants")
        .arg(&files.claimants)
        .arg("--settlements")
        .arg(&files.settlements)
        .env("OUTBOX_DB", files.db.as_arg())
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
        files.db.describe(),
        if files.schema.is_some() {
            "a fresh schema, removed at the end unless --keep"
        } else if files.temporary {
            "temporary directory, removed at the end unless --keep"
        } else {
            "from --db"
        },
        files.platform.display()
    ));
    say(format!(
        "{} replies to {} chats on telegram (cannot be asked), discord (deduplicates a nonce for a few minutes), slack (can be looked up) \
         and matrix (deduplicates a transaction id for 30 minutes); \
         fast retry schedule for the demo: 50, 100, 200, 400 ms; the dispatcher settles a possibly-sent part \
         by asking slack, discord and matrix, and the chat waits for the answer; on telegram an operator resends it",
        args.replies, args.chats
    ));

    let outbox = files.db.open(sim_options())?;
    open_platform(&files.platform)?;
    let api = PlatformApi::open(&files.platform)?;
    let mut operator_log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&files.operator_log)?;

    // The chat engine runs beside the worker, as in a real deployment.
    let engine = {
        let outbox = outbox.clone();
        let (replies, chats, seed) = (args.replies, args.chats, args.seed);
        std::thread::spawn(move || simulate_engine(&outbox, replies, chats, seed))
    };

    let bar = ProgressBar::new(args.replies as u64);
    bar.set_style(
        ProgressStyle::with_template(
            // At most 80 columns: 13 + 24 + " 3000/3000 replies settled  crashes 2".
            "{spinner} [{elapsed_precise}] {bar:24} {pos}/{len} replies settled  {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut summary = Summary::default();
    let mut worker = spawn_worker(&files, args.seed, 0)?;
    let kill_at: Vec<u64> = (1..=args.crashes as u64)
        .map(|k| args.replies as u64 * k / (args.crashes as u64 + 1))
        .collect();
    let deadline = Instant::now() + args.settle_timeout;
    let mut engine = Some(engine);
    let mut engine_result = None;
    loop {
        std::thread::sleep(Duration::from_millis(25));
        if let Some(status) = worker.try_wait()? {
            bar.finish_and_clear();
            return Err(format!(
                "the worker process ended on its own ({status}); see its output above"
            )
            .into());
        }
        let settled = settle_like_an_operator(&outbox, &api, OPERATOR_GRACE, &mut operator_log)?;
        summary.settled_by_lookup += settled.looked_up;
        summary.resent_blind += settled.resent_blind;
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
            worker = spawn_worker(&files, args.seed + summary.crashes, summary.crashes)?;
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
            let line = format!(
                "not settled after {}; the verdict counts what is left",
                humantime::format_duration(args.settle_timeout)
            );
            bar.suspend(|| eprintln!("{line}"));
            break;
        }
    }
    std::fs::write(stop_file(&files.platform), b"")?;
    worker.wait()?;
    std::fs::remove_file(stop_file(&files.platform))?;
    bar.finish_and_clear();

    let run = match (engine_result, engine) {
        (Some(run), _) => run,
        (None, Some(engine)) => engine.join().map_err(|_| "engine thread panicked")??,
        (None, None) => return Err("engine result missing".into()),
    };
    summary.chunks = run.chunks;
    summary.idempotent_reenqueues = run.again;
    summary.deliveries = args.replies as u64;
    verify(&outbox, &files, &run.order, &mut summary)?;
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
        if let Some((server, name)) = &files.schema {
            server.drop_schema(name)?;
        }
    }
    Ok(if summary.ok() { 0 } else { 1 })
}

impl Summary {
    fn ok(&self) -> bool {
        self.lost == 0
            && self.unexpected_dead_letters == 0
            && self.out_of_order == 0
            && self.missing_finalizations == 0
            && self.wrong_finalizations == 0
            && self.unexplained_duplicates == 0
            && self.max_uncertain_per_kill <= self.max_sends_in_flight
            && self.uncertain_left == 0
    }
}

/// Reads the verdict from the platforms' record, the `outbound_messages` table and the
/// operator's log.
fn verify(
    outbox: &Outbox,
    files: &Files,
    order: &[(String, String)],
    s: &mut Summary,
) -> CliResult<()> {
    let h = outbox.health()?;
    s.delivered = h.totals.delivered_deliveries;
    s.failed = h.totals.failed_deliveries;
    s.uncertain_left = h.totals.uncertain_chunks;

    let record = PlatformRecord::read(&open_platform(&files.platform)?)?;
    let settlements = std::fs::read_to_string(&files.settlements).unwrap_or_default();
    let operator =
        OperatorLog::read(&(std::fs::read_to_string(&files.operator_log)? + &settlements));
    let arrived = record.keys();
    let d = record.duplicates(&operator.blind);
    s.settling = Settling::of(&operator, &d);
    (
        s.replays_deduplicated,
        s.duplicates_by_policy,
        s.unexplained_duplicates,
    ) = (d.deduplicated, d.by_policy, d.unexplained);
    let mut rows = files.db.history()?;

    // Lost: a chunk of a delivered delivery the platform never got, or a delivery that
    // ended neither delivered nor failed.
    let mut position = HashMap::new();
    for (seq, (id, text)) in order.iter().enumerate() {
        let view = outbox.delivery(id.parse()?)?.ok_or("delivery vanished")?;
        let row = rows.remove(id);
        match view.status {
            DeliveryStatus::Delivered => {
                s.lost += view
                    .chunks
                    .iter()
                    .filter(|c| !arrived.contains(c.idempotency_key.as_str()))
                    .count() as u64;
                match row {
                    None => s.missing_finalizations += 1,
                    Some((content, count)) if content != *text || count != view.chunk_count => {
                        s.wrong_finalizations += 1
                    }
                    Some(_) => {}
                }
            }
            _ if row.is_some() => s.wrong_finalizations += 1,
            DeliveryStatus::Failed if chat_is_gone(&view.chat_id) => {}
            DeliveryStatus::Failed => s.unexpected_dead_letters += 1,
            _ => s.lost += 1,
        }
        for c in &view.chunks {
            position.insert(c.idempotency_key.clone(), (seq as u64, c.index));
        }
    }
    s.wrong_finalizations += rows.len() as u64; // rows for replies nobody enqueued
    s.out_of_order = record.chats_out_of_order(&position);

    // What each crash left uncertain, under the killed worker's claimant.
    let claimants: HashMap<u64, String> = std::fs::read_to_string(&files.claimants)?
        .lines()
        .filter_map(|l| {
            let (g, c) = l.split_once(' ')?;
            Some((g.parse().ok()?, c.to_owned()))
        })
        .collect();
    for killed in 0..s.crashes {
        if let Some(held) = claimants
            .get(&killed)
            .and_then(|c| operator.uncertain_by_claimant.get(c))
        {
            s.max_uncertain_per_kill = s.max_uncertain_per_kill.max(held.len() as u64);
        }
    }
    s.max_sends_in_flight = (WORKERS * BATCH) as u64;
    Ok(())
}

fn print_verdict(s: &Summary) {
    let mark = |ok: bool| if ok { "✓" } else { "✗" };
    println!();
    println!("verification, read from what the simulated platforms received:");
    println!(
        "  {} deliveries {}: delivered {}, dead letters {} ({} to chats that still exist), uncertain {}",
        mark(s.uncertain_left == 0 && s.unexpected_dead_letters == 0),
        s.deliveries,
        s.delivered,
        s.failed,
        s.unexpected_dead_letters,
        s.uncertain_left
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
        "  {} duplicate sends nobody decided on: {} (dropped by discord's nonce: {}; caused by resending on telegram, which cannot be asked: {})",
        mark(s.unexplained_duplicates == 0),
        s.unexplained_duplicates,
        s.replays_deduplicated,
        s.duplicates_by_policy
    );
    let seen = |c: &str| s.settling.duplicates_seen.get(c).copied().unwrap_or(0);
    println!(
        "  possibly-sent parts settled by asking the platform: {} found, {} sent again, {} held; left for a person: {}; duplicates the chats saw: slack {}, discord {}, matrix {}, telegram {}",
        s.settling.platform_found,
        s.settling.platform_resend,
        s.settling.platform_hold,
        s.settling.left_for_a_person,
        seen("slack"),
        seen("discord"),
        seen("matrix"),
        seen("telegram")
    );
    println!(
        "  {} finalizations into outbound_messages: {} missing, {} wrong",
        mark(s.missing_finalizations + s.wrong_finalizations == 0),
        s.missing_finalizations,
        s.wrong_finalizations
    );
    println!(
        "  {} most chunks one crash left uncertain: {} (sends in flight at most: {})",
        mark(s.max_uncertain_per_kill <= s.max_sends_in_flight),
        s.max_uncertain_per_kill,
        s.max_sends_in_flight
    );
    println!(
        "  uncertain chunks an operator settled by asking slack: {}; resent on telegram by policy: {}; engine re-enqueues deduplicated by caller key: {}",
        s.settled_by_lookup, s.resent_blind, s.idempotent_reenqueues
    );
    println!(
        "  worker processes killed with SIGKILL: {}; elapsed {:.1} s",
        s.crashes,
        s.elapsed_ms as f64 / 1000.0
    );
}
