//! `kvpool-bench fabric`: one-sided reads over libfabric providers (`tcp`, `shm`) through
//! kvpool's fabric layer (`kvpool_fabric`) and through kvpool's `fabric://` gets (a daemon
//! serving that provider), against a bare `fi_read` loop over the same provider written here on
//! the raw binding (the provider's own limit, as the raw TCP stream is for TCP), and kvpool's
//! own TCP and same-host gets of the same sizes, in the same run.
//!
//! For each provider and depth, `--pairs` rounds run every contender for `--duration-ms`, the
//! order reversing each round; a row's ratio is the median of its per-round ratios to the bare
//! loop, with the lowest and highest (goal: the layer and `fabric://` gets at least 0.8 of the
//! bare loop by their lowest). Every read of the fabric contenders lands in a registered buffer; the first and last
//! of each run are checked byte for byte. Every run is bounded by its duration.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use clap::Args;
use kvpool_bench::units::{self, fmt_size};

/// The layer's goal, as a share of the bare loop.
const GOAL: f64 = 0.8;

/// Flags of `kvpool-bench fabric`.
#[derive(Args, Debug)]
pub(crate) struct FabricArgs {
    /// Providers, comma-separated.
    #[arg(long, default_value = "tcp,shm", value_delimiter = ',')]
    providers: Vec<String>,
    /// Bytes of one read (B, KiB, MiB).
    #[arg(long, default_value = "2MiB", value_parser = units::parse_size)]
    size: u64,
    /// Reads in flight, comma-separated.
    #[arg(long, default_value = "1,8", value_delimiter = ',')]
    depths: Vec<usize>,
    /// Length of each contender's run, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    duration_ms: u64,
    /// Rounds of every contender, the order reversing each round.
    #[arg(long, default_value_t = 5)]
    pairs: usize,
    /// Length of each run of the progress-cost measurement (4 KiB gets over TCP timed one by
    /// one, with the fabric off and on, idle and under 2 MiB reads), in milliseconds; 0 skips it.
    #[arg(long, default_value_t = 2000)]
    latency_ms: u64,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One row: a contender at a depth, its GB/s in every round.
struct Row {
    what: String,
    depth: usize,
    gbps: Vec<f64>,
    /// Per round, this row's GB/s over the bare loop's of the same round.
    ratios: Vec<f64>,
    goal: Option<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        })
}

