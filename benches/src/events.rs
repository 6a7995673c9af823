//! `kvpool-bench events`: what publishing KV events costs the puts. Writers put 64 KiB values
//! back to back into one daemon, whose memory fills and then evicts all the time (each put is
//! then two events: the commit and an eviction); in windows that alternate in pairs (off then
//! on, then on then off, so that a drift of the shared machine's load biases neither side) a
//! subscriber reads every event of the namespace, or there is none. The figures: the puts per
//! second of each window, the events per second the subscriber was sent and those dropped for
//! lag, the CPU time the daemon and this process spent per put (which side the events cost),
//! and each pair's ratio of put throughput, on over off (goal: at least 0.95). Every run
//! is bounded and stops by itself; nothing here asserts on time.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use clap::Args;
use kvpool_bench::units::{self, fmt_rate, fmt_size};
use kvpool_client::{Client, ClientConfig, SameHost};

use crate::perf::daemon::{self, Daemon};
use crate::perf::machine::{process_ticks, ticks_per_s, Machine};

/// The goal: put throughput with a subscriber at least this share of it without one.
const GOAL: f64 = 0.95;

/// Time the writers run before the first window, so that every window sees a full pool.
const WARM_UP: Duration = Duration::from_secs(1);

/// Time a window waits after subscribing or unsubscribing before it counts.
const SETTLE: Duration = Duration::from_millis(200);

/// Flags of `kvpool-bench events`.
#[derive(Args, Debug)]
pub(crate) struct EventsArgs {
    /// Pairs of windows (one without a subscriber, one with, the order alternating).
    #[arg(long, default_value_t = 3)]
    pairs: usize,
    /// Length of each window, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    window_ms: u64,
    /// DRAM of the daemon (B, KiB, MiB, GiB).
    #[arg(long, default_value = "256MiB", value_parser = units::parse_size)]
    memory: u64,
    /// Value size of the puts.
    #[arg(long, default_value = "64KiB", value_parser = units::parse_size)]
    put_size: u64,
    /// Writer tasks, each on its own connection, putting new keys back to back.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
}

/// What one window saw.
struct Window {
    pair: usize,
    subscribed: bool,
    puts_per_s: f64,
    events_per_s: f64,
    dropped: u64,
    /// CPU time the daemon spent per put, microseconds (its events' cost shows here).
    daemon_us_per_put: f64,
    /// CPU time this process (writers, and the subscriber when there is one) spent per put.
    bench_us_per_put: f64,
}

/// Runs the windows and prints each, then the ratios.
pub(crate) fn run(args: EventsArgs) -> anyhow::Result<()> {
    ensure!(
        args.pairs > 0 && args.writers > 0,
        "--pairs and --writers must be positive"
    );
    let machine = Machine::detect();
    println!("kvpool-bench events — {}", machine.describe());
    println!(
        "  DRAM {}, {} writer(s) of {} puts back to back, windows of {} ms",
        fmt_size(args.memory),
        args.writers,
        fmt_size(args.put_size),
        args.window_ms
    );
    let rt = crate::perf::runtime(&machine)?;
    let bin = args.kvpoold.clone().unwrap_or_else(daemon::default_binary);
    let d = Daemon::start_with(&bin, args.memory, &[])?;
    let windows = rt.block_on(windows(&args, &d))?;
    print!("{}", render(&windows));
    Ok(())
}

async fn connect(d: &Daemon) -> anyhow::Result<Client> {
    let cfg = ClientConfig {
        same_host: SameHost::Off,
        ..ClientConfig::default()
    };
    Ok(Client::connect(&format!("tcp://{}", d.tcp), cfg).await?)
}

