//! `outbox-lab torture`: crash-consistency on this machine. A producer process enqueues,
//! two dispatcher processes send through the simulated platforms, a maintenance process
//! recovers, settles uncertain chunks as an operator could (asking the platform where
//! it can be asked, resending by policy where it cannot), acknowledges, purges and
//! checkpoints — and all of them are killed with SIGKILL at seeded random moments and
//! restarted. At the end the invariants are checked against what the platforms
//! recorded in their own file, which no role reads.
//!
//! `outbox-lab stress` is the contention run: several dispatcher processes, an enqueuer and
//! a health reader on one file, with every caller-visible error counted.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chunked_outbox::clock::SkewedClock;
use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::{
    ChannelAdapter, Claim, DeliveryId, Dispatcher, Error, NewDelivery, Outbox, OutboxOptions,
    Outcome,
};
use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::CliResult;
use crate::sim::{
    CHANNELS, OperatorLog, PlatformApi, PlatformRecord, Settling, SimPlatform, chat_is_gone,
    open_platform, reply_text, settle_like_an_operator, sim_options,
};
use crate::target::Target;

/// Options of `outbox-lab torture`.
#[derive(Args)]
pub struct TortureArgs {
    /// SIGKILLs to deliver (each followed by a restart).
    #[arg(long, default_value_t = 100)]
    kills: u64,
    /// Seed of every random choice (printed, so a failure can be replayed).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Replies the producer enqueues per kill.
    #[arg(long, default_value_t = 12)]
    replies_per_kill: u64,
    /// Keep the files instead of deleting them.
    #[arg(long)]
    keep: bool,
    /// How long to wait, after the last kill, for everything to settle; the verdict is
    /// printed either way (unsettled work counts against it).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    settle_timeout: Duration,
    /// PostgreSQL: times to end every connection of the processes under torture from
    /// the server's side (`pg_terminate_backend`), spread over the kills.
    #[arg(long, default_value_t = 0)]
    connection_kills: u64,
    /// PostgreSQL: times to restart the server, spread over the kills, by running
    /// `--restart-command` (a shell command that returns once the server is back).
    #[arg(long, default_value_t = 0, requires = "restart_command")]
    server_restarts: u64,
    /// The shell command that restarts the server (e.g. `pg_ctl -D … -m immediate
    /// restart`).
    #[arg(long)]
    restart_command: Option<String>,
    /// The clock of the first dispatcher process (and each of its restarts) this far
    /// ahead of the others', or behind with a leading `-`: `--skew 2m`, `--skew=-2m`.
    /// A host whose clock is off must change nothing the verdict sees.
    #[arg(long, value_parser = parse_skew, allow_hyphen_values = true)]
    skew: Option<i64>,
    /// A rolling upgrade: the roles start as this `outbox-lab` binary of an older
    /// release (which creates the schema at its version); once an eighth of the
    /// replies are enqueued this build migrates it, and once the older producer has
    /// enqueued on the new schema each process of the older build is replaced by one
    /// of this build — SIGKILLed or stopped cleanly, one by one — while the older ones
    /// still running keep writing. The verdict adds what the roll
    /// costs: processes refused, enqueues during the roll, the longest pause in sending.
    #[arg(long, value_name = "OUTBOX_LAB")]
    upgrade_from: Option<PathBuf>,
}

/// A signed duration in milliseconds: `2m` ahead, `-2m` behind.
fn parse_skew(text: &str) -> Result<i64, String> {
    let (sign, magnitude) = match text.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, text.strip_prefix('+').unwrap_or(text)),
    };
    let d = humantime::parse_duration(magnitude).map_err(|e| e.to_string())?;
    i64::try_from(d.as_millis())
        .map(|ms| sign * ms)
        .map_err(|_| format!("{text}: too large"))
}

/// The roles of the processes under torture.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum Role {
    Producer,
    Dispatcher,
    Maintenance,
}

/// Options of the hidden role process.
#[derive(Args)]
pub struct RoleArgs {
    #[arg(long, value_enum)]
    role: Role,
    /// Working directory holding the outbox, the platform record and the logs.
    #[arg(long)]
    dir: PathBuf,
    #[arg(long)]
    seed: u64,
    /// Replies the producer must have enqueued before it stops.
    #[arg(long, default_value_t = 0)]
    replies: u64,
    /// Which start of a role this process is (dispatchers log it with their claimant).
    #[arg(long, default_value_t = 0)]
    generation: u64,
    /// This process's clock is off by this many milliseconds (see `--skew`).
    #[arg(long, allow_hyphen_values = true)]
    skew_ms: Option<i64>,
}

/// What a rolling upgrade cost (`--upgrade-from`), from what the processes and the
/// platforms saw.
#[derive(Debug, Default, Serialize)]
struct Roll {
    /// Role processes of either build that exited on their own with a failure: a
    /// write refused (or any other error).
    refused: u64,
    /// Replies the producers confirmed between the migration and the moment the last
    /// process of the older build was gone.
    enqueues_during_roll: u64,
    /// Processes of the older build replaced: killed, and stopped cleanly.
    killed_old: u64,
    stopped_old: u64,
    /// The longest time, in that window, between two sends arriving at the platforms
    /// (ms), and the lease (the bound it must stay within).
    longest_send_pause_ms: u64,
    lease_ms: u64,
    /// Health's count of stored deliveries against the deliveries listed.
    deliveries_miscounted: u64,
    /// The builds health showed writing at the end.
    builds_at_end: Vec<String>,
}

