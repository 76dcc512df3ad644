//! Settling a possibly-sent part by asking the platform (replay policy `Ask`), on both
//! stores, with a scripted adapter: each decision (delivered, resend, hold, later) is
//! recorded on the part, reported and counted; a part is asked about once per time it
//! becomes uncertain; an answer about a part that moved meanwhile changes nothing; the
//! window of a deduplicating platform runs from the part's first send.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chunked_outbox::dispatch::DispatchEvent;
use chunked_outbox::maintenance::Resolution;
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus, ListFilter};
use chunked_outbox::rules::{ChannelPolicy, ReplayPolicy, RetryPolicy};
use chunked_outbox::settle::{Decision, PossiblySent, Settlement};
use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, OutboxOptions, Outcome, Result};
use common::*;

/// What the scripted platform answers to a send and to a question.
#[derive(Clone)]
struct Scripted {
    /// Outcomes of the sends, in order; `Delivered` once they run out.
    sends: Arc<Mutex<Vec<Outcome>>>,
    /// The answer to every question.
    answer: Arc<Mutex<Settlement>>,
    /// The keys it was asked about, and when their first send was.
    asked: Arc<Mutex<Vec<(String, i64)>>>,
    /// Keys of the sends it saw.
    sent: Arc<Mutex<Vec<String>>>,
}

impl Scripted {
    fn new(sends: Vec<Outcome>, answer: Settlement) -> Scripted {
        Scripted {
            sends: Arc::new(Mutex::new(sends)),
            answer: Arc::new(Mutex::new(answer)),
            asked: Arc::default(),
            sent: Arc::default(),
        }
    }

    fn answer(&self, answer: Settlement) {
        *self.answer.lock().unwrap() = answer;
    }

    fn asked(&self) -> Vec<(String, i64)> {
        self.asked.lock().unwrap().clone()
    }

    fn sent(&self) -> Vec<String> {
        self.sent.lock().unwrap().clone()
    }
}

impl ChannelAdapter for Scripted {
    fn send(&self, claim: &Claim) -> Outcome {
        self.sent
            .lock()
            .unwrap()
            .push(claim.idempotency_key.clone());
        let mut sends = self.sends.lock().unwrap();
        if sends.is_empty() {
            Outcome::delivered(Some(format!("m-{}", claim.index)))
        } else {
            sends.remove(0)
        }
    }

    fn settle(&self, part: &PossiblySent) -> Settlement {
        self.asked.lock().unwrap().push((
            part.claim.idempotency_key.clone(),
            part.first_sent_at.timestamp_millis(),
        ));
        self.answer.lock().unwrap().clone()
    }
}

fn timeout() -> Outcome {
    Outcome::Ambiguous {
        error: "read timeout after the request was written".into(),
    }
}

fn asking(replay: ReplayPolicy) -> OutboxOptions {
    OutboxOptions::default().with_channel("chat", ChannelPolicy::default().with_replay(replay))
}

/// A reply of `chunks` to `chat` on the channel "chat".
fn reply(
    outbox: &chunked_outbox::Outbox,
    chat: &str,
    chunks: &[&str],
) -> chunked_outbox::DeliveryId {
    let text = chunks.join("\n\n");
    outbox
        .enqueue(&chunked_outbox::NewDelivery::chunked(
            "chat",
            chat,
            text,
            chunks.iter().copied(),
        ))
        .unwrap()
        .id
}

/// A dispatcher on `db` with `adapter`, its events kept.
fn dispatcher(db: &TestDb, adapter: &Scripted) -> (Dispatcher, Arc<Mutex<Vec<DispatchEvent>>>) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let kept = events.clone();
    let dispatcher = Dispatcher::builder(db.outbox.clone())
        .adapter("chat", adapter.clone())
        .on_event(move |e| kept.lock().unwrap().push(e.clone()))
        .build()
        .unwrap();
    (dispatcher, events)
}

