//! Connections to the other nodes of one view, opened on first use, and a copy of an object
//! sent to one of them in its turn among this node's bulk transfers.

use std::collections::HashMap;
use std::time::Duration;

use kvpool::placement::ClusterView;
use kvpool::protocol::{Op, Priority, Reply};
use kvpool::NodeId;

use crate::bulk::{Bulk, CLUSTER_NS};
use crate::peer::{Peer, PeerAuth, PeerError};

/// Connections to the nodes of one view, opened on first use: the mover's to the owners of one
/// pass, or a read's to the holders it asks while the cluster settles.
pub(crate) struct Peers<'a> {
    view: &'a ClusterView,
    creds: &'a PeerAuth,
    me: u32,
    timeout: Duration,
    /// Per node: its connection, or None when it could not be reached this pass.
    open: HashMap<u32, Option<Peer>>,
}

impl<'a> Peers<'a> {
    pub(crate) fn new(
        view: &'a ClusterView,
        creds: &'a PeerAuth,
        me: u32,
        timeout: Duration,
    ) -> Self {
        Peers {
            view,
            creds,
            me,
            timeout,
            open: HashMap::new(),
        }
    }

    /// The connection to `node`, opened now if it is not yet; None when it could not be.
    pub(crate) async fn get(&mut self, node: u32) -> Option<&mut Peer> {
        if !self.open.contains_key(&node) {
            let p = match self.view.node(NodeId(node)) {
                Some(n) => Peer::connect(&n.tcp, self.creds, self.me, self.timeout)
                    .await
                    .ok(),
                None => None,
            };
            self.open.insert(node, p);
        }
        self.open.get_mut(&node).and_then(Option::as_mut)
    }
}

/// Sends `obj` to peer `p` as its copy of `key` (`Put`, stamped with `view`, 0 for none), in
/// its turn among this node's bulk transfers at background priority.
pub(crate) async fn send_copy(
    bulk: &Bulk,
    p: &mut Peer,
    view: u64,
    (ns, key, pin): (u32, &[u8], bool),
    obj: &kvpool::pool::ObjectRef<'_>,
) -> Result<Reply, PeerError> {
    let put = Op::Put {
        ns,
        key: key.to_vec(),
        checksum: obj.checksum(),
        pin,
    };
    let len = obj.bytes().len() as u64;
    let mut turn = bulk.admit(CLUSTER_NS, Priority::Background, len, None).ok();
    let payload = [obj.bytes()];
    let call = p.call_in_view(view, put, &payload);
    match turn.as_mut() {
        Some(t) => {
            let grant = t.chunk(len).await;
            crate::bulk::under(grant, bulk.hold(), call).await
        }
        None => call.await,
    }
}
