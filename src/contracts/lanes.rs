//! The lane primitives (`LaneStore`, `Locks` and `StoreTx::enter_lanes`): positions, heads,
//! holds, due times, activation.

use crate::clock::ManualClock;
use crate::ids::{CHUNK_STRIDE, DeliveryId};
use crate::outcome::Outcome;
use crate::reply::NewDelivery;
use crate::status::DeliveryStatus;
use crate::store::{Activation, HeadRow};

use super::{
    Fresh, T0, channel_t, claim_one, enqueue, fresh_at_t0, lane, options, row, view, write,
};

/// Deliveries of one lane get increasing positions in the order they were stored; the
/// head of a lane with an active delivery is that one; row numbers are never reused.
pub(super) fn lane_positions_follow_insert_order(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let ids: Vec<DeliveryId> = (0..3)
        .map(|i| enqueue(&ob, "a", &format!("m{i}")))
        .collect();
    let positions: Vec<i64> = ids
        .iter()
        .map(|id| write(&ob, |tx| tx.waiting(row(&ob, *id))).position)
        .collect();
    assert!(positions.windows(2).all(|p| p[0] < p[1]), "{positions:?}");
    assert_eq!(
        write(&ob, |tx| tx.lane_head(lane("a"))),
        Some(HeadRow::Active)
    );
    assert_eq!(write(&ob, |tx| tx.lane_head(lane("nobody"))), None);
    let next_row = write(&ob, |tx| tx.next_delivery_row());
    assert!(
        next_row > row(&ob, ids[2]),
        "rows are never handed out twice"
    );
}

/// With nothing active, the head is the first queued delivery in lane order, with what
/// activation needs (its head index and delayed start).
pub(super) fn the_head_is_the_first_queued_when_nothing_is_active(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    enqueue(&ob, "a", "first");
    let later = T0 + 60_000;
    let second = ob
        .enqueue(
            &NewDelivery::single("t", "a", "second").not_before(crate::clock::to_datetime(later)),
        )
        .unwrap()
        .id;
    enqueue(&ob, "a", "third");
    let claim = claim_one(&ob);
    // The ack makes the second active; read the head in the same transaction, before.
    let head = write(&ob, |tx| {
        tx.mark_delivered(claim.chunk_id.0, None, T0)?;
        tx.mark_finalized(row(&ob, claim.delivery_id), T0)?;
        tx.lane_head(lane("a"))
    });
    match head {
        Some(HeadRow::Queued(w)) => {
            assert_eq!(w.id, row(&ob, second));
            assert_eq!(w.head_index, 0);
            assert_eq!(w.not_before, Some(later));
        }
        other => panic!("expected the second queued, got {other:?}"),
    }
}

/// A lane is held, at its position, by an uncertain delivery or an unacknowledged dead
/// letter under `Block`, and by an uncertain one whose platform nobody asked yet
/// otherwise; an acknowledged dead letter, or a part whose answer is kept, holds only
/// under `Block`.
pub(super) fn a_lane_is_held_by_uncertain_and_unacknowledged_dead_letters(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let held = |block| write(&ob, |tx| tx.lane_held(lane("a"), block));
    let id = enqueue(&ob, "a", "x");
    assert_eq!((held(true), held(false)), (None, None));
    let claim = claim_one(&ob);
    ob.record(&claim, Outcome::Permanent { error: "no".into() })
        .unwrap();
    let position = write(&ob, |tx| tx.waiting(row(&ob, id))).position;
    assert_eq!(
        (held(true), held(false)),
        (Some(position), None),
        "a dead letter"
    );
    assert_eq!(
        write(&ob, |tx| tx.lane_held(lane("b"), true)),
        None,
        "lanes apart"
    );
    ob.dismiss_dead_letters(None).unwrap();
    assert_eq!(held(true), None);
    let id = enqueue(&ob, "a", "y");
    let claim = claim_one(&ob);
    ob.record(&claim, Outcome::Ambiguous { error: "?".into() })
        .unwrap();
    let position = write(&ob, |tx| tx.waiting(row(&ob, id))).position;
    assert_eq!(
        (held(true), held(false)),
        (Some(position), Some(position)),
        "uncertain, not asked yet"
    );
    let since = ob
        .delivery(id)
        .unwrap()
        .unwrap()
        .updated_at
        .timestamp_millis();
    assert!(write(&ob, |tx| tx.note_settlement(
        claim.chunk_id.0,
        since,
        "asked: ?; answered: ?; held for a person",
        None
    )));
    assert_eq!(
        (held(true), held(false)),
        (Some(position), None),
        "uncertain, answered"
    );
}

