//! A minimal HTTP/1.1 client for etcd's JSON gateway: one `POST` per connection
//! (`Connection: close`), over TCP or TLS (`https://`, rustls: the server's certificate is
//! verified against the configured CA and its name or IP address, and a client certificate is
//! presented when one is configured), responses framed by `Content-Length`, chunked, or to the
//! end of the stream. Every read is bounded: header lines, the header block, chunk-size lines and each body
//! (or each line of a streamed body) are capped, so a peer can't make us allocate without limit.
//! Timeouts are the caller's (every call site wraps these futures in one).

use std::io;
use std::sync::Arc;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// What can go wrong talking HTTP.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// The URL is not `http://host:port` or `https://host:port`.
    #[error("bad URL {0:?}: expected http://host:port or https://host:port")]
    BadUrl(String),
    /// An `https://` URL with no TLS client configuration to verify it by.
    #[error("{0}: https needs a TLS configuration (a CA to verify the server by)")]
    NoTls(String),
    /// Connecting, reading or writing failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The response broke HTTP/1.1 framing.
    #[error("malformed response: {0}")]
    Malformed(&'static str),
    /// A header, chunk or body exceeded its limit.
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
    /// A status other than 200.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status code.
        status: u16,
        /// The start of the body.
        body: String,
    },
}

/// Largest header line (and chunk-size line).
const MAX_LINE: usize = 8 << 10;
/// Most header lines.
const MAX_HEADERS: usize = 64;
/// How much one read asks for.
const READ: usize = 16 << 10;

/// An `http://host:port` or `https://host:port` endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Url {
    /// `host:port`.
    pub(crate) authority: String,
    /// `https://`: TLS, the server verified by the name or address in `authority`.
    pub(crate) tls: bool,
}

impl Url {
    /// Parses `http://host:port` or `https://host:port` (a trailing `/` is allowed; no path).
    pub(crate) fn parse(s: &str) -> Result<Url, HttpError> {
        let bad = || HttpError::BadUrl(s.to_string());
        let (rest, tls) = match (s.strip_prefix("http://"), s.strip_prefix("https://")) {
            (Some(r), _) => (r, false),
            (_, Some(r)) => (r, true),
            _ => return Err(bad()),
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(bad());
        }
        let url = Url {
            authority: authority.to_string(),
            tls,
        };
        if tls {
            url.server_name().map_err(|_| bad())?;
        }
        Ok(url)
    }

    /// The host as TLS verifies it: a DNS name, or an IP address (`[v6]` without brackets).
    fn server_name(&self) -> Result<ServerName<'static>, HttpError> {
        let host = self
            .authority
            .rsplit_once(':')
            .map_or(self.authority.as_str(), |(h, _)| h);
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        ServerName::try_from(host.to_string()).map_err(|_| HttpError::BadUrl(self.to_string()))
    }
}

impl std::fmt::Display for Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}", self.authority)
    }
}

