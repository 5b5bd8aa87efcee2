//! [`Coalesce`]: a response body that joins the data frames already received
//! into one, so a burst of SSE events costs one write to the client, not one
//! per event.
//!
//! An engine often writes many events at once (a batch step finishes several
//! tokens; a canned or cached answer is written whole). hyper's client hands
//! the proxy one frame per scheduler turn, and passing each on as it comes
//! means one system call per event. `Coalesce` never waits for data that has
//! not arrived: when its inner body has nothing ready, it gives the upstream
//! connection a couple of scheduler turns to hand over what it has already
//! read, then sends what it has. A turn costs a task poll, not a system call
//! and not a timer, so a token that arrives alone is late by microseconds.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};

/// Most bytes one outgoing frame gathers.
pub const MAX_BATCH_BYTES: usize = 64 * 1024;

/// Scheduler turns a batch waits through with nothing new before it goes.
/// One is not enough: with tokio 1.54 and hyper 1.12, the upstream
/// connection's next frame shows up on the second re-poll, and with one turn
/// every SSE event still went out in its own write (`cargo xtask bench
/// --only proxy`, stream rows: 1.4k req/s with one turn, 2.6k with two or
/// three).
const EMPTY_TURNS_BEFORE_SENDING: u8 = 2;

/// See the module documentation.
#[derive(Debug)]
pub struct Coalesce<B: Body> {
    inner: B,
    batch: Batch,
    /// What arrived behind the batch (trailers or an error), sent after it.
    held: Option<Result<Frame<Bytes>, B::Error>>,
    /// Scheduler turns the current batch has waited through with nothing
    /// new from the upstream connection.
    empty_turns: u8,
    /// The inner body ended; nothing more will come from it.
    inner_ended: bool,
}

// No field is pinned: the inner body is `Unpin` and the rest is plain data.
impl<B: Body + Unpin> Unpin for Coalesce<B> {}

impl<B: Body<Data = Bytes> + Unpin> Coalesce<B> {
    pub fn new(inner: B) -> Coalesce<B> {
        Coalesce {
            inner,
            batch: Batch::default(),
            held: None,
            empty_turns: 0,
            inner_ended: false,
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for Coalesce<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        if let Some(held) = this.held.take() {
            return Poll::Ready(Some(held));
        }
        while !this.inner_ended {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        this.batch.push(data);
                        this.empty_turns = 0;
                        if this.inner.is_end_stream() {
                            this.inner_ended = true;
                        } else if this.batch.len() >= MAX_BATCH_BYTES {
                            return Poll::Ready(Some(Ok(this.batch.take_frame())));
                        }
                    }
                    Err(other) => return this.send_before(Ok(other)),
                },
                Poll::Ready(Some(Err(error))) => return this.send_before(Err(error)),
                Poll::Ready(None) => this.inner_ended = true,
                Poll::Pending if this.batch.is_empty() => return Poll::Pending,
                Poll::Pending if this.empty_turns < EMPTY_TURNS_BEFORE_SENDING => {
                    // The upstream connection was woken when asked for more;
                    // let it run before the batch goes.
                    this.empty_turns += 1;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Pending => {
                    this.empty_turns = 0;
                    return Poll::Ready(Some(Ok(this.batch.take_frame())));
                }
            }
        }
        if this.batch.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Ready(Some(Ok(this.batch.take_frame())))
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none()
            && self.batch.is_empty()
            && (self.inner_ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        if self.inner_ended || !self.batch.is_empty() || self.held.is_some() {
            // Read once, before the first frame; a guess is fine after.
            return SizeHint::default();
        }
        self.inner.size_hint()
    }
}

impl<B: Body<Data = Bytes> + Unpin> Coalesce<B> {
    /// Sends the batch first, if there is one, and `next` after it.
    fn send_before(
        &mut self,
        next: Result<Frame<Bytes>, B::Error>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        if self.batch.is_empty() {
            return Poll::Ready(Some(next));
        }
        self.held = Some(next);
        Poll::Ready(Some(Ok(self.batch.take_frame())))
    }
}

