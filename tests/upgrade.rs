//! Rolling upgrades: the registry of processes that write an outbox, each with its
//! build, and the contract step that waits for the older ones (docs/OPERATING.md
//! "Upgrades"). The mixed-version run across a real migration is `outbox-lab torture
//! --upgrade-from`, run by `.ci/run`.

mod common;

use chunked_outbox::{OutboxOptions, Result};
use common::*;

/// What this build says of itself.
fn this_release(outbox: &chunked_outbox::Outbox) -> String {
    format!(
        "chunked-outbox {} (schema {})",
        env!("CARGO_PKG_VERSION"),
        outbox.schema_version()
    )
}

stores! {
    /// Each handle that may write says which build it is, and leaves when its last
    /// clone goes; health shows the builds writing.
    fn writing_handles_say_which_build_they_are() -> Result<()> {
        let db = TestDb::default();
        let second = db.reopen(OutboxOptions::default());
        let release = this_release(&db.outbox);
        let live = db.outbox.processes()?;
        assert_eq!(live.len(), 2, "{live:?}");
        for p in &live {
            assert_eq!(p.schema_level, db.outbox.schema_version());
            assert_eq!(p.release, release);
            assert_eq!(p.pid, i64::from(std::process::id()));
            assert!(!p.program.is_empty() && !p.host.is_empty(), "{p:?}");
        }
        let mut ids: Vec<String> = live.iter().map(|p| p.id.clone()).collect();
        ids.sort();
        let mut expected = vec![db.outbox.claimant().to_string(), second.claimant().to_string()];
        expected.sort();
        assert_eq!(ids, expected);
        let health = db.outbox.health()?;
        assert_eq!(health.builds(), vec![(release.as_str(), 2)]);
        assert!(
            health
                .to_prometheus()
                .contains(&format!("outbox_processes{{release=\"{release}\"}} 2")),
        );
        let clone = second.clone();
        drop(second);
        assert_eq!(db.outbox.processes()?.len(), 2, "a clone still holds it");
        drop(clone);
        let live = db.outbox.processes()?;
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].id, db.outbox.claimant().to_string());
        Ok(())
    }
}

/// A read-only handle does not register; a process killed leaves its row, which counts
/// no longer once it has not been seen for a lease.
#[test]
fn a_killed_process_lapses_and_a_reader_never_registers() -> Result<()> {
    let db = TestDb::default();
    let options = OutboxOptions::default().with_clock(std::sync::Arc::new(db.clock.clone()));
    let reader = chunked_outbox::Outbox::open_read_only(db.path(), options)?;
    assert_eq!(reader.processes()?.len(), 1);
    let lease = chunked_outbox::registry::PROCESS_LEASE.as_millis() as i64;
    db.raw().execute(
        "UPDATE outbound_processes SET seen_at = seen_at - ?1",
        [lease + 1],
    )?;
    assert!(db.outbox.processes()?.is_empty(), "gone past its lease");
    Ok(())
}

/// `outbox migrate` takes a contract step only when no process of an older build is
/// live: while one is, it lists it, names the release to upgrade it to, exits 1 and
/// changes nothing; `--force` takes the step, and the older process's writes are
/// refused from then on. (`contract_step` makes this build's schema a contract step.)
#[cfg(all(feature = "cli", feature = "sabotage"))]
#[test]
fn migrate_waits_for_older_processes_before_a_contract_step() -> Result<()> {
    let db = TestDb::on_system_clock(OutboxOptions::default());
    let level = db.outbox.schema_version();
    let writable_from = |db: &TestDb| -> i64 {
        db.raw()
            .query_row("SELECT writable_from FROM outbound_policy", [], |r| {
                r.get(0)
            })
            .unwrap()
    };
    let before = writable_from(&db);
    assert!(
        before < level,
        "this build's schema is no contract step of its own"
    );
    // A live process of an older build, as it registers itself.
    let now = chrono::Utc::now().timestamp_millis();
    db.raw().execute(
        "INSERT INTO outbound_processes
             (id, schema_level, release, program, host, pid, started_at, seen_at)
         VALUES ('older', ?1, 'chunked-outbox 0.0.9 (schema 14)', 'old-bot', 'box-2', 4242, ?2, ?2)",
        rusqlite::params![level - 1, now],
    )?;
    let migrate = |force: bool| {
        let mut command = assert_cmd::Command::cargo_bin("outbox").unwrap();
        command
            .arg("--db")
            .arg(db.path())
            .arg("migrate")
            .env("OUTBOX_SABOTAGE", "contract_step");
        if force {
            command.arg("--force");
        }
        command.output().unwrap()
    };
    let waiting = migrate(false);
    let said = String::from_utf8_lossy(&waiting.stderr);
    assert_eq!(waiting.status.code(), Some(1), "{said}");
    assert!(said.contains("contract step refused"), "{said}");
    assert!(
        said.contains("chunked-outbox 0.0.9 (schema 14)  old-bot pid 4242 on box-2"),
        "{said}"
    );
    assert!(
        said.contains(&format!("upgrade them to {}", this_release(&db.outbox))),
        "{said}"
    );
    assert_eq!(writable_from(&db), before, "nothing changed");
    let listed = String::from_utf8_lossy(&waiting.stdout);
    assert!(listed.contains("old-bot pid 4242"), "{listed}");

    // A process of an older build gone past its lease holds nothing back.
    let lapsed = TestDb::on_system_clock(OutboxOptions::default());
    let lease = chunked_outbox::registry::PROCESS_LEASE.as_millis() as i64;
    lapsed.raw().execute(
        "INSERT INTO outbound_processes
             (id, schema_level, release, program, host, pid, started_at, seen_at)
         VALUES ('gone', ?1, 'chunked-outbox 0.0.9 (schema 14)', 'old-bot', 'box-3', 4343, ?2, ?2)",
        rusqlite::params![level - 1, now - lease - 1_000],
    )?;
    let taken = assert_cmd::Command::cargo_bin("outbox")
        .unwrap()
        .arg("--db")
        .arg(lapsed.path())
        .arg("migrate")
        .env("OUTBOX_SABOTAGE", "contract_step")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&taken.stdout);
    assert!(taken.status.success(), "{said}");
    assert!(said.contains("contract step taken"), "{said}");
    assert!(!said.contains("old-bot"), "{said}");
    assert_eq!(writable_from(&lapsed), level);

    let forced = migrate(true);
    let said = String::from_utf8_lossy(&forced.stdout);
    assert!(forced.status.success(), "{said}");
    assert!(
        said.contains("forced: 1 process of older builds can no longer write"),
        "{said}"
    );
    assert_eq!(writable_from(&db), level);
    Ok(())
}

/// The console's overview says which builds write the outbox.
#[cfg(feature = "console")]
#[test]
fn the_console_shows_the_builds_writing() {
    use chunked_outbox::console::{Console, Request};
    let db = TestDb::default();
    let _second = db.reopen(OutboxOptions::default());
    let page = Console::new(db.outbox.clone()).respond(&Request::get("/console").from_owner());
    assert_eq!(page.status, 200);
    let release = this_release(&db.outbox);
    assert!(
        page.body
            .contains(&format!("Builds writing: {release} (2).")),
        "{}",
        page.body
    );
}
