//! `outbox`: inspect and repair a chunked-outbox database, read its health for
//! monitoring, and run the demo.

mod demo;
mod render;
mod sim;
mod torture;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use chunked_outbox::{
    ChunkId, DeliveryId, DeliveryStatus, Error, Health, ListFilter, Outbox, OutboxOptions,
    RecoverScope, Resolution,
};
use clap::{Args, Parser, Subcommand, ValueEnum};

/// Inspect, repair and monitor a chunked-outbox database.
#[derive(Parser)]
#[command(name = "outbox", version, about, long_about = None)]
struct Cli {
    /// The outbox database file.
    #[arg(long, global = true, env = "OUTBOX_DB", value_name = "PATH")]
    db: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a health snapshot; the exit status is 0 ok, 1 warn, 2 fail (3: could not tell).
    Health(HealthArgs),
    /// List deliveries, newest first.
    List(ListArgs),
    /// Show one delivery and each of its chunks.
    Show {
        /// The delivery id (a UUID).
        delivery: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Send a failed or uncertain delivery again (or every dead letter with --failed).
    Requeue {
        /// The delivery id.
        #[arg(required_unless_present = "failed", conflicts_with = "failed")]
        delivery: Option<String>,
        /// Requeue every dead letter.
        #[arg(long)]
        failed: bool,
    },
    /// Settle a chunk held as uncertain.
    Resolve {
        /// The chunk id (from `outbox show`).
        chunk: String,
        /// It reached the platform: mark it delivered.
        #[arg(long, conflicts_with = "resend", required_unless_present = "resend")]
        delivered: bool,
        /// It did not: send it again with the same idempotency key.
        #[arg(long)]
        resend: bool,
        /// The platform's message id, with --delivered.
        #[arg(long, requires = "delivered")]
        platform_id: Option<String>,
    },
    /// Acknowledge every dead letter (health stops failing on them; they stay listed).
    AckDeadLetters,
    /// Remove finished deliveries older than a duration (their `messages` rows stay).
    Purge {
        /// Age such as 7d, 12h, 30m.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Duration,
    },
    /// Settle chunks whose worker died, and finalize fully delivered deliveries.
    Recover {
        /// Treat every `sending` chunk as abandoned, not only expired leases. Only when no
        /// other process is sending from this file.
        #[arg(long)]
        all_sending: bool,
    },
    /// Create the database if needed and bring its schema up to date.
    Migrate,
    /// The main job: a simulated chat engine, a flaky platform, real crashes, a verdict.
    Demo(demo::DemoArgs),
    /// Internal: the demo's worker process.
    #[command(hide = true)]
    DemoWorker(demo::WorkerArgs),
    /// Crash-test this machine: SIGKILL producer, dispatcher and maintenance processes
    /// at random moments, restart them, and verify the invariants (JSON verdict).
    Torture(torture::TortureArgs),
    /// Internal: a process under torture.
    #[command(hide = true)]
    TortureRole(torture::RoleArgs),
    /// Contention run: dispatcher processes, an enqueuer and a health reader on one file.
    Stress(torture::StressArgs),
    /// Internal: a process of the stress run.
    #[command(hide = true)]
    StressRole(torture::StressRoleArgs),
}

#[derive(Args)]
struct HealthArgs {
    /// Print the snapshot as JSON.
    #[arg(long, conflicts_with = "prometheus")]
    json: bool,
    /// Print Prometheus text exposition.
    #[arg(long)]
    prometheus: bool,
    /// Warn when a chunk has been due longer than this.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    warn_due_age: Duration,
    /// Warn when more than this many leases have expired.
    #[arg(long, default_value_t = 0)]
    warn_expired_leases: u64,
    /// Fail when more than this many dead letters are unacknowledged.
    #[arg(long, default_value_t = 0)]
    fail_dead_letters: u64,
    /// Fail when more than this many chunks are uncertain.
    #[arg(long, default_value_t = 0)]
    fail_uncertain: u64,
}

#[derive(Args)]
struct ListArgs {
    /// Only this status.
    #[arg(long, value_enum)]
    status: Option<StatusArg>,
    /// Only this channel.
    #[arg(long)]
    channel: Option<String>,
    /// Only this chat.
    #[arg(long)]
    chat: Option<String>,
    /// At most this many.
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum StatusArg {
    Queued,
    Pending,
    Partial,
    Uncertain,
    Failed,
    Delivered,
}

impl From<StatusArg> for DeliveryStatus {
    fn from(s: StatusArg) -> Self {
        match s {
            StatusArg::Queued => DeliveryStatus::Queued,
            StatusArg::Pending => DeliveryStatus::Pending,
            StatusArg::Partial => DeliveryStatus::Partial,
            StatusArg::Uncertain => DeliveryStatus::Uncertain,
            StatusArg::Failed => DeliveryStatus::Failed,
            StatusArg::Delivered => DeliveryStatus::Delivered,
        }
    }
}

/// Exit status when the tool could not do its job (Nagios' "unknown").
const EXIT_ERROR: u8 = 3;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_ERROR } else { 0 });
        }
    };
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

