//! The adapter end to end: a slack-morphism client pointed at an emulated Slack Web API
//! on 127.0.0.1 that enforces Slack's documented behaviour for `chat.postMessage` —
//! text of at most 40,000 characters, `ratelimited` with a `Retry-After` header, unknown
//! and archived channels, bad and deactivated tokens, `internal_error`, a post that is
//! made but never answered — and every outcome recorded in a real outbox. It keeps each
//! post's message metadata and answers `conversations.history` and
//! `conversations.replies` (`oldest`, `include_all_metadata`, pages of `limit` with a
//! cursor), so a possibly-sent part can be looked up: found, absent, or a lookup that
//! fails. Its history methods can be rate-limited as Slack's tiers limit them: Tier 1
//! (one request a minute, 15 messages a page, for apps outside the Marketplace since
//! 2025) and Tier 3 (50 a minute), on a clock the test moves.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunked_outbox::clock::ManualClock;
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::platforms::slack::slack_morphism::SlackAdapter;
use chunked_outbox::rules::{Backoff, ChannelPolicy, LaneOrder, RetryPolicy};
use chunked_outbox::{AsyncDispatcher, DeliveryId, NewDelivery, Outbox, OutboxOptions};
use common::emulator;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};
use slack_morphism::prelude::*;

const TOKEN: &str = "xoxb-good";

/// One post the emulator accepted.
#[derive(Debug, Clone)]
struct Posted {
    channel: String,
    body: Value,
    ts: String,
}

/// What the emulated Web API holds: the posts, and the channels whose first post it
/// swallowed.
#[derive(Default)]
struct State {
    posted: Vec<Posted>,
    swallowed: std::collections::HashSet<String>,
    /// History reads (`conversations.history` and `.replies`) answered, rate-limited
    /// or not, and those answered with a page.
    lookups: usize,
    pages: usize,
    /// The rate tier of the history methods, on `clock`, with the times (ms) of the
    /// reads it let through; none: unlimited.
    tier: Option<(Tier, ManualClock)>,
    reads_at: Vec<i64>,
}

/// A Slack rate tier of the history methods: requests a minute, and messages a page.
#[derive(Clone, Copy)]
struct Tier {
    per_minute: usize,
    page: usize,
}

/// Tier 1, what `conversations.history` and `.replies` allow an app outside the
/// Marketplace since 2025: one request a minute, at most 15 messages a page.
const TIER_1: Tier = Tier {
    per_minute: 1,
    page: 15,
};
/// Tier 3 (Marketplace apps): 50 requests a minute, pages of up to 999 messages.
const TIER_3: Tier = Tier {
    per_minute: 50,
    page: 999,
};

/// The seconds to wait before the next history read, if the tier refuses one now;
/// otherwise the read is counted.
fn over_the_tier(state: &Mutex<State>) -> Option<u64> {
    let mut s = state.lock().unwrap();
    let (tier, clock) = s.tier.clone()?;
    let now = chunked_outbox::clock::Clock::now_ms(&clock);
    s.reads_at.retain(|at| now - at < 60_000);
    if s.reads_at.len() >= tier.per_minute {
        let free_at = s.reads_at[0] + 60_000;
        return Some(((free_at - now) as u64).div_ceil(1000));
    }
    s.reads_at.push(now);
    None
}

/// The emulated Web API. Channels choose the behaviour: C404 does not exist, CARCH is
/// archived, C429 is rate limited (3 s), C500 fails inside Slack, C777 posts and answers
/// too late; CLOST, CBROKEN and CBUSY read their first post and answer nothing (nothing
/// is posted), CBROKEN's history fails with `internal_error` and CBUSY's is rate-limited
/// (429, `Retry-After: 30`). The token
/// `xoxb-inactive` belongs to a deactivated account.
struct SlackApi {
    url: String,
    state: Arc<Mutex<State>>,
}

impl SlackApi {
    fn start() -> SlackApi {
        SlackApi::start_with(State::default())
    }

    /// An API whose history methods are rate-limited by `tier` on `clock`.
    fn start_tier(tier: Tier, clock: &ManualClock) -> SlackApi {
        SlackApi::start_with(State {
            tier: Some((tier, clock.clone())),
            ..State::default()
        })
    }

