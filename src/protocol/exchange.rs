//! The native exchange, without I/O: where every speaker of the protocol (the client, a node's
//! links to its peers, the fuzz harness, the tests' raw frames) builds its requests and judges
//! the replies. The speaker's shell moves the bytes; this module decides what they say.
//!
//! A request gets its id, the view stamp it is routed by and its class (bulk priority and
//! deadline) here and nowhere else ([`Exchange::request`]). A reply is judged into an
//! [`Outcome`]: the node's answer, a miss, a refusal because the request was routed by another
//! cluster view, or a refusal with a code ([`judge`]).

use thiserror::Error;

use super::codes::ErrorCode;
use super::frame::{encode, FramePrefix};
use super::message::{Op, Priority, Reply, Request, Response};
use rkyv::util::AlignedVec;

/// What a request says about its urgency: its bulk priority and its deadline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Class {
    /// Its turn among bulk transfers on the node.
    pub priority: Priority,
    /// Microseconds the sender waits for the reply, from when the node has read the header;
    /// 0: none.
    pub deadline_us: u64,
}

/// The sending side of one connection: the ids it has handed out, the view stamp and class
/// its next requests carry.
#[derive(Clone, Debug)]
pub struct Exchange {
    next_id: u64,
    /// The [`crate::placement::ClusterView::stamp`] the next requests are routed by; 0: sent to
    /// this node on purpose. Default 0.
    pub view: u64,
    /// The class the next requests carry. Default: `Normal` priority, no deadline.
    pub class: Class,
}

impl Default for Exchange {
    fn default() -> Self {
        Exchange::new()
    }
}

impl Exchange {
    /// An exchange whose first request gets id 1, routed by no view, of the default class.
    pub fn new() -> Exchange {
        Exchange {
            next_id: 1,
            view: 0,
            class: Class::default(),
        }
    }

    /// This exchange, its requests of class `class`.
    pub fn with_class(mut self, class: Class) -> Exchange {
        self.class = class;
        self
    }

    /// The id the next request will get.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }

    /// The next request: `op` with a fresh id, this exchange's view stamp and class.
    pub fn request(&mut self, op: Op) -> Outgoing {
        let id = self.next_id;
        self.next_id += 1;
        self.request_as(id, op)
    }

    /// `op` as request `id`, with this exchange's view stamp and class: for a speaker that
    /// chooses its ids itself (a test that sends a stale or repeated id, the fuzz harness).
    /// The exchange's own ids are not advanced.
    pub fn request_as(&self, id: u64, op: Op) -> Outgoing {
        let header = encode(&Request {
            id,
            view: self.view,
            priority: self.class.priority as u8,
            deadline_us: self.class.deadline_us,
            op,
        });
        Outgoing { id, header }
    }
}

/// One request, built: its id (the reply echoes it) and its archived header.
#[derive(Debug)]
pub struct Outgoing {
    /// The request's id.
    pub id: u64,
    /// The archived header, to follow the frame's prefix.
    pub header: AlignedVec,
}

impl Outgoing {
    /// The frame's prefix for a payload of `payload_len` bytes.
    pub fn prefix(&self, payload_len: u64) -> [u8; super::frame::PREFIX_LEN] {
        FramePrefix {
            header_len: self.header.len() as u32,
            payload_len,
        }
        .encode()
    }

    /// The whole frame with `payload`, in one buffer: prefix, header, payload.
    pub fn frame(&self, payload: &[u8]) -> Vec<u8> {
        let mut f =
            Vec::with_capacity(super::frame::PREFIX_LEN + self.header.len() + payload.len());
        f.extend_from_slice(&self.prefix(payload.len() as u64));
        f.extend_from_slice(&self.header);
        f.extend_from_slice(payload);
        f
    }
}

/// What a reply says about its request.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The node did what was asked; its answer (never `Error` nor `Miss`). A payload the frame
    /// carries belongs to it.
    Done(Reply),
    /// The key is not there (`Reply::Miss`): the most common answer of a cache, not a failure.
    Miss,
    /// Refused because the request was routed by another cluster view than the node's
    /// (`WrongView`): fetch the view and route again.
    Moved {
        /// The node's view version, when its message names it.
        version: Option<u64>,
        /// The node's words.
        message: String,
    },
    /// Refused with a code (anything but `WrongView`).
    Refused {
        /// Why.
        code: ErrorCode,
        /// The node's words.
        message: String,
    },
}

impl Outcome {
    /// The outcome a reply means.
    pub fn of(reply: Reply) -> Outcome {
        match reply {
            Reply::Miss => Outcome::Miss,
            Reply::Error { code, message } => match ErrorCode::from_u16(code) {
                ErrorCode::WrongView => Outcome::Moved {
                    version: version_in(&message),
                    message,
                },
                code => Outcome::Refused { code, message },
            },
            reply => Outcome::Done(reply),
        }
    }

