//! The adapter end to end: serenity's `Http` pointed at an emulated Discord REST API on
//! 127.0.0.1 that enforces Discord's documented behaviour — a nonce of at most 25
//! characters, deduplicated with `enforce_nonce`; content of at most 2,000 characters;
//! 429 with `retry_after`; unknown channels; users who cannot be messaged; missing
//! permissions; a bad token; an answer that never comes after the message was created —
//! and every outcome recorded in a real outbox. The nonce is remembered for "a few
//! minutes" (3, on a clock the test moves): a possibly-sent part is sent again inside
//! the adapter's window and held after it.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunked_outbox::clock::ManualClock;
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::platforms::discord::serenity::DiscordAdapter;
use chunked_outbox::rules::ChannelPolicy;
use chunked_outbox::{AsyncDispatcher, DeliveryId, NewDelivery, Outbox, OutboxOptions};
use common::emulator;
use serde_json::{Value, json};

const TOKEN: &str = "Bot SECRET";

/// What the emulated API holds: messages created, by nonce, and the channels it has
/// rate-limited once.
struct State {
    created: Vec<Value>,
    /// Each nonce's message, and when it was created (ms, on `clock`).
    by_nonce: HashMap<String, (usize, i64)>,
    rate_limited: HashMap<String, bool>,
    /// Requests still to answer 503 (no gateway took them: nothing created).
    unavailable: usize,
    /// Requests answered 503 so far.
    answered_unavailable: usize,
    /// Messages deleted (by a moderator), by index in `created`.
    deleted: std::collections::HashSet<usize>,
    /// Discord's clock.
    clock: ManualClock,
}

/// How long the emulated Discord remembers a nonce: "a few minutes".
const NONCE_MEMORY_MS: i64 = 3 * 60 * 1000;

/// The emulated API. Channel ids choose the behaviour: 10003 does not exist, 50007 is a
/// user who blocks messages from the bot, 50013 lacks permissions, 429 answers its first
/// request with a rate limit, 777 creates the message and answers too late. (serenity
/// sends to it only with its ratelimiter off, so the 429 reaches the adapter.)
struct DiscordApi {
    url: String,
    state: Arc<Mutex<State>>,
}

impl DiscordApi {
    fn start() -> DiscordApi {
        DiscordApi::start_at(&ManualClock::new(1_767_225_600_000))
    }

    /// An API whose clock is `clock`.
    fn start_at(clock: &ManualClock) -> DiscordApi {
        let state = Arc::new(Mutex::new(State {
            created: Vec::new(),
            by_nonce: HashMap::new(),
            rate_limited: HashMap::new(),
            unavailable: 0,
            answered_unavailable: 0,
            deleted: Default::default(),
            clock: clock.clone(),
        }));
        let url = emulator::serve(state.clone(), answer);
        DiscordApi { url, state }
    }

    fn http(&self, token: &str) -> Arc<serenity::http::Http> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        Arc::new(
            // serenity sends to a proxy only with its own ratelimiter off.
            serenity::http::HttpBuilder::new(token)
                .client(client)
                .proxy(self.url.clone())
                .ratelimiter_disabled(true)
                .build(),
        )
    }

    fn created(&self) -> Vec<Value> {
        self.state.lock().unwrap().created.clone()
    }

    /// Answers the next `n` requests 503, creating nothing.
    fn unavailable_for(&self, n: usize) {
        self.state.lock().unwrap().unavailable = n;
    }

    fn answered_unavailable(&self) -> usize {
        self.state.lock().unwrap().answered_unavailable
    }

    /// A moderator deletes every message made so far.
    fn delete_all(&self) {
        let mut s = self.state.lock().unwrap();
        s.deleted = (0..s.created.len()).collect();
    }
}

/// Whether `nonce`, enforced, names a message Discord still remembers but that was
/// deleted: Discord then answers `10008 Unknown Message`.
fn nonce_of_a_deleted_message(state: &Mutex<State>, body: &Value, nonce: Option<&str>) -> bool {
    let s = state.lock().unwrap();
    let now = chunked_outbox::clock::Clock::now_ms(&s.clock);
    body["enforce_nonce"] == true
        && nonce
            .and_then(|n| s.by_nonce.get(n))
            .is_some_and(|(i, at)| now - at < NONCE_MEMORY_MS && s.deleted.contains(i))
}

