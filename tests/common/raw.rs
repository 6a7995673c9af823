//! Raw native-protocol frames, for tests that must send what the client never would (part of a
//! payload, a request before `Hello`, a malformed op) and read the node's answer as it is.

use std::time::Duration;

use kvpool::protocol::{
    decode_response_owned, AlignedVec, Exchange, FramePrefix, Limits, Op, Reply, Response,
    PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Sends a request's prefix and header announcing `payload_len` bytes, and none of them.
pub async fn send_head(s: &mut (impl AsyncWrite + Unpin), id: u64, op: Op, payload_len: u64) {
    send_head_in_view(s, (id, 0), op, payload_len).await;
}

/// [`send_head`] of a request routed by view stamp `view`.
pub async fn send_head_in_view(
    s: &mut (impl AsyncWrite + Unpin),
    (id, view): (u64, u64),
    op: Op,
    payload_len: u64,
) {
    let mut exchange = Exchange::new();
    exchange.view = view;
    let out = exchange.request_as(id, op);
    s.write_all(&out.prefix(payload_len)).await.unwrap();
    s.write_all(&out.header).await.unwrap();
}

/// Sends a whole request: prefix, header and `payload`.
pub async fn send(s: &mut (impl AsyncWrite + Unpin), id: u64, op: Op, payload: &[u8]) {
    send_head(s, id, op, payload.len() as u64).await;
    s.write_all(payload).await.unwrap();
}

/// Reads one response, skipping its payload a piece at a time; None when the node closed the
/// connection. Panics when no reply starts within 10 s.
pub async fn recv(s: &mut (impl AsyncRead + Unpin)) -> Option<Response> {
    let mut prefix = [0u8; 16];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut prefix))
        .await
        .expect("reply in time")
        .ok()?;
    let p = FramePrefix::parse(&prefix, &Limits::default()).unwrap();
    let mut hdr = AlignedVec::<16>::new();
    hdr.resize(p.header_len as usize, 0);
    s.read_exact(&mut hdr).await.unwrap();
    let mut left = p.payload_len;
    let mut buf = vec![0u8; (64 << 10).min(left as usize)];
    while left > 0 {
        let take = left.min(buf.len() as u64) as usize;
        s.read_exact(&mut buf[..take]).await.unwrap();
        left -= take as u64;
    }
    Some(decode_response_owned(&hdr).unwrap())
}

/// Greets the node as client `client` (no token) and checks it answered `Hello`.
pub async fn hello(s: &mut (impl AsyncRead + AsyncWrite + Unpin), client: &str) {
    let op = Op::Hello {
        version: PROTOCOL_VERSION,
        token: String::new(),
        client: client.into(),
    };
    send(s, 1, op, &[]).await;
    let r = recv(s).await.expect("a reply to Hello");
    assert!(matches!(r.reply, Reply::Hello(_)), "{r:?}");
}

/// One request over a raw Unix connection, and its reply with the descriptors riding on it.
pub async fn unix_call(
    s: &mut tokio::net::UnixStream,
    id: u64,
    op: Op,
) -> (Reply, Vec<std::os::fd::OwnedFd>) {
    use std::os::fd::AsRawFd;
    send(s, id, op, &[]).await;
    let fds = loop {
        if let Some(fds) = kvpool::fdpass::peek_fds(s.as_raw_fd()).unwrap() {
            break fds;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let r = recv(s).await.expect("a reply");
    (r.reply, fds)
}

/// Greets the node over `s` with `token` and returns its `Hello` reply.
pub async fn hello_with(
    s: &mut (impl AsyncRead + AsyncWrite + Unpin),
    token: &str,
) -> kvpool::protocol::HelloInfo {
    let op = Op::Hello {
        version: PROTOCOL_VERSION,
        token: token.into(),
        client: "raw".into(),
    };
    send(s, 1, op, &[]).await;
    match recv(s).await.expect("a reply to Hello").reply {
        Reply::Hello(h) => h,
        other => panic!("{other:?}"),
    }
}
