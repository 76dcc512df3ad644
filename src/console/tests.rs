use super::*;
use crate::rules::Rules;
use crate::{NewDelivery, OutboxOptions, Outcome};

const TOKEN: &str = "a-long-enough-console-token";

fn outbox() -> Outbox {
    Outbox::open_in_memory(OutboxOptions::default()).unwrap()
}

/// An outbox on a manual clock, and the clock.
fn outbox_on_a_clock() -> (crate::clock::ManualClock, Outbox) {
    let clock = crate::clock::ManualClock::new(1_767_225_600_000);
    let options = OutboxOptions::default().with_clock(std::sync::Arc::new(clock.clone()));
    (clock, Outbox::open_in_memory(options).unwrap())
}

fn console_with(text: &str) -> (Console, DeliveryId) {
    let outbox = outbox();
    let id = outbox
        .enqueue(&NewDelivery::single("<i>chan</i>", "42", text))
        .unwrap()
        .id;
    (Console::new(outbox), id)
}

/// A `GET` from the file's owner (see [`Request::owner`]): what most tests need of a
/// console without a token.
fn owner_get(target: &str) -> Request<'_> {
    Request::get(target).from_owner()
}

/// A `POST` from the file's owner.
fn owner_post<'a>(target: &'a str, body: &'a [u8]) -> Request<'a> {
    Request::post(target, body).from_owner()
}

fn get(console: &Console, target: &str) -> Response {
    console.respond(&owner_get(target))
}

/// A reply on `channel`, chat 7, whose send failed for good.
fn dead_letter(outbox: &Outbox, channel: &str) -> DeliveryId {
    let id = outbox
        .enqueue(&NewDelivery::single(channel, "7", "x"))
        .unwrap()
        .id;
    let claim = outbox.claim_channels(&[channel], 1).unwrap().pop().unwrap();
    outbox
        .record_error_text(&claim, "Forbidden: bot was blocked by the user")
        .unwrap();
    id
}

/// A reply on `channel`, chat 7, whose send may or may not have arrived.
fn uncertain(outbox: &Outbox, channel: &str) -> DeliveryId {
    let id = outbox
        .enqueue(&NewDelivery::single(channel, "7", "x"))
        .unwrap()
        .id;
    let claim = outbox.claim_channels(&[channel], 1).unwrap().pop().unwrap();
    outbox
        .record(
            &claim,
            Outcome::Ambiguous {
                error: "read timeout".into(),
            },
        )
        .unwrap();
    id
}

/// A console with actions on, and the cookie and form token of a person signed in.
fn signed_in(outbox: Outbox) -> (Console, String, String) {
    let console = Console::new(outbox).with_actions(TOKEN).unwrap();
    let (cookie, csrf) = sign_in(&console);
    (console, cookie, csrf)
}

/// Signs in to `console`: the session's cookie and its form token.
fn sign_in(console: &Console) -> (String, String) {
    let page = get(console, "/console/sign-in");
    let csrf = form_token(&page.body);
    let body = format!("csrf={csrf}&token={TOKEN}");
    let answer = console.respond(&owner_post("/console/sign-in", body.as_bytes()));
    assert_eq!(answer.status, 303, "{}", answer.body);
    let cookie = answer.header("Set-Cookie").unwrap();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"));
    let cookie = cookie.split(';').next().unwrap().to_owned();
    let page = console.respond(&owner_get("/console").with_cookie(&cookie));
    assert_eq!(page.status, 200, "{}", page.body);
    let session_csrf = form_token(&page.body);
    assert_ne!(
        session_csrf, csrf,
        "the sign-in form has a token of its own"
    );
    (cookie, session_csrf)
}

/// The form token in a page.
fn form_token(body: &str) -> String {
    let at = body.find("name=\"csrf\" value=\"").expect("a form token") + 19;
    body[at..at + 32].to_owned()
}

fn post(console: &Console, cookie: &str, target: &str, body: &str) -> Response {
    console.respond(&owner_post(target, body.as_bytes()).with_cookie(cookie))
}

fn status(outbox: &Outbox, id: DeliveryId) -> DeliveryStatus {
    outbox.delivery(id).unwrap().unwrap().status
}

