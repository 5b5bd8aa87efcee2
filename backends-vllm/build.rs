//! Compiles `proto/vllm_engine.proto` into client and server code
//! (`load_transport::proto_build`, with the vendored protoc).

fn main() -> Result<(), load_transport::proto_build::ProtoBuildError> {
    load_transport::proto_build::compile("proto/vllm_engine.proto")
}
