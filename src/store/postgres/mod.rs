//! The PostgreSQL store (feature `postgres`): the same rules over tables in a
//! PostgreSQL schema, shared by every process and host of an application.
//!
//! # Enqueue inside the application's own transaction
//!
//! With [`Outbox::enqueue_in_pg`] (and `enqueue_in_tokio_pg`, `enqueue_in_sqlx`) the
//! reply commits or rolls back with the application's own writes (the transactional
//! outbox).
//!
//! The application's transaction runs one statement of the crate, the function
//! `outbound_enqueue(...)` that the outbox's schema holds. It writes one row — the
//! reply, *staged*: its lane not yet decided — and takes no lock of the outbox but
//! that row's and its caller key's. So a lane busy with other replies never holds up
//! the application's commit, a rollback leaves nothing, and the notification that
//! wakes the dispatchers of every host is sent by the commit itself. The outbox's own
//! short transactions then make the staged reply a delivery of its lane (by the next
//! claim of any dispatcher, or [`Outbox::recover`]), in commit order within the lane,
//! keeping the uid the application was given.
//!
//! # Isolation levels
//!
//! - **READ COMMITTED** (PostgreSQL's default): a caller key another transaction is
//!   using waits for that transaction; if it commits, the call returns its reply
//!   (`created == false`, or [`Error::IdempotencyConflict`] for other content); if it
//!   rolls back, the call makes the reply.
//! - **REPEATABLE READ** and **SERIALIZABLE**: the same, except that a key taken by a
//!   transaction that committed after this one's snapshot was taken cannot be read
//!   here: the call fails with [`Error::Busy`] (the server's serialization failure,
//!   `40001`), and the application retries its transaction, as it must for any write
//!   at these levels. A key taken before the snapshot returns that reply.
//!
//! A reply staged and not yet started shows as `queued` (without chunks) to
//! [`Outbox::delivery`] and in health, and can be cancelled.
//!
//! Any other client can call the function itself with the same eleven arguments
//! (`SELECT * FROM outbound_enqueue(...)`, see the migration
//! `V2__staged_replies.sql`); the typed calls also check the reply as
//! [`Outbox::enqueue`] does and compare the content of a reply found by its key.
//!
//! [`Outbox::enqueue_in_pg`]: crate::Outbox::enqueue_in_pg
//! [`Outbox::recover`]: crate::Outbox::recover
//! [`Outbox::delivery`]: crate::Outbox::delivery
//! [`Outbox::enqueue`]: crate::Outbox::enqueue
//! [`Error::IdempotencyConflict`]: crate::Error::IdempotencyConflict
//! [`Error::Busy`]: crate::Error::Busy

// Transactions run at READ COMMITTED, and the lock primitives of the seam are real
// locks (see `Locks` below): the rules read-decide-write only under them, so
// concurrent writers on several hosts keep every lane's order, every caller key and
// every channel's rate. Claims never wait: their chunk rows, lanes and channel slots
// are taken with `SKIP LOCKED`.
//
// Each connection keeps the statements it prepared, by the address of their `'static`
// text, so a statement is parsed and planned once per connection. Behind a transaction
// pooler, where the next transaction may run on another server connection, it keeps
// only each statement's parameter types and sends the statement unnamed with its
// values: one round trip, and no name left on the server.

pub(crate) mod application;
pub(crate) mod chunks;
pub(crate) mod client;
pub(crate) mod deliveries;
pub(crate) mod lanes;
pub(crate) mod listen;
pub(crate) mod operator;
#[cfg(test)]
mod plans;
pub(crate) mod processes;
pub(crate) mod reads;
pub(crate) mod rules;
pub(crate) mod runtime;
pub(crate) mod schema;
pub(crate) mod server;
pub(crate) mod statement;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use postgres::types::{ToSql, Type};
use postgres::{Row, Statement};

use crate::clock::ServerTime;
use crate::error::{Error, Result};
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::connections::Announce;
use crate::store::{ChannelRow, LaneEntry, LaneRef, Locks, StoreTx};

/// The public id of chunk `$index` of delivery row `$delivery`, as a column:
/// `delivery * CHUNK_STRIDE + index`.
macro_rules! chunk_id {
    ($delivery:literal, $index:literal) => {
        concat!(
            $delivery,
            " * ",
            $crate::store::chunk_stride!(),
            " + ",
            $index
        )
    };
}
pub(crate) use chunk_id;

/// The server's clock in milliseconds since the epoch, as a column.
macro_rules! server_ms {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000)::int8"
    };
}