#[test]
fn every_value_is_escaped() {
    let (console, id) = console_with("<script>alert(1)</script>");
    let page = get(&console, &format!("/console/deliveries/{id}?text=1"));
    assert_eq!(page.status, 200);
    assert!(!page.body.contains("<script>"), "{}", page.body);
    assert!(page.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    let overview = get(&console, "/console");
    assert!(!overview.body.contains("<i>chan</i>"));
    assert!(overview.body.contains("&lt;i&gt;chan&lt;/i&gt;"));
    for (name, value) in SECURITY_HEADERS {
        assert_eq!(overview.header(name), Some(value));
    }
}

#[test]
fn the_text_is_shown_only_when_asked_for() {
    let (console, id) = console_with("a secret reply");
    let page = get(&console, &format!("/console/deliveries/{id}"));
    assert_eq!(page.status, 200);
    assert!(!page.body.contains("a secret reply"));
    assert!(page.body.contains("Show the reply"));
    let asked = get(&console, &format!("/console/deliveries/{id}?text=1"));
    assert!(asked.body.contains("a secret reply"));
}

#[test]
fn unknown_pages_ids_and_methods_are_refused() {
    let (console, _) = console_with("x");
    assert_eq!(get(&console, "/console/nowhere").status, 404);
    assert_eq!(get(&console, "/console/deliveries/nope").status, 404);
    let absent = "01890a5d-ac96-774b-bcce-b302099a8057";
    assert_eq!(
        get(&console, &format!("/console/deliveries/{absent}")).status,
        404
    );
    let post = console.respond(&owner_post("/console", b""));
    assert_eq!((post.status, post.header("Allow")), (405, Some("GET")));
    let put = Request {
        method: "PUT",
        ..owner_get("/console/actions/dismiss")
    };
    assert_eq!(console.respond(&put).header("Allow"), Some("GET, POST"));
    assert_eq!(get(&console, "/console/style.css").status, 200);
}

#[test]
fn dead_letters_and_uncertain_replies_are_listed_by_channel() {
    let outbox = outbox();
    for channel in ["telegram", "discord"] {
        dead_letter(&outbox, channel);
    }
    let console = Console::new(outbox);
    let all = get(&console, "/console/dead-letters");
    assert_eq!(all.status, 200);
    assert_eq!(
        all.body.matches("bot was blocked").count(),
        2,
        "{}",
        all.body
    );
    let one = get(&console, "/console/dead-letters?channel=discord");
    assert_eq!(one.body.matches("bot was blocked").count(), 1);
    assert!(one.body.contains("discord, 7") && !one.body.contains("telegram, 7"));
    let uncertain = get(&console, "/console/uncertain");
    assert!(uncertain.body.contains("None."), "{}", uncertain.body);
}

#[test]
fn a_reply_is_found_by_its_id_or_caller_key_and_the_rules_are_shown() {
    let outbox = outbox();
    let id = outbox
        .enqueue(&NewDelivery::single("t", "1", "x").with_idempotency_key("turn-9"))
        .unwrap()
        .id;
    let console = Console::new(outbox);
    let found = get(&console, &format!("/console/deliveries?id=+{id}+"));
    assert_eq!(found.status, 200);
    assert!(found.body.contains(&id.to_string()));
    let by_key = get(&console, "/console/deliveries?id=turn-9");
    assert_eq!(by_key.status, 303);
    assert_eq!(
        by_key.header("Location"),
        Some(format!("/console/deliveries/{id}").as_str())
    );
    assert_eq!(get(&console, "/console/deliveries?id=turn-8").status, 404);
    assert_eq!(get(&console, "/console/deliveries?id=").status, 404);
    let rules = get(&console, "/console/rules");
    assert!(rules.body.contains("lane_order"), "{}", rules.body);
}

#[test]
fn the_overview_counts_per_channel() {
    let (console, _) = console_with("x");
    let page = get(&console, "/console/");
    assert_eq!(page.status, 200);
    // one due part on the channel and in the totals
    assert_eq!(page.body.matches("<td>1</td>").count(), 4, "{}", page.body);
}

#[test]
fn a_short_or_uncarriable_token_is_refused() {
    for token in [
        "short",
        "a token with spaces in it",
        "semicolon;semicolon;semi",
        // Item 8 of the review: long enough, but guessed first.
        "aaaaaaaaaaaaaaaa",
        "abcdabcdabcdabcdabcdabcd",
    ] {
        let refused = Console::new(outbox()).with_actions(token);
        assert!(
            matches!(
                refused,
                Err(Error::InvalidInput {
                    what: "console token",
                    ..
                })
            ),
            "{token:?}"
        );
    }
    assert!(
        Console::new(outbox())
            .with_actions("0123456789abcdef")
            .is_ok()
    );
}

#[test]
fn a_read_only_console_takes_no_action() {
    let outbox = outbox();
    let id = dead_letter(&outbox, "telegram");
    let console = Console::new(outbox.clone());
    let answer = post(
        &console,
        "outbox_console=anything",
        "/console/actions/requeue",
        &format!("delivery={id}"),
    );
    assert_eq!(answer.status, 403);
    assert!(answer.body.contains("read-only"));
    assert_eq!(status(&outbox, id), DeliveryStatus::Failed);
    // No buttons, and no sign-in link either.
    let page = get(&console, &format!("/console/deliveries/{id}"));
    assert!(!page.body.contains("<form class=\"action\"") && !page.body.contains("Sign in"));
}

#[test]
fn signing_in_takes_the_token_and_a_form_token() {
    let console = Console::new(outbox()).with_actions(TOKEN).unwrap();
    let csrf = form_token(&get(&console, "/console/sign-in").body);
    let wrong_token = console.respond(&owner_post(
        "/console/sign-in",
        format!("csrf={csrf}&token=not-the-token-at-all").as_bytes(),
    ));
    assert_eq!(wrong_token.status, 403);
    assert_eq!(wrong_token.header("Set-Cookie"), None);
    let no_csrf = console.respond(&owner_post(
        "/console/sign-in",
        format!("token={TOKEN}").as_bytes(),
    ));
    assert_eq!(no_csrf.status, 403);
    assert_eq!(no_csrf.header("Set-Cookie"), None);
    // Another console (another process) has another form token.
    let other = Console::new(outbox()).with_actions(TOKEN).unwrap();
    assert_ne!(form_token(&get(&other, "/console/sign-in").body), csrf);
    let (console, cookie, _) = signed_in(outbox());
    let page = console.respond(&owner_get("/console").with_cookie(&cookie));
    assert!(page.body.contains("Sign out"), "{}", page.body);
    // A wrong cookie is nobody: sent to the sign-in.
    let page = console.respond(&owner_get("/console").with_cookie("outbox_console=wrong"));
    assert_eq!(page.status, 303);
    assert_eq!(page.header("Location"), Some("/console/sign-in"));
}

#[test]
fn an_action_needs_the_cookie_and_the_form_token() {
    let outbox = outbox();
    let id = dead_letter(&outbox, "telegram");
    let (console, cookie, csrf) = signed_in(outbox.clone());
    let body = format!("csrf={csrf}&delivery={id}");
    let no_cookie = console.respond(&owner_post("/console/actions/requeue", body.as_bytes()));
    assert_eq!(no_cookie.status, 403);
    let wrong_csrf = post(
        &console,
        &cookie,
        "/console/actions/requeue",
        &format!("csrf={}&delivery={id}", "0".repeat(32)),
    );
    assert_eq!(wrong_csrf.status, 403);
    assert!(
        wrong_csrf.body.contains("Reload the page"),
        "{}",
        wrong_csrf.body
    );
    assert_eq!(status(&outbox, id), DeliveryStatus::Failed);
    let too_big = post(
        &console,
        &cookie,
        "/console/actions/requeue",
        &"x".repeat(MAX_FORM_BYTES + 1),
    );
    assert_eq!(too_big.status, 413);
    assert_eq!(status(&outbox, id), DeliveryStatus::Failed);
}

#[test]
fn requeue_resolve_resend_and_dismiss_change_the_rows() {
    let outbox = outbox();
    let failed = dead_letter(&outbox, "telegram");
    let settled = uncertain(&outbox, "slack");
    let resent = uncertain(&outbox, "discord");
    let (console, cookie, csrf) = signed_in(outbox.clone());

    let page =
        console.respond(&owner_get(&format!("/console/deliveries/{failed}")).with_cookie(&cookie));
    assert!(page.body.contains("Requeue") && page.body.contains("fresh attempt budget"));
    let back = format!("/console/deliveries/{failed}");
    let answer = post(
        &console,
        &cookie,
        "/console/actions/requeue",
        &format!("csrf={csrf}&delivery={failed}&back={back}"),
    );
    assert_eq!(answer.status, 303, "{}", answer.body);
    assert_eq!(
        answer.header("Location"),
        Some(format!("{back}?done=requeued&n=1").as_str())
    );
    assert_eq!(status(&outbox, failed), DeliveryStatus::Pending);
    let after =
        console.respond(&owner_get(answer.header("Location").unwrap()).with_cookie(&cookie));
    assert!(
        after.body.contains("Requeued: the reply goes out again."),
        "{}",
        after.body
    );

    let answer = post(
        &console,
        &cookie,
        "/console/actions/resolve",
        &format!("csrf={csrf}&delivery={settled}&platform_id=ts-1"),
    );
    assert_eq!(answer.status, 303, "{}", answer.body);
    let view = outbox.delivery(settled).unwrap().unwrap();
    assert_eq!(view.status, DeliveryStatus::Delivered);
    assert_eq!(view.chunks[0].platform_message_id.as_deref(), Some("ts-1"));

    let answer = post(
        &console,
        &cookie,
        "/console/actions/resend",
        &format!("csrf={csrf}&delivery={resent}"),
    );
    assert_eq!(answer.status, 303, "{}", answer.body);
    let view = outbox.delivery(resent).unwrap().unwrap();
    assert_eq!(view.chunks[0].status, ChunkStatus::Retry);

    // Resolving what is not uncertain changes nothing and says why.
    let again = post(
        &console,
        &cookie,
        "/console/actions/resolve",
        &format!("csrf={csrf}&delivery={settled}"),
    );
    assert_eq!(again.status, 409);
    assert!(again.body.contains("Nothing was changed"), "{}", again.body);

    let later = dead_letter(&outbox, "viber");
    let answer = post(
        &console,
        &cookie,
        "/console/actions/dismiss",
        &format!("csrf={csrf}&channel=viber"),
    );
    assert_eq!(
        answer.header("Location"),
        Some("/console?done=dismissed&n=1")
    );
    let view = outbox.delivery(later).unwrap().unwrap();
    assert!(view.acknowledged_at.is_some() && view.status == DeliveryStatus::Failed);
    let answer = post(
        &console,
        &cookie,
        "/console/actions/requeue-dead-letters",
        &format!("csrf={csrf}&channel="),
    );
    assert_eq!(
        answer.header("Location"),
        Some("/console?done=requeued-all&n=1")
    );
    assert_eq!(status(&outbox, later), DeliveryStatus::Pending);
}

#[test]
fn a_replay_resends_every_uncertain_part_of_one_channel() {
    let outbox = outbox();
    let slack = [uncertain(&outbox, "slack"), uncertain(&outbox, "slack")];
    let other = uncertain(&outbox, "discord");
    let (console, cookie, csrf) = signed_in(outbox.clone());
    let page = console.respond(&owner_get("/console/uncertain?channel=slack").with_cookie(&cookie));
    assert!(
        page.body.contains("Resend every uncertain part of slack"),
        "{}",
        page.body
    );
    let answer = post(
        &console,
        &cookie,
        "/console/actions/replay",
        &format!("csrf={csrf}&channel=slack&back=/console/uncertain"),
    );
    assert_eq!(
        answer.header("Location"),
        Some("/console/uncertain?done=replayed&n=2")
    );
    for id in slack {
        assert_eq!(
            outbox.delivery(id).unwrap().unwrap().chunks[0].status,
            ChunkStatus::Retry
        );
    }
    assert_eq!(status(&outbox, other), DeliveryStatus::Uncertain);
    let no_channel = post(
        &console,
        &cookie,
        "/console/actions/replay",
        &format!("csrf={csrf}&channel="),
    );
    assert_eq!(no_channel.status, 409);
}

#[test]
fn an_action_goes_back_only_to_a_console_page() {
    let outbox = outbox();
    dead_letter(&outbox, "telegram");
    let (console, cookie, csrf) = signed_in(outbox);
    for back in [
        "https://elsewhere.example/",
        "//elsewhere.example/console/",
        "/console/x?y=1",
    ] {
        let answer = post(
            &console,
            &cookie,
            "/console/actions/dismiss",
            &format!("csrf={csrf}&back={back}"),
        );
        assert_eq!(answer.status, 303);
        assert!(
            answer
                .header("Location")
                .unwrap()
                .starts_with("/console?done="),
            "{back}"
        );
    }
}

#[test]
fn a_held_chat_says_what_holds_it_and_what_frees_it() {
    let outbox = outbox();
    outbox
        .set_rules(Rules {
            lane_failure: crate::rules::LaneFailurePolicy::Block,
            ..outbox.rules().unwrap()
        })
        .unwrap();
    let held = uncertain(&outbox, "slack");
    let behind = outbox
        .enqueue(&NewDelivery::single("slack", "7", "next"))
        .unwrap()
        .id;
    let failed = dead_letter(&outbox, "telegram");
    outbox
        .enqueue(&NewDelivery::single("telegram", "7", "next"))
        .unwrap();
    // A chat with nothing queued is not listed, nor one whose first reply is due now.
    outbox
        .enqueue(&NewDelivery::single("discord", "9", "alone"))
        .unwrap();
    for text in ["first", "second"] {
        outbox
            .enqueue(&NewDelivery::single("line", "5", text))
            .unwrap();
    }
    let console = Console::new(outbox.clone());
    let page = get(&console, "/console/chats");
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains("slack, 7") && page.body.contains("telegram, 7"),
        "{}",
        page.body
    );
    assert!(!page.body.contains("discord, 9") && !page.body.contains("line, 5"));
    assert!(page.body.contains(&format!(
        "Part 1 of <a href=\"/console/deliveries/{held}\">"
    )));
    assert!(page.body.contains("may or may not have reached"));
    assert!(page.body.contains(&behind.to_string()));
    assert!(
        page.body
            .contains(&format!("Reply <a href=\"/console/deliveries/{failed}\">"))
    );
    assert!(page.body.contains("Requeue or dismiss"));
    // Dismissed, the dead letter frees its lane: the chat is no longer held.
    outbox.dismiss_dead_letters(Some("telegram")).unwrap();
    let page = get(&console, "/console/chats");
    assert!(!page.body.contains("telegram, 7"), "{}", page.body);
}

