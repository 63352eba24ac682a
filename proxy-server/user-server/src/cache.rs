//! The answers of the hub's reviews, kept for a while: a bounded map from a
//! question's SHA-256 to its answer, where concurrent askers of the same
//! uncached question wait for one review instead of sending one each, and
//! at most [`MAX_REVIEWS_IN_FLIGHT`] reviews are sent at once (a burst of
//! distinct new tokens queues here rather than at the hub's rate limiter).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;
use tokio::time::Instant;

/// A question's key: the SHA-256 of its parts (lengths included, so parts
/// cannot run into each other). Secrets such as tokens are kept only so.
pub fn key<'a>(parts: impl IntoIterator<Item = &'a str>) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update(part.len().to_le_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.finalize().into()
}

type Cell<T> = Arc<OnceCell<(Instant, T)>>;

/// Reviews of one kind sent to the hub at once, at most.
pub const MAX_REVIEWS_IN_FLIGHT: usize = 32;

pub struct ReviewCache<T> {
    capacity: usize,
    entries: Mutex<HashMap<[u8; 32], Cell<T>>>,
    in_flight: tokio::sync::Semaphore,
}

impl<T: Clone> ReviewCache<T> {
    pub fn new(capacity: usize) -> Self {
        ReviewCache {
            capacity: capacity.max(1),
            entries: Mutex::new(HashMap::new()),
            in_flight: tokio::sync::Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
        }
    }

    /// The answer to `key`: a kept one younger than its `ttl`, else the
    /// one `review` gives, which is kept when `ttl` of it is not zero.
    pub async fn get<F, Fut>(&self, key: [u8; 32], ttl: impl Fn(&T) -> Duration, review: F) -> T
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = T>,
    {
        let cell = self.cell(key, &ttl);
        let (answered, answer) = cell
            .get_or_init(|| async {
                // The semaphore is never closed, so a permit always comes.
                let _permit = self.in_flight.acquire().await.ok();
                (Instant::now(), review().await)
            })
            .await
            .clone();
        if answered.elapsed() >= ttl(&answer) {
            // Expired, or not to be kept at all (a failed review): the next
            // asker reviews again.
            self.forget(key, &cell);
        }
        answer
    }

    /// The cell for `key`: the kept one while it is fresh, else a new one
    /// (the map kept within its capacity).
    fn cell(&self, key: [u8; 32], ttl: &impl Fn(&T) -> Duration) -> Cell<T> {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = |cell: &Cell<T>| match cell.get() {
            Some((at, answer)) => at.elapsed() < ttl(answer),
            // Being reviewed right now.
            None => true,
        };
        if let Some(cell) = entries.get(&key).filter(|c| fresh(c)) {
            return cell.clone();
        }
        if entries.len() >= self.capacity {
            entries.retain(|_, cell| fresh(cell));
            if entries.len() >= self.capacity
                && let Some(oldest) = entries
                    .iter()
                    .filter_map(|(k, c)| c.get().map(|(at, _)| (*at, *k)))
                    .min()
                    .map(|(_, k)| k)
            {
                entries.remove(&oldest);
            }
        }
        let cell: Cell<T> = Arc::new(OnceCell::new());
        entries.insert(key, cell.clone());
        cell
    }

    fn forget(&self, key: [u8; 32], cell: &Cell<T>) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries
            .get(&key)
            .is_some_and(|kept| Arc::ptr_eq(kept, cell))
        {
            entries.remove(&key);
        }
    }

    /// How many answers are kept.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(start_paused = true)]
    async fn answers_are_shared_kept_for_their_ttl_and_failures_not_kept() {
        let cache: ReviewCache<Result<u32, ()>> = ReviewCache::new(10);
        let reviews = Arc::new(AtomicUsize::new(0));
        let ttl = |answer: &Result<u32, ()>| {
            if answer.is_ok() {
                Duration::from_secs(60)
            } else {
                Duration::ZERO
            }
        };
        let ask = |answer: Result<u32, ()>| {
            let reviews = reviews.clone();
            move || async move {
                reviews.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                answer
            }
        };
        let k = key(["alice"]);
        let answers =
            futures_util::future::join_all((0..5).map(|_| cache.get(k, ttl, ask(Ok(1))))).await;
        assert!(answers.iter().all(|a| *a == Ok(1)));
        assert_eq!(
            reviews.load(Ordering::SeqCst),
            1,
            "one review for five askers"
        );
        assert_eq!(cache.get(k, ttl, ask(Ok(2))).await, Ok(1));
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(cache.get(k, ttl, ask(Ok(3))).await, Ok(3), "expired");
        assert_eq!(reviews.load(Ordering::SeqCst), 2);

        let failing = key(["bob"]);
        assert_eq!(cache.get(failing, ttl, ask(Err(()))).await, Err(()));
        assert_eq!(
            cache.get(failing, ttl, ask(Ok(4))).await,
            Ok(4),
            "a failure is not kept"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_cache_keeps_within_its_capacity() {
        let cache: ReviewCache<u32> = ReviewCache::new(3);
        for n in 0..10u32 {
            let name = n.to_string();
            cache
                .get(
                    key([name.as_str()]),
                    |_| Duration::from_secs(60),
                    || async move { n },
                )
                .await;
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert_eq!(cache.len(), 3);
        // The newest are kept.
        assert_eq!(
            cache
                .get(key(["9"]), |_| Duration::from_secs(60), || async { 99 })
                .await,
            9
        );
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_so_many_reviews_run_at_once() {
        let cache: ReviewCache<u32> = ReviewCache::new(1000);
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let asks = (0..(MAX_REVIEWS_IN_FLIGHT * 3) as u32).map(|n| {
            let (running, most) = (running.clone(), most.clone());
            let name = n.to_string();
            let cache = &cache;
            async move {
                cache
                    .get(
                        key([name.as_str()]),
                        |_| Duration::from_secs(60),
                        || async move {
                            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            running.fetch_sub(1, Ordering::SeqCst);
                            n
                        },
                    )
                    .await
            }
        });
        let answers = futures_util::future::join_all(asks).await;
        assert_eq!(answers.len(), MAX_REVIEWS_IN_FLIGHT * 3);
        assert_eq!(most.load(Ordering::SeqCst), MAX_REVIEWS_IN_FLIGHT);
    }

    #[test]
    fn keys_do_not_run_into_each_other() {
        assert_ne!(key(["ab", "c"]), key(["a", "bc"]));
    }
}
