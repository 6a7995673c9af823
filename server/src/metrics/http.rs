//! `GET /metrics` (and `/health`) served over plain HTTP.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool::Pool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::series::Metrics;
use crate::admission::AcceptErrors;
use crate::config::NamespaceMetrics;
use crate::ledger::Ledger;

/// The content type of the page.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Most scrapes served at once; more wait in the listen backlog.
const MAX_SCRAPES: usize = 16;

/// Serves `GET /metrics` until `shutdown` resolves. Anything else gets 404; requests are read
/// into a small fixed buffer and connections are closed after one response. Per-namespace
/// series are shown as `namespaces` says (`Token`: to a request bearing `token`, or to all when
/// the node has none). A failed accept pauses the loop rather than spinning.
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    (pool, ledger): (Arc<Pool>, Arc<Ledger>),
    namespaces: NamespaceMetrics,
    token: String,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let scrapes = Arc::new(Semaphore::new(MAX_SCRAPES));
    let token: Arc<str> = token.into();
    let mut errors = AcceptErrors::default();
    loop {
        let permit = tokio::select! {
            p = scrapes.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
            _ = &mut shutdown => return,
        };
        let (sock, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => {
                    errors.succeeded();
                    s
                }
                Err(e) => {
                    let pause = errors.failed(&e, "metrics", Instant::now());
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => continue,
                        _ = &mut shutdown => return,
                    }
                }
            },
            _ = &mut shutdown => return,
        };
        let page = Page {
            metrics: metrics.clone(),
            pool: pool.clone(),
            ledger: ledger.clone(),
            namespaces,
            token: token.clone(),
        };
        tokio::spawn(async move {
            let _permit = permit;
            page.answer(sock).await;
        });
    }
}

/// What the metrics listener serves, shared by its connections.
struct Page {
    metrics: Arc<Metrics>,
    pool: Arc<Pool>,
    ledger: Arc<Ledger>,
    namespaces: NamespaceMetrics,
    token: Arc<str>,
}

impl Page {
    /// Reads one request head (up to 4 KiB, within 5 s), answers it and closes.
    async fn answer(&self, mut sock: tokio::net::TcpStream) {
        let mut buf = [0u8; 4096];
        let mut n = 0;
        let read = async {
            while n < buf.len() {
                let m = sock.read(&mut buf[n..]).await?;
                if m == 0 {
                    break;
                }
                n += m;
                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            std::io::Result::Ok(())
        };
        if tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .is_err()
        {
            return;
        }
        let (status, ctype, body) = self.respond(&String::from_utf8_lossy(&buf[..n]));
        let head = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        let _ = sock.write_all(head.as_bytes()).await;
        let _ = sock.write_all(body.as_bytes()).await;
        let _ = sock.shutdown().await;
    }

    /// Status, content type and body for the request head `req`.
    fn respond(&self, req: &str) -> (&'static str, &'static str, String) {
        if req.starts_with("GET /metrics ") || req.starts_with("GET /metrics?") {
            let show = match self.namespaces {
                NamespaceMetrics::Off => false,
                NamespaceMetrics::Open => true,
                NamespaceMetrics::Token => self.token.is_empty() || bears(req, &self.token),
            };
            match self.metrics.render(&self.pool, &self.ledger, show) {
                Ok(body) => ("200 OK", OPENMETRICS, body),
                Err(_) => (
                    "500 Internal Server Error",
                    "text/plain",
                    "encoding failed\n".to_string(),
                ),
            }
        } else if req.starts_with("GET /health ") {
            ("200 OK", "text/plain", "ok\n".to_string())
        } else {
            ("404 Not Found", "text/plain", "try /metrics\n".to_string())
        }
    }
}

/// Whether the request head carries `Authorization: Bearer <token>`.
fn bears(head: &str, token: &str) -> bool {
    head.lines().skip(1).any(|line| {
        let Some((name, value)) = line.split_once(':') else {
            return false;
        };
        let mut v = value.trim().splitn(2, ' ');
        name.trim().eq_ignore_ascii_case("authorization")
            && v.next().is_some_and(|s| s.eq_ignore_ascii_case("bearer"))
            && v.next().map(str::trim).is_some_and(|t| {
                kvpool::protocol::auth::token_matches(t.as_bytes(), token.as_bytes())
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_answers_metrics_health_and_nothing_else() {
        let cfg = kvpool::PoolConfig {
            segment_size: 4 << 20,
            backing: kvpool::segment::Backing::Anonymous,
            huge_pages: kvpool::segment::HugePages::Off,
            ..kvpool::PoolConfig::default()
        };
        let page = Page {
            metrics: Arc::default(),
            pool: Arc::new(Pool::new(&cfg, [1; 16]).unwrap()),
            ledger: Ledger::new(&crate::ledger::Bounds::none(), &[1 << 20]),
            namespaces: NamespaceMetrics::Token,
            token: "s3cret".into(),
        };
        let (status, ctype, body) = page.respond("GET /metrics HTTP/1.1\r\n\r\n");
        assert_eq!((status, ctype), ("200 OK", OPENMETRICS));
        assert!(body.contains("kvpool_objects") && body.ends_with("# EOF\n"));
        assert!(!body.contains("kvpool_namespace_objects"), "no token");
        let (_, _, body) =
            page.respond("GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n");
        assert!(body.contains("kvpool_namespace_objects"));
        let health = page.respond("GET /health HTTP/1.1\r\n\r\n");
        assert_eq!(health, ("200 OK", "text/plain", "ok\n".to_string()));
        assert_eq!(
            page.respond("GET /other HTTP/1.1\r\n\r\n").0,
            "404 Not Found"
        );
    }

    #[test]
    fn only_the_exact_bearer_token_is_accepted() {
        let get = |h: &str| format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{h}\r\n\r\n");
        assert!(bears(&get("Authorization: Bearer s3cret"), "s3cret"));
        assert!(bears(&get("authorization:bearer  s3cret "), "s3cret"));
        assert!(!bears(&get("Authorization: Bearer s3cre"), "s3cret"));
        assert!(!bears(&get("Authorization: Basic s3cret"), "s3cret"));
        assert!(!bears(&get("X-Token: s3cret"), "s3cret"));
        assert!(!bears(
            "GET /metrics?Authorization: Bearer s3cret HTTP/1.1\r\n\r\n",
            "s3cret"
        ));
    }
}
