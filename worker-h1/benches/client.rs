//! One request to an engine on loopback, answer read to its end, by this
//! crate's client and by hyper's two clients:
//!
//! - `h1`: `worker_h1::send` on a pool of kept-alive connections, the
//!   body read piece by piece with `WorkerBody::poll_data` in the calling
//!   task, as the router's proxy reads it.
//! - `hyper_pooled`: `hyper_util::client::legacy::Client` with an
//!   `HttpConnector` (`TCP_NODELAY`), hyper's pooled keep-alive client: the
//!   one that would replace this crate, and the comparable one. Its body is
//!   read with `frame()` to the end.
//! - `hyper_conn`: `hyper::client::conn::http1` on one kept connection
//!   (its connection task spawned, the `SendRequest` reused): hyper without
//!   the pool, for reference.
//!
//! The engine is a tokio `TcpListener` on a thread and runtime of its own,
//! reading each request (a 200-byte JSON `POST`) and answering on the same
//! connection:
//!
//! - `stream`: a chunked SSE answer of 64 events (about 130 bytes each,
//!   one chunk each), each event its own write, back to back: they arrive
//!   in as many reads as the timing makes.
//! - `stream_paced`: the same 64 events, 100 µs apart (the engine's
//!   thread sleeps between writes): every event arrives alone, as a
//!   decoding engine's do, and costs the client a wake-up, a read and a
//!   frame. Measured for CPU and event latency only (its wall time is the
//!   pacing).
//! - `json`: a 1 KB JSON answer with `Content-Length`.
//!
//! Each is run with the client on a current-thread runtime (`ct`), and on
//! a 2-worker multi-thread runtime (`mt`) with the loop in a spawned task,
//! as the router's proxy runs.
//!
//! Names: `<stream|json>/<client>/<ct|mt>`; the figure is wall time per
//! request (the engine's part included).
//!
//! After criterion, under `cargo bench`, an interleaved pass prints per
//! request the client's CPU time (that of every thread of the process but
//! the engine's, Linux `/proc/self/task/*/schedstat`, nanoseconds) and the
//! wall time, over a fixed number of requests in seven rounds of ten
//! slices, each client taking its turn at every slice (the first one
//! rotating), so that a change in the machine's load falls on every client
//! alike: the median of each client's rounds, and the median and range of
//! each round's ratio `h1 / hyper_pooled` and `h1 / hyper_conn`. On a
//! shared machine these are the figures to read; criterion's, measured
//! one benchmark after another, move with the machine's load. For
//! `stream_paced` it also prints the median and 90th percentile of an
//! event's latency, from just before the engine's write to the client's
//! having the frame. `WORKER_H1_CPU=0` skips the pass;
//! `WORKER_H1_CPU=<text>` runs only the rows whose name contains it.
//!
//! Run: `cargo bench -p worker-h1 --bench client -- --warm-up-time 1 --measurement-time 3`
//! (the interleaved pass alone: add a filter no benchmark matches, `-- none`).

use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use criterion::{Criterion, criterion_group};
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderValue, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use worker_h1::{HeaderLines, Outgoing, Pool};

type BoxError = Box<dyn Error + Send + Sync>;

/// Events in a streamed answer.
const EVENTS: usize = 64;
/// Bytes of the JSON answer's body.
const JSON_BYTES: usize = 1024;
/// Time between a paced stream's events.
const PACE: Duration = Duration::from_micros(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Stream,
    Paced,
    Json,
}

impl Scenario {
    const ALL: [Scenario; 3] = [Scenario::Stream, Scenario::Paced, Scenario::Json];

    fn name(self) -> &'static str {
        match self {
            Scenario::Stream => "stream",
            Scenario::Paced => "stream_paced",
            Scenario::Json => "json",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Scenario::Stream => "/stream",
            Scenario::Paced => "/stream-paced",
            Scenario::Json => "/json",
        }
    }

    /// Requests per round of the CPU pass.
    fn cpu_requests(self) -> u64 {
        match self {
            Scenario::Stream => 2000,
            Scenario::Paced => 100,
            Scenario::Json => 20_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    H1,
    HyperPooled,
    HyperConn,
}

impl Which {
    const ALL: [Which; 3] = [Which::H1, Which::HyperPooled, Which::HyperConn];

    fn name(self) -> &'static str {
        match self {
            Which::H1 => "h1",
            Which::HyperPooled => "hyper_pooled",
            Which::HyperConn => "hyper_conn",
        }
    }
}

