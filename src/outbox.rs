//! The [`Outbox`] handle: the rules' way into its store, and what every clone shares.

use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::finalize;
use crate::ids::{ClaimantId, DeliveryId};
use crate::lane;
use crate::options::OutboxOptions;
use crate::registry::{self, Process, Registration};
use crate::rules::{self, ChannelPolicy, FileRules, RetryPolicy, Rules, Stored};
use crate::store::connections::{Announce, ChangeWatch, Notifier, Store, Wakeups, Write};
use crate::store::{ProcessRow, StoreTx};

/// How often a claim of a handle that hears no notification looks for replies staged
/// by applications' transactions unasked (see [`Outbox::take_staged_hint`]): the
/// dispatchers' default poll interval.
pub(crate) const STAGED_LOOK: std::time::Duration = std::time::Duration::from_secs(1);

/// A durable outbox on one SQLite database ([`open`](Self::open)) or, with the feature
/// `postgres`, in a PostgreSQL database ([`connect`](Self::connect)). Cheap to clone;
/// `Send + Sync`.
///
/// On SQLite all writes of one `Outbox` go through a single connection behind a mutex,
/// in `BEGIN IMMEDIATE` transactions: SQLite has one writer, and more writer
/// connections only add lock contention. Reads (inspection, health) use a small pool of
/// read-only connections, which WAL mode lets run beside the writer. Other processes
/// may open the same file; SQLite's locking and the busy timeout serialise their writes
/// with ours. On PostgreSQL writes and reads share a pool of connections, and writers
/// of every process and host run at once under the locks of the rules
/// (docs/STORES.md).
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

struct Inner {
    store: Box<dyn Store>,
    wakeups: Wakeups,
    /// When a claim of this handle last looked for staged replies unasked (ms after
    /// `opened`; see [`Outbox::take_staged_hint`]).
    staged_looked: AtomicI64,
    opened: Instant,
    options: OutboxOptions,
    /// The high half of every fencing token this handle hands out.
    claimant: ClaimantId,
    /// The low half: a counter, so two claims of this handle never share a token.
    claims: AtomicU32,
    /// The stored rules as last read, with the version they were read at.
    stored: Mutex<Arc<Stored>>,
    /// This process's row in the registry of processes, renewed by a heartbeat while
    /// the handle lives (a writing handle on a file or a server only).
    registration: Mutex<Option<Registration>>,
    /// The registry's heartbeats so far: commits of this handle that make nothing due,
    /// which a dispatcher's watcher does not take for a sign of activity.
    heartbeats: AtomicU64,
}

impl Drop for Inner {
    /// The last clone of a registered handle removes its row: the process no longer
    /// writes through it. (A failure leaves the row to lapse.)
    fn drop(&mut self) {
        let registration = self
            .registration
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if registration.is_none() {
            return;
        }
        drop(registration);
        let id = self.claimant.to_string();
        let how = Write {
            change_rules: false,
            announce: Announce::No,
        };
        let _ = self.store.write_with(how, |tx| {
            tx.lock_rules(false)?;
            tx.forget_process(&id)
        });
    }
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut debug = f.debug_struct("Outbox");
        self.inner.store.describe(&mut debug);
        debug.finish_non_exhaustive()
    }
}

impl Outbox {
    /// A handle on `store`, opened with `options`: the stored rules read, and made to
    /// agree with those the options declare unless the store is open for reading only.
    pub(crate) fn from_store(
        store: Box<dyn Store>,
        options: OutboxOptions,
        read_only: bool,
    ) -> Result<Outbox> {
        let stored = store.read_with(|tx| tx.load_rules())?;
        let staged = store.capabilities().staged_replies;
        let outbox = Outbox {
            inner: Arc::new(Inner {
                store,
                // Replies may have been staged while no handle was open.
                wakeups: Wakeups {
                    staged: Arc::new(staged.into()),
                    ..Wakeups::default()
                },
                staged_looked: AtomicI64::new(0),
                opened: Instant::now(),
                options,
                claimant: ClaimantId::random(),
                claims: AtomicU32::new(0),
                stored: Mutex::new(Arc::new(stored)),
                registration: Mutex::new(None),
                heartbeats: AtomicU64::new(0),
            }),
        };
        if !read_only {
            outbox
                .reconcile()
                .map_err(|e| outbox.inner.store.locate(e))?;
            if outbox.store().capabilities().shared {
                outbox.register();
            }
        }
        Ok(outbox)
    }