/// A lane's due time is the earliest asked for unless a pause or an interval ends
/// later; neither ever moves earlier.
pub(super) fn lane_due_times_wait_for_pauses_and_intervals(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    write(&ob, |tx| {
        assert_eq!(tx.lane_due_time(lane("a"), T0)?, T0, "an unknown lane");
        assert_eq!(tx.pause_lane(lane("a"), T0 + 500)?, T0 + 500);
        assert_eq!(
            tx.pause_lane(lane("a"), T0 + 100)?,
            T0 + 500,
            "never shorter"
        );
        assert_eq!(tx.lane_due_time(lane("a"), T0)?, T0 + 500);
        assert_eq!(tx.lane_due_time(lane("a"), T0 + 900)?, T0 + 900);
        assert_eq!(tx.lane_due_time(lane("b"), T0)?, T0, "lanes apart");
        tx.note_lane_send(lane("b"), T0 + 700)?;
        tx.note_lane_send(lane("b"), T0 + 300)?;
        assert_eq!(tx.lane_due_time(lane("b"), T0)?, T0 + 700, "never earlier");
        Ok(())
    });
}

/// A pause pushes the lane's due chunks to its end, and leaves other lanes' alone.
pub(super) fn a_pause_pushes_the_lanes_due_chunks(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    enqueue(&ob, "a", "x");
    enqueue(&ob, "b", "y");
    write(&ob, |tx| tx.pause_lane(lane("a"), T0 + 5_000));
    let channel = write(&ob, |tx| tx.channel_number("t"));
    let row = channel_t(&ob);
    assert_eq!(row.id, channel);
    let due = write(&ob, |tx| tx.due_chunks(&row, T0, 10));
    assert_eq!(due.len(), 1, "only lane b is due now");
    assert_eq!(write(&ob, |tx| tx.next_due(channel)), Some(T0));
    let later = write(&ob, |tx| tx.due_chunks(&row, T0 + 5_000, 10));
    assert_eq!(later.len(), 2);
    assert_eq!(later[1].due_at, T0 + 5_000);
}

/// Activation makes a queued reply active and its head chunk due through its lane (a
/// queued reply's missing chunk row stored on the way); a later chunk is made due the
/// same way.
pub(super) fn activation_and_later_chunks_are_due_through_the_lane(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let first = ob
        .enqueue(&NewDelivery::chunked("t", "a", "x y", ["x", "y"]))
        .unwrap()
        .id;
    let second = enqueue(&ob, "a", "z");
    let channel = channel_t(&ob);
    write(&ob, |tx| tx.pause_lane(lane("a"), T0 + 500));
    let waiting = write(&ob, |tx| tx.waiting(row(&ob, second)));
    assert_eq!(
        (waiting.id, waiting.head_index, waiting.not_before),
        (row(&ob, second), 0, None)
    );
    write(&ob, |tx| {
        tx.activate(&Activation {
            waiting: waiting.clone(),
            status: DeliveryStatus::Pending,
            lane: lane("a"),
            earliest: T0,
        })
    });
    assert_eq!(view(&ob, second).status, DeliveryStatus::Pending);
    let due: Vec<(i64, i64)> = write(&ob, |tx| tx.due_chunks(&channel, T0 + 500, 10))
        .iter()
        .map(|c| (c.chunk, c.due_at))
        .collect();
    assert!(
        due.contains(&(row(&ob, second) * CHUNK_STRIDE, T0 + 500)),
        "{due:?}"
    );
    // The first reply's second chunk: nothing due until it is made due.
    let later = row(&ob, first) * CHUNK_STRIDE + 1;
    assert!(!due.iter().any(|(c, _)| *c == later));
    write(&ob, |tx| {
        tx.make_due(row(&ob, first), 1, lane("a"), T0 + 600)
    });
    let due = write(&ob, |tx| tx.due_chunks(&channel, T0 + 600, 10));
    assert!(due.iter().any(|c| c.chunk == later && c.due_at == T0 + 600));
    write(&ob, |tx| tx.make_due(row(&ob, first), 1, lane("a"), T0));
    let due = write(&ob, |tx| tx.due_chunks(&channel, T0 + 500, 10));
    assert!(
        due.iter().any(|c| c.chunk == later && c.due_at == T0 + 500),
        "the pause holds"
    );
}

