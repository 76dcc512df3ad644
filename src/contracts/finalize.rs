//! The finalization primitives (`FinalizeStore`, `StoreTx::finalize_delivered`): history
//! once, counters, the application's statement.

use crate::clock::ManualClock;
use crate::ids::CHUNK_STRIDE;
use crate::outbox::Outbox;
use crate::outcome::Outcome;
use crate::reply::NewDelivery;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::{ActivityRow, ChannelTally};

use super::{Fresh, T0, claim_one, enqueue, fresh_at_t0, options, row, view, write};

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
