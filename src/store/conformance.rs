//! The contract of each store primitive, checked primitive by primitive on every store.
//!
//! Each contract is a function of a fresh outbox on the store under test (and the
//! manual clock it runs on): it seeds rows through the public API or through other
//! primitives, calls the primitive in a write transaction of the store, and checks what
//! the primitive returned and what it left. [`conformance!`] makes one test of each
//! contract for a store; a new store adds one line at the bottom.

use std::sync::Arc;
use std::time::Duration;

use crate::claim::Claim;
use crate::clock::ManualClock;
use crate::ids::{CHUNK_STRIDE, DeliveryId};
use crate::options::OutboxOptions;
use crate::outbox::Outbox;
use crate::outcome::Outcome;
use crate::reply::NewDelivery;
use crate::rules::{ChannelPolicy, FileRules, LaneOrder, Rules};
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::{
    Activation, ActivityRow, ChannelTally, ChunkProgress, HeadRow, LaneRef, NewRow, StoreTx,
};

/// The time every contract starts at, ms.
const T0: i64 = 1_767_225_600_000;

/// A store under test: a fresh outbox on it, on a manual clock at [`T0`].
type Fresh = fn(OutboxOptions) -> Outbox;

fn options(clock: &ManualClock) -> OutboxOptions {
    OutboxOptions::default()
        .with_clock(Arc::new(clock.clone()))
        .with_lease(Duration::from_secs(30))
}

/// A fresh outbox on the store, on a manual clock at [`T0`] that the contract leaves there.
fn fresh_at_t0(fresh: Fresh) -> Outbox {
    fresh(options(&ManualClock::new(T0)))
}

/// Runs `f` in one write transaction of `ob`'s store.
fn write<T: Send>(
    ob: &Outbox,
    mut f: impl FnMut(&dyn StoreTx) -> crate::error::Result<T> + Send,
) -> T {
    ob.write(|tx, _| f(tx)).unwrap()
}

fn lane<'a>(chat: &'a str) -> LaneRef<'a> {
    LaneRef::new("t", chat)
}

fn row(ob: &Outbox, id: DeliveryId) -> i64 {
    ob.delivery_rowid(id)
}

fn enqueue(ob: &Outbox, chat: &str, text: &str) -> DeliveryId {
    ob.enqueue(&NewDelivery::single("t", chat, text))
        .unwrap()
        .id
}

/// Channel `t` as the claim reads it.
fn channel_t(ob: &Outbox) -> crate::store::ChannelRow {
    write(ob, |tx| Ok(tx.channels(Some("t"))?.remove(0)))
}

fn claim_one(ob: &Outbox) -> Claim {
    let mut claims = ob.claim(1).unwrap();
    assert_eq!(claims.len(), 1, "one chunk due");
    claims.remove(0)
}

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

/// Due chunks come in due order, at most `limit`, none due later than asked.
pub(super) fn due_chunks_come_in_due_order_up_to_the_limit(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    for (i, chat) in ["c", "a", "b"].iter().enumerate() {
        clock.set(T0 + 10 * (3 - i as i64));
        enqueue(&ob, chat, "x");
    }
    clock.set(T0 + 100);
    let row = channel_t(&ob);
    let due = write(&ob, |tx| tx.due_chunks(&row, T0 + 100, 10));
    let times: Vec<i64> = due.iter().map(|c| c.due_at).collect();
    assert_eq!(times, [T0 + 10, T0 + 20, T0 + 30]);
    let chats: Vec<String> = due
        .iter()
        .map(|c| c.row.as_ref().unwrap().chunk.chat_id.clone())
        .collect();
    assert_eq!(chats, ["b", "a", "c"]);
    assert_eq!(write(&ob, |tx| tx.due_chunks(&row, T0 + 100, 2)).len(), 2);
    assert_eq!(write(&ob, |tx| tx.due_chunks(&row, T0 + 15, 10)).len(), 1);
    assert_eq!(write(&ob, |tx| tx.next_due(row.id)), Some(T0 + 10));
    assert!(write(&ob, |tx| tx.channels(Some("nobody"))).is_empty());
}

/// A claim's chunk is found by its token only: a stale token is refused.
pub(super) fn a_stale_token_is_refused(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    enqueue(&ob, "a", "x");
    let claim = claim_one(&ob);
    let chunk = write(&ob, |tx| tx.claimed_chunk(claim.chunk_id.0, claim.token)).unwrap();
    assert_eq!(chunk.status, ChunkStatus::Sending);
    assert_eq!(chunk.attempts, 1, "the attempt counted at the claim");
    assert_eq!(
        write(&ob, |tx| tx
            .claimed_chunk(claim.chunk_id.0, claim.token ^ 1)),
        None
    );
    ob.record(&claim, Outcome::delivered(None)).unwrap();
    assert_eq!(
        write(&ob, |tx| tx.claimed_chunk(claim.chunk_id.0, claim.token)),
        None,
        "settled: the token is cleared"
    );
}

/// Marking a chunk sending counts an attempt and sets its lease as its due time; a
/// lease is renewed only under its own token while sending, and listed as expired
/// once it ends.
pub(super) fn leases_are_marked_renewed_and_expire(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    enqueue(&ob, "a", "x");
    let row = channel_t(&ob);
    let chunk = write(&ob, |tx| tx.due_chunks(&row, T0, 1)).remove(0).chunk;
    write(&ob, |tx| tx.mark_sending(chunk, T0, T0 + 1_000, 77));
    let held = write(&ob, |tx| tx.claimed_chunk(chunk, 77)).unwrap();
    assert_eq!((held.status, held.attempts), (ChunkStatus::Sending, 1));
    assert_eq!(write(&ob, |tx| tx.next_due(row.id)), Some(T0 + 1_000));
    assert!(write(&ob, |tx| tx.renew_lease(chunk, 77, T0 + 2_000)));
    assert!(!write(&ob, |tx| tx.renew_lease(chunk, 78, T0 + 9_000)));
    assert!(write(&ob, |tx| tx.expired_sending(row.id, T0 + 1_999)).is_empty());
    let expired = write(&ob, |tx| tx.expired_sending(row.id, T0 + 2_000));
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].id, chunk);
    write(&ob, |tx| tx.set_due(chunk, T0 + 2_500));
    assert_eq!(write(&ob, |tx| tx.next_due(row.id)), Some(T0 + 2_500));
    write(&ob, |tx| {
        tx.set_chunk_aside(chunk, ChunkStatus::Uncertain, "lost", true)
    });
    assert!(
        write(&ob, |tx| tx.claimed_chunk(chunk, 77)).is_some(),
        "token kept"
    );
    assert!(
        !write(&ob, |tx| tx.renew_lease(chunk, 77, T0 + 3_000)),
        "not sending"
    );
}

/// The one chunk of a queued reply sent as its whole text is read as pending, with no
/// attempts, and compared as the whole text — whether or not its row is stored yet.
pub(super) fn a_queued_replys_chunk_is_supplied(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    enqueue(&ob, "a", "first");
    let queued = enqueue(&ob, "a", "second");
    let id = row(&ob, queued) * CHUNK_STRIDE;
    let chunk = write(&ob, |tx| tx.load_chunk(id)).expect("the queued chunk");
    assert_eq!(
        (chunk.status, chunk.attempts, chunk.index),
        (ChunkStatus::Pending, 0, 0)
    );
    assert_eq!((chunk.delivery, chunk.total), (row(&ob, queued), 1));
    let content = write(&ob, |tx| tx.stored_content(row(&ob, queued)));
    assert_eq!(content.status, DeliveryStatus::Queued);
    assert_eq!(content.chunks, [None]);
    // Stored chunks: a chunk that is the whole text reads as None, any other as itself.
    let split = ob
        .enqueue(&NewDelivery::chunked("t", "b", "x y", ["x", "y"]))
        .unwrap()
        .id;
    let content = write(&ob, |tx| tx.stored_content(row(&ob, split)));
    assert_eq!(content.chunks, [Some("x".to_owned()), Some("y".to_owned())]);
    let whole = enqueue(&ob, "c", "whole");
    let content = write(&ob, |tx| tx.stored_content(row(&ob, whole)));
    assert_eq!(content.chunks, [None]);
    let texts: Vec<String> = view(&ob, split)
        .chunks
        .into_iter()
        .map(|c| c.text)
        .collect();
    assert_eq!(texts, ["x", "y"]);
    assert_eq!(write(&ob, |tx| tx.load_chunk(id + 1)), None);
}

