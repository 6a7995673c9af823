use proptest::prelude::*;

use super::encode;
use super::*;

/// Every command in `bytes`, fed whole; the error that stopped it, if any.
fn parse_all(limits: RespLimits, bytes: &[u8]) -> (Vec<Vec<Vec<u8>>>, Option<RespError>, usize) {
    let mut p = Parser::new(limits);
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        match p.parse(&bytes[at..]) {
            Ok(Parsed::Command { consumed }) => {
                out.push(p.args(&bytes[at..]).map(<[u8]>::to_vec).collect());
                at += consumed;
            }
            Ok(Parsed::Incomplete { need }) => {
                assert!(need >= 1);
                return (out, None, at);
            }
            Err(e) => return (out, Some(e), at),
        }
    }
}

/// The same, fed one byte at a time into a growing buffer, as a slow socket would.
fn parse_bytewise(limits: RespLimits, bytes: &[u8]) -> (Vec<Vec<Vec<u8>>>, Option<RespError>) {
    let mut p = Parser::new(limits);
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for &b in bytes {
        buf.push(b);
        loop {
            match p.parse(&buf) {
                Ok(Parsed::Command { consumed }) => {
                    out.push(p.args(&buf).map(<[u8]>::to_vec).collect());
                    buf.drain(..consumed);
                }
                Ok(Parsed::Incomplete { .. }) => break,
                Err(e) => return (out, Some(e)),
            }
        }
    }
    (out, None)
}

fn cmd(args: &[&[u8]]) -> Vec<u8> {
    let mut v = Vec::new();
    encode::command(&mut v, args);
    v
}

#[test]
fn array_commands_pipelined() {
    let mut bytes = cmd(&[b"SET", b"k\r\n", b"v\x00\xff"]);
    bytes.extend(cmd(&[b"GET", b"k\r\n"]));
    let (cmds, err, at) = parse_all(RespLimits::default(), &bytes);
    assert_eq!(err, None);
    assert_eq!(at, bytes.len());
    assert_eq!(
        cmds,
        vec![
            vec![b"SET".to_vec(), b"k\r\n".to_vec(), b"v\x00\xff".to_vec()],
            vec![b"GET".to_vec(), b"k\r\n".to_vec()]
        ]
    );
}

#[test]
fn inline_commands_with_quotes() {
    let bytes = b"PING\r\nset \"a b\" 'c\\'d' \"\\x41\\n\"\nget  x\r\n\r\n";
    let (cmds, err, _) = parse_all(RespLimits::default(), bytes);
    assert_eq!(err, None);
    assert_eq!(
        cmds,
        vec![
            vec![b"PING".to_vec()],
            vec![
                b"set".to_vec(),
                b"a b".to_vec(),
                b"c'd".to_vec(),
                b"A\n".to_vec()
            ],
            vec![b"get".to_vec(), b"x".to_vec()],
            vec![],
        ]
    );
    let (_, err, _) = parse_all(RespLimits::default(), b"set \"abc\r\n");
    assert_eq!(err, Some(RespError::UnbalancedQuotes));
    let (_, err, _) = parse_all(RespLimits::default(), b"set \"a\"b\r\n");
    assert_eq!(err, Some(RespError::UnbalancedQuotes));
}

#[test]
fn empty_and_null_arrays_are_no_commands() {
    let (cmds, err, at) = parse_all(RespLimits::default(), b"*0\r\n*-1\r\n");
    assert_eq!(err, None);
    assert_eq!(at, 9);
    assert_eq!(cmds, vec![Vec::<Vec<u8>>::new(), vec![]]);
}