    fn start_with(state: State) -> SlackApi {
        let state = Arc::new(Mutex::new(state));
        let url = format!("{}/api", emulator::serve(state.clone(), answer));
        SlackApi { url, state }
    }

    /// Another user's message in `channel`, now.
    fn chatter(&self, channel: &str, n: usize) {
        let mut s = self.state.lock().unwrap();
        for i in 0..n {
            let ts = next_ts(&s.posted);
            s.posted.push(Posted {
                channel: channel.into(),
                body: json!({"channel": channel, "text": format!("chatter {i}")}),
                ts,
            });
        }
    }

    fn adapter(&self, token: &str) -> SlackAdapter<SlackClientHyperConnector<HttpConnector>> {
        adapter_at(&self.url, token)
    }

    fn posted(&self) -> Vec<Posted> {
        self.state.lock().unwrap().posted.clone()
    }

    fn lookups(&self) -> usize {
        self.state.lock().unwrap().lookups
    }

    /// History pages answered (not rate-limited).
    fn pages(&self) -> usize {
        self.state.lock().unwrap().pages
    }
}

/// A `ts` for a new message: the time now, in microseconds, after every earlier one.
fn next_ts(posted: &[Posted]) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros();
    let last = posted
        .last()
        .map_or(0, |p| p.ts.replace('.', "").parse::<u128>().unwrap());
    let micros = now.max(last + 1);
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

/// A query parameter of the request's URL.
fn query<'a>(url: &'a str, name: &str) -> Option<&'a str> {
    url.split_once('?')?
        .1
        .split('&')
        .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
}

