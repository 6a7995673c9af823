//! kvpool over loopback TCP with the same-host path off — every byte crosses the socket, as it
//! would from another host — next to memcached and redis running the same workloads. For each
//! shape the three run in alternating slices (see [`compare`](super::compare)); kvpool's rows
//! go to the `tcp` section, the peers' to `peers`. One client (one connection) per conn.

use kvpool_client::{Client, ClientConfig, SameHost};

use super::compare::{interleave_tasks, AnyWorker};
use super::peer_client::{PeerConn, PeerGet, PeerSet};
use super::peers;
use super::report::Row;
use super::workloads::{self, KvGet, KvPut, DEPTH};
use super::{Ctx, Section};

/// The workloads every system runs: (operation, depth).
const SHAPES: [(&str, usize); 3] = [("get", 1), ("get", DEPTH), ("put", 1)];

/// Measures kvpool, memcached and redis: get, pipelined get and put, every size and
/// connection count.
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let endpoint = format!("tcp://{}", ctx.daemon()?.tcp);
    let window = ctx.window();
    let running = peers::start_all(ctx)?;
    let verify = !ctx.args.no_verify;
    let cfg = ClientConfig {
        same_host: SameHost::Off,
        verify_checksums: verify,
        ..ClientConfig::default()
    };
    for size in ctx.args.sizes.clone() {
        let (keys, value) = (workloads::keys(size), workloads::value(size));
        for conns in ctx.args.conns.clone() {
            for (op, depth) in SHAPES {
                let start = |w: usize| w * keys.len() / conns;
                let m = ctx.rt.block_on(async {
                    let mut sides = Vec::new();
                    let mut kv = Vec::new();
                    for w in 0..conns {
                        let c = Client::connect(&endpoint, cfg.clone()).await?;
                        anyhow::ensure!(
                            !c.is_local(),
                            "SameHost::Off client took the same-host path"
                        );
                        kv.push(match op {
                            "put" => AnyWorker::KvPut(KvPut::new(c, value.clone(), w)),
                            _ => {
                                AnyWorker::KvGet(KvGet::new(c, keys.clone(), size, depth, start(w)))
                            }
                        });
                    }
                    sides.push(kv);
                    for peer in &running {
                        let mut side = Vec::new();
                        for w in 0..conns {
                            let c = PeerConn::connect(peer.proto, peer.port).await?;
                            side.push(match op {
                                "put" => AnyWorker::PeerSet(PeerSet::new(c, value.clone(), w)),
                                _ => AnyWorker::PeerGet(PeerGet::new(
                                    c,
                                    keys.clone(),
                                    size,
                                    depth,
                                    start(w),
                                )),
                            });
                        }
                        sides.push(side);
                    }
                    interleave_tasks(&mut sides, window).await
                })?;
                ctx.report.push(
                    Row::new(Section::Tcp, "kvpool", op)
                        .shape(size, conns, depth)
                        .measured(&m[0]),
                );
                for (peer, m) in running.iter().zip(&m[1..]) {
                    ctx.report.push(
                        Row::new(Section::Peers, peer.proto.name(), op)
                            .shape(size, conns, depth)
                            .measured(m),
                    );
                }
            }
        }
    }
    drop(running);
    peers::link(&mut ctx.report);
    ctx.report.note(
        Section::Tcp,
        format!(
            "default client settings except same_host: Off; {}; \
             depth {DEPTH} = one batch_get_into of {DEPTH} keys per round trip; put cycles over 32 keys \
             per conn (the client hashes each value, the node checks the hash at commit); one client and \
             connection per conn; p50/p99 per round trip; measured in slices alternating with memcached \
             and redis",
            if verify {
                "every value received is checked against its xxh3 checksum (the default)"
            } else {
                "--no-verify: received values are NOT checked against their checksum"
            }
        ),
    );
    peers::note(&mut ctx.report);
    Ok(())
}