/// The verdict, printed as one JSON line. Every check can fail: each was seen failing
/// on a build broken on purpose.
#[derive(Debug, Default, Serialize)]
struct Verdict {
    kills: u64,
    /// Server connections of the processes ended by the server, and server restarts.
    connections_killed: u64,
    server_restarts: u64,
    deliveries: u64,
    chunks: u64,
    /// Chunks of finalized deliveries that never arrived, and confirmed deliveries that
    /// vanished or ended unsettled.
    lost: u64,
    /// Chats whose first arrivals do not follow enqueue order.
    out_of_order: u64,
    /// Deliveries all of whose chunks arrived but that have no `outbound_messages` row.
    missing_finalizations: u64,
    /// `outbound_messages` rows that are not what was enqueued: wrong content or chunk count, or
    /// a delivery nobody enqueued.
    wrong_finalizations: u64,
    /// Second arrivals on a platform that does not deduplicate that no decision
    /// explains.
    unexplained_duplicates: u64,
    /// Second arrivals caused by the operator's resends where no lookup exists.
    duplicates_by_policy: u64,
    replays_deduplicated: u64,
    /// Uncertain chunks the operator settled by asking the platform, and resent blind
    /// by policy.
    settled_by_lookup: u64,
    resent_blind: u64,
    /// What the dispatchers' questions to the platforms settled, what was left for a
    /// person, and the duplicates each channel's chats saw.
    settling: Settling,
    /// The most chunks that became `uncertain` through one kill of a dispatcher, and
    /// the most sends that dispatcher could have had in flight (workers × batch). A
    /// fault of the server (a connection kill, a restart) the dispatcher lived through
    /// strands what it had in flight too: the chunks left under a killed dispatcher
    /// count per stranding, the kill and each such fault (rounded up).
    max_uncertain_per_kill: u64,
    max_sends_in_flight: u64,
    /// Chunks still `uncertain` when the run ended.
    uncertain_left: u64,
    /// Dead letters to chats that no longer exist (the simulation's expected ones).
    dead_letters: u64,
    /// Dead letters to chats that still exist: a send a real platform accepts was
    /// refused, or a refusal was misread.
    unexpected_dead_letters: u64,
    /// A rolling upgrade's costs, with `--upgrade-from`.
    #[serde(skip_serializing_if = "Option::is_none")]
    roll: Option<Roll>,
    /// Health's dead-letter counts (dead letters, unacknowledged ones, failed parts)
    /// that differ from the dead letters the operator lists with their parts.
    dead_letters_miscounted: u64,
    seed: u64,
    elapsed_ms: u64,
}

/// Dispatcher processes under torture: workers each, and sends each worker has in
/// flight. Their product bounds what one kill may leave `uncertain`.
const DISPATCH_WORKERS: usize = 2;
const DISPATCH_BATCH: usize = 2;

/// How long the operator leaves a chunk `uncertain` before deciding (a live worker
/// whose lease ran out may still report it).
const OPERATOR_GRACE: Duration = Duration::from_secs(1);

/// Torture settings: the simulation's, with a short lease so the chunks a killed
/// dispatcher held come back quickly (several dispatchers run, so recovery must defer
/// to live leases and can only reclaim expired ones).
fn torture_options() -> OutboxOptions {
    sim_options().with_lease(TORTURE_LEASE)
}

/// Replies the older build's producer must enqueue on the migrated schema before the
/// rolling upgrade replaces anything.
const OLDER_ENQUEUES: u64 = 20;

/// The lease of the processes under torture.
const TORTURE_LEASE: Duration = Duration::from_millis(400);

fn stop_path(dir: &Path) -> PathBuf {
    dir.join("stop")
}

/// The file that stops the role process of `generation` alone.
fn own_stop_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("stop-{generation}"))
}

fn spawn(
    binary: &Path,
    role: Role,
    dir: &Path,
    seed: u64,
    replies: u64,
    generation: u64,
    skew_ms: Option<i64>,
) -> CliResult<Child> {
    let skew: Vec<String> = skew_ms
        .map(|ms| vec!["--skew-ms".into(), ms.to_string()])
        .unwrap_or_default();
    Ok(Command::new(binary)
        .args(["torture-role", "--role"])
        .arg(format!("{role:?}").to_lowercase())
        .arg("--dir")
        .arg(dir)
        .args([
            "--seed",
            &seed.to_string(),
            "--replies",
            &replies.to_string(),
            "--generation",
            &generation.to_string(),
        ])
        .args(skew)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?)
}

/// The processes under torture; those still running when the run ends early (an
/// error of the run itself) are killed, not left behind holding its output open.
struct Roles(Vec<Child>);

