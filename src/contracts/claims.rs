//! The claim primitives (`ClaimStore`): due chunks, fencing tokens, leases, channel slots.

use crate::clock::ManualClock;
use crate::outcome::Outcome;
use crate::rules::ChannelPolicy;
use crate::status::ChunkStatus;

use super::{Fresh, T0, channel_t, claim_one, enqueue, fresh_at_t0, options, write};

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
