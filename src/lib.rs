//! A durable outbox for outbound chat replies, split into independently retried chunks
//! and stored — in SQLite, or PostgreSQL for several hosts — before the first network
//! call.
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
//! # Where things are
//!
//! The crate root holds what every application touches: [`Outbox`] and its
//! [`OutboxOptions`], [`NewDelivery`], [`Claim`] and [`Outcome`], [`Error`], the
//! [`Splitter`], and the dispatchers ([`Dispatcher`], and [`AsyncDispatcher`] with the
//! feature `tokio`) with their adapter traits. The rest, by what you look for:
//!
//! | module | what is in it |
//! |---|---|
//! | [`platforms`] | ready adapters (features `teloxide`, `serenity`, `slack-morphism`) and the mappings of each platform's answers to an [`Outcome`] |
//! | [`dispatch`] | the dispatchers' builders, handles, events and reports |
//! | [`rules`] | the rules stored in the file: lane order, retries, replay, pacing, the finalization statement |
//! | [`monitoring`] | health snapshots and their verdicts, an HTTP endpoint, the `metrics` names, the views of `list` and `delivery` |
//! | [`maintenance`] | recovering dead workers' sends, settling uncertain chunks, purging |
//! | [`store`] | SQLite or PostgreSQL: which to pick, what differs, each one's settings |
//! | [`limits`] | the bounds input is held to |
//! | [`split`], [`ids`], [`clock`] | the splitter's units and markup; chunk keys and ids; injectable time |
//!
//! The `outbox` tool (feature `cli`, on by default) inspects and repairs an outbox:
//! `health`, `serve`, `list`, `show`, `requeue`, `resolve`, `cancel`, `purge`, `config`,
//! `migrate`; `outbox-lab` runs the `demo` and the `torture` that show the guarantees
//! below.
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
//!   delivered. With [`LaneOrder::Fifo`](rules::LaneOrder::Fifo) (the default) one delivery per chat is in flight
//!   at a time, so replies leave in enqueue order; [`LaneFailurePolicy`](rules::LaneFailurePolicy) says what
//!   happens when the head fails for good.
//! * **One key per chunk.** Every send of a chunk carries the same idempotency key,
//!   derived only by [`chunk_idempotency_key`](ids::chunk_idempotency_key).
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
//! request was written, or a crash while `sending`), the channel's [`ReplayPolicy`](rules::ReplayPolicy)
//! decides between replaying it (at-least-once) and holding it as `uncertain` for a
//! decision (at-most-once until resolved).
//!
//! # Durability
//!
//! The database runs in WAL mode with a busy timeout. With
//! [`Synchronous::Normal`](store::sqlite::Synchronous::Normal) (the default) every committed transaction survives a crash of
//! the process; a power loss may lose the last few commits but never corrupts the file.
//! [`Synchronous::Full`](store::sqlite::Synchronous::Full) also survives power loss, at the cost of an fsync per commit.
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

// Every Rust block of the README and the documents compiles and runs as a doctest (the
// README's quick start needs the Telegram adapter; `tests/readme.rs` also builds it as
// a project of its own and runs it against an emulated Bot API).
#[cfg(all(doctest, feature = "teloxide"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
macro_rules! doctests {
    ($($name:ident: $path:literal),* $(,)?) => {$(
        #[cfg(doctest)]
        #[doc = include_str!($path)]
        struct $name;
    )*};
}
doctests!(
    GuideDoctests: "../docs/GUIDE.md",
    MigratingDoctests: "../docs/MIGRATING.md",
    GuaranteesDoctests: "../docs/GUARANTEES.md",
    OperatingDoctests: "../docs/OPERATING.md",
    PlatformsDoctests: "../docs/PLATFORMS.md",
    PerformanceDoctests: "../docs/PERFORMANCE.md",
);

mod claim;
mod classify;
pub mod clock;
#[cfg(feature = "console")]
#[cfg_attr(docsrs, doc(cfg(feature = "console")))]
pub mod console;
#[cfg(test)]
mod contracts;
pub mod dispatch;
mod enqueue;
mod entry;
mod error;
mod finalize;
mod health;
pub mod ids;
mod inspect;
mod lane;
pub mod monitoring;
mod operator;
mod options;
mod outbox;
mod outcome;
mod parse;
pub mod platforms;
pub mod registry;
mod reply;
mod retention;
pub mod rules;
#[doc(hidden)]
pub mod sabotage;
pub mod settle;
pub mod split;
mod state;
mod status;
mod step;
pub mod store;
mod telemetry;
mod upgrade;
mod views;

// What every application touches. The rest is grouped in the modules below, by what a
// user looks for.
pub use claim::Claim;
#[cfg(feature = "tokio")]
pub use dispatch::{AsyncChannelAdapter, AsyncDispatcher};
pub use dispatch::{ChannelAdapter, Dispatcher};
pub use enqueue::{Enqueued, NewDelivery};
pub use error::{Error, Result};
pub use ids::DeliveryId;
pub use options::OutboxOptions;
pub use outbox::Outbox;
pub use outcome::Outcome;
pub use split::Splitter;
pub use state::Recorded;

/// What an operator runs on a live outbox: settling the sends of dead workers, settling
/// uncertain chunks, purging finished rows. Each is also a command of the `outbox` tool.
pub mod maintenance {
    pub use crate::claim::{RecoverScope, RecoveryReport};
    pub use crate::operator::Resolution;
    pub use crate::retention::PurgeReport;
}

/// The bounds the outbox holds input and waits to. Input beyond one is refused with
/// [`Error::InvalidInput`] before anything is written, except where an item says it is
/// cut or capped instead.
pub mod limits {
    pub use crate::claim::MAX_CLAIM_BATCH;
    pub use crate::classify::MAX_RETRY_AFTER;
    pub use crate::inspect::MAX_LIST_LIMIT;
    pub use crate::outcome::MAX_PLATFORM_ID_BYTES;
    pub use crate::reply::{
        MAX_CHANNEL_BYTES, MAX_CHAT_ID_BYTES, MAX_CHUNKS, MAX_DELIVERY_BYTES, MAX_ENQUEUE_BATCH,
        MAX_KEY_BYTES, MAX_METADATA_BYTES,
    };
    pub use crate::state::{MAX_ERROR_BYTES, MAX_REFUNDED_RATE_LIMITS};
}
