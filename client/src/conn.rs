//! One framed stream to a node: a TCP connection, a Unix socket connection, one
//! bidirectional stream of a QUIC connection, or a stream the config's connector opened. A
//! connection is used by one call at a time; a call that fails mid-frame (or times out) drops
//! its connection, so a stream is never reused out of sync.
//!
//! Uses `config`, `connector`, `endpoint` and `error` only.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool::protocol::auth::{self, ClusterSecret};
use kvpool::protocol::io::{discard, read_header, read_prefix, write_frame, FrameReader, LowWater};
pub(crate) use kvpool::protocol::Class;
use kvpool::protocol::{
    decode_response_owned, judge, AlignedVec, ErrorCode, Exchange, HelloInfo, Limits, Op, Outcome,
    Reply, Response, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::DigitallySignedStruct;
use tokio::io::{AsyncBufRead, AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::{TcpStream, UnixStream};

use crate::config::ClientConfig;
use crate::endpoint::Endpoint;
use crate::error::ClientError;

type Reader = Box<dyn AsyncRead + Unpin + Send>;
type Writer = Box<dyn AsyncWrite + Unpin + Send>;

const IO_BUFFER: usize = 64 << 10;

/// Most bytes [`Conn::read_into_hashed`] asks the socket for at once: the piece just received
/// is hashed while it is still in the cache (a core's L2 holds it), and a payload already
/// queued whole is taken in a few large reads instead of many small ones.
const HASH_PIECE: usize = kvpool::protocol::io::LOW_WATER_MAX;

/// An idle connection used this recently is reused without checking the node closed it.
const FRESH: Duration = Duration::from_millis(1);

pub(crate) struct Conn {
    r: FrameReader<Reader>,
    w: BufWriter<Writer>,
    hdr: AlignedVec,
    /// Builds the requests and judges the replies. Its view stamp and class, which the next
    /// requests carry, are set by the pool per call.
    pub(crate) exchange: Exchange,
    limits: Limits,
    /// The socket, for [`Conn::looks_open`] (None for a QUIC stream). Owned by `r` and `w`.
    fd: Option<RawFd>,
    /// The socket is a Unix socket (descriptors can come over it: [`Conn::call_with_fds`]).
    unix: bool,
    /// The QUIC connection of a QUIC stream, for [`Conn::looks_open`].
    quic: Option<quinn::Connection>,
    /// The stream came from the config's connector: [`Conn::looks_open`] polls it once.
    polled: bool,
    /// When the connection last finished an exchange (set by the pool).
    pub(crate) last_used: Instant,
}

impl Conn {
    /// Opens a stream and performs the handshake. `bulk`: the stream carries bulk calls; on
    /// QUIC it gets a lower send priority than the latency streams of the same connection, so
    /// a small request's bytes go out before a large put's.
    ///
    /// Asks for this build's protocol version, and, when the node is older
    /// (`UnsupportedVersion`), opens the stream again asking for [`MIN_PROTOCOL_VERSION`]:
    /// everything a client sends is of that version, and only the answers differ (a miss is an
    /// error there, `Miss` from [`kvpool::protocol::MISS_VERSION`] on).
    pub(crate) async fn open(
        endpoint: &Endpoint,
        cfg: &ClientConfig,
        stream: (Option<&quinn::Connection>, bool),
    ) -> Result<(Conn, HelloInfo), ClientError> {
        match Conn::open_as(PROTOCOL_VERSION, endpoint, cfg, stream).await {
            Err(ClientError::Server {
                code: ErrorCode::UnsupportedVersion,
                ..
            }) => Conn::open_as(MIN_PROTOCOL_VERSION, endpoint, cfg, stream).await,
            r => r,
        }
    }

    async fn open_as(
        version: u32,
        endpoint: &Endpoint,
        cfg: &ClientConfig,
        (quic, bulk): (Option<&quinn::Connection>, bool),
    ) -> Result<(Conn, HelloInfo), ClientError> {
        let (r, w, fd) = match &cfg.connector {
            Some(c) => {
                let (r, w) = tokio::io::split(c.connect(endpoint).await?);
                let (r, w): (Reader, Writer) = (Box::new(r), Box::new(w));
                (r, w, None)
            }
            None => Conn::dial(endpoint, cfg, (quic, bulk)).await?,
        };
        let mut conn = Conn {
            r: FrameReader::with_capacity(IO_BUFFER, r),
            w: BufWriter::with_capacity(IO_BUFFER, w),
            hdr: AlignedVec::new(),
            exchange: Exchange::new(),
            fd,
            unix: matches!(endpoint, Endpoint::Unix(_)) && cfg.connector.is_none(),
            polled: cfg.connector.is_some(),
            quic: quic.cloned(),
            last_used: Instant::now(),
            // Generous until the node tells us its limits: responses are bounded by what we ask.
            limits: Limits {
                max_header: 64 << 20,
                max_payload: u64::MAX,
                max_batch: u32::MAX,
            },
        };
        let hello = Op::Hello {
            version,
            token: cfg.token.clone(),
            client: cfg.client_name.clone(),
        };
        let hello = match conn.call(hello, &[]).await?.0 {
            Reply::Hello(h) => h,
            other => {
                return Err(ClientError::Protocol(format!(
                    "unexpected handshake reply {other:?}"
                )))
            }
        };
        if let Some(secret) = &cfg.cluster_secret {
            conn.cluster_auth(secret, &hello).await?;
        }
        Ok((conn, hello))
    }

    /// Opens the stream of [`Conn::open_as`] over the network: the endpoint's transport.
    /// Returns its halves and, for a TCP or Unix socket, the socket.
    async fn dial(
        endpoint: &Endpoint,
        cfg: &ClientConfig,
        (quic, bulk): (Option<&quinn::Connection>, bool),
    ) -> Result<(Reader, Writer, Option<RawFd>), ClientError> {
        let mut fd = None;
        let (r, w): (Reader, Writer) = match endpoint {
            Endpoint::Tcp(a) | Endpoint::Fabric(a) => {
                let s = TcpStream::connect(a.as_str()).await?;
                s.set_nodelay(true)?;
                fd = Some(s.as_raw_fd());
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
            Endpoint::Tls(a) => {
                let s = TcpStream::connect(a.as_str()).await?;
                s.set_nodelay(true)?;
                let tls = tls_config(cfg)?;
                let name = endpoint.host().unwrap_or("localhost").to_string();
                let name = rustls::pki_types::ServerName::try_from(name)
                    .map_err(|e| ClientError::Tls(e.to_string()))?;
                let s = tokio_rustls::TlsConnector::from(Arc::new(tls))
                    .connect(name, s)
                    .await
                    .map_err(|e| ClientError::Tls(e.to_string()))?;
                let (r, w) = tokio::io::split(s);
                (Box::new(r), Box::new(w))
            }
            Endpoint::Unix(p) => {
                let s = UnixStream::connect(p).await?;
                fd = Some(s.as_raw_fd());
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
            Endpoint::Quic(_) => {
                let c = quic.ok_or_else(|| ClientError::Tls("no QUIC connection".into()))?;
                let (send, recv) = c
                    .open_bi()
                    .await
                    .map_err(|e| ClientError::Tls(e.to_string()))?;
                // (Fails only on a stream already closed, which the handshake then reports.)
                let _ = send.set_priority(if bulk { 0 } else { 1 });
                (Box::new(recv), Box::new(send))
            }
        };
        Ok((r, w, fd))
    }

    /// Proves the cluster secret to the node and checks the node's proof in turn.
    async fn cluster_auth(
        &mut self,
        secret: &ClusterSecret,
        hello: &HelloInfo,
    ) -> Result<(), ClientError> {
        let nonce = auth::random().map_err(|e| ClientError::Protocol(e.to_string()))?;
        let proof = secret.peer_proof(hello.node, &hello.challenge, &nonce);
        match self.call(Op::ClusterAuth { nonce, proof }, &[]).await?.0 {
            Reply::ClusterAuth { proof }
                if secret.verify_node(hello.node, &hello.challenge, &nonce, &proof) =>
            {
                Ok(())
            }
            other => Err(ClientError::Protocol(format!(
                "node {} failed the cluster secret check (answered {other:?})",
                hello.node
            ))),
        }
    }

    /// Whether an idle connection can still carry a request: false when the node closed it (it
    /// exited or restarted) or it holds bytes nobody asked for (out of sync). One non-blocking
    /// peek at the socket, which does not depend on the runtime having polled it since; a
    /// stream from the config's connector is polled once instead.
    pub(crate) fn looks_open(&mut self) -> bool {
        if !self.r.buffer().is_empty() {
            return false;
        }
        if let Some(q) = &self.quic {
            return q.close_reason().is_none();
        }
        if self.polled {
            // Pending: nothing to read, the stream is open. Anything else is its end, an
            // error, or bytes nobody asked for.
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let fill = std::pin::Pin::new(&mut self.r).poll_fill_buf(&mut cx);
            return fill.is_pending();
        }
        // Used moments ago: no daemon restarts that fast, and the peek would cost a syscall per
        // call on a busy connection. (A node that died meanwhile fails the call, a miss.)
        if self.last_used.elapsed() < FRESH {
            return true;
        }
        let Some(fd) = self.fd else {
            return true;
        };
        let mut byte = 0u8;
        // SAFETY: `fd` is the socket `r` and `w` own, open as long as `self` lives; recv with
        // MSG_PEEK writes at most one byte into `byte` and consumes nothing.
        let n = unsafe {
            libc::recv(
                fd,
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n < 0 && {
            let e = std::io::Error::last_os_error().kind();
            e == std::io::ErrorKind::WouldBlock || e == std::io::ErrorKind::Interrupted
        }
    }

    /// Sends one request without waiting; returns its id. Call [`Conn::flush`] after a batch.
    pub(crate) async fn send(&mut self, op: Op, payload: &[&[u8]]) -> Result<u64, ClientError> {
        let out = self.exchange.request(op);
        write_frame(&mut self.w, &out.header, payload).await?;
        Ok(out.id)
    }

    pub(crate) async fn flush(&mut self) -> Result<(), ClientError> {
        self.w.flush().await?;
        Ok(())
    }

    /// Receives the response to request `id`, judged; the caller must consume the payload of a
    /// `Done` (any other outcome's is skipped here).
    pub(crate) async fn recv_outcome(&mut self, id: u64) -> Result<(Outcome, u64), ClientError> {
        let prefix = read_prefix(&mut self.r, &self.limits)
            .await?
            .ok_or_else(|| ClientError::Io(std::io::ErrorKind::UnexpectedEof.into()))?;
        read_header(&mut self.r, &prefix, &mut self.hdr).await?;
        let outcome = judge(id, decode_response_owned(&self.hdr)?)
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        if matches!(outcome, Outcome::Done(_)) {
            return Ok((outcome, prefix.payload_len));
        }
        self.skip(prefix.payload_len).await?;
        Ok((outcome, 0))
    }

    /// Receives the response to request `id`: the node's answer, whose payload the caller
    /// consumes, or its refusal as an error (a miss as `NotFound`).
    pub(crate) async fn recv(&mut self, id: u64) -> Result<(Reply, u64), ClientError> {
        let (outcome, len) = self.recv_outcome(id).await?;
        let reply = outcome.into_result().map_err(refused)?;
        Ok((reply, len))
    }

    /// One request, one response (whose payload the caller consumes).
    pub(crate) async fn call(
        &mut self,
        op: Op,
        payload: &[&[u8]],
    ) -> Result<(Reply, u64), ClientError> {
        let id = self.send(op, payload).await?;
        self.flush().await?;
        self.recv(id).await
    }

    /// A read whose miss is an answer: None when the key is not there (`Miss`, or `NotFound`
    /// from a node of an older protocol), else the reply, whose payload the caller consumes.
    pub(crate) async fn fetch(&mut self, op: Op) -> Result<Option<(Reply, u64)>, ClientError> {
        let id = self.send(op, &[]).await?;
        self.flush().await?;
        match self.recv_outcome(id).await? {
            (Outcome::Done(reply), len) => Ok(Some((reply, len))),
            (Outcome::Miss, _)
            | (
                Outcome::Refused {
                    code: ErrorCode::NotFound,
                    ..
                },
                _,
            ) => Ok(None),
            (outcome, _) => Err(refused(outcome.into_result().expect_err("not Done"))),
        }
    }

    /// A call (no payload either way) over a Unix socket whose reply brings file descriptors,
    /// attached to its first byte (`MapInfo`): they are taken with a peek as soon as that byte
    /// arrives, before the reply is read as usual (which drops the kernel's own copies).
    pub(crate) async fn call_with_fds(
        &mut self,
        op: Op,
        within: Duration,
    ) -> Result<(Reply, Vec<std::os::fd::OwnedFd>), ClientError> {
        let fd = match self.fd {
            Some(fd) if self.unix && self.r.buffer().is_empty() => fd,
            _ => {
                return Err(ClientError::Protocol(
                    "descriptors come only over an idle Unix socket".into(),
                ))
            }
        };
        let id = self.send(op, &[]).await?;
        self.flush().await?;
        let deadline = Instant::now() + within;
        let fds = loop {
            if let Some(fds) = kvpool::fdpass::peek_fds(fd)? {
                break fds;
            }
            if Instant::now() >= deadline {
                return Err(ClientError::Timeout);
            }
            // The reply is a local daemon's answer to a request it serves at once.
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        Ok((self.recv_simple(id).await?, fds))
    }

    /// A call whose reply carries no payload.
    pub(crate) async fn call_simple(
        &mut self,
        op: Op,
        payload: &[&[u8]],
    ) -> Result<Reply, ClientError> {
        let id = self.send(op, payload).await?;
        self.flush().await?;
        self.recv_simple(id).await
    }

    /// Receives the response to request `id`, which must carry no payload.
    async fn recv_simple(&mut self, id: u64) -> Result<Reply, ClientError> {
        let (reply, len) = self.recv(id).await?;
        if len != 0 {
            self.skip(len).await?;
            return Err(ClientError::Protocol("unexpected payload".into()));
        }
        Ok(reply)
    }

    /// The two halves of the stream, for a connection whose replies come unasked too (a
    /// watching connection: its events): one task reads every frame, others send.
    pub(crate) fn split(self) -> (ConnReader, ConnWriter) {
        (
            ConnReader {
                r: self.r,
                hdr: self.hdr,
                limits: self.limits,
            },
            ConnWriter {
                w: self.w,
                // A watching connection's requests are small: of the default class.
                exchange: self.exchange.with_class(Class::default()),
            },
        )
    }

    pub(crate) async fn read_into(&mut self, dst: &mut [u8]) -> Result<(), ClientError> {
        self.read_pieces(&mut [dst], false).await?;
        Ok(())
    }

    /// [`Conn::read_into`] that hashes the bytes (xxh3-64) as they arrive, a piece of at most
    /// [`HASH_PIECE`] bytes at a time: no second pass over memory, and the task reading this
    /// connection (and others, when it polls several reads) never stops draining sockets for
    /// longer than one piece's hash.
    pub(crate) async fn read_into_hashed(&mut self, dst: &mut [u8]) -> Result<u64, ClientError> {
        self.read_pieces(&mut [dst], true).await
    }

    /// Reads one value into `pieces`, filling them in order; with `hash`, hashes it (xxh3-64,
    /// over all the pieces as one) as it arrives, as [`Conn::read_into_hashed`] does, and
    /// returns the hash (0 without). Over TCP a large value is read with the socket's
    /// low-water mark raised ([`LowWater`]): signalled per [`HASH_PIECE`], not per segment.
    pub(crate) async fn read_pieces(
        &mut self,
        pieces: &mut [&mut [u8]],
        hash: bool,
    ) -> Result<u64, ClientError> {
        let mut h = hash.then(kvpool::checksum::Hasher::new);
        let mut left: usize = pieces.iter().map(|p| p.len()).sum();
        let mut water = LowWater::new(self.fd.filter(|_| !self.unix));
        for dst in pieces.iter_mut() {
            let mut at = 0;
            while at < dst.len() {
                let end = match h {
                    Some(_) => dst.len().min(at + HASH_PIECE),
                    None => dst.len(),
                };
                let n = water.read(&mut self.r, &mut dst[at..end], left).await?;
                if n == 0 {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                }
                if let Some(h) = h.as_mut() {
                    h.update(&dst[at..at + n]);
                }
                at += n;
                left -= n;
            }
        }
        water.finish()?;
        Ok(h.map_or(0, |h| h.digest()))
    }

    pub(crate) async fn skip(&mut self, n: u64) -> Result<(), ClientError> {
        discard(&mut self.r, n).await?;
        Ok(())
    }
}

/// The reading half of a split [`Conn`].
pub(crate) struct ConnReader {
    r: FrameReader<Reader>,
    hdr: AlignedVec,
    limits: Limits,
}

impl ConnReader {
    /// The next frame, whatever request it answers (or [`kvpool::protocol::EVENT_ID`]): its
    /// id and reply. A frame with a payload breaks the protocol of a watching connection.
    pub(crate) async fn next(&mut self) -> Result<(u64, Reply), ClientError> {
        let prefix = read_prefix(&mut self.r, &self.limits)
            .await?
            .ok_or_else(|| ClientError::Io(std::io::ErrorKind::UnexpectedEof.into()))?;
        read_header(&mut self.r, &prefix, &mut self.hdr).await?;
        let Response { id, reply } = decode_response_owned(&self.hdr)?;
        if prefix.payload_len != 0 {
            return Err(ClientError::Protocol("unexpected payload".into()));
        }
        Ok((id, reply))
    }
}

/// The sending half of a split [`Conn`].
pub(crate) struct ConnWriter {
    w: BufWriter<Writer>,
    exchange: Exchange,
}

impl ConnWriter {
    /// The id the next request will get.
    pub(crate) fn next_id(&self) -> u64 {
        self.exchange.next_id()
    }

    /// Sends one request (no payload) and flushes; returns its id.
    pub(crate) async fn send(&mut self, op: Op) -> Result<u64, ClientError> {
        let out = self.exchange.request(op);
        write_frame(&mut self.w, &out.header, &[]).await?;
        self.w.flush().await?;
        Ok(out.id)
    }
}

/// A reply read apart from its request (by a watching connection's reader): the node's answer,
/// or its refusal as the client's error.
pub(crate) fn judged(reply: Reply) -> Result<Reply, ClientError> {
    Outcome::of(reply).into_result().map_err(refused)
}

/// A node's refusal (its code and words) as the client's error.
fn refused((code, message): (ErrorCode, String)) -> ClientError {
    ClientError::Server { code, message }
}

/// The TLS 1.3 client configuration of QUIC and `tls://`: trusting `cfg.ca` (PEM) or, with
/// `cfg.insecure_skip_verify`, anything; kvpool's ALPN.
fn tls_config(cfg: &ClientConfig) -> Result<rustls::ClientConfig, ClientError> {
    let tls_err = |e: &dyn std::fmt::Display| ClientError::Tls(e.to_string());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err(&e))?;
    let mut tls = if cfg.insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_no_client_auth()
    } else {
        let mut roots = rustls::RootCertStore::empty();
        let ca = cfg.ca.as_ref().ok_or_else(|| {
            ClientError::Tls(
                "QUIC and tls:// need a CA certificate (ca) or insecure_skip_verify".into(),
            )
        })?;
        use rustls::pki_types::pem::PemObject;
        for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).map_err(|e| tls_err(&e))? {
            roots
                .add(c.map_err(|e| tls_err(&e))?)
                .map_err(|e| tls_err(&e))?;
        }
        builder.with_root_certificates(roots).with_no_client_auth()
    };
    tls.alpn_protocols = vec![b"kvpool/1".to_vec()];
    Ok(tls)
}

/// A QUIC client connection to `endpoint`, trusting `cfg.ca` (PEM) or, with
/// `cfg.insecure_skip_verify`, anything.
pub(crate) async fn quic_connect(
    endpoint: &Endpoint,
    cfg: &ClientConfig,
) -> Result<(quinn::Endpoint, quinn::Connection), ClientError> {
    let Endpoint::Quic(hp) = endpoint else {
        unreachable!("only called for QUIC endpoints")
    };
    let tls_err = |e: &dyn std::fmt::Display| ClientError::Tls(e.to_string());
    let addr = tokio::net::lookup_host(hp.as_str())
        .await?
        .next()
        .ok_or_else(|| ClientError::Endpoint(hp.clone()))?;
    let tls = tls_config(cfg)?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| tls_err(&e))?;
    let mut qcfg = quinn::ClientConfig::new(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport
        .stream_receive_window((16u32 << 20).into())
        .receive_window((64u32 << 20).into())
        .send_window(64 << 20);
    qcfg.transport_config(Arc::new(transport));
    let bind: std::net::SocketAddr = if addr.is_ipv6() {
        "[::]:0".parse().expect("valid")
    } else {
        "0.0.0.0:0".parse().expect("valid")
    };
    let mut ep = quinn::Endpoint::client(bind)?;
    ep.set_default_client_config(qcfg);
    let name = endpoint.host().unwrap_or("localhost").to_string();
    let conn = ep
        .connect(addr, &name)
        .map_err(|e| tls_err(&e))?
        .await
        .map_err(|e| tls_err(&e))?;
    Ok((ep, conn))
}

/// Accepts any server certificate (still checks the handshake signature). For tests and
/// trusted networks only: `insecure_skip_verify`.
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, self.algorithms())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, self.algorithms())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms().supported_schemes()
    }
}

impl NoVerify {
    /// The provider's signature algorithms: the handshake signature is still checked.
    fn algorithms(&self) -> &rustls::crypto::WebPkiSupportedAlgorithms {
        &self.0.signature_verification_algorithms
    }
}
