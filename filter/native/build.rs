//! Links the module with `-z now`: every Envoy callback it uses is resolved when Envoy loads
//! it, so an Envoy without one refuses the module at once, naming the symbol, instead of
//! failing at the first call.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
}
