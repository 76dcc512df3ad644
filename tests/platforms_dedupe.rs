//! The platforms that deduplicate a resend for a while, end to end: emulated LINE and
//! Matrix APIs on 127.0.0.1, as their references document them — LINE answers a push
//! repeated with the same `X-Line-Retry-Key` within 24 hours with 409 and the accepted
//! request's id, and posts nothing; a Matrix homeserver answers a send repeated with the
//! same transaction id (and access token) with the event it made, for as long as it
//! remembers the id (Synapse: 30 minutes) — on a clock the test moves. Adapters written
//! as an application writes them (reqwest, the crate's mappings), a blocking dispatcher,
//! and for each platform the two paths: inside the window a possibly-sent part is sent
//! again and the chat sees it once; after it, the part is held for a person.
#![cfg(feature = "tokio")]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunked_outbox::clock::{Clock, ManualClock};
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::platforms::{HttpReply, NoReply, line, matrix, no_reply};
use chunked_outbox::rules::ChannelPolicy;
use chunked_outbox::settle::{PossiblySent, Settlement};
use chunked_outbox::{
    ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox, OutboxOptions, Outcome,
};
use common::emulator;
use serde_json::json;

const TOKEN: &str = "Bearer secret";

/// One message the platform showed in a chat.
#[derive(Debug, Clone)]
struct Shown {
    chat: String,
    text: String,
    id: String,
}

/// What an emulated platform holds: the messages it showed, each key it accepted
/// (with the message and when), the chats whose first send it answers too late, and its
/// clock.
struct State {
    shown: Vec<Shown>,
    keys: HashMap<String, (usize, i64)>,
    slow: Vec<String>,
    clock: ManualClock,
}

struct Api {
    url: String,
    state: Arc<Mutex<State>>,
}

impl Api {
    fn start(clock: &ManualClock, answer: fn(tiny_http::Request, &Mutex<State>)) -> Api {
        let state = Arc::new(Mutex::new(State {
            shown: Vec::new(),
            keys: HashMap::new(),
            slow: vec!["Uslow".into(), "!slow:example.org".into()],
            clock: clock.clone(),
        }));
        Api {
            url: emulator::serve(state.clone(), answer),
            state,
        }
    }

    fn shown(&self) -> Vec<Shown> {
        self.state.lock().unwrap().shown.clone()
    }
}

/// Shows a message under `key` unless the key was accepted within `memory`: the index
/// of the message, and whether it is new. A slow chat's first message is shown and its
/// answer comes after the client gave up (the caller sleeps).
fn show(
    state: &Mutex<State>,
    key: String,
    memory: Duration,
    chat: &str,
    text: &str,
) -> (Shown, bool, bool) {
    let mut s = state.lock().unwrap();
    let now = s.clock.now_ms();
    if let Some(&(i, at)) = s.keys.get(&key)
        && now - at < memory.as_millis() as i64
    {
        return (s.shown[i].clone(), false, false);
    }
    let shown = Shown {
        chat: chat.into(),
        text: text.into(),
        id: format!("{}", 461_230_966_842_064_897_u64 + s.shown.len() as u64),
    };
    s.shown.push(shown.clone());
    let i = s.shown.len() - 1;
    s.keys.insert(key, (i, now));
    let slow = match s.slow.iter().position(|c| c == chat) {
        Some(p) => {
            s.slow.remove(p);
            true
        }
        None => false,
    };
    (shown, true, slow)
}

