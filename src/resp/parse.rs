//! The incremental command parser.
//!
//! The caller keeps the unconsumed bytes of its connection in one buffer whose first byte is the
//! first byte of the command being parsed, and only appends to it between calls. The parser
//! remembers how far it got, so a command arriving in pieces is scanned once. When a command is
//! complete it says how many bytes it took; its arguments are then read with [`Parser::arg`]
//! (ranges of that same buffer, or of the parser's scratch for unescaped inline words) until
//! the next call.

use std::ops::Range;

use super::RespLimits;

/// Why a byte stream is not RESP. After any of these the stream cannot be trusted: the daemon
/// answers with the error and closes the connection, as Redis does. Messages follow Redis's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RespError {
    /// `*<n>` is not a number or exceeds `max_args`.
    #[error("Protocol error: invalid multibulk length")]
    InvalidMultibulkLength,
    /// `$<n>` is not a number, is negative or exceeds `max_bulk`.
    #[error("Protocol error: invalid bulk length")]
    InvalidBulkLength,
    /// An element of a command array is not a bulk string.
    #[error("Protocol error: expected '$', got '{}'", printable(*.0))]
    ExpectedBulk(u8),
    /// A bulk string not followed by CRLF.
    #[error("Protocol error: bulk string not terminated by CRLF")]
    UnterminatedBulk,
    /// A count line (`*<n>`, `$<n>`) longer than any number.
    #[error("Protocol error: too big count string")]
    TooBigCount,
    /// An inline command line longer than `max_inline`.
    #[error("Protocol error: too big inline request")]
    TooBigInline,
    /// An inline command with more words than `max_args`.
    #[error("Protocol error: too many arguments in inline request")]
    TooManyInlineArgs,
    /// An inline command with an unclosed quote.
    #[error("Protocol error: unbalanced quotes in request")]
    UnbalancedQuotes,
    /// A command whose bytes exceed `max_command`.
    #[error("Protocol error: command larger than the query buffer limit")]
    CommandTooLarge,
}

/// What one call of [`Parser::parse`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A whole command, the first `consumed` bytes of the buffer; its arguments are
    /// [`Parser::args`] (none for an empty line or an empty array, which clients may send and
    /// which are ignored).
    Command {
        /// Bytes of the buffer the command took.
        consumed: usize,
    },
    /// More bytes are needed: at least `need` beyond those given. A hint for how much to read;
    /// the parser never relies on it.
    Incomplete {
        /// Bytes still missing, at least 1.
        need: usize,
    },
}

/// Where an incomplete command stands when it is inside a bulk string (see
/// [`Parser::pending_bulk`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingBulk {
    /// Which argument the string is (0: the command name).
    pub index: usize,
    /// How many arguments the command has.
    pub args: u64,
    /// The string's length, checked against the limits.
    pub len: usize,
    /// Where its bytes start in the buffer.
    pub start: usize,
}

/// The longest count line: `*`, a sign, 20 digits, CRLF, with room to spare.
const MAX_COUNT_LINE: usize = 32;

#[derive(Clone, Copy, Debug)]
enum State {
    /// Between commands.
    Start,
    /// Inside an array: `left` bulk strings still to come.
    Args { left: u64 },
    /// Inside an array, after a `$<len>` line: `len` bytes and CRLF at `pos`.
    Bulk { len: usize, left: u64 },
}

#[derive(Clone, Debug)]
enum Arg {
    /// Bytes of the caller's buffer.
    Buf(Range<usize>),
    /// Bytes of the parser's scratch (an inline word, unescaped).
    Scratch(Range<usize>),
}

/// An incremental, bounded RESP command parser (see the module docs for its contract).
#[derive(Clone, Debug)]
pub struct Parser {
    limits: RespLimits,
    state: State,
    /// Bytes of the current command scanned so far.
    pos: usize,
    args: Vec<Arg>,
    scratch: Vec<u8>,
    /// The last call returned a command: the next one starts afresh.
    done: bool,
}

impl Parser {
    /// A parser enforcing `limits`.
    pub fn new(limits: RespLimits) -> Self {
        Parser {
            limits,
            state: State::Start,
            pos: 0,
            args: Vec::new(),
            scratch: Vec::new(),
            done: false,
        }
    }

