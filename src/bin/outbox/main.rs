//! `outbox`: inspect and repair a chunked-outbox database, and read its health for
//! monitoring. (The demo and the crash harnesses are `outbox-lab`'s.)
//!
//! Commands that only read (`health`, `list`, `show`, `config show`) open the file
//! read-only: they create nothing, change no schema and switch no journal mode, and
//! refuse a file that is not an outbox. Repair commands open it without upgrading its
//! schema; only `migrate` creates a file or brings its schema up to date.

mod config;
mod exit;
mod render;
mod serve;
mod target;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chunked_outbox::maintenance::{RecoverScope, Resolution};
use chunked_outbox::monitoring::{self, DeliveryStatus, Level, ListFilter};
use chunked_outbox::{DeliveryId, Error, Outbox, OutboxOptions};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::render::clean;
use crate::target::Target;

pub(crate) use exit::CliResult;

/// Inspect, repair and monitor a chunked-outbox database.
#[derive(Parser)]
#[command(name = "outbox", version, about, long_about = None)]
struct Cli {
    /// The outbox: an SQLite file, or a PostgreSQL URL (`postgres://…`) or key-value
    /// connection string (`host=a,b port=5432,5432 dbname=chat
    /// target_session_attrs=read-write`; a build with the `postgres` feature), whose
    /// `search_path` option names the outbox's schema.
    #[arg(long, global = true, env = "OUTBOX_DB", value_name = "PATH|URL")]
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
        /// The delivery id (a UUID, as `outbox list` prints it).
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
        /// With --failed: only this channel's dead letters.
        #[arg(long, requires = "failed")]
        channel: Option<String>,
    },
    /// Withdraw a reply none of whose chunks has started (a started one is finished).
    Cancel {
        /// The delivery id.
        delivery: String,
    },
    /// Settle a chunk held as uncertain.
    Resolve {
        /// The chunk's key, `{delivery}:{n}` (n from 1, as `outbox show` prints it).
        chunk: String,
        /// It reached the platform: mark it delivered.
        #[arg(long, conflicts_with = "resend", required_unless_present = "resend")]
        delivered: bool,
        /// It did not: send it again with the same idempotency key.
        #[arg(long)]
        resend: bool,
        /// The platform's message id, with --delivered.
        #[arg(long, requires = "delivered", conflicts_with = "resend")]
        platform_id: Option<String>,
    },
    /// Dismiss dead letters: they have been seen (health stops failing on them; they stay
    /// listed and requeueable).
    #[command(alias = "ack-dead-letters")]
    DismissDeadLetters {
        /// Only this channel's dead letters.
        #[arg(long)]
        channel: Option<String>,
    },
    /// Remove finished deliveries older than a duration (their `outbound_messages` rows stay).
    Purge {
        /// Age such as 7d, 12h, 30m.
        #[arg(long, value_parser = cutoff)]
        older_than: Cutoff,
        /// Say what would be removed, and remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Settle chunks whose worker died, and finalize fully delivered deliveries.
    Recover {
        /// Treat every `sending` chunk as abandoned, not only expired leases. Only when no
        /// other process is sending from this file.
        #[arg(long)]
        all_sending: bool,
    },
    /// Serve /metrics (Prometheus text), /healthz (200 ok or warn, 503 fail, with the
    /// reasons; the thresholds of `health`) and /health.json over HTTP.
    Serve(serve::ServeArgs),
    /// Show or change the rules stored in the file (lane order, retries, channel rules).
    #[command(subcommand)]
    Config(config::ConfigCommand),
    /// Create the database if needed and bring its schema up to date (the only command
    /// that changes a schema); list the processes writing it, and take a contract step
    /// once none of an older build is live (exit 1 while one is).
    Migrate {
        /// Take a contract step although processes of older builds are live: each of
        /// their writes is refused from then on (`SchemaTooNew`).
        #[arg(long)]
        force: bool,
    },
}

#[derive(Args)]
struct HealthArgs {
    /// Print the snapshot as JSON.
    #[arg(long, conflicts_with = "prometheus")]
    json: bool,
    /// Print Prometheus text exposition.
    #[arg(long)]
    prometheus: bool,
    /// Exit 0 whatever the snapshot says (for textfile collectors that run the tool
    /// from cron); the status still goes to stderr.
    #[arg(long)]
    exit_zero: bool,
    #[command(flatten)]
    thresholds: Thresholds,
}

