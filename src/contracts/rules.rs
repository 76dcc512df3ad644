//! The stored rules and writers (`RuleStore`, `ProcessStore`): versions, channels, the
//! oldest writer, the registry.

use crate::rules::{ChannelPolicy, FileRules, LaneOrder, Rules};
use std::time::Duration;

use super::{Fresh, T0, fresh_at_t0, write};

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