/// Column `i` of the last row a simple query answered, if it has one and it is not
/// NULL.
fn simple_column(answer: &[postgres::SimpleQueryMessage], i: usize) -> Option<&str> {
    answer
        .iter()
        .rev()
        .find_map(|m| match m {
            postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .and_then(|row| row.try_get(i).ok().flatten())
}

/// The parameters of a statement.
pub(crate) type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// The pool of connections to the outbox's database: writes and reads alike.
pub(crate) struct PgStore {
    pool: Pool,
    /// Where the pool connects, for the listener's own connection.
    pub(crate) config: postgres::Config,
    /// The schema the outbox's tables are in (the first of the URL's `search_path`),
    /// quoted as an identifier by the server.
    pub(crate) quoted_schema: String,
    /// The connection string, without its password, for messages.
    pub(crate) target: String,
    /// Every transaction is READ ONLY: the server refuses a write.
    pub(crate) read_only: bool,
    /// The handle's time: the server's clock, read again at every write's `BEGIN`.
    pub(crate) time: Arc<ServerTime>,
    /// How each transaction begins (see [`Begins`]).
    pub(crate) begins: Box<Begins>,
    /// The salt of the database's delivery uids, read when it connected.
    id_salt: i64,
    /// How long a commit whose answer was lost asks the server what became of it
    /// (the busy timeout).
    patience: Duration,
    /// Whether a listener may hear other processes' commits (see `server.rs`).
    listens: bool,
    /// The listener, started by the first dispatcher or claim of the handle.
    listener: std::sync::OnceLock<Option<listen::Listener>>,
}

/// The round trip that begins each kind of transaction ([`Begin`]): `BEGIN`, then
/// `outbound_begin` (schema V5; one call, planned once per session) — or, for a write
/// on a connection of its own, the two prepared statements of [`OPENING_SQL`], which
/// do the same — setting for the transaction only (nothing leaks to other clients of
/// a pooler):
///
/// - `lock_timeout`, the busy timeout: a write that waits longer for a lane, a caller
///   key or the rules fails with [`Error::Busy`] instead of waiting without limit;
/// - no JIT and no parallel plans: short transactional statements, where a
///   misestimate should cost a loop, not a compile or a worker start;
/// - `idle_in_transaction_session_timeout`, twice the busy timeout and at least 2 s:
///   a transaction of this crate never waits between its statements, so a session
///   left idle inside one has lost its client (a process frozen or killed, a network
///   cut) and the server ends it, freeing the lanes it held, in seconds, not when TCP
///   at last notices (hours by default);
///
/// and, for a write, how it plans (below), then takes the rules' lock and reads, once
/// the lock is granted, the rules' version, the server's clock and the schema's version.
///
/// How a write plans its statements: each statement is prepared once per connection;
/// left to choose (`plan_cache_mode = auto`), the server plans most of the writes'
/// statements afresh at every execution (their parameters are arrays and limits it
/// cannot cost without values), and planning took longer than running them (an
/// enqueue: 0.33 ms of planning, 0.14 ms of execution). A write runs the generic plan
/// instead, made once per connection and kept until its tables' statistics change —
/// the plan the plan tests check (`plans.rs`) — with the plans that read whole tables
/// priced out (as [`PgTx::on_indexes`] does for a read). A plan made on empty tables (a
/// new outbox) can still read whole indexes; autovacuum's first analysis of the grown
/// table replaces it (`plans.rs` shows that it does). Reads keep the server's choice:
/// an inspection's optional filters want plans made for their values.
pub(crate) struct Begins {
    read: String,
    /// By `[read-only handle][change of the rules]`.
    write: [[String; 2]; 2],
    /// The `BEGIN` alone of a write on a connection of its own, by `[read-only handle]`
    /// (see [`OPENING_SQL`]).
    bare: [&'static str; 2],
    /// `lock_timeout` and `idle_in_transaction_session_timeout`, in milliseconds.
    lock_ms: String,
    idle_ms: String,
}

/// A write's opening on a connection of its own (not behind a transaction pooler),
/// sent after its bare `BEGIN` as two statements prepared on the connection, where
/// `outbound_begin` is one call of a function: the settings of [`Begins`] (`$1` the
/// lock timeout, `$2` the idle one) and the rules' lock (exclusive with `$3`), then,
/// read by the next statement once that lock is granted (in READ COMMITTED each
/// statement reads what was committed when it began), what [`STATE_SQL`] reads. The
/// function's call cost the server 0.09 ms per transaction, the two statements half
/// of that (`pg_stat_statements`).
const OPENING_SQL: &str = "SELECT outbound_lock_rules($3) FROM (
         SELECT set_config('lock_timeout', $1, true),
                set_config('idle_in_transaction_session_timeout', $2, true),
                set_config('jit', 'off', true),
                set_config('max_parallel_workers_per_gather', '0', true),
                set_config('plan_cache_mode', 'force_generic_plan', true),
                set_config('enable_seqscan', 'off', true),
                set_config('enable_mergejoin', 'off', true),
                set_config('enable_hashjoin', 'off', true)) settings";
/// The rules' version, the server's clock (ms) and the oldest build the schema accepts
/// as a writer, as `outbound_begin` answers them.
const STATE_SQL: &str = "SELECT p.version, (extract(epoch FROM clock_timestamp()) * 1000)::int8,
            p.writable_from
     FROM outbound_policy p WHERE p.id = 1";

impl Begins {
    pub(crate) fn new(busy_timeout: Duration) -> Self {
        let lock_ms = busy_timeout.as_millis().max(1);
        let idle_ms = (2 * busy_timeout.as_millis()).max(2_000);
        let sql = |begin: &str, rules_lock: &str| {
            format!("{begin}; SELECT * FROM outbound_begin({rules_lock}, {lock_ms}, {idle_ms})")
        };
        let write = |read_only: &str| {
            let begin = format!("BEGIN ISOLATION LEVEL READ COMMITTED{read_only}");
            [sql(&begin, "'shared'"), sql(&begin, "'exclusive'")]
        };
        Begins {
            read: sql("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", "NULL"),
            write: [write(""), write(" READ ONLY")],
            bare: [
                "BEGIN ISOLATION LEVEL READ COMMITTED",
                "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY",
            ],
            lock_ms: lock_ms.to_string(),
            idle_ms: idle_ms.to_string(),
        }
    }

    fn sql(&self, kind: Begin) -> &str {
        match kind {
            Begin::Write { change_rules } => &self.write[0][usize::from(change_rules)],
            Begin::WriteRefused { change_rules } => &self.write[1][usize::from(change_rules)],
            Begin::Read => &self.read,
        }
    }
}

impl PgStore {
    /// A pool of up to `size` connections to `url`, the first one opened now (so a
    /// wrong address fails here, with the server's message).
    pub(crate) fn connect(
        url: &str,
        size: u32,
        timeout: std::time::Duration,
        read_only: bool,
        pooled: bool,
        time: Arc<ServerTime>,
    ) -> Result<Self> {
        let mut config: tokio_postgres::Config = url.parse().map_err(|e: postgres::Error| {
            Error::invalid(
                "database url",
                format!(
                    "{} is not a PostgreSQL URL: {e}",
                    crate::store::redact_url(url)
                ),
            )
        })?;
        noticing_cuts(&mut config, timeout);
        let target = describe(&config);
        let manager = Manager {
            config: config.clone(),
            pooled,
        };
        // The first connection is made here, not by the pool: a wrong address, a refused
        // login or a missing socket fails at once with what the OS or the server said
        // (the pool would retry until its timeout and keep only "error connecting").
        let mut first = r2d2::ManageConnection::connect(&manager)?;
        // A connection idle for a while is checked when taken (a server restarted or
        // a connection ended meanwhile is replaced, not handed out; see
        // `Manager::is_valid`), and dropped when found broken.
        let pool = r2d2::Pool::builder()
            .max_size(size)
            .test_on_check_out(true)
            .min_idle(Some(0))
            .connection_timeout(timeout)
            .thread_pool(crate::store::connections::pool_upkeep())
            .build_unchecked(manager);
        let pool = Pool(Some(pool));
        let mut store = PgStore {
            pool,
            config: config.into(),
            quoted_schema: String::new(),
            target,
            read_only,
            time,
            begins: Box::new(Begins::new(timeout)),
            id_salt: 0,
            patience: timeout,
            listens: false,
            listener: std::sync::OnceLock::new(),
        };
        // The same round trip aligns the handle's time with the server's (a simple
        // query: one message, which a transaction pooler passes whole).
        let before = store.time.local_ms();
        let answer = first.client.simple_query(concat!(
            "SELECT quote_ident(coalesce(current_schema(), '')), ",
            server_ms!()
        ))?;
        let after = store.time.local_ms();
        if let Some(server) = simple_column(&answer, 1).and_then(|v| v.parse().ok()) {
            store.time.observe(server, before, after);
        }
        store.quoted_schema = simple_column(&answer, 0).unwrap_or_default().to_owned();
        Ok(store)
    }

    /// A connection of the pool.
    pub(crate) fn connection(&self) -> Result<r2d2::PooledConnection<Manager>> {
        self.pool.get().map_err(|e| Error::Connection {
            target: self.target.clone(),
            message: e.to_string(),
        })
    }

    /// Runs `f` on a transaction begun as `kind` on a connection of the pool.
    pub(crate) fn transaction<T: Send>(
        &self,
        kind: Begin,
        f: impl FnOnce(PgTx<'_>) -> Result<T> + Send,
    ) -> Result<T> {
        self.transaction_trusting(kind, None, f)
    }

    /// As [`transaction`](Self::transaction); with `moved`, the transaction may take the
    /// handle's copy of the rules on trust (`RuleStore::rules_version_or`) and sets
    /// `moved` if its `BEGIN` then finds them changed (it has failed, and nothing it
    /// did counts).
    pub(crate) fn transaction_trusting<T: Send>(
        &self,
        kind: Begin,
        moved: Option<&std::sync::atomic::AtomicBool>,
        f: impl FnOnce(PgTx<'_>) -> Result<T> + Send,
    ) -> Result<T> {
        runtime::off_runtime(|| {
            let mut conn = self.connection()?;
            PgTx::begin(&mut conn, kind, &self.begins, &self.time, moved)
                .and_then(f)
                .map_err(|e| self.located(&mut conn, kind, e))
        })
    }

    /// `e` as the caller should read it. A server that refuses a write of a handle
    /// opened for writing is a standby (reached through `target_session_attrs=any`, or
    /// just demoted) or a primary fenced read-only for a failover: a state that
    /// passes, like a lost connection, and not the handle's own refusal
    /// ([`Error::ReadOnly`]); the connection is dropped, so the next one looks for a
    /// server that takes writes. A lost connection is named by the server it reached.
    fn located(&self, conn: &mut PgConn, kind: Begin, e: Error) -> Error {
        match e {
            Error::ReadOnly(message) if matches!(kind, Begin::Write { .. }) => {
                conn.refused_writes = true;
                Error::Connection {
                    target: self.answered_by(&conn.server),
                    message: format!(
                        "the server takes no writes (a standby, or a primary fenced for a failover): {message}"
                    ),
                }
            }
            Error::Connection { target, message } if target.is_empty() => Error::Connection {
                target: self.answered_by(&conn.server),
                message,
            },
            e => e,
        }
    }
}

/// The pool, dropped off any async runtime: each connection's client drops a runtime
/// of its own (see [`runtime`]).
struct Pool(Option<r2d2::Pool<Manager>>);

impl std::ops::Deref for Pool {
    type Target = r2d2::Pool<Manager>;

    fn deref(&self) -> &Self::Target {
        self.0
            .as_ref()
            .expect("the pool is taken only when it is dropped")
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some(pool) = self.0.take() {
            runtime::off_runtime(move || drop(pool));
        }
    }
}

/// The id of the transaction, if it wrote anything.
const TXID_SQL: &str = "SELECT txid_current_if_assigned()";

/// Why a commit did not end well.
enum LostCommit {
    /// The server refused it, or the transaction failed before it: nothing happened.
    Failed(Error),
    /// The connection was lost with the commit under way; `xid` (if the transaction
    /// wrote anything) tells the server's log whether it happened.
    Lost {
        xid: Option<i64>,
        message: String,
        /// The server the transaction ran on: the only one that can tell.
        server: ServerIdentity,
    },
}

/// Which server a connection reached, noted in the round trip that opens it: the
/// cluster (`system_identifier`, which a standby made from a base backup shares with
/// its primary) and the timeline it writes on (none on a standby; a promotion starts a
/// new one), read from the WAL being written, not from the last checkpoint, which lags
/// a promotion. Transaction ids are a server's own: a promoted standby hands out again
/// the ids of transactions it never received, so whether a transaction committed can
/// only be asked of the server and timeline it ran on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerIdentity {
    system: Option<String>,
    timeline: Option<String>,
    /// Where it answered (`10.0.0.2:5432`, or a socket folder the login may see), for
    /// messages.
    pub(crate) address: Option<String>,
}

/// What [`ServerIdentity`] is read from (a simple query: a transaction pooler passes
/// it whole).
const IDENTITY_SQL: &str = "SELECT (SELECT system_identifier FROM pg_control_system())::text,
            CASE WHEN NOT pg_is_in_recovery()
                 THEN substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) END,
            coalesce(host(inet_server_addr()) || ':' || inet_server_port(),
                     (SELECT setting FROM pg_settings WHERE name = 'unix_socket_directories')
                         || ' port ' || current_setting('port'))";

impl ServerIdentity {
    fn read(client: &mut client::Client) -> std::result::Result<Self, postgres::Error> {
        let answer = client.simple_query(IDENTITY_SQL)?;
        let column = |i| simple_column(&answer, i).map(str::to_owned);
        Ok(ServerIdentity {
            system: column(0),
            timeline: column(1),
            address: column(2),
        })
    }

    /// Whether this server can answer for a transaction that ran on `origin`: the
    /// same cluster, writing on the same timeline.
    fn answers_for(&self, origin: &ServerIdentity) -> bool {
        self.system.is_some()
            && self.system == origin.system
            && self.timeline.is_some()
            && self.timeline == origin.timeline
    }

    /// Whether it may yet answer for `origin` (it is recovering, as a standby or a
    /// restarting primary does, and could come back as that server); else it never will.
    fn may_answer_for(&self, origin: &ServerIdentity) -> bool {
        self.system == origin.system && self.timeline.is_none()
    }
}

impl PgStore {
    /// Commits `tx` (see [`PgTx::commit_or_lose`]). When the connection is lost during
    /// the commit, asks the same server (and timeline) on another connection whether
    /// the transaction committed, for up to `patience`: a commit that happened is a
    /// success, one that did not is [`Error::Connection`] (nothing happened, a retry is
    /// safe); a server that stays out of reach, or another one in its place (a
    /// promoted standby), makes it [`Error::CommitUnknown`].
    pub(crate) fn commit(
        &self,
        tx: PgTx<'_>,
        announce: Announce,
        patience: Duration,
    ) -> Result<()> {
        let announce = match announce {
            Announce::Yes => true,
            Announce::IfMadeDue => tx.made_due.get(),
            Announce::No => false,
        };
        let (xid, message, server) = match tx.commit_or_lose(announce) {
            Ok(()) => return Ok(()),
            Err(LostCommit::Failed(e)) => return Err(e),
            Err(LostCommit::Lost {
                xid: None,
                message,
                server,
            }) => {
                // It wrote nothing: there was nothing to lose.
                return Err(self.lost(&server, message));
            }
            Err(LostCommit::Lost {
                xid: Some(xid),
                message,
                server,
            }) => (xid, message, server),
        };
        match self.committed(xid, &server, patience) {
            Some(true) => {
                tracing::warn!(xid, error = %message, "the connection was lost while committing; the server says the commit happened");
                Ok(())
            }
            Some(false) => Err(self.lost(
                &server,
                format!("{message} (during the commit, which the server rolled back)"),
            )),
            None => Err(Error::CommitUnknown {
                target: self.answered_by(&server),
                message,
            }),
        }
    }

    /// The connection string's hosts, and the one that answered when it is known:
    /// `postgres://a:5432,b:5432/chat (answered by 10.0.0.2:5432)`.
    pub(crate) fn answered_by(&self, server: &ServerIdentity) -> String {
        match &server.address {
            Some(address) => format!("{} (answered by {address})", self.target),
            None => self.target.clone(),
        }
    }

    fn lost(&self, server: &ServerIdentity, message: String) -> Error {
        Error::Connection {
            target: self.answered_by(server),
            message,
        }
    }

    /// Whether transaction `xid`, which ran on `origin`, committed (`None`: nobody
    /// can tell within `patience`). Only `origin` is asked: another server (a standby
    /// promoted meanwhile) knows nothing of it, and may have given its id to a
    /// transaction of its own. A transaction the server still runs (its backend has not
    /// yet noticed the lost connection) is asked about again.
    fn committed(&self, xid: i64, origin: &ServerIdentity, patience: Duration) -> Option<bool> {
        let give_up = std::time::Instant::now() + patience;
        let mut pause = Duration::from_millis(5);
        loop {
            let status = self.connection().and_then(|mut conn| {
                // (The pool checks a connection idle for a while when it hands it out,
                // so this one still reaches the server it noted.)
                if !conn.server.answers_for(origin)
                    && !crate::sabotage::planted("lost_commit_asked_anywhere")
                {
                    return Ok(Err(conn.server.may_answer_for(origin)));
                }
                Ok(Ok(conn
                    .client
                    // (a simple query: a transaction pooler passes it whole)
                    .simple_query(&format!("SELECT txid_status({xid})"))
                    .map(|answer| {
                        simple_column(&answer, 0).map(str::to_owned)
                    })?))
            });
            match status.as_ref().map(|s| s.as_ref().map(|s| s.as_deref())) {
                Ok(Ok(Some("committed"))) => return Some(true),
                Ok(Ok(Some("aborted"))) => return Some(false),
                // Too old to be known (cannot be ours), or an unknown word.
                Ok(Ok(None)) => return None,
                // Another server, that will never be the one it ran on.
                Ok(Err(false)) => {
                    tracing::warn!(
                        xid,
                        "a commit's answer was lost and another server answers now (a failover?); it cannot tell whether the commit happened"
                    );
                    return None;
                }
                Ok(Ok(Some(_))) | Ok(Err(true)) | Err(_) => {}
            }
            if std::time::Instant::now() + pause > give_up {
                return None;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(250));
        }
    }
}

/// Hosts, ports and database of a connection string, never its password:
/// `postgres://db.internal:5432/chat`, or for a Unix socket
/// `postgres:///chat?host=/run/postgresql&port=5432`; with several hosts, each of them
/// (`postgres://a:5432,b:5432/chat`, or `host=/a,/b port=5432,5432 dbname=chat` when a
/// socket is among them).
fn describe(config: &tokio_postgres::Config) -> String {
    use postgres::config::Host;
    let ports = config.get_ports();
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let db = config.get_dbname().unwrap_or("");
    match config.get_hosts() {
        [] => format!("postgres://localhost:{}/{db}", port(0)),
        #[cfg(unix)]
        [Host::Unix(path)] => format!("postgres:///{db}?host={}&port={}", path.display(), port(0)),
        hosts if hosts.iter().all(|h| matches!(h, Host::Tcp(_))) => {
            let each: Vec<String> = hosts
                .iter()
                .enumerate()
                .map(|(i, h)| match h {
                    Host::Tcp(name) => format!("{name}:{}", port(i)),
                    #[cfg(unix)]
                    Host::Unix(_) => unreachable!("only TCP hosts here"),
                })
                .collect();
            format!("postgres://{}/{db}", each.join(","))
        }
        hosts => {
            let (names, ports): (Vec<String>, Vec<String>) = hosts
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    let name = match h {
                        Host::Tcp(name) => name.clone(),
                        #[cfg(unix)]
                        Host::Unix(path) => path.display().to_string(),
                    };
                    (name, port(i).to_string())
                })
                .unzip();
            format!(
                "host={} port={} dbname={db}",
                names.join(","),
                ports.join(",")
            )
        }
    }
}