/// `conversations.history` (top-level posts of the channel) or `conversations.replies`
/// (the posts of thread `ts`), from `oldest` on, newest first, `limit` per page.
fn history(url: &str, state: &Mutex<State>) -> Value {
    let channel = query(url, "channel").unwrap_or_default();
    if channel == "CBROKEN" {
        return json!({"ok": false, "error": "internal_error"});
    }
    if channel == "CBUSY" {
        return json!({"ok": false, "error": "ratelimited"});
    }
    let oldest: f64 = query(url, "oldest")
        .and_then(|o| o.parse().ok())
        .unwrap_or(0.0);
    let thread = query(url, "ts").filter(|_| url.contains("conversations.replies"));
    let metadata = query(url, "include_all_metadata") == Some("true");
    let asked: usize = query(url, "limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(100);
    let limit = {
        let s = state.lock().unwrap();
        s.tier
            .as_ref()
            .map_or(asked, |(tier, _)| asked.min(tier.page))
    };
    let from: usize = query(url, "cursor")
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let s = state.lock().unwrap();
    let all: Vec<Value> = s
        .posted
        .iter()
        .rev()
        .filter(|p| p.channel == channel && p.ts.parse::<f64>().unwrap() >= oldest)
        .filter(|p| p.body["thread_ts"].as_str() == thread)
        .map(|p| {
            let mut m = json!({"type": "message", "ts": p.ts, "text": p.body["text"]});
            if metadata && !p.body["metadata"].is_null() {
                m["metadata"] = p.body["metadata"].clone();
            }
            m
        })
        .collect();
    let page: Vec<Value> = all.iter().skip(from).take(limit).cloned().collect();
    let more = from + limit < all.len();
    let cursor = if more {
        (from + limit).to_string()
    } else {
        String::new()
    };
    json!({"ok": true, "messages": page, "has_more": more,
           "response_metadata": {"next_cursor": cursor}})
}

fn adapter_at(url: &str, token: &str) -> SlackAdapter<SlackClientHyperConnector<HttpConnector>> {
    let connector =
        SlackClientHyperConnector::with_connector(HttpConnector::new()).with_slack_api_url(url);
    let client = Arc::new(SlackClient::new(connector));
    SlackAdapter::new(client, SlackApiToken::new(token.to_owned().into()))
        .with_timeout(Duration::from_millis(500))
}

fn answer(mut request: tiny_http::Request, state: &Mutex<State>) {
    let body = emulator::json_body(&mut request);
    let url = request.url().to_owned();
    let token = emulator::header(&request, "Authorization")
        .map(|t| t.trim_start_matches("Bearer ").to_owned())
        .unwrap_or_default();
    let respond = |status: u16, body: Value, retry_after: Option<&str>| {
        let headers: &[(&str, &str)] = match retry_after {
            Some(wait) => &[("Retry-After", wait)],
            None => &[],
        };
        emulator::respond(request, status, &body.to_string(), headers);
    };
    let error = |code: &str| json!({"ok": false, "error": code});
    if url.starts_with("/api/conversations.history")
        || url.starts_with("/api/conversations.replies")
    {
        if token != TOKEN {
            return respond(200, error("invalid_auth"), None);
        }
        state.lock().unwrap().lookups += 1;
        if let Some(wait) = over_the_tier(state) {
            return respond(429, error("ratelimited"), Some(&wait.to_string()));
        }
        let answer = history(&url, state);
        if answer["error"] == "ratelimited" {
            return respond(429, answer, Some("30"));
        }
        state.lock().unwrap().pages += usize::from(answer["ok"] == true);
        return respond(200, answer, None);
    }
    if !url.starts_with("/api/chat.postMessage") {
        return respond(404, error("unknown_method"), None);
    }
    let channel = body["channel"].as_str().unwrap_or_default().to_owned();
    let text = body["text"].as_str().unwrap_or_default().to_owned();
    match (token.as_str(), channel.as_str()) {
        ("xoxb-inactive", _) => return respond(200, error("account_inactive"), None),
        (t, _) if t != TOKEN => return respond(200, error("invalid_auth"), None),
        (_, "C404") => return respond(200, error("channel_not_found"), None),
        (_, "CARCH") => return respond(200, error("is_archived"), None),
        (_, "C429") => return respond(429, error("ratelimited"), Some("3")),
        (_, "C500") => return respond(200, error("internal_error"), None),
        _ if text.chars().count() > 40_000 => return respond(200, error("msg_too_long"), None),
        _ => {}
    }
    if ["CLOST", "CBROKEN", "CBUSY"].contains(&channel.as_str())
        && state.lock().unwrap().swallowed.insert(channel.clone())
    {
        // Read, not posted, and no answer before the client gives up.
        std::thread::sleep(Duration::from_secs(2));
        return;
    }
    let ts = {
        let mut s = state.lock().unwrap();
        let ts = next_ts(&s.posted);
        s.posted.push(Posted {
            channel: channel.clone(),
            body: body.clone(),
            ts: ts.clone(),
        });
        ts
    };
    let second_in_c2nd = channel == "C2ND" && api_posts_in(state, "C2ND") > 1;
    if channel == "C777" || second_in_c2nd {
        // Posted, but the answer comes after the client gave up.
        std::thread::sleep(Duration::from_secs(2));
    }
    respond(
        200,
        json!({"ok": true, "channel": channel, "ts": ts,
               "message": {"type": "message", "text": text, "ts": ts, "bot_id": "B1"}}),
        None,
    );
}

/// Posts made in `channel` so far.
fn api_posts_in(state: &Mutex<State>, channel: &str) -> usize {
    let s = state.lock().unwrap();
    s.posted.iter().filter(|p| p.channel == channel).count()
}

fn state(outbox: &Outbox, id: DeliveryId) -> (DeliveryStatus, ChunkStatus, u32, String) {
    let view = outbox.delivery(id).unwrap().unwrap();
    let c = &view.chunks[0];
    (
        view.status,
        c.status,
        c.attempts,
        c.last_error.clone().unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_answer_becomes_the_right_outcome() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    let ids = emulator::hello_each(
        &outbox,
        "slack",
        &["C1", "C404", "CARCH", "C429", "C500", "C777"],
    );
    let too_long = outbox
        .enqueue(&NewDelivery::single("slack", "C2", "a".repeat(40_001)))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &api.adapter(TOKEN)).await;

    let delivered = outbox.delivery(ids["C1"]).unwrap().unwrap();
    assert_eq!(delivered.status, DeliveryStatus::Delivered);
    let posted = api.posted();
    let first = posted.iter().find(|p| p.channel == "C1").unwrap();
    assert_eq!(
        delivered.chunks[0].platform_message_id.as_deref(),
        Some(first.ts.as_str())
    );
    // Every post carries its part's key in the message metadata.
    assert_eq!(first.body["metadata"]["event_type"], "chunked_outbox_part");
    assert_eq!(
        first.body["metadata"]["event_payload"]["key"],
        delivered.chunks[0].idempotency_key
    );

    for (id, code) in [
        (ids["C404"], "channel_not_found"),
        (ids["CARCH"], "is_archived"),
        (too_long, "msg_too_long"),
    ] {
        let (status, _, _, error) = state(&outbox, id);
        assert_eq!(status, DeliveryStatus::Failed, "{error}");
        assert!(error.contains(code), "{error}");
    }
    let (_, chunk, attempts, _) = state(&outbox, ids["C429"]);
    assert_eq!(
        (chunk, attempts),
        (ChunkStatus::Retry, 0),
        "paused, attempt given back"
    );
    let view = outbox.delivery(ids["C429"]).unwrap().unwrap();
    let wait = view.chunks[0].next_attempt_at.unwrap() - chrono::Utc::now();
    assert!(
        wait.num_milliseconds() > 1_500,
        "the Retry-After header's 3 s: {wait}"
    );

    // Slack failed inside, or never answered: it may have posted, so held.
    for channel in ["C500", "C777"] {
        assert_eq!(
            state(&outbox, ids[channel]).1,
            ChunkStatus::Uncertain,
            "{channel}"
        );
    }
    assert!(
        api.posted().iter().any(|p| p.channel == "C777"),
        "Slack has it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_problems_are_permanent_and_an_unreachable_api_is_transient() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    for (token, code) in [
        ("xoxb-wrong", "invalid_auth"),
        ("xoxb-inactive", "account_inactive"),
    ] {
        let id = outbox
            .enqueue(&NewDelivery::single("slack", "C1", "hi"))
            .unwrap()
            .id;
        emulator::send_due(&outbox, &api.adapter(token)).await;
        let (status, _, _, error) = state(&outbox, id);
        assert_eq!(status, DeliveryStatus::Failed);
        assert!(error.contains(code), "{error}");
    }

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/api", closed.local_addr().unwrap());
    drop(closed);
    let id = outbox
        .enqueue(&NewDelivery::single("slack", "C1", "again"))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &adapter_at(&url, TOKEN)).await;
    let (_, chunk, attempts, error) = state(&outbox, id);
    assert_eq!((chunk, attempts), (ChunkStatus::Retry, 1), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_chunk_goes_into_the_thread_from_the_metadata() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    let adapter = api.adapter(TOKEN);
    let reply = NewDelivery::chunked("slack", "C1", "a b", ["a", "b"])
        .with_metadata(r#"{"thread_ts": "1503435956.000247"}"#);
    let id = outbox.enqueue(&reply).unwrap().id;
    emulator::send_due(&outbox, &adapter).await;
    emulator::send_due(&outbox, &adapter).await;
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Delivered
    );
    let posted = api.posted();
    assert_eq!(posted.len(), 2);
    assert!(
        posted
            .iter()
            .all(|p| p.body["thread_ts"] == "1503435956.000247"),
        "{posted:?}"
    );
}

/// An outbox whose Slack channel asks its adapter about possibly-sent parts, and an
/// async dispatcher with `adapter` (no lookup grace, so the test need not wait).
fn asking(
    dir: &tempfile::TempDir,
    adapter: SlackAdapter<SlackClientHyperConnector<HttpConnector>>,
) -> (Outbox, AsyncDispatcher) {
    asking_with(dir, adapter, ChannelPolicy::asking())
}

fn asking_with(
    dir: &tempfile::TempDir,
    adapter: SlackAdapter<SlackClientHyperConnector<HttpConnector>>,
    policy: ChannelPolicy,
) -> (Outbox, AsyncDispatcher) {
    let options = OutboxOptions::default().with_channel("slack", policy);
    let outbox = Outbox::open(dir.path().join("bot.db"), options).unwrap();
    let dispatcher = AsyncDispatcher::builder(outbox.clone())
        .adapter("slack", adapter.with_lookup_grace(Duration::ZERO))
        .build()
        .unwrap();
    (outbox, dispatcher)
}

/// Posted, then no answer: the lookup finds the post by its key — past a page of
/// other messages, and in a thread through `conversations.replies` — and the part is
/// delivered with its `ts`, never posted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_possibly_sent_post_found_by_its_key_is_delivered() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let (outbox, dispatcher) = asking(&dir, api.adapter(TOKEN));
    let ids = emulator::hello_each(&outbox, "slack", &["C777"]);
    let threaded = NewDelivery::single("slack", "C777", "in the thread")
        .with_metadata(r#"{"thread_ts": "1503435956.000247"}"#);
    let threaded = outbox.enqueue(&threaded).unwrap().id;
    // One reply after the other (one lane): the second waits for the answer about the
    // first.
    for id in [ids["C777"], threaded] {
        emulator::send_due(&outbox, &api.adapter(TOKEN)).await;
        assert_eq!(state(&outbox, id).1, ChunkStatus::Uncertain);
        api.chatter("C777", 225);
        assert_eq!(dispatcher.settle_once().await, 1);
    }
    let posted = api.posted();
    for (id, text) in [(ids["C777"], "hello C777"), (threaded, "in the thread")] {
        let view = outbox.delivery(id).unwrap().unwrap();
        assert_eq!(view.status, DeliveryStatus::Delivered);
        let post = posted.iter().find(|p| p.body["text"] == text).unwrap();
        assert_eq!(
            view.chunks[0].platform_message_id.as_deref(),
            Some(post.ts.as_str())
        );
        let kept = view.chunks[0].settlement.clone().unwrap();
        assert!(kept.contains("a message with the key"), "{kept}");
    }
    let kept = outbox.delivery(threaded).unwrap().unwrap().chunks[0]
        .settlement
        .clone()
        .unwrap();
    assert!(kept.contains("conversations.replies"), "{kept}");
    assert_eq!(emulator::send_due(&outbox, &api.adapter(TOKEN)).await, 0);
    assert_eq!(
        api.posted().len(),
        452,
        "two posts and the chatter, nothing twice"
    );
    assert_eq!(dispatcher.stats().settled_delivered, 2);
}

/// The outbox's clock two minutes ahead of Slack's: a post made but unanswered — a
/// reply's second part, or a chat's second reply — is looked up from the `ts` of the
/// part before it (the reply's first part; the chat's last delivered reply) — Slack's
/// own time — and found, not posted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_searches_from_the_previous_parts_ts_whatever_the_clocks() {
    let two_parts = vec![NewDelivery::chunked(
        "slack",
        "C2ND",
        "one two",
        ["one", "two"],
    )];
    let two_replies = vec![
        NewDelivery::single("slack", "C2ND", "one"),
        NewDelivery::single("slack", "C2ND", "two"),
    ];
    for replies in [two_parts, two_replies] {
        let api = SlackApi::start();
        let dir = tempfile::tempdir().unwrap();
        let options = OutboxOptions::default()
            .with_channel("slack", ChannelPolicy::asking())
            .with_clock(Arc::new(chunked_outbox::clock::SkewedClock::ahead(
                Duration::from_secs(120),
            )));
        let outbox = Outbox::open(dir.path().join("bot.db"), options).unwrap();
        let dispatcher = AsyncDispatcher::builder(outbox.clone())
            .adapter(
                "slack",
                api.adapter(TOKEN).with_lookup_grace(Duration::ZERO),
            )
            .build()
            .unwrap();
        let ids: Vec<DeliveryId> = replies
            .iter()
            .map(|r| outbox.enqueue(r).unwrap().id)
            .collect();
        emulator::send_due(&outbox, &api.adapter(TOKEN)).await;
        emulator::send_due(&outbox, &api.adapter(TOKEN)).await;
        let last = *ids.last().unwrap();
        let second = |id| {
            let view = outbox.delivery(id).unwrap().unwrap();
            view.chunks.last().cloned().unwrap()
        };
        assert_eq!(second(last).status, ChunkStatus::Uncertain);
        assert_eq!(dispatcher.settle_once().await, 1);
        while emulator::send_due(&outbox, &api.adapter(TOKEN)).await > 0 {}
        for id in &ids {
            assert_eq!(state(&outbox, *id).0, DeliveryStatus::Delivered);
        }
        let kept = second(last).settlement.clone().unwrap();
        assert!(kept.contains("a message with the key"), "{kept}");
        let posted: Vec<Posted> = api
            .posted()
            .into_iter()
            .filter(|p| p.channel == "C2ND")
            .collect();
        assert_eq!(posted.len(), 2, "each part posted once");
        assert_eq!(
            second(last).platform_message_id.as_deref(),
            Some(posted[1].ts.as_str())
        );
    }
}

