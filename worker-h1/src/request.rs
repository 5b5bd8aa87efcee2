//! One request to a worker: its head written with its body in one
//! vectored write, and the response head read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};

use crate::body::WorkerBody;
use crate::head::{MAX_HEAD_BYTES, parse_head};
use crate::io::{READ_RESERVE, make_read_room, poll_read_buf, write_all_vectored};
use crate::pool::{Connection, Pool, Target};
use crate::{HeaderLines, SendError};

/// What a request to a worker is: the client's method, path, query,
/// headers (hop-by-hop ones already left out) and whole body.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    pub method: &'a Method,
    /// The path, from its leading `/`; the worker's path prefix goes
    /// before it.
    pub path: &'a str,
    /// What follows `?`, without it.
    pub query: Option<&'a str>,
    pub headers: &'a HeaderLines,
    /// Replaces the client's `Authorization` (the worker's own key).
    pub authorization: Option<&'a HeaderValue>,
    pub body: &'a Bytes,
}

/// A worker's response head, and its body to read.
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    /// The worker's headers, hop-by-hop ones and `Content-Length` left out.
    pub headers: HeaderLines,
    pub body: WorkerBody,
}

pub(crate) fn write_head(head: &mut Vec<u8>, target: &Target, request: &Outgoing<'_>) {
    head.clear();
    head.extend_from_slice(request.method.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(target.path_prefix.as_bytes());
    head.extend_from_slice(request.path.as_bytes());
    if let Some(query) = request.query {
        head.push(b'?');
        head.extend_from_slice(query.as_bytes());
    }
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(target.host_header.as_bytes());
    head.extend_from_slice(b"\r\n");
    match request.authorization {
        None => head.extend_from_slice(request.headers.as_wire()),
        Some(authorization) => {
            // The worker's key replaces the client's.
            for line in request.headers.lines() {
                if !line.name().eq_ignore_ascii_case(b"authorization") {
                    head.extend_from_slice(line.as_wire());
                }
            }
            head.extend_from_slice(b"authorization: ");
            head.extend_from_slice(authorization.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
    }
    head.extend_from_slice(b"content-length: ");
    head.extend_from_slice(itoa::Buffer::new().format(request.body.len()).as_bytes());
    head.extend_from_slice(b"\r\n\r\n");
}

/// Sends `request` to the pool's worker and reads the response head: on a
/// kept-alive connection if one is idle, else a new one (connected within
/// `connect_timeout`). A kept-alive connection the worker closed meanwhile
/// (it answers nothing at all) is replaced by a new one once, as hyper's
/// client does: nothing reached the worker's application.
pub async fn send(
    pool: &Arc<Pool>,
    request: &Outgoing<'_>,
    connect_timeout: Duration,
) -> Result<Response, SendError> {
    send_at(pool, request, connect_timeout, Instant::now()).await
}

/// [`send`] for a caller that has just read the clock: `now` is when the
/// request goes out, which the pool also counts idle time from.
pub async fn send_at(
    pool: &Arc<Pool>,
    request: &Outgoing<'_>,
    connect_timeout: Duration,
    now: Instant,
) -> Result<Response, SendError> {
    let target = match &pool.target {
        Ok(target) => target,
        Err(unusable) => {
            return Err(SendError::UnusableUrl {
                reason: unusable.reason(),
            });
        }
    };
    if let Some(mut connection) = pool.checkout(now) {
        connection.sent_at = now;
        match exchange(connection, target, request).await {
            Err(SendError::ClosedBeforeAnswer | SendError::Write(_)) => {}
            answered => return answered.map(|answer| answer.into_response(pool)),
        }
    }
    let connection = pool.connect(target, connect_timeout, now).await?;
    exchange(connection, target, request)
        .await
        .map(|answer| answer.into_response(pool))
}

/// A parsed head and the connection, its buffer past the head.
struct Answer {
    head: crate::head::ParsedHead,
    connection: Connection,
}

impl Answer {
    fn into_response(self, pool: &Arc<Pool>) -> Response {
        let Answer { head, connection } = self;
        Response {
            status: head.status,
            headers: head.headers,
            body: WorkerBody::new(connection, pool.clone(), head.framing, head.reusable),
        }
    }
}

async fn exchange(
    mut connection: Connection,
    target: &Target,
    request: &Outgoing<'_>,
) -> Result<Answer, SendError> {
    let mut head = std::mem::take(&mut connection.head);
    write_head(&mut head, target, request);
    write_all_vectored(&mut connection.stream, &[&head, request.body])
        .await
        .map_err(SendError::Write)?;
    connection.head = head;
    connection.buffer.clear();
    let head_request = request.method == Method::HEAD;
    loop {
        if !connection.buffer.is_empty()
            && let Some(head) = parse_head(&mut connection.buffer, head_request)?
        {
            return Ok(Answer { head, connection });
        }
        if connection.buffer.len() > MAX_HEAD_BYTES {
            return Err(SendError::BadHead(format!(
                "longer than {MAX_HEAD_BYTES} bytes"
            )));
        }
        make_read_room(&mut connection.buffer, READ_RESERVE);
        let read = std::future::poll_fn(|cx| {
            poll_read_buf(&mut connection.stream, &mut connection.buffer, cx)
        })
        .await;
        match read {
            Ok(0) if connection.buffer.is_empty() => return Err(SendError::ClosedBeforeAnswer),
            Err(error)
                if connection.buffer.is_empty()
                    && matches!(
                        error.kind(),
                        std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::BrokenPipe
                            // TLS: the worker closed without close_notify.
                            | std::io::ErrorKind::UnexpectedEof
                    ) =>
            {
                return Err(SendError::ClosedBeforeAnswer);
            }
            Ok(0) => {
                return Err(SendError::Read(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the connection closed mid-head",
                )));
            }
            Ok(_) => {}
            Err(error) => return Err(SendError::Read(error)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BodyError;
    use http::{HeaderMap, header};
    use http_body::Body;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn head_of(request: &Outgoing<'_>, url: &str) -> String {
        let target = Target::parse(url, None).unwrap();
        let mut head = Vec::new();
        write_head(&mut head, &target, request);
        String::from_utf8(head).unwrap()
    }

    #[test]
    fn the_request_head_drops_hop_by_hop_headers_and_sets_its_own() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-trace"),
        );
        headers.insert("x-trace", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::HOST, HeaderValue::from_static("router"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let headers = HeaderLines::forwarded_from_map(&headers);
        let body = Bytes::from_static(b"{}");
        let request = Outgoing {
            method: &Method::POST,
            path: "/v1/chat/completions",
            query: Some("x=1"),
            headers: &headers,
            authorization: None,
            body: &body,
        };
        let head = head_of(&request, "http://w:8000/engine-a");
        assert!(
            head.starts_with("POST /engine-a/v1/chat/completions?x=1 HTTP/1.1\r\nhost: w:8000\r\n"),
            "{head}"
        );
        assert!(head.contains("authorization: Bearer k\r\n"), "{head}");
        assert!(
            head.contains("content-type: application/json\r\n"),
            "{head}"
        );
        assert!(head.ends_with("content-length: 2\r\n\r\n"), "{head}");
        for gone in ["x-trace", "transfer-encoding", "connection", "router", "99"] {
            assert!(!head.contains(gone), "{gone} in {head}");
        }
        // The worker's own key replaces the client's.
        let key = HeaderValue::from_static("Bearer worker");
        let keyed = head_of(
            &Outgoing {
                authorization: Some(&key),
                ..request
            },
            "http://w:8000",
        );
        assert_eq!(keyed.matches("authorization").count(), 1, "{keyed}");
        assert!(
            keyed.contains("authorization: Bearer worker\r\n"),
            "{keyed}"
        );
    }

    /// A worker on loopback that answers each request on a connection with
    /// the next of `answers`, then closes the connection; its URL.
    async fn worker(answers: Vec<&'static [u8]>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut read = Vec::new();
            for answer in answers {
                // Each request is a head with an empty body.
                while !read.windows(4).any(|w| w == b"\r\n\r\n") {
                    let mut buffer = [0u8; 1024];
                    let n = stream.read(&mut buffer).await.unwrap();
                    if n == 0 {
                        return;
                    }
                    read.extend_from_slice(&buffer[..n]);
                }
                let end = read.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                read.drain(..end);
                stream.write_all(answer).await.unwrap();
            }
        });
        url
    }

    fn get<'a>(method: &'a Method, headers: &'a HeaderLines, body: &'a Bytes) -> Outgoing<'a> {
        Outgoing {
            method,
            path: "/",
            query: None,
            headers,
            authorization: None,
            body,
        }
    }

    #[tokio::test]
    async fn a_body_read_to_its_end_gives_its_connection_back() {
        let url = worker(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
        ])
        .await;
        let pool = Arc::new(Pool::new(&url));
        let (headers, body) = (HeaderLines::default(), Bytes::new());
        let request = get(&Method::GET, &headers, &body);
        for _ in 0..2 {
            let response = send(&pool, &request, Duration::from_secs(5)).await.unwrap();
            assert_eq!(response.status, StatusCode::OK);
            assert_eq!(pool.idle_count(), 0, "in use");
            let body = response.body.collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"ok");
            assert_eq!(pool.idle_count(), 1, "back in the pool");
        }
        // The third answer is cut short: an error, and no connection back.
        let mut response = send(&pool, &request, Duration::from_secs(5)).await.unwrap();
        let cut = std::future::poll_fn(|cx| response.body.poll_data(cx)).await;
        assert!(matches!(cut, Some(Err(BodyError::Closed))), "{cut:?}");
        assert!(response.body.is_end_stream());
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn a_head_request_reads_no_body() {
        let url = worker(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        ])
        .await;
        let pool = Arc::new(Pool::new(&url));
        let (headers, body) = (HeaderLines::default(), Bytes::new());
        let response = send(
            &pool,
            &get(&Method::HEAD, &headers, &body),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(response.body.collect().await.unwrap().to_bytes().is_empty());
        let response = send(
            &pool,
            &get(&Method::GET, &headers, &body),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(
            &response.body.collect().await.unwrap().to_bytes()[..],
            b"ok"
        );
    }

    #[tokio::test]
    async fn a_pooled_connection_the_worker_closed_is_replaced_once() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            // The first connection answers once and closes; the second
            // answers the retried request.
            for keep in [false, true] {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut buffer = [0u8; 1024];
                let _ = stream.read(&mut buffer).await.unwrap();
                stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nx")
                    .await
                    .unwrap();
                if keep {
                    let _ = stream.read(&mut buffer).await;
                }
            }
        });
        let pool = Arc::new(Pool::new(&url));
        let (headers, body) = (HeaderLines::default(), Bytes::new());
        let request = get(&Method::GET, &headers, &body);
        for _ in 0..2 {
            let response = send(&pool, &request, Duration::from_secs(5)).await.unwrap();
            assert_eq!(&response.body.collect().await.unwrap().to_bytes()[..], b"x");
        }
    }

    #[tokio::test]
    async fn a_malformed_head_is_refused() {
        let url = worker(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n",
        ])
        .await;
        let pool = Arc::new(Pool::new(&url));
        let (headers, body) = (HeaderLines::default(), Bytes::new());
        let refused = send(
            &pool,
            &get(&Method::GET, &headers, &body),
            Duration::from_secs(5),
        )
        .await;
        assert!(matches!(refused, Err(SendError::BadHead(_))), "{refused:?}");
        let unusable = Arc::new(Pool::new("ftp://x"));
        let refused = send(
            &unusable,
            &get(&Method::GET, &headers, &body),
            Duration::from_secs(5),
        )
        .await;
        assert!(
            matches!(refused, Err(SendError::UnusableUrl { .. })),
            "{refused:?}"
        );
    }
}