/// An error with every cause it carries ("error connecting to server: Connection
/// refused (os error 111)"), not only its first line.
fn with_causes(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

/// Sets what the URL leaves at its default so that a connection cut without a word
/// (a host gone, a network down) is noticed in seconds: TCP keepalives after 10 s idle,
/// every 5 s, 3 of them; data unacknowledged for 15 s ends the connection
/// (`tcp_user_timeout`); and a connect waits at most the busy timeout (at least 1 s).
/// The server frees a lost client's locks sooner still (see [`bounds`]).
fn noticing_cuts(config: &mut tokio_postgres::Config, busy_timeout: Duration) {
    config.keepalives(true);
    if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        config.keepalives_idle(Duration::from_secs(10));
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(Duration::from_secs(5));
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(3);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(Duration::from_secs(15));
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(busy_timeout.max(Duration::from_secs(1)));
    }
}

/// Opens connections for the pool.
pub(crate) struct Manager {
    config: tokio_postgres::Config,
    /// Connections go through a pooler in transaction mode (see [`PgConn::pooled`]).
    pooled: bool,
}

impl r2d2::ManageConnection for Manager {
    type Connection = PgConn;
    type Error = Error;

    fn connect(&self) -> Result<PgConn> {
        // Nothing is set for the session: behind a transaction pooler another client
        // would get it. What a transaction needs it sets itself (see `bounds`).
        let mut client = client::Client::connect(&self.config)?;
        let server = ServerIdentity::read(&mut client)?;
        Ok(PgConn {
            client,
            server,
            refused_writes: false,
            statements: HashMap::new(),
            types: HashMap::new(),
            taken: std::time::Instant::now(),
            pooled: self.pooled,
        })
    }

    /// A connection last taken less than [`TRUSTED_FOR`] ago is handed out as it is (a
    /// round trip per transaction saved while the outbox is busy); one idle longer is
    /// asked whether it still works.
    fn is_valid(&self, conn: &mut PgConn) -> Result<()> {
        if conn.taken.elapsed() >= TRUSTED_FOR {
            conn.client.simple_query("")?;
        }
        conn.taken = std::time::Instant::now();
        Ok(())
    }

    fn has_broken(&self, conn: &mut PgConn) -> bool {
        conn.client.is_closed() || conn.refused_writes
    }
}