/// Read but never posted: the lookup finds nothing with the key since the first send,
/// so the part is posted again — once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_possibly_sent_post_absent_from_the_history_is_posted_again() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    // (no backoff before the resend, so that it goes out at once on the real clock)
    let at_once = RetryPolicy::default().with_backoff(Backoff::Schedule(vec![Duration::ZERO]));
    let (outbox, dispatcher) = asking_with(
        &dir,
        api.adapter(TOKEN),
        ChannelPolicy::asking().with_retry(at_once),
    );
    let ids = emulator::hello_each(&outbox, "slack", &["CLOST"]);
    emulator::send_due(&outbox, &api.adapter(TOKEN)).await;
    assert_eq!(state(&outbox, ids["CLOST"]).1, ChunkStatus::Uncertain);
    assert!(api.posted().is_empty());

    assert_eq!(dispatcher.settle_once().await, 1);
    let view = outbox.delivery(ids["CLOST"]).unwrap().unwrap();
    let kept = view.chunks[0].settlement.clone().unwrap();
    assert!(
        kept.contains("no message with the key") && kept.contains("sent again"),
        "{kept}"
    );
    assert_eq!(emulator::send_due(&outbox, &api.adapter(TOKEN)).await, 1);
    assert_eq!(state(&outbox, ids["CLOST"]).0, DeliveryStatus::Delivered);
    assert_eq!(api.posted().len(), 1, "posted once");
    assert_eq!(dispatcher.stats().settled_resent, 1);
}

