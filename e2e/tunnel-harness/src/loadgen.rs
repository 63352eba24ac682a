//! Load-generation targets and clients shared by the throughput tests and the
//! benchmark. A *bulk* target speaks a tiny framing so the client can tell when
//! data has really arrived end to end (konnectivity has no half-close):
//! the client sends `b'U'` + u64 length + payload and waits for a 1-byte ack
//! (upload), or `b'D'` + u64 length and reads that many bytes (download).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use simulated_cluster::targets::TcpTarget;

const CHUNK: usize = 256 * 1024;

/// The bulk-transfer target. Stops when dropped.
pub struct BulkServer {
    pub addr: SocketAddr,
    sent: Arc<AtomicU64>,
    _target: TcpTarget,
}

impl BulkServer {
    pub async fn start() -> std::io::Result<Self> {
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let target = TcpTarget::serve(move |mut socket| {
            let counter = counter.clone();
            async move {
                let _ = serve_bulk(&mut socket, &counter).await;
            }
        })
        .await?;
        Ok(BulkServer {
            addr: target.addr,
            sent,
            _target: target,
        })
    }

    /// Download bytes the target's sockets have taken so far, over every
    /// connection (counted per written chunk of up to 256 KiB): when it
    /// stops growing while a download is unfinished, the reader's whole
    /// path is full.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

async fn serve_bulk<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    sent: &AtomicU64,
) -> std::io::Result<()> {
    loop {
        let mut op = [0u8; 9];
        if s.read_exact(&mut op).await.is_err() {
            return Ok(());
        }
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&op[1..]);
        let len = u64::from_be_bytes(len_bytes);
        match op[0] {
            b'U' => {
                let mut buf = vec![0u8; CHUNK];
                let mut left = len;
                while left > 0 {
                    let want = usize::try_from(left.min(CHUNK as u64)).unwrap_or(CHUNK);
                    let n = s.read(&mut buf[..want]).await?;
                    if n == 0 {
                        return Ok(());
                    }
                    left -= n as u64;
                }
                s.write_all(b"k").await?;
            }
            b'D' => {
                let buf = pattern(CHUNK);
                let mut left = len;
                while left > 0 {
                    let n = usize::try_from(left.min(CHUNK as u64)).unwrap_or(CHUNK);
                    s.write_all(&buf[..n]).await?;
                    sent.fetch_add(n as u64, Ordering::Relaxed);
                    left -= n as u64;
                }
            }
            _ => return Ok(()),
        }
    }
}

/// Deterministic, non-repeating-looking payload bytes.
pub fn pattern(len: usize) -> Vec<u8> {
    let mut x: u32 = 0x9E37_79B9;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 24) as u8
        })
        .collect()
}

/// Sends `total` bytes (in 1 MiB chunks, each numbered in its first byte,
/// so reordered or repeated data would change the digest) through `stream`,
/// whose far end echoes them, while reading them back; panics unless the
/// same bytes came back within `within`.
pub async fn echo_intact<S>(stream: S, total: usize, within: std::time::Duration)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    use sha2::{Digest, Sha256};
    let (mut rd, mut wr) = tokio::io::split(stream);
    let chunk = pattern(1024 * 1024);
    let writer = tokio::spawn(async move {
        let mut hash = Sha256::new();
        for i in 0..total.div_ceil(chunk.len()) {
            let mut c = chunk[..chunk.len().min(total - i * chunk.len())].to_vec();
            c[0] = i as u8;
            hash.update(&c);
            wr.write_all(&c).await.expect("write");
        }
        (hash.finalize(), wr)
    });
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut received = 0;
    tokio::time::timeout(within, async {
        while received < total {
            let n = rd.read(&mut buf).await.expect("read");
            assert!(n > 0, "stream ended after {received} bytes");
            hash.update(&buf[..n]);
            received += n;
        }
    })
    .await
    .expect("transfer timed out");
    let (sent, _wr) = writer.await.expect("writer");
    assert_eq!(received, total);
    assert_eq!(hash.finalize(), sent, "the bytes came back changed");
}

/// Sends `len` bytes to a bulk target and waits for its acknowledgement.
pub async fn upload<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, len: u64) -> std::io::Result<()> {
    let mut head = vec![b'U'];
    head.extend_from_slice(&len.to_be_bytes());
    s.write_all(&head).await?;
    let buf = pattern(CHUNK);
    let mut left = len;
    while left > 0 {
        let n = usize::try_from(left.min(CHUNK as u64)).unwrap_or(CHUNK);
        s.write_all(&buf[..n]).await?;
        left -= n as u64;
    }
    s.flush().await?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await?;
    Ok(())
}

/// Asks a bulk target for `len` bytes, without reading them.
pub async fn request_download<S: AsyncWrite + Unpin>(s: &mut S, len: u64) -> std::io::Result<()> {
    let mut head = vec![b'D'];
    head.extend_from_slice(&len.to_be_bytes());
    s.write_all(&head).await?;
    s.flush().await
}

/// Asks a bulk target for `len` bytes and reads them all.
pub async fn download<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    len: u64,
) -> std::io::Result<()> {
    request_download(s, len).await?;
    let mut buf = vec![0u8; CHUNK];
    let mut left = len;
    while left > 0 {
        let want = usize::try_from(left.min(CHUNK as u64)).unwrap_or(CHUNK);
        let n = s.read(&mut buf[..want]).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "short download",
            ));
        }
        left -= n as u64;
    }
    Ok(())
}

/// Resident set size of this process in bytes (Linux).
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// A benchmark knob: the environment variable `name` as a number, or
/// `default` when it is unset. A value that is not a whole number ends the
/// process with a message naming it, rather than silently measuring the
/// default.
pub fn knob(name: &str, default: usize) -> usize {
    let Ok(value) = std::env::var(name) else {
        return default;
    };
    value.parse().unwrap_or_else(|e| {
        eprintln!("{name}={value:?}: not a whole number ({e})");
        std::process::exit(2)
    })
}

/// What a process has used so far, from `/proc` (Linux).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessUsage {
    pub rss_mib: f64,
    /// User and system CPU time.
    pub cpu_seconds: f64,
}

/// The resident set and CPU time of process `pid`.
pub fn process_usage(pid: u32) -> std::io::Result<ProcessUsage> {
    let malformed = |what: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("/proc/{pid}/{what}"),
        )
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| malformed("status: no VmRSS"))?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command name, which is in parentheses.
    let after = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 2..))
        .ok_or_else(|| malformed("stat"))?;
    let fields: Vec<&str> = after.split(' ').collect();
    let ticks = |i: usize| -> std::io::Result<f64> {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| malformed("stat: short"))
    };
    // utime and stime (fields 14 and 15), in USER_HZ (100 on Linux).
    Ok(ProcessUsage {
        rss_mib: rss_kib / 1024.0,
        cpu_seconds: (ticks(11)? + ticks(12)?) / 100.0,
    })
}