#[test]
fn the_overview_shows_pacing_pauses_and_what_finished() {
    let outbox = outbox();
    for chat in ["1", "2"] {
        outbox
            .enqueue(&NewDelivery::single("telegram", chat, "x"))
            .unwrap();
        let claim = outbox.claim_channels(&["telegram"], 1).unwrap().remove(0);
        outbox.ack(&claim, None).unwrap();
    }
    // (paced only now: the two sends above are not held apart)
    outbox
        .set_channel_policy(
            "telegram",
            Some(
                crate::rules::ChannelPolicy::default()
                    .with_lane_interval(std::time::Duration::from_secs(1))
                    .with_channel_interval(std::time::Duration::from_micros(33_334)),
            ),
        )
        .unwrap();
    dead_letter(&outbox, "discord");
    outbox
        .enqueue(&NewDelivery::single("discord", "8", "x"))
        .unwrap();
    let claim = outbox.claim_channels(&["discord"], 1).unwrap().remove(0);
    outbox
        .record(
            &claim,
            Outcome::ChannelRateLimited {
                retry_after: std::time::Duration::from_secs(600),
                error: "global rate limit".into(),
            },
        )
        .unwrap();
    let page = get(&Console::new(outbox), "/console");
    let body = &page.body;
    assert!(
        body.contains("1.0 s between sends to a chat; at most 29.9994/s on the channel"),
        "{body}"
    );
    assert_eq!(body.matches("<td>until ").count(), 1, "{body}");
    assert_eq!(
        body.matches(": 2 delivered, 1 failed").count(),
        2,
        "the hour and the day: {body}"
    );
    assert!(body.contains("<svg class=\"chart\""));
    assert!(body.contains("<rect class=\"delivered\"") && body.contains("<rect class=\"failed\""));
}

