//! The two scenarios of the original outbox design, with its ordering defect fixed:
//! a single chunk's lifecycle through retry, delivery and terminal failure; and a
//! three-chunk delivery interrupted mid-send, recovered, and finalized exactly once.

mod common;

use std::time::Duration;

use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus, Health};
use chunked_outbox::rules::ChannelPolicy;
use chunked_outbox::{OutboxOptions, Outcome, Result};
use common::*;

fn counts(h: &Health) -> (u64, u64, u64, u64, u64, u64) {
    let t = &h.totals;
    (
        t.total_deliveries,
        t.delivered_deliveries,
        t.pending_chunks,
        t.sending_chunks,
        t.retry_chunks,
        t.failed_chunks,
    )
}

stores! {

    fn single_chunk_lifecycle() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;

        // Due at once after enqueue.
        let id = enqueue(ob, "42", &["hello"]);
        assert_eq!(ob.health()?.totals.due_chunks, 1);
        let claim = claim_one(ob);
        assert_eq!(claim.attempt, 1);
        assert_eq!(claim.index, 0);
        assert_eq!(claim.total, 1);

        // A transient failure schedules a retry 5 s out: not due before, due after.
        let recorded = ob.record(
            &claim,
            Outcome::Transient {
                error: "HTTP 502".into(),
            },
        )?;
        assert_eq!(recorded.status, ChunkStatus::Retry);
        assert_eq!(
            recorded.next_attempt_at.unwrap().timestamp_millis(),
            T0 + 5_000
        );
        db.advance(Duration::from_millis(4_999));
        assert!(
            claim_all(ob).is_empty(),
            "retry must not be due before its time"
        );
        assert_eq!(counts(&ob.health()?), (1, 0, 0, 0, 1, 0));
        db.advance(Duration::from_millis(1));
        let claim = claim_one(ob);
        assert_eq!(claim.attempt, 2);
        assert_eq!(counts(&ob.health()?), (1, 0, 0, 1, 0, 0));

        // Delivered: leaves the queue and the pending counts.
        let recorded = ob.ack(&claim, Some("tg-1"))?;
        assert!(recorded.finalized);
        assert!(claim_all(ob).is_empty());
        assert_eq!(counts(&ob.health()?), (1, 1, 0, 0, 0, 0));
        assert_eq!(view(ob, id).status, DeliveryStatus::Delivered);
        assert_eq!(db.messages_for(id)?, ["hello"]);

        // A terminal failure also leaves the queue, as a dead letter.
        let dead = enqueue(ob, "43", &["bye"]);
        let claim = claim_one(ob);
        let recorded = ob.record(
            &claim,
            Outcome::Permanent {
                error: "Bad Request: chat not found".into(),
            },
        )?;
        assert_eq!(recorded.status, ChunkStatus::Failed);
        db.advance(Duration::from_secs(3600));
        assert!(claim_all(ob).is_empty());
        let h = ob.health()?;
        assert_eq!(counts(&h), (2, 1, 0, 0, 0, 1));
        assert_eq!(h.totals.unacknowledged_dead_letters, 1);
        let v = view(ob, dead);
        assert_eq!(v.status, DeliveryStatus::Failed);
        assert_eq!(
            v.chunks[0].last_error.as_deref(),
            Some("Bad Request: chat not found")
        );
        assert!(db.messages_for(dead)?.is_empty());
        Ok(())
    }

    fn three_chunks_interrupted_recovered_and_finalized_once() -> Result<()> {
        let options = OutboxOptions::default()
            .with_channel("telegram", ChannelPolicy::replayable())
            .with_lease(Duration::from_secs(30));
        let db = TestDb::new(options.clone());
        let ob = &db.outbox;
        let id = enqueue(ob, "7", &["one", "two", "three"]);
        let h = ob.health()?;
        assert_eq!(counts(&h), (1, 0, 3, 0, 0, 0));

        // Chunk 0 delivered; chunk 1 becomes the only due chunk.
        let c0 = claim_one(ob);
        assert_eq!(c0.idempotency_key, format!("{id}:1"));
        ob.ack(&c0, Some("m0"))?;
        assert_eq!(counts(&ob.health()?), (1, 0, 2, 0, 0, 0));
        assert_eq!(view(ob, id).status, DeliveryStatus::Partial);

        // Chunk 1 is claimed, then the process "dies": the claim is dropped unrecorded.
        let c1 = claim_one(ob);
        assert_eq!(
            (c1.index, c1.idempotency_key.clone()),
            (1, format!("{id}:2"))
        );
        assert_eq!(counts(&ob.health()?), (1, 0, 1, 1, 0, 0));
        drop(c1);

        // A new process opens the file and recovers at start-up.
        let restarted = db.reopen(options);
        let report = restarted.recover(RecoverScope::AllSending)?;
        assert_eq!(report.retried, 1);
        assert_eq!(counts(&restarted.health()?), (1, 0, 1, 0, 1, 0));

        // Chunks 1 and 2 are then delivered strictly in order, with their stable keys.
        let c1 = claim_one(&restarted);
        assert_eq!((c1.index, c1.attempt), (1, 2));
        assert_eq!(c1.idempotency_key, format!("{id}:2"));
        assert!(!restarted.ack(&c1, Some("m1"))?.finalized);
        let c2 = claim_one(&restarted);
        assert_eq!(
            (c2.index, c2.idempotency_key.clone()),
            (2, format!("{id}:3"))
        );
        assert!(restarted.ack(&c2, Some("m2"))?.finalized);

        assert_eq!(counts(&restarted.health()?), (1, 1, 0, 0, 0, 0));
        let v = view(&restarted, id);
        assert_eq!(v.status, DeliveryStatus::Delivered);
        let platform_ids: Vec<_> = v
            .chunks
            .iter()
            .map(|c| c.platform_message_id.clone().unwrap())
            .collect();
        assert_eq!(platform_ids, ["m0", "m1", "m2"]);
        assert_eq!(db.messages_for(id)?, ["one\n\ntwo\n\nthree"]);

        // Recovery and its finalization sweep have nothing left to do, and finalize nothing twice.
        let again = restarted.recover(RecoverScope::AllSending)?;
        assert_eq!((again.retried, again.finalized), (0, 0));
        assert_eq!(db.messages_for(id)?.len(), 1);
        Ok(())
    }

    fn unsent_rest_of_a_dead_letter_is_not_pending_work() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["a", "b", "c"]);
        let c = claim_one(ob);
        ob.record(
            &c,
            Outcome::Permanent {
                error: "chat not found".into(),
            },
        )?;
        let h = ob.health()?;
        assert_eq!((h.totals.pending_chunks, h.totals.failed_chunks), (0, 1));
        ob.requeue_delivery(id)?;
        assert_eq!(
            ob.health()?.totals.pending_chunks,
            2,
            "requeued, the rest is pending again"
        );
        Ok(())
    }

    /// Health answers the two questions operators ask, each 0 when it should be: "is
    /// anything still moving?" and "is anything waiting for a human?" — even while
    /// replies are held behind an uncertain one, when `pending_chunks` stays above 0.
    fn health_tells_what_moves_and_what_waits_for_a_human() -> chunked_outbox::Result<()> {
        let db = TestDb::new(
            chunked_outbox::OutboxOptions::default()
                .with_lane_failure(chunked_outbox::rules::LaneFailurePolicy::Block),
        );
        let ob = &db.outbox;
        let totals = |ob: &chunked_outbox::Outbox| {
            let t = ob.health().unwrap().totals;
            (t.moving_chunks, t.awaiting_decision, t.pending_chunks)
        };
        assert_eq!(totals(ob), (0, 0, 0), "empty");
        enqueue(ob, "held", &["first"]);
        enqueue(ob, "held", &["behind it"]);
        enqueue(ob, "gone", &["x"]);
        enqueue(ob, "flaky", &["y"]);
        assert_eq!(totals(ob), (3, 0, 4), "three heads due, one reply queued");
        for claim in claim_all(ob) {
            let outcome = match claim.chat_id.as_str() {
                "held" => chunked_outbox::Outcome::Ambiguous {
                    error: "timeout".into(),
                },
                "gone" => chunked_outbox::Outcome::Permanent {
                    error: "chat not found".into(),
                },
                _ => chunked_outbox::Outcome::Transient {
                    error: "502".into(),
                },
            };
            ob.record(&claim, outcome)?;
        }
        // The retry still moves (later); the uncertain head and the dead letter wait for a
        // decision, and the reply behind the held one is pending but not moving.
        assert_eq!(totals(ob), (1, 2, 1));
        db.advance(Duration::from_secs(3600));
        let retry = claim_one(ob);
        ob.ack(&retry, None)?;
        assert_eq!(
            totals(ob),
            (0, 2, 1),
            "nothing moves: all that is left needs a human"
        );
        ob.dismiss_dead_letters(None)?;
        assert_eq!(totals(ob), (0, 1, 1));
        let h = ob.health()?;
        assert_eq!(h.channels["telegram"].awaiting_decision, 1);
        assert!(
            h.to_prometheus()
                .contains("outbox_moving_chunks{channel=\"telegram\"} 0")
        );
        Ok(())
    }

    /// The totals the file keeps only grow: a purge lowers the stored count of delivered
    /// replies, not the count of finalizations nor their latency histogram.
    fn finalizations_and_their_latency_are_counted_for_good() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let slow = enqueue(ob, "1", &["a"]);
        let fast = enqueue(ob, "2", &["b"]);
        let claims = claim_all(ob);
        let (first, second): (Vec<_>, Vec<_>) = claims.iter().partition(|c| c.delivery_id == fast);
        ob.ack(first[0], None)?; // at once
        db.advance(Duration::from_secs(40));
        ob.ack(second[0], None)?; // 40 s after its enqueue
        let l = ob.health()?.totals.reply_latency;
        assert_eq!((l.count, l.sum_ms), (2, 40_000));
        // 1 s, 5 s, 30 s, 2 min, 10 min, 1 h
        assert_eq!(l.buckets, [1, 1, 1, 2, 2, 2]);
        assert_eq!(ob.health()?.totals.finalized_total, 2);

        enqueue(ob, "3", &["kept: the newest delivery"]);
        db.advance(Duration::from_secs(1));
        let cutoff = chrono::DateTime::from_timestamp_millis(db.now_ms()).unwrap();
        assert_eq!(ob.purge(cutoff)?.deliveries, 2);
        assert!(ob.delivery(slow)?.is_none());
        let h = ob.health()?.totals;
        assert_eq!((h.delivered_deliveries, h.finalized_total), (0, 2));
        assert_eq!(h.reply_latency, l);
        Ok(())
    }

    /// One batch of acks across channels counts each finalization on its own channel,
    /// with its own latency.
    fn a_batch_of_acks_counts_each_channel_apart() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        for channel in ["telegram", "discord", "telegram"] {
            let chat = format!("{channel}-{}", ob.health()?.totals.total_deliveries);
            ob.enqueue(&chunked_outbox::NewDelivery::single(channel, chat, "hi"))?;
        }
        db.advance(Duration::from_secs(2));
        let claims = claim_all(ob);
        assert_eq!(claims.len(), 3);
        let recorded = ob.record_batch(claims.iter().map(|c| (c, Outcome::delivered(None))))?;
        assert!(
            recorded
                .iter()
                .all(|r| r.as_ref().is_ok_and(|r| r.finalized))
        );
        let h = ob.health()?;
        let (telegram, discord) = (&h.channels["telegram"], &h.channels["discord"]);
        assert_eq!((telegram.finalized_total, discord.finalized_total), (2, 1));
        assert_eq!(
            (telegram.delivered_deliveries, discord.delivered_deliveries),
            (2, 1)
        );
        assert_eq!(
            (telegram.reply_latency.count, telegram.reply_latency.sum_ms),
            (2, 4_000)
        );
        assert_eq!(discord.reply_latency.buckets, [0, 1, 1, 1, 1, 1]);
        Ok(())
    }
}
