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
//!
//! The thread sleeps while nothing is written: it checkpoints the interval after the
//! [`BATCH`]th commit of the handle since its last checkpoint
//! ([`Checkpointer::note_write`]), or [`LONE_WRITES_WAIT`] after the first if fewer
//! come (a registry heartbeat's row, an occasional reply): an idle outbox costs it no
//! wake-up, and a quiet one a checkpoint a minute at most.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::Connection;

use crate::error::{Error, Result};
use crate::options::OutboxOptions;

/// Commits after which the thread checkpoints an interval later.
pub(crate) const BATCH: u64 = 8;

/// How long fewer than [`BATCH`] commits wait for their checkpoint.
pub(crate) const LONE_WRITES_WAIT: Duration = Duration::from_secs(60);

/// The checkpointing thread; stopping it is dropping it.
pub(crate) struct Checkpointer {
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// Commits since the last checkpoint.
    dirty: Arc<AtomicU64>,
    /// Checkpoints run so far.
    #[cfg(test)]
    rounds: Arc<std::sync::atomic::AtomicUsize>,
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
        let dirty = Arc::new(AtomicU64::new(0));
        let written = dirty.clone();
        #[cfg(test)]
        let rounds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        #[cfg(test)]
        let counted = rounds.clone();
        let running = Arc::new(Mutex::new(()));
        let turn = running.clone();
        let thread = std::thread::Builder::new()
            .name("outbox-checkpoint".into())
            .spawn(move || {
                let (lock, wake) = &*signal;
                let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    // Until something is written, then until a batch of commits (or a
                    // while), then for the interval.
                    let commits = || written.load(Ordering::SeqCst);
                    stopped = wake
                        .wait_while(stopped, |stop| !*stop && commits() == 0)
                        .unwrap_or_else(|e| e.into_inner());
                    let (guard, _) = wake
                        .wait_timeout_while(stopped, LONE_WRITES_WAIT, |stop| {
                            !*stop && commits() < BATCH
                        })
                        .unwrap_or_else(|e| e.into_inner());
                    let (guard, _) = wake
                        .wait_timeout_while(guard, every, |stop| !*stop)
                        .unwrap_or_else(|e| e.into_inner());
                    stopped = guard;
                    if *stopped {
                        return;
                    }
                    // (Cleared before the checkpoint: a commit during it is checkpointed
                    // by the next round.)
                    written.store(0, Ordering::SeqCst);
                    // A failed or partial checkpoint is retried at the next tick; the
                    // WAL only grows meanwhile, nothing is lost.
                    let _running = turn.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
                    #[cfg(test)]
                    counted.fetch_add(1, Ordering::SeqCst);
                }
            })
            .map_err(|source| Error::Io {
                path: path.to_owned(),
                source,
            })?;
        Ok(Checkpointer {
            stop,
            dirty,
            #[cfg(test)]
            rounds,
            running,
            thread: Some(thread),
        })
    }

    /// Notes a commit of the handle's writer: the first since the last checkpoint and
    /// the [`BATCH`]th wake the thread (one atomic add for the others).
    pub(crate) fn note_write(&self) {
        let commits = self.dirty.fetch_add(1, Ordering::SeqCst) + 1;
        if commits == 1 || commits == BATCH {
            let (lock, wake) = &*self.stop;
            let _guard = lock.lock().unwrap_or_else(|e| e.into_inner());
            wake.notify_all();
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a write the thread never wakes to checkpoint; a lone write waits for
    /// more; a batch of them gets one checkpoint, and nothing after it.
    #[test]
    fn the_thread_checkpoints_only_after_a_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        Connection::open(&path)
            .unwrap()
            .execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (x)")
            .unwrap();
        let every = Duration::from_millis(1);
        let checkpointer = Checkpointer::start(&path, &OutboxOptions::default(), every).unwrap();
        let rounds = || checkpointer.rounds.load(Ordering::SeqCst);
        // Fifty intervals with nothing written: an interval's tick would have run 50.
        std::thread::sleep(every * 50);
        assert_eq!(rounds(), 0, "nothing written: nothing checkpointed");
        checkpointer.note_write();
        std::thread::sleep(every * 50);
        assert_eq!(rounds(), 0, "a lone write waits for more");
        for _ in 1..BATCH {
            checkpointer.note_write();
        }
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        while rounds() == 0 && std::time::Instant::now() < give_up {
            std::thread::sleep(every);
        }
        assert_eq!(rounds(), 1, "a batch of writes: one checkpoint");
        std::thread::sleep(every * 50);
        assert_eq!(rounds(), 1, "and none after it");
    }
}