/// The chat waits for the answer: a reply read but never posted is looked up, not
/// found and posted again before the chat's next reply, so the chat reads its replies
/// in the order they were enqueued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chat_waits_for_the_lookup_so_its_replies_keep_their_order() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let at_once = RetryPolicy::default().with_backoff(Backoff::Schedule(vec![Duration::ZERO]));
    let (outbox, dispatcher) = asking_with(
        &dir,
        api.adapter(TOKEN),
        ChannelPolicy::asking().with_retry(at_once),
    );
    let replies = ["first", "second"].map(|text| {
        outbox
            .enqueue(&NewDelivery::single("slack", "CLOST", text))
            .unwrap()
            .id
    });
    emulator::send_due(&outbox, &api.adapter(TOKEN)).await;
    emulator::send_due(&outbox, &api.adapter(TOKEN)).await;
    assert_eq!(state(&outbox, replies[0]).1, ChunkStatus::Uncertain);
    assert!(api.posted().is_empty(), "the second waits for the answer");

    assert_eq!(dispatcher.settle_once().await, 1);
    while emulator::send_due(&outbox, &api.adapter(TOKEN)).await > 0 {}
    let texts: Vec<Value> = api
        .posted()
        .iter()
        .map(|p| p.body["text"].clone())
        .collect();
    assert_eq!(
        texts,
        ["first", "second"],
        "in the order they were enqueued"
    );
    for id in replies {
        assert_eq!(state(&outbox, id).0, DeliveryStatus::Delivered);
    }
}

