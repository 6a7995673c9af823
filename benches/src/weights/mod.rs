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

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use futures_util::future::join_all;
use kvpool::weights::{chunk_key, Manifest, DEFAULT_CHUNK_SIZE, DEFAULT_NAMESPACE};
use kvpool_bench::units::{self, fmt_ns, fmt_size};
use kvpool_client::weights::{PublishOptions, Target, Weights};
use kvpool_client::{Client, ClientConfig, Located, SameHost};
use serde_json::json;

use crate::perf::daemon::{self, Daemon};
use crate::perf::machine::Machine;
use crate::perf::render::table;

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

/// One figure: a throughput (median of its runs) or a latency (p50 and p99 of its runs).
struct Row {
    phase: &'static str,
    what: String,
    bytes: u64,
    secs: Vec<f64>,
    latency: bool,
    vs: Option<Versus>,
}

/// A row's ratio to a reference of the same run.
struct Versus {
    name: String,
    ratio: f64,
    goal: Option<f64>,
}

impl Versus {
    fn describe(&self) -> String {
        let mut s = format!("{:.2}× {}", self.ratio, self.name);
        if let Some(g) = self.goal {
            let verdict = if self.ratio >= g { "met" } else { "MISSED" };
            s.push_str(&format!(" (goal ≥{g}×: {verdict})"));
        }
        s
    }
}

impl Row {
    fn new(phase: &'static str, what: &str, bytes: u64, times: &[Duration]) -> Row {
        Row {
            phase,
            what: what.into(),
            bytes,
            secs: times.iter().map(Duration::as_secs_f64).collect(),
            latency: false,
            vs: None,
        }
    }

    fn latency(mut self) -> Row {
        self.latency = true;
        self
    }

    fn quantile(&self, q: f64) -> f64 {
        let mut s = self.secs.clone();
        s.sort_by(f64::total_cmp);
        s.get(((s.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    }

    fn median(&self) -> f64 {
        self.quantile(0.5)
    }

    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.median() / 1e9
    }

    /// Compares this row's median with `reference`'s (the same bytes).
    fn versus(mut self, name: &str, reference: &Row, goal: Option<f64>) -> Row {
        self.vs = Some(Versus {
            name: name.into(),
            ratio: reference.median() / self.median(),
            goal,
        });
        self
    }
}

/// Everything a run found.
struct Report {
    machine: Machine,
    model: String,
    rows: Vec<Row>,
    notes: Vec<String>,
}

impl Report {
    fn render(&self) -> String {
        let mut out = String::new();
        let mut phase = "";
        let header = [
            "what",
            "bytes",
            "runs",
            "median",
            "GB/s",
            "p99",
            "vs reference (same run)",
        ];
        let mut lines: Vec<Vec<String>> = Vec::new();
        let flush = |out: &mut String, lines: &mut Vec<Vec<String>>| {
            if !lines.is_empty() {
                out.push_str(&table(&header, lines));
                lines.clear();
            }
        };
        for r in &self.rows {
            if r.phase != phase {
                flush(&mut out, &mut lines);
                phase = r.phase;
                out.push_str(&format!("\n== {phase} ==\n"));
            }
            let ns = r.median() * 1e9;
            lines.push(vec![
                r.what.clone(),
                fmt_bytes(r.bytes),
                r.secs.len().to_string(),
                fmt_ns(ns),
                if r.latency {
                    "-".into()
                } else {
                    format!("{:.2}", r.gbps())
                },
                if r.latency {
                    fmt_ns(r.quantile(0.99) * 1e9)
                } else {
                    "-".into()
                },
                r.vs.as_ref().map_or("-".into(), Versus::describe),
            ]);
        }
        flush(&mut out, &mut lines);
        for n in &self.notes {
            out.push_str(&format!("  * {n}\n"));
        }
        out
    }

    fn to_json(&self, args: &str) -> String {
        let rows: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "phase": r.phase,
                    "what": r.what,
                    "bytes": r.bytes,
                    "secs": r.secs,
                    "median_s": finite(r.median()),
                    "gbps": if r.latency { None } else { finite(r.gbps()) },
                    "p99_s": if r.latency { finite(r.quantile(0.99)) } else { None },
                    "vs": r.vs.as_ref().map(|v| json!({
                        "reference": v.name,
                        "ratio": finite(v.ratio),
                        "goal": v.goal,
                        "met": v.goal.map(|g| v.ratio >= g),
                    })),
                })
            })
            .collect();
        let doc = json!({
            "machine": self.machine.json(),
            "args": args,
            "model": self.model,
            "rows": rows,
            "notes": self.notes,
        });
        let mut s = serde_json::to_string_pretty(&doc).expect("a Value always serialises");
        s.push('\n');
        s
    }
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

