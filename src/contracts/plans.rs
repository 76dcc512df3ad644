//! Plan tests of the PostgreSQL store: its statements read what they are about through an index —
//! never a sequential scan, or a scan of a whole index, of the deliveries, chunks,
//! history or lanes — beside a
//! history of delivered rows, with fresh planner statistics and with stale ones (the
//! history added after the last ANALYZE, autovacuum off), in the generic plan a
//! prepared statement settles on.

use crate::options::OutboxOptions;
use crate::outbox::Outbox;
use crate::reply::NewDelivery;
use crate::store::postgres::chunks::{
    CLAIM_SQL, CLAIMED_MANY_SQL, CLAIMED_SQL, DUE_IN_CHANNELS_SQL, EXPIRED_SQL, LOAD_CHUNK_SQL,
    MARK_SENDING_MANY_SQL, NEXT_DUE_SQL,
};
use crate::store::postgres::deliveries::{
    FINALIZE_DELIVERED_SQL, HISTORY_SQL, INSERT_SQL, SWEEP_SQL,
};
use crate::store::postgres::lanes::{
    ACTIVATE_MANY_SQL, ADVANCE_SQL, ENTER_SQL, HEAD_SQL, HEADS_SQL, HELD_SQL, PAUSE_DUE_SQL,
    QUEUED_ALL_SQL,
};
use crate::store::postgres::locks::{LOCK_LANES, TRY_LOCK_LANES};
use crate::store::postgres::operator::{DEAD_LETTER_CHUNKS_SQL, UNASKED_SQL};
use crate::store::postgres::reads::{
    ACTIVITY_MINUTES_SQL, DEAD_LETTER_COUNTS_SQL, OPEN_CHUNKS_SQL, OPEN_DELIVERIES_SQL,
};

use crate::store::test_server as server;

/// Delivered replies in the fixture's history.
const HISTORY: i64 = 100_000;
/// Dead letters beside them.
const DEAD_LETTERS: i64 = 20_000;

/// Each statement with arguments for its parameters, and whether its primitive runs it
/// on the indexes (`PgTx::on_indexes`).
const STATEMENTS: &[(&str, &str, &str, bool)] = &[
    ("claim", CLAIM_SQL, "1, 0, 64", false),
    ("due in channels", DUE_IN_CHANNELS_SQL, "NULL, 0, 64", false),
    (
        "due in a channel",
        DUE_IN_CHANNELS_SQL,
        "'{t}', 0, 64",
        false,
    ),
    ("next due", NEXT_DUE_SQL, "1", false),
    ("expired leases", EXPIRED_SQL, "1, 0", false),
    ("claimed chunk", CLAIMED_SQL, "5, 0, 7", false),
    (
        "claimed chunks",
        CLAIMED_MANY_SQL,
        "'{5,6}', '{0,0}', '{7,8}'",
        false,
    ),
    (
        "mark sending",
        MARK_SENDING_MANY_SQL,
        "'{5,6}', '{0,0}', '{7,8}', 0, 0",
        false,
    ),
    (
        "finalize",
        FINALIZE_DELIVERED_SQL,
        "'{5,6}', '{0,0}', '{a,b}', 0, '{t}', '{0}', '{2}', '{0}', '{2}', '{2}', '{2}', \
         '{2}', '{2}', '{2}'",
        false,
    ),
    ("lane heads", HEADS_SQL, "'{t,t}', '{c1,c2}'", false),
    (
        "activate",
        ACTIVATE_MANY_SQL,
        "'{5,6}', '{0,0}', '{0,0}', '{t,t}', '{c1,c2}', '{pending,partial}'",
        false,
    ),
    (
        "advance lanes",
        ADVANCE_SQL,
        "'{t,t}', '{c1,c2}', 0, '{t,t}', '{f,t}'",
        false,
    ),
    ("enter lanes", ENTER_SQL, "'{t,t}', '{c1,c2}', 2", false),
    (
        "insert",
        INSERT_SQL,
        "'{900001}', '{u}', '{t}', '{c1}', '{NULL}', '{k}', '{pending}', '{1}', '{0}', '{x}', \
         '{NULL}', '{NULL}', '{900001}', '{0}', '{0}', '{NULL}', '{1}'",
        false,
    ),
    ("lock lanes", LOCK_LANES, "'{t,t}', '{c1,c2}'", false),
    (
        "try lock lanes",
        TRY_LOCK_LANES,
        "'{t,t}', '{c1,c2}'",
        false,
    ),
    ("load chunk", LOAD_CHUNK_SQL, "5, 0", false),
    ("lane head", HEAD_SQL, "'t', 'c1'", false),
    ("lane held", HELD_SQL, "'t', 'c1', false", false),
    ("lane held, blocking", HELD_SQL, "'t', 'c1', true", false),
    ("pause", PAUSE_DUE_SQL, "'t', 'c1', 0", false),
    ("history", HISTORY_SQL, "5, 0", false),
    ("queued", QUEUED_ALL_SQL, "", true),
    ("sweep", SWEEP_SQL, "", true),
    ("dead letters", DEAD_LETTER_CHUNKS_SQL, "NULL", true),
    ("unasked uncertain parts", UNASKED_SQL, "'t', 16", true),
    ("open deliveries", OPEN_DELIVERIES_SQL, "", true),
    ("open chunks", OPEN_CHUNKS_SQL, "0", true),
    ("dead letter counts", DEAD_LETTER_COUNTS_SQL, "", true),
    (
        "dead letters of a channel",
        DEAD_LETTER_CHUNKS_SQL,
        "'t'",
        true,
    ),
    ("a day's minutes", ACTIVITY_MINUTES_SQL, "0, 1440", false),
];

