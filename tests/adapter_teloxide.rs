//! The adapter end to end: a real teloxide `Bot` pointed at an emulated Bot API on
//! 127.0.0.1 that enforces Telegram's documented behaviour (message length, 429 with
//! `retry_after`, blocked users, unknown chats, migrated groups, a bad token, an answer
//! that never comes after the message was accepted), and every outcome recorded in a
//! real outbox.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::platforms::telegram::teloxide::TelegramAdapter;
use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
use common::emulator;
use serde_json::{Value, json};

const TOKEN: &str = "123:SECRET";

/// One request the emulator received.
#[derive(Debug, Clone)]
struct Received {
    chat: String,
    text: String,
    body: Value,
}

/// The emulated Bot API. Chat ids choose the behaviour: 403 blocked the bot, 404 does
/// not exist, 429 is rate limited (7 s), 500 was migrated to a supergroup, 777 is
/// accepted but answered too late, 502 gets a proxy's HTML page; any other is accepted.
struct BotApi {
    url: String,
    received: Arc<Mutex<Vec<Received>>>,
}

impl BotApi {
    fn start() -> BotApi {
        let received = Arc::new(Mutex::new(Vec::new()));
        let url = format!("{}/", emulator::serve(received.clone(), answer));
        BotApi { url, received }
    }

