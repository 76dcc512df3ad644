//! The options of a handle: settings of this process, and the stored rules it declares.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock, duration_ms};
use crate::error::{Error, Result};
use crate::rules::{ChannelPolicy, LaneFailurePolicy, LaneOrder, RetryPolicy};

/// SQLite's `synchronous` setting for the database.
///
/// Both settings keep every committed transaction across a crash of the *process*. They
/// differ on power loss or an operating-system crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// `synchronous=NORMAL`: in WAL mode, commits are not fsynced one by one; a power
    /// loss may roll back the most recent transactions, but never corrupts the file.
    /// Several times faster. The default.
    #[default]
    Normal,
    /// `synchronous=FULL`: every commit is fsynced; committed transactions also survive
    /// power loss.
    Full,
}

impl Synchronous {
    pub(crate) fn pragma_value(self) -> i64 {
        match self {
            Synchronous::Normal => 1,
            Synchronous::Full => 2,
        }
    }
}

/// Options for [`Outbox::open`](crate::Outbox::open) and
/// [`Outbox::open_in_memory`](crate::Outbox::open_in_memory).
///
/// Two kinds of option live here. Settings of this process — busy timeout,
/// `synchronous`, lease, readers, size cap, checkpoints, clock — apply to this handle
/// only. **Rules whose effects are stored** — lane order, lane failure policy, retry
/// policy, channel rules — live in the file, so every process acts on the same rows by
/// the same rules ([`Rules`](crate::rules::Rules)). A rule given here that the file does not
/// store yet (nobody declared it: a new file, one from before rules were stored, one
/// created by the `outbox` tool) is stored; one the file stores is checked, where a
/// difference is [`Error::PolicyConflict`] unless
/// [`with_policy_update`](Self::with_policy_update) says to replace it. Change them
/// on a running outbox with [`Outbox::set_rules`](crate::Outbox::set_rules) and
/// [`Outbox::set_channel_policy`](crate::Outbox::set_channel_policy), or with `outbox
/// config set`.
///
/// | option | default |
/// |---|---|
/// | busy timeout | 5 s |
/// | `synchronous` | [`Synchronous::Normal`] |
/// | lease | 60 s (at least 1 ms) |
/// | create if missing | yes |
/// | upgrade an older schema | yes |
/// | reader connections | 4 |
/// | maximum database size | none |
/// | background WAL checkpoints | every 100 ms |
/// | clock | [`SystemClock`] |
/// | PostgreSQL: wake-ups by LISTEN/NOTIFY | on |
/// | stored: retry | [`RetryPolicy::default`] (5 s, 25 s, 2 min, 10 min; 5 attempts; ±10 %) |
/// | stored: channel rules | [`ChannelPolicy::default`] (hold ambiguous sends, no pacing) for every channel |
/// | stored: lane order | [`LaneOrder::Fifo`] |
/// | stored: lane failure | [`LaneFailurePolicy::Skip`] |
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::OutboxOptions;
/// use chunked_outbox::store::sqlite::Synchronous;
/// use chunked_outbox::rules::ChannelPolicy;
///
/// let options = OutboxOptions::default()
///     .with_synchronous(Synchronous::Full)
///     .with_lease(Duration::from_secs(30))
///     .with_channel("matrix", ChannelPolicy::replayable())
///     .with_channel("telegram", ChannelPolicy::default().with_lane_interval(Duration::from_secs(1)));
/// ```
#[derive(Debug, Clone)]
pub struct OutboxOptions {
    pub(crate) busy_timeout: Duration,
    pub(crate) synchronous: Synchronous,
    pub(crate) lease: Duration,
    pub(crate) create_if_missing: bool,
    pub(crate) upgrade_schema: bool,
    pub(crate) readers: u32,
    pub(crate) max_size: Option<u64>,
    pub(crate) checkpoint_every: Option<Duration>,
    pub(crate) clock: Arc<dyn Clock>,
    /// Stored rules this process declares (`None`: whatever the file stores).
    pub(crate) retry: Option<RetryPolicy>,
    pub(crate) default_channel: Option<ChannelPolicy>,
    pub(crate) channels: Vec<(String, ChannelPolicy)>,
    pub(crate) lane_order: Option<LaneOrder>,
    pub(crate) lane_failure: Option<LaneFailurePolicy>,
    pub(crate) policy_update: bool,
    pub(crate) listen: bool,
    pub(crate) transaction_pooler: bool,
}

