//! Connections: reconnecting after the node closes its streams, timeouts and deadlines, and
//! the handshake's refusals (tokens, namespaces).

use std::sync::Arc;
use std::time::Duration;

use kvpool_client::{Client, ClientConfig, ClientError, ErrorCode};
use kvpool_server::Node;

use crate::harness::{eventually, Net};

#[tokio::test]
async fn a_call_after_the_node_closed_its_streams_reconnects() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"k", b"v").await.unwrap();
    let dials = net.dials();
    node.disconnect_all();
    eventually("the node closed every stream", || node.open_streams() == 0).await;
    assert_eq!(kv.get(b"k").await.unwrap().as_deref(), Some(&b"v"[..]));
    assert!(net.dials() > dials, "no new stream was opened");
}

#[tokio::test]
async fn the_client_reconnects_after_each_of_several_closes() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    for round in 0..4u8 {
        kv.put(&[round], &[round; 10]).await.unwrap();
        node.disconnect_all();
        eventually("the node closed every stream", || node.open_streams() == 0).await;
        assert_eq!(kv.get(&[round]).await.unwrap(), Some(vec![round; 10]));
    }
}

#[tokio::test]
async fn connections_the_node_closed_for_idling_are_replaced() {
    let net = Net::default();
    let node = net.start(1, "[limits]\nidle_timeout_ms = 20\n").await;
    let kv = net.client(&node).await;
    kv.put(b"k", b"v").await.unwrap();
    eventually("the node closed the idle stream", || {
        node.open_streams() == 0
    })
    .await;
    assert_eq!(kv.get(b"k").await.unwrap().as_deref(), Some(&b"v"[..]));
}

#[tokio::test]
async fn a_node_that_refuses_connections_fails_the_connect() {
    let net = Net::default();
    let node = net.start(1, "").await;
    net.cut(&node);
    match net.client_with(&node, net.client_config()).await {
        Err(ClientError::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused),
        other => panic!("expected a refused connection, got {:?}", other.map(|_| ())),
    }
}

#[tokio::test]
async fn a_node_that_never_answers_times_the_connect_out() {
    let net = Net::default();
    let node = net.start(1, "").await;
    net.silence(&node);
    let cfg = ClientConfig {
        timeout: Duration::from_millis(50),
        ..net.client_config()
    };
    match net.client_with(&node, cfg).await {
        Err(ClientError::Timeout) => {}
        other => panic!("expected a timeout, got {:?}", other.map(|_| ())),
    }
}

/// A client of a node that hangs once the client is connected (and has stored `k`), with call
/// timeout `timeout`.
async fn hung(timeout: Duration) -> (Net, Arc<Node>, Client) {
    let net = Net::default();
    let node = net.start(1, "").await;
    let cfg = ClientConfig {
        timeout,
        ..net.client_config()
    };
    let kv = net.client_with(&node, cfg).await.unwrap();
    kv.put(b"k", b"v").await.unwrap();
    net.silence(&node);
    eventually("the node closed every stream", || node.open_streams() == 0).await;
    (net, node, kv)
}

#[tokio::test]
async fn a_call_to_a_hung_node_times_out_and_the_client_recovers() {
    let (net, node, kv) = hung(Duration::from_millis(50)).await;
    assert!(matches!(kv.stats().await, Err(ClientError::Timeout)));
    net.restore(&node);
    assert_eq!(kv.get(b"k").await.unwrap().as_deref(), Some(&b"v"[..]));
}

#[tokio::test]
async fn a_call_past_its_deadline_times_out_before_the_timeout() {
    let (_net, _node, kv) = hung(Duration::from_secs(600)).await;
    let hurried = kv.with_deadline(Some(Duration::from_millis(50)));
    assert!(matches!(hurried.stats().await, Err(ClientError::Timeout)));
}

#[tokio::test]
async fn a_put_to_a_hung_node_reports_its_owner_unavailable() {
    let (_net, _node, kv) = hung(Duration::from_millis(50)).await;
    let err = kv.put(b"k2", b"v").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Unavailable));
}

