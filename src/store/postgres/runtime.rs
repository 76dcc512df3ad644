//! Where the blocking PostgreSQL client may run. It drives its connection with a tokio
//! runtime of its own, which tokio refuses to start (or drop) on a thread that is
//! running an async runtime's tasks: called there, it would abort the process. So the
//! store's entry points — connect, every transaction, the pool's drop — run through
//! [`off_runtime`].

use std::cell::Cell;

use tokio::runtime::{Handle, RuntimeFlavor};

thread_local! {
    /// Set while a thread runs the crate's own database work off the runtime (the
    /// tokio dispatcher's, on the blocking pool).
    static OFF: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` where the blocking client may run:
///
/// - here, on a thread that runs no runtime's tasks (a plain thread, tokio's blocking
///   pool);
/// - on a multi-thread runtime's worker, here under `block_in_place`, which moves the
///   worker's other tasks to other workers while `f` waits on the network;
/// - on a current-thread runtime, on a thread of its own, which the caller waits for (a
///   synchronous call from async code blocks its task, as any does).
pub(crate) fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if OFF.with(Cell::get) {
        return f();
    }
    match Handle::try_current() {
        Err(_) => f(),
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        Ok(_) => std::thread::scope(|s| match s.spawn(f).join() {
            Ok(value) => value,
            Err(panic) => std::panic::resume_unwind(panic),
        }),
    }
}

/// Runs `f`, the crate's own database work on a thread of tokio's blocking pool,
/// telling [`off_runtime`] that it runs off the runtime already.
#[cfg(feature = "tokio")]
pub(crate) fn on_blocking_pool<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            OFF.with(|off| off.set(self.0));
        }
    }
    let _reset = Reset(OFF.with(|off| off.replace(true)));
    f()
}
