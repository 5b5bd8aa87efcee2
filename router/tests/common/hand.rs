//! An engine written by hand on a raw socket, for tests that need to say
//! exactly which bytes a response puts on the wire, and when: `/health`
//! answers 200, `/v1/loads` an idle SGLang report, anything but a `POST`
//! 404, and a `POST` goes to the test.

use std::future::Future;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Starts an engine on a fresh loopback port; its URL. Each `POST`'s body
/// is read past, then `on_post` gets the connection to write the whole
/// answer on, and gives it back for the next request (or `None` to close
/// it).
pub async fn hand_engine<F, Fut>(on_post: F) -> String
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<TcpStream>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let on_post = Arc::new(on_post);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve(stream, on_post.clone()));
        }
    });
    url
}

/// Serves one connection's requests until it closes.
async fn serve<F, Fut>(mut stream: TcpStream, on_post: Arc<F>)
where
    F: Fn(TcpStream) -> Fut,
    Fut: Future<Output = Option<TcpStream>>,
{
    stream.set_nodelay(true).unwrap();
    let mut buffer = Vec::new();
    loop {
        let Some((head, body_len)) = read_head(&mut stream, &mut buffer).await else {
            return;
        };
        // The body follows the head; it is not needed, only read past.
        while buffer.len() < body_len {
            let mut more = [0u8; 4096];
            match stream.read(&mut more).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buffer.extend_from_slice(&more[..n]),
            }
        }
        buffer.drain(..body_len);
        let answer = |body: &str| {
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        if head.starts_with("GET /health") {
            stream.write_all(answer("{}").as_bytes()).await.unwrap();
        } else if head.starts_with("GET /v1/loads") {
            let loads = r#"{"timestamp": "", "version": "test", "dp_rank_count": 1, "loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0, "token_usage": 0.1, "gen_throughput": 2000.0}]}"#;
            stream.write_all(answer(loads).as_bytes()).await.unwrap();
        } else if head.starts_with("POST ") {
            match on_post(stream).await {
                Some(back) => stream = back,
                None => return,
            }
        } else {
            stream
                .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
        }
    }
}

/// Reads one request head from the connection; its text and body length.
async fn read_head(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<(String, usize)> {
    loop {
        if let Some(end) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
            buffer.drain(..end + 4);
            let body_len = head
                .lines()
                .filter_map(|line| line.split_once(':'))
                .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
                .and_then(|(_, value)| value.trim().parse().ok())
                .unwrap_or(0);
            return Some((head, body_len));
        }
        let mut more = [0u8; 4096];
        match stream.read(&mut more).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buffer.extend_from_slice(&more[..n]),
        }
    }
}
