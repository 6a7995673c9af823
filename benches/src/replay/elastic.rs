//! `kvpool-bench elastic`: the hit rate around a cluster event (a node joining or draining),
//! window by window, on real daemons replaying a trace in real time.
//!
//! The trace up to `at - before` is replayed as fast as it goes (the warm-up: the cache fills,
//! nothing is counted). From there requests are paced by their timestamps (divided by
//! `speed`), so the cluster's background work (handover, gossip) gets the wall time it would
//! get in production; at trace time `at` the event command runs (`sh -c`, beside the traffic,
//! not blocking it), and the hit rate is counted per `window` of trace time until `at + after`.
//! A run without a command is the control: the same requests, the cluster left as it was.
//!
//! A lookup or store that fails counts as a miss and as an error, as an engine would treat it;
//! a block that comes back with other bytes than were stored stops the run (the engine
//! checks every loaded block).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;

use super::cache::BlockCache;
use super::cli::BUNDLED_TRACE;
use super::pool_engine::{Remote, WrongBytes};
use super::trace::{Trace, TraceFormat};
use crate::units::parse_size;

/// `kvpool-bench elastic`.
#[derive(Args, Debug, Clone)]
pub struct ElasticArgs {
    /// Trace file (JSONL). Default: the bundled Mooncake conversation trace.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Trace format.
    #[arg(long, value_enum, default_value = "auto")]
    pub format: TraceFormat,
    /// Milliseconds per timestamp unit (default: what the format implies).
    #[arg(long)]
    pub time_unit_ms: Option<f64>,
    /// A node of the running cluster; the client routes every block to its owner.
    #[arg(long)]
    pub endpoint: String,
    /// Namespace on the cluster.
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// Bytes per block.
    #[arg(long, default_value = "16KiB")]
    pub block_bytes: String,
    /// Trace time of the event, seconds.
    #[arg(long, default_value_t = 1200.0)]
    pub at: f64,
    /// Trace seconds replayed in real time before the event (the steady state).
    #[arg(long, default_value_t = 120.0)]
    pub before: f64,
    /// Trace seconds replayed after the event.
    #[arg(long, default_value_t = 180.0)]
    pub after: f64,
    /// Window of the hit rate, trace seconds.
    #[arg(long, default_value_t = 60.0)]
    pub window: f64,
    /// Trace seconds per wall second in the paced part (1: real time).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Shell command run at the event (e.g. `kvpool cluster drain 3`); none: a control run.
    #[arg(long)]
    pub run: Option<String>,
    /// Hold the replay until the event's command has finished (then go on at the same pace):
    /// measures the cluster after the event rather than while it happens. A command still
    /// running after 10 minutes fails the run.
    #[arg(long)]
    pub wait_event: bool,
    /// Name of the run in the output.
    #[arg(long, default_value = "run")]
    pub label: String,
    /// Append the windows to this CSV file (written with a header when new).
    #[arg(long)]
    pub csv: Option<PathBuf>,
}

/// When the paced part starts and the event happens, in trace milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// The event.
    pub at_ms: u64,
    /// Paced replay from here (requests before it are the warm-up).
    pub from_ms: u64,
    /// Replay ends here.
    pub until_ms: u64,
    /// Window length.
    pub window_ms: u64,
    /// Trace time per wall time in the paced part.
    pub speed: f64,
    /// Hold the replay until the event's command has finished.
    pub wait_event: bool,
}

impl Plan {
    /// From the flags.
    pub fn new(at: f64, before: f64, after: f64, window: f64, speed: f64) -> anyhow::Result<Plan> {
        let valid = [at, before, after, window, speed]
            .iter()
            .all(|v| v.is_finite())
            && at >= 0.0
            && before >= 0.0
            && after > 0.0
            && window > 0.0
            && speed > 0.0;
        if !valid {
            bail!("--at and --before must be at least 0, --after, --window and --speed above 0, all finite");
        }
        let ms = |s: f64| (s * 1000.0).round() as u64;
        Ok(Plan {
            at_ms: ms(at),
            from_ms: ms((at - before).max(0.0)),
            until_ms: ms(at + after),
            window_ms: ms(window).max(1),
            speed,
            wait_event: false,
        })
    }

    /// The window a request arriving at `ms` counts in: 0 is the first after the event,
    /// -1 the last before it.
    pub fn window_of(&self, ms: u64) -> i64 {
        let d = ms as i64 - self.at_ms as i64;
        d.div_euclid(self.window_ms as i64)
    }
}