    /// Adds this process to the outbox's registry (see [`registry`](crate::registry)),
    /// and starts the heartbeat that renews its row while the handle lives. A failure
    /// is logged, not returned: the registry informs an upgrade, it guards nothing.
    fn register(&self) {
        let started = self.options().now_ms();
        let row = registry::this_process(
            self.claimant().to_string(),
            self.store().schema_version(),
            started,
            started,
        );
        let beat = move |inner: &Arc<Inner>| {
            let outbox = Outbox {
                inner: inner.clone(),
            };
            let now = outbox.options().now_ms();
            let row = ProcessRow {
                seen_at: now,
                ..row.clone()
            };
            let gone_before = now - 10 * registry::PROCESS_LEASE.as_millis() as i64;
            let noted = outbox.write(|tx, _| tx.note_process(&row, gone_before));
            inner.heartbeats.fetch_add(1, Ordering::SeqCst);
            noted
        };
        if let Err(e) = beat(&self.inner) {
            tracing::warn!(error = %e, "outbox: this process could not register itself");
        }
        let heartbeat = Registration::start(
            Arc::downgrade(&self.inner),
            registry::PROCESS_HEARTBEAT,
            beat,
        );
        *self
            .inner
            .registration
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(heartbeat);
    }

    /// How many heartbeats of the registry this handle has written (see
    /// [`dispatch::watch_others`](crate::dispatch)).
    pub(crate) fn heartbeats(&self) -> u64 {
        self.inner.heartbeats.load(Ordering::SeqCst)
    }

