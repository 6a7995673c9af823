//! `kvpool-bench perf`: how fast each of kvpool's data paths is, next to what bounds it.
//!
//! Every figure comes with its ratio to a reference measured in the same run with the same
//! value size, concurrency and depth: memcpy for the same-host path, a raw TCP stream,
//! memcached and redis for TCP, a bare quinn stream for QUIC, the system allocator for the
//! block allocator, a bare `HashMap` for the index. Every measurement lasts `--duration-ms`;
//! the run stops by itself.
//!
//! Sections (in run order): `memcpy`, `local`, `tcp`, `baselines`, `quic`, `cluster`, `alloc`,
//! `index`.
//! `local` needs `memcpy` as its reference, and `tcp` and `baselines` need each other, so selecting
//! one with `--only` runs the other too. References are measured in slices alternating with
//! what they are compared with (see `compare`), so drift of the machine does not skew ratios.

mod alloc;
mod bare_quic;
pub(crate) mod baseline_client;
pub(crate) mod baselines;
pub(crate) mod cluster;
pub(crate) mod compare;
pub(crate) mod daemon;
pub(crate) mod driver;
mod index;
mod json;
mod local;
pub(crate) mod machine;
mod memcpy;
mod quic;
pub(crate) mod raw;
pub(crate) mod render;
mod report;
mod tcp;
use kvpool_bench::units;
pub(crate) mod workloads;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use daemon::Daemon;
use machine::Machine;
use report::Report;

/// Flags of `kvpool-bench perf`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct PerfArgs {
    /// Value sizes, comma-separated (B, KiB, MiB, GiB).
    #[arg(long, value_delimiter = ',', default_value = "64KiB,2MiB", value_parser = units::parse_size)]
    sizes: Vec<u64>,
    /// Concurrent connections (threads for memcpy and one-sided reads), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    conns: Vec<usize>,
    /// Length of each measurement in milliseconds, per contender (after a short unrecorded
    /// warm-up); `alloc` gives each contender half of it.
    #[arg(long, default_value_t = 2000)]
    duration_ms: u64,
    /// Runs of each comparison in the `tcp` section, one after the other, each alternating its
    /// contenders in slices: a ratio is then reported as the median run's with the smallest and
    /// largest (`[min–max]`), and a target is met only when the smallest meets it. Each run
    /// takes `--duration-ms` per contender.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub(crate) pairs: u32,
    /// Sections to run, comma-separated [default: all].
    #[arg(long, value_delimiter = ',', value_enum)]
    only: Vec<Section>,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Turn off the xxh3 check of every received value in the TCP and QUIC kvpool clients (on
    /// by default, as in the client; the baselines check nothing). `local` measures both anyway.
    #[arg(long)]
    no_verify: bool,
    /// Objects inserted by the `index` section (fewer when memory is short).
    #[arg(long, default_value_t = 10_000_000)]
    index_objects: u64,
    /// Longest the `index` section may spend inserting, in milliseconds; it reports what it
    /// inserted by then.
    #[arg(long, default_value_t = 60_000)]
    index_budget_ms: u64,
    /// Key length in the `index` section, 16 to 256 bytes (prefix-hash keys are often 64 or
    /// more).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(16..=256))]
    index_key_len: u16,
}

/// A part of the benchmark.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Section {
    /// memcpy from DRAM (one copying thread per conn): the limit of the same-host path.
    Memcpy,
    /// Same-host client: one-sided `read_local` and `batch_get_into`.
    Local,
    /// Get and put over TCP, next to a raw TCP stream moving the same bytes.
    Tcp,
    /// memcached and redis on loopback, same workloads.
    Baselines,
    /// Get over QUIC next to a bare quinn stream.
    Quic,
    /// Aggregate get throughput of 1, 2 and 4 daemons in one cluster, and the extra hop to a
    /// previous owner after a node joins.
    Cluster,
    /// Block allocator allocate+free pairs.
    Alloc,
    /// Index memory per object.
    Index,
}

impl Section {
    /// Every section, in run order.
    pub(crate) const ALL: [Section; 8] = [
        Section::Memcpy,
        Section::Local,
        Section::Tcp,
        Section::Baselines,
        Section::Quic,
        Section::Cluster,
        Section::Alloc,
        Section::Index,
    ];

    /// Name as on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Section::Memcpy => "memcpy",
            Section::Local => "local",
            Section::Tcp => "tcp",
            Section::Baselines => "baselines",
            Section::Quic => "quic",
            Section::Cluster => "cluster",
            Section::Alloc => "alloc",
            Section::Index => "index",
        }
    }

    /// Heading of its table.
    pub(crate) fn title(self) -> &'static str {
        match self {
            Section::Memcpy => "memcpy: physical limit of the same-host path (DRAM → buffer)",
            Section::Local => "local: same-host client (segments mapped, no syscall per read)",
            Section::Tcp => {
                "tcp: kvpool over loopback TCP (SameHost::Off) next to a raw TCP stream"
            }
            Section::Baselines => {
                "baselines: memcached and redis on loopback, same keys, sizes, connections, depth"
            }
            Section::Quic => "quic: kvpool over QUIC next to a bare quinn stream",
            Section::Cluster => {
                "cluster: 1, 2 and 4 daemons as one pool over loopback TCP; the extra hop after a join"
            }
            Section::Alloc => "alloc: block allocator, allocate+free pairs, one thread",
            Section::Index => "index: memory per object",
        }
    }
}

