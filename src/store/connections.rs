//! The connection half of a store: how its transactions begin and end, how it is read,
//! how it hears other processes' commits, and what it can and cannot do. The rules
//! hold one [`Store`] and never ask which it is.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::StoreTx;

/// What differs between stores that the rules act on: asked, never inferred from which
/// store it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Capabilities {
    /// Its text columns hold the NUL character (SQLite's do, PostgreSQL's do not).
    pub nul_in_text: bool,
    /// Applications' own transactions may stage replies that the outbox's
    /// transactions then make deliveries of (PostgreSQL's `outbound_enqueue`).
    pub staged_replies: bool,
    /// Other processes may open it (a file, a server; not memory): its writing
    /// handles say who they are in its registry of processes.
    pub shared: bool,
}

/// How one write transaction begins and ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Write {
    /// It changes the stored rules: it holds them exclusively.
    pub change_rules: bool,
    /// Whether its commit wakes every process listening on the store (where the
    /// store can).
    pub announce: Announce,
}

/// Which write transactions' commits wake the processes listening on the store: on
/// PostgreSQL a notification sent with the commit, which costs the commit a
/// database-wide lock (commits that notify run one at a time) and every listening
/// connection a wake-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Announce {
    /// Never: a claim, a record (whoever records next claims what it made due), the
    /// finalization statement stored.
    No,
    /// Only if it made a chunk due: stored a reply at the head of its lane, or
    /// activated one that waited. An enqueue behind a busy lane head makes nothing due
    /// (the record that finishes the head activates it), so it wakes nobody.
    IfMadeDue,
    /// Always: a change of the rules, an operator's or a recovery's change, which may
    /// make work due in ways the store does not see.
    Yes,
}

/// The connection half of a store (see the [module](self)). A store's transactions are
/// [`StoreTx`]s; what a store cannot do fails with [`Error::Unsupported`] naming it.
pub(crate) trait Store: Send + Sync {
    /// Its name in messages: `SQLite`, `PostgreSQL`.
    fn name(&self) -> &'static str;
    /// What it can do (see [`Capabilities`]).
    fn capabilities(&self) -> Capabilities;
    /// The schema version this build writes on it.
    fn schema_version(&self) -> i64;
    /// The oldest build (schema version) this build's schema accepts as a writer: a
    /// schema that accepts older ones is due a contract step.
    fn writable_from(&self) -> i64;
    /// The salt of this database's delivery uids (see
    /// [`DeliveryId::for_row`](crate::ids::DeliveryId::for_row)), read when it opened.
    fn id_salt(&self) -> i64;
    /// Runs `work` in one write transaction — the stored rules locked shared, or
    /// exclusively for a change of them — and commits if it returns `Ok`, rolls back
    /// otherwise. `work` may run more than once, each time in a transaction of its own
    /// that a later one replaces (rolled back: a store that takes the handle's rules
    /// on trust runs it again when they turn out to have changed); the run that
    /// committed is the last.
    fn write(
        &self,
        how: Write,
        work: &mut (dyn FnMut(&dyn StoreTx) -> Result<()> + Send),
    ) -> Result<()>;
    /// Runs `work` in one read transaction: everything it reads is one snapshot.
    fn read(&self, work: &mut (dyn FnMut(&dyn StoreTx) -> Result<()> + Send)) -> Result<()>;
    /// A watcher of commits by any connection, other processes' included; commits it
    /// hears of at once wake `wake` itself.
    fn watch(&self, wake: &Wakeups) -> Result<Box<dyn ChangeWatch>>;
    /// Starts hearing other processes' commits at once, where the store can and has not
    /// yet (a failure leaves it to the watchers' polls).
    fn listen(&self, _wake: &Wakeups) {}
    /// Whether commits of other processes wake this handle at once now.
    fn hears_commits(&self) -> bool {
        false
    }
    /// Names the database in the fields of a handle's `Debug`, never with a password.
    fn describe(&self, out: &mut std::fmt::DebugStruct<'_, '_>);
    /// The database file, if the store has one.
    fn path(&self) -> Option<&Path> {
        None
    }
    /// `error` with where it happened, for an error of the open that followed the
    /// store's own (the file's path).
    fn locate(&self, error: Error) -> Error {
        error
    }
    /// The quoted schema in which an application's transaction finds the store's
    /// `outbound_enqueue`; [`Error::Unsupported`] naming `what` where there is none.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn application_schema(&self, what: &'static str) -> Result<&str> {
        Err(self.unsupported(what))
    }
    /// The store as itself, for what only one store has (an SQLite file's pragmas).
    fn as_any(&self) -> &dyn std::any::Any;
    /// [`Error::Unsupported`] naming `what` on this store.
    fn unsupported(&self, what: &'static str) -> Error {
        Error::Unsupported {
            what,
            store: self.name(),
        }
    }
}