/// A held delivery put back in its lane is queued, unfinished and unacknowledged, and
/// listed with its lane among the queued ones; activated again, it goes on from its
/// first undelivered chunk, `partial`.
pub(super) fn a_held_delivery_is_queued_again(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = ob
        .enqueue(&NewDelivery::chunked("t", "a", "x y", ["x", "y"]))
        .unwrap()
        .id;
    let claim = claim_one(&ob);
    ob.record(&claim, Outcome::delivered(None)).unwrap();
    let claim = claim_one(&ob);
    ob.record(&claim, Outcome::Permanent { error: "no".into() })
        .unwrap();
    ob.dismiss_dead_letters(None).unwrap();
    assert!(write(&ob, |tx| tx.queued_deliveries()).is_empty());
    write(&ob, |tx| tx.set_queued(row(&ob, id)));
    let v = view(&ob, id);
    assert_eq!(v.status, DeliveryStatus::Queued);
    assert_eq!((v.finished_at, v.acknowledged_at), (None, None));
    let queued = write(&ob, |tx| tx.queued_deliveries());
    assert_eq!(queued.len(), 1);
    assert_eq!(
        (
            queued[0].id,
            queued[0].channel.as_str(),
            queued[0].chat_id.as_str()
        ),
        (row(&ob, id), "t", "a")
    );
    let waiting = write(&ob, |tx| tx.waiting(row(&ob, id)));
    assert_eq!(waiting.head_index, 1, "its first undelivered chunk");
    write(&ob, |tx| {
        tx.activate(&Activation {
            waiting: waiting.clone(),
            status: DeliveryStatus::Partial,
            lane: lane("a"),
            earliest: T0,
        })
    });
    assert_eq!(view(&ob, id).status, DeliveryStatus::Partial);
}

/// An enqueue's entry into lanes (`enter_lanes`, `next_delivery_row_in`) reads what the
/// one-at-a-time reads say, replies staged in a lane included, and draws fresh rows in
/// ascending order.
pub(super) fn lanes_are_entered_as_their_reads_say(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    enqueue(&ob, "a", "a1");
    enqueue(&ob, "a", "a2");
    let b1 = enqueue(&ob, "b", "b1");
    let claim = claim_one(&ob);
    ob.record(&claim, Outcome::delivered(None)).unwrap();
    // (a delayed reply: what its activation needs is read with the head)
    let q1 = ob
        .enqueue(
            &NewDelivery::single("t", "q", "q1").not_before(crate::clock::to_datetime(T0 + 5_000)),
        )
        .unwrap()
        .id;
    write(&ob, |tx| {
        tx.pause_lane(lane("b"), T0 + 60_000)?;
        // (a reply put back in its lane: the lane's head is queued)
        tx.set_queued(row(&ob, q1))?;
        let staged = tx.stage(&NewDelivery::single("t", "c", "staged"), T0)?;
        let lanes = [lane("a"), lane("b"), lane("c"), lane("nobody"), lane("q")];
        let before = tx.next_delivery_row()?;
        let (entries, rows) = tx.enter_lanes(&lanes, 3)?;
        let (expected, later) = crate::store::composed::enter_lanes(tx, &lanes, 3)?;
        assert_eq!(entries, expected, "enter_lanes");
        assert_eq!(entries[2].staged_before, staged.is_some());
        assert_eq!(entries[1].free_at, T0 + 60_000, "lane b is paused");
        assert!(
            matches!(entries[0].head, Some(HeadRow::Active)),
            "{entries:?}"
        );
        assert!(
            matches!(&entries[4].head, Some(HeadRow::Queued(w))
                if w.id == row(&ob, q1) && w.not_before == Some(T0 + 5_000)),
            "{entries:?}"
        );
        assert_eq!(entries[3].head, None, "{entries:?}");
        assert!(
            rows[0] >= before && rows[0] > row(&ob, b1),
            "{rows:?} after {before}"
        );
        assert!(rows.windows(2).all(|r| r[0] < r[1]), "{rows:?}");
        assert!(
            later[0] >= rows[0] && later.len() == 3,
            "{later:?} after {rows:?}"
        );
        for l in lanes {
            let (row, staged_before) = tx.next_delivery_row_in(l)?;
            let (_, expected) = crate::store::composed::next_delivery_row_in(tx, l)?;
            assert_eq!(staged_before, expected, "next_delivery_row_in {l:?}");
            assert!(row >= rows[0], "a fresh row");
        }
        Ok(())
    });
}

/// What no other transaction holds, the only writer gets: every lock, and a channel's
/// slot as it stands. Dead letters noted by the work are taken once.
pub(super) fn the_only_writer_holds_every_lock(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    write(&ob, |tx| tx.channel_number("t"));
    let row = channel_t(&ob);
    write(&ob, |tx| {
        tx.lock_rules(false)?;
        tx.lock_key("t", "k")?;
        tx.lock_lanes(&mut [lane("b"), lane("a")])?;
        assert!(tx.try_lock_lane(lane("c"))?);
        assert_eq!(tx.lock_channel_slot(row.clone())?, Some(row.clone()));
        assert!(tx.take_dead_letters().is_empty());
        tx.note_dead_letter(7, "gone");
        tx.note_dead_letter(9, "lost");
        assert_eq!(
            tx.take_dead_letters(),
            [(7, "gone".to_owned()), (9, "lost".to_owned())]
        );
        assert!(tx.take_dead_letters().is_empty(), "taken once");
        Ok(())
    });
    ob.write(|tx, _| tx.lock_rules(true)).unwrap();
}
