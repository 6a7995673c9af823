//! The native protocol's decoders as a peer reaches them: a frame's prefix, then its header
//! read from the stream and validated (rkyv's bytecheck) as a request and as a response.
//!
//! Asserts: no panic; a prefix accepted is within the limits; the header buffer never holds
//! more than the bytes that arrived plus one read chunk, whatever length was announced; an
//! accepted header deserialises, and re-archiving it is stable (decode, encode, decode, encode
//! gives the same bytes); decoding allocates no more than a small multiple of the input.
#![no_main]

use kvpool::protocol::io::{read_header, read_prefix, HEADER_CHUNK};
use kvpool::protocol::{
    decode_request, decode_response, decode_response_owned, encode, AlignedVec, FramePrefix,
    Limits, Request, MAX_HELLO_HEADER, PREFIX_LEN,
};
use kvpool_fuzz::{block_on, peak, Counting};
use libfuzzer_sys::fuzz_target;
use rkyv::rancor;

#[global_allocator]
static ALLOC: Counting = Counting;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let hello = Limits {
        max_header: MAX_HELLO_HEADER,
        max_payload: 0,
        ..limits
    };
    for l in [limits, hello] {
        if let Some(p) = data.first_chunk::<PREFIX_LEN>() {
            if let Ok(p) = FramePrefix::parse(p, &l) {
                assert!(p.header_len >= 1 && p.header_len <= l.max_header);
                assert!(p.payload_len <= l.max_payload);
                assert_eq!(FramePrefix::parse(&p.encode(), &l), Ok(p));
            }
        }
        stream(data, &l);
    }
    header(data);
});

/// The input as a byte stream: prefix, then header, as the daemon's connection loop reads them.
fn stream(data: &[u8], limits: &Limits) {
    let mut r = data;
    let Ok(Some(prefix)) = block_on(read_prefix(&mut r, limits)) else {
        return;
    };
    let mut buf = AlignedVec::<16>::new();
    let read = block_on(read_header(&mut r, &prefix, &mut buf));
    let arrived = data.len() - PREFIX_LEN;
    assert!(
        buf.capacity() <= arrived + 2 * HEADER_CHUNK,
        "{} bytes held for {arrived} received",
        buf.capacity()
    );
    if read.is_ok() {
        assert_eq!(buf.len(), prefix.header_len as usize);
        header(&buf);
    }
}

/// One header, as a request and as a response.
fn header(data: &[u8]) {
    let mut aligned = AlignedVec::<16>::new();
    aligned.extend_from_slice(data);
    let before = aligned.len();
    let (_, held) = peak(|| {
        if let Ok(req) = decode_request(&aligned) {
            let owned: Request = rkyv::deserialize::<Request, rancor::Error>(req)
                .expect("a valid archive deserialises");
            let once = encode(&owned);
            let again: Request = rkyv::deserialize::<Request, rancor::Error>(
                decode_request(&once).expect("what we archive decodes"),
            )
            .expect("and deserialises");
            assert_eq!(again, owned);
            assert_eq!(&encode(&again)[..], &once[..]);
        }
        if decode_response(&aligned).is_ok() {
            let owned = decode_response_owned(&aligned).expect("a valid archive deserialises");
            let once = encode(&owned);
            let again = decode_response_owned(&once).expect("what we archive decodes");
            assert_eq!(&encode(&again)[..], &once[..]);
        }
    });
    // Deserialised values plus two re-archived copies: a few times the input, never more.
    assert!(
        held <= 32 * before + (64 << 10),
        "{held} bytes allocated decoding {before}"
    );
}
