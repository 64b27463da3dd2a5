//! Reliability and hostile input: every case ends in an error code and a clear WARN within a
//! bounded time, with nothing corrupted and nothing leaked (fds, threads, memory).
//!
//! Like the conformance suite, this drives the built plugin only through its C ABI
//! (`nccl_net_erdma_tools::client`, dlopen'ed as NCCL does), over tcp on loopback, or over verbs when
//! `NCCL_ERDMA_TEST_DEVICE` names a device (the Soft-RoCE tier). Cases that count fds,
//! threads or RSS, kill a peer or could crash run in a child process of their own
//! (`run_child`), so nothing else in this binary disturbs the counts; cases that feed garbage
//! handles or addresses run in their own network namespace with only loopback. A child runs
//! its test by its full name (`module::child_...`, see `test_name!`).
//!
//! | case | test |
//! |---|---|
//! | 1 strangers on a listen port | `strangers::strangers_are_rejected_with_a_warn_and_the_peer_still_connects`, `strangers::a_flood_of_silent_strangers_does_not_lock_out_the_peer` |
//! | 2 peer SIGKILLed mid-transfer | `peers::peer_killed_mid_transfer_receiver_gets_an_error`, `peers::peer_killed_mid_transfer_sender_gets_an_error`, `peers::peer_killed_while_the_sender_waits_for_its_receive_is_an_error`, `peers::verbs_completion_error_is_an_error_code_with_a_warn_naming_peer_opcode_and_status` (verbs) |
//! | 3 listener gone / unreachable / slow; peer host silent | `listeners::connect_to_a_gone_or_silent_listener_fails_in_bounded_time`, `peers::peer_host_that_stops_answering_fails_a_waiting_receive_within_the_peer_timeout` |
//! | 4 garbage handles | `handles::garbage_handles_never_cause_a_connection_attempt` |
//! | 5 bad arguments | `arguments::bad_arguments_on_every_entry_point_of_every_version`, `arguments::v11_listen_and_connect_take_a_null_context_without_crashing` |
//! | 6 dlclose/dlopen | `lifecycle::fifty_dlclose_dlopen_cycles_leave_nothing_behind` |
//! | 7 fork | `lifecycle::verbs_fork_after_registration_keeps_parent_transfers_correct` (verbs) |
//! | 8 stress | `lifecycle::stress_service_and_progress_threads_on_64_comms` |
//! | 9 fuzzing | `fuzz/` (cargo-fuzz, a target per decoder of peer bytes), seeds checked by `handles::fuzz_seed_corpus_decodes` and the library's `protocol` tests |
//! | 10 valgrind | `scripts/tiers/reliability.sh` |
//! | 11 hostile peers past the listen port (setup messages, move messages and tcp frames mid-stream) | `hostile::hostile_peers_fail_only_their_comm_with_a_warn_naming_the_field` |
//!
//! | file | holds |
//! |---|---|
//! | `support.rs` | fd/thread/RSS counts, WARN lines, the killable peer process (`Victim`), shared waits |
//! | `strangers.rs` | case 1 |
//! | `peers.rs` | case 2, and the peer host that goes silent (case 3) |
//! | `listeners.rs` | case 3: connect to a listener that is gone, slow, mute or unreachable |
//! | `handles.rs` | case 4, and the fuzzers' seed corpus (case 9) |
//! | `arguments.rs`, `arguments/` | case 5: one check function per entry point; raw table calls |
//! | `lifecycle.rs` | cases 6, 7 and 8 |
//! | `hostile.rs` | case 11: a man in the middle that rewrites or slips in messages |

#[path = "../common/mod.rs"]
mod common;
mod support;

mod arguments;
mod handles;
mod hostile;
mod lifecycle;
mod listeners;
mod peers;
mod strangers;