impl Default for OutboxOptions {
    fn default() -> Self {
        OutboxOptions {
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::Normal,
            lease: Duration::from_secs(60),
            create_if_missing: true,
            upgrade_schema: true,
            readers: 4,
            max_size: None,
            checkpoint_every: Some(Duration::from_millis(100)),
            clock: Arc::new(SystemClock),
            retry: None,
            default_channel: None,
            channels: Vec::new(),
            lane_order: None,
            lane_failure: None,
            policy_update: false,
            listen: true,
            transaction_pooler: false,
        }
    }
}

impl OutboxOptions {
    /// Checks every option against its documented range; [`Outbox::open`](crate::Outbox::open)
    /// calls it before touching the file.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a lease under 1 ms (a claim that protects nothing:
    /// two claimers would get the same chunk), an invalid retry policy (see
    /// [`RetryPolicy::validate`]), default channel rules with a retry policy of their
    /// own (give the file-wide one with [`with_retry`](Self::with_retry)), or a zero
    /// background checkpoint interval.
    pub fn validate(&self) -> Result<()> {
        if duration_ms(self.lease) < 1 {
            return Err(Error::invalid(
                "lease",
                format!(
                    "{:?} is under 1 ms; a lease must cover a send, or another claimer gets the same chunk",
                    self.lease
                ),
            ));
        }
        if let Some(retry) = &self.retry {
            retry.validate()?;
        }
        if let Some(rules) = &self.default_channel {
            crate::rules::check_default_channel(rules)?;
        }
        for (_, policy) in &self.channels {
            policy.validate()?;
        }
        if self.checkpoint_every.is_some_and(|every| every.is_zero()) {
            return Err(Error::invalid(
                "background checkpoints",
                "the interval is zero; use None to turn them off",
            ));
        }
        Ok(())
    }

    /// How long a connection waits for another one's write lock before giving up with
    /// [`Error::Busy`](crate::Error::Busy).
    pub fn with_busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Durability of commits; see [`Synchronous`].
    pub fn with_synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a claim owns its chunk unless renewed. A claim whose lease expired can be
    /// recovered by any claimer; a running [`Dispatcher`](crate::Dispatcher) renews the
    /// leases of the sends it has in flight, so the lease bounds how long a crashed
    /// dispatcher's chunks stay held, not how long a send may take. At least 1 ms.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Stored rule: the retry schedule and attempt budget of channels without one of
    /// their own.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }

    /// Stored rule: the rules of one channel, by name.
    pub fn with_channel(mut self, channel: impl Into<String>, policy: ChannelPolicy) -> Self {
        let channel = channel.into();
        self.channels.retain(|(name, _)| *name != channel);
        self.channels.push((channel, policy));
        self
    }

    /// Stored rule: the rules of channels without rules of their own. Their retry
    /// policy is the file-wide one ([`with_retry`](Self::with_retry)): rules given here
    /// with a retry policy of their own are refused at open.
    pub fn with_default_channel(mut self, policy: ChannelPolicy) -> Self {
        self.default_channel = Some(policy);
        self
    }

    /// Stored rule: ordering of deliveries within a chat.
    pub fn with_lane_order(mut self, order: LaneOrder) -> Self {
        self.lane_order = Some(order);
        self
    }

    /// Stored rule: what a FIFO lane does when its head fails for good.
    pub fn with_lane_failure(mut self, policy: LaneFailurePolicy) -> Self {
        self.lane_failure = Some(policy);
        self
    }

    /// Whether stored rules given in these options replace the file's when they
    /// differ (`true`), instead of failing the open with
    /// [`Error::PolicyConflict`](crate::Error::PolicyConflict) (`false`, the default).
    /// For an application that keeps its rules in its code and owns the file.
    pub fn with_policy_update(mut self, update: bool) -> Self {
        self.policy_update = update;
        self
    }

    /// Whether [`Outbox::open`](crate::Outbox::open) may create a missing file. When
    /// false, a missing file is [`Error::DatabaseMissing`](crate::Error::DatabaseMissing)
    /// and nothing appears on disk.
    pub fn with_create_if_missing(mut self, create: bool) -> Self {
        self.create_if_missing = create;
        self
    }

    /// Whether [`Outbox::open`](crate::Outbox::open) may bring an older schema up to
    /// date. When false, a file at an older schema version is
    /// [`Error::SchemaTooOld`](crate::Error::SchemaTooOld), and a file that is not an
    /// outbox is [`Error::NotAnOutbox`](crate::Error::NotAnOutbox); either is left as it
    /// was. Default true.
    pub fn with_schema_upgrade(mut self, upgrade: bool) -> Self {
        self.upgrade_schema = upgrade;
        self
    }