/// A caller key names one delivery of its channel.
pub(super) fn keys_are_found_per_channel(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = ob
        .enqueue(&NewDelivery::single("t", "a", "x").with_idempotency_key("k"))
        .unwrap()
        .id;
    let found = write(&ob, |tx| tx.find_by_key("t", "k")).unwrap();
    assert_eq!(found, (row(&ob, id), id.to_string()));
    assert_eq!(write(&ob, |tx| tx.find_by_key("u", "k")), None);
    assert_eq!(write(&ob, |tx| tx.find_by_key("t", "j")), None);
}

/// A channel name has one number, and registering one raises the rules' version.
pub(super) fn channel_numbers_are_stable(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let before = write(&ob, |tx| tx.rules_version());
    let a = write(&ob, |tx| tx.channel_number("a"));
    let after = write(&ob, |tx| tx.rules_version());
    assert!(after > before, "other handles learn the number");
    assert_eq!(write(&ob, |tx| tx.channel_number("a")), a);
    assert_ne!(write(&ob, |tx| tx.channel_number("b")), a);
    assert_eq!(write(&ob, |tx| tx.load_rules()).channel_ids["a"], a);
}

/// A write that takes a version of the rules on trust acts on the version stored: a
/// store that confirms it later finds another one and runs the write again, with the
/// version read.
pub(super) fn a_version_taken_on_trust_is_the_stored_one(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let stored = write(&ob, |tx| tx.rules_version());
    assert_eq!(write(&ob, |tx| tx.rules_version_or(stored)), stored);
    assert_eq!(write(&ob, |tx| tx.rules_version_or(stored - 1)), stored);
    assert_eq!(write(&ob, |tx| tx.rules_version_or(stored + 7)), stored);
    // The rules changed behind the handle's copy (a primitive's write, as another
    // handle's would be): a write that reads nothing still acts on the stored ones.
    let which = FileRules {
        lane_order: true,
        ..FileRules::default()
    };
    write(&ob, |tx| tx.store_file_rules(&Rules::default(), which));
    let now = ob.write(|_, rules| Ok(rules.version)).unwrap();
    assert_eq!(now, write(&ob, |tx| tx.rules_version()));
    assert!(now > stored);
}

/// Stored rules read back as stored, each change raising the version; a rule not
/// named keeps what is stored.
pub(super) fn rules_read_back_as_stored(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let v0 = write(&ob, |tx| tx.rules_version());
    let policy = Rules {
        lane_order: LaneOrder::Parallel,
        ..Rules::default()
    };
    let which = FileRules {
        lane_order: true,
        ..FileRules::default()
    };
    write(&ob, |tx| tx.store_file_rules(&policy, which));
    let stored = write(&ob, |tx| tx.load_rules());
    assert!(stored.version > v0);
    assert_eq!(stored.policy.lane_order, LaneOrder::Parallel);
    assert!(stored.declared.lane_order && !stored.declared.retry);
    let rules = ChannelPolicy::replayable().with_lane_interval(Duration::from_millis(1500));
    write(&ob, |tx| tx.store_channel_rules("m", Some(&rules)));
    let stored2 = write(&ob, |tx| tx.load_rules());
    assert!(stored2.version > stored.version);
    assert_eq!(stored2.policy.channels["m"], rules);
    write(&ob, |tx| tx.store_channel_rules("m", None));
    assert!(
        !write(&ob, |tx| tx.load_rules())
            .policy
            .channels
            .contains_key("m")
    );
    write(&ob, |tx| {
        tx.store_finalization_statement(Some("INSERT INTO x VALUES (1)"))
    });
    assert_eq!(
        write(&ob, |tx| tx.finalization_statement()).as_deref(),
        Some("INSERT INTO x VALUES (1)")
    );
}

/// Rate limits are counted per chunk; a fresh budget clears them and the attempts, and
/// remembers that an earlier budget sent the chunk.
pub(super) fn budgets_count_and_reset(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = enqueue(&ob, "a", "x");
    let claim = claim_one(&ob);
    let chunk = claim.chunk_id.0;
    assert_eq!(write(&ob, |tx| tx.count_rate_limit(chunk)), 1);
    assert_eq!(write(&ob, |tx| tx.count_rate_limit(chunk)), 2);
    let progress = |status, attempts, sent_before| {
        vec![ChunkProgress {
            id: chunk,
            index: 0,
            status,
            attempts,
            sent_before,
        }]
    };
    assert_eq!(
        write(&ob, |tx| tx.chunk_progress(row(&ob, id))),
        progress(ChunkStatus::Sending, 1, false)
    );
    write(&ob, |tx| tx.reset_budget(chunk));
    let reset = write(&ob, |tx| tx.load_chunk(chunk)).unwrap();
    assert_eq!((reset.status, reset.attempts), (ChunkStatus::Retry, 0));
    assert_eq!(
        write(&ob, |tx| tx.count_rate_limit(chunk)),
        1,
        "a fresh count"
    );
    assert_eq!(
        write(&ob, |tx| tx.chunk_progress(row(&ob, id))),
        progress(ChunkStatus::Retry, 0, true),
        "sent by the budget before"
    );
}

/// A nested transaction undone leaves nothing of its writes; one kept keeps them.
pub(super) fn nested_transactions_undo_or_keep(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    write(&ob, |tx| {
        assert!(tx.in_transaction());
        tx.begin_nested()?;
        tx.channel_number("undone")?;
        tx.end_nested(false)?;
        tx.begin_nested()?;
        tx.channel_number("kept")?;
        tx.end_nested(true)?;
        Ok(())
    });
    let ids = write(&ob, |tx| tx.load_rules()).channel_ids;
    assert!(
        ids.contains_key("kept") && !ids.contains_key("undone"),
        "{ids:?}"
    );
}

/// The history takes a delivery once; what its schema refuses is a refusal with the
/// database's message, a database that cannot answer is not.
pub(super) fn history_takes_a_delivery_once(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = enqueue(&ob, "a", "x");
    write(&ob, |tx| tx.write_history(row(&ob, id), T0));
    // (A transaction whose statement failed may fail to commit: on PostgreSQL it
    // was rolled back. The refusal is what is looked at.)
    let mut refused = None;
    let _ = ob.write(|tx, _| {
        refused = Some(tx.write_history(row(&ob, id), T0));
        Ok(())
    });
    let again = refused
        .expect("the write ran")
        .expect_err("a second copy is refused");
    let mut again = Some(again);
    let message = ob
        .write(|tx, _| tx.refusal(again.take().expect("refused once")))
        .unwrap();
    assert!(
        message.contains("UNIQUE") || message.contains("unique"),
        "{message}"
    );
    let busy = ob.write(|tx, _| tx.refusal(crate::error::Error::Busy));
    assert!(matches!(busy, Err(crate::error::Error::Busy)));
}

/// Finished-but-unfinalized deliveries are those with chunks, every one delivered.
pub(super) fn unfinalized_are_those_with_every_chunk_delivered(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let done = ob
        .enqueue(&NewDelivery::chunked("t", "a", "x y", ["x", "y"]))
        .unwrap()
        .id;
    enqueue(&ob, "b", "z");
    enqueue(&ob, "a", "queued");
    assert!(write(&ob, |tx| tx.finished_unfinalized()).is_empty());
    let first = row(&ob, done) * CHUNK_STRIDE;
    write(&ob, |tx| tx.mark_delivered(first, None, T0));
    assert!(
        write(&ob, |tx| tx.finished_unfinalized()).is_empty(),
        "one left"
    );
    write(&ob, |tx| tx.mark_delivered(first + 1, None, T0));
    let listed = write(&ob, |tx| tx.finished_unfinalized());
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].0.id, listed[0].0.chat_id.as_str()),
        (row(&ob, done), "a")
    );
    assert_eq!(listed[0].1, T0);
    write(&ob, |tx| tx.mark_finalized(row(&ob, done), T0));
    assert!(write(&ob, |tx| tx.finished_unfinalized()).is_empty());
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

/// A row set aside as corrupt is failed, and its lane is given back when readable.
pub(super) fn corrupt_rows_are_failed_with_their_lane(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = enqueue(&ob, "a", "x");
    let chunk = row(&ob, id) * CHUNK_STRIDE;
    let lane = write(&ob, |tx| tx.set_corrupt(chunk, row(&ob, id), "bad", T0));
    assert_eq!(lane, Some(("t".to_owned(), "a".to_owned())));
    let view = ob.delivery(id).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Failed);
    assert_eq!(
        write(&ob, |tx| tx.load_chunk(chunk)).unwrap().status,
        ChunkStatus::Failed
    );
}

