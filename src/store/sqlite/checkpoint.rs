//! Background WAL checkpoints, off the commit path.
//!
//! SQLite's automatic checkpoint runs inside whichever commit pushes the WAL past 1000
//! pages, and with `synchronous=NORMAL` it fsyncs the database file: that one commit
//! then takes milliseconds, which is what an enqueue → send latency p99 sees, and under
//! sustained writes the writer spends a tenth of its time checkpointing. With
//! background checkpoints on (the default for files), a thread of the outbox runs a
//! `PASSIVE` checkpoint — which never waits for readers or writers — on its own
//! connection at a fixed interval, and the writer's automatic checkpoint threshold is
//! raised to [`BACKGROUND_AUTOCHECKPOINT_PAGES`](crate::store::sqlite::StorageSettings::BACKGROUND_AUTOCHECKPOINT_PAGES),
//! where it only bounds the WAL if the thread falls behind.

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::Connection;

use crate::error::{Error, Result};
use crate::options::OutboxOptions;

/// The checkpointing thread; stopping it is dropping it.
pub(crate) struct Checkpointer {
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// Held while a checkpoint runs, so [`Outbox::checkpoint`](crate::Outbox::checkpoint)
    /// waits for the thread's instead of failing with `Busy` on SQLite's checkpoint lock.
    running: Arc<Mutex<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    pub(crate) fn start(
        path: &Path,
        options: &OutboxOptions,
        every: Duration,
    ) -> Result<Checkpointer> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(options.busy_timeout)?;
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let signal = stop.clone();
        let running = Arc::new(Mutex::new(()));
        let turn = running.clone();
        let thread = std::thread::Builder::new()
            .name("outbox-checkpoint".into())
            .spawn(move || {
                let (lock, wake) = &*signal;
                let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    let (guard, _) = wake
                        .wait_timeout_while(stopped, every, |stop| !*stop)
                        .unwrap_or_else(|e| e.into_inner());
                    stopped = guard;
                    if *stopped {
                        return;
                    }
                    // A failed or partial checkpoint is retried at the next tick; the
                    // WAL only grows meanwhile, nothing is lost.
                    let _running = turn.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
                }
            })
            .map_err(|source| Error::Io {
                path: path.to_owned(),
                source,
            })?;
        Ok(Checkpointer {
            stop,
            running,
            thread: Some(thread),
        })
    }

    /// Keeps the thread from checkpointing while the guard lives.
    pub(crate) fn exclusive(&self) -> MutexGuard<'_, ()> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (lock, wake) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Copies the WAL back into the database file and truncates it, on `conn`; `false` if
/// readers, or a checkpoint by another process, kept it from completing.
pub(crate) fn truncate(conn: &rusqlite::Connection) -> Result<bool> {
    let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
    Ok(busy == 0)
}
