//! Relaying one tunneled connection's bytes both ways: two half-duplex
//! copies (after linkerd2-proxy's `duplex`), each from a [`ChunkSource`] to a
//! [`ChunkSink`], run together by [`relay`], which reports how each ended.
//!
//! Unlike `tokio::io::copy_bidirectional`, one side of every relay here is
//! not a byte stream but a tunneled connection's two message halves (DATA
//! packets with flow-control credit). So a direction moves whole chunks
//! without copying them: a socket read becomes the payload of one packet
//! ([`ReadChunks`]), and a received payload is written out from the buffer
//! it arrived in ([`WriteChunks`]), its buffer budget released only once it
//! is written (the source learns it through [`ChunkSource::delivered`]).
//!
//! A direction ends when its source ends (EOF, a close) or its sink fails;
//! either way its sink is then told with [`ChunkSink::finish`] (a byte
//! stream's write side shuts down, a tunneled connection asks for CLOSE_REQ).
//! What happens to the other direction then is the relay's [`AfterUp`].

use std::future::Future;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::flow::READ_CHUNK;

/// The bytes a chunk carries.
pub trait Payload {
    fn payload(&self) -> &[u8];
}

impl Payload for Bytes {
    fn payload(&self) -> &[u8] {
        self
    }
}

impl<E: Payload> Payload for crate::flow::Delivery<E> {
    fn payload(&self) -> &[u8] {
        self.event.payload()
    }
}

/// Where one direction's chunks come from.
pub trait ChunkSource: Send {
    type Chunk: Payload + Send;
    /// Why the source has no more chunks.
    type End: Send;

    fn recv(&mut self) -> impl Future<Output = Result<Self::Chunk, Self::End>> + Send;

    /// `n` payload bytes of the last chunk reached the sink (and the chunk is
    /// dropped): the place to credit the peer.
    fn delivered(&mut self, _n: usize) {}
}

/// Where one direction's chunks go.
pub trait ChunkSink<C>: Send {
    type Error: Send;

