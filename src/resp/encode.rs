//! Replies, appended to a caller's buffer. Large values are not copied here: the daemon writes
//! [`bulk_header`], then the object's bytes straight from the pool, then [`CRLF`].

use super::Proto;

/// The line terminator.
pub const CRLF: &[u8] = b"\r\n";

/// `+<s>`: a simple string (`s` must not hold CR or LF; the callers' are constants).
pub fn simple(out: &mut Vec<u8>, s: &str) {
    out.push(b'+');
    out.extend_from_slice(s.as_bytes());
    out.extend_from_slice(CRLF);
}

/// `+OK`.
pub fn ok(out: &mut Vec<u8>) {
    out.extend_from_slice(b"+OK\r\n");
}

/// `-<msg>`: an error. `msg` starts with its code (`ERR`, `WRONGPASS`, ...); CR and LF in it
/// (a key echoed back, say) become spaces so the reply stays one line.
pub fn error(out: &mut Vec<u8>, msg: &str) {
    out.push(b'-');
    out.extend(
        msg.bytes()
            .map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
    );
    out.extend_from_slice(CRLF);
}

/// `:<n>`: an integer.
pub fn integer(out: &mut Vec<u8>, n: i64) {
    out.push(b':');
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(CRLF);
}

/// `$<len>\r\n`: the header of a bulk string whose `len` bytes and CRLF follow.
pub fn bulk_header(out: &mut Vec<u8>, len: usize) {
    out.push(b'$');
    out.extend_from_slice(len.to_string().as_bytes());
    out.extend_from_slice(CRLF);
}

/// `$<len>\r\n<bytes>\r\n`: a bulk string, copied.
pub fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    bulk_header(out, bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(CRLF);
}

/// A null: `$-1` in RESP2 (what a missing key's GET answers), `_` in RESP3.
pub fn null(out: &mut Vec<u8>, proto: Proto) {
    out.extend_from_slice(match proto {
        Proto::Resp2 => b"$-1\r\n",
        Proto::Resp3 => b"_\r\n",
    });
}

/// `*<n>`: the header of an array of `n` elements that follow.
pub fn array(out: &mut Vec<u8>, n: usize) {
    out.push(b'*');
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(CRLF);
}

/// The header of a map of `n` pairs that follow: `%<n>` in RESP3, an array of `2n` in RESP2.
pub fn map(out: &mut Vec<u8>, n: usize, proto: Proto) {
    match proto {
        Proto::Resp2 => array(out, 2 * n),
        Proto::Resp3 => {
            out.push(b'%');
            out.extend_from_slice(n.to_string().as_bytes());
            out.extend_from_slice(CRLF);
        }
    }
}

/// A command as clients send it: an array of bulk strings (for tests and tools).
pub fn command<A: AsRef<[u8]>>(out: &mut Vec<u8>, args: &[A]) {
    array(out, args.len());
    for a in args {
        bulk(out, a.as_ref());
    }
}