    fn bot(&self, token: &str) -> teloxide_core::Bot {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        teloxide_core::Bot::with_client(token, client).set_api_url(self.url.parse().unwrap())
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

fn answer(request: tiny_http::Request, log: &Mutex<Vec<Received>>) {
    let Some((request, body, chat, text)) = emulator::telegram_send(request, TOKEN) else {
        return;
    };
    let error = |status: u16, description: &str, parameters: Option<Value>| {
        let mut e = json!({"ok": false, "error_code": status, "description": description});
        if let Some(p) = parameters {
            e["parameters"] = p;
        }
        (status, e.to_string())
    };
    let (status, reply) = match chat.as_str() {
        "403" => error(403, "Forbidden: bot was blocked by the user", None),
        "404" => error(400, "Bad Request: chat not found", None),
        "429" => error(
            429,
            "Too Many Requests: retry after 7",
            Some(json!({"retry_after": 7})),
        ),
        "500" => error(
            400,
            "Bad Request: group chat was upgraded to a supergroup chat",
            Some(json!({"migrate_to_chat_id": -1_001_234_567_890_i64})),
        ),
        // A proxy's page instead of the API's JSON. (Not a 5xx: teloxide waits 10 s
        // before reading any server error.)
        "502" => (200, "<html><body>Bad Gateway</body></html>".to_owned()),
        _ if text.encode_utf16().count() > 4096 => {
            error(400, "Bad Request: message is too long", None)
        }
        _ => {
            let id = {
                let mut log = log.lock().unwrap();
                log.push(Received {
                    chat: chat.clone(),
                    text: text.clone(),
                    body: body.clone(),
                });
                log.len()
            };
            if chat == "777" {
                // Accepted, but the answer comes after the client gave up.
                std::thread::sleep(Duration::from_secs(2));
            }
            let message = json!({
                "message_id": id,
                "date": 1_700_000_000,
                "chat": {"id": chat.parse::<i64>().unwrap_or(0), "type": "private", "first_name": "A"},
                "text": text,
            });
            (200, json!({"ok": true, "result": message}).to_string())
        }
    };
    emulator::respond(request, status, &reply, &[]);
}

fn status_of(
    outbox: &Outbox,
    id: chunked_outbox::DeliveryId,
) -> (DeliveryStatus, ChunkStatus, String) {
    let view = outbox.delivery(id).unwrap().unwrap();
    let chunk = &view.chunks[view.delivered_count.min(view.chunk_count - 1) as usize];
    (
        view.status,
        chunk.status,
        chunk.last_error.clone().unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_answer_becomes_the_right_outcome() {
    let api = BotApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    let adapter = TelegramAdapter::new(api.bot(TOKEN));
    let ids = emulator::hello_each(
        &outbox,
        "telegram",
        &["100", "403", "404", "429", "500", "502", "777", "@news"],
    );
    // One chunk over Telegram's limit, as a splitter that was not used would leave it.
    let too_long = outbox
        .enqueue(&NewDelivery::single("telegram", "101", "🚀".repeat(2049)))
        .unwrap()
        .id;
    let bad_chat = outbox
        .enqueue(&NewDelivery::single("telegram", "not-a-chat", "x"))
        .unwrap()
        .id;
    let before = chrono::Utc::now();
    emulator::send_due(&outbox, &adapter).await;
    let after = chrono::Utc::now();

    let delivered = outbox.delivery(ids["100"]).unwrap().unwrap();
    assert_eq!(delivered.status, DeliveryStatus::Delivered);
    let platform_id = delivered.chunks[0].platform_message_id.clone().unwrap();
    assert!(
        api.received()
            .iter()
            .any(|r| r.chat == "100" && platform_id.parse::<usize>().is_ok()),
        "{platform_id}"
    );
    assert_eq!(
        outbox.delivery(ids["@news"]).unwrap().unwrap().status,
        DeliveryStatus::Delivered,
        "a channel username is a chat id too"
    );

    for (id, expected) in [
        (ids["403"], "blocked"),
        (ids["404"], "chat not found"),
        (ids["500"], "-1001234567890"),
        (too_long, "too long"),
        (bad_chat, "neither a number"),
    ] {
        let (status, chunk, error) = status_of(&outbox, id);
        assert_eq!(
            (status, chunk),
            (DeliveryStatus::Failed, ChunkStatus::Failed),
            "{error}"
        );
        assert!(error.contains(expected), "{error}");
    }

    // Rate limited: due again after Telegram's retry_after, the attempt given back.
    let limited = outbox.delivery(ids["429"]).unwrap().unwrap();
    let chunk = &limited.chunks[0];
    assert_eq!((chunk.status, chunk.attempts), (ChunkStatus::Retry, 0));
    let due = chunk.next_attempt_at.unwrap();
    let seven = chrono::Duration::seconds(7);
    assert!(before + seven <= due && due <= after + seven, "{due}");

    // Accepted, then no answer: it may be in the chat, so it is held, not resent.
    let (status, chunk, _) = status_of(&outbox, ids["777"]);
    assert_eq!(
        (status, chunk),
        (DeliveryStatus::Uncertain, ChunkStatus::Uncertain)
    );
    assert!(
        api.received().iter().any(|r| r.chat == "777"),
        "the platform has it"
    );
    // A proxy's page instead of JSON: unreadable, so ambiguous too.
    assert_eq!(status_of(&outbox, ids["502"]).1, ChunkStatus::Uncertain);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_token_is_permanent_and_an_unreachable_api_is_transient() {
    let api = BotApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    let id = outbox
        .enqueue(&NewDelivery::single("telegram", "100", "hi"))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &TelegramAdapter::new(api.bot("123:WRONG"))).await;
    let (status, _, error) = status_of(&outbox, id);
    assert_eq!(status, DeliveryStatus::Failed);
    assert!(
        error.contains("Unauthorized") || error.contains("Invalid"),
        "{error}"
    );

    // Nothing listens there: the request was never written.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/", closed.local_addr().unwrap());
    drop(closed);
    let unreachable = teloxide_core::Bot::new(TOKEN).set_api_url(url.parse().unwrap());
    let id = outbox
        .enqueue(&NewDelivery::single("telegram", "100", "again"))
        .unwrap()
        .id;
    emulator::send_due(&outbox, &TelegramAdapter::new(unreachable)).await;
    let view = outbox.delivery(id).unwrap().unwrap();
    assert_eq!(
        (view.chunks[0].status, view.chunks[0].attempts),
        (ChunkStatus::Retry, 1)
    );
}

/// The metadata's reply-to goes with the first chunk only; the thread and parse mode
/// with every chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_reaches_the_request() {
    let api = BotApi::start();
    let dir = tempfile::tempdir().unwrap();
    let outbox = Outbox::open(dir.path().join("bot.db"), OutboxOptions::default()).unwrap();
    let adapter = TelegramAdapter::new(api.bot(TOKEN));
    let metadata = json!({"reply_to_message_id": 41, "message_thread_id": 9, "parse_mode": "HTML"});
    let reply = NewDelivery::chunked("telegram", "100", "<b>one</b> two", ["<b>one</b>", "two"])
        .with_metadata(metadata.to_string());
    let id = outbox.enqueue(&reply).unwrap().id;
    emulator::send_due(&outbox, &adapter).await;
    emulator::send_due(&outbox, &adapter).await;
    assert_eq!(
        outbox.delivery(id).unwrap().unwrap().status,
        DeliveryStatus::Delivered
    );
    let sent = api.received();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].text, "<b>one</b>");
    assert_eq!(sent[0].body["reply_parameters"]["message_id"], 41);
    assert!(
        sent[1].body.get("reply_parameters").is_none(),
        "{:?}",
        sent[1].body
    );
    for s in &sent {
        assert_eq!(s.body["message_thread_id"], 9);
        assert_eq!(s.body["parse_mode"], "HTML");
    }

    // Metadata the adapter cannot read fails the same way on every attempt.
    let bad =
        NewDelivery::single("telegram", "100", "x").with_metadata("{\"parse_mode\": \"BBCode\"}");
    let id = outbox.enqueue(&bad).unwrap().id;
    emulator::send_due(&outbox, &adapter).await;
    let (status, _, error) = status_of(&outbox, id);
    assert_eq!(status, DeliveryStatus::Failed);
    assert!(error.contains("BBCode"), "{error}");
}