/// Data frames received and not yet passed on. One frame passes as it is;
/// several are joined into one.
#[derive(Debug, Default)]
enum Batch {
    #[default]
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Batch {
    fn push(&mut self, data: Bytes) {
        *self = match std::mem::take(self) {
            Batch::Empty => Batch::One(data),
            Batch::One(first) => {
                let mut joined = BytesMut::with_capacity(first.len() + data.len());
                joined.extend_from_slice(&first);
                joined.extend_from_slice(&data);
                Batch::Many(joined)
            }
            Batch::Many(mut joined) => {
                joined.extend_from_slice(&data);
                Batch::Many(joined)
            }
        };
    }

    fn len(&self) -> usize {
        match self {
            Batch::Empty => 0,
            Batch::One(data) => data.len(),
            Batch::Many(joined) => joined.len(),
        }
    }

    fn is_empty(&self) -> bool {
        matches!(self, Batch::Empty)
    }

    /// The batch as one data frame, leaving it empty.
    fn take_frame(&mut self) -> Frame<Bytes> {
        Frame::data(match std::mem::take(self) {
            Batch::Empty => Bytes::new(),
            Batch::One(data) => data,
            Batch::Many(joined) => joined.freeze(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    use super::*;

    /// One scripted answer of the inner body to a poll.
    #[derive(Debug)]
    enum Step {
        Data(&'static str),
        /// `len` bytes of filler.
        Filler(usize),
        Trailers,
        Fail,
        /// Nothing ready yet; the test polls again when it likes.
        NotYet,
    }

    #[derive(Debug)]
    struct Scripted {
        steps: VecDeque<Step>,
        /// Set when `is_end_stream` is known without another poll, like a
        /// body with a `Content-Length` whose bytes all arrived.
        known_length: bool,
    }

    impl Scripted {
        fn new(steps: impl IntoIterator<Item = Step>) -> Scripted {
            Scripted {
                steps: steps.into_iter().collect(),
                known_length: false,
            }
        }
    }

    impl Body for Scripted {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            match self.steps.pop_front() {
                None => Poll::Ready(None),
                Some(Step::Data(text)) => Poll::Ready(Some(Ok(Frame::data(Bytes::from(text))))),
                Some(Step::Filler(len)) => {
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; len])))))
                }
                Some(Step::Trailers) => {
                    Poll::Ready(Some(Ok(Frame::trailers(http::HeaderMap::new()))))
                }
                Some(Step::Fail) => Poll::Ready(Some(Err(std::io::Error::other("cut")))),
                Some(Step::NotYet) => Poll::Pending,
            }
        }

