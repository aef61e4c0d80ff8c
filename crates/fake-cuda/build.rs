// Programs find the fake by its real name through LD_LIBRARY_PATH; the
// SONAME makes it indistinguishable from the driver's library to the loader.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
