//! CRIU's own image schemas (proto/, vendored from CRIU 4.2 with its MIT
//! licence) compiled with prost and a vendored protoc.

fn main() {
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    let include = protoc_bin_vendored::include_path().expect("vendored protoc includes");
    // prost-build runs the protoc named here.
    std::env::set_var("PROTOC", protoc);
    let mut cfg = prost_build::Config::new();
    cfg.compile_protos(
        &["proto/pagemap.proto", "proto/mm.proto", "proto/stats.proto", "proto/gpusnap-files.proto"],
        &[std::path::PathBuf::from("proto"), include],
    )
    .expect("compile CRIU's protos");
    println!("cargo:rerun-if-changed=proto");
}