fn fmt_bytes(n: u64) -> String {
    if n >= 1 << 30 {
        format!("{:.2}GiB", n as f64 / (1u64 << 30) as f64)
    } else if n >= 1 << 20 {
        format!("{:.1}MiB", n as f64 / (1u64 << 20) as f64)
    } else {
        fmt_size(n)
    }
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
    let path = scratch.0.join("model.safetensors");
    eprintln!("  writing {} ({})", path.display(), shape.describe());
    let tensors = model::write(&shape, &path)?;
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
    let mut dst: Vec<Vec<u8>> = tensors.iter().map(|t| vec![0xa5; t.len as usize]).collect();
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

/// Targets for every tensor of a one-file manifest, into `dst`.
fn targets<'a>(m: &Manifest, dst: &'a mut [Vec<u8>]) -> Vec<Target<'a>> {
    debug_assert_eq!(m.files.len(), 1);
    dst.iter_mut()
        .enumerate()
        .map(|(i, d)| Target {
            file: 0,
            tensor: i,
            dst: &mut d[..],
        })
        .collect()
}

/// Fails unless every loaded tensor equals the file's.
fn check(model: &Model, dst: &[Vec<u8>], what: &str) -> anyhow::Result<()> {
    for (i, d) in dst.iter().enumerate() {
        ensure!(
            d[..] == *model.tensor(i),
            "{what}: tensor {i} differs from the file"
        );
    }
    Ok(())
}

/// Every chunk of the model: its key and (tensor, range in the tensor).
fn chunks(m: &Manifest) -> Vec<(Vec<u8>, usize, usize, usize)> {
    m.chunks()
        .map(|c| {
            (
                chunk_key(&m.name, &c),
                c.tensor,
                c.begin as usize,
                (c.begin + c.len) as usize,
            )
        })
        .collect()
}

/// Looks up every chunk (no lease), one request per node per 4096 keys as the loader does.
async fn lookup(kv: &Client, keys: &[Vec<u8>]) -> anyhow::Result<Vec<Located>> {
    let mut out = Vec::with_capacity(keys.len());
    for group in keys.chunks(KEYS_PER_REQUEST) {
        let refs: Vec<&[u8]> = group.iter().map(|k| &k[..]).collect();
        for f in kv.lease_replica(&refs, 0, 0).await? {
            out.push(f.context("a chunk is missing from the pool")?);
        }
    }
    Ok(out)
}

/// xxh3 of every chunk of the loaded tensors.
fn hash_all(dst: &[Vec<u8>], chunks: &[(Vec<u8>, usize, usize, usize)]) -> Duration {
    let t = Instant::now();
    for (_, ti, b, e) in chunks {
        std::hint::black_box(kvpool::checksum::checksum(&dst[*ti][*b..*e]));
    }
    t.elapsed()
}

/// Latency of `Weights::tensor` of `name` alone, `reps` times.
fn tensor_latency(
    rt: &tokio::runtime::Runtime,
    w: &Weights,
    m: &Manifest,
    name: &str,
    reps: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        let bytes = rt.block_on(w.tensor(m, name, None))?;
        out.push(t.elapsed());
        std::hint::black_box(bytes);
    }
    Ok(out)
}

/// Latency rows of tensor 0 (file order) and of the first small tensor, and of the manifest.
fn latencies(
    phase: &'static str,
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    w: &Weights,
    m: &Manifest,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut times = Vec::new();
    for _ in 0..args.latency_reps {
        let t = Instant::now();
        std::hint::black_box(rt.block_on(w.require(MODEL))?);
        times.push(t.elapsed());
    }
    report
        .rows
        .push(Row::new(phase, "manifest (Weights::require)", 0, &times).latency());
    let f = &m.files[0];
    let small = f
        .tensors
        .iter()
        .min_by_key(|t| t.len)
        .context("no tensors")?;
    for (t, label) in [(&f.tensors[0], "tensor 0"), (small, "smallest tensor")] {
        let times = tensor_latency(rt, w, m, &t.name, args.latency_reps)?;
        report.rows.push(
            Row::new(
                phase,
                &format!("Weights::tensor, {label} ({})", t.name),
                t.len,
                &times,
            )
            .latency(),
        );
    }
    Ok(())
}