    /// PostgreSQL: whether dispatchers are woken by the commits of other processes and
    /// hosts (`LISTEN`/`NOTIFY`, on a connection of each handle that runs a dispatcher)
    /// or only find their work at each poll. Behind a pooler in transaction mode, which
    /// cannot keep a `LISTEN`, it is off ([`with_transaction_pooler`](Self::with_transaction_pooler)).
    /// Default on; no effect on SQLite, where other processes' commits are seen at each
    /// poll.
    pub fn with_listen(mut self, listen: bool) -> Self {
        self.listen = listen;
        self
    }

    /// PostgreSQL: the URL names a pooler in transaction mode (PgBouncer's
    /// `pool_mode = transaction`), which hands each transaction whichever server
    /// connection is free. The handle then keeps nothing on a server connection beyond
    /// one transaction: statements are sent unnamed with their values (the server
    /// plans each execution, where a direct connection reuses its plans: through
    /// PgBouncer a single enqueue costs about three times as much), every setting is
    /// local to its transaction, wake-ups come from polls (no `LISTEN`), and it never
    /// migrates the schema (a migration's lock outlives its transaction): run `outbox
    /// migrate` (or connect once) through a direct connection when a new version
    /// arrives; until then a handle through the pooler is
    /// [`Error::SchemaTooOld`](crate::Error::SchemaTooOld). Behind PgBouncer the URL
    /// cannot name the schema (PgBouncer refuses the `options` parameter): give the
    /// role a default instead, `ALTER ROLE bot SET search_path = outbox`. A session
    /// pooler, or a direct connection, needs none of this. Default off.
    ///
    /// ```no_run
    /// use chunked_outbox::{Outbox, OutboxOptions};
    ///
    /// // Once per deploy, on a direct connection: the schema at this build's version.
    /// Outbox::connect("postgres://bot@db.internal:5432/chat", OutboxOptions::default())?;
    /// // Every process, through PgBouncer in transaction mode.
    /// let outbox = Outbox::connect(
    ///     "postgres://bot@pgbouncer.internal:6432/chat",
    ///     OutboxOptions::default().with_transaction_pooler(true),
    /// )?;
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub fn with_transaction_pooler(mut self, pooler: bool) -> Self {
        self.transaction_pooler = pooler;
        self
    }

    /// Number of pooled read-only connections (at least 1).
    pub fn with_readers(mut self, readers: u32) -> Self {
        self.readers = readers.max(1);
        self
    }

    /// Caps the database file at about `bytes` (SQLite's `max_page_count`). A write
    /// that would grow it further fails with [`Error::DiskFull`](crate::Error::DiskFull)
    /// and changes nothing; reopening with a larger cap (or none) lifts it. Default: no
    /// cap beyond the disk's.
    pub fn with_max_size(mut self, bytes: Option<u64>) -> Self {
        self.max_size = bytes;
        self
    }

    /// Passive WAL checkpoints on a background thread, this interval after every 8
    /// commits of the handle (a minute after fewer; none while nothing is written), so
    /// that the checkpoint rarely falls inside a commit (which then stalls for an fsync). SQLite's
    /// automatic checkpoint stays on as the bound under sustained writes, at
    /// [`BACKGROUND_AUTOCHECKPOINT_PAGES`](crate::store::sqlite::StorageSettings::BACKGROUND_AUTOCHECKPOINT_PAGES)
    /// instead of 1000. `None` leaves checkpoints to it alone, at SQLite's default.
    /// Files only. Default 100 ms.
    pub fn with_background_checkpoints(mut self, every: Option<Duration>) -> Self {
        self.checkpoint_every = every;
        self
    }

    /// Whether these options declare any stored rule (see [`Rules`](crate::rules::Rules)).
    pub(crate) fn declares_rules(&self) -> bool {
        self.lane_order.is_some()
            || self.lane_failure.is_some()
            || self.retry.is_some()
            || self.default_channel.is_some()
            || !self.channels.is_empty()
    }

    /// The clock every timestamp is read from.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The retry policy these options give the file, if they give one.
    pub fn retry_policy(&self) -> Option<&RetryPolicy> {
        self.retry.as_ref()
    }

    pub(crate) fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }
}
