//! A worker's response body, read from its connection by whoever polls it.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};

use crate::BodyError;
use crate::chunked::{Chunked, decode_chunked};
use crate::io::{READ_RESERVE, make_read_room, poll_read_buf};
use crate::pool::{Connection, Pool};

/// How a response body's end is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    Length { remaining: u64 },
    Chunked(Chunked),
    UntilClose,
    Done,
}

impl Framing {
    /// What is known of the rest of the body's length.
    fn size_hint(&self) -> SizeHint {
        match self {
            Framing::Length { remaining } => SizeHint::with_exact(*remaining),
            Framing::Done => SizeHint::with_exact(0),
            Framing::Chunked(_) | Framing::UntilClose => SizeHint::default(),
        }
    }
}

/// A worker's response body, read from its connection by whoever polls it.
/// Each poll yields every byte of data that had arrived: for a chunked
/// body, the data of every whole chunk and of the part of one, joined, so
/// a burst of events is one frame and an event that arrives alone goes out
/// at once. Once the body has been read to its end the connection goes
/// back to the pool; dropped before that (the client went away, a
/// deadline), it is closed, which tells the worker to stop.
#[derive(Debug)]
pub struct WorkerBody {
    connection: Option<Connection>,
    pool: Arc<Pool>,
    framing: Framing,
    reusable: bool,
    ended: bool,
}

impl WorkerBody {
    pub(crate) fn new(
        connection: Connection,
        pool: Arc<Pool>,
        framing: Framing,
        reusable: bool,
    ) -> WorkerBody {
        WorkerBody {
            connection: Some(connection),
            pool,
            framing,
            reusable,
            ended: false,
        }
    }

    /// The next run of body data, reading the socket when the buffer holds
    /// none; `None` at the body's end. After an error the body has ended
    /// and its connection is closed.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        loop {
            if self.ended {
                return Poll::Ready(None);
            }
            let data = match self.take_data() {
                Ok(data) => data,
                Err(error) => {
                    self.ended = true;
                    self.connection = None;
                    return Poll::Ready(Some(Err(error)));
                }
            };
            if self.framing == Framing::Done {
                self.finish();
            }
            if let Some(data) = data {
                return Poll::Ready(Some(Ok(data)));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let Some(connection) = self.connection.as_mut() else {
                return Poll::Ready(None);
            };
            make_read_room(&mut connection.buffer, READ_RESERVE);
            let read = poll_read_buf(&mut connection.stream, &mut connection.buffer, cx);
            match ready!(read) {
                Ok(0) => {
                    self.connection = None;
                    self.ended = true;
                    if self.framing == Framing::UntilClose {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Err(BodyError::Closed)));
                }
                Ok(_) => {}
                Err(error) => {
                    self.ended = true;
                    self.connection = None;
                    return Poll::Ready(Some(Err(BodyError::Io(error))));
                }
            }
        }
    }

    /// Takes the data the buffer holds (none when it holds no data), moving
    /// the framing on.
    fn take_data(&mut self) -> Result<Option<Bytes>, BodyError> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(None);
        };
        decode_body(&mut self.framing, &mut connection.buffer)
    }

    /// The body was read to its end: the connection goes back to the pool
    /// if it can carry another request (nothing followed the body).
    fn finish(&mut self) {
        self.ended = true;
        if let Some(connection) = self.connection.take()
            && self.reusable
            && connection.buffer.is_empty()
        {
            self.pool.give_back(connection);
        }
    }
}

/// Takes the body data that `buffer` holds, framed as `framing` says,
/// and moves `framing` on (to `Done` at the body's end): the data
/// (possibly none).
fn decode_body(framing: &mut Framing, buffer: &mut BytesMut) -> Result<Option<Bytes>, BodyError> {
    match framing {
        Framing::Done => Ok(None),
        Framing::UntilClose => Ok((!buffer.is_empty()).then(|| buffer.split().freeze())),
        Framing::Length { remaining } => {
            if buffer.is_empty() {
                return Ok(None);
            }
            let take = usize::try_from(*remaining).map_or(buffer.len(), |r| r.min(buffer.len()));
            *remaining -= take as u64;
            let data = buffer.split_to(take).freeze();
            if *remaining == 0 {
                *framing = Framing::Done;
            }
            Ok(Some(data))
        }
        Framing::Chunked(state) => {
            let data = decode_chunked(buffer, state)?;
            if *state == Chunked::Done {
                *framing = Framing::Done;
            }
            Ok(data)
        }
    }
}

impl Body for WorkerBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.get_mut().poll_data(cx).map_ok(Frame::data)
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        self.framing.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_pieces(framing: Framing, pieces: &[&[u8]]) -> (Vec<u8>, Framing, BytesMut) {
        let mut framing = framing;
        let mut buffer = BytesMut::new();
        let mut data = Vec::new();
        for piece in pieces {
            buffer.extend_from_slice(piece);
            while let Some(run) = decode_body(&mut framing, &mut buffer).unwrap() {
                data.extend_from_slice(&run);
            }
        }
        (data, framing, buffer)
    }

    #[test]
    fn a_length_ends_the_body_and_leaves_what_follows() {
        let wire = b"hello world";
        for split in 0..=wire.len() {
            let (head, tail) = wire.split_at(split);
            let (data, framing, rest) =
                decode_pieces(Framing::Length { remaining: 5 }, &[head, tail]);
            assert_eq!(data, b"hello", "split at {split}");
            assert_eq!(framing, Framing::Done);
            assert_eq!(&rest[..], b" world");
        }
        let (data, framing, _) = decode_pieces(Framing::Length { remaining: 50 }, &[wire]);
        assert_eq!(data, wire);
        assert_eq!(framing, Framing::Length { remaining: 39 });
        assert_eq!(
            Framing::Length { remaining: 39 }.size_hint().exact(),
            Some(39)
        );
    }

    #[test]
    fn a_chunked_body_ends_at_its_last_chunk() {
        let (data, framing, rest) = decode_pieces(
            Framing::Chunked(Chunked::Size),
            &[b"3\r\nabc\r\n0\r\n", b"\r\nnext"],
        );
        assert_eq!(data, b"abc");
        assert_eq!(framing, Framing::Done);
        assert_eq!(&rest[..], b"next");
    }

    #[test]
    fn until_close_takes_everything() {
        let (data, framing, _) = decode_pieces(Framing::UntilClose, &[b"a", b"", b"bc"]);
        assert_eq!(data, b"abc");
        assert_eq!(framing, Framing::UntilClose);
        assert_eq!(Framing::UntilClose.size_hint().exact(), None);
    }
}