/// A connection with the statements prepared on it.
pub(crate) struct PgConn {
    pub(crate) client: client::Client,
    /// The server it reached.
    pub(crate) server: ServerIdentity,
    /// Its server refused a write of a handle opened for writing (a standby, or a
    /// primary fenced read-only): the pool drops it rather than hand it out again.
    pub(crate) refused_writes: bool,
    statements: HashMap<(usize, usize), Statement>,
    /// Through a pooler in transaction mode, instead: the parameter types of each
    /// statement (the same on every server connection), learned by preparing it once;
    /// it then runs unnamed (a statement kept by name would be unknown on the next
    /// transaction's server connection, or another client's).
    types: HashMap<(usize, usize), Arc<[Type]>>,
    pooled: bool,
    /// When it was last taken from the pool (or opened).
    taken: std::time::Instant,
}

/// How a statement of the crate runs on a connection (see [`PgConn::types`]).
enum Prepared {
    Named(Statement),
    Unnamed(Arc<[Type]>),
}

/// `params` with the types the statement takes.
fn typed<'p>(
    params: &[&'p (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'p (dyn ToSql + Sync), Type)> {
    params.iter().copied().zip(types.iter().cloned()).collect()
}

/// An answer of another kind than the one asked for: [`client`] answers each request
/// with the kind it names.
fn unasked(answer: Option<client::Answer>) -> ! {
    let kind = answer.map(|a| std::mem::discriminant(&a));
    unreachable!("the client answered a statement with another kind of answer ({kind:?})")
}

/// How long after its last use a connection is handed out without a check: a server
/// restart or a connection ended within it fails one transaction (an
/// [`Error::Connection`], retried as any), instead of costing every transaction a
/// round trip.
const TRUSTED_FOR: Duration = Duration::from_millis(500);

/// How a [`PgTx`] begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Begin {
    /// A write, with the rules' lock taken (exclusive for a change of the rules) and
    /// their version read under it, in the round trip of its `BEGIN`.
    Write {
        change_rules: bool,
    },
    /// A write of a read-only handle (the server refuses what it writes).
    WriteRefused {
        change_rules: bool,
    },
    Read,
}

/// One transaction on a connection: every primitive of the seam.
///
/// Its `BEGIN` and the statements whose answers the rules do not read (locks, and
/// writes such as an activation or a keyless insert) are kept back and sent with the
/// next statement that must be answered, or with the `COMMIT`, in one round trip (see
/// [`client`]).
pub(crate) struct PgTx<'c> {
    conn: RefCell<&'c mut PgConn>,
    /// Kept back, in order: the `BEGIN` (until the first round trip), then statements
    /// whose answers the rules do not read.
    deferred: RefCell<Vec<Deferred<'c>>>,
    /// The handle's time, which each `BEGIN`'s reading of the server's clock corrects.
    time: &'c ServerTime,
    /// Set when the rules taken on trust turn out to have changed (see
    /// [`PgStore::transaction_trusting`]); `None`: nothing is taken on trust.
    moved: Option<&'c std::sync::atomic::AtomicBool>,
    /// The rules' version taken on trust, which the `BEGIN`'s answer must confirm.
    assumed_rules: Cell<Option<i64>>,
    /// Whether the transaction is still to be ended (rolled back when dropped).
    open: Cell<bool>,
    /// The rules' lock its `BEGIN` took (exclusively?), if any.
    rules_locked: Cell<Option<bool>>,
    /// The rules' version its `BEGIN` read under that lock, until it is asked for.
    rules_version: Cell<Option<i64>>,
    /// Its transaction id, once a write returned it (see [`PgTx::note_xid`]).
    xid: Cell<Option<i64>>,
    /// How many statements kept back from its start make up its `BEGIN` (see
    /// [`OPENING_SQL`]).
    opening: usize,
    /// Lanes (channel, chat) whose rows it locked while it read their due chunks, so
    /// that trying them costs no round trip (see `due_in_channels`).
    held_lanes: RefCell<Vec<(String, String)>>,
    /// What it adds to the counts of the minutes its replies finished in: written as the
    /// last statement before its `COMMIT`, so that a transaction waiting for a minute's
    /// row (shared with other connections) holds nothing another one waits for.
    activity: RefCell<Vec<crate::store::ActivityRow>>,
    /// How many of those there were when its nested transaction began.
    activity_mark: Cell<usize>,
    dead_letters: RefCell<Vec<(i64, String)>>,
    /// Whether it stored a reply at the head of its lane or activated one that waited
    /// (see [`Announce::IfMadeDue`]).
    made_due: Cell<bool>,
}

/// A value of a statement kept back (see [`PgTx::defer`]).
pub(crate) fn owned<T: ToSql + Sync + Send + 'static>(value: T) -> Box<dyn ToSql + Sync + Send> {
    Box::new(value)
}

/// The values of each statement kept back, as the client takes them.
fn values_of<'d>(deferred: &'d [Deferred<'_>]) -> Vec<Vec<&'d (dyn ToSql + Sync)>> {
    deferred
        .iter()
        .map(|d| match d {
            Deferred::Begin { .. } | Deferred::State(_) => Vec::new(),
            Deferred::Statement { values, .. } => {
                values.iter().map(|v| &**v as &(dyn ToSql + Sync)).collect()
            }
        })
        .collect()
}

/// The requests that send what was kept back (`values`: [`values_of`] it).
fn requests_of<'d>(
    deferred: &'d [Deferred<'_>],
    values: &'d [Vec<&'d (dyn ToSql + Sync)>],
) -> Vec<client::Request<'d>> {
    deferred
        .iter()
        .zip(values)
        .map(|(d, values)| client::Request {
            sql: match d {
                Deferred::Begin { sql, .. } => client::Sql::Simple(sql),
                Deferred::State(Prepared::Named(stmt))
                | Deferred::Statement {
                    prepared: Prepared::Named(stmt),
                    ..
                } => client::Sql::Prepared(stmt, values.clone()),
                Deferred::State(Prepared::Unnamed(_)) => {
                    client::Sql::Unnamed(STATE_SQL, Vec::new())
                }
                Deferred::Statement {
                    sql,
                    prepared: Prepared::Unnamed(types),
                    ..
                } => client::Sql::Unnamed(sql, typed(values, types)),
            },
            want: client::Want::Rows,
        })
        .collect()
}

/// What a transaction keeps back until its next round trip.
enum Deferred<'c> {
    /// Its `BEGIN` (see [`Begins`]); with `state`, a simple query that answers what
    /// [`STATE_SQL`] reads.
    Begin { sql: &'c str, state: bool },
    /// [`STATE_SQL`], prepared: the end of a write's opening (see [`OPENING_SQL`]).
    State(Prepared),
    /// A statement whose answer the rules do not read; with `xid`, the column of its
    /// row that holds the transaction's id; with `refusal`, the error it stands for
    /// when it fails its own check (see [`CHECK_FAILED`]).
    Statement {
        sql: &'static str,
        prepared: Prepared,
        values: Vec<Box<dyn ToSql + Sync + Send>>,
        xid: Option<usize>,
        refusal: Option<fn() -> Error>,
    },
}

/// How a statement kept back checks what the rules would check in its answer, which
/// they no longer read: it divides by zero when the check fails, so that the server
/// fails it (and the transaction, the `COMMIT` it may ride with included), and the
/// store reports the refusal it stands for ([`Deferred::Statement`]'s `refusal`).
const CHECK_FAILED: postgres::error::SqlState = postgres::error::SqlState::DIVISION_BY_ZERO;

impl Deferred<'_> {
    /// The error of this statement's answer: its refusal when its check failed.
    fn error(&self, e: postgres::Error) -> Error {
        match self {
            Deferred::Statement {
                refusal: Some(refusal),
                ..
            } if e.code() == Some(&CHECK_FAILED) => refusal(),
            _ => e.into(),
        }
    }
}

impl<'c> PgTx<'c> {
    /// A write transaction (READ COMMITTED, with the rules' locks; READ ONLY for a
    /// read-only handle, so the server refuses its writes), or a read transaction that
    /// sees one snapshot throughout (REPEATABLE READ, READ ONLY), begun by one simple
    /// query (see [`Begins`]) sent with its first statement.
    pub(crate) fn begin(
        conn: &'c mut PgConn,
        kind: Begin,
        begins: &'c Begins,
        time: &'c ServerTime,
        moved: Option<&'c std::sync::atomic::AtomicBool>,
    ) -> Result<Self> {
        let (rules_locked, read_only) = match kind {
            Begin::Write { change_rules } => (Some(change_rules), false),
            Begin::WriteRefused { change_rules } => (Some(change_rules), true),
            Begin::Read => (None, true),
        };
        let opening = match rules_locked {
            // A write on a connection of its own opens with prepared statements.
            Some(exclusive) if !conn.pooled => Some(exclusive),
            _ => None,
        };
        let tx = PgTx {
            deferred: RefCell::new(vec![Deferred::Begin {
                sql: match opening {
                    Some(_) => begins.bare[usize::from(read_only)],
                    None => begins.sql(kind),
                },
                state: opening.is_none(),
            }]),
            opening: if opening.is_some() { 3 } else { 1 },
            time,
            moved,
            assumed_rules: Cell::new(None),
            open: Cell::new(true),
            rules_locked: Cell::new(rules_locked),
            rules_version: Cell::new(None),
            xid: Cell::new(None),
            held_lanes: RefCell::new(Vec::new()),
            activity: RefCell::new(Vec::new()),
            activity_mark: Cell::new(0),
            dead_letters: RefCell::new(Vec::new()),
            made_due: Cell::new(false),
            conn: RefCell::new(conn),
        };
        if let Some(exclusive) = opening {
            let values = vec![
                owned(begins.lock_ms.clone()),
                owned(begins.idle_ms.clone()),
                owned(exclusive),
            ];
            tx.defer(OPENING_SQL, values, None)?;
            let state = Deferred::State(tx.statement(STATE_SQL)?);
            tx.deferred.borrow_mut().push(state);
        }
        Ok(tx)
    }

