//! Cancel: a reply none of whose chunks has started is withdrawn and its lane moves on;
//! a started reply is finished, and the refusal changes nothing.

mod common;

use std::time::Duration;

use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::rules::LaneOrder;
use chunked_outbox::{DeliveryId, Error, OutboxOptions, Outcome, Result};
use common::*;

/// Asserts that `cancel` refuses with [`Error::CancelTooLate`] naming `status` and
/// `attempts`, and that the delivery is exactly as it was.
fn refused_too_late(db: &TestDb, id: DeliveryId, status: ChunkStatus, attempts: u32) {
    let before = view(&db.outbox, id);
    match db.outbox.cancel(id) {
        Err(Error::CancelTooLate {
            delivery,
            chunk,
            status: s,
            attempts: a,
            index,
        }) => {
            assert_eq!(delivery, id);
            assert_eq!((chunk, index), (before.chunks[0].id, 0));
            assert_eq!((s, a), (status, attempts));
        }
        other => panic!("expected CancelTooLate, got {other:?}"),
    }
    assert_eq!(view(&db.outbox, id), before, "a refusal changes nothing");
}

stores! {

    fn an_unstarted_reply_is_withdrawn_and_its_lane_moves_on() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let stale = enqueue(ob, "1", &["working", "on", "it"]);
        let fresh = enqueue(ob, "1", &["here it is"]);
        assert_eq!(view(ob, fresh).status, DeliveryStatus::Queued);

        db.advance(Duration::from_secs(1));
        ob.cancel(stale)?;
        let cancelled = view(ob, stale);
        assert_eq!(cancelled.status, DeliveryStatus::Cancelled);
        assert!(cancelled.chunks.is_empty(), "its chunks are removed");
        assert_eq!(
            cancelled.text, "working\n\non\n\nit",
            "the delivery keeps its text"
        );
        assert_eq!(
            cancelled.finished_at.map(|t| t.timestamp_millis()),
            Some(db.now_ms())
        );
        assert_eq!(view(ob, fresh).status, DeliveryStatus::Pending);

        let h = ob.health()?.totals;
        assert_eq!(
            (
                h.cancelled_deliveries,
                h.pending_deliveries,
                h.pending_chunks,
                h.moving_chunks,
                h.total_deliveries
            ),
            (1, 1, 1, 1, 2)
        );

        // Only the fresh reply is sent and enters the history.
        let claim = claim_one(ob);
        assert_eq!(
            (claim.delivery_id, claim.text.as_str()),
            (fresh, "here it is")
        );
        assert!(ob.ack(&claim, None)?.finalized);
        assert!(claim_all(ob).is_empty());
        assert!(db.messages_for(stale)?.is_empty());
        assert_eq!(db.messages_for(fresh)?, vec!["here it is".to_owned()]);

        // Cancelling again does nothing.
        ob.cancel(stale)?;
        assert_eq!(view(ob, stale), cancelled);
        assert_eq!(ob.health()?.totals.moving_chunks, 0);
        Ok(())
    }

    fn a_queued_reply_is_cancelled_without_disturbing_the_active_one() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let active = enqueue(ob, "1", &["one", "two"]);
        let queued = enqueue(ob, "1", &["withdrawn"]);
        let last = enqueue(ob, "1", &["three"]);
        let c0 = claim_one(ob);
        assert_eq!(c0.delivery_id, active);

        ob.cancel(queued)?;
        assert_eq!(
            view(ob, last).status,
            DeliveryStatus::Queued,
            "still behind"
        );
        ob.ack(&c0, None)?;
        let c1 = claim_one(ob);
        assert_eq!((c1.delivery_id, c1.index), (active, 1));
        ob.ack(&c1, None)?;
        assert_eq!(claim_one(ob).delivery_id, last, "the lane skipped it");
        Ok(())
    }

    fn a_parallel_lane_reply_is_cancelled_too() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lane_order(LaneOrder::Parallel));
        let ob = &db.outbox;
        let a = enqueue(ob, "1", &["a"]);
        let b = enqueue(ob, "1", &["b"]);
        ob.cancel(a)?;
        let claims = claim_all(ob);
        assert_eq!(
            claims.iter().map(|c| c.delivery_id).collect::<Vec<_>>(),
            vec![b]
        );
        Ok(())
    }

    fn a_started_reply_is_finished_not_cut_short() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["first", "second"]);

        // Being sent.
        let claim = claim_one(ob);
        refused_too_late(&db, id, ChunkStatus::Sending, 1);

        // Failed once: the failed send may have reached the platform.
        ob.record(
            &claim,
            Outcome::Transient {
                error: "502 bad gateway".into(),
            },
        )?;
        refused_too_late(&db, id, ChunkStatus::Retry, 1);

        // Partly delivered.
        db.advance(Duration::from_secs(60));
        let again = claim_one(ob);
        ob.ack(&again, None)?;
        let err = ob.cancel(id).unwrap_err();
        assert!(
            matches!(
                err,
                Error::DeliveryState {
                    status: DeliveryStatus::Partial,
                    action: "cancel",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("is partial; cancel needs a queued or pending"),
            "{err}"
        );
        let rest = claim_one(ob);
        assert!(ob.ack(&rest, None)?.finalized, "it finishes");
        assert!(matches!(
            ob.cancel(id),
            Err(Error::DeliveryState {
                status: DeliveryStatus::Delivered,
                ..
            })
        ));
        Ok(())
    }

    fn uncertain_and_dead_replies_are_not_cancelled() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let held = enqueue(ob, "1", &["maybe sent"]);
        let dead = enqueue(ob, "2", &["refused"]);
        for claim in claim_all(ob) {
            let outcome = if claim.delivery_id == held {
                Outcome::Ambiguous {
                    error: "timeout after write".into(),
                }
            } else {
                Outcome::Permanent {
                    error: "chat not found".into(),
                }
            };
            ob.record(&claim, outcome)?;
        }
        for (id, status) in [
            (held, DeliveryStatus::Uncertain),
            (dead, DeliveryStatus::Failed),
        ] {
            let before = view(ob, id);
            assert!(matches!(
                ob.cancel(id),
                Err(Error::DeliveryState { status: s, .. }) if s == status
            ));
            assert_eq!(view(ob, id), before);
        }
        Ok(())
    }

    fn a_send_given_back_unstarted_or_refused_by_a_rate_limit_has_not_started() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let released = enqueue(ob, "1", &["given back"]);
        let limited = enqueue(ob, "2", &["rate limited"]);
        for claim in claim_all(ob) {
            if claim.delivery_id == released {
                ob.release(&claim)?;
            } else {
                ob.record(
                    &claim,
                    Outcome::RateLimited {
                        retry_after: Duration::from_secs(5),
                        error: "429".into(),
                    },
                )?;
            }
        }
        assert_eq!(view(ob, limited).chunks[0].status, ChunkStatus::Retry);
        ob.cancel(released)?;
        ob.cancel(limited)?;
        db.advance(Duration::from_secs(10));
        assert!(claim_all(ob).is_empty(), "nothing of them is sent");
        Ok(())
    }

    fn unknown_ids_and_requeues_of_a_cancelled_reply_are_refused() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let id = enqueue(ob, "1", &["a"]);
        // A well-formed id this database never handed out.
        let other = TestDb::default();
        let stranger = enqueue(&other.outbox, "1", &["a"]);
        assert!(matches!(ob.cancel(stranger), Err(Error::DeliveryNotFound(d)) if d == stranger));

        ob.cancel(id)?;
        let err = ob.requeue_delivery(id).unwrap_err();
        assert!(
            matches!(
                err,
                Error::DeliveryState {
                    status: DeliveryStatus::Cancelled,
                    action: "requeue",
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(view(ob, id).status, DeliveryStatus::Cancelled);
        Ok(())
    }

    fn purge_removes_cancelled_replies() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let cancelled = enqueue(ob, "1", &["a", "b"]);
        let newest = enqueue(ob, "2", &["kept: the newest delivery"]);
        ob.cancel(cancelled)?;
        db.advance(Duration::from_secs(1));
        let cutoff = chrono::DateTime::from_timestamp_millis(db.now_ms()).unwrap();
        let preview = ob.purge_preview(cutoff)?;
        assert_eq!((preview.deliveries, preview.chunks), (1, 0));
        assert_eq!(ob.purge(cutoff)?, preview);
        assert!(ob.delivery(cancelled)?.is_none());
        assert!(ob.delivery(newest)?.is_some());
        assert_eq!(ob.health()?.totals.cancelled_deliveries, 0);
        Ok(())
    }

    /// A cancelled reply has no chunk rows left, which recovery's sweep for wholly
    /// delivered replies must not read as "all of them delivered": queued or pending when
    /// cancelled, it never enters the history.
    fn recovery_does_not_finalize_a_cancelled_reply() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let pending = enqueue(ob, "1", &["pending"]);
        let queued = enqueue(ob, "1", &["queued"]);
        ob.cancel(queued)?;
        ob.cancel(pending)?;
        let report = ob.recover(chunked_outbox::maintenance::RecoverScope::AllSending)?;
        assert_eq!(report.finalized, 0);
        for id in [pending, queued] {
            assert_eq!(view(ob, id).status, DeliveryStatus::Cancelled);
            assert!(db.messages_for(id)?.is_empty());
        }
        assert_eq!(ob.health()?.totals.finalized_total, 0);
        Ok(())
    }

    /// Found: enqueueing a cancelled reply again with its key (a retried request, a
    /// redelivered webhook) failed with `IdempotencyConflict`, because its chunks are gone;
    /// the key still names it, so the enqueue returns it and writes nothing.
    fn a_cancelled_reply_is_still_named_by_its_key() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let reply = || {
            chunked_outbox::NewDelivery::chunked("telegram", "1", "a b", ["a", "b"])
                .with_idempotency_key("update-7")
        };
        let first = ob.enqueue(&reply())?;
        ob.cancel(first.id)?;
        let again = ob.enqueue(&reply())?;
        assert_eq!((again.id, again.created), (first.id, false));
        assert_eq!(view(ob, first.id).status, DeliveryStatus::Cancelled);
        assert!(claim_all(ob).is_empty(), "nothing to send");
        let other = ob
            .enqueue(
                &chunked_outbox::NewDelivery::single("telegram", "1", "other")
                    .with_idempotency_key("update-7"),
            )
            .unwrap_err();
        assert!(
            matches!(other, Error::IdempotencyConflict { existing, .. } if existing == first.id),
            "{other:?}"
        );
        Ok(())
    }
}
