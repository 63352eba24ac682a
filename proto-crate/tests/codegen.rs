//! Regenerates the checked-in protobuf/gRPC code from `proto/` and fails on any
//! difference, so ordinary builds never need `protoc` while the generated code
//! can never drift from the `.proto` files.
//!
//! To update the checked-in code after editing a `.proto` file:
//! `CLUSTER_PROXY_REGENERATE=1 cargo test -p cluster-proxy-proto --test codegen`.

use std::path::{Path, PathBuf};

const GENERATED: &str = "konnectivity.rs";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn generate(out_dir: &Path) {
    let proto_dir = crate_dir().join("proto");
    let files = [
        proto_dir.join("konnectivity/client.proto"),
        proto_dir.join("konnectivity/agent.proto"),
    ];
    let descriptors =
        protox::compile(files, [&proto_dir]).expect("compile .proto files with protox");
    let mut prost_config = prost_build::Config::new();
    // Package-less protos would otherwise land in a file named `_.rs`.
    prost_config.default_package_filename("konnectivity");
    // DATA payloads are passed through without copying.
    prost_config.bytes(["."]);
    tonic_prost_build::configure()
        .build_transport(false)
        .emit_rerun_if_changed(false)
        .out_dir(out_dir)
        .compile_fds_with_config(descriptors, prost_config)
        .expect("generate Rust code");
}

#[test]
fn checked_in_code_matches_proto_files() {
    let scratch = tempfile::tempdir().expect("temp dir");
    generate(scratch.path());
    let fresh = std::fs::read_to_string(scratch.path().join(GENERATED)).expect("generated file");
    let checked_in_path = crate_dir().join("src/gen").join(GENERATED);
    let checked_in = std::fs::read_to_string(&checked_in_path).unwrap_or_default();
    if fresh != checked_in {
        if std::env::var_os("CLUSTER_PROXY_REGENERATE").is_some() {
            std::fs::write(&checked_in_path, fresh).expect("write generated code");
            return;
        }
        panic!(
            "{} is out of date with proto/; rerun with CLUSTER_PROXY_REGENERATE=1 and commit the result",
            checked_in_path.display()
        );
    }
}