#[test]
fn dead_letters_are_filtered_by_error_and_chats_are_found() {
    let outbox = outbox();
    dead_letter(&outbox, "telegram");
    let other = outbox
        .enqueue(&NewDelivery::single("slack", "C9", "x"))
        .unwrap()
        .id;
    let claim = outbox.claim_channels(&["slack"], 1).unwrap().remove(0);
    outbox
        .record_error_text(&claim, "channel_not_found")
        .unwrap();
    let (console, cookie, _) = signed_in(outbox.clone());
    let page =
        console.respond(&owner_get("/console/dead-letters?error=NOT_FOUND").with_cookie(&cookie));
    assert!(page.body.contains(&other.to_string()), "{}", page.body);
    assert!(!page.body.contains("bot was blocked"), "{}", page.body);
    // The buttons for every dead letter of a channel are not offered under an error filter.
    assert!(
        !page.body.contains("/console/actions/dismiss"),
        "{}",
        page.body
    );
    let all = console.respond(&owner_get("/console/dead-letters").with_cookie(&cookie));
    assert!(all.body.contains("/console/actions/dismiss"));
    // A search by chat lists its unfinished replies, on every channel.
    outbox
        .enqueue(&NewDelivery::single("discord", "C9", "y"))
        .unwrap();
    let chat = console.respond(&owner_get("/console/deliveries?id=C9").with_cookie(&cookie));
    assert_eq!(chat.status, 200);
    assert!(
        chat.body.contains("slack, C9") && chat.body.contains("discord, C9"),
        "{}",
        chat.body
    );
    let none = owner_get("/console/deliveries?id=C8").with_cookie(&cookie);
    assert_eq!(console.respond(&none).status, 404);
}

#[test]
fn a_form_up_to_the_limit_is_read_and_signing_out_forgets_the_cookie() {
    let outbox = outbox();
    let id = dead_letter(&outbox, "telegram");
    assert!(!Console::new(outbox.clone()).takes_actions());
    let (console, cookie, csrf) = signed_in(outbox.clone());
    assert!(console.takes_actions());
    // Exactly the limit: read (the padding is a field nobody asks for).
    let mut body = format!("csrf={csrf}&delivery={id}&pad=");
    body.push_str(&"x".repeat(MAX_FORM_BYTES - body.len()));
    assert_eq!(body.len(), MAX_FORM_BYTES);
    let answer = post(&console, &cookie, "/console/actions/requeue", &body);
    assert_eq!(answer.status, 303, "{}", answer.body);
    assert_eq!(status(&outbox, id), DeliveryStatus::Pending);
    // The documented 16 KiB: a form of 10,000 bytes is read too.
    let id = dead_letter(&outbox, "viber");
    let mut body = format!("csrf={csrf}&delivery={id}&pad=");
    body.push_str(&"x".repeat(10_000 - body.len()));
    let answer = post(&console, &cookie, "/console/actions/requeue", &body);
    assert_eq!(answer.status, 303, "{}", answer.body);
    let out = post(
        &console,
        &cookie,
        "/console/sign-out",
        &format!("csrf={csrf}"),
    );
    assert_eq!(out.status, 303);
    let cleared = out.header("Set-Cookie").unwrap();
    assert!(
        cleared.starts_with("outbox_console=;") && cleared.contains("Max-Age=0"),
        "{cleared}"
    );
}