    /// The limits this parser enforces.
    pub fn limits(&self) -> &RespLimits {
        &self.limits
    }

    /// Parses the command at the start of `buf` (see the module docs: `buf` must hold the same
    /// bytes as at the previous call, plus any appended, unless that call returned a command).
    pub fn parse(&mut self, buf: &[u8]) -> Result<Parsed, RespError> {
        if self.done {
            self.done = false;
            self.state = State::Start;
            self.pos = 0;
            self.args.clear();
            self.scratch.clear();
        }
        let parsed = self.advance(buf);
        if parsed.is_err() {
            // An error ends the command as a complete one does: a parser used again (the
            // daemon closes the connection instead) starts afresh, never from a stale `pos`.
            self.done = true;
        }
        parsed
    }

    /// [`Parser::parse`] from where the last call stopped.
    fn advance(&mut self, buf: &[u8]) -> Result<Parsed, RespError> {
        loop {
            match self.state {
                State::Start => {
                    let Some(&first) = buf.first() else {
                        return Ok(Parsed::Incomplete { need: 1 });
                    };
                    if first != b'*' {
                        return self.inline(buf);
                    }
                    let Some((n, next)) = self.count_line(buf, 0)? else {
                        return Ok(Parsed::Incomplete { need: 1 });
                    };
                    let n = n.ok_or(RespError::InvalidMultibulkLength)?;
                    if n > self.limits.max_args as i64 {
                        return Err(RespError::InvalidMultibulkLength);
                    }
                    self.pos = next;
                    if n <= 0 {
                        return Ok(self.finish());
                    }
                    self.state = State::Args { left: n as u64 };
                }
                State::Args { left } => {
                    let Some(&first) = buf.get(self.pos) else {
                        return Ok(Parsed::Incomplete { need: 1 });
                    };
                    if first != b'$' {
                        return Err(RespError::ExpectedBulk(first));
                    }
                    let Some((len, next)) = self.count_line(buf, self.pos)? else {
                        return Ok(Parsed::Incomplete { need: 1 });
                    };
                    let len = match len {
                        Some(l) if l >= 0 && l as u64 <= self.limits.max_bulk => l as u64,
                        _ => return Err(RespError::InvalidBulkLength),
                    };
                    // The whole command, this string and its CRLF included, within bounds.
                    if next as u64 + len + 2 > self.limits.max_command {
                        return Err(RespError::CommandTooLarge);
                    }
                    self.pos = next;
                    self.state = State::Bulk {
                        len: len as usize,
                        left,
                    };
                }
                State::Bulk { len, left } => {
                    let end = self.pos + len;
                    if buf.len() < end + 2 {
                        return Ok(Parsed::Incomplete {
                            need: end + 2 - buf.len(),
                        });
                    }
                    if &buf[end..end + 2] != b"\r\n" {
                        return Err(RespError::UnterminatedBulk);
                    }
                    self.args.push(Arg::Buf(self.pos..end));
                    self.pos = end + 2;
                    if left == 1 {
                        return Ok(self.finish());
                    }
                    self.state = State::Args { left: left - 1 };
                }
            }
        }
    }

    /// When the last call returned [`Parsed::Incomplete`] inside a bulk string: which argument
    /// it is and where its bytes start. The arguments before it are readable with
    /// [`Parser::arg`]. A caller may then take the string's bytes and its CRLF from the stream
    /// itself (a large value straight into its destination) and call [`Parser::reset`].
    pub fn pending_bulk(&self) -> Option<PendingBulk> {
        match self.state {
            State::Bulk { len, left } if !self.done => Some(PendingBulk {
                index: self.args.len(),
                args: self.args.len() as u64 + left,
                len,
                start: self.pos,
            }),
            _ => None,
        }
    }

    /// Forgets the command being parsed: its bytes were consumed by the caller. The next call
    /// parses a new command at the start of the buffer it is given.
    pub fn reset(&mut self) {
        self.done = true;
    }

