//! `outbox config show` and `outbox config set`: the rules stored in the file, which
//! every process on it follows.

use std::fmt::Write as _;
use std::time::Duration;

use chunked_outbox::Outbox;
use chunked_outbox::rules::{
    Backoff, ChannelPolicy, LaneFailurePolicy, LaneOrder, ReplayPolicy, RetryPolicy, Rules,
};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{Value, json};

use crate::CliResult;
use crate::render::{clean, table};

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Print the stored rules: lane order, lane failure policy, retry policy, and each
    /// channel's replay policy, lane interval, rate and retry policy.
    Show {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Change stored rules; every process on the file follows them from its next write.
    Set(SetArgs),
}

#[derive(Args)]
pub struct SetArgs {
    /// How replies to one chat are ordered.
    #[arg(long, value_enum)]
    lane_order: Option<OrderArg>,
    /// What a FIFO chat does when its head reply fails for good or is held.
    #[arg(long, value_enum)]
    lane_failure: Option<FailureArg>,
    /// Change the rules of this channel (its own rules, starting from those it follows
    /// now) instead of the file-wide ones.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["default_channel", "lane_order", "lane_failure"])]
    channel: Option<String>,
    /// Change the rules of channels without rules of their own.
    #[arg(long, conflicts_with_all = ["lane_order", "lane_failure"])]
    default_channel: bool,
    /// With --channel: drop its own rules, so it follows the default again.
    #[arg(long, requires = "channel")]
    inherit: bool,
    /// What happens to a chunk that may have been sent (needs --channel or
    /// --default-channel).
    #[arg(long, value_enum)]
    replay: Option<ReplayArg>,
    /// Minimum time between two sends to one chat, such as 1s (needs --channel or
    /// --default-channel).
    #[arg(long, value_parser = humantime::parse_duration)]
    lane_interval: Option<Duration>,
    /// Most sends per second on the whole channel, across every process; 0 for no
    /// limit (needs --channel or --default-channel).
    #[arg(long, value_name = "PER_SECOND")]
    rate: Option<f64>,
    /// Attempts a chunk gets before it fails (the file's retry policy, or the channel's
    /// own with --channel).
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Delays between retries, such as 5s,25s,2m,10m (the last one repeats).
    #[arg(long, value_delimiter = ',', value_parser = humantime::parse_duration)]
    backoff: Option<Vec<Duration>>,
    /// Relative jitter of each delay, 0.0 to 1.0.
    #[arg(long)]
    jitter: Option<f64>,
    /// Fail a delivery older than this instead of retrying it, such as 1d; `none` for no
    /// limit.
    #[arg(long, value_parser = parse_max_age)]
    max_age: Option<MaxAge>,
    /// The statement that writes a finalized reply into the application's own history,
    /// with named parameters such as :delivery_id, :chat_id, :content (checked against
    /// the file's schema).
    #[arg(long, value_name = "SQL", conflicts_with_all = ["channel", "default_channel", "lane_order", "lane_failure", "no_finalize_sql"])]
    finalize_sql: Option<String>,
    /// Stop writing finalized replies anywhere but the outbox's own history.
    #[arg(long, conflicts_with_all = ["channel", "default_channel", "lane_order", "lane_failure"])]
    no_finalize_sql: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum OrderArg {
    Fifo,
    Parallel,
}

#[derive(Clone, Copy, ValueEnum)]
enum FailureArg {
    Skip,
    Block,
}

#[derive(Clone, Copy, ValueEnum)]
enum ReplayArg {
    Hold,
    Replay,
    Ask,
}

#[derive(Clone, Copy)]
struct MaxAge(Option<Duration>);

fn parse_max_age(s: &str) -> Result<MaxAge, String> {
    if s == "none" {
        return Ok(MaxAge(None));
    }
    humantime::parse_duration(s)
        .map(|d| MaxAge(Some(d)))
        .map_err(|e| format!("{s:?} is not a duration such as 1d, or none: {e}"))
}

pub fn run(outbox: &Outbox, command: &ConfigCommand) -> CliResult<u8> {
    match command {
        ConfigCommand::Show { json } => {
            let policy = outbox.rules()?;
            let channels = known_channels(outbox, &policy)?;
            let finalize = outbox.finalization()?;
            if *json {
                let mut v = policy_json(&policy, &channels);
                v["finalize_sql"] = finalize.map_or(Value::Null, Value::String);
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", policy_text(&policy, &channels, finalize.as_deref()));
            }
            Ok(0)
        }
        ConfigCommand::Set(args) => {
            set(outbox, args)?;
            let policy = outbox.rules()?;
            let channels = known_channels(outbox, &policy)?;
            let finalize = outbox.finalization()?;
            print!("{}", policy_text(&policy, &channels, finalize.as_deref()));
            Ok(0)
        }
    }
}

/// Every channel the file knows: with rules of its own, or with deliveries.
fn known_channels(outbox: &Outbox, policy: &Rules) -> CliResult<Vec<String>> {
    let mut names: Vec<String> = policy.channels.keys().cloned().collect();
    names.extend(outbox.health()?.channels.into_keys());
    names.sort();
    names.dedup();
    Ok(names)
}

fn set(outbox: &Outbox, args: &SetArgs) -> CliResult<()> {
    if args.finalize_sql.is_some() || args.no_finalize_sql {
        outbox.set_finalization(args.finalize_sql.as_deref())?;
        return Ok(());
    }
    let channel_rule_given =
        args.replay.is_some() || args.lane_interval.is_some() || args.rate.is_some();
    let retry_given = args.max_attempts.is_some()
        || args.backoff.is_some()
        || args.jitter.is_some()
        || args.max_age.is_some();
    let mut policy = outbox.rules()?;
    if let Some(name) = &args.channel {
        if args.inherit {
            if channel_rule_given || retry_given {
                return Err(
                    "--inherit drops the channel's own rules; give no other rule with it".into(),
                );
            }
            outbox.set_channel_policy(name, None)?;
            return Ok(());
        }
        let mut rules = policy.channel(name).clone();
        change_channel(&mut rules, args);
        if retry_given {
            let mut retry = policy.retry_for(name).clone();
            change_retry(&mut retry, args);
            rules.retry = Some(retry);
        }
        outbox.set_channel_policy(name, Some(rules))?;
        return Ok(());
    }
    if args.default_channel {
        change_channel(&mut policy.default_channel, args);
    } else if channel_rule_given {
        return Err("--replay, --lane-interval and --rate are rules of a channel: add --channel NAME or --default-channel".into());
    }
    if let Some(order) = args.lane_order {
        policy.lane_order = match order {
            OrderArg::Fifo => LaneOrder::Fifo,
            OrderArg::Parallel => LaneOrder::Parallel,
        };
    }
    if let Some(failure) = args.lane_failure {
        policy.lane_failure = match failure {
            FailureArg::Skip => LaneFailurePolicy::Skip,
            FailureArg::Block => LaneFailurePolicy::Block,
        };
    }
    change_retry(&mut policy.retry, args);
    // Channels keep their own rules: only the file-wide ones change here.
    policy.channels.clear();
    outbox.set_rules(policy)?;
    Ok(())
}

fn change_channel(rules: &mut ChannelPolicy, args: &SetArgs) {
    if let Some(replay) = args.replay {
        rules.replay = match replay {
            ReplayArg::Hold => ReplayPolicy::Hold,
            ReplayArg::Replay => ReplayPolicy::Replay,
            ReplayArg::Ask => ReplayPolicy::Ask,
        };
    }
    if let Some(interval) = args.lane_interval {
        rules.lane_interval = interval;
    }
    if let Some(rate) = args.rate {
        *rules = rules.clone().with_rate_per_second(rate);
    }
}

fn change_retry(retry: &mut RetryPolicy, args: &SetArgs) {
    if let Some(n) = args.max_attempts {
        retry.max_attempts = n;
    }
    if let Some(steps) = &args.backoff {
        retry.backoff = Backoff::Schedule(steps.clone());
    }
    if let Some(jitter) = args.jitter {
        retry.jitter = jitter;
    }
    if let Some(MaxAge(age)) = args.max_age {
        retry.max_age = age;
    }
}

fn duration(d: Duration) -> String {
    if d.is_zero() {
        "0s".into()
    } else {
        humantime::format_duration(d).to_string()
    }
}

fn rate(d: Duration) -> String {
    if d.is_zero() {
        "no limit".into()
    } else {
        format!("{:.2}/s", 1.0 / d.as_secs_f64())
    }
}

fn retry_text(r: &RetryPolicy) -> String {
    let backoff = match &r.backoff {
        Backoff::Schedule(steps) => steps
            .iter()
            .map(|d| duration(*d))
            .collect::<Vec<_>>()
            .join(", "),
        Backoff::Exponential { base, factor, cap } => {
            format!("{} ×{factor} up to {}", duration(*base), duration(*cap))
        }
        _ => "?".into(),
    };
    let age = r.max_age.map_or("no maximum age".into(), |a| {
        format!("at most {} old", duration(a))
    });
    format!(
        "{backoff}; {} attempts; jitter ±{:.0} %; {age}",
        r.max_attempts,
        r.jitter * 100.0
    )
}

fn replay_word(r: ReplayPolicy) -> &'static str {
    match r {
        ReplayPolicy::Replay => "replay",
        ReplayPolicy::Ask => "ask",
        _ => "hold",
    }
}

