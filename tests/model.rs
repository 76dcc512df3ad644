//! Model-based property test: random sequences of enqueue / claim / ack / every kind of
//! failure / release / lease expiry / recover / requeue / resolve / purge run against the
//! real outbox and a small model of what must be true, with the invariants checked
//! after every step:
//!
//! * the delivered chunks of every delivery are exactly the ones the model acked (and
//!   always a prefix: chunk k+1 is never delivered before chunk k);
//! * only the head chunk of a delivery is ever due or leased;
//! * a FIFO lane has at most one active delivery, and a claim never returns a chunk of a
//!   delivery behind an unfinished one in its lane;
//! * a chunk is never handed out while a live (unexpired) claim holds it, and a live
//!   claim is never refused as stale;
//! * a delivery is in `outbound_messages` exactly once iff all its chunks were delivered;
//! * attempts never exceed the budget; health agrees with the rows.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use chunked_outbox::clock::{Clock, ManualClock};
use chunked_outbox::maintenance::{RecoverScope, Resolution};
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus, ListFilter};
use chunked_outbox::rules::{ChannelPolicy, RetryPolicy};
use chunked_outbox::{Claim, DeliveryId, Error, NewDelivery, Outbox, OutboxOptions, Outcome};
use common::{Store, on_store};
use proptest::prelude::*;

const LANES: [(&str, &str); 3] = [("telegram", "a"), ("telegram", "b"), ("matrix", "c")];
const LEASE_MS: i64 = 30_000;
const MAX_ATTEMPTS: u32 = 4;

#[derive(Debug, Clone)]
enum Op {
    Enqueue { lane: usize, chunks: usize },
    Claim { limit: usize },
    Ack { pick: usize },
    Transient { pick: usize },
    Permanent { pick: usize },
    RateLimited { pick: usize, secs: u64 },
    Ambiguous { pick: usize },
    Release { pick: usize },
    Advance { secs: u64 },
    Recover,
    RequeueDeadLetters,
    Resolve { pick: usize, delivered: bool },
    Purge,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..LANES.len(), 1_usize..4).prop_map(|(lane, chunks)| Op::Enqueue { lane, chunks }),
        4 => (1_usize..5).prop_map(|limit| Op::Claim { limit }),
        5 => any::<usize>().prop_map(|pick| Op::Ack { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Transient { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Permanent { pick }),
        1 => (any::<usize>(), 1_u64..60).prop_map(|(pick, secs)| Op::RateLimited { pick, secs }),
        1 => any::<usize>().prop_map(|pick| Op::Ambiguous { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        3 => (0_u64..120).prop_map(|secs| Op::Advance { secs }),
        1 => Just(Op::Recover),
        1 => Just(Op::RequeueDeadLetters),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, delivered)| Op::Resolve { pick, delivered }),
        1 => Just(Op::Purge),
    ]
}

/// What the model knows of one delivery.
struct MDelivery {
    lane: usize,
    chunks: usize,
    delivered: usize,
    purged: bool,
    /// Requeued or resent after failing or being held: by the documented lane policy it
    /// rejoins its lane behind whatever is active, so it may wait behind newer replies.
    requeued: bool,
}

struct World {
    db: common::TestDb,
    clock: ManualClock,
    outbox: Outbox,
    deliveries: Vec<(DeliveryId, MDelivery)>,
    /// Claims the test holds, with the clock time their lease ends.
    held: Vec<Claim>,
    finalized: usize,
}

impl World {
    fn new() -> World {
        let options = OutboxOptions::default()
            .with_lease(Duration::from_millis(LEASE_MS as u64))
            .with_retry(RetryPolicy::default().with_max_attempts(MAX_ATTEMPTS))
            .with_channel("matrix", ChannelPolicy::replayable());
        let db = common::TestDb::new(options);
        World {
            outbox: db.outbox.clone(),
            clock: db.clock.clone(),
            db,
            deliveries: Vec::new(),
            held: Vec::new(),
            finalized: 0,
        }
    }

    fn now(&self) -> i64 {
        self.clock.now_ms()
    }