/// Phase 1: one daemon, same host.
fn same_host(
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    model: &mut Model,
    dst: &mut [Vec<u8>],
    report: &mut Report,
) -> anyhow::Result<()> {
    const PHASE: &str = "same host: 1 kvpoold, Unix socket and mapped segments";
    eprintln!("== {PHASE} ==");
    let d = Daemon::start(bin, daemon::memory_for(model.bytes))?;
    let kv = rt.block_on(Client::connect(
        &format!("tcp://{}", d.tcp),
        ClientConfig::default(),
    ))?;
    if !kv.is_local() {
        report.notes.push(
            "the client did not take the same-host path (segments not mappable here): \
             the same-host rows are over the daemon's socket"
                .into(),
        );
    }
    let w = Weights::new(&kv, DEFAULT_NAMESPACE)?;
    let paths = [model.path.clone()];
    let file_len = model.file.len() as u64;
    let path = model.path.clone();
    let (read, publish) = alternate(
        args.reps,
        model.file_mut(),
        |buf| limits::read_file(&path, buf),
        |_| {
            rt.block_on(w.remove(MODEL))?;
            let t = Instant::now();
            rt.block_on(w.publish(MODEL, &paths, &PublishOptions::default()))?;
            Ok(t.elapsed())
        },
    )?;
    let read = Row::new(PHASE, "read() of the file (reference)", file_len, &read);
    let publish = Row::new(PHASE, "Weights::publish, cold", model.bytes, &publish).versus(
        "file read",
        &read,
        Some(PUBLISH_GOAL),
    );
    let publish_missed = publish.vs.as_ref().is_some_and(|v| v.ratio < PUBLISH_GOAL);
    report.rows.push(read);
    report.rows.push(publish);
    let m = rt.block_on(w.require(MODEL))?;
    let chunk_list = chunks(&m);
    publish_breakdown(rt, &w, model, &m, &chunk_list, report)?;
    if publish_missed {
        report.notes.push(
            "publish: a reader thread reads and hashes each chunk while the runtime stores the \
             previous 64 MiB batch (presence check, then pinned put); the breakdown rows time \
             those stages alone on the same bytes"
                .into(),
        );
    }

    let src = model.sources();
    let (copy, load) = alternate(
        args.reps,
        dst,
        |dst| Ok(limits::memcpy(&src, dst)),
        |dst| {
            let mut t = targets(&m, dst);
            let start = Instant::now();
            let r = rt.block_on(w.load_into(&m, &mut t, None))?;
            let took = start.elapsed();
            ensure!(r.bytes_from_pool == model.bytes, "load: {r:?}");
            Ok(took)
        },
    )?;
    check(model, dst, "same-host load_into")?;
    let copy = Row::new(
        PHASE,
        "memcpy, buffer to buffer (reference)",
        model.bytes,
        &copy,
    );
    let load = Row::new(PHASE, "Weights::load_into, warm", model.bytes, &load).versus(
        "memcpy",
        &copy,
        Some(LOCAL_GOAL),
    );
    report.rows.push(copy);
    report.rows.push(load);

    // Where a same-host load spends its time: the lookup, the copy with the hash in the same
    // pass, the copy alone, the hash alone.
    let keys: Vec<Vec<u8>> = chunk_list.iter().map(|c| c.0.clone()).collect();
    let t = Instant::now();
    let located = rt.block_on(lookup(w.client(), &keys))?;
    let looked = t.elapsed();
    report.rows.push(
        Row::new(
            PHASE,
            &format!("  stage: lookup of {} chunks", keys.len()),
            0,
            &[looked],
        )
        .latency(),
    );
    if kv.is_local() {
        let t = Instant::now();
        for ((_, ti, b, e), l) in chunk_list.iter().zip(&located) {
            w.client()
                .read_local_verified(l, &mut dst[*ti][*b..*e])
                .context("not mapped")??;
        }
        let verified = t.elapsed();
        let t = Instant::now();
        for ((_, ti, b, e), l) in chunk_list.iter().zip(&located) {
            w.client()
                .read_local(&l.addr, 0, &mut dst[*ti][*b..*e])
                .context("not mapped")?
                .map_err(|f| anyhow::anyhow!("read_local: {f:?}"))?;
        }
        let plain = t.elapsed();
        report.rows.push(Row::new(
            PHASE,
            "  stage: copy + xxh3 in one pass (read_local_verified)",
            model.bytes,
            &[verified],
        ));
        report.rows.push(Row::new(
            PHASE,
            "  stage: copy alone (read_local)",
            model.bytes,
            &[plain],
        ));
    }
    let hashed = hash_all(dst, &chunk_list);
    report.rows.push(Row::new(
        PHASE,
        "  stage: xxh3 alone",
        model.bytes,
        &[hashed],
    ));
    latencies(PHASE, args, rt, &w, &m, report)?;
    rt.block_on(w.remove(MODEL))?;
    drop(d);
    Ok(())
}