fn answer(mut request: tiny_http::Request, state: &Mutex<State>) {
    let body = emulator::json_body(&mut request);
    let url = request.url().to_owned();
    let authorized = emulator::header(&request, "Authorization").as_deref() == Some(TOKEN);
    let error =
        |status: u16, code: u32, message: &str| (status, json!({"message": message, "code": code}));
    let channel = url
        .strip_prefix("/api/v10/channels/")
        .and_then(|rest| rest.strip_suffix("/messages"))
        .unwrap_or_default()
        .to_owned();
    let content = body["content"].as_str().unwrap_or_default().to_owned();
    let nonce = body["nonce"].as_str().map(str::to_owned);
    let unavailable = {
        let mut s = state.lock().unwrap();
        let now = s.unavailable > 0;
        if now {
            s.unavailable -= 1;
            s.answered_unavailable += 1;
        }
        now
    };
    let (status, reply) = if unavailable {
        error(
            503,
            0,
            "upstream connect error or disconnect/reset before headers",
        )
    } else if !authorized {
        error(401, 0, "401: Unauthorized")
    } else if channel.is_empty() {
        error(404, 0, "404: Not Found")
    } else if nonce.as_ref().is_some_and(|n| n.chars().count() > 25) {
        (
            400,
            json!({"code": 50035, "message": "Invalid Form Body",
                   "errors": {"nonce": {"_errors": [{"code": "BASE_TYPE_MAX_LENGTH", "message": "Must be 25 or fewer in length."}]}}}),
        )
    } else if content.chars().count() > 2000 {
        (
            400,
            json!({"code": 50035, "message": "Invalid Form Body",
                   "errors": {"content": {"_errors": [{"code": "BASE_TYPE_MAX_LENGTH", "message": "Must be 2000 or fewer in length."}]}}}),
        )
    } else {
        match channel.as_str() {
            "10003" => error(404, 10003, "Unknown Channel"),
            "50007" => error(403, 50007, "Cannot send messages to this user"),
            "50013" => error(403, 50013, "Missing Permissions"),
            "429"
                if !state
                    .lock()
                    .unwrap()
                    .rate_limited
                    .insert(channel.clone(), true)
                    .unwrap_or(false) =>
            {
                (
                    429,
                    json!({"message": "You are being rate limited.", "retry_after": 0.05, "global": false}),
                )
            }
            _ if nonce_of_a_deleted_message(state, &body, nonce.as_deref()) => {
                error(404, 10008, "Unknown Message")
            }
            _ => {
                let (message, fresh) = {
                    let mut s = state.lock().unwrap();
                    let enforced = body["enforce_nonce"] == true;
                    let now = chunked_outbox::clock::Clock::now_ms(&s.clock);
                    match nonce
                        .as_ref()
                        .and_then(|n| s.by_nonce.get(n))
                        .filter(|(_, at)| enforced && now - at < NONCE_MEMORY_MS)
                    {
                        // The same nonce again: no new message, the first one returned.
                        Some(&(i, _)) => (s.created[i].clone(), false),
                        None => {
                            let id = (1_189_283_621_932_285_000_u64 + s.created.len() as u64)
                                .to_string();
                            let message =
                                message_json(&id, &channel, &content, nonce.as_deref(), &body);
                            s.created.push(message.clone());
                            if let Some(n) = &nonce {
                                let i = s.created.len() - 1;
                                s.by_nonce.insert(n.clone(), (i, now));
                            }
                            (message, true)
                        }
                    }
                };
                if channel == "777" && fresh {
                    // Created, but the answer comes after the client gave up.
                    std::thread::sleep(Duration::from_secs(2));
                }
                (200, message)
            }
        }
    };
    emulator::respond(request, status, &reply.to_string(), &[]);
}