/// The plan `explain` prints, as JSON.
fn json_plan(client: &mut impl postgres::GenericClient, explain: &str) -> serde_json::Value {
    let rows = client.simple_query(explain).unwrap();
    let text = rows
        .iter()
        .find_map(|m| match m {
            postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .expect("a plan");
    serde_json::from_str(&text).unwrap()
}

/// Every scan node of a JSON plan: (node type, relation). An index scan with no
/// condition on the index reads all of it, and is named a "Full Index Scan" unless the
/// index holds unfinished work only.
fn scans(plan: &serde_json::Value, out: &mut Vec<(String, String)>) {
    if let Some(node) = plan.get("Node Type").and_then(|v| v.as_str()) {
        let relation = plan.get("Relation Name").and_then(|v| v.as_str());
        // The partial indexes of unfinished work are as small as that work (staged
        // replies live until a claim or enqueue starts them); those of the dead letters
        // hold them and nothing else, for a statement over every dead letter.
        let partial = matches!(
            plan.get("Index Name").and_then(|v| v.as_str()),
            Some(
                "outbound_deliveries_open"
                    | "outbound_delivery_chunks_due"
                    | "outbound_deliveries_staged"
                    | "outbound_deliveries_dead"
                    | "outbound_deliveries_dead_newest"
            )
        );
        let unbounded = matches!(node, "Index Scan" | "Index Only Scan")
            && plan.get("Index Cond").is_none()
            && !partial;
        let node = if unbounded { "Full Index Scan" } else { node };
        out.push((node.to_owned(), relation.unwrap_or_default().to_owned()));
    }
    for child in plan
        .get("Plans")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
    {
        scans(child, out);
    }
}

/// The sequential scans of outbox tables in each statement's generic plan.
fn full_scans(url: &str) -> Vec<String> {
    let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
    client
        .batch_execute(
            "SET jit = off; SET max_parallel_workers_per_gather = 0;
             SET plan_cache_mode = force_generic_plan",
        )
        .unwrap();
    let mut found = Vec::new();
    for (i, (name, sql, args, on_indexes)) in STATEMENTS.iter().enumerate() {
        let mut tx = client.transaction().unwrap();
        if *on_indexes {
            tx.batch_execute(
                "SET LOCAL enable_seqscan = off; SET LOCAL enable_mergejoin = off;
                 SET LOCAL enable_hashjoin = off",
            )
            .unwrap();
        }
        tx.batch_execute(&format!("PREPARE p{i} AS {sql}")).unwrap();
        let execute = if args.is_empty() {
            format!("EXPLAIN (FORMAT JSON) EXECUTE p{i}")
        } else {
            format!("EXPLAIN (FORMAT JSON) EXECUTE p{i}({args})")
        };
        whole_reads(name, &json_plan(&mut tx, &execute), &mut found);
        tx.rollback().unwrap();
    }
    found
}

/// Adds a few unfinished replies, `HISTORY` delivered ones and `DEAD_LETTERS`.
fn grow(outbox: &Outbox, client: &mut postgres::Client) {
    for chat in 0..20 {
        outbox
            .enqueue(&NewDelivery::single("t", format!("c{chat}"), "x"))
            .unwrap();
    }
    client
        .execute(
            "WITH d AS (
                 INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status,
                     chunk_count, delivered_count, created_at, updated_at, finished_at, text)
                 SELECT nextval('outbound_deliveries_id_seq'), gen_random_uuid()::text, 't',
                        'c' || (i % 5000), 'delivered', 1, 1, 0, 0, 0, 'h'
                 FROM generate_series(1, $1::bigint) AS i
                 RETURNING id, uid, chat_id),
             c AS (
                 INSERT INTO outbound_delivery_chunks (delivery_id, chunk_index, status,
                     attempts, channel_id)
                 SELECT id, 0, 'delivered', 1, 1 FROM d),
             l AS (
                 INSERT INTO outbound_lanes (channel, chat_id)
                 SELECT DISTINCT 't', chat_id FROM d ON CONFLICT DO NOTHING)
             INSERT INTO outbound_messages (delivery_id, channel, chat_id, content,
                 chunk_count, created_at, delivered_at)
             SELECT uid, 't', chat_id, 'h', 1, 0, 0 FROM d",
            &[&HISTORY],
        )
        .unwrap();
    // Dead letters piled up beside them, as every user who blocked the bot leaves one.
    client
        .execute(
            "WITH d AS (
                 INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status,
                     chunk_count, delivered_count, created_at, updated_at, finished_at, text)
                 SELECT nextval('outbound_deliveries_id_seq'), gen_random_uuid()::text, 't',
                        'gone' || i, 'failed', 1, 0, 0, 0, 0, 'h'
                 FROM generate_series(1, $1::bigint) AS i
                 RETURNING id)
             INSERT INTO outbound_delivery_chunks (delivery_id, chunk_index, status,
                 attempts, channel_id)
             SELECT id, 0, 'failed', 1, 1 FROM d",
            &[&DEAD_LETTERS],
        )
        .unwrap();
    // A month of minutes counted, by four connections.
    client
        .batch_execute(
            "INSERT INTO outbound_activity (minute, shard, delivered)
             SELECT m, s, 1 FROM generate_series(0, 43199) AS m, generate_series(0, 3) AS s",
        )
        .unwrap();
}

