//! The operator and retention primitives (`OperatorStore`, `RetentionStore`): dead letters,
//! cancels, lookups, settlements, purges.

use crate::clock::ManualClock;
use crate::ids::{CHUNK_STRIDE, DeliveryId};
use crate::outcome::Outcome;
use crate::reply::NewDelivery;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::ChunkProgress;
use std::time::Duration;

use super::{
    Fresh, T0, channel_t, claim_one, enqueue, fresh_at_t0, lane, options, row, view, write,
};

/// Dead letters are listed oldest first, per channel or all, until requeued; an
/// acknowledgement returns each lane it touched once and only the first time.
pub(super) fn dead_letters_are_listed_and_acknowledged(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    let mut ids = Vec::new();
    for (channel, chat) in [("t", "a"), ("u", "b"), ("t", "c")] {
        ids.push(
            ob.enqueue(&NewDelivery::single(channel, chat, "x"))
                .unwrap()
                .id,
        );
        let claim = claim_one(&ob);
        ob.record(&claim, Outcome::Permanent { error: "no".into() })
            .unwrap();
    }
    let all: Vec<i64> = write(&ob, |tx| tx.dead_letter_chunks(None))
        .iter()
        .map(|c| c.delivery)
        .collect();
    assert_eq!(all, ids.iter().map(|id| row(&ob, *id)).collect::<Vec<_>>());
    let t: Vec<i64> = write(&ob, |tx| tx.dead_letter_chunks(Some("t")))
        .iter()
        .map(|c| c.delivery)
        .collect();
    assert_eq!(t, [row(&ob, ids[0]), row(&ob, ids[2])]);
    let lanes = write(&ob, |tx| tx.acknowledge_dead_letters(Some("t"), T0 + 1));
    assert_eq!(lanes.len(), 2);
    assert!(lanes.contains(&("t".into(), "a".into())) && lanes.contains(&("t".into(), "c".into())));
    assert!(write(&ob, |tx| tx.acknowledge_dead_letters(Some("t"), T0 + 2)).is_empty());
    assert_eq!(
        view(&ob, ids[0]).acknowledged_at,
        Some(crate::clock::to_datetime(T0 + 1))
    );
    assert_eq!(view(&ob, ids[1]).acknowledged_at, None, "another channel");
    assert_eq!(
        write(&ob, |tx| tx.acknowledge_dead_letters(None, T0 + 3)).len(),
        1
    );
}

/// A cancel removes a delivery's chunks and marks it cancelled, finished; a chunk
/// counts as started once claimed.
pub(super) fn cancels_remove_chunks(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    let id = ob
        .enqueue(&NewDelivery::chunked("t", "a", "x y", ["x", "y"]))
        .unwrap()
        .id;
    let first = row(&ob, id) * CHUNK_STRIDE;
    let untouched = |index: u32| ChunkProgress {
        id: first + i64::from(index),
        index,
        status: ChunkStatus::Pending,
        attempts: 0,
        sent_before: false,
    };
    assert_eq!(
        write(&ob, |tx| tx.chunk_progress(row(&ob, id))),
        [untouched(0), untouched(1)]
    );
    assert_eq!(write(&ob, |tx| tx.delete_chunks(row(&ob, id))), 2);
    write(&ob, |tx| tx.mark_cancelled(row(&ob, id), T0 + 7));
    let v = view(&ob, id);
    assert_eq!((v.status, v.chunks.len()), (DeliveryStatus::Cancelled, 0));
    assert_eq!(v.finished_at, Some(crate::clock::to_datetime(T0 + 7)));
    let other = enqueue(&ob, "b", "y");
    let claim = claim_one(&ob);
    assert_eq!(
        write(&ob, |tx| tx.chunk_progress(row(&ob, other))),
        [ChunkProgress {
            id: claim.chunk_id.0,
            index: 0,
            status: ChunkStatus::Sending,
            attempts: 1,
            sent_before: false,
        }]
    );
}

/// Operator lookups match a delivery's row and uid together, and prefer its held chunk.
pub(super) fn operator_lookups_match_row_and_uid(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = ob
        .enqueue(&NewDelivery::chunked("t", "a", "x y", ["x", "y"]))
        .unwrap()
        .id;
    let (r, uid) = (row(&ob, id), id.to_string());
    let head = write(&ob, |tx| tx.held_or_head_chunk(r, &uid)).unwrap();
    assert_eq!(head.index, 0);
    let claim = claim_one(&ob);
    ob.record(&claim, Outcome::delivered(None)).unwrap();
    assert_eq!(
        write(&ob, |tx| tx.held_or_head_chunk(r, &uid))
            .unwrap()
            .index,
        1,
        "the head"
    );
    let claim = claim_one(&ob);
    ob.record(&claim, Outcome::Ambiguous { error: "?".into() })
        .unwrap();
    let held = write(&ob, |tx| tx.held_or_head_chunk(r, &uid)).unwrap();
    assert_eq!((held.index, held.status), (1, ChunkStatus::Uncertain));
    let state = write(&ob, |tx| tx.delivery_state(r, &uid)).unwrap();
    assert_eq!(
        state,
        (r, DeliveryStatus::Uncertain, "t".to_owned(), "a".to_owned())
    );
    let other = DeliveryId::from(uuid::Uuid::nil()).to_string();
    assert_eq!(write(&ob, |tx| tx.held_or_head_chunk(r, &other)), None);
    assert_eq!(write(&ob, |tx| tx.delivery_state(r, &other)), None);
    let names = write(&ob, |tx| tx.delivery_names(r)).unwrap();
    assert_eq!(names, (uid, "t".to_owned(), "a".to_owned()));
    assert_eq!(write(&ob, |tx| tx.delivery_names(r + 1)), None);
}

