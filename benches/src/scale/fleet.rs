//! Many `kvpoold`s on this machine as one pool, started through the benchmarks' one launcher
//! ([`crate::perf::daemon::Daemon`]), and every node's own view polled at once: the pool has
//! converged when each live node's view says the same thing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures_util::future::join_all;
use kvpool::placement::{ClusterView, NodeState};
use kvpool_client::{Client, ClientConfig, SameHost};

use crate::perf::daemon::Daemon;

/// How the nodes learn each other.
#[derive(Clone, Debug)]
pub(crate) enum Membership {
    /// Static peers: every node is given node 0's address and gossips from there.
    Static,
    /// etcd at this client URL, under this prefix.
    Etcd { url: String, prefix: String },
}

/// What every node is started with.
#[derive(Clone, Debug)]
pub(crate) struct NodeSpec {
    pub(crate) bin: PathBuf,
    pub(crate) memory: u64,
    pub(crate) heartbeat_ms: u64,
    pub(crate) down_after_ms: u64,
    /// Tokio worker threads per node (`TOKIO_WORKER_THREADS`).
    pub(crate) threads: usize,
    pub(crate) membership: Membership,
    /// The cluster secret every node is given (`--cluster-secret-file`).
    pub(crate) secret: PathBuf,
}

/// One node: its process (None once killed or gone) and a client of it alone.
pub(crate) struct Member {
    pub(crate) id: u32,
    pub(crate) daemon: Daemon,
    pub(crate) client: Option<Client>,
    pub(crate) alive: bool,
}

/// The pool's nodes, in id order.
pub(crate) struct Fleet {
    pub(crate) spec: NodeSpec,
    pub(crate) members: Vec<Member>,
}

/// A client of one node that polls its view (no same-host path, short timeout).
pub(crate) fn poll_cfg() -> ClientConfig {
    ClientConfig {
        same_host: SameHost::Off,
        timeout: Duration::from_secs(5),
        ..ClientConfig::default()
    }
}

impl Fleet {
    /// Starts nodes `0..n` one after another (each waits for its ready line).
    pub(crate) async fn start(spec: NodeSpec, n: u32) -> anyhow::Result<Fleet> {
        let mut f = Fleet {
            spec,
            members: Vec::new(),
        };
        for id in 0..n {
            f.add(id).await?;
        }
        Ok(f)
    }

    /// Starts node `id` and connects a client to it; returns when its ready line came.
    pub(crate) async fn add(&mut self, id: u32) -> anyhow::Result<()> {
        let s = &self.spec;
        let mut extra: Vec<String> = vec![
            "--node-id".into(),
            id.to_string(),
            "--heartbeat-ms".into(),
            s.heartbeat_ms.to_string(),
            "--down-after-ms".into(),
            s.down_after_ms.to_string(),
            "--cluster-secret-file".into(),
            s.secret.display().to_string(),
            "--backing".into(),
            "shm".into(),
            "--huge-pages".into(),
            "off".into(),
        ];
        match &s.membership {
            Membership::Static => {
                if let Some(seed) = self.members.first() {
                    extra.extend(["--peer".into(), seed.daemon.tcp.clone()]);
                }
            }
            Membership::Etcd { url, prefix } => {
                extra.extend([
                    "--etcd".into(),
                    url.clone(),
                    "--etcd-prefix".into(),
                    prefix.clone(),
                ]);
            }
        }
        let threads = s.threads.to_string();
        let env = [("TOKIO_WORKER_THREADS", threads.as_str())];
        let daemon = Daemon::start_env(&s.bin, s.memory, &extra, &env)
            .with_context(|| format!("starting node {id}"))?;
        let endpoint = format!("tcp://{}", daemon.tcp);
        let client = Client::connect(&endpoint, poll_cfg())
            .await
            .with_context(|| format!("connecting to node {id}"))?;
        self.members.push(Member {
            id,
            daemon,
            client: Some(client),
            alive: true,
        });
        Ok(())
    }

    /// The member of id `id`.
    pub(crate) fn member(&mut self, id: u32) -> &mut Member {
        self.members
            .iter_mut()
            .find(|m| m.id == id)
            .expect("a started node")
    }

    /// SIGKILLs node `id`.
    pub(crate) fn kill(&mut self, id: u32) {
        let m = self.member(id);
        m.daemon.kill();
        m.client = None;
        m.alive = false;
    }

    /// Live nodes' endpoints, for clients that route over the whole pool.
    pub(crate) fn endpoint(&self) -> String {
        let m = self.members.iter().find(|m| m.alive).expect("a live node");
        format!("tcp://{}", m.daemon.tcp)
    }

    /// Every live node's view, polled at once (None where the node did not answer).
    pub(crate) async fn views(&self) -> Vec<(u32, Option<ClusterView>)> {
        let polls = self.members.iter().filter(|m| m.alive).map(|m| async move {
            let v = match &m.client {
                Some(c) => c.view().await.ok(),
                None => None,
            };
            (m.id, v)
        });
        join_all(polls).await
    }

    /// Polls every live node's view until `want` holds of each (rounds `every` apart), for at
    /// most `bound`; returns the time from `since` to the first round where it held, and the
    /// rounds polled.
    pub(crate) async fn converge(
        &self,
        what: &str,
        since: Instant,
        bound: Duration,
        want: impl Fn(&ClusterView) -> bool,
    ) -> anyhow::Result<Converged> {
        let mut rounds = 0u32;
        loop {
            let views = self.views().await;
            rounds += 1;
            let behind = views
                .iter()
                .filter(|(_, v)| !v.as_ref().is_some_and(&want))
                .count();
            if behind == 0 {
                return Ok(Converged {
                    after: since.elapsed(),
                    rounds,
                });
            }
            if since.elapsed() > bound {
                let sample = views
                    .iter()
                    .find(|(_, v)| !v.as_ref().is_some_and(&want))
                    .map(|(id, v)| format!("node {id}: {}", describe(v.as_ref())));
                bail!(
                    "{what}: {behind} of {} nodes still disagree after {bound:?} ({})",
                    views.len(),
                    sample.unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A convergence: how long it took, and in how many polling rounds (each polls every node).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Converged {
    pub(crate) after: Duration,
    pub(crate) rounds: u32,
}

/// Serving nodes in `v`.
pub(crate) fn serving(v: &ClusterView) -> usize {
    v.nodes
        .iter()
        .filter(|n| n.state == NodeState::Serving)
        .count()
}

/// The state of node `id` in `v` (None: not in it).
pub(crate) fn state_of(v: &ClusterView, id: u32) -> Option<NodeState> {
    v.nodes.iter().find(|n| n.id == id).map(|n| n.state)
}

fn describe(v: Option<&ClusterView>) -> String {
    match v {
        None => "no answer".into(),
        Some(v) => format!(
            "{} records, {} serving, version {}",
            v.nodes.len(),
            serving(v),
            v.version
        ),
    }
}

/// Writes a fresh cluster secret to `path` (mode 0600), the file every node is given.
pub(crate) fn write_secret(path: &Path) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let text = kvpool::protocol::auth::ClusterSecret::generate_file_contents()
        .map_err(|e| anyhow::anyhow!("generating the cluster secret: {e}"))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}
