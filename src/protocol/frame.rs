//! Frames: a fixed 16-byte prefix, an rkyv-archived header, raw payload bytes.
//!
//! ```text
//! magic "KVP1" (4) | header_len u32 LE (4) | payload_len u64 LE (8) | header | payload
//! ```

use rkyv::rancor;
use rkyv::util::AlignedVec;
use thiserror::Error;

use super::message::{ArchivedRequest, ArchivedResponse};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVP1";
/// Length of the fixed prefix.
pub const PREFIX_LEN: usize = 16;

/// Largest header a node accepts before the handshake (a `Hello`: a version, a token and a
/// client name), bytes: 64 KiB. Until a peer has authenticated, that is all it may make the
/// node buffer.
pub const MAX_HELLO_HEADER: u32 = 64 << 10;

/// Hard limits on what a peer may send. Defaults suit KV blocks and weight chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest header, bytes. Default 8 MiB: the largest batch request (`max_batch` items with
    /// keys of `MAX_KEY_LEN` bytes, about 4.5 MiB archived) fits with room to spare. Readers
    /// grow the header buffer with the bytes that actually arrive, never to the announced
    /// length up front.
    pub max_header: u32,
    /// Largest payload, bytes. Default 1 GiB. Payloads are streamed into segment memory or
    /// caller buffers, never buffered whole on the heap.
    pub max_payload: u64,
    /// Most items in one batch. Default 16 384.
    pub max_batch: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header: 8 << 20,
            max_payload: 1 << 30,
            max_batch: 16_384,
        }
    }
}

/// Why a frame was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    /// The prefix does not start with [`MAGIC`]: not our protocol, or a desynchronised stream.
    #[error("bad frame magic")]
    BadMagic,
    /// The header is larger than `max_header`.
    #[error("header of {0} bytes exceeds the limit")]
    HeaderTooLarge(u32),
    /// The payload is larger than `max_payload`.
    #[error("payload of {0} bytes exceeds the limit")]
    PayloadTooLarge(u64),
    /// The header failed validation.
    #[error("malformed header: {0}")]
    Malformed(String),
}

/// The fixed prefix of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FramePrefix {
    /// Length of the archived header.
    pub header_len: u32,
    /// Length of the raw payload.
    pub payload_len: u64,
}

