//! `outbox-lab`: the test lab beside the `outbox` tool. `demo` is the main job (a
//! simulated chat engine, flaky simulated platforms, real crashes of the worker, a
//! verdict read from what the platforms received); `torture` and `stress` are the
//! crash and contention harnesses. None of it is linked into the library or the
//! `outbox` tool: the simulated platforms live here only.

// The tool's own modules the harnesses share: how a command ends, where an outbox is,
// and how a health snapshot and an error print (the lab uses part of each).
#[path = "../outbox/exit.rs"]
mod exit;
#[path = "../outbox/render.rs"]
#[allow(dead_code)]
mod render;
#[path = "../outbox/target.rs"]
#[allow(dead_code)]
mod target;

mod demo;
mod sim;
mod target_lab;
mod torture;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub(crate) use exit::CliResult;

/// The demo and the crash harnesses of chunked-outbox.
#[derive(Parser)]
#[command(name = "outbox-lab", version, about, long_about = None)]
struct Cli {
    /// Where the harness keeps its outbox: by default a fresh SQLite file of its own; a
    /// PostgreSQL URL (`postgres://…`; a build with the `postgres` feature) puts it in a
    /// fresh schema of that database.
    #[arg(long, global = true, env = "OUTBOX_DB", value_name = "PATH|URL")]
    db: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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

fn main() -> ExitCode {
    exit::main(|cli: Cli| {
        let db = cli.db.as_deref();
        match cli.command {
            Command::Demo(args) => demo::run(db, &args),
            Command::DemoWorker(args) => demo::worker(&args),
            Command::Torture(args) => torture::run(db, &args),
            Command::TortureRole(args) => torture::role(&args),
            Command::Stress(args) => torture::stress(db, &args),
            Command::StressRole(args) => torture::stress_role(&args),
        }
    })
}
