//! A durable outbox for outbound chat replies, split into independently retried chunks
//! and stored in SQLite before the first network call.
//!
//! A chat engine hands the outbox a logical message ("the reply to user 42 on
//! Telegram") already split into chunks that fit the platform. The outbox stores it,
//! hands the chunks out in order under a lease, retries each one with backoff, survives
//! crashes at any instant, and writes the complete message into its history table, `outbound_messages`,
//! exactly once, in the same transaction as the last chunk's acknowledgement.
//!
//! ```
//! use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};
//!
//! let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
//! for chat in ["42", "43", "44"] {
//!     let reply = NewDelivery::chunked("telegram", chat, "Hello\n\nWorld", ["Hello", "World"]);
//!     outbox.enqueue(&reply)?;
//! }
//!
//! // A worker loop: claim what you are about to send, send each chunk with its stable
//! // key, and record the outcome of every claim you took.
//! loop {
//!     let claims = outbox.claim(16)?;
//!     if claims.is_empty() {
//!         break;
//!     }
//!     for claim in claims {
//!         // send_to_platform(&claim.chat_id, &claim.text, &claim.idempotency_key) ...
//!         let recorded = outbox.record(&claim, Outcome::delivered(Some("msg-1".into())))?;
//!         if recorded.finalized {
//!             println!("{} fully delivered", claim.delivery_id);
//!         }
//!     }
//! }
//! let totals = outbox.health()?.totals;
//! assert_eq!(totals.delivered_deliveries, 3);
//! assert_eq!(totals.sending_chunks + totals.uncertain_chunks, 0, "no claim left behind");
//! # Ok::<(), chunked_outbox::Error>(())
//! ```
//!
//! A claim counts as a send in flight: if the process dies holding it, the chunk may
//! have reached the platform. A [`Dispatcher`] claims exactly the sends it has in
//! flight, renews their leases, catches adapter panics and records each outcome before
//! its next send — most applications run one instead of this loop.
//!
//! # What else is here
//!
//! * [`Dispatcher`] (threads) and [`AsyncDispatcher`] (feature `tokio`) run the loop
//!   above against [`ChannelAdapter`]s, one per channel, with events
//!   ([`DispatchEvent`]) for finalized replies and dead letters.
//! * Ready adapters (features `teloxide`, `serenity`, `slack-morphism`, see
//!   `adapters`) and typed mappings of the platforms' answers ([`platforms`]).
//! * [`Splitter`]: platform presets, grapheme-safe cuts, code fences and Telegram HTML
//!   kept whole.
//! * Monitoring: [`Outbox::health`] with [`Health::to_prometheus`] and
//!   [`Health::verdict`]; an HTTP [`monitoring::Endpoint`] (`/metrics`, `/healthz`,
//!   `/health.json`) to mount in the application's server; and with feature `metrics`
//!   counters and histograms through the `metrics` facade ([`telemetry`]).
//! * A PostgreSQL store (feature `postgres`) for applications on several hosts:
//!   [`Outbox::connect`], wake-ups across hosts, and replies enqueued inside the
//!   application's own transaction ([`app_transaction`]; with features
//!   `tokio-postgres` and `sqlx` for those clients).
//! * The `outbox` tool (feature `cli`, on by default): `health`, `serve`, `list`, `show`,
//!   `requeue`, `resolve`, `cancel`, `purge`, `config`, `migrate`, and the `demo` and
//!   `torture` that show the guarantees below.
//!
//! # Chunk states
//!
//! ```text
//! pending ──claim──▶ sending ──ack──────────────▶ delivered
//! retry   ──claim──▶ sending ──transient error──▶ retry (due after backoff)
//!                    sending ──permanent error──▶ failed (dead letter)
//!                    sending ──attempts exhausted▶ failed
//!                    sending ──rate limited─────▶ retry (lane paused; attempt refunded)
//!                    sending ──lease expired / ambiguous ─▶ retry      if the channel may replay
//!                                                         ─▶ uncertain  otherwise
//! failed | uncertain ──requeue──▶ retry
//! uncertain ──resolve as delivered──▶ delivered
//! uncertain ──late outcome of the claim whose lease ran out──▶ delivered | retry | failed
//! ```
//!
//! # Guarantees
//!
//! * **Nothing is lost.** An enqueue that returned `Ok` survives any crash of the
//!   process. Rows leave only through [`Outbox::purge`].
//! * **Order.** Chunk *k+1* of a delivery is never handed out before chunk *k* is
//!   delivered. With [`LaneOrder::Fifo`] (the default) one delivery per chat is in flight
//!   at a time, so replies leave in enqueue order; [`LaneFailurePolicy`] says what
//!   happens when the head fails for good.
//! * **One key per chunk.** Every send of a chunk carries the same idempotency key,
//!   derived only by [`chunk_idempotency_key`].
//! * **Exactly-once finalization.** A delivery is written to `outbound_messages` in the
//!   transaction that records its last ack, and `outbound_messages.delivery_id` is UNIQUE.
//! * **Fenced claims.** Every outcome checks the claim's token: a worker whose lease
//!   expired cannot settle a chunk that was claimed again or settled by an operator
//!   ([`Error::StaleClaim`]), and can still settle one nobody else took. Expired leases
//!   are reclaimed by ordinary claiming.
//! * **A crash leaves only what was in flight.** After a dispatcher process dies, at
//!   most one chunk per send it had in flight (`workers × batch_size`) can be held
//!   `uncertain`; everything else it had not started stays due, uncharged.
//! * **Attempts are counted before I/O**, in the claim transaction, so a chunk that
//!   crashes the process every time still runs out of attempts.
//! * **Bad input changes nothing.** Invalid input is refused with
//!   [`Error::InvalidInput`] before any write; every operation is one transaction.
//!
//! What the outbox cannot promise is that a platform without idempotent sends never
//! sees a duplicate: when a send may have reached the platform (a timeout after the
//! request was written, or a crash while `sending`), the channel's [`ReplayPolicy`]
//! decides between replaying it (at-least-once) and holding it as `uncertain` for a
//! decision (at-most-once until resolved).
//!
//! # Durability
//!
//! The database runs in WAL mode with a busy timeout. With
//! [`Synchronous::Normal`] (the default) every committed transaction survives a crash of
//! the process; a power loss may lose the last few commits but never corrupts the file.
//! [`Synchronous::Full`] also survives power loss, at the cost of an fsync per commit.
//! The file is created with mode 0600. Message text is never logged above `debug`.
//! A background thread runs passive WAL checkpoints so that they rarely fall inside a
//! commit ([`OutboxOptions::with_background_checkpoints`]).
//!
//! # Concurrency
//!
//! An [`Outbox`] serialises its writes through one connection (SQLite has one writer)
//! and reads through a pool. Several threads may share one `Outbox`; several processes
//! may open the same file. Concurrent claimers never receive the same chunk.