/// A lookup that fails cannot tell: the part is held for a person, with the error;
/// and none is made before the grace has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_lookup_holds_the_part_for_a_person() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let (outbox, dispatcher) = asking(&dir, api.adapter(TOKEN));
    let ids = emulator::hello_each(&outbox, "slack", &["CBROKEN"]);
    emulator::send_due(&outbox, &api.adapter(TOKEN)).await;

    // With the default grace (10 s) nothing is asked yet: a post Slack is still making
    // would not be in the history.
    let patient = AsyncDispatcher::builder(outbox.clone())
        .adapter("slack", api.adapter(TOKEN))
        .build()
        .unwrap();
    assert_eq!(patient.settle_once().await, 0);
    assert_eq!(
        outbox.delivery(ids["CBROKEN"]).unwrap().unwrap().chunks[0].settlement,
        None
    );

    assert_eq!(dispatcher.settle_once().await, 1);
    emulator::send_due(&outbox, &api.adapter(TOKEN)).await;
    let view = outbox.delivery(ids["CBROKEN"]).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Uncertain);
    let kept = view.chunks[0].settlement.clone().unwrap();
    assert!(
        kept.contains("internal_error") && kept.contains("held for a person"),
        "{kept}"
    );
    assert!(api.posted().is_empty(), "nothing posted");
    assert_eq!(dispatcher.stats().settled_held, 1);
}

