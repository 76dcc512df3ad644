//! The operator console as a person uses it: Debian's Chromium, headless, driven through
//! its WebDriver (`chromedriver`), against `outbox serve` over an outbox with a held
//! chat, an uncertain part, dead letters and a reply whose text is a `<script>`, on
//! each store. It reads what a person would read, presses the buttons a person would
//! press, and checks the rows in the store after each; it tries the hostile cases (a
//! page read before the sign-in, a form from another site, a form with the right token
//! from another origin of the same host, a wrong form token, the script, a session's
//! cookie after its sign-out). Each page's
//! screenshot is written under `target/tmp/console-screenshots/<store>/` (and to
//! `$OUTBOX_SCREENSHOTS/<store>/` when set: `docs/console` is made that way).
//!
//! Without Chromium and chromedriver the test says so and passes, so a fresh machine's
//! `cargo test` runs; with `OUTBOX_REQUIRE_BROWSER` set (as `.ci/run` sets it, after
//! installing them) it fails instead.

#[macro_use]
mod common;

use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chunked_outbox::monitoring::{DeliveryStatus, ListFilter};
use chunked_outbox::rules::LaneFailurePolicy;
use chunked_outbox::{DeliveryId, NewDelivery, Outbox, OutboxOptions, Outcome};
use common::{Store, TestDb, current_store};
use fantoccini::{Client, ClientBuilder, Locator};

const TOKEN: &str = "console-token-for-the-browser-test";
const SCRIPT: &str = "<script>document.title='owned'</script>";

/// A child process killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// chromedriver on a free port of the loopback, and its URL; `None` (after saying so)
/// when it or Chromium is not installed and the browser is not required.
fn chromedriver() -> Option<(Running, String)> {
    let driver = std::env::var_os("CHROMEDRIVER")
        .map_or_else(|| PathBuf::from("chromedriver"), PathBuf::from);
    let missing = |what: &str| {
        let message = format!(
            "\n*** console browser test SKIPPED: {what}\n(apt-get install chromium chromium-driver)\n"
        );
        if std::env::var_os("OUTBOX_REQUIRE_BROWSER").is_some() {
            panic!(
                "{message}OUTBOX_REQUIRE_BROWSER is set: the browser test may not pass without a browser"
            );
        }
        let _ = std::io::stderr().write_all(message.as_bytes());
        None
    };
    if Command::new(chromium()).arg("--version").output().is_err() {
        return missing(&format!("no {}", chromium().display()));
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let child = match Command::new(&driver)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(child) => Running(child),
        Err(e) => return missing(&format!("cannot start {}: {e}", driver.display())),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "chromedriver did not listen within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some((child, format!("http://127.0.0.1:{port}")))
}

fn chromium() -> PathBuf {
    std::env::var_os("CHROMIUM").map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from)
}

/// `outbox serve` on `db` with the console's actions on, and its base URL.
fn serve(db: &str, token_file: &Path) -> (common::serve::Serving, String) {
    let serving = common::serve::Serving::start(
        db,
        &["--console-token-file".as_ref(), token_file.as_os_str()],
    );
    assert!(
        serving.banner.contains("behind the sign-in"),
        "{}",
        serving.banner
    );
    let base = serving.base();
    (serving, base)
}

/// What the console is shown: every kind of trouble a person on call meets.
struct Scene {
    /// Part 1 may or may not have reached Slack; a reply waits behind it.
    uncertain: DeliveryId,
    behind_uncertain: DeliveryId,
    /// The user blocked the bot; a reply waits behind it (lane failure policy block).
    dead: DeliveryId,
    /// Another dead letter, on its own chat.
    dead_alone: DeliveryId,
    /// A reply whose text is a script.
    script: DeliveryId,
}

fn scene(outbox: &Outbox) -> Scene {
    let mut rules = outbox.rules().unwrap();
    rules.lane_failure = LaneFailurePolicy::Block;
    outbox.set_rules(rules).unwrap();
    let reply = |channel: &str, chat: &str, text: &str| {
        outbox
            .enqueue(&NewDelivery::single(channel, chat, text))
            .unwrap()
            .id
    };
    let send = |channel: &str, outcome: Outcome| {
        let claim = outbox.claim_channels(&[channel], 1).unwrap().remove(0);
        outbox.record(&claim, outcome).unwrap();
    };
    for n in 0..3 {
        reply("slack", "C-history", &format!("answer {n}"));
        send("slack", Outcome::delivered(Some(format!("ts-{n}"))));
    }
    let uncertain = reply("slack", "C1", "the first answer");
    send(
        "slack",
        Outcome::Ambiguous {
            error: "read timeout after the request was written".into(),
        },
    );
    // Slack was asked about it, and could not tell: it is a person's.
    let part = outbox.possibly_sent("slack", 1).unwrap().remove(0);
    let lookup = chunked_outbox::settle::Settlement::hold(
        "conversations.history of C1 for the key",
        "internal_error",
    );
    outbox.settle(&part, &lookup).unwrap().unwrap();
    let behind_uncertain = reply("slack", "C1", "the second answer");
    let dead = reply("telegram", "42", "hello");
    send(
        "telegram",
        Outcome::from_error_text("Forbidden: bot was blocked by the user"),
    );
    reply("telegram", "42", "are you there?");
    let dead_alone = reply("viber", "7", "hi");
    send("viber", Outcome::from_error_text("chat not found"));
    let script = outbox
        .enqueue(&NewDelivery::single("discord", "9", SCRIPT).with_idempotency_key("turn-77"))
        .unwrap()
        .id;
    Scene {
        uncertain,
        behind_uncertain,
        dead,
        dead_alone,
        script,
    }
}