    /// The answer of `Done`, or the refusal's code and the node's words (`WrongView` for
    /// `Moved`, `NotFound` for a miss): for a speaker to whom a miss is no answer.
    pub fn into_result(self) -> Result<Reply, (ErrorCode, String)> {
        match self {
            Outcome::Done(reply) => Ok(reply),
            Outcome::Miss => Err((ErrorCode::NotFound, "no such key".into())),
            Outcome::Moved { message, .. } => Err((ErrorCode::WrongView, message)),
            Outcome::Refused { code, message } => Err((code, message)),
        }
    }
}

/// A frame that is no reply to the request it was read for.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ExchangeError {
    /// It answers another request: the stream is out of step.
    #[error("response {got} for request {want}")]
    OtherRequest {
        /// The id the reply carries.
        got: u64,
        /// The id of the request it was read for.
        want: u64,
    },
}

/// Judges `response`, read for request `want`. A node that could not read a request's id
/// answers its error with id 0, which is taken as this request's.
pub fn judge(want: u64, response: Response) -> Result<Outcome, ExchangeError> {
    let Response { id, reply } = response;
    if id != want && !(id == 0 && matches!(reply, Reply::Error { .. })) {
        return Err(ExchangeError::OtherRequest { got: id, want });
    }
    Ok(Outcome::of(reply))
}

/// The view version a `WrongView` message ends with ("… this node is at version 12").
fn version_in(message: &str) -> Option<u64> {
    let digits = message
        .trim_end()
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()?;
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_request, decode_response_owned, FramePrefix, Limits};

    #[test]
    fn requests_get_fresh_ids_the_view_stamp_and_the_class() {
        let mut x = Exchange::new().with_class(Class {
            priority: Priority::High,
            deadline_us: 500,
        });
        x.view = 77;
        let a = x.request(Op::Stats);
        let b = x.request(Op::View);
        assert_eq!((a.id, b.id, x.next_id()), (1, 2, 3));
        let r = decode_request(&b.header).unwrap();
        assert_eq!(r.id.to_native(), 2);
        assert_eq!(r.view.to_native(), 77);
        assert_eq!(r.priority, Priority::High as u8);
        assert_eq!(r.deadline_us.to_native(), 500);
    }

    #[test]
    fn a_request_of_a_chosen_id_leaves_the_ids_alone() {
        let x = Exchange::new();
        let out = x.request_as(9, Op::Stats);
        assert_eq!(out.id, 9);
        assert_eq!(x.next_id(), 1);
    }

    #[test]
    fn a_frame_is_prefix_header_payload() {
        let out = Exchange::new().request(Op::Stats);
        let f = out.frame(b"xyz");
        let p = FramePrefix::parse(&f[..16].try_into().unwrap(), &Limits::default()).unwrap();
        assert_eq!(p.header_len as usize, out.header.len());
        assert_eq!(p.payload_len, 3);
        assert_eq!(&f[16..16 + out.header.len()], &out.header[..]);
        assert_eq!(&f[16 + out.header.len()..], b"xyz");
    }

    #[test]
    fn replies_are_judged_into_outcomes() {
        let judged = |reply| judge(4, Response { id: 4, reply }).unwrap();
        assert_eq!(judged(Reply::Miss), Outcome::Miss);
        assert_eq!(judged(Reply::Done), Outcome::Done(Reply::Done));
        assert_eq!(
            judged(Reply::Error {
                code: ErrorCode::WrongView as u16,
                message: "routed by another cluster view; this node is at version 12".into(),
            }),
            Outcome::Moved {
                version: Some(12),
                message: "routed by another cluster view; this node is at version 12".into(),
            }
        );
        assert_eq!(
            judged(Reply::Error {
                code: ErrorCode::PoolFull as u16,
                message: "full".into(),
            }),
            Outcome::Refused {
                code: ErrorCode::PoolFull,
                message: "full".into(),
            }
        );
    }

    #[test]
    fn a_reply_to_another_request_is_out_of_step_unless_it_is_an_unread_ones_error() {
        let other = Response {
            id: 5,
            reply: Reply::Done,
        };
        assert_eq!(
            judge(4, other),
            Err(ExchangeError::OtherRequest { got: 5, want: 4 })
        );
        let unread = Response {
            id: 0,
            reply: Reply::Error {
                code: ErrorCode::Malformed as u16,
                message: "bad".into(),
            },
        };
        assert!(matches!(
            judge(4, unread),
            Ok(Outcome::Refused {
                code: ErrorCode::Malformed,
                ..
            })
        ));
        let unasked = Response {
            id: 0,
            reply: Reply::Done,
        };
        assert!(judge(4, unasked).is_err());
    }

    #[test]
    fn a_miss_round_trips_the_wire() {
        let hdr = encode(&Response {
            id: 3,
            reply: Reply::Miss,
        });
        let r = decode_response_owned(&hdr).unwrap();
        assert_eq!(judge(3, r), Ok(Outcome::Miss));
    }

    #[test]
    fn a_version_is_read_off_the_end_of_a_message_or_not_at_all() {
        assert_eq!(version_in("at version 40"), Some(40));
        assert_eq!(version_in("no number"), None);
        assert_eq!(version_in(""), None);
    }
}