pub(crate) type CliResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn run(cli: Cli) -> CliResult<u8> {
    let db = cli.db.as_deref();
    match cli.command {
        Command::Health(args) => health(&open_existing(db)?, &args),
        Command::List(args) => {
            let filter = ListFilter {
                status: args.status.map(Into::into),
                channel: args.channel,
                chat_id: args.chat,
                limit: args.limit,
            };
            let deliveries = open_existing(db)?.list(&filter)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&deliveries)?);
            } else {
                print!("{}", render::list(&deliveries));
            }
            Ok(0)
        }
        Command::Show { delivery, json } => {
            let id: DeliveryId = delivery.parse()?;
            let view = open_existing(db)?
                .delivery(id)?
                .ok_or(Error::DeliveryNotFound(id))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&view)?);
            } else {
                print!("{}", render::show(&view));
            }
            Ok(0)
        }
        Command::Requeue { delivery, .. } => {
            // clap makes DELIVERY and --failed exclusive, and one of them required.
            let outbox = open_existing(db)?;
            let count = match delivery {
                Some(id) => {
                    outbox.requeue_delivery(id.parse()?)?;
                    1
                }
                None => outbox.requeue_dead_letters()?,
            };
            println!("requeued {}", plural(count, "delivery", "deliveries"));
            Ok(0)
        }
        Command::Resolve {
            chunk,
            delivered,
            platform_id,
            ..
        } => {
            let chunk: ChunkId = chunk.parse()?;
            let resolution = if delivered {
                Resolution::Delivered {
                    platform_message_id: platform_id,
                }
            } else {
                Resolution::Resend
            };
            let recorded = open_existing(db)?.resolve_uncertain(chunk, resolution)?;
            println!(
                "chunk {chunk} is now {}{}",
                recorded.status,
                if recorded.finalized {
                    "; its delivery is finalized"
                } else {
                    ""
                }
            );
            Ok(0)
        }
        Command::AckDeadLetters => {
            let n = open_existing(db)?.acknowledge_dead_letters()?;
            println!("acknowledged {}", plural(n, "dead letter", "dead letters"));
            Ok(0)
        }
        Command::Purge { older_than } => {
            let outbox = open_existing(db)?;
            let cutoff = chrono::Utc::now()
                - chrono::Duration::from_std(older_than)
                    .map_err(|_| "--older-than is too large")?;
            let report = outbox.purge(cutoff)?;
            outbox.checkpoint().ok();
            println!(
                "purged {} ({}) finished before {}",
                plural(report.deliveries, "delivery", "deliveries"),
                plural(report.chunks, "chunk", "chunks"),
                cutoff.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            );
            Ok(0)
        }
        Command::Recover { all_sending } => {
            let scope = if all_sending {
                RecoverScope::AllSending
            } else {
                RecoverScope::ExpiredLeases
            };
            let r = open_existing(db)?.recover(scope)?;
            println!(
                "retried {}, held uncertain {}, failed {}, finalized {}",
                r.retried, r.held_uncertain, r.failed, r.finalized
            );
            Ok(0)
        }
        Command::Migrate => {
            let path = require_db(db)?;
            Outbox::open(path, OutboxOptions::default())?;
            println!(
                "{} is at schema version {}",
                path.display(),
                chunked_outbox::SCHEMA_VERSION
            );
            Ok(0)
        }
        Command::Demo(args) => demo::run(db, &args),
        Command::DemoWorker(args) => demo::worker(&args),
        Command::Torture(args) => torture::run(db, &args),
        Command::TortureRole(args) => torture::role(&args),
        Command::Stress(args) => torture::stress(db, &args),
        Command::StressRole(args) => torture::stress_role(&args),
    }
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn require_db(db: Option<&Path>) -> CliResult<&Path> {
    db.ok_or_else(|| "no database: pass --db PATH or set OUTBOX_DB".into())
}

/// Opens an existing database; a missing file is an error and nothing is created.
fn open_existing(db: Option<&Path>) -> CliResult<Outbox> {
    let path = require_db(db)?;
    Ok(Outbox::open(
        path,
        OutboxOptions::default().with_create_if_missing(false),
    )?)
}

/// Prints the snapshot and turns it into an exit status.
fn health(outbox: &Outbox, args: &HealthArgs) -> CliResult<u8> {
    let h = outbox.health()?;
    let (code, reasons) = verdict(&h, args);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&h)?);
    } else if args.prometheus {
        print!("{}", h.to_prometheus());
    } else {
        print!("{}", render::health(&h));
        let word = ["ok", "warn", "fail"][usize::from(code)];
        println!(
            "status: {word}{}",
            if reasons.is_empty() {
                String::new()
            } else {
                format!(" ({})", reasons.join("; "))
            }
        );
    }
    Ok(code)
}

fn verdict(h: &Health, args: &HealthArgs) -> (u8, Vec<String>) {
    let t = &h.totals;
    let mut code = 0;
    let mut reasons = Vec::new();
    let mut flag = |level: u8, reason: String| {
        code = code.max(level);
        reasons.push(reason);
    };
    if t.unacknowledged_dead_letters > args.fail_dead_letters {
        flag(
            2,
            format!(
                "{} unacknowledged dead letters",
                t.unacknowledged_dead_letters
            ),
        );
    }
    if t.uncertain_chunks > args.fail_uncertain {
        flag(2, format!("{} uncertain chunks", t.uncertain_chunks));
    }
    if t.expired_leases > args.warn_expired_leases {
        flag(1, format!("{} expired leases", t.expired_leases));
    }
    if let Some(age) = t
        .oldest_due_age_ms
        .filter(|ms| *ms > args.warn_due_age.as_millis() as u64)
    {
        flag(
            1,
            format!(
                "a chunk has been due for {}",
                humantime::format_duration(Duration::from_secs(age / 1000))
            ),
        );
    }
    (code, reasons)
}
