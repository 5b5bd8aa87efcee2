//! Reading a client's request body under a size limit and a deadline.
//!
//! A client that declares a body and then stalls, or sends more than the
//! limit, must not hold a connection or a buffer: [`read_body`] bounds both,
//! and [`BodyReadError`] says which bound was hit and how to answer it.

use std::time::Duration;

use axum::BoxError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http_body::Body;
use http_body_util::BodyExt;
use thiserror::Error;

use crate::config::ServerConfig;

/// After a body turns out too large, at most this much more of it is read
/// and thrown away before answering 413. A client that writes its whole body
/// before reading (Python's urllib, for one) then reads the 413 instead of a
/// connection reset, as behind nginx's lingering close; past this bound it
/// gets the reset.
pub(crate) const DISCARD_LIMIT_BYTES: u64 = 64 * 1024 * 1024;

/// The longest the rest of a too-large body is read and thrown away.
pub(crate) const DISCARD_TIME: Duration = Duration::from_secs(5);

/// Why a request body could not be read. Each answer closes the connection:
/// the rest of the body may still be on its way and is not worth reading.
#[derive(Debug, Error)]
pub(crate) enum BodyReadError {
    /// The body is larger than `server.body_limit_bytes`: answer 413.
    #[error("request body exceeds {limit_bytes} bytes (server.body_limit_bytes)")]
    TooLarge { limit_bytes: usize },
    /// The whole body did not arrive within `server.client_body_timeout_ms`:
    /// answer 408.
    #[error(
        "request body did not arrive within {} ms (server.client_body_timeout_ms)",
        after.as_millis()
    )]
    TimedOut { after: Duration },
    /// The client went away or sent a malformed body (say, bad chunked
    /// encoding) before its end. The answer (400) will rarely be read.
    #[error("request body broke off before its end")]
    Disconnected {
        #[source]
        source: axum::Error,
    },
}

impl BodyReadError {
    /// The status to answer with: 413, 408 or 400.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            BodyReadError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyReadError::TimedOut { .. } => StatusCode::REQUEST_TIMEOUT,
            BodyReadError::Disconnected { .. } => StatusCode::BAD_REQUEST,
        }
    }

    /// An OpenAI-shaped error (`{"error": {"message", "type"}}`) with
    /// [`status`](Self::status) and `Connection: close`.
    pub(crate) fn response(&self) -> Response {
        let body = serde_json::json!({
            "error": {"message": self.to_string(), "type": "invalid_request_error"}
        });
        let mut response = (self.status(), axum::Json(body)).into_response();
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    }
}

impl IntoResponse for BodyReadError {
    fn into_response(self) -> Response {
        self.response()
    }
}

/// [`read_body`] under the server's `body_limit_bytes` and
/// `client_body_timeout_ms`, from the request's arrival.
pub(crate) async fn read_client_body<B>(
    body: B,
    server: &ServerConfig,
    arrived: tokio::time::Instant,
) -> Result<Bytes, BodyReadError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    read_body(
        body,
        server.body_limit_bytes,
        server.client_body_timeout(),
        arrived,
    )
    .await
}

/// Reads the whole of `body` if it is at most `limit_bytes` long and arrives
/// within `deadline` of `started`: the request's arrival, a time the caller
/// has already read, so the read costs no clock read of its own.
///
/// A body over the limit is read on and thrown away for up to
/// [`DISCARD_LIMIT_BYTES`] and [`DISCARD_TIME`] before `TooLarge` returns, so
/// that the client can read the 413. A body that breaks before reaching the
/// limit is `Disconnected`, never `TooLarge`.
///
/// Any body will do: axum's, or hyper's own `Incoming` (the proxy's routes
/// read it directly, with no boxing in between).
pub(crate) async fn read_body<B>(
    mut body: B,
    limit_bytes: usize,
    deadline: Duration,
    started: tokio::time::Instant,
) -> Result<Bytes, BodyReadError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let read = collect(&mut body, limit_bytes);
    // A deadline past what the clock can hold is no deadline.
    let read = match started.checked_add(deadline) {
        Some(read_by) => tokio::time::timeout_at(read_by, read).await,
        None => Ok(read.await),
    };
    match read {
        Err(_elapsed) => Err(BodyReadError::TimedOut { after: deadline }),
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(Stop::Broken(source))) => Err(BodyReadError::Disconnected { source }),
        Ok(Err(Stop::TooLarge)) => {
            discard(&mut body).await;
            Err(BodyReadError::TooLarge { limit_bytes })
        }
    }
}