#[tokio::test]
async fn a_get_from_a_hung_node_is_a_miss_counted_as_unreachable() {
    let (net, node, kv) = hung(Duration::from_millis(50)).await;
    assert_eq!(kv.unreachable_events(), 0);
    assert_eq!(kv.get(b"k").await.unwrap(), None);
    assert_eq!(kv.unreachable_events(), 1);
    net.restore(&node);
    assert_eq!(kv.get(b"k").await.unwrap().as_deref(), Some(&b"v"[..]));
}

const TOKENS: &str = "[auth]\ntoken = \"node-token\"\n\n\
    [[namespace]]\nname = \"team\"\ntokens = [\"team-token\"]\n\n\
    [[namespace]]\nname = \"other\"\ntokens = [\"other-token\"]\n";

fn with_token(net: &Net, token: &str) -> ClientConfig {
    ClientConfig {
        token: token.into(),
        ..net.client_config()
    }
}

#[tokio::test]
async fn a_wrong_token_is_refused_at_the_handshake() {
    let net = Net::default();
    let node = net.start(1, TOKENS).await;
    let err = net
        .client_with(&node, with_token(&net, "wrong"))
        .await
        .err();
    assert_eq!(err.and_then(|e| e.code()), Some(ErrorCode::Unauthorized));
}

#[tokio::test]
async fn a_missing_token_is_refused_at_the_handshake() {
    let net = Net::default();
    let node = net.start(1, TOKENS).await;
    let err = net.client_with(&node, with_token(&net, "")).await.err();
    assert_eq!(err.and_then(|e| e.code()), Some(ErrorCode::Unauthorized));
}

#[tokio::test]
async fn the_node_token_opens_every_namespace() {
    let net = Net::default();
    let node = net.start(1, TOKENS).await;
    let kv = net
        .client_with(&node, with_token(&net, "node-token"))
        .await
        .unwrap();
    for ns in ["default", "team", "other"] {
        let c = kv.namespace(ns).unwrap();
        c.put(b"k", ns.as_bytes()).await.unwrap();
        assert_eq!(c.get(b"k").await.unwrap().as_deref(), Some(ns.as_bytes()));
    }
}

#[tokio::test]
async fn a_namespace_token_opens_its_namespace_only() {
    let net = Net::default();
    let node = net.start(1, TOKENS).await;
    let cfg = ClientConfig {
        namespace: "team".into(),
        ..with_token(&net, "team-token")
    };
    let team = net.client_with(&node, cfg).await.unwrap();
    team.put(b"k", b"team's").await.unwrap();
    // The node does not even name the namespaces the token does not open.
    match team.namespace("other") {
        Err(ClientError::UnknownNamespace(n)) => assert_eq!(n, "other"),
        other => panic!("expected UnknownNamespace, got {:?}", other.map(|_| ())),
    }
    // An open namespace is there for every token.
    let open = team.namespace("default").unwrap();
    open.put(b"k", b"open").await.unwrap();
    assert_eq!(team.get(b"k").await.unwrap().unwrap(), b"team's");
}

#[tokio::test]
async fn namespaces_keep_their_keys_apart() {
    let net = Net::default();
    let node = net.start(1, TOKENS).await;
    let kv = net
        .client_with(&node, with_token(&net, "node-token"))
        .await
        .unwrap();
    let (team, other) = (
        kv.namespace("team").unwrap(),
        kv.namespace("other").unwrap(),
    );
    team.put(b"shared-name", b"team").await.unwrap();
    assert_eq!(other.get(b"shared-name").await.unwrap(), None);
    other.put(b"shared-name", b"other").await.unwrap();
    assert_eq!(team.get(b"shared-name").await.unwrap().unwrap(), b"team");
    assert_eq!(team.remove_all().await.unwrap(), 1);
    assert_eq!(other.get(b"shared-name").await.unwrap().unwrap(), b"other");
}

#[tokio::test]
async fn an_unknown_namespace_is_refused_by_name() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    match kv.namespace("no-such-namespace") {
        Err(ClientError::UnknownNamespace(n)) => assert_eq!(n, "no-such-namespace"),
        other => panic!("expected UnknownNamespace, got {:?}", other.map(|_| ())),
    }
}