#[test]
fn a_chat_is_held_by_what_holds_it_not_by_a_dismissed_dead_letter_nor_a_live_send() {
    let clock = crate::clock::ManualClock::new(1_767_225_600_000);
    let outbox = Outbox::open_in_memory(
        OutboxOptions::default()
            .with_clock(std::sync::Arc::new(clock.clone()))
            .with_lease(std::time::Duration::from_secs(60)),
    )
    .unwrap();
    outbox
        .set_rules(Rules {
            lane_failure: crate::rules::LaneFailurePolicy::Block,
            ..outbox.rules().unwrap()
        })
        .unwrap();
    // A dismissed dead letter holds nothing: what holds slack's chat 7 is the uncertain
    // reply after it.
    let skipped = dead_letter(&outbox, "slack");
    outbox.dismiss_dead_letters(None).unwrap();
    let held = uncertain(&outbox, "slack");
    outbox
        .enqueue(&NewDelivery::single("slack", "7", "third"))
        .unwrap();
    // Discord's chat 7 is being sent, its lease running: it goes out as it should.
    outbox
        .enqueue(&NewDelivery::single("discord", "7", "first"))
        .unwrap();
    outbox.claim_channels(&["discord"], 1).unwrap();
    outbox
        .enqueue(&NewDelivery::single("discord", "7", "second"))
        .unwrap();
    let console = Console::new(outbox);
    let page = get(&console, "/console/chats");
    assert!(
        page.body.contains(&format!(
            "Part 1 of <a href=\"/console/deliveries/{held}\">"
        )),
        "{}",
        page.body
    );
    assert!(!page.body.contains(&skipped.to_string()), "{}", page.body);
    assert!(!page.body.contains("discord, 7"), "{}", page.body);
    // Its lease runs out (at its end it has): its dispatcher stopped, and the chat is
    // held.
    clock.advance(std::time::Duration::from_secs(60));
    let page = get(&console, "/console/chats");
    assert!(
        page.body.contains("discord, 7") && page.body.contains("its lease ran out"),
        "{}",
        page.body
    );
}

#[test]
fn under_skip_an_uncertain_reply_holds_nothing_and_a_retry_does() {
    let outbox = outbox();
    // Lane failure policy `skip` (the default): the uncertain reply lets the next one
    // go, whose send failed and is retried later; the third waits for that one.
    uncertain(&outbox, "slack");
    let retried = outbox
        .enqueue(&NewDelivery::single("slack", "7", "second"))
        .unwrap()
        .id;
    let claim = outbox.claim_channels(&["slack"], 1).unwrap().remove(0);
    assert_eq!(claim.delivery_id, retried);
    outbox
        .record(
            &claim,
            Outcome::Transient {
                error: "502 Bad Gateway".into(),
            },
        )
        .unwrap();
    outbox
        .enqueue(&NewDelivery::single("slack", "7", "third"))
        .unwrap();
    let page = get(&Console::new(outbox), "/console/chats");
    assert!(
        page.body.contains(&format!(
            "Part 1 of <a href=\"/console/deliveries/{retried}\">"
        )) && page.body.contains("502 Bad Gateway"),
        "{}",
        page.body
    );
    assert!(
        !page.body.contains("may or may not have reached"),
        "{}",
        page.body
    );
}

#[test]
fn a_reply_shows_what_its_platform_was_asked_escaped() {
    let outbox = outbox();
    let id = uncertain(&outbox, "slack");
    let part = outbox.possibly_sent("slack", 1).unwrap().remove(0);
    let answer = crate::settle::Settlement::hold("conversations.history", "<b>internal_error</b>");
    outbox.settle(&part, &answer).unwrap();
    let page = get(&Console::new(outbox), &format!("/console/deliveries/{id}"));
    assert!(
        page.body.contains(
            "Part 1: asked: conversations.history; answered: \
             &lt;b&gt;internal_error&lt;/b&gt;; held for a person"
        ),
        "{}",
        page.body
    );
}

// The review's items, one test each (items 3, 6 and 7 are `outbox serve`'s: tests/serve.rs).

/// Item 1: a page asked for under another name (a rebinding page's) is refused, whatever
/// it is; a request with no `Host` too.
#[test]
fn a_request_naming_another_host_is_refused() {
    let (console, id) = console_with("a secret reply");
    for target in [
        format!("/console/deliveries/{id}?text=1"),
        "/console".to_owned(),
        "/console/style.css".to_owned(),
    ] {
        let rebound = console.respond(&owner_get(&target).with_host("rebind.example:9464"));
        assert_eq!(rebound.status, 421, "{target}");
        assert!(!rebound.body.contains("a secret reply"));
        let hostless = Request {
            host: None,
            ..owner_get(&target)
        };
        assert_eq!(console.respond(&hostless).status, 421, "{target}");
    }
    for own in ["localhost:9464", "127.0.0.1:9464", "[::1]:9464"] {
        let page = owner_get("/console").with_host(own);
        assert_eq!(console.respond(&page).status, 200, "{own}");
    }
    // An embedder names its own hosts and port.
    let named = console.with_allowed_hosts(
        AllowedHosts::loopback(Some(9464))
            .allow("ops.example")
            .unwrap(),
    );
    assert_eq!(
        named
            .respond(&owner_get("/console").with_host("localhost:8080"))
            .status,
        421
    );
    // The name is answered; but it is a name others reach it by (a proxy's), so a
    // console without a token shows nothing under it, even to the owner's socket.
    let proxied = named.respond(&owner_get("/console").with_host("ops.example"));
    assert_eq!(proxied.status, 403);
    assert!(proxied.body.contains("no token"), "{}", proxied.body);
    assert_eq!(
        named
            .respond(&owner_get("/console").with_host("localhost:9464"))
            .status,
        200
    );
}