    /// Whether the `BEGIN` is still kept back (nothing was sent yet).
    fn unsent(&self) -> bool {
        matches!(self.deferred.borrow().first(), Some(Deferred::Begin { .. }))
    }

    /// Keeps `sql` back until the next round trip: a statement whose answer the rules
    /// do not read (with `xid`, the column of its row that holds the transaction's id).
    fn defer(
        &self,
        sql: &'static str,
        values: Vec<Box<dyn ToSql + Sync + Send>>,
        xid: Option<usize>,
    ) -> Result<()> {
        self.defer_checked(sql, values, xid, None)
    }

    /// [`defer`](Self::defer) a statement that checks its own answer, failing as
    /// [`CHECK_FAILED`] says with `refusal` when the check fails.
    fn defer_checked(
        &self,
        sql: &'static str,
        values: Vec<Box<dyn ToSql + Sync + Send>>,
        xid: Option<usize>,
        refusal: Option<fn() -> Error>,
    ) -> Result<()> {
        let prepared = self.statement(sql)?;
        self.deferred.borrow_mut().push(Deferred::Statement {
            sql,
            prepared,
            values,
            xid,
            refusal,
        });
        Ok(())
    }

    /// Sends what was kept back, if anything, and reads its answers.
    fn flush(&self) -> Result<()> {
        if self.deferred.borrow().is_empty() {
            return Ok(());
        }
        self.send(None).map(drop)
    }

    /// Sends `last` after what was kept back, in one round trip, and answers `last`'s
    /// answer; the first error is the answer (after a failed statement, every later one
    /// of the transaction fails too).
    fn send(&self, last: Option<client::Request<'_>>) -> Result<Option<client::Answer>> {
        let deferred = self.deferred.take();
        let values = values_of(&deferred);
        let mut requests = requests_of(&deferred, &values);
        requests.extend(last);
        let before = self.time.local_ms();
        let mut answers = self.conn.borrow_mut().client.pipeline(&requests)?;
        let after = self.time.local_ms();
        let last = (answers.len() > deferred.len())
            .then(|| answers.pop())
            .flatten();
        for (d, answer) in deferred.iter().zip(answers) {
            self.settle(d, answer.map_err(|e| d.error(e))?, before, after)?;
        }
        Ok(last.transpose()?)
    }

    /// Runs one statement (after what was kept back) for the answer `want` asks for.
    fn run(
        &self,
        sql: &'static str,
        params: Params<'_>,
        want: client::Want,
    ) -> Result<client::Answer> {
        let prepared = self.statement(sql)?;
        let sql = match &prepared {
            Prepared::Named(stmt) => client::Sql::Prepared(stmt, params.to_vec()),
            Prepared::Unnamed(types) => client::Sql::Unnamed(sql, typed(params, types)),
        };
        match self.send(Some(client::Request { sql, want }))? {
            Some(answer) => Ok(answer),
            None => unasked(None),
        }
    }

