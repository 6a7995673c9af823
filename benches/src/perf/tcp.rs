//! kvpool over loopback TCP with the same-host path off — every byte crosses the socket, as it
//! would from another host — next to a raw TCP stream moving the same bytes (the physical
//! limit, see [`raw`](super::raw)) and memcached and redis running the same workloads. For
//! each shape the four run in alternating slices (see [`compare`](super::compare)); kvpool's
//! and the raw stream's rows go to the `tcp` section, the baselines' to `baselines`. One client (one
//! connection) per conn; the n-th connections of all four share their receive buffers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvpool_client::{Client, ClientConfig, SameHost};

use super::baseline_client::{BaselineConn, BaselineGet, BaselineSet};
use super::baselines::{self, Baseline};
use super::compare::{interleave_tasks, AnyWorker};
use super::driver::Measured;
use super::raw::{self, RawGet, RawPut, RawServer};
use super::report::{Ref, Report, Row};
use super::workloads::{self, Buffers, KvGet, KvPut, DEPTH};
use super::{Ctx, Section};

/// Name of the raw TCP reference in rows and ratios.
pub(crate) const RAW: &str = "raw tcp";

/// The workloads every system runs: (operation, depth).
const SHAPES: [(&str, usize); 3] = [("get", 1), ("get", DEPTH), ("put", 1)];

/// Measures kvpool, the raw TCP stream, memcached and redis: get, pipelined get and put, every
/// size and connection count.
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let endpoint = format!("tcp://{}", ctx.daemon()?.tcp);
    let window = ctx.window();
    let max_size = ctx.args.sizes.iter().copied().max().context("no sizes")?;
    let raw = RawServer::start(raw::region_bytes(max_size))?;
    let running = baselines::start_all(ctx)?;
    let verify = !ctx.args.no_verify;
    let contenders = Contenders {
        endpoint,
        cfg: ClientConfig {
            same_host: SameHost::Off,
            verify_checksums: verify,
            ..ClientConfig::default()
        },
        raw: raw.addr,
        baselines: &running,
    };
    for size in ctx.args.sizes.clone() {
        let (keys, value) = (workloads::keys(size), workloads::value(size));
        for conns in ctx.args.conns.clone() {
            for (op, depth) in SHAPES {
                let shape = Shape {
                    op,
                    size,
                    conns,
                    depth,
                    keys: keys.clone(),
                    value: value.clone(),
                };
                let mut runs = Vec::new();
                for _ in 0..ctx.args.pairs {
                    runs.push(ctx.rt.block_on(contenders.measure(&shape, window))?);
                }
                push_rows(&mut ctx.report, &running, &shape, &runs);
            }
        }
    }
    drop(running);
    drop(raw);
    baselines::link(&mut ctx.report);
    ctx.report.note(Section::Tcp, method_note(verify));
    baselines::note(&mut ctx.report, &ctx.args.sizes, &ctx.args.conns);
    Ok(())
}

/// One workload at one value size and connection count.
struct Shape {
    /// `get` or `put`.
    op: &'static str,
    size: u64,
    conns: usize,
    depth: usize,
    /// The data set's keys for this size.
    keys: Arc<Vec<Vec<u8>>>,
    /// The value a put stores.
    value: Arc<Vec<u8>>,
}

impl Shape {
    /// The key worker `w` starts at, so the workers spread over the data set.
    fn start(&self, w: usize) -> usize {
        w * self.keys.len() / self.conns
    }
}

/// The systems measured side by side, and how to reach each.
struct Contenders<'a> {
    /// kvpool's endpoint.
    endpoint: String,
    /// kvpool's client settings.
    cfg: ClientConfig,
    /// The raw TCP stream's server.
    raw: SocketAddr,
    /// memcached and redis, those that started.
    baselines: &'a [Baseline],
}