/// Item 2: with a token, every page but the sign-in form and the style sheet needs the
/// sign-in; nothing of a reply is read before it.
#[test]
fn with_a_token_reading_needs_the_sign_in() {
    let outbox = outbox();
    let id = outbox
        .enqueue(
            &NewDelivery::single("telegram", "chat-42", "a secret reply")
                .with_idempotency_key("turn-1"),
        )
        .unwrap()
        .id;
    dead_letter(&outbox, "slack");
    let console = Console::new(outbox.clone()).with_actions(TOKEN).unwrap();
    let pages = [
        "/console".to_owned(),
        "/console/".to_owned(),
        "/console/chats".to_owned(),
        "/console/uncertain".to_owned(),
        "/console/dead-letters".to_owned(),
        "/console/rules".to_owned(),
        format!("/console/deliveries/{id}?text=1"),
        "/console/deliveries?id=turn-1".to_owned(),
        "/console/deliveries?id=chat-42".to_owned(),
    ];
    for page in &pages {
        let answer = get(&console, page);
        assert_eq!(answer.status, 303, "{page}: {}", answer.body);
        assert_eq!(
            answer.header("Location"),
            Some("/console/sign-in"),
            "{page}"
        );
        for secret in [
            "a secret reply",
            "chat-42",
            "turn-1",
            "bot was blocked",
            "slack",
        ] {
            assert!(!answer.body.contains(secret), "{page} shows {secret}");
        }
    }
    assert_eq!(get(&console, "/console/sign-in").status, 200);
    assert_eq!(get(&console, "/console/style.css").status, 200);
    let (cookie, _) = sign_in(&console);
    for page in &pages[..7] {
        let answer = console.respond(&owner_get(page).with_cookie(&cookie));
        assert_eq!(answer.status, 200, "{page}");
    }
    // Without a token the console is read-only, and read by the file's owner alone.
    assert_eq!(get(&Console::new(outbox), "/console").status, 200);
}

/// Item 4: the form token is the session's — not shown before sign-in, not another
/// session's, not the sign-in form's — and a form from another origin or site is
/// refused with the right tokens.
#[test]
fn an_action_takes_only_its_sessions_form_from_its_own_origin() {
    let outbox = outbox();
    let id = dead_letter(&outbox, "telegram");
    let console = Console::new(outbox.clone()).with_actions(TOKEN).unwrap();
    let sign_in_page = get(&console, "/console/sign-in");
    let public = form_token(&sign_in_page.body);
    let (cookie, csrf) = sign_in(&console);
    let (other_cookie, other_csrf) = sign_in(&console);
    assert_ne!(csrf, other_csrf);
    let requeue = |cookie: &str, csrf: &str| {
        post(
            &console,
            cookie,
            "/console/actions/requeue",
            &format!("csrf={csrf}&delivery={id}"),
        )
    };
    assert_eq!(
        requeue(&cookie, &public).status,
        403,
        "the sign-in form's token"
    );
    assert_eq!(
        requeue(&cookie, &other_csrf).status,
        403,
        "another session's"
    );
    assert_eq!(requeue(&other_cookie, &csrf).status, 403);
    assert_eq!(status(&outbox, id), DeliveryStatus::Failed);
    let body = format!("csrf={csrf}&delivery={id}");
    let form = owner_post("/console/actions/requeue", body.as_bytes())
        .with_host("localhost:9464")
        .with_cookie(&cookie);
    for forged in [
        form.with_origin("http://localhost:8080"),
        form.with_origin("http://evil.example"),
        form.with_origin("null"),
        form.with_fetch_site("same-site"),
        form.with_fetch_site("cross-site"),
    ] {
        let answer = console.respond(&forged);
        assert_eq!(answer.status, 403, "{forged:?}");
        assert!(answer.body.contains("came from another"), "{}", answer.body);
        assert_eq!(status(&outbox, id), DeliveryStatus::Failed);
    }
    let own = form
        .with_origin("http://localhost:9464")
        .with_fetch_site("same-origin");
    assert_eq!(console.respond(&own).status, 303);
    assert_eq!(status(&outbox, id), DeliveryStatus::Pending);
    // Chromium's own form under `Referrer-Policy: no-referrer`: `Origin: null`, and
    // the fetch metadata saying it is the console's own.
    let id = dead_letter(&outbox, "viber");
    let body = format!("csrf={csrf}&delivery={id}");
    let chromium = owner_post("/console/actions/requeue", body.as_bytes())
        .with_cookie(&cookie)
        .with_origin("null")
        .with_fetch_site("same-origin");
    assert_eq!(console.respond(&chromium).status, 303);
    assert_eq!(status(&outbox, id), DeliveryStatus::Pending);
    // The sign-in form is held to the same origin.
    let signing = format!("csrf={public}&token={TOKEN}");
    let forged = owner_post("/console/sign-in", signing.as_bytes()).with_fetch_site("cross-site");
    assert_eq!(console.respond(&forged).status, 403);
}

/// Item 5: the cookie carries a session id, never the token; the session ends at
/// sign-out, when idle and at its lifetime's end; `Secure` when asked or over HTTPS.
#[test]
fn a_session_is_the_servers_and_ends() {
    let (clock, outbox) = outbox_on_a_clock();
    let id = dead_letter(&outbox, "telegram");
    let console = Console::new(outbox.clone()).with_actions(TOKEN).unwrap();
    let (cookie, csrf) = sign_in(&console);
    assert!(!cookie.contains(TOKEN), "{cookie}");
    assert_eq!(cookie.len(), "outbox_console=".len() + 32);
    let reads = |cookie: &str| {
        console
            .respond(&owner_get("/console").with_cookie(cookie))
            .status
            == 200
    };
    assert!(reads(&cookie));
    // The token itself as a cookie is nobody.
    assert!(!reads(&format!("outbox_console={TOKEN}")));
    // Signed out: the old cookie reads nothing and acts on nothing.
    let out = post(
        &console,
        &cookie,
        "/console/sign-out",
        &format!("csrf={csrf}"),
    );
    assert_eq!(out.status, 303);
    assert!(!reads(&cookie));
    let acted = post(
        &console,
        &cookie,
        "/console/actions/requeue",
        &format!("csrf={csrf}&delivery={id}"),
    );
    assert_eq!(acted.status, 403);
    assert_eq!(status(&outbox, id), DeliveryStatus::Failed);
    // Idle past SESSION_IDLE: ended; used within it, it lives on.
    let (cookie, _) = sign_in(&console);
    clock.advance(SESSION_IDLE - std::time::Duration::from_secs(1));
    assert!(reads(&cookie));
    clock.advance(SESSION_IDLE - std::time::Duration::from_secs(1));
    assert!(reads(&cookie));
    clock.advance(SESSION_IDLE);
    assert!(!reads(&cookie));
    // However busy, a session ends SESSION_LIFETIME after sign-in.
    let (cookie, _) = sign_in(&console);
    let mut used = std::time::Duration::ZERO;
    while used + SESSION_IDLE / 2 < SESSION_LIFETIME {
        clock.advance(SESSION_IDLE / 2);
        used += SESSION_IDLE / 2;
        assert!(reads(&cookie));
    }
    clock.advance(SESSION_LIFETIME - used);
    assert!(!reads(&cookie));
    // Secure: asked for, or the request came over HTTPS.
    let set_cookie = |console: &Console, https: bool| {
        let page = get(console, "/console/sign-in");
        let body = format!("csrf={}&token={TOKEN}", form_token(&page.body));
        let request = Request {
            https,
            ..owner_post("/console/sign-in", body.as_bytes())
        };
        console
            .respond(&request)
            .header("Set-Cookie")
            .unwrap()
            .to_owned()
    };
    assert!(!set_cookie(&console, false).contains("Secure"));
    assert!(set_cookie(&console, true).contains("; Secure"));
    let secure = console.clone().with_secure_cookie(true);
    assert!(set_cookie(&secure, false).contains("; Secure"));
}

