//! Ordering: chunk k+1 is never handed out before chunk k is delivered (even while k
//! waits in backoff), a FIFO lane keeps deliveries in enqueue order, the lane failure
//! policies behave as documented, and parallel lanes only order chunks.

mod common;

use std::time::Duration;

use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::rules::{ChannelPolicy, LaneFailurePolicy, LaneOrder};
use chunked_outbox::{Claim, DeliveryId, NewDelivery, OutboxOptions, Outcome, Result};
use common::*;

/// Each delivery's status, chunks delivered, and each chunk's status and whether it is
/// due (or leased), in enqueue order.
type Rows = Vec<(DeliveryStatus, u32, Vec<(ChunkStatus, bool, bool)>)>;

fn rows(db: &TestDb, ids: &[DeliveryId]) -> Rows {
    ids.iter()
        .map(|id| {
            let v = view(&db.outbox, *id);
            let chunks = v
                .chunks
                .iter()
                .map(|c| {
                    (
                        c.status,
                        c.next_attempt_at.is_some(),
                        c.lease_until.is_some(),
                    )
                })
                .collect();
            (v.status, v.delivered_count, chunks)
        })
        .collect()
}

/// The claims of a round as (place in enqueue order, chunk index), sorted.
fn places(ids: &[DeliveryId], claims: &[Claim]) -> Vec<(usize, u32)> {
    let mut places: Vec<(usize, u32)> = claims
        .iter()
        .map(|c| {
            (
                ids.iter().position(|id| *id == c.delivery_id).unwrap(),
                c.index,
            )
        })
        .collect();
    places.sort_unstable();
    places
}

