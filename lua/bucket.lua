-- tollgate token bucket: refill, then take `cost` tokens, atomically.
--
-- KEYS[1] = the bucket, e.g. tollgate:b:{acme} (the hash tag keeps it in one cluster slot)
-- ARGV[1] = capacity (tokens), ARGV[2] = rate (tokens/s), ARGV[3] = cost (tokens)
-- ARGV[4] = optional: the tokens a bucket that does not exist yet starts with (default:
--           full). Used when a client moves between its global bucket and regional shards,
--           so the move does not hand it a fresh burst.
--
-- The time comes from Redis itself (TIME), so gateway clocks never matter and the
-- decision is one round trip. The arithmetic is the same as src/limiter/bucket.rs,
-- operation for operation, so the embedded store decides identically.
--
-- Returns { allowed (1|0), tokens left (string, exact), wait in microseconds until
-- `cost` tokens exist (0 when allowed, -1 when cost exceeds capacity) }.

local cap = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local s = redis.call('HMGET', KEYS[1], 'tk', 'ts')
local tokens = tonumber(s[1]) or math.min(cap, tonumber(ARGV[4] or '') or cap)
local ts = tonumber(s[2]) or now

local elapsed = now - ts
if elapsed < 0 then elapsed = 0 end
tokens = math.min(cap, tokens + elapsed * rate / 1000000)

local allowed = 0
local wait = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
elseif cost > cap then
  wait = -1
else
  wait = math.ceil((cost - tokens) / rate * 1000000)
end

-- %.17g keeps every bit of the double; TIME's parts keep the timestamp exact.
redis.call('HSET', KEYS[1], 'tk', string.format('%.17g', tokens), 'ts', t[1] .. string.format('%06d', tonumber(t[2])))
-- Idle buckets expire once they would be full anyway (+1 s of slack).
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) / rate * 1000) + 1000)

return { allowed, string.format('%.17g', tokens), wait }