/// The publisher's stages on their own: read() in chunks, xxh3 of each, and storing them
/// (presence check and pinned put, 64 MiB per batch) from memory.
fn publish_breakdown(
    rt: &tokio::runtime::Runtime,
    w: &Weights,
    model: &mut Model,
    m: &Manifest,
    chunk_list: &[(Vec<u8>, usize, usize, usize)],
    report: &mut Report,
) -> anyhow::Result<()> {
    const PHASE: &str = "same host: 1 kvpoold, Unix socket and mapped segments";
    use std::io::{Read, Seek, SeekFrom};
    let data_start = model.tensors[0].0;
    let t = Instant::now();
    let mut f = std::fs::File::open(&model.path)?;
    f.seek(SeekFrom::Start(data_start as u64))?;
    for (_, ti, b, e) in chunk_list {
        let (at, _) = model.tensors[*ti];
        f.read_exact(&mut model.file_mut()[at + b..at + e])?;
    }
    let read = t.elapsed();
    let t = Instant::now();
    for (_, ti, b, e) in chunk_list {
        let (at, _) = model.tensors[*ti];
        std::hint::black_box(kvpool::checksum::checksum(&model.file[at + b..at + e]));
    }
    let hashed = t.elapsed();
    // The model's own chunks must go first, or the pool would need room for two copies.
    rt.block_on(w.remove(MODEL))?;
    let kv = w.client();
    let keys: Vec<Vec<u8>> = (0..chunk_list.len())
        .map(|i| format!("bench-store/{i}").into_bytes())
        .collect();
    let t = Instant::now();
    let mut i = 0;
    while i < chunk_list.len() {
        let mut end = i;
        let mut bytes = 0;
        while end < chunk_list.len()
            && (end == i || bytes + (chunk_list[end].3 - chunk_list[end].2) as u64 <= BATCH_BYTES)
        {
            bytes += (chunk_list[end].3 - chunk_list[end].2) as u64;
            end += 1;
        }
        let items: Vec<(&[u8], &[u8])> = (i..end)
            .map(|j| {
                let (_, ti, b, e) = &chunk_list[j];
                let (at, _) = model.tensors[*ti];
                (&keys[j][..], &model.file[at + b..at + e])
            })
            .collect();
        let refs: Vec<&[u8]> = items.iter().map(|x| x.0).collect();
        rt.block_on(kv.present(&refs))?;
        let codes = rt.block_on(kv.batch_put_pinned(&items))?;
        ensure!(
            codes.iter().all(|c| *c == kvpool::protocol::ErrorCode::Ok),
            "store: {codes:?}"
        );
        i = end;
    }
    let stored = t.elapsed();
    for group in keys.chunks(KEYS_PER_REQUEST) {
        let refs: Vec<&[u8]> = group.iter().map(|k| &k[..]).collect();
        rt.block_on(kv.batch_remove(&refs))?;
    }
    // Back as it was for the loads.
    rt.block_on(w.publish(
        MODEL,
        std::slice::from_ref(&model.path),
        &PublishOptions::default(),
    ))?;
    ensure!(
        rt.block_on(w.require(MODEL))? == *m,
        "republished another manifest"
    );
    let n = chunk_list.len();
    report.rows.push(Row::new(
        PHASE,
        &format!("  stage: read() in {n} chunks"),
        model.bytes,
        &[read],
    ));
    report.rows.push(Row::new(
        PHASE,
        "  stage: xxh3 of each chunk",
        model.bytes,
        &[hashed],
    ));
    report.rows.push(Row::new(
        PHASE,
        "  stage: store (present + batch_put_pinned, 64 MiB batches)",
        model.bytes,
        &[stored],
    ));
    Ok(())
}