/// What every section works with.
pub(crate) struct Ctx {
    /// The flags.
    pub(crate) args: PerfArgs,
    /// Runtime of the clients (and of in-process servers that share it).
    pub(crate) rt: tokio::runtime::Runtime,
    /// The figures so far.
    pub(crate) report: Report,
    daemon: Option<Daemon>,
}

impl Ctx {
    /// Length of one measurement.
    pub(crate) fn window(&self) -> Duration {
        Duration::from_millis(self.args.duration_ms.max(1))
    }

    /// The benchmark's kvpoold, started on first use, with every size's data set stored.
    pub(crate) fn daemon(&mut self) -> anyhow::Result<&Daemon> {
        if self.daemon.is_none() {
            let bin = self
                .args
                .kvpoold
                .clone()
                .unwrap_or_else(daemon::default_binary);
            let stored = workloads::stored_bytes(&self.args.sizes, &self.args.conns);
            let memory = daemon::memory_for(stored);
            eprintln!("  starting {} with {} MiB", bin.display(), memory >> 20);
            self.daemon = Some(Daemon::start(&bin, memory)?);
        }
        let d = self.daemon.as_mut().expect("started above");
        self.rt.block_on(workloads::ensure_loaded(
            d,
            &self.args.sizes,
            &self.args.conns,
        ))?;
        Ok(d)
    }
}

/// The benchmarks' runtime (a worker per core), with a task that stops kvpoold and the
/// baselines this process started when it is interrupted (SIGINT or SIGTERM).
pub(crate) fn runtime(machine: &Machine) -> anyhow::Result<tokio::runtime::Runtime> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(machine.nproc)
        .enable_all()
        .build()?;
    rt.spawn(async {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut term) = signal(SignalKind::terminate()) else {
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        eprintln!("interrupted: stopping kvpoold and the baselines");
        daemon::kill_all();
        std::process::exit(130);
    });
    Ok(rt)
}

/// Runs the selected sections, prints the tables and writes the JSON.
pub(crate) fn run(args: PerfArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.sizes.is_empty() && !args.conns.is_empty(),
        "--sizes and --conns need at least one value"
    );
    anyhow::ensure!(
        args.conns.iter().all(|&c| c > 0),
        "--conns must be positive"
    );
    let selected = selection(&args.only);
    let began = Instant::now();
    let machine = Machine::detect();
    eprintln!("kvpool-bench perf — {}", machine.describe());
    let rt = runtime(&machine)?;
    let mut ctx = Ctx {
        args,
        rt,
        report: Report::new(machine),
        daemon: None,
    };
    for section in Section::ALL.into_iter().filter(|s| selected.contains(s)) {
        if section == Section::Alloc {
            // Nothing after this point talks to kvpoold: give its memory back.
            ctx.daemon = None;
        }
        eprintln!(
            "== {} == (at {:.0} s)",
            section.title(),
            began.elapsed().as_secs_f64()
        );
        let result = match section {
            Section::Memcpy if selected.contains(&Section::Local) => {
                eprintln!("  measured by `local`, alternating with its one-sided reads");
                Ok(())
            }
            Section::Memcpy => memcpy::run(&mut ctx),
            Section::Local => local::run(&mut ctx),
            // `tcp` and `baselines` always run together: the four contenders alternate per shape.
            Section::Tcp => tcp::run(&mut ctx),
            Section::Baselines => {
                eprintln!("  measured by `tcp`, alternating with kvpool");
                Ok(())
            }
            Section::Quic => quic::run(&mut ctx),
            Section::Cluster => {
                // Its own daemons: give the shared one's memory back first.
                ctx.daemon = None;
                cluster::run(&mut ctx)
            }
            Section::Alloc => alloc::run(&mut ctx),
            Section::Index => index::run(&mut ctx),
        };
        if let Err(e) = result {
            ctx.report.note(section, format!("section failed: {e:#}"));
        }
    }
    ctx.daemon = None;
    let report = &ctx.report;
    render::publish(
        &report.render(),
        began,
        ctx.args.json.as_deref(),
        |cmdline| report.to_json(cmdline),
    )
}

/// The sections to run: all by default; `--only` plus what its sections are compared with.
fn selection(only: &[Section]) -> Vec<Section> {
    if only.is_empty() {
        return Section::ALL.to_vec();
    }
    let mut s = only.to_vec();
    let mut add = |x: Section, why: &str| {
        if !s.contains(&x) {
            eprintln!("also running `{}`: {why}", x.name());
            s.push(x);
        }
    };
    if only.contains(&Section::Local) {
        add(Section::Memcpy, "it is the reference of `local`");
    }
    if only.contains(&Section::Tcp) {
        add(
            Section::Baselines,
            "memcached and redis are the references of `tcp`",
        );
    }
    if only.contains(&Section::Baselines) {
        add(
            Section::Tcp,
            "`baselines` compares them with kvpool over TCP",
        );
    }
    s
}