/// The outbox's own tables (a bare `ANALYZE` would also analyze the schemas of the
/// tests running beside this one, and change their plans under them).
const ANALYZE_OUTBOX: &str = "ANALYZE outbound_deliveries, outbound_delivery_chunks,
     outbound_messages, outbound_lanes, outbound_activity";

/// Statistics taken now and kept: autovacuum off for the outbox's tables, then ANALYZE.
const FREEZE_STATISTICS: &str = "ALTER TABLE outbound_deliveries SET (autovacuum_enabled = off);
     ALTER TABLE outbound_delivery_chunks SET (autovacuum_enabled = off);
     ALTER TABLE outbound_messages SET (autovacuum_enabled = off);
     ALTER TABLE outbound_lanes SET (autovacuum_enabled = off);
     ALTER TABLE outbound_activity SET (autovacuum_enabled = off);
     ANALYZE outbound_deliveries, outbound_delivery_chunks, outbound_messages, outbound_lanes,
         outbound_activity";

/// An outbox with `HISTORY` delivered replies and a few unfinished ones, its tables'
/// statistics taken before the history was added (`stale`) or after.
fn fixture(stale: bool) -> Option<String> {
    let url = server::fresh_schema_url()?;
    let outbox = Outbox::connect(&url, OutboxOptions::default()).unwrap();
    let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    if stale {
        client.batch_execute(FREEZE_STATISTICS).unwrap();
    }
    grow(&outbox, &mut client);
    if !stale {
        client.batch_execute(ANALYZE_OUTBOX).unwrap();
    }
    Some(url)
}

