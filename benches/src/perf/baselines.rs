//! memcached and redis as child processes on loopback, loaded with the same keys and values as
//! kvpool, for the `tcp` section to drive with the same workloads (sizes, connections, depth,
//! duration) through the minimal clients of [`baseline_client`](super::baseline_client); then the
//! ratios kvpool/memcached and kvpool/redis attached to kvpool's rows.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::baseline_client::{BaselineConn, Proto};
use super::daemon::{register, stop};
use super::report::{Ref, Report};
use super::workloads::{self, DEPTH};
use super::{Ctx, Section};
use kvpool_bench::units::fmt_size;

/// Value size at which the targets apply, and the targets (kvpool ÷ baseline).
const TARGET_SIZE: u64 = 2 << 20;
const TARGET_MEMCACHED: f64 = 1.0;
const TARGET_REDIS: f64 = 1.5;

/// A running baseline server, stopped when dropped.
pub(crate) struct Baseline {
    /// Which one.
    pub(crate) proto: Proto,
    /// Its loopback port.
    pub(crate) port: u16,
    child: Child,
}

impl Drop for Baseline {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(5));
    }
}

/// Memory settings of the baselines, large enough for what a run stores (the defaults unless the
/// sizes or connection counts call for more).
pub(crate) struct Limits {
    /// memcached `-m`, MiB.
    pub(crate) memcached_mib: u64,
    /// memcached `-I`, MiB: room for the largest value and its item header.
    pub(crate) memcached_item_mib: u64,
    /// redis `--maxmemory`, MiB.
    pub(crate) redis_mib: u64,
}

impl Limits {
    fn new(sizes: &[u64], conns: &[usize]) -> Limits {
        // Twice what is stored leaves room for slab classes, allocator size classes and
        // redis's reply buffers.
        let stored_mib = (2 * workloads::stored_bytes(sizes, conns)).div_ceil(1 << 20);
        let largest_mib = sizes.iter().max().copied().unwrap_or(0) >> 20;
        Limits {
            memcached_mib: stored_mib.max(4096),
            memcached_item_mib: (largest_mib + 1).next_power_of_two().max(32),
            redis_mib: stored_mib.max(4096),
        }
    }
}

/// Starts memcached and redis (those installed; a note for each missing one) and stores every
/// size's data set in them.
pub(crate) fn start_all(ctx: &mut Ctx) -> anyhow::Result<Vec<Baseline>> {
    let limits = Limits::new(&ctx.args.sizes, &ctx.args.conns);
    let mut running = Vec::new();
    for proto in [Proto::Memcached, Proto::Redis] {
        match start(proto, &limits)? {
            Some(baseline) => {
                ctx.rt
                    .block_on(load(proto, baseline.port, &ctx.args.sizes, &ctx.args.conns))?;
                running.push(baseline);
            }
            None => {
                let (bin, pkg) = binary(proto);
                ctx.report.note(
                    Section::Baselines,
                    format!("{bin} not installed: skipping (apt-get install {pkg})"),
                );
            }
        }
    }
    Ok(running)
}

/// Attaches kvpool/baseline ratios to every TCP row that has a baseline row of the same shape.
pub(crate) fn link(report: &mut Report) {
    let mut add = Vec::new();
    for (i, kv) in report
        .rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.section == Section::Tcp && r.system == "kvpool")
    {
        for (proto, target) in [
            (Proto::Memcached, TARGET_MEMCACHED),
            (Proto::Redis, TARGET_REDIS),
        ] {
            let baseline = report.find(Section::Baselines, proto.name(), &kv.op, kv);
            if let Some(r) = baseline.and_then(|b| Ref::between(proto.name(), kv, b)) {
                let r = match kv.size == Some(TARGET_SIZE) {
                    true => r.aiming(target),
                    false => r,
                };
                add.push((i, r));
            }
        }
    }
    for (i, r) in add {
        report.rows[i].refs.retain(|x| x.name != r.name);
        report.rows[i].refs.push(r);
    }
}

