//! The RESP command parser (kvpool::resp::Parser), as the daemon's RESP door drives it.
//!
//! The first input byte picks the limits (Redis's defaults, or small ones so every limit is
//! reached) and how the rest arrives: whole, or in pieces of varying size appended between
//! calls, as a socket delivers them. Asserts: no panic; pieces or whole, the same commands and
//! the same error come out; every command, re-encoded as a RESP array, parses back to the same
//! arguments (decode, encode, decode); what the parser reports of a pending bulk string is
//! within the buffer and the limits; parsing allocates no more than a multiple of the input.
#![no_main]

use kvpool::resp::{Parsed, Parser, RespError, RespLimits};
use kvpool_fuzz::{peak, Counting};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: Counting = Counting;

const SMALL: RespLimits = RespLimits {
    max_bulk: 64,
    max_args: 8,
    max_inline: 64,
    max_command: 256,
};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    let limits = match mode & 1 {
        0 => RespLimits::default(),
        _ => SMALL,
    };
    let (whole, held) = peak(|| parse_all(limits, input, None));
    assert!(
        held <= 64 * input.len() + 4096,
        "{held} bytes allocated parsing {}",
        input.len()
    );
    let pieces = parse_all(limits, input, Some(mode >> 1));
    assert_eq!(whole, pieces, "whole and in pieces disagree");
    for args in &whole.0 {
        let mut encoded = Vec::new();
        encoded.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            encoded.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            encoded.extend_from_slice(a);
            encoded.extend_from_slice(b"\r\n");
        }
        let again = parse_all(RespLimits::default(), &encoded, None);
        // An empty command (a blank line) re-encodes as `*0`, which parses to nothing too.
        assert_eq!(again.0.len(), 1, "{encoded:?}");
        assert_eq!(&again.0[0], args);
        assert_eq!(again.1, None);
    }
});

/// The commands parsed from `input` (each its arguments) and the error that ended it, if any.
/// `pieces`: deliver the input a few bytes at a time (sizes derived from the seed), calling
/// the parser after each, as a connection does; `None`: all at once.
fn parse_all(
    limits: RespLimits,
    input: &[u8],
    pieces: Option<u8>,
) -> (Vec<Vec<Vec<u8>>>, Option<RespError>) {
    let mut parser = Parser::new(limits);
    let mut commands = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut fed = 0;
    let mut step = pieces.map_or(input.len(), |s| s as usize % 7 + 1);
    loop {
        let more = step.min(input.len() - fed);
        buf.extend_from_slice(&input[fed..fed + more]);
        fed += more;
        step = pieces.map_or(step, |_| step * 3 % 11 + 1);
        loop {
            match parser.parse(&buf) {
                Ok(Parsed::Command { consumed }) => {
                    assert!(consumed > 0 && consumed <= buf.len());
                    let args: Vec<Vec<u8>> = parser.args(&buf).map(<[u8]>::to_vec).collect();
                    assert_eq!(args.len(), parser.len());
                    assert!(args.len() as u64 <= limits.max_args.max(1));
                    if !args.is_empty() {
                        commands.push(args);
                    }
                    buf.drain(..consumed);
                }
                Ok(Parsed::Incomplete { need }) => {
                    assert!(need >= 1);
                    if let Some(p) = parser.pending_bulk() {
                        assert!(p.start <= buf.len() && p.index as u64 <= p.args);
                        assert!(p.len as u64 <= limits.max_bulk);
                    }
                    break;
                }
                Err(e) => return (commands, Some(e)),
            }
        }
        if fed == input.len() {
            return (commands, None);
        }
    }
}