#[test]
fn no_statement_reads_a_whole_table_with_fresh_or_stale_statistics() {
    if server::server_url().is_none() {
        return;
    }
    for stale in [false, true] {
        let url = fixture(stale).unwrap();
        let found = full_scans(&url);
        assert!(
            found.is_empty(),
            "{} statistics: {found:#?}",
            if stale { "stale" } else { "fresh" }
        );
    }
}

/// The sequential scans and whole-index scans of outbox tables in `plan`.
fn whole_reads(name: &str, plan: &serde_json::Value, found: &mut Vec<String>) {
    let mut nodes = Vec::new();
    scans(&plan[0]["Plan"], &mut nodes);
    for (node, relation) in nodes {
        let ours = relation.starts_with("outbound_")
            && !matches!(
                relation.as_str(),
                "outbound_policy"
                    | "outbound_channels"
                    | "outbound_channel_stats"
                    | "outbound_dead_letter_counts"
            );
        if matches!(node.as_str(), "Seq Scan" | "Full Index Scan") && ours {
            found.push(format!("{name}: {node} on {relation}"));
        }
    }
}

/// A write's generic plan is made once per connection and kept until the statistics of
/// its tables change. Made on empty tables (a new outbox) it may read whole indexes —
/// everything costs nothing there — so it must not outlive them: once the tables have
/// grown and are analyzed (autovacuum analyzes a table after 50 changed rows and 10 %
/// of it), every write's cached plan is made again and reads through the indexes.
#[test]
fn write_plans_made_on_empty_tables_are_made_again_once_the_tables_grow() {
    let Some(url) = server::fresh_schema_url() else {
        return;
    };
    let outbox = Outbox::connect(&url, OutboxOptions::default()).unwrap();
    let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    client.batch_execute(FREEZE_STATISTICS).unwrap();
    let explain = |client: &mut postgres::Client, found: &mut Vec<String>| {
        let mut tx = client.transaction().unwrap();
        // How a write plans (see `Begins`).
        tx.batch_execute("SELECT * FROM outbound_begin('shared', 5000, 10000)")
            .unwrap();
        for (i, (name, _, args, _)) in STATEMENTS.iter().enumerate() {
            let execute = if args.is_empty() {
                format!("EXPLAIN (FORMAT JSON) EXECUTE w{i}")
            } else {
                format!("EXPLAIN (FORMAT JSON) EXECUTE w{i}({args})")
            };
            whole_reads(name, &json_plan(&mut tx, &execute), found);
        }
        tx.rollback().unwrap();
    };
    for (i, (_, sql, _, _)) in STATEMENTS.iter().enumerate() {
        client
            .batch_execute(&format!("PREPARE w{i} AS {sql}"))
            .unwrap();
    }
    // Plan (and cache) every statement on the empty tables, then grow them as
    // autovacuum would see them grow.
    explain(&mut client, &mut Vec::new());
    grow(&outbox, &mut client);
    client.batch_execute(ANALYZE_OUTBOX).unwrap();
    let mut found = Vec::new();
    explain(&mut client, &mut found);
    assert!(found.is_empty(), "{found:#?}");
}

/// The check can fail: a statement that filters the history by an unindexed column
/// reads the whole table.
#[test]
fn a_statement_without_an_index_is_caught() {
    let Some(url) = fixture(false) else {
        return;
    };
    let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let plan = json_plan(
        &mut client,
        "EXPLAIN (FORMAT JSON) SELECT id FROM outbound_deliveries WHERE text = 'h'",
    );
    let mut nodes = Vec::new();
    scans(&plan[0]["Plan"], &mut nodes);
    assert!(
        nodes
            .iter()
            .any(|(node, relation)| node == "Seq Scan" && relation == "outbound_deliveries"),
        "{nodes:?}"
    );
}
