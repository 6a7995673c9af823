//! kvpool's get over QUIC next to the cheapest possible QUIC transfer of the same bytes: an
//! in-process quinn server (its own runtime, like a separate daemon) that answers each
//! one-byte request on a fresh bidirectional stream with the whole value. Same TLS provider
//! (rustls + ring), same flow-control windows as kvpool.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use kvpool_client::{Client, ClientConfig, SameHost};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::compare::{interleave_tasks, AnyWorker};
use super::driver::Worker;
use super::report::{Ref, Row};
use super::workloads::{self, Buffers, KvGet};
use super::{Ctx, Section};

/// Target of kvpool over QUIC, as a fraction of the bare transfer.
const TARGET: f64 = 0.8;
const ALPN: &[u8] = b"bench/1";

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

/// The in-process reference server, on its own runtime.
struct BareServer {
    rt: Option<tokio::runtime::Runtime>,
    addr: SocketAddr,
    cert: CertificateDer<'static>,
}

impl BareServer {
    fn start(size: u64) -> anyhow::Result<BareServer> {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])?;
        let cert = ck.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], key)?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(
            quinn::crypto::rustls::QuicServerConfig::try_from(tls)?,
        ));
        cfg.transport_config(Arc::new(transport()));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bare-quic")
            .enable_all()
            .build()?;
        let ep = rt.block_on(async {
            quinn::Endpoint::server(cfg, "127.0.0.1:0".parse().expect("valid address"))
        })?;
        let addr = ep.local_addr()?;
        let payload = workloads::value(size);
        rt.spawn(async move {
            while let Some(incoming) = ep.accept().await {
                let payload = payload.clone();
                tokio::spawn(serve(incoming, payload));
            }
        });
        Ok(BareServer {
            rt: Some(rt),
            addr,
            cert,
        })
    }
}

/// Answers every stream of one connection with the whole payload, until the client leaves.
async fn serve(incoming: quinn::Incoming, payload: Arc<Vec<u8>>) -> anyhow::Result<()> {
    let conn = incoming.await?;
    loop {
        let (mut send, mut recv) = conn.accept_bi().await?;
        let payload = payload.clone();
        tokio::spawn(async move {
            let mut req = [0u8; 1];
            recv.read_exact(&mut req).await?;
            send.write_all(&payload).await?;
            send.finish()?;
            anyhow::Ok(())
        });
    }
}

impl Drop for BareServer {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Flow-control windows of kvpool's QUIC client and server.
fn transport() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window((16u32 << 20).into())
        .receive_window((64u32 << 20).into())
        .send_window(64 << 20);
    t
}

/// One connection to the reference server.
pub(crate) struct BareClient {
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    buf: Vec<u8>,
}

impl BareClient {
    async fn connect(
        addr: SocketAddr,
        cert: &CertificateDer<'static>,
        size: u64,
    ) -> anyhow::Result<BareClient> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.clone())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let mut cfg = quinn::ClientConfig::new(Arc::new(
            quinn::crypto::rustls::QuicClientConfig::try_from(tls)?,
        ));
        cfg.transport_config(Arc::new(transport()));
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().expect("valid address"))?;
        endpoint.set_default_client_config(cfg);
        let conn = endpoint.connect(addr, "localhost")?.await?;
        Ok(BareClient {
            _endpoint: endpoint,
            conn,
            buf: vec![0u8; size as usize],
        })
    }
}

impl Worker for BareClient {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let (mut send, mut recv) = self.conn.open_bi().await?;
        send.write_all(&[1]).await?;
        send.finish()?;
        recv.read_exact(&mut self.buf).await?;
        let mut more = [0u8; 1];
        anyhow::ensure!(
            recv.read(&mut more).await?.is_none(),
            "bare server sent more than the value"
        );
        Ok(self.buf.len() as u64)
    }
}