stores! {

    fn batched_writes_leave_the_rows_one_at_a_time_writes_leave() -> Result<()> {
        // One script on two outboxes: one enqueues and records in batches (which the
        // stores may write set by set), the other one reply and one outcome at a time.
        let (batched, single) = (TestDb::default(), TestDb::default());
        let replies: Vec<NewDelivery> = (0..30)
            .map(|i| {
                let chat = format!("c{}", i % 6);
                if i % 7 == 3 {
                    NewDelivery::chunked("telegram", chat, format!("r{i}"), [format!("r{i} a"), format!("r{i} b")])
                } else {
                    NewDelivery::single("telegram", chat, format!("r{i}"))
                }
            })
            .collect();
        let (first, rest) = replies.split_at(4);
        // A first batch, then more replies into the same lanes.
        let mut batched_ids: Vec<DeliveryId> =
            batched.outbox.enqueue_batch(first)?.iter().map(|e| e.id).collect();
        batched_ids.extend(batched.outbox.enqueue_batch(rest)?.iter().map(|e| e.id));
        let single_ids: Vec<DeliveryId> = replies
            .iter()
            .map(|r| Ok(single.outbox.enqueue(r)?.id))
            .collect::<Result<_>>()?;
        assert_eq!(rows(&batched, &batched_ids), rows(&single, &single_ids));
        let mut rounds = 0;
        loop {
            let (b, s) = (claim_all(&batched.outbox), claim_all(&single.outbox));
            assert_eq!(places(&batched_ids, &b), places(&single_ids, &s), "round {rounds}");
            if b.is_empty() {
                break;
            }
            let recorded = batched.outbox.record_batch(b.iter().map(|c| (c, Outcome::delivered(None))))?;
            let finalized_b: usize = recorded.into_iter().map(|r| Ok(usize::from(r?.finalized))).sum::<Result<_>>()?;
            let mut finalized_s = 0;
            for c in &s {
                finalized_s += usize::from(single.outbox.record(c, Outcome::delivered(None))?.finalized);
            }
            assert_eq!(finalized_b, finalized_s, "round {rounds}");
            assert_eq!(rows(&batched, &batched_ids), rows(&single, &single_ids), "round {rounds}");
            rounds += 1;
        }
        // Six chats of five replies, a send of each chat a round; four chats have a
        // reply in two chunks.
        assert_eq!(rounds, 6);
        let (hb, hs) = (batched.outbox.health()?.totals, single.outbox.health()?.totals);
        assert_eq!(hb.delivered_deliveries, 30);
        assert_eq!(hb, hs);
        Ok(())
    }

    fn chunk_in_backoff_blocks_the_next_chunk() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["a", "b", "c"]);
        let c0 = claim_one(ob);
        assert_eq!(c0.index, 0);
        ob.record(
            &c0,
            Outcome::Transient {
                error: "timeout".into(),
            },
        )?;

        // While chunk 0 waits 5 s, nothing else of the delivery is claimable.
        for _ in 0..4 {
            assert!(claim_all(ob).is_empty());
            db.advance(Duration::from_secs(1));
        }
        db.advance(Duration::from_secs(1));
        let c0 = claim_one(ob);
        assert_eq!(c0.index, 0, "the retried chunk comes before its successors");
        ob.ack(&c0, None)?;
        let c1 = claim_one(ob);
        assert_eq!(c1.index, 1);
        assert_eq!(
            view(ob, id).chunks[2].next_attempt_at,
            None,
            "chunk 2 is not due yet"
        );
        Ok(())
    }

    fn lane_is_fifo_across_deliveries_and_other_lanes_flow() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let first = enqueue(ob, "chat-a", &["a1", "a2"]);
        let second = enqueue(ob, "chat-a", &["b1"]);
        let other = enqueue(ob, "chat-b", &["x1"]);
        assert_eq!(view(ob, second).status, DeliveryStatus::Queued);

        // Only the lane heads are due: first's chunk 0, and chat-b's delivery.
        let claims = claim_all(ob);
        let mut got: Vec<_> = claims.iter().map(|c| (c.delivery_id, c.index)).collect();
        got.sort();
        let mut want = vec![(first, 0), (other, 0)];
        want.sort();
        assert_eq!(got, want);

        // first fails transiently: chat-a stays blocked behind it.
        let a = claims.iter().find(|c| c.delivery_id == first).unwrap();
        let b = claims.iter().find(|c| c.delivery_id == other).unwrap();
        ob.record(
            a,
            Outcome::Transient {
                error: "503".into(),
            },
        )?;
        ob.ack(b, None)?;
        db.advance(Duration::from_secs(60));

        let mut order = Vec::new();
        while let Some(c) = claim_all(ob).pop() {
            order.push((c.delivery_id, c.index));
            ob.ack(&c, None)?;
        }
        assert_eq!(order, [(first, 0), (first, 1), (second, 0)]);
        Ok(())
    }

    fn skip_policy_lets_the_lane_continue_past_a_dead_letter() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let doomed = enqueue(ob, "c", &["x"]);
        let next = enqueue(ob, "c", &["y"]);
        let claim = claim_one(ob);
        ob.record(
            &claim,
            Outcome::Permanent {
                error: "message is too long".into(),
            },
        )?;
        let claim = claim_one(ob);
        assert_eq!(claim.delivery_id, next);
        ob.ack(&claim, None)?;
        assert_eq!(view(ob, doomed).status, DeliveryStatus::Failed);

        // Requeued later, the dead letter goes out once the lane is idle.
        ob.requeue_delivery(doomed)?;
        let claim = claim_one(ob);
        assert_eq!((claim.delivery_id, claim.attempt), (doomed, 1));
        Ok(())
    }

    fn block_policy_holds_the_lane_until_acknowledged_or_requeued() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lane_failure(LaneFailurePolicy::Block));
        let ob = &db.outbox;
        let doomed = enqueue(ob, "c", &["x"]);
        let waiting = enqueue(ob, "c", &["y"]);
        let claim = claim_one(ob);
        ob.record(
            &claim,
            Outcome::Permanent {
                error: "chat not found".into(),
            },
        )?;
        assert!(
            claim_all(ob).is_empty(),
            "the lane waits behind its dead letter"
        );
        assert_eq!(view(ob, waiting).status, DeliveryStatus::Queued);

        // Requeue: the same delivery goes first again.
        ob.requeue_delivery(doomed)?;
        let claim = claim_one(ob);
        assert_eq!(claim.delivery_id, doomed);
        ob.record(
            &claim,
            Outcome::Permanent {
                error: "chat not found".into(),
            },
        )?;
        assert!(claim_all(ob).is_empty());

        // Acknowledge: the operator has seen it; the lane moves on.
        assert_eq!(ob.dismiss_dead_letters(None)?, 1);
        let claim = claim_one(ob);
        assert_eq!(claim.delivery_id, waiting);
        Ok(())
    }

    fn block_policy_also_waits_for_an_uncertain_head() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lane_failure(LaneFailurePolicy::Block));
        let ob = &db.outbox;
        let held = enqueue(ob, "c", &["x", "y"]);
        let waiting = enqueue(ob, "c", &["z"]);
        let claim = claim_one(ob);
        ob.record(
            &claim,
            Outcome::Ambiguous {
                error: "read timeout".into(),
            },
        )?;
        assert!(claim_all(ob).is_empty());

        // Resolved as delivered: the held delivery carries on, then the next one.
        ob.resolve_uncertain(
            claim.chunk_id,
            chunked_outbox::maintenance::Resolution::Delivered {
                platform_message_id: None,
            },
        )?;
        let c = claim_one(ob);
        assert_eq!((c.delivery_id, c.index), (held, 1));
        ob.ack(&c, None)?;
        assert_eq!(claim_one(ob).delivery_id, waiting);
        Ok(())
    }

    fn parallel_lanes_order_chunks_but_not_deliveries() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lane_order(LaneOrder::Parallel));
        let ob = &db.outbox;
        let a = enqueue(ob, "c", &["a1", "a2"]);
        let b = enqueue(ob, "c", &["b1"]);
        let claims = claim_all(ob);
        let mut got: Vec<_> = claims.iter().map(|c| (c.delivery_id, c.index)).collect();
        got.sort();
        let mut want = vec![(a, 0), (b, 0)];
        want.sort();
        assert_eq!(
            got, want,
            "both deliveries are active, each with only its head chunk"
        );
        Ok(())
    }

    fn pacing_spaces_sends_within_a_lane() -> Result<()> {
        let options = OutboxOptions::default().with_channel(
            "telegram",
            ChannelPolicy::default().with_lane_interval(Duration::from_secs(1)),
        );
        let db = TestDb::new(options);
        let ob = &db.outbox;
        enqueue(ob, "c", &["a", "b"]);
        enqueue(ob, "c", &["c"]);
        let mut sent_at = Vec::new();
        for _ in 0..200 {
            for claim in claim_all(ob) {
                sent_at.push(db.now_ms());
                ob.ack(&claim, None)?;
            }
            db.advance(Duration::from_millis(100));
        }
        assert_eq!(sent_at.len(), 3);
        assert!(
            sent_at.windows(2).all(|w| w[1] - w[0] >= 1_000),
            "sends closer than the interval: {sent_at:?}"
        );
        Ok(())
    }

    /// A delayed reply is not due before its time, whether it is enqueued into an idle
    /// chat or waits behind another reply first; in a FIFO chat the replies after it wait.
    fn a_delayed_reply_starts_no_earlier_than_asked() -> Result<()> {
        let db = TestDb::default();
        let later = chrono::DateTime::from_timestamp_millis(db.now_ms() + 60_000).unwrap();
        let delayed = db
            .outbox
            .enqueue(
                &chunked_outbox::NewDelivery::single("telegram", "a", "in a minute").not_before(later),
            )?
            .id;
        let after = enqueue(&db.outbox, "a", &["after it"]);
        let other = enqueue(&db.outbox, "b", &["another chat, at once"]);
        let claims = claim_all(&db.outbox);
        assert_eq!(
            claims.iter().map(|c| c.delivery_id).collect::<Vec<_>>(),
            vec![other]
        );
        db.outbox.ack(&claims[0], None)?;
        assert_eq!(view(&db.outbox, delayed).not_before, Some(later));
        assert_eq!(
            db.outbox.next_due(None)?.map(|t| t.timestamp_millis()),
            Some(db.now_ms() + 60_000)
        );
        db.advance(std::time::Duration::from_millis(59_999));
        assert!(claim_all(&db.outbox).is_empty(), "not yet");
        db.advance(std::time::Duration::from_millis(1));
        let claim = claim_one(&db.outbox);
        assert_eq!(claim.delivery_id, delayed);
        db.outbox.ack(&claim, None)?;
        assert_eq!(claim_one(&db.outbox).delivery_id, after);

        // Behind another reply: the delay still holds when its turn comes.
        let first = enqueue(&db.outbox, "c", &["first"]);
        let at = chrono::DateTime::from_timestamp_millis(db.now_ms() + 30_000).unwrap();
        let queued = db
            .outbox
            .enqueue(&chunked_outbox::NewDelivery::single("telegram", "c", "later").not_before(at))?
            .id;
        let head = claim_one(&db.outbox);
        assert_eq!(head.delivery_id, first);
        db.outbox.ack(&head, None)?;
        assert!(claim_all(&db.outbox).is_empty(), "its turn, not its time");
        db.advance(std::time::Duration::from_secs(30));
        assert_eq!(claim_one(&db.outbox).delivery_id, queued);
        Ok(())
    }
}
