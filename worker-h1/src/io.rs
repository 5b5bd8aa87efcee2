//! Socket reads and writes: one vectored write per request, reads into a
//! buffer's spare room, on plain TCP or TLS alike.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// Room made in a read buffer when under half of it is free
/// ([`make_read_room`]).
pub(crate) const READ_RESERVE: usize = 16 * 1024;
/// Most slices handed to one vectored write (the kernel takes up to 1024).
const MAX_WRITE_SLICES: usize = 32;

/// Writes `slices` in order, in as few system calls as the socket allows
/// (one, normally).
pub(crate) async fn write_all_vectored(
    stream: &mut WorkerStream,
    slices: &[&[u8]],
) -> std::io::Result<()> {
    // The slice being written, and how much of it is out.
    let mut index = 0usize;
    let mut offset = 0usize;
    while index < slices.len() {
        if offset == slices[index].len() {
            index += 1;
            offset = 0;
            continue;
        }
        let n = std::future::poll_fn(|cx| {
            let mut vectored = [IoSlice::new(&[]); MAX_WRITE_SLICES];
            let rest = &slices[index..];
            vectored[0] = IoSlice::new(&rest[0][offset..]);
            for (slot, slice) in vectored.iter_mut().zip(rest).skip(1) {
                *slot = IoSlice::new(slice);
            }
            Pin::new(&mut *stream)
                .poll_write_vectored(cx, &vectored[..rest.len().min(MAX_WRITE_SLICES)])
        })
        .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        // Step past what went out.
        let mut left = n;
        while left > 0 && index < slices.len() {
            let here = slices[index].len() - offset;
            if left < here {
                offset += left;
                left = 0;
            } else {
                left -= here;
                index += 1;
                offset = 0;
            }
        }
    }
    // TLS keeps what it has not sent yet in its own buffer; on plain TCP
    // this returns at once.
    std::future::poll_fn(|cx| Pin::new(&mut *stream).poll_flush(cx)).await
}

/// Makes room in `buffer` for a read of up to `room_bytes`, unless half of
/// that is free already. What was read before it (a request body, a frame
/// still being sent) keeps the buffer's allocation shared, so reserving
/// the whole room whenever a byte of it was used would move the buffer to
/// a new allocation on every request.
pub(crate) fn make_read_room(buffer: &mut BytesMut, room_bytes: usize) {
    if buffer.capacity() - buffer.len() < room_bytes / 2 {
        buffer.reserve(room_bytes);
    }
}

/// Reads what the socket has into the buffer's spare room. tokio marks the
/// socket drained when a read fills less than the room offered, so the
/// next poll waits for readiness without another system call.
pub(crate) fn poll_read_buf(
    stream: &mut WorkerStream,
    buffer: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<usize>> {
    tokio_util::io::poll_read_buf(Pin::new(stream), cx, buffer)
}

/// A connection to a worker: plain TCP, or TLS over it. The TLS state is
/// boxed (it is tens of kilobytes), so a plain connection stays small; a
/// plain read or write costs one branch more, nothing else.
#[derive(Debug)]
pub(crate) enum WorkerStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for WorkerStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WorkerStream::Plain(tcp) => Pin::new(tcp).poll_read(cx, buf),
            WorkerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WorkerStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            WorkerStream::Plain(tcp) => Pin::new(tcp).poll_write(cx, buf),
            WorkerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            WorkerStream::Plain(tcp) => Pin::new(tcp).poll_write_vectored(cx, bufs),
            WorkerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            WorkerStream::Plain(tcp) => tcp.is_write_vectored(),
            WorkerStream::Tls(tls) => tls.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WorkerStream::Plain(tcp) => Pin::new(tcp).poll_flush(cx),
            WorkerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WorkerStream::Plain(tcp) => Pin::new(tcp).poll_shutdown(cx),
            WorkerStream::Tls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_room_stays_in_a_shared_allocation_while_half_of_it_is_free() {
        let mut buffer = BytesMut::with_capacity(1024);
        buffer.extend_from_slice(&[b'x'; 300]);
        // What was read is handed on and still held, as a request body is.
        let held = buffer.split_to(300).freeze();
        let room_at = buffer.spare_capacity_mut().as_ptr();
        make_read_room(&mut buffer, 1024);
        assert_eq!(
            buffer.capacity(),
            1024 - 300,
            "half the room is free: no move"
        );
        assert_eq!(buffer.spare_capacity_mut().as_ptr(), room_at);

        buffer.extend_from_slice(&[b'y'; 400]);
        make_read_room(&mut buffer, 1024);
        assert!(
            buffer.capacity() - buffer.len() >= 1024,
            "under half free: the whole room"
        );
        assert_eq!(&buffer[..], &[b'y'; 400][..], "what was unread is kept");
        assert_eq!(&held[..], &[b'x'; 300][..]);
    }
}