/// What the engine answers, built once.
#[derive(Debug)]
struct Answers {
    json: Bytes,
    stream_head: Bytes,
    events: Vec<Bytes>,
    /// Body bytes of each answer, to check every read.
    json_body: usize,
    stream_body: usize,
}

impl Answers {
    fn new() -> Answers {
        let mut body =
            String::from("{\"id\":\"cmpl-1\",\"object\":\"chat.completion\",\"text\":\"");
        while body.len() < JSON_BYTES - 2 {
            body.push('x');
        }
        body.push_str("\"}");
        let json = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut stream_body = 0;
        let events = (0..EVENTS)
            .map(|i| {
                let event = format!(
                    "data: {{\"id\":\"cmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i:03}\"}}}}]}}\n\n"
                );
                stream_body += event.len();
                Bytes::from(format!("{:x}\r\n{event}\r\n", event.len()))
            })
            .collect();
        Answers {
            json: Bytes::from(json),
            stream_head: Bytes::from_static(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            ),
            events,
            json_body: body.len(),
            stream_body,
        }
    }

    fn body_bytes(&self, scenario: Scenario) -> usize {
        match scenario {
            Scenario::Json => self.json_body,
            Scenario::Stream | Scenario::Paced => self.stream_body,
        }
    }
}

/// The engine: where it listens, when it last wrote a paced event, and
/// its thread's id (left out of the client's CPU time).
#[derive(Debug)]
struct Engine {
    address: SocketAddr,
    written: Arc<Written>,
    answers: Arc<Answers>,
    tid: Option<String>,
}

/// When the engine began writing its last paced event: nanoseconds since
/// `base`.
#[derive(Debug)]
struct Written {
    base: Instant,
    at_ns: AtomicU64,
}

impl Written {
    fn mark(&self) {
        let ns = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.at_ns.store(ns, Ordering::Release);
    }

    fn since_ns(&self) -> u64 {
        let now = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        now.saturating_sub(self.at_ns.load(Ordering::Acquire))
    }
}

fn start_engine() -> Result<Engine, BoxError> {
    let written = Arc::new(Written {
        base: Instant::now(),
        at_ns: AtomicU64::new(0),
    });
    let answers = Arc::new(Answers::new());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (marks, ans) = (written.clone(), answers.clone());
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let tid = std::fs::read_link("/proc/thread-self")
                .ok()
                .and_then(|link| link.file_name().map(|n| n.to_string_lossy().into_owned()));
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    let _ = ready_tx.send(Err(error.to_string()));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match TcpListener::bind("127.0.0.1:0").await {
                    Ok(listener) => listener,
                    Err(error) => {
                        let _ = ready_tx.send(Err(error.to_string()));
                        return;
                    }
                };
                let _ = ready_tx.send(
                    listener
                        .local_addr()
                        .map(|address| (address, tid))
                        .map_err(|error| error.to_string()),
                );
                while let Ok((stream, _)) = listener.accept().await {
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(serve(stream, marks.clone(), ans.clone()));
                }
            });
        })?;
    let (address, tid) = ready_rx.recv()??;
    Ok(Engine {
        address,
        written,
        answers,
        tid,
    })
}

