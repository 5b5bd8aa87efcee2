//! A gRPC backend's `build.rs` (feature `proto-build`): its `.proto` compiled
//! into client and server code, with protoc supplied by `protoc-bin-vendored`
//! (no system install needed).
//!
//! ```no_run
//! // build.rs of a backend whose proto is proto/mine.proto:
//! fn main() -> Result<(), load_transport::proto_build::ProtoBuildError> {
//!     load_transport::proto_build::compile("proto/mine.proto")
//! }
//! ```

use std::path::{Path, PathBuf};

/// Why a backend's `.proto` did not compile.
#[derive(Debug, thiserror::Error)]
pub enum ProtoBuildError {
    /// `protoc-bin-vendored` has no protoc for this host.
    #[error("no vendored protoc for this host")]
    Protoc(#[source] protoc_bin_vendored::Error),
    /// protoc or the code generator failed on the file.
    #[error("compiling {}", .proto.display())]
    Compile {
        proto: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Compiles `proto` (a path relative to the crate, its imports resolved from
/// its own folder) into the client and the server, for
/// `tonic::include_proto!`, and reruns the build script when it changes.
pub fn compile(proto: &str) -> Result<(), ProtoBuildError> {
    println!("cargo:rerun-if-changed={proto}");
    let mut config = prost_build::Config::new();
    config.protoc_executable(
        protoc_bin_vendored::protoc_bin_path().map_err(ProtoBuildError::Protoc)?,
    );
    let include = Path::new(proto).parent().unwrap_or(Path::new("."));
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &[Path::new(proto)], &[include])
        .map_err(|source| ProtoBuildError::Compile {
            proto: PathBuf::from(proto),
            source,
        })
}
