//! Hostile input driven through the public API by proptest: arbitrary strings (NUL
//! bytes, control characters, quotes, SQL fragments, huge keys) for every field,
//! arbitrary chunk lists, limits and ids. Each call either does the right thing —
//! an accepted delivery round-trips byte for byte — or returns a typed error and writes
//! nothing. Nothing panics.

mod common;

use chunked_outbox::ids::ChunkId;
use chunked_outbox::maintenance::Resolution;
use chunked_outbox::monitoring::ListFilter;
use chunked_outbox::split::LengthUnit;
use chunked_outbox::{DeliveryId, Error, NewDelivery, Outbox, OutboxOptions, Splitter};
use common::*;
use proptest::prelude::*;

fn rows(outbox: &Outbox) -> (u64, u64) {
    let h = outbox.health().unwrap();
    (h.totals.total_deliveries, h.totals.pending_chunks)
}

fn nasty_string() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => any::<String>(),
        2 => "[ \\t\\n\\r]{0,4}",
        2 => Just("'; DROP TABLE messages; --".to_owned()),
        1 => Just("\0".to_owned()),
        1 => Just("\"quoted\" `tick` ?1 :name @p $x".to_owned()),
        1 => Just("k".repeat(10 * 1024)),
        1 => "[a-z]{1,12}",
    ]
}

fn delivery() -> impl Strategy<Value = NewDelivery> {
    (
        nasty_string(),
        nasty_string(),
        nasty_string(),
        proptest::collection::vec(nasty_string(), 0..4),
        proptest::option::of(nasty_string()),
        proptest::option::of(nasty_string()),
    )
        .prop_map(|(channel, chat, text, chunks, key, sender)| {
            let mut d = NewDelivery::chunked(channel, chat, text, chunks);
            if let Some(key) = key {
                d = d.with_idempotency_key(key);
            }
            if let Some(sender) = sender {
                d = d.with_sender(sender);
            }
            d
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn enqueue_accepts_exactly_or_refuses_without_writing(d in delivery()) {
        let outbox = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
        let before = rows(&outbox);
        match outbox.enqueue(&d) {
            Ok(enqueued) => {
                let v = outbox.delivery(enqueued.id).unwrap().expect("stored");
                let texts: Vec<&str> = v.chunks.iter().map(|c| c.text.as_str()).collect();
                let wanted: Vec<&str> = d.chunks().iter().map(String::as_str).collect();
                prop_assert_eq!(texts, wanted);
                // What a worker gets is exactly what was enqueued.
                let claim = outbox.claim(1).unwrap().pop().expect("due");
                prop_assert_eq!(&claim.text, &d.chunks()[0]);
            }
            Err(Error::InvalidInput { .. }) => prop_assert_eq!(rows(&outbox), before),
            Err(e) => prop_assert!(false, "unexpected error {:?}", e),
        }
    }

    #[test]
    fn ids_limits_and_filters_never_panic(
        text in any::<String>(),
        n in any::<i64>(),
        limit in any::<usize>(),
        channel in proptest::option::of(nasty_string()),
    ) {
        let outbox = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
        let _ = outbox.enqueue(&NewDelivery::single("telegram", "1", "x")).unwrap();
        match text.parse::<DeliveryId>() {
            Ok(id) => {
                prop_assert!(outbox.delivery(id).unwrap().is_none());
                let r = outbox.requeue_delivery(id);
                prop_assert!(matches!(r, Err(Error::DeliveryNotFound(_))), "{:?}", r);
            }
            Err(e) => prop_assert!(matches!(e, Error::InvalidInput { .. }), "unexpected {:?}", e),
        }
        let chunk = ChunkId::from(n);
        if n != 1 {
            let r = outbox.requeue_chunk(chunk);
            prop_assert!(matches!(r, Err(Error::ChunkNotFound(_))), "{:?}", r);
            let r = outbox.resolve_uncertain(chunk, Resolution::Resend);
            prop_assert!(matches!(r, Err(Error::ChunkNotFound(_))), "{:?}", r);
        }
        match outbox.claim(limit) {
            Ok(claims) => prop_assert!((1..=chunked_outbox::limits::MAX_CLAIM_BATCH).contains(&limit) && claims.len() <= 1),
            Err(e) => prop_assert!(matches!(e, Error::InvalidInput { what: "limit", .. }), "unexpected {:?}", e),
        }
        let mut filter = ListFilter::default().limit(limit);
        if let Some(channel) = channel {
            filter = filter.channel(channel);
        }
        match outbox.list(&filter) {
            Ok(found) => prop_assert!(found.len() <= 1),
            Err(e) => prop_assert!(matches!(e, Error::InvalidInput { .. }), "unexpected {:?}", e),
        }
    }

    #[test]
    fn splitter_never_panics_or_hangs(text in any::<String>(), limit in any::<usize>()) {
        for unit in [LengthUnit::Bytes, LengthUnit::Chars, LengthUnit::Utf16] {
            match Splitter::new(limit, unit).and_then(|s| s.split(&text)) {
                Ok(chunks) => prop_assert!(chunks.iter().all(|c| unit.len(c) <= limit && !c.trim().is_empty())),
                Err(e) => prop_assert!(matches!(e, Error::InvalidInput { .. }), "unexpected {:?}", e),
            }
        }
    }
}

stores! {

    fn a_ten_megabyte_reply_is_split_and_stored_or_refused_cleanly() -> chunked_outbox::Result<()> {
        let db = TestDb::default();
        let text = "A paragraph of a very long answer.\n\n".repeat(300_000); // ~10.5 MB
        let split = NewDelivery::split("discord", "1", text.clone(), &Splitter::discord())?;
        // The text plus its chunks is over the 16 MiB limit: refused, nothing written.
        let err = db.outbox.enqueue(&split).unwrap_err();
        assert!(
            matches!(err, Error::InvalidInput { what: "text", .. }),
            "{err:?}"
        );
        assert_eq!(rows(&db.outbox), (0, 0));
        // Half of it fits and round-trips.
        let half = &text[..text.len() / 2];
        let id = db
            .outbox
            .enqueue_text("discord", "1", half, &Splitter::discord())?
            .id;
        let v = view(&db.outbox, id);
        assert_eq!(v.text, half);
        assert_eq!(
            v.chunks
                .iter()
                .map(|c| c.text.as_str())
                .collect::<String>()
                .trim_end(),
            half.trim_end()
        );
        Ok(())
    }
}