fn status(outbox: &Outbox, id: DeliveryId) -> DeliveryStatus {
    outbox.delivery(id).unwrap().unwrap().status
}

stores! {
    /// Every page, every button, every hostile case, on this store.
    fn a_person_on_call_reads_and_acts_in_a_real_browser() {
        let Some((_driver, driver_url)) = chromedriver() else { return };
        let db = TestDb::on_system_clock(OutboxOptions::default());
        let outbox = db.outbox.clone();
        let scene = scene(&outbox);
        let token_file = db.dir.path().join("console-token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
        // Readable by its owner only: `outbox serve` refuses it otherwise.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let target = db.url.clone().unwrap_or_else(|| db.path().display().to_string());
        let (_server, base) = serve(&target, &token_file);
        let store = match current_store() {
            Store::Sqlite => "sqlite",
            Store::Postgres => "postgres",
        };
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let browser = Browser::open(&driver_url, &base, store).await;
            let result = walk(&browser, &outbox, &scene).await;
            browser.client.clone().close().await.ok();
            result
        });
    }
}

/// A browser session on the console.
struct Browser {
    client: Client,
    base: String,
    shots: Vec<PathBuf>,
}

impl Browser {
    async fn open(driver_url: &str, base: &str, store: &str) -> Browser {
        let profile = tempfile::tempdir().unwrap().keep();
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": chromium(),
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--window-size=1280,900",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(capabilities)
            .connect(driver_url)
            .await
            .expect("a Chromium session through chromedriver");
        let mut shots = vec![
            Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join("console-screenshots")
                .join(store),
        ];
        if let Some(dir) = std::env::var_os("OUTBOX_SCREENSHOTS") {
            shots.push(Path::new(&dir).join(store));
        }
        for dir in &shots {
            std::fs::create_dir_all(dir).unwrap();
        }
        Browser {
            client,
            base: base.to_owned(),
            shots,
        }
    }

    async fn goto(&self, path: &str) {
        self.client
            .goto(&format!("{}{path}", self.base))
            .await
            .expect("page loads");
    }

