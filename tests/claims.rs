//! Claims and outcomes: fencing by token, attempts counted before I/O (poison chunks
//! run out), rate limits that pause the lane without using an attempt, releases,
//! ambiguous sends per replay policy, expired leases reclaimed by ordinary claiming, and
//! concurrent claimers that never share a chunk.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::rules::ChannelPolicy;
use chunked_outbox::{Claim, Error, NewDelivery, OutboxOptions, Outcome, Result};
use common::*;

/// `options` with Telegram replayable and a 10 s lease: an expired claim is sent again.
fn replayable(options: OutboxOptions) -> OutboxOptions {
    options
        .with_channel("telegram", ChannelPolicy::replayable())
        .with_lease(Duration::from_secs(10))
}

fn claim_after(db: &TestDb, wait: Duration) -> chunked_outbox::Claim {
    db.advance(wait);
    claim_one(&db.outbox)
}

stores! {

    fn stale_token_cannot_settle_a_reclaimed_chunk() -> Result<()> {
        let db = TestDb::new(replayable(OutboxOptions::default()));
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["hi"]);
        let slow = claim_one(ob);
        db.advance(Duration::from_secs(11));
        let fresh = claim_one(ob); // reclaims the expired lease
        assert_eq!(fresh.chunk_id, slow.chunk_id);
        assert_eq!(fresh.attempt, 2);

        // The slow worker wakes up: every transition is refused and changes nothing.
        for outcome in [
            Outcome::delivered(Some("late".into())),
            Outcome::Transient { error: "x".into() },
            Outcome::Permanent { error: "x".into() },
            Outcome::Ambiguous { error: "x".into() },
            Outcome::RateLimited {
                retry_after: Duration::from_secs(1),
                error: "x".into(),
            },
        ] {
            let err = ob.record(&slow, outcome).unwrap_err();
            assert!(
                matches!(err, Error::StaleClaim { chunk } if chunk == slow.chunk_id),
                "{err:?}"
            );
        }
        assert!(matches!(ob.release(&slow), Err(Error::StaleClaim { .. })));
        let v = view(ob, id);
        assert_eq!(
            (v.chunks[0].status, v.chunks[0].attempts),
            (ChunkStatus::Sending, 2)
        );

        // The current owner settles it; a second outcome on the same claim is stale too.
        assert!(ob.ack(&fresh, Some("m"))?.finalized);
        assert!(matches!(
            ob.ack(&fresh, None),
            Err(Error::StaleClaim { .. })
        ));
        assert_eq!(db.messages_for(id)?.len(), 1);
        Ok(())
    }

    fn poison_chunk_exhausts_attempts_without_any_outcome() -> Result<()> {
        // The worker "crashes" on every claim: no outcome is ever recorded.
        let db = TestDb::new(replayable(OutboxOptions::default()));
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["boom"]);
        let mut attempts = Vec::new();
        for _ in 0..10 {
            for claim in claim_all(ob) {
                attempts.push(claim.attempt);
            }
            db.advance(Duration::from_secs(11));
        }
        assert_eq!(attempts, [1, 2, 3, 4, 5], "five claims, then no more");
        let v = view(ob, id);
        assert_eq!(v.status, DeliveryStatus::Failed);
        assert_eq!(v.chunks[0].status, ChunkStatus::Failed);
        assert!(
            v.chunks[0]
                .last_error
                .as_deref()
                .unwrap()
                .contains("lease expired")
        );
        Ok(())
    }

    /// Recovery (not only claiming) fails a chunk whose last attempt ended without an
    /// outcome, and says so in its report.
    fn recovery_fails_a_chunk_whose_attempts_ran_out() -> Result<()> {
        let db = TestDb::new(replayable(OutboxOptions::default()));
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["boom"]);
        for attempt in 1..=5 {
            let _crashed = claim_one(ob);
            db.advance(Duration::from_secs(11));
            let r = ob.recover(RecoverScope::ExpiredLeases)?;
            let expected = if attempt < 5 { (1, 0) } else { (0, 1) };
            assert_eq!(
                (r.retried, r.failed, r.held_uncertain),
                (expected.0, expected.1, 0)
            );
        }
        assert_eq!(view(ob, id).status, DeliveryStatus::Failed);
        assert!(claim_all(ob).is_empty());
        Ok(())
    }

    fn transient_failures_exhaust_the_budget() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["x"]);
        let mut statuses = Vec::new();
        for _ in 0..5 {
            let claim = claim_one(ob);
            statuses.push(
                ob.record(
                    &claim,
                    Outcome::Transient {
                        error: "503".into(),
                    },
                )?
                .status,
            );
            db.advance(Duration::from_secs(601));
        }
        assert_eq!(statuses[..4], [ChunkStatus::Retry; 4]);
        assert_eq!(statuses[4], ChunkStatus::Failed);
        assert!(claim_all(ob).is_empty());
        assert_eq!(view(ob, id).chunks[0].attempts, 5);
        Ok(())
    }

    fn rate_limit_pauses_the_lane_without_using_an_attempt() -> Result<()> {
        let db =
            TestDb::new(OutboxOptions::default().with_lane_order(chunked_outbox::rules::LaneOrder::Parallel));
        let ob = &db.outbox;
        let a = enqueue(ob, "busy", &["a"]);
        let b = enqueue(ob, "busy", &["b"]);
        let other = enqueue(ob, "calm", &["c"]);
        let claims = claim_all(ob);
        let ca = claims.iter().find(|c| c.delivery_id == a).unwrap();
        let recorded = ob.record(
            ca,
            Outcome::RateLimited {
                retry_after: Duration::from_secs(30),
                error: "429".into(),
            },
        )?;
        assert_eq!(recorded.status, ChunkStatus::Retry);
        assert_eq!(
            view(ob, a).chunks[0].attempts,
            0,
            "a rate limit gives the attempt back"
        );
        for c in claims.iter().filter(|c| c.delivery_id != a) {
            ob.release(c)?;
        }

        // The whole "busy" lane waits 30 s; the "calm" lane does not.
        db.advance(Duration::from_secs(29));
        let due: Vec<_> = claim_all(ob).iter().map(|c| c.delivery_id).collect();
        assert_eq!(due, [other]);
        db.advance(Duration::from_secs(1));
        let mut due: Vec<_> = claim_all(ob).iter().map(|c| c.delivery_id).collect();
        due.sort();
        let mut want = vec![a, b];
        want.sort();
        assert_eq!(due, want);
        Ok(())
    }

    fn enqueue_into_a_paused_lane_waits_for_the_pause() -> Result<()> {
        let db =
            TestDb::new(OutboxOptions::default().with_lane_order(chunked_outbox::rules::LaneOrder::Parallel));
        let ob = &db.outbox;
        enqueue(ob, "c", &["a"]);
        let claim = claim_one(ob);
        ob.record(
            &claim,
            Outcome::RateLimited {
                retry_after: Duration::from_secs(10),
                error: "slow down".into(),
            },
        )?;
        enqueue(ob, "c", &["b"]);
        assert!(claim_all(ob).is_empty());
        db.advance(Duration::from_secs(10));
        assert_eq!(claim_all(ob).len(), 2);
        Ok(())
    }

    /// A chunk whose lease ran out while its lane was paused is not sent again before the
    /// pause ends: the lease expiry alone does not make it due.
    fn an_expired_lease_in_a_paused_lane_waits_for_the_pause() -> Result<()> {
        let db = TestDb::new(replayable(
            OutboxOptions::default().with_lane_order(chunked_outbox::rules::LaneOrder::Parallel),
        ));
        let ob = &db.outbox;
        let slow = enqueue(ob, "c", &["a"]);
        let limited = enqueue(ob, "c", &["b"]);
        let claims = claim_all(ob);
        let cb = claims.iter().find(|c| c.delivery_id == limited).unwrap();
        ob.record(
            cb,
            Outcome::RateLimited {
                retry_after: Duration::from_secs(60),
                error: "429".into(),
            },
        )?;
        db.advance(Duration::from_secs(11));
        assert!(claim_all(ob).is_empty(), "the lane is paused for 60 s");
        db.advance(Duration::from_secs(49));
        let mut due: Vec<_> = claim_all(ob).iter().map(|c| c.delivery_id).collect();
        assert_eq!(due, [slow], "the chunk whose lease ran out is sent alone");
        due.extend(claim_all(ob).iter().map(|c| c.delivery_id));
        assert_eq!(due, [slow, limited]);
        Ok(())
    }

    fn release_refunds_the_attempt_and_keeps_the_chunk_due() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["x"]);
        let claim = claim_one(ob);
        let recorded = ob.release(&claim)?;
        assert_eq!(recorded.status, ChunkStatus::Pending);
        let again = claim_one(ob);
        assert_eq!(again.attempt, 1);
        assert_ne!(again, claim, "a new claim carries a new token");
        assert_eq!(view(ob, id).chunks[0].attempts, 1);
        Ok(())
    }

    /// A dead letter is finished (its delivery has a finish time); a chunk held
    /// `uncertain` is not: its delivery may still go on.
    fn a_dead_letter_is_finished_and_a_held_delivery_is_not() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let dead = enqueue(ob, "gone", &["x"]);
        let held = enqueue(ob, "unsure", &["y"]);
        for c in claim_all(ob) {
            let outcome = if c.delivery_id == dead {
                Outcome::Permanent {
                    error: "chat not found".into(),
                }
            } else {
                Outcome::Ambiguous {
                    error: "timeout".into(),
                }
            };
            ob.record(&c, outcome)?;
        }
        let (d, h) = (view(ob, dead), view(ob, held));
        assert_eq!(
            (d.status, d.finished_at.is_some()),
            (DeliveryStatus::Failed, true)
        );
        assert_eq!(
            (h.status, h.finished_at.is_some()),
            (DeliveryStatus::Uncertain, false)
        );
        Ok(())
    }

    fn ambiguous_outcome_follows_the_replay_policy() -> Result<()> {
        let options = OutboxOptions::default().with_channel("matrix", ChannelPolicy::replayable());
        let db = TestDb::new(options);
        let ob = &db.outbox;
        let held = enqueue(ob, "t", &["x"]);
        let replayed = ob.enqueue(&NewDelivery::single("matrix", "!room", "y"))?.id;
        for claim in claim_all(ob) {
            ob.record(
                &claim,
                Outcome::Ambiguous {
                    error: "timeout after write".into(),
                },
            )?;
        }
        assert_eq!(view(ob, held).chunks[0].status, ChunkStatus::Uncertain);
        assert_eq!(view(ob, held).status, DeliveryStatus::Uncertain);
        assert_eq!(view(ob, replayed).chunks[0].status, ChunkStatus::Retry);
        db.advance(Duration::from_secs(5));
        let claim = claim_one(ob);
        assert_eq!(claim.delivery_id, replayed);
        assert_eq!(
            claim.idempotency_key,
            format!("{replayed}:1"),
            "the replay carries the same key"
        );
        assert_eq!(ob.health()?.totals.uncertain_chunks, 1);
        Ok(())
    }

    fn expired_lease_on_a_hold_channel_becomes_uncertain_during_claiming() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lease(Duration::from_secs(10)));
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["x"]);
        let lost = claim_one(ob);
        assert_eq!(ob.health()?.totals.expired_leases, 0);
        db.advance(Duration::from_secs(10));
        assert_eq!(ob.health()?.totals.expired_leases, 1);
        assert!(claim_all(ob).is_empty(), "not replayed blindly");
        let v = view(ob, id);
        assert_eq!(v.chunks[0].status, ChunkStatus::Uncertain);
        assert_eq!(
            v.chunks[0].claimant,
            Some(ob.claimant()),
            "still names its claim"
        );
        // The worker was only slow: nobody else took the chunk, so its ack still counts.
        assert!(ob.ack(&lost, None)?.finalized);
        assert!(matches!(ob.ack(&lost, None), Err(Error::StaleClaim { .. })));
        Ok(())
    }

    fn recover_defers_to_live_leases_unless_told_otherwise() -> Result<()> {
        let options = OutboxOptions::default().with_channel("telegram", ChannelPolicy::replayable());
        let db = TestDb::new(options);
        let ob = &db.outbox;
        enqueue(ob, "1", &["x"]);
        let live = claim_one(ob);
        assert_eq!(ob.recover(RecoverScope::ExpiredLeases)?.retried, 0);
        ob.ack(&live, None)?;
        enqueue(ob, "2", &["y"]);
        let _orphan = claim_one(ob);
        assert_eq!(ob.recover(RecoverScope::AllSending)?.retried, 1);
        Ok(())
    }

    fn claim_limits_and_channel_filter() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        assert!(matches!(ob.claim(0), Err(Error::InvalidInput { .. })));
        assert!(matches!(
            ob.claim(usize::MAX),
            Err(Error::InvalidInput { .. })
        ));
        let max = chunked_outbox::limits::MAX_CLAIM_BATCH;
        assert!(matches!(ob.claim(max + 1), Err(Error::InvalidInput { .. })));
        assert!(ob.claim(max)?.is_empty(), "the limit itself is allowed");
        assert!(matches!(
            ob.claim_channels(&[], 1),
            Err(Error::InvalidInput { .. })
        ));
        enqueue(ob, "1", &["x"]);
        ob.enqueue(&NewDelivery::single("slack", "C1", "y"))?;
        assert!(ob.claim_channels(&["discord"], 10)?.is_empty());
        let slack = ob.claim_channels(&["slack", "line"], 10)?;
        assert_eq!(slack.len(), 1);
        assert_eq!(slack[0].channel, "slack");
        assert_eq!(ob.health()?.channels["telegram"].due_chunks, 1);
        Ok(())
    }

    fn eight_threads_never_receive_the_same_chunk() -> Result<()> {
        let db =
            TestDb::new(OutboxOptions::default().with_lane_order(chunked_outbox::rules::LaneOrder::Parallel));
        let total = 2_000;
        for i in 0..total {
            enqueue(&db.outbox, &format!("chat-{}", i % 50), &["x"]);
        }
        let barrier = Arc::new(Barrier::new(8));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                // Half the threads share the handle, half open their own connections.
                let ob = if t % 2 == 0 {
                    db.outbox.clone()
                } else {
                    db.reopen(OutboxOptions::default())
                };
                let barrier = barrier.clone();
                std::thread::spawn(move || -> Result<Vec<i64>> {
                    barrier.wait();
                    let mut mine = Vec::new();
                    loop {
                        let claims = ob.claim(7)?;
                        if claims.is_empty() {
                            return Ok(mine);
                        }
                        for c in claims {
                            mine.push(c.chunk_id.get());
                            ob.ack(&c, None)?;
                        }
                    }
                })
            })
            .collect();
        let mut seen = HashSet::new();
        let mut count = 0;
        for h in handles {
            for id in h.join().expect("thread")? {
                count += 1;
                assert!(seen.insert(id), "chunk {id} handed out twice");
            }
        }
        assert_eq!(count, total);
        assert_eq!(
            db.outbox.health()?.totals.delivered_deliveries,
            total as u64
        );
        Ok(())
    }

    fn record_batch_settles_each_claim_and_refuses_only_stale_ones() -> Result<()> {
        let db =
            TestDb::new(OutboxOptions::default().with_lane_order(chunked_outbox::rules::LaneOrder::Parallel));
        let ob = &db.outbox;
        for chat in ["1", "2", "3"] {
            enqueue(ob, chat, &["x"]);
        }
        let claims = claim_all(ob);
        assert_eq!(claims.len(), 3);
        ob.ack(&claims[1], None)?; // settled already: stale in the batch
        let results = ob.record_batch([
            (&claims[0], Outcome::delivered(None)),
            (&claims[1], Outcome::delivered(None)),
            (
                &claims[2],
                Outcome::Transient {
                    error: "503".into(),
                },
            ),
        ])?;
        assert!(results[0].as_ref().is_ok_and(|r| r.finalized));
        assert!(matches!(results[1], Err(Error::StaleClaim { .. })));
        assert_eq!(
            results[2].as_ref().map(|r| r.status).ok(),
            Some(ChunkStatus::Retry)
        );
        let h = ob.health()?;
        assert_eq!(
            (h.totals.delivered_deliveries, h.totals.retry_chunks),
            (2, 1)
        );
        Ok(())
    }

    /// A worker whose lease ran out while it was still sending (a stalled machine, a slow
    /// platform) used to be refused when it came back, although nobody else had taken the
    /// chunk: the platform had the message, the outbox held it `uncertain`. Its outcome now
    /// settles the chunk — whatever it is — as long as nobody else took the chunk over.
    fn a_late_outcome_settles_a_chunk_held_after_its_lease_ran_out() -> Result<()> {
        let late = |outcome: Outcome| -> Result<(DeliveryStatus, ChunkStatus, usize)> {
            let db = TestDb::new(OutboxOptions::default().with_lease(Duration::from_secs(10)));
            let ob = &db.outbox;
            // Another handle on the file (another process) runs the recovery.
            let other = db.reopen(OutboxOptions::default());
            let id = ob
                .enqueue(&NewDelivery::chunked("telegram", "c", "a b", ["a", "b"]))?
                .id;
            let claim = claim_one(ob);
            db.advance(Duration::from_secs(11));
            assert_eq!(
                other.recover(RecoverScope::ExpiredLeases)?.held_uncertain,
                1
            );
            assert_eq!(view(ob, id).chunks[0].claimant, Some(ob.claimant()));
            ob.record(&claim, outcome)?;
            assert!(
                matches!(ob.ack(&claim, None), Err(Error::StaleClaim { .. })),
                "settled once"
            );
            let v = view(ob, id);
            assert_eq!(v.chunks[0].claimant, None);
            Ok((v.status, v.chunks[0].status, claim_all(ob).len()))
        };
        // Delivered: chunk 1 counts, and chunk 2 is due next (the delivery is back in its
        // lane).
        assert_eq!(
            late(Outcome::delivered(Some("m".into())))?,
            (DeliveryStatus::Partial, ChunkStatus::Delivered, 1)
        );
        // Not sent after all: due again from its lane, after the backoff.
        assert_eq!(
            late(Outcome::Transient {
                error: "502".into()
            })?,
            (DeliveryStatus::Pending, ChunkStatus::Retry, 0)
        );
        // A dead letter.
        assert_eq!(
            late(Outcome::Permanent {
                error: "chat not found".into()
            })?,
            (DeliveryStatus::Failed, ChunkStatus::Failed, 0)
        );
        // Still unknown: stays held, and no longer names a claimant.
        let (d, c, due) = late(Outcome::Ambiguous {
            error: "timeout".into(),
        })?;
        assert_eq!(
            (d, c, due),
            (DeliveryStatus::Uncertain, ChunkStatus::Uncertain, 0)
        );
        Ok(())
    }

    /// The same for a chunk given back unsent after its lease ran out: it was never sent,
    /// so it goes back to its lane, attempt refunded, instead of staying `uncertain`.
    fn a_late_release_sends_a_held_chunk_again() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lease(Duration::from_secs(10)));
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["x"]);
        let claim = claim_one(ob);
        db.advance(Duration::from_secs(11));
        assert!(claim_all(ob).is_empty(), "held, not replayed");
        ob.release(&claim)?;
        let again = claim_one(ob);
        assert_eq!((again.chunk_id, again.attempt), (claim.chunk_id, 1));
        assert!(ob.ack(&again, None)?.finalized);
        assert_eq!(view(ob, id).status, DeliveryStatus::Delivered);
        Ok(())
    }

    /// On a channel that may replay, an expired lease puts the chunk back to `retry` still
    /// naming its claim: the late worker's ack counts until someone claims it again.
    fn a_late_ack_counts_until_a_replayable_chunk_is_claimed_again() -> Result<()> {
        let db = TestDb::new(replayable(OutboxOptions::default()));
        let ob = &db.outbox;
        let first = enqueue(ob, "1", &["x"]);
        let claim = claim_one(ob);
        db.advance(Duration::from_secs(11));
        assert_eq!(ob.recover(RecoverScope::ExpiredLeases)?.retried, 1);
        assert_eq!(view(ob, first).chunks[0].status, ChunkStatus::Retry);
        assert!(ob.ack(&claim, None)?.finalized, "nobody took it over yet");
        assert!(claim_all(ob).is_empty(), "and it is not sent again");

        let second = enqueue(ob, "2", &["y"]);
        let slow = claim_one(ob);
        db.advance(Duration::from_secs(11));
        let fresh = claim_one(ob); // claimed again: the slow one is out
        assert!(matches!(ob.ack(&slow, None), Err(Error::StaleClaim { .. })));
        assert!(ob.ack(&fresh, None)?.finalized);
        assert_eq!(view(ob, second).status, DeliveryStatus::Delivered);
        Ok(())
    }

    /// `RetryPolicy::max_age`: a delivery older than it is failed instead of retried, both
    /// when an outcome asks for a retry and when a due chunk is claimed.
    fn deliveries_older_than_the_maximum_age_are_failed_not_retried() -> Result<()> {
        let retry = chunked_outbox::rules::RetryPolicy::default()
            .with_max_age(Some(Duration::from_secs(3600)))
            .with_max_attempts(100);
        let db = TestDb::new(OutboxOptions::default().with_retry(retry));
        let ob = &db.outbox;
        let young = enqueue(ob, "young", &["x"]);
        let old = enqueue(ob, "old", &["y"]);
        let transient = || Outcome::Transient {
            error: "503".into(),
        };
        // Within the age: retried.
        db.advance(Duration::from_secs(1800));
        for c in claim_all(ob) {
            assert_eq!(ob.record(&c, transient())?.status, ChunkStatus::Retry);
        }
        // Past it, at the outcome: failed, with the reason.
        db.advance(Duration::from_secs(1801));
        let c = claim_all(ob).into_iter().find(|c| c.delivery_id == young);
        assert!(
            c.is_none(),
            "a due chunk past the age is failed at the claim"
        );
        let v = view(ob, young);
        assert_eq!(v.status, DeliveryStatus::Failed);
        assert!(
            v.chunks[0]
                .last_error
                .as_deref()
                .unwrap()
                .contains("maximum age")
        );
        assert_eq!(view(ob, old).status, DeliveryStatus::Failed);

        // A reply enqueued later is still served, and one failing past its age at the
        // outcome is failed there.
        let late = enqueue(ob, "late", &["z"]);
        let c = claim_one(ob);
        db.advance(Duration::from_secs(3601));
        assert_eq!(ob.record(&c, transient())?.status, ChunkStatus::Failed);
        let v = view(ob, late);
        assert!(
            v.chunks[0]
                .last_error
                .as_deref()
                .unwrap()
                .contains("maximum age"),
            "{v:?}"
        );
        Ok(())
    }

    /// Error texts are kept up to `MAX_ERROR_BYTES`, cut at a character boundary; platform
    /// ids up to `MAX_PLATFORM_ID_BYTES` — and an ack with a longer id is kept, not refused.
    fn long_error_texts_and_platform_ids_are_cut_at_a_character_boundary() -> Result<()> {
        use chunked_outbox::limits::{MAX_ERROR_BYTES, MAX_PLATFORM_ID_BYTES};
        let db = TestDb::default();
        let ob = &db.outbox;
        // An odd prefix puts a two-byte character across the limit.
        let error = format!("x{}", "é".repeat(MAX_ERROR_BYTES));
        let exact = "y".repeat(MAX_ERROR_BYTES);
        for (text, kept) in [
            (error.as_str(), &error[..MAX_ERROR_BYTES - 1]),
            (exact.as_str(), exact.as_str()),
            ("short", "short"),
        ] {
            let id = enqueue(ob, &format!("e{}", text.len()), &["x"]);
            let c = claim_one(ob);
            ob.record(
                &c,
                Outcome::Transient {
                    error: text.to_owned(),
                },
            )?;
            assert_eq!(view(ob, id).chunks[0].last_error.as_deref(), Some(kept));
        }
        let long_id = format!("z{}", "ü".repeat(MAX_PLATFORM_ID_BYTES));
        let id = enqueue(ob, "p", &["x"]);
        let c = claim_all(ob)
            .into_iter()
            .find(|c| c.delivery_id == id)
            .unwrap();
        assert!(ob.ack(&c, Some(&long_id))?.finalized, "the ack is kept");
        let stored = view(ob, id).chunks[0].platform_message_id.clone().unwrap();
        assert_eq!(stored, long_id[..MAX_PLATFORM_ID_BYTES - 1]);
        Ok(())
    }

    /// A rate limit's wait is capped, so a garbled "retry after 9999999999999" pauses the
    /// chat for an hour, not for ages.
    fn a_rate_limit_pauses_for_at_most_the_cap() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        enqueue(ob, "1", &["a"]);
        let claim = claim_one(ob);
        let recorded = ob.record(
            &claim,
            Outcome::from_error_text("Too Many Requests: retry after 9999999999999"),
        )?;
        assert_eq!(
            recorded.next_attempt_at.map(|t| t.timestamp_millis()),
            Some(db.now_ms() + chunked_outbox::limits::MAX_RETRY_AFTER.as_millis() as i64)
        );
        let recorded = ob.record(
            &claim_after(&db, chunked_outbox::limits::MAX_RETRY_AFTER),
            Outcome::RateLimited {
                retry_after: Duration::MAX,
                error: "429".into(),
            },
        )?;
        assert_eq!(
            recorded.next_attempt_at.map(|t| t.timestamp_millis()),
            Some(db.now_ms() + chunked_outbox::limits::MAX_RETRY_AFTER.as_millis() as i64),
            "the typed outcome is capped the same way"
        );
        Ok(())
    }

    /// Rate limits give the attempt back only so many times: a chunk the platform refuses
    /// as "rate limited" forever becomes a dead letter instead of blocking its chat.
    fn refunds_are_capped_so_no_chunk_is_rate_limited_forever() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["refused forever"]);
        let max_attempts = ob.rules()?.retry.max_attempts;
        let limited = || Outcome::RateLimited {
            retry_after: Duration::from_secs(1),
            error: "429".into(),
        };
        for _ in 0..chunked_outbox::limits::MAX_REFUNDED_RATE_LIMITS {
            let claim = claim_after(&db, Duration::from_secs(1));
            ob.record(&claim, limited())?;
        }
        assert_eq!(view(ob, id).chunks[0].attempts, 0, "all refunded so far");
        for used in 1..max_attempts {
            let claim = claim_after(&db, Duration::from_secs(1));
            assert_eq!(ob.record(&claim, limited())?.status, ChunkStatus::Retry);
            assert_eq!(
                view(ob, id).chunks[0].attempts,
                used,
                "each one uses an attempt now"
            );
        }
        let claim = claim_after(&db, Duration::from_secs(1));
        assert_eq!(ob.record(&claim, limited())?.status, ChunkStatus::Failed);
        let v = view(ob, id);
        assert_eq!(v.status, chunked_outbox::monitoring::DeliveryStatus::Failed);
        let error = v.chunks[0].last_error.clone().unwrap();
        let times = chunked_outbox::limits::MAX_REFUNDED_RATE_LIMITS + max_attempts;
        assert!(
            error.contains(&format!("rate limited {times} times")),
            "{error}"
        );

        // A requeue gives a fresh budget, refunds included.
        ob.requeue_delivery(id)?;
        let claim = claim_after(&db, Duration::from_secs(1));
        ob.record(&claim, limited())?;
        assert_eq!(view(ob, id).chunks[0].attempts, 0);
        Ok(())
    }

    /// A claim built for an adapter's unit test holds no chunk: recording it changes
    /// nothing and says so.
    fn a_test_claim_cannot_settle_anything() -> Result<()> {
        let db = TestDb::default();
        let id = enqueue(&db.outbox, "42", &["hello"]);
        let claim = chunked_outbox::Claim::for_testing("telegram", "42", "hello");
        let err = db.outbox.ack(&claim, None).unwrap_err();
        assert!(matches!(err, Error::StaleClaim { .. }), "{err:?}");
        assert_eq!(view(&db.outbox, id).chunks[0].status, ChunkStatus::Pending);
        let debug = format!("{claim:?}");
        assert!(
            debug.contains("<5 bytes>") && !debug.contains("token"),
            "{debug}"
        );
        Ok(())
    }

    /// Item 8 of the review: a chunk whose lease ran out may be what crashed its process,
    /// so a claim hands it out alone (first in due order), stops before one that comes
    /// after other chunks, and the chunk is an ordinary one again once an outcome of it
    /// was recorded.
    fn a_chunk_whose_lease_ran_out_is_claimed_alone() -> Result<()> {
        let db = TestDb::new(replayable(OutboxOptions::default()));
        let ob = &db.outbox;
        let first = enqueue(ob, "a", &["x"]);
        let second = enqueue(ob, "b", &["y"]);
        let abandoned = claim_all(ob); // the process dies with both in flight
        assert_eq!(abandoned.len(), 2);
        let third = enqueue(ob, "c", &["z"]);
        db.advance(Duration::from_secs(61));
        let ids = |claims: &[Claim]| claims.iter().map(|c| c.delivery_id).collect::<Vec<_>>();
        let due_first = claim_all(ob);
        assert_eq!(ids(&due_first), [third], "the claim stops before a suspect");
        ob.record(&due_first[0], Outcome::delivered(None))?;
        let alone = claim_all(ob);
        assert_eq!(ids(&alone), [first], "a suspect goes alone");
        let next = claim_all(ob);
        assert_eq!(ids(&next), [second], "and so does the next one");
        // Recovery puts such a chunk back to retry; it is still a suspect.
        ob.record(
            &alone[0],
            Outcome::Transient {
                error: "503".into(),
            },
        )?;
        ob.recover(RecoverScope::AllSending)?;
        db.advance(Duration::from_secs(30));
        let after = claim_all(ob);
        assert_eq!(after.len(), 1, "{after:?}");
        assert_eq!(after[0].chat_id, "b", "the recovered suspect, alone");
        // Its outcome recorded, nothing is suspect: the rest goes together.
        ob.record(
            &after[0],
            Outcome::Transient {
                error: "503".into(),
            },
        )?;
        db.advance(Duration::from_secs(3600)); // past both backoffs
        assert_eq!(claim_all(ob).len(), 2);
        Ok(())
    }
}
