//! The processes that write an outbox, each saying which build it is: what a rolling
//! upgrade needs to know before a contract step (see docs/OPERATING.md "Upgrades").
//!
//! Every handle that may write a file or a PostgreSQL schema (not a read-only one, not
//! one in memory) adds its row when it opens, renews it every [`PROCESS_HEARTBEAT`]
//! from a thread of its own, and removes it when its last clone is dropped. A process
//! killed leaves its row behind; it counts as gone once it has not been seen for
//! [`PROCESS_LEASE`], and is removed by the next heartbeat of anyone after ten leases.
//! Builds of a schema before the registry's (SQLite 15, PostgreSQL 10) write without
//! registering.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::error::Result;
use crate::store::{ProcessRow, release};

/// How often a running handle renews its row.
pub const PROCESS_HEARTBEAT: Duration = Duration::from_secs(30);
/// How long a row counts after its last renewal: a process not seen for this long is
/// taken to be gone.
pub const PROCESS_LEASE: Duration = Duration::from_secs(120);

/// A process that writes the outbox, as it registered itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Process {
    /// The handle's id (its claimant).
    pub id: String,
    /// The schema version its build writes.
    pub schema_level: i64,
    /// Its release: `chunked-outbox 0.1.0 (schema 15)`.
    pub release: String,
    /// The program's file name.
    pub program: String,
    /// The host it runs on.
    pub host: String,
    /// Its process id on that host.
    pub pid: i64,
    /// When it opened the outbox (the outbox's clock).
    pub started_at: DateTime<Utc>,
    /// When it last renewed its row.
    pub seen_at: DateTime<Utc>,
}

impl From<ProcessRow> for Process {
    fn from(row: ProcessRow) -> Process {
        Process {
            id: row.id,
            schema_level: row.schema_level,
            release: row.release,
            program: row.program,
            host: row.host,
            pid: row.pid,
            started_at: crate::clock::to_datetime(row.started_at),
            seen_at: crate::clock::to_datetime(row.seen_at),
        }
    }
}

/// This process's row, seen at `now`.
pub(crate) fn this_process(id: String, schema_level: i64, started_at: i64, now: i64) -> ProcessRow {
    let program = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    ProcessRow {
        id,
        schema_level,
        release: release(schema_level),
        program,
        host,
        pid: i64::from(std::process::id()),
        started_at,
        seen_at: now,
    }
}

/// A handle's heartbeat: a thread that renews its row until the handle goes.
pub(crate) struct Registration {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Registration {
    /// Calls `beat` every `every` until dropped, or until `alive` is gone (the handle it
    /// holds only weakly).
    pub(crate) fn start<T: Send + Sync + 'static>(
        alive: Weak<T>,
        every: Duration,
        beat: impl Fn(&Arc<T>) -> Result<()> + Send + 'static,
    ) -> Registration {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("outbox-heartbeat".into())
            .spawn(move || {
                let (stopped, wake) = &*stopping;
                let mut guard = stopped.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    guard = wake
                        .wait_timeout_while(guard, every, |stopped| !*stopped)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    if *guard {
                        return;
                    }
                    let Some(handle) = alive.upgrade() else {
                        return;
                    };
                    drop(guard);
                    if let Err(e) = beat(&handle) {
                        tracing::warn!(error = %e, "outbox: this process's heartbeat failed");
                    }
                    drop(handle);
                    guard = stopped.lock().unwrap_or_else(|p| p.into_inner());
                }
            })
            .ok();
        Registration { stop, thread }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let (stopped, wake) = &*self.stop;
        *stopped.lock().unwrap_or_else(|p| p.into_inner()) = true;
        wake.notify_all();
        if let Some(thread) = self.thread.take()
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }
}

/// What a contract step did, or why it waits (see [`Outbox::contract_step`](crate::Outbox::contract_step)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContractStep {
    /// None is due: the schema accepts no build older than this one's requires.
    NotDue,
    /// The schema now accepts writers from `writable_from` on; `stopped` are the
    /// older processes that were live (none unless forced): each write of theirs is
    /// refused from now on.
    Applied {
        /// The oldest build it accepts now.
        writable_from: i64,
        /// The older processes it stopped.
        stopped: Vec<Process>,
    },
    /// Older processes are live: the schema still accepts them, until they are
    /// replaced (or the step is forced).
    Waiting {
        /// The oldest build it would accept.
        writable_from: i64,
        /// The live processes of older builds, each still writing.
        older: Vec<Process>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The heartbeat beats until its registration is dropped, and stops once the
    /// handle it holds weakly is gone.
    #[test]
    fn a_heartbeat_beats_until_dropped_or_its_handle_is_gone() {
        let handle = Arc::new(AtomicUsize::new(0));
        let beating = Registration::start(Arc::downgrade(&handle), Duration::from_millis(1), |n| {
            n.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        while handle.load(Ordering::SeqCst) < 3 {
            std::thread::yield_now();
        }
        drop(beating);
        let after = handle.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(handle.load(Ordering::SeqCst), after, "stopped when dropped");

        // Dropping it waits for the thread: what the thread owns is gone by then.
        struct Owned(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Owned {
            fn drop(&mut self) {
                std::thread::sleep(Duration::from_millis(20));
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let owned = Owned(ended.clone());
        let joined = Registration::start(
            Arc::downgrade(&handle),
            Duration::from_secs(60),
            move |_| {
                let _ = &owned;
                Ok(())
            },
        );
        drop(joined);
        assert!(
            ended.load(Ordering::SeqCst),
            "joined before the drop returned"
        );

        let gone = Arc::new(AtomicUsize::new(0));
        let orphan = Registration::start(Arc::downgrade(&gone), Duration::from_millis(1), |n| {
            n.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        drop(gone);
        let thread = orphan.thread.as_ref().unwrap();
        while !thread.is_finished() {
            std::thread::yield_now();
        }
    }
}