stores! {
    /// Found: the part is delivered with the platform's id, without a second send; the
    /// reply is finalized; the answer is on the part, in the events and the stats.
    fn a_part_the_platform_has_is_delivered_without_a_resend() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let adapter = Scripted::new(
            vec![timeout()],
            Settlement::found("history of 1 for the key", "found, ts 17.5", Some("17.5".into())),
        );
        let (dispatcher, events) = dispatcher(&db, &adapter);
        let id = reply(&db.outbox, "1", &["only"]);
        let first_send = db.now_ms();
        assert_eq!(dispatcher.run_once()?, 1);
        assert_eq!(view(&db.outbox, id).status, DeliveryStatus::Uncertain);
        db.clock.advance(Duration::from_secs(3));

        assert_eq!(dispatcher.settle_once(), 1);
        let v = view(&db.outbox, id);
        assert_eq!(v.status, DeliveryStatus::Delivered);
        let c = &v.chunks[0];
        assert_eq!(c.platform_message_id.as_deref(), Some("17.5"));
        assert_eq!(c.first_sent_at.map(|t| t.timestamp_millis()), Some(first_send));
        let kept = c.settlement.as_deref().unwrap();
        assert!(kept.contains("history of 1 for the key") && kept.contains("found, ts 17.5"), "{kept}");
        assert_eq!(adapter.sent().len(), 1, "no second send");
        assert_eq!(adapter.asked(), [(c.idempotency_key.clone(), first_send)]);
        let stats = dispatcher.stats();
        assert_eq!((stats.settled_delivered, stats.settled_resent, stats.settled_held), (1, 0, 0));
        let events = events.lock().unwrap();
        assert!(events.iter().any(|e| matches!(e, DispatchEvent::Settled { delivery_id, settlement, .. }
            if *delivery_id == id && matches!(settlement.decision, Decision::Delivered { .. }))));
        assert!(events.iter().any(|e| matches!(e, DispatchEvent::Finalized { delivery_id, .. } if *delivery_id == id)));
        Ok(())
    }

    /// Absent (or deduplicated): sent again under the same key, and delivered.
    fn a_part_the_platform_lacks_is_sent_again_under_its_key() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let adapter = Scripted::new(vec![timeout()], Settlement::resend("history", "no message with the key"));
        let (dispatcher, _) = dispatcher(&db, &adapter);
        let id = reply(&db.outbox, "1", &["a", "b"]);
        dispatcher.run_once()?;
        assert_eq!(dispatcher.settle_once(), 1);
        let v = view(&db.outbox, id);
        assert_eq!(v.chunks[0].status, ChunkStatus::Retry);
        assert!(v.chunks[0].settlement.as_deref().unwrap().contains("sent again"));
        // (after the backoff its attempt earned: 5 s, give or take a tenth)
        db.clock.advance(Duration::from_secs(6));
        while dispatcher.run_once()? > 0 {}
        assert_eq!(view(&db.outbox, id).status, DeliveryStatus::Delivered);
        let sent = adapter.sent();
        assert_eq!(sent.len(), 3);
        assert_eq!(sent[0], sent[1], "the resend carries the same key");
        assert_eq!(dispatcher.stats().settled_resent, 1);
        Ok(())
    }

    /// Cannot tell: held for a person, the answer kept; not asked again until it
    /// becomes uncertain again.
    fn a_part_the_platform_cannot_tell_about_is_held_and_asked_once() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let adapter = Scripted::new(vec![timeout(), timeout()], Settlement::hold("history", "internal_error"));
        let (dispatcher, _) = dispatcher(&db, &adapter);
        let id = reply(&db.outbox, "1", &["only"]);
        dispatcher.run_once()?;
        assert_eq!(dispatcher.settle_once(), 1);
        assert_eq!(dispatcher.settle_once(), 0, "asked once");
        assert_eq!(adapter.asked().len(), 1);
        let v = view(&db.outbox, id);
        assert_eq!(v.status, DeliveryStatus::Uncertain);
        assert!(v.chunks[0].settlement.as_deref().unwrap().contains("held for a person"));
        assert_eq!(dispatcher.stats().settled_held, 1);

        // A person sends it again; it is uncertain again: a new question.
        let first_send = v.chunks[0].first_sent_at.unwrap().timestamp_millis();
        db.clock.advance(Duration::from_secs(60));
        db.outbox.resolve_uncertain(v.chunks[0].id, Resolution::Resend)?;
        dispatcher.run_once()?;
        let v = view(&db.outbox, id);
        assert_eq!(v.status, DeliveryStatus::Uncertain);
        assert_eq!(v.chunks[0].settlement, None, "unasked since it became uncertain again");
        adapter.answer(Settlement::found("history", "found", None));
        assert_eq!(dispatcher.settle_once(), 1);
        assert_eq!(view(&db.outbox, id).status, DeliveryStatus::Delivered);
        // The window still runs from the very first send.
        assert_eq!(adapter.asked()[1].1, first_send);
        Ok(())
    }

    /// Under `ask` (and the default lane policy `skip`) the chat waits for the answer:
    /// the next reply is not sent while a part of the one before is being asked about,
    /// so a resend lands before it (A1, A2, B — never A1, B, A2). Once the answer is
    /// "hold", the chat goes on without the held reply.
    fn a_chat_waits_for_the_answer_and_goes_on_once_it_is_hold() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let adapter = Scripted::new(
            vec![Outcome::delivered(Some("a1".into())), timeout()],
            Settlement::resend("history", "no message with the key"),
        );
        let (dispatcher, _) = dispatcher(&db, &adapter);
        let a = reply(&db.outbox, "1", &["a1", "a2"]);
        let b = reply(&db.outbox, "1", &["b"]);
        while dispatcher.run_once()? > 0 {}
        assert_eq!(view(&db.outbox, a).chunks[1].status, ChunkStatus::Uncertain);
        db.clock.advance(Duration::from_secs(3600));
        assert_eq!(dispatcher.run_once()?, 0, "the chat waits for the answer");
        assert_eq!(view(&db.outbox, b).status, DeliveryStatus::Queued);
        assert_eq!(dispatcher.settle_once(), 1);
        db.clock.advance(Duration::from_secs(6));
        while dispatcher.run_once()? > 0 {}
        let keys = |id| view(&db.outbox, id).chunks.iter().map(|c| c.idempotency_key.clone()).collect::<Vec<_>>();
        let sent = adapter.sent();
        let delivered: Vec<_> = sent.iter().skip(2).cloned().collect();
        assert_eq!(delivered, [keys(a)[1].clone(), keys(b)[0].clone()], "A2 again, then B: {sent:?}");
        assert_eq!(view(&db.outbox, b).status, DeliveryStatus::Delivered);

        // Held for a person: the chat goes on at once.
        adapter.answer(Settlement::hold("history", "internal_error"));
        *adapter.sends.lock().unwrap() = vec![timeout()];
        let c = reply(&db.outbox, "1", &["c"]);
        let d = reply(&db.outbox, "1", &["d"]);
        while dispatcher.run_once()? > 0 {}
        assert_eq!(view(&db.outbox, c).status, DeliveryStatus::Uncertain);
        assert_eq!(view(&db.outbox, d).status, DeliveryStatus::Queued, "waits for the answer");
        assert_eq!(dispatcher.settle_once(), 1);
        while dispatcher.run_once()? > 0 {}
        assert_eq!(view(&db.outbox, c).status, DeliveryStatus::Uncertain);
        assert_eq!(view(&db.outbox, d).status, DeliveryStatus::Delivered, "the chat went on");
        Ok(())
    }

    /// A chat waiting for an answer goes on as soon as its channel stops asking (the
    /// stored rules changed by any process): nobody would ask any more.
    fn a_chat_waiting_for_an_answer_goes_on_when_its_channel_stops_asking() -> Result<()> {
        goes_on_once_nobody_asks(asking(ReplayPolicy::Ask), |outbox| {
            outbox.set_channel_policy("chat", Some(ChannelPolicy::default()))
        })
    }

    /// The same when the channel asks under the default channel rules and those stop
    /// asking.
    fn a_chat_waiting_for_an_answer_goes_on_when_the_default_rules_stop_asking() -> Result<()> {
        let options = OutboxOptions::default().with_default_channel(ChannelPolicy::asking());
        goes_on_once_nobody_asks(options, |outbox| {
            let mut rules = outbox.rules()?;
            rules.default_channel = ChannelPolicy::default();
            outbox.set_rules(rules)
        })
    }

    /// Under `hold` nothing is asked, and under `skip` the chat does not wait for a
    /// person: the next reply goes at once.
    fn without_ask_a_held_reply_does_not_stop_its_chat() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Hold));
        let adapter = Scripted::new(vec![timeout()], Settlement::hold("history", "?"));
        let (dispatcher, _) = dispatcher(&db, &adapter);
        let a = reply(&db.outbox, "1", &["a"]);
        let b = reply(&db.outbox, "1", &["b"]);
        while dispatcher.run_once()? > 0 {}
        assert_eq!(view(&db.outbox, a).status, DeliveryStatus::Uncertain);
        assert_eq!(view(&db.outbox, b).status, DeliveryStatus::Delivered);
        Ok(())
    }

    /// A resend the platform decides is another attempt: the part keeps its attempts
    /// and waits the backoff its last one earned; once they are spent it is held for a
    /// person, with why, and asked no more.
    fn a_platform_decided_resend_keeps_the_attempts_and_runs_out() -> Result<()> {
        let retry = RetryPolicy::default().with_max_attempts(3);
        let db = TestDb::new(
            OutboxOptions::default()
                .with_channel("chat", ChannelPolicy::asking().with_retry(retry)),
        );
        let every_send_ambiguous = (0..10).map(|_| timeout()).collect();
        let adapter = Scripted::new(every_send_ambiguous, Settlement::resend("history", "no message with the key"));
        let (dispatcher, _) = dispatcher(&db, &adapter);
        let id = reply(&db.outbox, "1", &["only"]);
        for attempt in 1..=3 {
            assert_eq!(dispatcher.run_once()?, 1, "attempt {attempt} is sent");
            assert_eq!(dispatcher.settle_once(), 1);
            let c = &view(&db.outbox, id).chunks[0];
            assert_eq!(c.attempts, attempt, "the attempts are kept");
            if attempt < 3 {
                assert_eq!(c.status, ChunkStatus::Retry);
                assert_eq!(dispatcher.run_once()?, 0, "sent again before its backoff");
                db.clock.advance(Duration::from_secs(3600));
            }
        }
        let v = view(&db.outbox, id);
        assert_eq!(v.status, DeliveryStatus::Uncertain);
        let kept = v.chunks[0].settlement.as_deref().unwrap();
        assert!(kept.contains("sent 3 times") && kept.contains("held for a person"), "{kept}");
        assert_eq!(adapter.sent().len(), 3);
        db.clock.advance(Duration::from_secs(3600));
        assert_eq!(dispatcher.run_once()?, 0);
        assert_eq!(dispatcher.settle_once(), 0, "asked no more");
        assert_eq!(adapter.sent().len(), 3);
        let stats = dispatcher.stats();
        assert_eq!((stats.settled_resent, stats.settled_held), (2, 1), "counted as held: {stats:?}");
        Ok(())
    }

    /// A resend a window allows carries the window's deadline (its end less a margin):
    /// claimed before it, the part is sent; at or after it, the part is held as
    /// uncertain instead, with why, and asked about again.
    fn a_resend_goes_inside_its_window_or_not_at_all() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let ob = &db.outbox;
        let window = Duration::from_secs(120);
        for chat in ["early", "late"] {
            reply(ob, chat, &["only"]);
            let claim = claim_one(ob);
            ob.record(&claim, timeout())?;
        }
        db.clock.advance(Duration::from_secs(90));
        for part in ob.possibly_sent("chat", 16)? {
            let settlement = Settlement::within_window(&part, window, "test key");
            // 120 s less a tenth: due by 108 s after the first send.
            let by = settlement.resend_by.expect("a deadline");
            assert_eq!(by - part.first_sent_at, chrono::Duration::seconds(108));
            ob.settle(&part, &settlement)?;
        }
        // After the backoff (5 s ± 10%), inside the deadline: one is sent.
        db.clock.advance(Duration::from_secs(10));
        let early = ob.claim(1)?;
        assert_eq!(early.len(), 1);
        assert_eq!(early[0].chat_id, "early");
        // At the deadline the other is held, not sent.
        db.clock.advance(Duration::from_secs(8));
        assert!(ob.claim(16)?.is_empty(), "nothing sent past the deadline");
        let late = ob.list(&ListFilter::default())?.into_iter().find(|v| v.chat_id == "late").unwrap();
        let late = view(ob, late.id);
        assert_eq!(late.status, DeliveryStatus::Uncertain);
        assert!(late.chunks[0].last_error.as_deref().unwrap().contains("had to go by"), "{late:?}");
        // Asked again: the window has passed.
        let again = ob.possibly_sent("chat", 16)?;
        assert_eq!(again.len(), 1);
        assert_eq!(Settlement::within_window(&again[0], window, "test key").decision, Decision::Hold);
        Ok(())
    }

    /// A resend the platform says an earlier send already delivered (a message deleted
    /// since): delivered, with the platform's word kept after the question's.
    fn a_part_delivered_earlier_is_delivered_with_why() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let ob = &db.outbox;
        let id = reply(ob, "1", &["only"]);
        let claim = claim_one(ob);
        ob.record(&claim, timeout())?;
        let part = ob.possibly_sent("chat", 16)?.remove(0);
        ob.settle(&part, &Settlement::resend("the nonce", "inside the window"))?;
        db.clock.advance(Duration::from_secs(6));
        let again = claim_one(ob);
        let note = "Discord answered 10008 Unknown Message: deleted since";
        ob.record(&again, Outcome::DeliveredEarlier { note: note.into() })?;
        let v = view(ob, id);
        assert_eq!(v.status, DeliveryStatus::Delivered);
        let kept = v.chunks[0].settlement.as_deref().unwrap();
        assert!(kept.contains("inside the window") && kept.ends_with(note), "{kept}");
        Ok(())
    }

    /// Later: nothing recorded, asked again at the next round.
    fn a_later_answer_is_asked_again() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let adapter = Scripted::new(vec![timeout()], Settlement::later("history", "ratelimited"));
        let (dispatcher, _) = dispatcher(&db, &adapter);
        let id = reply(&db.outbox, "1", &["only"]);
        dispatcher.run_once()?;
        assert_eq!(dispatcher.settle_once(), 0);
        assert_eq!(view(&db.outbox, id).chunks[0].settlement, None);
        adapter.answer(Settlement::resend("history", "absent"));
        assert_eq!(dispatcher.settle_once(), 1);
        assert_eq!(adapter.asked().len(), 2);
        Ok(())
    }

    /// A "later" with a wait (a rate limit's `Retry-After`): the channel's platform is
    /// asked nothing more — about this part or any other — until the wait is over; the
    /// answer is counted and reported, and nothing is recorded on the part.
    fn a_later_answer_with_a_wait_leaves_the_channel_alone_until_it_is_over() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let adapter = Scripted::new(
            vec![timeout(), timeout()],
            Settlement::later_after("history", "ratelimited", Duration::from_secs(30)),
        );
        let (dispatcher, events) = dispatcher(&db, &adapter);
        let a = reply(&db.outbox, "1", &["only"]);
        reply(&db.outbox, "2", &["only"]);
        while dispatcher.run_once()? > 0 {}
        assert_eq!(adapter.sent().len(), 2);
        assert_eq!(dispatcher.settle_once(), 0);
        assert_eq!(adapter.asked().len(), 1, "one question, not one per part");
        assert_eq!(dispatcher.stats().settled_later, 1);
        assert!(events.lock().unwrap().iter().any(|e| matches!(e, DispatchEvent::Settled { settlement, .. }
            if settlement.decision == Decision::Later)));
        assert_eq!(view(&db.outbox, a).chunks[0].settlement, None, "nothing recorded");
        db.clock.advance(Duration::from_secs(29));
        assert_eq!(dispatcher.settle_once(), 0);
        assert_eq!(adapter.asked().len(), 1, "not asked during the wait");
        db.clock.advance(Duration::from_secs(1));
        adapter.answer(Settlement::found("history", "found", None));
        assert_eq!(dispatcher.settle_once(), 2, "both asked once the wait is over");
        assert_eq!(adapter.asked().len(), 3);
        assert_eq!(view(&db.outbox, a).status, DeliveryStatus::Delivered, "found, as answered");
        Ok(())
    }

    /// Under `Hold` nobody asks; under `Ask` a part whose lease ran out (a crash) is
    /// asked about like one that timed out.
    fn only_asking_channels_are_asked_and_a_crash_is_asked_about() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Hold).with_lease(Duration::from_secs(10)));
        let adapter = Scripted::new(vec![timeout()], Settlement::found("history", "found", None));
        let (dispatcher, _) = dispatcher(&db, &adapter);
        let held = reply(&db.outbox, "1", &["only"]);
        dispatcher.run_once()?;
        assert_eq!(dispatcher.settle_once(), 0);
        assert!(adapter.asked().is_empty());
        assert_eq!(view(&db.outbox, held).status, DeliveryStatus::Uncertain);

        let mut rules = db.outbox.rules()?;
        rules.channels.insert("chat".into(), ChannelPolicy::asking());
        db.outbox.set_rules(rules)?;
        // The held part of before is asked about now; then a claim that dies.
        assert_eq!(dispatcher.settle_once(), 1);
        let crashed = reply(&db.outbox, "2", &["only"]);
        let lost = claim_one(&db.outbox);
        db.clock.advance(Duration::from_secs(11));
        db.outbox.recover(Default::default())?;
        assert_eq!(view(&db.outbox, crashed).status, DeliveryStatus::Uncertain);
        assert_eq!(dispatcher.settle_once(), 1);
        assert_eq!(adapter.asked().last().unwrap().0, lost.idempotency_key);
        assert_eq!(view(&db.outbox, crashed).status, DeliveryStatus::Delivered);
        Ok(())
    }

    /// An answer about a part that moved after it was read (resolved by a person, or
    /// settled by another process) changes nothing.
    fn an_answer_about_a_part_that_moved_is_dropped() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let ob = &db.outbox;
        let id = reply(ob, "1", &["only"]);
        let claim = claim_one(ob);
        ob.record(&claim, timeout())?;
        let parts = ob.possibly_sent("chat", 16)?;
        assert_eq!(parts.len(), 1);
        let found = Settlement::found("history", "found", Some("p".into()));
        // Another process answered first.
        assert!(ob.settle(&parts[0], &Settlement::resend("history", "absent"))?.is_some());
        assert_eq!(ob.settle(&parts[0], &found)?, None);
        assert!(ob.possibly_sent("chat", 16)?.is_empty());
        // Sent again (after its backoff) and uncertain again: the old reading is stale
        // still.
        db.clock.advance(Duration::from_secs(6));
        let again = claim_one(ob);
        db.clock.advance(Duration::from_millis(5));
        ob.record(&again, timeout())?;
        assert_eq!(ob.settle(&parts[0], &found)?, None);
        assert_eq!(view(ob, id).status, DeliveryStatus::Uncertain);
        let fresh = ob.possibly_sent("chat", 16)?;
        assert_eq!(ob.settle(&fresh[0], &found)?.map(|r| r.status), Some(ChunkStatus::Delivered));
        Ok(())
    }

    /// A deduplication window runs from the first send, on the outbox's clock.
    fn a_window_runs_from_the_first_send() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let ob = &db.outbox;
        let window = Duration::from_secs(120);
        for chat in ["1", "2"] {
            reply(ob, chat, &["only"]);
            let claim = claim_one(ob);
            ob.record(&claim, timeout())?;
            db.clock.advance(Duration::from_secs(100));
        }
        // Now: chat 1 first sent 200 s ago, chat 2 100 s ago.
        let parts = ob.possibly_sent("chat", 16)?;
        let decided: Vec<(String, Decision)> = parts
            .iter()
            .map(|p| (p.claim.chat_id.clone(), Settlement::within_window(p, window, "test key").decision))
            .collect();
        assert_eq!(decided, [("1".to_owned(), Decision::Hold), ("2".to_owned(), Decision::Resend)]);
        let second = &parts[1];
        assert_eq!(second.since_first_send(), Duration::from_secs(100));
        assert_eq!(second.uncertain_for(), Duration::from_secs(100));
        let asked = Settlement::within_window(second, window, "test key").asked;
        assert_eq!(asked, "the test key deduplicates for 120 s; first sent 100 s ago");
        // The window is used less a tenth, the time a send may take: open up to 108 s
        // less a millisecond, closed from there.
        let at = |ms: u64| {
            let mut part = second.clone();
            part.now = part.first_sent_at + chrono::Duration::milliseconds(ms as i64);
            Settlement::within_window(&part, window, "test key").decision
        };
        assert_eq!((at(107_999), at(108_000)), (Decision::Resend, Decision::Hold));
        // The words the metric and the logs carry.
        let words: Vec<&str> = [
            Decision::Delivered { platform_message_id: None },
            Decision::Resend,
            Decision::Hold,
            Decision::Later,
        ]
        .iter()
        .map(Decision::as_str)
        .collect();
        assert_eq!(words, ["delivered", "resend", "hold", "later"]);
        Ok(())
    }
}