/// A message object as Discord's API reference documents it.
fn message_json(
    id: &str,
    channel: &str,
    content: &str,
    nonce: Option<&str>,
    body: &Value,
) -> Value {
    json!({
        "id": id,
        "channel_id": channel,
        "author": {"id": "41771983423143937", "username": "bot", "discriminator": "0",
                   "global_name": null, "avatar": null, "bot": true},
        "content": content,
        "timestamp": "2026-12-01T00:00:00.000000+00:00",
        "edited_timestamp": null,
        "tts": false,
        "mention_everyone": false,
        "mentions": [],
        "mention_roles": [],
        "attachments": [],
        "embeds": [],
        "pinned": false,
        "type": if body.get("message_reference").is_some() { 19 } else { 0 },
        "nonce": nonce,
        "message_reference": body.get("message_reference").cloned(),
        "flags": 0
    })
}

fn outbox(dir: &tempfile::TempDir) -> Outbox {
    outbox_with_clock(dir, None)
}

fn outbox_with_clock(dir: &tempfile::TempDir, clock: Option<&ManualClock>) -> Outbox {
    let mut options = OutboxOptions::default().with_channel("discord", ChannelPolicy::replayable());
    if let Some(clock) = clock {
        options = options.with_clock(Arc::new(clock.clone()));
    }
    Outbox::open(dir.path().join("bot.db"), options).unwrap()
}

fn last_error(outbox: &Outbox, id: DeliveryId) -> (DeliveryStatus, String) {
    let view = outbox.delivery(id).unwrap().unwrap();
    (
        view.status,
        view.chunks[0].last_error.clone().unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_answer_becomes_the_right_outcome() {
    let api = DiscordApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = outbox(&dir);
    let adapter = DiscordAdapter::new(api.http(TOKEN));
    let ids = emulator::hello_each(
        &outbox,
        "discord",
        &["1001", "10003", "50007", "50013", "429", "general"],
    );
    let too_long = outbox
        .enqueue(&NewDelivery::single("discord", "1002", "x".repeat(2001)))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &adapter).await;

    let delivered = outbox.delivery(ids["1001"]).unwrap().unwrap();
    assert_eq!(delivered.status, DeliveryStatus::Delivered);
    let created = api.created();
    let first = created.iter().find(|m| m["channel_id"] == "1001").unwrap();
    assert_eq!(
        delivered.chunks[0].platform_message_id.as_deref(),
        first["id"].as_str()
    );
    assert!(first["nonce"].as_str().unwrap().len() <= 25);
    // With serenity's ratelimiter off the 429 reaches the adapter: the chat pauses and
    // the attempt is given back.
    let limited = outbox.delivery(ids["429"]).unwrap().unwrap();
    assert_eq!(
        (limited.chunks[0].status, limited.chunks[0].attempts),
        (ChunkStatus::Retry, 0)
    );

    // The full 38-character key as a nonce, as a hand-written adapter might send it:
    // Discord refuses it (that is why the adapter sends the compact key).
    let full_key = serenity::builder::CreateMessage::new()
        .content("x")
        .nonce(serenity::model::channel::Nonce::String(format!(
            "{}:1",
            ids["1001"]
        )))
        .enforce_nonce(true);
    let refused = serenity::model::id::ChannelId::new(1001)
        .send_message(&api.http(TOKEN), full_key)
        .await;
    assert!(matches!(
        chunked_outbox::platforms::discord::serenity::outcome(refused),
        chunked_outbox::Outcome::Permanent { error } if error.contains("50035")
    ));

    for (id, expected) in [
        (ids["10003"], "10003"),
        (ids["50007"], "50007"),
        (ids["50013"], "50013"),
        (ids["general"], "not a Discord id"),
        // serenity refuses it before sending.
        (too_long, "too large"),
    ] {
        let (status, error) = last_error(&outbox, id);
        assert_eq!(status, DeliveryStatus::Failed, "{error}");
        assert!(error.contains(expected), "{error}");
    }
}

/// Created, then no answer: the chunk is replayed with the same nonce, and Discord
/// returns the first message instead of creating a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_send_is_replayed_and_deduplicated_by_its_nonce() {
    let api = DiscordApi::start();
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_767_225_600_000);
    let outbox = outbox_with_clock(&dir, Some(&clock));
    let adapter = DiscordAdapter::new(api.http(TOKEN));
    let id = outbox
        .enqueue(&NewDelivery::single("discord", "777", "exactly once"))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &adapter).await;
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(
        view.chunks[0].status,
        ChunkStatus::Retry,
        "replayable: retried"
    );
    // Due again after the backoff.
    assert_eq!(
        emulator::send_due(&outbox, &adapter).await,
        0,
        "not before its backoff"
    );
    clock.advance(Duration::from_secs(60));
    assert_eq!(emulator::send_due(&outbox, &adapter).await, 1);
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Delivered);
    let created = api.created();
    assert_eq!(
        created.len(),
        1,
        "one message, whatever the sends: {created:?}"
    );
    assert_eq!(
        view.chunks[0].platform_message_id.as_deref(),
        created[0]["id"].as_str()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_token_is_permanent_and_a_reply_reference_is_sent() {
    let api = DiscordApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = outbox(&dir);
    let id = outbox
        .enqueue(&NewDelivery::single("discord", "1001", "hi"))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &DiscordAdapter::new(api.http("Bot WRONG"))).await;
    let (status, error) = last_error(&outbox, id);
    assert_eq!(status, DeliveryStatus::Failed);
    assert!(error.contains("401"), "{error}");

    let adapter = DiscordAdapter::new(api.http(TOKEN));
    let reply = NewDelivery::chunked("discord", "1001", "a b", ["a", "b"])
        .with_metadata(r#"{"reply_to_message_id": "1189283621932284999"}"#);
    let id = outbox.enqueue(&reply).unwrap().id;
    emulator::send_due(&outbox, &adapter).await;
    emulator::send_due(&outbox, &adapter).await;
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Delivered
    );
    let created = api.created();
    assert_eq!(created.len(), 2);
    assert_eq!(
        created[0]["message_reference"]["message_id"],
        "1189283621932284999"
    );
    assert!(
        created[1]["message_reference"].is_null(),
        "only the first chunk replies"
    );
}

