//! The two stores behind [`Outbox`](crate::Outbox), and what is particular to each.
//!
//! One API, one set of guarantees and one test suite cover both; pick by where the
//! application runs:
//!
//! | | SQLite (default) | PostgreSQL (feature `postgres`) |
//! |---|---|---|
//! | open | [`Outbox::open`](crate::Outbox::open)`("replies.db", options)` | `Outbox::connect("postgres://…", options)` |
//! | for | one host: a bot, a CLI agent, an engine with its own SQLite file | several hosts or replicas sharing one database |
//! | writers | one at a time (SQLite has one writer); readers beside it | many, on different hosts |
//! | wake-ups across processes | within the poll interval (`PRAGMA data_version`) | at once (`LISTEN`/`NOTIFY`), polling while the listener is down |
//! | the application's own transaction | [`Outbox::enqueue_in`](crate::Outbox::enqueue_in) on its rusqlite connection | `postgres`: `enqueue_in_pg`, `enqueue_in_tokio_pg`, `enqueue_in_sqlx` |
//! | a lost answer to `COMMIT` | cannot happen (no network) | looked up on the server and timeline it ran on ([`Error::CommitUnknown`] when it cannot be, or another server answers in its place) |

// The storage seam (for maintainers; ARCHITECTURE.md has the whole map): the rules of
// the outbox (lanes, claims, outcomes, finalization, operator actions, retention) call
// these primitives of one store transaction, and `connections::Store` for the
// transactions themselves; each store keeps its own SQL, schema, migrations, plans and
// connections behind them.
//
// Every primitive the rules of the outbox (lanes, claims, outcomes, finalization,
// operator actions, retention) call these primitives of one store transaction; each
// backend keeps its own SQL, schema, migrations and plans behind them.
//
// Every primitive is intent-level ("the head of this lane", "mark this chunk
// delivered"), not a statement: a backend answers each one its own way, with its own
// keys and plans. The contract of each primitive — what it returns, what it changes,
// what it must keep — is written on it and checked primitive by primitive in
// `src/contracts/`, for every store.
//
// **Locks are part of the rules.** Where a rule reads, decides and writes (the head of
// a lane, a channel's rate slot, a caller key, the rules themselves), it first calls a
// lock primitive of `Locks`. SQLite runs one writer at a time (`BEGIN IMMEDIATE`),
// so its locks are no-ops; a store with concurrent writers must make each of them
// exclude every other writer of the same lane, slot, key or rules until the
// transaction ends. ARCHITECTURE.md lists every such place ("check-then-act under the
// writer").
//
// The primitives are grouped by what they keep (one trait each), and `StoreTx` is
// all of them: the rules take `&dyn StoreTx`.

use crate::error::{Error, Result};
use crate::rules::{ChannelPolicy, FileRules, Rules, Stored};
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::views::{CorruptRow, DeliveryView, ListFilter};

pub(crate) mod connections;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod sqlite;
/// The PostgreSQL server of the tests (shared with the integration tests).
#[cfg(all(test, feature = "postgres"))]
#[path = "../../tests/common/postgres.rs"]
pub(crate) mod test_server;

/// [`CHUNK_STRIDE`](crate::ids::CHUNK_STRIDE) as SQL text, and the last chunk index it
/// leaves room for: a chunk's id is `delivery row * stride + index` on every store.
macro_rules! chunk_stride {
    () => {
        "16384"
    };
    (last index) => {
        "16383"
    };
}
const _: () = assert!(crate::ids::CHUNK_STRIDE == 16384);

/// The oldest delivery holding lane (`$channel`, `$chat`): under
/// `LaneFailurePolicy::Block` (`$block` true) an uncertain one or a dead letter nobody
/// acknowledged; otherwise (a channel that asks its platform, `LaneHold::Asking`) an
/// uncertain one whose part nobody has asked the platform about yet — its head chunk
/// (`$head`, a condition on chunk `c` of delivery `d`) uncertain with no settlement.
/// The same query on every store, placeholders and chunk key in its dialect.
macro_rules! held_sql {
    ($channel:literal, $chat:literal, $block:literal, $head:expr) => {
        concat!(
            "SELECT min(id) FROM (
                 SELECT min(d.id) AS id FROM outbound_deliveries d
                 WHERE d.channel = ",
            $channel,
            " AND d.chat_id = ",
            $chat,
            " AND d.status = 'uncertain' AND d.status <> 'delivered' AND d.status <> 'failed'
                   AND (",
            $block,
            " OR EXISTS (SELECT 1 FROM outbound_delivery_chunks c WHERE ",
            $head,
            " AND c.status = 'uncertain' AND c.settlement IS NULL))
                 UNION ALL
                 SELECT min(id) FROM outbound_deliveries
                 WHERE channel = ",
            $channel,
            " AND chat_id = ",
            $chat,
            " AND status = 'failed' AND acknowledged_at IS NULL AND ",
            $block,
            ") AS held"
        )
    };
}

/// How many replies enqueued before an uncertain part's a lookup of its chat's last
/// delivered part reads (`OperatorStore::unasked_uncertain`): a bounded range of the
/// primary key, whatever the length of history.
macro_rules! previous_replies_read {
    () => {
        "1000"
    };
}

/// Placeholder `$n` of SQLite's dialect (`?n`) and of PostgreSQL's (`$n`): the shared
/// statements below take one of the two.
macro_rules! sqlite_param {
    ($n:literal) => {
        concat!("?", $n)
    };
}
#[cfg(feature = "postgres")]
macro_rules! pg_param {
    ($n:literal) => {
        concat!("$", $n)
    };
}

/// The statements both stores spell alike but for their placeholders (`$p`: one of
/// `sqlite_param`, `pg_param`), each for the primitive of its name: the status a
/// delivery takes and what it clears, written once.
macro_rules! count_delivered_sql {
    ($p:ident) => {
        concat!(
            "UPDATE outbound_deliveries
             SET delivered_count = delivered_count + 1, updated_at = ",
            $p!(2),
            ", status = coalesce(",
            $p!(3),
            ", status) WHERE id = ",
            $p!(1)
        )
    };
}
macro_rules! set_delivery_aside_sql {
    ($p:ident) => {
        concat!(
            "UPDATE outbound_deliveries SET status = ",
            $p!(2),
            ", updated_at = ",
            $p!(3),
            ", finished_at = ",
            $p!(4),
            " WHERE id = ",
            $p!(1)
        )
    };
}
macro_rules! mark_finalized_sql {
    ($p:ident) => {
        concat!(
            "UPDATE outbound_deliveries
             SET status = 'delivered', delivered_count = chunk_count, updated_at = ",
            $p!(2),
            ", finished_at = ",
            $p!(2),
            ", finalize_error = NULL WHERE id = ",
            $p!(1)
        )
    };
}
macro_rules! mark_unfinalized_sql {
    ($p:ident) => {
        concat!(
            "UPDATE outbound_deliveries
             SET status = 'unfinalized', delivered_count = chunk_count, updated_at = ",
            $p!(2),
            ", finalize_error = ",
            $p!(3),
            " WHERE id = ",
            $p!(1)
        )
    };
}
macro_rules! mark_cancelled_sql {
    ($p:ident) => {
        concat!(
            "UPDATE outbound_deliveries SET status = 'cancelled', updated_at = ",
            $p!(2),
            ", finished_at = ",
            $p!(2),
            " WHERE id = ",
            $p!(1)
        )
    };
}
macro_rules! note_process_sql {
    ($p:ident) => {
        concat!(
            "INSERT INTO outbound_processes
                 (id, schema_level, release, program, host, pid, started_at, seen_at)
             VALUES (",
            $p!(1),
            ", ",
            $p!(2),
            ", ",
            $p!(3),
            ", ",
            $p!(4),
            ", ",
            $p!(5),
            ", ",
            $p!(6),
            ", ",
            $p!(7),
            ", ",
            $p!(8),
            ")
             ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at"
        )
    };
}
macro_rules! prune_processes_sql {
    ($p:ident) => {
        concat!("DELETE FROM outbound_processes WHERE seen_at < ", $p!(1))
    };
}
macro_rules! forget_process_sql {
    ($p:ident) => {
        concat!("DELETE FROM outbound_processes WHERE id = ", $p!(1))
    };
}
macro_rules! processes_sql {
    ($p:ident) => {
        concat!(
            "SELECT id, schema_level, release, program, host, pid, started_at, seen_at
             FROM outbound_processes WHERE seen_at >= ",
            $p!(1),
            " ORDER BY schema_level, release, started_at, id"
        )
    };
}
macro_rules! set_queued_sql {
    ($p:ident) => {
        concat!(
            "UPDATE outbound_deliveries
             SET status = 'queued', finished_at = NULL, acknowledged_at = NULL WHERE id = ",
            $p!(1)
        )
    };
}

/// A delivery that changes no more: delivered, cancelled, or a dead letter someone
/// acknowledged (checked again when a listed one is removed). The same condition on
/// every store.
macro_rules! finished_sql {
    () => {
        "(status IN ('delivered', 'cancelled')
          OR (status = 'failed' AND acknowledged_at IS NOT NULL))"
    };
}

/// The deliveries a purge may remove, `$cutoff` the placeholder of the cutoff in the
/// store's dialect: finished before it, and never the newest one (row ids are never
/// reused, so the newest row keeps the next one from repeating).
macro_rules! purgeable_sql {
    ($cutoff:literal) => {
        concat!(
            "finished_at < ",
            $cutoff,
            " AND ",
            $crate::store::finished_sql!(),
            " AND id < (SELECT max(id) FROM outbound_deliveries)"
        )
    };
}

#[cfg(feature = "postgres")]
pub(crate) use pg_param;
pub(crate) use {
    chunk_stride, count_delivered_sql, finished_sql, forget_process_sql, held_sql,
    mark_cancelled_sql, mark_finalized_sql, mark_unfinalized_sql, note_process_sql,
    previous_replies_read, processes_sql, prune_processes_sql, purgeable_sql,
    set_delivery_aside_sql, set_queued_sql, sqlite_param,
};

/// One lane: the deliveries of one chat on one channel, in order. Locks are taken in
/// the order of this type (channel, then chat), so two transactions that lock several
/// lanes never wait for each other in a circle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct LaneRef<'a> {
    pub channel: &'a str,
    pub chat_id: &'a str,
}