    /// The processes writing the outbox now (seen within [`registry::PROCESS_LEASE`]),
    /// each with its build, oldest build first: what a contract step would stop (see
    /// docs/OPERATING.md "Upgrades"). Builds of a schema before the registry (SQLite
    /// 15, PostgreSQL 10) do not register.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn processes(&self) -> Result<Vec<Process>> {
        let since = self.options().now_ms() - registry::PROCESS_LEASE.as_millis() as i64;
        let rows = self.read(|tx| tx.processes(since))?;
        Ok(rows.into_iter().map(Process::from).collect())
    }

    /// The store this handle's rules run on.
    pub(crate) fn store(&self) -> &dyn Store {
        &*self.inner.store
    }

    /// The rules stored in the file (see [`Rules`]), as every process on it follows
    /// them.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn rules(&self) -> Result<Rules> {
        self.read(|tx| Ok(tx.load_rules()?.policy))
    }

    /// Replaces the file-wide stored rules — lane order, lane failure policy, retry
    /// policy, default channel rules — and the rules of every channel named in
    /// `policy.channels` (a channel left out keeps its own). Every process on the file
    /// follows them from its next write on. Rows already stored move with the change: a
    /// switch to [`LaneOrder::Parallel`](crate::rules::LaneOrder::Parallel) starts every reply
    /// that was queued behind another, and a switch to
    /// [`LaneFailurePolicy::Skip`](crate::rules::LaneFailurePolicy::Skip) lets lanes blocked by
    /// a held head move on. (A switch to FIFO lets the replies already under way in a
    /// chat finish; new ones queue.)
    ///
    /// A file-wide rule is stored (declared, so that options giving another are a
    /// [`PolicyConflict`](Error::PolicyConflict)) when `policy` changes it or the file
    /// stores it already; one nobody declared that `policy` leaves as it reads stays
    /// undeclared, free for the first process that gives it.
    ///
    /// ```
    /// use chunked_outbox::{Outbox, OutboxOptions};
    /// use chunked_outbox::rules::LaneOrder;
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let mut rules = outbox.rules()?;
    /// rules.lane_order = LaneOrder::Parallel;
    /// outbox.set_rules(rules)?;
    /// assert_eq!(outbox.rules()?.lane_order, LaneOrder::Parallel);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for an invalid retry policy; database errors (nothing is
    /// changed then).
    pub fn set_rules(&self, policy: Rules) -> Result<()> {
        policy.retry.validate()?;
        rules::check_default_channel(&policy.default_channel)?;
        for rules in policy.channels.values() {
            rules.validate()?;
        }
        self.change_rules(|tx, before| {
            let (had, was) = (&before.policy, before.declared);
            let changed = FileRules {
                lane_order: was.lane_order || policy.lane_order != had.lane_order,
                lane_failure: was.lane_failure || policy.lane_failure != had.lane_failure,
                retry: was.retry || policy.retry.stored_form() != had.retry,
                default_channel: was.default_channel
                    || policy.default_channel.stored_form() != had.default_channel,
            };
            if changed.any() {
                tx.store_file_rules(&policy, changed)?;
            }
            for (channel, rules) in &policy.channels {
                tx.store_channel_rules(channel, Some(rules))?;
            }
            let now = self.options().now_ms();
            lane::follow_rule_change(tx, &before.policy, &policy, now)
        })
    }

    /// Gives one channel stored rules of its own (`Some`), or lets it follow the file's
    /// default channel rules (`None`). Every process on the file follows them from its
    /// next write on.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for an empty channel name or an invalid retry policy;
    /// database errors.
    pub fn set_channel_policy(&self, channel: &str, rules: Option<ChannelPolicy>) -> Result<()> {
        if channel.trim().is_empty() {
            return Err(Error::invalid("channel", "must not be empty or whitespace"));
        }
        if let Some(rules) = &rules {
            rules.validate()?;
        }
        self.change_rules(|tx, before| {
            tx.store_channel_rules(channel, rules.as_ref())?;
            // (A channel that stops asking its platform lets its waiting chats go on.)
            let mut after = before.policy.clone();
            after.set_channel(channel, rules.as_ref());
            lane::follow_rule_change(tx, &before.policy, &after, self.options().now_ms())
        })
    }

    /// The application's statement that finalization runs, if the file stores one (see
    /// [`set_finalization`](Self::set_finalization)).
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn finalization(&self) -> Result<Option<String>> {
        self.read(|tx| tx.finalization_statement())
    }

    /// Stores the statement that writes a finalized delivery into the application's
    /// own history (`Some`), or stops running one (`None`). It runs in the transaction
    /// of the delivery's last ack, after the delivery's row in `outbound_messages`,
    /// whose UNIQUE key keeps a delivery from being finalized twice: the application's
    /// table receives each delivery exactly once, whatever its own constraints. Every
    /// process that may finalize — dispatchers, [`resolve_uncertain`](Self::resolve_uncertain),
    /// [`recover`](Self::recover), the `outbox` tool — runs the same statement.
    ///
    /// Values are bound by name, never interpolated; the names are
    /// [`FINALIZE_PARAMETERS`](crate::rules::FINALIZE_PARAMETERS). The statement is checked
    /// against the file's schema when it is set. If the application's table refuses a
    /// reply when it runs (a constraint, a trigger, a row with that id already), that
    /// reply alone is set aside: its chunks stay delivered, nothing of its finalization
    /// is written, it becomes [`Unfinalized`](crate::monitoring::DeliveryStatus::Unfinalized) with
    /// the statement's message ([`Recorded::finalize_error`](crate::Recorded::finalize_error),
    /// health, `outbox show`), its chat moves on, and every other outcome of the same
    /// transaction is recorded. [`recover`](Self::recover) or
    /// [`finalize_again`](Self::finalize_again) finalizes it once the table takes it.
    /// (A trigger that raises `ROLLBACK` ends the whole transaction, so nothing of the
    /// ack is recorded; raise `ABORT` to refuse one row.)
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("app.db");
    /// rusqlite::Connection::open(&path).unwrap().execute_batch(
    ///     "CREATE TABLE messages (id TEXT PRIMARY KEY, chat_id TEXT, content TEXT, timestamp TEXT)",
    /// ).unwrap();
    /// let outbox = Outbox::open(&path, OutboxOptions::default())?;
    /// outbox.set_finalization(Some(
    ///     "INSERT INTO messages (id, chat_id, content, timestamp)
    ///      VALUES (:delivery_id, :chat_id, :content, :delivered_at_rfc3339)",
    /// ))?;
    /// outbox.enqueue(&NewDelivery::single("telegram", "77", "hello"))?;
    /// let claim = outbox.claim(1)?.pop().unwrap();
    /// outbox.ack(&claim, None)?;
    /// let app = rusqlite::Connection::open(&path).unwrap();
    /// let content: String = app.query_row("SELECT content FROM messages", [], |r| r.get(0)).unwrap();
    /// assert_eq!(content, "hello");
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] if the statement does not prepare against the file's
    /// schema, holds more than one statement, writes nothing, or uses a parameter that
    /// is positional or not one of the names (nothing is stored then); database errors.
    pub fn set_finalization(&self, sql: Option<&str>) -> Result<()> {
        self.transact(true, Announce::No, |tx, _| {
            if let Some(sql) = sql {
                finalize::validate_statement(tx, sql)?;
            }
            tx.store_finalization_statement(sql)
        })
    }

    /// Wakes this process's dispatchers to look for due work now.
    ///
    /// Every write of this handle that can make work due does this itself. Call it after
    /// committing a transaction in which you used [`enqueue_in`](Self::enqueue_in): the
    /// reply becomes visible only at your commit, so a wake-up before it would find
    /// nothing. Without the call, a dispatcher still notices the commit within its poll
    /// interval.
    pub fn wake(&self) {
        self.inner.wakeups.notifier.notify();
    }

    /// The claimant id this handle stamps on its claims (see [`ClaimantId`]).
    pub fn claimant(&self) -> ClaimantId {
        self.inner.claimant
    }

    /// A fencing token no other claim of this handle has, naming this handle.
    pub(crate) fn next_token(&self) -> i64 {
        let seq = self.inner.claims.fetch_add(1, Ordering::Relaxed);
        self.inner.claimant.token(seq)
    }

    /// Whether staged replies may be waiting, cleared (see [`Wakeups`]): said by a
    /// notification, or — on a store with staged replies, when this handle hears no
    /// notification (notifications off behind a transaction pooler, or its listener
    /// down) — once a [`STAGED_LOOK`] has passed since a claim last looked, so every
    /// claim loop finds staged replies within it.
    pub(crate) fn take_staged_hint(&self) -> bool {
        self.inner.wakeups.staged.swap(false, Ordering::AcqRel) || self.staged_look_due()
    }

    /// Whether a claim of this handle, which hears no notification, should look for
    /// staged replies now (see [`take_staged_hint`](Self::take_staged_hint)).
    fn staged_look_due(&self) -> bool {
        let store = self.store();
        if !store.capabilities().staged_replies || store.hears_commits() {
            return false;
        }
        let now = crate::clock::duration_ms(self.inner.opened.elapsed());
        let looked = &self.inner.staged_looked;
        let last = looked.load(Ordering::Acquire);
        now - last >= crate::clock::duration_ms(STAGED_LOOK)
            && looked
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// Whether staged replies may be waiting (the next claim should look).
    pub(crate) fn staged_hinted(&self) -> bool {
        self.inner.wakeups.staged.load(Ordering::Acquire)
    }

    /// Says that staged replies may be waiting.
    pub(crate) fn hint_staged(&self) {
        self.inner.wakeups.staged.store(true, Ordering::Release);
    }

    pub(crate) fn notifier(&self) -> &Notifier {
        &self.inner.wakeups.notifier
    }

    /// Watches the database for commits by any connection, including other
    /// processes' (see [`Store::watch`]).
    ///
    /// # Errors
    ///
    /// Database errors opening the watching connection; [`Error::Io`] if a listener's
    /// thread cannot be started.
    pub(crate) fn change_watcher(&self) -> Result<Box<dyn ChangeWatch>> {
        self.store().watch(&self.inner.wakeups)
    }

    /// Starts hearing other processes' commits, where the store can (see
    /// [`Store::listen`]).
    pub(crate) fn listen_for_staged(&self) {
        self.store().listen(&self.inner.wakeups);
    }

    /// The uid of a new delivery in row `rowid`.
    pub(crate) fn new_delivery_id(&self, rowid: i64, created_ms: i64) -> DeliveryId {
        DeliveryId::for_row(rowid, self.store().id_salt(), created_ms)
    }

    /// The row of delivery `id` in this database, if it is one of ours (callers also
    /// match the stored uid).
    pub(crate) fn delivery_rowid(&self, id: DeliveryId) -> i64 {
        id.rowid(self.store().id_salt())
    }

    /// The database file, or `None` for an in-memory outbox and one in PostgreSQL.
    pub fn path(&self) -> Option<&Path> {
        self.store().path()
    }

    /// The outbox's time: what its rules store and compare (due times, leases, ages).
    /// On PostgreSQL that is the server's clock — this handle's clock corrected by its
    /// offset to the server's, measured at every write — so every host agrees on it; on
    /// SQLite, this handle's clock. Give cutoffs on it rather than on the host's own
    /// clock, which may be minutes off:
    ///
    /// ```
    /// use chunked_outbox::{Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let report = outbox.purge(outbox.now() - chrono::Duration::days(7))?;
    /// assert_eq!(report.deliveries, 0);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        crate::clock::to_datetime(self.options().now_ms())
    }

    /// The options this outbox was opened with.
    pub fn options(&self) -> &OutboxOptions {
        &self.inner.options
    }

    /// Runs `f` in one write transaction with the stored rules as they stand in it;
    /// commits if it returns `Ok`, rolls back otherwise.
    pub(crate) fn write<T: Send>(
        &self,
        f: impl FnMut(&dyn StoreTx, &Stored) -> Result<T> + Send,
    ) -> Result<T> {
        self.transact(false, Announce::No, f)
    }

    /// As [`write`](Self::write) for a change of the stored rules: the rules held
    /// exclusively, so no other write acts on the rules it replaces; then wakes this
    /// process's dispatchers.
    fn change_rules(
        &self,
        f: impl FnMut(&dyn StoreTx, &Stored) -> Result<()> + Send,
    ) -> Result<()> {
        self.transact(true, Announce::Yes, f)?;
        self.wake();
        Ok(())
    }

    /// As [`change_rules`](Self::change_rules), for work that returns a value.
    pub(crate) fn change_rules_with<T: Send>(
        &self,
        mut f: impl FnMut(&dyn StoreTx) -> Result<T> + Send,
    ) -> Result<T> {
        let value = self.transact(true, Announce::Yes, |tx, _| f(tx))?;
        self.wake();
        Ok(value)
    }

    /// One write transaction: the rules locked (shared, or exclusive for a change of
    /// them) and read as they stand in it, `f`, then the commit — announced to every
    /// listening process as `announce` says.
    fn transact<T: Send>(
        &self,
        change_rules: bool,
        announce: Announce,
        mut f: impl FnMut(&dyn StoreTx, &Stored) -> Result<T> + Send,
    ) -> Result<T> {
        let how = Write {
            change_rules,
            announce,
        };
        let result = self.store().write_with(how, |tx| {
            tx.lock_rules(change_rules)?;
            let rules = self.current_rules(tx)?;
            f(tx, &rules)
        });
        if result.is_err() && self.store().capabilities().staged_replies {
            // Staged replies it made deliveries of are staged again.
            self.hint_staged();
        }
        result
    }

    /// The stored rules as the caller's own transaction sees them (`enqueue_in`): the
    /// handle's copy when it is of the same version, else read here and **not** kept.
    /// That transaction may yet roll back (a channel it registered, a version it
    /// bumped, would then never have existed), so nothing read inside it may enter the
    /// copy every clone of this handle shares.
    pub(crate) fn rules_uncached(&self, tx: &dyn StoreTx) -> Result<Arc<Stored>> {
        let version = tx.rules_version()?;
        let cached = self.cached_rules();
        if cached.version == version {
            return Ok(cached);
        }
        Ok(Arc::new(tx.load_rules()?))
    }

    /// The handle's copy of the stored rules.
    fn cached_rules(&self) -> Arc<Stored> {
        self.inner
            .stored
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The stored rules, read again if another handle (or process) changed them since
    /// this handle last read them: one single-row read per transaction otherwise.
    fn current_rules(&self, tx: &dyn StoreTx) -> Result<Arc<Stored>> {
        let held = self.cached_rules().version;
        let version = tx.rules_version_or(held)?;
        let mut cached = self.inner.stored.lock().unwrap_or_else(|e| e.into_inner());
        if cached.version != version {
            *cached = Arc::new(tx.load_rules()?);
        }
        Ok(cached.clone())
    }

    /// As [`write`](Self::write), then wakes the idle dispatchers of this process,
    /// and those of every other process on the outbox as `announce` says (by a
    /// notification sent with the commit, where the store can): [`Announce::Yes`] for
    /// writes that can make work due, [`Announce::IfMadeDue`] for enqueues,
    /// [`Announce::No`] for a dispatcher's own round, whose claim in the same
    /// transaction takes what its outcomes made due (other hosts find the rest when
    /// they next look).
    pub(crate) fn write_and_wake<T: Send>(
        &self,
        announce: Announce,
        f: impl FnMut(&dyn StoreTx, &Stored) -> Result<T> + Send,
    ) -> Result<T> {
        let value = self.transact(false, announce, f)?;
        self.wake();
        Ok(value)
    }

    /// Runs `f` in one read transaction: everything `f` reads is one consistent
    /// snapshot.
    pub(crate) fn read<T: Send>(
        &self,
        f: impl FnOnce(&dyn StoreTx) -> Result<T> + Send,
    ) -> Result<T> {
        self.store().read_with(f)
    }

    /// Makes the stored rules agree with those the options declare (see
    /// [`reconcile`]), holding the rules exclusively.
    fn reconcile(&self) -> Result<()> {
        if !self.options().declares_rules() {
            return Ok(());
        }
        self.transact(true, Announce::Yes, |tx, _| reconcile(tx, self.options()))
    }
}