/// A rate-limited lookup cannot tell yet: nothing is recorded, the answer is counted,
/// and Slack is asked nothing more until its `Retry-After` (30 s) is over — not at the
/// next round, nor about the channel's other waiting parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_lookup_is_asked_again_after_its_wait() {
    let api = SlackApi::start();
    let dir = tempfile::tempdir().unwrap();
    let (outbox, dispatcher) = asking(&dir, api.adapter(TOKEN));
    // The older part is asked first; the other one (whose lookup would fail) waits
    // with it, since the wait is the channel's.
    let first = emulator::hello_each(&outbox, "slack", &["CBUSY"]);
    let second = emulator::hello_each(&outbox, "slack", &["CBROKEN"]);
    emulator::send_due(&outbox, &api.adapter(TOKEN)).await;
    for _ in 0..3 {
        assert_eq!(dispatcher.settle_once().await, 0);
        for id in [first["CBUSY"], second["CBROKEN"]] {
            let view = outbox.delivery(id).unwrap().unwrap();
            assert_eq!(
                (view.status, view.chunks[0].settlement.clone()),
                (DeliveryStatus::Uncertain, None)
            );
        }
    }
    assert_eq!(api.lookups(), 1, "one read, then the wait Slack asked for");
    assert_eq!(dispatcher.stats().settled_later, 1);
    assert_eq!(
        outbox.possibly_sent("slack", 4).unwrap().len(),
        2,
        "still to be asked"
    );
}

/// An emulated Slack whose history methods `tier` limits, on a manual clock started at
/// the time now (Slack's `ts` are the emulator's real time); an outbox on that clock
/// whose Slack channel asks, with `order` lanes; a dispatcher whose adapter looks up at
/// once and gives up after `limit`.
struct Tiered {
    clock: ManualClock,
    api: SlackApi,
    outbox: Outbox,
    dispatcher: AsyncDispatcher,
    _dir: tempfile::TempDir,
}

impl Tiered {
    fn new(tier: Tier, order: LaneOrder, limit: Duration) -> Tiered {
        let clock = ManualClock::new(chrono::Utc::now().timestamp_millis());
        let api = SlackApi::start_tier(tier, &clock);
        let dir = tempfile::tempdir().unwrap();
        let options = OutboxOptions::default()
            .with_channel("slack", ChannelPolicy::asking())
            .with_lane_order(order)
            .with_clock(Arc::new(clock.clone()));
        let outbox = Outbox::open(dir.path().join("bot.db"), options).unwrap();
        let adapter = api
            .adapter(TOKEN)
            .with_lookup_grace(Duration::ZERO)
            .with_lookup_limit(limit);
        let dispatcher = AsyncDispatcher::builder(outbox.clone())
            .adapter("slack", adapter)
            .build()
            .unwrap();
        Tiered {
            clock,
            api,
            outbox,
            dispatcher,
            _dir: dir,
        }
    }

    /// `hello {chat}` sent once to `chat` (left uncertain there, posted or not), then
    /// `chatter` messages of others after it.
    async fn uncertain_hello(&self, chat: &str, chatter: usize) -> DeliveryId {
        let id = emulator::hello_each(&self.outbox, "slack", &[chat])[chat];
        emulator::send_due(&self.outbox, &self.api.adapter(TOKEN)).await;
        assert_eq!(state(&self.outbox, id).1, ChunkStatus::Uncertain);
        self.api.chatter(chat, chatter);
        id
    }

    /// Rounds of asking, 10 s apart, until `done` or 60 rounds are over.
    async fn ask_until(&self, mut done: impl FnMut() -> bool) {
        for _ in 0..60 {
            if done() {
                return;
            }
            self.dispatcher.settle_once().await;
            self.clock.advance(Duration::from_secs(10));
        }
    }
}

