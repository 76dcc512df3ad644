//! What both flavours of dispatcher share in their surface: the builder (one type,
//! with a blocking and an async `adapter`/`build`) and the shutdown report.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::{ChannelAdapter, Core, DispatchEvent, DispatchStats, EventSink, Settings, Shared};
use crate::error::Result;
use crate::outbox::Outbox;

/// Builds a [`Dispatcher`](crate::Dispatcher) (or, as
/// [`AsyncDispatcherBuilder`](crate::dispatch::AsyncDispatcherBuilder), an async one): register
/// one adapter per channel, then `build`.
pub struct DispatcherBuilder<A: ?Sized = dyn ChannelAdapter> {
    pub(crate) outbox: Outbox,
    pub(crate) settings: Settings,
    pub(crate) adapters: HashMap<String, Arc<A>>,
    pub(crate) events: Option<EventSink>,
}

impl<A: ?Sized> DispatcherBuilder<A> {
    pub(crate) fn new(outbox: Outbox) -> Self {
        DispatcherBuilder {
            outbox,
            settings: Settings::default(),
            adapters: HashMap::new(),
            events: None,
        }
    }

    /// Worker threads (tasks, for the async flavour), each claiming and sending on its
    /// own. Default 2.
    pub fn workers(mut self, workers: usize) -> Self {
        self.settings.workers = workers;
        self
    }

    /// Sends each worker has in flight at once, to different chats (at most 1024).
    /// Default 1.
    ///
    /// A worker claims exactly the chunks it sends at once, and the outcomes of one
    /// round are committed in the transaction that claims the next, so a crash leaves
    /// at most `workers × batch_size` chunks possibly sent — the sends that were in
    /// flight. A larger batch means fewer commits per chunk (more throughput with fast
    /// platforms) and more concurrent sends; the blocking flavour sends a batch of
    /// more than one on a thread per chunk.
    pub fn batch_size(mut self, batch: usize) -> Self {
        self.settings.batch = batch;
        self
    }

    /// How often the dispatcher looks for commits by other processes (and other
    /// connections) while they come: one watcher looks for all the workers and wakes
    /// them. While nothing changes it looks less and less often, doubling its wait, down
    /// to once a second, so an idle dispatcher wakes about once a second, and a commit
    /// after a quiet spell is noticed within a second. Enqueues in this process wake
    /// workers at once — except [`Outbox::enqueue_in`](crate::Outbox::enqueue_in), whose
    /// reply exists only once the application commits its own transaction: call
    /// [`Outbox::wake`](crate::Outbox::wake) after that commit, or the reply waits for
    /// the watcher's next look. On PostgreSQL with notifications on, other hosts'
    /// commits wake the dispatcher as they come. Default 50 ms.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// How often the dispatcher asks the platforms about parts held uncertain on its
    /// channels whose stored replay policy is
    /// [`Ask`](crate::rules::ReplayPolicy::Ask) (see [`settle`](crate::settle)): each
    /// round asks about up to 16 parts of each such channel that nobody asked about yet.
    /// While nothing is asked and nothing written, the rounds slow down, doubling, to
    /// one every 30 intervals; a part this dispatcher records as uncertain is asked
    /// about at once. Default 1 s.
    pub fn settle_interval(mut self, interval: Duration) -> Self {
        self.settings.settle_interval = interval;
        self
    }

    /// Records a send that has not returned within `timeout` as
    /// [`Outcome::Ambiguous`](crate::Outcome::Ambiguous) (it may have reached the platform) and moves on. Default
    /// none: an adapter should bound its own I/O. Without it, a send that hangs holds
    /// its worker (its lease renewed) but never the other chats for longer than a lease,
    /// even when it is sent alone after a crash. The async flavour drops the send's
    /// future; the blocking flavour runs each send on a thread of its own and abandons
    /// one that does not return in time (its eventual result is ignored).
    pub fn send_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.settings.send_timeout = timeout;
        self
    }

    /// Tells the application what happened to its replies, without polling: `f` is
    /// called with a [`DispatchEvent`] once a reply is finalized (with the platform's
    /// message id of each chunk, to store for later edits) and once one becomes a dead
    /// letter (to tell the user it could not be delivered). It runs on a dispatcher
    /// thread after the outcome is committed: keep it short, say by sending into a
    /// channel. A panic in it is caught and logged.
    ///
    /// ```
    /// use std::sync::mpsc;
    /// use chunked_outbox::{ChannelAdapter, Claim, Dispatcher, NewDelivery, Outbox, OutboxOptions, Outcome};
    /// use chunked_outbox::dispatch::DispatchEvent;
    ///
    /// struct Accept;
    /// impl ChannelAdapter for Accept {
    ///     fn send(&self, _: &Claim) -> Outcome { Outcome::delivered(Some("tg-1".into())) }
    /// }
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let (tx, events) = mpsc::channel();
    /// let dispatcher = Dispatcher::builder(outbox.clone())
    ///     .adapter("telegram", Accept)
    ///     .on_event(move |e| { let _ = tx.send(e.clone()); })
    ///     .build()?;
    /// let id = outbox.enqueue(&NewDelivery::single("telegram", "42", "hi"))?.id;
    /// dispatcher.run_once()?;
    /// match events.try_recv().unwrap() {
    ///     DispatchEvent::Finalized { delivery_id, platform_message_ids, .. } => {
    ///         assert_eq!(delivery_id, id);
    ///         assert_eq!(platform_message_ids, vec![Some("tg-1".to_string())]);
    ///     }
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub fn on_event(mut self, f: impl Fn(&DispatchEvent) + Send + Sync + 'static) -> Self {
        self.events = Some(Arc::new(f));
        self
    }
}

impl<A: ?Sized> DispatcherBuilder<A> {
    pub(crate) fn into_shared(self) -> Result<Arc<Shared<A>>> {
        let channels = self.adapters.keys().cloned().collect();
        let mut core = Core::new(self.outbox, self.settings, channels)?;
        core.events = self.events;
        Ok(Arc::new(Shared {
            core,
            adapters: self.adapters,
        }))
    }
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Every worker finished within the timeout, none by a panic.
    pub clean: bool,
    /// Workers still inside an adapter's `send` when the timeout passed. They record
    /// their outcome when it returns; their leases are renewed until then.
    pub still_sending: usize,
    /// Workers that ended by a panic of the dispatcher itself (adapter panics are
    /// caught and counted in [`DispatchStats::panics`]; a worker goes on after them).
    pub workers_lost: usize,
    /// What the dispatcher did over its life.
    pub stats: DispatchStats,
}