/// When a snapshot warns or fails (`outbox health`'s exit status, `outbox serve`'s
/// `/healthz`).
#[derive(Args)]
pub(crate) struct Thresholds {
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
    /// Only the delivery enqueued with this caller idempotency key.
    #[arg(long)]
    key: Option<String>,
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
    Cancelled,
    Unfinalized,
}

impl From<StatusArg> for DeliveryStatus {
    fn from(s: StatusArg) -> Self {
        match s {
            StatusArg::Unfinalized => DeliveryStatus::Unfinalized,
            StatusArg::Queued => DeliveryStatus::Queued,
            StatusArg::Pending => DeliveryStatus::Pending,
            StatusArg::Partial => DeliveryStatus::Partial,
            StatusArg::Uncertain => DeliveryStatus::Uncertain,
            StatusArg::Failed => DeliveryStatus::Failed,
            StatusArg::Delivered => DeliveryStatus::Delivered,
            StatusArg::Cancelled => DeliveryStatus::Cancelled,
        }
    }
}

/// `--older-than`: an age, reaching back from the outbox's time (the server's, on
/// PostgreSQL: this host's clock may be minutes off).
#[derive(Clone, Copy)]
struct Cutoff(chrono::Duration);

impl Cutoff {
    /// The time `self` before the outbox's.
    fn before(self, outbox: &Outbox) -> DateTime<Utc> {
        outbox
            .now()
            .checked_sub_signed(self.0)
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }
}

/// Parses an age such as `7d`, refusing ages that reach before the calendar can (a
/// usage error, not a crash).
fn cutoff(s: &str) -> Result<Cutoff, String> {
    let age = humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))?;
    chrono::Duration::from_std(age)
        .ok()
        .filter(|age| Utc::now().checked_sub_signed(*age).is_some())
        .map(Cutoff)
        .ok_or_else(|| format!("{s:?} reaches further back than any date; give a smaller age"))
}

fn main() -> ExitCode {
    exit::main(run)
}