/// Runs the benchmark, prints the table and writes the JSON.
pub(crate) fn run(args: FabricArgs) -> anyhow::Result<()> {
    if !kvpool_fabric::AVAILABLE {
        bail!(
            "this build has no libfabric binding: apt-get install libfabric-dev libclang-dev, \
             then rebuild"
        );
    }
    ensure!(
        args.pairs > 0 && args.duration_ms > 0 && !args.depths.contains(&0),
        "--pairs, --duration-ms and every depth must be positive"
    );
    let began = Instant::now();
    let size = usize::try_from(args.size)?;
    let per = Duration::from_millis(args.duration_ms);
    let max_depth = args.depths.iter().copied().max().unwrap_or(1);
    let kv = imp::KvpoolGets::start(args.kvpoold.as_deref(), size, max_depth, None)?;
    let mut out = String::new();
    let mut json_rows = Vec::new();
    let mut latency_rows = Vec::new();
    for provider in &args.providers {
        let mut bare = imp::Bare::open(provider, size, max_depth)
            .with_context(|| format!("the bare loop over {provider}"))?;
        let mut layer = imp::Layer::open(provider, size, max_depth)
            .with_context(|| format!("the fabric layer over {provider}"))?;
        let provider_name = layer.provider();
        let over_fabric =
            imp::KvpoolGets::start(args.kvpoold.as_deref(), size, max_depth, Some(provider))
                .with_context(|| format!("kvpoold serving {provider}"))?;
        for &depth in &args.depths {
            let mut rows: Vec<Row> = [
                format!("bare fi_read loop over {provider_name} (reference)"),
                format!("kvpool_fabric read_many over {provider_name}"),
                format!("kvpool batch_get_into over fabric://, {provider_name}"),
                "kvpool batch_get_into over TCP".into(),
                "kvpool batch_get_into, same host".into(),
            ]
            .into_iter()
            .enumerate()
            .map(|(i, what)| Row {
                what,
                depth,
                gbps: Vec::new(),
                ratios: Vec::new(),
                goal: (i == 1 || i == 2).then_some(GOAL),
            })
            .collect();
            for round in 0..args.pairs {
                let mut order = [0, 1, 2, 3, 4];
                if round % 2 == 1 {
                    order.reverse();
                }
                let mut got = [0.0; 5];
                for c in order {
                    let bytes_per_s = match c {
                        0 => bare.run(depth, per)?,
                        1 => layer.run(depth, per)?,
                        2 => over_fabric.run(imp::Path::Fabric, depth, per)?,
                        3 => kv.run(imp::Path::Tcp, depth, per)?,
                        _ => kv.run(imp::Path::SameHost, depth, per)?,
                    };
                    got[c] = bytes_per_s / 1e9;
                }
                for (c, row) in rows.iter_mut().enumerate() {
                    row.gbps.push(got[c]);
                    row.ratios.push(got[c] / got[0]);
                }
            }
            for r in &rows {
                let (lo, hi) = min_max(&r.ratios);
                let verdict = r.goal.map_or(String::new(), |g| {
                    let met = if lo >= g { "met" } else { "MISSED" };
                    format!(" (goal ≥{g}× by the lowest: {met})")
                });
                out.push_str(&format!(
                    "  {:<52} {:>6} depth {:<2} {:>6.2} GB/s  {:.2}× [{lo:.2}–{hi:.2}] bare{verdict}\n",
                    r.what,
                    fmt_size(args.size),
                    r.depth,
                    median(&r.gbps),
                    median(&r.ratios),
                ));
                json_rows.push(serde_json::json!({
                    "provider": provider,
                    "what": r.what,
                    "size": args.size,
                    "depth": r.depth,
                    "gbps_runs": r.gbps,
                    "gbps": median(&r.gbps),
                    "ratio": median(&r.ratios),
                    "ratio_min": lo,
                    "ratio_max": hi,
                    "goal": r.goal,
                    "met": r.goal.map(|g| lo >= g),
                }));
            }
        }
        if args.latency_ms > 0 {
            let (text, rows) = progress_cost(
                &kv,
                &over_fabric,
                &provider_name,
                max_depth,
                Duration::from_millis(args.latency_ms),
            )?;
            out.push_str(&text);
            latency_rows.extend(rows);
        }
    }
    crate::perf::render::publish(&out, began, args.json.as_deref(), |cmdline| {
        let mut s = serde_json::to_string_pretty(&serde_json::json!({
            "args": cmdline,
            "rows": json_rows,
            "latency": latency_rows,
        }))
        .expect("a Value always serialises");
        s.push('\n');
        s
    })
}

/// What the node's fabric progress costs latency-class requests: 4 KiB gets over TCP, timed one
/// by one, on the node without a fabric (`kv`) and on the one serving `provider`
/// (`over_fabric`), idle and while another client streams 2 MiB reads `depth` at a time (over
/// TCP from the first, over `fabric://` from the second). Returns the table's text and its JSON.
fn progress_cost(
    kv: &imp::KvpoolGets,
    over_fabric: &imp::KvpoolGets,
    provider: &str,
    depth: usize,
    per: Duration,
) -> anyhow::Result<(String, Vec<serde_json::Value>)> {
    let cases: [(&str, &imp::KvpoolGets, Option<imp::Path>); 4] = [
        ("fabric off, idle", kv, None),
        ("fabric on, idle", over_fabric, None),
        ("fabric off, 2 MiB gets over TCP", kv, Some(imp::Path::Tcp)),
        (
            "fabric on, 2 MiB gets over fabric://",
            over_fabric,
            Some(imp::Path::Fabric),
        ),
    ];
    let mut got = Vec::new();
    for (what, node, load) in cases {
        let (p50, p99) = std::thread::scope(|s| -> anyhow::Result<(f64, f64)> {
            let streaming = load.map(|path| s.spawn(move || node.run(path, depth, per)));
            let lat = node.latency(per);
            if let Some(t) = streaming {
                t.join()
                    .map_err(|_| anyhow::anyhow!("the streaming reader panicked"))??;
            }
            lat
        })?;
        got.push((what, p50, p99));
    }
    let mut text = format!("  4 KiB gets over TCP while the node serves {provider}:\n");
    let mut rows = Vec::new();
    for (i, (what, p50, p99)) in got.iter().enumerate() {
        // Each loaded case against its own idle node's figure... and fabric on against off.
        let base = match i {
            0 | 1 => got[0].2,
            _ => got[2].2,
        };
        text.push_str(&format!(
            "    {what:<40} p50 {p50:>7.1} µs  p99 {p99:>7.1} µs  ({:.2}× the p99 of {})\n",
            p99 / base,
            if i < 2 {
                "fabric off, idle"
            } else {
                "fabric off under TCP load"
            },
        ));
        rows.push(serde_json::json!({
            "provider": provider,
            "what": what,
            "p50_us": p50,
            "p99_us": p99,
            "p99_ratio": p99 / base,
        }));
    }
    Ok((text, rows))
}