#[test]
fn limits_are_enforced_before_any_allocation() {
    let l = RespLimits {
        max_bulk: 10,
        max_args: 3,
        max_inline: 16,
        max_command: 40,
    };
    let cases: &[(&[u8], RespError)] = &[
        (b"*4\r\n", RespError::InvalidMultibulkLength),
        (b"*x\r\n", RespError::InvalidMultibulkLength),
        (b"*1\r\n$11\r\n", RespError::InvalidBulkLength),
        (b"*1\r\n$-1\r\n", RespError::InvalidBulkLength),
        (b"*1\r\n$01\r\n", RespError::InvalidBulkLength),
        (b"*1\r\n+OK\r\n", RespError::ExpectedBulk(b'+')),
        (b"*1\r\n$1\r\nab\r\n", RespError::UnterminatedBulk),
        (
            b"*3\r\n$10\r\n0123456789\r\n$10\r\n0123456789\r\n$10\r\n",
            RespError::CommandTooLarge,
        ),
        (b"this inline line is too long", RespError::TooBigInline),
        (
            b"*1\r\n$99999999999999999999999999999999999",
            RespError::TooBigCount,
        ),
        (
            b"*99999999999999999999\r\n",
            RespError::InvalidMultibulkLength,
        ),
    ];
    for (bytes, want) in cases {
        let (_, err, _) = parse_all(l, bytes);
        assert_eq!(err, Some(*want), "{:?}", String::from_utf8_lossy(bytes));
    }
    // A declared 512 MiB bulk is only a promise: nothing is reserved for it.
    let mut p = Parser::new(RespLimits::default());
    let r = p.parse(b"*2\r\n$3\r\nGET\r\n$536870912\r\n");
    assert_eq!(r, Ok(Parsed::Incomplete { need: 536_870_914 }));
}

/// Found by the `resp` fuzz target (fuzz/): an inline command of more words than `max_args`
/// was accepted whole, though `max_args` bounds every command's arguments. Its input, as found.
#[test]
fn an_inline_command_is_held_to_max_args() {
    let l = RespLimits {
        max_bulk: 64,
        max_args: 8,
        max_inline: 64,
        max_command: 256,
    };
    let found = b"\xff\xff\xff\xff\x00\x0c\xcf\xff\xdf\x0b\x30\x13\xb0\x47\x00\x00\x34\x47\x0d\xff\xff\xff\x40\xff\xff\x09\x00\x0c\xcf\xff\xff\x0b\x35\x3b\x20\x31\x0d\x0e\x34\x47\x0d\x0a";
    let (cmds, err) = parse_bytewise(l, found);
    assert!(cmds.iter().all(|c| c.len() <= 8), "{cmds:?}");
    assert_eq!(err, Some(RespError::TooManyInlineArgs));
    let (cmds, err, _) = parse_all(l, b"a b c d e f g h\r\na b c d e f g h i\r\n");
    assert_eq!(cmds.len(), 1);
    assert_eq!(err, Some(RespError::TooManyInlineArgs));
}

#[test]
fn error_lines_stay_one_line() {
    let e = RespError::ExpectedBulk(b'\n').to_string();
    assert!(!e.contains('\n'));
    let mut out = Vec::new();
    encode::error(&mut out, "ERR bad key 'a\r\nb'");
    assert_eq!(out, b"-ERR bad key 'a  b'\r\n");
}

#[test]
fn encoders_write_the_exact_bytes() {
    let mut out = Vec::new();
    encode::ok(&mut out);
    encode::integer(&mut out, 0);
    encode::integer(&mut out, -3);
    encode::null(&mut out, Proto::Resp2);
    encode::null(&mut out, Proto::Resp3);
    encode::bulk(&mut out, b"a\r\n");
    encode::map(&mut out, 2, Proto::Resp2);
    encode::map(&mut out, 2, Proto::Resp3);
    assert_eq!(
        out,
        b"+OK\r\n:0\r\n:-3\r\n$-1\r\n_\r\n$3\r\na\r\n\r\n*4\r\n%2\r\n"
    );
}

fn args_strategy() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 1..6)
}