fn policy_text(p: &Rules, channels: &[String], finalize: Option<&str>) -> String {
    let order = match p.lane_order {
        LaneOrder::Parallel => "parallel",
        _ => "fifo",
    };
    let failure = match p.lane_failure {
        LaneFailurePolicy::Block => "block",
        _ => "skip",
    };
    let d = &p.default_channel;
    let mut out = format!(
        "lane order     {order}\nlane failure   {failure}\nretry          {}\ndefault rules  replay {}, lane interval {}, rate {}\n",
        retry_text(&p.retry),
        replay_word(d.replay),
        duration(d.lane_interval),
        rate(d.channel_interval)
    );
    let _ = writeln!(
        out,
        "finalization   outbound_messages{}",
        finalize.map_or(String::new(), |sql| {
            let sql: Vec<&str> = sql.split_whitespace().collect();
            format!(", then: {}", clean(&sql.join(" ")))
        })
    );
    let rows: Vec<Vec<String>> = channels
        .iter()
        .map(|name| {
            let own = p.channels.contains_key(name);
            let c = p.channel(name);
            vec![
                clean(name),
                if own { "own" } else { "default" }.into(),
                replay_word(c.replay).into(),
                duration(c.lane_interval),
                rate(c.channel_interval),
                c.retry.as_ref().map_or("the file's".into(), retry_text),
            ]
        })
        .collect();
    if rows.is_empty() {
        out.push_str("no channels yet\n");
    } else {
        out.push_str(&table(
            &[
                "channel",
                "rules",
                "replay",
                "lane interval",
                "rate",
                "retry",
            ],
            rows,
        ));
    }
    out
}

