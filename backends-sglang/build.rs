//! Compiles `proto/sglang_scheduler.proto` into client and server code
//! (`load_transport::proto_build`, with the vendored protoc).

fn main() -> Result<(), load_transport::proto_build::ProtoBuildError> {
    load_transport::proto_build::compile("proto/sglang_scheduler.proto")
}