/// Answers requests on one connection until the client closes it.
async fn serve(
    mut stream: TcpStream,
    written: Arc<Written>,
    answers: Arc<Answers>,
) -> Result<(), BoxError> {
    let mut buffer = BytesMut::with_capacity(16 * 1024);
    loop {
        let (path, request_bytes) = loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut request = httparse::Request::new(&mut headers);
            if let httparse::Status::Complete(head) = request.parse(&buffer)? {
                let length = request
                    .headers
                    .iter()
                    .find(|header| header.name.eq_ignore_ascii_case("content-length"))
                    .map(|header| std::str::from_utf8(header.value).map(str::parse::<usize>))
                    .transpose()?
                    .transpose()?
                    .unwrap_or(0);
                break (request.path.unwrap_or_default().to_owned(), head + length);
            }
            if stream.read_buf(&mut buffer).await? == 0 {
                return Ok(());
            }
        };
        while buffer.len() < request_bytes {
            if stream.read_buf(&mut buffer).await? == 0 {
                return Ok(());
            }
        }
        buffer.advance(request_bytes);
        match path.as_str() {
            "/json" => stream.write_all(&answers.json).await?,
            "/stream" => {
                stream.write_all(&answers.stream_head).await?;
                for event in &answers.events {
                    stream.write_all(event).await?;
                }
                stream.write_all(b"0\r\n\r\n").await?;
            }
            "/stream-paced" => {
                stream.write_all(&answers.stream_head).await?;
                for event in &answers.events {
                    // One connection at a time: blocking the engine's
                    // runtime is what pacing it means.
                    std::thread::sleep(PACE);
                    written.mark();
                    stream.write_all(event).await?;
                }
                stream.write_all(b"0\r\n\r\n").await?;
            }
            _ => {
                stream
                    .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    .await?
            }
        }
    }
}

/// The three clients, on one runtime.
struct Clients {
    engine: Arc<Engine>,
    pool: Arc<Pool>,
    pooled: Client<HttpConnector, Full<Bytes>>,
    conn: SendRequest<Full<Bytes>>,
    /// Each scenario's URL, parsed once, for the pooled client.
    uris: Vec<Uri>,
    request_body: Bytes,
    headers: HeaderLines,
    host: HeaderValue,
    /// Each paced event's latency, nanoseconds.
    latencies: Vec<u64>,
}

impl Clients {
    async fn connect(engine: Arc<Engine>) -> Result<Clients, BoxError> {
        let url = format!("http://{}", engine.address);
        let pool = Arc::new(Pool::new(&url));
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let pooled = Client::builder(TokioExecutor::new()).build(connector);
        let stream = TcpStream::connect(engine.address).await?;
        stream.set_nodelay(true)?;
        let (conn, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let mut request_body = String::from(
            "{\"model\":\"m\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"",
        );
        while request_body.len() < 196 {
            request_body.push('q');
        }
        request_body.push_str("\"}]}");
        let mut headers = HeaderLines::default();
        headers.append(&CONTENT_TYPE, &HeaderValue::from_static("application/json"));
        let uris = Scenario::ALL
            .iter()
            .map(|scenario| format!("http://{}{}", engine.address, scenario.path()).parse())
            .collect::<Result<_, _>>()?;
        Ok(Clients {
            host: HeaderValue::from_str(&engine.address.to_string())?,
            engine,
            pool,
            pooled,
            conn,
            uris,
            request_body: Bytes::from(request_body),
            headers,
            latencies: Vec::new(),
        })
    }

    /// One request; the body bytes read.
    async fn one(&mut self, which: Which, scenario: Scenario) -> Result<usize, BoxError> {
        let paced = (scenario == Scenario::Paced).then_some(&*self.engine.written);
        let mut read = 0;
        match which {
            Which::H1 => {
                let request = Outgoing {
                    method: &Method::POST,
                    path: scenario.path(),
                    query: None,
                    headers: &self.headers,
                    authorization: None,
                    body: &self.request_body,
                };
                let mut response =
                    worker_h1::send(&self.pool, &request, Duration::from_secs(5)).await?;
                while let Some(data) = std::future::poll_fn(|cx| response.body.poll_data(cx)).await
                {
                    read += data?.len();
                    if let Some(written) = paced {
                        self.latencies.push(written.since_ns());
                    }
                }
            }
            Which::HyperPooled | Which::HyperConn => {
                let pooled = which == Which::HyperPooled;
                let uri = if pooled {
                    let index = Scenario::ALL.iter().position(|s| *s == scenario);
                    self.uris[index.unwrap_or_default()].clone()
                } else {
                    Uri::from_static(scenario.path())
                };
                let mut request = Request::builder()
                    .method(Method::POST)
                    .uri(uri)
                    .header(CONTENT_TYPE, "application/json");
                if !pooled {
                    request = request.header(HOST, self.host.clone());
                }
                let request = request.body(Full::new(self.request_body.clone()))?;
                let response = if pooled {
                    self.pooled.request(request).await?
                } else {
                    self.conn.ready().await?;
                    self.conn.send_request(request).await?
                };
                let mut body = response.into_body();
                while let Some(frame) = body.frame().await {
                    if let Ok(data) = frame?.into_data() {
                        read += data.len();
                        if let Some(written) = paced {
                            self.latencies.push(written.since_ns());
                        }
                    }
                }
            }
        }
        Ok(read)
    }

    /// `requests` requests, each answer checked; the wall time they took.
    async fn run(
        &mut self,
        which: Which,
        scenario: Scenario,
        requests: u64,
    ) -> Result<Duration, BoxError> {
        let expected = self.engine.answers.body_bytes(scenario);
        let start = Instant::now();
        for _ in 0..requests {
            let read = self.one(which, scenario).await?;
            if read != expected {
                return Err(format!("read {read} body bytes, expected {expected}").into());
            }
        }
        Ok(start.elapsed())
    }
}

/// A runtime for the clients, and the clients on it.
struct Setup {
    name: &'static str,
    runtime: Runtime,
    /// Whether the loop runs in a spawned task (on a worker thread).
    spawn: bool,
    clients: Option<Clients>,
}

impl Setup {
    fn new(name: &'static str, engine: &Arc<Engine>) -> Result<Setup, BoxError> {
        let spawn = name == "mt";
        let runtime = if spawn {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
        } else {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
        };
        let clients = runtime.block_on(Clients::connect(engine.clone()))?;
        Ok(Setup {
            name,
            runtime,
            spawn,
            clients: Some(clients),
        })
    }

