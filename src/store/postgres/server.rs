//! The PostgreSQL store's connections: connecting (and migrating), the transactions of
//! the seam on a connection of the pool, and hearing other hosts' commits.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::begin::Begin;
use super::pool::PgStore;
use super::tx::PgTx;
use super::{runtime, schema};
use crate::clock::ServerTime;
use crate::error::{Error, Result};
use crate::options::OutboxOptions;
use crate::store::StoreTx;
use crate::store::connections::{Capabilities, ChangeWatch, Store, Wakeups, Write};
use crate::store::postgres::listen::{self, ListenState, RESYNC};

impl PgStore {
    /// Connects to the outbox at `url` (see [`Outbox::connect`](crate::Outbox::connect)),
    /// creating or upgrading its tables unless `read_only` or behind a transaction
    /// pooler. From here on `options` tells the server's time (see [`ServerTime`]).
    pub(crate) fn open(url: &str, options: &mut OutboxOptions, read_only: bool) -> Result<Self> {
        // Called from async code, it runs off the runtime's worker (see `runtime`), as
        // every call of this store does.
        runtime::off_runtime(|| PgStore::open_here(url, options, read_only))
    }

    fn open_here(url: &str, options: &mut OutboxOptions, read_only: bool) -> Result<Self> {
        // Every time the rules store or compare is the server's (see `ServerTime`).
        let time = Arc::new(ServerTime::new(options.clock.clone()));
        let mut store = PgStore::connect(
            url,
            options.readers + 1,
            options.busy_timeout,
            read_only,
            options.transaction_pooler,
            time.clone(),
        )?;
        options.clock = time;
        store.listens = options.listen && !options.transaction_pooler;
        let mut conn = store.connection()?;
        store.id_salt = if read_only || options.transaction_pooler {
            // Behind a transaction pooler: checked in one transaction, so its
            // statements meet one server connection; never migrated (see
            // `OutboxOptions::with_transaction_pooler`).
            conn.client.batch_execute("BEGIN")?;
            let checked =
                schema::require_current(&mut conn).and_then(|()| schema::id_salt(&mut conn));
            conn.client.batch_execute("ROLLBACK")?;
            checked?
        } else {
            schema::migrate(&mut conn, &store.config, options.upgrade_schema)?;
            schema::id_salt(&mut conn)?
        };
        drop(conn);
        Ok(store)
    }

    /// The state of this store's listener, started on first use; `None` when wake-ups
    /// by notification are off ([`OutboxOptions::with_listen`]).
    pub(crate) fn listener(&self, wake: &Wakeups) -> Result<Option<Arc<ListenState>>> {
        if !self.listens {
            return Ok(None);
        }
        if let Some(running) = self.listener.get() {
            return Ok(running.as_ref().map(|l| l.state.clone()));
        }
        let started = listen::start(
            self.config.clone(),
            wake.notifier.clone(),
            wake.staged.clone(),
        )
        .map_err(|source| Error::Io {
            path: "listener thread".into(),
            source,
        })?;
        let state = started.state.clone();
        if self.listener.set(Some(started)).is_err() {
            // Another dispatcher of this handle started one first: ours stops.
            return Ok(self
                .listener
                .get()
                .and_then(|l| l.as_ref())
                .map(|l| l.state.clone()));
        }
        Ok(Some(state))
    }
}

