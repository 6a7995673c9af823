//! The HTTP client for etcd's JSON gateway: one `POST` per connection (`Connection: close`)
//! over TCP or TLS (`https://`, rustls: the server's certificate is verified against the
//! configured CA and its name or IP address, and a client certificate is presented when one is
//! configured). hyper speaks HTTP/1.1 (framing, chunked bodies, bounded header reads); this
//! module bounds each body (or each line of a streamed body) at the caller's `max`, so a peer
//! can't make us allocate without limit. Timeouts are the caller's (every call site wraps
//! these futures in one).

use std::io;
use std::sync::Arc;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, AUTHORIZATION, CONNECTION, CONTENT_TYPE, HOST};
use hyper::Request;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// What can go wrong talking HTTP.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// The URL is not `http://host:port` or `https://host:port`.
    #[error("bad URL {0:?}: expected http://host:port or https://host:port")]
    BadUrl(String),
    /// An `https://` URL with no TLS client configuration to verify it by.
    #[error("{0}: https needs a TLS configuration (a CA to verify the server by)")]
    NoTls(String),
    /// Connecting, or the TLS handshake, failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The exchange failed after connecting: the peer broke HTTP/1.1 or the connection.
    #[error("http: {0}")]
    Http(String),
    /// The request could not be made as asked.
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    /// A body, or a line of a streamed body, exceeded its limit.
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

impl From<hyper::Error> for HttpError {
    /// hyper's error with its causes: the cause (a TLS alert, a reset) is what an operator
    /// needs to read.
    fn from(e: hyper::Error) -> HttpError {
        let mut text = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            text.push_str(": ");
            text.push_str(&c.to_string());
            cause = c.source();
        }
        HttpError::Http(text)
    }
}

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
    let mut req = Request::post(path)
        .header(HOST, url.authority.as_str())
        .header(CONTENT_TYPE, "application/json")
        .header(CONNECTION, "close");
    if let Some(a) = authorization {
        // A value with a line break would smuggle headers (the token comes from the server).
        let a = HeaderValue::from_str(a)
            .map_err(|_| HttpError::Malformed("line break in the authorization value"))?;
        req = req.header(AUTHORIZATION, a);
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(json)))
        .map_err(|_| HttpError::Malformed("path or host"))?;
    let s = connect(url, tls).await?;
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .title_case_headers(true)
        .handshake(TokioIo::new(s))
        .await?;
    let conn = AbortOnDrop(tokio::spawn(async move {
        let _ = conn.await;
    }));
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let mut body = Body {
        incoming: resp.into_body(),
        _conn: conn,
        buf: Vec::new(),
        done: false,
        max,
    };
    if status != 200 {
        let text = body.read_all().await.unwrap_or_default();
        let text = String::from_utf8_lossy(&text[..text.len().min(512)]).into_owned();
        return Err(HttpError::Status { status, body: text });
    }
    Ok(body)
}

/// Ends the connection's task when the body (or the request, cut off by a timeout) is dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A response body being read.
pub(crate) struct Body {
    incoming: Incoming,
    /// The task driving the connection, for as long as the body is read.
    _conn: AbortOnDrop,
    /// Received bytes not yet handed out.
    buf: Vec<u8>,
    /// The body is over.
    done: bool,
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

    /// Appends the next data hyper decoded to `buf`. False once the body is over.
    async fn fill(&mut self) -> Result<bool, HttpError> {
        while !self.done {
            match self.incoming.frame().await {
                None => self.done = true,
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buf.extend_from_slice(&data);
                        return Ok(true);
                    }
                }
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