impl Contenders<'_> {
    /// Connects every contender's workers for `shape` and measures them in alternating
    /// slices: kvpool first, then the raw stream, then each baseline. The n-th workers of all
    /// of them share their receive buffers.
    async fn measure(&self, shape: &Shape, window: Duration) -> anyhow::Result<Vec<Measured>> {
        let bufs: Vec<Buffers> = (0..shape.conns).map(|_| Buffers::default()).collect();
        let (mut kv, mut stream) = (Vec::new(), Vec::new());
        for (w, b) in bufs.iter().enumerate() {
            kv.push(self.kvpool_worker(shape, w, b).await?);
            stream.push(self.raw_worker(shape, w, b).await?);
        }
        let mut sides = vec![kv, stream];
        for baseline in self.baselines {
            let mut side = Vec::new();
            for (w, b) in bufs.iter().enumerate() {
                side.push(baseline_worker(baseline, shape, w, b).await?);
            }
            sides.push(side);
        }
        interleave_tasks(&mut sides, window).await
    }

    /// kvpool's worker `w`, on a client of its own that does not take the same-host path.
    async fn kvpool_worker(
        &self,
        shape: &Shape,
        w: usize,
        b: &Buffers,
    ) -> anyhow::Result<AnyWorker> {
        let c = Client::connect(&self.endpoint, self.cfg.clone()).await?;
        anyhow::ensure!(
            !c.is_local(),
            "SameHost::Off client took the same-host path"
        );
        Ok(match shape.op {
            "put" => AnyWorker::KvPut(KvPut::new(c, shape.value.clone(), w, shape.conns)),
            _ => AnyWorker::KvGet(KvGet::new(
                c,
                shape.keys.clone(),
                shape.size,
                shape.depth,
                shape.start(w),
                b.clone(),
            )),
        })
    }

    /// The raw stream's worker `w`.
    async fn raw_worker(&self, shape: &Shape, w: usize, b: &Buffers) -> anyhow::Result<AnyWorker> {
        Ok(match shape.op {
            "put" => AnyWorker::RawPut(
                RawPut::connect(self.raw, shape.value.clone(), shape.conns).await?,
            ),
            _ => AnyWorker::RawGet(
                RawGet::connect(
                    self.raw,
                    shape.size,
                    shape.depth,
                    shape.keys.len(),
                    shape.start(w),
                    b.clone(),
                )
                .await?,
            ),
        })
    }
}

/// `baseline`'s worker `w`.
async fn baseline_worker(
    baseline: &Baseline,
    shape: &Shape,
    w: usize,
    b: &Buffers,
) -> anyhow::Result<AnyWorker> {
    let c = BaselineConn::connect(baseline.proto, baseline.port).await?;
    Ok(match shape.op {
        "put" => AnyWorker::BaselineSet(BaselineSet::new(c, shape.value.clone(), w, shape.conns)),
        _ => AnyWorker::BaselineGet(BaselineGet::new(
            c,
            shape.keys.clone(),
            shape.size,
            shape.depth,
            shape.start(w),
            b.clone(),
        )),
    })
}

/// The rows of one shape's runs (each: kvpool, raw stream, then the baselines in order): the
/// raw stream's, kvpool's with its ratio to it, and each baseline's.
fn push_rows(report: &mut Report, running: &[Baseline], shape: &Shape, runs: &[Vec<Measured>]) {
    let (op, size, conns, depth) = (shape.op, shape.size, shape.conns, shape.depth);
    let of = |i: usize| -> Vec<Measured> { runs.iter().map(|m| m[i].clone()).collect() };
    let raw_row = Row::new(Section::Tcp, RAW, op)
        .shape(size, conns, depth)
        .measured_runs(&of(1));
    let mut row = Row::new(Section::Tcp, "kvpool", op)
        .shape(size, conns, depth)
        .measured_runs(&of(0));
    if let Some(r) = Ref::between(RAW, &row, &raw_row) {
        row.refs.push(r);
    }
    report.push(raw_row);
    report.push(row);
    for (i, baseline) in running.iter().enumerate() {
        report.push(
            Row::new(Section::Baselines, baseline.proto.name(), op)
                .shape(size, conns, depth)
                .measured_runs(&of(2 + i)),
        );
    }
}

/// How the `tcp` section measures, for its notes.
fn method_note(verify: bool) -> String {
    format!(
        "default client settings except same_host: Off; {}; \
         depth {DEPTH} = one batch_get_into of {DEPTH} keys per round trip; put cycles over up to 32 keys \
         per conn, at most 512 MiB of them per size, stored with the data set beforehand in every \
         system so that each put overwrites a value (the client hashes each value, the node checks the \
         hash at commit); one client and connection per conn; p50/p99 per round trip; measured in slices \
         alternating with the raw tcp stream, memcached and redis. {RAW} = the physical limit of loopback \
         TCP for the same transfer: an in-process tokio server on 127.0.0.1 (own runtime, 2 threads) holds \
         a 512 MiB data set (read from DRAM, as kvpool's and the baselines' are) and answers each \
         request with the objects it names, written straight from it (writev); the client walks as many \
         objects as kvpool's data set has, in kvpool's order, and reads them into reused buffers (depth {DEPTH}: one request for \
         {DEPTH} consecutive objects, read into {DEPTH} buffers with readv; put: request and value in one \
         writev, the server reads the value into one of as many slots per connection as kvpool's put \
         loop has keys, and echoes the request); whoever receives 256 KiB or more raises the socket's \
         receive low-water mark per value as kvpool's client and node do; no framing, lookup or checksum; \
         the n-th connections of kvpool, raw tcp and the baselines share their receive buffers",
        if verify {
            "every value received is checked against its xxh3 checksum (the default)"
        } else {
            "--no-verify: received values are NOT checked against their checksum"
        }
    )
}