impl<'a> LaneRef<'a> {
    pub(crate) fn new(channel: &'a str, chat_id: &'a str) -> Self {
        LaneRef { channel, chat_id }
    }
}

/// A delivery to make active: its row, its place in its lane, the index of its head
/// chunk (chunks before it were delivered before it was set aside), and the time it may
/// start, if delayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Waiting {
    pub id: i64,
    /// Its place in its lane's order (see [`DeliveryStore::next_delivery_row`]).
    pub position: i64,
    pub head_index: i64,
    pub not_before: Option<i64>,
}

/// A delivery to make active (see [`LaneStore::activate`]): the status it takes, its
/// lane, and the time its head chunk may start at the earliest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Activation<'a> {
    pub waiting: Waiting,
    pub status: DeliveryStatus,
    pub lane: LaneRef<'a>,
    pub earliest: i64,
}

/// The first unfinished delivery of a lane in lane order, active ones before queued
/// ones (see [`LaneStore::lane_head`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HeadRow {
    /// A delivery of the lane is active (`pending` or `partial`).
    Active,
    /// Nothing is active; this is the first queued delivery.
    Queued(Waiting),
}

/// A lane as an enqueue finds it, under its lock (see [`StoreTx::enter_lanes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LaneEntry {
    /// Replies applications staged in the lane wait to go first.
    pub staged_before: bool,
    /// Its first unfinished delivery (see [`LaneStore::lane_head`]).
    pub head: Option<HeadRow>,
    /// The end of its pause or interval ([`LaneStore::lane_due_time`] of the earliest
    /// time there is): a send may start at `max(earliest, free_at)`.
    pub free_at: i64,
}

/// What a build of schema `schema_level` says of itself, in the registry of processes
/// and as the release to upgrade to: `chunked-outbox 0.1.0 (schema 15)`.
pub(crate) fn release(schema_level: i64) -> String {
    format!(
        "chunked-outbox {} (schema {schema_level})",
        env!("CARGO_PKG_VERSION")
    )
}

/// A process that writes the outbox, as it registered itself (see `registry`): its
/// build, and when it was last seen (the outbox's clock, ms).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProcessRow {
    pub id: String,
    pub schema_level: i64,
    pub release: String,
    pub program: String,
    pub host: String,
    pub pid: i64,
    pub started_at: i64,
    pub seen_at: i64,
}

/// A chunk with the delivery facts its transitions need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkRef {
    pub id: i64,
    pub delivery: i64,
    pub index: i64,
    pub status: ChunkStatus,
    pub attempts: u32,
    pub channel: String,
    pub chat_id: String,
    pub created_at: i64,
    /// Chunks in the delivery.
    pub total: i64,
}

/// How far a chunk got, as a cancel reads it (see [`OperatorStore::chunk_progress`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkProgress {
    pub id: i64,
    pub index: u32,
    pub status: ChunkStatus,
    pub attempts: u32,
    /// An earlier attempt budget (before an operator's requeue) sent it.
    pub sent_before: bool,
}

/// A delivery with its lane, as operator actions and sweeps find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeliveryLane {
    pub id: i64,
    pub channel: String,
    pub chat_id: String,
}

/// A channel as the claim needs it: its number, and its channel-wide rate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChannelRow {
    pub id: i64,
    pub name: String,
    /// The channel's interval between sends, µs (0: no rate limit), and the start of
    /// its next send on the channel's schedule, µs.
    pub interval_us: i64,
    pub next_send_at_us: Option<i64>,
    /// The end of a rate limit of the whole channel, ms.
    pub paused_until: Option<i64>,
}

