//! `kvpool-bench weights`: publishing and loading model weights, each figure next to
//! what bounds it on this machine, measured in the same run on the same bytes.
//!
//! A generated safetensors file (a Llama-style bf16 model of `--size`, see [`model`]) is
//! written to a temporary directory, then:
//!
//! 1. one kvpoold on this host, the client on the same-host path (Unix socket, segments mapped):
//!    cold `Weights::publish` of the file against `read()` of the whole file (page cache warm);
//!    `Weights::load_into` preallocated buffers against memcpy between two sets of buffers of
//!    the tensors' sizes; the latency of `Weights::tensor` of tensor 0 alone;
//! 2. two kvpoolds as one pool over loopback TCP (same-host path off, 2 copies of each chunk):
//!    `load_into` against one raw TCP stream of the same bytes within this process; the latency
//!    of tensor 0 again.
//!
//! Each contender runs `--reps` times alternating with its reference (A B, B A, ...), and the
//! medians are compared. Where a figure falls short, the stages it is made of are timed on
//! their own (read, hash, store; lookup, copy, hash) so the table says where the time goes.
//! Every run is bounded: a fixed number of passes over a file of a fixed size.

pub(crate) mod limits;
mod model;
mod report;
mod same_host;
mod stages;
mod tcp;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use kvpool::weights::DEFAULT_CHUNK_SIZE;
use kvpool_bench::units::{self, fmt_size};

use crate::perf::daemon;
use crate::perf::machine::Machine;
use report::Report;
use same_host::same_host;
use tcp::over_tcp;

/// Name the model is published under.
const MODEL: &str = "bench-model";

/// Bytes per store request in the publish breakdown (the publisher's batch).
const BATCH_BYTES: u64 = 64 << 20;

/// Chunks read at once in the TCP breakdown (the loader's `READS_IN_FLIGHT`).
const READS_IN_FLIGHT: usize = 16;

/// Keys per lookup request (the loader's).
const KEYS_PER_REQUEST: usize = 4096;

/// Goals (docs/BENCHMARKS.md, "Model weights"), as fractions of the reference.
const PUBLISH_GOAL: f64 = 0.8;
const LOCAL_GOAL: f64 = 0.9;
const TCP_GOAL: f64 = 0.8;

/// Flags of `kvpool-bench weights`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct WeightsArgs {
    /// Size of the generated safetensors file (B, KiB, MiB, GiB); at least 32MiB.
    #[arg(long, default_value = "2GiB", value_parser = units::parse_size)]
    size: u64,
    /// Timed runs of each contender, alternating with its reference; medians are compared.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Loads of one tensor for each latency figure.
    #[arg(long, default_value_t = 20)]
    latency_reps: usize,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Directory for the generated file [default: the system's temporary directory].
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// The generated file's directory, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The checkpoint in memory: the file's bytes and where each tensor lies in them.
struct Model {
    path: PathBuf,
    /// Shared with the raw TCP sender in the second phase only.
    file: Arc<Vec<u8>>,
    /// (start in `file`, length) per tensor, in file order.
    tensors: Vec<(usize, usize)>,
    bytes: u64,
}

impl Model {
    fn tensor(&self, i: usize) -> &[u8] {
        let (at, n) = self.tensors[i];
        &self.file[at..at + n]
    }

    /// The file's bytes, writable while nothing else holds them.
    fn file_mut(&mut self) -> &mut [u8] {
        Arc::get_mut(&mut self.file).expect("the file buffer is not shared yet")
    }

    fn sources(&self) -> Vec<&[u8]> {
        (0..self.tensors.len()).map(|i| self.tensor(i)).collect()
    }
}

/// Runs both phases, prints the table and writes the JSON.
pub(crate) fn run(args: WeightsArgs) -> anyhow::Result<()> {
    ensure!(
        args.reps > 0 && args.latency_reps > 0,
        "--reps and --latency-reps must be positive"
    );
    let began = Instant::now();
    let machine = Machine::detect();
    eprintln!("kvpool-bench weights — {}", machine.describe());
    let shape = model::ModelShape::for_size(args.size)?;
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("kvpool-bench-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let scratch = Scratch(dir.clone());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(machine.nproc)
        .enable_all()
        .build()?;
    remove_on_interrupt(&rt, dir);
    let (mut model, mut dst) = generate(&shape, &scratch.0)?;
    let mut report = Report {
        machine,
        model: format!(
            "{}; chunks of {}",
            shape.describe(),
            fmt_size(DEFAULT_CHUNK_SIZE)
        ),
        rows: Vec::new(),
        notes: Vec::new(),
    };
    let bin = args.kvpoold.clone().unwrap_or_else(daemon::default_binary);
    same_host(&args, &rt, &bin, &mut model, &mut dst, &mut report)?;
    over_tcp(&args, &rt, &bin, &model, &mut dst, &mut report)?;
    report.notes.push(format!(
        "model: {}; file and buffers in this process's memory, written before the first run; \
         medians of {} alternating runs per contender",
        report.model, args.reps
    ));
    crate::perf::render::publish(&report.render(), began, args.json.as_deref(), |cmdline| {
        report.to_json(cmdline)
    })?;
    drop(scratch);
    Ok(())
}

/// On SIGINT or SIGTERM: stops the daemons, removes `dir` and exits.
fn remove_on_interrupt(rt: &tokio::runtime::Runtime, dir: PathBuf) {
    rt.spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut term) = signal(SignalKind::terminate()) else {
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        eprintln!("interrupted: stopping kvpoold and removing the generated file");
        daemon::kill_all();
        let _ = std::fs::remove_dir_all(&dir);
        std::process::exit(130);
    });
}

/// Writes the checkpoint of `shape` into `dir` and reads it into memory (warming the page
/// cache); the model, and a written buffer per tensor to load into.
fn generate(shape: &model::ModelShape, dir: &Path) -> anyhow::Result<(Model, Vec<Vec<u8>>)> {
    let path = dir.join("model.safetensors");
    eprintln!("  writing {} ({})", path.display(), shape.describe());
    let tensors = model::write(shape, &path)?;
    let file_len = std::fs::metadata(&path)?.len() as usize;
    let data_start = file_len - shape.bytes() as usize;
    let mut at = data_start;
    let mut model = Model {
        path,
        // Written, not only allocated, so no measurement pays for its first touch.
        file: Arc::new(vec![0x5a; file_len]),
        tensors: tensors
            .iter()
            .map(|t| {
                let r = (at, t.len as usize);
                at += t.len as usize;
                r
            })
            .collect(),
        bytes: shape.bytes(),
    };
    // Warms the page cache (the file was just written, so it mostly is).
    let path = model.path.clone();
    limits::read_file(&path, model.file_mut())?;
    let dst: Vec<Vec<u8>> = tensors.iter().map(|t| vec![0xa5; t.len as usize]).collect();
    Ok((model, dst))
}

/// Runs `a` and `b` `reps` times each on `state`, alternating which goes first.
pub(crate) fn alternate<S: ?Sized>(
    reps: usize,
    state: &mut S,
    mut a: impl FnMut(&mut S) -> anyhow::Result<Duration>,
    mut b: impl FnMut(&mut S) -> anyhow::Result<Duration>,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for r in 0..reps {
        if r % 2 == 0 {
            ta.push(a(state)?);
            tb.push(b(state)?);
        } else {
            tb.push(b(state)?);
            ta.push(a(state)?);
        }
    }
    Ok((ta, tb))
}
