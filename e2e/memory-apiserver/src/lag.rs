//! A client-side layer that holds back the events of one resource's
//! watches. On a busy kube-apiserver a controller's cache can trail the API
//! by seconds; with this layer a test makes it trail every time, so code
//! that trusts its cache for "what did I write last" is caught.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, BodyStream, StreamBody};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the lagging service answers with: the inner body, boxed.
pub type LaggedResponse = http::Response<UnsyncBoxBody<Bytes, BoxError>>;

/// Delays every chunk (one watch event each, as the API sends them) of the
/// watches on the resource whose collection path ends in `/{plural}` by
/// `delay`; everything else passes through untouched. Events keep their
/// order. A zero `delay` lags nothing.
#[derive(Debug, Clone)]
pub struct LaggingWatches {
    collection_suffix: Arc<str>,
    delay: Duration,
}

impl LaggingWatches {
    pub fn new(plural: &str, delay: Duration) -> Self {
        Self {
            collection_suffix: format!("/{plural}").into(),
            delay,
        }
    }

    fn lags<B>(&self, request: &http::Request<B>) -> bool {
        !self.delay.is_zero()
            && request.uri().path().ends_with(&*self.collection_suffix)
            && request
                .uri()
                .query()
                .is_some_and(|query| query.split('&').any(|pair| pair == "watch=true"))
    }
}

impl<S> tower::Layer<S> for LaggingWatches {
    type Service = LaggingWatchService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LaggingWatchService {
            inner,
            lag: self.clone(),
        }
    }
}

/// The service [`LaggingWatches`] wraps around a client's stack.
#[derive(Debug, Clone)]
pub struct LaggingWatchService<S> {
    inner: S,
    lag: LaggingWatches,
}

impl<S, RequestBody, B> tower::Service<http::Request<RequestBody>> for LaggingWatchService<S>
where
    S: tower::Service<http::Request<RequestBody>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = LaggedResponse;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<LaggedResponse, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let delay = self.lag.lags(&request).then_some(self.lag.delay);
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await.map_err(Into::into)?;
            Ok(response.map(|body| {
                let body = body.map_err(Into::into);
                match delay {
                    Some(delay) => {
                        let frames = BodyStream::new(body).then(move |frame| async move {
                            tokio::time::sleep(delay).await;
                            frame
                        });
                        StreamBody::new(frames).boxed_unsync()
                    }
                    None => body.boxed_unsync(),
                }
            }))
        })
    }
}
