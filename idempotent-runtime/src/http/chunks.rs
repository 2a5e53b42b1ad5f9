//! A body's data, gathered chunk by chunk as the layers read it.

use bytes::Bytes;

/// The data chunks of a body read so far. The first is kept as it is: a body of one chunk (the
/// usual request, response or gRPC answer) is neither copied nor put in a list. Empty chunks are
/// skipped.
#[derive(Default)]
pub(crate) struct Chunks {
    first: Bytes,
    more: Vec<Bytes>,
    len: usize,
}

impl Chunks {
    /// The bytes gathered so far.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Adds the next chunk.
    pub(crate) fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        self.len = self.len.saturating_add(data.len());
        if self.first.is_empty() {
            self.first = data;
        } else {
            self.more.push(data);
        }
    }

    /// The chunks in order, as they were read.
    pub(crate) fn into_chunks(self) -> impl Iterator<Item = Bytes> {
        std::iter::once(self.first).filter(|first| !first.is_empty()).chain(self.more)
    }

    /// The whole body in one buffer: the first chunk itself when it is the only one.
    pub(crate) fn into_bytes(self) -> Bytes {
        if self.more.is_empty() {
            return self.first;
        }
        let mut whole = Vec::with_capacity(self.len);
        for chunk in std::iter::once(&self.first).chain(&self.more) {
            whole.extend_from_slice(chunk);
        }
        whole.into()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Bodies in chunks, for a limit of 5 bytes: within it (empty chunks among them) ...
    pub(crate) const WITHIN_5: [&[&[u8]]; 4] =
        [&[b"ab", b"", b"cd", b"e"], &[b"", b"abcde"], &[b"abc", b"de", b""], &[b"", b""]];
    /// ... and past it at the first, a middle or the last chunk. Each layer's body reader is
    /// tested with them.
    pub(crate) const PAST_5: [&[&[u8]]; 4] = [
        &[b"abcdef", b"gh"],
        &[b"abc", b"def", b"gh"],
        &[b"", b"abcd", b"", b"ef"],
        &[b"a", b"b", b"c", b"d", b"e", b"f"],
    ];

    #[test]
    fn http_chunks_keep_one_chunk_as_it_is_and_join_several_in_order() {
        let one = Bytes::from_static(b"abc");
        let mut chunks = Chunks::default();
        chunks.push(Bytes::new());
        chunks.push(one.clone());
        chunks.push(Bytes::new());
        let whole = chunks.into_bytes();
        assert_eq!((whole.as_ptr(), whole.len()), (one.as_ptr(), one.len()), "not copied");
        for case in WITHIN_5.into_iter().chain(PAST_5) {
            let gather = || {
                let mut chunks = Chunks::default();
                for chunk in case {
                    chunks.push(Bytes::copy_from_slice(chunk));
                }
                chunks
            };
            assert_eq!(gather().len(), case.concat().len(), "{case:?}");
            assert_eq!(gather().into_bytes(), case.concat(), "{case:?}");
            let listed: Vec<Bytes> = gather().into_chunks().collect();
            assert!(listed.iter().all(|c| !c.is_empty()), "{case:?}");
            assert_eq!(listed.concat(), case.concat(), "{case:?}");
        }
        assert!(Chunks::default().into_chunks().next().is_none());
    }
}