/// The contenders (compiled where the binding is).
#[cfg(libfabric)]
mod imp {
    use std::ffi::CString;
    use std::ptr::{null, null_mut};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use anyhow::{bail, ensure, Context};
    use kvpool_client::{Client, ClientConfig, SameHost};
    use kvpool_fabric::sys;
    use kvpool_fabric::{Endpoint, Fabric, Peer, Region, Remote};

    use crate::perf::daemon::{self, Daemon};

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(37) ^ (i >> 13)) as u8
    }

    /// A thread that polls a serving endpoint until dropped (software providers move a peer's
    /// reads only while the serving side's queue is polled).
    struct Progress {
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Progress {
        fn start(mut poll: impl FnMut() + Send + 'static) -> Progress {
            let stop = Arc::new(AtomicBool::new(false));
            let stopping = stop.clone();
            let thread = std::thread::spawn(move || {
                while !stopping.load(Ordering::Relaxed) {
                    poll();
                    std::thread::yield_now();
                }
            });
            Progress {
                stop,
                thread: Some(thread),
            }
        }
    }

    impl Drop for Progress {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    /// kvpool's fabric layer: a serving endpoint (its region filled, polled by a thread) and a
    /// reading endpoint in another domain, reading `depth` values at once with `read_many`.
    pub(super) struct Layer {
        client: Endpoint,
        dst: Region,
        peer: Peer,
        remote: Remote,
        size: usize,
        provider: String,
        _progress: Progress,
        _fabrics: (Fabric, Fabric),
    }

    impl Layer {
        pub(super) fn open(provider: &str, size: usize, depth: usize) -> anyhow::Result<Layer> {
            let (sf, cf) = (Fabric::open(provider)?, Fabric::open(provider)?);
            let mut server = sf.endpoint()?;
            let mut src = server.register(size, true, false)?;
            for (i, b) in src.bytes_mut().iter_mut().enumerate() {
                *b = pattern(i);
            }
            let remote = src.remote();
            let client = cf.endpoint()?;
            let peer = client.insert(&server.name()?)?;
            server.insert(&client.name()?)?;
            let dst = client.register(size * depth, false, false)?;
            let progress = Progress::start(move || {
                let _ = &src;
                let _ = server.poll();
            });
            Ok(Layer {
                provider: sf.provider(),
                client,
                dst,
                peer,
                remote,
                size,
                _progress: progress,
                _fabrics: (sf, cf),
            })
        }

        pub(super) fn provider(&self) -> String {
            self.provider.clone()
        }

        /// Bytes per second of `depth` reads at a time for `per`; checks the values read.
        pub(super) fn run(&mut self, depth: usize, per: Duration) -> anyhow::Result<f64> {
            let reads: Vec<_> = (0..depth)
                .map(|i| {
                    (
                        i * self.size..(i + 1) * self.size,
                        self.peer,
                        self.remote,
                        0,
                    )
                })
                .collect();
            self.dst.bytes_mut()[..self.size * depth].fill(0);
            let (start, mut bytes) = (Instant::now(), 0u64);
            while start.elapsed() < per {
                self.client.read_many(&mut self.dst, &reads, depth)?;
                bytes += (self.size * depth) as u64;
            }
            let took = start.elapsed().as_secs_f64();
            for i in [0, depth - 1] {
                let got = &self.dst.bytes()[i * self.size..(i + 1) * self.size];
                ensure!(
                    got.iter().enumerate().all(|(j, &b)| b == pattern(j)),
                    "a value read over the fabric layer differs"
                );
            }
            Ok(bytes as f64 / took)
        }
    }

    /// A libfabric call's result, as an error naming it.
    fn ok(op: &str, r: isize) -> anyhow::Result<()> {
        if r < 0 {
            bail!("{op}: libfabric error {}", -r);
        }
        Ok(())
    }

    /// The bare loop's libfabric objects, in one domain (closed with the process).
    pub(super) struct Bare {
        client_ep: *mut sys::fid_ep,
        client_cq: *mut sys::fid_cq,
        dst: Vec<u8>,
        desc: *mut std::ffi::c_void,
        peer: sys::fi_addr_t,
        remote: (u64, u64),
        size: usize,
        _src: Vec<u8>,
        /// Stopped before anything is closed.
        progress: Option<Progress>,
        /// Every libfabric object, closed in this order when dropped (endpoints first: shm
        /// removes an endpoint's file in /dev/shm only when it is closed).
        objects: Vec<*mut sys::fid>,
    }

    impl Drop for Bare {
        fn drop(&mut self) {
            drop(self.progress.take());
            for &fid in &self.objects {
                // SAFETY: each object was opened by `open`, nothing uses it any more (the
                // progress thread has stopped), and dependents come before what they use.
                unsafe { sys::fi_close(fid) };
            }
        }
    }

    /// A raw pointer moved into the progress thread.
    struct SendPtr(*mut sys::fid_cq);
    // SAFETY: the queue belongs to a domain opened FI_THREAD_SAFE, and only the progress
    // thread reads it.
    unsafe impl Send for SendPtr {}

    impl Bare {
        /// Opens `provider` with the same hints as the fabric layer, two endpoints in one
        /// domain, a source of `size` bytes and a destination of `size * depth`.
        pub(super) fn open(provider: &str, size: usize, depth: usize) -> anyhow::Result<Bare> {
            // SAFETY: plain libfabric setup; every pointer comes from the call before it, and
            // the objects live until the value is dropped (its Drop closes them).
            unsafe {
                let hints = sys::fi_allocinfo();
                ensure!(!hints.is_null(), "fi_allocinfo");
                let h = &mut *hints;
                h.caps = u64::from(sys::FI_RMA | sys::FI_READ | sys::FI_REMOTE_READ);
                (*h.ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
                (*h.domain_attr).mr_mode = (sys::FI_MR_LOCAL
                    | sys::FI_MR_VIRT_ADDR
                    | sys::FI_MR_ALLOCATED
                    | sys::FI_MR_PROV_KEY
                    | sys::FI_MR_ENDPOINT) as i32;
                (*h.domain_attr).threading = sys::fi_threading_FI_THREAD_SAFE;
                (*h.fabric_attr).prov_name = libc::strdup(CString::new(provider)?.as_ptr());
                let mut info = null_mut();
                let r = sys::fi_getinfo((1 << 16) | 17, null(), null(), 0, hints, &mut info);
                ok("fi_getinfo", r as isize)?;
                let i = &*info;
                let mr_mode = (*i.domain_attr).mr_mode as u32;
                let (mut fabric, mut domain) = (null_mut(), null_mut());
                ok(
                    "fi_fabric",
                    sys::fi_fabric(i.fabric_attr, &mut fabric, null_mut()) as isize,
                )?;
                ok(
                    "fi_domain",
                    sys::fi_domain(fabric, info, &mut domain, null_mut()) as isize,
                )?;
                let endpoint = || -> anyhow::Result<_> {
                    let mut cq_attr = sys::fi_cq_attr {
                        format: sys::fi_cq_format_FI_CQ_FORMAT_CONTEXT,
                        size: 256,
                        ..Default::default()
                    };
                    let mut av_attr = sys::fi_av_attr {
                        type_: sys::fi_av_type_FI_AV_TABLE,
                        ..Default::default()
                    };
                    let (mut cq, mut av, mut ep) = (null_mut(), null_mut(), null_mut());
                    ok(
                        "fi_cq_open",
                        sys::fi_cq_open(domain, &mut cq_attr, &mut cq, null_mut()) as isize,
                    )?;
                    ok(
                        "fi_av_open",
                        sys::fi_av_open(domain, &mut av_attr, &mut av, null_mut()) as isize,
                    )?;
                    ok(
                        "fi_endpoint",
                        sys::fi_endpoint(domain, info, &mut ep, null_mut()) as isize,
                    )?;
                    ok(
                        "fi_ep_bind",
                        sys::fi_ep_bind(ep, &mut (*av).fid, 0) as isize,
                    )?;
                    ok(
                        "fi_ep_bind",
                        sys::fi_ep_bind(
                            ep,
                            &mut (*cq).fid,
                            u64::from(sys::FI_TRANSMIT | sys::FI_RECV),
                        ) as isize,
                    )?;
                    ok("fi_enable", sys::fi_enable(ep) as isize)?;
                    let mut name = vec![0u8; 256];
                    let mut len = name.len();
                    ok(
                        "fi_getname",
                        sys::fi_getname(&mut (*ep).fid, name.as_mut_ptr().cast(), &mut len)
                            as isize,
                    )?;
                    name.truncate(len);
                    Ok((ep, cq, av, name))
                };
                let (server_ep, server_cq, server_av, server_name) = endpoint()?;
                let (client_ep, client_cq, client_av, client_name) = endpoint()?;
                let mut peer = 0;
                let n = sys::fi_av_insert(
                    client_av,
                    server_name.as_ptr().cast(),
                    1,
                    &mut peer,
                    0,
                    null_mut(),
                );
                ensure!(n == 1, "fi_av_insert");
                let mut back = 0;
                let n = sys::fi_av_insert(
                    server_av,
                    client_name.as_ptr().cast(),
                    1,
                    &mut back,
                    0,
                    null_mut(),
                );
                ensure!(n == 1, "fi_av_insert");
                let src: Vec<u8> = (0..size).map(pattern).collect();
                let mut dst = vec![0u8; size * depth];
                let register = |ep: *mut sys::fid_ep,
                                buf: *const u8,
                                len: usize,
                                access: u32,
                                key: u64|
                 -> anyhow::Result<*mut sys::fid_mr> {
                    let mut mr = null_mut();
                    ok(
                        "fi_mr_reg",
                        sys::fi_mr_reg(
                            domain,
                            buf.cast(),
                            len,
                            u64::from(access),
                            0,
                            key,
                            0,
                            &mut mr,
                            null_mut(),
                        ) as isize,
                    )?;
                    if mr_mode & sys::FI_MR_ENDPOINT != 0 {
                        ok(
                            "fi_mr_bind",
                            sys::fi_mr_bind(mr, &mut (*ep).fid, 0) as isize,
                        )?;
                        ok("fi_mr_enable", sys::fi_mr_enable(mr) as isize)?;
                    }
                    Ok(mr)
                };
                let src_mr = register(server_ep, src.as_ptr(), size, sys::FI_REMOTE_READ, 1)?;
                let dst_mr = register(client_ep, dst.as_mut_ptr(), dst.len(), sys::FI_READ, 2)?;
                let addr = if mr_mode & sys::FI_MR_VIRT_ADDR != 0 {
                    src.as_ptr() as u64
                } else {
                    0
                };
                let cq = SendPtr(server_cq);
                let progress = Progress::start(move || {
                    let cq = &cq;
                    let mut e = sys::fi_cq_entry::default();
                    sys::fi_cq_read(cq.0, (&mut e as *mut sys::fi_cq_entry).cast(), 1);
                });
                let objects = vec![
                    &mut (*client_ep).fid as *mut sys::fid,
                    &mut (*server_ep).fid,
                    &mut (*dst_mr).fid,
                    &mut (*src_mr).fid,
                    &mut (*client_av).fid,
                    &mut (*server_av).fid,
                    &mut (*client_cq).fid,
                    &mut (*server_cq).fid,
                    &mut (*domain).fid,
                    &mut (*fabric).fid,
                ];
                Ok(Bare {
                    client_ep,
                    client_cq,
                    desc: sys::fi_mr_desc(dst_mr),
                    dst,
                    peer,
                    remote: (addr, sys::fi_mr_key(src_mr)),
                    size,
                    _src: src,
                    progress: Some(progress),
                    objects,
                })
            }
        }

        /// Bytes per second of `depth` reads kept in flight for `per`; checks the values read.
        pub(super) fn run(&mut self, depth: usize, per: Duration) -> anyhow::Result<f64> {
            let (start, mut done, mut posted) = (Instant::now(), 0u64, 0u64);
            let base = self.dst.as_mut_ptr();
            self.dst.fill(0);
            loop {
                let open = start.elapsed() < per;
                if open && posted - done < depth as u64 {
                    let slot = (posted % depth as u64) as usize;
                    // SAFETY: slot `slot` of the registered destination is in bounds and has no
                    // read in flight (at most `depth` are, one per slot, in order).
                    let r = unsafe {
                        sys::fi_read(
                            self.client_ep,
                            base.add(slot * self.size).cast(),
                            self.size,
                            self.desc,
                            self.peer,
                            self.remote.0,
                            self.remote.1,
                            null_mut(),
                        )
                    };
                    if r == 0 {
                        posted += 1;
                        continue;
                    }
                    ensure!(r == -(sys::FI_EAGAIN as isize), "fi_read: {r}");
                }
                if !open && done == posted {
                    break;
                }
                let mut e = sys::fi_cq_entry::default();
                // SAFETY: the queue is open; one context-format entry.
                let n = unsafe {
                    sys::fi_cq_read(self.client_cq, (&mut e as *mut sys::fi_cq_entry).cast(), 1)
                };
                if n == 1 {
                    done += 1;
                } else {
                    ensure!(n == -(sys::FI_EAGAIN as isize), "fi_cq_read: {n}");
                }
            }
            let took = start.elapsed().as_secs_f64();
            let used = depth.min(posted as usize).max(1);
            for slot in [0, used - 1] {
                let got = &self.dst[slot * self.size..(slot + 1) * self.size];
                ensure!(
                    got.iter().enumerate().all(|(j, &b)| b == pattern(j)),
                    "a value read by the bare loop differs"
                );
            }
            Ok((done * self.size as u64) as f64 / took)
        }
    }

    /// The small value of the latency runs.
    const SMALL_KEY: &[u8] = b"fabric-bench/small";
    const SMALL: usize = 4096;

    /// Which of a [`KvpoolGets`]'s clients reads.
    #[derive(Clone, Copy)]
    pub(super) enum Path {
        Tcp,
        SameHost,
        Fabric,
    }

    /// kvpool's own gets of the same sizes: one kvpoold, `depth` keys read with one
    /// `batch_get_into`, over TCP, on the same-host path and, with a daemon serving a fabric
    /// provider, over `fabric://`.
    pub(super) struct KvpoolGets {
        rt: tokio::runtime::Runtime,
        tcp: Client,
        local: Client,
        fabric: Option<Client>,
        keys: Vec<Vec<u8>>,
        size: usize,
        _daemon: Daemon,
    }

    impl KvpoolGets {
        pub(super) fn start(
            bin: Option<&std::path::Path>,
            size: usize,
            depth: usize,
            fabric: Option<&str>,
        ) -> anyhow::Result<KvpoolGets> {
            let bin = bin.map_or_else(daemon::default_binary, std::path::Path::to_path_buf);
            let extra: Vec<String> = fabric
                .map(|p| vec!["--fabric".into(), p.into()])
                .unwrap_or_default();
            let d = Daemon::start_with(&bin, daemon::memory_for((size * depth) as u64), &extra)?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            let url = format!("tcp://{}", d.tcp);
            let tcp = rt.block_on(Client::connect(
                &url,
                ClientConfig {
                    same_host: SameHost::Off,
                    ..Default::default()
                },
            ))?;
            let local = rt.block_on(Client::connect(&url, ClientConfig::default()))?;
            let fabric = match fabric {
                Some(_) => Some(rt.block_on(Client::connect(
                    &format!("fabric://{}", d.tcp),
                    ClientConfig {
                        same_host: SameHost::Off,
                        ..Default::default()
                    },
                ))?),
                None => None,
            };
            let value: Vec<u8> = (0..size).map(pattern).collect();
            let keys: Vec<Vec<u8>> = (0..depth)
                .map(|i| format!("fabric-bench/{i}").into())
                .collect();
            for k in &keys {
                rt.block_on(tcp.put(k, &value))
                    .context("storing the values")?;
            }
            rt.block_on(tcp.put(SMALL_KEY, &value[..SMALL]))
                .context("storing the small value")?;
            Ok(KvpoolGets {
                rt,
                tcp,
                local,
                fabric,
                keys,
                size,
                _daemon: d,
            })
        }

        /// p50 and p99, in µs, of 4 KiB gets over TCP one at a time for `per`.
        pub(super) fn latency(&self, per: Duration) -> anyhow::Result<(f64, f64)> {
            let mut hist = hdrhistogram::Histogram::<u64>::new(3)?;
            let mut buf = vec![0u8; SMALL];
            let start = Instant::now();
            while start.elapsed() < per {
                let t = Instant::now();
                let got = self.rt.block_on(self.tcp.get_into(SMALL_KEY, &mut buf))?;
                hist.record(t.elapsed().as_nanos() as u64)?;
                ensure!(got == Some(SMALL), "the small get missed");
            }
            ensure!(
                buf.iter().enumerate().all(|(j, &b)| b == pattern(j)),
                "a small value kvpool returned differs"
            );
            let us = |q| hist.value_at_quantile(q) as f64 / 1e3;
            Ok((us(0.5), us(0.99)))
        }

        /// Bytes per second of `depth` gets per call for `per`; checks the values read.
        pub(super) fn run(&self, path: Path, depth: usize, per: Duration) -> anyhow::Result<f64> {
            let client = match path {
                Path::Tcp => &self.tcp,
                Path::SameHost => &self.local,
                Path::Fabric => self
                    .fabric
                    .as_ref()
                    .context("a daemon started without a fabric")?,
            };
            let keys: Vec<&[u8]> = self.keys[..depth].iter().map(|k| &k[..]).collect();
            let mut bufs = vec![vec![0u8; self.size]; depth];
            let (start, mut bytes) = (Instant::now(), 0u64);
            while start.elapsed() < per {
                let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                let got = self.rt.block_on(client.batch_get_into(&keys, &mut dsts))?;
                ensure!(got.iter().all(|g| *g == Some(self.size)), "a get missed");
                bytes += (self.size * depth) as u64;
            }
            let took = start.elapsed().as_secs_f64();
            ensure!(
                bufs[0].iter().enumerate().all(|(j, &b)| b == pattern(j)),
                "a value kvpool returned differs"
            );
            Ok(bytes as f64 / took)
        }
    }
}

/// Without the binding there is nothing to run ([`run`] says so first).
#[cfg(not(libfabric))]
mod imp {
    use std::time::Duration;

    pub(super) struct KvpoolGets;
    pub(super) struct Bare;
    pub(super) struct Layer;
    #[derive(Clone, Copy)]
    pub(super) enum Path {
        Tcp,
        SameHost,
        Fabric,
    }

    impl KvpoolGets {
        pub(super) fn start(
            _: Option<&std::path::Path>,
            _: usize,
            _: usize,
            _: Option<&str>,
        ) -> anyhow::Result<KvpoolGets> {
            anyhow::bail!("no libfabric binding")
        }
        pub(super) fn run(&self, _: Path, _: usize, _: Duration) -> anyhow::Result<f64> {
            anyhow::bail!("no libfabric binding")
        }
        pub(super) fn latency(&self, _: Duration) -> anyhow::Result<(f64, f64)> {
            anyhow::bail!("no libfabric binding")
        }
    }

    impl Bare {
        pub(super) fn open(_: &str, _: usize, _: usize) -> anyhow::Result<Bare> {
            anyhow::bail!("no libfabric binding")
        }
        pub(super) fn run(&mut self, _: usize, _: Duration) -> anyhow::Result<f64> {
            anyhow::bail!("no libfabric binding")
        }
    }

    impl Layer {
        pub(super) fn open(_: &str, _: usize, _: usize) -> anyhow::Result<Layer> {
            anyhow::bail!("no libfabric binding")
        }
        pub(super) fn provider(&self) -> String {
            String::new()
        }
        pub(super) fn run(&mut self, _: usize, _: Duration) -> anyhow::Result<f64> {
            anyhow::bail!("no libfabric binding")
        }
    }
}