/// Phase 2: two daemons over loopback TCP.
fn over_tcp(
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    model: &Model,
    dst: &mut [Vec<u8>],
    report: &mut Report,
) -> anyhow::Result<()> {
    const PHASE: &str = "loopback TCP: 2 kvpoolds as one pool, same-host path off";
    eprintln!("== {PHASE} ==");
    // Each node holds a copy of every chunk (pinned_replicas = 2).
    let (nodes, _) =
        crate::perf::cluster::start_daemons(rt, bin, 2, daemon::memory_for(model.bytes))?;
    let cfg = ClientConfig {
        same_host: SameHost::Off,
        ..ClientConfig::default()
    };
    let kv = rt.block_on(Client::connect(&format!("tcp://{}", nodes[0].tcp), cfg))?;
    let w = Weights::new(&kv, DEFAULT_NAMESPACE)?;
    let t = Instant::now();
    rt.block_on(w.publish(
        MODEL,
        std::slice::from_ref(&model.path),
        &PublishOptions::default(),
    ))?;
    let published = t.elapsed();
    report.rows.push(Row::new(
        PHASE,
        &format!(
            "Weights::publish, cold, {} copies",
            w.client().pinned_replicas()
        ),
        model.bytes,
        &[published],
    ));
    let m = rt.block_on(w.require(MODEL))?;
    let mut raw = limits::RawStream::start(model.file.clone(), model.tensors[0].0)?;
    let (stream, load) = alternate(
        args.reps,
        dst,
        |dst| raw.receive(dst),
        |dst| {
            let mut t = targets(&m, dst);
            let start = Instant::now();
            let r = rt.block_on(w.load_into(&m, &mut t, None))?;
            let took = start.elapsed();
            ensure!(r.bytes_from_pool == model.bytes, "load: {r:?}");
            Ok(took)
        },
    )?;
    drop(raw);
    check(model, dst, "TCP load_into")?;
    let stream = Row::new(
        PHASE,
        "raw TCP stream, 1 connection (reference)",
        model.bytes,
        &stream,
    );
    let load = Row::new(PHASE, "Weights::load_into, warm", model.bytes, &load).versus(
        "raw TCP",
        &stream,
        Some(TCP_GOAL),
    );
    report.rows.push(stream);
    report.rows.push(load);

    // Where a TCP load spends its time: the lookups, the reads without the hash, the hash.
    let chunk_list = chunks(&m);
    let keys: Vec<Vec<u8>> = chunk_list.iter().map(|c| c.0.clone()).collect();
    let t = Instant::now();
    let located = rt.block_on(lookup(w.client(), &keys))?;
    let looked = t.elapsed();
    report.rows.push(
        Row::new(
            PHASE,
            &format!("  stage: lookup of {} chunks", keys.len()),
            0,
            &[looked],
        )
        .latency(),
    );
    let t = Instant::now();
    rt.block_on(read_unhashed(w.client(), &chunk_list, &located, dst))?;
    let reads = t.elapsed();
    report.rows.push(Row::new(
        PHASE,
        &format!("  stage: reads alone, {READS_IN_FLIGHT} in flight, no hash"),
        model.bytes,
        &[reads],
    ));
    check(model, dst, "TCP reads")?;
    let hashed = hash_all(dst, &chunk_list);
    report.rows.push(Row::new(
        PHASE,
        "  stage: xxh3 alone",
        model.bytes,
        &[hashed],
    ));
    latencies(PHASE, args, rt, &w, &m, report)?;
    drop(nodes);
    Ok(())
}

/// The loader's TCP reads without its hash: groups of [`READS_IN_FLIGHT`] at once.
async fn read_unhashed(
    kv: &Client,
    chunk_list: &[(Vec<u8>, usize, usize, usize)],
    located: &[Located],
    dst: &mut [Vec<u8>],
) -> anyhow::Result<()> {
    let mut work: Vec<(&mut [u8], &Located)> = Vec::with_capacity(located.len());
    let mut rest: Vec<&mut [u8]> = dst.iter_mut().map(|d| &mut d[..]).collect();
    // Chunks come in tensor order and, within a tensor, in order: cut each buffer front to back.
    for ((_, ti, b, e), l) in chunk_list.iter().zip(located) {
        let buf = std::mem::take(&mut rest[*ti]);
        let (head, tail) = buf.split_at_mut(e - b);
        rest[*ti] = tail;
        work.push((head, l));
    }
    while !work.is_empty() {
        let take = work.len().min(READS_IN_FLIGHT);
        let batch: Vec<_> = work.drain(..take).collect();
        for ok in join_all(batch.into_iter().map(|(d, l)| kv.read(&l.addr, 0, d))).await {
            ensure!(ok?, "a chunk went missing");
        }
    }
    Ok(())
}