/// A connection to the server: TCP, or TLS over TCP.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Connects to `url`: over TLS with `tls` for `https://` (an error without it).
async fn connect(
    url: &Url,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Box<dyn Stream>, HttpError> {
    let s = TcpStream::connect(&url.authority).await?;
    s.set_nodelay(true)?;
    if !url.tls {
        return Ok(Box::new(s));
    }
    let tls = tls.ok_or_else(|| HttpError::NoTls(url.to_string()))?;
    let s = tokio_rustls::TlsConnector::from(tls.clone())
        .connect(url.server_name()?, s)
        .await?;
    Ok(Box::new(s))
}

/// Sends `POST path` with a JSON body (and `authorization`, when given, as the
/// `Authorization` header) and reads the status and headers; the body is read from the
/// returned [`Body`], at most `max` bytes at a time (the whole body, or one line of a streamed
/// one). `tls` is the client configuration for `https://` URLs.
pub(crate) async fn post(
    url: &Url,
    tls: Option<&Arc<rustls::ClientConfig>>,
    path: &str,
    json: &[u8],
    authorization: Option<&str>,
    max: usize,
) -> Result<Body, HttpError> {
    let auth = match authorization {
        // A value with a line break would smuggle headers (the token comes from the server).
        Some(a) if a.bytes().any(|b| b == b'\r' || b == b'\n') => {
            return Err(HttpError::Malformed(
                "line break in the authorization value",
            ))
        }
        Some(a) => format!("Authorization: {a}\r\n"),
        None => String::new(),
    };
    let mut s = connect(url, tls).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{auth}Connection: close\r\n\r\n",
        url.authority,
        json.len()
    );
    let sent = async {
        s.write_all(head.as_bytes()).await?;
        s.write_all(json).await?;
        s.flush().await
    };
    if let Err(e) = sent.await {
        // A TLS 1.3 server that refuses the client (no certificate, or one it does not
        // trust) does so after the client's side of the handshake, in an alert: a read
        // surfaces it, where the write only saw the socket close.
        let mut probe = [0u8; 1];
        return Err(match s.read(&mut probe).await {
            Err(alert) if alert.kind() == io::ErrorKind::InvalidData => alert.into(),
            _ => e.into(),
        });
    }
    let mut r = BufReader::new(s);
    let status_line = read_line(&mut r, MAX_LINE).await?;
    let status = parse_status(&status_line)?;
    let mut framing = Framing::ToEnd;
    for _ in 0..=MAX_HEADERS {
        let line = read_line(&mut r, MAX_LINE).await?;
        let line = trim_crlf(&line);
        if line.is_empty() {
            let mut body = Body {
                r,
                framing,
                buf: Vec::new(),
                max,
            };
            if status != 200 {
                let text = body.read_all().await.unwrap_or_default();
                let text = String::from_utf8_lossy(&text[..text.len().min(512)]).into_owned();
                return Err(HttpError::Status { status, body: text });
            }
            return Ok(body);
        }
        let Some((name, value)) = std::str::from_utf8(line)
            .ok()
            .and_then(|l| l.split_once(':'))
        else {
            return Err(HttpError::Malformed("header line"));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let n = value
                .parse()
                .map_err(|_| HttpError::Malformed("content-length"))?;
            framing = Framing::Length(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            && value.eq_ignore_ascii_case("chunked")
        {
            framing = Framing::Chunked { left: 0 };
        }
    }
    Err(HttpError::Malformed("too many headers"))
}

/// How the body ends.
#[derive(Debug)]
enum Framing {
    /// This many bytes are left.
    Length(u64),
    /// Chunked; `left` bytes remain in the current chunk (0: a size line comes next).
    Chunked { left: u64 },
    /// Until the peer closes.
    ToEnd,
    /// Read completely.
    Done,
}

/// A response body being read.
pub(crate) struct Body {
    r: BufReader<Box<dyn Stream>>,
    framing: Framing,
    /// Decoded bytes not yet handed out.
    buf: Vec<u8>,
    max: usize,
}

impl Body {
    /// The whole body (at most `max` bytes).
    pub(crate) async fn read_all(&mut self) -> Result<Vec<u8>, HttpError> {
        while self.fill().await? {
            if self.buf.len() > self.max {
                return Err(HttpError::TooLarge(self.max));
            }
        }
        Ok(std::mem::take(&mut self.buf))
    }

    /// The next newline-terminated message of a streamed body (without the newline), at most
    /// `max` bytes; the remainder at the end of the body; None once the body is over.
    pub(crate) async fn next_line(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=i).collect();
                line.pop();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(line));
            }
            if self.buf.len() > self.max {
                return Err(HttpError::TooLarge(self.max));
            }
            if !self.fill().await? {
                if self.buf.iter().all(u8::is_ascii_whitespace) {
                    return Ok(None);
                }
                return Ok(Some(std::mem::take(&mut self.buf)));
            }
        }
    }

    /// Appends more decoded bytes to `buf`. False once the body is over.
    async fn fill(&mut self) -> Result<bool, HttpError> {
        loop {
            match self.framing {
                Framing::Done => return Ok(false),
                Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Ok(false);
                }
                Framing::Length(n) => {
                    let got = self.read_some(n).await?;
                    if got == 0 {
                        return Err(HttpError::Malformed("body shorter than content-length"));
                    }
                    self.framing = Framing::Length(n - got as u64);
                    return Ok(true);
                }
                Framing::ToEnd => {
                    if self.read_some(READ as u64).await? == 0 {
                        self.framing = Framing::Done;
                        return Ok(false);
                    }
                    return Ok(true);
                }
                Framing::Chunked { left: 0 } => {
                    let line = read_line(&mut self.r, MAX_LINE).await?;
                    let size = std::str::from_utf8(trim_crlf(&line))
                        .ok()
                        .map(|l| l.split(';').next().unwrap_or("").trim())
                        .and_then(|h| u64::from_str_radix(h, 16).ok())
                        .ok_or(HttpError::Malformed("chunk size"))?;
                    if size == 0 {
                        // Trailers, up to the empty line.
                        for _ in 0..=MAX_HEADERS {
                            if trim_crlf(&read_line(&mut self.r, MAX_LINE).await?).is_empty() {
                                self.framing = Framing::Done;
                                return Ok(false);
                            }
                        }
                        return Err(HttpError::Malformed("too many trailers"));
                    }
                    self.framing = Framing::Chunked { left: size };
                }
                Framing::Chunked { left } => {
                    let got = self.read_some(left).await?;
                    if got == 0 {
                        return Err(HttpError::Malformed("stream ended inside a chunk"));
                    }
                    let left = left - got as u64;
                    if left == 0 {
                        let crlf = read_line(&mut self.r, MAX_LINE).await?;
                        if !trim_crlf(&crlf).is_empty() {
                            return Err(HttpError::Malformed("chunk not followed by CRLF"));
                        }
                    }
                    self.framing = Framing::Chunked { left };
                    return Ok(true);
                }
            }
        }
    }

    /// Reads at most `n` (and at most [`READ`]) bytes into `buf`; 0 at the end of the stream.
    async fn read_some(&mut self, n: u64) -> Result<usize, HttpError> {
        let want = n.min(READ as u64) as usize;
        let at = self.buf.len();
        self.buf.resize(at + want, 0);
        let got = self.r.read(&mut self.buf[at..]).await;
        self.buf.truncate(at + *got.as_ref().unwrap_or(&0));
        Ok(got?)
    }
}

