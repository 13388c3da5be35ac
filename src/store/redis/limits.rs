//! The [`Buckets`] port of the Redis store: the engine's ([`RedisBuckets`]), over the same
//! connections as the store's other ports.
//!
//! [`RedisBuckets`]: tollgate_engine::redis::RedisBuckets

use std::sync::Arc;

use async_trait::async_trait;
use futures_util::future::BoxFuture;

use super::backend::RedisStore;
use crate::domain::{Applied, Bucket, Ruling};
use crate::store::{BucketCalls, Buckets, Budget, StoreError};

#[async_trait(?Send)]
impl Buckets for RedisStore {
    async fn take(
        &self,
        key: &str,
        applied: &[Applied],
        cost: f64,
        budget: Option<Budget>,
    ) -> Result<Ruling, StoreError> {
        self.buckets.take(key, applied, cost, budget).await
    }

    async fn adjust(
        &self,
        key: &str,
        applied: &[Applied],
        delta: f64,
    ) -> Result<Ruling, StoreError> {
        self.buckets.adjust(key, applied, delta).await
    }

    async fn peek(&self, key: &str, applied: &[Applied]) -> Result<Ruling, StoreError> {
        self.buckets.peek(key, applied).await
    }

    fn tokens_now<'a>(
        &'a self,
        key: &'a str,
        field: &'a str,
        bucket: Bucket,
    ) -> BoxFuture<'a, Result<Option<f64>, StoreError>> {
        self.buckets.tokens_now(key, field, bucket)
    }

    async fn refill(&self, key: &str, buckets: &[Arc<str>]) -> Result<(), StoreError> {
        self.buckets.refill(key, buckets).await
    }

    async fn keep_connected(&self) {
        self.buckets.keep_connected().await
    }

    fn calls(&self) -> Option<BucketCalls> {
        self.buckets.calls()
    }
}