/// An outbox on `clock` whose Discord channel asks its adapter about possibly-sent
/// parts, a dispatcher with `adapter`, and a reply to channel 777 (created, answered
/// too late) sent once: it is uncertain.
async fn uncertain_on_777(
    dir: &tempfile::TempDir,
    clock: &ManualClock,
    adapter: DiscordAdapter,
) -> (Outbox, AsyncDispatcher, DeliveryId) {
    let options = OutboxOptions::default()
        .with_channel("discord", ChannelPolicy::asking())
        .with_clock(Arc::new(clock.clone()));
    let outbox = Outbox::open(dir.path().join("bot.db"), options).unwrap();
    let id = outbox
        .enqueue(&NewDelivery::single("discord", "777", "exactly once"))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &adapter).await;
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Uncertain
    );
    let dispatcher = AsyncDispatcher::builder(outbox.clone())
        .adapter("discord", adapter)
        .build()
        .unwrap();
    (outbox, dispatcher, id)
}

/// Inside the nonce window: asked, the part is sent again with its nonce, and Discord
/// returns the message it made: one message in the chat, no person involved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inside_the_nonce_window_a_possibly_sent_part_is_sent_again_once() {
    let clock = ManualClock::new(1_767_225_600_000);
    let api = DiscordApi::start_at(&clock);
    let dir = tempfile::tempdir().unwrap();
    let (outbox, dispatcher, id) =
        uncertain_on_777(&dir, &clock, DiscordAdapter::new(api.http(TOKEN))).await;
    clock.advance(Duration::from_secs(90));
    assert_eq!(dispatcher.settle_once().await, 1);
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(view.chunks[0].status, ChunkStatus::Retry);
    let kept = view.chunks[0].settlement.clone().unwrap();
    assert!(
        kept.contains("first sent 90 s ago") && kept.contains("inside the window"),
        "{kept}"
    );
    // Sent again after the backoff its attempt earned (5 s, give or take a tenth).
    clock.advance(Duration::from_secs(6));
    assert_eq!(
        emulator::send_due(&outbox, &DiscordAdapter::new(api.http(TOKEN))).await,
        1
    );
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Delivered);
    let created = api.created();
    assert_eq!(created.len(), 1, "one message in the chat: {created:?}");
    assert_eq!(
        view.chunks[0].platform_message_id.as_deref(),
        created[0]["id"].as_str()
    );
    assert_eq!(dispatcher.stats().settled_resent, 1);
}

