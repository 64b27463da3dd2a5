//! `nccl-net-erdma-info`: what the plugin sees on this host, as the plugin would use it, with
//! a fix for every problem found. Exit status 0 when the plugin can run here, 1 otherwise.

fn main() {
    let report = nccl_net_erdma::report::collect();
    print!("{}", report.render());
    std::process::exit(if report.plugin_runs { 0 } else { 1 });
}
