//! A small, allocation-free msgpack reader over a byte slice, made for hostile input: every
//! read is bounds-checked, lengths are checked against the bytes left before anything is
//! reserved, and skipping nested values is depth-limited.

/// Why a payload is not the msgpack we expect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgpackError {
    #[error("truncated at byte {0}")]
    Truncated(usize),
    #[error("expected {expected} at byte {at}, found marker 0x{marker:02x}")]
    Unexpected { expected: &'static str, at: usize, marker: u8 },
    #[error("string at byte {0} is not UTF-8")]
    Utf8(usize),
    #[error("nesting deeper than {0} levels")]
    TooDeep(usize),
    #[error("integer at byte {0} out of range")]
    Range(usize),
}

type Result<T> = std::result::Result<T, MsgpackError>;

/// Deepest nesting [`Reader::skip`] follows; vLLM's events nest three or four levels.
pub const MAX_DEPTH: usize = 32;

/// A cursor over one msgpack payload.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// An integer as msgpack stores it: unsigned, or negative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    Unsigned(u64),
    Negative(i64),
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    pub fn peek(&self) -> Result<u8> {
        self.buf.get(self.pos).copied().ok_or(MsgpackError::Truncated(self.pos))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or(MsgpackError::Truncated(self.pos))?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn be(&mut self, n: usize) -> Result<u64> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    /// Past the marker: `width` big-endian bytes follow (a length, or the value).
    fn sized(&mut self, width: usize) -> Result<u64> {
        self.pos += 1;
        self.be(width)
    }

    /// Past the marker, which holds the length itself (`fix` formats).
    fn fixed(&mut self, len: u8) -> usize {
        self.pos += 1;
        usize::from(len)
    }

    fn unexpected<T>(&self, expected: &'static str, marker: u8) -> Result<T> {
        Err(MsgpackError::Unexpected { expected, at: self.pos, marker })
    }

    /// Consumes a `nil` if one is next.
    pub fn try_nil(&mut self) -> Result<bool> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Length of the array that follows. The length is checked against the bytes left (each
    /// element takes at least one byte), so it is safe to reserve.
    pub fn array_len(&mut self) -> Result<usize> {
        let marker = self.peek()?;
        let n = match marker {
            0x90..=0x9f => self.fixed(marker & 0x0f),
            0xdc => self.sized(2)? as usize,
            0xdd => self.sized(4)? as usize,
            _ => return self.unexpected("array", marker),
        };
        self.check_count(n)
    }

    /// The array that follows, each element read by `item`.
    pub fn array<T, E: From<MsgpackError>>(
        &mut self,
        mut item: impl FnMut(&mut Self) -> std::result::Result<T, E>,
    ) -> std::result::Result<Vec<T>, E> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(item(self)?);
        }
        Ok(out)
    }

    /// Length of the map that follows (entries, each at least two bytes).
    pub fn map_len(&mut self) -> Result<usize> {
        let marker = self.peek()?;
        let n = match marker {
            0x80..=0x8f => self.fixed(marker & 0x0f),
            0xde => self.sized(2)? as usize,
            0xdf => self.sized(4)? as usize,
            _ => return self.unexpected("map", marker),
        };
        self.check_count(n.saturating_mul(2)).map(|_| n)
    }

    fn check_count(&self, n: usize) -> Result<usize> {
        if n > self.buf.len() - self.pos { Err(MsgpackError::Truncated(self.pos)) } else { Ok(n) }
    }

    /// True if an array follows (without consuming it).
    pub fn at_array(&self) -> bool {
        matches!(self.peek(), Ok(0x90..=0x9f | 0xdc | 0xdd))
    }

    /// True if a map follows (without consuming it).
    pub fn at_map(&self) -> bool {
        matches!(self.peek(), Ok(0x80..=0x8f | 0xde | 0xdf))
    }

    /// True if a string follows.
    pub fn at_str(&self) -> bool {
        matches!(self.peek(), Ok(0xa0..=0xbf | 0xd9..=0xdb))
    }

    pub fn str(&mut self) -> Result<&'a str> {
        let at = self.pos;
        let marker = self.peek()?;
        let n = match marker {
            0xa0..=0xbf => self.fixed(marker & 0x1f),
            0xd9..=0xdb => self.sized(1 << (marker - 0xd9))? as usize,
            _ => return self.unexpected("string", marker),
        };
        std::str::from_utf8(self.take(n)?).map_err(|_| MsgpackError::Utf8(at))
    }

    pub fn bin(&mut self) -> Result<&'a [u8]> {
        let marker = self.peek()?;
        let n = match marker {
            0xc4..=0xc6 => self.sized(1 << (marker - 0xc4))? as usize,
            _ => return self.unexpected("bin", marker),
        };
        self.take(n)
    }

    /// Any integer.
    pub fn int(&mut self) -> Result<Int> {
        let marker = self.peek()?;
        Ok(match marker {
            0x00..=0x7f => Int::Unsigned(self.fixed(marker) as u64),
            0xe0..=0xff => {
                self.pos += 1;
                Int::Negative(i64::from(marker as i8))
            }
            0xcc..=0xcf => Int::Unsigned(self.sized(1 << (marker - 0xcc))?),
            0xd0..=0xd3 => {
                let bytes = 1usize << (marker - 0xd0);
                let shift = 64 - 8 * bytes as u32;
                let v = (self.sized(bytes)? << shift) as i64 >> shift; // sign-extend
                if v >= 0 { Int::Unsigned(v as u64) } else { Int::Negative(v) }
            }
            _ => return self.unexpected("integer", marker),
        })
    }

    /// A non-negative integer that fits `u64`.
    pub fn uint(&mut self) -> Result<u64> {
        let at = self.pos;
        match self.int()? {
            Int::Unsigned(v) => Ok(v),
            Int::Negative(_) => Err(MsgpackError::Range(at)),
        }
    }

    /// A float (f32 or f64) or an integer, as f64.
    pub fn number(&mut self) -> Result<f64> {
        let marker = self.peek()?;
        match marker {
            0xca => Ok(f64::from(f32::from_bits(self.sized(4)? as u32))),
            0xcb => Ok(f64::from_bits(self.sized(8)?)),
            _ => match self.int()? {
                Int::Unsigned(v) => Ok(v as f64),
                Int::Negative(v) => Ok(v as f64),
            },
        }
    }

    /// Skips one value of any type.
    pub fn skip(&mut self) -> Result<()> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(MsgpackError::TooDeep(MAX_DEPTH));
        }
        let marker = self.peek()?;
        match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => {
                self.pos += 1;
            }
            0x80..=0x8f | 0xde | 0xdf => {
                let n = self.map_len()?;
                for _ in 0..n * 2 {
                    self.skip_depth(depth + 1)?;
                }
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let n = self.array_len()?;
                for _ in 0..n {
                    self.skip_depth(depth + 1)?;
                }
            }
            0xa0..=0xbf | 0xd9..=0xdb => {
                self.str()?;
            }
            0xc4..=0xc6 => {
                self.bin()?;
            }
            0xc7..=0xc9 => {
                // ext 8/16/32: length, type byte, data
                let n = self.sized(1 << (marker - 0xc7))? as usize;
                self.take(n + 1)?;
            }
            0xca | 0xcb => {
                self.number()?;
            }
            0xcc..=0xd3 => {
                self.int()?;
            }
            0xd4..=0xd8 => {
                // fixext 1/2/4/8/16: type byte + data
                self.pos += 1;
                self.take(1 + (1 << (marker - 0xd4)))?;
            }
            0xc1 => return self.unexpected("a value", marker),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ints_of_every_width_and_sign() {
        let bytes = [
            0x05, 0xcc, 0xff, 0xcd, 0x01, 0x00, 0xce, 0, 1, 0, 0, 0xcf, 0xf0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0xd0, 0x80,
            0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0xd1, 0x00, 0x10,
        ];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.int().unwrap(), Int::Unsigned(5));
        assert_eq!(r.int().unwrap(), Int::Unsigned(255));
        assert_eq!(r.int().unwrap(), Int::Unsigned(256));
        assert_eq!(r.int().unwrap(), Int::Unsigned(65536));
        assert_eq!(r.int().unwrap(), Int::Unsigned(0xf000_0000_0000_0001));
        assert_eq!(r.int().unwrap(), Int::Negative(-1));
        assert_eq!(r.int().unwrap(), Int::Negative(-128));
        assert_eq!(r.int().unwrap(), Int::Negative(-2));
        assert_eq!(r.int().unwrap(), Int::Unsigned(16), "a positive int16 is unsigned");
        assert!(r.is_empty());
    }

    #[test]
    fn hostile_lengths_and_nesting_are_errors_not_allocations() {
        // An array claiming 4 billion elements in a 5-byte payload.
        assert_eq!(Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).array_len(), Err(MsgpackError::Truncated(5)));
        assert!(Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff]).str().is_err());
        let deep = vec![0x91u8; 10_000];
        assert_eq!(Reader::new(&deep).skip(), Err(MsgpackError::TooDeep(MAX_DEPTH)));
        assert!(Reader::new(&[0xc1]).skip().is_err());
        assert!(Reader::new(&[0xa2, 0xff, 0xfe]).str().is_err(), "invalid UTF-8");
        assert!(Reader::new(&[]).peek().is_err());
    }

    #[test]
    fn skips_every_kind_of_value() {
        let bytes = [
            0x82, 0xa1, b'a', 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xa1, b'b', 0x93, 0xc0, 0xc3, 0xc4, 0x02, 1, 2, 0xd6, 1, 1,
            2, 3, 4, 0x2a,
        ];
        let mut r = Reader::new(&bytes);
        r.skip().unwrap(); // the map
        r.skip().unwrap(); // fixext4
        assert_eq!(r.uint().unwrap(), 42);
    }
}