        fn is_end_stream(&self) -> bool {
            self.known_length && self.steps.is_empty()
        }
    }

    #[derive(Default)]
    struct CountWakes(AtomicUsize);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// What one poll gave: `Some(text)` for data, `"<trailers>"`,
    /// `"<error>"`, `"<end>"`, or `None` for pending.
    fn poll(body: &mut Coalesce<Scripted>, waker: &Waker) -> Option<String> {
        let mut cx = Context::from_waker(waker);
        match Pin::new(body).poll_frame(&mut cx) {
            Poll::Pending => None,
            Poll::Ready(None) => Some("<end>".into()),
            Poll::Ready(Some(Err(_))) => Some("<error>".into()),
            Poll::Ready(Some(Ok(frame))) => Some(match frame.into_data() {
                Ok(data) => String::from_utf8_lossy(&data).into_owned(),
                Err(_) => "<trailers>".into(),
            }),
        }
    }

    fn drain(steps: Vec<Step>) -> Vec<Option<String>> {
        let wakes = Arc::new(CountWakes::default());
        let waker = Waker::from(wakes.clone());
        let mut body = Coalesce::new(Scripted::new(steps));
        let mut seen = Vec::new();
        loop {
            let answer = poll(&mut body, &waker);
            let end = answer.as_deref() == Some("<end>");
            seen.push(answer);
            if end || seen.len() > 32 {
                return seen;
            }
        }
    }

    fn data(text: &str) -> Option<String> {
        Some(text.into())
    }

    #[test]
    fn frames_that_arrived_together_go_out_as_one() {
        use Step::*;
        let seen = drain(vec![
            Data("a"),
            Data("b"),
            NotYet,
            NotYet,
            Data("c"),
            NotYet,
            NotYet,
            NotYet,
        ]);
        // a and b, two turns for the upstream, c, then two turns with
        // nothing new: a+b+c go out together; the end follows.
        assert_eq!(
            seen,
            vec![None, None, None, None, data("abc"), Some("<end>".into())]
        );
    }

    #[test]
    fn nothing_waits_for_data_that_has_not_arrived() {
        use Step::*;
        let wakes = Arc::new(CountWakes::default());
        let waker = Waker::from(wakes.clone());
        let mut body = Coalesce::new(Scripted::new(vec![
            Data("a"),
            NotYet,
            NotYet,
            NotYet,
            NotYet,
        ]));
        for turn in 1..=EMPTY_TURNS_BEFORE_SENDING {
            assert_eq!(poll(&mut body, &waker), None, "a turn for the upstream");
            assert_eq!(
                wakes.0.load(Ordering::SeqCst),
                usize::from(turn),
                "and it asked to be polled again"
            );
        }
        assert_eq!(poll(&mut body, &waker), data("a"), "then `a` goes alone");
        assert_eq!(poll(&mut body, &waker), None, "an empty batch just waits");
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            usize::from(EMPTY_TURNS_BEFORE_SENDING),
            "without waking itself"
        );
    }

    #[test]
    fn the_end_sends_the_batch_at_once() {
        use Step::*;
        assert_eq!(
            drain(vec![Data("a"), Data("b")]),
            vec![data("ab"), Some("<end>".into())]
        );
        // A known length ends without polling the inner body again.
        let waker = Waker::from(Arc::new(CountWakes::default()));
        let mut body = Coalesce::new(Scripted {
            known_length: true,
            ..Scripted::new(vec![Data("whole")])
        });
        assert!(!body.is_end_stream());
        assert_eq!(poll(&mut body, &waker), data("whole"));
        assert!(body.is_end_stream());
    }

    #[test]
    fn trailers_and_errors_follow_the_data_before_them() {
        use Step::*;
        assert_eq!(
            drain(vec![Data("a"), Trailers]),
            vec![data("a"), Some("<trailers>".into()), Some("<end>".into())]
        );
        let seen = drain(vec![Data("a"), Data("b"), Fail]);
        assert_eq!(seen[..2], [data("ab"), Some("<error>".into())]);
    }

    #[test]
    fn a_batch_stops_growing_at_the_limit() {
        let waker = Waker::from(Arc::new(CountWakes::default()));
        let mut body = Coalesce::new(Scripted::new(vec![
            Step::Filler(MAX_BATCH_BYTES / 2),
            Step::Filler(MAX_BATCH_BYTES / 2),
            Step::Data("tail"),
        ]));
        assert_eq!(
            poll(&mut body, &waker).map(|text| text.len()),
            Some(MAX_BATCH_BYTES)
        );
        assert_eq!(poll(&mut body, &waker), data("tail"));
        assert_eq!(poll(&mut body, &waker), Some("<end>".into()));
    }

    #[test]
    fn the_size_hint_passes_through_before_the_first_frame() {
        let body = Coalesce::new(http_body_util::Full::new(Bytes::from_static(b"12345")));
        assert_eq!(body.size_hint().exact(), Some(5));
    }
}
