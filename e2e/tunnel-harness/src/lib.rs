//! Starting cluster-proxy's data plane for tests and benchmarks: a throwaway
//! PKI ([`pki`]); proxy-servers, tunnel clients and hand-driven agents in
//! this process ([`in_process`]); a proxy-server and a proxy-agent as child
//! processes ([`child`]); several replicas behind a balancer ([`replicas`]);
//! load generators ([`loadgen`]), raw HTTP/2 frames ([`h2_frames`]) and paths
//! that go silent ([`faults`]).
#![forbid(unsafe_code)]

pub mod child;
pub mod faults;
pub mod h2_frames;
pub mod in_process;
pub mod loadgen;
pub mod pki;
pub mod replicas;
