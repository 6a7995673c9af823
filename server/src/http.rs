//! A minimal HTTP/1.1 client for etcd's JSON gateway: one `POST` per connection
//! (`Connection: close`), responses framed by `Content-Length`, chunked, or to the end of the
//! stream. Every read is bounded: header lines, the header block, chunk-size lines and each body
//! (or each line of a streamed body) are capped, so a peer can't make us allocate without limit.
//! Timeouts are the caller's (every call site wraps these futures in one).

use std::io;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// What can go wrong talking HTTP.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// The URL is not `http://host:port`.
    #[error("bad URL {0:?}: expected http://host:port")]
    BadUrl(String),
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

/// An `http://host:port` endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Url {
    /// `host:port`.
    pub(crate) authority: String,
}

impl Url {
    /// Parses `http://host:port` (a trailing `/` is allowed; no path, no TLS).
    pub(crate) fn parse(s: &str) -> Result<Url, HttpError> {
        let bad = || HttpError::BadUrl(s.to_string());
        let rest = s.strip_prefix("http://").ok_or_else(bad)?;
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(bad());
        }
        Ok(Url {
            authority: authority.to_string(),
        })
    }
}

/// Sends `POST path` with a JSON body (and `authorization`, when given, as the
/// `Authorization` header) and reads the status and headers; the body is read from the
/// returned [`Body`], at most `max` bytes at a time (the whole body, or one line of a streamed
/// one).
pub(crate) async fn post(
    url: &Url,
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
    let mut s = TcpStream::connect(&url.authority).await?;
    s.set_nodelay(true)?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{auth}Connection: close\r\n\r\n",
        url.authority,
        json.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(json).await?;
    s.flush().await?;
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
    r: BufReader<TcpStream>,
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
async fn read_line(r: &mut BufReader<TcpStream>, max: usize) -> Result<Vec<u8>, HttpError> {
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
        assert!(Url::parse("https://h:1").is_err());
        assert!(Url::parse("http://h").is_err());
        assert!(Url::parse("http://h:1/v3").is_err());
    }

    #[tokio::test]
    async fn content_length_and_chunked_bodies_decode() {
        let url = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").await;
        let mut b = post(&url, "/", b"{}", None, 100).await.unwrap();
        assert_eq!(b.read_all().await.unwrap(), b"hello");

        let url = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;x=y\r\n{\"a\"\r\n6\r\n:1}\n{\"\r\n\
              5\r\nb\":2}\r\n0\r\n\r\n",
        )
        .await;
        let mut b = post(&url, "/", b"{}", None, 100).await.unwrap();
        assert_eq!(b.next_line().await.unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(b.next_line().await.unwrap().unwrap(), b"{\"b\":2}");
        assert!(b.next_line().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn the_authorization_header_is_sent_and_cannot_carry_a_line_break() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url {
            authority: l.local_addr().unwrap().to_string(),
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
        let mut b = post(&url, "/v3/kv/put", b"{}", Some("tok.en"), 100)
            .await
            .unwrap();
        assert_eq!(b.read_all().await.unwrap(), b"");
        let head = head.await.unwrap();
        assert!(head.contains("\r\nAuthorization: tok.en\r\n"), "{head}");

        let smuggled = post(&url, "/", b"{}", Some("t\r\nX-Evil: 1"), 100).await;
        assert!(matches!(smuggled, Err(HttpError::Malformed(_))));
    }

    #[tokio::test]
    async fn oversized_and_failed_responses_are_errors() {
        let url = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n0123456789").await;
        let mut b = post(&url, "/", b"{}", None, 4).await.unwrap();
        assert!(matches!(b.read_all().await, Err(HttpError::TooLarge(4))));

        let url = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n").await;
        let mut b = post(&url, "/", b"{}", None, 16).await.unwrap();
        assert!(b.next_line().await.is_err(), "an endless line is cut off");

        let url = serve_once(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nnope").await;
        match post(&url, "/", b"{}", None, 100).await {
            Err(HttpError::Status { status: 404, body }) => assert_eq!(body, "nop"),
            other => panic!("{:?}", other.map(|_| ())),
        }
    }
}