    fn model(&mut self, id: DeliveryId) -> &mut MDelivery {
        &mut self
            .deliveries
            .iter_mut()
            .find(|(d, _)| *d == id)
            .expect("known delivery")
            .1
    }

    /// Whether the claim's delivery is held `uncertain` (its lease ran out unsettled).
    fn was_held(&self, claim: &Claim) -> bool {
        self.outbox
            .delivery(claim.delivery_id)
            .unwrap()
            .is_some_and(|d| d.status == DeliveryStatus::Uncertain)
    }

    fn take_held(&mut self, pick: usize) -> Option<Claim> {
        (!self.held.is_empty()).then(|| self.held.remove(pick % self.held.len()))
    }

    /// Records an outcome for a held claim. A claim whose lease has not expired must be
    /// accepted; an expired one may have been recovered or re-claimed meanwhile.
    fn settle(&mut self, claim: Claim, outcome: Outcome) {
        let live = self.now() < claim.lease_until.timestamp_millis();
        let acking = matches!(outcome, Outcome::Delivered { .. });
        let held = self.was_held(&claim);
        match self.outbox.record(&claim, outcome) {
            Ok(recorded) => {
                // A late outcome for a chunk held `uncertain` after its lease ran out:
                // its delivery rejoins its lane as a requeue would.
                if held {
                    self.model(claim.delivery_id).requeued = true;
                }
                if acking {
                    let m = self.model(claim.delivery_id);
                    assert_eq!(
                        m.delivered, claim.index as usize,
                        "acked chunk is the next one"
                    );
                    m.delivered += 1;
                    assert_eq!(recorded.finalized, m.delivered == m.chunks);
                    if recorded.finalized {
                        self.finalized += 1;
                    }
                }
            }
            Err(Error::StaleClaim { .. }) => assert!(!live, "a live claim was refused as stale"),
            Err(e) => panic!("unexpected error: {e:?}"),
        }
    }

