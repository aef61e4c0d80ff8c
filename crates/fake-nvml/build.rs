// Found through LD_LIBRARY_PATH under the real library's name; the SONAME
// matches it so the loader cannot tell the fake from NVML.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
}
