"""RedisStore: KV pages in a Redis server, with this store's own exact LRU bookkeeping.

Keys under one prefix P (default "vckv"; stores with different prefixes never touch each other):
    P:d:<key>   the value                 P:lru    sorted set key -> last-use clock
    P:size      hash key -> value bytes   P:clock  logical clock   P:bytes  sum of P:size

Capacity: this store's own LRU (chosen over Redis `maxmemory` + allkeys-lru, which samples
approximately, counts Redis' overhead rather than payload bytes, and would evict the bookkeeping
keys or other users' keys). Every mutation runs as one Lua script, which Redis executes
atomically, so several clients sharing one server keep P:lru, P:size and P:bytes consistent and
the LRU order exact. Run the server with `maxmemory-policy noeviction` (Debian's default) and a
maxmemory above the capacity; a value Redis itself dropped reads as a miss.
Every call has a socket timeout and no retries: a down or slow server raises StoreError at once.
"""

from __future__ import annotations

import re

from sglang_vericache.mem_cache.storage.base import KVStore, StoreError

# KEYS: data key, lru, size, clock, bytes. ARGV: value, capacity (-1 = none), member, data prefix.
_PUT = """
local size = string.len(ARGV[1])
local cap = tonumber(ARGV[2])
local old = redis.call('HGET', KEYS[3], ARGV[3])
if old then redis.call('INCRBY', KEYS[5], -tonumber(old)) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[3], size)
local total = redis.call('INCRBY', KEYS[5], size)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[3])
local n = 0
while cap >= 0 and total > cap do
  local m = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if m == nil or m == ARGV[3] then break end
  local s = tonumber(redis.call('HGET', KEYS[3], m) or '0')
  redis.call('ZREM', KEYS[2], m)
  redis.call('HDEL', KEYS[3], m)
  redis.call('DEL', ARGV[4] .. m)
  total = redis.call('INCRBY', KEYS[5], -s)
  n = n + 1
end
return n
"""
# KEYS: lru, clock. ARGV: data prefix, members...
_GET = """
local out = {}
for i = 2, #ARGV do
  local v = redis.call('GET', ARGV[1] .. ARGV[i])
  if not v then break end
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[2]), ARGV[i])
  out[#out + 1] = v
end
return out
"""
# KEYS: data key, lru, size, bytes. ARGV: member.
_DELETE = """
local s = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if not s then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('INCRBY', KEYS[4], -tonumber(s))
return 1
"""


class RedisStore(KVStore):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        capacity_bytes: int | None = None,
        prefix: str = "vckv",
        timeout_s: float = 1.0,
    ):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not re.fullmatch(r"[0-9A-Za-z_.\-]+", prefix):
            raise ValueError(f"redis key prefix must be [0-9A-Za-z_.-]+ (no ':'), got {prefix!r}")
        super().__init__(capacity_bytes)
        self.url, self.prefix, self.timeout_s = url, prefix, timeout_s
        self._errors = (redis.RedisError, OSError)
        self._r = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )
        self._put_script = self._r.register_script(_PUT)
        self._get_script = self._r.register_script(_GET)
        self._delete_script = self._r.register_script(_DELETE)
        self._lru, self._size, self._clock, self._bytes = (f"{prefix}:{n}" for n in ("lru", "size", "clock", "bytes"))
        self._data = f"{prefix}:d:"

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r}, capacity_bytes={self.capacity_bytes})"

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise StoreError(f"redis KV store {self.url}: {type(e).__name__}: {e}") from e

    # ---- backend primitives ------------------------------------------------------------------
    def _put(self, key: str, data: bytes) -> int:
        cap = -1 if self.capacity_bytes is None else self.capacity_bytes
        keys = [self._data + key, self._lru, self._size, self._clock, self._bytes]
        return int(self._call(self._put_script, keys=keys, args=[data, cap, key, self._data]))

    def _get_prefix(self, keys: list[str]) -> list[bytes]:
        if not keys:
            return []
        return list(self._call(self._get_script, keys=[self._lru, self._clock], args=[self._data, *keys]))

    def _count_prefix(self, keys: list[str]) -> int:
        if not keys:
            return 0

        def run() -> list:
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._data + k)
            return pipe.execute()

        n = 0
        for present in self._call(run):
            if not present:
                break
            n += 1
        return n

    def _delete(self, key: str) -> bool:
        keys = [self._data + key, self._lru, self._size, self._bytes]
        return bool(self._call(self._delete_script, keys=keys, args=[key]))

    # ---- public extras -----------------------------------------------------------------------
    def size_bytes(self) -> int:
        return int(self._call(self._r.get, self._bytes) or 0)

    def keys_lru(self) -> list[str]:
        return [k.decode() for k in self._call(self._r.zrange, self._lru, 0, -1)]

    def clear(self) -> None:
        def run() -> None:
            batch = []
            for k in self._r.scan_iter(match=f"{self.prefix}:*", count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    self._r.delete(*batch)
                    batch = []
            if batch:
                self._r.delete(*batch)

        self._call(run)

    def ping(self) -> bool:
        return bool(self._call(self._r.ping))

    def close(self) -> None:
        self._r.close()
