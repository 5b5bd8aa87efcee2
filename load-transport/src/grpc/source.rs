//! [`GrpcLoadSource`]: one worker's `GetLoads` over tonic, for any backend
//! that says how to call it ([`GetLoads`]).

use std::fmt::Debug;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use load_protocols::{LoadValidationError, WorkerLoad};
use policy_core::{
    BackendError, BackendRegistry, BackendSpec, LoadAddress, LoadError, LoadSource, SourceOptions,
};
use tonic::Status;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, Endpoint};

use super::{LoadRpc, authorized_request, bearer_metadata, grpc_endpoint};

/// What differs between the gRPC backends: the generated client and
/// request message, the reply's conversion, and how a few outcomes read.
/// Everything else is [`GrpcLoadSource`]'s.
///
/// Implemented by a unit type per backend; see [`GrpcLoadSource`] for an
/// example.
pub trait GetLoads: Debug + Send + Sync + 'static {
    /// The reply message.
    type Reply: Send + 'static;

    /// The backend name, as registered ([`LoadSource::kind`]); also the
    /// backend named when the load address is missing.
    const KIND: &'static str;
    /// The RPC's name in [`LoadError::Unsupported`].
    const WHAT: &'static str = "GetLoads";
    /// A server-sent `DEADLINE_EXCEEDED` means "no report this time" rather
    /// than a timed-out poll (see [`LoadRpc`]).
    const DEADLINE_EXCEEDED_IS_NO_REPORT: bool = false;
    /// The deadline also travels to the server as `grpc-timeout`, so it can
    /// give up when the caller has.
    const SENDS_DEADLINE: bool = false;

    /// One `GetLoads` call on `channel` by the generated client, which must
    /// refuse replies over `body_limit_bytes` (`max_decoding_message_size`).
    /// `request` carries the metadata and timeout; [`tonic::Request::map`]
    /// puts the backend's own message in it.
    fn call(
        channel: Channel,
        body_limit_bytes: usize,
        request: tonic::Request<()>,
    ) -> impl Future<Output = Result<tonic::Response<Self::Reply>, Status>> + Send;

    /// The reply as a validated [`WorkerLoad`]; `Ok(None)` for "no report
    /// this time" (an empty rank list).
    fn worker_load(reply: Self::Reply) -> Result<Option<WorkerLoad>, LoadValidationError>;
}

/// One worker's load over gRPC `GetLoads`, for the backend `R`.
///
/// The channel is made with `Endpoint::connect_lazy` on the first poll (so a
/// source can be built outside a Tokio runtime) and reconnects by itself.
/// The deadline of [`SourceOptions`] is the connect timeout and the request
/// timeout, and bounds the whole call; replies larger than the body cap are
/// refused; the API key goes out as `authorization: Bearer …`.
///
/// Outcomes:
/// - an empty `loads` list → `Ok(None)`;
/// - `DEADLINE_EXCEEDED` from the server → `Ok(None)` where
///   [`GetLoads::DEADLINE_EXCEEDED_IS_NO_REPORT`], else
///   [`LoadError::Timeout`];
/// - no answer within our own deadline → [`LoadError::Timeout`];
/// - `UNIMPLEMENTED` → [`LoadError::Unsupported`];
/// - `UNAVAILABLE` from a failed connection → [`LoadError::Connect`];
/// - a reply over the body cap → [`LoadError::BodyTooLarge`];
/// - any other status (a server's own `UNAVAILABLE` included) →
///   [`LoadError::Grpc`] with the [`Status`] as its source;
/// - impossible values → [`LoadError::Invalid`].
///
/// ```
/// use load_protocols::{LoadValidationError, WorkerLoad};
/// use load_transport::grpc::{GetLoads, GrpcLoadSource};
/// use policy_core::{BackendRegistry, BackendSpec};
/// use tonic::transport::Channel;
///
/// #[derive(Debug)]
/// struct Mine;
///
/// impl GetLoads for Mine {
///     type Reply = Vec<u8>;
///     const KIND: &'static str = "mine-grpc";
///
///     async fn call(
///         _channel: Channel,
///         _body_limit_bytes: usize,
///         _request: tonic::Request<()>,
///     ) -> Result<tonic::Response<Vec<u8>>, tonic::Status> {
///         // With a generated client:
///         // MineClient::new(channel)
///         //     .max_decoding_message_size(body_limit_bytes)
///         //     .get_loads(request.map(|()| GetLoadsRequest { .. }))
///         //     .await
///         Ok(tonic::Response::new(Vec::new()))
///     }
///     fn worker_load(_reply: Vec<u8>) -> Result<Option<WorkerLoad>, LoadValidationError> {
///         Ok(None)
///     }
/// }
///
/// let mut registry = BackendRegistry::new();
/// GrpcLoadSource::<Mine>::register(&mut registry);
/// let spec = BackendSpec::new("http://10.0.0.1:8000").with_load_url("grpc://10.0.0.1:9000");
/// let source = registry.build("mine-grpc", &spec)?;
/// assert_eq!(source.load_url(), "grpc://10.0.0.1:9000");
/// # Ok::<(), policy_core::BackendError>(())
/// ```
#[derive(Debug)]
pub struct GrpcLoadSource<R: GetLoads> {
    url: String,
    endpoint: Endpoint,
    channel: OnceLock<Channel>,
    deadline: Duration,
    body_limit_bytes: usize,
    authorization: Option<AsciiMetadataValue>,
    backend: PhantomData<R>,
}