    /// The arguments of the command the last call returned (command name first).
    pub fn args<'a>(&'a self, buf: &'a [u8]) -> impl ExactSizeIterator<Item = &'a [u8]> + 'a {
        self.args.iter().map(move |a| match a {
            Arg::Buf(r) => &buf[r.clone()],
            Arg::Scratch(r) => &self.scratch[r.clone()],
        })
    }

    /// Argument `i` of the command the last call returned.
    pub fn arg<'a>(&'a self, buf: &'a [u8], i: usize) -> Option<&'a [u8]> {
        Some(match self.args.get(i)? {
            Arg::Buf(r) => &buf[r.clone()],
            Arg::Scratch(r) => &self.scratch[r.clone()],
        })
    }

    /// How many arguments the command the last call returned has.
    pub fn len(&self) -> usize {
        self.args.len()
    }

    /// Whether that command has no arguments (an empty line or array: nothing to do).
    pub fn is_empty(&self) -> bool {
        self.args.is_empty()
    }

    fn finish(&mut self) -> Parsed {
        self.done = true;
        Parsed::Command { consumed: self.pos }
    }

    /// The signed number on the count line starting at `at` (`*<n>\r\n` or `$<n>\r\n`, None
    /// when it is not a number) and where the next line starts; Ok(None) while incomplete.
    fn count_line(&self, buf: &[u8], at: usize) -> Result<Option<(Option<i64>, usize)>, RespError> {
        let window = &buf[at..buf.len().min(at + MAX_COUNT_LINE)];
        let Some(cr) = window.iter().position(|&b| b == b'\r') else {
            if window.len() >= MAX_COUNT_LINE {
                return Err(RespError::TooBigCount);
            }
            return Ok(None);
        };
        let Some(&lf) = buf.get(at + cr + 1) else {
            return Ok(None);
        };
        if lf != b'\n' {
            // A count line ends with CRLF; anything else is a count that is not a number.
            return Ok(Some((None, at + cr + 2)));
        }
        Ok(Some((parse_int(&window[1..cr]), at + cr + 2)))
    }

    /// An inline command: one line (LF or CRLF), words split on blanks, with Redis's quoting.
    /// While the line is incomplete, `pos` is how much of it earlier calls scanned (no LF in
    /// it), so a line arriving a byte at a time is scanned once, not once per byte.
    fn inline(&mut self, buf: &[u8]) -> Result<Parsed, RespError> {
        let window = &buf[..buf.len().min(self.limits.max_inline)];
        let from = self.pos.min(window.len());
        let Some(lf) = window[from..]
            .iter()
            .position(|&b| b == b'\n')
            .map(|i| from + i)
        else {
            if buf.len() >= self.limits.max_inline {
                return Err(RespError::TooBigInline);
            }
            self.pos = window.len();
            return Ok(Parsed::Incomplete { need: 1 });
        };
        let mut line = &buf[..lf];
        if let [rest @ .., b'\r'] = line {
            line = rest;
        }
        self.split_words(line)?;
        self.pos = lf + 1;
        Ok(self.finish())
    }

    fn split_words(&mut self, line: &[u8]) -> Result<(), RespError> {
        let mut i = 0;
        loop {
            while i < line.len() && is_blank(line[i]) {
                i += 1;
            }
            if i == line.len() {
                return Ok(());
            }
            // `max_args` bounds an inline command's words as it bounds an array's elements.
            if self.args.len() as u64 >= self.limits.max_args {
                return Err(RespError::TooManyInlineArgs);
            }
            let start = self.scratch.len();
            match line[i] {
                q @ (b'"' | b'\'') => {
                    i += 1;
                    loop {
                        let Some(&c) = line.get(i) else {
                            return Err(RespError::UnbalancedQuotes);
                        };
                        i += 1;
                        if c == q {
                            // A closing quote must end the word.
                            if line.get(i).is_some_and(|&c| !is_blank(c)) {
                                return Err(RespError::UnbalancedQuotes);
                            }
                            break;
                        }
                        if c != b'\\' || i == line.len() {
                            self.scratch.push(c);
                            continue;
                        }
                        let e = line[i];
                        i += 1;
                        if q == b'\'' {
                            // Single quotes: only \' is an escape.
                            if e != b'\'' {
                                self.scratch.push(b'\\');
                            }
                            self.scratch.push(e);
                            continue;
                        }
                        match e {
                            b'x' if i + 1 < line.len()
                                && hex(line[i]).is_some()
                                && hex(line[i + 1]).is_some() =>
                            {
                                let v =
                                    hex(line[i]).unwrap_or(0) * 16 + hex(line[i + 1]).unwrap_or(0);
                                self.scratch.push(v);
                                i += 2;
                            }
                            b'n' => self.scratch.push(b'\n'),
                            b'r' => self.scratch.push(b'\r'),
                            b't' => self.scratch.push(b'\t'),
                            b'b' => self.scratch.push(8),
                            b'a' => self.scratch.push(7),
                            other => self.scratch.push(other),
                        }
                    }
                }
                _ => {
                    while i < line.len() && !is_blank(line[i]) {
                        self.scratch.push(line[i]);
                        i += 1;
                    }
                }
            }
            self.args.push(Arg::Scratch(start..self.scratch.len()));
        }
    }
}

