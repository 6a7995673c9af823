//! The cheapest possible QUIC transfer, the reference kvpool's get over QUIC is measured
//! against: an in-process quinn server (its own runtime, like a separate daemon) that answers
//! each one-byte request on a fresh bidirectional stream with the whole value, and its client.
//! Same TLS provider (rustls + ring), same flow-control windows as kvpool.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::driver::Worker;
use super::workloads;

const ALPN: &[u8] = b"bench/1";

/// The in-process reference server, on its own runtime.
pub(crate) struct BareServer {
    rt: Option<tokio::runtime::Runtime>,
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    /// Its self-signed certificate, for the client to trust.
    pub(crate) cert: CertificateDer<'static>,
}

impl BareServer {
    /// Starts serving a payload of `size` bytes.
    pub(crate) fn start(size: u64) -> anyhow::Result<BareServer> {
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
    /// Connects to the server at `addr`, trusting `cert`, for values of `size` bytes.
    pub(crate) async fn connect(
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