/// Explains the baseline rows.
pub(crate) fn note(report: &mut Report, sizes: &[u64], conns: &[usize]) {
    let l = Limits::new(sizes, conns);
    report.note(
        Section::Baselines,
        format!(
            "put = SET/set; depth {DEPTH} = {DEPTH} GET/get requests written back to back before reading the replies \
             (kvpool: one batch_get_into of {DEPTH} keys); memcached -t 2 -m {} -I {}m, redis single-threaded, \
             no persistence, maxmemory {}mb; targets at {}: kvpool ≥{TARGET_MEMCACHED}× memcached, ≥{TARGET_REDIS}× redis",
            l.memcached_mib,
            l.memcached_item_mib,
            l.redis_mib,
            fmt_size(TARGET_SIZE)
        ),
    );
}

/// (binary, Debian package) of a baseline.
pub(crate) fn binary(proto: Proto) -> (&'static str, &'static str) {
    match proto {
        Proto::Redis => ("redis-server", "redis-server"),
        Proto::Memcached => ("memcached", "memcached"),
    }
}

/// Finds `name` in PATH (and the usual sbin directories).
fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/bin", "/usr/local/sbin"])
        .map(|d| PathBuf::from(d).join(name))
        .find(|p| p.is_file());
    found
}

/// A free loopback port (bind to port 0, read it, close).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts the baseline on a free port and waits until it answers; None when not installed.
pub(crate) fn start(proto: Proto, limits: &Limits) -> anyhow::Result<Option<Baseline>> {
    let (bin, _) = binary(proto);
    let Some(path) = which(bin) else {
        return Ok(None);
    };
    let port = free_port()?;
    let p = port.to_string();
    let mut cmd = Command::new(&path);
    match proto {
        Proto::Redis => {
            cmd.args([
                "--port",
                &p,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ]);
            let maxmemory = format!("{}mb", limits.redis_mib);
            cmd.args([
                "--maxmemory",
                &maxmemory,
                "--maxmemory-policy",
                "noeviction",
                "--loglevel",
                "warning",
            ]);
        }
        Proto::Memcached => {
            let (m, i) = (
                limits.memcached_mib.to_string(),
                format!("{}m", limits.memcached_item_mib),
            );
            cmd.args([
                "-p",
                &p,
                "-U",
                "0",
                "-l",
                "127.0.0.1",
                "-m",
                &m,
                "-I",
                &i,
                "-t",
                "2",
            ]);
            // SAFETY: geteuid has no preconditions. memcached refuses to run as root without -u.
            if unsafe { libc::geteuid() } == 0 {
                cmd.args(["-u", "root"]);
            }
        }
    }
    eprintln!("  starting {} on 127.0.0.1:{port}", path.display());
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {bin}"))?;
    register(child.id(), None);
    let mut baseline = Baseline { proto, port, child };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = baseline.child.try_wait()? {
            bail!("{bin} exited at start ({status}); run `{cmd:?}` by hand to see why");
        }
        std::thread::sleep(Duration::from_millis(50));
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(Some(baseline));
        }
        if Instant::now() > deadline {
            bail!("{bin} did not accept connections on port {port} within 10 s");
        }
    }
}

/// Stores every size's data set and put keys in the baseline, 16 pipelined sets at a time.
async fn load(proto: Proto, port: u16, sizes: &[u64], conns: &[usize]) -> anyhow::Result<()> {
    for &size in sizes {
        let keys = workloads::stored_keys(size, conns);
        eprintln!(
            "  loading {} × {} into {}",
            keys.len(),
            fmt_size(size),
            proto.name()
        );
        store(proto, port, &keys, size).await?;
    }
    Ok(())
}

/// Stores `keys` in the baseline, each with the value of `size` ([`workloads::value`]), 16
/// pipelined sets at a time.
pub(crate) async fn store(
    proto: Proto,
    port: u16,
    keys: &[Vec<u8>],
    size: u64,
) -> anyhow::Result<()> {
    let mut c = BaselineConn::connect(proto, port).await?;
    c.ping().await?;
    let value = workloads::value(size);
    for chunk in keys.chunks(16) {
        for k in chunk {
            c.send_set(k, &value).await?;
        }
        c.flush().await?;
        for _ in chunk {
            c.read_set().await?;
        }
    }
    Ok(())
}
