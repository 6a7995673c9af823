//! The cluster family, node to node: `ClusterAuth` proves the cluster secret, after which a
//! peer may `Gossip` (merge views), `Drain` (ask this node to leave) and `Move` (ask for the
//! pinned objects of keys it took over); `View` shows this node's view; `Vouch` tells a key's
//! previous owner whether its copy may still be served.

use kvpool::protocol::{ErrorCode, Heard, Key, Reply};
use rkyv::Archived;
use tokio::io::{AsyncRead, AsyncWrite};

use super::conn::{Conn, Next};
use crate::service::AuthDenied;

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    /// A wrong proof closes the connection, and so does one refused unchecked because the
    /// node's budget of wrong proofs is spent (`[limits] cluster_auth_failures_per_second`).
    pub(super) async fn cluster_auth(
        &mut self,
        id: u64,
        nonce: &[u8; 32],
        proof: &[u8; 32],
    ) -> Next {
        let node = self.s.hello.node;
        let verified =
            self.s
                .verify_cluster_peer(self.session.peer_ip, &self.session.challenge, nonce, proof);
        if let Err(denied) = verified {
            // debug, not warn: anyone can send this, and logs must not be floodable.
            tracing::debug!(
                transport = self.transport.name(),
                "refused a connection that failed the cluster secret check"
            );
            let message = match denied {
                AuthDenied::Wrong => "wrong cluster secret".to_string(),
                AuthDenied::Throttled(t) => format!(
                    "too many failed cluster authentications on this node, this address's \
                     among them; retry in {} ms ([limits] cluster_auth_failures_per_second)",
                    t.wait.as_millis().max(1)
                ),
            };
            self.fail(id, ErrorCode::Unauthorized, &message).await?;
            return Ok(false);
        }
        self.session.peer = true;
        if let Some(access) = &mut self.session.access {
            access.grant_all();
        }
        let proof = self
            .s
            .peers
            .secret
            .node_proof(node, &self.session.challenge, nonce);
        self.reply(id, Reply::ClusterAuth { proof }, &[]).await?;
        Ok(true)
    }

    /// `Gossip` and `Heartbeat` (`heard`: the hearings it relays).
    pub(super) async fn gossip(
        &mut self,
        id: u64,
        view: &Archived<kvpool::placement::ClusterView>,
        heard: Option<&Archived<Vec<Heard>>>,
    ) -> Next {
        if !self.session.peer {
            self.fail(
                id,
                ErrorCode::Unauthorized,
                "gossip is cluster control: it needs the cluster secret (ClusterAuth)",
            )
            .await?;
            return Ok(true);
        }
        let theirs: kvpool::placement::ClusterView =
            match rkyv::deserialize::<_, rkyv::rancor::Error>(view) {
                Ok(v) => v,
                Err(e) => {
                    self.fail(id, ErrorCode::Malformed, &e.to_string()).await?;
                    return Ok(true);
                }
            };
        if let Some(heard) = heard {
            let heard: Vec<Heard> = heard
                .iter()
                .map(|h| Heard {
                    node: h.node.to_native(),
                    age_ms: h.age_ms.to_native(),
                })
                .collect();
            self.s.cluster.relayed(&heard);
        }
        let after = self.s.cluster.merge(&theirs);
        let after = kvpool::protocol::view_for(after, self.session.version);
        self.reply(id, Reply::View(after), &[]).await?;
        Ok(true)
    }

    pub(super) async fn view(&mut self, id: u64) -> Next {
        let view = kvpool::protocol::view_for(self.s.cluster.view(), self.session.version);
        self.reply(id, Reply::View(view), &[]).await?;
        Ok(true)
    }

    pub(super) async fn drain(&mut self, id: u64) -> Next {
        if !self.session.peer {
            self.fail(
                id,
                ErrorCode::Unauthorized,
                "drain is cluster control: it needs the cluster secret (ClusterAuth)",
            )
            .await?;
            return Ok(true);
        }
        tracing::info!(client = "drain request", "drain requested");
        self.s.cluster.request_drain();
        self.reply(id, Reply::Done, &[]).await?;
        Ok(true)
    }

    /// Per key `Ok` when a copy of it on another node may be served, else `Superseded`.
    pub(super) async fn vouch(&mut self, id: u64, ns: u32, keys: &Archived<Vec<Key>>) -> Next {
        // A copy elsewhere may be one of up to this many (pinned objects have more).
        let replicas = self
            .s
            .replication(ns)
            .map(|r| r.replicas.max(r.pinned_replicas) as usize)
            .ok_or(ErrorCode::UnknownNamespace);
        let r = self
            .s
            .batch_check(keys.len())
            .and(replicas)
            .map(|replicas| {
                Reply::Statuses(
                    keys.iter()
                        .map(|k| {
                            if self.s.cluster.vouches(ns, k.as_slice(), replicas) {
                                ErrorCode::Ok as u16
                            } else {
                                ErrorCode::Superseded as u16
                            }
                        })
                        .collect(),
                )
            });
        self.answer(id, r).await
    }

    /// `Move`: the sender's view merged, then this node's pinned objects of `keys` moved to
    /// their owners under its view now; answered with its view, as `Gossip` is.
    pub(super) async fn move_keys(
        &mut self,
        id: u64,
        ns: u32,
        keys: &Archived<Vec<Key>>,
        view: &Archived<kvpool::placement::ClusterView>,
    ) -> Next {
        if !self.session.peer {
            self.fail(
                id,
                ErrorCode::Unauthorized,
                "move is cluster control: it needs the cluster secret (ClusterAuth)",
            )
            .await?;
            return Ok(true);
        }
        let pinned = self
            .s
            .replication(ns)
            .map(|r| r.pinned_replicas.max(1) as usize)
            .ok_or(ErrorCode::UnknownNamespace);
        let r = match self.s.batch_check(keys.len()).and(pinned) {
            Ok(r) => r,
            Err(code) => return self.answer(id, Err(code)).await,
        };
        let theirs: kvpool::placement::ClusterView =
            match rkyv::deserialize::<_, rkyv::rancor::Error>(view) {
                Ok(v) => v,
                Err(e) => {
                    self.fail(id, ErrorCode::Malformed, &e.to_string()).await?;
                    return Ok(true);
                }
            };
        // Moved under the newer of the two views: the sender's read is routed by its own, and
        // a copy made under a view the sender does not hold would not be taken.
        let s = self.s;
        s.cluster.merge(&theirs);
        let creds = s.peer_auth();
        let keys = keys.iter().map(|k| k.as_slice().to_vec()).collect();
        crate::mover::move_now(
            &s.pool,
            &s.cluster,
            (ns, r, keys),
            (&creds, &s.bulk),
            s.peers.timeout,
            s.started,
        )
        .await;
        let view = kvpool::protocol::view_for(s.cluster.view(), self.session.version);
        self.reply(id, Reply::View(view), &[]).await?;
        Ok(true)
    }
}
