//! Reads a count an engine reports in its response, as the bytes pass
//! through the proxy: the prefix-cache hit, OpenAI's
//! `usage.prompt_tokens_details.cached_tokens` (a whole answer, or a
//! stream's closing usage chunk) and SGLang `/generate`'s
//! `meta_info.cached_tokens` (every chunk; the last one's is the total);
//! and the tokens generated, `usage.completion_tokens` and
//! `meta_info.completion_tokens` in the same places.
//!
//! A scanner looks for its key (`"cached_tokens"`) followed by optional
//! whitespace, `:`, optional whitespace and a non-negative integer, in any
//! number of pieces split anywhere: the key and the number may straddle
//! piece boundaries. The last value seen wins. It does not parse JSON: the
//! key's quotes are part of the pattern, so the words `cached_tokens` inside
//! a string (where quotes are escaped) do not match, and any other value
//! (`null`, a negative, fractional or exponent number, one beyond `u64`)
//! is skipped. Searching a piece is one `memmem` pass; the only state kept
//! between pieces is the key's last bytes and the number read so far, so it
//! allocates nothing.
//!
//! An example in use: the unit test `tests::example`.

use std::sync::LazyLock;

use memchr::memmem::Finder;

/// The key a scanner looks for.
pub(crate) trait CountKey {
    /// The key, with its quotes; at most [`MAX_KEY_LEN`] bytes.
    const KEY: &'static [u8];
    fn finder() -> &'static Finder<'static>;
}

/// `"cached_tokens"`: the prompt tokens the engine's prefix cache served.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CachedTokens;

/// `"completion_tokens"`: the tokens the engine generated.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CompletionTokens;

static CACHED_TOKENS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(CachedTokens::KEY));
static COMPLETION_TOKENS: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(CompletionTokens::KEY));

impl CountKey for CachedTokens {
    const KEY: &'static [u8] = b"\"cached_tokens\"";
    fn finder() -> &'static Finder<'static> {
        &CACHED_TOKENS
    }
}

impl CountKey for CompletionTokens {
    const KEY: &'static [u8] = b"\"completion_tokens\"";
    fn finder() -> &'static Finder<'static> {
        &COMPLETION_TOKENS
    }
}

const MAX_KEY_LEN: usize = 24;
/// Bytes of the longest key that can be left at the end of a piece without
/// a match.
const MAX_CARRY: usize = MAX_KEY_LEN - 1;
/// Digits of the largest `u64`.
const MAX_DIGITS: u8 = 20;

/// Where the scanner is in the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Looking for the key; the last bytes of the previous piece (at most
    /// [`CARRY`]) may be the key's start.
    Key,
    /// After the key, before the `:`.
    Colon,
    /// After the `:`, before the number.
    Number,
    /// In the number's digits (`value`, `digits` so far).
    Digits,
}

/// The incremental scanner of one key (see the module docs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CountScanner<K> {
    key: std::marker::PhantomData<K>,
    state: State,
    carry: [u8; MAX_CARRY],
    carry_len: u8,
    value: u64,
    digits: u8,
    /// The digits overflowed a `u64`: the number is skipped.
    overflow: bool,
    last: Option<u64>,
}

/// Reads `cached_tokens`.
pub(crate) type CachedTokensScanner = CountScanner<CachedTokens>;
/// Reads `completion_tokens`.
pub(crate) type CompletionTokensScanner = CountScanner<CompletionTokens>;

impl<K: CountKey> Default for CountScanner<K> {
    fn default() -> CountScanner<K> {
        const { assert!(K::KEY.len() <= MAX_KEY_LEN) };
        CountScanner {
            key: std::marker::PhantomData,
            state: State::Key,
            carry: [0; MAX_CARRY],
            carry_len: 0,
            value: 0,
            digits: 0,
            overflow: false,
            last: None,
        }
    }
}

impl<K: CountKey> CountScanner<K> {
    /// Bytes of this key that can be left at the end of a piece without a
    /// match.
    const CARRY: usize = K::KEY.len() - 1;

    /// The last value seen so far, including a number the text ends in.
    pub(crate) fn value(&self) -> Option<u64> {
        if self.state == State::Digits && !self.overflow && self.digits > 0 {
            return Some(self.value);
        }
        self.last
    }