/// `b` as a character fit for an error line (which must not hold CR or LF).
fn printable(b: u8) -> char {
    if b.is_ascii_graphic() || b == b' ' {
        char::from(b)
    } else {
        '?'
    }
}

fn is_blank(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r' | b'\n' | 0x0b | 0x0c)
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// A strict decimal, as Redis reads counts and integer arguments: an optional `-`, then
/// digits, no leading zeros but `0`, within i64.
pub fn parse_int(s: &[u8]) -> Option<i64> {
    let (neg, digits) = match s {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, s),
    };
    if digits.is_empty() || digits.len() > 19 || (digits.len() > 1 && digits[0] == b'0') {
        return None;
    }
    let mut v: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add((d - b'0') as i64)?;
    }
    Some(if neg { -v } else { v })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `resp` fuzz target running slowly: an inline line arriving in pieces was
    /// rescanned from its start at every call, so a client trickling a 64 KiB line a byte at a
    /// time cost the node 2 billion byte comparisons. Each call now starts where the last
    /// stopped.
    #[test]
    fn an_inline_line_in_pieces_is_scanned_once() {
        let mut p = Parser::new(RespLimits::default());
        let line = b"SET key value\n";
        for end in 1..line.len() {
            assert_eq!(p.parse(&line[..end]), Ok(Parsed::Incomplete { need: 1 }));
            assert_eq!(p.pos, end, "bytes scanned after {end} arrived");
        }
        assert_eq!(p.parse(line), Ok(Parsed::Command { consumed: 14 }));
        let args: Vec<&[u8]> = p.args(line).collect();
        assert_eq!(args, [&b"SET"[..], b"key", b"value"]);
    }

    /// What an earlier command scanned never shifts where the next one is scanned: after a
    /// command, after an error, and after [`Parser::reset`], the next call starts at byte 0 of
    /// the buffer it is given (here a shorter line, whose LF a stale `pos` would skip).
    #[test]
    fn the_next_command_is_scanned_from_its_start() {
        let limits = RespLimits {
            max_inline: 16,
            ..RespLimits::default()
        };
        let mut p = Parser::new(limits);
        assert_eq!(p.parse(b"PING PING"), Ok(Parsed::Incomplete { need: 1 }));
        assert_eq!(
            p.parse(b"PING PING\n"),
            Ok(Parsed::Command { consumed: 10 })
        );
        assert_eq!(p.parse(b"A\n"), Ok(Parsed::Command { consumed: 2 }));

        assert_eq!(p.parse(b"0123456789"), Ok(Parsed::Incomplete { need: 1 }));
        assert_eq!(p.parse(b"0123456789abcdefgh"), Err(RespError::TooBigInline));
        assert_eq!(p.parse(b"B\n"), Ok(Parsed::Command { consumed: 2 }));
        assert_eq!(p.arg(b"B\n", 0), Some(&b"B"[..]));

        assert_eq!(p.parse(b"0123456789"), Ok(Parsed::Incomplete { need: 1 }));
        p.reset();
        assert_eq!(p.parse(b"C\n"), Ok(Parsed::Command { consumed: 2 }));
    }
}