    /// Takes in the answer to a statement that was kept back.
    fn settle(
        &self,
        sent: &Deferred<'_>,
        answer: client::Answer,
        before: i64,
        after: i64,
    ) -> Result<()> {
        match (sent, answer) {
            (Deferred::Begin { state: true, .. }, client::Answer::Simple(answer)) => {
                let column = |i: usize| simple_column(&answer, i).and_then(|v| v.parse().ok());
                self.begun([column(0), column(1), column(2)], before, after)?;
            }
            (Deferred::State(_), client::Answer::Rows(rows)) => {
                let column = |i: usize| -> Result<Option<i64>> {
                    Ok(match rows.first() {
                        Some(row) => row.try_get(i)?,
                        None => None,
                    })
                };
                self.begun([column(0)?, column(1)?, column(2)?], before, after)?;
            }
            (Deferred::Statement { xid: Some(i), .. }, client::Answer::Rows(rows)) => {
                if let Some(row) = rows.first() {
                    self.note_xid(row, *i)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Notes that the transaction holds lane (`channel`, `chat`)'s row.
    pub(crate) fn hold_lane(&self, channel: String, chat: String) {
        self.held_lanes.borrow_mut().push((channel, chat));
    }

    /// Whether the transaction holds `lane`'s row, as [`hold_lane`](Self::hold_lane)
    /// noted.
    fn holds_lane(&self, lane: LaneRef<'_>) -> bool {
        self.held_lanes
            .borrow()
            .iter()
            .any(|(channel, chat)| channel == lane.channel && chat == lane.chat_id)
    }

    /// Takes in what the opening of the transaction read (`[rules' version, server's
    /// clock, oldest writer the schema accepts]`, each `None` when there was no row), between the
    /// local times `before` and `after`.
    fn begun(
        &self,
        [version, server, schema]: [Option<i64>; 3],
        before: i64,
        after: i64,
    ) -> Result<()> {
        // A newer build's contract step, while this process ran, dropped what its
        // statements rely on: it writes nothing more (an expand step leaves it be).
        if let Some(writable_from) = schema.filter(|v| *v > schema::latest_version()) {
            return Err(schema::too_new(writable_from, writable_from, ""));
        }
        if let Some(server) = server {
            self.time.observe(server, before, after);
        }
        // Without it (a read, or no row 1), `rules_version` asks again and reports what
        // it finds.
        if self.assumed_rules.get().is_some_and(|a| version != Some(a)) {
            if let Some(moved) = self.moved {
                moved.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            return Err(Error::Busy);
        }
        self.rules_version.set(version);
        Ok(())
    }

    /// Keeps the transaction id a write returned in column `i` (its
    /// `txid_current_if_assigned()`), which saves [`commit_or_lose`](Self::commit_or_lose)
    /// a round trip. Every write of a transaction has the same id.
    pub(crate) fn note_xid(&self, row: &Row, i: usize) -> Result<()> {
        if let Some(xid) = row.try_get::<_, Option<i64>>(i)? {
            self.xid.set(Some(xid));
        }
        Ok(())
    }

    /// The rules' version read by `BEGIN`, once (the `BEGIN` is sent now if it was
    /// kept back).
    pub(crate) fn version_read_at_begin(&self) -> Result<Option<i64>> {
        self.flush()?;
        Ok(self.rules_version.take())
    }

    /// `cached` taken on trust as the rules' version when the `BEGIN` is still kept
    /// back and the transaction may be run again: its answer confirms it, or sets
    /// `moved` and fails the transaction (see [`PgStore::transaction_trusting`]).
    pub(crate) fn assume_rules_version(&self, cached: i64) -> bool {
        // (One version on trust per transaction: another is read.)
        if self.moved.is_none()
            || !self.unsent()
            || self.assumed_rules.get().is_some_and(|a| a != cached)
        {
            return false;
        }
        self.assumed_rules.set(Some(cached));
        true
    }

    /// Commits the transaction; with `announce`, its commit also wakes the idle
    /// dispatchers of every process listening on this outbox (see [`listen`]), in the
    /// same round trip. The transaction's id is read first, so that a commit whose
    /// answer is lost can be looked up ([`PgStore::commit`]).
    fn commit_or_lose(self, announce: bool) -> std::result::Result<(), LostCommit> {
        if self.unsent()
            && self.deferred.borrow().len() == self.opening
            && !announce
            && self.assumed_rules.get().is_none()
        {
            // Nothing was sent, nor kept back but the `BEGIN`, nor taken on trust that
            // its answer must confirm: there is nothing to commit.
            self.open.set(false);
            return Ok(());
        }
        // Known from a write that returned it, else read now, with whatever was kept
        // back: a statement of those that failed has made the COMMIT a rollback.
        let xid = match self.xid.get() {
            Some(xid) => Some(xid),
            None => match self.query_one(TXID_SQL, &[]) {
                Ok(row) => row.get::<_, Option<i64>>(0),
                Err(e) => return Err(LostCommit::Failed(e)),
            },
        };
        self.open.set(false);
        let mut minutes = self.activity.take();
        minutes.sort_by_key(|m| m.bucket);
        for minute in crate::store::ActivityRow::merged(minutes) {
            self.defer(
                ACTIVITY_SQL,
                vec![
                    owned(minute.bucket),
                    owned(minute.delivered),
                    owned(minute.failed),
                    owned(minute.latency_sum_ms),
                    owned(minute.latency_max_ms),
                ],
                None,
            )
            .map_err(LostCommit::Failed)?;
        }
        let sql = if announce {
            listen::COMMIT_ANNOUNCED
        } else {
            "COMMIT"
        };
        // What was kept back (writes whose answers the rules do not read) rides with
        // the COMMIT: if one of them fails, the COMMIT is a rollback.
        let deferred = self.deferred.take();
        let values = values_of(&deferred);
        let mut requests = requests_of(&deferred, &values);
        requests.push(client::Request {
            sql: client::Sql::Simple(sql),
            want: client::Want::Rows,
        });
        let server = self.conn.borrow().server.clone();
        let lost = |e: &postgres::Error| LostCommit::Lost {
            xid,
            message: e.to_string(),
            server: server.clone(),
        };
        let before = self.time.local_ms();
        let mut answers = match self.conn.borrow_mut().client.pipeline(&requests) {
            Ok(answers) => answers,
            Err(e) if connection_lost(&e) => return Err(lost(&e)),
            Err(e) => return Err(LostCommit::Failed(e.into())),
        };
        let after = self.time.local_ms();
        let commit = answers.pop();
        let mut failed = None;
        for (d, answer) in deferred.iter().zip(answers) {
            match answer {
                Err(e) if connection_lost(&e) => return Err(lost(&e)),
                Err(e) => failed = failed.or(Some(d.error(e))),
                Ok(answer) => {
                    if let Err(e) = self.settle(d, answer, before, after) {
                        failed = failed.or(Some(e));
                    }
                }
            }
        }
        let mut conn = self.conn.borrow_mut();
        match commit {
            Some(Ok(_)) if failed.is_none() => Ok(()),
            // The server refused the commit (a serialization failure, say), or a
            // statement sent with it failed: it did not happen. (A backend ended
            // while it commits answers with an error too, `57P01`, when the commit
            // may well have happened: that is a lost one.)
            Some(Err(e)) if connection_lost(&e) => Err(lost(&e)),
            commit => {
                // If the notification failed, COMMIT never ran: end the transaction
                // (after a refused COMMIT there is none left, and this does nothing).
                let _ = conn.client.batch_execute("ROLLBACK");
                let refused = match commit {
                    Some(Err(e)) => Some(Error::from(e)),
                    _ => None,
                };
                Err(LostCommit::Failed(
                    failed.or(refused).unwrap_or_else(|| unasked(None)),
                ))
            }
        }
    }

    /// How `sql` runs on this connection: its prepared statement, or behind a
    /// transaction pooler its parameter types (see [`PgConn::types`]).
    fn statement(&self, sql: &'static str) -> Result<Prepared> {
        let mut conn = self.conn.borrow_mut();
        let key = (sql.as_ptr() as usize, sql.len());
        if conn.pooled {
            if let Some(types) = conn.types.get(&key) {
                return Ok(Prepared::Unnamed(types.clone()));
            }
            // Closed when dropped: the message goes out with the next statement, on
            // this transaction's server connection.
            let types: Arc<[Type]> = conn.client.prepare(sql)?.params().into();
            conn.types.insert(key, types.clone());
            return Ok(Prepared::Unnamed(types));
        }
        if let Some(stmt) = conn.statements.get(&key) {
            return Ok(Prepared::Named(stmt.clone()));
        }
        let stmt = conn.client.prepare(sql)?;
        conn.statements.insert(key, stmt.clone());
        Ok(Prepared::Named(stmt))
    }

    pub(crate) fn query(&self, sql: &'static str, params: Params<'_>) -> Result<Vec<Row>> {
        match self.run(sql, params, client::Want::Rows)? {
            client::Answer::Rows(rows) => Ok(rows),
            other => unasked(Some(other)),
        }
    }

    pub(crate) fn query_opt(&self, sql: &'static str, params: Params<'_>) -> Result<Option<Row>> {
        match self.run(sql, params, client::Want::Opt)? {
            client::Answer::Opt(row) => Ok(row),
            other => unasked(Some(other)),
        }
    }

    pub(crate) fn query_one(&self, sql: &'static str, params: Params<'_>) -> Result<Row> {
        match self.run(sql, params, client::Want::One)? {
            client::Answer::One(row) => Ok(row),
            other => unasked(Some(other)),
        }
    }

    pub(crate) fn execute(&self, sql: &'static str, params: Params<'_>) -> Result<u64> {
        match self.run(sql, params, client::Want::Count)? {
            client::Answer::Count(n) => Ok(n),
            other => unasked(Some(other)),
        }
    }

    /// A statement made at run time (a listing's filters, the application's text):
    /// prepared for this use only.
    pub(crate) fn query_dynamic(&self, sql: &str, params: Params<'_>) -> Result<Vec<Row>> {
        let request = client::Request {
            sql: client::Sql::Text(sql, params.to_vec()),
            want: client::Want::Rows,
        };
        match self.send(Some(request))? {
            Some(client::Answer::Rows(rows)) => Ok(rows),
            other => unasked(other),
        }
    }

    /// Runs `f` on the client itself, once what was kept back is sent.
    pub(crate) fn with_client<T>(&self, f: impl FnOnce(&mut client::Client) -> T) -> Result<T> {
        self.flush()?;
        Ok(f(&mut self.conn.borrow_mut().client))
    }

    /// Runs `f` with plans that read whole tables priced out (sequential scans, and
    /// merge or hash joins, which read all of the inner side): a read of the unfinished
    /// rows must go through their index and look up each one's chunks, even when the
    /// planner's statistics are stale (a table that grew by a million delivered rows
    /// since it was last analyzed still looks as if most of it were unfinished).
    ///
    /// In a write, which prices them out throughout (`write_planning!`), the statement
    /// is planned for its values instead of run with its generic plan: these are the
    /// maintenance statements (a purge's batch, the finalization sweep, requeues), whose
    /// cutoffs and limits decide which index pays (a purge's generic plan took twice as
    /// long beside 1M delivered rows, `examples/pg_scale`).
    pub(crate) fn on_indexes<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let write = self.rules_locked.get().is_some();
        self.batch(if write {
            "SET LOCAL plan_cache_mode = auto"
        } else {
            "SET LOCAL enable_seqscan = off; SET LOCAL enable_mergejoin = off;
             SET LOCAL enable_hashjoin = off"
        })?;
        let value = f()?;
        self.batch(if write {
            "SET LOCAL plan_cache_mode = force_generic_plan"
        } else {
            "SET LOCAL enable_seqscan TO DEFAULT; SET LOCAL enable_mergejoin TO DEFAULT;
             SET LOCAL enable_hashjoin TO DEFAULT"
        })?;
        Ok(value)
    }

    pub(crate) fn batch(&self, sql: &str) -> Result<()> {
        let request = client::Request {
            sql: client::Sql::Simple(sql),
            want: client::Want::Rows,
        };
        self.send(Some(request)).map(drop)
    }
}

impl Drop for PgTx<'_> {
    fn drop(&mut self) {
        // (Nothing was sent if the `BEGIN` was kept back: there is nothing to end.)
        if self.open.get() && !self.unsent() {
            let mut conn = self.conn.borrow_mut();
            // A failed rollback leaves a broken connection, which the pool drops.
            let _ = conn.client.batch_execute("ROLLBACK");
        }
    }
}

/// The key of chunk `id`: its delivery row and index.
pub(crate) fn chunk_key(id: i64) -> (i64, i64) {
    (
        id.div_euclid(crate::ids::CHUNK_STRIDE),
        id.rem_euclid(crate::ids::CHUNK_STRIDE),
    )
}

pub(crate) fn chunk_status(row: &Row, i: usize) -> Result<ChunkStatus> {
    row.try_get::<_, &str>(i)?.parse()
}

/// A delivery's status in column `i`.
pub(crate) fn delivery_status(row: &Row, i: usize) -> Result<DeliveryStatus> {
    status_of(row.try_get(i)?)
}

/// A stored delivery status; a reply staged by an application's transaction (`new`,
/// not yet in its lane) shows as queued.
pub(crate) fn status_of(stored: &str) -> Result<DeliveryStatus> {
    match stored {
        "new" => Ok(DeliveryStatus::Queued),
        status => status.parse(),
    }
}

/// A non-negative count column.
pub(crate) fn count(row: &Row, i: usize) -> Result<u64> {
    Ok(row.try_get::<_, Option<i64>>(i)?.unwrap_or(0).max(0) as u64)
}

/// The rules' lock, per schema: shared by every write, exclusive for a change of them
/// (schema V5's `outbound_lock_rules`, which `outbound_begin` takes too).
const LOCK_RULES_SHARED: &str = "SELECT outbound_lock_rules(false)";
const LOCK_RULES: &str = "SELECT outbound_lock_rules(true)";

/// A caller key of a channel (two enqueues with one key wait for each other).
const LOCK_KEY: &str = "SELECT pg_advisory_xact_lock(hashtextextended(
     current_schema() || '/key/' || length($1::text) || '/' || $1::text || $2::text, 0))";

/// Locks the lane rows of `$rows` (channel, chat), waiting for them, in the server's
/// order of lanes (so two transactions never wait for each other in a circle); creates
/// those missing. Writes no new row version when a row exists (the update's condition
/// is false: only the lock of the conflicting row is taken). Answers the transaction's
/// id (a row lock assigns one).
macro_rules! lock_lanes_sql {
    ($rows:literal) => {
        concat!(
            "WITH l AS (
                 INSERT INTO outbound_lanes (channel, chat_id) ",
            $rows,
            " ON CONFLICT (channel, chat_id) DO UPDATE
                 SET paused_until = outbound_lanes.paused_until WHERE false
                 RETURNING 1)
             SELECT txid_current_if_assigned() FROM (SELECT count(*) FROM l) locked"
        )
    };
}

