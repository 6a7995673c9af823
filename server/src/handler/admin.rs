//! The admin family: `Hello`, the handshake that authenticates a connection and tells it the
//! node's namespaces, limits and view; and `Stats`.

use kvpool::protocol::auth;
use kvpool::protocol::{ErrorCode, Reply, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use rkyv::string::ArchivedString;
use tokio::io::{AsyncRead, AsyncWrite};

use super::conn::{Conn, Next};

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Conn<'_, R, W> {
    /// A version outside `MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION` or a wrong token closes the
    /// connection. An accepted one leaves the reaper's registry: the connection is never reaped
    /// to make room after it.
    pub(super) async fn hello(
        &mut self,
        id: u64,
        version: u32,
        token: &ArchivedString,
        client: &ArchivedString,
    ) -> Next {
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
            self.fail(
                id,
                ErrorCode::UnsupportedVersion,
                &format!(
                    "this node speaks protocol {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}, not {version}"
                ),
            )
            .await?;
            return Ok(false);
        }
        let access = match self
            .s
            .authenticate_peer(token.as_str(), self.session.peer_ip)
        {
            Ok(access) => access,
            Err(denied) => {
                self.fail(id, ErrorCode::Unauthorized, &denied.message())
                    .await?;
                return Ok(false);
            }
        };
        if let Err(why) = self
            .s
            .admit_token(token.as_str(), &mut self.session.token_slot)
        {
            self.fail(id, ErrorCode::LimitExceeded, &why).await?;
            return Ok(false);
        }
        if let Some(admit) = self.session.admit.take() {
            if !admit.authenticated() {
                // Reaped to make room for a newer connection while this Hello was read.
                return Ok(false);
            }
        }
        // Authenticated connections read through a full-size buffer.
        self.r.set_capacity(super::conn::IO_BUFFER);
        tracing::debug!(
            client = client.as_str(),
            transport = self.transport.name(),
            "client connected"
        );
        self.session.challenge = match auth::random() {
            Ok(c) => c,
            Err(e) => {
                self.fail(id, ErrorCode::Internal, &e.to_string()).await?;
                return Ok(false);
            }
        };
        let mut hello = self.s.hello.clone();
        hello.challenge = self.session.challenge;
        // The connection speaks the version it asked for.
        hello.version = version;
        self.session.version = version;
        hello.namespaces.retain(|(_, id)| access.allows(*id));
        hello.replication.retain(|r| access.allows(r.ns));
        hello.view = kvpool::protocol::view_for(self.s.cluster.view(), version);
        self.session.access = Some(access);
        self.reply(id, Reply::Hello(hello), &[]).await?;
        Ok(true)
    }

    /// The node's statistics, with only the namespaces this connection may use.
    pub(super) async fn stats(&mut self, id: u64) -> Next {
        let mut stats = self.s.pool.stats();
        stats
            .namespaces
            .retain(|n| self.session.access.as_ref().is_some_and(|a| a.allows(n.id)));
        self.reply(id, Reply::Stats(stats), &[]).await?;
        Ok(true)
    }

    /// `DiskStats`: the disk tier's, node-wide like `Stats`' totals (none without a tier).
    pub(super) async fn disk_stats(&mut self, id: u64) -> Next {
        let stats = self.s.disk.as_ref().map(|d| Box::new(d.stats()));
        self.reply(id, Reply::DiskStats(stats), &[]).await?;
        Ok(true)
    }

    /// `Traffic`: the node's operations, payload bytes and refusals since start.
    pub(super) async fn traffic(&mut self, id: u64) -> Next {
        let traffic = self.s.metrics.traffic(self.s.pool.long_keys_refused());
        self.reply(id, Reply::Traffic(traffic), &[]).await?;
        Ok(true)
    }
}