    fn send(&mut self, chunk: C) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The direction ended (its source ended or this sink failed): shut
    /// down, or tell the peer. Nothing by default.
    fn finish(&mut self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// How one direction ended.
#[derive(Debug)]
pub enum Copied<End, Error> {
    /// The source ended.
    SourceEnded(End),
    /// The sink refused a chunk.
    SinkFailed(Error),
}

/// Moves `source`'s chunks to `sink` until one of them ends, then finishes
/// the sink.
pub async fn copy<Src, Snk>(mut source: Src, mut sink: Snk) -> Copied<Src::End, Snk::Error>
where
    Src: ChunkSource,
    Snk: ChunkSink<Src::Chunk>,
{
    let ended = loop {
        let chunk = match source.recv().await {
            Ok(chunk) => chunk,
            Err(end) => break Copied::SourceEnded(end),
        };
        let n = chunk.payload().len();
        if let Err(e) = sink.send(chunk).await {
            break Copied::SinkFailed(e);
        }
        source.delivered(n);
    };
    sink.finish().await;
    ended
}

/// A byte stream's reads as chunks of at most [`READ_CHUNK`] bytes.
pub struct ReadChunks<R> {
    reader: R,
}

impl<R> ReadChunks<R> {
    pub fn new(reader: R) -> Self {
        ReadChunks { reader }
    }
}

/// Why a byte stream gives no more chunks.
#[derive(Debug)]
pub enum ReadEnd {
    Eof,
    Failed(std::io::Error),
}

impl<R: AsyncRead + Unpin + Send> ChunkSource for ReadChunks<R> {
    type Chunk = Bytes;
    type End = ReadEnd;

    async fn recv(&mut self) -> Result<Bytes, ReadEnd> {
        // A fresh buffer for every read, not the rest of the last one (as
        // `tokio_util::io::ReaderStream` does): each packet is one whole
        // read, and a payload queued on the far side pins only its own buffer.
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        match self.reader.read_buf(&mut buf).await {
            Ok(0) => Err(ReadEnd::Eof),
            Ok(_) => Ok(buf.freeze()),
            Err(e) => Err(ReadEnd::Failed(e)),
        }
    }
}

/// Writes each chunk to a byte stream and flushes it; shuts the stream's
/// write side down when the direction ends.
pub struct WriteChunks<W> {
    writer: W,
}

impl<W> WriteChunks<W> {
    pub fn new(writer: W) -> Self {
        WriteChunks { writer }
    }
}

impl<W: AsyncWrite + Unpin + Send, C: Payload + Send> ChunkSink<C> for WriteChunks<W> {
    type Error = std::io::Error;

    async fn send(&mut self, chunk: C) -> Result<(), std::io::Error> {
        self.writer.write_all(chunk.payload()).await?;
        // A TLS layer may keep bytes it could not yet put on a full socket;
        // only a flush writes them out. Without it the tail of a burst waits
        // for the next chunk, however long the peer stays quiet. (On a plain
        // TCP stream a flush does nothing.)
        self.writer.flush().await
    }

    async fn finish(&mut self) {
        let _ = self.writer.shutdown().await;
    }
}

/// What a relay does once its up direction (towards the tunnel) has ended.
#[derive(Debug, Clone, Copy)]
pub enum AfterUp {
    /// Stops the down direction too: the connection ends with its first
    /// direction (konnectivity has no half-close).
    Stop,
    /// Lets the down direction run on for at most this long, for what the
    /// peer still sends before it closes.
    Drain(Duration),
}

/// How each direction of a relay ended; `None`: still running when the
/// relay stopped.
#[derive(Debug)]
pub struct Relayed<Up, Down> {
    pub up: Option<Up>,
    pub down: Option<Down>,
}

/// Runs both directions of a connection until the down direction ends, the
/// up direction ends (then as `after_up` says), or `stop` fires.
pub async fn relay<Up, Down, Stop>(
    up: Up,
    down: Down,
    after_up: AfterUp,
    stop: Stop,
) -> Relayed<Up::Output, Down::Output>
where
    Up: Future,
    Down: Future,
    Stop: Future<Output = ()>,
{
    tokio::pin!(up, down, stop);
    tokio::select! {
        ended = &mut down => Relayed { up: None, down: Some(ended) },
        ended = &mut up => {
            let down = match after_up {
                AfterUp::Stop => None,
                AfterUp::Drain(limit) => tokio::select! {
                    ended = tokio::time::timeout(limit, &mut down) => ended.ok(),
                    () = &mut stop => None,
                },
            };
            Relayed { up: Some(ended), down }
        }
        () = &mut stop => Relayed { up: None, down: None },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink collecting chunks, failing after `fail_after` of them.
    struct Collect {
        got: Vec<u8>,
        fail_after: usize,
        finished: bool,
    }

    impl ChunkSink<Bytes> for &mut Collect {
        type Error = ();

        async fn send(&mut self, chunk: Bytes) -> Result<(), ()> {
            if self.fail_after == 0 {
                return Err(());
            }
            self.fail_after -= 1;
            self.got.extend_from_slice(&chunk);
            Ok(())
        }

        async fn finish(&mut self) {
            self.finished = true;
        }
    }

    #[tokio::test]
    async fn a_byte_stream_is_copied_in_read_chunks_and_the_sink_finished_at_eof() {
        let data = vec![7u8; READ_CHUNK * 2 + 5];
        let mut sink = Collect {
            got: Vec::new(),
            fail_after: usize::MAX,
            finished: false,
        };
        let ended = copy(ReadChunks::new(&data[..]), &mut sink).await;
        assert!(matches!(ended, Copied::SourceEnded(ReadEnd::Eof)));
        assert_eq!(sink.got, data);
        assert!(sink.finished);
    }

    #[tokio::test]
    async fn a_failing_sink_ends_the_direction_and_is_still_finished() {
        let data = vec![1u8; READ_CHUNK * 3];
        let mut sink = Collect {
            got: Vec::new(),
            fail_after: 1,
            finished: false,
        };
        let ended = copy(ReadChunks::new(&data[..]), &mut sink).await;
        assert!(matches!(ended, Copied::SinkFailed(())));
        assert_eq!(sink.got.len(), READ_CHUNK);
        assert!(sink.finished);
    }

    #[tokio::test]
    async fn chunks_are_written_and_the_writer_shut_down_when_the_source_ends() {
        struct Chunks(Vec<Bytes>, usize);
        impl ChunkSource for Chunks {
            type Chunk = Bytes;
            type End = ();
            async fn recv(&mut self) -> Result<Bytes, ()> {
                if self.0.is_empty() {
                    Err(())
                } else {
                    Ok(self.0.remove(0))
                }
            }
            fn delivered(&mut self, n: usize) {
                self.1 += n;
            }
        }
        let (client, mut server) = tokio::io::duplex(1024);
        let mut source = Chunks(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"c")], 0);
        let ended = copy(&mut source, WriteChunks::new(client)).await;
        assert!(matches!(ended, Copied::SourceEnded(())));
        assert_eq!(source.1, 3);
        let mut out = Vec::new();
        server.read_to_end(&mut out).await.expect("read");
        assert_eq!(out, b"abc");
    }

    impl<S: ChunkSource> ChunkSource for &mut S {
        type Chunk = S::Chunk;
        type End = S::End;
        fn recv(&mut self) -> impl Future<Output = Result<S::Chunk, S::End>> + Send {
            (**self).recv()
        }
        fn delivered(&mut self, n: usize) {
            (**self).delivered(n)
        }
    }

    #[tokio::test]
    async fn after_up_drains_down_for_a_bounded_time_or_stops_it() {
        let up = async { "up" };
        let down = std::future::pending::<&str>();
        let relayed = relay(
            up,
            down,
            AfterUp::Drain(Duration::from_millis(20)),
            std::future::pending(),
        )
        .await;
        assert_eq!((relayed.up, relayed.down), (Some("up"), None));
        let relayed = relay(
            async { "up" },
            async {
                tokio::time::sleep(Duration::from_millis(1)).await;
                "down"
            },
            AfterUp::Drain(Duration::from_secs(10)),
            std::future::pending(),
        )
        .await;
        assert_eq!((relayed.up, relayed.down), (Some("up"), Some("down")));
        let relayed = relay(
            std::future::pending::<()>(),
            std::future::pending::<()>(),
            AfterUp::Stop,
            async {},
        )
        .await;
        assert!(relayed.up.is_none() && relayed.down.is_none());
    }
}
