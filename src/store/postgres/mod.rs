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
// locks (see `locks.rs`): the rules read-decide-write only under them, so
// concurrent writers on several hosts keep every lane's order, every caller key and
// every channel's rate. Claims never wait: their chunk rows, lanes and channel slots
// are taken with `SKIP LOCKED`.
//
// Each connection keeps the statements it prepared, by the address of their `'static`
// text, so a statement is parsed and planned once per connection. Behind a transaction
// pooler, where the next transaction may run on another server connection, it keeps
// only each statement's parameter types and sends the statement unnamed with its
// values: one round trip, and no name left on the server.

// One concept a file, as in `sqlite/`:
// - the connections: `pool` (the pool, connecting, which server a connection
//   reached), `client` (a connection that pipelines), `runtime` (where the blocking
//   client may run), `listen` (hearing other hosts' commits);
// - the transaction: `begin` (its first round trip), `tx` ([`PgTx`] and the
//   primitives that are its own), `pipeline` (what it keeps back), `locks`, `commit`
//   (the commit protocol: a lost commit looked up), `error` (the server's errors as the
//   outbox's), `seam` (the primitives that are the transaction's own: nested
//   transactions, entering lanes, finalizing);
// - the store: `server` (opening, migrating, the `Store` of the seam), `schema`;
// - the SQL of the seam by area, each on `tx::PgTx`: `lanes`, `chunks` (chunks and
//   claims), `deliveries` (deliveries and finalization), `operator` (operator and
//   retention), `reads`, `rules`, `processes`, `application` (the statement an
//   application's transaction runs), `statement` (the application's finalization
//   statement).

pub(crate) mod application;
mod begin;
pub(crate) mod chunks;
pub(crate) mod client;
mod commit;
pub(crate) mod deliveries;
mod error;
pub(crate) mod lanes;
pub(crate) mod listen;
pub(crate) mod locks;
pub(crate) mod operator;
mod pipeline;
pub(crate) mod pool;
pub(crate) mod processes;
pub(crate) mod reads;
pub(crate) mod rules;
pub(crate) mod runtime;
pub(crate) mod schema;
mod seam;
pub(crate) mod server;
pub(crate) mod statement;
pub(crate) mod tx;

pub(crate) use pool::PgStore;

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