/// One line including its `\n`, at most `max` bytes; an error at the end of the stream.
async fn read_line(r: &mut BufReader<Box<dyn Stream>>, max: usize) -> Result<Vec<u8>, HttpError> {
    let mut line = Vec::new();
    loop {
        let avail = r.fill_buf().await?;
        if avail.is_empty() {
            return Err(HttpError::Io(io::ErrorKind::UnexpectedEof.into()));
        }
        let (take, end) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        if line.len() + take > max {
            return Err(HttpError::TooLarge(max));
        }
        line.extend_from_slice(&avail[..take]);
        r.consume(take);
        if end {
            return Ok(line);
        }
    }
}

fn trim_crlf(l: &[u8]) -> &[u8] {
    let l = l.strip_suffix(b"\n").unwrap_or(l);
    l.strip_suffix(b"\r").unwrap_or(l)
}

fn parse_status(line: &[u8]) -> Result<u16, HttpError> {
    let line = std::str::from_utf8(trim_crlf(line)).map_err(|_| HttpError::Malformed("status"))?;
    let mut parts = line.split(' ');
    match (parts.next(), parts.next().map(str::parse)) {
        (Some(v), Some(Ok(code))) if v.starts_with("HTTP/1.") => Ok(code),
        _ => Err(HttpError::Malformed("status line")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::net::TcpListener;

    /// Serves one connection with `reply` (after reading the request head) and returns its URL.
    async fn serve_once(reply: &'static [u8]) -> Url {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url {
            authority: l.local_addr().unwrap().to_string(),
            tls: false,
        };
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            s.write_all(reply).await.unwrap();
        });
        url
    }

    #[test]
    fn urls_parse() {
        assert_eq!(
            Url::parse("http://127.0.0.1:2379/").unwrap().authority,
            "127.0.0.1:2379"
        );
        let tls = Url::parse("https://etcd-0.example:2379").unwrap();
        assert!(tls.tls && tls.authority == "etcd-0.example:2379");
        assert_eq!(tls.to_string(), "https://etcd-0.example:2379");
        assert!(matches!(
            Url::parse("https://[::1]:2379").unwrap().server_name(),
            Ok(ServerName::IpAddress(_))
        ));
        assert!(Url::parse("https://bad_name!:1").is_err());
        assert!(Url::parse("ftp://h:1").is_err());
        assert!(Url::parse("http://h").is_err());
        assert!(Url::parse("http://h:1/v3").is_err());
    }

    #[tokio::test]
    async fn content_length_and_chunked_bodies_decode() {
        let url = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").await;
        let mut b = post(&url, None, "/", b"{}", None, 100).await.unwrap();
        assert_eq!(b.read_all().await.unwrap(), b"hello");

        let url = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;x=y\r\n{\"a\"\r\n6\r\n:1}\n{\"\r\n\
              5\r\nb\":2}\r\n0\r\n\r\n",
        )
        .await;
        let mut b = post(&url, None, "/", b"{}", None, 100).await.unwrap();
        assert_eq!(b.next_line().await.unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(b.next_line().await.unwrap().unwrap(), b"{\"b\":2}");
        assert!(b.next_line().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn the_authorization_header_is_sent_and_cannot_carry_a_line_break() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url {
            authority: l.local_addr().unwrap().to_string(),
            tls: false,
        };
        let head = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                .await
                .unwrap();
            String::from_utf8_lossy(&buf[..n]).into_owned()
        });
        let mut b = post(&url, None, "/v3/kv/put", b"{}", Some("tok.en"), 100)
            .await
            .unwrap();
        assert_eq!(b.read_all().await.unwrap(), b"");
        let head = head.await.unwrap();
        assert!(head.contains("\r\nAuthorization: tok.en\r\n"), "{head}");

        let smuggled = post(&url, None, "/", b"{}", Some("t\r\nX-Evil: 1"), 100).await;
        assert!(matches!(smuggled, Err(HttpError::Malformed(_))));
    }

    #[tokio::test]
    async fn oversized_and_failed_responses_are_errors() {
        let url = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n0123456789").await;
        let mut b = post(&url, None, "/", b"{}", None, 4).await.unwrap();
        assert!(matches!(b.read_all().await, Err(HttpError::TooLarge(4))));

        let url = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n").await;
        let mut b = post(&url, None, "/", b"{}", None, 16).await.unwrap();
        assert!(b.next_line().await.is_err(), "an endless line is cut off");

        let url = serve_once(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nnope").await;
        match post(&url, None, "/", b"{}", None, 100).await {
            Err(HttpError::Status { status: 404, body }) => assert_eq!(body, "nop"),
            other => panic!("{:?}", other.map(|_| ())),
        }
    }

    /// A certificate authority, which signs certificates for names with one usage.
    struct Pki {
        ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    }

    impl Pki {
        fn new(name: &str) -> Pki {
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name);
            let key = rcgen::KeyPair::generate().unwrap();
            Pki {
                ca: rcgen::CertifiedIssuer::self_signed(params, key).unwrap(),
            }
        }

        fn leaf(
            &self,
            names: &[&str],
            usage: rcgen::ExtendedKeyUsagePurpose,
        ) -> (rcgen::Certificate, rcgen::KeyPair) {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            let mut params = rcgen::CertificateParams::new(names).unwrap();
            params.extended_key_usages = vec![usage];
            let key = rcgen::KeyPair::generate().unwrap();
            (params.signed_by(&key, &self.ca).unwrap(), key)
        }
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// An HTTPS server on loopback with a certificate of `pki` for 127.0.0.1 that answers
    /// every connection `200 ok` (when `client_ca` is set, only clients with a certificate it
    /// signed get that far); its URL.
    async fn serve_tls(pki: &Pki, client_ca: Option<&Pki>) -> Url {
        use rcgen::ExtendedKeyUsagePurpose::ServerAuth;
        let (cert, key) = pki.leaf(&["127.0.0.1"], ServerAuth);
        let (cert, key) = (
            cert.der().clone(),
            rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
        );
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                roots.add(ca.ca.der().clone()).unwrap();
                let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .build()
                .unwrap();
                builder.with_client_cert_verifier(v)
            }
            None => builder.with_no_client_auth(),
        };
        let cfg = builder.with_single_cert(vec![cert], key).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url::parse(&format!("https://{}", l.local_addr().unwrap())).unwrap();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut s) = acceptor.accept(s).await else {
                        return;
                    };
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .await;
                    let _ = s.shutdown().await;
                });
            }
        });
        url
    }

    /// Writes the PEM files `tls::https_client_config` reads: `pki`'s CA, and a client
    /// certificate with its key when `client` is given.
    fn client_config(
        dir: &std::path::Path,
        pki: &Pki,
        client: Option<&Pki>,
    ) -> Arc<rustls::ClientConfig> {
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, pki.ca.pem()).unwrap();
        let pair = client.map(|c| {
            let (cert, key) = c.leaf(&["kvpool-node"], rcgen::ExtendedKeyUsagePurpose::ClientAuth);
            let (cp, kp) = (dir.join("client.pem"), dir.join("client-key.pem"));
            std::fs::write(&cp, cert.pem()).unwrap();
            std::fs::write(&kp, key.serialize_pem()).unwrap();
            (cp, kp)
        });
        let client = pair.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
        Arc::new(crate::tls::https_client_config(&ca, client).unwrap())
    }

    /// Over `https://`, the server's certificate is verified by the configured CA (another
    /// CA's certificate is refused, and no configuration at all is an error, never a silent
    /// plain connection), and a client certificate is presented when the server asks.
    #[tokio::test]
    async fn https_verifies_the_server_and_presents_a_client_certificate() {
        let dir = kvpool_system_tests::temp_dir("http-tls");
        let (etcd_ca, other_ca) = (Pki::new("etcd CA"), Pki::new("another CA"));
        let url = serve_tls(&etcd_ca, None).await;
        let good = client_config(&dir, &etcd_ca, None);
        let mut b = post(&url, Some(&good), "/", b"{}", None, 100)
            .await
            .unwrap();
        assert_eq!(b.read_all().await.unwrap(), b"ok");

        let wrong = client_config(&dir, &other_ca, None);
        let e = post(&url, Some(&wrong), "/", b"{}", None, 100).await.err();
        assert!(
            matches!(&e, Some(HttpError::Io(e)) if e.to_string().contains("certificate")),
            "{e:?}"
        );
        let e = post(&url, None, "/", b"{}", None, 100).await.err();
        assert!(matches!(e, Some(HttpError::NoTls(_))), "{e:?}");
        let mut by_name = url.clone();
        by_name.authority = by_name.authority.replace("127.0.0.1", "localhost");
        let e = post(&by_name, Some(&good), "/", b"{}", None, 100)
            .await
            .err();
        assert!(
            e.is_some(),
            "a certificate for 127.0.0.1 does not name localhost"
        );

        let mutual = serve_tls(&etcd_ca, Some(&etcd_ca)).await;
        let with_cert = client_config(&dir, &etcd_ca, Some(&etcd_ca));
        let mut b = post(&mutual, Some(&with_cert), "/", b"{}", None, 100)
            .await
            .unwrap();
        assert_eq!(b.read_all().await.unwrap(), b"ok");
        let refused = async {
            let mut b = post(&mutual, Some(&good), "/", b"{}", None, 100).await?;
            b.read_all().await
        };
        assert!(refused.await.is_err(), "no client certificate, no answer");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