/// Makes the stored rules agree with those `options` declares, in a transaction holding
/// the rules exclusively (so processes opening one outbox at once see each other's
/// declarations): a rule nobody declared yet is stored as given; a declared rule that
/// differs is [`Error::PolicyConflict`] unless the options say to update. A channel
/// with no rules of its own takes the rules given for it.
fn reconcile(tx: &dyn StoreTx, options: &OutboxOptions) -> Result<()> {
    // Compared as the file would store them (whole milliseconds), or a rule given in
    // finer units would differ from itself once stored.
    let retry = options.retry.as_ref().map(RetryPolicy::stored_form);
    let default_channel = options
        .default_channel
        .as_ref()
        .map(ChannelPolicy::stored_form);
    let Stored {
        policy: stored,
        declared,
        ..
    } = tx.load_rules()?;
    let mut wanted = stored.clone();
    let update = options.policy_update;
    let store = FileRules {
        lane_order: declare(
            "lane order",
            options.lane_order,
            declared.lane_order,
            &mut wanted.lane_order,
            |o| rules::lane_order_str(*o).into(),
            update,
        )?,
        lane_failure: declare(
            "lane failure policy",
            options.lane_failure,
            declared.lane_failure,
            &mut wanted.lane_failure,
            |f| rules::lane_failure_str(*f).into(),
            update,
        )?,
        retry: declare(
            "retry policy",
            retry,
            declared.retry,
            &mut wanted.retry,
            rules::retry_to_json,
            update,
        )?,
        default_channel: declare(
            "default channel rules",
            default_channel,
            declared.default_channel,
            &mut wanted.default_channel,
            |c| format!("{c:?}"),
            update,
        )?,
    };
    let mut channels = Vec::new();
    for (name, given) in &options.channels {
        let mut have = stored.channels.get(name).cloned();
        let declared = have.is_some();
        let given = Some(Some(given.stored_form()));
        if declare(
            &format!("rules of channel {name:?}"),
            given,
            declared,
            &mut have,
            |c| c.as_ref().map(|c| format!("{c:?}")).unwrap_or_default(),
            update,
        )? {
            channels.push((name, have));
        }
    }
    if store.any() {
        tx.store_file_rules(&wanted, store)?;
    }
    for (name, rules) in &channels {
        tx.store_channel_rules(name, rules.as_ref())?;
        wanted.set_channel(name, rules.as_ref());
    }
    if store.any() || !channels.is_empty() {
        lane::follow_rule_change(tx, &stored, &wanted, options.now_ms())?;
    }
    Ok(())
}

