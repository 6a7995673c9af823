//! In-process clusters: [`Node`]s served in the test's runtime and a [`Connector`] that hands
//! a client a stream to the node its endpoint names, so a real client drives the nodes' real
//! connection handler with no socket and no process.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvpool::placement::NodeState;
use kvpool_client::{
    BoxStream, Client, ClientConfig, ClientError, Connecting, Connector, Endpoint,
};
use kvpool_server::{Config, Node};
use tokio::io::DuplexStream;

/// A node's configuration: `id`, a small anonymous pool, and the extra TOML `extra` (sections
/// such as `[limits]` or `[[namespace]]`).
pub(crate) fn config(id: u32, extra: &str) -> Config {
    let text = format!(
        "node_id = {id}\n\n[memory]\nsize = \"8MiB\"\nbacking = \"anonymous\"\n\
         huge_pages = \"off\"\n\n{extra}"
    );
    Config::from_toml(&text).expect("a valid test configuration")
}

/// The nodes a client can reach, by the address each advertises. Cheap to clone; clones
/// share the nodes.
#[derive(Clone, Debug, Default)]
pub(crate) struct Net {
    nodes: Arc<Mutex<HashMap<String, Arc<Node>>>>,
    /// Addresses that refuse connections for now, as a node that went away does.
    cut: Arc<Mutex<Vec<String>>>,
    /// Addresses whose new streams are never answered for now, as a hung node's.
    silent: Arc<Mutex<Vec<String>>>,
    /// The far ends of the streams nobody answers, kept open.
    unanswered: Arc<Mutex<Vec<DuplexStream>>>,
    /// Streams opened so far.
    dials: Arc<AtomicUsize>,
}

impl Connector for Net {
    fn connect<'a>(&'a self, endpoint: &'a Endpoint) -> Connecting<'a> {
        Box::pin(async move {
            self.dials.fetch_add(1, Ordering::Relaxed);
            let addr = match endpoint {
                Endpoint::Tcp(a) | Endpoint::Quic(a) | Endpoint::Tls(a) | Endpoint::Fabric(a) => {
                    a.clone()
                }
                Endpoint::Unix(p) => p.display().to_string(),
            };
            if self.cut.lock().unwrap().contains(&addr) {
                return Err(io::ErrorKind::ConnectionRefused.into());
            }
            if self.silent.lock().unwrap().contains(&addr) {
                let (ours, theirs) = tokio::io::duplex(64 << 10);
                self.unanswered.lock().unwrap().push(theirs);
                return Ok(Box::new(ours) as BoxStream);
            }
            let node = self.nodes.lock().unwrap().get(&addr).cloned();
            match node {
                Some(n) => Ok(Box::new(n.connect()) as BoxStream),
                None => Err(io::ErrorKind::ConnectionRefused.into()),
            }
        })
    }
}

impl Net {
    /// Starts node `id` with `extra` configuration and makes it reachable.
    pub(crate) async fn start(&self, id: u32, extra: &str) -> Arc<Node> {
        let node = Arc::new(Node::start(config(id, extra)).await.expect("node starts"));
        self.nodes
            .lock()
            .unwrap()
            .insert(node.address().to_string(), node.clone());
        node
    }

    /// Stops `node` answering: new streams to it are refused, and its open streams close.
    pub(crate) fn cut(&self, node: &Node) {
        self.cut.lock().unwrap().push(node.address().to_string());
        node.disconnect_all();
    }

    /// Makes `node` hang: its open streams close, and new ones are never answered.
    pub(crate) fn silence(&self, node: &Node) {
        self.silent.lock().unwrap().push(node.address().to_string());
        node.disconnect_all();
    }

    /// Undoes [`Net::cut`] and [`Net::silence`]: new streams to `node` are served again.
    pub(crate) fn restore(&self, node: &Node) {
        let addr = node.address();
        self.cut.lock().unwrap().retain(|a| a != addr);
        self.silent.lock().unwrap().retain(|a| a != addr);
    }

    /// Streams opened so far, by every client of this network.
    pub(crate) fn dials(&self) -> usize {
        self.dials.load(Ordering::Relaxed)
    }

    /// A client configuration whose streams go to these nodes.
    pub(crate) fn client_config(&self) -> ClientConfig {
        ClientConfig {
            connector: Some(Arc::new(self.clone())),
            timeout: Duration::from_secs(5),
            ..ClientConfig::default()
        }
    }

    /// A client connected through `node` with `cfg` (whose connector is set here).
    pub(crate) async fn client_with(
        &self,
        node: &Node,
        mut cfg: ClientConfig,
    ) -> Result<Client, ClientError> {
        cfg.connector = Some(Arc::new(self.clone()));
        Client::connect(&format!("tcp://{}", node.address()), cfg).await
    }

    /// A client connected through `node` with the default configuration.
    pub(crate) async fn client(&self, node: &Node) -> Client {
        self.client_with(node, self.client_config())
            .await
            .expect("client connects")
    }
}

/// Gossips among `nodes` until they hold one view, as heartbeats would: every node merges
/// every other's view, twice over.
pub(crate) fn converge(nodes: &[&Node]) {
    for _ in 0..2 {
        for a in nodes {
            for b in nodes {
                if a.id() != b.id() {
                    a.merge_view(&b.view());
                }
            }
        }
    }
    let stamp = nodes[0].view().stamp();
    for n in nodes {
        assert_eq!(
            n.view().stamp(),
            stamp,
            "node {} holds another view",
            n.id()
        );
    }
}

/// A cluster of nodes `1..=n`, started with `extra` and converged, all serving.
pub(crate) async fn cluster(n: u32, extra: &str) -> (Net, Vec<Arc<Node>>) {
    let net = Net::default();
    let mut nodes = Vec::new();
    for id in 1..=n {
        nodes.push(net.start(id, extra).await);
    }
    let refs: Vec<&Node> = nodes.iter().map(|n| &**n).collect();
    converge(&refs);
    for n in &nodes {
        assert!(n.view().nodes.iter().all(|r| r.state == NodeState::Serving));
    }
    (net, nodes)
}

/// Keys `prefix-0` .. `prefix-{n-1}`.
pub(crate) fn keys(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}-{i}").into_bytes())
        .collect()
}

/// The value stored under `key` in the tests: its bytes repeated to `len`.
pub(crate) fn value_of(key: &[u8], len: usize) -> Vec<u8> {
    key.iter().copied().cycle().take(len).collect()
}

/// `(key, value)` items of `ks[i]` with `vs[i]`.
pub(crate) fn pairs<'a>(ks: &'a [Vec<u8>], vs: &'a [Vec<u8>]) -> Vec<(&'a [u8], &'a [u8])> {
    ks.iter().zip(vs).map(|(k, v)| (&k[..], &v[..])).collect()
}

/// Borrowed slices of `v`.
pub(crate) fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(|k| k.as_slice()).collect()
}

/// Whether `node` holds an object of `key` in namespace `ns` (its pool asked directly).
pub(crate) fn holds(node: &Node, ns: u32, key: &[u8]) -> bool {
    node.pool().get(ns, key, 0).is_ok()
}

/// Waits until `cond` holds, checking every few milliseconds (at most about five seconds).
pub(crate) async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never happened: {what}");
}