proptest! {
    /// Commands encoded as clients send them parse back to the same arguments, whole or fed
    /// a byte at a time.
    #[test]
    fn round_trip(cmds in prop::collection::vec(args_strategy(), 1..5)) {
        let mut bytes = Vec::new();
        for c in &cmds {
            encode::command(&mut bytes, c);
        }
        let (whole, err, at) = parse_all(RespLimits::default(), &bytes);
        prop_assert_eq!(err, None);
        prop_assert_eq!(at, bytes.len());
        prop_assert_eq!(&whole, &cmds);
        let (pieces, err) = parse_bytewise(RespLimits::default(), &bytes);
        prop_assert_eq!(err, None);
        prop_assert_eq!(&pieces, &cmds);
    }

    /// Splitting a stream at any byte gives the same commands and the same error as feeding
    /// it whole.
    #[test]
    fn split_anywhere_same_result(
        cmds in prop::collection::vec(args_strategy(), 1..4),
        tail in prop::collection::vec(any::<u8>(), 0..24),
        split in any::<prop::sample::Index>(),
    ) {
        let mut bytes = Vec::new();
        for c in &cmds {
            encode::command(&mut bytes, c);
        }
        bytes.extend_from_slice(&tail);
        let (whole, werr, _) = parse_all(RespLimits::default(), &bytes);
        let at = split.index(bytes.len() + 1);
        let mut p = Parser::new(RespLimits::default());
        let mut buf = bytes[..at].to_vec();
        let mut got = Vec::new();
        let mut err = None;
        let mut fed_rest = false;
        loop {
            match p.parse(&buf) {
                Ok(Parsed::Command { consumed }) => {
                    got.push(p.args(&buf).map(<[u8]>::to_vec).collect::<Vec<_>>());
                    buf.drain(..consumed);
                }
                Ok(Parsed::Incomplete { .. }) if !fed_rest => {
                    buf.extend_from_slice(&bytes[at..]);
                    fed_rest = true;
                }
                Ok(Parsed::Incomplete { .. }) => break,
                Err(e) => { err = Some(e); break; }
            }
        }
        if !fed_rest {
            // An error came before the split: the rest is never looked at.
            prop_assert!(err.is_some());
        }
        prop_assert_eq!(got, whole);
        prop_assert_eq!(err, werr);
    }

    /// Arbitrary bytes never panic, whole or byte by byte, and agree with each other.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let l = RespLimits { max_bulk: 64, max_args: 8, max_inline: 64, max_command: 256 };
        let (whole, werr, _) = parse_all(l, &bytes);
        let (pieces, perr) = parse_bytewise(l, &bytes);
        prop_assert_eq!(whole, pieces);
        prop_assert_eq!(werr, perr);
    }

    /// RESP-looking garbage (headers with random numbers) never panics either.
    #[test]
    fn resp_shaped_garbage_never_panics(
        parts in prop::collection::vec(
            prop_oneof![
                Just(b"*".to_vec()), Just(b"$".to_vec()), Just(b"\r\n".to_vec()),
                Just(b"-1".to_vec()), Just(b"\"".to_vec()), Just(b"\\x".to_vec()),
                any::<i64>().prop_map(|n| n.to_string().into_bytes()),
                prop::collection::vec(any::<u8>(), 0..8),
            ],
            0..40,
        ),
    ) {
        let bytes: Vec<u8> = parts.concat();
        let l = RespLimits { max_bulk: 1 << 20, max_args: 1000, max_inline: 128, max_command: 1 << 22 };
        let (whole, werr, _) = parse_all(l, &bytes);
        let (pieces, perr) = parse_bytewise(l, &bytes);
        prop_assert_eq!(whole, pieces);
        prop_assert_eq!(werr, perr);
    }
}

#[test]
fn a_pending_bulk_can_be_taken_from_the_stream() {
    let mut p = Parser::new(RespLimits::default());
    let head = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10\r\n0123";
    assert!(matches!(p.parse(head), Ok(Parsed::Incomplete { .. })));
    let pb = p.pending_bulk().expect("inside the value");
    assert_eq!(
        pb,
        PendingBulk {
            index: 2,
            args: 3,
            len: 10,
            start: head.len() - 4
        }
    );
    assert_eq!(p.arg(head, 0), Some(&b"SET"[..]));
    assert_eq!(p.arg(head, 1), Some(&b"k"[..]));
    // The caller took the value itself; the next command parses from scratch.
    p.reset();
    assert_eq!(p.pending_bulk(), None);
    assert_eq!(p.parse(b"PING\r\n"), Ok(Parsed::Command { consumed: 6 }));
    assert_eq!(p.arg(b"PING\r\n", 0), Some(&b"PING"[..]));
}