impl Store for PgStore {
    fn name(&self) -> &'static str {
        "PostgreSQL"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            nul_in_text: false,
            staged_replies: true,
            shared: true,
        }
    }

    fn schema_version(&self) -> i64 {
        super::schema::latest_version()
    }

    fn writable_from(&self) -> i64 {
        super::schema::WRITABLE_FROM
    }

    fn id_salt(&self) -> i64 {
        self.id_salt
    }

    fn write(
        &self,
        how: Write,
        work: &mut (dyn FnMut(&dyn StoreTx) -> Result<()> + Send),
    ) -> Result<()> {
        let Write {
            change_rules,
            announce,
        } = how;
        let kind = if self.read_only {
            Begin::WriteRefused { change_rules }
        } else {
            Begin::Write { change_rules }
        };
        // The work takes the handle's copy of the rules on trust (see
        // `RuleStore::rules_version_or`) and its `BEGIN` rides with its first
        // statement. If another handle changed the rules since this one read them, the
        // first round trip says so, nothing of the transaction counts, and the work
        // runs again on the rules read first.
        let mut run = |moved: Option<&AtomicBool>| {
            self.transaction_trusting(kind, moved, |tx: PgTx<'_>| {
                work(&tx)?;
                self.commit(tx, announce, self.patience)
            })
        };
        let moved = AtomicBool::new(false);
        let trusting = run(Some(&moved));
        if !moved.load(Ordering::Relaxed) {
            return trusting;
        }
        run(None)
    }

    fn read(&self, work: &mut (dyn FnMut(&dyn StoreTx) -> Result<()> + Send)) -> Result<()> {
        self.transaction(Begin::Read, |tx: PgTx<'_>| work(&tx))
    }

    fn watch(&self, wake: &Wakeups) -> Result<Box<dyn ChangeWatch>> {
        Ok(Box::new(ServerWatch {
            listener: self.listener(wake)?,
            resynced: Instant::now(),
            wake: wake.clone(),
        }))
    }

    fn listen(&self, wake: &Wakeups) {
        if self.listener.get().is_none() {
            let _ = self.listener(wake);
        }
    }

    fn hears_commits(&self) -> bool {
        self.listener
            .get()
            .and_then(|l| l.as_ref())
            .is_some_and(|l| l.state.healthy())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn describe(&self, out: &mut std::fmt::DebugStruct<'_, '_>) {
        out.field("database", &self.target);
    }

    fn application_schema(&self, _what: &'static str) -> Result<&str> {
        Ok(&self.quoted_schema)
    }
}

/// A server's watcher: the handle's listener wakes the dispatchers itself; while it is
/// down (or off), every poll looks again, and a look at the due times looks for staged
/// replies too.
pub(crate) struct ServerWatch {
    pub(crate) listener: Option<Arc<ListenState>>,
    pub(crate) resynced: Instant,
    pub(crate) wake: Wakeups,
}

impl ChangeWatch for ServerWatch {
    fn changed(&mut self) -> Result<bool> {
        let heard = self.listener.as_ref().is_some_and(|l| l.healthy());
        if heard && self.resynced.elapsed() < RESYNC {
            return Ok(false);
        }
        self.resynced = Instant::now();
        self.wake
            .staged
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(true)
    }

    fn quiet_for(&self) -> Option<std::time::Duration> {
        let heard = self.listener.as_ref().is_some_and(|l| l.healthy());
        heard.then(|| RESYNC.saturating_sub(self.resynced.elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::connections::Announce;
    use crate::store::test_server::{fresh_schema_url, server_url};

    /// A dispatcher reads the due times again at a poll only while nobody listens
    /// (notifications off, or the listener's connection down), and otherwise once per
    /// resync interval.
    #[test]
    fn a_server_watcher_polls_only_while_nobody_listens() {
        let state = Arc::new(ListenState::default());
        let mut watcher = ServerWatch {
            listener: Some(state.clone()),
            resynced: Instant::now(),
            wake: Wakeups::default(),
        };
        assert!(watcher.changed().unwrap(), "listener down: poll");
        assert!(watcher.changed().unwrap(), "still down: poll again");
        assert_eq!(watcher.quiet_for(), None, "down: only a look tells");
        state.set_healthy(true);
        assert!(!watcher.changed().unwrap(), "listening: wait to be woken");
        assert!(
            watcher
                .quiet_for()
                .is_some_and(|q| q > RESYNC / 2 && q <= RESYNC),
            "listening: nothing to look at before the resync"
        );
        watcher.resynced -= RESYNC;
        assert!(watcher.changed().unwrap(), "a resync is due");
        assert!(!watcher.changed().unwrap(), "and then not again at once");
        let mut off = ServerWatch {
            listener: None,
            resynced: Instant::now(),
            wake: Wakeups::default(),
        };
        assert!(
            off.changed().unwrap(),
            "notifications off: every poll looks"
        );
    }

    /// A write holds the rules' lock from its `BEGIN` round trip on (shared; exclusive
    /// for a change of the rules), before the rules' work reads anything; a read holds
    /// none.
    #[test]
    fn a_write_holds_the_rules_from_its_begin() {
        let Some(url) = fresh_schema_url() else {
            return;
        };
        let store = PgStore::open(&url, &mut OutboxOptions::default(), false).unwrap();
        let held = |kind: Begin| {
            store
                .transaction(kind, |tx: PgTx<'_>| {
                    let rows = tx.query(
                        "SELECT mode FROM pg_locks
                         WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
                        &[],
                    )?;
                    rows.iter()
                        .map(|r| Ok(r.try_get::<_, String>(0)?))
                        .collect::<Result<Vec<_>>>()
                })
                .unwrap()
        };
        let write = |change_rules| Begin::Write { change_rules };
        assert_eq!(held(write(false)), ["ShareLock"]);
        assert_eq!(held(write(true)), ["ExclusiveLock"]);
        assert_eq!(held(Begin::Read), Vec::<String>::new());
    }

    /// A write on a connection of its own opens with the prepared statements of
    /// `OPENING_SQL`; behind a transaction pooler, where statements run unnamed, with
    /// `outbound_begin`'s one call. Both set the transaction's bounds and plans.
    #[test]
    fn a_write_opens_as_its_connection_allows() {
        let Some(url) = fresh_schema_url() else {
            return;
        };
        for pooler in [false, true] {
            let mut options = OutboxOptions::default().with_transaction_pooler(pooler);
            let store = PgStore::open(&url, &mut options, false).unwrap();
            let (prepared, settings) = store
                .transaction(
                    Begin::Write {
                        change_rules: false,
                    },
                    |tx: PgTx<'_>| {
                        let row = tx.query_one(
                            "SELECT current_setting('lock_timeout'),
                                current_setting('idle_in_transaction_session_timeout'),
                                current_setting('plan_cache_mode')",
                            &[],
                        )?;
                        let setting = |i| row.try_get::<_, String>(i);
                        Ok((tx.opening > 1, [setting(0)?, setting(1)?, setting(2)?]))
                    },
                )
                .unwrap();
            assert_eq!(prepared, !pooler, "behind a pooler: {pooler}");
            assert_eq!(
                settings,
                ["5s", "10s", "force_generic_plan"],
                "behind a pooler: {pooler}"
            );
        }
    }

    /// A lane the claim's read locked inside a nested transaction that was rolled back
    /// is no longer taken as held: trying it asks the server, and another transaction
    /// may hold it by then. Nor is a lane of the same channel that the read did not lock.
    #[test]
    fn a_lane_locked_in_a_rolled_back_nested_transaction_is_tried_again() {
        use crate::store::{ClaimStore, LaneRef, Locks};
        use crate::{NewDelivery, Outbox};
        let Some(url) = fresh_schema_url() else {
            return;
        };
        let outbox = Outbox::connect(&url, OutboxOptions::default()).unwrap();
        outbox.enqueue(&NewDelivery::single("t", "a", "x")).unwrap();
        let store = PgStore::open(&url, &mut OutboxOptions::default(), false).unwrap();
        let lane = LaneRef::new("t", "a");
        let (held_then, taken_now) = store
            .transaction(
                Begin::Write {
                    change_rules: false,
                },
                |tx: PgTx<'_>| {
                    tx.begin_nested()?;
                    tx.due_in_channels(None, i64::MAX, 10)?;
                    let held_then = tx.holds_lane(lane);
                    tx.end_nested(false)?;
                    let mut other = postgres::Client::connect(&url, postgres::NoTls)?;
                    other.batch_execute(
                        "BEGIN; SELECT 1 FROM outbound_lanes
                     WHERE channel = 't' AND chat_id = 'a' FOR NO KEY UPDATE",
                    )?;
                    let taken_now = tx.try_lock_lane(lane)?;
                    other.batch_execute("ROLLBACK")?;
                    Ok((held_then, taken_now))
                },
            )
            .unwrap();
        assert!(held_then, "the read locked the lane");
        assert!(!taken_now, "another transaction holds it now");
        // A lane of the same channel the read did not lock is not held either.
        outbox.enqueue(&NewDelivery::single("t", "b", "y")).unwrap();
        let mut other = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        other
            .batch_execute(
                "BEGIN; SELECT 1 FROM outbound_lanes
                 WHERE channel = 't' AND chat_id = 'b' FOR NO KEY UPDATE",
            )
            .unwrap();
        let (a, b) = store
            .transaction(
                Begin::Write {
                    change_rules: false,
                },
                |tx: PgTx<'_>| {
                    tx.due_in_channels(None, i64::MAX, 10)?;
                    Ok((
                        tx.holds_lane(lane),
                        tx.try_lock_lane(LaneRef::new("t", "b"))?,
                    ))
                },
            )
            .unwrap();
        other.batch_execute("ROLLBACK").unwrap();
        assert!(a && !b, "lane a held: {a}; lane b taken: {b}");
    }

    /// The round trips of the hot path's operations, counted on the client (the
    /// fewest over a few runs: a statement's first use on a connection prepares it,
    /// and a connection idle for a while is checked when taken). A transaction's
    /// `BEGIN` and its locks ride with its next statement.
    #[test]
    fn hot_path_round_trips() {
        use crate::{NewDelivery, Outbox, Outcome};
        let Some(url) = fresh_schema_url() else {
            return;
        };
        let outbox = Outbox::connect(&url, OutboxOptions::default()).unwrap();
        let trips = || crate::store::postgres::client::ROUND_TRIPS.with(|n| n.get());
        let fewest = |f: &mut dyn FnMut(usize)| {
            (0..12)
                .map(|i| {
                    let before = trips();
                    f(i);
                    trips() - before
                })
                .min()
                .unwrap()
        };
        let reply = |chat: String| NewDelivery::single("t", chat, "x");
        let first = fewest(&mut |i| {
            outbox.enqueue(&reply(format!("free-{i}"))).unwrap();
        });
        let queued = fewest(&mut |i| {
            outbox.enqueue(&reply(format!("free-{i}"))).unwrap();
        });
        let mut claims = Vec::new();
        let claim = fewest(&mut |_| claims.push(outbox.claim(1).unwrap().remove(0)));
        let mut claims = claims.into_iter();
        let record = fewest(&mut |_| {
            let claim = claims.next().unwrap();
            outbox.record(&claim, Outcome::delivered(None)).unwrap();
        });
        // A dispatcher's step: the outcome of its last send recorded and its next send
        // claimed, in one transaction.
        for i in 0..13 {
            outbox.enqueue(&reply(format!("step-{i}"))).unwrap();
        }
        let mut held = outbox.claim(1).unwrap();
        let step = fewest(&mut |_| {
            let claim = held.pop().unwrap();
            let outcomes = [(claim, Outcome::delivered(None))];
            let step = outbox
                .record_and_claim(&outcomes, &["t"], 1, crate::claim::Isolation::Busy)
                .unwrap();
            assert!(step.recorded[0].is_ok());
            held = step.claims;
        });
        assert_eq!(
            (first, queued, claim, record, step),
            (2, 2, 2, 2, 3),
            "round trips of an enqueue (lane free, lane busy), a claim(1), a record, \
             a dispatcher's record-and-claim step"
        );
    }

    /// An enqueue's commit notifies the listening processes only when it made a chunk
    /// due: a reply at the head of its lane (due now or later), or a queued one it
    /// activated. One queued behind its lane's head, or found by its caller key, makes
    /// nothing due and notifies nobody; nor do a claim and a record.
    #[test]
    fn only_an_enqueue_that_makes_a_chunk_due_is_announced() {
        use postgres::fallible_iterator::FallibleIterator;

        use crate::store::{LaneRef, LaneStore};
        use crate::{NewDelivery, Outbox, Outcome};
        let Some(url) = fresh_schema_url() else {
            return;
        };
        let outbox = Outbox::connect(&url, OutboxOptions::default().with_listen(false)).unwrap();
        let mut listening = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let channel: String = listening
            .query_one(listen::CHANNEL_QUERY, &[])
            .unwrap()
            .get(0);
        listening
            .batch_execute(&format!("LISTEN \"{channel}\""))
            .unwrap();
        let mut marking = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        // The outbox's notifications since the last call: those committed before a
        // marker notification, which arrives after every one committed before it.
        let mut heard = || {
            marking
                .execute("SELECT pg_notify($1, 'marker')", &[&channel])
                .unwrap();
            let mut heard = 0;
            let mut notifications = listening.notifications();
            let mut arriving = notifications.timeout_iter(Duration::from_secs(30));
            loop {
                let n = arriving
                    .next()
                    .unwrap()
                    .expect("the marker notification never arrived");
                if n.payload() == "marker" {
                    return heard;
                }
                heard += 1;
            }
        };
        let reply = |chat: &str, text: &str| NewDelivery::single("t", chat, text);

        outbox.enqueue(&reply("a", "a1")).unwrap();
        assert_eq!(heard(), 1, "a reply at the head of its lane");
        outbox.enqueue(&reply("a", "a2")).unwrap();
        assert_eq!(heard(), 0, "a reply queued behind its lane's head");
        outbox
            .enqueue_batch(&[reply("a", "a3"), reply("b", "b1"), reply("b", "b2")])
            .unwrap();
        assert_eq!(heard(), 1, "a batch with one reply at the head of its lane");
        let b3 = outbox
            .enqueue_batch(&[reply("a", "a4"), reply("b", "b3")])
            .unwrap();
        assert_eq!(heard(), 0, "a batch of replies queued behind their heads");
        let later = outbox.now() + chrono::Duration::hours(1);
        outbox.enqueue(&reply("c", "c1").not_before(later)).unwrap();
        assert_eq!(heard(), 1, "a reply at the head of its lane, due later");
        let keyed = reply("d", "d1").with_idempotency_key("k");
        outbox.enqueue(&keyed).unwrap();
        assert_eq!(
            heard(),
            1,
            "a reply with a caller key at the head of its lane"
        );
        outbox.enqueue(&keyed).unwrap();
        assert_eq!(heard(), 0, "a reply found by its caller key");
        outbox
            .enqueue(&reply("d", "d2").with_idempotency_key("k2"))
            .unwrap();
        assert_eq!(
            heard(),
            0,
            "a reply with a caller key queued behind its head"
        );

        let claims = outbox.claim(10).unwrap();
        assert_eq!(heard(), 0, "a claim");
        outbox.record(&claims[0], Outcome::delivered(None)).unwrap();
        assert_eq!(heard(), 0, "a record that activates the next reply");

        // An enqueue that finds a queued reply with nothing in front of it activates
        // that one first: its transaction made a chunk due.
        let store = PgStore::open(&url, &mut OutboxOptions::default(), false).unwrap();
        let queued = outbox.delivery_rowid(b3[1].id);
        let made_due = store
            .transaction(
                Begin::Write {
                    change_rules: false,
                },
                |tx: PgTx<'_>| {
                    tx.activate_many(&[])?;
                    let before = tx.made_due.get();
                    let waiting = tx.waiting(queued)?;
                    tx.activate(&crate::store::Activation {
                        waiting,
                        status: crate::status::DeliveryStatus::Pending,
                        lane: LaneRef::new("t", "b"),
                        earliest: 0,
                    })?;
                    Ok((before, tx.made_due.get()))
                },
            )
            .unwrap();
        assert_eq!(made_due, (false, true), "an activation made a chunk due");
    }

    /// Another handle's commit wakes this handle's dispatchers through the listener;
    /// a listener whose connection is killed reconnects and wakes them once (what was
    /// committed meanwhile was not announced to it).
    #[test]
    fn the_listener_wakes_on_other_handles_commits_and_comes_back() {
        let Some(url) = fresh_schema_url() else {
            return;
        };
        let deadline = || Instant::now() + Duration::from_secs(30);
        let watched = PgStore::open(&url, &mut OutboxOptions::default(), false).unwrap();
        let wake = Wakeups::default();
        let state = watched.listener(&wake).unwrap().unwrap();
        let until = deadline();
        while !state.healthy() {
            assert!(Instant::now() < until, "the listener never connected");
            std::thread::sleep(Duration::from_millis(5));
        }
        let notifier = &wake.notifier;
        let other = PgStore::open(&url, &mut OutboxOptions::default(), false).unwrap();
        let seen = notifier.generation();
        let announce = Write {
            change_rules: false,
            announce: Announce::Yes,
        };
        other.write(announce, &mut |_| Ok(())).unwrap();
        assert_ne!(
            notifier.wait(seen, Duration::from_secs(30)),
            seen,
            "the other handle's announced commit woke nobody here"
        );

        let connects = state.connects();
        let seen = notifier.generation();
        let mut admin = postgres::Client::connect(&server_url().unwrap(), postgres::NoTls).unwrap();
        let killed = admin
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE application_name = $1",
                &[&listen::APPLICATION_NAME],
            )
            .unwrap();
        assert!(!killed.is_empty(), "no listening connection to kill");
        let until = deadline();
        while state.connects() == connects {
            assert!(Instant::now() < until, "the listener never came back");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_ne!(
            notifier.generation(),
            seen,
            "a reconnect wakes the dispatchers"
        );
    }
}
