//! The chunk primitives (`ChunkStore`): supplying, budgets, rescheduling, setting aside.

use crate::clock::ManualClock;
use crate::ids::CHUNK_STRIDE;
use crate::reply::NewDelivery;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::ChunkProgress;

use super::{Fresh, T0, channel_t, claim_one, enqueue, fresh_at_t0, options, row, view, write};

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