/// LINE's `POST /v2/bot/message/push`.
fn line_api(mut request: tiny_http::Request, state: &Mutex<State>) {
    let body = emulator::json_body(&mut request);
    if emulator::header(&request, "Authorization").as_deref() != Some(TOKEN) {
        return emulator::respond(request, 401, r#"{"message":"Authentication failed"}"#, &[]);
    }
    let Some(key) = emulator::header(&request, "X-Line-Retry-Key") else {
        return emulator::respond(request, 400, r#"{"message":"no retry key"}"#, &[]);
    };
    let to = body["to"].as_str().unwrap_or_default().to_owned();
    let text = body["messages"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (shown, fresh, slow) = show(state, key, line::RETRY_KEY_WINDOW, &to, &text);
    let request_id = format!("request-{}", shown.id);
    if !fresh {
        let answer = json!({"message": "The retry key is already accepted",
                            "sentMessages": [{"id": shown.id, "quoteToken": "q"}]});
        return emulator::respond(
            request,
            409,
            &answer.to_string(),
            &[("X-Line-Accepted-Request-Id", &request_id)],
        );
    }
    if slow {
        std::thread::sleep(Duration::from_secs(2));
    }
    let answer = json!({"sentMessages": [{"id": shown.id, "quoteToken": "q"}]});
    emulator::respond(
        request,
        200,
        &answer.to_string(),
        &[("X-Line-Request-Id", &request_id)],
    );
}

/// Matrix's `PUT /_matrix/client/v3/rooms/{roomId}/send/m.room.message/{txnId}`.
fn matrix_api(mut request: tiny_http::Request, state: &Mutex<State>) {
    let body = emulator::json_body(&mut request);
    if emulator::header(&request, "Authorization").as_deref() != Some(TOKEN) {
        let answer = r#"{"errcode":"M_UNKNOWN_TOKEN","error":"Invalid access token"}"#;
        return emulator::respond(request, 401, answer, &[]);
    }
    let url = request.url().to_owned();
    let Some((room, txn)) = url
        .strip_prefix("/_matrix/client/v3/rooms/")
        .and_then(|rest| rest.split_once("/send/m.room.message/"))
    else {
        return emulator::respond(request, 404, r#"{"errcode":"M_UNRECOGNIZED"}"#, &[]);
    };
    let room = room.replace("%21", "!").replace("%3A", ":");
    let text = body["body"].as_str().unwrap_or_default().to_owned();
    // A transaction id is scoped to the access token.
    let key = format!("{TOKEN}/{txn}");
    let (shown, _, slow) = show(state, key, matrix::SYNAPSE_TRANSACTION_WINDOW, &room, &text);
    if slow {
        std::thread::sleep(Duration::from_secs(2));
    }
    let answer = json!({"event_id": format!("${}", shown.id)});
    emulator::respond(request, 200, &answer.to_string(), &[]);
}

/// How an application's adapter sends with reqwest and maps what it got.
fn http_outcome(
    sent: reqwest::Result<reqwest::blocking::Response>,
    map: fn(&HttpReply<'_>) -> Outcome,
) -> Outcome {
    match sent {
        Ok(response) => {
            let status = response.status().as_u16();
            let accepted = response
                .headers()
                .get("X-Line-Accepted-Request-Id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = response.text().unwrap_or_default();
            let mut reply = HttpReply::new(status, &body);
            if let Some(accepted) = &accepted {
                reply = reply.with_accepted_request_id(accepted);
            }
            map(&reply)
        }
        Err(e) if e.is_connect() => no_reply(NoReply::NotSent, e.to_string()),
        Err(e) => no_reply(NoReply::MaybeSent, e.to_string()),
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap()
}

/// A LINE adapter: the part's key as a UUID in `X-Line-Retry-Key`.
struct Line {
    url: String,
    client: reqwest::blocking::Client,
}

impl ChannelAdapter for Line {
    fn send(&self, claim: &Claim) -> Outcome {
        let body = json!({"to": claim.chat_id, "messages": [{"type": "text", "text": claim.text}]});
        let sent = self
            .client
            .post(format!("{}/v2/bot/message/push", self.url))
            .header("Authorization", TOKEN)
            .header("X-Line-Retry-Key", claim.key_uuid().to_string())
            .header("Content-Type", "application/json")
            .body(body.to_string())
            .send();
        http_outcome(sent, line::outcome)
    }

    fn settle(&self, part: &PossiblySent) -> Settlement {
        line::settle(part)
    }
}

/// A Matrix adapter: the part's compact key as the transaction id.
struct Matrix {
    url: String,
    client: reqwest::blocking::Client,
}

impl ChannelAdapter for Matrix {
    fn send(&self, claim: &Claim) -> Outcome {
        let room = claim.chat_id.replace('!', "%21").replace(':', "%3A");
        let sent = self
            .client
            .put(format!(
                "{}/_matrix/client/v3/rooms/{room}/send/m.room.message/{}",
                self.url,
                claim.compact_key()
            ))
            .header("Authorization", TOKEN)
            .body(json!({"msgtype": "m.text", "body": claim.text}).to_string())
            .send();
        http_outcome(sent, matrix::outcome)
    }

    fn settle(&self, part: &PossiblySent) -> Settlement {
        matrix::settle(part, matrix::SYNAPSE_TRANSACTION_WINDOW)
    }
}

/// The emulated platform of a run.
#[derive(Clone, Copy)]
enum Platform {
    Line,
    Matrix,
}

/// On `platform`, emulated on the outbox's clock, with its channel asking its adapter:
/// a reply to the slow chat is sent once (it is uncertain), asked about after `wait`,
/// then whatever is due is sent. The reply's status, its part's platform id and
/// settlement, and the messages the chat was shown.
fn asked_after(
    platform: Platform,
    wait: Duration,
) -> (DeliveryStatus, Option<String>, String, Vec<Shown>) {
    let clock = ManualClock::new(1_767_225_600_000);
    let (api, channel, chat) = match platform {
        Platform::Line => (Api::start(&clock, line_api), "line", "Uslow"),
        Platform::Matrix => (
            Api::start(&clock, matrix_api),
            "matrix",
            "!slow:example.org",
        ),
    };
    let (url, client) = (api.url.clone(), client());
    let adapter: Arc<dyn ChannelAdapter> = match platform {
        Platform::Line => Arc::new(Line { url, client }),
        Platform::Matrix => Arc::new(Matrix { url, client }),
    };
    let dir = tempfile::tempdir().unwrap();
    let options = OutboxOptions::default()
        .with_channel(channel, ChannelPolicy::asking())
        .with_clock(Arc::new(clock.clone()));
    let outbox = Outbox::open(dir.path().join("bot.db"), options).unwrap();
    let id = outbox
        .enqueue(&NewDelivery::single(channel, chat, "exactly once"))
        .unwrap()
        .id;
    let dispatcher = Dispatcher::builder(outbox.clone())
        .adapter(channel, adapter)
        .build()
        .unwrap();
    assert_eq!(dispatcher.run_once().unwrap(), 1);
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Uncertain
    );
    clock.advance(wait);
    assert_eq!(dispatcher.settle_once(), 1);
    // A resend waits the backoff its attempt earned (5 s, give or take a tenth).
    clock.advance(Duration::from_secs(6));
    dispatcher.run_once().unwrap();
    let view = outbox.delivery(id).unwrap().unwrap();
    let part = &view.chunks[0];
    assert_ne!(part.status, ChunkStatus::Sending);
    (
        view.status,
        part.platform_message_id.clone(),
        part.settlement.clone().unwrap_or_default(),
        api.shown(),
    )
}

#[test]
fn line_inside_its_retry_key_window_sends_again_and_reads_the_409_as_delivered() {
    let (status, id, kept, shown) = asked_after(Platform::Line, Duration::from_secs(3600));
    assert_eq!(status, DeliveryStatus::Delivered);
    assert_eq!(shown.len(), 1, "shown once: {shown:?}");
    assert_eq!(
        (shown[0].chat.as_str(), shown[0].text.as_str()),
        ("Uslow", "exactly once")
    );
    assert_eq!(
        id.as_deref(),
        Some(shown[0].id.as_str()),
        "the 409 names the message"
    );
    assert!(
        kept.contains("LINE X-Line-Retry-Key") && kept.contains("sent again"),
        "{kept}"
    );
}

#[test]
fn line_after_its_retry_key_window_holds_the_part() {
    let (status, _, kept, shown) = asked_after(Platform::Line, Duration::from_secs(25 * 3600));
    assert_eq!(status, DeliveryStatus::Uncertain);
    assert_eq!(shown.len(), 1, "nothing sent again: {shown:?}");
    assert!(
        kept.contains("window has passed") && kept.contains("held for a person"),
        "{kept}"
    );
}

#[test]
fn matrix_inside_the_transaction_window_sends_again_and_gets_the_same_event() {
    let (status, id, kept, shown) = asked_after(Platform::Matrix, Duration::from_secs(600));
    assert_eq!(status, DeliveryStatus::Delivered);
    assert_eq!(shown.len(), 1, "shown once: {shown:?}");
    assert_eq!(id, Some(format!("${}", shown[0].id)));
    assert!(
        kept.contains("Matrix transaction id") && kept.contains("sent again"),
        "{kept}"
    );
}

#[test]
fn matrix_after_the_transaction_window_holds_the_part() {
    let (status, _, kept, shown) = asked_after(Platform::Matrix, Duration::from_secs(40 * 60));
    assert_eq!(status, DeliveryStatus::Uncertain);
    assert_eq!(shown.len(), 1, "nothing sent again: {shown:?}");
    assert!(kept.contains("window has passed"), "{kept}");
}
