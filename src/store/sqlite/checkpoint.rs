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
                let mut wait = every / FASTEST;
                loop {
                    let (guard, _) = wake
                        .wait_timeout_while(stopped, wait, |stop| !*stop)
                        .unwrap_or_else(|e| e.into_inner());
                    stopped = guard;
                    if *stopped {
                        return;
                    }
                    // A failed or partial checkpoint is retried at the next tick; the
                    // WAL only grows meanwhile, nothing is lost.
                    let _running = turn.lock().unwrap_or_else(|e| e.into_inner());
                    let frames = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1));
                    wait = pace(wait, every, frames.unwrap_or(0));
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

/// The WAL the thread leaves behind it, in frames: SQLite's own checkpoint threshold.
const TARGET_FRAMES: i64 = 1000;

/// The shortest wait between two checkpoints, as a fraction of the longest.
const FASTEST: u32 = 16;

/// The wait before the next checkpoint, after one that found `frames` frames in the
/// WAL (written since it last restarted) at the end of a wait of `wait`. While the
/// writes outrun [`TARGET_FRAMES`], the wait shrinks in proportion, so that the next
/// checkpoint finds about that many, down to a sixteenth of `every`; otherwise it
/// doubles back towards `every`, so an idle outbox looks at its WAL once every `every`.
/// The thread starts at the shortest wait, as if the writes were outrunning it: a
/// process that opens the outbox and enqueues at once keeps a small WAL from the start.
///
/// A small WAL is cheaper to write as well as to read: commits to a WAL checkpointed
/// this way ran about a tenth faster, on a disk, than to one checkpointed at a fixed
/// 100 ms, which let it grow to thousands of frames (`examples/sqlite_hot_path.rs`).
fn pace(wait: Duration, every: Duration, frames: i64) -> Duration {
    let fastest = every / FASTEST;
    if frames > TARGET_FRAMES {
        wait.mul_f64(TARGET_FRAMES as f64 / frames as f64)
            .max(fastest)
    } else {
        (wait * 2).min(every)
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

    #[test]
    fn checkpoints_come_sooner_while_writes_outrun_the_target_and_drift_back_after() {
        let every = Duration::from_millis(160);
        let ms = Duration::from_millis;
        // Four times the target: the next wait is a quarter, so about the target is
        // written in it; never below a sixteenth of `every`.
        assert_eq!(pace(every, every, 4 * TARGET_FRAMES), ms(40));
        assert_eq!(pace(ms(40), every, 2 * TARGET_FRAMES), ms(20));
        assert_eq!(pace(ms(20), every, 100 * TARGET_FRAMES), ms(10));
        // At or under the target: back towards `every`, doubling.
        let mut wait = ms(10);
        let mut waits = Vec::new();
        for frames in [TARGET_FRAMES, 0, 0, 0, 0] {
            wait = pace(wait, every, frames);
            waits.push(wait.as_millis());
        }
        assert_eq!(waits, [20, 40, 80, 160, 160]);
    }
}
