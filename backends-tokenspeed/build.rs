//! Compiles `proto/tokenspeed_scheduler.proto` into client and server code,
//! with protoc supplied by `protoc-bin-vendored` (no system install needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/tokenspeed_scheduler.proto";
    println!("cargo:rerun-if-changed={proto}");
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &[proto], &["proto"])?;
    Ok(())
}
