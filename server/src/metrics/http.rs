//! The metrics listener (`listen.metrics`): `GET /metrics` answers the page that
//! [`Metrics::render`](super::series::Metrics) encodes, `GET /health` answers `ok` while the
//! process serves HTTP (a liveness probe), `GET /ready` answers 200 only while this node is
//! `serving` and 503 with its state otherwise (a readiness probe: a joining, draining or
//! departed node is taken out of its load balancer), anything else 404. HTTP/1.1 served by hyper, one request per connection, the request head read within
//! 5 s into a bounded buffer, at most [`MAX_SCRAPES`] connections at once.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use kvpool::placement::NodeState;
use kvpool::Pool;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::series::Metrics;
use crate::admission::AcceptErrors;
use crate::cluster::Cluster;
use crate::config::NamespaceMetrics;
use crate::disk_tier::DiskTier;
use crate::ledger::Ledger;

/// The content type of the page.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Most scrapes served at once; more wait in the listen backlog.
const MAX_SCRAPES: usize = 16;

/// How long a client has to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// The read buffer of a connection, and so the largest request head (hyper's smallest).
const MAX_HEAD: usize = 8 << 10;

/// Serves `GET /metrics`, `/health` and `/ready` (by `cluster`'s state of this node) until
/// `shutdown` resolves. Anything else gets 404; connections are closed after one response. Per-namespace series are shown as `namespaces` says (`Token`: to
/// a request bearing `token`, or to all when the node has none). A failed accept pauses the
/// loop rather than spinning.
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    (pool, ledger, disk, cluster): Observed,
    namespaces: NamespaceMetrics,
    token: String,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let scrapes = Arc::new(Semaphore::new(MAX_SCRAPES));
    let page = Arc::new(Page {
        metrics,
        pool,
        ledger,
        disk,
        cluster,
        namespaces,
        token: token.into(),
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.keep_alive(false)
        .title_case_headers(true)
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD);
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
        let page = page.clone();
        let conn = http.serve_connection(
            TokioIo::new(sock),
            hyper::service::service_fn(move |req| {
                let page = page.clone();
                async move { Ok::<_, Infallible>(page.respond(&req)) }
            }),
        );
        tokio::spawn(async move {
            let _permit = permit;
            let _ = conn.await;
        });
    }
}

/// What the listener reports on: the pool, its ledger, the disk tier when it is on, and this
/// node's place in the cluster.
pub(crate) type Observed = (Arc<Pool>, Arc<Ledger>, Option<Arc<DiskTier>>, Arc<Cluster>);

/// What the metrics listener serves, shared by its connections.
struct Page {
    metrics: Arc<Metrics>,
    pool: Arc<Pool>,
    ledger: Arc<Ledger>,
    /// The disk tier, when it is on.
    disk: Option<Arc<DiskTier>>,
    /// This node's membership, whose own state `/ready` reports.
    cluster: Arc<Cluster>,
    namespaces: NamespaceMetrics,
    token: Arc<str>,
}

impl Page {
    /// The response to `req`.
    fn respond<B>(&self, req: &Request<B>) -> Response<Full<Bytes>> {
        let (status, ctype, body) = match (req.method(), req.uri().path()) {
            (&Method::GET, "/metrics") => {
                let show = match self.namespaces {
                    NamespaceMetrics::Off => false,
                    NamespaceMetrics::Open => true,
                    NamespaceMetrics::Token => {
                        self.token.is_empty() || bears(req.headers(), &self.token)
                    }
                };
                match self
                    .metrics
                    .render(&self.pool, &self.ledger, self.disk.as_deref(), show)
                {
                    Ok(body) => (StatusCode::OK, OPENMETRICS, body),
                    Err(_) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        "encoding failed\n".to_string(),
                    ),
                }
            }
            (&Method::GET, "/health") => (StatusCode::OK, "text/plain", "ok\n".to_string()),
            (&Method::GET, "/ready") => {
                let state = self.cluster.my_state();
                (
                    readiness(state),
                    "text/plain",
                    format!("{}\n", state.name()),
                )
            }
            _ => (
                StatusCode::NOT_FOUND,
                "text/plain",
                "try /metrics\n".to_string(),
            ),
        };
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(ctype));
        r
    }
}

/// The status `/ready` answers for this node's state: 200 only while it is `serving` (a node
/// alone serves from its start; one in a cluster once it has joined), 503 while it is joining,
/// draining, restarting or down.
fn readiness(state: NodeState) -> StatusCode {
    match state {
        NodeState::Serving => StatusCode::OK,
        NodeState::Joining | NodeState::Draining | NodeState::Down | NodeState::Restarting => {
            StatusCode::SERVICE_UNAVAILABLE
        }
    }
}