impl ChannelRow {
    /// Whether the channel has no rate and no pause at `now`: a claim reads its due
    /// chunks without taking a slot first.
    pub(crate) fn unpaced_and_free(&self, now: i64) -> bool {
        self.interval_us == 0 && self.paused_until.is_none_or(|p| p <= now)
    }
}

/// A claimable (or lease-expired) chunk read by the claim: its row, or why the row
/// cannot be read.
#[derive(Debug)]
pub(crate) struct Candidate {
    pub chunk: i64,
    pub delivery: i64,
    pub channel_id: i64,
    pub due_at: i64,
    pub row: std::result::Result<Readable, String>,
}

/// The readable row of a [`Candidate`].
#[derive(Debug)]
pub(crate) struct Readable {
    pub chunk: ChunkRef,
    /// A due chunk that still carries a claim's token is one whose lease ran out
    /// (`sending`, reclaimed by this claim; or `retry`, put back by recovery): a suspect.
    pub suspect: bool,
    /// The deadline of a resend a deduplication window allowed (ms), if any.
    pub resend_by: Option<i64>,
    pub uid: crate::ids::DeliveryId,
    pub text: String,
    pub metadata: Option<String>,
}

/// What an enqueue with a caller key compares with the delivery the key names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredContent {
    pub channel: String,
    pub chat_id: String,
    pub sender: Option<String>,
    pub text: String,
    pub metadata: Option<String>,
    pub status: DeliveryStatus,
    /// Each chunk's own text, in order; `None` for a chunk that is the whole text.
    pub chunks: Vec<Option<String>>,
}

/// A delivery to store (see [`DeliveryStore::insert_delivery`]).
pub(crate) struct NewRow<'a> {
    pub row: i64,
    pub uid: &'a str,
    pub delivery: &'a crate::reply::NewDelivery,
    pub channel_id: i64,
    pub active: bool,
    pub now: i64,
    /// The due time of the head chunk of an active delivery.
    pub head_due: Option<i64>,
    /// Whether its chunk rows are stored now; a queued reply sent as one chunk of its
    /// whole text has its row stored at activation.
    pub chunk_rows: bool,
}

/// The shape of the application's finalization statement, as the store's database
/// prepares it (see [`FinalizeStore::describe_statement`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StatementShape {
    /// The statement changes nothing.
    pub read_only: bool,
    /// It returns rows.
    pub returns_rows: bool,
    /// Each parameter's name with its sigil (`:name`), `None` for a positional one.
    pub parameters: Vec<Option<String>>,
}

/// The finalized replies of one channel in one transaction, for the channel's counters.
pub(crate) struct ChannelTally<'a> {
    pub channel: &'a str,
    pub latest: i64,
    pub count: i64,
    pub latency_sum_ms: i64,
    /// Replies finalized within 1 s, 5 s, 30 s, 120 s, 600 s, 3600 s of their enqueue.
    pub latency_le: [i64; 6],
}

/// A delivery a purge may remove.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Purgeable {
    pub id: i64,
    pub channel: String,
    pub delivered: bool,
}