/// Waits (at most 10 s) until `done` holds, looking every millisecond.
/// A reply of chat 1 held uncertain under `options` (its channel asking), a second one
/// waiting behind it; once `stop_asking` changes the stored rules, the second is sent.
fn goes_on_once_nobody_asks(
    options: OutboxOptions,
    stop_asking: impl FnOnce(&chunked_outbox::Outbox) -> Result<()>,
) -> Result<()> {
    let db = TestDb::new(options);
    let adapter = Scripted::new(vec![timeout()], Settlement::hold("history", "?"));
    let (dispatcher, _) = dispatcher(&db, &adapter);
    let a = reply(&db.outbox, "1", &["a"]);
    let b = reply(&db.outbox, "1", &["b"]);
    while dispatcher.run_once()? > 0 {}
    assert_eq!(view(&db.outbox, b).status, DeliveryStatus::Queued);
    stop_asking(&db.outbox)?;
    while dispatcher.run_once()? > 0 {}
    assert_eq!(view(&db.outbox, a).status, DeliveryStatus::Uncertain);
    assert_eq!(view(&db.outbox, b).status, DeliveryStatus::Delivered);
    Ok(())
}

fn until(mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "not settled in 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

stores! {
    /// A started dispatcher asks by itself, every settle interval: the part that timed
    /// out is found and the reply finalized with no call of the application's.
    fn a_started_dispatcher_settles_by_itself() -> Result<()> {
        let db = TestDb::on_system_clock(asking(ReplayPolicy::Ask));
        let adapter = Scripted::new(vec![timeout()], Settlement::found("history", "found", Some("p".into())));
        let dispatcher = Dispatcher::builder(db.outbox.clone())
            .adapter("chat", adapter.clone())
            .settle_interval(Duration::from_millis(5))
            .build()?;
        let running = dispatcher.start()?;
        let id = reply(&db.outbox, "1", &["only"]);
        until(|| view(&db.outbox, id).status == DeliveryStatus::Delivered);
        let report = running.shutdown(Duration::from_secs(5));
        assert!(report.clean);
        assert_eq!(report.stats.settled_delivered, 1);
        assert_eq!(adapter.sent().len(), 1);
        Ok(())
    }
}

stores! {
    /// The settler asks once per interval, not in a loop, and a shutdown does not wait
    /// for the interval to pass.
    fn the_settler_waits_its_interval_but_not_to_stop() -> Result<()> {
        let db = TestDb::on_system_clock(asking(ReplayPolicy::Ask));
        let adapter = Scripted::new(vec![timeout()], Settlement::later("history", "ratelimited"));
        let dispatcher = Dispatcher::builder(db.outbox.clone())
            .adapter("chat", adapter.clone())
            .settle_interval(Duration::from_secs(3600))
            .build()?;
        reply(&db.outbox, "1", &["only"]);
        dispatcher.run_once()?;
        let running = dispatcher.start()?;
        until(|| !adapter.asked().is_empty());
        let report = running.shutdown(Duration::from_secs(5));
        assert!(report.clean);
        assert_eq!(adapter.asked().len(), 1, "asked again before the interval passed");
        Ok(())
    }
}

#[cfg(feature = "tokio")]
mod async_dispatcher {
    use super::*;
    use chunked_outbox::dispatch::SendFuture;
    use chunked_outbox::{AsyncChannelAdapter, AsyncDispatcher};

    struct Async(Scripted);

    impl AsyncChannelAdapter for Async {
        fn send<'a>(&'a self, claim: &'a Claim) -> SendFuture<'a, Outcome> {
            Box::pin(std::future::ready(self.0.send(claim)))
        }

        fn settle<'a>(&'a self, part: &'a PossiblySent) -> SendFuture<'a, Settlement> {
            Box::pin(std::future::ready(self.0.settle(part)))
        }
    }

    /// The async flavour asks by itself too, on its own task; an answer that the part
    /// is absent sends it again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_started_async_dispatcher_settles_by_itself() {
        let dir = tempfile::tempdir().unwrap();
        let outbox =
            chunked_outbox::Outbox::open(dir.path().join("o.db"), asking(ReplayPolicy::Ask))
                .unwrap();
        let adapter = Scripted::new(vec![timeout()], Settlement::resend("history", "absent"));
        let dispatcher = AsyncDispatcher::builder(outbox.clone())
            .adapter("chat", Async(adapter.clone()))
            .settle_interval(Duration::from_millis(5))
            .build()
            .unwrap();
        let running = dispatcher.start().unwrap();
        let id = reply(&outbox, "1", &["only"]);
        let check = outbox.clone();
        tokio::task::spawn_blocking(move || {
            until(|| view(&check, id).status == DeliveryStatus::Delivered)
        })
        .await
        .unwrap();
        let report = running.shutdown(Duration::from_secs(5)).await;
        assert!(report.clean);
        assert_eq!(report.stats.settled_resent, 1);
        assert_eq!(adapter.sent().len(), 2, "sent, then sent again");
    }
}

/// An adapter with only `send`: it cannot ask.
struct SendOnly;

impl ChannelAdapter for SendOnly {
    fn send(&self, _: &Claim) -> Outcome {
        timeout()
    }
}

stores! {
    /// On an asking channel whose adapter has no way to ask (Telegram's), the part is
    /// held for a person and says why.
    fn an_adapter_that_cannot_ask_holds_the_part() -> Result<()> {
        let db = TestDb::new(asking(ReplayPolicy::Ask));
        let dispatcher = Dispatcher::builder(db.outbox.clone()).adapter("chat", SendOnly).build()?;
        let id = reply(&db.outbox, "1", &["only"]);
        dispatcher.run_once()?;
        assert_eq!(dispatcher.settle_once(), 1);
        let v = view(&db.outbox, id);
        assert_eq!(v.status, DeliveryStatus::Uncertain);
        assert_eq!(
            v.chunks[0].settlement.as_deref(),
            Some("asked: the chat adapter; answered: it has no way to ask its platform; held for a person")
        );
        assert_eq!(dispatcher.settle_once(), 0, "asked once");
        Ok(())
    }
}