impl Drop for Roles {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The chat a reply goes to: a function of the seed and its number, so the verifier
/// knows it without asking the (possibly purged) outbox.
fn chat_of(seed: u64, n: u64) -> (usize, String) {
    let mut rng = fastrand::Rng::with_seed(seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let channel = rng.usize(0..CHANNELS.len());
    (
        channel,
        format!("{}-chat-{}", CHANNELS[channel].name, rng.usize(0..40)),
    )
}

/// Where the outbox under torture is: the file in `dir`, or the PostgreSQL schema
/// whose URL `run` wrote there.
fn outbox_target(dir: &Path) -> Target {
    match std::fs::read_to_string(dir.join("outbox.url")) {
        Ok(url) => Target::Postgres(url),
        Err(_) => Target::File(dir.join("outbox.db")),
    }
}

/// The PostgreSQL schema a torture run of `seed` in this process uses; also the
/// `application_name` of its processes' connections (the driver's own carry none).
fn schema_name(seed: u64) -> String {
    format!("outbox_torture_{}_{seed}", std::process::id())
}

/// Whether an error of the outbox passes when the server is back (a lost connection,
/// a restart, a busy lock): the processes under torture retry those, as any
/// application on a network must.
fn transient(e: &Error) -> bool {
    matches!(
        e,
        Error::Busy | Error::Connection { .. } | Error::CommitUnknown { .. } | Error::Pool { .. }
    )
}

/// `f` until it succeeds or fails for good; transient failures are retried for up to
/// a minute.
fn retrying<T>(mut f: impl FnMut() -> chunked_outbox::Result<T>) -> chunked_outbox::Result<T> {
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        match f() {
            Err(e) if transient(&e) && Instant::now() < give_up => {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Opens the outbox under torture, waiting for a server that is restarting; on a
/// host whose clock is `skew_ms` off, if given.
fn open_outbox(dir: &Path, skew_ms: Option<i64>) -> CliResult<Outbox> {
    let give_up = Instant::now() + Duration::from_secs(60);
    let options = match skew_ms {
        Some(ms) if ms < 0 => torture_options().with_clock(std::sync::Arc::new(
            SkewedClock::behind(Duration::from_millis(ms.unsigned_abs())),
        )),
        Some(ms) => torture_options().with_clock(std::sync::Arc::new(SkewedClock::ahead(
            Duration::from_millis(ms as u64),
        ))),
        None => torture_options(),
    };
    loop {
        match outbox_target(dir).open(options.clone()) {
            Err(e)
                if Instant::now() < give_up && e.downcast_ref::<Error>().is_some_and(transient) =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

pub fn run(db: Option<&Path>, args: &TortureArgs) -> CliResult<u8> {
    let server = match db.map(Target::of) {
        None => None,
        Some(server @ Target::Postgres(_)) => Some(server),
        Some(Target::File(_)) => {
            return Err(
                "torture works in a fresh temporary directory; pass no --db \
                        (or a postgres:// URL, to torture an outbox in that database)"
                    .into(),
            );
        }
    };
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!(
        "outbox-torture-{}-{}",
        std::process::id(),
        args.seed
    ));
    std::fs::create_dir_all(&dir)?;
    // On PostgreSQL the outbox is a fresh schema of the database; the platforms' record
    // and the logs stay files (they belong to the world, not to the outbox).
    if let Some(server) = &server {
        // Every commit the verdict relies on must outlive a crash of the server (a
        // test server may run with `synchronous_commit = off`), and the server's side
        // finds the roles' connections by their name.
        let name = schema_name(args.seed);
        let Target::Postgres(url) =
            server.fresh_schema(&name, "-c synchronous_commit=on", Some(&name))?
        else {
            unreachable!("a schema is a PostgreSQL target");
        };
        std::fs::write(dir.join("outbox.url"), url)?;
    } else if args.connection_kills + args.server_restarts > 0 {
        return Err("--connection-kills and --server-restarts need a PostgreSQL --db".into());
    }
    eprintln!(
        "torture: seed {}, {} kills, files in {}, outbox {}",
        args.seed,
        args.kills,
        dir.display(),
        outbox_target(&dir).describe()
    );
    // On a rolling upgrade the older release's tool (`outbox`, beside its lab) creates
    // the outbox at its version, as an operator would before starting its processes.
    match &args.upgrade_from {
        None => drop(outbox_target(&dir).open(torture_options())?),
        Some(old) => {
            let tool = old.with_file_name("outbox");
            let status = Command::new(&tool)
                .arg("--db")
                .arg(outbox_target(&dir).as_arg())
                .arg("migrate")
                .stdout(Stdio::null())
                .status()
                .map_err(|e| format!("cannot run the older release's {}: {e}", tool.display()))?;
            if !status.success() {
                return Err(
                    format!("the older release's `outbox migrate` failed: {status}").into(),
                );
            }
        }
    }
    open_platform(&dir.join("platform.db"))?;
    let this_build = std::env::current_exe()?;
    let mut roll = args.upgrade_from.as_ref().map(|_| RollState::default());
    // Which build each role process runs.
    let mut older: Vec<bool> = vec![args.upgrade_from.is_some(); 4];
    let binary_of = |older: bool| -> &Path {
        match (&args.upgrade_from, older) {
            (Some(old), true) => old,
            _ => &this_build,
        }
    };

    let replies = (args.kills * args.replies_per_kill).max(100);
    let roles = [
        Role::Producer,
        Role::Dispatcher,
        Role::Dispatcher,
        Role::Maintenance,
    ];
    // The first dispatcher's host (roles[1]) has the skewed clock, if any.
    let skew_of = |i: usize| if i == 1 { args.skew } else { None };
    let mut children = Roles(
        roles
            .iter()
            .enumerate()
            .map(|(i, r)| {
                spawn(
                    binary_of(older[i]),
                    *r,
                    &dir,
                    args.seed + i as u64,
                    replies,
                    i as u64,
                    skew_of(i),
                )
            })
            .collect::<CliResult<_>>()?,
    );
    let mut generations: Vec<u64> = (0..roles.len() as u64).collect();
    // Role `slot` started again as `generation`, of the older build or this one. The
    // producer keeps the run's seed: it decides which chat each reply goes to.
    let start = |slot: usize, generation: u64, older: bool| {
        let seed = if slot == 0 {
            args.seed
        } else {
            args.seed.wrapping_add(generation)
        };
        spawn(
            binary_of(older),
            roles[slot],
            &dir,
            seed,
            replies,
            generation,
            skew_of(slot),
        )
    };
    // Each dispatcher killed, with the server's faults it lived through.
    let mut killed_dispatchers = Vec::new();
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let mut generation = roles.len() as u64;
    let (mut connections_killed, mut restarts) = (0, 0);
    // The server's faults so far (each round of connection kills and each restart
    // counts once), and how many there were when each role's process started.
    let mut faults = 0;
    let mut born_at = roles.map(|_| 0);
    // The server's faults, spread evenly over the kills.
    let spread = |n: u64, i: u64| (i + 1) * n / args.kills.max(1) - i * n / args.kills.max(1);
    // The kills, and on a rolling upgrade as many more as it takes to replace every
    // process of the older build.
    let mut i = 0;
    while i < args.kills || roll.as_ref().is_some_and(|r| r.rolled.is_none()) {
        std::thread::sleep(Duration::from_millis(rng.u64(5..60)));
        if let Some(server) = &server {
            for _ in 0..spread(args.connection_kills, i) {
                connections_killed += server.terminate_connections(&schema_name(args.seed))?;
                faults += 1;
            }
            for _ in 0..spread(args.server_restarts, i) {
                let command = args.restart_command.as_deref().unwrap_or_default();
                let status = std::process::Command::new("sh")
                    .args(["-c", command])
                    .status()?;
                if !status.success() {
                    return Err(format!("the restart command failed: {status}").into());
                }
                restarts += 1;
                faults += 1;
            }
        }
        // A process that ended on its own with a failure (a write refused) is counted
        // and started again; a producer that finished is left finished.
        for slot in 0..roles.len() {
            let Some(status) = children.0[slot].try_wait()? else {
                continue;
            };
            if status.success() {
                continue;
            }
            if let Some(roll) = &mut roll {
                roll.refused += 1;
            }
            eprintln!("torture: a {:?} process failed ({status})", roles[slot]);
            generation += 1;
            generations[slot] = generation;
            born_at[slot] = faults;
            children.0[slot] = start(slot, generation, older[slot])?;
        }
        // A rolling upgrade: once the producer has enqueued an eighth of its replies,
        // this build migrates; then the older producer is given time to enqueue on the
        // new schema (a number of replies, not a time: a producer that is refused, or
        // a build too slow, shows in the verdict) before anything is replaced.
        if let Some(roll) = roll.as_mut().filter(|r| r.migrated.is_none())
            && (confirmed_lines(&dir) >= replies / 8 || i >= args.kills / 2)
        {
            let before = confirmed_lines(&dir);
            roll.migrated = Some((wall_ms(), before));
            roll.handle = Some(open_outbox(&dir, None)?);
            let give_up = Instant::now() + Duration::from_secs(30);
            while confirmed_lines(&dir) < before + OLDER_ENQUEUES
                && children.0[0].try_wait()?.is_none()
                && Instant::now() < give_up
            {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        // Most kills hit a dispatcher (sends in flight) or the producer (enqueues).
        // Once migrated, every second replaces a process of the older build, one by
        // one, the producer last (so the older build enqueues on the new schema for
        // longest); whatever a kill hits comes back as this build.
        let replacing = roll
            .as_ref()
            .and_then(|r| r.migrated.map(|_| i))
            .filter(|i| i % 2 == 0)
            .and_then(|_| older.iter().rposition(|o| *o));
        let victim = replacing.unwrap_or_else(|| match rng.u32(0..10) {
            0..4 => 1 + rng.usize(0..2),
            4..8 => 0,
            _ => 3,
        });
        let old_victim = older[victim];
        let child = &mut children.0[victim];
        let clean =
            replacing.is_some() && roll.as_ref().is_some_and(|r| r.killed_old > r.stopped_old);
        if clean {
            // A clean stop: asked, and waited for.
            std::fs::write(own_stop_path(&dir, generations[victim]), b"")?;
            let give_up = Instant::now() + Duration::from_secs(30);
            while child.try_wait()?.is_none() && Instant::now() < give_up {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        child.kill()?;
        child.wait()?;
        if roles[victim] == Role::Dispatcher && !clean {
            killed_dispatchers.push((generations[victim], faults - born_at[victim]));
        }
        if let Some(roll) = roll.as_mut().filter(|r| r.migrated.is_some() && old_victim) {
            if clean {
                roll.stopped_old += 1;
            } else {
                roll.killed_old += 1;
            }
            older[victim] = false;
            if !older.contains(&true) {
                roll.rolled = Some((wall_ms(), confirmed_lines(&dir)));
            }
        }
        generation += 1;
        generations[victim] = generation;
        born_at[victim] = faults;
        children.0[victim] = start(victim, generation, older[victim])?;
        i += 1;
    }

    // No more kills: let everything settle, then stop the roles.
    let outbox = open_outbox(&dir, None)?;
    let deadline = Instant::now() + args.settle_timeout;
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let producer_done = children.0[0].try_wait()?.is_some_and(|s| s.success());
        let h = retrying(|| outbox.health())?;
        let t = &h.totals;
        if producer_done
            && t.pending_chunks + t.retry_chunks + t.sending_chunks + t.uncertain_chunks == 0
        {
            break;
        }
        if Instant::now() > deadline {
            eprintln!(
                "torture: not settled after {} (seed {}); the verdict counts what is left",
                humantime::format_duration(args.settle_timeout),
                args.seed
            );
            break;
        }
    }
    std::fs::write(stop_path(&dir), b"")?;
    for child in &mut children.0 {
        child.wait()?;
    }

    let mut verdict = verify(&dir, &outbox, args.seed, &killed_dispatchers)?;
    if let Some(roll) = roll {
        verdict.roll = Some(roll.verdict(&dir, &outbox)?);
    }
    verdict.kills = i;
    verdict.connections_killed = connections_killed;
    verdict.server_restarts = restarts;
    verdict.seed = args.seed;
    verdict.elapsed_ms = started.elapsed().as_millis() as u64;
    println!("{}", serde_json::to_string(&verdict)?);
    drop(outbox);
    if !args.keep {
        std::fs::remove_dir_all(&dir)?;
        if let Some(server) = &server {
            server.drop_schema(&schema_name(args.seed))?;
        }
    }
    let ok = verdict.lost == 0
        && verdict.unexpected_dead_letters == 0
        && verdict.dead_letters_miscounted == 0
        && verdict.out_of_order == 0
        && verdict.missing_finalizations == 0
        && verdict.wrong_finalizations == 0
        && verdict.unexplained_duplicates == 0
        && verdict.max_uncertain_per_kill <= verdict.max_sends_in_flight
        && verdict.uncertain_left == 0
        && verdict.roll.as_ref().is_none_or(Roll::held);
    Ok(if ok { 0 } else { 1 })
}

/// A rolling upgrade as it goes: when this build migrated and when the last process of
/// the older build was gone (wall-clock ms, and the producers' confirmed replies then).
#[derive(Default)]
struct RollState {
    migrated: Option<(i64, u64)>,
    rolled: Option<(i64, u64)>,
    /// This build's handle, opened to migrate.
    handle: Option<Outbox>,
    refused: u64,
    killed_old: u64,
    stopped_old: u64,
}

impl RollState {
    fn verdict(self, dir: &Path, outbox: &Outbox) -> CliResult<Roll> {
        let (from, before) = self.migrated.unwrap_or_default();
        let (to, after) = self.rolled.unwrap_or((wall_ms(), confirmed_lines(dir)));
        let platform = open_platform(&dir.join("platform.db"))?;
        let mut at =
            platform.prepare("SELECT at FROM received WHERE at BETWEEN ?1 AND ?2 ORDER BY at")?;
        let times: Vec<i64> = at
            .query_map([from, to], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        // From the migration to the first send after it, between sends, and from the
        // last one to the end of the roll.
        let longest = std::iter::once(from)
            .chain(times)
            .chain(std::iter::once(to))
            .collect::<Vec<_>>()
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default();
        let health = outbox.health()?;
        let listed = outbox
            .list(&chunked_outbox::monitoring::ListFilter::default().limit(10_000))?
            .len() as u64;
        Ok(Roll {
            refused: self.refused,
            enqueues_during_roll: after.saturating_sub(before),
            killed_old: self.killed_old,
            stopped_old: self.stopped_old,
            longest_send_pause_ms: longest.max(0) as u64,
            lease_ms: TORTURE_LEASE.as_millis() as u64,
            deliveries_miscounted: u64::from(health.totals.total_deliveries != listed),
            builds_at_end: health
                .builds()
                .iter()
                .map(|(r, _)| (*r).to_owned())
                .collect(),
        }
        .rolled(self.rolled.is_some()))
    }
}

impl Roll {
    /// Marks a roll that never replaced every older process as refused.
    fn rolled(mut self, done: bool) -> Roll {
        if !done {
            self.refused += 1;
        }
        self
    }

    /// Whether the roll kept every promise: nothing refused, enqueues went on, sending
    /// never paused past a lease, health's counts are the rows.
    fn held(&self) -> bool {
        self.refused == 0
            && self.enqueues_during_roll >= OLDER_ENQUEUES
            && self.longest_send_pause_ms <= self.lease_ms
            && self.deliveries_miscounted == 0
    }
}

/// The replies the producers confirmed so far (lines of their log).
fn confirmed_lines(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join("producer.log"))
        .map(|log| log.lines().count() as u64)
        .unwrap_or_default()
}

/// Milliseconds since the epoch, on this machine's clock (the platforms' record's).
fn wall_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// How many of health's dead-letter counts differ from what an operator lists: the
/// dead letters, those nobody acknowledged, and their failed parts.
fn dead_letters_miscounted(outbox: &Outbox) -> CliResult<u64> {
    let totals = outbox.health()?.totals;
    let listed = outbox.list(
        &chunked_outbox::monitoring::ListFilter::default()
            .status(chunked_outbox::monitoring::DeliveryStatus::Failed)
            .limit(10_000),
    )?;
    let unacknowledged = listed
        .iter()
        .filter(|d| d.acknowledged_at.is_none())
        .count();
    let mut failed_parts = 0;
    for d in &listed {
        if let Some(view) = outbox.delivery(d.id)? {
            failed_parts += view
                .chunks
                .iter()
                .filter(|c| c.status == chunked_outbox::monitoring::ChunkStatus::Failed)
                .count();
        }
    }
    Ok([
        (totals.failed_deliveries, listed.len()),
        (totals.unacknowledged_dead_letters, unacknowledged),
        (totals.failed_chunks, failed_parts),
    ]
    .iter()
    .filter(|(counted, seen)| *counted != *seen as u64)
    .count() as u64)
}

/// One process under torture.
pub fn role(args: &RoleArgs) -> CliResult<u8> {
    let platform = args.dir.join("platform.db");
    // Every role stops when the run ends, or when this process alone is asked to (a
    // clean stop, as a rolling upgrade stops a process of the older build).
    let (all, own) = (
        stop_path(&args.dir),
        own_stop_path(&args.dir, args.generation),
    );
    let stopping = || all.exists() || own.exists();
    let outbox = open_outbox(&args.dir, args.skew_ms)?;
    match args.role {
        Role::Producer => produce(&outbox, &args.dir, args.seed, args.replies, &own),
        Role::Dispatcher => {
            // Who this process is, for the verdict to attribute what a kill leaves.
            let mut claimants = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(args.dir.join("claimants.log"))?;
            writeln!(claimants, "{} {}", args.generation, outbox.claimant())?;
            let mut builder = Dispatcher::builder(outbox.clone())
                .workers(DISPATCH_WORKERS)
                .batch_size(DISPATCH_BATCH)
                .poll_interval(Duration::from_millis(10))
                .settle_interval(Duration::from_millis(100));
            for (i, channel) in CHANNELS.iter().enumerate() {
                let seed = args.seed.wrapping_mul(31).wrapping_add(i as u64);
                builder = builder.adapter(
                    channel.name,
                    SimPlatform::new(channel, open_platform(&platform)?, seed)
                        .logging_settlements(&args.dir.join("settle.log"))?,
                );
            }
            let running = builder.build()?.start()?;
            while !stopping() {
                std::thread::sleep(Duration::from_millis(10));
            }
            running.shutdown(Duration::from_secs(10));
            Ok(0)
        }
        Role::Maintenance => {
            let api = PlatformApi::open(&platform)?;
            let mut log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(args.dir.join("operator.log"))?;
            let mut rng = fastrand::Rng::with_seed(args.seed);
            while !stopping() {
                retrying(|| outbox.recover(RecoverScope::ExpiredLeases))?;
                match settle_like_an_operator(&outbox, &api, OPERATOR_GRACE, &mut log) {
                    Err(e) if e.downcast_ref::<Error>().is_some_and(transient) => {}
                    other => drop(other?),
                }
                if rng.u8(0..4) == 0 {
                    retrying(|| outbox.purge(chrono::Utc::now() - chrono::Duration::seconds(1)))?;
                }
                if rng.u8(0..10) == 0 {
                    let _ = outbox.checkpoint(); // busy readers may defer it
                }
                std::thread::sleep(Duration::from_millis(rng.u64(5..30)));
            }
            Ok(0)
        }
    }
}

/// Enqueues replies `0..replies` with caller keys, logging each id once `enqueue`
/// returned. A restarted producer resumes after the last logged reply and enqueues it
/// again under the same key, which the outbox deduplicates.
fn produce(outbox: &Outbox, dir: &Path, seed: u64, replies: u64, stop: &Path) -> CliResult<u8> {
    let log_path = dir.join("producer.log");
    let next = std::fs::read_to_string(&log_path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(' ')?.0.parse::<u64>().ok())
        .max()
        .map_or(0, |n| n + 1);
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    for n in next..replies {
        if stop.exists() {
            return Ok(0);
        }
        let (channel, chat) = chat_of(seed, n);
        let mut rng = fastrand::Rng::with_seed(n);
        let text = reply_text(&mut rng, n as usize);
        let reply = NewDelivery::split(
            CHANNELS[channel].name,
            chat,
            text,
            &CHANNELS[channel].splitter,
        )?
        .with_idempotency_key(format!("torture-{n}"));
        // The caller key makes a retry safe, whatever happened to the first call.
        let id = retrying(|| outbox.enqueue(&reply))?.id;
        log.write_all(format!("{n} {id}\n").as_bytes())?;
        if n % 8 == 7 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(0)
}

/// Checks every promise; `killed` holds each dispatcher killed (its generation), with
/// the server's faults it lived through.
fn verify(dir: &Path, outbox: &Outbox, seed: u64, killed: &[(u64, u64)]) -> CliResult<Verdict> {
    let mut v = Verdict::default();
    // What the producer knows it enqueued (enqueue returned Ok), in order.
    let mut confirmed: Vec<(u64, DeliveryId)> = Vec::new();
    let mut seen_n = HashSet::new();
    for line in std::fs::read_to_string(dir.join("producer.log"))?.lines() {
        let Some((n, id)) = line.split_once(' ') else {
            continue;
        }; // a torn last line
        let (Ok(n), Ok(id)) = (n.parse::<u64>(), id.parse::<DeliveryId>()) else {
            continue;
        };
        if seen_n.insert(n) {
            confirmed.push((n, id));
        }
    }
    confirmed.sort();
    v.deliveries = confirmed.len() as u64;

    let record = PlatformRecord::read(&open_platform(&dir.join("platform.db"))?)?;
    let arrived = record.keys();
    let log = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    let operator = OperatorLog::read(&(log("operator.log") + &log("settle.log")));
    let duplicates = record.duplicates(&operator.blind);
    v.settling = Settling::of(&operator, &duplicates);
    v.replays_deduplicated = duplicates.deduplicated;
    v.duplicates_by_policy = duplicates.by_policy;
    v.unexplained_duplicates = duplicates.unexplained;
    v.resent_blind = operator.blind.len() as u64;
    v.settled_by_lookup = operator.looked_up;
    let mut rows = outbox_target(dir).history()?;

    // Each confirmed delivery: finalized (an outbound_messages row), a dead letter, or lost.
    let mut position: HashMap<String, (u64, u32)> = HashMap::new();
    for (n, id) in &confirmed {
        let uid = id.to_string();
        let finalized = rows.remove(&uid);
        let stored = outbox.delivery(*id)?;
        let expected = reply_text(&mut fastrand::Rng::with_seed(*n), *n as usize);
        let chunks = match (&finalized, &stored) {
            (Some((content, count)), _) => {
                let split = stored.as_ref().map_or(*count, |d| d.chunk_count);
                if *content != expected || split != *count {
                    v.wrong_finalizations += 1;
                }
                *count
            }
            (None, Some(d)) => d.chunk_count,
            (None, None) => {
                // Gone from the outbox without a history row: only an acknowledged dead
                // letter may be purged like that (the operator logged each one it saw),
                // and only chats that no longer exist should produce dead letters.
                match (
                    operator.dead.contains(&uid),
                    chat_is_gone(&chat_of(seed, *n).1),
                ) {
                    (true, true) => v.dead_letters += 1,
                    (true, false) => v.unexpected_dead_letters += 1,
                    (false, _) => v.lost += 1,
                }
                continue;
            }
        };
        v.chunks += u64::from(chunks);
        let keys: Vec<String> = (0..chunks)
            .map(|i| chunked_outbox::ids::chunk_idempotency_key(id, i))
            .collect();
        let got = keys.iter().filter(|k| arrived.contains(k.as_str())).count() as u32;
        match (&finalized, stored.as_ref().map(|d| d.status)) {
            (Some(_), _) => v.lost += u64::from(chunks - got),
            (None, Some(chunked_outbox::monitoring::DeliveryStatus::Failed)) => {
                if chat_is_gone(&chat_of(seed, *n).1) {
                    v.dead_letters += 1;
                } else {
                    v.unexpected_dead_letters += 1;
                }
            }
            (None, Some(chunked_outbox::monitoring::DeliveryStatus::Uncertain)) => {}
            (None, _) if got == chunks => v.missing_finalizations += 1,
            (None, _) => v.lost += 1,
        }
        for (i, key) in keys.into_iter().enumerate() {
            position.insert(key, (*n, i as u32));
        }
    }
    // History rows of deliveries nobody enqueued.
    v.wrong_finalizations += rows.len() as u64;
    v.dead_letters_miscounted = dead_letters_miscounted(outbox)?;
    v.out_of_order = record.chats_out_of_order(&position);

    // What each kill of a dispatcher left uncertain: the chunks the operator found held
    // under the dead process's claimant, plus any still held at the end, per stranding
    // (its kill and each fault of the server it lived through).
    let mut held_at_end: HashMap<String, HashSet<(u32, String)>> = HashMap::new();
    let h = outbox.health()?;
    v.uncertain_left = h.totals.uncertain_chunks;
    if v.uncertain_left > 0 {
        let filter = chunked_outbox::monitoring::ListFilter::default()
            .status(chunked_outbox::monitoring::DeliveryStatus::Uncertain)
            .limit(10_000);
        for d in outbox.list(&filter)? {
            for c in outbox.delivery(d.id)?.into_iter().flat_map(|d| d.chunks) {
                if let (chunked_outbox::monitoring::ChunkStatus::Uncertain, Some(claimant)) =
                    (c.status, c.claimant)
                {
                    held_at_end
                        .entry(claimant.to_string())
                        .or_default()
                        .insert((c.attempts, c.idempotency_key));
                }
            }
        }
    }
    let claimants: HashMap<u64, String> = std::fs::read_to_string(dir.join("claimants.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (g, c) = l.split_once(' ')?;
            Some((g.parse().ok()?, c.to_owned()))
        })
        .collect();
    let empty = HashSet::new();
    for (generation, faults) in killed {
        let Some(claimant) = claimants.get(generation) else {
            continue; // killed before it claimed anything
        };
        let seen = operator
            .uncertain_by_claimant
            .get(claimant)
            .unwrap_or(&empty);
        let left = held_at_end.get(claimant).unwrap_or(&empty);
        let strandings = 1 + faults;
        v.max_uncertain_per_kill = v
            .max_uncertain_per_kill
            .max((seen.union(left).count() as u64).div_ceil(strandings));
    }
    v.max_sends_in_flight = (DISPATCH_WORKERS * DISPATCH_BATCH) as u64;
    Ok(v)
}

// ------------------------------------------------------------------ contention ----

/// Options of `outbox-lab stress`.
#[derive(Args)]
pub struct StressArgs {
    /// Dispatcher processes.
    #[arg(long, default_value_t = 4)]
    dispatchers: usize,
    /// Worker threads per dispatcher process.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Replies the enqueuer process writes (one chunk each).
    #[arg(long, default_value_t = 20_000)]
    replies: u64,
}

/// Options of the hidden stress role process.
#[derive(Args)]
pub struct StressRoleArgs {
    #[arg(long)]
    dir: PathBuf,
    /// `enqueue`, `health`, or `dispatch`.
    #[arg(long)]
    kind: String,
    #[arg(long, default_value_t = 0)]
    replies: u64,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[arg(long, default_value_t = 0)]
    index: usize,
}

#[derive(Debug, Default, Serialize, serde::Deserialize)]
struct StressReport {
    busy_errors: u64,
    other_errors: u64,
    operations: u64,
}

/// Records every key it is handed; never fails.
struct KeyRecorder(Mutex<Vec<String>>, AtomicU64);

impl ChannelAdapter for KeyRecorder {
    fn send(&self, claim: &Claim) -> Outcome {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(claim.idempotency_key.clone());
        self.1.fetch_add(1, Ordering::Relaxed);
        Outcome::delivered(None)
    }
}

fn count_error(report: &mut StressReport, e: &Error) {
    if matches!(e, Error::Busy) {
        report.busy_errors += 1
    } else {
        report.other_errors += 1
    }
}

pub fn stress(db: Option<&Path>, args: &StressArgs) -> CliResult<u8> {
    if db.is_some() {
        return Err("stress works in a fresh temporary directory; do not pass --db".into());
    }
    let dir = std::env::temp_dir().join(format!("outbox-stress-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let outbox = Outbox::open(dir.join("outbox.db"), OutboxOptions::default())?;
    let started = Instant::now();
    let spawn_role = |kind: &str, index: usize| -> CliResult<Child> {
        Ok(Command::new(std::env::current_exe()?)
            .args(["stress-role", "--kind", kind, "--dir"])
            .arg(&dir)
            .args([
                "--replies",
                &args.replies.to_string(),
                "--workers",
                &args.workers.to_string(),
            ])
            .args(["--index", &index.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()?)
    };
    let mut children = vec![spawn_role("enqueue", 0)?, spawn_role("health", 0)?];
    for i in 0..args.dispatchers {
        children.push(spawn_role("dispatch", i)?);
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    while outbox.health()?.totals.delivered_deliveries < args.replies {
        if Instant::now() > deadline {
            return Err("stress did not finish within 10 minutes".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = started.elapsed();
    std::fs::write(stop_path(&dir), b"")?;
    let mut total = StressReport::default();
    let mut keys = HashSet::new();
    let mut claimed_twice = 0;
    for (i, child) in children.iter_mut().enumerate() {
        if !child.wait()?.success() {
            return Err(format!("stress process {i} failed").into());
        }
    }
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        if name.ends_with(".report.json") {
            let r: StressReport = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
            total.busy_errors += r.busy_errors;
            total.other_errors += r.other_errors;
        } else if name.ends_with(".keys") {
            for key in std::fs::read_to_string(&path)?.lines() {
                if !keys.insert(key.to_owned()) {
                    claimed_twice += 1;
                }
            }
        }
    }
    let per_s = args.replies as f64 / elapsed.as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "dispatcher_processes": args.dispatchers,
            "workers_per_process": args.workers,
            "chunks": args.replies,
            "sent": keys.len() + claimed_twice,
            "claimed_twice": claimed_twice,
            "busy_errors": total.busy_errors,
            "other_errors": total.other_errors,
            "elapsed_ms": elapsed.as_millis() as u64,
            "chunks_per_s": per_s.round(),
        })
    );
    drop(outbox);
    std::fs::remove_dir_all(&dir)?;
    Ok(
        if claimed_twice == 0
            && total.busy_errors == 0
            && total.other_errors == 0
            && keys.len() as u64 == args.replies
        {
            0
        } else {
            1
        },
    )
}

pub fn stress_role(args: &StressRoleArgs) -> CliResult<u8> {
    let outbox = Outbox::open(args.dir.join("outbox.db"), OutboxOptions::default())?;
    let stop = stop_path(&args.dir);
    let mut report = StressReport::default();
    let name = format!("{}-{}", args.kind, args.index);
    match args.kind.as_str() {
        "enqueue" => {
            for n in 0..args.replies {
                let reply = NewDelivery::single(
                    "stress",
                    format!("chat-{}", n % 500),
                    format!("reply {n}"),
                );
                match outbox.enqueue(&reply) {
                    Ok(_) => report.operations += 1,
                    Err(e) => count_error(&mut report, &e),
                }
            }
        }
        "health" => {
            while !stop.exists() {
                match outbox.health() {
                    Ok(_) => report.operations += 1,
                    Err(e) => count_error(&mut report, &e),
                }
            }
        }
        "dispatch" => {
            let recorder = std::sync::Arc::new(KeyRecorder(Mutex::default(), AtomicU64::new(0)));
            let running = Dispatcher::builder(outbox.clone())
                .adapter("stress", SharedRecorder(recorder.clone()))
                .workers(args.workers)
                .batch_size(32)
                .build()?
                .start()?;
            while !stop.exists() {
                std::thread::sleep(Duration::from_millis(10));
            }
            let shutdown = running.shutdown(Duration::from_secs(30));
            report.operations = recorder.1.load(Ordering::Relaxed);
            report.other_errors += shutdown.stats.errors;
            let keys = recorder
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .join("\n");
            std::fs::write(args.dir.join(format!("{name}.keys")), keys)?;
        }
        other => return Err(format!("unknown stress role {other}").into()),
    }
    std::fs::write(
        args.dir.join(format!("{name}.report.json")),
        serde_json::to_string(&report)?,
    )?;
    Ok(0)
}

struct SharedRecorder(std::sync::Arc<KeyRecorder>);

impl ChannelAdapter for SharedRecorder {
    fn send(&self, claim: &Claim) -> Outcome {
        self.0.send(claim)
    }
}
