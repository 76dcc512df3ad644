//! Both crates in one program, on one SQLite: the application's own sqlx pool and the
//! outbox, side by side.

fn main() {
    let _pool: Option<sqlx::SqlitePool> = None;
    let outbox = chunked_outbox::Outbox::open_in_memory(Default::default()).expect("outbox");
    println!("{}", outbox.health().expect("health").totals.total_deliveries);
}
