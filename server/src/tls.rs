//! TLS material for QUIC and for TLS over TCP (`listen.tls`): the configured certificate and
//! key, or a self-signed pair generated on first start into the data directory (and reused
//! after).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// ALPN protocol id of kvpool over QUIC.
pub const ALPN: &[u8] = b"kvpool/1";

/// Where the generated certificate goes; clients may pass it as their CA (`--ca`).
pub fn generated_cert_path(data_dir: &Path) -> PathBuf {
    data_dir.join("tls-cert.pem")
}

/// Loads `cert`/`key`, or loads or generates the self-signed pair in `data_dir`.
pub fn load_or_generate(
    cert: Option<&Path>,
    key: Option<&Path>,
    data_dir: &Path,
) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let (cert_path, key_path) = match (cert, key) {
        (Some(c), Some(k)) => (c.to_path_buf(), k.to_path_buf()),
        (None, None) => {
            let c = generated_cert_path(data_dir);
            let k = data_dir.join("tls-key.pem");
            if !c.exists() || !k.exists() {
                generate(&c, &k)?;
                tracing::info!(cert = %c.display(), "generated a self-signed TLS certificate");
            }
            (c, k)
        }
        _ => bail!("tls.cert and tls.key must be given together"),
    };
    Ok((read_certs(&cert_path)?, read_key(&key_path)?))
}

/// Every certificate in the PEM file at `path` (at least one).
fn read_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

/// The private key in the PEM file at `path`.
fn read_key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).with_context(|| format!("reading {}", path.display()))
}

/// The TLS client configuration for `https://` etcd endpoints: the server's certificate is
/// verified against the CA certificates in `ca` (PEM) and the URL's name or address; with
/// `client` (certificate chain and key, PEM), that certificate is presented, for etcd's
/// `--client-cert-auth`. TLS 1.2 or 1.3, ring crypto, ALPN `http/1.1`.
pub fn https_client_config(
    ca: &Path,
    client: Option<(&Path, &Path)>,
) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in read_certs(ca)? {
        roots
            .add(cert)
            .with_context(|| format!("a CA certificate in {}", ca.display()))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut tls = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
            .with_context(|| format!("the client certificate {}", cert.display()))?,
        None => builder.with_no_client_auth(),
    };
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tls)
}

/// The TLS server configuration of `listen.tls` and, under QUIC's, of QUIC: TLS 1.3 only,
/// ring crypto, kvpool's ALPN.
pub fn tcp_server_config(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    Ok(tls)
}

/// The QUIC server configuration: TLS 1.3 only, ring crypto, kvpool's ALPN, and flow-control
/// windows sized for multi-megabyte values.
pub fn quic_server_config(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    max_streams: u32,
) -> anyhow::Result<quinn::ServerConfig> {
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tcp_server_config(certs, key)?)?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_concurrent_bidi_streams(max_streams.into())
        .max_concurrent_uni_streams(0u32.into())
        .stream_receive_window((16u32 << 20).into())
        .receive_window((64u32 << 20).into())
        .send_window(64 << 20);
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

fn generate(cert_path: &Path, key_path: &Path) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    if let Ok(h) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        names.push(h.trim().to_string());
    }
    let ck = rcgen::generate_simple_self_signed(names)?;
    if let Some(dir) = cert_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(cert_path, ck.cert.pem())?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(key_path)?;
    f.write_all(ck.signing_key.serialize_pem().as_bytes())?;
    Ok(())
}
