//! PostgreSQL as a real deployment meets it: several hosts whose clocks disagree, text
//! the server cannot store, replies staged by other services, waits that must end,
//! addresses that are wrong, and async code.
//!
//! Each test is one thing a multi-host deployment brings that a single process never
//! shows, checked through what a real party could see: the outbox's views and claims.
#![cfg(feature = "postgres")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use chunked_outbox::clock::{Clock, SkewedClock, SystemClock};
use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::monitoring::ChunkStatus;
use chunked_outbox::rules::RetryPolicy;
use chunked_outbox::{
    ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox, OutboxOptions, Outcome,
};
use common::postgres::fresh_schema_url;

/// A host on schema `url` whose clock is `clock`.
fn host(url: &str, clock: impl Clock + 'static, options: OutboxOptions) -> Outbox {
    Outbox::connect(url, options.with_clock(Arc::new(clock))).expect("connect")
}

fn url() -> String {
    fresh_schema_url().expect("the PostgreSQL test server")
}

/// A host whose clock is 90 s ahead takes over no chunk under another host's live 60 s
/// lease, and the holder's ack stands.
#[test]
fn a_host_ahead_takes_over_no_live_lease() {
    let url = url();
    let lease = OutboxOptions::default().with_lease(Duration::from_secs(60));
    let a = host(&url, SystemClock, lease.clone());
    let b = host(&url, SkewedClock::ahead(Duration::from_secs(90)), lease);

    let id = a.enqueue(&NewDelivery::single("t", "c", "one")).unwrap().id;
    let claim = a.claim(1).unwrap().remove(0);
    assert!(
        b.claim(1).unwrap().is_empty(),
        "the host 90 s ahead claimed a chunk under a live lease"
    );
    b.recover(RecoverScope::ExpiredLeases).unwrap();
    a.ack(&claim, Some("m1"))
        .expect("the lease holder's ack was refused");
    let view = a.delivery(id).unwrap().unwrap();
    assert_eq!(view.chunks[0].status, ChunkStatus::Delivered);
    assert_eq!(view.chunks[0].attempts, 1, "sent twice");
}

/// A reply enqueued by a host 2 minutes behind is not dead-lettered for its age (60 s
/// allowed) by a host on time; a host 90 s behind finds work that is due at once.
#[test]
fn a_host_behind_neither_ages_replies_nor_waits_for_work() {
    let url = url();
    let options = OutboxOptions::default()
        .with_retry(RetryPolicy::default().with_max_age(Some(Duration::from_secs(60))));
    let a = host(&url, SystemClock, options.clone());
    let b = host(&url, SkewedClock::behind(Duration::from_secs(120)), options);

    let id = b.enqueue(&NewDelivery::single("t", "c1", "hi")).unwrap().id;
    let claims = a.claim(1).unwrap();
    assert_eq!(
        claims.len(),
        1,
        "a fresh reply from a host behind was not claimed: {:?}",
        a.delivery(id).unwrap().unwrap().chunks[0]
    );
    a.ack(&claims[0], None).unwrap();

    let c = host(
        &url,
        SkewedClock::behind(Duration::from_secs(90)),
        OutboxOptions::default(),
    );
    a.enqueue(&NewDelivery::single("t", "c2", "fresh")).unwrap();
    let claims = c.claim(1).unwrap();
    assert_eq!(
        claims.len(),
        1,
        "a host 90 s behind did not see work that is due"
    );
    c.ack(&claims[0], None).unwrap();
}

/// The platform of [`a_round_keeps_every_outcome_the_store_can_hold`]: its answer per
/// chat.
struct Answers;

impl ChannelAdapter for Answers {
    fn send(&self, claim: &Claim) -> Outcome {
        match claim.chat_id.as_str() {
            "nul-id" => Outcome::delivered(Some("id\0x".into())),
            "nul-error" => Outcome::Transient {
                error: "bad\0gateway".into(),
            },
            "poison" => Outcome::delivered(Some("poison".into())),
            _ => Outcome::delivered(Some("fine".into())),
        }
    }
}

/// A NUL in an outcome's platform id or error text (PostgreSQL's text cannot hold one)
/// is stored as U+FFFD; and an outcome the store refuses (here a trigger of the
/// application's refuses one id) costs only that outcome, never the others of its round.
#[test]
fn a_round_keeps_every_outcome_the_store_can_hold() {
    let url = url();
    let outbox = Outbox::connect(&url, OutboxOptions::default()).unwrap();
    let mut admin = admin(&url);
    admin
        .batch_execute(
            "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.platform_message_id = 'poison' THEN
                     RAISE EXCEPTION 'the application refuses this id';
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_poison BEFORE UPDATE ON outbound_delivery_chunks
                 FOR EACH ROW EXECUTE FUNCTION refuse_poison();",
        )
        .unwrap();
    let chats = ["nul-id", "nul-error", "poison", "plain"];
    let ids: Vec<_> = chats
        .iter()
        .map(|chat| {
            outbox
                .enqueue(&NewDelivery::single("t", *chat, "hello"))
                .unwrap()
                .id
        })
        .collect();
    let dispatcher = Dispatcher::builder(outbox.clone())
        .batch_size(8)
        .adapter("t", Answers)
        .build()
        .unwrap();
    assert_eq!(dispatcher.run_once().unwrap(), 4);

    let chunk = |i: usize| outbox.delivery(ids[i]).unwrap().unwrap().chunks.remove(0);
    let nul_id = chunk(0);
    assert_eq!(nul_id.status, ChunkStatus::Delivered);
    assert_eq!(nul_id.platform_message_id.as_deref(), Some("id\u{FFFD}x"));
    let nul_error = chunk(1);
    assert_eq!(nul_error.status, ChunkStatus::Retry);
    assert_eq!(nul_error.last_error.as_deref(), Some("bad\u{FFFD}gateway"));
    assert_eq!(
        chunk(2).status,
        ChunkStatus::Sending,
        "the refused outcome is left to its lease"
    );
    assert_eq!(chunk(3).status, ChunkStatus::Delivered);
    assert_eq!(dispatcher.stats().dropped, 1);
}

/// A direct connection to the schema of `url`.
fn admin(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).unwrap()
}