/// Starts the writers, warms the pool up, then runs the windows in alternating pairs.
async fn windows(args: &EventsArgs, d: &Daemon) -> anyhow::Result<Vec<Window>> {
    let stop = Arc::new(AtomicBool::new(false));
    let puts = Arc::new(AtomicU64::new(0));
    let value = Arc::new(vec![0x5a_u8; args.put_size as usize]);
    let mut writers = Vec::new();
    for w in 0..args.writers {
        let c = connect(d).await?;
        let (stop, puts, value) = (stop.clone(), puts.clone(), value.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("events-bench/{w}/{i}");
                c.put(key.as_bytes(), &value).await?;
                puts.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            anyhow::Ok(())
        }));
    }
    tokio::time::sleep(WARM_UP).await;
    let mut out = Vec::new();
    let result = async {
        for pair in 0..args.pairs {
            let order = if pair % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for subscribed in order {
                let w = window(args, d, &puts, pair, subscribed).await?;
                eprintln!(
                    "  pair {pair}, subscriber {}: {} puts/s, {} events/s, {} dropped",
                    if subscribed { "on" } else { "off" },
                    fmt_rate(w.puts_per_s),
                    fmt_rate(w.events_per_s),
                    w.dropped
                );
                out.push(w);
            }
        }
        anyhow::Ok(())
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await??;
    }
    result?;
    Ok(out)
}

/// One window: puts counted over `--window-ms`, with a subscriber reading every event or none.
async fn window(
    args: &EventsArgs,
    d: &Daemon,
    puts: &AtomicU64,
    pair: usize,
    subscribed: bool,
) -> anyhow::Result<Window> {
    let events = Arc::new(AtomicU64::new(0));
    let dropped = Arc::new(AtomicU64::new(0));
    let reader = if subscribed {
        let c = connect(d).await?;
        let mut sub = c.kv_events(b"").await?;
        let (events, dropped) = (events.clone(), dropped.clone());
        Some(tokio::spawn(async move {
            let _client = c;
            while let Some(b) = sub.next().await {
                let b = b?;
                events.fetch_add(b.events.len() as u64, Ordering::Relaxed);
                dropped.fetch_add(b.dropped, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }))
    } else {
        None
    };
    tokio::time::sleep(SETTLE).await;
    let (p0, e0, d0, t0) = (
        puts.load(Ordering::Relaxed),
        events.load(Ordering::Relaxed),
        dropped.load(Ordering::Relaxed),
        Instant::now(),
    );
    let (daemon0, bench0) = (process_ticks(d.pid()), process_ticks(std::process::id()));
    tokio::time::sleep(Duration::from_millis(args.window_ms)).await;
    let secs = t0.elapsed().as_secs_f64();
    let n = (puts.load(Ordering::Relaxed) - p0).max(1) as f64;
    let us_per_put = |ticks: u64| ticks as f64 / ticks_per_s() * 1e6 / n;
    let w = Window {
        pair,
        subscribed,
        puts_per_s: (puts.load(Ordering::Relaxed) - p0) as f64 / secs,
        events_per_s: (events.load(Ordering::Relaxed) - e0) as f64 / secs,
        dropped: dropped.load(Ordering::Relaxed) - d0,
        daemon_us_per_put: us_per_put(process_ticks(d.pid()) - daemon0),
        bench_us_per_put: us_per_put(process_ticks(std::process::id()) - bench0),
    };
    if let Some(r) = reader {
        r.abort();
    }
    Ok(w)
}

/// The windows and, per pair, the ratio of put throughput (on over off) against the goal.
fn render(windows: &[Window]) -> String {
    let mut s = String::from(
        "\n  pair  subscriber  puts/s      events/s    dropped  daemon CPU/put  bench CPU/put\n",
    );
    for w in windows {
        s += &format!(
            "  {:<4}  {:<10}  {:<10}  {:<10}  {:<7}  {:<14}  {:.1} µs\n",
            w.pair,
            if w.subscribed { "on" } else { "off" },
            fmt_rate(w.puts_per_s),
            fmt_rate(w.events_per_s),
            w.dropped,
            format!("{:.1} µs", w.daemon_us_per_put),
            w.bench_us_per_put
        );
    }
    let mut ratios = Vec::new();
    for pair in windows.chunks(2) {
        let on = pair.iter().find(|w| w.subscribed);
        let off = pair.iter().find(|w| !w.subscribed);
        if let (Some(on), Some(off)) = (on, off) {
            ratios.push(on.puts_per_s / off.puts_per_s.max(f64::MIN_POSITIVE));
        }
    }
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    let median = match n {
        0 => 0.0,
        _ if n % 2 == 1 => ratios[n / 2],
        _ => (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0,
    };
    let list: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
    s += &format!(
        "\n  put throughput with a subscriber / without: {} (median {median:.3}, goal ≥ {GOAL}: {})\n",
        list.join(", "),
        if median >= GOAL { "met" } else { "not met" }
    );
    s
}