/// A chunk's first send is kept across its sends; an uncertain chunk is listed as
/// unasked — per channel, oldest first, up to the limit, with its first send, when it
/// became uncertain and the token left on it — until a settlement is noted, which only
/// the chunk still uncertain and unasked takes, its delivery unchanged since it was
/// read; it is unasked again each time it becomes uncertain again.
pub(super) fn uncertain_chunks_are_asked_about_once(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id_a = enqueue(&ob, "a", "x");
    enqueue(&ob, "b", "y");
    let channel = channel_t(&ob);
    let due = write(&ob, |tx| tx.due_chunks(&channel, T0, 2));
    let ((a, da), (b, db)) = (
        (due[0].chunk, due[0].delivery),
        (due[1].chunk, due[1].delivery),
    );
    let uncertain = |chunk: i64, delivery: i64, keep_token: bool, at: i64| {
        write(&ob, |tx| {
            tx.set_chunk_aside(chunk, ChunkStatus::Uncertain, "maybe", keep_token)?;
            tx.set_delivery_aside(delivery, ChunkStatus::Uncertain, at, None)
        })
    };
    write(&ob, |tx| tx.mark_sending(a, T0 + 5, T0 + 1_000, 7));
    write(&ob, |tx| tx.mark_sending(b, T0 + 6, T0 + 1_000, 8));
    uncertain(a, da, true, T0 + 10);
    uncertain(b, db, false, T0 + 20);
    let listed = |limit: usize| {
        write(&ob, |tx| tx.unasked_uncertain("t", limit))
            .into_iter()
            .map(|u| (u.chunk.id, u.first_sent_at, u.since, u.token, u.text))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        listed(10),
        [
            (a, T0 + 5, T0 + 10, Some(7), "x".to_owned()),
            (b, T0 + 6, T0 + 20, None, "y".to_owned())
        ]
    );
    assert_eq!(listed(1).len(), 1);
    assert!(write(&ob, |tx| tx.unasked_uncertain("other", 10)).is_empty());

    assert!(
        !write(&ob, |tx| tx.note_settlement(a, T0 + 11, "stale", None)),
        "changed since"
    );
    assert!(write(&ob, |tx| tx.note_settlement(
        a,
        T0 + 10,
        "asked",
        None
    )));
    assert!(
        !write(&ob, |tx| tx.note_settlement(a, T0 + 10, "again", None)),
        "asked already"
    );
    assert_eq!(listed(10).iter().map(|u| u.0).collect::<Vec<_>>(), [b]);
    let view = |d: DeliveryId| ob.delivery(d).unwrap().unwrap().chunks.remove(0);
    assert_eq!(row(&ob, id_a), da);
    assert_eq!(view(id_a).settlement.as_deref(), Some("asked"));
    assert_eq!(
        view(id_a).first_sent_at.map(|t| t.timestamp_millis()),
        Some(T0 + 5)
    );

    // Sent again: the first send's time stays; uncertain again: unasked again.
    write(&ob, |tx| tx.mark_sending(a, T0 + 50, T0 + 1_000, 9));
    uncertain(a, da, true, T0 + 60);
    assert_eq!(view(id_a).settlement, None);
    assert_eq!(listed(10)[0], (a, T0 + 5, T0 + 60, Some(9), "x".to_owned()));
    // A settlement that allows a resend keeps its deadline, which the claim's read of
    // the chunk carries; a later word of the platform is added after the first.
    assert!(write(&ob, |tx| tx.note_settlement(
        a,
        T0 + 60,
        "resend",
        Some(T0 + 900)
    )));
    write(&ob, |tx| tx.append_settlement(a, "delivered earlier"));
    assert_eq!(
        view(id_a).settlement.as_deref(),
        Some("resend; delivered earlier")
    );
    write(&ob, |tx| tx.set_due(a, T0 + 70));
    let read = write(&ob, |tx| tx.due_chunks(&channel, T0 + 70, 10));
    let read = read.iter().find(|c| c.chunk == a).unwrap();
    assert_eq!(read.row.as_ref().unwrap().resend_by, Some(T0 + 900));
    // A chunk no longer uncertain takes no settlement.
    write(&ob, |tx| {
        tx.set_chunk_aside(b, ChunkStatus::Failed, "gone", false)
    });
    assert!(!write(&ob, |tx| tx.note_settlement(
        b,
        T0 + 20,
        "late",
        None
    )));
}