fn run(cli: Cli) -> CliResult<u8> {
    let db = cli.db.as_deref();
    match cli.command {
        Command::Health(args) => health(&open_read_only(db)?, &args),
        // Read-only unless the console may act: then opened as a repair is.
        Command::Serve(args) if args.takes_actions() => serve::serve(&open_for_repair(db)?, &args),
        Command::Serve(args) => serve::serve(&open_read_only(db)?, &args),
        Command::List(args) => {
            let mut filter = ListFilter::default().limit(args.limit);
            filter.status = args.status.map(Into::into);
            filter.channel = args.channel;
            filter.chat_id = args.chat;
            filter.idempotency_key = args.key;
            let outbox = open_read_only(db)?;
            let deliveries = outbox.list(&filter)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&deliveries)?);
            } else {
                print!("{}", render::list(&deliveries));
                for row in outbox.corrupt_rows()? {
                    println!(
                        "corrupt row {} (uid {}): {}",
                        row.row,
                        clean(&row.uid),
                        clean(&row.reason)
                    );
                }
            }
            Ok(0)
        }
        Command::Show { delivery, json } => {
            let id = delivery_id(&delivery)?;
            let view = open_read_only(db)?
                .delivery(id)?
                .ok_or(Error::DeliveryNotFound(id))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&view)?);
            } else {
                print!("{}", render::show(&view));
            }
            Ok(0)
        }
        Command::Requeue {
            delivery, channel, ..
        } => {
            // clap makes DELIVERY and --failed exclusive, and one of them required.
            let outbox = open_for_repair(db)?;
            let count = match delivery {
                Some(id) => {
                    outbox.requeue_delivery(delivery_id(&id)?)?;
                    1
                }
                None => outbox.requeue_dead_letters(channel.as_deref())?,
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
            let outbox = open_for_repair(db)?;
            let (delivery, n) = chunk_key(&chunk)?;
            let view = outbox
                .delivery(delivery)?
                .ok_or(Error::DeliveryNotFound(delivery))?;
            let target = view
                .chunks
                .iter()
                .find(|c| c.index + 1 == n)
                .ok_or_else(|| {
                    format!(
                        "delivery {delivery} has {} chunks; there is no chunk {n} ({chunk:?})",
                        view.chunk_count
                    )
                })?;
            let resolution = if delivered {
                Resolution::Delivered {
                    platform_message_id: platform_id,
                }
            } else {
                Resolution::Resend
            };
            let recorded =
                outbox
                    .resolve_uncertain(target.id, resolution)
                    .map_err(|e| {
                        match e {
                    Error::InvalidState { status, .. } => format!(
                        "chunk {delivery}:{n} is {status}; only an uncertain chunk can be resolved"
                    )
                    .into(),
                    other => Box::new(other) as Box<dyn std::error::Error + Send + Sync>,
                }
                    })?;
            println!(
                "chunk {delivery}:{n} is now {}{}",
                recorded.status,
                if recorded.finalized {
                    "; its delivery is finalized"
                } else {
                    ""
                }
            );
            Ok(0)
        }
        Command::Cancel { delivery } => {
            let id = delivery_id(&delivery)?;
            open_for_repair(db)?.cancel(id)?;
            println!("delivery {id} is cancelled");
            Ok(0)
        }
        Command::DismissDeadLetters { channel } => {
            let n = open_for_repair(db)?.dismiss_dead_letters(channel.as_deref())?;
            println!("dismissed {}", plural(n, "dead letter", "dead letters"));
            Ok(0)
        }
        Command::Purge {
            older_than,
            dry_run,
        } => {
            let outbox = if dry_run {
                open_read_only(db)?
            } else {
                open_for_repair(db)?
            };
            let cutoff = older_than.before(&outbox);
            let before = cutoff.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
            if dry_run {
                let report = outbox.purge_preview(cutoff)?;
                println!(
                    "would purge {} ({}) finished before {before}; nothing was removed",
                    plural(report.deliveries, "delivery", "deliveries"),
                    plural(report.chunks, "chunk", "chunks"),
                );
                return Ok(0);
            }
            let report = outbox.purge(cutoff)?;
            outbox.checkpoint().ok();
            println!(
                "purged {} ({}) finished before {before}",
                plural(report.deliveries, "delivery", "deliveries"),
                plural(report.chunks, "chunk", "chunks"),
            );
            Ok(0)
        }
        Command::Recover { all_sending } => {
            let scope = if all_sending {
                RecoverScope::AllSending
            } else {
                RecoverScope::ExpiredLeases
            };
            let r = open_for_repair(db)?.recover(scope)?;
            println!(
                "retried {}, held uncertain {}, failed {}, finalized {}",
                r.retried, r.held_uncertain, r.failed, r.finalized
            );
            Ok(0)
        }
        Command::Config(command) => {
            let outbox = match command {
                config::ConfigCommand::Show { .. } => open_read_only(db)?,
                config::ConfigCommand::Set(_) => open_for_repair(db)?,
            };
            config::run(&outbox, &command)
        }
        Command::Migrate { force } => {
            let target = Target::of(require_db(db)?);
            let outbox = target.open(OutboxOptions::default())?;
            let step = outbox.contract_step(force)?;
            let store = match target {
                Target::File(_) => "SQLite",
                Target::Postgres(_) => "PostgreSQL",
            };
            println!(
                "{}: up to date for this build's {store} schema version {}",
                target.describe(),
                outbox.schema_version()
            );
            let others: Vec<_> = outbox
                .processes()?
                .into_iter()
                .filter(|p| p.id != outbox.claimant().to_string())
                .collect();
            println!(
                "{} writing it besides this one:",
                plural(others.len() as u64, "process", "processes")
            );
            print!("{}", render::processes(&others, outbox.now()));
            use chunked_outbox::registry::ContractStep;
            match step {
                ContractStep::NotDue => {
                    println!("contract step: none due (older builds that it accepts keep writing)");
                    Ok(0)
                }
                ContractStep::Applied {
                    writable_from,
                    stopped,
                } => {
                    println!(
                        "contract step taken: it accepts builds of schema {writable_from} or later"
                    );
                    if !stopped.is_empty() {
                        println!(
                            "forced: {} of older builds can no longer write (each write is refused):",
                            plural(stopped.len() as u64, "process", "processes")
                        );
                        print!("{}", render::processes(&stopped, outbox.now()));
                    }
                    Ok(0)
                }
                ContractStep::Waiting {
                    writable_from,
                    older,
                } => {
                    eprintln!(
                        "contract step refused: it would stop {} of builds older than schema \
                         {writable_from}, still live:",
                        plural(older.len() as u64, "process", "processes")
                    );
                    eprint!("{}", render::processes(&older, outbox.now()));
                    eprintln!(
                        "upgrade them to chunked-outbox {} (schema {}) or later and run \
                         `outbox migrate` again, or pass --force (their writes will be refused)",
                        env!("CARGO_PKG_VERSION"),
                        outbox.schema_version()
                    );
                    Ok(1)
                }
            }
        }
    }
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn require_db(db: Option<&Path>) -> CliResult<&Path> {
    db.ok_or_else(|| "no database: pass --db PATH (or a postgres:// URL) or set OUTBOX_DB".into())
}