impl<R: GetLoads> GrpcLoadSource<R> {
    /// A source calling the scheduler at `url` (`grpc://host:port`).
    ///
    /// Fails with [`BackendError::InvalidAddress`] for any other address and
    /// with [`BackendError::Client`] for an API key that cannot be metadata.
    /// No connection is made here.
    pub fn new(url: &str, options: &SourceOptions) -> Result<GrpcLoadSource<R>, BackendError> {
        let endpoint = grpc_endpoint(url)?;
        let authorization = bearer_metadata(url, options.api_key.as_deref())?;
        Ok(GrpcLoadSource {
            endpoint: endpoint
                .connect_timeout(options.deadline)
                .timeout(options.deadline),
            url: url.to_owned(),
            channel: OnceLock::new(),
            deadline: options.deadline,
            body_limit_bytes: options.body_limit_bytes,
            authorization,
            backend: PhantomData,
        })
    }

    /// A source for `spec`'s load address, which this backend requires.
    pub fn from_spec(spec: &BackendSpec) -> Result<GrpcLoadSource<R>, BackendError> {
        GrpcLoadSource::new(spec.required_load_url(R::KIND)?, &spec.options)
    }

    /// Registers the backend `R::KIND`, built by [`from_spec`](Self::from_spec),
    /// with the `grpc://` load address it requires.
    pub fn register(registry: &mut BackendRegistry) {
        registry.register(R::KIND, LoadAddress::Grpc, |spec| {
            let source = GrpcLoadSource::<R>::from_spec(spec)?;
            Ok(Arc::new(source) as Arc<dyn LoadSource>)
        });
    }

    fn channel(&self) -> Channel {
        // `connect_lazy` spawns onto the runtime, so it waits for the first
        // poll rather than running in the (synchronous) factory.
        self.channel
            .get_or_init(|| self.endpoint.connect_lazy())
            .clone()
    }
}

#[async_trait]
impl<R: GetLoads> LoadSource for GrpcLoadSource<R> {
    async fn fetch(&self) -> Result<Option<WorkerLoad>, LoadError> {
        let mut request = authorized_request((), self.authorization.as_ref());
        if R::SENDS_DEADLINE {
            request.set_timeout(self.deadline);
        }
        let rpc = LoadRpc {
            url: &self.url,
            what: R::WHAT,
            deadline: self.deadline,
            body_limit_bytes: self.body_limit_bytes,
            deadline_exceeded_is_no_report: R::DEADLINE_EXCEEDED_IS_NO_REPORT,
        };
        let call = R::call(self.channel(), self.body_limit_bytes, request);
        let Some(reply) = rpc.call(call).await? else {
            return Ok(None);
        };
        R::worker_load(reply).map_err(|source| LoadError::Invalid {
            url: self.url.clone(),
            source,
        })
    }

    fn kind(&self) -> &'static str {
        R::KIND
    }

    fn load_url(&self) -> &str {
        &self.url
    }
}
