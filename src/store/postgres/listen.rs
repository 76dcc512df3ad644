//! Wake-ups across hosts: a transaction that makes work due sends a notification with
//! its commit (`pg_notify`, delivered only if it commits), and one thread per
//! [`Outbox`](crate::Outbox) handle listens for them on a connection of its own and
//! wakes the handle's idle dispatchers.
//!
//! The listener is a hint, never the truth: while its connection is down the
//! dispatchers fall back to reading the due times at every poll, it reconnects with a
//! backoff, and after each reconnect it wakes them once (notifications sent while it
//! was away are lost). Even while it is healthy an idle dispatcher reads the due times
//! again every [`RESYNC`], so work made due later by another host (a retry it
//! scheduled before it stopped) is never left for a notification that will not come.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use postgres::NoTls;
use postgres::fallible_iterator::FallibleIterator;

use crate::store::connections::Notifier;

/// The notification channel of the outbox in the connection's current schema (one per
/// schema: a database may hold several outboxes). A name made of letters and digits,
/// used through `pg_notify` and quoted for `LISTEN`.
pub(super) const CHANNEL_QUERY: &str = "SELECT 'chunked_outbox_' || md5(current_schema())";

/// Commits a transaction with its notification (delivered at the commit, and only if
/// it commits), in one round trip.
pub(crate) const COMMIT_ANNOUNCED: &str =
    "SELECT pg_notify('chunked_outbox_' || md5(current_schema()), ''); COMMIT";

/// The `application_name` of listening connections (as `pg_stat_activity` shows them).
pub const APPLICATION_NAME: &str = "chunked-outbox listener";

/// The payload of the notification `outbound_enqueue` sends: a reply staged in an
/// application's transaction waits to join its lane.
const STAGED: &str = "staged";

/// How often an idle dispatcher reads the due times again while the listener is
/// healthy (the watcher's only look then: see `dispatch::watch_others`).
pub(crate) const RESYNC: Duration = Duration::from_secs(30);

/// How long the listener waits for a notification before it looks whether its handle
/// was dropped: once a second, the one wake-up an idle listener makes.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How often a quiet listener asks the server whether its connection still works (a
/// silent network never answers; TCP keepalives notice it too, within 25 s).
const PROBE_EVERY: Duration = Duration::from_secs(30);

/// The longest wait between two attempts to reconnect.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The state a listener thread shares with the handle's watchers.
#[derive(Debug, Default)]
pub(crate) struct ListenState {
    /// Listening now: every commit that made work due will wake us.
    healthy: AtomicBool,
    /// Set when the handle is dropped: the thread ends at its next check.
    stop: AtomicBool,
    /// Times the listening connection was (re)made.
    connects: AtomicU64,
}

impl ListenState {
    #[cfg(test)]
    pub(crate) fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Release);
    }

    pub(crate) fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// How many times the listener has connected (1 once it first listens).
    #[cfg(test)]
    pub(crate) fn connects(&self) -> u64 {
        self.connects.load(Ordering::Acquire)
    }
}

/// A running listener; dropping it stops its thread (within [`CHECK_EVERY`]).
#[derive(Debug)]
pub(crate) struct Listener {
    pub(crate) state: Arc<ListenState>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
    }
}

/// Starts the listening thread on a connection made from `config`, waking `notifier`
/// for every notification and once after each (re)connect.
pub(crate) fn start(
    config: postgres::Config,
    notifier: Arc<Notifier>,
    staged: Arc<AtomicBool>,
) -> std::io::Result<Listener> {
    let state = Arc::new(ListenState::default());
    let shared = state.clone();
    std::thread::Builder::new()
        .name("outbox-listener".into())
        .spawn(move || {
            let wake = Wake {
                notifier: &notifier,
                staged: &staged,
            };
            listen(&config, &wake, &shared)
        })?;
    Ok(Listener { state })
}

/// What a notification wakes: the dispatchers, and (for a reply staged by an
/// application's transaction, or after a reconnect) the next claim's look at staged
/// replies.
struct Wake<'a> {
    notifier: &'a Notifier,
    staged: &'a AtomicBool,
}

impl Wake<'_> {
    fn all(&self) {
        self.staged.store(true, Ordering::Release);
        self.notifier.notify();
    }
}

fn listen(config: &postgres::Config, wake: &Wake<'_>, state: &ListenState) {
    let mut backoff = Duration::from_millis(20);
    while !state.stop.load(Ordering::Acquire) {
        let Ok(mut client) = subscribe(config) else {
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(MAX_BACKOFF);
            continue;
        };
        backoff = Duration::from_millis(20);
        state.connects.fetch_add(1, Ordering::AcqRel);
        state.healthy.store(true, Ordering::Release);
        // What was committed while nobody listened is found by looking again.
        wake.all();
        serve(&mut client, wake, state);
        state.healthy.store(false, Ordering::Release);
        tracing::warn!("the outbox's listening connection was lost; polling until it is back");
        wake.all();
    }
}

/// A connection listening on the outbox's channel.
fn subscribe(config: &postgres::Config) -> Result<postgres::Client, postgres::Error> {
    let mut client = config
        .clone()
        .application_name(APPLICATION_NAME)
        .connect(NoTls)?;
    let channel: String = client.query_one(CHANNEL_QUERY, &[])?.get(0);
    client.batch_execute(&format!("LISTEN \"{channel}\""))?;
    Ok(client)
}

/// Wakes the handle's dispatchers for each notification until the connection fails or
/// the handle is dropped.
fn serve(client: &mut postgres::Client, wake: &Wake<'_>, state: &ListenState) {
    let mut probed = Instant::now();
    loop {
        if state.stop.load(Ordering::Acquire) {
            return;
        }
        let started = Instant::now();
        let mut woke = false;
        {
            let mut notifications = client.notifications();
            let mut iter = notifications.timeout_iter(CHECK_EVERY);
            loop {
                match iter.next() {
                    Ok(Some(n)) => {
                        if n.payload() == STAGED {
                            wake.staged.store(true, Ordering::Release);
                        }
                        wake.notifier.notify();
                        woke = true;
                        // Under a steady stream, still look at `stop` now and then.
                        if started.elapsed() >= CHECK_EVERY {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(_) => return,
                }
            }
        }
        // `None` also means the server went away: a closed connection shows at once;
        // a silent network only to a question, asked now and then with a deadline.
        if client.is_closed() {
            return;
        }
        if woke {
            probed = Instant::now();
        } else if probed.elapsed() >= PROBE_EVERY {
            if client.is_valid(CHECK_EVERY * 4).is_err() {
                return;
            }
            probed = Instant::now();
        }
    }
}