impl dyn Store + '_ {
    /// [`Store::write`] of work that returns a value (its last run's).
    pub(crate) fn write_with<T: Send>(
        &self,
        how: Write,
        mut work: impl FnMut(&dyn StoreTx) -> Result<T> + Send,
    ) -> Result<T> {
        let mut value = None;
        self.write(how, &mut |tx| {
            value = Some(work(tx)?);
            Ok(())
        })?;
        // A store that returns Ok ran the work (see `Store::write`).
        Ok(value.expect("a store returned Ok without running the transaction's work"))
    }

    /// [`Store::read`] of work that returns a value.
    pub(crate) fn read_with<T: Send>(
        &self,
        work: impl FnOnce(&dyn StoreTx) -> Result<T> + Send,
    ) -> Result<T> {
        let mut run = Once::new(work);
        self.read(&mut |tx| run.call(tx))?;
        Ok(run.take())
    }
}

/// Work a store runs once, and its value.
enum Once<F, T> {
    Ready(F),
    Done(T),
    Taken,
}

impl<F: FnOnce(&dyn StoreTx) -> Result<T>, T> Once<F, T> {
    fn new(work: F) -> Self {
        Once::Ready(work)
    }

    fn call(&mut self, tx: &dyn StoreTx) -> Result<()> {
        if let Once::Ready(work) = std::mem::replace(self, Once::Taken) {
            *self = Once::Done(work(tx)?);
        }
        Ok(())
    }

    fn take(self) -> T {
        match self {
            Once::Done(value) => value,
            // A store that returns Ok ran the work (see `Store::write`).
            _ => unreachable!("a store returned Ok without running the transaction's work"),
        }
    }
}

/// Notices commits to the database by other connections, asked at each poll of an
/// idle dispatcher.
pub(crate) trait ChangeWatch: Send {
    /// Whether anything may have been committed since the last call that the
    /// dispatchers were not woken for.
    fn changed(&mut self) -> Result<bool>;

    /// How long nothing can change unseen, as far as this watcher knows (a store whose
    /// commits are announced, while it hears them): an idle dispatcher's watcher may wait
    /// that long before it asks again. `None`: only asking tells.
    fn quiet_for(&self) -> Option<Duration> {
        None
    }
}

/// A watcher of a database no other connection can write (in memory).
pub(crate) struct Unwatched;

impl ChangeWatch for Unwatched {
    fn changed(&mut self) -> Result<bool> {
        Ok(false)
    }
}

/// What wakes a handle's dispatchers: its [`Notifier`], and whether replies staged by
/// applications' transactions may be waiting (set by a notification or a poll, taken
/// by the next claim).
#[derive(Debug, Clone, Default)]
pub(crate) struct Wakeups {
    pub notifier: Arc<Notifier>,
    pub staged: Arc<AtomicBool>,
}

/// A generation counter that writers bump and idle dispatchers wait on, so an enqueue
/// in this process wakes them at once instead of at their next poll.
#[derive(Debug, Default)]
pub(crate) struct Notifier {
    state: Mutex<Generation>,
    changed: Condvar,
    #[cfg(feature = "tokio")]
    pub(crate) async_changed: tokio::sync::Notify,
}

/// The generation, and how many threads wait on it.
#[derive(Debug, Default)]
struct Generation {
    value: u64,
    /// Blocked in [`Notifier::wait`]: a notification with none wakes nobody, and
    /// skips the wake-up call, a system call on every write otherwise (the standard
    /// condition variable makes it whether or not anyone waits).
    waiters: usize,
    /// The wake-up calls made.
    #[cfg(test)]
    wake_calls: usize,
}