enum Stop {
    TooLarge,
    Broken(axum::Error),
}

async fn collect<B>(body: &mut B, limit_bytes: usize) -> Result<Bytes, Stop>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let limit = u64::try_from(limit_bytes).unwrap_or(u64::MAX);
    let hint = body.size_hint();
    // A declared Content-Length over the limit is refused before buffering.
    if hint.lower() > limit {
        return Err(Stop::TooLarge);
    }
    let mut length: u64 = 0;
    // Most bodies arrive in one chunk: keep it without copying, and copy
    // only when a second one comes.
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| Stop::Broken(axum::Error::new(error)))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers carry nothing the router forwards
        };
        length = length.saturating_add(data.len() as u64);
        if length > limit {
            return Err(Stop::TooLarge);
        }
        if let Some(joined) = joined.as_mut() {
            joined.extend_from_slice(&data);
        } else if let Some(earlier) = first.take() {
            let expected = hint.exact().unwrap_or(length).min(limit);
            let mut buffer = BytesMut::with_capacity(usize::try_from(expected).unwrap_or(0));
            buffer.extend_from_slice(&earlier);
            buffer.extend_from_slice(&data);
            joined = Some(buffer);
        } else {
            first = Some(data);
        }
    }
    Ok(match (joined, first) {
        (Some(joined), _) => joined.freeze(),
        (None, Some(first)) => first,
        (None, None) => Bytes::new(),
    })
}

