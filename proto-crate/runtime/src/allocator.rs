//! The global allocator of every binary: mimalloc, in the images (static
//! musl builds) and in glibc builds alike, so what is benchmarked and
//! tested is what ships.
//!
//! musl's malloc hands freed memory back to the kernel eagerly, so a data
//! path that allocates and frees buffers per read pays page faults and TLB
//! shootdowns per packet: linked with it, proxy-server spent 2.3–3.1
//! CPU-seconds per GiB moved against 1.2–1.7 for the same code linked with
//! glibc in the same runs. glibc's malloc does the same in smaller measure
//! (it trims the top of a heap once 128 KiB there are free): with it the
//! agent spent 7–17 % more CPU per GiB than with mimalloc in the same runs
//! (README, "The allocator: mimalloc"). Every binary links this crate, so
//! declaring the allocator here gives all of them the same one, and
//! `images/build.sh` refuses a binary without it.

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
