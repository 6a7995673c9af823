//! The RESP door in a cluster: a key that this node does not hold as its only owner goes to its
//! owners through kvpool's own client, so a Redis client can use any node's door. The client
//! routes by the view, writes every replica a namespace asks for, and, while the view changes,
//! looks a miss up once more on the key's previous owner, exactly as an application's client does.
//!
//! The client connects lazily, to this node's own advertised TCP address, with the node token
//! (which admits to every namespace) and without the same-host path; one per door, shared by its
//! connections, each command taking a handle for its connection's namespace.

use std::time::Duration;

use kvpool::protocol::ErrorCode;
use kvpool_client::{Client, ClientConfig, ClientError, SameHost};
use tokio::sync::OnceCell;

/// The door's client for keys owned elsewhere.
pub(crate) struct Forwarder {
    token: String,
    timeout: Duration,
    client: OnceCell<Client>,
}

impl Forwarder {
    pub(crate) fn new(token: String, timeout: Duration) -> Forwarder {
        Forwarder {
            token,
            timeout,
            client: OnceCell::new(),
        }
    }

    /// How long a forwarded request (and a forwarded value still arriving) may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A client in namespace `ns`, connecting through `endpoint` (`host:port`, this node's
    /// advertised TCP address) the first time.
    pub(crate) async fn client(&self, endpoint: &str, ns: &str) -> Result<Client, ClientError> {
        let base = self
            .client
            .get_or_try_init(|| async {
                let cfg = ClientConfig {
                    namespace: ns.to_string(),
                    token: self.token.clone(),
                    client_name: "kvpoold resp door".into(),
                    timeout: self.timeout,
                    same_host: SameHost::Off,
                    ..ClientConfig::default()
                };
                Client::connect(&format!("tcp://{endpoint}"), cfg).await
            })
            .await?;
        base.namespace(ns)
    }
}

/// The RESP error line for a forwarded request that failed.
pub(crate) fn error_text(e: &ClientError) -> String {
    match e {
        ClientError::Server {
            code: ErrorCode::PoolFull | ErrorCode::QuotaExceeded,
            message,
        } => format!("OOM kvpool: the owner has no room: {message}"),
        ClientError::Timeout => "ERR kvpool: the key's owner did not answer in time".into(),
        e => format!("ERR kvpool: forwarding to the key's owner failed: {e}"),
    }
}

/// Where one command's forwarded requests go: the door's client, this node's address and the
/// connection's namespace. Holds nothing of the connection, so a command can await it.
pub(crate) struct Target<'a> {
    pub(crate) forwarder: &'a Forwarder,
    pub(crate) endpoint: String,
    pub(crate) ns: String,
}

impl Target<'_> {
    /// The client in the connection's namespace, or the error line to answer.
    pub(crate) async fn client(&self) -> Result<Client, String> {
        self.forwarder
            .client(&self.endpoint, &self.ns)
            .await
            .map_err(|e| error_text(&e))
    }

    /// The value of a key owned elsewhere: Ok(None) for a miss.
    pub(crate) async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
        let c = self.client().await?;
        c.get(key).await.map_err(|e| error_text(&e))
    }

    /// Stores a value whose key is owned elsewhere (on every replica).
    pub(crate) async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), String> {
        let c = self.client().await?;
        c.put(key, value).await.map_err(|e| error_text(&e))
    }

    pub(crate) async fn exists(&self, key: &[u8]) -> Result<bool, String> {
        let c = self.client().await?;
        c.exists(key).await.map_err(|e| error_text(&e))
    }

    pub(crate) async fn remove(&self, key: &[u8]) -> Result<bool, String> {
        let c = self.client().await?;
        c.remove(key).await.map_err(|e| error_text(&e))
    }
}