// On docs.rs (`--cfg docsrs`, see Cargo.toml), each item behind a feature is marked
// with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(any(feature = "teloxide", feature = "serenity", feature = "slack-morphism"))]
pub mod adapters;
#[cfg(feature = "postgres")]
pub mod app_transaction;
mod claim;
mod classify;
mod clock;
mod dispatch;
mod enqueue;
mod error;
mod finalize;
mod health;
mod ids;
mod inspect;
mod lane;
pub mod monitoring;
mod operator;
mod options;
mod outbox;
mod outcome;
pub mod platforms;
mod retention;
mod rules;
#[doc(hidden)]
pub mod sabotage;
mod split;
mod state;
mod status;
mod step;
mod store;
pub mod telemetry;

pub use claim::{Claim, RecoverScope, RecoveryReport};
pub use classify::{ErrorClass, classify_error};
pub use clock::{Clock, ManualClock, SystemClock};
#[cfg(feature = "tokio")]
pub use dispatch::tokio::{
    AsyncChannelAdapter, AsyncDispatcher, AsyncDispatcherBuilder, RunningAsyncDispatcher,
    SendFuture,
};
pub use dispatch::{
    ChannelAdapter, DispatchEvent, DispatchStats, Dispatcher, DispatcherBuilder, RunningDispatcher,
    ShutdownReport,
};
pub use enqueue::{Enqueued, NewDelivery};
pub use error::{Error, Result};
pub use finalize::FINALIZE_PARAMETERS;
pub use health::{ChannelHealth, Health, LATENCY_BUCKETS, LatencyHistogram};
pub use ids::{
    COMPACT_KEY_LEN, ChunkId, ClaimantId, DeliveryId, chunk_compact_key, chunk_idempotency_key,
    chunk_key_uuid,
};
pub use inspect::{ChunkView, CorruptRow, DeliveryView, ListFilter};
pub use operator::Resolution;
pub use options::{OutboxOptions, Synchronous};
pub use outbox::Outbox;
pub use outcome::Outcome;
pub use retention::PurgeReport;
pub use rules::{
    Backoff, ChannelPolicy, LaneFailurePolicy, LaneOrder, Policy, ReplayPolicy, RetryPolicy,
};
/// The rusqlite this crate is built with: [`Outbox::enqueue_in`] takes its
/// `Connection`, so an application names the same version through this re-export.
pub use rusqlite;
pub use split::{LengthUnit, Markup, Splitter};
pub use state::Recorded;
pub use status::{ChunkStatus, DeliveryStatus};
pub use store::sqlite::connection::StorageSettings;
pub use store::sqlite::schema::SCHEMA_VERSION;

/// The bounds the outbox holds input and waits to. Input beyond one is refused with
/// [`Error::InvalidInput`] before anything is written, except where an item says it is
/// cut or capped instead.
pub mod limits {
    pub use crate::claim::MAX_CLAIM_BATCH;
    pub use crate::classify::MAX_RETRY_AFTER;
    pub use crate::enqueue::{
        MAX_CHANNEL_BYTES, MAX_CHAT_ID_BYTES, MAX_CHUNKS, MAX_DELIVERY_BYTES, MAX_ENQUEUE_BATCH,
        MAX_KEY_BYTES, MAX_METADATA_BYTES,
    };
    pub use crate::inspect::MAX_LIST_LIMIT;
    pub use crate::outcome::MAX_PLATFORM_ID_BYTES;
    pub use crate::state::{MAX_ERROR_BYTES, MAX_REFUNDED_RATE_LIMITS};
}
