//! One connection of the native protocol, server side, from its first byte: the handshake gate
//! (`Hello`: version, token), then every operation a client may send, through the daemon's own
//! connection loop (kvpool-server's `handler::serve`) over a fresh one-node pool.
//!
//! The first input byte picks the opening: raw (the handshake is the fuzzer's to get right),
//! or a valid `Hello` with the node's token or a namespace's token sent ahead of the rest, so
//! the operations behind the gate are reached too. The rest is the byte stream as sent.
//!
//! Asserts: no panic; everything the node writes back is a sequence of well-formed response
//! frames; serving allocates no more than a multiple of the input plus the connection's fixed
//! buffers, whatever lengths the frames announce.
#![no_main]

use kvpool::protocol::{
    decode_response_owned, AlignedVec, Exchange, FramePrefix, Limits, Op, PREFIX_LEN,
    PROTOCOL_VERSION,
};
use kvpool_fuzz::{peak, Counting};
use kvpool_server::fuzzing::{Harness, NODE_TOKEN, TEAM_TOKEN};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: Counting = Counting;

fuzz_target!(|data: &[u8]| {
    let Some((&opening, rest)) = data.split_first() else {
        return;
    };
    let mut input = match opening % 3 {
        0 => Vec::new(),
        1 => hello(NODE_TOKEN),
        _ => hello(TEAM_TOKEN),
    };
    input.extend_from_slice(rest);
    let harness = Harness::new();
    let (out, held) = peak(|| harness.serve(&input));
    // The connection's read and write buffers (64 KiB each), a header chunk, replies: a few MiB
    // at most, plus what the input itself makes the node store (in its index, not its pool).
    assert!(
        held <= 16 * input.len() + (8 << 20),
        "{held} bytes allocated serving {} bytes",
        input.len()
    );
    check_replies(&out);
});

/// A `Hello` frame with `token`.
fn hello(token: &str) -> Vec<u8> {
    let hello = Op::Hello {
        version: PROTOCOL_VERSION,
        token: token.into(),
        client: "fuzz".into(),
    };
    Exchange::new().request(hello).frame(&[])
}

/// Every reply is a frame a client accepts: a valid prefix, a header that decodes, its payload.
fn check_replies(mut out: &[u8]) {
    let limits = Limits::default();
    while !out.is_empty() {
        let prefix = out.first_chunk::<PREFIX_LEN>().expect("a whole prefix");
        let p = FramePrefix::parse(prefix, &limits).expect("a valid prefix");
        let header_end = PREFIX_LEN + p.header_len as usize;
        let mut header = AlignedVec::<16>::new();
        header.extend_from_slice(&out[PREFIX_LEN..header_end]);
        decode_response_owned(&header).expect("a reply header decodes");
        let end = header_end + usize::try_from(p.payload_len).expect("a payload that fits");
        assert!(end <= out.len(), "a reply cut short");
        out = &out[end..];
    }
}