    /// The text a person reads on the page.
    async fn text(&self) -> String {
        self.client
            .find(Locator::Css("body"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn click_link(&self, text: &str) {
        self.click(Locator::LinkText(text), text).await;
    }

    async fn press(&self, button: &str) {
        let xpath = format!("//button[normalize-space()=\"{button}\"]");
        self.click(Locator::XPath(&xpath), button).await;
    }

    /// Clicks what `locator` finds and waits for the page it leads to: a click returns
    /// before the browser has left the page, so the old page's root must go stale.
    async fn click(&self, locator: Locator<'_>, what: &str) {
        let old = self.client.find(Locator::Css("html")).await.unwrap();
        let target = self
            .client
            .find(locator)
            .await
            .unwrap_or_else(|e| panic!("{what:?}: {e}"));
        target.click().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while old.tag_name().await.is_ok() {
            assert!(
                Instant::now() < deadline,
                "clicking {what:?} led nowhere within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn buttons(&self) -> usize {
        self.client
            .find_all(Locator::Css("form.action button"))
            .await
            .unwrap()
            .len()
    }

    async fn type_into(&self, name: &str, text: &str) {
        let field = self
            .client
            .find(Locator::Css(&format!("input[name={name}]")))
            .await
            .unwrap();
        field.clear().await.unwrap();
        field.send_keys(text).await.unwrap();
    }

    async fn screenshot(&self, name: &str) {
        let png = self.client.screenshot().await.expect("a screenshot");
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        for dir in &self.shots {
            std::fs::write(dir.join(format!("{name}.png")), &png).unwrap();
        }
    }
}

async fn walk(b: &Browser, outbox: &Outbox, scene: &Scene) {
    // Before the sign-in nothing is read: every page leads to the sign-in form.
    b.goto(&format!("/console/deliveries/{}?text=1", scene.script))
        .await;
    let gate = b.text().await;
    assert!(gate.contains("Sign in"), "{gate}");
    for secret in [
        "<script>",
        "turn-77",
        "C-history",
        "bot was blocked",
        "slack",
    ] {
        assert!(
            !gate.contains(secret),
            "{secret} shown before the sign-in: {gate}"
        );
    }
    b.screenshot("sign-in").await;

    // A form from another site changes nothing.
    let forged = format!(
        "data:text/html,<form method=post action='{}/console/actions/requeue'>\
         <input name=delivery value={}><input name=csrf value=guess><button>go</button></form>",
        b.base, scene.dead
    );
    b.client.goto(&forged).await.unwrap();
    b.press("go").await;
    assert!(b.text().await.contains("Not allowed"));
    assert_eq!(status(outbox, scene.dead), DeliveryStatus::Failed);

    // Signing in: a wrong token is refused, the right one opens the console.
    b.goto("/console/sign-in").await;
    b.type_into("token", "not-the-console-token-at-all").await;
    b.press("Sign in").await;
    let wrong = b.text().await;
    assert!(wrong.contains("That is not the token."), "{wrong}");
    b.type_into("token", TOKEN).await;
    b.press("Sign in").await;
    let overview = b.text().await;
    assert!(overview.contains("Sign out"), "{overview}");

    // The overview: what health says, per channel, and the builds writing (this test's
    // handle and the server's).
    for channel in ["slack", "telegram", "viber", "discord", "all channels"] {
        assert!(overview.contains(channel), "{overview}");
    }
    assert!(
        overview.contains("Builds writing: chunked-outbox"),
        "{overview}"
    );
    b.screenshot("overview").await;

    // Held chats: why, and what frees them.
    b.click_link("Chats").await;
    let chats = b.text().await;
    assert!(
        chats.contains("slack, C1") && chats.contains("telegram, 42"),
        "{chats}"
    );
    assert!(
        chats.contains("may or may not have reached the platform"),
        "{chats}"
    );
    assert!(
        chats.contains("failed for good") && chats.contains("Requeue or dismiss"),
        "{chats}"
    );
    assert!(
        !chats.contains("viber, 7"),
        "a dead letter with nothing behind it holds no one: {chats}"
    );
    b.screenshot("chats").await;

    // The rules, as stored.
    b.click_link("Rules").await;
    let rules = b.text().await;
    assert!(rules.contains("\"lane_failure\": \"block\""), "{rules}");

    // A search by chat lists its unfinished replies; by caller key, it opens the reply.
    b.type_into("id", "42").await;
    b.press("Show").await;
    let chat = b.text().await;
    assert!(
        chat.contains("Chat 42") && chat.contains(&scene.dead.to_string()),
        "{chat}"
    );
    b.type_into("id", "turn-77").await;
    b.press("Show").await;
    // The script reply renders as text, and runs nothing.
    assert!(b.text().await.contains(&format!("Reply {}", scene.script)));
    assert!(
        !b.text().await.contains(SCRIPT),
        "the text is shown only when asked for"
    );
    b.click_link("Show the reply's text").await;
    let shown = b
        .client
        .find(Locator::Css("pre"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(shown, SCRIPT);
    assert_ne!(b.client.title().await.unwrap(), "owned");

    // A wrong form token is refused, signed in or not.
    b.goto(&format!("/console/deliveries/{}", scene.dead)).await;
    assert!(b.buttons().await > 0, "signed in, the buttons are shown");
    b.client
        .execute(
            "document.querySelector('form.action input[name=csrf]').value = '0'.repeat(32)",
            vec![],
        )
        .await
        .unwrap();
    b.press("Requeue").await;
    let refused = b.text().await;
    assert!(
        refused.contains("Not allowed") && refused.contains("Reload the page"),
        "{refused}"
    );
    assert_eq!(status(outbox, scene.dead), DeliveryStatus::Failed);

    // An uncertain part: read what is known, resolve it as delivered.
    b.click_link("Uncertain").await;
    assert!(
        b.text()
            .await
            .contains("read timeout after the request was written")
    );
    b.screenshot("uncertain").await;
    b.click_link(&scene.uncertain.to_string()).await;
    let story = b.text().await;
    assert!(
        story.contains("uncertain")
            && story.contains("Sends nothing: records the part as delivered")
            && story.contains(
                "Part 1: asked: conversations.history of C1 for the key; \
                 answered: internal_error; held for a person"
            ),
        "{story}"
    );
    b.screenshot("uncertain-reply").await;
    b.press("Resolve as delivered").await;
    let resolved = b.text().await;
    assert!(
        resolved.contains("Resolved as delivered: nothing was sent."),
        "{resolved}"
    );
    assert_eq!(
        b.client
            .find(Locator::Css("dd.state"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "delivered"
    );
    assert_eq!(status(outbox, scene.uncertain), DeliveryStatus::Delivered);
    assert_eq!(
        status(outbox, scene.behind_uncertain),
        DeliveryStatus::Pending,
        "the chat moves on"
    );

    // Dead letters: requeue one from its story, dismiss the rest from the list.
    b.click_link("Dead letters").await;
    let listed = b.text().await;
    assert!(
        listed.contains("bot was blocked by the user") && listed.contains("chat not found"),
        "{listed}"
    );
    b.screenshot("dead-letters").await;
    // Filtered by error: only the reply whose error says so.
    b.type_into("error", "BLOCKED").await;
    b.press("Filter").await;
    let filtered = b.text().await;
    assert!(filtered.contains(&scene.dead.to_string()), "{filtered}");
    assert!(
        !filtered.contains(&scene.dead_alone.to_string()),
        "{filtered}"
    );
    b.click_link("Dead letters").await;
    b.click_link(&scene.dead.to_string()).await;
    b.press("Requeue").await;
    assert!(
        b.text()
            .await
            .contains("Requeued: the reply goes out again.")
    );
    assert_eq!(status(outbox, scene.dead), DeliveryStatus::Pending);
    b.click_link("Dead letters").await;
    b.press("Dismiss the dead letters of every channel").await;
    assert!(b.text().await.contains("Dismissed 1 dead reply."));
    let alone = outbox.delivery(scene.dead_alone).unwrap().unwrap();
    assert!(alone.acknowledged_at.is_some() && alone.status == DeliveryStatus::Failed);
    // Nothing is held any more.
    b.click_link("Chats").await;
    assert!(b.text().await.contains("None: no chat has a reply held"));
    let held = outbox
        .list(&ListFilter::default().status(DeliveryStatus::Uncertain))
        .unwrap();
    assert!(held.is_empty());

    // A page on another port of this host — the same site, so the browser sends the
    // session's cookie along — posts a form with the session's own form token: refused
    // by its origin, and nothing changes.
    let csrf = b
        .client
        .find(Locator::Css("input[name=csrf]"))
        .await
        .unwrap()
        .attr("value")
        .await
        .unwrap()
        .expect("the session's form token");
    let attacker = AttackerPage::serve(&format!(
        "<form method=post action='{}/console/actions/requeue'>\
         <input name=delivery value={}><input name=csrf value={csrf}>\
         <button>go</button></form>",
        b.base, scene.dead_alone
    ));
    b.client.goto(&attacker.url).await.unwrap();
    b.press("go").await;
    let refused = b.text().await;
    assert!(
        refused.contains("Not allowed") && refused.contains("came from another"),
        "{refused}"
    );
    assert_eq!(status(outbox, scene.dead_alone), DeliveryStatus::Failed);

    // Signing out ends the session: its cookie, sent again, opens nothing.
    b.goto("/console").await;
    let cookie = b
        .client
        .get_all_cookies()
        .await
        .unwrap()
        .into_iter()
        .find(|c| c.name() == "outbox_console")
        .expect("the session cookie");
    assert!(cookie.http_only().unwrap_or(false));
    assert!(
        !cookie.value().contains(TOKEN),
        "the cookie is not the token"
    );
    let stolen = format!("outbox_console={}", cookie.value());
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let read = |cookie: String| {
        let client = client.clone();
        let url = format!("{}/console/dead-letters", b.base);
        async move {
            client
                .get(url)
                .header("cookie", cookie)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(
        read(stolen.clone()).await,
        200,
        "signed in, the cookie reads"
    );
    b.press("Sign out").await;
    assert!(b.text().await.contains("Sign in"));
    assert_eq!(
        read(stolen).await,
        303,
        "signed out, the old cookie reads nothing"
    );
    b.goto("/console/dead-letters").await;
    assert!(!b.text().await.contains("chat not found"));
}

/// A page served from another port of the loopback: another origin of the same site.
struct AttackerPage {
    url: String,
    server: std::sync::Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AttackerPage {
    fn serve(html: &str) -> AttackerPage {
        let server = std::sync::Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let url = format!("http://{}/", server.server_addr());
        let page = html.to_owned();
        let serving = server.clone();
        let thread = std::thread::spawn(move || {
            for request in serving.incoming_requests() {
                let header = "Content-Type: text/html"
                    .parse::<tiny_http::Header>()
                    .unwrap();
                let answer = tiny_http::Response::from_string(page.clone()).with_header(header);
                let _ = request.respond(answer);
            }
        });
        AttackerPage {
            url,
            server,
            thread: Some(thread),
        }
    }
}

impl Drop for AttackerPage {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