    fn apply(&mut self, op: &Op) {
        match op.clone() {
            Op::Enqueue { lane, chunks } => {
                let (channel, chat) = LANES[lane];
                let parts: Vec<String> = (0..chunks).map(|i| format!("part {i}")).collect();
                let id = self
                    .outbox
                    .enqueue(&NewDelivery::chunked(channel, chat, parts.join(" "), parts))
                    .unwrap()
                    .id;
                self.deliveries.push((
                    id,
                    MDelivery {
                        lane,
                        chunks,
                        delivered: 0,
                        purged: false,
                        requeued: false,
                    },
                ));
            }
            Op::Claim { limit } => {
                let statuses = self.statuses();
                let claims = self.outbox.claim(limit).unwrap();
                for c in &claims {
                    // Never while a live claim holds the chunk.
                    let now = self.now();
                    assert!(
                        !self
                            .held
                            .iter()
                            .any(|h| h.chunk_id == c.chunk_id
                                && now < h.lease_until.timestamp_millis()),
                        "chunk {} handed out while a live claim holds it",
                        c.chunk_id
                    );
                    self.held.retain(|h| h.chunk_id != c.chunk_id);
                    // Head of its delivery, and nothing unfinished ahead of it in its lane.
                    let m = &self
                        .deliveries
                        .iter()
                        .find(|(d, _)| *d == c.delivery_id)
                        .unwrap()
                        .1;
                    assert_eq!(c.index as usize, m.delivered, "claimed chunk is the head");
                    assert!(c.attempt <= MAX_ATTEMPTS);
                    let lane = m.lane;
                    for (other, om) in &self.deliveries {
                        if *other == c.delivery_id {
                            break;
                        }
                        if om.lane == lane && !om.purged {
                            let s = statuses[other];
                            let settled = matches!(
                                s,
                                DeliveryStatus::Delivered
                                    | DeliveryStatus::Failed
                                    | DeliveryStatus::Uncertain
                            );
                            assert!(
                                settled || (s == DeliveryStatus::Queued && om.requeued),
                                "claimed {} while {other} ahead in its lane is {s}",
                                c.delivery_id
                            );
                        }
                    }
                }
                self.held.extend(claims);
            }
            Op::Ack { pick } => {
                if let Some(c) = self.take_held(pick) {
                    self.settle(c, Outcome::delivered(None));
                }
            }
            Op::Transient { pick } => {
                if let Some(c) = self.take_held(pick) {
                    self.settle(
                        c,
                        Outcome::Transient {
                            error: "503".into(),
                        },
                    );
                }
            }
            Op::Permanent { pick } => {
                if let Some(c) = self.take_held(pick) {
                    self.settle(
                        c,
                        Outcome::Permanent {
                            error: "chat not found".into(),
                        },
                    );
                }
            }
            Op::RateLimited { pick, secs } => {
                if let Some(c) = self.take_held(pick) {
                    self.settle(
                        c,
                        Outcome::RateLimited {
                            retry_after: Duration::from_secs(secs),
                            error: "429".into(),
                        },
                    );
                }
            }
            Op::Ambiguous { pick } => {
                if let Some(c) = self.take_held(pick) {
                    self.settle(
                        c,
                        Outcome::Ambiguous {
                            error: "timeout".into(),
                        },
                    );
                }
            }
            Op::Release { pick } => {
                if let Some(c) = self.take_held(pick) {
                    let live = self.now() < c.lease_until.timestamp_millis();
                    let held = self.was_held(&c);
                    match self.outbox.release(&c) {
                        Ok(_) if held => self.model(c.delivery_id).requeued = true,
                        Ok(_) => {}
                        Err(Error::StaleClaim { .. }) => assert!(!live),
                        Err(e) => panic!("{e:?}"),
                    }
                }
            }
            Op::Advance { secs } => self.clock.advance(Duration::from_secs(secs)),
            Op::Recover => {
                let report = self.outbox.recover(RecoverScope::ExpiredLeases).unwrap();
                assert_eq!(
                    report.finalized, 0,
                    "our own path never leaves a delivery unfinalized"
                );
            }
            Op::RequeueDeadLetters => {
                let statuses = self.statuses();
                let n = self.outbox.requeue_dead_letters(None).unwrap();
                let mut failed = 0;
                for (id, m) in &mut self.deliveries {
                    if statuses.get(id) == Some(&DeliveryStatus::Failed) {
                        m.requeued = true;
                        failed += 1;
                    }
                }
                assert_eq!(n, failed, "every dead letter was requeued");
            }
            Op::Resolve { pick, delivered } => {
                let uncertain: Vec<(DeliveryId, chunked_outbox::ids::ChunkId, u32)> = self
                    .outbox
                    .list(
                        &ListFilter::default()
                            .status(DeliveryStatus::Uncertain)
                            .limit(1000),
                    )
                    .unwrap()
                    .into_iter()
                    .flat_map(|d| {
                        let v = self.outbox.delivery(d.id).unwrap().unwrap();
                        v.chunks
                            .into_iter()
                            .filter(|c| c.status == ChunkStatus::Uncertain)
                            .map(move |c| (d.id, c.id, c.index))
                    })
                    .collect();
                if uncertain.is_empty() {
                    return;
                }
                let (id, chunk, index) = uncertain[pick % uncertain.len()];
                let resolution = if delivered {
                    Resolution::Delivered {
                        platform_message_id: None,
                    }
                } else {
                    Resolution::Resend
                };
                let recorded = self.outbox.resolve_uncertain(chunk, resolution).unwrap();
                let m = self.model(id);
                m.requeued = true;
                if delivered {
                    assert_eq!(m.delivered, index as usize);
                    m.delivered += 1;
                    if recorded.finalized {
                        self.finalized += 1;
                    }
                }
            }
            Op::Purge => {
                let cutoff = chrono::DateTime::from_timestamp_millis(self.now() + 1).unwrap();
                self.outbox.purge(cutoff).unwrap();
                let statuses = self.statuses();
                for (id, m) in &mut self.deliveries {
                    if !statuses.contains_key(id) {
                        m.purged = true;
                    }
                }
            }
        }
    }