    /// Reads the next piece of the text.
    pub(crate) fn feed(&mut self, piece: &[u8]) {
        let mut at = 0;
        while at < piece.len() {
            match self.state {
                State::Key => {
                    at = self.find_key(piece, at);
                }
                State::Colon => {
                    let byte = piece[at];
                    if byte == b':' {
                        self.state = State::Number;
                        at += 1;
                    } else if is_space(byte) {
                        at += 1;
                    } else {
                        // Read again as a possible key start.
                        self.state = State::Key;
                    }
                }
                State::Number => {
                    let byte = piece[at];
                    if byte.is_ascii_digit() {
                        self.state = State::Digits;
                        self.value = 0;
                        self.digits = 0;
                        self.overflow = false;
                    } else if is_space(byte) {
                        at += 1;
                    } else {
                        self.state = State::Key;
                    }
                }
                State::Digits => {
                    let byte = piece[at];
                    if byte.is_ascii_digit() {
                        self.push_digit(byte - b'0');
                        at += 1;
                    } else {
                        // `.`, `e` or `E` make it a float, which no count is.
                        if !matches!(byte, b'.' | b'e' | b'E') && !self.overflow {
                            self.last = Some(self.value);
                        }
                        self.state = State::Key;
                    }
                }
            }
        }
    }

    fn push_digit(&mut self, digit: u8) {
        self.digits = self.digits.saturating_add(1);
        match self
            .value
            .checked_mul(10)
            .and_then(|value| value.checked_add(u64::from(digit)))
        {
            Some(value) if self.digits <= MAX_DIGITS => self.value = value,
            _ => self.overflow = true,
        }
    }

    /// Searches `piece[at..]` for the key, the carried bytes of the previous
    /// piece first; returns where reading goes on (the piece's end when no
    /// key was found, its tail then carried).
    fn find_key(&mut self, piece: &[u8], at: usize) -> usize {
        let rest = &piece[at..];
        let carry = Self::CARRY;
        let key_len = K::KEY.len();
        let finder = K::finder();
        let carried = usize::from(self.carry_len);
        // A key that starts in the carried bytes ends within the first
        // CARRY bytes of this piece.
        let mut joined = [0u8; 2 * MAX_CARRY];
        let head = rest.len().min(carry);
        joined[..carried].copy_from_slice(&self.carry[..carried]);
        joined[carried..carried + head].copy_from_slice(&rest[..head]);
        let joined = &joined[..carried + head];
        if carried > 0
            && let Some(start) = finder.find(joined)
        {
            self.carry_len = 0;
            self.state = State::Colon;
            return at + start + key_len - carried;
        }
        if let Some(start) = finder.find(rest) {
            self.carry_len = 0;
            self.state = State::Colon;
            return at + start + key_len;
        }
        // Keep the last CARRY bytes read: of this piece, or of the carried
        // bytes and this short piece.
        let tail = if rest.len() >= carry {
            &rest[rest.len() - carry..]
        } else {
            &joined[joined.len().saturating_sub(carry)..]
        };
        self.carry[..tail.len()].copy_from_slice(tail);
        self.carry_len = tail.len() as u8;
        piece.len()
    }
}

