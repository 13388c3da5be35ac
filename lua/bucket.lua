-- tollgate token bucket: refill, then take `cost` tokens for each of `n` requests that
-- arrived together, in order, atomically.
--
-- KEYS[1] = the bucket, e.g. tollgate:b:{acme} (the hash tag keeps it in one cluster slot)
-- ARGV[1] = capacity (tokens), ARGV[2] = rate (tokens/s), ARGV[3] = cost (tokens)
-- ARGV[4] = optional: the tokens a bucket that does not exist yet starts with (default:
--           full). Used when a client moves between its global bucket and regional shards,
--           so the move does not hand it a fresh burst.
-- ARGV[5] = optional: how many requests of `cost` to decide (default 1). A gateway sends
--           the requests for one bucket that arrived while its previous call was in
--           flight as one call; deciding them one after another here is exactly what `n`
--           separate calls at this instant would decide.
--
-- The time comes from Redis itself (TIME), so gateway clocks never matter and the
-- decision is one round trip. The arithmetic is the same as src/limiter/bucket.rs
-- (`refill`, then `take_from` per request), operation for operation, so the embedded store
-- decides identically and the gateway can replay the takes to give each request its own
-- verdict.
--
-- Returns { requests admitted, the tokens after refilling and before any take (string,
-- exact) }. Once one request is denied the rest are too: they all cost the same.

local cap = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local n = tonumber(ARGV[5] or '') or 1

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local s = redis.call('HMGET', KEYS[1], 'tk', 'ts')
local tokens = tonumber(s[1]) or math.min(cap, tonumber(ARGV[4] or '') or cap)
local ts = tonumber(s[2]) or now

local elapsed = now - ts
if elapsed < 0 then elapsed = 0 end
tokens = math.min(cap, tokens + elapsed * rate / 1000000)
local refilled = tokens

local admitted = 0
while admitted < n and tokens >= cost do
  tokens = tokens - cost
  admitted = admitted + 1
end

-- %.17g keeps every bit of the double; TIME's parts keep the timestamp exact.
redis.call('HSET', KEYS[1], 'tk', string.format('%.17g', tokens), 'ts', t[1] .. string.format('%06d', tonumber(t[2])))
-- Idle buckets expire once they would be full anyway (+1 s of slack).
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) / rate * 1000) + 1000)

return { admitted, string.format('%.17g', refilled) }
