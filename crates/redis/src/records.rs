//! Plain keys every instance reads: shared records (a job's state), sets, deleted budgets,
//! operator blocks and counters.

use std::time::Duration;

use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::store::StoreError;

use crate::RedisStore;
use crate::batch::Invocation;
use crate::errors::bounded;

impl RedisStore {
    /// Writes `value` under `key` for `ttl`: a record every instance may read (a job's state).
    pub async fn put(&self, key: &str, value: &str, ttl: Duration) -> Result<(), StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut command = ::redis::cmd("SET");
        command.arg(key).arg(value).arg("PX").arg(ms);
        let _: () = bounded(&self.address, self.timeout, self.connection.query(&command)).await?;
        Ok(())
    }

    /// Writes the record `value` (a JSON object with `version` and `final` fields) under `key`
    /// for `ttl`, unless the record there must stand: one that is final, or of a higher version
    /// than `version` (`record.lua`). Returns whether it was written.
    pub async fn put_record(&self, key: &str, value: &str, version: u64, ttl: Duration) -> Result<bool, StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut invocation = Invocation::of(&self.record);
        invocation.key(key);
        invocation.arg(value).arg(version).arg(ms);
        let written: i64 = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        Ok(written == 1)
    }

    /// What [`RedisStore::put`] or [`RedisStore::put_record`] wrote under `key`, if it is still there.
    pub async fn get(&self, key: &str) -> Result<Option<String>, StoreError> {
        let mut command = ::redis::cmd("GET");
        command.arg(key);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// Adds `member` to the set at `key`, which is kept `ttl` past its latest addition.
    pub async fn set_add(&self, key: &str, member: &str, ttl: Duration) -> Result<(), StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut script = ::redis::cmd("EVAL");
        // One call (a pipeline of two could be split by a failover): add, then keep.
        script.arg("redis.call('SADD', KEYS[1], ARGV[1]) return redis.call('PEXPIRE', KEYS[1], ARGV[2])");
        script.arg(1).arg(key).arg(member).arg(ms);
        let _: i64 = bounded(&self.address, self.timeout, self.connection.query(&script)).await?;
        Ok(())
    }

    /// Announces `member` at `key` (a sorted set, by Redis's clock), drops the announcements older
    /// than `keep`, and publishes the key's name on `channel`, in one script: whoever hears it finds
    /// the member there, and the key never holds more than `keep` of announcements.
    pub async fn announce(&self, key: &str, member: &str, keep: Duration, channel: &str) -> Result<(), StoreError> {
        let ms = u64::try_from(keep.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut script = ::redis::cmd("EVAL");
        script.arg(
            "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) \
             redis.call('ZADD', KEYS[1], now, ARGV[1]) \
             redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2])) \
             redis.call('PEXPIRE', KEYS[1], ARGV[2]) \
             return redis.call('PUBLISH', ARGV[3], KEYS[1])",
        );
        script.arg(1).arg(key).arg(member).arg(ms).arg(channel);
        let _: i64 = bounded(&self.address, self.timeout, self.connection.query(&script)).await?;
        Ok(())
    }

    /// What [`RedisStore::announce`] left at `key`, oldest first.
    pub async fn announced(&self, key: &str) -> Result<Vec<String>, StoreError> {
        let mut command = ::redis::cmd("ZRANGE");
        command.arg(key).arg(0).arg(-1);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// Takes `members` out of the announcements at `key`.
    pub async fn withdraw(&self, key: &str, members: &[String]) -> Result<(), StoreError> {
        self.remove_members("ZREM", key, members).await
    }

    /// Removes `members` from the set or sorted set at `key` with `command` (`SREM`, `ZREM`); one
    /// round trip, none for no members.
    async fn remove_members(&self, command: &str, key: &str, members: &[String]) -> Result<(), StoreError> {
        if members.is_empty() {
            return Ok(());
        }
        let mut command = ::redis::cmd(command);
        command.arg(key).arg(members);
        let _: i64 = bounded(&self.address, self.timeout, self.connection.query(&command)).await?;
        Ok(())
    }

    /// Sets `key` for `ttl` unless it is set (`SET NX PX`): whether it was not.
    pub async fn take_once(&self, key: &str, ttl: Duration) -> Result<bool, StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut command = ::redis::cmd("SET");
        command.arg(key).arg(1).arg("NX").arg("PX").arg(ms);
        let set: Option<String> = bounded(&self.address, self.timeout, self.connection.query(&command)).await?;
        Ok(set.is_some())
    }

    /// The members of the set at `key` (none when it is gone).
    pub async fn set_members(&self, key: &str) -> Result<Vec<String>, StoreError> {
        let mut command = ::redis::cmd("SMEMBERS");
        command.arg(key);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// Removes `members` from the set at `key`.
    pub async fn set_remove(&self, key: &str, members: &[String]) -> Result<(), StoreError> {
        self.remove_members("SREM", key, members).await
    }

    /// Deletes `keys` (one `DEL`: on a cluster they must share a hash tag); returns how many were
    /// there.
    pub async fn forget(&self, keys: &[&str]) -> Result<u64, StoreError> {
        if keys.is_empty() {
            return Ok(0);
        }
        if let Some(groups) = self.by_slot(keys.iter().copied()) {
            // A caller's budgets may span slots on a cluster (its OAuth client's): one DEL each.
            let forgotten = groups.iter().map(|group| async move {
                let part: Vec<&str> = group.iter().map(|&i| keys[i]).collect();
                let mut command = ::redis::cmd("DEL");
                command.arg(&part);
                bounded::<u64>(&self.address, self.timeout, self.connection.query(&command)).await
            });
            return Ok(futures::future::try_join_all(forgotten).await?.into_iter().fold(0, u64::saturating_add));
        }
        let mut command = ::redis::cmd("DEL");
        command.arg(keys);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// Sets the operator block `key` for `duration`, which [`Budgets::decide`](mcp_ratelimit_kernel::store::Budgets::decide) honours on every
    /// instance.
    pub async fn block(&self, key: &str, duration: Duration) -> Result<(), StoreError> {
        self.put(key, "blocked", duration).await
    }

    /// How long the block `key` still holds, if it does.
    pub async fn block_left(&self, key: &str) -> Result<Option<Nanos>, StoreError> {
        let mut command = ::redis::cmd("PTTL");
        command.arg(key);
        let left: i64 = bounded(&self.address, self.timeout, self.connection.query(&command)).await?;
        Ok(u64::try_from(left).ok().filter(|ms| *ms > 0).map(Nanos::from_millis))
    }

    /// Adds one to the counter at `key` and returns it (a signal every instance can watch).
    pub async fn bump(&self, key: &str) -> Result<u64, StoreError> {
        let mut command = ::redis::cmd("INCR");
        command.arg(key);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// The counter at `key` (0 when there is none).
    pub async fn counter(&self, key: &str) -> Result<u64, StoreError> {
        Ok(self.get(key).await?.and_then(|v| v.parse().ok()).unwrap_or(0))
    }
}
