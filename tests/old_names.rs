//! The names the crate root held before the surface was grouped still build and mean
//! what they meant: code written against them keeps working (with a deprecation
//! warning that says where each name went).
#![allow(deprecated)]

use std::time::Duration;

use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};

#[test]
fn the_old_root_names_are_the_new_items() {
    // Types: the same type under both paths (a mismatch would not compile).
    let order: chunked_outbox::rules::LaneOrder = chunked_outbox::LaneOrder::Parallel;
    let status: chunked_outbox::monitoring::DeliveryStatus =
        chunked_outbox::DeliveryStatus::Pending;
    let channel: chunked_outbox::rules::ChannelPolicy =
        chunked_outbox::ChannelPolicy::default().with_lane_interval(Duration::from_secs(1));
    assert_eq!(order, chunked_outbox::rules::LaneOrder::Parallel);
    assert_eq!(status, chunked_outbox::monitoring::DeliveryStatus::Pending);
    assert_eq!(channel.lane_interval, Duration::from_secs(1));

    // Constants and functions give what the new paths give.
    assert_eq!(
        chunked_outbox::SCHEMA_VERSION,
        chunked_outbox::backends::sqlite::SCHEMA_VERSION
    );
    assert_eq!(
        chunked_outbox::COMPACT_KEY_LEN,
        chunked_outbox::ids::COMPACT_KEY_LEN
    );
    assert_eq!(
        chunked_outbox::FINALIZE_PARAMETERS,
        chunked_outbox::rules::FINALIZE_PARAMETERS
    );
    assert_eq!(
        chunked_outbox::LATENCY_BUCKETS,
        chunked_outbox::monitoring::LATENCY_BUCKETS
    );
    let id: chunked_outbox::DeliveryId = "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap();
    assert_eq!(
        chunked_outbox::chunk_idempotency_key(&id, 1),
        chunked_outbox::ids::chunk_idempotency_key(&id, 1)
    );
    assert_eq!(
        chunked_outbox::chunk_compact_key(&id, 1),
        chunked_outbox::ids::chunk_compact_key(&id, 1)
    );
    assert_eq!(
        chunked_outbox::chunk_key_uuid(&id, 1),
        chunked_outbox::ids::chunk_key_uuid(&id, 1)
    );
    let text = "Forbidden: bot was blocked by the user";
    assert_eq!(
        chunked_outbox::classify_error(text),
        chunked_outbox::platforms::classify_error(text)
    );
}

#[test]
fn the_old_method_names_do_what_the_new_ones_do() -> chunked_outbox::Result<()> {
    let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    let mut rules = outbox.rules()?;
    rules.lane_order = chunked_outbox::rules::LaneOrder::Parallel;
    outbox.set_rules(rules)?;
    // The old names read and write the same stored rules.
    let mut old: chunked_outbox::Policy = outbox.policy()?;
    assert_eq!(old.lane_order, chunked_outbox::LaneOrder::Parallel);
    old.lane_order = chunked_outbox::LaneOrder::Fifo;
    outbox.set_policy(old)?;
    assert_eq!(
        outbox.rules()?.lane_order,
        chunked_outbox::rules::LaneOrder::Fifo
    );

    outbox.enqueue(&NewDelivery::single("telegram", "42", "hello"))?;
    let claim = outbox.claim(1)?.pop().expect("a claim");
    outbox.record(
        &claim,
        Outcome::Permanent {
            error: "chat not found".into(),
        },
    )?;
    assert_eq!(outbox.health()?.totals.unacknowledged_dead_letters, 1);
    assert_eq!(outbox.acknowledge_dead_letters(None)?, 1);
    assert_eq!(outbox.health()?.totals.unacknowledged_dead_letters, 0);
    Ok(())
}