/// The locks of the rules (see the module's documentation). Each one holds until the
/// transaction ends.
pub(crate) trait Locks {
    /// The stored rules: shared by every write (the rules it read stay the rules it
    /// acts on), exclusive for a change of them.
    fn lock_rules(&self, exclusive: bool) -> Result<()>;
    /// These lanes, waiting for them, in sorted order.
    fn lock_lanes(&self, lanes: &mut [LaneRef<'_>]) -> Result<()>;
    /// One lane if no other transaction holds it; `false` (and nothing locked) if one
    /// does. Claims never wait.
    fn try_lock_lane(&self, lane: LaneRef<'_>) -> Result<bool>;
    /// [`try_lock_lane`](Self::try_lock_lane) of each lane, in one go where the store
    /// can: whether each one is now this transaction's. A lane given twice is taken
    /// once and answers `true` twice.
    fn try_lock_lanes(&self, lanes: &[LaneRef<'_>]) -> Result<Vec<bool>> {
        lanes.iter().map(|lane| self.try_lock_lane(*lane)).collect()
    }
    /// A caller key of a channel, so two enqueues with one key cannot both store it.
    fn lock_key(&self, channel: &str, key: &str) -> Result<()>;
    /// The rate slot of a paced channel: the row as it stands under the lock, or `None`
    /// if another claim holds it (skipped, never waited for).
    fn lock_channel_slot(&self, row: ChannelRow) -> Result<Option<ChannelRow>>;
}

/// The stored rules and channel numbers.
pub(crate) trait RuleStore {
    /// The version of the stored rules; every change of a rule or channel raises it.
    fn rules_version(&self) -> Result<i64>;
    /// As [`rules_version`](Self::rules_version), except that a store which confirms
    /// the version later in a write (before anything it wrote counts) may answer
    /// `cached`, the version of the handle's copy, on trust: if the rules turn out to
    /// be another version, the write fails, and its store runs it again with the
    /// version read first (see [`Store::write`](connections::Store::write)).
    fn rules_version_or(&self, cached: i64) -> Result<i64> {
        let _ = cached;
        self.rules_version()
    }
    /// Every stored rule; a file-wide rule nobody declared reads as its default.
    fn load_rules(&self) -> Result<Stored>;
    /// Stores the file-wide rules of `policy` that `which` names (the others keep what
    /// is stored), raising the version.
    fn store_file_rules(&self, policy: &Rules, which: FileRules) -> Result<()>;
    /// Gives `channel` rules of its own, or the default (`None`), raising the version.
    fn store_channel_rules(&self, channel: &str, rules: Option<&ChannelPolicy>) -> Result<()>;
    /// The number of `channel`, registering it on first sight (raising the version).
    /// One name has one number, whoever registers it first.
    fn channel_number(&self, channel: &str) -> Result<i64>;
    /// The application's finalization statement, if one is stored.
    fn finalization_statement(&self) -> Result<Option<String>>;
    /// Stores (or clears) the application's finalization statement, raising the version.
    fn store_finalization_statement(&self, sql: Option<&str>) -> Result<()>;
    /// The oldest build (schema version) the schema accepts as a writer.
    fn writable_from(&self) -> Result<i64>;
    /// A contract step: the schema accepts writers from `writable_from` on, and
    /// `migrated_by` is the release to upgrade to.
    fn set_writable_from(&self, writable_from: i64, migrated_by: &str) -> Result<()>;
}

/// Lanes: heads, due times, pauses.
pub(crate) trait LaneStore {
    /// Delivery `delivery` as an activation needs it.
    fn waiting(&self, delivery: i64) -> Result<Waiting>;
    /// The lane's first unfinished delivery: an active one if any, else its first
    /// queued one in lane order (see `sabotage::planted("out_of_order")`); `None` if
    /// nothing is active or queued.
    fn lane_head(&self, lane: LaneRef<'_>) -> Result<Option<HeadRow>>;
    /// The lane position of the first delivery holding the lane: with `block`
    /// ([`LaneFailurePolicy::Block`](crate::rules::LaneFailurePolicy::Block)) an
    /// uncertain one or a dead letter nobody acknowledged; without, an uncertain one
    /// whose platform nobody has asked about its part yet
    /// ([`LaneHold::Asking`](crate::rules::LaneHold::Asking)).
    fn lane_held(&self, lane: LaneRef<'_>, block: bool) -> Result<Option<i64>>;
    /// [`lane_head`](Self::lane_head) of each lane, in one go where the store can.
    fn lane_heads(&self, lanes: &[LaneRef<'_>]) -> Result<Vec<Option<HeadRow>>> {
        lanes.iter().map(|lane| self.lane_head(*lane)).collect()
    }
    /// Gives the waiting delivery the activation's status and makes its head chunk due
    /// at [`lane_due_time`](Self::lane_due_time) of its `earliest` — storing that
    /// chunk's row if it has none (a queued reply sent as one chunk of its whole text).
    fn activate(&self, head: &Activation<'_>) -> Result<()>;
    /// [`activate`](Self::activate) of each activation (one delivery per lane), in one
    /// go where the store can.
    fn activate_many(&self, heads: &[Activation<'_>]) -> Result<()> {
        composed::activate_many(self, heads)
    }
    /// Activates the next queued delivery of each free lane of `lanes` (distinct FIFO
    /// lanes, each with what holds it in `holds`), its head chunk due no earlier than
    /// `earliest`, in one go where the store can: whether it did. A store that does not
    /// (the default) leaves it to the rules, which compose it from
    /// [`lane_heads`](Self::lane_heads), [`lane_held`](Self::lane_held) and
    /// [`activate_many`](Self::activate_many); one that does leaves the rows they would
    /// leave (the contract
    /// `advancing_lanes_in_one_go_leaves_what_the_rules_leave`).
    fn advance_lanes(
        &self,
        _lanes: &[LaneRef<'_>],
        _holds: &[crate::rules::LaneHold],
        _earliest: i64,
    ) -> Result<bool> {
        Ok(false)
    }
    /// Makes chunk `index` of `delivery` due at [`lane_due_time`](Self::lane_due_time)
    /// of `earliest`.
    fn make_due(&self, delivery: i64, index: i64, lane: LaneRef<'_>, earliest: i64) -> Result<()>;
    /// `earliest`, or the end of the lane's rate-limit pause or of its lane interval
    /// since its last send, whichever is latest.
    fn lane_due_time(&self, lane: LaneRef<'_>, earliest: i64) -> Result<i64>;
    /// No send of the lane starts before `next_at` (never moves it earlier).
    fn note_lane_send(&self, lane: LaneRef<'_>, next_at: i64) -> Result<()>;
    /// Pauses the lane until `until`, or longer if it is paused longer already, and
    /// pushes its chunks due before the end of the pause to that end. Returns the end.
    fn pause_lane(&self, lane: LaneRef<'_>, until: i64) -> Result<i64>;
    /// No send of `channel` starts before `until` (never moves it earlier).
    fn pause_channel(&self, channel: &str, until: i64) -> Result<()>;
    /// Puts a held delivery back in its lane as `queued` (clearing its finish and
    /// acknowledgement).
    fn set_queued(&self, delivery: i64) -> Result<()>;
    /// Every queued delivery, in lane order within each lane.
    fn queued_deliveries(&self) -> Result<Vec<DeliveryLane>>;
}

/// Chunk rows and the delivery rows they move.
pub(crate) trait ChunkStore {
    /// Chunk `id`, including the one chunk of a queued reply whose row is stored at its
    /// activation (read as `pending`, no attempts).
    fn load_chunk(&self, id: i64) -> Result<Option<ChunkRef>>;
    /// Chunk `id` if it still carries `token` and is `sending`, `uncertain` or `retry`.
    fn claimed_chunk(&self, id: i64, token: i64) -> Result<Option<ChunkRef>>;
    /// [`claimed_chunk`](Self::claimed_chunk) of each `(id, token)`, in one go where
    /// the store can.
    fn claimed_chunks(&self, claims: &[(i64, i64)]) -> Result<Vec<Option<ChunkRef>>> {
        claims
            .iter()
            .map(|(id, token)| self.claimed_chunk(*id, *token))
            .collect()
    }
    /// Sets status, attempts and due time, clears the token, and keeps `error` (if
    /// given) as the last error.
    fn reschedule(
        &self,
        chunk: i64,
        status: ChunkStatus,
        attempts: u32,
        due: i64,
        error: Option<&str>,
    ) -> Result<()>;
    /// `retry` with `attempts`, nothing due (its lane decides), no token; keeps `error`
    /// if given.
    fn set_retry_unscheduled(&self, chunk: i64, attempts: u32, error: Option<&str>) -> Result<()>;
    /// A fresh attempt budget (an operator's requeue): `retry`, no attempts or rate
    /// limits, nothing due, no token; remembers that an earlier budget sent it.
    fn reset_budget(&self, chunk: i64) -> Result<()>;
    /// Counts one more rate limit of the chunk's budget; returns the count.
    fn count_rate_limit(&self, chunk: i64) -> Result<u32>;
    /// `delivered`, nothing due, no token, with the platform's id and the time.
    fn mark_delivered(&self, chunk: i64, platform_message_id: Option<&str>, now: i64)
    -> Result<()>;
    /// One more chunk of the delivery delivered; the delivery takes `status` if given.
    fn count_delivered(
        &self,
        delivery: i64,
        now: i64,
        status: Option<DeliveryStatus>,
    ) -> Result<()>;
    /// `status`, nothing due, `error` as the last error; the token kept if
    /// `keep_token` (a lease that ran out: its worker may still report), else cleared.
    fn set_chunk_aside(
        &self,
        chunk: i64,
        status: ChunkStatus,
        error: &str,
        keep_token: bool,
    ) -> Result<()>;
    /// `retry` due at `due`, keeping the token.
    fn retry_keeping_token(&self, chunk: i64, due: i64) -> Result<()>;
    /// The delivery takes the status of a chunk set aside, changed at `now`, finished at
    /// `finished` (or not finished, for `None`).
    fn set_delivery_aside(
        &self,
        delivery: i64,
        status: ChunkStatus,
        now: i64,
        finished: Option<i64>,
    ) -> Result<()>;
    /// Sets aside an unreadable chunk and its delivery as failed with `reason` kept as
    /// the delivery's corruption; returns the delivery's lane if it can be read.
    fn set_corrupt(
        &self,
        chunk: i64,
        delivery: i64,
        reason: &str,
        now: i64,
    ) -> Result<Option<(String, String)>>;
    /// The uid, channel and chat of a delivery, if stored.
    fn delivery_names(&self, delivery: i64) -> Result<Option<(String, String, String)>>;
}

/// Claims: channels, due chunks, leases.
pub(crate) trait ClaimStore {
    /// The channel named `name` (every channel, for `None`), with the interval its
    /// stored rules (or the default's) give.
    fn channels(&self, name: Option<&str>) -> Result<Vec<ChannelRow>>;
    /// The next send of channel `id` starts no earlier than `next_us` (µs).
    fn set_channel_slot(&self, id: i64, next_us: i64) -> Result<()>;
    /// Up to `limit` chunks of channel `row` due at `now` or earlier (leases that ran
    /// out included), in due order.
    fn due_chunks(&self, row: &ChannelRow, now: i64, limit: usize) -> Result<Vec<Candidate>>;
    /// The channels named `names` (every channel, for `None`, in number order; given
    /// names in name order, a name given twice one channel), each with its [`due_chunks`](Self::due_chunks) (at
    /// most `limit`) if it has no rate and no pause at `now` — `None` for the others,
    /// whose slot the claim takes first. In one go where the store can.
    fn due_in_channels(
        &self,
        names: Option<&[&str]>,
        now: i64,
        limit: usize,
    ) -> Result<Vec<(ChannelRow, Option<Vec<Candidate>>)>> {
        channel_rows(self, names)?
            .into_iter()
            .map(|row| {
                let due = if row.unpaced_and_free(now) {
                    Some(self.due_chunks(&row, now, limit)?)
                } else {
                    None
                };
                Ok((row, due))
            })
            .collect()
    }
    /// The earliest due time of channel `id`.
    fn next_due(&self, id: i64) -> Result<Option<i64>>;
    /// `sending` under `token` until `lease_until`, one more attempt counted; its first
    /// send's time set to `now` if it had none.
    fn mark_sending(&self, chunk: i64, now: i64, lease_until: i64, token: i64) -> Result<()>;
    /// [`mark_sending`](Self::mark_sending) of each `(chunk, token)`, in one go where
    /// the store can.
    fn mark_sending_many(&self, chunks: &[(i64, i64)], now: i64, lease_until: i64) -> Result<()> {
        composed::mark_sending_many(self, chunks, now, lease_until)
    }
    /// Due at `due` (a chunk whose lane is not free yet).
    fn set_due(&self, chunk: i64, due: i64) -> Result<()>;
    /// Extends the lease of a chunk still `sending` under `token`; whether it was.
    fn renew_lease(&self, chunk: i64, token: i64, until: i64) -> Result<bool>;
    /// `sending` chunks of channel `id` whose lease ends at or before `until`.
    fn expired_sending(&self, id: i64, until: i64) -> Result<Vec<ChunkRef>>;
}

/// The channel rows of `names` (every channel, for `None`), with the interval their
/// stored rules (or the default's) give. Channels the store has never seen have no
/// chunks and are left out.
pub(crate) fn channel_rows<T: ClaimStore + ?Sized>(
    tx: &T,
    names: Option<&[&str]>,
) -> Result<Vec<ChannelRow>> {
    match names {
        None => tx.channels(None),
        Some(names) => {
            // A name given twice is one channel: read twice, its due chunks would be
            // candidates twice, and the same chunk claimed twice in one claim.
            let mut names = names.to_vec();
            names.sort_unstable();
            names.dedup();
            let mut rows = Vec::with_capacity(names.len());
            for name in names {
                rows.extend(tx.channels(Some(name))?);
            }
            Ok(rows)
        }
    }
}

/// Deliveries: caller keys and new rows.
pub(crate) trait DeliveryStore {
    /// The row and uid of the delivery with caller key `key` on `channel`.
    fn find_by_key(&self, channel: &str, key: &str) -> Result<Option<(i64, String)>>;
    /// What an enqueue with its key compares (the chunk of a queued reply stored at
    /// activation is supplied).
    fn stored_content(&self, delivery: i64) -> Result<StoredContent>;
    /// The row number the next delivery gets. Never one a delivery had before, and in
    /// the order of commits among the deliveries of one lane (the transaction holds
    /// the lane), so that it is the lane position too.
    fn next_delivery_row(&self) -> Result<i64>;
    /// As [`next_delivery_row`](Self::next_delivery_row) for a delivery of `lane`
    /// (whose lock the caller holds), and whether replies [`staged`](Self::staged) in
    /// that lane wait to go before it.
    fn next_delivery_row_in(&self, lane: LaneRef<'_>) -> Result<(i64, bool)> {
        composed::next_delivery_row_in(self, lane)
    }
    /// [`insert_delivery`](Self::insert_delivery) of each row, in one go where the
    /// store can.
    fn insert_deliveries(&self, rows: &[NewRow<'_>]) -> Result<Vec<bool>> {
        composed::insert_deliveries(self, rows)
    }
    /// Stores a delivery (`pending` if active, else `queued`) and, if `chunk_rows`, its
    /// chunks, the head chunk of an active one due at `head_due`. False (nothing
    /// stored) when its caller key was taken meanwhile by a transaction the key's lock
    /// does not cover (an application's, see [`staged`](Self::staged)).
    fn insert_delivery(&self, row: &NewRow<'_>) -> Result<bool>;
    /// Replies staged by applications' own transactions (PostgreSQL's
    /// `outbound_enqueue`: a row, no lane decided), oldest first, at most `limit`. A
    /// store without them has none.
    fn staged(&self, limit: i64) -> Result<Vec<Staged>>;
    /// The replies staged in `lane`, oldest first.
    fn staged_in_lane(&self, lane: LaneRef<'_>) -> Result<Vec<Staged>>;
    /// Removes staged reply `row`, if it is still staged (not cancelled meanwhile);
    /// whether it was. Its key stays held by this transaction.
    fn take_staged(&self, row: i64) -> Result<bool>;
    /// Notes that the reply staged as row `old` (which its uid names) is row `new`.
    fn note_renumbered(&self, old: i64, new: i64) -> Result<()>;
}

/// A delivery's row (where it is now), status, channel and chat.
pub(crate) type DeliveryState = (i64, DeliveryStatus, String, String);

/// A reply staged by an application's transaction.
#[derive(Debug, Clone)]
pub(crate) struct Staged {
    pub row: i64,
    pub uid: String,
    pub delivery: crate::reply::NewDelivery,
}

/// Finalization and the history.
pub(crate) trait FinalizeStore {
    /// Copies delivery `delivery` into the crate's history, finalized at `now`; the
    /// history's unique key refuses a second copy. Whether the delivery was there to
    /// copy.
    fn write_history(&self, delivery: i64, now: i64) -> Result<bool>;
    /// How the store's database reads an application's statement, or the database's
    /// message if it does not prepare.
    fn describe_statement(&self, sql: &str) -> Result<std::result::Result<StatementShape, String>>;
    /// Runs the application's statement for `delivery`, finalized at `now`: parameter
    /// `i` bound to the value of [`FINALIZE_PARAMETERS`](crate::rules::FINALIZE_PARAMETERS)`[at[i]]`.
    fn run_statement(&self, sql: &str, delivery: i64, now: i64) -> Result<()>;
    /// The message of a database error in which the application's schema refused its
    /// statement (a constraint, a trigger, a missing table, a type), or the error itself
    /// when the database failed.
    fn refusal(&self, error: Error) -> Result<String>;
    /// `delivered`, every chunk counted, finished now, no finalization error.
    fn mark_finalized(&self, delivery: i64, now: i64) -> Result<()>;
    /// `unfinalized` with the statement's message, every chunk counted.
    fn mark_unfinalized(&self, delivery: i64, now: i64, message: &str) -> Result<()>;
    /// Adds finalized replies to a channel's counters.
    fn add_channel_stats(&self, tally: &ChannelTally<'_>) -> Result<()>;
    /// Adds to minute `minute`'s count of finished replies (the console's charts, read
    /// by [`ReadStore::activity_minutes`]): `delivered` replies whose enqueue-to-delivery
    /// times add up to `latency_sum_ms`, the longest `latency_max_ms`, and `failed` dead
    /// letters.
    fn add_activity(&self, minute: &ActivityRow) -> Result<()>;
    /// Unfinished deliveries that have chunks, all of them delivered, with their
    /// enqueue time.
    fn finished_unfinalized(&self) -> Result<Vec<(DeliveryLane, i64)>>;
    /// The enqueue time of delivery `delivery`.
    fn created_at(&self, delivery: i64) -> Result<i64>;
}

/// Operator actions.
pub(crate) trait OperatorStore {
    /// The failed chunks of dead letters (not set aside as corrupt), oldest delivery
    /// first; of one channel, or of all for `None`.
    fn dead_letter_chunks(&self, channel: Option<&str>) -> Result<Vec<ChunkRef>>;
    /// Acknowledges every unacknowledged dead letter (of one channel, or all); returns
    /// their lanes.
    fn acknowledge_dead_letters(
        &self,
        channel: Option<&str>,
        now: i64,
    ) -> Result<Vec<(String, String)>>;
    /// Every chunk row of `delivery`, in index order, held so that no claim starts one
    /// before the transaction ends.
    fn chunk_progress(&self, delivery: i64) -> Result<Vec<ChunkProgress>>;
    /// Removes the chunks of `delivery`; returns how many.
    fn delete_chunks(&self, delivery: i64) -> Result<u64>;
    /// `cancelled`, finished now.
    fn mark_cancelled(&self, delivery: i64, now: i64) -> Result<()>;
    /// The failed or uncertain chunk of delivery row `delivery` with uid `uid`, or else
    /// its head chunk.
    fn held_or_head_chunk(&self, delivery: i64, uid: &str) -> Result<Option<ChunkRef>>;
    /// Row, status and lane of the delivery with uid `uid`, which names row
    /// `delivery` (or, on PostgreSQL, the row it was staged as).
    fn delivery_state(&self, delivery: i64, uid: &str) -> Result<Option<DeliveryState>>;
    /// Up to `limit` `uncertain` chunks of `channel` whose platform nobody asked about
    /// since they became uncertain (no settlement), oldest delivery first.
    fn unasked_uncertain(&self, channel: &str, limit: usize) -> Result<Vec<Unasked>>;
    /// Keeps `settlement` on chunk `chunk` (and the deadline of the resend it allows,
    /// `resend_by`) if it is still the unasked `uncertain` chunk whose delivery last
    /// changed at `since`; whether it was.
    fn note_settlement(
        &self,
        chunk: i64,
        since: i64,
        settlement: &str,
        resend_by: Option<i64>,
    ) -> Result<bool>;
    /// Adds `text` to what chunk `chunk` keeps of the platform's answers.
    fn append_settlement(&self, chunk: i64, text: &str) -> Result<()>;
}

/// An `uncertain` chunk nobody asked its platform about yet (see
/// [`OperatorStore::unasked_uncertain`]).
#[derive(Debug, Clone)]
pub(crate) struct Unasked {
    pub chunk: ChunkRef,
    /// Its delivery's uid, as stored (a row whose uid does not parse is left out by the
    /// caller).
    pub uid: String,
    pub text: String,
    pub metadata: Option<String>,
    /// Its first send's claim, or its delivery's creation for a chunk claimed before
    /// the time was kept.
    pub first_sent_at: i64,
    /// When its delivery last changed: when it became uncertain.
    pub since: i64,
    /// The token of the claim that left it uncertain, if kept (a lease that ran out).
    pub token: Option<i64>,
    /// The platform's id for the reply's previous part, or for a first part the last
    /// part of its chat's latest reply finished before it was first sent (among the
    /// `previous_replies_read!` replies before it), if one has it.
    pub previous_platform_id: Option<String>,
}

/// Retention.
pub(crate) trait RetentionStore {
    /// Up to `max` deliveries after row `after`, in row order, finished before `cutoff`
    /// — delivered, cancelled, or acknowledged dead letters — never the newest row.
    fn purgeable(&self, after: i64, cutoff: i64, max: i64) -> Result<Vec<Purgeable>>;
    /// Removes a delivery row and its chunks if it is still one [`purgeable`](Self::purgeable)
    /// lists (finished; checked again on the row as it stands); returns the chunks removed.
    fn delete_delivery(&self, delivery: i64) -> Result<u64>;
    /// Lowers a channel's count of stored finalized replies.
    fn forget_delivered(&self, channel: &str, count: i64) -> Result<()>;
    /// Removes lane rows whose pause and interval both ended before `now`.
    fn forget_idle_lanes(&self, now: i64) -> Result<()>;
    /// Forgets the counts of the minutes before `minute` (a purge's cutoff), and folds
    /// counts kept per connection that has ended into one row, where a store keeps them
    /// so.
    fn tidy_counters(&self, minute: i64) -> Result<()>;
    /// How many deliveries and chunks a purge with `cutoff` would remove now.
    fn purge_counts(&self, cutoff: i64) -> Result<(u64, u64)>;
}

/// A channel's counters of finalized replies, as kept (they only grow, except
/// `delivered`, which a purge lowers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StatsRow {
    pub channel: String,
    /// Finalized replies still stored.
    pub delivered: u64,
    pub last_delivered_at: Option<i64>,
    pub finalized_total: u64,
    pub latency_count: u64,
    pub latency_sum_ms: u64,
    /// Replies finalized within 1 s, 5 s, 30 s, 120 s, 600 s, 3600 s of their enqueue.
    pub latency_le: [u64; 6],
}

/// Unfinished deliveries of one channel in one status (and acknowledgement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeliveryGroup {
    pub channel: String,
    pub status: DeliveryStatus,
    /// Nobody acknowledged them (dead letters).
    pub unacknowledged: bool,
    pub count: u64,
    pub oldest_created_at: i64,
    /// How many were set aside as unreadable.
    pub corrupt: u64,
}

/// The chunks of unfinished deliveries of one channel in one status (the unsent rest of
/// a dead letter left out; the chunk of a queued reply whose row is stored at its
/// activation counted as pending).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkGroup {
    pub channel: String,
    pub status: ChunkStatus,
    pub count: u64,
    /// Due at `now` or earlier (for `sending`: whose lease ended).
    pub due_now: u64,
    /// The earliest due time of those not `sending`.
    pub oldest_due: Option<i64>,
    /// Those with a due time at all (the outbox will move them by itself).
    pub scheduled: u64,
}

/// What a health snapshot is counted from: maintained counters and unfinished rows,
/// never the history.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HealthRows {
    pub stats: Vec<StatsRow>,
    pub deliveries: Vec<DeliveryGroup>,
    pub chunks: Vec<ChunkGroup>,
    /// Read from a standby: how far behind it is.
    pub replica: Option<crate::views::Replica>,
}

/// The reads of monitoring and inspection: coarse, so each store answers them with its
/// own plans, in one consistent snapshot.
pub(crate) trait ReadStore {
    /// What a health snapshot at `now` is counted from.
    fn health_rows(&self, now: i64) -> Result<HealthRows>;
    /// Delivery row `delivery` with uid `uid`, with its chunks (the chunk of a queued
    /// reply whose row is stored at its activation included).
    fn delivery_view(&self, delivery: i64, uid: &str) -> Result<Option<DeliveryView>>;
    /// Deliveries matching `filter`, newest first, without their chunks; rows that
    /// cannot be read are left out.
    fn list(&self, filter: &ListFilter) -> Result<Vec<DeliveryView>>;
    /// Unfinished deliveries set aside as unreadable, or whose uid does not parse.
    fn corrupt_rows(&self) -> Result<Vec<CorruptRow>>;
    /// Replies delivered or failed for good at `since` (ms) or later, in buckets of
    /// `bucket` ms counted from `since`, in bucket order; only buckets with a reply.
    /// Read over the index of finished deliveries: only those rows.
    fn activity(&self, since: i64, bucket: i64) -> Result<Vec<ActivityRow>>;
    /// The counts [`FinalizeStore::add_activity`] kept for minutes `from..=to`, one row
    /// per minute with any (its number in `bucket`), in minute order.
    fn activity_minutes(&self, from: i64, to: i64) -> Result<Vec<ActivityRow>>;
}

/// One bucket of [`ReadStore::activity`], or one minute of
/// [`ReadStore::activity_minutes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ActivityRow {
    /// The bucket's number from `since` (0 is the first); a minute's number (its start
    /// in ms, divided by 60,000).
    pub bucket: i64,
    pub delivered: i64,
    pub failed: i64,
    /// The sum and the maximum of the delivered replies' enqueue-to-finish times, ms.
    pub latency_sum_ms: i64,
    pub latency_max_ms: i64,
}

impl ActivityRow {
    /// Rows in `bucket` order, those of one bucket added into one (`rows` in order).
    pub(crate) fn merged(rows: impl IntoIterator<Item = ActivityRow>) -> Vec<ActivityRow> {
        let mut merged: Vec<ActivityRow> = Vec::new();
        for m in rows {
            match merged.last_mut() {
                Some(last) if last.bucket == m.bucket => {
                    last.delivered += m.delivered;
                    last.failed += m.failed;
                    last.latency_sum_ms += m.latency_sum_ms;
                    last.latency_max_ms = last.latency_max_ms.max(m.latency_max_ms);
                }
                _ => merged.push(m),
            }
        }
        merged
    }
}

impl HealthRows {
    /// A channel's dead letters as its store counts them as they come and go (never by
    /// reading them): `dead_letters` in all, `unacknowledged` of them nobody
    /// acknowledged, `corrupt` set aside as unreadable, and `failed_chunks` failed parts.
    pub(crate) fn add_dead_letters(
        &mut self,
        channel: String,
        dead_letters: u64,
        unacknowledged: u64,
        corrupt: u64,
        failed_chunks: u64,
    ) {
        let group = |unacknowledged, count, corrupt| DeliveryGroup {
            channel: channel.clone(),
            status: DeliveryStatus::Failed,
            unacknowledged,
            count,
            oldest_created_at: 0, // not in flight: no age reported
            corrupt,
        };
        self.deliveries.push(group(true, unacknowledged, 0));
        self.deliveries.push(group(
            false,
            dead_letters.saturating_sub(unacknowledged),
            corrupt,
        ));
        self.chunks.push(ChunkGroup {
            channel,
            status: ChunkStatus::Failed,
            count: failed_chunks,
            due_now: 0,
            oldest_due: None,
            scheduled: 0,
        });
    }
}

/// One transaction of a store: every primitive, and the dead letters its work made.
/// The processes that write the outbox, each with its build (SQLite schema 15,
/// PostgreSQL 10).
pub(crate) trait ProcessStore {
    /// Adds process `row`, or renews its `seen_at` if it is there; first removes every
    /// row last seen before `gone_before` (processes long gone without closing).
    fn note_process(&self, row: &ProcessRow, gone_before: i64) -> Result<()>;
    /// Removes process `id`: it closed.
    fn forget_process(&self, id: &str) -> Result<()>;
    /// The processes seen at `since` or later, oldest build first.
    fn processes(&self, since: i64) -> Result<Vec<ProcessRow>>;
}

pub(crate) trait StoreTx:
    Locks
    + RuleStore
    + ProcessStore
    + LaneStore
    + ChunkStore
    + ClaimStore
    + DeliveryStore
    + FinalizeStore
    + OperatorStore
    + RetentionStore
    + ReadStore
{
    /// Opens a nested transaction (a savepoint).
    fn begin_nested(&self) -> Result<()>;
    /// Ends the nested transaction, keeping its writes or undoing them.
    fn end_nested(&self, keep: bool) -> Result<()>;
    /// Whether the transaction is still open: an error may have ended it (a trigger's
    /// `RAISE(ROLLBACK)`), leaving nothing to undo to.
    fn in_transaction(&self) -> bool;
    /// Notes that this work made delivery row `delivery` a dead letter, for `error`.
    fn note_dead_letter(&self, delivery: i64, error: &str);
    /// The dead letters noted so far, taken.
    fn take_dead_letters(&self) -> Vec<(i64, String)>;
    /// Every row of the outbox's own tables, each as text, sorted: what two ways of
    /// writing the same thing must both leave (the contract suite, `src/contracts/`, compares them).
    #[cfg(test)]
    fn table_rows(&self) -> Result<Vec<String>>;
    /// Stages `d` at `now` as an application's own transaction does (see
    /// [`staged`](DeliveryStore::staged)); its uid. `None` from a store without staged
    /// replies.
    #[cfg(test)]
    fn stage(&self, _d: &crate::reply::NewDelivery, _now: i64) -> Result<Option<String>> {
        Ok(None)
    }
    /// Each lane as an enqueue into it needs it, and `rows` row numbers drawn
    /// ascending as [`next_delivery_row`](DeliveryStore::next_delivery_row) draws them
    /// (the rows of the deliveries the caller stores, in that order), in one go where
    /// the store can. The caller holds the lanes. A store without staged replies has
    /// none before.
    fn enter_lanes(
        &self,
        lanes: &[LaneRef<'_>],
        rows: usize,
    ) -> Result<(Vec<LaneEntry>, Vec<i64>)> {
        composed::enter_lanes(self, lanes, rows)
    }
    /// For each `(chunk, delivery, platform message id)`, the last chunk of its delivery:
    /// [`mark_delivered`](ChunkStore::mark_delivered), [`write_history`](FinalizeStore::write_history)
    /// and [`mark_finalized`](FinalizeStore::mark_finalized); then
    /// [`add_channel_stats`](FinalizeStore::add_channel_stats) of each tally (in the order
    /// given: channel name order) — in one go where the store can, the history rows in
    /// the order given. How many deliveries were there to copy; a store that answers
    /// before it knows may answer all of them, and then must fail the transaction,
    /// its commit at the latest, with the rules' refusal when one was missing.
    fn finalize_delivered(
        &self,
        chunks: &[(i64, i64, Option<&str>)],
        tallies: &[ChannelTally<'_>],
        now: i64,
    ) -> Result<usize> {
        composed::finalize_delivered(self, chunks, tallies, now)
    }
}

/// Where a part of a list of deliveries is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ListFrom {
    /// Every delivery, history included.
    All,
    /// The work in flight (or waiting for a person), from its index.
    InFlight,
    /// One channel's dead letters, from their indexes.
    Dead,
}

/// [`ReadStore::list`] as both stores answer it: unfinished deliveries are read from
/// the index of work in flight and from the dead letters', channel by channel (those of
/// `channels`, or the filter's one), newest first, so a page of them costs the page;
/// `read` answers one part (with the channel for [`ListFrom::Dead`]), newest first, at
/// most `filter.limit` rows, each with its row number.
pub(crate) fn list_deliveries(
    filter: &ListFilter,
    channels: impl FnOnce() -> Result<Vec<String>>,
    mut read: impl FnMut(ListFrom, Option<&str>) -> Result<Vec<(i64, DeliveryView)>>,
) -> Result<Vec<DeliveryView>> {
    let unfinished = filter.unfinished
        || filter
            .status
            .is_some_and(|status| status != DeliveryStatus::Delivered);
    let mut rows = Vec::new();
    if !unfinished {
        rows = read(ListFrom::All, None)?;
    } else {
        if filter.status != Some(DeliveryStatus::Failed) {
            rows.extend(read(ListFrom::InFlight, None)?);
        }
        if filter
            .status
            .is_none_or(|status| status == DeliveryStatus::Failed)
        {
            let channels = match &filter.channel {
                Some(channel) => vec![channel.clone()],
                None => channels()?,
            };
            for channel in &channels {
                rows.extend(read(ListFrom::Dead, Some(channel))?);
            }
            rows.sort_by_key(|(row, _)| std::cmp::Reverse(*row));
            rows.truncate(filter.limit);
        }
    }
    Ok(rows.into_iter().map(|(_, view)| view).collect())
}

/// Each batched primitive composed of the one-at-a-time ones: what a store that has no
/// version of its own does, and what the contract suite compares a store's own
/// version with (the same rows must result).
pub(crate) mod composed {
    use super::*;

    /// [`LaneStore::activate_many`].
    pub(crate) fn activate_many<T: LaneStore + ?Sized>(
        tx: &T,
        heads: &[Activation<'_>],
    ) -> Result<()> {
        for head in heads {
            tx.activate(head)?;
        }
        Ok(())
    }

    /// [`ClaimStore::mark_sending_many`].
    pub(crate) fn mark_sending_many<T: ClaimStore + ?Sized>(
        tx: &T,
        chunks: &[(i64, i64)],
        now: i64,
        lease_until: i64,
    ) -> Result<()> {
        for (chunk, token) in chunks {
            tx.mark_sending(*chunk, now, lease_until, *token)?;
        }
        Ok(())
    }

    /// [`DeliveryStore::next_delivery_row_in`]: staged replies of the lane go first.
    pub(crate) fn next_delivery_row_in<T: DeliveryStore + ?Sized>(
        tx: &T,
        lane: LaneRef<'_>,
    ) -> Result<(i64, bool)> {
        let staged_before = !tx.staged_in_lane(lane)?.is_empty();
        Ok((tx.next_delivery_row()?, staged_before))
    }

    /// [`DeliveryStore::insert_deliveries`].
    pub(crate) fn insert_deliveries<T: DeliveryStore + ?Sized>(
        tx: &T,
        rows: &[NewRow<'_>],
    ) -> Result<Vec<bool>> {
        rows.iter().map(|row| tx.insert_delivery(row)).collect()
    }

    /// [`StoreTx::enter_lanes`].
    pub(crate) fn enter_lanes<T: LaneStore + DeliveryStore + ?Sized>(
        tx: &T,
        lanes: &[LaneRef<'_>],
        rows: usize,
    ) -> Result<(Vec<LaneEntry>, Vec<i64>)> {
        let entries = lanes
            .iter()
            .map(|lane| {
                Ok(LaneEntry {
                    staged_before: !tx.staged_in_lane(*lane)?.is_empty(),
                    head: tx.lane_head(*lane)?,
                    free_at: tx.lane_due_time(*lane, i64::MIN)?,
                })
            })
            .collect::<Result<_>>()?;
        let first = tx.next_delivery_row()?;
        Ok((entries, (first..).take(rows).collect()))
    }

    /// [`StoreTx::finalize_delivered`].
    pub(crate) fn finalize_delivered<T: ChunkStore + FinalizeStore + ?Sized>(
        tx: &T,
        chunks: &[(i64, i64, Option<&str>)],
        tallies: &[ChannelTally<'_>],
        now: i64,
    ) -> Result<usize> {
        let mut copied = 0;
        for (chunk, delivery, platform_message_id) in chunks {
            tx.mark_delivered(*chunk, *platform_message_id, now)?;
            if tx.write_history(*delivery, now)? {
                copied += 1;
            }
            tx.mark_finalized(*delivery, now)?;
        }
        for tally in tallies {
            tx.add_channel_stats(tally)?;
        }
        Ok(copied)
    }
}

/// A PostgreSQL connection URL as a message may show it: a password, in the user part
/// or as a `password` parameter, replaced by `***`. Every message of this crate and
/// its tool that names a server shows it so.
///
/// ```
/// use chunked_outbox::store::redact_url;
///
/// assert_eq!(redact_url("postgres://bot:s3cret@db/chat"), "postgres://bot:***@db/chat");
/// assert_eq!(
///     redact_url("postgresql:///chat?host=/run/postgresql&password=s3cret&sslmode=disable"),
///     "postgresql:///chat?host=/run/postgresql&password=***&sslmode=disable"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    // postgres://user:secret@host/… (the user part ends at the last '@' before the path)
    if let Some(start) = out.find("://").map(|i| i + 3) {
        let end = out[start..]
            .find(['/', '?'])
            .map_or(out.len(), |i| start + i);
        if let Some(at) = out[start..end].rfind('@').map(|i| start + i)
            && let Some(colon) = out[start..at].find(':').map(|i| start + i)
        {
            out.replace_range(colon + 1..at, "***");
        }
    }
    // …?password=secret&… (and any case of the key)
    let mut from = 0;
    while let Some(i) = out[from..].to_ascii_lowercase().find("password=") {
        let value = from + i + "password=".len();
        let preceded = out[..from + i].ends_with(['?', '&', ' ']) || from + i == 0;
        let end = out[value..]
            .find(['&', ' '])
            .map_or(out.len(), |j| value + j);
        if preceded {
            out.replace_range(value..end, "***");
            from = value + 3;
        } else {
            from = value;
        }
    }
    out
}