/// Item 8: wrong tokens are counted per peer and overall; past the allowance a sign-in
/// waits (429 with `Retry-After`) without its token even being compared, and the wait
/// grows.
#[test]
fn wrong_tokens_earn_a_growing_wait() {
    let (clock, outbox) = outbox_on_a_clock();
    let console = Console::new(outbox).with_actions(TOKEN).unwrap();
    let csrf = form_token(&get(&console, "/console/sign-in").body);
    let attacker = IpAddr::from([192, 0, 2, 1]);
    let operator = IpAddr::from([192, 0, 2, 2]);
    let try_token = |peer: IpAddr, token: &str| {
        let body = format!("csrf={csrf}&token={token}");
        console.respond(&owner_post("/console/sign-in", body.as_bytes()).from_peer(peer))
    };
    for _ in 0..=FREE_SIGN_IN_FAILURES {
        assert_eq!(try_token(attacker, "wrong-token-0123456789").status, 403);
    }
    // Even the right token waits now, from that peer.
    let waiting = try_token(attacker, TOKEN);
    assert_eq!(waiting.status, 429, "{}", waiting.body);
    assert_eq!(waiting.header("Retry-After"), Some("1"));
    assert_eq!(waiting.header("Set-Cookie"), None);
    // Another peer is not held up.
    assert_eq!(try_token(operator, TOKEN).status, 303);
    clock.advance(std::time::Duration::from_secs(1));
    assert_eq!(try_token(attacker, "wrong-token-0123456789").status, 403);
    let longer = try_token(attacker, "wrong-token-0123456789");
    assert_eq!(longer.header("Retry-After"), Some("2"));
}

/// Item 9: `back` goes only to a known console page; a CR/LF in it never reaches the
/// `Location` header, and the action is answered as done (303), not 500.
#[test]
fn back_names_a_console_page_and_nothing_reaches_a_header() {
    let outbox = outbox();
    let (console, cookie, csrf) = signed_in(outbox.clone());
    for back in [
        "/console/dead-letters%0d%0aSet-Cookie:%20outbox_console=x",
        "/console/dead-letters%0aX:1",
        "/console/nowhere",
        "/console/actions/dismiss",
        "/console/sign-out",
    ] {
        dead_letter(&outbox, "telegram");
        let answer = post(
            &console,
            &cookie,
            "/console/actions/dismiss",
            &format!("csrf={csrf}&back={back}"),
        );
        assert_eq!(answer.status, 303, "{back}");
        let location = answer.header("Location").unwrap();
        assert!(
            location.starts_with("/console?done=dismissed"),
            "{back}: {location}"
        );
        assert!(!location.bytes().any(|b| b.is_ascii_control()));
        assert_eq!(answer.header("Set-Cookie"), None);
    }
    let id = dead_letter(&outbox, "telegram");
    let answer = post(
        &console,
        &cookie,
        "/console/actions/requeue",
        &format!("csrf={csrf}&delivery={id}&back=/console/deliveries/{id}"),
    );
    assert_eq!(
        answer.header("Location"),
        Some(format!("/console/deliveries/{id}?done=requeued&n=1").as_str())
    );
}

#[test]
fn a_chat_waiting_for_its_platforms_answer_is_held_until_the_answer_is_hold() {
    // Lane failure policy `skip`, the channel asking its platform: the uncertain reply
    // holds its chat until the answer is recorded.
    let options =
        OutboxOptions::default().with_channel("slack", crate::rules::ChannelPolicy::asking());
    let outbox = Outbox::open_in_memory(options).unwrap();
    let held = uncertain(&outbox, "slack");
    outbox
        .enqueue(&NewDelivery::single("slack", "7", "second"))
        .unwrap();
    let console = Console::new(outbox.clone());
    let page = get(&console, "/console/chats");
    assert!(
        page.body.contains("slack, 7")
            && page.body.contains(&format!(
                "Part 1 of <a href=\"/console/deliveries/{held}\">"
            )),
        "{}",
        page.body
    );
    let part = outbox.possibly_sent("slack", 1).unwrap().remove(0);
    let answer = crate::settle::Settlement::hold("history", "internal_error");
    outbox.settle(&part, &answer).unwrap().unwrap();
    let page = get(&console, "/console/chats");
    assert!(!page.body.contains("slack, 7"), "{}", page.body);
    // The chat went on: what holds it now is the next reply's retry, not the held one.
    let claim = outbox.claim_channels(&["slack"], 1).unwrap().remove(0);
    let outcome = Outcome::Transient {
        error: "502 Bad Gateway".into(),
    };
    outbox.record(&claim, outcome).unwrap();
    outbox
        .enqueue(&NewDelivery::single("slack", "7", "third"))
        .unwrap();
    let page = get(&console, "/console/chats");
    assert!(
        page.body.contains(&format!(
            "Part 1 of <a href=\"/console/deliveries/{}\">",
            claim.delivery_id
        )) && !page.body.contains(&held.to_string()),
        "{}",
        page.body
    );
}