impl Notifier {
    pub(crate) fn notify(&self) {
        let mut state = self.lock();
        state.value += 1;
        // Read under the lock a waiter holds until it sleeps: one counted here has
        // released the lock only by going to sleep on the condition variable, so the
        // call made after the lock is released reaches it (and a waiter that comes
        // later sees the new generation). Made after the release, the call does not
        // wake a thread only for it to wait for the lock this one still holds.
        let wake = state.waiters > 0;
        #[cfg(test)]
        {
            state.wake_calls += usize::from(wake);
        }
        drop(state);
        if wake {
            self.changed.notify_all();
        }
        #[cfg(feature = "tokio")]
        self.async_changed.notify_waiters();
    }

    pub(crate) fn generation(&self) -> u64 {
        self.lock().value
    }

    /// Waits until the generation differs from `seen` or `timeout` passes; returns the
    /// generation then.
    pub(crate) fn wait(&self, seen: u64, timeout: Duration) -> u64 {
        let mut state = self.lock();
        state.waiters += 1;
        let (mut state, _) = self
            .changed
            .wait_timeout_while(state, timeout, |g| g.value == seen)
            .unwrap_or_else(|e| e.into_inner());
        state.waiters -= 1;
        state.value
    }

    /// Threads blocked in [`wait`](Self::wait) now, and the wake-up calls made.
    #[cfg(test)]
    fn waiters_and_calls(&self) -> (usize, usize) {
        let state = self.lock();
        (state.waiters, state.wake_calls)
    }

    fn lock(&self) -> MutexGuard<'_, Generation> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs `f`, the crate's own database work, on a thread of tokio's blocking pool, where
/// a store's blocking client may run as it is (see `store::postgres::runtime`).
#[cfg(feature = "tokio")]
pub(crate) fn on_blocking_pool<T>(f: impl FnOnce() -> T) -> T {
    #[cfg(feature = "postgres")]
    return crate::store::postgres::runtime::on_blocking_pool(f);
    #[cfg(not(feature = "postgres"))]
    f()
}

/// The one scheduler thread every connection pool of the process runs its upkeep on.
pub(crate) fn pool_upkeep() -> Arc<scheduled_thread_pool::ScheduledThreadPool> {
    static UPKEEP: std::sync::OnceLock<Arc<scheduled_thread_pool::ScheduledThreadPool>> =
        std::sync::OnceLock::new();
    UPKEEP
        .get_or_init(|| {
            Arc::new(
                scheduled_thread_pool::ScheduledThreadPool::builder()
                    .num_threads(1)
                    .thread_name_pattern("outbox-pool-upkeep")
                    .build(),
            )
        })
        .clone()
}

/// The pool's own failure (no connection free within its timeout, say), on either store.
impl From<r2d2::Error> for Error {
    fn from(err: r2d2::Error) -> Self {
        Error::Pool {
            message: err.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifier_wakes_waiters_and_times_out_otherwise() {
        let n = Arc::new(Notifier::default());
        let seen = n.generation();
        assert_eq!(
            n.wait(seen, Duration::from_millis(1)),
            seen,
            "no notify: timeout"
        );
        let waker = {
            let n = n.clone();
            std::thread::spawn(move || n.notify())
        };
        assert_eq!(n.wait(seen, Duration::from_secs(60)), seen + 1);
        waker.join().unwrap();
    }

    #[test]
    fn a_notification_makes_a_wake_up_call_only_for_counted_waiters() {
        let n = Arc::new(Notifier::default());
        n.notify();
        assert_eq!(n.generation(), 1);
        assert_eq!(n.waiters_and_calls(), (0, 0), "nobody waited: no call");
        let waiter = {
            let n = n.clone();
            std::thread::spawn(move || {
                let started = std::time::Instant::now();
                (n.wait(1, Duration::from_secs(60)), started.elapsed())
            })
        };
        // The count is raised under the lock the waiter sleeps with.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while n.waiters_and_calls().0 == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter was never counted"
            );
            std::thread::yield_now();
        }
        n.notify();
        let (generation, waited) = waiter.join().unwrap();
        // Not at the end of its minute: woken.
        assert!(waited < Duration::from_secs(30), "waited {waited:?}");
        assert_eq!(generation, 2);
        assert_eq!(
            n.waiters_and_calls(),
            (0, 1),
            "one call, for the one waiter"
        );
    }
}