fn is_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn example() {
        let mut scanner = CachedTokensScanner::default();
        scanner.feed(br#"{"usage":{"prompt_tokens":900,"prompt_tokens_det"#);
        scanner.feed(br#"ails":{"cached_tok"#);
        scanner.feed(br#"ens": 76"#);
        scanner.feed(br#"8}}}"#);
        assert_eq!(scanner.value(), Some(768));
    }

    fn scan(pieces: &[&[u8]]) -> Option<u64> {
        let mut scanner = CachedTokensScanner::default();
        for piece in pieces {
            scanner.feed(piece);
        }
        scanner.value()
    }

    fn whole(text: &str) -> Option<u64> {
        scan(&[text.as_bytes()])
    }

    #[test]
    fn reads_each_engines_report() {
        let openai = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":4100,"completion_tokens":3,"total_tokens":4103,"prompt_tokens_details":{"cached_tokens":3840}}}"#;
        assert_eq!(whole(openai), Some(3840));
        let sglang = r#"{"text":"hi","meta_info":{"id":"x","prompt_tokens":4100,"completion_tokens":3,"cached_tokens":1024,"finish_reason":{"type":"length","length":3}}}"#;
        assert_eq!(whole(sglang), Some(1024));
        // A stream: every /generate chunk carries the count, the last wins.
        let stream = concat!(
            "data: {\"text\":\"a\",\"meta_info\":{\"cached_tokens\":0}}\n\n",
            "data: {\"text\":\"ab\",\"meta_info\":{\"cached_tokens\":0}}\n\n",
            "data: {\"text\":\"abc\",\"meta_info\":{\"cached_tokens\":512}}\n\n",
            "data: [DONE]\n\n"
        );
        assert_eq!(whole(stream), Some(512));
        // Pretty-printed.
        assert_eq!(whole("{\n  \"cached_tokens\" :\n\t 77\n}"), Some(77));
    }

    #[test]
    fn nothing_that_is_not_a_count_is_read() {
        for text in [
            "",
            r#"{"usage":{"prompt_tokens":12}}"#,
            r#"{"cached_tokens":null}"#,
            r#"{"cached_tokens":-5}"#,
            r#"{"cached_tokens":1.5}"#,
            r#"{"cached_tokens":2e3}"#,
            r#"{"cached_tokens":"12"}"#,
            r#"{"cached_tokens":99999999999999999999999}"#,
            r#"{"cached_tokens":18446744073709551616}"#,
            // The words inside a string, whose quotes are escaped.
            r#"{"content":"say \"cached_tokens\": 12 please"}"#,
            r#"{"not_cached_tokens":12}"#,
            r#"{"cached_tokens_total":12}"#,
        ] {
            assert_eq!(whole(text), None, "{text}");
        }
        assert_eq!(
            whole(r#"{"cached_tokens":18446744073709551615}"#),
            Some(u64::MAX)
        );
        // A bad value does not hide a good one after it, nor erase one
        // before it.
        assert_eq!(
            whole(r#"{"cached_tokens":null,"x":{"cached_tokens":9}}"#),
            Some(9)
        );
        assert_eq!(
            whole(r#"{"cached_tokens":9,"x":{"cached_tokens":null}}"#),
            Some(9)
        );
        // A text that ends in the number.
        assert_eq!(whole(r#""cached_tokens":42"#), Some(42));
    }

    #[test]
    fn the_completion_scanner_reads_its_own_key_split_anywhere() {
        let text = br#"{"usage":{"prompt_tokens":900,"completion_tokens":57,"prompt_tokens_details":{"cached_tokens":768}}}"#;
        for cut in 0..text.len() {
            let mut completion = CompletionTokensScanner::default();
            let mut cached = CachedTokensScanner::default();
            for piece in [&text[..cut], &text[cut..]] {
                completion.feed(piece);
                cached.feed(piece);
            }
            assert_eq!(completion.value(), Some(57), "cut at {cut}");
            assert_eq!(cached.value(), Some(768), "cut at {cut}");
        }
    }

    #[test]
    fn a_key_split_one_byte_per_piece_is_found() {
        let text = br#"xx{"cached_tokens": 300}"#;
        let pieces: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(scan(&pieces), Some(300));
        // A quote that ends one candidate and starts the key.
        let text = br#"{"a":"cached_tokens""cached_tokens":7}"#;
        for size in 1..text.len() {
            let pieces: Vec<&[u8]> = text.chunks(size).collect();
            assert_eq!(scan(&pieces), Some(7), "pieces of {size}");
        }
    }

    /// A response body as an engine writes it, with a count somewhere.
    fn body() -> impl Strategy<Value = (String, Option<u64>)> {
        let count = prop_oneof![Just(None), any::<u64>().prop_map(Some)];
        (
            "[a-z \\\":,{}0-9]{0,40}",
            count,
            "[ \\n]{0,2}",
            "[ \\n]{0,2}",
            "[a-z \\\":,{}]{0,40}",
        )
            .prop_map(|(before, count, space1, space2, after)| {
                let value = count.map_or("null".to_owned(), |count| count.to_string());
                let text = format!(
                    r#"{{"pre":"{}","usage":{{"cached_tokens"{space1}:{space2}{value},"post":"{}"}}}}"#,
                    before.replace('"', "'"),
                    after.replace('"', "'")
                );
                (text, count)
            })
    }

    proptest! {
        #[test]
        fn the_same_value_is_found_wherever_the_body_is_split((text, count) in body()) {
            let bytes = text.as_bytes();
            prop_assert_eq!(whole(&text), count);
            for cut in 0..=bytes.len() {
                prop_assert_eq!(scan(&[&bytes[..cut], &bytes[cut..]]), count, "cut at {}", cut);
            }
            for size in 1..8 {
                let pieces: Vec<&[u8]> = bytes.chunks(size).collect();
                prop_assert_eq!(scan(&pieces), count, "pieces of {}", size);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_split_reads_agree(bytes in proptest::collection::vec(any::<u8>(), 0..200), cut in 0usize..200) {
            let cut = cut.min(bytes.len());
            prop_assert_eq!(scan(&[&bytes]), scan(&[&bytes[..cut], &bytes[cut..]]));
        }
    }
}