const LOCK_LANE: &str = lock_lanes_sql!("VALUES ($1, $2)");
pub(crate) const LOCK_LANES: &str =
    lock_lanes_sql!("SELECT DISTINCT * FROM unnest($1::text[], $2::text[]) ORDER BY 1, 2");

/// Locks a lane's row unless another transaction holds it; answers the transaction's
/// id (read once the row is locked, which assigns one), so that the writes after it can
/// ride with the `COMMIT`.
const TRY_LOCK_LANE: &str = "SELECT txid_current_if_assigned() FROM (
         SELECT 1 FROM outbound_lanes WHERE channel = $1 AND chat_id = $2
         FOR NO KEY UPDATE SKIP LOCKED) l";
/// The lanes of `$1`, `$2` no other transaction holds, locked, with the transaction's
/// id (as [`TRY_LOCK_LANE`]).
pub(crate) const TRY_LOCK_LANES: &str = "SELECT l.channel, l.chat_id, txid_current_if_assigned()
     FROM unnest($1::text[], $2::text[]) AS u(ch, chat)
     CROSS JOIN LATERAL (
         SELECT channel, chat_id FROM outbound_lanes WHERE channel = u.ch AND chat_id = u.chat
         FOR NO KEY UPDATE SKIP LOCKED) l";
const LANE_EXISTS: &str = "SELECT 1 FROM outbound_lanes WHERE channel = $1 AND chat_id = $2";
const CREATE_LANE: &str = "INSERT INTO outbound_lanes (channel, chat_id) VALUES ($1, $2)
     ON CONFLICT DO NOTHING";

/// A paced channel's row as it stands, locked unless another claim holds it.
const LOCK_CHANNEL_SLOT: &str = "SELECT ch.id, ch.name,
        coalesce(ch.channel_interval_us, p.channel_interval_us, 0), ch.next_send_at_us,
        ch.paused_until
     FROM outbound_channels ch, outbound_policy p WHERE p.id = 1 AND ch.id = $1
     FOR NO KEY UPDATE OF ch SKIP LOCKED";