/// Whether the request carries `Authorization: Bearer <token>`.
fn bears(headers: &HeaderMap, token: &str) -> bool {
    headers.get_all(AUTHORIZATION).iter().any(|value| {
        let Ok(value) = value.to_str() else {
            return false;
        };
        let mut v = value.trim().splitn(2, ' ');
        v.next().is_some_and(|s| s.eq_ignore_ascii_case("bearer"))
            && v.next().map(str::trim).is_some_and(|t| {
                kvpool::protocol::auth::token_matches(t.as_bytes(), token.as_bytes())
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use http_body_util::BodyExt;

    fn get(uri: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut r = Request::get(uri);
        for (name, value) in headers {
            r = r.header(*name, *value);
        }
        r.body(()).unwrap()
    }

    /// Status, content type and body of `page`'s answer to `req`.
    fn answer(page: &Page, req: &Request<()>) -> (StatusCode, String, String) {
        let r = page.respond(req);
        let ctype = r.headers()[CONTENT_TYPE].to_str().unwrap().to_string();
        let status = r.status();
        let body = text(r.into_body());
        (status, ctype, body)
    }

    fn text(b: Full<Bytes>) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let bytes = rt.block_on(b.collect()).unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    /// A page over a small pool, for a node whose own record is in `state`.
    fn page(state: NodeState) -> Page {
        let cfg = kvpool::PoolConfig {
            segment_size: 4 << 20,
            backing: kvpool::segment::Backing::Anonymous,
            huge_pages: kvpool::segment::HugePages::Off,
            ..kvpool::PoolConfig::default()
        };
        let mut me = kvpool::placement::NodeInfo::serving(3, 4 << 20);
        me.state = state;
        Page {
            metrics: Arc::default(),
            pool: Arc::new(Pool::new(&cfg, [1; 16]).unwrap()),
            ledger: Ledger::new(&crate::ledger::Bounds::none(), &[1 << 20]),
            disk: None,
            cluster: Arc::new(Cluster::new(me, crate::cluster::Source::Gossip)),
            namespaces: NamespaceMetrics::Token,
            token: "s3cret".into(),
        }
    }

    #[test]
    fn the_page_answers_metrics_health_ready_and_nothing_else() {
        let page = page(NodeState::Serving);
        let (status, ctype, body) = answer(&page, &get("/metrics", &[]));
        assert_eq!((status, ctype.as_str()), (StatusCode::OK, OPENMETRICS));
        assert!(body.contains("kvpool_objects") && body.ends_with("# EOF\n"));
        assert!(!body.contains("kvpool_namespace_objects"), "no token");
        let (_, _, body) = answer(
            &page,
            &get("/metrics?x=1", &[("Authorization", "Bearer s3cret")]),
        );
        assert!(body.contains("kvpool_namespace_objects"));
        let health = answer(&page, &get("/health", &[]));
        assert_eq!(
            health,
            (StatusCode::OK, "text/plain".to_string(), "ok\n".to_string())
        );
        let ready = answer(&page, &get("/ready", &[]));
        assert_eq!(
            ready,
            (
                StatusCode::OK,
                "text/plain".to_string(),
                "serving\n".to_string()
            )
        );
        assert_eq!(answer(&page, &get("/other", &[])).0, StatusCode::NOT_FOUND);
        let head = Request::head("/metrics").body(()).unwrap();
        assert_eq!(answer(&page, &head).0, StatusCode::NOT_FOUND);
    }

    #[test]
    fn ready_follows_the_nodes_own_state() {
        for (state, status) in [
            (NodeState::Joining, StatusCode::SERVICE_UNAVAILABLE),
            (NodeState::Serving, StatusCode::OK),
            (NodeState::Draining, StatusCode::SERVICE_UNAVAILABLE),
            (NodeState::Down, StatusCode::SERVICE_UNAVAILABLE),
            (NodeState::Restarting, StatusCode::SERVICE_UNAVAILABLE),
        ] {
            let page = page(state);
            let (got, _, body) = answer(&page, &get("/ready", &[]));
            assert_eq!((got, body), (status, format!("{}\n", state.name())));
            // Liveness does not depend on the state: a draining node is alive.
            assert_eq!(answer(&page, &get("/health", &[])).0, StatusCode::OK);
        }
        // The state as it changes, read at each request.
        let page = page(NodeState::Serving);
        page.cluster.set_state(NodeState::Draining);
        let (got, _, body) = answer(&page, &get("/ready", &[]));
        assert_eq!(
            (got, body.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
        );
        let post = Request::post("/ready").body(()).unwrap();
        assert_eq!(answer(&page, &post).0, StatusCode::NOT_FOUND);
    }

    #[test]
    fn only_the_exact_bearer_token_is_accepted() {
        let h = |name: &str, value: &str| {
            let mut m = HeaderMap::new();
            m.insert(
                hyper::header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
            m
        };
        assert!(bears(&h("Authorization", "Bearer s3cret"), "s3cret"));
        assert!(bears(&h("authorization", "bearer  s3cret "), "s3cret"));
        assert!(!bears(&h("Authorization", "Bearer s3cre"), "s3cret"));
        assert!(!bears(&h("Authorization", "Basic s3cret"), "s3cret"));
        assert!(!bears(&h("X-Token", "s3cret"), "s3cret"));
        let in_query = get("/metrics?Authorization=Bearer%20s3cret", &[]);
        assert!(!bears(in_query.headers(), "s3cret"));
    }
}
