//! How each transaction begins: its `BEGIN`, the settings it runs under and the
//! rules' lock, in one round trip.

use std::time::Duration;

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
/// the plan the plan tests check (`src/contracts/plans.rs`) — with the plans that read whole tables
/// priced out (as [`PgTx::on_indexes`] does for a read). A plan made on empty tables (a
/// new outbox) can still read whole indexes; autovacuum's first analysis of the grown
/// table replaces it (the plan tests show that it does). Reads keep the server's choice:
/// an inspection's optional filters want plans made for their values.
pub(crate) struct Begins {
    pub(super) read: String,
    /// By `[read-only handle][change of the rules]`.
    pub(super) write: [[String; 2]; 2],
    /// The `BEGIN` alone of a write on a connection of its own, by `[read-only handle]`
    /// (see [`OPENING_SQL`]).
    pub(super) bare: [&'static str; 2],
    /// `lock_timeout` and `idle_in_transaction_session_timeout`, in milliseconds.
    pub(super) lock_ms: String,
    pub(super) idle_ms: String,
}

/// A write's opening on a connection of its own (not behind a transaction pooler),
/// sent after its bare `BEGIN` as two statements prepared on the connection, where
/// `outbound_begin` is one call of a function: the settings of [`Begins`] (`$1` the
/// lock timeout, `$2` the idle one) and the rules' lock (exclusive with `$3`), then,
/// read by the next statement once that lock is granted (in READ COMMITTED each
/// statement reads what was committed when it began), what [`STATE_SQL`] reads. The
/// function's call cost the server 0.09 ms per transaction, the two statements half
/// of that (`pg_stat_statements`).
pub(super) const OPENING_SQL: &str = "SELECT outbound_lock_rules($3) FROM (
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
pub(super) const STATE_SQL: &str =
    "SELECT p.version, (extract(epoch FROM clock_timestamp()) * 1000)::int8,
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

    pub(super) fn sql(&self, kind: Begin) -> &str {
        match kind {
            Begin::Write { change_rules } => &self.write[0][usize::from(change_rules)],
            Begin::WriteRefused { change_rules } => &self.write[1][usize::from(change_rules)],
            Begin::Read => &self.read,
        }
    }
}

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