/// Lane rows are locked (one writer per lane until the transaction ends), caller keys
/// and the rules with advisory locks of the transaction.
impl Locks for PgTx<'_> {
    fn lock_rules(&self, exclusive: bool) -> Result<()> {
        if self
            .rules_locked
            .get()
            .is_some_and(|held| held || !exclusive)
        {
            // Taken by `BEGIN`.
            return Ok(());
        }
        // (Sent with the next statement: nothing is read under it before then.)
        let sql = if exclusive {
            LOCK_RULES
        } else {
            LOCK_RULES_SHARED
        };
        self.defer(sql, Vec::new(), None)
    }

    fn lock_lanes(&self, lanes: &mut [LaneRef<'_>]) -> Result<()> {
        if crate::sabotage::planted("no_lane_locks") {
            return Ok(());
        }
        // Sent with the next statement, which the server runs once the locks are
        // granted; its row is the transaction's id.
        if let [lane] = lanes {
            let values = vec![
                owned(lane.channel.to_owned()),
                owned(lane.chat_id.to_owned()),
            ];
            return self.defer(LOCK_LANE, values, Some(0));
        }
        let channels: Vec<String> = lanes.iter().map(|l| l.channel.to_owned()).collect();
        let chats: Vec<String> = lanes.iter().map(|l| l.chat_id.to_owned()).collect();
        self.defer(LOCK_LANES, vec![owned(channels), owned(chats)], Some(0))
    }

    fn try_lock_lane(&self, lane: LaneRef<'_>) -> Result<bool> {
        if crate::sabotage::planted("no_lane_locks") || self.holds_lane(lane) {
            return Ok(true);
        }
        let params: Params<'_> = &[&lane.channel, &lane.chat_id];
        let locked = |tx: &Self| -> Result<bool> {
            let Some(row) = tx.query_opt(TRY_LOCK_LANE, params)? else {
                return Ok(false);
            };
            tx.note_xid(&row, 0)?;
            Ok(true)
        };
        if locked(self)? {
            return Ok(true);
        }
        if self.query_opt(LANE_EXISTS, params)?.is_some() {
            return Ok(false);
        }
        // Every enqueue stores its lane's row, and a purge removes only lanes with
        // nothing unfinished; a lane without its row is rare, and made here.
        self.execute(CREATE_LANE, params)?;
        locked(self)
    }

    fn try_lock_lanes(&self, lanes: &[LaneRef<'_>]) -> Result<Vec<bool>> {
        let unheld = lanes.iter().filter(|l| !self.holds_lane(**l)).count();
        if unheld < 2 || crate::sabotage::planted("no_lane_locks") {
            return lanes.iter().map(|lane| self.try_lock_lane(*lane)).collect();
        }
        let channels: Vec<&str> = lanes.iter().map(|l| l.channel).collect();
        let chats: Vec<&str> = lanes.iter().map(|l| l.chat_id).collect();
        let rows = self.query(TRY_LOCK_LANES, &[&channels, &chats])?;
        if let Some(row) = rows.first() {
            self.note_xid(row, 2)?;
        }
        let taken: std::collections::HashSet<(String, String)> = rows
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect::<Result<_>>()?;
        lanes
            .iter()
            .map(|lane| {
                if taken.contains(&(lane.channel.to_owned(), lane.chat_id.to_owned())) {
                    return Ok(true);
                }
                // Held by another transaction, or (rarely) without its row.
                self.try_lock_lane(*lane)
            })
            .collect()
    }

    fn lock_key(&self, channel: &str, key: &str) -> Result<()> {
        // (Sent with the next statement: the key's reply is read after it.)
        let values = vec![owned(channel.to_owned()), owned(key.to_owned())];
        self.defer(LOCK_KEY, values, None)
    }

    fn lock_channel_slot(&self, row: ChannelRow) -> Result<Option<ChannelRow>> {
        self.query_opt(LOCK_CHANNEL_SLOT, &[&row.id])?
            .as_ref()
            .map(chunks::channel_row)
            .transpose()
    }
}

impl StoreTx for PgTx<'_> {
    fn begin_nested(&self) -> Result<()> {
        self.activity_mark.set(self.activity.borrow().len());
        self.batch("SAVEPOINT chunked_outbox_nested")
    }

    fn end_nested(&self, keep: bool) -> Result<()> {
        if keep {
            self.batch("RELEASE SAVEPOINT chunked_outbox_nested")
        } else {
            // The row locks taken since are released: a lane noted as held may not be.
            self.held_lanes.borrow_mut().clear();
            self.activity
                .borrow_mut()
                .truncate(self.activity_mark.get());
            self.batch(
                "ROLLBACK TO SAVEPOINT chunked_outbox_nested;
                 RELEASE SAVEPOINT chunked_outbox_nested",
            )
        }
    }

    fn in_transaction(&self) -> bool {
        // An error inside a transaction leaves it to be rolled back, never ended.
        self.open.get()
    }

    fn enter_lanes(
        &self,
        lanes: &[LaneRef<'_>],
        rows: usize,
    ) -> Result<(Vec<LaneEntry>, Vec<i64>)> {
        let sql = if crate::sabotage::planted("out_of_order") {
            lanes::ENTER_SQL_NEWEST_FIRST
        } else {
            lanes::ENTER_SQL
        };
        let channels: Vec<&str> = lanes.iter().map(|l| l.channel).collect();
        let chats: Vec<&str> = lanes.iter().map(|l| l.chat_id).collect();
        let mut drawn = Vec::new();
        let mut entries: Vec<Option<LaneEntry>> = lanes.iter().map(|_| None).collect();
        for r in self.query(sql, &[&channels, &chats, &(rows as i64)])? {
            if let Some(rows) = r.try_get::<_, Option<Vec<i64>>>(1)? {
                drawn = rows;
            }
            let entry = LaneEntry {
                staged_before: r.try_get(2)?,
                free_at: r.try_get(3)?,
                head: match r.try_get::<_, Option<bool>>(4)? {
                    Some(_) => Some(lanes::head_row(&r, 4)?),
                    None => None,
                },
            };
            let n: i64 = r.try_get(0)?;
            if let Some(slot) = usize::try_from(n - 1).ok().and_then(|i| entries.get_mut(i)) {
                *slot = Some(entry);
            }
        }
        let entries = entries
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::invalid("lanes", "a lane read no row"))?;
        if drawn.len() != rows {
            return Err(Error::invalid("rows", "the sequence drew too few rows"));
        }
        if crate::sabotage::planted("no_lane_locks") {
            // The window the lane's lock closes (its head read, the new head not yet
            // committed) held open as on a slow machine, so that the hammer meets the
            // planted race in every run rather than in some.
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok((entries, drawn))
    }

    fn finalize_delivered(
        &self,
        chunks: &[(i64, i64, Option<&str>)],
        tallies: &[crate::store::ChannelTally<'_>],
        now: i64,
    ) -> Result<usize> {
        if chunks.is_empty() && tallies.is_empty() {
            return Ok(0);
        }
        let (deliveries, indexes): (Vec<i64>, Vec<i64>) =
            chunks.iter().map(|(id, ..)| chunk_key(*id)).unzip();
        let ids: Vec<Option<String>> = chunks
            .iter()
            .map(|(.., id)| id.map(str::to_owned))
            .collect();
        let channels: Vec<String> = tallies.iter().map(|t| t.channel.to_owned()).collect();
        let column = |f: fn(&crate::store::ChannelTally<'_>) -> i64| {
            owned(tallies.iter().map(f).collect::<Vec<i64>>())
        };
        let bucket = |i: usize| {
            owned(
                tallies
                    .iter()
                    .map(|t| t.latency_le[i])
                    .collect::<Vec<i64>>(),
            )
        };
        // Kept back: the statement itself fails unless it copied every delivery (the
        // rules' check of its count), and the transaction with it.
        self.defer_checked(
            deliveries::FINALIZE_DELIVERED_SQL,
            vec![
                owned(deliveries),
                owned(indexes),
                owned(ids),
                owned(now),
                owned(channels),
                column(|t| t.latest),
                column(|t| t.count),
                column(|t| t.latency_sum_ms),
                bucket(0),
                bucket(1),
                bucket(2),
                bucket(3),
                bucket(4),
                bucket(5),
            ],
            Some(1),
            Some(|| Error::invalid("delivery", "a delivery to finalize is not stored")),
        )?;
        Ok(chunks.len())
    }

    fn note_dead_letter(&self, delivery: i64, error: &str) {
        self.dead_letters
            .borrow_mut()
            .push((delivery, error.to_owned()));
    }

    fn take_dead_letters(&self) -> Vec<(i64, String)> {
        std::mem::take(&mut self.dead_letters.borrow_mut())
    }

    #[cfg(test)]
    fn table_rows(&self) -> Result<Vec<String>> {
        const TABLES: &[&str] = &[
            "SELECT 'deliveries ' || t::text FROM outbound_deliveries t",
            "SELECT 'chunks ' || t::text FROM outbound_delivery_chunks t",
            // Its identity column counts on past an undone insert: its order stands in.
            "SELECT 'messages ' || row_number() OVER (ORDER BY id) || ' '
                    || (delivery_id, channel, chat_id, sender, content, chunk_count,
                        created_at, delivered_at)::text
             FROM outbound_messages",
            "SELECT 'stats ' || t::text FROM outbound_channel_stats t",
            "SELECT 'policy ' || t::text FROM outbound_policy t",
            "SELECT 'channels ' || t::text FROM outbound_channels t",
            "SELECT 'lanes ' || t::text FROM outbound_lanes t",
            "SELECT 'renumbered ' || t::text FROM outbound_renumbered t",
        ];
        let mut rows = Vec::new();
        for sql in TABLES {
            for r in self.query(sql, &[])? {
                rows.push(r.try_get(0)?);
            }
        }
        rows.sort();
        Ok(rows)
    }

    #[cfg(test)]
    fn stage(&self, d: &crate::reply::NewDelivery, now: i64) -> Result<Option<String>> {
        let call = crate::store::postgres::application::Call {
            delivery: d,
            now,
            uid_high: 0,
            uid_spare: 0,
        };
        let r = self.query_one(
            "SELECT uid FROM outbound_enqueue($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            &call.params(),
        )?;
        Ok(Some(r.try_get(0)?))
    }
}

/// Maps the PostgreSQL failures a caller can act on to their own variants.
pub(crate) fn map_error(err: postgres::Error) -> Error {
    use postgres::error::SqlState;
    match err.code() {
        Some(code)
            if *code == SqlState::T_R_DEADLOCK_DETECTED
                || *code == SqlState::T_R_SERIALIZATION_FAILURE
                || *code == SqlState::LOCK_NOT_AVAILABLE
                || *code == SqlState::QUERY_CANCELED =>
        {
            Error::Busy
        }
        Some(code) if *code == SqlState::DISK_FULL => Error::DiskFull,
        Some(code) if *code == SqlState::READ_ONLY_SQL_TRANSACTION => {
            Error::ReadOnly(message(&err))
        }
        _ if connection_lost(&err) => Error::Connection {
            target: String::new(),
            message: message(&err),
        },
        _ => Error::Postgres(err),
    }
}

/// Whether the connection is gone: closed, failed at the socket, or ended by the
/// server (terminated, shut down, not accepting connections yet, idle too long inside
/// a transaction).
fn connection_lost(err: &postgres::Error) -> bool {
    use postgres::error::SqlState;
    match err.code() {
        Some(code) => {
            code.code().starts_with("08")
                || *code == SqlState::ADMIN_SHUTDOWN
                || *code == SqlState::CRASH_SHUTDOWN
                || *code == SqlState::CANNOT_CONNECT_NOW
                // The server ended a session idle in a transaction (see `bounds`).
                || *code == SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT
        }
        None => err.is_closed() || is_io(err),
    }
}

/// Whether the error is the socket's (the server went away, the network failed).
fn is_io(err: &postgres::Error) -> bool {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if e.is::<std::io::Error>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// The server's own message of an error (with its detail), else the error's.
pub(crate) fn message(err: &postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{} ({detail})", db.message()),
            None => db.message().to_owned(),
        },
        None => err.to_string(),
    }
}

/// Adds to a minute's count of finished replies (see `PgTx::commit_or_lose`).
const ACTIVITY_SQL: &str = "INSERT INTO outbound_activity AS a
         (minute, shard, delivered, failed, latency_sum_ms, latency_max_ms)
     VALUES ($1, pg_backend_pid() % 16, $2, $3, $4, $5)
     ON CONFLICT (minute, shard) DO UPDATE
     SET delivered = a.delivered + $2, failed = a.failed + $3,
         latency_sum_ms = a.latency_sum_ms + $4,
         latency_max_ms = greatest(a.latency_max_ms, $5)";

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool drops a connection whose server refused a write of this handle (a
    /// standby, a fenced primary) and one the server ended; it keeps a sound one.
    #[test]
    fn the_pool_drops_a_connection_that_refused_writes_or_ended() {
        use r2d2::ManageConnection;
        let Some(url) = crate::store::test_server::server_url() else {
            return;
        };
        let manager = Manager {
            config: url.parse().unwrap(),
            pooled: false,
        };
        let mut conn = manager.connect().unwrap();
        assert!(!manager.has_broken(&mut conn), "a sound connection is kept");
        assert!(conn.server.system.is_some() && conn.server.timeline.is_some());
        conn.refused_writes = true;
        assert!(manager.has_broken(&mut conn), "refused a write");
        let mut ended = manager.connect().unwrap();
        let pid: i32 = ended
            .client
            .query_one("SELECT pg_backend_pid()", &[])
            .unwrap()
            .get(0);
        let mut admin = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .unwrap();
        assert!(ended.client.batch_execute("SELECT 1").is_err());
        assert!(manager.has_broken(&mut ended), "ended by the server");
    }

    fn described(url: &str) -> String {
        describe(&url.parse().unwrap())
    }

    /// Messages name every host of a connection string, with its port, never a
    /// password.
    #[test]
    fn a_connection_string_is_described_host_by_host() {
        assert_eq!(
            described("postgres://bot:secret@db-a:5432/chat"),
            "postgres://db-a:5432/chat"
        );
        assert_eq!(
            described("host=db-a,db-b port=5432,5433 dbname=chat password=secret"),
            "postgres://db-a:5432,db-b:5433/chat"
        );
        assert_eq!(
            described("host=db-a,db-b port=6432 dbname=chat"),
            "postgres://db-a:6432,db-b:6432/chat"
        );
        assert_eq!(
            described("postgres:///chat?host=/run/a&port=5432"),
            "postgres:///chat?host=/run/a&port=5432"
        );
        assert_eq!(
            described("host=/run/a,db-b port=5432,5433 dbname=chat"),
            "host=/run/a,db-b port=5432,5433 dbname=chat"
        );
    }

    /// Only the server and timeline a transaction ran on answer for it; a standby of
    /// the same cluster may yet (it could be that server, restarting); a server on
    /// another timeline or of another cluster never will.
    #[test]
    fn only_the_same_server_and_timeline_answer_for_a_lost_commit() {
        let server = |system: Option<&str>, timeline: Option<&str>| ServerIdentity {
            system: system.map(str::to_owned),
            timeline: timeline.map(str::to_owned),
            address: None,
        };
        let origin = server(Some("7715"), Some("00000001"));
        assert!(origin.answers_for(&origin));
        for other in [
            server(Some("7715"), Some("00000002")),
            server(Some("9999"), Some("00000001")),
            server(Some("7715"), None),
            server(None, Some("00000001")),
        ] {
            assert!(!other.answers_for(&origin), "{other:?}");
        }
        assert!(!server(None, None).answers_for(&server(None, None)));
        assert!(server(Some("7715"), None).may_answer_for(&origin));
        assert!(!server(Some("7715"), Some("00000002")).may_answer_for(&origin));
        assert!(!server(Some("9999"), None).may_answer_for(&origin));
    }
}
