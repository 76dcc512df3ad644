//! The batched primitives, each against the one-at-a-time ones it stands for: the same rows
//! must result.

use crate::clock::ManualClock;
use crate::ids::{CHUNK_STRIDE, DeliveryId};
use crate::outcome::Outcome;
use crate::reply::NewDelivery;
use crate::status::DeliveryStatus;
use crate::store::{Activation, ChannelTally, HeadRow, NewRow};

use super::{
    Fresh, T0, claim_one, enqueue, fresh_at_t0, lane, options, row, same_both_ways, write,
};

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
/// every state a head can be in and with every hold ([`LaneHold`](crate::rules::LaneHold)).
pub(super) fn advancing_lanes_in_one_go_leaves_what_the_rules_leave(fresh: Fresh) {
    use crate::rules::LaneFailurePolicy;
    use crate::rules::LaneHold;
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