/// Tier 1: the post is on the third page of 15; a page a minute. The read goes on from
/// its cursor after each `ratelimited` (its `Retry-After` kept: Slack is asked nothing
/// before it is over) and finds the post: three pages in all, never posted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_1_lookup_goes_on_from_its_cursor_and_finds_the_post() {
    let t = Tiered::new(TIER_1, LaneOrder::Fifo, Duration::from_secs(1800));
    let id = t.uncertain_hello("C777", 40).await;
    t.ask_until(|| state(&t.outbox, id).0 == DeliveryStatus::Delivered)
        .await;
    let (outbox, api) = (&t.outbox, &t.api);
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(
        view.status,
        DeliveryStatus::Delivered,
        "{:?}",
        view.chunks[0].settlement
    );
    let ours: Vec<Posted> = api
        .posted()
        .into_iter()
        .filter(|p| p.body["text"] == "hello C777")
        .collect();
    assert_eq!(ours.len(), 1, "posted once");
    assert_eq!(
        view.chunks[0].platform_message_id.as_deref(),
        Some(ours[0].ts.as_str())
    );
    assert_eq!(api.pages(), 3, "each page read once");
    assert!(
        api.lookups() <= 5,
        "one refusal a minute at most: {}",
        api.lookups()
    );
    assert!(t.dispatcher.stats().settled_later >= 2);
}

/// Tier 1, two replies of one chat waiting at once (parallel lanes): one page read
/// answers both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_read_serves_every_part_waiting_in_the_conversation() {
    let t = Tiered::new(TIER_1, LaneOrder::Parallel, Duration::from_secs(1800));
    let (outbox, api, dispatcher) = (&t.outbox, &t.api, &t.dispatcher);
    let ids = ["a", "b"].map(|text| {
        outbox
            .enqueue(&NewDelivery::single("slack", "C777", text))
            .unwrap()
            .id
    });
    emulator::send_due(outbox, &api.adapter(TOKEN)).await;
    for id in ids {
        assert_eq!(state(outbox, id).1, ChunkStatus::Uncertain);
    }
    assert_eq!(dispatcher.settle_once().await, 2);
    for id in ids {
        assert_eq!(state(outbox, id).0, DeliveryStatus::Delivered);
    }
    assert_eq!((api.pages(), api.lookups()), (1, 1), "one read for both");
    assert_eq!(api.posted().len(), 2);
}

/// Tier 1 and a busy channel: a read that has not reached the part's time when the
/// adapter's limit is over holds the part for a person, with why; nothing is posted
/// twice, and Slack is read no more than a page a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_that_cannot_finish_in_time_is_held_for_a_person() {
    let t = Tiered::new(TIER_1, LaneOrder::Fifo, Duration::from_secs(300));
    let id = t.uncertain_hello("CLOST", 600).await;
    let (outbox, api) = (&t.outbox, &t.api);
    let answered = || {
        state(outbox, id).0 != DeliveryStatus::Uncertain
            || outbox.delivery(id).unwrap().unwrap().chunks[0]
                .settlement
                .is_some()
    };
    t.ask_until(answered).await;
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Uncertain);
    let kept = view.chunks[0].settlement.clone().unwrap_or_default();
    assert!(
        kept.contains("had not finished 300 s") && kept.contains("held for a person"),
        "{kept}"
    );
    assert!(
        api.posted().iter().all(|p| p.body["text"] != "hello CLOST"),
        "nothing posted"
    );
    assert!(
        (5..=7).contains(&api.pages()),
        "a page a minute: {}",
        api.pages()
    );
}

/// Tier 3: pages of 200, 50 reads a minute: the post, behind 1,500 messages, is found
/// in one question, without a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_tier_3_a_lookup_reads_its_pages_at_once() {
    let t = Tiered::new(TIER_3, LaneOrder::Fifo, Duration::from_secs(1800));
    let id = t.uncertain_hello("C777", 1_500).await;
    assert_eq!(t.dispatcher.settle_once().await, 1);
    assert_eq!(state(&t.outbox, id).0, DeliveryStatus::Delivered);
    assert_eq!((t.api.pages(), t.api.lookups()), (8, 8));
}
