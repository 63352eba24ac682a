//! The global allocator of static (musl) builds, which is what the images
//! ship.
//!
//! musl's malloc hands freed memory back to the kernel eagerly, so a data
//! path that allocates and frees buffers per read pays page faults and TLB
//! shootdowns per packet: linked with it, proxy-server spent 2.3–3.1
//! CPU-seconds per GiB moved against 1.2–1.7 for the same code linked with
//! glibc in the same runs (README, Images). Every binary links this crate, so declaring the allocator here
//! gives all of them the same one, and `images/build.sh` refuses a binary
//! without it; glibc builds (development, tests, benchmarks) keep the
//! system allocator.

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