    fn run(
        &mut self,
        which: Which,
        scenario: Scenario,
        requests: u64,
    ) -> Result<Duration, BoxError> {
        let mut clients = self.clients.take().ok_or("the clients were lost")?;
        let (clients, elapsed) = if self.spawn {
            self.runtime.block_on(self.runtime.spawn(async move {
                let elapsed = clients.run(which, scenario, requests).await;
                (clients, elapsed)
            }))?
        } else {
            let elapsed = self
                .runtime
                .block_on(clients.run(which, scenario, requests));
            (clients, elapsed)
        };
        self.clients = Some(clients);
        elapsed
    }
}

fn or_exit<T>(result: Result<T, BoxError>) -> T {
    match result {
        Ok(value) => value,
        Err(error) => {
            eprintln!("worker-h1 client bench: {error}");
            std::process::exit(1);
        }
    }
}

fn setups() -> (Arc<Engine>, Vec<Setup>) {
    let engine = Arc::new(or_exit(start_engine()));
    let setups = ["ct", "mt"]
        .into_iter()
        .map(|name| or_exit(Setup::new(name, &engine)))
        .collect();
    (engine, setups)
}

fn requests(c: &mut Criterion) {
    let (_engine, mut setups) = setups();
    for scenario in [Scenario::Stream, Scenario::Json] {
        let mut group = c.benchmark_group(scenario.name());
        for setup in &mut setups {
            for which in Which::ALL {
                group.bench_function(format!("{}/{}", which.name(), setup.name), |b| {
                    b.iter_custom(|iters| or_exit(setup.run(which, scenario, iters)));
                });
            }
        }
        group.finish();
    }
}

/// CPU nanoseconds of every thread of this process but `leave_out`.
fn process_cpu_ns(leave_out: Option<&str>) -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let task = task.ok()?;
        if leave_out.is_some_and(|tid| task.file_name().to_string_lossy() == tid) {
            continue;
        }
        let schedstat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
        total += schedstat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn percentile(sorted: &[u64], fraction: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted.get(index).map_or(f64::NAN, |ns| *ns as f64 / 1e3)
}

fn range(values: &[f64]) -> String {
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{low:.2}..{high:.2}")
}

/// Each client's median over the rounds (`figures[client][round]`, ns
/// per request), and the median and range of each round's ratio of
/// `h1`'s to each hyper client's.
fn summary(figures: &[Vec<f64>]) -> String {
    let ratios = |other: usize| -> Vec<f64> {
        figures[0]
            .iter()
            .zip(&figures[other])
            .map(|(h1, o)| h1 / o)
            .collect()
    };
    let (pooled, conn) = (ratios(1), ratios(2));
    let medians: Vec<String> = Which::ALL
        .iter()
        .zip(figures)
        .map(|(which, values)| {
            format!(
                "{} {:.1} µs",
                which.name(),
                median(&mut values.clone()) / 1e3
            )
        })
        .collect();
    format!(
        "{}; h1/hyper_pooled {:.2} ({}), h1/hyper_conn {:.2} ({})",
        medians.join(", "),
        median(&mut pooled.clone()),
        range(&pooled),
        median(&mut conn.clone()),
        range(&conn),
    )
}

/// The interleaved pass: per scenario and runtime, rounds of each client
/// in turn; CPU and wall time per request and their ratios, and a paced
/// event's latency.
fn cpu_report(filter: &str) -> Result<(), BoxError> {
    const ROUNDS: usize = 7;
    // Each round's requests, in slices taken by each client in turn, so
    // that a change in the machine's load falls on every client alike.
    const SLICES: usize = 10;
    let (engine, mut setups) = setups();
    let leave_out = engine.tid.as_deref();
    if process_cpu_ns(leave_out).is_none() || leave_out.is_none() {
        println!("client CPU: /proc/self/task/*/schedstat unavailable");
        return Ok(());
    }
    println!(
        "\nper request, interleaved: client CPU (every thread but the engine's) \
         and wall time, median of {ROUNDS} rounds:"
    );
    for scenario in Scenario::ALL {
        for setup in &mut setups {
            let row = format!("{}/{}", scenario.name(), setup.name);
            if !row.contains(filter) {
                continue;
            }
            let requests = scenario.cpu_requests();
            for which in Which::ALL {
                setup.run(which, scenario, requests / 4)?;
            }
            let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); Which::ALL.len()];
            let mut wall: Vec<Vec<f64>> = vec![Vec::new(); Which::ALL.len()];
            let mut latencies: Vec<Vec<u64>> = vec![Vec::new(); Which::ALL.len()];
            for round in 0..ROUNDS {
                let mut round_cpu_ns = [0u64; Which::ALL.len()];
                let mut round_wall = [Duration::ZERO; Which::ALL.len()];
                for slice in 0..SLICES {
                    for turn in 0..Which::ALL.len() {
                        let index = (round + slice + turn) % Which::ALL.len();
                        if let Some(clients) = setup.clients.as_mut() {
                            clients.latencies.clear();
                        }
                        let before = process_cpu_ns(leave_out).ok_or("schedstat")?;
                        round_wall[index] +=
                            setup.run(Which::ALL[index], scenario, requests / SLICES as u64)?;
                        let after = process_cpu_ns(leave_out).ok_or("schedstat")?;
                        round_cpu_ns[index] += after.saturating_sub(before);
                        if let Some(clients) = setup.clients.as_mut() {
                            latencies[index].append(&mut clients.latencies);
                        }
                    }
                }
                for index in 0..Which::ALL.len() {
                    cpu[index].push(round_cpu_ns[index] as f64 / requests as f64);
                    wall[index].push(round_wall[index].as_nanos() as f64 / requests as f64);
                }
            }
            println!("  {row:<20} CPU  {}", summary(&cpu));
            if scenario != Scenario::Paced {
                println!("  {:<20} wall {}", "", summary(&wall));
            }
            if scenario == Scenario::Paced {
                let figures: Vec<String> = Which::ALL
                    .iter()
                    .zip(&mut latencies)
                    .map(|(which, values)| {
                        values.sort_unstable();
                        format!(
                            "{} p50 {:.1} µs p90 {:.1} µs",
                            which.name(),
                            percentile(values, 0.5),
                            percentile(values, 0.9)
                        )
                    })
                    .collect();
                println!("  {:<20} event latency: {}", "", figures.join(", "));
            }
        }
    }
    Ok(())
}

criterion_group!(benches, requests);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let filter = std::env::var("WORKER_H1_CPU").unwrap_or_default();
    if std::env::args().any(|arg| arg == "--bench") && filter != "0" {
        or_exit(cpu_report(&filter));
    }
}
