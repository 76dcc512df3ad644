//! The read primitives (`ReadStore`): health, views and listings, counts over time.

use crate::clock::ManualClock;
use crate::ids::{CHUNK_STRIDE, DeliveryId};
use crate::outbox::Outbox;
use crate::outcome::Outcome;
use crate::reply::NewDelivery;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::ActivityRow;

use super::{Fresh, T0, claim_one, enqueue, fresh_at_t0, options, row, view, write};

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