/// The view of delivery `id` as the store reads it.
fn view(ob: &Outbox, id: DeliveryId) -> crate::inspect::DeliveryView {
    write(ob, |tx| tx.delivery_view(row(ob, id), &id.to_string())).expect("stored")
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

/// A channel's pause holds its slot and never shortens; its slot is set as given.
pub(super) fn channel_pauses_and_slots(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = write(&ob, |tx| tx.channel_number("t"));
    write(&ob, |tx| tx.pause_channel("t", T0 + 900));
    write(&ob, |tx| tx.pause_channel("t", T0 + 100));
    write(&ob, |tx| tx.set_channel_slot(id, 123_456));
    let row = channel_t(&ob);
    assert_eq!(row.paused_until, Some(T0 + 900));
    assert_eq!(row.next_send_at_us, Some(123_456));
    assert_eq!(row.interval_us, 0);
    write(&ob, |tx| {
        tx.store_channel_rules(
            "t",
            Some(&ChannelPolicy::default().with_rate_per_second(10.0)),
        )
    });
    assert_eq!(
        write(&ob, |tx| tx.channels(Some("t")))[0].interval_us,
        100_000
    );
    assert_eq!(write(&ob, |tx| tx.channels(None)).len(), 1);
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

/// Rescheduling sets status, attempts, due time and the last error (kept when none is
/// given), and clears the token; an unscheduled retry is due nowhere; an expired lease's
/// retry keeps its token.
pub(super) fn chunks_are_rescheduled(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = enqueue(&ob, "a", "x");
    let claim = claim_one(&ob);
    let chunk = claim.chunk_id.0;
    let channel = channel_t(&ob);
    write(&ob, |tx| {
        tx.reschedule(chunk, ChunkStatus::Retry, 3, T0 + 50, Some("e"))
    });
    assert_eq!(
        write(&ob, |tx| tx.claimed_chunk(chunk, claim.token)),
        None,
        "token cleared"
    );
    let c = write(&ob, |tx| tx.load_chunk(chunk)).unwrap();
    assert_eq!((c.status, c.attempts), (ChunkStatus::Retry, 3));
    assert_eq!(write(&ob, |tx| tx.next_due(channel.id)), Some(T0 + 50));
    write(&ob, |tx| {
        tx.reschedule(chunk, ChunkStatus::Pending, 0, T0 + 60, None)
    });
    assert_eq!(
        view(&ob, id).chunks[0].last_error.as_deref(),
        Some("e"),
        "kept"
    );
    write(&ob, |tx| tx.set_retry_unscheduled(chunk, 2, Some("f")));
    let c = write(&ob, |tx| tx.load_chunk(chunk)).unwrap();
    assert_eq!((c.status, c.attempts), (ChunkStatus::Retry, 2));
    assert_eq!(
        write(&ob, |tx| tx.next_due(channel.id)),
        None,
        "due nowhere"
    );
    assert_eq!(view(&ob, id).chunks[0].last_error.as_deref(), Some("f"));
    write(&ob, |tx| tx.set_retry_unscheduled(chunk, 1, None));
    assert_eq!(
        view(&ob, id).chunks[0].last_error.as_deref(),
        Some("f"),
        "kept"
    );
    write(&ob, |tx| tx.mark_sending(chunk, T0, T0 + 1_000, 9));
    write(&ob, |tx| tx.retry_keeping_token(chunk, T0 + 70));
    let held = write(&ob, |tx| tx.claimed_chunk(chunk, 9)).expect("token kept");
    assert_eq!(held.status, ChunkStatus::Retry);
    assert_eq!(write(&ob, |tx| tx.next_due(channel.id)), Some(T0 + 70));
}

/// Setting a chunk and its delivery aside: the chunk takes the status and error and is
/// due nowhere; the delivery takes the status, finished only when failed.
pub(super) fn chunks_and_deliveries_are_set_aside(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    let id = enqueue(&ob, "a", "x");
    let claim = claim_one(&ob);
    let chunk = claim.chunk_id.0;
    let channel = channel_t(&ob);
    write(&ob, |tx| {
        tx.set_chunk_aside(chunk, ChunkStatus::Uncertain, "maybe", false)
    });
    assert_eq!(
        write(&ob, |tx| tx.claimed_chunk(chunk, claim.token)),
        None,
        "token cleared"
    );
    assert_eq!(write(&ob, |tx| tx.next_due(channel.id)), None);
    write(&ob, |tx| {
        tx.set_delivery_aside(row(&ob, id), ChunkStatus::Uncertain, T0 + 5, None)
    });
    let v = view(&ob, id);
    assert_eq!((v.status, v.finished_at), (DeliveryStatus::Uncertain, None));
    assert_eq!(v.chunks[0].status, ChunkStatus::Uncertain);
    assert_eq!(v.chunks[0].last_error.as_deref(), Some("maybe"));
    write(&ob, |tx| {
        tx.set_delivery_aside(row(&ob, id), ChunkStatus::Failed, T0 + 5, Some(T0 + 6))
    });
    let v = view(&ob, id);
    assert_eq!(v.status, DeliveryStatus::Failed);
    assert_eq!(v.finished_at, Some(crate::clock::to_datetime(T0 + 6)));
}

/// Delivered chunks are counted on their delivery (an active one becomes partial); a
/// delivery is marked finalized or unfinalized with every chunk counted.
pub(super) fn deliveries_count_and_finalize(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    let id = ob
        .enqueue(&NewDelivery::chunked("t", "a", "x y", ["x", "y"]))
        .unwrap()
        .id;
    let first = row(&ob, id) * CHUNK_STRIDE;
    write(&ob, |tx| tx.mark_delivered(first, Some("p1"), T0 + 1));
    write(&ob, |tx| tx.count_delivered(row(&ob, id), T0 + 1, None));
    let v = view(&ob, id);
    assert_eq!(
        (v.status, v.delivered_count),
        (DeliveryStatus::Pending, 1),
        "held aside: status kept"
    );
    assert_eq!(v.chunks[0].platform_message_id.as_deref(), Some("p1"));
    assert_eq!(v.chunks[0].status, ChunkStatus::Delivered);
    write(&ob, |tx| {
        tx.count_delivered(row(&ob, id), T0 + 2, Some(DeliveryStatus::Partial))
    });
    assert_eq!(view(&ob, id).status, DeliveryStatus::Partial);
    assert_eq!(write(&ob, |tx| tx.created_at(row(&ob, id))), T0);
    write(&ob, |tx| {
        tx.mark_unfinalized(row(&ob, id), T0 + 3, "refused")
    });
    let v = view(&ob, id);
    assert_eq!(v.status, DeliveryStatus::Unfinalized);
    assert_eq!(
        (v.delivered_count, v.finalize_error.as_deref()),
        (2, Some("refused"))
    );
    write(&ob, |tx| tx.mark_finalized(row(&ob, id), T0 + 4));
    let v = view(&ob, id);
    assert_eq!(
        (v.status, v.finalize_error),
        (DeliveryStatus::Delivered, None)
    );
    assert_eq!(v.finished_at, Some(crate::clock::to_datetime(T0 + 4)));
}

/// A channel's counters add up what each tally adds; a purge lowers the stored count.
pub(super) fn channel_counters_add_up(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    for (latest, latency) in [(T0 + 9, [1, 1, 1, 1, 1, 1]), (T0 + 5, [0, 1, 1, 1, 1, 2])] {
        write(&ob, |tx| {
            tx.add_channel_stats(&crate::store::ChannelTally {
                channel: "t",
                latest,
                count: 2,
                latency_sum_ms: 700,
                latency_le: latency,
            })
        });
    }
    write(&ob, |tx| tx.forget_delivered("t", 1));
    let stats = write(&ob, |tx| tx.health_rows(T0)).stats;
    assert_eq!(stats.len(), 1);
    let s = &stats[0];
    assert_eq!(
        (s.channel.as_str(), s.delivered, s.finalized_total),
        ("t", 3, 4)
    );
    assert_eq!((s.latency_count, s.latency_sum_ms), (4, 1400));
    assert_eq!(s.latency_le, [1, 2, 2, 2, 2, 3]);
    assert_eq!(
        s.last_delivered_at,
        Some(T0 + 9),
        "the latest, not the last written"
    );
}

/// The application's statement is described as the database reads it, refused with
/// the database's message when it does not prepare, and run with its parameters bound
/// from the delivery.
pub(super) fn statements_are_described_and_run(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = enqueue(&ob, "a", "hello");
    let update = "UPDATE outbound_deliveries SET sender = :content WHERE uid = :delivery_id";
    let shape = write(&ob, |tx| tx.describe_statement(update)).unwrap();
    assert!(!shape.read_only && !shape.returns_rows);
    assert_eq!(
        shape.parameters,
        [Some(":content".to_owned()), Some(":delivery_id".to_owned())]
    );
    let select = write(&ob, |tx| tx.describe_statement("SELECT 1")).unwrap();
    assert!(select.read_only && select.returns_rows);
    assert!(write(&ob, |tx| tx.describe_statement("UPDATE nowhere SET x = 1")).is_err());
    write(&ob, |tx| tx.run_statement(update, row(&ob, id), T0));
    assert_eq!(view(&ob, id).sender.as_deref(), Some("hello"));
}

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

/// Health counts unfinished deliveries and their chunks by channel and status, the
/// queued reply's missing chunk row as a pending chunk; the unsent rest of a dead
/// letter is not counted.
pub(super) fn health_counts_unfinished_rows(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    enqueue(&ob, "a", "x");
    enqueue(&ob, "a", "queued");
    ob.enqueue(&NewDelivery::chunked("u", "b", "x y", ["x", "y"]))
        .unwrap();
    let rows = write(&ob, |tx| tx.health_rows(T0 + 1));
    let groups = |channel: &str| -> Vec<(DeliveryStatus, u64)> {
        let mut g: Vec<_> = rows
            .deliveries
            .iter()
            .filter(|d| d.channel == channel)
            .map(|d| (d.status, d.count))
            .collect();
        g.sort_by_key(|(s, _)| s.as_str());
        g
    };
    assert_eq!(
        groups("t"),
        [(DeliveryStatus::Pending, 1), (DeliveryStatus::Queued, 1)]
    );
    assert_eq!(groups("u"), [(DeliveryStatus::Pending, 1)]);
    let t: Vec<_> = rows.chunks.iter().filter(|c| c.channel == "t").collect();
    assert_eq!(t.len(), 1);
    assert_eq!(
        (t[0].status, t[0].count, t[0].due_now, t[0].scheduled),
        (ChunkStatus::Pending, 2, 1, 1)
    );
    assert_eq!(t[0].oldest_due, Some(T0));
    let u: Vec<_> = rows.chunks.iter().filter(|c| c.channel == "u").collect();
    assert_eq!(
        (u[0].count, u[0].due_now),
        (2, 1),
        "the later chunk is pending, not due"
    );
    assert!(
        rows.deliveries
            .iter()
            .all(|d| d.oldest_created_at == T0 && d.corrupt == 0)
    );
    let claim = claim_one(&ob);
    ob.record(&claim, Outcome::Permanent { error: "no".into() })
        .unwrap();
    let rows = write(&ob, |tx| tx.health_rows(T0 + 1));
    let failed = rows
        .deliveries
        .iter()
        .find(|d| d.status == DeliveryStatus::Failed)
        .unwrap();
    assert!(failed.unacknowledged);
    let failed_chunks: u64 = rows
        .chunks
        .iter()
        .filter(|c| c.status == ChunkStatus::Failed)
        .map(|c| c.count)
        .sum();
    assert_eq!(failed_chunks, 1);
}

/// A view shows a delivery with its chunks (a queued reply's one chunk supplied); a
/// list filters, orders newest first and stops at its limit; corrupt rows are listed.
pub(super) fn deliveries_are_viewed_listed_and_reported(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    let a = enqueue(&ob, "a", "one");
    let b = enqueue(&ob, "a", "two");
    let c = ob
        .enqueue(&NewDelivery::single("u", "c", "three"))
        .unwrap()
        .id;
    let v = view(&ob, b);
    assert_eq!(
        (v.status, v.text.as_str(), v.chunks.len()),
        (DeliveryStatus::Queued, "two", 1)
    );
    assert_eq!(
        (v.chunks[0].status, v.chunks[0].text.as_str()),
        (ChunkStatus::Pending, "two")
    );
    assert_eq!(v.chunks[0].id.0, row(&ob, b) * CHUNK_STRIDE);
    let wrong = DeliveryId::from(uuid::Uuid::nil()).to_string();
    assert_eq!(write(&ob, |tx| tx.delivery_view(row(&ob, a), &wrong)), None);
    let ids = |filter: crate::inspect::ListFilter| -> Vec<DeliveryId> {
        write(&ob, |tx| tx.list(&filter))
            .iter()
            .map(|v| v.id)
            .collect()
    };
    let all = crate::inspect::ListFilter::default();
    assert_eq!(ids(all.clone()), [c, b, a]);
    assert_eq!(ids(all.clone().limit(2)), [c, b]);
    assert_eq!(ids(all.clone().channel("t")), [b, a]);
    assert_eq!(ids(all.clone().status(DeliveryStatus::Queued)), [b]);
    let pending = &view(&ob, a).chunks[0];
    assert_eq!(pending.next_attempt_at, Some(crate::clock::to_datetime(T0)));
    assert_eq!(pending.lease_until, None);
    let claim = ob.claim_channels(&["t"], 1).unwrap().remove(0);
    assert_eq!(claim.delivery_id, a);
    let sending = &view(&ob, a).chunks[0];
    assert_eq!(
        (sending.next_attempt_at, sending.lease_until),
        (None, Some(claim.lease_until))
    );
    ob.record(&claim, Outcome::delivered(None)).unwrap();
    assert_eq!(ids(all.clone().status(DeliveryStatus::Delivered)), [a]);
    // Unfinished: neither delivered nor cancelled.
    let d = ob
        .enqueue(&NewDelivery::single("u", "d", "four"))
        .unwrap()
        .id;
    ob.cancel(d).unwrap();
    assert_eq!(ids(all.clone().unfinished()), [c, b]);
    assert_eq!(ids(all.clone().unfinished().chat_id("c")), [c]);
    // By caller key, on any channel or on the one given.
    let keyed = ob
        .enqueue(&NewDelivery::single("v", "e", "five").with_idempotency_key("turn-1"))
        .unwrap()
        .id;
    assert_eq!(ids(all.clone().idempotency_key("turn-1")), [keyed]);
    assert_eq!(
        ids(all.clone().idempotency_key("turn-1").channel("v")),
        [keyed]
    );
    assert_eq!(ids(all.clone().idempotency_key("turn-1").channel("t")), []);
    assert_eq!(ids(all.clone().idempotency_key("turn-2")), []);
    assert!(write(&ob, |tx| tx.corrupt_rows()).is_empty());
    write(&ob, |tx| {
        tx.set_corrupt(row(&ob, c) * CHUNK_STRIDE, row(&ob, c), "bad text", T0)
    });
    let corrupt = write(&ob, |tx| tx.corrupt_rows());
    assert_eq!(corrupt.len(), 1);
    assert_eq!(
        (corrupt[0].row, corrupt[0].reason.as_str()),
        (row(&ob, c), "bad text")
    );
    assert_eq!(corrupt[0].uid, c.to_string());
}

/// The dead letters a snapshot counts — kept by the store as they come and go, never
/// read one by one — are those its rows hold, after every way a dead letter comes and
/// goes: a permanent failure, an acknowledgement, a requeue, a row set aside as
/// unreadable, a purge; and the lists of unfinished replies and of dead letters read
/// them, newest first, beside the work in flight.
pub(super) fn dead_letters_are_counted_as_they_come_and_go(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    let counted = |ob: &Outbox| {
        let rows = write(ob, |tx| tx.health_rows(T0));
        let mut counts: Vec<(String, u64, u64, u64, u64)> = Vec::new();
        for channel in ["t", "u"] {
            let dead = |unacknowledged: Option<bool>| -> u64 {
                rows.deliveries
                    .iter()
                    .filter(|d| d.channel == channel && d.status == DeliveryStatus::Failed)
                    .filter(|d| unacknowledged.is_none_or(|u| d.unacknowledged == u))
                    .map(|d| d.count)
                    .sum()
            };
            let corrupt: u64 = rows
                .deliveries
                .iter()
                .filter(|d| d.channel == channel && d.status == DeliveryStatus::Failed)
                .map(|d| d.corrupt)
                .sum();
            let chunks: u64 = rows
                .chunks
                .iter()
                .filter(|c| c.channel == channel && c.status == ChunkStatus::Failed)
                .map(|c| c.count)
                .sum();
            counts.push((
                channel.into(),
                dead(None),
                dead(Some(true)),
                corrupt,
                chunks,
            ));
        }
        counts
    };
    // What the rows hold, read one by one.
    let recounted = |ob: &Outbox| {
        let failed = ob
            .list(
                &crate::inspect::ListFilter::default()
                    .status(DeliveryStatus::Failed)
                    .limit(crate::inspect::MAX_LIST_LIMIT),
            )
            .unwrap();
        let corrupt = write(ob, |tx| tx.corrupt_rows());
        ["t", "u"]
            .map(|channel| {
                let of: Vec<_> = failed.iter().filter(|v| v.channel == channel).collect();
                let views: Vec<_> = of
                    .iter()
                    .map(|v| ob.delivery(v.id).unwrap().unwrap())
                    .collect();
                (
                    channel.to_owned(),
                    of.len() as u64,
                    of.iter().filter(|v| v.acknowledged_at.is_none()).count() as u64,
                    corrupt
                        .iter()
                        .filter(|c| of.iter().any(|v| v.id.to_string() == c.uid))
                        .count() as u64,
                    views
                        .iter()
                        .flat_map(|v| &v.chunks)
                        .filter(|c| c.status == ChunkStatus::Failed)
                        .count() as u64,
                )
            })
            .to_vec()
    };
    let fail = |channel: &str, chat: &str| {
        let id = ob
            .enqueue(&NewDelivery::chunked(channel, chat, "a b", ["a", "b"]))
            .unwrap()
            .id;
        let claim = ob.claim_channels(&[channel], 1).unwrap().remove(0);
        assert_eq!(claim.delivery_id, id);
        ob.record(
            &claim,
            Outcome::Permanent {
                error: "gone".into(),
            },
        )
        .unwrap();
        id
    };
    let check = |ob: &Outbox, expected: [(u64, u64, u64, u64); 2], step: &str| {
        let counts = counted(ob);
        assert_eq!(counts, recounted(ob), "{step}: the counts are the rows'");
        let numbers: Vec<_> = counts.iter().map(|c| (c.1, c.2, c.3, c.4)).collect();
        assert_eq!(numbers, expected, "{step}");
    };
    check(&ob, [(0, 0, 0, 0); 2], "none yet");
    let first = fail("t", "1");
    fail("t", "2");
    let third = fail("t", "3");
    fail("u", "1");
    // Work in flight beside them, on the same lanes and others.
    let flying = ob
        .enqueue(&NewDelivery::single("t", "1", "later"))
        .unwrap()
        .id;
    check(&ob, [(3, 3, 0, 3), (1, 1, 0, 1)], "failed");
    let unfinished = ob
        .list(
            &crate::inspect::ListFilter::default()
                .unfinished()
                .channel("t"),
        )
        .unwrap();
    let ids: Vec<_> = unfinished.iter().map(|v| v.id).collect();
    assert_eq!(ids.len(), 4);
    assert_eq!(ids[0], flying, "newest first, in flight and dead alike");
    assert_eq!(ids[3], first);
    let newest = ob
        .list(
            &crate::inspect::ListFilter::default()
                .status(DeliveryStatus::Failed)
                .limit(2),
        )
        .unwrap();
    assert_eq!(newest.len(), 2, "across channels, the newest two");
    assert_eq!(newest[1].id, third);
    assert_eq!(ob.dismiss_dead_letters(Some("u")).unwrap(), 1);
    check(&ob, [(3, 3, 0, 3), (1, 0, 0, 1)], "acknowledged");
    ob.requeue_delivery(first).unwrap();
    check(&ob, [(2, 2, 0, 2), (1, 0, 0, 1)], "requeued");
    write(&ob, |tx| {
        tx.set_corrupt(
            row(&ob, flying) * CHUNK_STRIDE,
            row(&ob, flying),
            "bad text",
            T0,
        )
    });
    check(&ob, [(3, 3, 1, 3), (1, 0, 0, 1)], "set aside");
    clock.advance(std::time::Duration::from_secs(60));
    let report = ob.purge(crate::clock::to_datetime(T0 + 1)).unwrap();
    assert_eq!(report.deliveries, 1, "the acknowledged dead letter of u");
    check(&ob, [(3, 3, 1, 3), (0, 0, 0, 0)], "purged");
}

/// The counts kept per minute as replies finish are those the finished rows give, for
/// a reply acked alone, acks in a batch, a dead letter and a reply set aside as
/// unreadable; a purge forgets the minutes before its cutoff with their rows.
pub(super) fn finished_replies_are_counted_per_minute_as_they_finish(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    let minute = crate::finalize::minute_of(T0);
    let reply = |channel: &str, chat: &str| {
        ob.enqueue(&NewDelivery::single(channel, chat, "x"))
            .unwrap()
            .id
    };
    for chat in ["1", "2", "3"] {
        reply("batch", chat);
    }
    reply("alone", "1");
    reply("dead", "1");
    let odd = reply("odd", "1");
    clock.set(T0 + 1_000);
    let claim = ob.claim_channels(&["alone"], 1).unwrap().remove(0);
    ob.record(&claim, Outcome::delivered(None)).unwrap();
    clock.set(T0 + 61_500);
    let claims = ob.claim_channels(&["batch"], 3).unwrap();
    assert_eq!(claims.len(), 3);
    for recorded in ob
        .record_batch(claims.iter().map(|c| (c, Outcome::delivered(None))))
        .unwrap()
    {
        recorded.unwrap();
    }
    clock.set(T0 + 62_000);
    let claim = ob.claim_channels(&["dead"], 1).unwrap().remove(0);
    ob.record(
        &claim,
        Outcome::Permanent {
            error: "gone".into(),
        },
    )
    .unwrap();
    clock.set(T0 + 130_000);
    let (chunk, delivery) = (row(&ob, odd) * CHUNK_STRIDE, row(&ob, odd));
    ob.write(|tx, rules| {
        crate::state::set_aside_corrupt(tx, rules, chunk, delivery, "bad text", T0 + 130_000)
    })
    .unwrap();
    let agree = |ob: &Outbox, from: i64| {
        let kept: Vec<ActivityRow> = write(ob, |tx| tx.activity_minutes(from, minute + 10))
            .into_iter()
            .map(|m| ActivityRow {
                bucket: m.bucket - minute,
                ..m
            })
            .collect();
        let read = write(ob, |tx| tx.activity(T0, 60_000));
        assert_eq!(kept, read, "kept per minute, and read from the rows");
        kept
    };
    let kept = agree(&ob, minute);
    let counted = |kept: &[ActivityRow]| -> Vec<(i64, i64, i64)> {
        kept.iter()
            .map(|m| (m.bucket, m.delivered, m.failed))
            .collect()
    };
    assert_eq!(counted(&kept), [(0, 1, 0), (1, 3, 1), (2, 0, 1)]);
    assert_eq!(kept[1].latency_max_ms, 61_500);
    // The console's charts: whole minutes, ending with the current one.
    let hour = ob.activity(std::time::Duration::from_secs(300), 5).unwrap();
    let delivered: Vec<u64> = hour.buckets.iter().map(|b| b.delivered).collect();
    assert_eq!(delivered, [0, 0, 1, 3, 0]);
    assert_eq!(hour.buckets[2].start.timestamp_millis(), T0);
    assert_eq!(hour.buckets[3].max_latency_ms, Some(61_500));
    // A purge takes the minutes before its cutoff with their rows.
    clock.set(T0 + 3_600_000);
    ob.dismiss_dead_letters(Some("dead")).unwrap();
    let purged = ob.purge(crate::clock::to_datetime(T0 + 120_000)).unwrap();
    assert_eq!(purged.deliveries, 5);
    assert_eq!(counted(&agree(&ob, minute - 10)), [(2, 0, 1)]);
}

/// Finished replies are counted by the time they finished: delivered ones with their
/// enqueue-to-finish times, dead letters apart, unfinished and cancelled ones not at all.
pub(super) fn finished_replies_are_counted_by_time(fresh: Fresh) {
    let clock = ManualClock::new(T0);
    let ob = fresh(options(&clock));
    // Each on a channel of its own, sent when the clock says.
    let reply = |channel: &str| {
        ob.enqueue(&NewDelivery::single(channel, "a", "x"))
            .unwrap()
            .id
    };
    let send = |channel: &str, outcome: Outcome| {
        let claim = ob.claim_channels(&[channel], 1).unwrap().remove(0);
        ob.record(&claim, outcome).unwrap();
    };
    for channel in ["quick", "slow", "dead", "never"] {
        reply(channel);
    }
    let cancelled = reply("cancelled");
    ob.cancel(cancelled).unwrap();
    clock.set(T0 + 1_000);
    send("quick", Outcome::delivered(None));
    clock.set(T0 + 61_000);
    send("slow", Outcome::delivered(None));
    clock.set(T0 + 62_000);
    send(
        "dead",
        Outcome::from_error_text("Forbidden: bot was blocked by the user"),
    );
    let row = |bucket, delivered, failed, sum, max| ActivityRow {
        bucket,
        delivered,
        failed,
        latency_sum_ms: sum,
        latency_max_ms: max,
    };
    assert_eq!(
        write(&ob, |tx| tx.activity(T0, 60_000)),
        [row(0, 1, 0, 1_000, 1_000), row(1, 1, 1, 61_000, 61_000)]
    );
    // Counted from `since`, and nothing before it.
    assert_eq!(
        write(&ob, |tx| tx.activity(T0 + 1_001, 30_000)),
        [row(1, 1, 0, 61_000, 61_000), row(2, 0, 1, 0, 0)]
    );
    assert_eq!(write(&ob, |tx| tx.activity(T0 + 62_001, 1_000)), []);
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

/// The batched reads a store packs into single statements read what the primitive
/// they batch reads one at a time: each lane's head, each claim's chunk, and each
/// channel's due chunks (with the channels whose rate or pause keeps them out).
pub(super) fn batched_reads_agree_with_one_at_a_time(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    for (chat, text) in [
        ("a", "a1"),
        ("a", "a2"),
        ("b", "b1"),
        ("c", "c1"),
        ("c", "c2"),
    ] {
        enqueue(&ob, chat, text);
    }
    ob.enqueue(&NewDelivery::single("u", "d", "other channel"))
        .unwrap();
    let held = claim_one(&ob);
    write(&ob, |tx| {
        let lanes = [lane("a"), lane("b"), lane("c"), lane("nobody")];
        let one_by_one: Vec<_> = lanes
            .iter()
            .map(|l| tx.lane_head(*l))
            .collect::<crate::error::Result<_>>()?;
        assert_eq!(tx.lane_heads(&lanes)?, one_by_one, "lane_heads");
        assert!(one_by_one.iter().any(Option::is_some));

        let claims = [
            (held.chunk_id.0, held.token),
            (held.chunk_id.0, held.token + 1),
            (held.chunk_id.0 + CHUNK_STRIDE, 1),
        ];
        let one_by_one: Vec<_> = claims
            .iter()
            .map(|(id, token)| tx.claimed_chunk(*id, *token))
            .collect::<crate::error::Result<_>>()?;
        assert_eq!(tx.claimed_chunks(&claims)?, one_by_one, "claimed_chunks");
        assert!(one_by_one[0].is_some() && one_by_one[1].is_none());

        let seen = |due: Vec<(
            crate::store::ChannelRow,
            Option<Vec<crate::store::Candidate>>,
        )>| {
            due.into_iter()
                .map(|(row, chunks)| {
                    let chunks = chunks.map(|c| {
                        c.iter()
                            .map(|c| (c.chunk, c.delivery, c.due_at, c.row.is_ok()))
                            .collect::<Vec<_>>()
                    });
                    (row, chunks)
                })
                .collect::<Vec<_>>()
        };
        for paused in [false, true] {
            if paused {
                tx.pause_channel("t", T0 + 1_000)?;
            }
            for names in [None, Some(&["t", "u"][..]), Some(&["u"][..])] {
                for limit in [1, 10] {
                    let composed = crate::store::channel_rows(tx, names)?
                        .into_iter()
                        .map(|row| {
                            let due = if row.unpaced_and_free(T0) {
                                Some(tx.due_chunks(&row, T0, limit)?)
                            } else {
                                None
                            };
                            Ok((row, due))
                        })
                        .collect::<crate::error::Result<Vec<_>>>()?;
                    assert_eq!(
                        seen(tx.due_in_channels(names, T0, limit)?),
                        seen(composed),
                        "due_in_channels {names:?} {limit} paused {paused}"
                    );
                }
            }
        }

        // The only writer takes every lane it tries, batched or not.
        let batched = tx.try_lock_lanes(&lanes)?;
        let single: Vec<bool> = lanes
            .iter()
            .map(|l| tx.try_lock_lane(*l))
            .collect::<crate::error::Result<_>>()?;
        assert_eq!(batched, single, "try_lock_lanes");
        Ok(())
    });
}

/// Runs `mine` (a store's own version of a batched primitive) and `composed` (its
/// composition of the one-at-a-time primitives) from the same rows, each undone after:
/// both return the same and leave the same rows, which differ from the rows before.
fn same_both_ways<R: PartialEq + std::fmt::Debug>(
    tx: &dyn StoreTx,
    what: &str,
    mine: impl Fn() -> crate::error::Result<R>,
    composed: impl Fn() -> crate::error::Result<R>,
) -> crate::error::Result<()> {
    let before = tx.table_rows()?;
    let run = |f: &dyn Fn() -> crate::error::Result<R>| -> crate::error::Result<(R, Vec<String>)> {
        tx.begin_nested()?;
        let returned = f()?;
        let rows = tx.table_rows()?;
        tx.end_nested(false)?;
        Ok((returned, rows))
    };
    let (returned, rows) = run(&mine)?;
    let (expected, expected_rows) = run(&composed)?;
    assert_eq!(returned, expected, "{what}: what it returned");
    assert_ne!(rows, before, "{what} wrote nothing");
    assert_eq!(rows, expected_rows, "{what}: the rows it left");
    assert_eq!(tx.table_rows()?, before, "{what}: undone");
    Ok(())
}

/// The batched writes (`insert_deliveries`, `mark_sending_many`, `finalize_delivered`,
/// `activate_many`) leave the rows their composition of one-at-a-time writes leaves.
pub(super) fn batched_writes_leave_the_rows_one_at_a_time_leaves(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let a1 = enqueue(&ob, "a", "a1");
    enqueue(&ob, "a", "a2");
    let b1 = enqueue(&ob, "b", "b1");
    let b2 = ob
        .enqueue(&NewDelivery::chunked("t", "b", "b2b2", ["b2", "b2"]))
        .unwrap()
        .id;
    let c1 = ob
        .enqueue(&NewDelivery::chunked("t", "c", "c1c1", ["c1", "c1"]).with_sender("bot"))
        .unwrap()
        .id;
    let claims = ob.claim(10).unwrap();
    assert_eq!(claims.len(), 3, "the head of each lane");
    ob.enqueue(&NewDelivery::single("t", "z", "z1").with_idempotency_key("k-taken"))
        .unwrap();
    let chunk = |id: DeliveryId, index: i64| row(&ob, id) * CHUNK_STRIDE + index;
    write(&ob, |tx| {
        let pending = [(chunk(c1, 1), 7), (chunk(b2, 0), 8)];
        same_both_ways(
            tx,
            "mark_sending_many",
            || tx.mark_sending_many(&pending, T0, T0 + 30_000),
            || crate::store::composed::mark_sending_many(tx, &pending, T0, T0 + 30_000),
        )?;

        let channel_id = tx.channel_number("t")?;
        let first = tx.next_delivery_row()?;
        let replies = [
            NewDelivery::single("t", "d", "d1"),
            NewDelivery::single("t", "d", "d2"),
            NewDelivery::chunked("t", "e", "e1e1", ["e1", "e1"])
                .with_idempotency_key("k-e")
                .with_metadata("{}")
                .not_before(crate::clock::to_datetime(T0 + 5_000)),
            NewDelivery::chunked("t", "e", "e2e2", ["e2", "e2"]),
            // (its caller key taken, as by an application's transaction the key's lock
            // does not cover)
            NewDelivery::chunked("t", "f", "f1f1", ["f1", "f1"]).with_idempotency_key("k-taken"),
        ];
        let uids: Vec<String> = (first..)
            .take(replies.len())
            .map(|r| ob.new_delivery_id(r, T0).to_string())
            .collect();
        let rows: Vec<NewRow<'_>> = [
            (true, Some(T0), true),
            (false, None, false),
            (true, Some(T0 + 5_000), true),
            (false, None, true),
            (true, Some(T0), true),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, (active, head_due, chunk_rows))| NewRow {
            row: first + i as i64,
            uid: &uids[i],
            delivery: &replies[i],
            channel_id,
            active,
            now: T0,
            head_due,
            chunk_rows,
        })
        .collect();
        same_both_ways(
            tx,
            "insert_deliveries",
            || tx.insert_deliveries(&rows),
            || crate::store::composed::insert_deliveries(tx, &rows),
        )?;
        // The reply whose key is taken is not stored, nor are its chunks.
        let stored = |rows: &[NewRow<'_>]| -> crate::error::Result<_> {
            tx.begin_nested()?;
            let stored = tx.insert_deliveries(rows)?;
            let left = tx.table_rows()?;
            tx.end_nested(false)?;
            Ok((stored, left))
        };
        let (all, left) = stored(&rows)?;
        assert_eq!(all, [true, true, true, true, false], "insert_deliveries");
        assert_eq!(
            left,
            stored(&rows[..4])?.1,
            "a reply whose key is taken left rows"
        );

        let acks = [
            (chunk(a1, 0), row(&ob, a1), Some("p-a1")),
            (chunk(b1, 0), row(&ob, b1), None),
        ];
        let tallies = [ChannelTally {
            channel: "t",
            latest: T0,
            count: 2,
            latency_sum_ms: 10,
            latency_le: [1, 2, 2, 2, 2, 2],
        }];
        same_both_ways(
            tx,
            "finalize_delivered",
            || tx.finalize_delivered(&acks, &tallies, T0),
            || crate::store::composed::finalize_delivered(tx, &acks, &tallies, T0),
        )?;

        // With a1 and b1 finished, a2 (its chunk row stored now) and b2 head their lanes.
        crate::store::composed::finalize_delivered(tx, &acks, &tallies, T0)?;
        tx.pause_lane(lane("b"), T0 + 60_000)?;
        let lanes = [lane("a"), lane("b")];
        let heads: Vec<_> = tx
            .lane_heads(&lanes)?
            .into_iter()
            .zip(lanes)
            .zip([T0, T0 + 5_000])
            .map(|((head, lane), earliest)| match head {
                Some(HeadRow::Queued(waiting)) => Activation {
                    status: DeliveryStatus::Pending,
                    waiting,
                    lane,
                    earliest,
                },
                other => panic!("expected a queued head, got {other:?}"),
            })
            .collect();
        same_both_ways(
            tx,
            "activate_many",
            || tx.activate_many(&heads),
            || crate::store::composed::activate_many(tx, &heads),
        )
    });
}

/// [`LaneStore::advance_lanes`](crate::store::LaneStore::advance_lanes), where a store
/// does it in one go, leaves the rows the rules' composition
/// ([`lane::advance_lanes`](crate::lane::advance_lanes)) leaves, over lanes in
/// every state a head can be in and with every hold ([`LaneHold`](crate::lane::LaneHold)).
pub(super) fn advancing_lanes_in_one_go_leaves_what_the_rules_leave(fresh: Fresh) {
    use crate::lane::LaneHold;
    use crate::rules::LaneFailurePolicy;
    let clock = ManualClock::new(T0);
    // (Under `Block` the scene's own failures leave their lanes as they are.)
    let ob = fresh(options(&clock).with_lane_failure(LaneFailurePolicy::Block));
    let at = |ms: i64| crate::clock::to_datetime(T0 + ms);
    // busy: an active head; next: a head finished below, then queued replies (stored
    // without chunk rows); partial: a delayed reply with a chunk delivered, put back in
    // its lane below; later: a delayed reply behind a head; paused: the lane paused;
    // failed and unsure: a dead letter and an uncertain reply ahead of queued ones;
    // asked: an uncertain reply whose platform's answer is kept, ahead of a queued one;
    // idle: nothing at all.
    enqueue(&ob, "busy", "b1");
    enqueue(&ob, "busy", "b2");
    let n0 = enqueue(&ob, "next", "n0");
    let n1 = enqueue(&ob, "next", "n1");
    enqueue(&ob, "next", "n2");
    let p1 = ob
        .enqueue(&NewDelivery::chunked("t", "partial", "p1p1", ["p1", "p1"]).not_before(at(2_000)))
        .unwrap()
        .id;
    let l0 = enqueue(&ob, "later", "l0");
    let l1 = ob
        .enqueue(&NewDelivery::single("t", "later", "l1").not_before(at(5_000)))
        .unwrap()
        .id;
    let s0 = enqueue(&ob, "paused", "s0");
    let s1 = enqueue(&ob, "paused", "s1");
    enqueue(&ob, "failed", "f0");
    let f1 = enqueue(&ob, "failed", "f1");
    enqueue(&ob, "unsure", "u0");
    let u1 = enqueue(&ob, "unsure", "u1");
    let a0 = enqueue(&ob, "asked", "a0");
    let a1 = enqueue(&ob, "asked", "a1");
    clock.set(T0 + 2_000);
    for claim in ob.claim(20).unwrap() {
        let outcome = match claim.chat_id.as_str() {
            "partial" => Outcome::delivered(None),
            "failed" => Outcome::Permanent { error: "no".into() },
            "unsure" | "asked" => Outcome::Ambiguous { error: "?".into() },
            _ => continue,
        };
        ob.record(&claim, outcome).unwrap();
    }
    let since = ob
        .delivery(a0)
        .unwrap()
        .unwrap()
        .updated_at
        .timestamp_millis();
    assert!(write(&ob, |tx| tx.note_settlement(
        row(&ob, a0) * CHUNK_STRIDE,
        since,
        "held",
        None
    )));
    let lanes = [
        "asked", "busy", "failed", "idle", "later", "next", "partial", "paused", "unsure",
    ]
    .map(lane);
    write(&ob, |tx| {
        for finished in [n0, l0, s0] {
            tx.mark_finalized(row(&ob, finished), T0)?;
        }
        tx.set_queued(row(&ob, p1))?;
        tx.pause_lane(lane("paused"), T0 + 60_000)?;
        // The scene as the rules read it (the scene's own acks and failures advanced
        // their lanes through the store's way, which must have left them so).
        let queued = |id: DeliveryId, head_index: i64, not_before: Option<i64>| {
            Some(HeadRow::Queued(crate::store::Waiting {
                id: row(&ob, id),
                position: row(&ob, id),
                head_index,
                not_before,
            }))
        };
        assert_eq!(
            tx.lane_heads(&lanes)?,
            [
                queued(a1, 0, None),
                Some(HeadRow::Active),
                queued(f1, 0, None),
                None,
                queued(l1, 0, Some(T0 + 5_000)),
                queued(n1, 0, None),
                queued(p1, 1, Some(T0 + 2_000)),
                queued(s1, 0, None),
                queued(u1, 0, None),
            ],
            "the lanes' heads"
        );
        // Each hold on every lane, and the lanes held each their own way.
        let mut held = vec![
            [LaneHold::Nothing; 9],
            [LaneHold::Asking; 9],
            [LaneHold::Everything; 9],
        ];
        held.push(std::array::from_fn(|i| {
            [LaneHold::Nothing, LaneHold::Asking, LaneHold::Everything][i % 3]
        }));
        for holds in held {
            for earliest in [T0 + 1_000, T0 + 9_000] {
                same_both_ways(
                    tx,
                    &format!("advance_lanes {holds:?} from {earliest}"),
                    || {
                        // (A store that does not do it in one go leaves it to the rules.)
                        if !tx.advance_lanes(&lanes, &holds, earliest)? {
                            crate::lane::advance_lanes(tx, &lanes, &holds, earliest)?;
                        }
                        Ok(())
                    },
                    || crate::lane::advance_lanes(tx, &lanes, &holds, earliest),
                )?;
            }
        }
        Ok(())
    });
}

/// A finalization whose delivery is not stored is refused as the rules refuse it, with
/// every finalization of its batch: the store may answer fewer than asked (and the
/// rules refuse), or fail the transaction itself (by its commit at the latest).
pub(super) fn a_finalization_without_its_delivery_is_refused(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let id = enqueue(&ob, "a", "a1");
    let _sending = claim_one(&ob);
    let stored = (row(&ob, id) * CHUNK_STRIDE, row(&ob, id), Some("p-1"));
    let missing = (
        row(&ob, id) * CHUNK_STRIDE + 1_000_000 * CHUNK_STRIDE,
        row(&ob, id) + 1_000_000,
        None,
    );
    let tally = |count| ChannelTally {
        channel: "t",
        latest: T0,
        count,
        latency_sum_ms: 0,
        latency_le: [count; 6],
    };
    let before = write(&ob, |tx| tx.table_rows());
    let refused = ob.write(|tx, _| {
        let acks = [stored, missing];
        if tx.finalize_delivered(&acks, &[tally(2)], T0)? != acks.len() {
            return Err(crate::error::Error::invalid("delivery", "not stored"));
        }
        Ok(())
    });
    assert!(
        matches!(
            refused,
            Err(crate::error::Error::InvalidInput {
                what: "delivery",
                ..
            })
        ),
        "{refused:?}"
    );
    assert_eq!(
        write(&ob, |tx| tx.table_rows()),
        before,
        "nothing finalized"
    );
    // The same finalization without the missing one is taken.
    let n = write(&ob, |tx| tx.finalize_delivered(&[stored], &[tally(1)], T0));
    assert_eq!(n, 1);
    let finalized = write(&ob, |tx| tx.table_rows());
    assert_ne!(finalized, before);
    // A second copy is refused by the history's schema, not as a missing delivery.
    let again = ob.write(|tx, _| tx.finalize_delivered(&[stored], &[tally(1)], T0));
    assert!(
        matches!(&again, Err(e) if !matches!(e, crate::error::Error::InvalidInput { .. })),
        "{again:?}"
    );
    assert_eq!(write(&ob, |tx| tx.table_rows()), finalized);
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

/// Replies staged by an application's transaction are listed oldest first, per lane,
/// taken once, and found by the row they were staged as after they are stored as
/// another. A store without staged replies lists none and takes none.
pub(super) fn staged_replies_are_listed_taken_and_renumbered(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    enqueue(&ob, "a", "enqueued");
    write(&ob, |tx| {
        let replies = [("a", "s1"), ("b", "s2"), ("a", "s3")]
            .map(|(chat, text)| NewDelivery::single("t", chat, text).with_idempotency_key(text));
        let mut uids = Vec::new();
        for d in &replies {
            match tx.stage(d, T0)? {
                Some(uid) => uids.push(uid),
                None => {
                    assert!(tx.staged(10)?.is_empty());
                    assert!(tx.staged_in_lane(lane("a"))?.is_empty());
                    assert!(!tx.take_staged(1)?);
                    return Ok(());
                }
            }
        }
        let seen = |staged: Vec<crate::store::Staged>| {
            staged
                .into_iter()
                .map(|s| (s.uid, s.delivery))
                .collect::<Vec<_>>()
        };
        let all: Vec<_> = uids.iter().cloned().zip(replies.iter().cloned()).collect();
        let staged = tx.staged(10)?;
        let old = staged[0].row;
        assert_eq!(seen(staged), all, "staged");
        assert_eq!(seen(tx.staged(2)?), all[..2], "staged, at most 2");
        assert_eq!(
            seen(tx.staged_in_lane(lane("a"))?),
            [all[0].clone(), all[2].clone()],
            "staged in lane a"
        );
        assert!(tx.staged_in_lane(lane("c"))?.is_empty());

        assert!(tx.take_staged(old)?, "taken");
        assert!(!tx.take_staged(old)?, "taken once");
        assert_eq!(seen(tx.staged(10)?), all[1..], "the rest");
        assert_eq!(tx.find_by_key("t", "s1")?, None, "taken with its row");

        // Stored again as a new row of its lane, it is found by the row it was staged as.
        let new = tx.next_delivery_row()?;
        tx.insert_delivery(&NewRow {
            row: new,
            uid: &uids[0],
            delivery: &replies[0],
            channel_id: tx.channel_number("t")?,
            active: false,
            now: T0,
            head_due: None,
            chunk_rows: true,
        })?;
        assert_eq!(
            tx.delivery_state(old, &uids[0])?,
            None,
            "not yet renumbered"
        );
        tx.note_renumbered(old, new)?;
        let state = tx.delivery_state(old, &uids[0])?;
        assert_eq!(state.map(|s| s.0), Some(new), "renumbered");
        assert_eq!(tx.stored_content(old)?.text, "s1");
        Ok(())
    });
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

/// Makes one test of each contract for a store.
/// [`ProcessStore`](crate::store::ProcessStore): a process is added once and renewed
/// after; `processes` lists those seen since a time, oldest build first; a row long
/// gone is removed by the next note; a closed process is forgotten.
pub(super) fn processes_are_noted_renewed_pruned_and_forgotten(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let process = |id: &str, level: i64, seen_at: i64| crate::store::ProcessRow {
        id: id.into(),
        schema_level: level,
        release: format!("r{level}"),
        program: "bot".into(),
        host: "h".into(),
        pid: 7,
        started_at: T0,
        seen_at,
    };
    let ids = |rows: Vec<crate::store::ProcessRow>| -> Vec<(String, i64)> {
        rows.into_iter().map(|p| (p.id, p.seen_at)).collect()
    };
    // A shared store's handle registered itself: out of the way.
    write(&ob, |tx| tx.forget_process(&ob.claimant().to_string()));
    write(&ob, |tx| {
        tx.note_process(&process("new", 16, T0), 0)?;
        tx.note_process(&process("old", 15, T0 + 1), 0)?;
        // Renewed: only its `seen_at` moves.
        tx.note_process(&process("new", 99, T0 + 5), 0)
    });
    let read = |since| ob.read(|tx| tx.processes(since)).unwrap();
    let all = read(0);
    assert_eq!(
        ids(all.clone()),
        [("old".into(), T0 + 1), ("new".into(), T0 + 5)]
    );
    assert_eq!((all[1].schema_level, all[1].release.as_str()), (16, "r16"));
    assert_eq!(ids(read(T0 + 2)), [("new".into(), T0 + 5)]);
    // A note removes the rows seen before its cutoff first.
    write(&ob, |tx| {
        tx.note_process(&process("third", 16, T0 + 9), T0 + 2)
    });
    assert_eq!(
        ids(read(0)),
        [("new".into(), T0 + 5), ("third".into(), T0 + 9)]
    );
    write(&ob, |tx| tx.forget_process("new"));
    assert_eq!(ids(read(0)), [("third".into(), T0 + 9)]);
}

/// [`RuleStore::writable_from`](crate::store::RuleStore::writable_from) reads what the
/// migrations left, and a contract step raises it and names the release to upgrade to.
pub(super) fn the_oldest_writer_is_read_and_raised(fresh: Fresh) {
    let ob = fresh_at_t0(fresh);
    let first = ob.read(|tx| tx.writable_from()).unwrap();
    assert_eq!(first, ob.store().writable_from());
    assert!(first <= ob.schema_version());
    write(&ob, |tx| {
        tx.set_writable_from(first + 1, "chunked-outbox 9.9.9")
    });
    assert_eq!(ob.read(|tx| tx.writable_from()).unwrap(), first + 1);
}

macro_rules! conformance {
    ($store:ident, $fresh:expr) => {
        conformance!($store, $fresh, true);
    };
    ($store:ident, $fresh:expr, $available:expr) => {
        mod $store {
            use super::*;
            conformance!(@tests $fresh, $available;
                lane_positions_follow_insert_order,
                the_head_is_the_first_queued_when_nothing_is_active,
                a_lane_is_held_by_uncertain_and_unacknowledged_dead_letters,
                an_unasked_part_carries_the_platform_id_before_it,
                lane_due_times_wait_for_pauses_and_intervals,
                a_pause_pushes_the_lanes_due_chunks,
                due_chunks_come_in_due_order_up_to_the_limit,
                a_stale_token_is_refused,
                leases_are_marked_renewed_and_expire,
                a_queued_replys_chunk_is_supplied,
                keys_are_found_per_channel,
                channel_numbers_are_stable,
                a_version_taken_on_trust_is_the_stored_one,
                rules_read_back_as_stored,
                budgets_count_and_reset,
                nested_transactions_undo_or_keep,
                history_takes_a_delivery_once,
                unfinalized_are_those_with_every_chunk_delivered,
                purges_spare_the_newest_and_the_unfinished,
                corrupt_rows_are_failed_with_their_lane,
                activation_and_later_chunks_are_due_through_the_lane,
                a_held_delivery_is_queued_again,
                channel_pauses_and_slots,
                chunks_are_rescheduled,
                chunks_and_deliveries_are_set_aside,
                deliveries_count_and_finalize,
                channel_counters_add_up,
                statements_are_described_and_run,
                dead_letters_are_listed_and_acknowledged,
                cancels_remove_chunks,
                operator_lookups_match_row_and_uid,
                health_counts_unfinished_rows,
                dead_letters_are_counted_as_they_come_and_go,
                deliveries_are_viewed_listed_and_reported,
                finished_replies_are_counted_by_time,
                finished_replies_are_counted_per_minute_as_they_finish,
                idle_lanes_are_forgotten,
                the_only_writer_holds_every_lock,
                batched_reads_agree_with_one_at_a_time,
                batched_writes_leave_the_rows_one_at_a_time_leaves,
                a_finalization_without_its_delivery_is_refused,
                advancing_lanes_in_one_go_leaves_what_the_rules_leave,
                lanes_are_entered_as_their_reads_say,
                staged_replies_are_listed_taken_and_renumbered,
                uncertain_chunks_are_asked_about_once,
                processes_are_noted_renewed_pruned_and_forgotten,
                the_oldest_writer_is_read_and_raised,
            );
        }
    };
    (@tests $fresh:expr, $available:expr; $($contract:ident),* $(,)?) => {
        $(
            #[test]
            fn $contract() {
                // A store without its server is skipped (loudly; see `server`).
                if $available {
                    super::$contract($fresh);
                }
            }
        )*
    };
}

conformance!(sqlite, |options| Outbox::open_in_memory(options).unwrap());

#[cfg(feature = "postgres")]
use crate::store::test_server as server;

#[cfg(feature = "postgres")]
conformance!(
    postgres,
    |options| {
        let url = server::fresh_schema_url().expect("the test server");
        Outbox::connect(&url, options).unwrap()
    },
    server::server_url().is_some()
);