/// Reads and drops the rest of a too-large body, within the discard bounds;
/// stops early if the body ends or breaks.
async fn discard<B>(body: &mut B)
where
    B: Body<Data = Bytes> + Unpin,
{
    let drain = async {
        let mut discarded: u64 = 0;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                discarded = discarded.saturating_add(data.len() as u64);
                if discarded > DISCARD_LIMIT_BYTES {
                    return;
                }
            }
        }
    };
    let _ = tokio::time::timeout(DISCARD_TIME, drain).await;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use axum::body::Body;
    use futures::{StreamExt, stream};
    use tokio::time::Instant;

    use super::*;

    type Chunk = Result<Bytes, std::io::Error>;

    fn chunks(parts: &[&'static str]) -> Vec<Chunk> {
        parts
            .iter()
            .map(|part| Ok(Bytes::from_static(part.as_bytes())))
            .collect()
    }

    /// A body from `parts` that then stalls forever (a client that stops
    /// sending without closing).
    fn stalling(parts: Vec<Chunk>) -> Body {
        Body::from_stream(stream::iter(parts).chain(stream::pending()))
    }

    /// A body that yields `parts` and ends, counting the bytes pulled from it.
    fn counted(parts: Vec<Chunk>, pulled: Arc<AtomicU64>) -> Body {
        Body::from_stream(stream::iter(parts).inspect(move |chunk| {
            if let Ok(chunk) = chunk {
                pulled.fetch_add(chunk.len() as u64, Ordering::SeqCst);
            }
        }))
    }

    const LONG: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn a_body_within_the_limit_is_read_whole() {
        let one = read_body(Body::from("hello"), 5, LONG, Instant::now())
            .await
            .unwrap();
        assert_eq!(one, "hello");
        let pieces = Body::from_stream(stream::iter(chunks(&["he", "ll", "o"])));
        assert_eq!(
            read_body(pieces, 5, LONG, Instant::now()).await.unwrap(),
            "hello"
        );
        assert_eq!(
            read_body(Body::empty(), 5, LONG, Instant::now())
                .await
                .unwrap(),
            ""
        );
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_too_large() {
        let error = read_body(Body::from("123456"), 5, LONG, Instant::now())
            .await
            .unwrap_err();
        assert!(
            matches!(error, BodyReadError::TooLarge { limit_bytes: 5 }),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn a_streamed_body_over_the_limit_is_too_large_and_read_to_its_end() {
        let pulled = Arc::new(AtomicU64::new(0));
        let parts = chunks(&["1234", "5678", "rest of it", "and more"]);
        let error = read_body(counted(parts, pulled.clone()), 5, LONG, Instant::now())
            .await
            .unwrap_err();
        assert!(matches!(error, BodyReadError::TooLarge { .. }), "{error:?}");
        assert_eq!(
            pulled.load(Ordering::SeqCst),
            4 + 4 + 10 + 8,
            "the rest was read and thrown away, so the client can read the 413"
        );
    }

    #[tokio::test]
    async fn discarding_stops_after_the_byte_bound() {
        let pulled = Arc::new(AtomicU64::new(0));
        let chunk = Bytes::from(vec![0u8; 1 << 20]);
        let counter = pulled.clone();
        let endless = stream::repeat(chunk).map(move |chunk| {
            counter.fetch_add(chunk.len() as u64, Ordering::SeqCst);
            Ok::<_, std::io::Error>(chunk)
        });
        let error = read_body(Body::from_stream(endless), 1024, LONG, Instant::now())
            .await
            .unwrap_err();
        assert!(matches!(error, BodyReadError::TooLarge { .. }), "{error:?}");
        let pulled = pulled.load(Ordering::SeqCst);
        assert!(pulled > DISCARD_LIMIT_BYTES, "{pulled}");
        assert!(pulled <= DISCARD_LIMIT_BYTES + 2 * (1 << 20), "{pulled}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_counts_from_the_requests_arrival() {
        // The head arrived 20 s ago: of a 30 s deadline, 10 s are left.
        tokio::time::advance(Duration::from_secs(20)).await;
        let arrived = Instant::now() - Duration::from_secs(20);
        let reading = Instant::now();
        let error = read_body(stalling(chunks(&["12"])), 100, LONG, arrived)
            .await
            .unwrap_err();
        assert!(
            matches!(error, BodyReadError::TimedOut { after } if after == LONG),
            "{error:?}"
        );
        assert_eq!(reading.elapsed(), Duration::from_secs(10));
        // A deadline the clock cannot hold is no deadline.
        let read = read_body(Body::from("hello"), 5, Duration::MAX, Instant::now()).await;
        assert_eq!(read.unwrap(), "hello");
    }

    #[tokio::test(start_paused = true)]
    async fn discarding_stops_after_the_time_bound() {
        let started = tokio::time::Instant::now();
        let error = read_body(stalling(chunks(&["123456"])), 5, LONG, Instant::now())
            .await
            .unwrap_err();
        assert!(matches!(error, BodyReadError::TooLarge { .. }), "{error:?}");
        // Paused time moves only to the timers that fire: the discard bound
        // ended it, not the body deadline.
        let elapsed = started.elapsed();
        assert!(elapsed >= DISCARD_TIME && elapsed < LONG, "{elapsed:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_times_out_at_the_deadline() {
        let deadline = Duration::from_millis(500);
        let started = tokio::time::Instant::now();
        let error = read_body(stalling(chunks(&["12345"])), 100, deadline, Instant::now())
            .await
            .unwrap_err();
        assert!(
            matches!(error, BodyReadError::TimedOut { after } if after == deadline),
            "{error:?}"
        );
        let elapsed = started.elapsed();
        assert!(elapsed >= deadline && elapsed < LONG, "{elapsed:?}");
        assert_eq!(error.status(), StatusCode::REQUEST_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_keeps_trickling_still_times_out() {
        // One byte every 100 ms: activity never stops, the deadline still holds.
        let trickle = stream::unfold((), |()| async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Some((Ok::<_, std::io::Error>(Bytes::from_static(b"x")), ()))
        });
        let error = read_body(
            Body::from_stream(trickle),
            1 << 20,
            Duration::from_secs(1),
            Instant::now(),
        )
        .await
        .unwrap_err();
        assert!(matches!(error, BodyReadError::TimedOut { .. }), "{error:?}");
    }

    #[tokio::test]
    async fn a_body_that_breaks_is_disconnected_not_too_large() {
        let mut parts = chunks(&["1234"]);
        parts.push(Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "client went away",
        )));
        let error = read_body(
            Body::from_stream(stream::iter(parts)),
            5,
            LONG,
            Instant::now(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(error, BodyReadError::Disconnected { .. }),
            "{error:?}"
        );
        assert_eq!(error.status(), StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn answers_close_the_connection_and_keep_the_proxys_wording() {
        let cases = [
            (
                BodyReadError::TooLarge { limit_bytes: 1024 },
                StatusCode::PAYLOAD_TOO_LARGE,
                "request body exceeds 1024 bytes (server.body_limit_bytes)",
            ),
            (
                BodyReadError::TimedOut {
                    after: Duration::from_millis(1500),
                },
                StatusCode::REQUEST_TIMEOUT,
                "request body did not arrive within 1500 ms (server.client_body_timeout_ms)",
            ),
        ];
        for (error, status, message) in cases {
            let response = error.into_response();
            assert_eq!(response.status(), status);
            assert_eq!(response.headers()[header::CONNECTION], "close");
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .unwrap();
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(json["error"]["message"], message);
            assert_eq!(json["error"]["type"], "invalid_request_error");
        }
    }
}
