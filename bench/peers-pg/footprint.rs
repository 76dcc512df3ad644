
/// What the timed parts of this process wrote to the server's WAL, for the notes of its
/// result line: `scripts/peers-pg` appends this module to the harness copy's `common`
/// crate and has `Timer` call `start` and `stop`, so every system's timed part (pgmq's
/// as this crate's) is measured the same way. The WAL position (`pg_current_wal_lsn()`)
/// is read before and after each timed part, and `pg_waldump --stats=record` counts the
/// records between: heap inserts and updates are the row versions written, B-tree leaf
/// inserts the index entries. Everything the server logged in the window counts
/// (autovacuum too), as it costs the same disk. The machine's busy CPU time in the
/// window (`/proc/stat`: server, client and everything else) is counted too. The reads
/// and the count are untimed.
pub mod footprint {
    use std::process::Command;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Sum {
        bytes: u64,
        /// Busy CPU time of the whole machine, in clock ticks.
        busy_ticks: u64,
        counts: Vec<(String, u64)>,
        failed: Option<String>,
    }

    static STARTED: Mutex<Option<(u64, u64)>> = Mutex::new(None);

    /// The machine's busy CPU time so far, in clock ticks (`/proc/stat`'s first line
    /// less idle and iowait; 0 where there is none).
    fn busy_ticks() -> u64 {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .filter_map(|t| t.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal (guest time is in user)
        ticks.iter().take(8).sum::<u64>() - ticks.get(3).copied().unwrap_or(0)
            - ticks.get(4).copied().unwrap_or(0)
    }
    static SUM: Mutex<Option<Sum>> = Mutex::new(None);

    fn bin(name: &str) -> String {
        let dir = std::env::var("PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into());
        format!("{dir}/{name}")
    }

    fn psql(sql: &str) -> Result<String, String> {
        let out = Command::new(bin("psql"))
            .args(["-XAtq", "-d", super::ADMIN_DB, "-c", sql])
            .output()
            .map_err(|e| format!("psql: {e}"))?;
        if !out.status.success() {
            return Err(format!("psql: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    fn lsn_text(lsn: u64) -> String {
        format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
    }

    /// The server's WAL write position, as a byte count.
    fn position() -> Result<u64, String> {
        psql("SELECT pg_current_wal_lsn() - '0/0'")?
            .parse()
            .map_err(|e| format!("a WAL position: {e}"))
    }

    pub fn start() {
        *STARTED.lock().unwrap() = position().ok().map(|at| (at, busy_ticks()));
    }

    pub fn stop() {
        let busy = busy_ticks();
        let started = STARTED.lock().unwrap().take();
        let measured = started
            .ok_or_else(|| "no WAL position at the start".to_owned())
            .and_then(|(from, busy_from)| Ok((from, position()?, busy - busy_from)))
            .and_then(|(from, to, busy)| Ok((to - from, busy, records(from, to)?)));
        let mut sum = SUM.lock().unwrap();
        let sum = sum.get_or_insert_with(Sum::default);
        match measured {
            Ok((bytes, busy, counts)) => {
                sum.bytes += bytes;
                sum.busy_ticks += busy;
                for (kind, n) in counts {
                    match sum.counts.iter_mut().find(|(k, _)| *k == kind) {
                        Some((_, total)) => *total += n,
                        None => sum.counts.push((kind, n)),
                    }
                }
            }
            Err(e) => sum.failed = Some(e),
        }
    }

    /// Records by type between two WAL positions (`pg_waldump --stats=record`).
    fn records(from: u64, to: u64) -> Result<Vec<(String, u64)>, String> {
        if from == to {
            return Ok(Vec::new());
        }
        let dir = psql("SHOW data_directory")?;
        let out = Command::new(bin("pg_waldump"))
            .args(["--stats=record", "-p"])
            .arg(format!("{dir}/pg_wal"))
            .args(["-s", &lsn_text(from), "-e", &lsn_text(to)])
            .output()
            .map_err(|e| format!("pg_waldump: {e}"))?;
        if !out.status.success() {
            return Err(format!("pg_waldump: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| {
                let mut words = line.split_whitespace();
                let kind = words.next()?;
                let n = words.next()?.parse().ok()?;
                kind.contains('/').then(|| (kind.to_owned(), n))
            })
            .collect())
    }

    /// "footprint per message: …" for `n` operations, or why there is none.
    pub fn summary(n: usize) -> Option<String> {
        let sum = SUM.lock().unwrap();
        let sum = sum.as_ref()?;
        if let Some(e) = &sum.failed {
            return Some(format!("footprint not measured: {e}"));
        }
        let n = n.max(1) as f64;
        let count = |f: &dyn Fn(&str) -> bool| {
            sum.counts.iter().filter(|(k, _)| f(k)).map(|(_, c)| *c).sum::<u64>() as f64 / n
        };
        let kind = |k: &str| k.split('+').next().unwrap_or(k).to_owned();
        let inserts = count(&|k| kind(k) == "Heap/INSERT" || kind(k) == "Heap2/MULTI_INSERT");
        let updates = count(&|k| kind(k) == "Heap/UPDATE");
        let hot = count(&|k| kind(k) == "Heap/HOT_UPDATE");
        let deletes = count(&|k| kind(k) == "Heap/DELETE");
        let locks = count(&|k| kind(k) == "Heap/LOCK");
        let index = count(&|k| kind(k).starts_with("Btree/INSERT"));
        let commits = count(&|k| kind(k) == "Transaction/COMMIT");
        // (USER_HZ is 100 on every Linux port that matters here.)
        let cpu_ms = sum.busy_ticks as f64 * 10.0 / n;
        Some(format!(
            "footprint per message: {:.0} WAL bytes, {:.2} row versions ({inserts:.2} inserted, \
             {updates:.2} updated, {hot:.2} HOT-updated), {deletes:.2} deleted, {locks:.2} \
             row locks, {index:.2} index entries, {commits:.2} commits, {cpu_ms:.3} ms of \
             CPU (the machine's)",
            sum.bytes as f64 / n,
            inserts + updates + hot,
        ))
    }
}