impl FramePrefix {
    /// Encodes the prefix.
    pub fn encode(&self) -> [u8; PREFIX_LEN] {
        let mut b = [0u8; PREFIX_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&self.header_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parses and checks a prefix against `limits`, before anything else of the frame is read.
    pub fn parse(b: &[u8; PREFIX_LEN], limits: &Limits) -> Result<FramePrefix, FrameError> {
        if b[0..4] != MAGIC {
            return Err(FrameError::BadMagic);
        }
        let header_len = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        let payload_len = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        if header_len == 0 || header_len > limits.max_header {
            return Err(FrameError::HeaderTooLarge(header_len));
        }
        if payload_len > limits.max_payload {
            return Err(FrameError::PayloadTooLarge(payload_len));
        }
        Ok(FramePrefix {
            header_len,
            payload_len,
        })
    }
}

/// Archives a request or response header.
pub fn encode<T>(value: &T) -> AlignedVec
where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    rkyv::to_bytes::<rancor::Error>(value).expect("archiving into memory cannot fail")
}

/// Validates and views an archived request (the bytes must be 16-byte aligned: read them into
/// an [`AlignedVec`]).
pub fn decode_request(bytes: &[u8]) -> Result<&ArchivedRequest, FrameError> {
    rkyv::access::<ArchivedRequest, rancor::Error>(bytes)
        .map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Validates and views an archived response.
pub fn decode_response(bytes: &[u8]) -> Result<&ArchivedResponse, FrameError> {
    rkyv::access::<ArchivedResponse, rancor::Error>(bytes)
        .map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Validates an archived response and deserialises it (response headers are small).
pub fn decode_response_owned(bytes: &[u8]) -> Result<super::message::Response, FrameError> {
    let a = decode_response(bytes)?;
    rkyv::deserialize::<super::message::Response, rancor::Error>(a)
        .map_err(|e| FrameError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{ArchivedOp, Op, Request};

    #[test]
    fn archived_headers_keep_the_size_older_peers_decode() {
        // rkyv finds the root of an archive at the end of the buffer by its size: a Request or
        // Response of another size would be misread by a node of an older version the
        // handshake still accepts (MIN_PROTOCOL_VERSION).
        use crate::protocol::{ArchivedRequest, ArchivedResponse};
        assert_eq!(std::mem::size_of::<ArchivedRequest>(), 112);
        assert_eq!(std::mem::size_of::<ArchivedResponse>(), 128);
    }

    #[test]
    fn prefix_checks_magic_and_limits() {
        let l = Limits::default();
        let p = FramePrefix {
            header_len: 100,
            payload_len: 5,
        };
        assert_eq!(FramePrefix::parse(&p.encode(), &l), Ok(p));
        let mut bad = p.encode();
        bad[0] = b'X';
        assert_eq!(FramePrefix::parse(&bad, &l), Err(FrameError::BadMagic));
        let big = FramePrefix {
            header_len: l.max_header + 1,
            payload_len: 0,
        };
        assert!(matches!(
            FramePrefix::parse(&big.encode(), &l),
            Err(FrameError::HeaderTooLarge(_))
        ));
        let zero = FramePrefix {
            header_len: 0,
            payload_len: 0,
        };
        assert!(FramePrefix::parse(&zero.encode(), &l).is_err());
        let huge = FramePrefix {
            header_len: 10,
            payload_len: u64::MAX,
        };
        assert!(matches!(
            FramePrefix::parse(&huge.encode(), &l),
            Err(FrameError::PayloadTooLarge(_))
        ));
    }

    #[test]
    fn request_round_trips_and_garbage_is_rejected() {
        let r = Request {
            id: 42,
            view: 0,
            priority: crate::protocol::Priority::Normal as u8,
            deadline_us: 0,
            op: Op::Get {
                ns: 3,
                key: b"abc".to_vec(),
            },
        };
        let bytes = encode(&r);
        let a = decode_request(&bytes).unwrap();
        assert_eq!(a.id.to_native(), 42);
        match &a.op {
            ArchivedOp::Get { ns, key } => {
                assert_eq!(ns.to_native(), 3);
                assert_eq!(key.as_slice(), b"abc");
            }
            _ => panic!("wrong op"),
        }
        let mut aligned = AlignedVec::<16>::new();
        aligned.extend_from_slice(&[0xff; 64]);
        assert!(decode_request(&aligned).is_err());
    }

    /// The default header limit holds the largest batch a client may send: `max_batch` items,
    /// every key `MAX_KEY_LEN` bytes long, in every batch request shape.
    #[test]
    fn a_full_batch_of_longest_keys_fits_the_header_limit() {
        use crate::protocol::{AllocItem, PutItem};
        let l = Limits::default();
        let n = l.max_batch as usize;
        let key = || vec![0xa5u8; crate::MAX_KEY_LEN];
        let ops = [
            Op::BatchPut {
                ns: u32::MAX,
                items: (0..n)
                    .map(|_| PutItem {
                        key: key(),
                        len: u64::MAX,
                        checksum: u64::MAX,
                    })
                    .collect(),
                pin: true,
                depths: vec![u32::MAX; n],
            },
            Op::Alloc {
                ns: u32::MAX,
                items: (0..n)
                    .map(|_| AllocItem {
                        key: key(),
                        len: u64::MAX,
                    })
                    .collect(),
                pin: true,
                depths: vec![u32::MAX; n],
            },
            Op::BatchGet {
                ns: u32::MAX,
                keys: (0..n).map(|_| key()).collect(),
                prefix: true,
            },
            Op::Lookup {
                ns: u32::MAX,
                keys: (0..n).map(|_| key()).collect(),
                lease_ms: u64::MAX,
            },
        ];
        for op in ops {
            let bytes = encode(&Request {
                id: u64::MAX,
                view: u64::MAX,
                priority: crate::protocol::Priority::Normal as u8,
                deadline_us: 0,
                op,
            });
            assert!(
                bytes.len() <= l.max_header as usize,
                "a full batch archives to {} bytes, over the {} byte limit",
                bytes.len(),
                l.max_header
            );
            let prefix = FramePrefix {
                header_len: bytes.len() as u32,
                payload_len: 0,
            };
            assert_eq!(FramePrefix::parse(&prefix.encode(), &l), Ok(prefix));
        }
        assert!(MAX_HELLO_HEADER < l.max_header);
    }

    /// The largest `Scan` page a node sends (`max_batch` keys of the longest length) fits the
    /// default header limit too, so a reader with the node's own limits can take it.
    #[test]
    fn a_full_scan_page_of_longest_keys_fits_the_header_limit() {
        use crate::protocol::{Reply, Response};
        let l = Limits::default();
        let keys = vec![vec![0xa5u8; crate::MAX_KEY_LEN]; l.max_batch as usize];
        let bytes = encode(&Response {
            id: u64::MAX,
            reply: Reply::Keys {
                keys,
                cursor: u64::MAX,
            },
        });
        assert!(
            bytes.len() <= l.max_header as usize,
            "{} bytes",
            bytes.len()
        );
    }

    fn sample_requests() -> Vec<Request> {
        use crate::protocol::{CommitItem, PutItem};
        let place = crate::addr::Place {
            incarnation: 77,
            segment: 0,
            offset: 512,
            len: 100,
            generation: 9,
        };
        let addr = crate::addr::MacKey::new([3; 16]).address(crate::NodeId(1), place);
        vec![
            Request {
                id: 1,
                view: 0,
                priority: crate::protocol::Priority::Normal as u8,
                deadline_us: 0,
                op: Op::Hello {
                    version: 1,
                    token: "t".into(),
                    client: "c".into(),
                },
            },
            Request {
                id: 2,
                view: 0,
                priority: crate::protocol::Priority::Normal as u8,
                deadline_us: 0,
                op: Op::BatchPut {
                    ns: 0,
                    items: vec![PutItem {
                        key: b"k".to_vec(),
                        len: 3,
                        checksum: 7,
                    }],
                    pin: true,
                    depths: vec![3],
                },
            },
            Request {
                id: 3,
                view: 0,
                priority: crate::protocol::Priority::Normal as u8,
                deadline_us: 0,
                op: Op::Exists {
                    ns: 1,
                    keys: vec![b"a".to_vec(), b"bb".to_vec()],
                },
            },
            Request {
                id: 4,
                view: 0,
                priority: crate::protocol::Priority::Normal as u8,
                deadline_us: 0,
                op: Op::Commit {
                    items: vec![CommitItem { addr, checksum: 1 }],
                },
            },
            Request {
                id: 5,
                view: 0,
                priority: crate::protocol::Priority::Normal as u8,
                deadline_us: 0,
                op: Op::Read {
                    addr,
                    offset: 0,
                    len: 10,
                },
            },
        ]
    }

    proptest::proptest! {
        /// Arbitrary bytes never make the decoders panic.
        #[test]
        fn random_bytes_are_rejected_or_decoded_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let mut aligned = AlignedVec::<16>::new();
            aligned.extend_from_slice(&bytes);
            let _ = decode_request(&aligned);
            let _ = decode_response(&aligned);
            if bytes.len() >= PREFIX_LEN {
                let p: [u8; PREFIX_LEN] = bytes[..PREFIX_LEN].try_into().unwrap();
                if let Ok(p) = FramePrefix::parse(&p, &Limits::default()) {
                    proptest::prop_assert!(p.header_len <= Limits::default().max_header);
                    proptest::prop_assert!(p.payload_len <= Limits::default().max_payload);
                }
            }
        }

        /// Valid frames with bytes flipped, truncated or extended never make the decoder
        /// panic, and whatever it accepts is a well-formed request.
        #[test]
        fn mutated_frames_never_panic(which in 0usize..5, flips in proptest::collection::vec((proptest::num::usize::ANY, proptest::num::u8::ANY), 1..8), cut in proptest::num::usize::ANY) {
            let bytes = encode(&sample_requests()[which]);
            let mut v = bytes.to_vec();
            for (pos, val) in flips {
                let n = v.len();
                v[pos % n] ^= val;
            }
            let keep = cut % (v.len() + 1);
            let mut aligned = AlignedVec::<16>::new();
            aligned.extend_from_slice(&v[..keep]);
            if let Ok(r) = decode_request(&aligned) {
                let owned: Result<Request, rancor::Error> = rkyv::deserialize(r);
                proptest::prop_assert!(owned.is_ok());
            }
        }
    }
}