/// An unasked part carries the platform id a lookup may start from: its reply's
/// previous part's, or, for a first part, the last part's of its chat's latest reply
/// finished before it was first sent — not another chat's, nor one that finished after.
pub(super) fn an_unasked_part_carries_the_platform_id_before_it(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock).with_lane_order(crate::rules::LaneOrder::Parallel));
    let send = |outcome: Outcome| {
        let claim = claim_one(&ob);
        ob.record(&claim, outcome).unwrap();
        clock.advance(Duration::from_millis(10));
    };
    let delivered = |id: &str| Outcome::delivered(Some(id.into()));
    let maybe = || Outcome::Ambiguous { error: "?".into() };
    // Chat p: a reply of two parts delivered, another chat's reply, then a reply sent
    // once, uncertain; chat q: a reply whose second part is uncertain; chat n: nothing
    // before its uncertain reply.
    ob.enqueue(&NewDelivery::chunked("t", "p", "p0 p1", ["p0", "p1"]))
        .unwrap();
    send(delivered("p-0"));
    send(delivered("p-1"));
    enqueue(&ob, "x", "x0");
    send(delivered("x-0"));
    let p = enqueue(&ob, "p", "p2");
    send(maybe());
    let q = ob
        .enqueue(&NewDelivery::chunked("t", "q", "q0 q1", ["q0", "q1"]))
        .unwrap()
        .id;
    send(delivered("q-0"));
    send(maybe());
    let n = enqueue(&ob, "n", "n0");
    send(maybe());
    // Chat l: a reply whose first send started before the one ahead of it finished
    // (parallel lanes): that one's id is no bound for it.
    let l0 = enqueue(&ob, "l", "l0");
    let l1 = enqueue(&ob, "l", "l1");
    let mut both = ob.claim(2).unwrap();
    both.sort_by_key(|c| c.delivery_id == l1);
    clock.advance(Duration::from_millis(10));
    ob.record(&both[0], delivered("l-0")).unwrap();
    ob.record(&both[1], maybe()).unwrap();
    assert_eq!(both[0].delivery_id, l0);
    let bound = |id: DeliveryId| {
        write(&ob, |tx| tx.unasked_uncertain("t", 10))
            .into_iter()
            .find(|u| u.uid == id.to_string())
            .map(|u| u.previous_platform_id)
            .expect("listed")
    };
    assert_eq!(
        bound(p).as_deref(),
        Some("p-1"),
        "the chat's last delivered part"
    );
    assert_eq!(
        bound(q).as_deref(),
        Some("q-0"),
        "the reply's previous part"
    );
    assert_eq!(bound(n), None, "nothing before it");
    assert_eq!(bound(l1), None, "finished after its first send");
}

/// A purge never lists the newest delivery, lists only finished ones before the
/// cutoff, and removing one removes its chunks — if it is still finished.
pub(super) fn purges_spare_the_newest_and_the_unfinished(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    for chat in ["a", "b", "c"] {
        enqueue(&ob, chat, "x");
    }
    for claim in ob.claim(3).unwrap() {
        ob.record(&claim, Outcome::delivered(None)).unwrap();
    }
    enqueue(&ob, "d", "unfinished");
    let listed = write(&ob, |tx| tx.purgeable(0, T0 + 1, 100));
    assert_eq!(
        listed.len(),
        3,
        "every finished one: the newest is unfinished"
    );
    assert!(listed.iter().all(|p| p.delivered && p.channel == "t"));
    assert!(
        write(&ob, |tx| tx.purgeable(0, T0, 100)).is_empty(),
        "cutoff"
    );
    assert_eq!(
        write(&ob, |tx| tx.purgeable(listed[0].id, T0 + 1, 1)).len(),
        1
    );
    assert_eq!(write(&ob, |tx| tx.purge_counts(T0 + 1)), (3, 3));
    assert_eq!(write(&ob, |tx| tx.delete_delivery(listed[0].id)), 1);
    assert_eq!(write(&ob, |tx| tx.purge_counts(T0 + 1)), (2, 2));
    // Listed, then put back in its lane (a requeue of an acknowledged dead letter, in
    // another transaction): the removal checks again and leaves it.
    write(&ob, |tx| tx.set_queued(listed[1].id));
    assert_eq!(write(&ob, |tx| tx.delete_delivery(listed[1].id)), 0);
    assert!(write(&ob, |tx| tx.delivery_names(listed[1].id)).is_some());
}

/// Lane rows whose pause and interval both ended are forgotten; others are kept.
pub(super) fn idle_lanes_are_forgotten(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    write(&ob, |tx| {
        tx.pause_lane(lane("a"), T0 + 10)?;
        tx.note_lane_send(lane("b"), T0 + 1_000)
    });
    write(&ob, |tx| tx.forget_idle_lanes(T0 + 500));
    // Forgotten or not, a lane's due time is what it was: the only way to tell is a
    // due time asked before the pause ended.
    assert_eq!(
        write(&ob, |tx| tx.lane_due_time(lane("a"), T0)),
        T0,
        "a forgotten"
    );
    assert_eq!(
        write(&ob, |tx| tx.lane_due_time(lane("b"), T0)),
        T0 + 1_000,
        "b kept"
    );
}
