//! The router's HTTP/1.1 client, kept at this path for compatibility: it
//! is the [`worker_h1`] crate now, and new code uses that crate directly.
//!
//! Everything is `worker_h1`'s but the response body's type: callers here
//! read it piece by piece ([`WorkerBody::poll_piece`], [`Piece`]), as
//! they did when the client could also hand on a worker's chunks framed
//! as they came; every piece is data now. [`send`] and [`send_at`] give a
//! [`Response`] with that body.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body::{Body, Frame, SizeHint};

pub use worker_h1::{BodyError, HeaderLines, Outgoing, Pool, SendError};

/// A worker's response head, and its body to read
/// ([`worker_h1::Response`]).
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    /// The worker's headers, hop-by-hop ones and `Content-Length` left out.
    pub headers: HeaderLines,
    pub body: WorkerBody,
}

impl From<worker_h1::Response> for Response {
    fn from(response: worker_h1::Response) -> Response {
        Response {
            status: response.status,
            headers: response.headers,
            body: WorkerBody(response.body),
        }
    }
}

/// [`worker_h1::send`], its response as [`Response`].
pub async fn send(
    pool: &Arc<Pool>,
    request: &Outgoing<'_>,
    connect_timeout: Duration,
) -> Result<Response, SendError> {
    worker_h1::send(pool, request, connect_timeout)
        .await
        .map(Response::from)
}

/// [`worker_h1::send_at`], its response as [`Response`].
pub async fn send_at(
    pool: &Arc<Pool>,
    request: &Outgoing<'_>,
    connect_timeout: Duration,
    now: Instant,
) -> Result<Response, SendError> {
    worker_h1::send_at(pool, request, connect_timeout, now)
        .await
        .map(Response::from)
}

/// A worker's response body ([`worker_h1::WorkerBody`]), read in pieces.
#[derive(Debug)]
pub struct WorkerBody(worker_h1::WorkerBody);

impl WorkerBody {
    /// The next piece of the body ([`worker_h1::WorkerBody::poll_data`]).
    /// `relay` is not used: every piece is [`Piece::Data`].
    pub fn poll_piece(
        &mut self,
        cx: &mut Context<'_>,
        _relay: bool,
    ) -> Poll<Option<Result<Piece, BodyError>>> {
        self.0.poll_data(cx).map_ok(Piece::Data)
    }
}

impl Body for WorkerBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.get_mut().0.poll_data(cx).map_ok(Frame::data)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}

/// A piece of a worker's body on its way to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Body data.
    Data(Bytes),
}

impl Piece {
    /// The body data the piece carries, in order.
    pub fn data_parts(&self) -> impl Iterator<Item = &[u8]> {
        let Piece::Data(data) = self;
        (!data.is_empty()).then_some(&data[..]).into_iter()
    }

    /// The body data.
    pub fn into_data(self) -> Bytes {
        let Piece::Data(data) = self;
        data
    }

    /// The piece's length in bytes.
    pub fn len(&self) -> usize {
        let Piece::Data(data) = self;
        data.len()
    }

    /// Whether it carries no bytes at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_is_its_data() {
        let piece = Piece::Data(Bytes::from_static(b"data: 1\n\n"));
        assert_eq!(piece.len(), 9);
        assert!(!piece.is_empty());
        assert_eq!(
            piece.data_parts().collect::<Vec<_>>(),
            [&b"data: 1\n\n"[..]]
        );
        assert_eq!(piece.into_data(), "data: 1\n\n");
        let empty = Piece::Data(Bytes::new());
        assert!(empty.is_empty());
        assert_eq!(empty.data_parts().count(), 0);
    }
}