    fn statuses(&self) -> HashMap<DeliveryId, DeliveryStatus> {
        self.outbox
            .list(&ListFilter::default().limit(10_000))
            .unwrap()
            .into_iter()
            .map(|d| (d.id, d.status))
            .collect()
    }

    fn check(&self) {
        let mut active_per_lane = [0; LANES.len()];
        let mut stored = 0;
        let mut delivered_stored = 0;
        for (id, m) in &self.deliveries {
            let Some(v) = self.outbox.delivery(*id).unwrap() else {
                assert!(m.purged, "{id} vanished without a purge");
                continue;
            };
            assert!(!m.purged);
            stored += 1;
            let delivered: Vec<bool> = v
                .chunks
                .iter()
                .map(|c| c.status == ChunkStatus::Delivered)
                .collect();
            let expected: Vec<bool> = (0..m.chunks).map(|i| i < m.delivered).collect();
            assert_eq!(
                delivered, expected,
                "delivered chunks of {id} differ from the model"
            );
            let full = m.delivered == m.chunks;
            assert_eq!(
                v.status == DeliveryStatus::Delivered,
                full,
                "{id}: status {} vs model",
                v.status
            );
            if full {
                delivered_stored += 1;
            }
            for c in &v.chunks {
                assert!(c.attempts <= MAX_ATTEMPTS, "attempts over budget");
                let scheduled = c.next_attempt_at.is_some() || c.lease_until.is_some();
                if scheduled {
                    assert_eq!(
                        c.index as usize, m.delivered,
                        "{id}: a non-head chunk is due or leased"
                    );
                }
            }
            if matches!(v.status, DeliveryStatus::Pending | DeliveryStatus::Partial) {
                active_per_lane[m.lane] += 1;
            }
        }
        assert!(
            active_per_lane.iter().all(|n| *n <= 1),
            "more than one active delivery in a lane: {active_per_lane:?}"
        );
        let h = self.outbox.health().unwrap();
        assert_eq!(h.totals.total_deliveries, stored);
        assert_eq!(h.totals.delivered_deliveries, delivered_stored);
    }
}

/// Applies `ops`, checking the invariants after each, then drains everything.
fn run(ops: &[Op]) {
    let mut world = World::new();
    for op in ops {
        world.apply(op);
        world.check();
    }
    // Drain: everything still open finishes, and each delivery is finalized once.
    for _ in 0..50 {
        if world
            .deliveries
            .iter()
            .all(|(_, m)| m.delivered == m.chunks)
        {
            break;
        }
        world.apply(&Op::Advance { secs: 700 });
        world.apply(&Op::Recover);
        world.apply(&Op::RequeueDeadLetters);
        for pick in 0..8 {
            world.apply(&Op::Resolve {
                pick,
                delivered: true,
            });
        }
        world.apply(&Op::Claim { limit: 4 });
        while !world.held.is_empty() {
            world.apply(&Op::Ack { pick: 0 });
        }
        world.check();
    }
    let finished = world
        .deliveries
        .iter()
        .filter(|(_, m)| m.delivered == m.chunks)
        .count();
    assert_eq!(
        finished,
        world.deliveries.len(),
        "everything was delivered in the end"
    );
    assert_eq!(
        world.finalized,
        world.deliveries.len(),
        "each finalized exactly once"
    );
    let rows = world.db.int("SELECT count(*) FROM outbound_messages");
    assert_eq!(
        rows as usize,
        world.deliveries.len(),
        "one outbound_messages row per delivery"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_operation_sequences_keep_the_invariants(ops in proptest::collection::vec(op(), 1..60)) {
        on_store(Store::Sqlite, || run(&ops));
    }
}

#[cfg(feature = "postgres")]
proptest! {
    // Each case is a fresh schema on the server: fewer cases than on SQLite.
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn random_operation_sequences_keep_the_invariants_on_postgres(
        ops in proptest::collection::vec(op(), 1..60)
    ) {
        on_store(Store::Postgres, || run(&ops));
    }
}
