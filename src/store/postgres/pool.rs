//! The pool of connections to the outbox's database: connecting, which server a
//! connection reached, and the transactions the rules run on a connection of the pool.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use postgres::Statement;
use postgres::types::Type;

use super::begin::Begins;
use super::client::{self, describe, simple_column};
use super::listen;
use super::runtime;
use crate::clock::ServerTime;
use crate::error::{Error, Result};

/// The server's clock in milliseconds since the epoch, as a column.
macro_rules! server_ms {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000)::int8"
    };
}

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
    pub(super) id_salt: i64,
    /// How long a commit whose answer was lost asks the server what became of it
    /// (the busy timeout).
    pub(super) patience: Duration,
    /// Whether a listener may hear other processes' commits (see `server.rs`).
    pub(super) listens: bool,
    /// The listener, started by the first dispatcher or claim of the handle.
    pub(super) listener: std::sync::OnceLock<Option<listen::Listener>>,
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

/// Which server a connection reached, noted in the round trip that opens it: the
/// cluster (`system_identifier`, which a standby made from a base backup shares with
/// its primary) and the timeline it writes on (none on a standby; a promotion starts a
/// new one), read from the WAL being written, not from the last checkpoint, which lags
/// a promotion. Transaction ids are a server's own: a promoted standby hands out again
/// the ids of transactions it never received, so whether a transaction committed can
/// only be asked of the server and timeline it ran on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerIdentity {
    pub(super) system: Option<String>,
    pub(super) timeline: Option<String>,
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
    pub(super) fn read(client: &mut client::Client) -> std::result::Result<Self, postgres::Error> {
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
    pub(super) fn answers_for(&self, origin: &ServerIdentity) -> bool {
        self.system.is_some()
            && self.system == origin.system
            && self.timeline.is_some()
            && self.timeline == origin.timeline
    }

    /// Whether it may yet answer for `origin` (it is recovering, as a standby or a
    /// restarting primary does, and could come back as that server); else it never will.
    pub(super) fn may_answer_for(&self, origin: &ServerIdentity) -> bool {
        self.system == origin.system && self.timeline.is_none()
    }
}

/// Sets what the URL leaves at its default so that a connection cut without a word
/// (a host gone, a network down) is noticed in seconds: TCP keepalives after 10 s idle,
/// every 5 s, 3 of them; data unacknowledged for 15 s ends the connection
/// (`tcp_user_timeout`); and a connect waits at most the busy timeout (at least 1 s).
/// The server frees a lost client's locks sooner still (see [`bounds`]).
pub(super) fn noticing_cuts(config: &mut tokio_postgres::Config, busy_timeout: Duration) {
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
    pub(super) statements: HashMap<(usize, usize), Statement>,
    /// Through a pooler in transaction mode, instead: the parameter types of each
    /// statement (the same on every server connection), learned by preparing it once;
    /// it then runs unnamed (a statement kept by name would be unknown on the next
    /// transaction's server connection, or another client's).
    pub(super) types: HashMap<(usize, usize), Arc<[Type]>>,
    pub(super) pooled: bool,
    /// When it was last taken from the pool (or opened).
    pub(super) taken: std::time::Instant,
}

/// How long after its last use a connection is handed out without a check: a server
/// restart or a connection ended within it fails one transaction (an
/// [`Error::Connection`], retried as any), instead of costing every transaction a
/// round trip.
pub(super) const TRUSTED_FOR: Duration = Duration::from_millis(500);

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