/// A resend decided inside the nonce window goes inside it or not at all: asked at 90 s,
/// the resend meets 503s and its backoff until the window's deadline has passed; the
/// next claim holds the part instead of sending it, and asked again the answer is a hold
/// (the window has passed). One message in the chat, however long the outage lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_that_misses_its_window_is_held_not_sent_late() {
    let clock = ManualClock::new(1_767_225_600_000);
    let api = DiscordApi::start_at(&clock);
    let dir = tempfile::tempdir().unwrap();
    let (outbox, dispatcher, id) =
        uncertain_on_777(&dir, &clock, DiscordAdapter::new(api.http(TOKEN))).await;
    clock.advance(Duration::from_secs(90));
    assert_eq!(dispatcher.settle_once().await, 1);
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(
        view.chunks[0].status,
        ChunkStatus::Retry,
        "a resend inside the window"
    );
    api.unavailable_for(3);
    // Twenty minutes, a step at a time: every resend that is due is tried, and every
    // question asked.
    let adapter = DiscordAdapter::new(api.http(TOKEN));
    for _ in 0..120 {
        clock.advance(Duration::from_secs(10));
        emulator::send_due(&outbox, &adapter).await;
        dispatcher.settle_once().await;
    }
    assert!(
        api.answered_unavailable() >= 1,
        "the resend was tried inside the window"
    );
    assert_eq!(api.created().len(), 1, "one message in the chat");
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Uncertain);
    let part = &view.chunks[0];
    assert!(
        part.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("had to go by"),
        "{:?}",
        part.last_error
    );
    let kept = part.settlement.clone().unwrap();
    assert!(
        kept.contains("window has passed") && kept.contains("held for a person"),
        "{kept}"
    );
}

/// The first send landed and a moderator deleted it; the resend inside the nonce
/// window is answered `10008 Unknown Message`: the part is delivered, with why, not a
/// dead letter, and nothing is posted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_of_a_deleted_message_is_delivered_not_a_dead_letter() {
    let clock = ManualClock::new(1_767_225_600_000);
    let api = DiscordApi::start_at(&clock);
    let dir = tempfile::tempdir().unwrap();
    let (outbox, dispatcher, id) =
        uncertain_on_777(&dir, &clock, DiscordAdapter::new(api.http(TOKEN))).await;
    api.delete_all();
    clock.advance(Duration::from_secs(60));
    assert_eq!(dispatcher.settle_once().await, 1);
    clock.advance(Duration::from_secs(6));
    let adapter = DiscordAdapter::new(api.http(TOKEN));
    assert_eq!(emulator::send_due(&outbox, &adapter).await, 1);
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Delivered);
    let kept = view.chunks[0].settlement.clone().unwrap();
    assert!(
        kept.contains("10008") && kept.contains("deleted since"),
        "{kept}"
    );
    assert_eq!(api.created().len(), 1, "nothing posted again");
}

/// After the nonce window: a resend would be a second message, so the part is held
/// for a person, with why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_nonce_window_a_possibly_sent_part_is_held() {
    let clock = ManualClock::new(1_767_225_600_000);
    let api = DiscordApi::start_at(&clock);
    let dir = tempfile::tempdir().unwrap();
    let (outbox, dispatcher, id) =
        uncertain_on_777(&dir, &clock, DiscordAdapter::new(api.http(TOKEN))).await;
    clock.advance(Duration::from_secs(5 * 60));
    assert_eq!(dispatcher.settle_once().await, 1);
    emulator::send_due(&outbox, &DiscordAdapter::new(api.http(TOKEN))).await;
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Uncertain);
    let kept = view.chunks[0].settlement.clone().unwrap();
    assert!(
        kept.contains("window has passed") && kept.contains("held for a person"),
        "{kept}"
    );
    assert_eq!(api.created().len(), 1, "nothing sent again");
    assert_eq!(dispatcher.stats().settled_held, 1);
    // A shorter window of the application's own holds sooner.
    let dir = tempfile::tempdir().unwrap();
    let short = DiscordAdapter::new(api.http(TOKEN)).with_nonce_window(Duration::from_secs(30));
    let (outbox, dispatcher, id) = uncertain_on_777(&dir, &clock, short).await;
    clock.advance(Duration::from_secs(45));
    dispatcher.settle_once().await;
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Uncertain
    );
}
