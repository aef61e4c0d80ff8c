//! The CRI v1 messages and client, generated from Kubernetes' api.proto
//! (proto/api.proto, vendored from k8s.io/cri-api with its Apache-2.0 licence)
//! with tonic and a vendored protoc, so that no system protoc is needed to
//! build.

fn main() {
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    // tonic-prost-build runs the protoc named here.
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["proto/api.proto"], &["proto"])
        .expect("compile the CRI's api.proto");
    println!("cargo:rerun-if-changed=proto");
}