/// One window's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    /// Window index (see [`Plan::window_of`]).
    pub index: i64,
    /// Requests.
    pub requests: u64,
    /// Blocks requested.
    pub blocks: u64,
    /// Blocks found (leading runs).
    pub hits: u64,
    /// Lookups or stores that failed (counted as misses).
    pub errors: u64,
}

impl Window {
    /// hits / blocks.
    pub fn hit_rate(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            self.hits as f64 / self.blocks as f64
        }
    }
}

/// What a run saw.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Warm-up requests (not counted).
    pub warmup_requests: u64,
    /// The windows of the paced part, in order.
    pub windows: Vec<Window>,
    /// Wall seconds from the event to the end of its command (None: no event, or it was still
    /// running when the replay ended).
    pub event_seconds: Option<f64>,
    /// The latest a request was issued after its paced time, seconds.
    pub max_lag_s: f64,
}

/// The event command, running beside the traffic.
struct Event {
    child: Child,
    started: Instant,
}

impl Event {
    /// Starts `cmd` (`sh -c`).
    fn start(cmd: &str) -> anyhow::Result<Event> {
        let child = Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .spawn()
            .with_context(|| format!("running {cmd:?}"))?;
        Ok(Event {
            child,
            started: Instant::now(),
        })
    }

    /// How long the command ran, once it has exited; None while it runs. A failed command is
    /// an error.
    fn poll(&mut self) -> anyhow::Result<Option<Duration>> {
        match self.child.try_wait()? {
            None => Ok(None),
            Some(status) if status.success() => Ok(Some(self.started.elapsed())),
            Some(status) => bail!("the event command failed: {status}"),
        }
    }

