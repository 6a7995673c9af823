//! kvpool's get over QUIC next to the cheapest possible QUIC transfer of the same bytes
//! (`bare_quic`), the two alternating in slices of one window.

use anyhow::Context;
use kvpool_client::{Client, ClientConfig, SameHost};

use super::bare_quic::{BareClient, BareServer};
use super::compare::{interleave_tasks, AnyWorker};
use super::report::{Ref, Row};
use super::workloads::{self, Buffers, KvGet};
use super::{Ctx, Section};

/// Target of kvpool over QUIC, as a fraction of the bare transfer.
const TARGET: f64 = 0.8;

/// Measures both at the largest configured size for every connection count.
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let size = ctx.args.sizes.iter().copied().max().context("no sizes")?;
    let (quic, ca) = {
        let d = ctx.daemon()?;
        (format!("quic://{}", d.quic), d.cert())
    };
    let window = ctx.window();
    let server = BareServer::start(size)?;
    let cfg = ClientConfig {
        ca: Some(ca),
        same_host: SameHost::Off,
        verify_checksums: !ctx.args.no_verify,
        ..ClientConfig::default()
    };
    let keys = workloads::keys(size);
    for conns in ctx.args.conns.clone() {
        let m = ctx.rt.block_on(async {
            let (mut bare, mut kv) = (Vec::new(), Vec::new());
            for w in 0..conns {
                bare.push(AnyWorker::Bare(
                    BareClient::connect(server.addr, &server.cert, size).await?,
                ));
                let c = Client::connect(&quic, cfg.clone()).await?;
                kv.push(AnyWorker::KvGet(KvGet::new(
                    c,
                    keys.clone(),
                    size,
                    1,
                    w * keys.len() / conns,
                    Buffers::default(),
                )));
            }
            interleave_tasks(&mut [bare, kv], window).await
        })?;
        let bare_row = Row::new(Section::Quic, "bare quinn", "get")
            .shape(size, conns, 1)
            .measured(&m[0]);
        let mut row = Row::new(Section::Quic, "kvpool", "get")
            .shape(size, conns, 1)
            .measured(&m[1]);
        if let (Some(k), Some(b)) = (row.gbps, bare_row.gbps.filter(|b| *b > 0.0)) {
            row.refs.push(Ref::with_target("bare quinn", k / b, TARGET));
        }
        ctx.report.push(bare_row);
        ctx.report.push(row);
    }
    ctx.report.note(
        Section::Quic,
        "QUIC is CPU-bound here: TLS 1.3 encryption and quinn's user-space UDP stack on both ends share the \
         machine's cores, so neither side reaches memory or loopback bandwidth. TCP is kvpool's default data \
         path; QUIC is for links that need encryption. One QUIC connection per conn; bare quinn opens a \
         stream per request, sends 1 byte and reads the whole value to the end of the stream; the two \
         alternate in four slices",
    );
    Ok(())
}
