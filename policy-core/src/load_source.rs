use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use load_protocols::WorkerLoad;

use crate::{BackendError, LoadError};

/// How one worker's load is fetched: I/O at the edge, one instance per worker.
///
/// Called a few times a second per worker by the router's load monitor, so a
/// boxed future per poll (`#[async_trait]`) is noise next to the RPC, and the
/// trait stays object-safe for `Arc<dyn LoadSource>`.
///
/// `fetch` answers `Ok(Some)` with a fresh validated report, `Ok(None)` for
/// "no report this time" (an empty rank list, `DEADLINE_EXCEEDED` on an
/// encode-only worker), and `Err` for a failed poll.
///
/// ```
/// use async_trait::async_trait;
/// use load_protocols::{SchedulerLoadSnapshot, WorkerLoad};
/// use policy_core::{LoadError, LoadSource};
///
/// /// A backend that always reports two waiting requests.
/// struct Constant;
///
/// #[async_trait]
/// impl LoadSource for Constant {
///     async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
///         let rank = SchedulerLoadSnapshot { num_waiting_reqs: 2, ..Default::default() };
///         WorkerLoad::from_ranks(vec![rank])
///             .map(Some)
///             .map_err(|source| LoadError::Invalid { url: self.load_url().into(), source })
///     }
///     fn kind(&self) -> &'static str { "constant" }
///     fn load_url(&self) -> &str { "http://127.0.0.1:1" }
/// }
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let load = Constant.fetch().await?.expect("a report");
/// assert_eq!(load.waiting_requests(), 2);
/// # Ok::<(), LoadError>(())
/// # }).unwrap();
/// ```
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
#[async_trait]
pub trait LoadSource: Send + Sync {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError>;

    /// The backend name this source was built for (`sglang`, `vllm-grpc`, …).
    fn kind(&self) -> &'static str;

    /// The address polled, for logs and errors.
    fn load_url(&self) -> &str;
}

/// Options every backend factory understands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceOptions {
    /// Deadline for one poll, connection included.
    pub deadline: Duration,
    /// Largest load-report body accepted.
    pub body_limit_bytes: usize,
    /// Sent as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// For an `https://` load address: a PEM file of the certificates that
    /// may sign the worker's certificate; unset, the system's roots.
    pub ca_file: Option<PathBuf>,
}

impl Default for SourceOptions {
    fn default() -> SourceOptions {
        SourceOptions {
            deadline: Duration::from_millis(500),
            body_limit_bytes: 1024 * 1024,
            api_key: None,
            ca_file: None,
        }
    }
}

/// What a backend factory builds a source from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    /// The worker's HTTP address, where requests travel.
    pub worker_url: String,
    /// A separate load address (a `grpc://` URL for the gRPC backends).
    pub load_url: Option<String>,
    pub options: SourceOptions,
}

impl BackendSpec {
    pub fn new(worker_url: impl Into<String>) -> BackendSpec {
        BackendSpec {
            worker_url: worker_url.into(),
            load_url: None,
            options: SourceOptions::default(),
        }
    }

    #[must_use]
    pub fn with_load_url(mut self, load_url: impl Into<String>) -> BackendSpec {
        self.load_url = Some(load_url.into());
        self
    }

    /// The separate load address, for a backend (`backend`, as registered)
    /// that cannot work without one: the gRPC flavours.
    pub fn required_load_url(&self, backend: &str) -> Result<&str, BackendError> {
        self.load_url
            .as_deref()
            .ok_or_else(|| BackendError::MissingLoadUrl {
                backend: backend.to_owned(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_load_url_names_the_backend() {
        let spec = BackendSpec::new("http://w:1");
        assert!(matches!(
            spec.required_load_url("tokenspeed"),
            Err(BackendError::MissingLoadUrl { backend }) if backend == "tokenspeed"
        ));
        let spec = spec.with_load_url("grpc://w:2");
        assert_eq!(spec.required_load_url("tokenspeed").unwrap(), "grpc://w:2");
    }
}
