//! The transport load sources share, so every backend checks addresses,
//! sends its key and reports failures the same way. The traits and the
//! error types ([`LoadSource`](policy_core::LoadSource),
//! [`LoadError`](policy_core::LoadError)) are `policy-core`'s; this crate
//! is the clients, and maps every failure into those errors.
//!
//! - [`http`] (feature `http`): the `http://` and `https://` address
//!   check, the bearer header, one GET of a load report on the router's own
//!   HTTP/1.1 client, [`worker_h1`] (accept header, status, content type,
//!   capped body; TLS to an `https://` worker with the source's CA file or
//!   the system's roots), and the router's control-plane clients
//!   ([`http::pooled_client`], [`http::pooled_https_client`],
//!   [`http::read_capped`]).
//! - [`grpc`] (feature `grpc`): the `grpc://` endpoint, bearer metadata, a
//!   failed call's status as a `LoadError`, and
//!   [`GrpcLoadSource`](grpc::GrpcLoadSource), the whole `GetLoads` source
//!   for a backend that implements [`GetLoads`](grpc::GetLoads).
//! - `proto_build` (feature `proto-build`): a gRPC backend's `build.rs`,
//!   its `.proto` compiled with the vendored protoc, as a build-dependency
//!   that builds nothing else of this crate.
//! - `test_support` (feature `test-support`, for gRPC backends' tests): a
//!   scripted load server on loopback and the checks every gRPC load source
//!   passes whatever its proto.
//!
//! `http` and `grpc` are on by default; an HTTP-only user turns them off and
//! asks for `http`, which keeps tonic out of its build.
//!
//! ```
//! use load_transport::grpc::grpc_endpoint;
//! use load_transport::http::{ReportClient, ReportFormat, ReportUrl, http_base};
//! use policy_core::SourceOptions;
//!
//! // An HTTP load source checks its base once and parses its URL once…
//! let base = http_base("http://10.0.0.3:8000/")?;
//! let options = SourceOptions::default();
//! let metrics = ReportUrl::new(&base, "/metrics", ReportFormat::PrometheusText, "/metrics", &options)?;
//! assert_eq!(metrics.as_str(), "http://10.0.0.3:8000/metrics");
//! // …then each poll is `client.get(&metrics).await`: the body, or a `LoadError`.
//! let _client = ReportClient::new(&base, &options)?;
//!
//! // A gRPC one gets its endpoint from the `grpc://` load address.
//! let endpoint = grpc_endpoint("grpc://10.0.0.2:19000")?;
//! assert_eq!(endpoint.uri().to_string(), "http://10.0.0.2:19000/");
//! # Ok::<(), policy_core::BackendError>(())
//! ```

#[cfg(feature = "grpc")]
pub mod grpc;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "proto-build")]
pub mod proto_build;
#[cfg(feature = "test-support")]
pub mod test_support;
