//! The delivery primitives (`DeliveryStore`, nested transactions): keys, staged replies.

use crate::reply::NewDelivery;
use crate::store::NewRow;

use super::{Fresh, T0, enqueue, fresh_at_t0, lane, row, write};

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