fn retry_json(r: &RetryPolicy) -> Value {
    let ms = |d: Duration| d.as_millis() as u64;
    let backoff = match &r.backoff {
        Backoff::Schedule(steps) => {
            json!({ "schedule_ms": steps.iter().map(|d| ms(*d)).collect::<Vec<_>>() })
        }
        Backoff::Exponential { base, factor, cap } => {
            json!({ "exponential": { "base_ms": ms(*base), "factor": factor, "cap_ms": ms(*cap) } })
        }
        _ => Value::Null,
    };
    json!({
        "backoff": backoff,
        "max_attempts": r.max_attempts,
        "jitter": r.jitter,
        "max_age_ms": r.max_age.map(ms),
    })
}

fn channel_json(c: &ChannelPolicy) -> Value {
    let ms = |d: Duration| d.as_millis() as u64;
    json!({
        "replay": replay_word(c.replay),
        "lane_interval_ms": ms(c.lane_interval),
        "channel_interval_us": c.channel_interval.as_micros() as u64,
        "rate_per_second": (!c.channel_interval.is_zero()).then(|| 1.0 / c.channel_interval.as_secs_f64()),
        "retry": c.retry.as_ref().map(retry_json),
    })
}

fn policy_json(p: &Rules, channels: &[String]) -> Value {
    let mut per_channel = serde_json::Map::new();
    for name in channels {
        let mut rules = channel_json(p.channel(name));
        rules["own_rules"] = Value::Bool(p.channels.contains_key(name));
        per_channel.insert(name.clone(), rules);
    }
    json!({
        "schema_version": chunked_outbox::store::sqlite::SCHEMA_VERSION,
        "lane_order": match p.lane_order { LaneOrder::Parallel => "parallel", _ => "fifo" },
        "lane_failure": match p.lane_failure { LaneFailurePolicy::Block => "block", _ => "skip" },
        "retry": retry_json(&p.retry),
        "default_channel": channel_json(&p.default_channel),
        "channels": per_channel,
    })
}
