//! Generates the Rust ABI types from `include/nccl_net.h`, so the plugin's types cannot drift
//! from the header that C code and tests compile against, and pins the library in memory.

use std::{env, path::PathBuf};

fn main() {
    let header = "include/nccl_net.h";
    println!("cargo:rerun-if-changed={header}");
    println!("cargo:rerun-if-env-changed=LIBCLANG_PATH");

    let bindings = bindgen::Builder::default()
        .header(header)
        .allowlist_type("nccl.*")
        .allowlist_var("NCCL_.*")
        .allowlist_var("ncclProfiler.*")
        .rustified_enum("ncclResult_t")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .generate()
        .expect("bindgen failed on include/nccl_net.h (is libclang installed? set LIBCLANG_PATH)");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings
        .write_to_file(out.join("nccl_net.rs"))
        .expect("writing the generated bindings");

    // NCCL >= 2.28 dlclose()s the plugin after the last communicator. Keeping the image mapped
    // (as NCCL's own IB transport effectively does) means no code a thread, a TLS destructor or
    // the panic hook may still reach is ever unmapped.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