/// Who can reach a request decides what it is shown: without a token, the owner's
/// socket alone reads; a TCP client (even on loopback), a proxy in front (any
/// forwarding header) or a name others use read nothing.
#[test]
fn without_a_token_only_the_owner_reads() {
    let (console, id) = console_with("a secret reply");
    let target = format!("/console/deliveries/{id}?text=1");
    let loopback = IpAddr::from([127, 0, 0, 1]);
    let owner = console.respond(&owner_get(&target));
    assert_eq!(owner.status, 200);
    assert!(owner.body.contains("a secret reply"));
    let others = [
        (
            "a TCP client on loopback",
            Request::get(&target).from_peer(loopback),
        ),
        (
            "another machine",
            Request::get(&target).from_peer([192, 0, 2, 7].into()),
        ),
        ("a sender nobody named", Request::get(&target)),
        (
            "a proxy on the owner's socket",
            owner_get(&target).with_forwarded("192.0.2.7"),
        ),
        (
            "a proxy on loopback",
            Request::get(&target)
                .from_peer(loopback)
                .with_forwarded("for=192.0.2.7"),
        ),
    ];
    for (who, request) in others {
        let answer = console.respond(&request);
        assert_eq!(answer.status, 403, "{who}");
        assert!(!answer.body.contains("a secret reply"), "{who}");
        assert!(
            answer.body.contains("--console-token-file"),
            "{who}: says how"
        );
    }
    // Whatever its value: a header a proxy adds marks the request as proxied.
    assert_eq!(
        console.reach(&owner_get(&target).with_forwarded("")),
        Reach::Network
    );
    assert_eq!(console.reach(&owner_get("/console")), Reach::Owner);
    let tcp = Request::get("/console").from_peer(loopback);
    assert_eq!(console.reach(&tcp), Reach::ThisMachine);
    assert_eq!(
        console.reach(&tcp.with_host("127.0.0.2:9464")),
        Reach::ThisMachine
    );
    assert_eq!(console.reach(&tcp.with_host("box.example")), Reach::Network);
    // The style sheet shows nothing of the outbox.
    let style = console.respond(&Request::get("/console/style.css").from_peer(loopback));
    assert_eq!(style.status, 200);
}

/// A sign-in from another machine is taken only over TLS (the request came over HTTPS,
/// or TLS ends in front), or over plain HTTP accepted by name; the cookie is `Secure`
/// whenever TLS is in front. From this machine, plain HTTP crosses no network.
#[test]
fn a_token_crosses_a_network_only_over_tls() {
    let console = Console::new(outbox())
        .with_actions(TOKEN)
        .unwrap()
        .with_allowed_hosts(AllowedHosts::loopback(None).allow("ops.example").unwrap());
    let csrf = form_token(&get(&console, "/console/sign-in").body);
    let body = format!("csrf={csrf}&token={TOKEN}");
    let remote = IpAddr::from([192, 0, 2, 7]);
    let sign_in = |console: &Console, request: Request<'_>| console.respond(&request);
    let plain = Request::post("/console/sign-in", body.as_bytes())
        .with_host("ops.example")
        .from_peer(remote);
    let refused = sign_in(&console, plain);
    assert_eq!(refused.status, 403);
    assert!(refused.body.contains("in clear"), "{}", refused.body);
    assert_eq!(refused.header("Set-Cookie"), None);
    // Refused before the token is looked at: a wrong one is not counted either.
    let wrong = format!("csrf={csrf}&token=not-the-token-0123456789");
    for _ in 0..=FREE_SIGN_IN_FAILURES {
        let guess = Request::post("/console/sign-in", wrong.as_bytes())
            .with_host("ops.example")
            .from_peer(remote);
        assert_eq!(sign_in(&console, guess).status, 403);
    }
    let https = sign_in(&console, plain.over_https());
    assert_eq!(https.status, 303, "{}", https.body);
    assert!(https.header("Set-Cookie").unwrap().contains("; Secure"));
    let behind_tls = console.clone().with_secure_cookie(true);
    let proxied = sign_in(
        &behind_tls,
        plain.with_forwarded("for=192.0.2.7;proto=https"),
    );
    assert_eq!(proxied.status, 303);
    assert!(proxied.header("Set-Cookie").unwrap().contains("; Secure"));
    let accepted = console.clone().with_plain_http_sign_in(true);
    let in_clear = sign_in(&accepted, plain);
    assert_eq!(in_clear.status, 303);
    assert!(!in_clear.header("Set-Cookie").unwrap().contains("Secure"));
    // This machine: no network crossed.
    let local = Request::post("/console/sign-in", body.as_bytes()).from_peer([127, 0, 0, 1].into());
    assert_eq!(sign_in(&console, local).status, 303);
}

/// Wrong tokens from many addresses never keep out the right token from one that has
/// failed nothing; behind a trusted proxy, the clients it forwards are counted apart.
#[test]
fn nobody_elses_wrong_tokens_lock_the_operator_out() {
    let (_clock, outbox) = outbox_on_a_clock();
    let console = Console::new(outbox).with_actions(TOKEN).unwrap();
    let csrf = form_token(&get(&console, "/console/sign-in").body);
    let wrong = format!("csrf={csrf}&token=wrong-token-0123456789");
    let right = format!("csrf={csrf}&token={TOKEN}");
    let attempt = |body: &str, peer: IpAddr, forwarded: Option<&str>| {
        let request = Request {
            forwarded,
            ..owner_post("/console/sign-in", body.as_bytes()).from_peer(peer)
        };
        console.respond(&request).status
    };
    for n in 0..40u8 {
        let status = attempt(&wrong, IpAddr::from([203, 0, 113, n % 12]), None);
        assert!(status == 403 || status == 429, "{status}");
    }
    assert_eq!(attempt(&right, IpAddr::from([198, 51, 100, 7]), None), 303);

    // Behind a proxy every peer is the proxy: trusted, it names the clients.
    let proxy = IpAddr::from([127, 0, 0, 1]);
    let trusting = console.clone().with_trusted_proxies([proxy]);
    let attempt = |body: &str, forwarded: &str| {
        let request = owner_post("/console/sign-in", body.as_bytes())
            .from_peer(proxy)
            .with_forwarded(forwarded);
        trusting.respond(&request.over_https()).status
    };
    for _ in 0..10 {
        attempt(&wrong, "203.0.113.50");
    }
    assert_eq!(attempt(&right, "203.0.113.50"), 429, "its own failures");
    assert_eq!(attempt(&right, "198.51.100.8"), 303, "another client");
}