/// Opens an existing outbox for reading: nothing is created or changed.
fn open_read_only(db: Option<&Path>) -> CliResult<Outbox> {
    Target::of(require_db(db)?).open_read_only(OutboxOptions::default())
}

/// Opens an existing outbox at this build's schema for a repair; nothing is created or
/// upgraded (that is `outbox migrate`'s), and the file's stored rules apply.
fn open_for_repair(db: Option<&Path>) -> CliResult<Outbox> {
    let options = OutboxOptions::default()
        .with_create_if_missing(false)
        .with_schema_upgrade(false)
        .with_background_checkpoints(None);
    Target::of(require_db(db)?).open(options)
}

fn delivery_id(text: &str) -> CliResult<DeliveryId> {
    text.parse().map_err(|_| {
        format!(
            "{:?} is not a delivery id: give the UUID `outbox list` prints",
            clean(text)
        )
        .into()
    })
}

/// A chunk's key, `{delivery}:{n}` with n counted from 1 — never a bare number, which
/// would mean another chunk in another file.
fn chunk_key(text: &str) -> CliResult<(DeliveryId, u32)> {
    let parsed = text.rsplit_once(':').and_then(|(delivery, n)| {
        Some((delivery.parse::<DeliveryId>().ok()?, n.parse::<u32>().ok()?))
    });
    match parsed {
        Some((delivery, n)) if n >= 1 => Ok((delivery, n)),
        _ => Err(format!(
            "{:?} is not a chunk key: give {{delivery}}:{{n}}, such as 0199d6a2-0c0c-7000-8000-000000000001:1, as `outbox show` prints it",
            clean(text)
        )
        .into()),
    }
}

/// Prints the snapshot and turns it into an exit status.
fn health(outbox: &Outbox, args: &HealthArgs) -> CliResult<u8> {
    let h = outbox.health()?;
    let verdict = h.verdict(&args.thresholds.to_library());
    let code = match verdict.level {
        Level::Ok => 0,
        Level::Warn => 1,
        Level::Fail => 2,
    };
    let mut status = format!("status: {}", verdict.level.as_str());
    for reason in &verdict.reasons {
        status.push_str("\n  ");
        status.push_str(reason);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&h)?);
    } else if args.prometheus {
        print!("{}", h.to_prometheus());
    } else {
        print!("{}", render::health(&h));
        println!("{status}");
    }
    if args.exit_zero {
        if args.json || args.prometheus {
            eprintln!("{status}");
        }
        return Ok(0);
    }
    Ok(code)
}

impl Thresholds {
    /// The library's thresholds with these values.
    pub(crate) fn to_library(&self) -> monitoring::Thresholds {
        monitoring::Thresholds::default()
            .with_warn_due_age(self.warn_due_age)
            .with_warn_expired_leases(self.warn_expired_leases)
            .with_fail_dead_letters(self.fail_dead_letters)
            .with_fail_uncertain(self.fail_uncertain)
    }
}
