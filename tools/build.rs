//! Builds the C logger the tools hand to a plugin (csrc/logger.c): NCCL's logger is
//! C-variadic, and only C can read the arguments of any plugin's printf formats.

fn main() {
    println!("cargo:rerun-if-changed=csrc/logger.c");
    println!("cargo:rerun-if-changed=../include/nccl_net.h");
    cc::Build::new()
        .file("csrc/logger.c")
        .include("../include")
        .warnings(true)
        .extra_warnings(true)
        .compile("nccl_net_tools_logger");
}