/// Declares one stored rule: `Ok(true)` to store `given` (nobody declared the rule, or
/// the options update it), `Ok(false)` if nothing is given or the same is stored,
/// [`Error::PolicyConflict`] if another is stored. `wanted` becomes `given`.
fn declare<T: PartialEq>(
    rule: &str,
    given: Option<T>,
    declared: bool,
    wanted: &mut T,
    show: impl Fn(&T) -> String,
    update: bool,
) -> Result<bool> {
    let Some(given) = given else {
        return Ok(false);
    };
    let store = if declared && given == *wanted {
        false
    } else if !declared || update {
        true
    } else {
        return Err(Error::PolicyConflict {
            rule: rule.into(),
            stored: show(wanted),
            given: show(&given),
        });
    };
    *wanted = given;
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store without staged replies never has its claims look for them unasked,
    /// however long since the last look; an SQLite outbox has none.
    #[test]
    fn no_unasked_look_for_staged_replies_where_none_can_be() {
        let outbox = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
        let long_ago = -10 * crate::clock::duration_ms(STAGED_LOOK);
        outbox
            .inner
            .staged_looked
            .store(long_ago, Ordering::Release);
        assert!(!outbox.take_staged_hint());
        assert_eq!(outbox.inner.staged_looked.load(Ordering::Acquire), long_ago);
    }
}