    /// Waits for the command to exit, at most `limit` (then kills it: an error).
    fn wait(&mut self, limit: Duration) -> anyhow::Result<Duration> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(took) = self.poll()? {
                return Ok(took);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("the event command was still running after {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Longest the replay holds for the event's command (`wait_event`), and longest it waits for
/// one still running after the replay.
const EVENT_LIMIT: Duration = Duration::from_secs(600);
const AFTER_LIMIT: Duration = Duration::from_secs(120);

/// Replays `trace` against `cache` by `plan`, running `event` (`sh -c`) when the trace reaches
/// the event.
pub fn replay_around(
    trace: &Trace,
    cache: &mut dyn BlockCache,
    plan: &Plan,
    event: Option<&str>,
) -> anyhow::Result<Outcome> {
    let mut o = Outcome::default();
    // The command until its time comes, then the running command until it has exited.
    let mut waiting = event;
    let mut running: Option<Event> = None;
    let mut paced_start: Option<Instant> = None;
    for r in trace
        .requests
        .iter()
        .take_while(|r| r.arrival_ms < plan.until_ms)
    {
        if r.arrival_ms < plan.from_ms {
            lookup_and_store(cache, &r.blocks)?;
            o.warmup_requests += 1;
            continue;
        }
        let start = *paced_start.get_or_insert_with(Instant::now);
        let due = Duration::from_secs_f64((r.arrival_ms - plan.from_ms) as f64 / 1e3 / plan.speed);
        let now = start.elapsed();
        if now < due {
            std::thread::sleep(due - now);
        } else {
            o.max_lag_s = o.max_lag_s.max((now - due).as_secs_f64());
        }
        if let Some(cmd) = waiting.filter(|_| r.arrival_ms >= plan.at_ms) {
            waiting = None;
            eprintln!(
                "event at trace time {:.0} s: {cmd}",
                r.arrival_ms as f64 / 1e3
            );
            let mut e = Event::start(cmd)?;
            if plan.wait_event {
                let took = e.wait(EVENT_LIMIT)?;
                o.event_seconds = Some(took.as_secs_f64());
                // The rest keeps its pace from here.
                paced_start = Some(start + took);
            } else {
                running = Some(e);
            }
        }
        if let Some(took) = running.as_mut().map(Event::poll).transpose()?.flatten() {
            o.event_seconds = Some(took.as_secs_f64());
            running = None;
        }
        let index = plan.window_of(r.arrival_ms);
        if o.windows.last().is_none_or(|w| w.index != index) {
            o.windows.push(Window {
                index,
                ..Window::default()
            });
        }
        let (hits, failed) = lookup_and_store(cache, &r.blocks)?;
        let w = o.windows.last_mut().expect("pushed above");
        w.requests += 1;
        w.blocks += r.blocks.len() as u64;
        w.hits += hits as u64;
        w.errors += u64::from(failed);
    }
    if waiting.is_some() {
        bail!("the trace ends before the event's time");
    }
    // Still running (a drain that waits for the node to leave): it must still end, and well.
    if let Some(mut e) = running {
        e.wait(AFTER_LIMIT)?;
    }
    Ok(o)
}

/// One request: the hit prefix (loaded and checked by the cache), then all its blocks stored.
/// A failure is a miss (and reported as one); wrong bytes are not a failure but the end.
fn lookup_and_store(cache: &mut dyn BlockCache, blocks: &[u64]) -> anyhow::Result<(usize, bool)> {
    let (hits, mut failed) = match cache.lookup(blocks) {
        Ok(h) => (h, false),
        Err(e) if is_wrong_bytes(&e) => return Err(e),
        Err(_) => (0, true),
    };
    match cache.store(blocks, &[]) {
        Ok(()) => {}
        Err(e) if is_wrong_bytes(&e) => return Err(e),
        Err(_) => failed = true,
    }
    Ok((hits, failed))
}

fn is_wrong_bytes(e: &anyhow::Error) -> bool {
    e.downcast_ref::<WrongBytes>().is_some()
}

/// Runs the subcommand.
pub fn run(args: &ElasticArgs) -> anyhow::Result<()> {
    let path = args
        .trace
        .clone()
        .unwrap_or_else(|| PathBuf::from(BUNDLED_TRACE));
    let trace = Trace::load(&path, args.format, None, args.time_unit_ms, None)?;
    let plan = Plan {
        wait_event: args.wait_event,
        ..Plan::new(args.at, args.before, args.after, args.window, args.speed)?
    };
    let block_bytes = parse_size(&args.block_bytes).map_err(anyhow::Error::msg)?;
    let mut cache = Remote::connect(&args.endpoint, &args.namespace, block_bytes, 0)?;
    let nodes = cache.cluster_nodes()?;
    eprintln!(
        "{}: {} serving nodes; warm-up to {:.0} s, paced to {:.0} s, event at {:.0} s",
        args.label,
        nodes,
        plan.from_ms as f64 / 1e3,
        plan.until_ms as f64 / 1e3,
        plan.at_ms as f64 / 1e3
    );
    let o = replay_around(&trace, &mut cache, &plan, args.run.as_deref())?;
    print_windows(&args.label, &plan, &o);
    if let Some(csv) = &args.csv {
        append_csv(csv, &args.label, &plan, &o)?;
        eprintln!("appended to {}", csv.display());
    }
    Ok(())
}

fn span(plan: &Plan, index: i64) -> (f64, f64) {
    let w = plan.window_ms as f64 / 1e3;
    (index as f64 * w, (index + 1) as f64 * w)
}

fn print_windows(label: &str, plan: &Plan, o: &Outcome) {
    println!(
        "{label}: {} warm-up requests; event command took {}; pacing lag at most {:.2} s",
        o.warmup_requests,
        o.event_seconds
            .map_or_else(|| "-".to_string(), |s| format!("{s:.1} s")),
        o.max_lag_s
    );
    println!(
        "{:<14} {:>16} {:>9} {:>9} {:>8} {:>7}",
        "run", "window (s)", "requests", "blocks", "hit%", "errors"
    );
    for w in &o.windows {
        let (a, b) = span(plan, w.index);
        println!(
            "{label:<14} {:>16} {:>9} {:>9} {:>7.2}% {:>7}",
            format!("{a:+.0}..{b:+.0}"),
            w.requests,
            w.blocks,
            w.hit_rate() * 100.0,
            w.errors
        );
    }
}

fn append_csv(path: &std::path::Path, label: &str, plan: &Plan, o: &Outcome) -> anyhow::Result<()> {
    use std::io::Write;
    let new = !path.exists();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    if new {
        writeln!(
            f,
            "run,window_start_s,window_end_s,requests,blocks,hits,hit_rate,errors"
        )?;
    }
    for w in &o.windows {
        let (a, b) = span(plan, w.index);
        writeln!(
            f,
            "{label},{a},{b},{},{},{},{:.6},{}",
            w.requests,
            w.blocks,
            w.hits,
            w.hit_rate(),
            w.errors
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::cache::{Lru, Unbounded};
    use crate::replay::trace::Request;

    fn trace(n: u64, every_ms: u64) -> Trace {
        Trace {
            requests: (0..n)
                .map(|i| Request {
                    arrival_ms: i * every_ms,
                    input_tokens: 512 * 4,
                    output_tokens: 1,
                    // A shared first block, then two of their own, then a repeat of the previous
                    // request's second block.
                    blocks: vec![0, 10 * i + 1, 10 * i + 2, 10 * i.saturating_sub(1) + 1],
                })
                .collect(),
            block_tokens: 512,
            format: TraceFormat::Mooncake,
        }
    }

    #[test]
    fn windows_split_at_the_event_and_the_warm_up_is_not_counted() {
        let t = trace(100, 1000); // 100 s, one request a second
        let plan = Plan::new(50.0, 20.0, 30.0, 10.0, 1e6).unwrap();
        let mut c = Unbounded::default();
        let o = replay_around(&t, &mut c, &plan, None).unwrap();
        assert_eq!(o.warmup_requests, 30);
        let idx: Vec<i64> = o.windows.iter().map(|w| w.index).collect();
        assert_eq!(idx, vec![-2, -1, 0, 1, 2]);
        assert!(o.windows.iter().all(|w| w.requests == 10 && w.blocks == 40));
        // Every request finds block 0; its own blocks are new, so the run stops there.
        assert!(o.windows.iter().all(|w| w.hits == 10));
        assert_eq!(o.event_seconds, None);
    }

    #[test]
    fn the_event_command_runs_once_at_its_time_and_a_failing_one_is_an_error() {
        let t = trace(60, 1000);
        let dir = std::env::temp_dir().join(format!("kvpool-elastic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let marker = dir.join("fired");
        let plan = Plan::new(30.0, 10.0, 20.0, 10.0, 1e6).unwrap();
        let cmd = format!("echo x >> {}", marker.display());
        let mut c = Lru::new(1000);
        replay_around(&t, &mut c, &plan, Some(&cmd)).unwrap();
        assert_eq!(std::fs::read_to_string(&marker).unwrap(), "x\n");
        std::fs::remove_dir_all(&dir).unwrap();
        let err = replay_around(&t, &mut Lru::new(10), &plan, Some("exit 3")).unwrap_err();
        assert!(err.to_string().contains("event command failed"), "{err}");
        // An event after the trace's end is refused rather than silently never run.
        let late = Plan::new(100.0, 10.0, 20.0, 10.0, 1e6).unwrap();
        assert!(replay_around(&t, &mut Lru::new(10), &late, Some("true")).is_err());
    }

    #[test]
    fn pacing_follows_the_timestamps() {
        let t = trace(11, 100); // 1 s of trace
        let plan = Plan::new(0.5, 0.5, 0.5, 0.5, 4.0).unwrap(); // the last request is due at 0.9 s / 4
        let start = Instant::now();
        replay_around(&t, &mut Unbounded::default(), &plan, None).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(225));
    }

    #[test]
    fn failures_count_as_misses_and_wrong_bytes_stop_the_run() {
        struct Failing(bool);
        impl BlockCache for Failing {
            fn lookup(&mut self, _: &[u64]) -> anyhow::Result<usize> {
                if self.0 {
                    return Err(WrongBytes(3).into());
                }
                bail!("connection refused")
            }
            fn store(&mut self, _: &[u64], _: &[u64]) -> anyhow::Result<()> {
                Ok(())
            }
        }
        let t = trace(20, 1000);
        let plan = Plan::new(10.0, 10.0, 10.0, 10.0, 1e6).unwrap();
        let o = replay_around(&t, &mut Failing(false), &plan, None).unwrap();
        assert_eq!(o.windows.iter().map(|w| w.errors).sum::<u64>(), 20);
        assert_eq!(o.windows.iter().map(|w| w.hits).sum::<u64>(), 0);
        assert!(replay_around(&t, &mut Failing(true), &plan, None).is_err());
    }

    #[test]
    fn bad_plans_are_refused() {
        assert!(Plan::new(10.0, 1.0, 0.0, 1.0, 1.0).is_err());
        assert!(Plan::new(10.0, 1.0, 1.0, 1.0, 0.0).is_err());
        assert!(Plan::new(f64::NAN, 1.0, 1.0, 1.0, 1.0).is_err());
        assert_eq!(Plan::new(5.0, 60.0, 1.0, 1.0, 1.0).unwrap().from_ms, 0);
    }
}
